"""The rule-based seed generator: a legal, sensible kernel for any problem and target.

Like a library heuristic it picks the tile by shape regime, then the pipeline depth the shared memory allows, and
split-K / stream-K only when there are too few output tiles to fill the GPU. The search starts from here.
"""

from __future__ import annotations

from .nodes import (ARCHS, Epilogue, Kernel, Mma, Pad, Pipeline, Problem, Repack, SplitK, Swizzle, Target,
                    Tile)
from .indexing import ceil_div, leaves_empty_slice
from .analysis import realigned_ring_bytes
from .target import H200_SMS, MAX_CLUSTER_NONPORTABLE, SMEM_LIMIT
from .verify import applicable, check_problem, leading_dims, verify_problem


def _widest(sizes) -> int:
    """The widest vector (elements, at most 16 bytes of a 16-bit type) that every size is a multiple of."""
    return next(v for v in (8, 4, 2, 1) if all(size % v == 0 for size in sizes))


def alignment(problem: Problem) -> int:
    """pad.align: the widest load vector that the leading dimensions of A and B are multiples of."""
    dims = leading_dims(problem)
    return _widest([dims["A"][1], dims["B"][1]])


def store_vector(problem: Problem) -> int:
    """epilogue.vector: the widest store vector that C's leading dimension is a multiple of, at most pad.align."""
    return min(alignment(problem), _widest([leading_dims(problem)["C"][1]]))


def split_slices(problem: Problem, tiles: int, bk: int, num_sms: int, cap: int, cover: bool = False) -> int:
    """Split-K slices when `tiles` output tiles fill less than half the SMs and K is long enough to share (at least 8
    k tiles of `bk`): as many as bring the blocks to one wave (`cover`: at least one wave, rounding up; else at
    most one), each slice keeping at least 4 k tiles, at most `cap`; 1 when not worth it. Fewer if the partition of
    l2ir.indexing.splitk_range would leave the last slice without a k tile."""
    k_tiles = ceil_div(problem.k, bk)
    if tiles * 2 > num_sms or k_tiles < 8:
        return 1
    waves = ceil_div(num_sms, tiles) if cover else num_sms // tiles
    slices = max(1, min(cap, k_tiles // 4, waves))
    while slices > 1 and leaves_empty_slice(k_tiles, slices):
        slices -= 1
    return slices


def _split(problem: Problem, bm: int, bn: int, bk: int, num_sms: int) -> int:
    """The seeds' split: up to 8 slices, covering at least one wave."""
    return split_slices(problem, ceil_div(problem.m, bm) * ceil_div(problem.n, bn), bk, num_sms, 8, cover=True)


def _raster(problem: Problem, bm: int, bn: int, group: int) -> Swizzle:
    """Walk the longer output dimension in strips of `group` tiles so concurrent blocks share A/B tiles in L2."""
    tiles_m, tiles_n = ceil_div(problem.m, bm), ceil_div(problem.n, bn)
    if tiles_m * tiles_n <= group * group:
        return Swizzle(raster="along_n", group=1)
    return Swizzle(raster="along_n" if tiles_n >= tiles_m else "along_m", group=group)


def seed_sm80(problem: Problem, arch: str = "sm80", num_sms: int = H200_SMS) -> Kernel:
    """mma.sync + ldmatrix + cp.async multistage. Tiles by regime, from the H200 sweep (bench/NOTES.md): 128x128x64
    with the 128-byte swizzle for large outputs, 64x128x32 when one side is thin, 64x64x32 for tiny ones."""
    align = alignment(problem)
    m, n = problem.m, problem.n
    if m <= 64 and n <= 64:
        block, warps, stages, smem = (64, 64, 32), (2, 2), 3, (2, 3, 3)
    elif min(m, n) <= 512:
        block, warps, stages, smem = (64, 128, 32), (2, 2), 4, (2, 3, 3)
    else:
        # BK=64 halves = 128-byte rows: <3,3,3> XORs 3 row bits into the 8 16-byte chunks of a row.
        block, warps, stages, smem = (128, 128, 64), (2, 2), 3, (3, 3, 3)
    bm, bn, bk = block
    # pad.align=1 stages raw rows beside the realigned tiles (l2ir.analysis.realigned_ring_bytes): fewer stages
    # where the ring would not fit the arch's shared memory.
    while align == 1 and stages > 1 and realigned_ring_bytes(bm, bn, bk, stages) > SMEM_LIMIT[arch]:
        stages -= 1
    slices = _split(problem, bm, bn, bk, num_sms)
    raster = _raster(problem, bm, bn, 8)
    kernel = Kernel(
        target=Target(arch),
        tile=Tile(block=block, warps=warps),
        mma=Mma("mma_sync", (16, 8, 16)),
        # Register prefetch overlaps the next k-step's ldmatrix with this step's MMAs.
        pipeline=Pipeline("multistage", stages, prefetch=True),
        swizzle=Swizzle(smem=smem, raster=raster.raster, group=raster.group),
        pad=Pad("predicate", "predicate", "zero_fill", align),
        splitk=SplitK("split_k", slices) if slices > 1 else None,
        epilogue=Epilogue("smem", store_vector(problem)),
    )
    return check_problem(kernel, problem)


def split_tile_kernel(block: tuple[int, int, int], schedule: str, splitk: SplitK) -> Kernel:
    """One output tile per block on the cuda_ptx sm90a rule, its K loop split in the kernel (a cluster's blocks or
    the block's two consumer warpgroups): a TMA ring that fills shared memory, the 128-byte swizzle, zero-filled
    edges, and each block or warpgroup storing its share of the tile straight from registers."""
    return Kernel(
        target=Target("sm90a"),
        tile=Tile(block=block, warps=(8, 1) if schedule == "cooperative" else (4, 1)),
        mma=Mma("wgmma", (64, block[1], 16)),
        pipeline=Pipeline("tma_ws", "auto", schedule=schedule, persistent=False),
        swizzle=Swizzle(smem=(3, 3, 3)),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
        splitk=splitk,
        epilogue=Epilogue("direct", 2),
    )


# Rows of A for which the cooperative 128x64 cluster split was measured to win (100, 127 and 128): at most one row
# of 128-row tiles, more than half of each one real.
COOP_SPLIT_M = (64, 128)


def coop_split_kernel(problem: Problem, num_sms: int = H200_SMS) -> Kernel | None:
    """Split-K 2 in a thread-block cluster on cooperative 128x64 tiles (lowered by cuda_ptx), for 64 < M <= 128 with
    a long K: one row of 128-row tiles reads B once, two consumer warpgroups share each tile, and the two slices
    halve every block's K loop while the blocks stay one wave. On the H200 it ran 127x4096x4096 in 13.8 us against
    16.4 us for the best 64x64 or 128x128 tile and 23.2 us for the stream-K seed, 128x4096x16384 in 44 us against
    51, 100x3000x4104 in 18.7 us against 25.8 (bench/results/cublas_tiles_h200.json). None outside that M, when the
    blocks would not fit one wave or would fill less than half the SMs, or when K is too short to split. Two
    slices only: four were measured only at two waves (256 blocks), where they lost."""
    if not COOP_SPLIT_M[0] < problem.m <= COOP_SPLIT_M[1]:
        return None
    tiles = ceil_div(problem.m, 128) * ceil_div(problem.n, 64)
    slices = split_slices(problem, tiles, 64, num_sms, 2)    # 1 unless one wave of 2 slices and K allows
    if slices < 2 or 4 * tiles < num_sms:
        return None
    return split_tile_kernel((128, 64, 64), "cooperative", SplitK("split_k", slices, "cluster"))


# Rows of A up to which the 64x64 cluster split is the sm90a seed: one row of 64-row tiles (decode and skinny M).
CLUSTER_SPLIT_MAX_M = 64


def cluster_split_kernel(problem: Problem, num_sms: int = H200_SMS) -> Kernel | None:
    """Split-K reduced inside a thread-block cluster (cuda_ptx, sm90a): one consumer warpgroup per 64x64 tile and
    slice, as many slices (at least 4 k tiles each) as bring the blocks near one wave, rounded down to a power of two:
    a cluster's blocks must share one GPC (16-18 SMs on an H200), and 2, 4, 8 or 16 of them pack a GPC with no SMs
    left over. None when the tiles alone fill the SMs or K is short. Against the stream-K seed it replaces for
    M <= 64 (bench/results/unaligned_v4_h200.json, families_small_v3_h200.json, splitk_cluster_h200.json):
    1x4096x4096 15.8 us against 27.5, 64x2048x8192 18.2 (4 slices) against 31.4, 64x256x2048 4.6-5.0 against 15.8."""
    tiles = ceil_div(problem.m, 64) * ceil_div(problem.n, 64)
    slices = min(split_slices(problem, tiles, 64, num_sms, 16), MAX_CLUSTER_NONPORTABLE)
    k_tiles = ceil_div(problem.k, 64)
    while slices > 1 and (slices & (slices - 1) or leaves_empty_slice(k_tiles, slices)):
        slices -= 1              # the next lower power of two that leaves no slice empty
    if slices < 2:
        return None
    return split_tile_kernel((64, 64, 64), "pingpong", SplitK("split_k", slices, "cluster"))


def seed_sm90a(problem: Problem, num_sms: int = H200_SMS) -> Kernel:
    """TMA + wgmma warp-specialized. Ping-pong won 40 of 41 Hopper shapes in the H200 sweep (bench/NOTES.md): its two
    consumer warpgroups alternate tiles, so one tile's epilogue hides under the other's main loop. Thin M takes
    64x256 tiles; when the tiles cannot fill the GPU and K is long, cooperative 128x128 with stream-K (the ping-pong
    kernel has no stream-K scheduler), except in the raw-PTX problem class, where M <= 64 takes the 64x64 cluster
    split (cluster_split_kernel) and 64 < M <= 128 the cooperative 128x64 cluster split (coop_split_kernel) where
    they apply."""
    if cuda_ptx_lowered(problem):
        split = (cluster_split_kernel(problem, num_sms) if problem.m <= CLUSTER_SPLIT_MAX_M else
                 coop_split_kernel(problem, num_sms))
        if split is not None and applicable(split, problem):
            return split
    m = problem.m
    if _split(problem, 128, 128, 64, num_sms) > 1:
        block, warps, schedule, splitk = (128, 128, 64), (8, 1), "cooperative", SplitK("stream_k")
    elif m <= 64:
        block, warps, schedule, splitk = (64, 256, 64), (4, 1), "pingpong", None
    else:
        block, warps, schedule, splitk = (128, 128, 64), (4, 1), "pingpong", None
    bm, bn, bk = block
    raster = _raster(problem, bm, bn, 8)
    kernel = Kernel(
        target=Target("sm90a"),
        tile=Tile(block=block, warps=warps),
        mma=Mma("wgmma", (64, bn // warps[1], 16)),
        pipeline=Pipeline("tma_ws", "auto", schedule=schedule, persistent=True),
        # 128-byte rows (BK=64 halves) take TMA's 128-byte swizzle: conflict-free wgmma operand reads.
        swizzle=Swizzle(smem=(3, 3, 3), raster=raster.raster, group=raster.group),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
        splitk=splitk,
        epilogue=Epilogue("tma", 8),
    )
    return check_problem(kernel, problem)


# Output tiles of 128x128 from which the cooperative 128x128 repack kernel beat one warpgroup per 64x64 tile on
# the H200 (1023x1025x1027, 72 tiles: 20.4 vs 26.1 us; 512x512x4097, 16 tiles: 38.3 vs 25.3 us).
REPACK_MID_TILES = 48
# Below this many rows of A the copy of B costs more than the GEMM's own pass over it (17x9999x3333: 93 us
# against the sm80 path's 61).
REPACK_MIN_M = 64
# The repack kernels' tiles, largest first: cooperative 128x256 and 128x128 (two consumer warpgroups, persistent),
# and one warpgroup per 64x64 tile with a block per tile.
REPACK_TILES = ((128, 256, 64), (128, 128, 64), (64, 64, 64))


def repack_kernel(problem: Problem, block: tuple[int, int, int]) -> Kernel:
    """TMA + wgmma on copies of A and B with aligned rows (the repack node), for an odd K on Hopper."""
    bm, bn, bk = block
    coop = bm >= 128
    raster = _raster(problem, bm, bn, 8)
    c_vector = _widest([leading_dims(problem)["C"][1]])
    return Kernel(
        target=Target("sm90a"),
        tile=Tile(block=block, warps=(8, 1) if coop else (4, 1)),
        mma=Mma("wgmma", (64, bn, 16)),
        pipeline=Pipeline("tma_ws", "auto", schedule="cooperative" if coop else "pingpong", persistent=coop),
        swizzle=Swizzle(smem=(3, 3, 3), raster=raster.raster, group=raster.group),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
        repack=Repack("ab"),
        # Staged 16-byte stores where C's rows allow them; else the accumulator's own pairs or single elements.
        epilogue=Epilogue("smem", 8) if c_vector == 8 and coop else Epilogue("direct", min(c_vector, 2)),
    )


def repack_tile(problem: Problem, num_sms: int = H200_SMS) -> tuple[int, int, int]:
    """The repack tile for this output: 128x256 once those tiles fill the GPU, 128x128 for mid-size outputs,
    64x64 for small ones (bench/results/repack_unaligned_h200.json)."""
    m, n = problem.m, problem.n
    if ceil_div(m, 128) * ceil_div(n, 256) >= num_sms:
        return REPACK_TILES[0]
    if ceil_div(m, 128) * ceil_div(n, 128) >= REPACK_MID_TILES:
        return REPACK_TILES[1]
    return REPACK_TILES[2]


def seed_sm90a_repack(problem: Problem, num_sms: int = H200_SMS) -> Kernel:
    """An odd K on Hopper: copy A and B into aligned rows first (the repack node), then TMA + wgmma on the copies.
    The narrow-load sm80 path ran 1.2-20x slower than these on the H200 (bench/results/repack_unaligned_h200.json):
    cooperative 128x256 tiles once they fill the GPU (4096x4096x1001: 4.6x torch.matmul), 128x128 for mid-size
    outputs (1024x1024x999: 2.0x), and one warpgroup per 64x64 tile, a block per tile, for small ones
    (333x555x777: 1.7x)."""
    return check_problem(repack_kernel(problem, repack_tile(problem, num_sms)), problem)


def cuda_ptx_lowered(problem: Problem) -> bool:
    """The problem class the raw-PTX Hopper kernels are generated for (backends/cuda_ptx/sm90a.py: the repack and the
    cluster split-K kernels): K-major A and B, 16-bit inputs and outputs, fp32 accumulation."""
    return (problem.a[1], problem.b[1], problem.acc) == ("row", "col", "f32") and problem.c[0] in ("f16", "bf16")


def seed(problem: Problem, arch: str, num_sms: int = H200_SMS) -> Kernel:
    """A legal kernel for `problem` on `arch`. TMA needs 16-byte aligned rows: an odd K on sm90a gets the repack
    kernels (aligned copies of A and B); other unaligned problems get the sm80 path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown target '{arch}' (targets: {', '.join(ARCHS)})")
    verify_problem(problem)
    # The sm90a seed ends in a TMA store, which needs C's rows 16-byte aligned as well.
    if arch == "sm90a" and store_vector(problem) == 8:
        return seed_sm90a(problem, num_sms)
    # An odd K misaligns every row of A and B: copy them aligned, then run TMA on the copies. Below 64 rows of A
    # the copy of B costs more than the GEMM's own pass over it (17x9999x3333: 93 us against the sm80 path's 61).
    if arch == "sm90a" and alignment(problem) < 8 and problem.m >= REPACK_MIN_M and cuda_ptx_lowered(problem):
        return seed_sm90a_repack(problem, num_sms)
    return seed_sm80(problem, arch, num_sms)
