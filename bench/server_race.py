"""The server scenario of the families benchmark: per shape, the offline race's best candidates raced again in the
server scenario (L2 flushed, the GPU idle before each call), the server winner reported on fresh samples.

    python3 bench/server_race.py --derived bench/results/families_derived_v13_h200.json --top 3 \
        --out bench/results/families_server_h200

`l2ir bench` times only its offline winner in the server scenario, on the samples it then reports. A kernel that
wins a CUDA-graph replay over warm buffers is not always the one that wins a single cold call (a persistent kernel's
prologue, a cluster launch, a split-K workspace are paid once per call there), and a dispatch table chooses per
scenario. So for each row of a derive_families output this takes from the row's own bench run (its PREFIX.jsonl)
the `--top` candidates with the best offline speedups that passed every gate (the offline winner always among
them), rebuilds each from the run's summary (its IR and backend), times each in the server scenario through every
gate (selection, PREFIX.jsonl here), and re-times the best of them on fresh inputs and seeds (PREFIX-fresh.jsonl):
the fresh numbers are the report, as in the bench. Both files are resumable: a rerun measures only what is missing.
--fresh-trials N re-times each winner N times (trial t >= 2 in PREFIX-tT-fresh.jsonl) and reports the median trial.
--carry RACE.json (repeatable) adds to each shape the server winner and runner-up of an earlier race (its summary's
'kernels' give their IR), so a new race starts from what the earlier ones found without listing their cases again.
--case MxNxK:SWEEP:CONFIG (repeatable) adds a sweep configuration to a shape's race (named "SWEEP/CONFIG"): a kernel
the offline race did not have, chosen here on server samples and reported on fresh ones like the others.
--sweep SWEEP:N (repeatable) adds to every raced shape the N configurations of SWEEP that the verifier admits for it
and the stand-in cost model (search/standin.py) ranks fastest: a pre-screen by a model, so a wider race costs N
evaluations per sweep and shape, not the sweep's size. --shape MxNxK (repeatable) races only those rows; a later
`derive_families --server FILE` replaces an earlier file's rows with them, win or lose. The server winner is the
fastest candidate on the selection samples among the steady ones: a kernel whose samples' interquartile range is
above BIMODAL_IQR_SHARE of their median (and above the timer's TIMER_FLOOR_US and twice torch's in the same rounds)
wins only where no steady candidate was timed, and one whose torch rounds ran more than BASELINE_DRIFT slower than
the shape's usual never wins.

PREFIX.json: per shape the candidates' server speedups, the server winner and its fresh times, every raced kernel's
IR and backend ('kernels', as a bench summary has them: `l2ir db import` then `l2ir export --scenario server`
packages the race's winners), and by FLOP regime
(below 100 GFLOP, the families benchmark's) and for the unaligned shapes the fresh geomean, minimum and the shapes
below 0.9x. --compile-only builds every candidate into the compile cache and stops (it needs no GPU); --standin
runs the race against the stand-in cost model (search/standin.py: NOT measured, labelled so in the environment), to
check a derivation's race end to end on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from l2ir.search.records import JsonlStore, first_failure, passed, results_file
from l2ir.search.report import families_groups, geomean, timing
from sweep_cases import case_arg

from l2ir.cli import shape_arg


class RaceError(Exception):
    pass


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise RaceError(f"{path}: cannot read {what}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise RaceError(f"{path}: {what} is not JSON (line {e.lineno}): {e.msg}") from None


def sweep_arg(text: str):
    """argparse type: SWEEP:N -> (sweep, n)."""
    try:
        sweep, count = text.split(":")
        n = int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"sweep '{text}' is not SWEEP:N") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"sweep '{text}': N must be at least 1")
    return sweep, n


def modelled_configs(sweep: str, shape, count: int) -> list[str]:
    """The `count` configurations of `sweep` that the verifier admits for `shape`, fastest first by the stand-in
    cost model (ties by name, so the pick is reproducible)."""
    from l2ir.search.gates import admits
    from l2ir.search.standin import kernel_time_us
    from l2ir.search.sweeps import load_sweep

    from l2ir.nodes import Problem

    problem = Problem(*shape)
    admitted = [(kernel_time_us(k, problem), name) for name, k in load_sweep(sweep).items() if admits(k, problem)[0]]
    return [name for _, name in sorted(admitted)[:count]]


# An earlier race's candidates a --carry brings to each of its shapes: its server winner and the next fastest.
CARRY_TOP = 2


def carried_candidates(race_paths) -> dict[tuple, list[dict]]:
    """Per shape, the CARRY_TOP best candidates of each earlier race summary (its server winner first), with the IR
    and backend of its 'kernels' section, in the order the files are given."""
    out: dict[tuple, list[dict]] = {}
    for path in race_paths:
        race = _read_json(path, "a server_race summary")
        if "rows" not in race or "kernels" not in race:
            raise RaceError(f"--carry {path}: not a server_race summary with its kernels (no 'rows' or 'kernels')")
        for row in race["rows"]:
            timed = sorted((c for c in row.get("candidates", []) if c.get("server_speedup")),
                           key=lambda c: (c["name"] != row.get("server_winner"), -c["server_speedup"]))
            for c in timed[:CARRY_TOP]:
                info = race["kernels"].get(c["hash"])
                if info is None:
                    raise RaceError(f"--carry {path}: kernel {c['hash']} ({c['name']}) is not in its 'kernels'")
                out.setdefault(tuple(row["shape"]), []).append(
                    {"name": c["name"], "hash": c["hash"], "backend": info.get("backend"), "kernel": info["kernel"],
                     "offline_speedup": None})
    return out


def race_entries(derived_path: Path, top: int, cases=(), sweeps=(), shapes=None, carry=None) -> tuple[str, list[dict]]:
    """(problem class, one entry per derived row: shape, source run, offline winner and fresh speedup, and the top
    offline candidates as (name, hash, backend, kernel text, offline speedup), best first, then the `cases`
    ((shape, sweep, config), sweep_cases.case_arg's) of that shape, the modelled picks of the `sweeps`
    ((sweep, n), modelled_configs) for it and the `carry` candidates (carried_candidates') of that shape, with no
    offline speedup; a kernel already in the race is not added again. `shapes`: only those rows (None: all)."""
    from l2ir.backends.registry import BACKENDS
    from l2ir.search.sweeps import load_sweep

    from l2ir.errors import L2IRError
    from l2ir.text import print_kernel, print_problem

    derived = _read_json(derived_path, "the derive_families output")
    if "rows" not in derived or "problem_class" not in derived:
        raise RaceError(f"{derived_path}: not a derive_families output (no 'rows' or 'problem_class')")
    runs: dict[str, tuple[dict, dict]] = {}
    entries = []
    for row in derived["rows"]:
        if shapes is not None and tuple(row["shape"]) not in shapes:
            continue
        try:
            shape_cases = [c for c in cases if tuple(c[0]) == tuple(row["shape"])] + [
                (tuple(row["shape"]), sweep, config) for sweep, n in sweeps
                for config in modelled_configs(sweep, tuple(row["shape"]), n)]
        except L2IRError as e:
            raise RaceError(f"--sweep: {e}") from None
        source = row["source"]
        if source not in runs:
            prefix = derived_path.parent / source
            summary = _read_json(prefix.with_suffix(".json"), "a bench summary")
            records: dict[str, list[dict]] = {}
            evals = results_file(prefix.with_suffix(".jsonl"))   # or its archive .jsonl.gz
            if not evals.is_file():
                raise RaceError(f"{evals}: cannot read: no such file")
            for rec in JsonlStore(evals):
                if rec.get("scenario") == "offline" and passed(rec) and rec.get("speedup"):
                    records.setdefault(rec["problem"], []).append(rec)
            runs[source] = (summary, records)
        summary, records = runs[source]
        shape = tuple(row["shape"])
        ptext = print_problem(_problem(derived["problem_class"], shape))
        best: dict[str, dict] = {}
        for rec in records.get(ptext, []):
            h = rec["kernel_hash"][:12]
            if h not in best or rec["speedup"] > best[h]["speedup"]:
                best[h] = rec
        ranked = sorted(best.values(), key=lambda r: -r["speedup"])
        winner_hash = next((r["best_hash"] for r in summary["shapes"] if tuple(r["shape"]) == shape), None)
        chosen = ranked[:top]
        if winner_hash and all(r["kernel_hash"][:12] != winner_hash for r in chosen):
            chosen = chosen[:top - 1] + [best[winner_hash]] if winner_hash in best else chosen
        cands = []
        for rec in chosen:
            h = rec["kernel_hash"][:12]
            info = summary.get("kernels", {}).get(h)
            if info is None:
                raise RaceError(f"{source}.json: kernel {h} (evaluated on {shape}) is not in its 'kernels' section")
            name = rec.get("config") or info["config"]
            cands.append({"name": name, "hash": h, "backend": _backend(name, info), "kernel": info["kernel"],
                          "offline_speedup": rec["speedup"]})
        for _, sweep, config in shape_cases:
            configs = load_sweep(sweep)
            if config not in configs:
                raise RaceError(f"--case {'x'.join(map(str, shape))}:{sweep}:{config}: no configuration '{config}' "
                                f"in sweep '{sweep}'")
            h = configs[config].content_hash()[:12]
            if all(c["hash"] != h for c in cands):
                cands.append({"name": f"{sweep}/{config}", "hash": h, "backend": sweep if sweep in BACKENDS else None,
                              "kernel": print_kernel(configs[config]), "offline_speedup": None})
        for c in (carry or {}).get(shape, []):
            if all(have["hash"] != c["hash"] for have in cands):
                cands.append(dict(c))
        entries.append({"shape": list(shape), "source": source, "offline_winner": row["winner"],
                        "offline_fresh_speedup": row["fresh"].get("speedup"), "candidates": cands})
    return derived["problem_class"], entries


def _backend(name: str, info: dict) -> str | None:
    """The backend a candidate was lowered with: a family config's is its name's prefix ("cuda_ptx/..."), as the
    bench names them; any other's is the run's (its summary's entry, unless that entry is a family config's: the
    summary keeps one entry per kernel, and a seed can equal a family's config)."""
    from l2ir.backends.registry import BACKENDS

    prefix = name.split("/", 1)[0] if "/" in name else None
    if prefix in BACKENDS:
        return prefix
    entry_prefix = str(info.get("config", "")).split("/", 1)[0]
    return None if entry_prefix in BACKENDS else info.get("backend")


def fresh_path(out: Path, trial: int) -> Path:
    """The fresh samples of trial `trial` (from 1): OUT-fresh.jsonl, then OUT-t2-fresh.jsonl, ... (each ends in
    -fresh, so `l2ir db import` takes every trial as a re-time)."""
    return out.with_name(out.name + ("-fresh.jsonl" if trial == 1 else f"-t{trial}-fresh.jsonl"))


def median_trial(trials: list[dict]) -> dict:
    """The fresh trial with the median speedup (the lower one of an even count), with every trial's speedup: one
    fresh server call set is good to ~2% per shape and 13-17% in its worst trial (bench/results/server_aa_h200.json)."""
    ranked = sorted(trials, key=lambda t: t["speedup"])
    return {**ranked[(len(ranked) - 1) // 2], "trial_speedups": [t["speedup"] for t in trials]}


def kernels_section(entries: list[dict]) -> dict:
    """Every raced kernel by its 12-hex hash: name, backend and IR, in a bench summary's 'kernels' form, so that
    `l2ir db import` gives the race's records their kernels (and `l2ir export --scenario server` can package them:
    a `--case` or `--sweep` kernel is in no offline run's summary)."""
    out: dict[str, dict] = {}
    for e in entries:
        for c in e["candidates"]:
            out.setdefault(c["hash"], {"config": c["name"], "backend": c["backend"], "kernel": c["kernel"]})
    return out


def _problem(problem_class: str, shape):
    from l2ir.text import parse_problem

    m, n, k = shape
    return parse_problem(f"gemm m={m} n={n} k={k} {problem_class}")


# A kernel whose selection samples' interquartile range exceeds BIMODAL_IQR_SHARE of their median is bimodal (a
# workspace split-K on the H200 was seen at 59 or 80 us per cold call, by turns): its median on one sample set says
# little about the next, so it wins the race only where no steady candidate was timed. Below TIMER_FLOOR_US the spread
# is the event timer's granularity (samples of a 5 us kernel fall on a ~0.5 us grid), not the kernel's; and a spread
# within twice torch's in the same rounds is the GPU's moment, not the kernel's.
BIMODAL_IQR_SHARE = 0.10
TIMER_FLOOR_US = 1.0
# torch.matmul's median in a candidate's rounds more than this above the shape's median over all candidates: the
# candidate's speedup owes that much to a slower baseline (the server A/A's worst trial on a tiny shape was 17% off),
# so it does not win the race.
BASELINE_DRIFT = 0.25


def kernel_spread(rec: dict) -> dict:
    """A record's kernel and torch medians and interquartile ranges (microseconds), as a race entry keeps them."""
    out = {}
    for side, key in (("kernel", "kernel_stats"), ("torch", "baseline_stats")):
        st = rec.get(key) or {}
        ok = st.get("median") and st.get("q25") is not None and st.get("q75") is not None
        out[f"{side}_median_us"] = st["median"] if ok else None
        out[f"{side}_iqr_us"] = st["q75"] - st["q25"] if ok else None
    return out


def steady(entry: dict) -> bool:
    """Whether a race entry's samples are steady (an entry without stats counts as steady)."""
    med, iqr = entry.get("kernel_median_us"), entry.get("kernel_iqr_us")
    if med is None or iqr is None:
        return True
    return iqr <= max(BIMODAL_IQR_SHARE * med, TIMER_FLOOR_US, 2 * (entry.get("torch_iqr_us") or 0.0))


def server_winner(timed: list[tuple[dict, dict]]) -> tuple[dict, dict] | None:
    """The fastest of the timed (entry, candidate) pairs by selection speedup among those whose torch rounds were not
    slower than the shape's usual (BASELINE_DRIFT), a steady one before any bimodal one."""
    if not timed:
        return None
    torch_medians = [t[0]["torch_median_us"] for t in timed if t[0].get("torch_median_us")]
    usual = statistics.median(torch_medians) if torch_medians else None
    fair = [t for t in timed if usual is None or not t[0].get("torch_median_us")
            or t[0]["torch_median_us"] <= (1 + BASELINE_DRIFT) * usual]
    return max([t for t in fair if steady(t[0])] or fair, key=lambda t: t[0]["server_speedup"])


def group_summary(rows: list[dict]) -> dict:
    """Fresh server geomean, minimum and the shapes below 0.9x, by regime below 100 GFLOP and for the unaligned."""
    def stats(sel: list[dict]) -> dict:
        speeds = [r["fresh_server"]["speedup"] for r in sel if r.get("fresh_server", {}).get("speedup")]
        return {"shapes": len(sel), "timed": len(speeds), "fresh_geomean_speedup": geomean(speeds),
                "fresh_min_speedup": min(speeds, default=None),
                "below_0.9x": sorted([r["shape"], round(float(r["fresh_server"]["speedup"]), 3)] for r in sel
                                     if r.get("fresh_server", {}).get("speedup", 1) < 0.9)}

    return families_groups(rows, stats)


def group_line(label: str, g: dict) -> str:
    """One group of group_summary, for the console."""
    return (f"{label}: {g['timed']}/{g['shapes']} shapes, server fresh geomean {g['fresh_geomean_speedup']:.3f}x, "
            f"min {g['fresh_min_speedup']:.3f}x, below 0.9x: {g['below_0.9x']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--derived", type=Path, required=True, help="derive_families output (its runs in the same folder)")
    ap.add_argument("--top", type=int, default=3, help="offline candidates raced per shape (default %(default)s)")
    ap.add_argument("--case", type=case_arg, action="append", default=[], metavar="MxNxK:SWEEP:CONFIG",
                    help="race this sweep configuration on that shape too (repeatable)")
    ap.add_argument("--sweep", type=sweep_arg, action="append", default=[], metavar="SWEEP:N",
                    help="race on every shape the N configurations of SWEEP the cost model ranks fastest (repeatable)")
    ap.add_argument("--shape", type=shape_arg, action="append", default=None, metavar="MxNxK",
                    help="race only this row (repeatable; default every row)")
    ap.add_argument("--out", type=Path, required=True, help="results prefix: OUT.jsonl, OUT-fresh.jsonl, OUT.json")
    ap.add_argument("--carry", type=Path, action="append", default=[], metavar="RACE.json",
                    help="race on each shape an earlier race's winner and runner-up too (repeatable)")
    ap.add_argument("--fresh-trials", type=int, default=1, metavar="N",
                    help="re-time each winner N times on fresh inputs and seeds and report the median trial "
                         "(default %(default)s)")
    ap.add_argument("--cache-dir", default=".l2ir-cache")
    ap.add_argument("--compile-only", action="store_true", help="build the candidates into the cache and stop")
    ap.add_argument("--standin", action="store_true", help="time against the stand-in cost model (NOT measured)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting shapes after this many seconds")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top {args.top}: need at least 1")
    if args.fresh_trials < 1:
        ap.error(f"--fresh-trials {args.fresh_trials}: need at least 1")
    t_start = time.perf_counter()
    try:
        shapes = None if args.shape is None else {tuple(s) for s in args.shape}
        problem_class, entries = race_entries(args.derived, args.top, args.case, args.sweep, shapes,
                                              carried_candidates(args.carry))
        raced = {tuple(e["shape"]) for e in entries}
        for flag, asked in (("--shape", shapes or set()), ("--case", {tuple(c[0]) for c in args.case})):
            if asked - raced:
                raise RaceError(f"{flag}: shape(s) {sorted(asked - raced)} not among the raced rows of "
                                f"{args.derived.name}")
    except RaceError as e:
        print(f"server_race: {e}", file=sys.stderr)
        return 2

    from l2ir.backends.compile import CompileOptions
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import EvalConfig, Evaluator
    from l2ir.search.pipeline import Candidate, Pipeline, PipelineConfig

    from l2ir.text import parse_kernel

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    pclass = _problem(problem_class, (1, 1, 1))
    pcfg = PipelineConfig(compile=CompileOptions(cache_dir=args.cache_dir, device_sm="sm_90"),
                          compile_kernels=not args.standin, any_binary=args.standin)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    selection = JsonlStore(args.out.with_suffix(".jsonl"))
    select = Pipeline(pcfg, None, selection, log=log)
    fresh = [Pipeline(pcfg, None, JsonlStore(fresh_path(args.out, t)), log=log) for t in range(1, args.fresh_trials + 1)]
    # One candidate per distinct kernel and backend: the pipeline treats a repeat as a duplicate, and a kernel that
    # races on several shapes is built once.
    unique: dict[tuple[str, str | None], Candidate] = {}
    for e in entries:
        for c in e["candidates"]:
            unique.setdefault((c["hash"], c["backend"]), Candidate(c["name"], parse_kernel(c["kernel"]),
                                                                   f"server_race:{e['source']}", c["backend"]))
    items = dict(zip(unique, select.prepare(list(unique.values()), pclass)))
    failed = [f"{items[k].candidate.name}: {items[k].error}" for k in items if not items[k].ok]
    log(f"prepared {len(items)} kernels for {len(entries)} shapes in {time.perf_counter() - t_start:.0f} s"
        + (f"; {len(failed)} not built: {failed[:3]}" if failed else ""))
    if args.compile_only:
        return 1 if failed else 0

    rows = []
    stopped = False
    if args.standin:
        from l2ir.search.standin import StandinConfig, StandinEvaluator

        evaluator = StandinEvaluator(StandinConfig(scenarios=("server",)))
    else:
        evaluator = Evaluator(EvalConfig(scenarios=("server",), timing=BENCH_TIMING))   # the bench's cold calls
    with evaluator as ev:
        for e in entries:
            if time.perf_counter() - t_start > args.budget_s:
                stopped = True
                log(f"budget of {args.budget_s:.0f} s reached; stopping before {e['shape']}")
                break
            shape = tuple(e["shape"])
            problem = pclass.with_shape(*shape)
            row = {k: e[k] for k in ("shape", "source", "offline_winner", "offline_fresh_speedup")}
            row["candidates"] = []
            timed = []
            for c in e["candidates"]:
                o = select.evaluate(items[(c["hash"], c["backend"])], problem, ev, scenarios=("server",))
                rec = o.measurements[0].to_json() if o is not None and o.measurements else None
                entry = {"name": c["name"], "hash": c["hash"], "offline_speedup": c["offline_speedup"],
                         "server_speedup": rec.get("speedup") if rec and passed(rec) else None,
                         **kernel_spread(rec or {})}
                if rec is None or not passed(rec):
                    entry["failure"] = first_failure(rec)[:200] if rec else (o.error if o else "not evaluated")
                row["candidates"].append(entry)
                offline = f"{c['offline_speedup']:.3f}x" if c["offline_speedup"] else "not raced"
                log(f"{shape} {c['name']:52s} server {entry['server_speedup'] or 0:.3f}x (offline {offline})"
                    + (f"  {entry['failure']}" if "failure" in entry else ""))
                if entry["server_speedup"]:
                    timed.append((entry, c))
            best = server_winner(timed)
            if best is not None:
                row["server_winner"] = best[0]["name"]
                trials = []
                for trial in fresh:
                    f = trial.evaluate(items[(best[1]["hash"], best[1]["backend"])], problem, ev, scenarios=("server",))
                    frec = f.measurements[0].to_json() if f is not None and f.measurements else None
                    if frec is None or not passed(frec) or not frec.get("speedup"):
                        row["fresh_failure"] = ("not evaluated" if frec is None else "no speedup" if passed(frec)
                                                else first_failure(frec)[:200])
                        break
                    trials.append({k: v for k, v in timing(frec).items() if "samples" not in k})
                else:
                    row["fresh_server"] = median_trial(trials)
                log(f"{shape} server winner {row['server_winner']}: fresh "
                    f"{row.get('fresh_server', {}).get('speedup') or 0:.3f}x"
                    + (f" (trials {', '.join(f'{t:.3f}' for t in row['fresh_server']['trial_speedups'])})"
                       if len(trials) > 1 and "fresh_server" in row else ""))
            rows.append(row)

    result = {"command": "python3 bench/server_race.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "scenario": "server (L2 flushed, 0.5 ms spin before each call, device time), interleaved with "
                          "torch.matmul; selection on OUT.jsonl's samples, report on OUT-fresh.jsonl's",
              "derived": args.derived.name, "top": args.top, "problem_class": problem_class,
              # the evaluator learns the GPU's environment from its worker on the first call, so read it after the
              # race; a rerun that measured nothing takes the one its records were measured in
              "environment": evaluator.environment or next((r["environment"] for r in selection
                                                            if r.get("environment")), {}),
              "stopped_early": stopped, "seconds": round(time.perf_counter() - t_start, 1),
              "groups": group_summary(rows), "rows": rows, "kernels": kernels_section(entries)}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    for label, g in result["groups"].items():
        if g["timed"]:
            print(group_line(f"{label:>12}", g))
    print(f"wrote {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
