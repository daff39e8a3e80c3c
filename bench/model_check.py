"""How well the stand-in cost model ranks a server race's candidates: per shape, the Spearman correlation between
the model's kernel time (search/standin.kernel_time_us) and the measured cold median, and whether the model's
fastest is the measured fastest.

    python3 bench/model_check.py bench/results/families_server_wide_h200.json \
        --out bench/results/standin_vs_server_h200.json

`server_race --sweep SWEEP:N` races only the model's N fastest configurations of a sweep: a pre-screen that is
worth what the model's ranking of cold calls is worth. This reads a race summary (its rows' candidates with their
measured kernel medians, its 'kernels' section for their IR) and needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from l2ir.nodes import Problem
from l2ir.text import parse_kernel


def ranks(xs) -> np.ndarray:
    """Ranks from 1, ties sharing their average rank."""
    xs = np.asarray(xs, dtype=float)
    order = np.argsort(xs, kind="stable")
    out = np.empty(len(xs))
    out[order] = np.arange(1, len(xs) + 1)
    for v in np.unique(xs):
        tied = xs == v
        out[tied] = out[tied].mean()
    return out


def spearman(a, b) -> float:
    """Spearman's rank correlation (the Pearson correlation of the ranks)."""
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def check(race: dict) -> dict:
    """Per row: candidates timed, the rank correlation, the model's and the measurement's fastest; and the totals."""
    from l2ir.search.standin import kernel_time_us

    rows = []
    for r in race["rows"]:
        problem = Problem(*r["shape"])
        pts = [(kernel_time_us(parse_kernel(race["kernels"][c["hash"]]["kernel"]), problem), c["kernel_median_us"],
                c["name"]) for c in r["candidates"] if c.get("kernel_median_us")]
        if len(pts) < 3:
            continue
        rows.append({"shape": r["shape"], "timed": len(pts), "spearman": spearman([p[0] for p in pts],
                                                                                  [p[1] for p in pts]),
                     "model_fastest": min(pts)[2], "measured_fastest": min(pts, key=lambda p: p[1])[2]})
    hits = sum(r["model_fastest"] == r["measured_fastest"] for r in rows)
    return {"rows": rows, "median_spearman": statistics.median([r["spearman"] for r in rows]) if rows else None,
            "model_fastest_is_measured_fastest": [hits, len(rows)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("race", type=Path, help="a server_race summary (with its 'kernels' section)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        race = json.loads(args.race.read_text())
        race["rows"], race["kernels"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.race}: not a server_race summary with its kernels ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    result = check(race)
    if not result["rows"]:
        print(f"error: {args.race}: no row has 3 candidates with measured kernel medians (a race before they were "
              "recorded?)", file=sys.stderr)
        return 2
    result = {"command": "python3 bench/model_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "race": args.race.name, "environment": race.get("environment", {}), **result}
    for r in result["rows"]:
        print(f"{tuple(r['shape'])}: {r['timed']} timed, spearman {r['spearman']:+.2f}, model fastest "
              f"{r['model_fastest']}, measured fastest {r['measured_fastest']}")
    hits, total = result["model_fastest_is_measured_fastest"]
    print(f"median spearman {result['median_spearman']:+.2f}; the model's fastest is the measured fastest on "
          f"{hits} of {total} shapes")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
