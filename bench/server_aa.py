"""The server scenario's A/A check: torch.matmul timed against itself, cold, as the server race times a kernel.

    python3 bench/server_aa.py --rows bench/results/families_derived_v15_h200.json --trials 3 \
        --out bench/results/server_aa_h200.json

The families benchmark reports server speedups of a few percent per shape, and groups whose geomean sits within a
percent of a target. A win that small means something only beside the harness's own spread: this times torch.matmul
as "kernel" and torch.matmul as "baseline" with search/timing.time_server and the bench's timing (L2 flushed, a
device spin before each call, the two sides in a drawn order per round, a fresh input set per round, the same
number of sets and rounds the evaluator uses), on every row's shape, `--trials` times over. Each trial's ratio is
what a record's speedup would be (baseline median over kernel median), so a harness without bias gives 1.0; the
spread of the ratios per shape, and of each group's geomean across trials, is the noise a server number carries.
Each trial also reports second/first: the median of the samples taken second in their round over those taken first
(each side's samples over its own median, both sides pooled), the cost of leading a round. --coin orders each round
by a coin, as the timing did before it balanced the orders, for the comparison.

OUT (JSON): per shape the ratios of every trial; per group (below 1 GFLOP, 1-100 GFLOP, the unaligned shapes) the
geomean of each trial, their range, and the median per-shape |ratio - 1|. --cpu times CPU tensors with the host
clock (no flush, no spin), to check the script end to end on a machine without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from l2ir.search import timing
from l2ir.search.bench import BENCH_TIMING
from l2ir.search.report import families_groups, geomean, gflop
from l2ir.search.timing import CudaClock, Guard, HostClock, l2_bytes, sets_for, time_server

from l2ir.cli import shape_arg


class FreshInputs(Guard):
    """The evaluator's per-round input refresh (new values, same pointers); torch needs no output check."""

    def __init__(self, sets):
        self.sets = sets

    def refresh(self, sets):
        for i in sets:
            self.sets[i][0].normal_()
            self.sets[i][1].normal_()


def coin_orders(rng, rounds: int) -> list[bool]:
    """The order the timing drew before balanced orders: a coin per round (for --coin)."""
    return [bool(rng.integers(0, 2)) for _ in range(rounds)]


def position_ratio(t) -> float | None:
    """Median of the samples taken second in their round over the median of those taken first, both sides pooled
    (each side's samples over its own median, so the two sides' speeds cancel): below 1 when going second is faster."""
    firsts, seconds = [], []
    for side, med, leads in ((t.kernel_us, statistics.median(t.kernel_us), t.kernel_first),
                             (t.baseline_us, statistics.median(t.baseline_us), [not x for x in t.kernel_first])):
        for x, lead in zip(side, leads):
            (firsts if lead else seconds).append(x / med)
    return statistics.median(seconds) / statistics.median(firsts) if firsts and seconds else None


def aa_trial(shape: tuple[int, int, int], device, seed: int, cfg=BENCH_TIMING) -> tuple[float, float | None]:
    """One server A/A trial on fresh buffers: (median(baseline) / median(kernel), position_ratio), both sides
    torch.matmul."""
    import torch

    m, n, k = shape
    gpu = device.type == "cuda"
    l2 = l2_bytes(device) if gpu else 50 << 20
    n_sets = sets_for(2 * (m * k + k * n + m * n), l2, cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.float16 if gpu else torch.float32
    sets = []
    for _ in range(n_sets):
        a = torch.randn((m, k), generator=gen, device=device).to(dtype)
        b = torch.randn((n, k), generator=gen, device=device).to(dtype).t()      # a=row b=col, as the families
        sets.append((a, b, torch.empty((m, n), dtype=dtype, device=device),
                     torch.empty((m, n), dtype=dtype, device=device)))

    def side(out: int):
        return lambda i: torch.matmul(sets[i][0], sets[i][1], out=sets[i][out])

    clock = (CudaClock if gpu else HostClock)(cfg, device)
    t = time_server(side(2), side(3), n_sets, cfg, FreshInputs(sets), np.random.default_rng(seed), clock)
    return statistics.median(t.baseline_us) / statistics.median(t.kernel_us), position_ratio(t)


def group_summary(rows: list[dict]) -> dict:
    """Per group: each trial's geomean ratio, their range, and the median per-shape |ratio - 1| over all trials."""
    def stats(sel):
        trials = len(sel[0]["ratios"]) if sel else 0
        per_trial = [geomean([r["ratios"][t] for r in sel]) for t in range(trials)]
        deviations = [abs(x - 1.0) for r in sel for x in r["ratios"]]
        positions = [x for r in sel for x in r.get("second_over_first", []) if x]
        return {"shapes": len(sel), "trial_geomeans": per_trial,
                "second_over_first_median": statistics.median(positions) if positions else None,
                "geomean_range": [min(per_trial), max(per_trial)] if per_trial else None,
                "median_shape_deviation": statistics.median(deviations) if deviations else None,
                "max_shape_deviation": max(deviations, default=None)}

    return families_groups(rows, stats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=Path, help="a derive_families or server_race output: time its rows' shapes")
    ap.add_argument("--shape", type=shape_arg, action="append", default=[], metavar="MxNxK", help="a shape (repeatable)")
    ap.add_argument("--trials", type=int, default=3, help="independent A/A trials per shape (default %(default)s)")
    ap.add_argument("--max-gflop", type=float, default=100.0, help="only shapes below this (default %(default)s)")
    ap.add_argument("--coin", action="store_true",
                    help="order each round by a coin, as the timing did before balanced orders (the comparison)")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors and the host clock (a check, not a measurement)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import torch

    shapes = list(args.shape)
    if args.rows is not None:
        try:
            shapes += [tuple(r["shape"]) for r in json.loads(args.rows.read_text())["rows"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --rows {args.rows}: not a derive_families or server_race output ({e})", file=sys.stderr)
            return 2
    shapes = list(dict.fromkeys(s for s in shapes if gflop(s) < args.max_gflop))
    if not shapes:
        print("error: no shapes (give --rows or --shape)", file=sys.stderr)
        return 2
    if args.trials < 1:
        print(f"error: --trials {args.trials}: expected at least 1", file=sys.stderr)
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA GPU visible (use --cpu to check the script on the host)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        env = {"gpu": None, "cpu_check": True, "torch": torch.__version__}
    else:
        from l2ir.search.evaluator import environment

        env = environment(torch.cuda.current_device())
    balanced = timing.kernel_first_orders
    if args.coin:
        timing.kernel_first_orders = coin_orders            # time_server looks the order up per call
    t0 = time.perf_counter()
    rows = []
    try:
        for n, s in enumerate(shapes):
            # a seed per shape and trial, as the evaluator draws one per evaluation: no order is shared by shapes
            trials = [aa_trial(s, device, seed=7919 * n + 104729 * t + 1) for t in range(args.trials)]
            rows.append({"shape": list(s), "ratios": [r for r, _ in trials],
                         "second_over_first": [p for _, p in trials]})
            print(f"{s}: A/A " + " ".join(f"{r:.3f}" for r, _ in trials)
                  + "  second/first " + " ".join(f"{p:.3f}" if p else "-" for _, p in trials))
    finally:
        timing.kernel_first_orders = balanced
    result = {"command": "python3 bench/server_aa.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "scenario": "server A/A: torch.matmul against torch.matmul with search/timing.time_server and the "
                          "bench's timing (L2 flushed, 0.5 ms spin, fresh set per round), orders "
                          + ("by a coin per round" if args.coin else "balanced (each side first in half the rounds)"),
              "environment": env, "seconds": round(time.perf_counter() - t0, 1),
              "groups": group_summary(rows), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for label, g in result["groups"].items():
        if g["shapes"]:
            lo, hi = g["geomean_range"]
            pos = g["second_over_first_median"]
            print(f"{label:>12}: {g['shapes']} shapes, A/A geomean {lo:.3f}-{hi:.3f} over {args.trials} trials, "
                  f"median shape deviation {g['median_shape_deviation']:.3f}, max {g['max_shape_deviation']:.3f}"
                  + (f", second/first {pos:.3f}" if pos else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
