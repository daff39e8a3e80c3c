"""Expert rules: the heuristics a GEMM library ships, as a ranked list of proposals with the reason for each.

The numbers that decide are the ones a library looks at: output tiles against the SM count (132 on an H100/H200),
how full the last wave is, K tiles per output tile, and the problem's FLOPs.

- tiles by waves: among the Hopper tiles, the one with the best (wave fill x arithmetic intensity); a last wave that
  runs a few blocks while most SMs idle wastes up to a whole wave;
- split-K / stream-K when the tiles cannot fill the SMs and K is long enough to share (small M*N, large K);
- ping-pong when the epilogue is a large share of a tile's time (few K tiles): one warpgroup's epilogue runs under
  the other's main loop; cooperative for long K, where the 2-warpgroup 128xN tile halves the B traffic per FLOP;
- 2x1 clusters for large shapes: TMA multicast shares each B tile between the two blocks of a cluster;
- small tiles for small outputs, so there are enough blocks to occupy the GPU;
- the sm80 rule (cp.async + mma.sync) with few stages for tiny, latency-bound problems: no TMA descriptor
  prefetch, no producer warpgroup, no cluster launch; a short K loop needs no deep ring;
- rasterize along the longer dimension in groups of 8 tiles (L2 reuse of A/B tiles) once there are many tiles, and
  within one wave when a few tile rows face many tile columns (the blocks that read each B tile side by side);
- pad=divisible in each dimension the problem divides (no bounds checks, no OOB fill);
- an odd K on Hopper: copy A and B into aligned rows (the repack node) and run TMA + wgmma on the copies.

Each rule makes a whole candidate kernel; the proposal is its difference from the parent as edits. Candidates the
verifier, the problem or the backend reject, and duplicates, are dropped; the rest keep the rules' priority for this
problem (the rule that addresses its regime first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from l2ir.analysis import output_tiles
from l2ir.indexing import BlockSplit, ceil_div
from l2ir.nodes import Epilogue, Interleave, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile
from l2ir.seed import (COOP_SPLIT_M, REPACK_MIN_M, REPACK_TILES, alignment, cluster_split_kernel, coop_split_kernel,
                       cuda_ptx_lowered, repack_kernel, repack_tile, split_tile_kernel, store_vector)
from l2ir.seed import split_slices as seed_split_slices
from l2ir.target import DTYPE_BYTES, H200_SMS

from .actions import diff_edits, normal_backend
from .base import Context, Dedupe, Proposal, StatelessPolicy, try_legalize

# Below this many FLOPs a GEMM is launch- and latency-bound on an H100/H200 (a few microseconds at any tile).
TINY_FLOPS = 2e8
# A problem whose output is at most this many elements fits in a handful of 128x128 tiles.
SMALL_OUTPUT = 512 * 512
# K tiles (of 64) per output tile below which the epilogue is a large share of a tile's time.
SHORT_K_TILES = 16
# Output tiles per SM above which clusters and rasterization pay.
MANY_WAVES = 2
# Within one wave, grouping pays when at most this many tile rows face at least SKINNY_LONG tile columns.
SKINNY_SHORT, SKINNY_LONG = 8, 16

# 128x64 cooperative is cuBLAS's tile for M = 128-512 with N >= 2048 (bench/results/cublas_kernels_h200.json); with
# programmatic dependent launch it ran 512x2048x4096 at 1.001x on fresh samples, where the 128x128 cluster split-K
# kernel had run 0.84x (bench/results/pdl_tiles_h200.json).
HOPPER_TILES = ((128, 256, "cooperative"), (256, 128, "cooperative"), (128, 128, "cooperative"),
                (128, 64, "cooperative"), (128, 128, "pingpong"), (64, 256, "pingpong"), (64, 128, "pingpong"),
                (64, 64, "pingpong"))


# Four-block clusters of the cooperative split-K kernel (full ring) the H200 holds at once: 30, by
# cudaOccupancyMaxActiveClusters (a cluster's blocks must share one GPC, so fewer than 132 / 4 fit;
# bench/results/cluster_occupancy_h200.json). The timings agree: 27 clusters (128x112 tiles in 4 slices at
# 100x3000x4104) ran in 16.7 us, 32 (128x96) 1.4x slower, in two waves (bench/results/ntile_split_h200.json).
FOUR_BLOCK_CLUSTER_WAVE = 30


def coop_split4_kernel(problem: Problem, sms: int) -> Kernel | None:
    """64 < M <= 128 with a long K: cooperative 128xBN tiles split in 4 in a cluster, BN the narrowest multiple of
    16 whose tiles fit one wave of four-block clusters, between 64 and 128. At 100x3000x4104 that is 128x112 (27
    clusters): 16.7 us against 17.1 for 128x128 and 18.8 for the seed's 128x64 in 2 slices. None outside that M,
    where the tiles need a BN above 128, or where K leaves a slice under 4 k tiles."""
    slices = 4
    if not COOP_SPLIT_M[0] < problem.m <= COOP_SPLIT_M[1] or ceil_div(problem.k, 64) < 4 * slices:
        return None
    clusters = FOUR_BLOCK_CLUSTER_WAVE * sms // H200_SMS
    if clusters < 1:
        return None              # a GPU (or a slice of one) too small for a wave of four-block clusters
    bn = max(64, 16 * ceil_div(ceil_div(problem.n, clusters), 16))
    if bn > 128:
        return None
    return split_tile_kernel((128, bn, 64), "cooperative", SplitK("split_k", slices, "cluster"))


# A multicast along N: the blocks of a 1xN cluster share one read of their A tile. At 100x3000x4104 CUTLASS's
# ping-pong 64x64, one tile per block, ran 12.9 us in 1x8 clusters (12 of them), 13.8 in 1x4 (24), 18.0 in 1x2 and
# 22.6 without a cluster; at 127x4096x4096 its 32 four-block clusters, more than a wave, ran 19.6 us against the
# seed's 13.4 (bench/results/multicast_np_h200.json, multicast_np_wide_h200.json). The cuda_ptx kernel gains from
# sharing B along M as well (2x4: 15.5 us, 1x4: 19.9) but stays behind CUTLASS's there.
# Resident clusters of a full-ring one-block-per-SM kernel, by size (cudaOccupancyMaxActiveClusters on the H200,
# bench/results/cluster_occupancy_h200.json).
CLUSTER_WAVE = {4: FOUR_BLOCK_CLUSTER_WAVE, 8: 15}


def multicast_kernel(problem: Problem, sms: int, backend: str, cluster: tuple[int, int]) -> Kernel | None:
    """M <= 128 with a long K and many N tiles: ping-pong 64x64 tiles, one per block, in `cluster` (CM x CN; TMA
    multicast of A along N, of B along M when CM > 1), when the clusters fit one wave (CLUSTER_WAVE) and fill at
    least half the SMs. `backend` cutlass_sm90 (TMA store) or cuda_ptx (direct stores). None elsewhere."""
    cm, cn = cluster
    tiles_m = ceil_div(problem.m, 64)
    if problem.m > 128 or ceil_div(problem.k, 64) < SHORT_K_TILES or cm > tiles_m:
        return None
    clusters = ceil_div(tiles_m, cm) * ceil_div(ceil_div(problem.n, 64), cn)
    if not (2 * clusters * cm * cn >= sms and clusters <= CLUSTER_WAVE[cm * cn] * sms // H200_SMS):
        return None
    k = hopper_kernel(problem, 64, 64, "pingpong", cluster=cluster, raster=Swizzle(raster="along_n", group=8))
    k = k.replace(pipeline=dataclasses.replace(k.pipeline, persistent=False))
    return k if backend == "cutlass_sm90" else k.replace(epilogue=Epilogue("direct", 2))


def tiles_of(problem: Problem, bm: int, bn: int) -> int:
    return ceil_div(problem.m, bm) * ceil_div(problem.n, bn)


def wave_fill(tiles: int, sms: int) -> float:
    """Fraction of SM-slots doing work over all waves: 1.0 when the tiles are a multiple of the SMs."""
    return tiles / (ceil_div(tiles, sms) * sms)


def intensity(bm: int, bn: int) -> float:
    """FLOPs per loaded element of a BMxBN tile, relative to 128x256 (the largest a Hopper block holds in
    registers): 2*BM*BN / (BM+BN)."""
    return (2 * bm * bn / (bm + bn)) / (2 * 128 * 256 / (128 + 256))


def split_slices(problem: Problem, tiles: int, bk: int, sms: int) -> int:
    """The rules' split (l2ir.seed.split_slices): up to 16 slices, at most one wave."""
    return seed_split_slices(problem, tiles, bk, sms, 16)


def hopper_kernel(problem: Problem, bm: int, bn: int, schedule: str, cluster=(1, 1), splitk: SplitK | None = None,
                  raster: Swizzle | None = None) -> Kernel:
    warps = (8, 1) if schedule == "cooperative" else (4, 1)
    sw = raster or Swizzle()
    return Kernel(
        target=Target("sm90a"),
        tile=Tile(block=(bm, bn, 64), warps=warps, cluster=cluster),
        mma=Mma("wgmma", (64, bn, 16)),
        pipeline=Pipeline("tma_ws", "auto", schedule=schedule, persistent=True),
        swizzle=Swizzle(smem=(3, 3, 3), raster=sw.raster, group=min(sw.group, 8)),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
        splitk=splitk,
        epilogue=Epilogue("tma", 8),
    )


def sm80_kernel(problem: Problem, block, warps, stages: int, slices: int = 1, raster: Swizzle | None = None,
                epilogue: str = "smem") -> Kernel:
    align = alignment(problem)
    sw = raster or Swizzle()
    bk = block[2]
    return Kernel(
        target=Target("sm80"),
        tile=Tile(block=block, warps=warps),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("multistage", stages, prefetch=True),
        swizzle=Swizzle(smem=(3, 3, 3) if bk >= 64 else (2, 3, 3), raster=sw.raster, group=sw.group),
        pad=Pad("predicate", "predicate", "zero_fill", align),
        splitk=SplitK("split_k", slices) if slices > 1 else None,
        epilogue=Epilogue(epilogue, store_vector(problem)),
    )


# Rows of A up to which an odd K takes the decode kernel with realigned loads (measured at M=17).
DECODE_ROWS = 32


def decode_align_kernel(problem: Problem, arch: str, stages: int = 4, slices: int = 4) -> Kernel:
    """The cuda_ptx_sm80 decode kernel for unaligned rows (search/sweeps/cuda_ptx_sm80/
    ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode.l2, on the problem's target): 32x128 tiles over 8 warps, 4
    stages, split-K 4 reduced in the kernel, direct stores of single elements; or another ring and split."""
    return Kernel(
        target=Target(arch),
        tile=Tile(block=(32, 128, 64), warps=(2, 4)),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("multistage", stages, prefetch=True),
        swizzle=Swizzle(smem=(3, 3, 3)),
        pad=Pad("predicate", "zero_fill", "zero_fill", 1),
        splitk=SplitK("split_k", slices),
        epilogue=Epilogue("direct", 1),
    )


# The decode kernel's 4-stage ring (130 KB) leaves one block per SM, its 3-stage ring (108 KB) two. Where 4 slices
# of the 4-stage kernel need more than one wave, the 3-stage kernel with as many slices as fit two blocks per SM in
# one wave ran faster: 17x9999x3333 47.4 us against 59.9 (3 slices, 237 blocks), 8x11008x4095 54.3 against 71.0
# (258 blocks); at 31x4001x2047 (32 tiles x 4 slices: one wave already) the 4-stage kernel stayed best
# (bench/results/odd_k_decode_h200.json).
DECODE_WAVE_BLOCKS_PER_SM = 2


def decode_one_wave_slices(problem: Problem, sms: int) -> int | None:
    """Split-K slices of the 3-stage decode kernel that fill one wave at two blocks per SM, or None where the 4-stage
    kernel's 4 slices already fit one wave of one block per SM (or fewer than 2 slices would fit)."""
    tiles = tiles_of(problem, 32, 128)
    if tiles * 4 <= sms:
        return None
    slices = min(4, DECODE_WAVE_BLOCKS_PER_SM * sms // tiles)
    return slices if slices >= 2 else None


# Rows of A up to which an odd K takes the interleaved decode kernel: its blocks take columns 8 apart, so B streams
# by whole 16-byte copies and only A is realigned. On an H200 it won 1x11008x4095 to 64x4096x4097 over the realigning
# decode kernel (17x9999x3333 32.9 us against 47.3, 16x8192x4097 30.8 against 50.6); at 100x3000x4103 the seed stayed
# faster (bench/results/interleave_h200.json, interleave_wide_h200.json).
INTERLEAVE_ROWS = 64


def interleave_decode_kernel(problem: Problem, arch: str, slices: int) -> Kernel:
    """The interleaved odd-K decode kernel (search/sweeps/cuda_ptx_sm80/ptx_sm80_32x128x64_w2x4_s4_splitk3_interleave.l2
    on the problem's target): 32x128 tiles of columns 8 apart, 4 stages (90 KB: two blocks per SM), split-K in the
    kernel."""
    return decode_align_kernel(problem, arch, stages=4, slices=slices).replace(interleave=Interleave())


def interleave_slices(problem: Problem, sms: int) -> int:
    """Split-K slices that bring the interleaved kernel's tiles closest to one wave of two blocks per SM (2 to 4):
    3 at 17x9999x3333 (80 tiles) and 8x11008x4095 (88), 4 at 16x8192x4097 and 64x4096x4097 (64) measured best."""
    tiles = output_tiles(interleave_decode_kernel(problem, "sm80", 2), problem)
    return max(2, min(4, DECODE_WAVE_BLOCKS_PER_SM * sms // tiles))


# C-write-bound GEMMs (K of 64-256 and a C much larger than L2): the cuda_ptx cooperative 128x256 tile with the TMA
# store epilogue lets the warps start the next tile while C drains: 8192x4096x128 23.2 us (fresh 1.205x) against 27.2
# with the staged 16-byte stores and 27.1 for CUTLASS's ping-pong; at 12288x12288x64 and 1024x12288x128 it tied or
# trailed them (bench/results/tma_store_h200.json), so it is proposed beside them, not over them.
WRITE_BOUND_MAX_K = 256
WRITE_BOUND_MIN_C_BYTES = 32 << 20


# Rows of A up to which a 16-byte-aligned K takes the direct decode kernel (bench/results/direct_split_h200.json:
# 1x4096x4096 11.08 us and 8x4096x4096 11.55 us against torch's 13.8-13.9, where the best shared-memory kernel ran
# 14.3-14.5; at 4x11008x4096, 344 blocks of 512 threads in 2.6 waves, it ran 0.97x).
DIRECT_DECODE_ROWS = 8


def direct_decode_kernel(problem: Problem, arch: str, deep: bool = False) -> Kernel:
    """The direct decode kernel (search/sweeps/cuda_ptx_direct/direct_8x32x128_w1x4_s2_k4.l2, on the problem's
    target): no shared memory for operands, every lane loads its mma.sync fragments, two k steps of them in
    registers, and 4 groups of 4 warps split the k steps and add up in slice order. deep: four register sets of
    half the k step (direct_8x32x64_w1x4_s4_k4.l2), so three steps stay in flight while one multiplies."""
    return Kernel(
        target=Target(arch),
        tile=Tile(block=(8, 32, 64 if deep else 128), warps=(1, 4)),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("direct", 4 if deep else 2),
        pad=Pad("predicate", "predicate", "zero_fill", 8),
        splitk=SplitK("split_k", 4, "block"),
        epilogue=Epilogue("direct", 2 if problem.n % 2 == 0 else 1),
    )


# reduce=block on 64x32 tiles: where it won (bench/results/families_focus_v5_h200.json: 1024x128x1024, 64 tiles,
# 16 k tiles, 5.17 us, 0.93x; 256x64x128, 8 tiles, 2 k tiles, 0.95x), the tiles were at most one wave and the K
# loop at most 16 k tiles; on longer loops one SM's TMA path limits it and the cluster split wins.
BLOCK_SPLIT_MAX_K_TILES = 16


def block_split_kernel(problem: Problem, sms: int) -> Kernel | None:
    """Split-K inside one block (cuda_ptx, sm90a): the cooperative block's two consumer warpgroups take the two
    halves of a 64x32 tile's K loop from one ring (l2ir.indexing.BlockSplit). None when the tiles exceed one wave,
    the K loop is longer than BLOCK_SPLIT_MAX_K_TILES or a single k tile leaves a warpgroup nothing."""
    k_tiles = ceil_div(problem.k, 64)
    if tiles_of(problem, 64, 32) > sms or not 2 <= k_tiles <= BLOCK_SPLIT_MAX_K_TILES:
        return None
    return split_tile_kernel((64, 32, 64), "cooperative", SplitK("split_k", BlockSplit.SLICES, "block"))


def raster_for(problem: Problem, bm: int, bn: int, sms: int) -> Swizzle:
    """Walk the longer output dimension in groups of 8 tiles once there are many tiles (concurrent blocks share A/B
    tiles in L2). Within one wave only where a few tile rows face many tile columns: group 1 puts the blocks that
    read each B tile a whole row of tiles apart, group 8 side by side, so the second read meets the first in L2
    (cuda_ptx 64x64 on the H200: 127x4096x4096, 2 x 64 tiles, 17.9 -> 14.2 us; 128x4096x16384 54.5 -> 52.3;
    512x2048x4096, 8 x 32, 27.6 -> 27.0; bench/results/tma_promotion_probe_h200.json). On squarer few-tile grids
    it cost 2-5% (128x128x16384, 512x512x2048, 1024x128x1024, 1024x256x256: families_focus_v5_h200.json), so they
    keep group 1; so does the mirror case (few tile columns, many rows), which was not measured."""
    tm, tn = ceil_div(problem.m, bm), ceil_div(problem.n, bn)
    if tm * tn >= MANY_WAVES * sms // 2:
        return Swizzle(raster="along_n" if tn >= tm else "along_m", group=8)
    if 2 <= tm <= SKINNY_SHORT and tn >= SKINNY_LONG:
        return Swizzle(raster="along_n", group=8)
    return Swizzle()


@dataclass(frozen=True)
class Candidate:
    priority: float          # higher first
    kernel: Kernel
    note: str
    backend: str | None = None


def candidates(problem: Problem, parent: Kernel, arch: str, sms: int) -> list[Candidate]:
    """Every rule's candidate for this problem, with its priority and reason."""
    m, n, k = problem.shape
    flops = problem.flops
    hopper = arch == "sm90a" and store_vector(problem) == 8      # TMA loads and the TMA store
    out: list[Candidate] = []
    tiny = flops < TINY_FLOPS
    small = m * n <= SMALL_OUTPUT

    # Tiny, latency-bound: the sm80 rule, small tile, shallow ring.
    if tiny or (small and k <= 1024):
        block = (64, 64, 32) if m * n <= 256 * 256 else (64, 128, 32)
        stages = 2 if k <= 256 else 3
        slices = split_slices(problem, tiles_of(problem, block[0], block[1]), 32, sms)
        out.append(Candidate(
            10.0, sm80_kernel(problem, block, (2, 2), stages, slices),
            f"tiny: {flops / 1e6:.1f} MFLOP is latency-bound; the sm80 rule (cp.async + mma.sync) has no producer "
            f"warpgroup or TMA setup, {block[0]}x{block[1]} tiles, {stages} stages for {ceil_div(k, 32)} K tiles"
            + (f", split-K {slices}" if slices > 1 else "")))

    # Tiles by waves (Hopper).
    scored = []
    if hopper:
        for bm, bn, sched in HOPPER_TILES:
            t = tiles_of(problem, bm, bn)
            fill = min(1.0, t / sms) if t < sms else wave_fill(t, sms)
            # Tiles hanging over the edge of C compute zeros.
            useful = m * n / (t * bm * bn)
            k_tiles = ceil_div(k, 64)
            # Long K favours the cooperative tile (B traffic halved per FLOP); short K ping-pong (epilogue hidden).
            sched_fit = 1.0 if (sched == "pingpong") == (k_tiles <= SHORT_K_TILES) else 0.8
            scored.append((fill * useful * intensity(bm, bn) ** 0.5 * sched_fit, bm, bn, sched, t, fill))
        scored.sort(key=lambda s: -s[0])
        for rank, (score, bm, bn, sched, t, fill) in enumerate(scored[:3]):
            out.append(Candidate(
                8.0 - rank + score, hopper_kernel(problem, bm, bn, sched, raster=raster_for(problem, bm, bn, sms)),
                f"waves: {bm}x{bn} {sched} gives {t} tiles = {t / sms:.2f} waves of {sms} SMs "
                f"({fill:.0%} of SM-slots busy), intensity {intensity(bm, bn):.2f} of 128x256"))

    # An odd K on Hopper: copy A and B aligned (the repack node), then TMA + wgmma; the tile by output size first.
    if arch == "sm90a" and alignment(problem) < 8 and cuda_ptx_lowered(problem):
        best = repack_tile(problem, sms)
        for block in REPACK_TILES:
            t = tiles_of(problem, block[0], block[1])
            # Below REPACK_MIN_M rows the copy of B costs more than the GEMM's own pass over it (l2ir/seed.py):
            # proposed, but after the small-tile sm80 kernels.
            priority = (9.9 if block == best else 8.9 - t / (t + sms)) if m >= REPACK_MIN_M else 5.5 - t / (t + sms)
            out.append(Candidate(
                priority, repack_kernel(problem, block),
                f"repack: K={k} leaves every row of A and B on a 2-byte boundary, which TMA cannot read; copy them "
                f"to rows of {ceil_div(k, 8) * 8} elements first, then {block[0]}x{block[1]} tiles ({t} tiles)"
                + (" (skinny M: the copy of B may cost more than it saves)" if m < REPACK_MIN_M else ""),
                backend="cuda_ptx"))

    # An odd K with few rows of A (decode): 16-byte cp.async blocks realigned in shared memory (cuda_ptx_sm80; CuTe
    # loads such rows narrowly and ran the seed at 17x9999x3333 in 1.5 ms against 60 us here; bench/results/
    # unaligned_v4_h200.json). cuda_ptx_sm80 is this kernel's default backend too; it is named so that its children
    # stay on it (policy.actions.normal_backend), e.g. one whose align edit would make it CuTe's.
    if arch in ("sm80", "sm90a") and alignment(problem) < 8 and m <= DECODE_ROWS:
        out.append(Candidate(
            9.2, decode_align_kernel(problem, arch),
            f"decode, odd K: {m} row(s) of A, every row of A and B on a 2-byte boundary; 32x128 tiles stage the "
            "aligned 16-byte blocks around each row by cp.async and realign them in shared memory, 4 split-K slices",
            backend="cuda_ptx_sm80"))
        slices = decode_one_wave_slices(problem, sms)
        if slices is not None:
            out.append(Candidate(
                9.21, decode_align_kernel(problem, arch, stages=3, slices=slices),
                f"decode, odd K, one wave: {tiles_of(problem, 32, 128)} tiles x 4 slices of the 4-stage kernel take "
                f"more than one wave; a 3-stage ring fits two blocks per SM, {slices} slices fill one wave "
                "(bench/results/odd_k_decode_h200.json)", backend="cuda_ptx_sm80"))

    # An odd K with few rows of A: the interleaved decode kernel, B read in whole 16-byte copies (cuda_ptx_sm80; the
    # node's tensor-map form on cuda_ptx ran 1.1-1.26x slower on an H100: bench/results/h100/interleave_tma_h100.json).
    if arch in ("sm80", "sm90a") and alignment(problem) < 8 and m <= INTERLEAVE_ROWS:
        # The wave's slice count first, then 3 (the best measured at 31x4001x2047, where the wave rule says 4).
        for rank, slices in enumerate(dict.fromkeys((interleave_slices(problem, sms), 3))):
            out.append(Candidate(
                9.22 - 0.005 * rank, interleave_decode_kernel(problem, arch, slices),
                f"interleaved decode, odd K: {m} row(s) of A; each block takes 128 columns 8 apart, whose rows of B "
                f"start at one offset, so B streams by whole 16-byte copies and only A is realigned; {slices} "
                "split-K slices (bench/results/interleave_h200.json)", backend="cuda_ptx_sm80"))

    # C-write-bound: the TMA store epilogue (cuda_ptx; search/sweeps/cuda_ptx/ptx_coop_128x256x64_tma.l2).
    c_bytes = m * n * DTYPE_BYTES[problem.c[0]]
    if (hopper and k <= WRITE_BOUND_MAX_K and c_bytes >= WRITE_BOUND_MIN_C_BYTES
            and DTYPE_BYTES[problem.c[0]] == 2 and cuda_ptx_lowered(problem)):
        out.append(Candidate(
            8.5, hopper_kernel(problem, 128, 256, "cooperative", raster=Swizzle(raster="along_n", group=8)),
            f"write-bound: K={k} against a {c_bytes >> 20} MB C; TMA stores C from shared memory while the warps "
            "start the next tile (bench/results/tma_store_h200.json)", backend="cuda_ptx"))

    # Decode with 16-byte rows: stream B straight into registers (cuda_ptx_direct, its only backend); K must give
    # each of the 4 slices of warps a k step of 128.
    if m <= DIRECT_DECODE_ROWS and alignment(problem) == 8 and k >= 4 * 128 and cuda_ptx_lowered(problem):
        out.append(Candidate(
            9.3, direct_decode_kernel(problem, arch),
            f"decode: {m} row(s) of A: each lane loads its fragments from global memory (no shared-memory stage), "
            "4 groups of warps split K so an SM keeps enough loads in flight to stream B", backend="cuda_ptx_direct"))
        # Not measured yet (bench/NOTES.md, deeper register stages): ranked just below the measured kernel.
        out.append(Candidate(
            9.25, direct_decode_kernel(problem, arch, deep=True),
            f"decode: {m} row(s) of A, as the direct kernel above with four register sets of half the k step: three "
            "steps of B stay in flight while one multiplies", backend="cuda_ptx_direct"))

    # Skinny M, many N tiles, a long K: share each A read between the blocks of a cluster (TMA multicast along N).
    if hopper:
        for backend, cluster, priority in (("cutlass_sm90", (1, 8), 9.96), ("cutlass_sm90", (1, 4), 9.95),
                                           ("cuda_ptx", (2, 4), 9.0)):
            if backend == "cuda_ptx" and not cuda_ptx_lowered(problem):
                continue
            mc = multicast_kernel(problem, sms, backend, cluster)
            if mc is not None:
                out.append(Candidate(
                    priority, mc, f"multicast: {ceil_div(m, 64)} tile row(s) of 64 against {ceil_div(n, 64)} tile "
                    f"columns and {ceil_div(k, 64)} k tiles: {cluster[0]}x{cluster[1]} clusters, one 64x64 tile per "
                    "block, share each A read (bench/results/multicast_np_wide_h200.json)", backend=backend))

    # Few small tiles with a short K loop: the block's two consumer warpgroups split it (cuda_ptx).
    if hopper and cuda_ptx_lowered(problem):
        block = block_split_kernel(problem, sms)
        if block is not None:
            out.append(Candidate(
                7.4, block, f"block split: {tiles_of(problem, 64, 32)} tiles of 64x32 and {ceil_div(k, 64)} k tiles: "
                "the block's two consumer warpgroups take half the K loop each from one ring and add up in shared "
                "memory (bench/results/families_focus_v5_h200.json)", backend="cuda_ptx"))

    # Split-K / stream-K when the tiles cannot fill the SMs.
    bm, bn = (128, 128) if hopper else (64, 64)
    t = tiles_of(problem, bm, bn)
    slices = split_slices(problem, t, 64 if hopper else 32, sms)
    if slices > 1:
        why = (f"split: {t} tiles of {bm}x{bn} fill {t / sms:.0%} of {sms} SMs and K={k} is "
               f"{ceil_div(k, 64 if hopper else 32)} K tiles")
        if hopper:
            out.append(Candidate(9.5, hopper_kernel(problem, 128, 128, "cooperative", splitk=SplitK("stream_k")),
                                 why + ": stream-K spreads the MAC loop evenly over a persistent grid"))
            cluster = cluster_split_kernel(problem, sms)
            if cluster is not None:
                out.append(Candidate(
                    9.8, cluster, f"split: {tiles_of(problem, 64, 64)} tiles of 64x64 and K={k}: split-K "
                    f"{cluster.splitk.slices} in a thread-block cluster (the slices add up in each other's shared "
                    "memory, one barrier round trip; bench/NOTES.md, cluster split-K)", backend="cuda_ptx"))
            coop = coop_split_kernel(problem, sms)
            if coop is not None:
                out.append(Candidate(
                    9.9, coop, f"split: {tiles_of(problem, 128, 64)} cooperative tiles of 128x64 and K={k}: split-K "
                    f"{coop.splitk.slices} in a thread-block cluster, "
                    f"{tiles_of(problem, 128, 64) * coop.splitk.slices} blocks, half the K loop each "
                    "(bench/results/cublas_tiles_h200.json)", backend="cuda_ptx"))
            coop4 = coop_split4_kernel(problem, sms)
            if coop4 is not None:
                bn4 = coop4.tile.bn
                out.append(Candidate(
                    9.85, coop4, f"split: {tiles_of(problem, 128, bn4)} cooperative tiles of 128x{bn4} and K={k}: "
                    f"split-K 4 in four-block clusters, one wave of them (bench/results/ntile_split_h200.json)",
                    backend="cuda_ptx"))
        out.append(Candidate(9.0 if not hopper else 7.5,
                             sm80_kernel(problem, (64, 64, 32), (2, 2), 4, slices),
                             why + f": split-K {slices} (sm80 rule, fp32 partials reduced in the workspace)"))

    # Schedule by the epilogue's share, on the parent's own tile.
    if parent.pipeline is not None and parent.pipeline.mode == "tma_ws" and parent.splitk is None:
        k_tiles = ceil_div(k, parent.tile.bk)
        want = "pingpong" if k_tiles <= SHORT_K_TILES else "cooperative"
        pbm, pbn, _ = parent.tile.block
        if parent.pipeline.schedule != want and (want == "pingpong" or pbm >= 128):
            child = parent.replace(tile=dataclasses.replace(parent.tile, warps=(4, 1) if want == "pingpong"
                                                            else (8, 1)),
                                   pipeline=dataclasses.replace(parent.pipeline, schedule=want))
            out.append(Candidate(
                7.0, child,
                f"schedule: {k_tiles} K tiles per output tile -> {want} ("
                + ("the epilogue is a large share; the other warpgroup's main loop hides it)" if want == "pingpong"
                   else "long main loop; two warpgroups share each B tile)")))

    # Clusters for large shapes.
    if hopper and scored:
        _, bm, bn, sched, t, _ = scored[0]
        if t >= MANY_WAVES * sms and m >= 2 * bm:
            out.append(Candidate(
                7.2, hopper_kernel(problem, bm, bn, sched, cluster=(2, 1), raster=raster_for(problem, bm, bn, sms)),
                f"cluster: {t} tiles ({t / sms:.1f} waves); a 2x1 cluster multicasts each B tile to two blocks"))

    # Small outputs: small tiles to make blocks.
    if small and not tiny:
        for block, warps in (((64, 64, 32), (2, 2)), ((64, 128, 32), (2, 2))):
            tb = tiles_of(problem, block[0], block[1])
            out.append(Candidate(6.0 + tb / (tb + sms), sm80_kernel(problem, block, warps, 3 if k <= 2048 else 4),
                                 f"small: {m}x{n} output; {block[0]}x{block[1]} tiles make {tb} blocks for {sms} SMs"))

    # Rasterization and divisibility on the parent.
    if not parent.is_source:
        pbm, pbn, pbk = parent.tile.block
        want = raster_for(problem, pbm, pbn, sms)
        have = parent.swizzle or Swizzle()
        if (have.raster, have.group) != (want.raster, want.group) and want.group > 1:
            out.append(Candidate(4.0, parent.replace(swizzle=dataclasses.replace(have, raster=want.raster,
                                                                                 group=want.group)),
                                 f"raster: {tiles_of(problem, pbm, pbn)} tiles; walk {want.raster} in groups of "
                                 f"{want.group} so concurrent blocks share A/B tiles in L2"))
        pad = parent.pad
        for dim, size, tile in (("m", m, pbm), ("n", n, pbn), ("k", k, pbk)):
            if size % tile == 0 and getattr(pad, dim) != "divisible":
                pad = dataclasses.replace(pad, **{dim: "divisible"})
        if pad != parent.pad:
            out.append(Candidate(3.0, parent.replace(pad=pad),
                                 "divisible: the problem is a multiple of the tile in "
                                 + ", ".join(d for d in "mnk" if getattr(pad, d) != getattr(parent.pad, d))
                                 + "; drop the bounds checks"))

        # Stages for the sm80 rule: deep rings hide latency on long K; short K cannot fill one.
        if parent.pipeline.mode == "multistage":
            k_tiles = ceil_div(k, pbk)
            stages = max(2, min(5, k_tiles // 4 + 2))
            if stages != parent.pipeline.stages:
                out.append(Candidate(3.5, parent.replace(pipeline=dataclasses.replace(parent.pipeline,
                                                                                      stages=stages)),
                                     f"stages: {k_tiles} K tiles -> {stages} cp.async stages in flight"))
    return sorted(out, key=lambda c: -c.priority)


class Rules(StatelessPolicy):
    """Ranked, explained proposals from library-style heuristics; deterministic (no randomness at all)."""

    name = "rules"

    def propose(self, context: Context) -> list[Proposal]:
        seen = Dedupe.of(context)
        out: list[Proposal] = []
        for cand in candidates(context.problem, context.parent, context.arch, context.num_sms):
            if len(out) >= context.count:
                break
            backend = normal_backend(cand.kernel, cand.backend or context.backend)
            if try_legalize(cand.kernel, context.problem, backend) is None or not seen.fresh(cand.kernel, backend):
                continue
            edits = diff_edits(context.parent, cand.kernel)
            out.append(Proposal(edits=edits, note=cand.note, backend=backend) if edits
                       else Proposal(kernel=cand.kernel, note=cand.note, backend=backend))
        return out
