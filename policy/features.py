"""Numeric features of a problem and of a kernel on it, for learned policies and cost models.

Problem: log sizes, FLOPs, aspect ratios, divisibility by the common tiles, and how many 128x128 tiles it makes
per SM. Kernel: tile, stages, schedule, split-K, cluster, repack, interleave, epilogue, padding, backend, and what the
tile does to this problem (waves, last-wave fill, wasted edge area, K tiles). All are scaled to roughly [-1, 1].

Every feature has a name (`STATE_FEATURES`, in vector order). A saved learned policy records the names it was trained
on, so a version that adds a feature still loads it (policy.learned: the new input starts with zero weights).
"""

from __future__ import annotations

import math

import numpy as np

from l2ir.analysis import block_reduce, cluster_reduce, output_tiles
from l2ir.indexing import ceil_div
from l2ir.nodes import Kernel, Problem
from l2ir.verify import resolved_stages

BACKEND_NAMES = ("cutlass_sm90", "cuda_ptx", "cute_sm80", "cuda_ptx_sm80")


def _l2(x: float) -> float:
    return math.log2(max(x, 1e-9))


def problem_features(p: Problem, num_sms: int) -> list[float]:
    m, n, k = p.shape
    tiles = ceil_div(m, 128) * ceil_div(n, 128)
    return [
        _l2(m) / 14, _l2(n) / 14, _l2(k) / 14, (_l2(p.flops) - 30) / 15,
        _l2(m / n) / 8, _l2(k / math.sqrt(m * n)) / 8,
        float(m % 128 == 0), float(n % 128 == 0), float(k % 64 == 0),
        float(m % 8 == 0 and n % 8 == 0 and k % 8 == 0),
        _l2(tiles / num_sms) / 8,
    ]


def kernel_features(kern: Kernel, p: Problem, num_sms: int, backend: str | None = None) -> list[float]:
    if kern.is_source:
        return [0.0] * KERNEL_DIM
    bm, bn, bk = kern.tile.block
    pipe, sk, epi, pad = kern.pipeline, kern.splitk, kern.epilogue, kern.pad
    sw = kern.swizzle
    tiles = output_tiles(kern, p)
    slices = 1 if sk is None else (sk.slices if sk.mode == "split_k" else max(1, num_sms // max(tiles, 1)))
    units = tiles if block_reduce(kern) else tiles * slices     # reduce=block: the slices share one block
    waves = ceil_div(units, num_sms)
    return [
        _l2(bm) / 8, _l2(bn) / 8, _l2(bk) / 8, min(resolved_stages(kern), 16) / 8,
        float(pipe.mode == "tma_ws"), float(pipe.schedule == "cooperative"), float(pipe.schedule == "pingpong"),
        float(pipe.persistent), float(pipe.prefetch),
        float(sk is None), float(sk is not None and sk.mode == "split_k"), float(sk is not None and sk.mode == "stream_k"),
        _l2(slices) / 4, float(cluster_reduce(kern)), float(kern.repack is not None), float(kern.interleave is not None),
        _l2(kern.tile.cluster[0]), _l2(kern.tile.cluster[1]),
        float(epi.path == "direct"), float(epi.path == "smem"), float(epi.path == "tma"), epi.vector / 8,
        sum(getattr(pad, d) == "divisible" for d in "mnk") / 3, sum(getattr(pad, d) == "predicate" for d in "mnk") / 3,
        pad.align / 8,
        float(sw is not None and sw.raster == "along_m"), _l2(sw.group if sw else 1) / 4,
        float(sw is not None and sw.smem is not None),
        *[float(backend == b) for b in BACKEND_NAMES],
        _l2(units / num_sms) / 8, units / (waves * num_sms), p.m * p.n / (tiles * bm * bn),
        _l2(ceil_div(p.k, bk * slices)) / 10,
    ]


PROBLEM_FEATURES = ("log_m", "log_n", "log_k", "log_flops", "log_m_over_n", "log_k_over_mn", "m_by_128", "n_by_128",
                    "k_by_64", "aligned_8", "log_tiles_per_sm")
KERNEL_FEATURES = ("log_bm", "log_bn", "log_bk", "stages", "tma", "cooperative", "pingpong", "persistent", "prefetch",
                   "no_split", "split_k", "stream_k", "log_slices", "cluster_reduce", "repack", "interleave",
                   "log_cluster_m", "log_cluster_n", "epilogue_direct", "epilogue_smem", "epilogue_tma",
                   "epilogue_vector", "pad_divisible", "pad_predicate", "align",
                   "raster_along_m", "log_group", "smem_swizzle", *(f"backend_{b}" for b in BACKEND_NAMES),
                   "log_units_per_sm", "last_wave_fill", "edge_fill", "log_k_tiles")
PARENT_FEATURES = ("measured", "log_speedup")
KERNEL_DIM = len(KERNEL_FEATURES)
PROBLEM_DIM = len(PROBLEM_FEATURES)


def state_features(p: Problem, kern: Kernel, num_sms: int, backend: str | None,
                   parent_reward: float | None) -> np.ndarray:
    """The policy's input: problem, kernel, and the parent's measured log speedup (0 with a flag when unknown)."""
    extra = [0.0, 0.0] if parent_reward is None else [1.0, max(-2.0, min(2.0, parent_reward))]
    v = problem_features(p, num_sms) + kernel_features(kern, p, num_sms, backend) + extra
    return np.asarray(v, dtype=np.float32)


STATE_FEATURES = (*(f"problem.{n}" for n in PROBLEM_FEATURES), *(f"kernel.{n}" for n in KERNEL_FEATURES),
                  *(f"parent.{n}" for n in PARENT_FEATURES))
STATE_DIM = len(STATE_FEATURES)


def _without(*names: str) -> tuple[str, ...]:
    return tuple(f for f in STATE_FEATURES if f not in names)


# States saved before the features had names (no "features" in the state) were trained on the features of their
# day, in this order, told apart by their count: the cluster reduction came at 46 -> 47, the repack node at
# 47 -> 48, the interleave node at 48 -> 49.
UNNAMED_FEATURES = {46: _without("kernel.cluster_reduce", "kernel.repack", "kernel.interleave"),
                    47: _without("kernel.repack", "kernel.interleave"),
                    48: _without("kernel.interleave")}
