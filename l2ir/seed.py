"""The rule-based seed generator: a legal, sensible kernel for any problem and target.

Like a library heuristic it picks the tile by shape regime, then the pipeline depth the shared memory allows, and
split-K / stream-K only when there are too few output tiles to fill the GPU. The search starts from here.
"""

from __future__ import annotations

from .nodes import (ARCHS, Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile)
from .verify import check_problem, leading_dims, verify_problem

H200_SMS = 132


def alignment(problem: Problem) -> int:
    """The widest vector (elements, at most 16 bytes) that every leading dimension is a multiple of."""
    for align in (8, 4, 2, 1):
        if all(size % align == 0 for _, size in leading_dims(problem).values()):
            return align
    return 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(problem: Problem, bm: int, bn: int, bk: int, num_sms: int) -> int:
    """Split K when the output tiles fill less than half the SMs and K is long enough to share."""
    tiles = _cdiv(problem.m, bm) * _cdiv(problem.n, bn)
    k_tiles = _cdiv(problem.k, bk)
    if tiles * 2 > num_sms or k_tiles < 8:
        return 1
    return max(1, min(8, k_tiles // 4, _cdiv(num_sms, tiles)))


def _raster(problem: Problem, bm: int, bn: int, group: int) -> Swizzle:
    """Walk the longer output dimension in strips of `group` tiles so concurrent blocks share A/B tiles in L2."""
    tiles_m, tiles_n = _cdiv(problem.m, bm), _cdiv(problem.n, bn)
    if tiles_m * tiles_n <= group * group:
        return Swizzle(raster="along_n", group=1)
    return Swizzle(raster="along_n" if tiles_n >= tiles_m else "along_m", group=group)


def seed_sm80(problem: Problem, arch: str = "sm80", num_sms: int = H200_SMS) -> Kernel:
    """mma.sync + ldmatrix + cp.async multistage: 128x256 for big outputs, 128x128 mid, 64x64 for thin ones."""
    align = alignment(problem)
    m, n = problem.m, problem.n
    if m <= 64 or n <= 64:
        block, warps, stages = (64, 64, 32), (2, 2), 3
    elif m >= 2048 and n >= 2048:
        block, warps, stages = (128, 256, 32), (2, 4), 3
    else:
        block, warps, stages = (128, 128, 32), (2, 2), 4
    bm, bn, bk = block
    slices = _split(problem, bm, bn, bk, num_sms)
    raster = _raster(problem, bm, bn, 8)
    kernel = Kernel(
        target=Target(arch),
        tile=Tile(block=block, warps=warps),
        mma=Mma("mma_sync", (16, 8, 16)),
        # Register prefetch overlaps the next k-step's ldmatrix with this step's MMAs.
        pipeline=Pipeline("multistage", stages, prefetch=True),
        # BK=32 halves: a 64-byte row holds four 16-byte chunks, so a 2-bit XOR (<2,3,3>) spreads ldmatrix rows
        # over all banks.
        swizzle=Swizzle(smem=(2, 3, 3), raster=raster.raster, group=raster.group),
        pad=Pad("predicate", "predicate", "zero_fill", align),
        splitk=SplitK("split_k", slices) if slices > 1 else None,
        epilogue=Epilogue("smem", min(8, align)),
    )
    return check_problem(kernel, problem)


def seed_sm90a(problem: Problem, num_sms: int = H200_SMS) -> Kernel:
    """TMA + wgmma warp-specialized: cooperative 128x256 (cluster 2x1) for big outputs, 128x128 mid, ping-pong 64x256
    for thin M; stream-K when the tiles cannot fill the GPU."""
    m, n = problem.m, problem.n
    if m <= 64:
        block, warps, schedule, cluster = (64, 256, 64), (4, 1), "pingpong", (1, 1)
    elif m >= 2048 and n >= 2048:
        block, warps, schedule, cluster = (128, 256, 64), (8, 1), "cooperative", (2, 1)
    else:
        block, warps, schedule, cluster = (128, 128, 64), (8, 1), "cooperative", (1, 1)
    bm, bn, bk = block
    stream = _split(problem, bm, bn, bk, num_sms) > 1
    raster = _raster(problem, bm, bn, 8)
    kernel = Kernel(
        target=Target("sm90a"),
        tile=Tile(block=block, warps=warps, cluster=cluster),
        mma=Mma("wgmma", (64, bn, 16)),
        pipeline=Pipeline("tma_ws", "auto", schedule=schedule, persistent=True),
        # 128-byte rows (BK=64 halves) take TMA's 128-byte swizzle: conflict-free wgmma operand reads.
        swizzle=Swizzle(smem=(3, 3, 3), raster=raster.raster, group=raster.group),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
        splitk=SplitK("stream_k") if stream else None,
        epilogue=Epilogue("tma", 8),
    )
    return check_problem(kernel, problem)


def seed(problem: Problem, arch: str, num_sms: int = H200_SMS) -> Kernel:
    """A legal kernel for `problem` on `arch`. TMA needs 16-byte aligned rows; other problems get the sm80 path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown target '{arch}' (targets: {', '.join(ARCHS)})")
    verify_problem(problem)
    if arch == "sm90a" and alignment(problem) == 8:
        return seed_sm90a(problem, num_sms)
    return seed_sm80(problem, arch, num_sms)
