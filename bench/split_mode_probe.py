"""(GPU) Where a kernel's slow mode in the server scenario comes from: the same cold calls under variants of the
scenario, every sample kept.

    python3 bench/split_mode_probe.py --case 512x2048x16384:cuda_ptx:ptx_splitk_w4x1_64x256x64_s2 \
        --out bench/results/split_mode_h200.json

  zero     search.timing.time_server as it is (MEASURE.md: zero 256 MiB, a 0.5 ms device spin, one call)
  read     the flush reads the 256 MiB instead of zeroing it: L2 then holds clean lines, so the call's misses write
           nothing back
  nopdl    zero, with the kernel built without programmatic dependent launch (bench/pdl_probe.variant)
  idle     zero, with a synchronize and a 2 ms host sleep before the spin (the GPU idles between calls)
Each variant times the case's kernel (launched as ncu_probe does, on its own buffers and a workspace zeroed once)
against torch.matmul, 40 rounds, each side leading half of them; the kernel's output is checked against an fp32
reference after each variant. Reported: the samples, their medians, and the share of the kernel's samples beyond
1.2x its fastest (the slow mode) beside torch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from pdl_probe import variant
from sweep_cases import MAX_REL_ERR, answer_error, case_arg, lower_case

VARIANTS = ("zero", "read", "nopdl", "idle")
SLOW = 1.2          # a sample this far above the variant's fastest is in the slow mode
ROUNDS = 40


def slow_share(samples: list[float]) -> float:
    fastest = min(samples)
    return sum(s > SLOW * fastest for s in samples) / len(samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("split_mode_probe: no CUDA GPU", file=sys.stderr)
        return 2
    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import environment
    from l2ir.search.timing import CudaClock, time_server

    from l2ir.runtime import load

    class ReadFlushClock(CudaClock):
        """The flush reads a buffer larger than L2 instead of zeroing it: the lines it leaves are clean."""

        def flush(self):
            self.clean()

    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    cfg = replace(BENCH_TIMING, server_samples=ROUNDS)
    started = time.time()
    rows, status = [], 0
    for (m, n, k), sweep, config in args.case:
        try:
            _, _, plan = lower_case((m, n, k), sweep, config)
        except ValueError as e:
            ap.error(str(e))
        builds = {}
        for pdl in (True, False):
            built = compile_plan(variant(plan, pdl), CompileOptions())
            if not built.ok:
                print(f"split_mode_probe: {sweep}/{config} (pdl {pdl}) did not build: {built.summary()}",
                      file=sys.stderr)
                return 1
            builds[pdl] = load(variant(plan, pdl), built.binary)
        sets = 2
        a = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(sets)]
        b = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(sets)]    # B stored N x K
        c = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(sets)]
        ws_bytes = builds[True].workspace_bytes(m, n, k)
        ws = torch.zeros(max(ws_bytes, 1), device="cuda", dtype=torch.uint8)   # the tree's counters start at zero
        for name in VARIANTS:
            run = builds[name != "nopdl"]

            def mine(i, run=run, a=a, b=b, c=c, shape=(m, n, k), ws=ws, ws_bytes=ws_bytes):
                run(a[i].data_ptr(), b[i].data_ptr(), c[i].data_ptr(), *shape, ws.data_ptr(), ws_bytes)

            def theirs(i, a=a, b=b):
                torch.matmul(a[i], b[i].t())

            vcfg = replace(cfg, idle_gap_s=0.002) if name == "idle" else cfg
            clock = ReadFlushClock(vcfg) if name == "read" else None
            t = time_server(mine, theirs, sets, vcfg, rng=np.random.default_rng([m, n, k]), clock=clock)
            errs = []
            for i in range(sets):
                mine(i)
                errs.append(answer_error(c[i], a[i], b[i]))
            ok = max(errs) <= MAX_REL_ERR
            status |= 0 if ok else 1
            row = {"shape": [m, n, k], "case": f"{sweep}/{config}", "variant": name, "correct": ok,
                   "max_rel_err": max(errs), "kernel_us": t.kernel_us, "torch_us": t.baseline_us,
                   "kernel_first": t.kernel_first, "kernel_median_us": statistics.median(t.kernel_us),
                   "torch_median_us": statistics.median(t.baseline_us), "kernel_slow_share": slow_share(t.kernel_us),
                   "torch_slow_share": slow_share(t.baseline_us)}
            rows.append(row)
            print(f"{m}x{n}x{k} {sweep}/{config} {name:6s} {'ok ' if ok else 'BAD'} kernel "
                  f"{row['kernel_median_us']:7.2f} us (slow {row['kernel_slow_share']:.0%})  torch "
                  f"{row['torch_median_us']:7.2f} us (slow {row['torch_slow_share']:.0%})  samples "
                  f"{' '.join(f'{x:.0f}' for x in t.kernel_us)}", flush=True)
    out = {"command": " ".join(["python3", "bench/split_mode_probe.py", *(argv or sys.argv[1:])]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - started, 1),
           "environment": environment(0), "scenario": "server variants (see the module doc)", "rounds": ROUNDS,
           "slow_factor": SLOW, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
