"""Learned policy vs random edits: GPU evaluations needed to reach a speedup on shapes the learned policy never saw.

    python bench/policy_compare.py --standin                       # the stand-in cost model (NOT measured)
    python bench/policy_compare.py --train-on standin --target 1.0 # train on the stand-in, compare on the GPU

1. Shapes: `--train-shapes + --held-shapes` grid shapes spread over the four FLOP regimes (search.tune's sample);
   every k-th goes to the held-out set, the rest train. The two sets never share a shape.
2. Training: the search loop (l2ir.search.loop.Search) runs the learned policy over the training shapes with
   `--train-budget` candidates each; the policy learns from every reward the loop hands back. Its state is
   written to OUT_learned_state.json (or read from --state, skipping training).
3. Comparison: for each seed, one search run per policy over the held-out shapes, the same budget, the same step-0
   population (the rule-based seeds only: no sweeps, no neighbours from earlier runs, so the policy alone makes
   every later candidate); the learned policy is frozen (it does not learn on held-out shapes). For each shape the
   loop's incumbent curve gives the candidates evaluated until the incumbent's speedup first reached --target.
4. Two targets: --target (a speedup over torch.matmul) and --target-of-best (a fraction of the best any run found
   on the shape, which every shape can reach). OUT.json holds the environment, the configuration, every curve and
   the summary per target (mean evaluations to the target, counting a shape never reached as budget + 1; how many
   runs reached it; geomean best speedup); OUT.md the tables; OUT_learned_state.json the trained policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Frozen:
    """A policy that proposes but no longer learns (update is ignored)."""

    def __init__(self, policy):
        self.policy = policy
        self.name = policy.name

    def propose(self, context):
        return self.policy.propose(context)

    def update(self, feedback):
        return None

    def state_dict(self):
        return self.policy.state_dict()

    def load_state_dict(self, state):
        self.policy.load_state_dict(state)


def split_shapes(train: int, held: int) -> tuple[list, list]:
    from l2ir.search.tune import regime_sample

    shapes = regime_sample(train + held)
    if len(shapes) < train + held:
        raise SystemExit(f"policy_compare: the grid sample has only {len(shapes)} shapes for {train}+{held}")
    step = (train + held) / held
    held_idx = {min(len(shapes) - 1, int(i * step + step / 2)) for i in range(held)}
    return ([s for i, s in enumerate(shapes) if i not in held_idx], [s for i, s in enumerate(shapes) if i in held_idx])


def tune_config(shapes, policy: str, seed: int, budget: int, mode: str, args, init_size: int):
    from l2ir.search.loop import TuneConfig

    want = dict(shapes=tuple(tuple(s) for s in shapes), policy=policy, seed=seed, budget_candidates=budget,
                batch=args.batch, init_size=init_size, arch=args.arch, neighbours=0, sweeps=False, mode=mode,
                retime=False, cache_dir=args.cache_dir, device_sm=args.device_sm, budget_wall_s=args.budget_seconds)
    have = {f.name for f in dataclasses.fields(TuneConfig)}
    return TuneConfig(**{k: v for k, v in want.items() if k in have})


def evaluators(mode: str, seed: int):
    from l2ir.search.tune import _evaluators

    return _evaluators(mode, seed)


def run_search(shapes, policy, seed: int, budget: int, mode: str, args, db_path: Path, init_size: int):
    from l2ir.search.db import RecordsDB
    from l2ir.search.loop import Search

    ev, rt = evaluators(mode, seed)
    db = RecordsDB(db_path)
    try:
        search = Search(tune_config(shapes, policy.name, seed, budget, mode, args, init_size), db, ev, rt,
                        policy=policy, command="bench/policy_compare.py " + " ".join(sys.argv[1:]))
        states = search.run()
        env = dict(ev.environment) if ev is not None and getattr(ev, "environment", None) else {}
    finally:
        for e in (ev, rt):
            if e is not None:
                e.close()
        db.close()
    return states, env


def evaluations_to(curve, target: float) -> int | None:
    """The loop's curve is (candidates evaluated, incumbent speedup) after each accepted change."""
    for cands, speedup in curve:
        if speedup is not None and speedup >= target:
            return max(1, int(cands))
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--standin", action="store_true", help="train and compare on the stand-in cost model (NOT "
                    "measured); default: the GPU")
    ap.add_argument("--train-on", choices=("same", "standin"), default="same",
                    help="train on the comparison's evaluator (same) or on the stand-in, saving GPU time")
    ap.add_argument("--state", help="a saved learned-policy state (JSON) to start from; skips training")
    ap.add_argument("--train-shapes", type=int, default=24)
    ap.add_argument("--held-shapes", type=int, default=8)
    ap.add_argument("--limit-held", type=int, metavar="K", help="compare on K of the held-out shapes (evenly spread)")
    ap.add_argument("--train-budget", type=int, default=24, help="candidates per training shape")
    ap.add_argument("--train-epochs", type=int, default=2, help="passes over the training shapes")
    ap.add_argument("--budget", type=int, default=24, help="candidates per held-out shape and policy")
    ap.add_argument("--target", type=float, default=1.0, help="the speedup over torch.matmul to reach")
    ap.add_argument("--target-of-best", type=float, default=0.97, metavar="F",
                    help="the second target: per shape, F times the best speedup any run found on it (one every "
                         "shape can reach, also where nothing beats torch.matmul)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--entropy", type=float, default=None,
                    help="the learned policy's entropy bonus (default: policy.learned's)")
    ap.add_argument("--lr", type=float, default=None, help="the learned policy's learning rate (default: policy.learned's)")
    ap.add_argument("--train-seed", type=int, default=0,
                    help="the learned policy's initial weights (one training run per call: compare several to see "
                         "how much of a difference is the training's luck)")
    ap.add_argument("--budget-seconds", type=float, default=math.inf,
                    help="wall seconds per search run (each policy and seed gets the same); a shape cut short "
                         "counts the candidates it reached")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--arch", default="sm90a")
    ap.add_argument("--cache-dir", default=".l2ir-cache")
    ap.add_argument("--device-sm", default="sm_90")
    ap.add_argument("--db-dir", help="keep the runs' records DBs here (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="results prefix (default bench/results/policy_compare[_standin])")
    args = ap.parse_args(argv)
    for name in ("train_shapes", "held_shapes", "train_budget", "budget", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"policy_compare: --{name.replace('_', '-')} must be >= 1")

    from l2ir.policy.learned import Learned
    from l2ir.policy.random_edits import RandomEdits

    mode = "standin" if args.standin else "gpu"
    train_mode = "standin" if args.train_on == "standin" or args.state else mode
    if mode == "gpu":
        from l2ir.search.preflight import missing

        lacks = missing(gpu=True, toolchain=True)
        if lacks:
            raise SystemExit(f"policy_compare: cannot compare on the GPU here: {'; '.join(lacks)} (--standin runs "
                             "against the stand-in cost model, NOT measured)")
    out = Path(args.out or ROOT / "bench" / "results" / ("policy_compare_standin" if args.standin
                                                         else "policy_compare"))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.db_dir:
        work = Path(args.db_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="policy_compare_")
        work = Path(tmp.name)
    train, held = split_shapes(args.train_shapes, args.held_shapes)
    if args.limit_held is not None and args.limit_held < len(held):
        # A GPU run compiles most candidates afresh (tens of seconds each): compare on an even spread of the
        # held-out shapes, keeping the split (and so which shapes are held out) the state was trained with.
        step = len(held) / args.limit_held
        held = [held[int(i * step)] for i in range(args.limit_held)]
    t0 = time.time()

    learned = Learned(seed=args.train_seed, **{k: v for k, v in (("entropy", args.entropy), ("lr", args.lr))
                                               if v is not None})
    trained_shapes = [list(x) for x in train]
    if args.state:
        try:
            state = json.loads(Path(args.state).read_text())
            learned = Learned.from_state(state)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"policy_compare: --state {args.state}: {e}") from None
        trained_shapes = state.get("trained_shapes", [])
        seen = [x for x in held if list(x) in trained_shapes]
        if seen:
            raise SystemExit(f"policy_compare: --state {args.state} was trained on held-out shape(s) "
                             f"{', '.join('x'.join(map(str, x)) for x in seen)}; use the --train-shapes and "
                             "--held-shapes it was trained with")
        trained_on = f"state {args.state}"
    else:
        for epoch in range(args.train_epochs):
            db = work / f"train_{epoch}.db"
            db.unlink(missing_ok=True)
            run_search(train, learned, 1000 + epoch, args.train_budget, train_mode, args, db, init_size=2)
            print(f"policy_compare: trained epoch {epoch + 1}/{args.train_epochs} on {len(train)} shapes "
                  f"({learned.updates} updates, {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        trained_on = (f"{len(train)} shapes x {args.train_epochs} epochs x {args.train_budget} candidates ({train_mode}), "
                      f"initial weights seed {args.train_seed}, entropy bonus {learned.entropy}, lr {learned.lr}")
    # The shapes it learned on travel with the state, so a later comparison can refuse to call them held out.
    (out.parent / (out.name + "_learned_state.json")).write_text(
        json.dumps(learned.state_dict() | {"trained_shapes": trained_shapes}))

    rows, env = [], {}
    for seed in args.seeds:
        for name, policy in (("learned", Frozen(learned)), ("random", RandomEdits())):
            db = work / f"held_{name}_{seed}.db"
            db.unlink(missing_ok=True)
            states, env = run_search(held, policy, seed, args.budget, mode, args, db, init_size=2)
            for st in states:
                rows.append({"policy": name, "seed": seed, "shape": list(st.shape),
                             "best_speedup": st.best, "candidates": st.candidates, "failures": st.failures,
                             "illegal": st.illegal, "gpu_seconds": st.gpu_s,
                             "curve": [[int(c), s] for c, s in st.curve]})
            print(f"policy_compare: {name} seed {seed} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    best_of = {tuple(sh): max((r["best_speedup"] or 0.0) for r in rows if tuple(r["shape"]) == tuple(sh))
               for sh in held}
    # Two targets: a fixed speedup over torch.matmul, and a fraction of the best any run found on the shape (one
    # every shape can reach, also where nothing beats torch.matmul).
    kinds = {"absolute": (f"{args.target}x over torch.matmul", lambda sh: args.target),
             "of_best": (f"{args.target_of_best} x the best speedup any run found on the shape",
                         lambda sh: args.target_of_best * best_of[sh])}
    summary = {}
    for kind, (what, target_of) in kinds.items():
        summary[kind] = {"target": what}
        for r in rows:
            r.setdefault("targets", {})[kind] = target_of(tuple(r["shape"]))
            r.setdefault("evaluations_to_target", {})[kind] = evaluations_to(r["curve"], r["targets"][kind])
        for name in ("learned", "random"):
            mine = [r for r in rows if r["policy"] == name]
            evals = [r["evaluations_to_target"][kind] or args.budget + 1 for r in mine]
            best = [r["best_speedup"] for r in mine if r["best_speedup"]]
            summary[kind][name] = {
                "mean_evaluations_to_target": sum(evals) / len(evals) if evals else None,
                "reached": sum(r["evaluations_to_target"][kind] is not None for r in mine), "runs": len(mine),
                "geomean_best_speedup": math.exp(sum(map(math.log, best)) / len(best)) if best else None,
            }
    result = {"what": "evaluations to reach a speedup on held-out shapes: learned policy vs random edits",
              "measured": mode == "gpu", "mode": mode, "environment": env, "budget": args.budget,
              "seeds": args.seeds, "trained_on": trained_on,
              "train_shapes": [list(x) for x in train], "held_shapes": [list(x) for x in held],
              "command": "python bench/policy_compare.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "seconds": time.time() - t0, "summary": summary, "rows": rows}
    # OUT is a prefix: a dot in it (--out /tmp/e0.2) is part of the name, not a suffix to replace.
    json_path, md_path = out.parent / (out.name + ".json"), out.parent / (out.name + ".md")
    json_path.write_text(json.dumps(result, indent=1))
    where = f"GPU: {env.get('gpu')}" if mode == "gpu" else "STAND-IN cost model, NOT measured"
    lines = [f"# Learned policy vs random edits ({where})", "",
             (f"Budget {args.budget} candidates per shape (the first 2 are the rule-based seeds); seeds {args.seeds}; "
              f"learned trained on {trained_on}; the held-out shapes were never trained on."), ""]
    for kind, (what, _) in kinds.items():
        lines += [f"## Target: {what}", "",
                  "| shape | " + " | ".join(f"{p} s{x}" for x in args.seeds for p in ("learned", "random")) + " |",
                  "|---|" + "---|" * (2 * len(args.seeds))]
        for shape in held:
            cells = []
            for x in args.seeds:
                for p in ("learned", "random"):
                    r = next(r for r in rows if r["policy"] == p and r["seed"] == x
                             and tuple(r["shape"]) == tuple(shape))
                    e = r["evaluations_to_target"][kind]
                    cells.append(f"{e if e is not None else '-'} ({r['best_speedup'] or 0:.3f}x)")
            lines.append(f"| {'x'.join(map(str, shape))} | " + " | ".join(cells) + " |")
        lines += ["", "Cells: candidates evaluated until the incumbent reached the target ('-': never within the "
                  "budget, counted as budget + 1 in the mean), and the best speedup found.", "",
                  "| policy | mean evaluations to target | reached | geomean best speedup |", "|---|---|---|---|"]
        for name in ("learned", "random"):
            x = summary[kind][name]
            lines.append(f"| {name} | {x['mean_evaluations_to_target']:.1f} | {x['reached']}/{x['runs']} | "
                         f"{x['geomean_best_speedup'] or 0:.3f}x |")
        lines.append("")
    md_path.write_text("\n".join(lines))
    print("\n".join(ln for ln in lines if ln.startswith(("## ", "| learned", "| random"))))
    print(f"policy_compare: wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
