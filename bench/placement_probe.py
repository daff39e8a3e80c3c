"""(GPU) Where and how fast a cuda_ptx kernel's blocks run in its cold calls: per call, each block's SM, start and end
time and SM clock rate, beside the call's time, so fast and slow calls of a bimodal kernel can be compared.

    python3 bench/placement_probe.py --case 512x2048x16384:cuda_ptx:ptx_splitk_w4x1_64x256x64_s2 \
        --out bench/results/placement_h200.json

An experiment, not a feature. The generated source is edited (as bench/cache_policy_probe.py does): thread 0 of every
block writes %smid, %globaltimer and %clock64 at the kernel's entry, and the first consumer thread %globaltimer and
%clock64 as its last statement, into a device array that an exported host function copies out after the call. Each
round is the server scenario's (search.timing: zero 256 MiB, a 0.5 ms device spin, events around one call), then a
synchronize and the read-out. Per call: its time, the SMs used, the most blocks on one SM, the spread of the blocks'
start and end times, the blocks' median run time, and their SM clock (clock64 cycles over globaltimer ns between
entry and exit: a clock that drops in the slow calls is the power limit, not the kernel's traffic); the kernel's
output is checked against fp32 at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from split_mode_probe import SLOW
from sweep_cases import MAX_REL_ERR, answer_error, case_arg, lower_case

ROUNDS = 40
MAX_BLOCKS = 4096
ENTRY = "l2ir_cuda_ptx_sm90a_gemm("
FIELDS = 5                       # per block: smid, entry ns, entry clock, exit ns, exit clock
BUFFER = (f"__device__ unsigned long long l2ir_probe_place[{FIELDS * MAX_BLOCKS}];   "
          "// placement_probe: smid, entry ns, entry clock, exit ns, exit clock\n")
RECORD = (f"  if (threadIdx.x == 0 && blockIdx.x < {MAX_BLOCKS}) {{   // placement_probe\n"
          "    unsigned long long t0, c0; unsigned sm;\n"
          '    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));\n'
          '    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c0));\n'
          '    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n'
          f"    unsigned long long* rec = l2ir_probe_place + {FIELDS} * blockIdx.x;\n"
          "    rec[0] = sm; rec[1] = t0; rec[2] = c0;\n"
          "  }\n")
# The first consumer thread (thread 0 is the producer's, done once its last TMA load is issued), after everything.
EXIT = (f"  if (threadIdx.x == 128 && blockIdx.x < {MAX_BLOCKS}) {{   // placement_probe\n"
        "    unsigned long long t1, c1;\n"
        '    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));\n'
        '    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c1));\n'
        f"    l2ir_probe_place[{FIELDS} * blockIdx.x + 3] = t1; l2ir_probe_place[{FIELDS} * blockIdx.x + 4] = c1;\n"
        "  }\n")
READ = ('\nextern "C" int l2ir_probe_read(unsigned long long* host, int n) {   // placement_probe\n'
        f"  return cudaMemcpyFromSymbol(host, l2ir_probe_place, sizeof(unsigned long long) * {FIELDS} * n) == "
        "cudaSuccess ? 0 : 1;\n"
        "}\n")


def _body_end(source: str, open_brace: int) -> int:
    """Index of the brace that closes the one at `open_brace`, skipping comments, strings and characters."""
    depth, i = 0, open_brace
    while i < len(source):
        if source.startswith("//", i):
            i = source.find("\n", i)
            if i < 0:
                break
            continue
        if source.startswith("/*", i):
            i = source.find("*/", i) + 2
            continue
        ch = source[i]
        if ch in "\"'":
            j = i + 1
            while j < len(source) and source[j] != ch:
                j += 2 if source[j] == "\\" else 1
            i = j + 1
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def instrumented(source: str) -> str:
    """The source with the placement record at the kernel's entry and exit, and its read-out function."""
    at = source.find(ENTRY)
    body = source.find("{", at) + 1 if at >= 0 else -1
    end = _body_end(source, body - 1) if body > 0 else -1
    first_include_end = source.find("\n", source.find("#include <cuda_runtime.h>")) + 1
    if at < 0 or body <= 0 or end < 0 or first_include_end <= 0 or "return" in source[body:end]:
        raise ValueError(f"the generated source has no {ENTRY!r} kernel with one exit: the probe's edit no longer "
                         "applies")
    return (source[:first_include_end] + BUFFER + source[first_include_end:body] + "\n" + RECORD
            + source[body:end] + EXIT + source[end:] + READ)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:cuda_ptx:CONFIG (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("placement_probe: no CUDA GPU", file=sys.stderr)
        return 2
    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import environment
    from l2ir.search.timing import CudaClock

    from l2ir.runtime import load

    started = time.time()
    rows, status = [], 0
    for (m, n, k), sweep, config in args.case:
        try:
            _, _, plan = lower_case((m, n, k), sweep, config)
            plan = dataclasses.replace(plan, source=instrumented(plan.source))
        except ValueError as e:
            ap.error(str(e))
        built = compile_plan(plan, CompileOptions())
        if not built.ok:
            print(f"placement_probe: {sweep}/{config} did not build: {built.summary()}", file=sys.stderr)
            return 1
        run = load(plan, built.binary)
        lib = getattr(run, "_lib", None) or ctypes.CDLL(str(built.binary))   # the library the launches go through
        lib.l2ir_probe_read.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(n, k, device="cuda", dtype=torch.float16)       # B stored N x K
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ws_bytes = run.workspace_bytes(m, n, k)
        ws = torch.zeros(max(ws_bytes, 1), device="cuda", dtype=torch.uint8)
        clock = CudaClock(BENCH_TIMING)
        host = (ctypes.c_ulonglong * (FIELDS * MAX_BLOCKS))()
        calls = []
        def call(run=run, a=a, b=b, c=c, shape=(m, n, k), ws=ws, ws_bytes=ws_bytes):
            run(a.data_ptr(), b.data_ptr(), c.data_ptr(), *shape, ws.data_ptr(), ws_bytes)

        for r in range(ROUNDS + 3):
            clock.flush()
            clock.spin()
            handle = clock.start(call)
            us = clock.elapsed_ms(handle) * 1000.0
            torch.cuda.synchronize()
            if lib.l2ir_probe_read(host, MAX_BLOCKS) != 0:
                print("placement_probe: reading the placement record failed", file=sys.stderr)
                return 1
            if r < 3:
                continue                               # warm-up calls: module load, first tensor maps
            recs = [tuple(int(host[FIELDS * i + f]) for f in range(FIELDS)) for i in range(MAX_BLOCKS)
                    if host[FIELDS * i + 1]]
            per_sm: dict[int, int] = {}
            for sm, *_ in recs:
                per_sm[sm] = per_sm.get(sm, 0) + 1
            starts = sorted(t0 for _, t0, _, _, _ in recs)
            ends = sorted(t1 for _, _, _, t1, _ in recs if t1)
            runs = [(t1 - t0, c1 - c0) for _, t0, c0, t1, c1 in recs if t1 > t0]
            calls.append({"us": us, "blocks": len(recs), "sms": len(per_sm), "max_per_sm": max(per_sm.values()),
                          "start_spread_us": (starts[-1] - starts[0]) / 1000.0,
                          "end_spread_us": (ends[-1] - ends[0]) / 1000.0 if ends else None,
                          "late_blocks": sum(t - starts[0] > 2000 for t in starts),   # started > 2 us after the first
                          "block_us_median": statistics.median(ns for ns, _ in runs) / 1000.0 if runs else None,
                          # SM clock over each block's run: cycles per ns = GHz
                          "clock_ghz": sorted(round(cy / ns, 3) for ns, cy in runs if ns)[len(runs) // 2]
                          if runs else None,
                          "clock_ghz_min": min((cy / ns for ns, cy in runs if ns), default=None),
                          "idle_sms": sorted(set(range(max(per_sm) + 1)) - set(per_sm)), "placement": per_sm})
        err = answer_error(c, a, b)
        ok = err <= MAX_REL_ERR
        status |= 0 if ok else 1
        fastest = min(x["us"] for x in calls)
        for x in calls:
            x["slow"] = x["us"] > SLOW * fastest          # the slow mode as split_mode_probe counts it
        for mode in (False, True):
            got = [x for x in calls if x["slow"] == mode]
            if got:
                print(f"{m}x{n}x{k} {sweep}/{config} {'slow' if mode else 'fast'}: {len(got)} calls, median "
                      f"{statistics.median(x['us'] for x in got):.1f} us, SMs {sorted({x['sms'] for x in got})}, "
                      f"max blocks/SM {sorted({x['max_per_sm'] for x in got})}, start spread median "
                      f"{statistics.median(x['start_spread_us'] for x in got):.2f} us, late blocks "
                      f"{sorted({x['late_blocks'] for x in got})}, block run median "
                      f"{statistics.median(x['block_us_median'] or 0 for x in got):.1f} us, SM clock median "
                      f"{statistics.median(x['clock_ghz'] or 0 for x in got):.3f} GHz (min "
                      f"{min(x['clock_ghz_min'] or 0 for x in got):.3f})", flush=True)
        rows.append({"shape": [m, n, k], "case": f"{sweep}/{config}", "correct": ok, "max_rel_err": err,
                     "calls": calls})
    out = {"command": " ".join(["python3", "bench/placement_probe.py", *(argv or sys.argv[1:])]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - started, 1),
           "environment": environment(0), "scenario": "server rounds (flush, spin, one call), then the read-out",
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
