"""`l2ir bench`: the seed kernel and a named sweep (search/sweeps/) over grid shapes, through the candidate pipeline.

Every distinct kernel is lowered and compiled once, in parallel (search/pipeline.py), then evaluated on every shape
its rules admit. For each shape every candidate goes through all correctness gates and the offline timing; the best
one that passed every gate is then gated again and timed in the server scenario (falling back to the next best if the
re-check fails). Every measurement is appended to `<out>.jsonl` as it is made (search/records.py: a killed run loses
nothing and a rerun skips what is there); `<out>.csv` and `<out>.json` hold the per-shape table and the summary
(search/report.py: geomean speedup by FLOP regime, pass rate, compile seconds per kernel) with the environment.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from l2ir.nodes import Kernel, Problem
from l2ir.text import print_problem_class

from .records import JsonlStore, first_failure, passed
from .report import (
    RunStats,
    ShapeResult,
    fmt_us,
    kernel_report,
    summarize,
    timing,
    write_csv,
)
from .timing import TimingConfig

GRID = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384)
# The bench's timing, both scenarios: 10 ms replays (offline) and 15 cold calls per side (server). The probes that
# re-time a bench's kernels (bench/server_race.py, bench/cold_start_probe.py) use it too, so their numbers compare.
BENCH_TIMING = TimingConfig(trials=7, target_ms=10.0, server_samples=15)


def grid_shapes(count: int, min_gflop: float = 0.0, max_gflop: float = float("inf")) -> list[tuple[int, int, int]]:
    """`count` shapes of the {64..16384}^3 grid (those of at least `min_gflop` and below `max_gflop`) spread evenly
    over the FLOP range (sorted by FLOPs, then M, N, K)."""
    shapes = sorted(((m, n, k) for m in GRID for n in GRID for k in GRID
                     if min_gflop * 1e9 <= 2 * m * n * k < max_gflop * 1e9),
                    key=lambda s: (s[0] * s[1] * s[2], s))
    if count >= len(shapes):
        return shapes
    if count <= 1:
        return shapes[-1:] if count == 1 else []
    idx = sorted({round(i * (len(shapes) - 1) / (count - 1)) for i in range(count)})
    return [shapes[i] for i in idx]


def default_sweep(target: str, backend: str | None) -> str:
    """The sweep named after the forced backend if there is one, else after the target (sm80 otherwise)."""
    from .sweeps import sweep_names

    names = sweep_names()
    if backend in names:
        return backend
    return target if target in names else "sm80"


@dataclass(frozen=True)
class BenchConfig:
    out: Path                                   # results prefix: <out>.jsonl, <out>.csv, <out>.json
    shapes: tuple[tuple[int, int, int], ...]
    sweep: tuple[tuple[str, Kernel], ...]       # (config name, kernel), e.g. load_sweep("sm90a").items()
    sweep_name: str = ""                        # where the configs came from (records their origin)
    # Kernel families measured side by side: (backend, sweep name, ((config name, kernel), ...)). Given, they
    # replace `sweep`; each config is lowered by its family's backend and named "<backend>/<config>", so every
    # record and the winner say which family it is.
    families: tuple[tuple[str, str, tuple[tuple[str, Kernel], ...]], ...] = ()
    # Re-time each shape's winner offline on fresh inputs and seeds (<out>-fresh.jsonl): the selection samples
    # picked it, the fresh ones report it, so the winner's luck in selection is not reported as speed.
    fresh: bool = True
    target: str = "sm80"                        # the seed generator's target
    budget_s: float = 1e9                       # stop starting new shapes after this long (results are kept)
    resume: bool = True
    backend: str | None = None
    compile_jobs: int = 0
    cache_dir: str = ".l2ir-cache"
    command: str = ""
    report_only: bool = False                   # rebuild the summary from OUT.jsonl; measure nothing (no GPU)
    device_sm: str = "sm_90"                    # the SASS target: the GPU the kernels run on (H100/H200 = sm_90)
    # The problem class (dtypes, layouts, accumulator); each shape replaces its sizes.
    problem: Problem = Problem(1, 1, 1)
    # False holds cuBLAS to the fp32-accumulation contract (no fp16 split-K reductions); True times torch.matmul
    # with PyTorch's default flags, which is what a user calling it gets.
    baseline_reduced_precision: bool = False


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def candidates_for(cfg: BenchConfig, shape: tuple[int, int, int]):
    """The seed for this shape first (it keeps its name when a sweep config is the same kernel), then the sweep."""
    from l2ir.seed import seed

    from .pipeline import Candidate

    first = [Candidate("seed", seed(cfg.problem.with_shape(*shape), cfg.target), "seed")]
    if cfg.families:
        return first + [Candidate(f"{backend}/{name}", k, f"sweep:{sweep}", backend)
                        for backend, sweep, configs in cfg.families for name, k in configs]
    origin = f"sweep:{cfg.sweep_name}" if cfg.sweep_name else "sweep"
    return first + [Candidate(name, k, origin) for name, k in cfg.sweep]



def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark on this machine's GPU (nothing but stored records with report_only) and write the results.
    Returns the summary."""
    from l2ir.backends.compile import CompileOptions

    from .evaluator import EvalConfig, Evaluator
    from .pipeline import Pipeline, PipelineConfig
    t_start = time.perf_counter()
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    store = JsonlStore(cfg.out.with_suffix(".jsonl"), resume=cfg.resume)
    # report_only rebuilds the tables from the records: nothing is compiled (a machine without nvcc can do it).
    pcfg = PipelineConfig(backend=cfg.backend, any_binary=cfg.report_only, compile_kernels=not cfg.report_only,
                          compile=CompileOptions(cache_dir=cfg.cache_dir, jobs=cfg.compile_jobs, device_sm=cfg.device_sm))
    pipeline = Pipeline(pcfg, None, store, log=_log)
    # The winner's report timing: never answered from the selection records, only from earlier fresh ones.
    fresh_pipeline = Pipeline(pcfg, None, JsonlStore(cfg.out.with_name(cfg.out.name + "-fresh.jsonl"),
                                                      resume=cfg.resume), log=_log)

    # Lower and compile every distinct kernel of every shape once, in one parallel batch (all shapes share one
    # dtype/layout class); the per-shape calls below then only look them up.
    per_shape = {shape: candidates_for(cfg, shape) for shape in cfg.shapes}
    pipeline.prepare([c for cands in per_shape.values() for c in cands], cfg.problem)
    compiled = [p for p in pipeline.prepared if p.artifact is not None]
    stats = RunStats(kernels=len(compiled), compile_wall=pipeline.compile_wall_s,
                     compile_failures=sum(1 for p in compiled if not p.artifact.ok),
                     compile_seconds=[p.artifact.compile_seconds for p in compiled],
                     compile_seconds_fresh=[p.artifact.compile_seconds for p in compiled
                                            if not getattr(p.artifact, "cached", False)])
    _log(f"compiled {stats.kernels} kernels in {stats.compile_wall:.1f} s wall ({stats.compile_failures} failed)")

    shape_results: list[ShapeResult] = []
    env: dict = {}
    tcfg = BENCH_TIMING
    with contextlib.ExitStack() as stack:
        evaluators = {} if cfg.report_only else {
            s: stack.enter_context(Evaluator(EvalConfig(scenarios=(s,), timing=tcfg,
                                                        baseline_reduced_precision=cfg.baseline_reduced_precision)))
            for s in ("offline", "server")}

        def measure(item, problem, scenario):
            return pipeline.evaluate(item, problem, evaluators.get(scenario), scenarios=(scenario,))

        for shape in cfg.shapes:
            if time.perf_counter() - t_start > cfg.budget_s:
                stats.stopped_early = True
                _log(f"budget of {cfg.budget_s:.0f} s reached; stopping before {shape}")
                break
            problem = cfg.problem.with_shape(*shape)
            sr = ShapeResult(shape)
            ranked = []
            for item in pipeline.prepare(per_shape[shape], cfg.problem):
                name = item.candidate.name
                o = measure(item, problem, "offline")
                if o is None or o.status in ("illegal", "duplicate", "unsupported", "lowering_failed"):
                    continue           # pruned as the search prunes it: not a candidate for this shape
                sr.candidates += 1
                if o.status == "compile_failed":
                    stats.evaluations += 1
                    sr.gates[name] = {"errors": [o.error]}
                    _log(f"{shape} {name:28s} FAIL  {o.error[:160]}")
                    continue
                rec = o.measurements[0].to_json()
                env = env or rec.get("environment") or {}
                ok = passed(rec)
                stats.evaluations += 1
                stats.passes += ok
                sr.gates[name] = {v["name"]: v["passed"] for v in rec["verdicts"]} | (
                    {"errors": rec["errors"][:1]} if rec["errors"] else {})
                _log(f"{shape} {name:28s} {'pass' if ok else 'FAIL'} "
                     f"{fmt_us(rec.get('kernel_median_us'))} us vs torch {fmt_us(rec.get('baseline_median_us'))} us"
                     + ("" if ok else f"  {first_failure(rec)[:160]}"))
                if ok and rec.get("speedup"):
                    ranked.append((rec["speedup"], item, rec))
            # Best first: gated again and timed in the server scenario until one passes that re-check.
            for _, item, rec in sorted(ranked, key=lambda c: -c[0]):
                name = item.candidate.name
                o = measure(item, problem, "server")
                srv = o.measurements[0].to_json() if o is not None and o.measurements else None
                if srv is not None and not passed(srv):
                    # Passed once, failed when gated again (a race?): it is no result, and neither is its time.
                    stats.recheck_failures += 1
                    sr.gates[name]["recheck"] = False
                    _log(f"{shape} {name:28s} FAILED the re-check: {first_failure(srv)[:160]}")
                    continue
                sr.best_name, sr.best_hash = name, item.kernel_hash[:12]
                sr.offline = timing(rec)
                sr.server = timing(srv) if srv is not None else {}
                if cfg.fresh:
                    f = fresh_pipeline.evaluate(item, problem, evaluators.get("offline"), scenarios=("offline",))
                    frec = f.measurements[0].to_json() if f is not None and f.measurements else None
                    if frec is not None and passed(frec):
                        sr.fresh = timing(frec)
                    elif frec is not None:
                        stats.recheck_failures += 1
                        sr.gates[name]["fresh"] = False
                        _log(f"{shape} {name:28s} FAILED on fresh inputs: {first_failure(frec)[:160]}")
                break
            sr.passed = sum(1 for g in sr.gates.values() if "errors" not in g and all(g.values()))
            shape_results.append(sr)
        env = env or (evaluators["offline"].environment if evaluators else {}) or {}

    stats.seconds = time.perf_counter() - t_start
    summary = summarize(shape_results, stats, target=cfg.target, problem_class=print_problem_class(cfg.problem),
                        command=cfg.command, environment=env, shapes_planned=len(cfg.shapes),
                        baseline_reduced_precision=cfg.baseline_reduced_precision)
    summary["kernels"] = kernel_report(compiled, cfg.backend)
    write_csv(cfg.out.with_suffix(".csv"), shape_results, env)
    cfg.out.with_suffix(".json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary
