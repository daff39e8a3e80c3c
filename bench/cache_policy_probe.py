"""Do L2 cache policies close the gap on C-write-bound GEMMs? (an A/B on generated cuda_ptx sources)

    python bench/cache_policy_probe.py --case 8192x4096x128:cuda_ptx:ptx_coop_128x256x64 [...] --out FILE

At K = 64-256 a GEMM's DRAM traffic is mostly C, a stream larger than L2 (8192x4096 fp16: 64 MB against 60 MB).
Every tile re-reads its rows of A and columns of B from L2; if the C stream evicts them, the re-reads come from
DRAM and the kernel moves more than the floor's bytes (bench/NOTES.md, "Where the time goes on C-write-bound
shapes"). This times each case's generated source as lowered and with its text edited:
  cs       the epilogue's 16-byte C stores as st.global.cs (evict first: C is written once);
  last     the TMA loads of A and B with an L2::cache_hint of evict_last (the CUTLASS CacheHintSm90 value);
  cs+last  both.
Each variant is checked against torch.matmul on the timed sets (max |diff| <= 1e-2 x max |ref|, fp32
accumulation in both) and timed in the evaluator's offline scenario (search.timing.time_offline, interleaved with
torch.matmul). An edit that wins here becomes an IR field, gated by the evaluator; this probe only measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from sweep_cases import case_arg, lower_case

STORE = "*reinterpret_cast<uint4*>(C + (size_t)grow * N + gcol) = *reinterpret_cast<const uint4*>(c_tile + off);"
STORE_CS = "__stcs(reinterpret_cast<uint4*>(C + (size_t)grow * N + gcol), *reinterpret_cast<const uint4*>(c_tile + off));"
LOAD = ('"cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"\n'
        '      :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");')
# CUTLASS's CacheHintSm90::EVICT_LAST: the 64-bit L2 policy word for "keep these lines over others".
LOAD_LAST = ('"cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint '
             '[%0], [%1, {%3, %4}], [%2], %5;"\n'
             '      :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), '
             '"l"(0x14F0000000000000ull) : "memory");')
VARIANTS = {"as_lowered": (), "cs": ((STORE, STORE_CS),), "last": ((LOAD, LOAD_LAST),),
            "cs+last": ((STORE, STORE_CS), (LOAD, LOAD_LAST))}


def edited(source: str, edits) -> str:
    for old, new in edits:
        if old not in source:
            raise ValueError(f"the generated source has no {old[:60]!r}...: the probe's edit no longer applies")
        source = source.replace(old, new)
    return source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("cache_policy_probe: no CUDA GPU here", file=sys.stderr)
        return 1
    from l2ir.backends.compile import CompileOptions, compile_many
    from l2ir.search.evaluator import environment
    from l2ir.search.timing import TimingConfig, sets_for, time_offline

    from l2ir.runtime import load

    torch.cuda.init()
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    cfg = TimingConfig()
    rows = []
    # Every variant's source is compiled first, in parallel (a cuda_ptx translation unit takes ~20 s).
    variants, built_of = {}, {}
    for shape, sweep, config in args.case:
        _, _, plan = lower_case(shape, sweep, config)
        for name, edits in VARIANTS.items():
            try:
                variants[(shape, sweep, config, name)] = dataclasses.replace(plan, source=edited(plan.source, edits))
            except ValueError as e:
                variants[(shape, sweep, config, name)] = e
    plans = [v for v in variants.values() if not isinstance(v, ValueError)]
    for v, b in zip(plans, compile_many(plans, CompileOptions())):
        built_of[id(v)] = b
    for (m, n, k), sweep, config in args.case:
        n_sets = sets_for(2 * (m * k + n * k + m * n), l2, cfg)
        sets = [(torch.randn(m, k, device="cuda").half(), torch.randn(n, k, device="cuda").half(),
                 torch.empty(m, n, device="cuda", dtype=torch.half), torch.empty(m, n, device="cuda", dtype=torch.half))
                for _ in range(n_sets)]

        def baseline(i, sets=sets):
            a, b, _, cb = sets[i]
            torch.matmul(a, b.t(), out=cb)

        for name, edits in VARIANTS.items():
            row = {"shape": [m, n, k], "case": f"{sweep}/{config}", "variant": name}
            vplan = variants[((m, n, k), sweep, config, name)]
            if isinstance(vplan, ValueError):
                rows.append({**row, "error": str(vplan)})
                continue
            built = built_of[id(vplan)]
            if not built.ok:
                rows.append({**row, "error": built.summary()})
                continue
            launcher = load(vplan, built.binary)
            ws_bytes = launcher.workspace_bytes(m, n, k)
            ws = torch.zeros(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")

            def kernel(i, launcher=launcher, sets=sets, mnk=(m, n, k), ws=ws, ws_bytes=ws_bytes):
                a, b, c, _ = sets[i]
                launcher(a.data_ptr(), b.data_ptr(), c.data_ptr(), *mnk, ws.data_ptr(), ws_bytes)

            k_us, b_us, reps = time_offline(kernel, baseline, n_sets, cfg)
            torch.cuda.synchronize()
            worst = max(float((c.float() - cb.float()).abs().max() / cb.float().abs().max()) for _, _, c, cb in sets)
            rows.append({**row, "kernel_us": statistics.median(k_us), "torch_us": statistics.median(b_us),
                         "kernel_spread": (max(k_us) - min(k_us)) / min(k_us), "reps": reps,
                         "max_rel_diff_vs_torch": worst, "correct": worst <= 1e-2})
            launcher.close()
            r = rows[-1]
            print(f"{m}x{n}x{k} {config} {name:>10}: {r['kernel_us']:8.2f} us (torch {r['torch_us']:.2f}), "
                  f"rel diff {worst:.1e}", flush=True)
        sets.clear()
        torch.cuda.empty_cache()
    out = {"command": "python3 bench/cache_policy_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(0),
           "scenario": "offline (CUDA-graph replay over rotated input sets, interleaved with torch.matmul)",
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'shape':>16} {'case':<34} {'variant':>10} {'us':>8} {'torch':>8} {'vs as lowered':>13}")
    base = {}
    for r in rows:
        key = (tuple(r["shape"]), r["case"])
        if r["variant"] == "as_lowered" and "kernel_us" in r:
            base[key] = r["kernel_us"]
        s = "x".join(map(str, r["shape"]))
        if "kernel_us" not in r:
            print(f"{s:>16} {r['case']:<34} {r['variant']:>10} error: {r['error'][:60]}")
            continue
        rel = base.get(key, float("nan")) / r["kernel_us"]
        print(f"{s:>16} {r['case']:<34} {r['variant']:>10} {r['kernel_us']:8.2f} {r['torch_us']:8.2f} {rel:13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
