"""Which shapes `l2ir export` serves with an L2IR kernel, and whether those choices hold on samples they were not made
on: the spread rule (speedup * (1 - spread) > 1, the export's rule up to commit 16ff220) against the paired bound
(the lower 95 % confidence bound of the median per-round speedup above 1, l2ir/export.py now).

    python3 bench/export_rule_check.py --race bench/results/families_server_v16_h200 \
        --out bench/results/export_rule_v16_h200.json

Reads a server race (bench/server_race.py with --fresh-trials: PREFIX.jsonl holds the selection rounds,
PREFIX-fresh.jsonl and PREFIX-tN-fresh.jsonl the winner's fresh trials) into a records DB in memory. No GPU: it
only re-reads measured samples. Two views, by the families benchmark's groups:
- export: both rules decided on the fresh trials, as `l2ir export --scenario server` decides; what a package's table
  then promises (a shape on cuBLAS counts 1.0x).
- held out: both rules decided on the race's selection rounds of the winner alone; each decision reported on the
  fresh trials' median speedup, which the decision never saw. A served shape whose fresh speedup is below 1 is a
  wrong choice; `oracle` serves exactly the shapes whose fresh speedup is above 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from l2ir.search.db import RecordsDB, split_problem
from l2ir.search.records import results_file
from l2ir.search.report import families_groups, geomean

from l2ir.export import WIN_CONFIDENCE, choose, choose_environment, win_verdict
from l2ir.search.timing import PairedSpeedup

NO_SAMPLES = PairedSpeedup(None, None, 0)


def spread_rule(speedup, spread) -> bool:
    """The export's rule up to commit 16ff220, speedup * (1 - spread) > 1: win_verdict's verdict without samples."""
    return win_verdict(speedup, spread, NO_SAMPLES)[0]


def race_files(prefix: Path) -> list[Path]:
    files = [results_file(prefix.with_name(prefix.name + ".jsonl")),
             results_file(prefix.with_name(prefix.name + "-fresh.jsonl"))]
    files += sorted(prefix.parent.glob(prefix.name + "-t*-fresh.jsonl*"))
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise SystemExit(f"export_rule_check: {', '.join(missing)}: not found (a server race with --fresh-trials?)")
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--race", required=True, type=Path, help="a server race's PREFIX (bench/server_race.py --out)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)

    db = RecordsDB(":memory:")
    for f in race_files(args.race):
        db.import_jsonl(f)
    env = choose_environment(db, None)
    choices = {(c.m, c.n, c.k, c.problem_class): c for c in choose(db, env, "server")}
    problems = {(*r.shape, split_problem(r.problem)[1]): r.problem
                for r in db.measurements(environment=env, scenario="server")}
    rows = []
    for key, c in sorted(choices.items()):
        m, n, k, _ = key
        problem = problems[key]
        retimed = {r.kernel: r for r in db.ranking(problem, env, "server", purpose="retime", limit=1000,
                                                   per_kernel="median")}
        # The held-out decision must not see the fresh trials: the winner is the re-timed kernel the selection
        # rounds rank first (the race re-times its selection winner).
        selection = [r for r in db.ranking(problem, env, "server", purpose="import", limit=1000) if r.kernel in retimed]
        if not selection:
            continue
        sel = selection[0]
        winner = retimed[sel.kernel]           # its fresh numbers: the median trial
        held_ok, held_bound, _ = win_verdict(sel.speedup, sel.spread, db.paired_speedup(
            problem, sel.kernel, env, "server", "import", WIN_CONFIDENCE))
        rows.append({
            "shape": [m, n, k], "winner": winner.kernel[:12], "fresh_speedup": winner.speedup,
            "export": {"spread_rule": spread_rule(winner.speedup, winner.spread),
                       "bound_rule": c.kernel is not None, "bound": c.speedup_bound, "reason": c.reason},
            "held_out": {"selection_speedup": sel.speedup if sel else None,
                         "selection_spread": sel.spread if sel else None,
                         "spread_rule": spread_rule(sel.speedup, sel.spread),
                         "bound_rule": held_ok, "bound": held_bound},
        })

    def delivered(view: str, rule: str):
        def stats(rs):
            if view == "oracle":
                served = [r for r in rs if r["fresh_speedup"] > 1.0]
            else:
                served = [r for r in rs if r[view][rule]]
            got = [r["fresh_speedup"] if r in served else 1.0 for r in rs]
            wrong = [r for r in served if r["fresh_speedup"] < 1.0]
            return {"shapes": len(rs), "served": len(served), "geomean": geomean(got),
                    "served_below_1": [[r["shape"], round(r["fresh_speedup"], 3)] for r in wrong]}
        return stats

    out = {
        "command": "python3 " + " ".join(sys.argv), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "race": str(args.race), "environment": db.environments()[0][1] if db.environments() else None,
        "scenario": "server (the race's cold calls); no GPU here: a re-reading of measured samples",
        "confidence": WIN_CONFIDENCE,
        "groups": {f"{view}/{rule}": families_groups(rows, delivered(view, rule))
                   for view in ("export", "held_out") for rule in ("spread_rule", "bound_rule")},
        "oracle": families_groups(rows, delivered("oracle", "")),
        "rows": rows,
    }
    out["groups"]["oracle"] = out.pop("oracle")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'view/rule':<24} {'group':<12} {'served':>7} {'geomean':>8}  served below 1x")
    for name, groups in out["groups"].items():
        for group, s in groups.items():
            print(f"{name:<24} {group:<12} {s['served']:>3}/{s['shapes']:<3} {s['geomean']:>8.3f}  "
                  f"{s['served_below_1'] or ''}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
