"""Where a cold call's time goes: each case timed offline, in the server scenario, and in the server scenario with
the L2 flush shrunk to 1 MiB (the refreshed inputs then stay in L2), beside torch.matmul, and an empty launch.

    python3 bench/cold_start_probe.py --case 64x64x64:cuda_ptx_sm80:ptx_sm80_64x64x32_w2x2_s3 \
        --out bench/results/cold_start_h200.json

The server scenario (search/timing.time_server, MEASURE.md) zeroes 256 MiB, spins the GPU 0.5 ms, then times one
call. Its time minus the offline time per call is what a cold call costs a kernel; server minus "server, no flush"
is the part the flushed L2 causes (operands, code and descriptors from HBM, dirty flush lines written back), the
rest is a single launch without a replay's overlap (PDL, the previous call's tail). An empty launch
(torch.cuda._sleep(1)) timed the same way is the floor no kernel goes under. Every case runs through every gate
in each timed scenario (the evaluator's), so a time is a gate-clean kernel's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from sweep_cases import case_arg, lower_case

VARIANTS = ("offline", "server", "server_no_flush")


def empty_launch_us(cfg) -> float:
    """Median server-scenario time (search/timing.time_server under `cfg`) of a launch that does nothing
    (torch.cuda._sleep(1)), timed against itself."""
    import torch
    from l2ir.search.timing import time_server

    def empty(_):
        torch.cuda._sleep(1)

    return statistics.median(time_server(empty, empty, 1, cfg).kernel_us)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = ap.parse_args(argv)

    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import EvalConfig, Evaluator

    # The bench's timing, and the same with a 1 MiB flush: the refreshed inputs then stay in L2.
    timings = {"offline": BENCH_TIMING, "server": BENCH_TIMING,
               "server_no_flush": replace(BENCH_TIMING, flush_bytes=1 << 20)}
    configs = {name: EvalConfig(scenarios=(name.split("_")[0],), timing=t) for name, t in timings.items()}
    started = time.time()
    rows, env = [], {}
    built = []
    for shape, sweep, config in args.case:
        try:
            kernel, problem, plan = lower_case(shape, sweep, config)
        except ValueError as e:
            ap.error(str(e))
        art = compile_plan(plan, CompileOptions(device_sm="sm_90"))
        if not art.ok:
            print(f"cold_start_probe: {sweep}/{config} did not build: {art.summary()}", file=sys.stderr)
            return 1
        built.append((shape, f"{sweep}/{config}", kernel, problem, plan, art))
    for name in VARIANTS:
        with Evaluator(configs[name]) as ev:
            env = env or ev.environment
            for shape, case, kernel, problem, plan, art in built:
                (meas,) = ev.evaluate(kernel, problem, plan, art)
                rows.append({"shape": list(shape), "case": case, "variant": name, "gates_passed": meas.passed,
                             "errors": meas.errors[:2], "kernel_us": meas.kernel_median_us,
                             "torch_us": meas.baseline_median_us, "speedup": meas.speedup})
                print(f"{'x'.join(map(str, shape)):>16} {case:52s} {name:16s} gates "
                      f"{'pass' if meas.passed else 'FAIL'} {meas.kernel_median_us or float('nan'):8.2f} us  torch "
                      f"{meas.baseline_median_us or float('nan'):8.2f} us", flush=True)
    empty = {name: empty_launch_us(timings[name]) for name in ("server", "server_no_flush")}
    out = {"command": " ".join(["python3", "bench/cold_start_probe.py", *(argv or sys.argv[1:])]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - started, 1),
           "environment": env, "scenario": "offline and server (search/timing), and server with a 1 MiB flush",
           "empty_launch_us": empty, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"empty launch: server {empty['server']:.2f} us, server without the flush {empty['server_no_flush']:.2f} us")
    print(f"{'shape':>16} {'case':52} {'side':6} {'offline':>8} {'server':>8} {'no flush':>8} {'cold':>6} {'of L2':>6}")
    for shape, case, *_ in built:
        got = {r["variant"]: r for r in rows if r["shape"] == list(shape) and r["case"] == case}
        for side in ("kernel_us", "torch_us"):
            t = {v: got[v][side] or float("nan") for v in VARIANTS}
            print(f"{'x'.join(map(str, shape)):>16} {case:52} {side[:-3]:6} {t['offline']:8.2f} {t['server']:8.2f} "
                  f"{t['server_no_flush']:8.2f} {t['server'] - t['offline']:6.2f} {t['server'] - t['server_no_flush']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
