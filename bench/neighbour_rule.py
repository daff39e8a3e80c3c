"""(CPU) The neighbour rule's predicted-speedup bound (l2ir.dispatch.BORROW_MIN_PREDICTED), against measurements.

    python bench/neighbour_rule.py --out bench/results/neighbour_rule_h200.json

For every untuned shape that a dispatch benchmark run served with a borrowed kernel (rows "untuned near MxNxK" of
bench/dispatch_bench.py's JSON), the device speedup it measured against torch.matmul, and the speedup
l2ir.dispatch.predicted_speedup gives it from the tuned shape's measured speedup (the benchmark's fresh re-timing of
the winner, `shapes[i].fresh.speedup`, which is what the package's table holds: export.choose prefers re-timed rows)
and the kernel's tile (its IR in that benchmark's summary). For each bound: the shapes that would still borrow, how
many of them lose (< 0.97x), how many winners (> 1.03x) would go to cuBLAS instead, and the geomean over the run's
borrowed untuned shapes with a declined shape counting 1.0 (cuBLAS's own time on the device; its eager calls may
still run the kernel, Package._eager_of). The bound was chosen on the first run (selection) and is reported on the
others: the second is the same package and shapes re-measured, the last two another package. A run recorded after
the rule no longer lists the declined shapes' kernels, so this reads the runs from before it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# (dispatch benchmark run, the benchmark whose records the package was exported from, role)
RUNS = (("dispatch_families_v4_fast_h200", "families_small_v3_h200", "selection"),
        ("dispatch_families_v5_fast_h200", "families_small_v3_h200", "report"),
        ("dispatch_unaligned_v5_fast_h200", "unaligned_v4_h200", "report"),
        ("dispatch_unaligned_v6_fast_h200", "unaligned_v4_h200", "report"))
BOUNDS = (0.0, 1.0, 1.05, 1.1, 1.15, 1.2)


def rows_of(run: str, source: str) -> list[dict]:
    from l2ir.dispatch import flop_ratio, predicted_speedup, tile_ratio
    from l2ir.export import EAGER_SLACK_US      # the packages' rule.eager_slack_us

    summary = json.loads((RESULTS / f"{source}.json").read_text())
    irs = {h: v["kernel"] for h, v in summary["kernels"].items()}
    fresh = {tuple(x["shape"]): x["fresh"] for x in summary["shapes"] if x.get("fresh")}
    speedups = {shape: f["speedup"] for shape, f in fresh.items()}
    out = []
    for r in json.loads((RESULTS / f"{run}.json").read_text())["rows"]:
        if r["served"] != "l2ir" or not r["kind"].startswith("untuned near") or r.get("eager_only"):
            continue
        tuned = tuple(int(d) for d in r["kind"].split()[-1].split("x"))
        ir, s = irs.get(r["kernel"][:12]), speedups.get(tuned)
        if ir is None or s is None:
            continue
        m = re.search(r"block=(\d+)x(\d+)x(\d+)", ir)
        tile = tuple(int(g) for g in m.groups()) if m else None
        shape = (r["m"], r["n"], r["k"])
        # The eager prediction of a declined shape (Package._eager_of, the package's 1 us slack)
        eager_ok = tile is not None and (fresh[tuned]["kernel_us"] * tile_ratio(tile, tuned, shape)
                                         <= fresh[tuned]["torch_us"] * flop_ratio(tuned, shape) + EAGER_SLACK_US)
        out.append({"shape": shape, "tuned": tuned, "tile": tile, "tuned_speedup": s,
                    "predicted": predicted_speedup(s, tile, tuned, shape), "measured": r["device_speedup"],
                    "eager_ok": eager_ok, "measured_eager": r["eager_speedup"]})
    return out


def at_bound(rows: list[dict], bound: float) -> dict:
    kept = [r for r in rows if r["predicted"] >= bound]
    declined = [r for r in rows if r["predicted"] < bound]
    eager = [r for r in declined if r["eager_ok"]]
    return {"bound": bound, "borrowed": len(kept), "losses_borrowed": sum(r["measured"] < 0.97 for r in kept),
            "wins_declined": sum(r["measured"] > 1.03 for r in declined),
            # declined shapes whose eager calls still run the kernel, and their measured eager speedup
            "declined_eager": len(eager),
            "declined_eager_geomean_eager_speedup": (math.exp(sum(math.log(r["measured_eager"]) for r in eager)
                                                     / len(eager)) if eager else None),
            "geomean_device_speedup": math.exp(sum(math.log(r["measured"]) for r in kept) / len(rows)),
            "min_borrowed": min((r["measured"] for r in kept), default=None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = {"command": "python bench/neighbour_rule.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "runs": []}
    for run, source, role in RUNS:
        rows = rows_of(run, source)
        table = [at_bound(rows, b) for b in BOUNDS]
        result["runs"].append({"run": run, "package_source": source, "role": role, "untuned_shapes": len(rows),
                               "by_bound": table, "rows": rows})
        print(f"{run} ({role}, {len(rows)} untuned shapes)")
        for t in table:
            print(f"  bound {t['bound']:4}: borrowed {t['borrowed']:3}, losses borrowed {t['losses_borrowed']:2}, "
                  f"wins declined {t['wins_declined']:2} ({t['declined_eager']} still eager), "
                  f"geomean {t['geomean_device_speedup']:.3f}, "
                  f"min borrowed {t['min_borrowed'] if t['min_borrowed'] is None else round(t['min_borrowed'], 3)}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
