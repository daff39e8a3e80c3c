"""Does programmatic dependent launch move L2IR's kernels against torch.matmul? An A/B with an A/A beside it.

Every backend kernel built for sm90 now executes griddepcontrol.wait before its first global access and is launched
with programmatic stream serialization (runtime.Launch.pdl for "kernels" plans; the host shims' L2IR_PDL, and
CUTLASS's GDC), so in a stream of GEMMs its blocks are placed and run their prologue while the previous grid drains.
This probe lowers sweep kernels and runs each through the evaluator (every gate, then offline timing interleaved with
torch.matmul) with PDL off and on, twice each in the order off, on, off, on: the two runs of one variant are the A/A.
`--scenario server` times one cold call per sample instead (an L2 flush and a spin before each call), where the
previous grid is the spin and a PDL launch has nothing to overlap: what, if anything, asking for it costs.

    python3 bench/pdl_probe.py --case 2048x256x512:sm90a_skinny:pingpong_64x64x64_c2x1 \
        --out bench/results/pdl_probe_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from l2ir.runtime import PDL_MACRO
from sweep_cases import case_arg, lower_case

ORDER = ("off", "on", "off", "on")


def variant(plan, pdl: bool):
    """The plan launched with programmatic dependent launch or without it: a "kernels" plan's launches say so (on
    where its backend asked for it); a host shim is built with l2ir.runtime.PDL_MACRO at 1 or 0, whatever its
    default (CUTLASS's stream-K kernels are built for the ordinary launch unless asked)."""
    if plan.form == "kernels":
        return dataclasses.replace(plan, launches=tuple(dataclasses.replace(ln, pdl=ln.pdl and pdl)
                                                        for ln in plan.launches))
    return dataclasses.replace(plan, extra_flags=(*plan.extra_flags, f"-D{PDL_MACRO}={int(pdl)}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--scenario", choices=("offline", "server"), default="offline",
                    help="offline: back-to-back calls, where PDL overlaps the launch with the previous grid's drain; "
                         "server: one cold call after an L2 flush and a spin, at the bench's sample count")
    args = ap.parse_args(argv)

    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import EvalConfig, Evaluator

    rows, env = [], {}
    started = time.time()
    # the server scenario at the server race's timing (bench/server_race.py), offline at the evaluator's default
    timing = {"timing": BENCH_TIMING} if args.scenario == "server" else {}
    with Evaluator(EvalConfig(scenarios=(args.scenario,), **timing)) as ev:
        for (m, n, k), sweep, config in args.case:
            try:
                kernel, problem, plan = lower_case((m, n, k), sweep, config)
            except ValueError as e:
                ap.error(str(e))
            for i, pdl in enumerate(o == "on" for o in ORDER):
                v = variant(plan, pdl)
                built = compile_plan(v, CompileOptions())
                (meas,) = ev.evaluate(kernel, problem, v, built)
                row = {"shape": [m, n, k], "case": f"{sweep}/{config}", "pdl": pdl, "round": i // 2,
                       "gates_passed": meas.passed, "errors": meas.errors[:2],
                       "kernel_us": meas.kernel_median_us, "torch_us": meas.baseline_median_us,
                       "speedup": meas.speedup, "kernel_spread": meas.kernel_stats.get("rel_spread")}
                env = env or meas.environment
                rows.append(row)
                print(f"{m}x{n}x{k} {sweep}/{config:34s} pdl={'on ' if pdl else 'off'} gates "
                      f"{'pass' if meas.passed else 'FAIL'} {meas.kernel_median_us or float('nan'):8.2f} us  torch "
                      f"{meas.baseline_median_us or float('nan'):8.2f} us", flush=True)
    out = {"command": " ".join(["python3", "bench/pdl_probe.py", *(argv or sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - started, 1),
           "environment": env, "scenario": args.scenario, "order": list(ORDER), "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'shape':>16} {'case':48} {'off us':>8} {'on us':>8} {'off x':>6} {'on x':>6} {'A/A off':>8} {'A/A on':>7}")
    for (m, n, k), sweep, config in args.case:
        got = [r for r in rows if r["shape"] == [m, n, k] and r["case"] == f"{sweep}/{config}" and r["kernel_us"]]
        def pick(pdl, key):
            return [r[key] for r in got if r["pdl"] == pdl]
        def aa(pdl):
            t = pick(pdl, "kernel_us")
            return abs(t[0] - t[1]) / min(t) if len(t) == 2 else float("nan")
        def med(pdl, key):
            values = pick(pdl, key)
            return statistics.median(values) if values else float("nan")
        print(f"{f'{m}x{n}x{k}':>16} {f'{sweep}/{config}':48} "
              f"{med(False, 'kernel_us'):8.2f} {med(True, 'kernel_us'):8.2f} "
              f"{med(False, 'speedup'):6.3f} {med(True, 'speedup'):6.3f} {aa(False):8.3f} {aa(True):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
