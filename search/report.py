"""Benchmark reports: the per-shape rows, the summary (geomean speedup by FLOP regime, pass rate, compile cost) with
the environment, the CSV/JSON files and the printed tables."""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import hashlib
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from l2ir import target

# FLOP regimes the summary groups by: launch/latency-bound, one-wave, multi-wave, compute-bound.
REGIMES = ((0.0, 1e9, "< 1 GFLOP"), (1e9, 1e11, "1-100 GFLOP"), (1e11, 1e12, "0.1-1 TFLOP"),
           (1e12, math.inf, ">= 1 TFLOP"))


@dataclass
class ShapeResult:
    """One shape's row: how many candidates ran, how many passed every gate, the best one and its times."""

    shape: tuple[int, int, int]
    candidates: int = 0
    passed: int = 0
    best_name: str | None = None
    best_hash: str | None = None
    offline: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    gates: dict = field(default_factory=dict)
    fresh: dict = field(default_factory=dict)     # the winner re-timed offline on fresh inputs (its report time)


@dataclass
class RunStats:
    """What the summary counts besides the shapes."""

    evaluations: int = 0
    passes: int = 0
    recheck_failures: int = 0
    compile_seconds: list[float] = field(default_factory=list)        # every compiled kernel's build time
    compile_seconds_fresh: list[float] = field(default_factory=list)  # the ones built in this run
    compile_wall: float = 0.0
    kernels: int = 0
    compile_failures: int = 0
    stopped_early: bool = False
    seconds: float = 0.0


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def gflop(shape: tuple[int, int, int]) -> float:
    m, n, k = shape
    return 2 * m * n * k / 1e9


# Roofline ceilings (peak tensor FLOP/s, DRAM bytes/s) by a substring of the GPU's name; a GPU not named here (or
# a stand-in) gets no roofline rather than another chip's.
ROOFLINE_CEILINGS = {"H200": (target.H200_TENSOR_F16_FLOPS, target.H200_DRAM_BYTES_PER_S)}


def ceilings_for(env: dict | None) -> tuple[float, float] | None:
    """The roofline ceilings of the GPU an environment measured on, or None (unknown GPU, stand-in)."""
    env = env or {}
    if env.get("standin"):
        return None
    return next((c for name, c in ROOFLINE_CEILINGS.items() if name in str(env.get("gpu") or "")), None)


def roofline(shape: tuple[int, int, int], problem_class: str, ceilings: tuple[float, float]) -> dict:
    """A GEMM's floor time: the longer of its FLOPs at the tensor rate and its least DRAM traffic (A and B read once,
    C written once; dtypes from the problem class's a=, b=, c=, f16 where absent) at the DRAM rate."""
    m, n, k = shape
    size = {}
    for op in "abc":
        mt = re.search(rf"(?:^|\s){op}=(\w+)", problem_class)
        dtype = mt.group(1) if mt else "f16"
        if dtype not in target.DTYPE_BYTES:
            raise ValueError(f"roofline: operand {op} of problem class {problem_class!r} has dtype {dtype!r}, not one "
                             f"of {sorted(target.DTYPE_BYTES)}")
        size[op] = target.DTYPE_BYTES[dtype]
    flop_rate, byte_rate = ceilings
    flops = 2 * m * n * k
    nbytes = m * k * size["a"] + k * n * size["b"] + m * n * size["c"]
    compute_s, memory_s = flops / flop_rate, nbytes / byte_rate
    return {"flops": flops, "bytes": nbytes, "floor_us": max(compute_s, memory_s) * 1e6,
            "bound": "compute" if compute_s >= memory_s else "memory"}


def roofline_share(floor_us: float, time_us: float | None) -> float | None:
    """The share of the floor a time reaches (floor / time); above 1 means faster than the hardware allows."""
    return floor_us / time_us if time_us else None


def median(xs) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def timing(rec: dict) -> dict:
    """A measurement record's times, in the shape rows' form."""
    ks, bs = rec.get("kernel_stats") or {}, rec.get("baseline_stats") or {}
    return {"kernel_us": rec.get("kernel_median_us"), "torch_us": rec.get("baseline_median_us"),
            "speedup": rec.get("speedup"), "kernel_spread": ks.get("rel_spread"),
            "torch_spread": bs.get("rel_spread"), "kernel_samples": rec.get("kernel_us"),
            "torch_samples": rec.get("baseline_us")}


def summarize(results: list[ShapeResult], stats: RunStats, *, target: str, problem_class: str, command: str,
              environment: dict, shapes_planned: int, baseline_reduced_precision: bool = False) -> dict:
    by_regime = {}
    for lo, hi, label in REGIMES:
        rows = [r for r in results if lo <= gflop(r.shape) * 1e9 < hi]
        by_regime[label] = {
            "shapes": len(rows),
            "offline_geomean_speedup": geomean([r.offline.get("speedup") for r in rows]),
            "server_geomean_speedup": geomean([r.server.get("speedup") for r in rows]),
            "shapes_faster_offline": sum(1 for r in rows if (r.offline.get("speedup") or 0) > 1.0),
        }
    every, fresh = stats.compile_seconds, stats.compile_seconds_fresh
    return {
        "scenario": "offline (CUDA-graph replay, inputs rotated) and server (L2 flushed, idle gap), device time",
        "baseline": "torch.matmul (cuBLAS), same shapes, layouts and kind of inputs (its own buffers), interleaved; "
                    + ("PyTorch default flags (fp16 reduced-precision reductions allowed)" if baseline_reduced_precision
                       else "fp16/bf16 reduced-precision reductions disabled (the fp32-accumulation contract)"),
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment,
        "target": target,
        "problem_class": problem_class,
        "shapes_planned": shapes_planned,
        "shapes_done": len(results),
        "stopped_early": stats.stopped_early,
        "seconds": round(stats.seconds, 1),
        "evaluations": stats.evaluations,
        "gate_pass_rate": stats.passes / stats.evaluations if stats.evaluations else None,
        "kernels_compiled": stats.kernels,
        "compile_failures": stats.compile_failures,
        "compile_seconds_per_kernel": (sum(every) / len(every)) if every else None,
        "compile_seconds_per_kernel_fresh": (sum(fresh) / len(fresh)) if fresh else None,
        "compile_wall_seconds": round(stats.compile_wall, 1),
        "overall_offline_geomean_speedup": geomean([r.offline.get("speedup") for r in results]),
        "overall_server_geomean_speedup": geomean([r.server.get("speedup") for r in results]),
        "by_regime": by_regime,
        "recheck_failures": stats.recheck_failures,
        **fresh_summary(results, problem_class, environment),
        "shapes": [dataclasses.asdict(r) | {part: {k: v for k, v in getattr(r, part).items() if "samples" not in k}
                                             for part in ("offline", "server", "fresh")}
                   for r in results],
    }


def family_of(name: str | None) -> str | None:
    """The family (backend) of a bench candidate name: "cuda_ptx/64x128" -> "cuda_ptx" (search/bench.py names a
    family's configs "<backend>/<config>"); the seed and single-sweep configs belong to the default backend."""
    if name is None:
        return None
    return name.split("/", 1)[0] if "/" in name else "default"


def is_unaligned(shape: tuple[int, int, int]) -> bool:
    """A shape with a dimension that is not a multiple of 8: no 16-byte vector covers its rows evenly."""
    return any(d % 8 for d in shape)


# DRAM-bound shapes whose roofline floor is at least this long move at least ~65 MB (at the H200's 4.8 TB/s): a
# call's fixed cost (launch, the first bytes' latency: 2-3 us even for a kernel that only streams the bytes,
# bench/results/dram_ceiling_h200.json) is then under a fifth of the floor, so the bandwidth roofline is a reachable
# bar. Below it the fixed cost alone keeps any kernel, torch's included, far under the roofline.
LONG_FLOOR_US = 15.0


def families_groups(rows: list[dict], stats) -> dict:
    """`stats(rows)` for each group of the families benchmark: the FLOP regimes below 100 GFLOP and the unaligned
    shapes (rows are dicts with a "shape")."""
    out = {label: stats([r for r in rows if lo <= gflop(tuple(r["shape"])) * 1e9 < hi]) for lo, hi, label in REGIMES[:2]}
    out["unaligned"] = stats([r for r in rows if is_unaligned(tuple(r["shape"]))])
    return out


def _ratio_stats(xs: list[float]) -> dict:
    return {"n": len(xs), "geomean": geomean(xs), "min": min(xs, default=None), "max": max(xs, default=None)}


def fresh_summary(results: list[ShapeResult], problem_class: str, environment: dict) -> dict:
    """What the winners measure on fresh samples (the report numbers; selection picked them on other samples), by
    FLOP regime and by group (unaligned shapes, DRAM-bound shapes with their roofline shares), which family won
    where, and the repeat check: torch.matmul timed in the selection run and again in the fresh run, the same
    kernel twice (an A/A check of the method), beside the winner's own selection-to-fresh ratio."""
    ceilings = ceilings_for(environment)

    def fresh_speeds(rows: list[ShapeResult]) -> dict:
        speeds = [r.fresh.get("speedup") for r in rows]
        return {"shapes": len(rows), "fresh_geomean_speedup": geomean(speeds),
                "fresh_min_speedup": min((x for x in speeds if x), default=None)}

    by_regime = {label: fresh_speeds([r for r in results if lo <= gflop(r.shape) * 1e9 < hi])
                 for lo, hi, label in REGIMES}
    groups = {"unaligned": fresh_speeds([r for r in results if is_unaligned(r.shape)])}
    if ceilings is not None:
        dram = []
        for r in results:
            roof = roofline(r.shape, problem_class, ceilings)
            if roof["bound"] == "memory" and gflop(r.shape) >= 1.0:
                dram.append({"shape": list(r.shape), "floor_us": round(roof["floor_us"], 3),
                             "kernel_share": roofline_share(roof["floor_us"], r.fresh.get("kernel_us")),
                             "torch_share": roofline_share(roof["floor_us"], r.fresh.get("torch_us"))})
        long = [d for d in dram if d["floor_us"] >= LONG_FLOOR_US]
        groups["dram_bound"] = {"shapes": len(dram), "rule": "memory-bound on the roofline and at least 1 GFLOP",
                                "median_kernel_share": median([d["kernel_share"] for d in dram]),
                                "median_torch_share": median([d["torch_share"] for d in dram]),
                                "long_floor": {"rule": f"floor at least {LONG_FLOOR_US:g} us", "shapes": len(long),
                                               "median_kernel_share": median([d["kernel_share"] for d in long]),
                                               "median_torch_share": median([d["torch_share"] for d in long])},
                                "rows": dram}
    wins = dict(Counter(family_of(r.best_name) for r in results if r.best_name is not None))

    def fresh_over_selection(side: str) -> dict:
        return _ratio_stats([r.fresh[side] / r.offline[side] for r in results
                             if r.fresh.get(side) and r.offline.get(side)])

    return {"overall_fresh_geomean_speedup": fresh_speeds(results)["fresh_geomean_speedup"],
            "fresh_by_regime": by_regime, "groups": groups, "wins_by_family": wins,
            "repeat_check": {"torch_fresh_over_selection": fresh_over_selection("torch_us"),
                             "winner_fresh_over_selection": fresh_over_selection("kernel_us")}}


def short_symbol(symbol: str, limit: int = 72) -> str:
    """CUTLASS kernels have mangled names of kilobytes; keep a readable head and a hash that tells them apart."""
    if len(symbol) <= limit:
        return symbol
    return f"{symbol[:limit - 14]}..{hashlib.sha256(symbol.encode()).hexdigest()[:12]}"


def kernel_report(prepared, backend: str | None = None) -> dict:
    """Per compiled kernel (search/pipeline.py's Prepared items): its IR and the backend it was lowered with (its
    family's, else `backend`, the run's forced one; None: the registry's default), registers and spills (ptxas), and
    from the SASS the matrix instructions (HGMMA on the wgmma path, HMMA on mma.sync) and local-memory loads/stores
    (spills)."""
    from l2ir.backends.sass import inspect

    report = {}
    for p in prepared:
        a = p.artifact
        if a is None or a.key == "uncompiled":
            continue                    # never lowered, or a report rebuilt without compiling: nothing was built
        entry = {"config": p.candidate.name, "kernel": p.candidate.kernel.text(), "backend": p.candidate.backend or backend,
                 "compiled": a.ok,
                 "compile_seconds": round(a.compile_seconds, 1), "from_cache": bool(getattr(a, "cached", False))}
        if a.ok:
            entry["functions"] = {short_symbol(fn): {"registers": r.registers, "spill_stores": r.spill_stores,
                                                     "spill_loads": r.spill_loads, "stack_frame": r.stack_frame}
                                  for fn, r in a.resources.items() if r.entry}
            entry["sass"] = inspect(a.binary)
        report[p.kernel_hash[:12]] = entry
    return report


CSV_COLUMNS = ["M", "N", "K", "gflop", "candidates", "passed_all_gates", "best_config", "best_kernel",
               "offline_kernel_us", "offline_torch_us", "offline_speedup", "offline_kernel_spread",
               "offline_torch_spread", "server_kernel_us", "server_torch_us", "server_speedup", "server_kernel_spread",
               "server_torch_spread", "gpu", "driver", "cuda", "torch", "date"]


def write_csv(path: Path, results: list[ShapeResult], env: dict) -> None:
    date = dt.date.today().isoformat()
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for r in results:
            o, s = r.offline, r.server
            w.writerow([*r.shape, round(gflop(r.shape), 3), r.candidates, r.passed,
                        r.best_name, r.best_hash, o.get("kernel_us"), o.get("torch_us"), o.get("speedup"),
                        o.get("kernel_spread"), o.get("torch_spread"), s.get("kernel_us"), s.get("torch_us"),
                        s.get("speedup"), s.get("kernel_spread"), s.get("torch_spread"), env.get("gpu"),
                        env.get("driver"), env.get("cuda_runtime"), env.get("torch"), date])


def fmt_us(x) -> str:
    return f"{x:9.2f}" if isinstance(x, (int, float)) else "        -"


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"l2ir bench ({summary['target']}): {summary['shapes_done']}/{summary['shapes_planned']} shapes")
    for col in ("M", "N", "K", "best", "offline us", "torch us", "speedup", "server x"):
        t.add_column(col, justify="right")
    for r in summary["shapes"]:
        o, s = r["offline"], r["server"]
        t.add_row(*map(str, r["shape"]), str(r["best_name"]), fmt_us(o.get("kernel_us")), fmt_us(o.get("torch_us")),
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
