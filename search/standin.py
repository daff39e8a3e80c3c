"""A deterministic STAND-IN for the GPU evaluator: a cost model, not a measurement.

It lets the whole search loop (proposals, legalizing, dedupe, budgets, acceptance, re-timing, records, resume) run
and be tested on a machine without a GPU. Its numbers come from a small model of an H200-like part (tiles, waves,
pipeline stages, split-K reduction, memory traffic, launch latency) with multiplicative noise drawn from a seed,
so the same seed, kernel, problem and scenarios always give the same samples. Every Measurement it returns carries
the environment STANDIN_ENV, which the records DB keeps apart from every real GPU: stand-in numbers never rank
against measured ones, and `l2ir tune --standin` labels its output as not measured.

It has the evaluator's interface (`config.scenarios`, `environment`, `evaluate(kernel, problem, plan, artifact,
time_kernel=True, skip_gates=())`) and reports the GPU time a real evaluation would have cost (`last_cost_s`), so
budgets behave as on the GPU. It reports the evaluator's gates (search/gates.py), all passing except for a few
kernels (chosen by their hash) that fail the ragged-shapes gate, so the loop's failure paths run.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from l2ir.analysis import block_reduce, cluster_reduce, multicast, output_tiles
from l2ir.indexing import Repack, ceil_div
from l2ir.nodes import Kernel, Problem
from l2ir.target import H200_SMS
from l2ir.text import print_problem

from .evaluator import Measurement
from .gates import GATES, TIMING_GATES, Verdict
from .timing import summarize

STANDIN_ENV = {"gpu": "stand-in cost model (not measured)", "capability": "9.0", "sms": H200_SMS,
               "sm_clock_max_mhz": None, "mem_clock_mhz": None, "driver": None, "cuda_runtime": None,
               "torch": None, "cutlass": None, "standin": True}


SMS = H200_SMS
PEAK_TFLOPS = 989.0          # dense fp16 tensor-core peak of an H100/H200 SXM
HBM_TBPS = 4.8
LAUNCH_US = 2.5


@dataclass(frozen=True)
class StandinConfig:
    scenarios: tuple[str, ...] = ("offline",)
    seed: int = 0
    noise: float = 0.03           # relative sigma of one timing sample
    offline_samples: int = 7
    server_samples: int = 15
    fail_one_in: int = 13         # kernels whose hash is 0 mod this fail the ragged-shapes gate
    # Relative sigma of one evaluation's offset, shared by all its samples (a GPU's clocks, L2 state and placement
    # move a whole trial, so a median does not average it out). Above 0 every evaluation of a kernel on a problem
    # draws afresh (the n-th one from its own seed), as on a GPU; 0 gives every evaluation the same samples.
    eval_noise: float = 0.0


def _efficiency(kernel: Kernel) -> float:
    """The fraction of the per-SM peak a kernel's main loop reaches, by instruction, tile and pipeline."""
    t, p = kernel.tile, kernel.pipeline
    wgmma = kernel.mma is not None and kernel.mma.op == "wgmma"
    eff = 0.80 if wgmma else 0.42
    area = t.bm * t.bn
    eff *= min(1.0, 0.55 + 0.45 * area / (128 * 256))      # small tiles re-read operands more per MMA
    stages = p.stages if isinstance(p.stages, int) else 4
    eff *= {1: 0.6, 2: 0.82, 3: 0.94}.get(stages, 1.0)
    if wgmma and p.schedule == "pingpong":
        eff *= 1.04                                          # one tile's epilogue hides under the other's loop
    if t.bk == 32 and wgmma:
        eff *= 0.9
    # Loads narrower than 16 bytes (pad.align < 8) issue more instructions and, realigned, more shared traffic. With
    # the interleave node only A is realigned and B streams in whole 16-byte copies: 1.4-1.7x the realigning kernel
    # at M <= 64 on an H200 (bench/results/interleave_h200.json).
    eff *= 0.5 if kernel.interleave is not None else {1: 0.35, 2: 0.55, 4: 0.8}.get(kernel.pad.align, 1.0)
    return eff


def kernel_time_us(kernel: Kernel, problem: Problem, sms: int = SMS) -> float:
    """The model's device time of one call."""
    m, n, k = problem.shape
    if kernel.is_source:
        return LAUNCH_US + 2.0 * m * n * k / (PEAK_TFLOPS * 1e6 * 0.05)
    t = kernel.tile
    grid = {"tiles_m": ceil_div(m, t.bm), "tiles_n": ceil_div(n, t.bn)}
    tiles = output_tiles(kernel, problem)
    # A multicast cluster's grid is whole clusters: a block past the tile grid still runs the K loop to load its
    # share for the others, so it takes an SM for a whole tile's time (l2ir.indexing.ClusterMulticast). Multicast
    # saves L2-to-SM reads, not DRAM bytes (L2 already serves the re-reads), so the traffic below is unchanged:
    # offline, multicast lost on every skinny shape measured (bench/NOTES.md).
    mc = multicast(kernel)
    blocks = tiles if mc is None else mc.blocks().eval(grid)
    sk = kernel.splitk
    slices = sk.slices if (sk is not None and sk.mode == "split_k") else 1
    k_per = ceil_div(ceil_div(k, t.bk), slices) * t.bk
    in_block = block_reduce(kernel)
    if in_block:
        # reduce=block: the slices are one block's two consumer warpgroups, so the grid is the tiles; the two halve
        # the tile's MMA time (k_per), not the bytes it loads (the memory term below; on the H200 the loads were
        # the limit: bench/NOTES.md, the block split); the partials meet in shared memory.
        slices = 1
    per_sm = PEAK_TFLOPS * 1e6 / sms * _efficiency(kernel)           # FLOP per microsecond per SM
    tile_us = 2.0 * t.bm * t.bn * k_per / per_sm + 0.4
    work = blocks * slices
    stream_k = sk is not None and sk.mode == "stream_k"
    # stream-K: every SM gets the same share of all tiles' k iterations, so fewer tiles than SMs still fill the
    # machine (a fractional wave); a tile that spans SMs is finished by a fixup through the workspace.
    split_tiles = stream_k and tiles % sms != 0
    if stream_k:
        iters = ceil_div(k, t.bk)
        compute = ceil_div(tiles * iters, sms) / iters * (tile_us - 0.4) * 1.06 + 0.4
    else:
        compute = math.ceil(work / sms) * tile_us
    traffic = 2.0 * (m * k * ceil_div(n, t.bn) ** 0.5 + k * n * ceil_div(m, t.bm) ** 0.5 + m * n)
    in_cluster = cluster_reduce(kernel)
    if slices > 1 and not in_cluster:
        traffic += 2 * 4.0 * m * n * slices                          # fp32 partials written and read back
    if split_tiles:
        traffic += 2 * 4.0 * min(sms, tiles * iters) * t.bm * t.bn   # each SM's partial tile written and read back
    memory = traffic / (HBM_TBPS * 1e6)
    # A workspace reduction pays fences and dependent L2 round trips; a cluster's partials stay on chip (pushed into
    # the owners' shared memory, one mbarrier wait; not refit since the push, which ran 0.4-0.6 us faster on the H200).
    reduce_us = 0.2 if in_block else 1.5 if split_tiles else 0.0 if slices == 1 else (0.5 if in_cluster else 1.5)
    # repack: a second kernel reads the operands it copies and writes their aligned copies (l2ir.indexing.Repack).
    repack_us = 0.0
    if kernel.repack is not None:
        copy = Repack(kernel.repack.operands, problem.a[1], problem.b[1]).end.eval({"m": m, "n": n, "k": k}) * 2
        repack_us = 1.0 + 2.0 * copy / (HBM_TBPS * 1e6) if copy else 0.0
    return LAUNCH_US + max(compute, memory) + reduce_us + repack_us


def baseline_time_us(problem: Problem) -> float:
    """torch.matmul in the model: cuBLAS's heuristic picks the best of a few tiles for the shape (wave quantization
    and tile efficiency) at a fixed efficiency, plus a longer host-side setup that only small problems notice."""
    m, n, k = problem.shape
    flops = 2.0 * m * n * k
    best = math.inf
    for bm, bn, eff in ((128, 256, 0.76), (128, 128, 0.70), (64, 128, 0.55), (64, 64, 0.40)):
        tiles = ceil_div(m, bm) * ceil_div(n, bn)
        waves = max(1, math.ceil(tiles / SMS))
        fill = tiles / (waves * SMS)
        best = min(best, flops / (PEAK_TFLOPS * 1e6 * eff * fill))
    memory = 2.0 * (m * k + k * n + m * n) / (HBM_TBPS * 1e6)
    return LAUNCH_US + 3.0 + max(best, memory)


def _seed_of(*parts) -> list[int]:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


class StandinEvaluator:
    """The evaluator's interface over the cost model. NOT a measurement: see the module docstring."""

    measured = False

    def __init__(self, config: StandinConfig = StandinConfig()):
        self.config = config
        self.environment = dict(STANDIN_ENV)
        self.last_cost_s = 0.0
        self.calls = 0
        self._evaluations: dict[tuple[str, str], int] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass

    def evaluate(self, kernel: Kernel, problem: Problem, plan=None, artifact=None, time_kernel: bool = True,
                 skip_gates: tuple[str, ...] = ()) -> list[Measurement]:
        self.calls += 1
        cfg = self.config
        h = kernel.content_hash()
        ptext = print_problem(problem)
        scenarios = cfg.scenarios if time_kernel and cfg.scenarios else ("gates",)
        verdicts = []
        failing = int(h[:8], 16) % cfg.fail_one_in == 0
        for g in GATES:
            if g in skip_gates:
                continue
            bad = failing and g == "ragged_shapes"
            verdicts.append(Verdict(g, not bad, "stand-in: planted failure (m=100 n=100 k=72 wrong)" if bad
                                    else "stand-in: not run on a GPU"))
        m, n, k = problem.shape
        gate_cost = 0.02 * len(verdicts) + 2e-9 * m * n * k / 1e3
        self.last_cost_s = gate_cost
        base = dict(kernel_hash=h, problem=ptext, environment=dict(self.environment), verdicts=list(verdicts),
                    artifact_key="standin", compile_seconds=0.0, baseline="torch.matmul (stand-in model)")
        out = []
        timed = time_kernel and all(v.passed for v in verdicts)
        nth = self._evaluations.get((h, ptext), 0)
        self._evaluations[(h, ptext)] = nth + 1
        fresh = (nth,) if cfg.eval_noise > 0 else ()
        for s in scenarios:
            if not timed or s == "gates":
                out.append(Measurement(scenario=s, **base))
                continue
            rng = np.random.default_rng(_seed_of(cfg.seed, h, ptext, s, ",".join(scenarios), *fresh))
            count = cfg.offline_samples if s == "offline" else cfg.server_samples
            kt, bt = kernel_time_us(kernel, problem), baseline_time_us(problem)
            if cfg.eval_noise > 0:
                kt *= math.exp(rng.normal(0, cfg.eval_noise))
            if s == "server":
                kt, bt = kt * 1.08 + 4.0, bt * 1.06 + 4.0             # cold L2 and a launch from idle
            ks = list(kt * np.exp(rng.normal(0, cfg.noise, count)))
            bs = list(bt * np.exp(rng.normal(0, cfg.noise, count)))
            kstat, bstat = summarize(ks), summarize(bs)
            # A real offline trial replays ~10 ms per side; a server sample is one call after a flush.
            self.last_cost_s += count * (0.02 if s == "offline" else 0.004)
            timed_verdicts = [Verdict(g, True, "stand-in: not run on a GPU") for g in TIMING_GATES]
            out.append(Measurement(scenario=s, kernel_us=ks, baseline_us=bs, kernel_stats=kstat,
                                   baseline_stats=bstat, kernel_median_us=kstat["median"],
                                   baseline_median_us=bstat["median"], speedup=bstat["median"] / kstat["median"],
                                   **(base | {"verdicts": list(verdicts) + timed_verdicts})))
        return out
