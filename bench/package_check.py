"""(GPU) Does an exported package deliver what its table promises? Each tuned shape of the package through
`l2ir.matmul`: who served it, its answer against an fp32 reference on fresh inputs, and its cold call against
torch.matmul in the scenario the package was chosen for.

    python3 bench/package_check.py --package PKG --out bench/results/package_check_h200.json

The races time a kernel through the evaluator's launcher; a user calls `l2ir.matmul`, which routes, allocates the
output (and a split-K workspace) and launches through the package's binaries. This times the user's call: in the
server scenario `search.timing.time_server` (an L2 flush, a device spin, one call per side per round, the sides
balanced; MEASURE.md), offline `search.timing.time_offline` (CUDA-graph replay over rotated inputs). A shape the
table gives to cuBLAS without an eager kernel runs torch.matmul on both sides, so its ratio is an A/A (offline,
under CUDA-graph capture, an eager kernel's shape runs cuBLAS too). Per shape the
JSON holds the route (`route`: the table's kernel, cuBLAS with an L2IR kernel on eager calls, or cuBLAS; `served`:
the dispatcher's counter that moved), the check (max |C - ref| / max |ref|, fresh inputs of every set), both medians and the table's own speedup beside the measured one; per group (report.families_groups) the geomean of
all shapes and of each route's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from l2ir.search.report import families_groups, geomean
from sweep_cases import MAX_REL_ERR, answer_error

from l2ir.cli import shape_arg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", type=Path, required=True, help="folder written by `l2ir export`")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--shape", type=shape_arg, action="append", default=[],
                    help="check only MxNxK (repeatable; default every tuned shape of the package)")
    args = ap.parse_args(argv)

    try:
        table = json.loads((args.package / "table.json").read_text())
        listed = {(e["m"], e["n"], e["k"]): e for e in table["entries"]
                  if e["problem_class"] == "a=f16:row b=f16:col c=f16:row acc=f32"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"package_check: {args.package}: no readable table.json ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    entries = [e for shape, e in listed.items() if not args.shape or shape in args.shape]
    missing = sorted(set(args.shape) - set(listed))
    if missing or not entries:
        what = f"no tuned shape {', '.join('x'.join(map(str, s)) for s in missing)}" if missing else \
            "no tuned f16 row x col shape"
        print(f"package_check: {args.package} has {what} to check", file=sys.stderr)
        return 2
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("package_check: no CUDA GPU", file=sys.stderr)
        return 2
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import environment
    from l2ir.search.timing import summarize, time_offline, time_server

    import l2ir

    scenario = table.get("scenario", "offline")
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False    # fp32 accumulation on both sides
    l2ir.load(str(args.package))
    started = time.time()
    rows, status = [], 0
    for e in entries:
        m, n, k = e["m"], e["n"], e["k"]
        sets = 2
        a = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(sets)]
        w = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(sets)]   # B stored N x K (F.linear)
        before = l2ir.dispatch_stats()
        l2ir.matmul(a[0], w[0].t())             # the first call decides the route
        torch.cuda.synchronize()
        after = l2ir.dispatch_stats()
        served = sorted(r for r in after if after[r] != before.get(r, 0)) or ["none"]
        err = max(answer_error(l2ir.matmul(a[i], w[i].t()), a[i], w[i]) for i in range(sets))
        ok = err <= MAX_REL_ERR
        status |= 0 if ok else 1

        def mine(i, a=a, w=w):
            l2ir.matmul(a[i], w[i].t())

        def theirs(i, a=a, w=w):
            torch.matmul(a[i], w[i].t())

        if scenario == "server":
            # Each side leads half the rounds, in a shuffled order seeded by the shape (search.timing).
            t = time_server(mine, theirs, sets, BENCH_TIMING, rng=np.random.default_rng([m, n, k]))
            kernel_us, torch_us = t.kernel_us, t.baseline_us
        else:
            kernel_us, torch_us, _ = time_offline(mine, theirs, sets, BENCH_TIMING)
        ks, ts = summarize(kernel_us), summarize(torch_us)
        speedup = ts["median"] / ks["median"] if ks["median"] else None
        # The table's route: its kernel ("table"), cuBLAS with an L2IR kernel on eager calls ("eager": the export's
        # EAGER_SLACK_US rule, which trades up to that much device time for the host time of small calls), or cuBLAS.
        # The dispatcher goes by the packaged binaries' keys (an eager kernel that failed to package has none).
        route = "table" if e.get("kernel_key") else "eager" if e.get("eager_kernel_key") else "cublas"
        row = {"shape": [m, n, k], "route": route, "served": served,
               "table_kernel": e.get("kernel_key") or e.get("eager_kernel_key"),
               "table_speedup": e.get("speedup"), "table_reason": e.get("reason"), "max_rel_err": err, "correct": ok,
               "l2ir_us": ks["median"], "torch_us": ts["median"], "speedup": speedup,
               "l2ir_samples": kernel_us, "torch_samples": torch_us}
        rows.append(row)
        print(f"{m:>6}x{n:<6}x{k:<6} {route:6s} {'/'.join(served):10s} err {err:.1e} {'ok ' if ok else 'BAD'} l2ir "
              f"{ks['median']:8.2f} us  torch {ts['median']:8.2f} us  {speedup or float('nan'):.3f}x  (table "
              f"{e.get('speedup') or float('nan'):.3f}x)", flush=True)

    def stats(rs):
        table = [r for r in rs if r["route"] == "table"]
        eager = [r for r in rs if r["route"] == "eager"]
        return {"shapes": len(rs), "table": len(table), "eager": len(eager),
                "geomean_all": geomean([r["speedup"] for r in rs]),
                "geomean_table": geomean([r["speedup"] for r in table]),
                "geomean_table_promised": geomean([r["table_speedup"] for r in table]),
                "geomean_eager": geomean([r["speedup"] for r in eager]),
                "geomean_cublas": geomean([r["speedup"] for r in rs if r["route"] == "cublas"]),
                "min_all": min((r["speedup"] for r in rs if r["speedup"]), default=None)}

    groups = families_groups(rows, stats)
    out = {"command": " ".join(["python3", "bench/package_check.py", *(argv or sys.argv[1:])]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - started, 1),
           "environment": environment(0), "scenario": scenario, "package_environment": table.get("environment"),
           "timing": {"server_samples": BENCH_TIMING.server_samples, "flush_bytes": BENCH_TIMING.flush_bytes},
           "groups": groups, "dispatch_stats": l2ir.dispatch_stats(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    nan = float("nan")
    for label, g in groups.items():
        print(f"{label:>12}: {g['shapes']} shapes, geomean {g['geomean_all'] or nan:.3f}x, min {g['min_all'] or nan:.3f}x;"
              f" {g['table']} on the table's kernel {g['geomean_table'] or nan:.3f}x (promised "
              f"{g['geomean_table_promised'] or nan:.3f}x), {g['eager']} on an eager kernel {g['geomean_eager'] or nan:.3f}x,"
              f" the rest cuBLAS {g['geomean_cublas'] or nan:.3f}x")
    bad = [r["shape"] for r in rows if not r["correct"]]
    print(f"wrote {args.out}; {len(rows)} shapes, {len(bad)} wrong{': ' + str(bad) if bad else ''}")
    return status


if __name__ == "__main__":
    sys.exit(main())
