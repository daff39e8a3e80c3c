"""Does the TMA descriptor's L2 promotion move the cuda_ptx kernels? An experiment, not a feature.

The cuda_ptx sm90a host shim encodes its tensor maps with CU_TENSOR_MAP_L2_PROMOTION_L2_256B; CUTLASS's make_tma_copy
uses L2_128B. On 127x4096x4096 CUTLASS's ping-pong 64x64 kernel ran 13.2 us where the cuda_ptx one-consumer 64x64
kernel ran 17.1 us (bench/results/skinny_cluster64_h200.json, block_split_h200.json): same tile, same ring depth,
one wave of 128 blocks. This probe lowers cuda_ptx sweep kernels, rewrites the promotion in the generated host code
(nothing else), builds each variant and runs it through the evaluator (every gate, then offline timing against
torch.matmul), variants of one kernel back to back on each shape.

    python3 bench/tma_promotion_probe.py --shape 127x4096x4096 --config ptx_w4x1_64x64x64 \
        --out bench/results/tma_promotion_probe_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from l2ir.cli import shape_arg

PROMOTIONS = ("L2_256B", "L2_128B", "L2_64B", "NONE")
GENERATED = "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"


def variant(plan, promotion: str):
    """The plan with every tensor map encoded at `promotion` instead of the backend's L2_256B."""
    if GENERATED not in plan.source:
        raise SystemExit(f"tma_promotion_probe: the generated source no longer encodes {GENERATED}; update the probe")
    return dataclasses.replace(plan, source=plan.source.replace(GENERATED, f"CU_TENSOR_MAP_L2_PROMOTION_{promotion}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=shape_arg, action="append", required=True, help="MxNxK (repeatable)")
    ap.add_argument("--config", action="append", required=True, help="a cuda_ptx sweep configuration (repeatable)")
    ap.add_argument("--promotion", action="append", choices=PROMOTIONS, help="default: all")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)

    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.backends.registry import lower
    from l2ir.nodes import Problem
    from l2ir.search.evaluator import EvalConfig, Evaluator
    from l2ir.search.sweeps import load_sweep

    sweep = load_sweep("cuda_ptx")
    unknown = [c for c in args.config if c not in sweep]
    if unknown:
        ap.error(f"unknown cuda_ptx configs {unknown}")
    promotions = args.promotion or list(PROMOTIONS)
    rows, env = [], {}
    started = time.time()
    with Evaluator(EvalConfig(scenarios=("offline",))) as ev:
        for m, n, k in args.shape:
            problem = Problem(m, n, k)
            for config in args.config:
                kernel = sweep[config]
                plan = lower(kernel, problem, backend="cuda_ptx")
                for promotion in promotions:
                    built = compile_plan(variant(plan, promotion), CompileOptions())
                    (meas,) = ev.evaluate(kernel, problem, variant(plan, promotion), built)
                    row = {"shape": [m, n, k], "config": config, "promotion": promotion,
                           "gates_passed": meas.passed, "errors": meas.errors[:2],
                           "kernel_us": meas.kernel_median_us, "torch_us": meas.baseline_median_us,
                           "speedup": meas.speedup, "kernel_spread": meas.kernel_stats.get("rel_spread")}
                    env = env or meas.environment
                    rows.append(row)
                    print(f"{m}x{n}x{k} {config:34s} {promotion:8s} gates {'pass' if meas.passed else 'FAIL'} "
                          f"{meas.kernel_median_us or float('nan'):8.2f} us  torch "
                          f"{meas.baseline_median_us or float('nan'):8.2f} us", flush=True)
    out = {"command": " ".join(["python3", "bench/tma_promotion_probe.py", *(argv or sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - started, 1),
           "environment": env, "scenario": "offline", "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'shape':>16} {'config':34} " + " ".join(f"{p:>9}" for p in promotions))
    for m, n, k in args.shape:
        for config in args.config:
            got = {r["promotion"]: r["kernel_us"] for r in rows if r["shape"] == [m, n, k] and r["config"] == config}
            print(f"{f'{m}x{n}x{k}':>16} {config:34} " + " ".join(
                f"{got.get(p) or float('nan'):9.2f}" for p in promotions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
