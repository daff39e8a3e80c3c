"""Where each profiled kernel's time goes: the span its busiest SM held work, and the rest of the launch.

Reads Nsight Compute's raw CSV (`ncu --csv --page raw`, with at least gpu__time_duration.sum,
sm__cycles_elapsed.max and sm__cycles_active.max; the recipes `ncu-cold` and `ncu-launch` collect them) and
prints, for each run of consecutive launches of one kernel and grid, the medians of:

- the launch's device time (gpu__time_duration);
- the busiest SM's active cycles (a warp resident): the kernel's execution, prologue to last store;
- the elapsed cycles the busiest SM did not hold work: the launch before the first block lands and the drain after
  the last one leaves. An SM reports active only while a block is resident, so time here is not spent in the
  kernel's code: a cold call that loses only here loses in the launch, not in its prologue.

    python3 bench/ncu_split.py bench/results/ncu_cold_h200.csv [--json OUT]

Lines of ncu's own chatter and the program's output (anything that is not a quoted CSV row) are skipped.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from itertools import groupby
from pathlib import Path

NEEDED = ("gpu__time_duration.sum", "sm__cycles_elapsed.max", "sm__cycles_active.max")


class SplitError(ValueError):
    pass


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def read_rows(text: str) -> list[dict]:
    """The profiled launches of an ncu raw CSV, in launch order (the units row dropped)."""
    table = [line for line in text.splitlines(keepends=True) if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("".join(table))))
    if not rows:
        raise SplitError("no ncu CSV rows (run ncu with --csv --page raw)")
    missing = [m for m in NEEDED if m not in rows[0]]
    if missing:
        raise SplitError(f"the CSV lacks the metrics {missing} (collect them with --metrics)")
    first_id = rows[0].get("ID", "")
    return rows[1:] if not first_id.strip().isdigit() else rows    # ncu's second row carries the units


def split(rows: list[dict]) -> list[dict]:
    """One entry per run of consecutive launches with the same kernel name and grid size: medians of each part."""
    out = []
    for (name, grid), launches in groupby(rows, key=lambda r: (r["Kernel Name"], r.get("launch__grid_size", ""))):
        group = list(launches)
        def med(metric: str) -> float:
            return statistics.median(_number(g[metric]) for g in group)
        time_ns, elapsed, active = (med(m) for m in NEEDED)
        # cycles per ns of this launch: the clock the SM counters ran at (the clocks are left alone)
        ghz = elapsed / time_ns if time_ns else 0.0
        out.append({"kernel": name, "grid": grid, "launches": len(group), "time_us": time_ns / 1000,
                    "active_cycles": active, "elapsed_cycles": elapsed, "idle_cycles": elapsed - active,
                    "active_us": active / ghz / 1000 if ghz else 0.0,
                    "idle_us": (elapsed - active) / ghz / 1000 if ghz else 0.0})
    return out


def short_name(name: str) -> str:
    """Demangled names run to kilobytes; the head before the template arguments says which kernel it is."""
    head = name.split("<")[0].replace("void ", "").strip()
    return head[:40] if head else name[:40]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path, help="ncu --csv --page raw output")
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    try:
        parts = split(read_rows(args.csv.read_text()))
    except OSError as e:
        print(f"ncu_split: {args.csv}: cannot read: {e.strerror}", file=sys.stderr)
        return 2
    except SplitError as e:
        print(f"ncu_split: {args.csv}: {e}", file=sys.stderr)
        return 2
    print(f"{'kernel':40} {'grid':>5} {'n':>2} {'time us':>8} {'active us':>9} {'idle us':>8}")
    for p in parts:
        print(f"{short_name(p['kernel']):40} {p['grid']:>5} {p['launches']:>2} {p['time_us']:8.2f} "
              f"{p['active_us']:9.2f} {p['idle_us']:8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"source": str(args.csv), "rows": parts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
