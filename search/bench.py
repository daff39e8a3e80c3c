"""`l2ir bench`: lower, compile and evaluate the seed kernel and a sweep of configurations over grid shapes.

Kernels are problem-independent (M, N, K are run-time arguments), so every distinct kernel is compiled once, in
parallel, and then evaluated on every shape its Pad policy admits. For each shape every applicable candidate goes
through all correctness gates and the offline timing; the best one that passed every gate is then timed again in the
server scenario. Every measurement is appended to `<out>.jsonl` as it is made (a killed run loses nothing and
`--resume` skips what is there); `<out>.csv` and `<out>.json` hold the per-shape table and the summary (geomean
speedup by FLOP regime, pass rate, compile seconds per kernel) with the environment.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime as dt
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from l2ir.errors import L2IRError
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile
from l2ir.seed import seed
from l2ir.text import print_problem
from l2ir.verify import applicable

GRID = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384)
# FLOP regimes the summary groups by: launch/latency-bound, one-wave, multi-wave, compute-bound.
REGIMES = ((0.0, 1e9, "< 1 GFLOP"), (1e9, 1e11, "1-100 GFLOP"), (1e11, 1e12, "0.1-1 TFLOP"),
           (1e12, math.inf, ">= 1 TFLOP"))


def grid_shapes(count: int, min_gflop: float = 0.0) -> list[tuple[int, int, int]]:
    """`count` shapes of the {64..16384}^3 grid (those of at least `min_gflop`) spread evenly over the FLOP range
    (sorted by FLOPs, then M, N, K)."""
    shapes = sorted(((m, n, k) for m in GRID for n in GRID for k in GRID if 2 * m * n * k >= min_gflop * 1e9),
                    key=lambda s: (s[0] * s[1] * s[2], s))
    if count >= len(shapes):
        return shapes
    if count <= 1:
        return shapes[-1:] if count == 1 else []
    idx = sorted({round(i * (len(shapes) - 1) / (count - 1)) for i in range(count)})
    return [shapes[i] for i in idx]


def sm80_config(block, warps, stages, smem_swizzle, prefetch=True, group=8, raster="along_n",
                epilogue="smem", splitk=None) -> Kernel:
    return Kernel(
        target=Target("sm80"),
        tile=Tile(block=block, warps=warps),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("multistage", stages, prefetch=prefetch),
        swizzle=Swizzle(smem=smem_swizzle, raster=raster, group=group),
        pad=Pad("predicate", "predicate", "zero_fill", 8),
        splitk=splitk,
        epilogue=Epilogue(epilogue, 8),
    )


# A small sweep of sm80 configurations around the ones CUDA-L2's kernels use: big tiles for big outputs,
# deeper BK=64 rows with the 128-byte swizzle, and small tiles for thin problems.
SM80_SWEEP: dict[str, Kernel] = {
    "128x256x32_w2x4_s3": sm80_config((128, 256, 32), (2, 4), 3, (2, 3, 3)),
    "128x128x32_w2x2_s4": sm80_config((128, 128, 32), (2, 2), 4, (2, 3, 3)),
    "128x128x64_w2x2_s3": sm80_config((128, 128, 64), (2, 2), 3, (3, 3, 3)),
    "64x128x32_w2x2_s4": sm80_config((64, 128, 32), (2, 2), 4, (2, 3, 3)),
    "64x64x32_w2x2_s3_splitk4": sm80_config((64, 64, 32), (2, 2), 3, (2, 3, 3), splitk=SplitK("split_k", 4)),
}


def sm90_config(block, schedule, cluster=(1, 1), splitk=None, group=8, raster="along_n") -> Kernel:
    """A TMA warp-specialized wgmma kernel: cooperative = 2 consumer warpgroups share a tile (warps 8x1); ping-pong =
    2 consumer warpgroups alternate tiles (warps 4x1), so one tile's epilogue hides under the other's main loop."""
    warps = (8, 1) if schedule == "cooperative" else (4, 1)
    return Kernel(
        target=Target("sm90a"),
        tile=Tile(block=block, warps=warps, cluster=cluster),
        mma=Mma("wgmma", (64, block[1], 16)),
        pipeline=Pipeline("tma_ws", "auto", schedule=schedule, persistent=True),
        swizzle=Swizzle(smem=(3, 3, 3), raster=raster, group=group),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
        splitk=splitk,
        epilogue=Epilogue("tma", 8),
    )


# Hopper sweep: the CUTLASS 3.x shapes that win on H100/H200-class parts.
SM90_SWEEP: dict[str, Kernel] = {
    "coop_128x256x64_c1x1": sm90_config((128, 256, 64), "cooperative"),
    "coop_128x256x64_c2x1": sm90_config((128, 256, 64), "cooperative", cluster=(2, 1)),
    "coop_256x128x64_c1x2": sm90_config((256, 128, 64), "cooperative", cluster=(1, 2)),
    "pingpong_128x128x64_c1x1": sm90_config((128, 128, 64), "pingpong"),
    "pingpong_64x256x64_c1x1": sm90_config((64, 256, 64), "pingpong"),
    "pingpong_128x128x64_c1x2": sm90_config((128, 128, 64), "pingpong", cluster=(1, 2)),
    "pingpong_64x256x64_c2x1": sm90_config((64, 256, 64), "pingpong", cluster=(2, 1)),
    "coop_128x256x64_c2x1_streamk": sm90_config((128, 256, 64), "cooperative", cluster=(2, 1),
                                                splitk=SplitK("stream_k")),
}

# The raw CUDA/PTX backend (cooperative, no TMA store yet): its epilogue stages C through shared memory.
PTX_SWEEP: dict[str, Kernel] = {
    name: k.replace(epilogue=Epilogue("smem", 8), splitk=None, tile=dataclasses.replace(k.tile, cluster=(1, 1)))
    for name, k in (("ptx_coop_128x256x64", sm90_config((128, 256, 64), "cooperative")),
                    ("ptx_coop_256x128x64", sm90_config((256, 128, 64), "cooperative")),
                    ("ptx_coop_128x128x64", sm90_config((128, 128, 64), "cooperative")))
}

# The raw CUDA/PTX backend's sm80 rule (mma.sync + ldmatrix + cp.async, no CuTe): the smem epilogue with 16-byte
# stores, no split-K (the seed brings split-K where the shape wants it).
PTX_SM80_SWEEP: dict[str, Kernel] = {
    "ptx_sm80_128x128x32_w2x2_s4": sm80_config((128, 128, 32), (2, 2), 4, (2, 3, 3)),
    "ptx_sm80_128x256x32_w2x4_s3": sm80_config((128, 256, 32), (2, 4), 3, (2, 3, 3)),
    "ptx_sm80_64x64x32_w2x2_s3": sm80_config((64, 64, 32), (2, 2), 3, (2, 3, 3)),
}

SWEEPS = {"sm80": SM80_SWEEP, "sm90a": SM90_SWEEP, "cuda_ptx": PTX_SWEEP, "cuda_ptx_sm80": PTX_SM80_SWEEP}


@dataclass(frozen=True)
class BenchConfig:
    out: Path                                   # results prefix: <out>.jsonl, <out>.csv, <out>.json
    shapes: tuple[tuple[int, int, int], ...]
    sweep: tuple[tuple[str, Kernel], ...]
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


@dataclass
class ShapeResult:
    shape: tuple[int, int, int]
    candidates: int = 0
    passed: int = 0
    best_name: str | None = None
    best_hash: str | None = None
    offline: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    gates: dict = field(default_factory=dict)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load_done(path: Path) -> dict[tuple[str, str, str], dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                key = (rec["kernel_hash"], rec["problem"], rec["scenario"], rec.get("artifact_key", ""))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue          # a line cut by a kill mid-write, or not a measurement
            done[key] = rec
            done[key[:3]] = rec   # the latest record for (kernel, problem, scenario), whatever binary: report-only
    return done


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark on this machine's GPU and write the results. Returns the summary."""
    from l2ir.backends.compile import CompileOptions, compile_many
    from l2ir.backends.registry import lower
    from l2ir.text import print_problem

    from .evaluator import EvalConfig, Evaluator, kernel_hash
    from .timing import TimingConfig

    t_start = time.perf_counter()
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    jsonl = cfg.out.with_suffix(".jsonl")
    done = _load_done(jsonl) if cfg.resume else {}
    if not cfg.resume and jsonl.exists():
        jsonl.unlink()

    # 1. Candidates per shape: the seed plus every sweep config the problem admits.
    per_shape: dict[tuple[int, int, int], list[tuple[str, Kernel]]] = {}
    kernels: dict[str, tuple[str, Kernel]] = {}
    base = cfg.problem
    for shape in cfg.shapes:
        problem = base.with_shape(*shape)
        cands = [("seed", seed(problem, cfg.target))] + list(cfg.sweep)
        seen, chosen = set(), []
        for name, k in cands:
            h = k.content_hash()
            if h in seen or not applicable(k, problem):
                continue
            seen.add(h)
            chosen.append((name, k))
            kernels.setdefault(h, (name, k))
        per_shape[shape] = chosen

    # 2. Lower and compile every distinct kernel once (all shapes share one dtype/layout class).
    plans, artifacts = {}, {}
    t0 = time.perf_counter()
    for h, (name, k) in list(kernels.items()):
        try:
            plans[h] = lower(k, base, cfg.backend)
        except (NotImplementedError, L2IRError) as e:
            # A candidate the backend cannot lower is pruned, as the search does; the run goes on.
            _log(f"not lowered: {name} {h[:12]}: {e}")
            del kernels[h]
    for shape in per_shape:
        per_shape[shape] = [(n, k) for n, k in per_shape[shape] if k.content_hash() in kernels]
    keys = list(plans)
    results = compile_many([plans[h] for h in keys], CompileOptions(cache_dir=cfg.cache_dir, jobs=cfg.compile_jobs,
                                                                           device_sm=cfg.device_sm))
    artifacts = dict(zip(keys, results))
    compile_wall = time.perf_counter() - t0
    fresh = [a.compile_seconds for a in results if not getattr(a, "cached", False)]
    every = [a.compile_seconds for a in results]
    failed = {h: a for h, a in artifacts.items() if not a.ok}
    for h, a in failed.items():
        _log(f"compile failed: {kernels[h][0]} {h[:12]}: {a.summary()}\n  reproduce: {a.repro}")
    _log(f"compiled {len(keys)} kernels in {compile_wall:.1f} s wall ({len(failed)} failed)")
    kernel_report = _kernel_report(kernels, artifacts)

    # 3. Evaluate: gates + offline timing for every candidate; then, best first, the candidates that passed are
    #    gated again and timed in the server scenario until one passes that re-check: it is the shape's result.
    shape_results: list[ShapeResult] = []
    evals = passes = recheck_failures = 0
    stopped_early = False
    env: dict = {}
    timing = TimingConfig(trials=7, target_ms=10.0, server_samples=15)
    brp = cfg.baseline_reduced_precision
    with contextlib.ExitStack() as stack:
        evaluators = {} if cfg.report_only else {
            s: stack.enter_context(Evaluator(EvalConfig(scenarios=(s,), timing=timing, baseline_reduced_precision=brp)))
            for s in ("offline", "server")}

        def measure(scenario: str, name: str, k: Kernel, problem: Problem, ptext: str) -> dict | None:
            """The recorded measurement if this run (same binary) has one, else a new one (None in report-only)."""
            h = k.content_hash()
            key = (kernel_hash(k), ptext, scenario) + (() if cfg.report_only else (artifacts[h].key,))
            rec = done.get(key)
            if rec is not None and rec.get("errors") and not cfg.report_only:
                rec = None     # an error (out of memory, a dead worker) is no verdict on the kernel: measure again
            if rec is None and not cfg.report_only:
                ms = evaluators[scenario].evaluate(k, problem, plans[h], artifacts[h])
                _append(jsonl, ms, name)
                rec = json.loads(ms[0].dumps())
            return rec

        for shape in cfg.shapes:
            if time.perf_counter() - t_start > cfg.budget_s:
                stopped_early = True
                _log(f"budget of {cfg.budget_s:.0f} s reached; stopping before {shape}")
                break
            problem = base.with_shape(*shape)
            ptext = print_problem(problem)
            sr = ShapeResult(shape, candidates=len(per_shape[shape]))
            passing = []
            for name, k in per_shape[shape]:
                rec = measure("offline", name, k, problem, ptext)
                if rec is None:
                    continue
                env = env or rec.get("environment") or {}
                evals += 1
                ok = _passed(rec)
                passes += ok
                sr.gates[name] = {v["name"]: v["passed"] for v in rec["verdicts"]} | (
                    {"errors": rec["errors"][:1]} if rec["errors"] else {})
                _log(f"{shape} {name:28s} {'pass' if ok else 'FAIL'} "
                     f"{_fmt(rec.get('kernel_median_us'))} us vs torch {_fmt(rec.get('baseline_median_us'))} us"
                     + ("" if ok else f"  {(rec['errors'] or [_first_failure(rec)])[0][:160]}"))
                if ok and rec.get("speedup"):
                    passing.append((rec["speedup"], name, k, rec))
            for _, name, k, rec in sorted(passing, key=lambda c: -c[0]):
                srv = measure("server", name, k, problem, ptext)
                if srv is not None and not _passed(srv):
                    # Passed once, failed when gated again (a race?): it is no result, and neither is its time.
                    recheck_failures += 1
                    sr.gates[name]["recheck"] = False
                    _log(f"{shape} {name:28s} FAILED the re-check: {(srv['errors'] or [_first_failure(srv)])[0][:160]}")
                    continue
                sr.best_name, sr.best_hash = name, k.content_hash()[:12]
                sr.offline = _timing(rec)
                sr.server = _timing(srv) if srv is not None else {}
                break
            sr.passed = sum(1 for g in sr.gates.values() if "errors" not in g and all(g.values()))
            shape_results.append(sr)
        env = env or (evaluators["offline"].environment if evaluators else {}) or {}

    summary = _summary(cfg, shape_results, evals, passes, fresh, every, compile_wall, len(keys), len(failed), env,
                       stopped_early, time.perf_counter() - t_start)
    summary["recheck_failures"] = recheck_failures
    summary["kernels"] = kernel_report
    _write_csv(cfg.out.with_suffix(".csv"), shape_results, env)
    cfg.out.with_suffix(".json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _kernel_report(kernels: dict, artifacts: dict) -> dict:
    """Per compiled kernel: registers and spills (ptxas), and from the SASS the matrix instructions (HGMMA on the
    wgmma path, HMMA on mma.sync) and local-memory loads/stores (spills)."""
    from l2ir.backends.sass import inspect

    report = {}
    for h, (name, k) in kernels.items():
        a = artifacts[h]
        entry = {"config": name, "kernel": k.text(), "compiled": a.ok, "compile_seconds": round(a.compile_seconds, 1),
                 "from_cache": bool(getattr(a, "cached", False))}
        if a.ok:
            entry["functions"] = {_short(fn): {"registers": r.registers, "spill_stores": r.spill_stores,
                                       "spill_loads": r.spill_loads, "stack_frame": r.stack_frame}
                                  for fn, r in a.resources.items() if r.entry}
            entry["sass"] = inspect(a.binary)
        report[h[:12]] = entry
    return report


def _short(symbol: str, limit: int = 72) -> str:
    """CUTLASS kernels have mangled names of kilobytes; keep a readable head and a hash that tells them apart."""
    if len(symbol) <= limit:
        return symbol
    import hashlib

    return f"{symbol[:limit - 14]}..{hashlib.sha256(symbol.encode()).hexdigest()[:12]}"


def _append(path: Path, measurements, name: str) -> None:
    with open(path, "a") as fh:
        for m in measurements:
            rec = json.loads(m.dumps())
            rec["config"] = name
            fh.write(json.dumps(rec) + "\n")


def _passed(rec: dict) -> bool:
    return not rec.get("errors") and bool(rec.get("verdicts")) and all(v["passed"] for v in rec["verdicts"])


def _first_failure(rec: dict) -> str:
    for v in rec.get("verdicts", []):
        if not v["passed"]:
            return f"gate {v['name']}: {v.get('detail', '')}"
    return "no verdicts"


def _fmt(x) -> str:
    return f"{x:9.2f}" if isinstance(x, (int, float)) else "        -"


def _timing(rec: dict) -> dict:
    ks, bs = rec.get("kernel_stats") or {}, rec.get("baseline_stats") or {}
    return {"kernel_us": rec.get("kernel_median_us"), "torch_us": rec.get("baseline_median_us"),
            "speedup": rec.get("speedup"), "kernel_spread": ks.get("rel_spread"),
            "torch_spread": bs.get("rel_spread"), "kernel_samples": rec.get("kernel_us"),
            "torch_samples": rec.get("baseline_us")}


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _summary(cfg, results, evals, passes, fresh, every, compile_wall, n_kernels, n_failed, env, stopped, seconds):
    by_regime = {}
    for lo, hi, label in REGIMES:
        rows = [r for r in results if lo <= 2 * r.shape[0] * r.shape[1] * r.shape[2] < hi]
        by_regime[label] = {
            "shapes": len(rows),
            "offline_geomean_speedup": _geomean([r.offline.get("speedup") for r in rows]),
            "server_geomean_speedup": _geomean([r.server.get("speedup") for r in rows]),
            "shapes_faster_offline": sum(1 for r in rows if (r.offline.get("speedup") or 0) > 1.0),
        }
    return {
        "scenario": "offline (CUDA-graph replay, inputs rotated) and server (L2 flushed, idle gap), device time",
        "baseline": "torch.matmul (cuBLAS), same inputs and layouts, interleaved; "
                    + ("PyTorch default flags (fp16 reduced-precision reductions allowed)" if cfg.baseline_reduced_precision
                       else "fp16/bf16 reduced-precision reductions disabled (the fp32-accumulation contract)"),
        "command": cfg.command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "target": cfg.target,
        "problem_class": " ".join(w for w in print_problem(cfg.problem).split()[4:]),   # after "gemm m= n= k="
        "shapes_planned": len(cfg.shapes),
        "shapes_done": len(results),
        "stopped_early": stopped,
        "seconds": round(seconds, 1),
        "evaluations": evals,
        "gate_pass_rate": passes / evals if evals else None,
        "kernels_compiled": n_kernels,
        "compile_failures": n_failed,
        "compile_seconds_per_kernel": (sum(every) / len(every)) if every else None,
        "compile_seconds_per_kernel_fresh": (sum(fresh) / len(fresh)) if fresh else None,
        "compile_wall_seconds": round(compile_wall, 1),
        "overall_offline_geomean_speedup": _geomean([r.offline.get("speedup") for r in results]),
        "overall_server_geomean_speedup": _geomean([r.server.get("speedup") for r in results]),
        "by_regime": by_regime,
        "shapes": [dataclasses.asdict(r) | {"offline": {k: v for k, v in r.offline.items() if "samples" not in k},
                                             "server": {k: v for k, v in r.server.items() if "samples" not in k}}
                   for r in results],
    }


def _write_csv(path: Path, results: list[ShapeResult], env: dict) -> None:
    cols = ["M", "N", "K", "gflop", "candidates", "passed_all_gates", "best_config", "best_kernel",
            "offline_kernel_us", "offline_torch_us", "offline_speedup", "offline_kernel_spread", "offline_torch_spread",
            "server_kernel_us", "server_torch_us", "server_speedup", "server_kernel_spread", "server_torch_spread",
            "gpu", "driver", "cuda", "torch", "date"]
    date = dt.date.today().isoformat()
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in results:
            o, s = r.offline, r.server
            w.writerow([*r.shape, round(2 * r.shape[0] * r.shape[1] * r.shape[2] / 1e9, 3), r.candidates, r.passed,
                        r.best_name, r.best_hash, o.get("kernel_us"), o.get("torch_us"), o.get("speedup"),
                        o.get("kernel_spread"), o.get("torch_spread"), s.get("kernel_us"), s.get("torch_us"),
                        s.get("speedup"), s.get("kernel_spread"), s.get("torch_spread"), env.get("gpu"),
                        env.get("driver"), env.get("cuda_runtime"), env.get("torch"), date])


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"l2ir bench ({summary['target']}): {summary['shapes_done']}/{summary['shapes_planned']} shapes")
    for col in ("M", "N", "K", "best", "offline us", "torch us", "speedup", "server x"):
        t.add_column(col, justify="right")
    for r in summary["shapes"]:
        o, s = r["offline"], r["server"]
        t.add_row(*map(str, r["shape"]), str(r["best_name"]), _fmt(o.get("kernel_us")), _fmt(o.get("torch_us")),
                  f"{o['speedup']:.3f}" if o.get("speedup") else "-", f"{s['speedup']:.3f}" if s.get("speedup") else "-")
    c = Console(width=140)
    c.print(t)
    for label, g in summary["by_regime"].items():
        gm = g["offline_geomean_speedup"]
        c.print(f"{label:>12}: {g['shapes']:3d} shapes, offline geomean {gm:.3f}x" if gm else f"{label:>12}: -")
    for h, kr in summary.get("kernels", {}).items():
        fns = kr.get("functions") or {}
        regs = max((f["registers"] for f in fns.values()), default=0)
        spills = sum(f["spill_stores"] + f["spill_loads"] for f in fns.values())
        sass = kr.get("sass")
        sass_txt = ("HGMMA {hgmma}, HMMA {hmma}, LDL/STL {local_loads}/{local_stores}".format(**sass) if sass
                    else "SASS not inspected (no cuobjdump)")
        c.print(f"{h} {kr['config']:30s} regs {regs:3d}  spill bytes {spills}  {sass_txt}")
    rate = summary["gate_pass_rate"]
    fresh = summary["compile_seconds_per_kernel_fresh"]
    compile_txt = (f"{fresh:.1f} s/kernel compiled in this run" if fresh is not None else
                   f"{summary['compile_seconds_per_kernel'] or 0:.1f} s/kernel when first built (all from the cache)")
    c.print(f"gate pass rate {rate:.3f} over {summary['evaluations']} evaluations" if rate is not None else
            "no evaluations", end="; ")
    c.print(f"re-check failures {summary.get('recheck_failures', 0)}; compile {compile_txt} "
            f"({summary['kernels_compiled']} kernels, {summary['compile_failures']} failed)")
