"""The families benchmark's groups after later, narrower runs: each shape's row replaced by a later run that raced
the shape's winner again.

    python3 bench/derive_families.py bench/results/families_small_v3_h200 bench/results/unaligned_v4_h200 \
        bench/results/cublas_tiles_h200 --out bench/results/families_derived_h200.json

Each argument is a bench prefix (PREFIX.json, the summary, and PREFIX.jsonl, every evaluation). The first is the
base run; the others follow in the order given. A shape's row (its winner and that winner's fresh-sample times) is
replaced by a later run's row only when the later run evaluated the current winner itself (the same kernel hash) on
that shape: the later winner then beat it in one selection, and its fresh times come from one run, so a replaced row
is never a best-of-runs pick. Shapes of a later run outside the base set are ignored. The groups (FLOP regimes,
unaligned shapes, DRAM-bound shapes and their roofline shares) are search.report.fresh_summary's, the bench's own.

--ceiling FILE (bench/dram_ceiling_probe.py's output) adds to each DRAM-bound row the time of a kernel that only
streams the shape's bytes, and the share of that ceiling the winner reaches: what is left to gain, where the
roofline share alone mixes it with what no kernel can reach.

--server FILE (bench/server_race.py's output over this derivation) adds the server scenario: each row's server
winner and its fresh server times, and the server groups (by regime below 100 GFLOP, and the unaligned shapes).
Repeated, a later file's rows (a wider race over some shapes, `server_race --shape`) replace an earlier file's for
the shapes it timed, whatever they measure (one race's selection and fresh samples per row, never the better of
two fresh reports), and the groups are recomputed from the rows kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from l2ir.search.db import split_problem
from l2ir.search.records import JsonlStore, results_file
from l2ir.search.report import REGIMES, ShapeResult, fresh_summary, gflop, median


class DeriveError(Exception):
    pass


def same_card(base: dict, other: dict, name: str) -> None:
    """One derivation holds one card's numbers: a file measured on another GPU than the base run is an error
    (a device call can land on an H100 where an H200 was asked for). Files that do not name their GPU pass."""
    gpu, base_gpu = (other or {}).get("gpu"), (base or {}).get("gpu")
    if gpu and base_gpu and gpu != base_gpu:
        raise DeriveError(f"{name}: measured on an {gpu}, the base run on an {base_gpu}")


def _load(prefix: str) -> tuple[dict, dict[tuple, set[str]]]:
    """(summary, shape -> kernel hashes evaluated on it) of one bench run."""
    summary_path, evals_path = Path(prefix + ".json"), results_file(prefix + ".jsonl")   # or its .jsonl.gz
    try:
        summary = json.loads(summary_path.read_text())
    except OSError as e:
        raise DeriveError(f"{summary_path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise DeriveError(f"{summary_path}: not JSON (line {e.lineno}): {e.msg}") from None
    if "shapes" not in summary or "problem_class" not in summary:
        raise DeriveError(f"{summary_path}: not a bench summary (no 'shapes' or 'problem_class')")
    if not evals_path.is_file():
        raise DeriveError(f"{evals_path}: cannot read: no such file")
    evaluated: dict[tuple, set[str]] = {}
    for rec in JsonlStore(evals_path):          # a line cut by a kill is skipped, as every reader of these files does
        shape = split_problem(str(rec.get("problem", "")))[0]
        if shape is not None and isinstance(rec.get("kernel_hash"), str):
            evaluated.setdefault(shape, set()).add(rec["kernel_hash"][:12])
    return summary, evaluated


def derive(prefixes: list[str]) -> dict:
    base, _ = _load(prefixes[0])
    rows = {tuple(r["shape"]): dict(r, source=Path(prefixes[0]).name) for r in base["shapes"] if r.get("fresh")}
    replaced = []
    for prefix in prefixes[1:]:
        later, evaluated = _load(prefix)
        same_card(base.get("environment"), later.get("environment"), f"{prefix}.json")
        if later["problem_class"] != base["problem_class"]:
            raise DeriveError(f"{prefix}.json: problem class {later['problem_class']!r}, not the base run's "
                              f"{base['problem_class']!r}")
        for r in later["shapes"]:
            shape = tuple(r["shape"])
            now = rows.get(shape)
            if now is None or not r.get("fresh") or not now.get("best_hash"):
                continue
            if now["best_hash"][:12] in evaluated.get(shape, set()):
                replaced.append({"shape": list(shape), "from": now["source"], "to": Path(prefix).name,
                                 "speedup_before": now["fresh"].get("speedup"),
                                 "speedup_after": r["fresh"].get("speedup"),
                                 "winner_before": now.get("best_name"), "winner_after": r.get("best_name")})
                rows[shape] = dict(r, source=Path(prefix).name)
    results = [ShapeResult(shape=s, best_name=r.get("best_name"), best_hash=r.get("best_hash"),
                           offline=r.get("offline") or {}, fresh=r["fresh"]) for s, r in sorted(rows.items())]
    summary = fresh_summary(results, base["problem_class"], base.get("environment") or {})
    below = {label: sorted([list(r.shape), round(r.fresh["speedup"], 3)] for r in results
                           if lo <= gflop(r.shape) * 1e9 < hi and r.fresh.get("speedup", 1) < 0.9)
             for lo, hi, label in REGIMES[:2]}       # the families benchmark's regimes: below 100 GFLOP
    return {"runs": [Path(p).name for p in prefixes], "problem_class": base["problem_class"],
            "environment": base.get("environment"), "replaced": replaced, "below_0.9x": below,
            "rows": [{"shape": list(s), "source": r["source"], "winner": r.get("best_name"),
                      "fresh": r["fresh"]} for s, r in sorted(rows.items())],
            **{k: summary[k] for k in ("overall_fresh_geomean_speedup", "fresh_by_regime", "groups",
                                        "wins_by_family")}}


def add_ceiling(result: dict, ceiling_path: Path) -> None:
    """The DRAM-bound rows' stream-kernel ceilings (dram_ceiling_probe), and the winners' share of them."""
    try:
        probe = json.loads(ceiling_path.read_text())
        ceiling = {tuple(r["shape"]): r["ceiling_us"] for r in probe["rows"] if r.get("ceiling_us")}
        same_card(result.get("environment"), probe.get("environment"), str(ceiling_path))
    except OSError as e:
        raise DeriveError(f"{ceiling_path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DeriveError(f"{ceiling_path}: not a dram_ceiling_probe output ({e})") from None
    group = result["groups"].get("dram_bound")
    if not group:
        return
    of_ceiling = []
    for row in group["rows"]:
        c = ceiling.get(tuple(row["shape"]))
        if c is None or not row.get("kernel_share"):
            continue
        kernel_us = row["floor_us"] / row["kernel_share"]
        row["ceiling_us"], row["ceiling_share"] = c, row["floor_us"] / c
        row["kernel_share_of_ceiling"] = c / kernel_us
        of_ceiling.append(row["kernel_share_of_ceiling"])
    group["ceiling_source"] = ceiling_path.name
    group["median_ceiling_share"] = median([r["ceiling_share"] for r in group["rows"] if "ceiling_share" in r])
    group["median_kernel_share_of_ceiling"] = median(of_ceiling)


def add_server(result: dict, *server_paths: Path) -> None:
    """Each row's server winner and fresh server times (server_race; a later file's row replaces an earlier's for
    its shape), and the server groups as result["server"]: the race's own for one file, recomputed from the rows
    for several."""
    from server_race import group_summary  # bench/server_race.py, beside this script

    races = []
    for path in server_paths:
        try:
            race = json.loads(path.read_text())
            same_card(result.get("environment"), race.get("environment"), str(path))
            races.append((path.name, {tuple(r["shape"]): r for r in race["rows"]}, race["groups"], race.get("scenario")))
        except OSError as e:
            raise DeriveError(f"{path}: cannot read: {e.strerror}") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DeriveError(f"{path}: not a server_race output ({e})") from None
    for row in result["rows"]:
        for name, by_shape, _, _ in races:
            r = by_shape.get(tuple(row["shape"]))
            if r is None:
                continue
            for key in ("server_winner", "fresh_server", "server_source"):
                row.pop(key, None)
            if r.get("fresh_server"):
                row["server_winner"], row["fresh_server"] = r["server_winner"], r["fresh_server"]
                if len(races) > 1:
                    row["server_source"] = name
    groups = races[0][2] if len(races) == 1 else group_summary(result["rows"])
    result["server"] = {"source": ", ".join(name for name, *_ in races), "scenario": races[-1][3], "groups": groups}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefixes", nargs="+", help="bench result prefixes: the base run first, then later runs")
    ap.add_argument("--ceiling", type=Path, help="dram_ceiling_probe output: per DRAM-bound shape, the stream ceiling")
    ap.add_argument("--server", type=Path, action="append", default=[],
                    help="server_race output: per shape, the server winner's fresh times (repeatable: later ones "
                         "replace earlier ones' rows)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        result = derive(args.prefixes)
        if args.ceiling:
            add_ceiling(result, args.ceiling)
        if args.server:
            add_server(result, *args.server)
    except DeriveError as e:
        print(f"derive_families: {e}", file=sys.stderr)
        return 2
    result = {"command": "python3 bench/derive_families.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for label, reg in result["fresh_by_regime"].items():
        if reg["shapes"]:
            print(f"{label:>12}: {reg['shapes']:3d} shapes, fresh geomean {reg['fresh_geomean_speedup']:.3f}x, "
                  f"min {reg['fresh_min_speedup']:.3f}x, below 0.9x: {result['below_0.9x'].get(label, '-')}")
    g = result["groups"]
    print(f"   unaligned: {g['unaligned']['shapes']} shapes, "
          f"fresh geomean {g['unaligned']['fresh_geomean_speedup']:.3f}x")
    if "dram_bound" in g:
        print(f"  DRAM-bound: {g['dram_bound']['shapes']} shapes, median roofline share kernel "
              f"{g['dram_bound']['median_kernel_share']:.3f}, torch {g['dram_bound']['median_torch_share']:.3f}"
              + (f"; stream ceiling {g['dram_bound']['median_ceiling_share']:.3f}, winners at a median "
                 f"{g['dram_bound']['median_kernel_share_of_ceiling']:.3f} of it"
                 if g["dram_bound"].get("median_kernel_share_of_ceiling") else ""))
        long = g["dram_bound"].get("long_floor")
        if long and long["shapes"]:
            print(f"    {long['rule']}: {long['shapes']} shapes, median roofline share kernel "
                  f"{long['median_kernel_share']:.3f}, torch {long['median_torch_share']:.3f}")
    if "server" in result:
        from server_race import group_line  # bench/server_race.py, beside this script

        for label, sg in result["server"]["groups"].items():
            if sg["timed"]:
                print(group_line(f"  {label}", sg))
    for r in result["replaced"]:
        print(f"  replaced {r['shape']}: {r['speedup_before']:.3f}x ({r['from']}) -> {r['speedup_after']:.3f}x "
              f"({r['to']})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
