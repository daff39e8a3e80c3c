"""Derived quantities of a kernel: the one definition of each number the verifier checks and the backends, the seed
and the search restate (threads per block, bytes of a pipeline stage, shared memory per block, the stage count that
`stages=auto` resolves to, accumulator and estimated registers per thread).

Each is a pure function of the kernel (and the element sizes); hardware limits come from l2ir.target.
"""

from __future__ import annotations

from .indexing import ClusterMulticast, ClusterReduce, ceil_div, column_tiles
from .nodes import Kernel, Problem
from .target import (DTYPE_BYTES, KB, PRODUCER_THREADS, SMEM_LIMIT, TMA_BARRIER_BYTES, WARP_THREADS,
                     WARPGROUP_THREADS)

# Registers always needed beside accumulators and fragments: addresses, loop counters and predicates.
REG_OVERHEAD = 40
# The smem epilogue pads each staged C row by 8 elements: rows then start 16 (f16) or 32 (f32) bytes apart modulo
# 128, so the 8 rows of one mma fragment store hit different banks.
C_ROW_PAD = 8


def elem_bytes(problem: Problem | None = None) -> int:
    return DTYPE_BYTES[problem.a[0]] if problem is not None else 2


def threads(kernel: Kernel) -> int:
    """Threads per block."""
    if kernel.is_source:
        b = kernel.source.block
        return b[0] * b[1] * b[2]
    t = kernel.tile.num_warps * WARP_THREADS
    if kernel.pipeline.mode == "direct" and block_reduce(kernel):
        return t * kernel.splitk.slices          # one group of 1 x WN warps per K slice
    if kernel.pipeline.mode == "tma_ws":
        # pingpong runs two consumer warpgroups on alternating tiles, each the size of `warps`.
        consumers = t * (2 if kernel.pipeline.schedule == "pingpong" else 1)
        return consumers + PRODUCER_THREADS
    return t


def operand_stage_bytes(kernel: Kernel, ebytes: int = 2) -> int:
    """The A and B tiles of one pipeline stage: (BM + BN) x BK elements."""
    bm, bn, bk = kernel.tile.block
    return (bm + bn) * bk * ebytes


def stage_bytes(kernel: Kernel, ebytes: int = 2) -> int:
    """One pipeline stage: its operand tiles plus, for a TMA ring, the stage's full/empty mbarrier pair."""
    extra = TMA_BARRIER_BYTES if kernel.pipeline.mode == "tma_ws" else 0
    return operand_stage_bytes(kernel, ebytes) + extra


def epilogue_smem_bytes(kernel: Kernel, out_bytes: int = 2) -> int:
    """Shared memory the epilogue needs beyond the pipeline's buffers."""
    bm, bn, _ = kernel.tile.block
    path = kernel.epilogue.path
    if path == "direct":
        return 0
    if path == "tma":
        # The TMA epilogue stores sub-tiles (e.g. 64x32) double-buffered, never the whole tile at once.
        return min(bm * bn * out_bytes, 32 * KB)
    # smem path: the whole C tile, each row padded by 8 elements so column-wise fragment writes spread over the
    # banks; split-K stages fp32 partials instead of the output dtype.
    staged = 4 if kernel.splitk is not None else out_bytes
    return bm * (bn + C_ROW_PAD) * staged


def resolved_stages(kernel: Kernel, ebytes: int = 2, epilogue_bytes: int | None = None) -> int:
    """The stage count, with 'auto' resolved the way the CUTLASS auto carve-out does: fill what the epilogue leaves.
    `epilogue_bytes` is a backend's own epilogue footprint where it differs from epilogue_smem_bytes' (the cuda_ptx
    rule's TMA store stages the whole tile, CUTLASS's double-buffered sub-tiles)."""
    stages = kernel.pipeline.stages
    if stages != "auto":
        return stages
    epi = epilogue_smem_bytes(kernel) if epilogue_bytes is None else epilogue_bytes
    free = SMEM_LIMIT[kernel.target.arch] - epi - cluster_receive_bytes(kernel)
    stages = max(0, free // stage_bytes(kernel, ebytes))
    if block_reduce(kernel):
        stages -= stages % 2      # an even ring: each consumer warpgroup owns its stages (l2ir.indexing.BlockSplit)
    return stages


def realigned_buffers(stages: int) -> int:
    """pad.align=1 on a cp.async ring: realigned tiles the MMAs read. With 3 or more stages the next k-tile is
    realigned while this one is multiplied (two buffers); with fewer there is no staged tile to spare (one)."""
    return 2 if stages >= 3 else 1


def realigned_ring_bytes(bm: int, bn: int, bk: int, stages: int, ebytes: int = 2, interleave: bool = False) -> int:
    """pad.align=1 on a cp.async ring: rows start on any 2-byte boundary, which no cp.async form copies, so each
    stage holds the raw aligned 16-byte blocks covering every row's k-tile (BK/8 + 1 blocks: one more when the row
    does not start on a block), and the MMAs read realigned_buffers(stages) swizzled tiles. With the interleave
    node only A is staged and realigned: B's rows of one residue share an alignment, so each stage holds B's
    swizzled tile as the aligned rings do and the MMAs read it there."""
    staged = bm if interleave else bm + bn           # rows staged raw and realigned
    b_ring = stages * bk * bn if interleave else 0    # B's tile read in its stage
    return ((stages * (bk + 8) + realigned_buffers(stages) * bk) * staged + b_ring) * ebytes


def ring_bytes(kernel: Kernel, ebytes: int = 2) -> int:
    """The main loop's shared memory: the stages' A and B tiles, or with pad.align=1 on a cp.async ring the raw
    staging stages plus the realigned tiles (realigned_ring_bytes)."""
    if kernel.pipeline.mode == "direct":
        return 0                          # operands go from global memory to registers
    if kernel.pipeline.mode == "multistage" and kernel.pad.align == 1:
        return realigned_ring_bytes(*kernel.tile.block, resolved_stages(kernel, ebytes), ebytes,
                                    kernel.interleave is not None)
    return resolved_stages(kernel, ebytes) * stage_bytes(kernel, ebytes)


def ring_description(kernel: Kernel, ebytes: int = 2) -> str:
    """How ring_bytes adds up, for resource errors."""
    stages = resolved_stages(kernel, ebytes)
    if kernel.pipeline.mode == "direct":
        return f"the K split's fp32 accumulators, {direct_reduce_bytes(kernel) / 1024:.1f} KB; no operand stages"
    if kernel.pipeline.mode == "multistage" and kernel.pad.align == 1:
        bm, bn, bk = kernel.tile.block
        if kernel.interleave is not None:
            return (f"{stages} stages x {((bk + 8) * bm + bk * bn) * ebytes / 1024:.1f} KB (A staged, B's tile) + "
                    f"{realigned_buffers(stages)} realigned A tiles x {bk * bm * ebytes / 1024:.1f} KB")
        return (f"{stages} staging stages x {(bk + 8) * (bm + bn) * ebytes / 1024:.1f} KB + "
                f"{realigned_buffers(stages)} realigned tiles x {bk * (bm + bn) * ebytes / 1024:.1f} KB")
    return f"{stages} stages x {stage_bytes(kernel, ebytes) / 1024:.1f} KB"


def smem_bytes(kernel: Kernel, ebytes: int = 2, out_bytes: int = 2) -> int:
    """Dynamic shared memory per block, with C staged in `out_bytes`-byte elements."""
    if kernel.is_source:
        return kernel.source.smem
    if kernel.pipeline.mode == "direct":
        return direct_reduce_bytes(kernel)
    ring = ring_bytes(kernel, ebytes)
    epi = epilogue_smem_bytes(kernel, out_bytes)
    if kernel.pipeline.mode == "multistage" and kernel.epilogue.path == "smem":
        # After the main loop the ring is drained, so the C tile reuses its buffers.
        return max(ring, epi)
    return ring + epi + cluster_receive_bytes(kernel)


def cluster_receive_bytes(kernel: Kernel) -> int:
    """reduce=cluster: the buffer beside the ring where the cluster's other blocks push the fragment units this
    block owns (l2ir.indexing.ClusterReduce.receive_vecs float4s), plus 16 bytes for its mbarrier and the padding
    that aligns the buffer to 16. It cannot reuse the ring: a block pushes as soon as its own K loop ends, while the
    owner's wgmma may still be reading its stages."""
    if not cluster_reduce(kernel) or kernel.splitk.mode != "split_k" or kernel.splitk.slices < 2:
        return 0                          # none, or a reduce=cluster the verifier refuses by its own rule
    wgs = warpgroups_m(kernel)
    units = ClusterReduce.units(kernel.tile.bm // wgs, kernel.tile.bn)
    return 16 * ClusterReduce(kernel.splitk.slices).receive_vecs(units, 128 * wgs) + 16


def output_tiles(kernel: Kernel, problem: Problem) -> int:
    """The kernel's output tiles on the problem: BM rows by BN columns of C, the columns consecutive or, with the
    interleave node, each residue's runs of BN view rows (l2ir.indexing.column_tiles)."""
    t = kernel.tile
    return ceil_div(problem.m, t.bm) * int(column_tiles(problem.n, t.bn, kernel.interleave is not None).eval({}))


def warpgroups_m(kernel: Kernel) -> int:
    """wgmma: the consumer warpgroups stacked along M (4 warps each), each owning BM / warpgroups_m rows. With
    reduce=block the two consumer warpgroups split the K loop instead, each over all BM rows."""
    if block_reduce(kernel):
        return 1
    return max(1, kernel.tile.warps[0] // 4)


def cluster_reduce(kernel: Kernel) -> bool:
    """split-K whose slices reduce inside a thread-block cluster (l2ir.indexing.ClusterReduce)."""
    return kernel.splitk is not None and kernel.splitk.reduce == "cluster"


def block_reduce(kernel: Kernel) -> bool:
    """split-K whose 2 slices are one block's consumer warpgroups (l2ir.indexing.BlockSplit)."""
    return kernel.splitk is not None and kernel.splitk.reduce == "block"


def multicast(kernel: Kernel) -> ClusterMulticast | None:
    """The cluster's operand sharing (l2ir.indexing.ClusterMulticast) of a TMA kernel with one tile per block in a
    cluster larger than 1x1, with or without split-K through the workspace (each slice a copy of the cluster grid);
    None for every other kernel (a persistent cluster kernel walks tiles in its library's own order; the verifier
    gives reduce=cluster and reduce=block no tile.cluster, stream-K runs a persistent grid, and fp32 atomics into C
    are a different reduction)."""
    if (kernel.is_source or kernel.tile.cluster == (1, 1) or kernel.pipeline.mode != "tma_ws" or kernel.pipeline.persistent
            or (kernel.splitk is not None and (kernel.splitk.mode, kernel.splitk.reduce) != ("split_k", "workspace"))):
        return None
    return ClusterMulticast(*kernel.tile.cluster)


def shares_fragments(kernel: Kernel) -> bool:
    """split-K whose slices add up through shared memory, each storing the fragment units it owns
    (l2ir.indexing.ClusterReduce): a cluster's blocks (reduce=cluster) or a block's warpgroups (reduce=block)."""
    return cluster_reduce(kernel) or block_reduce(kernel)


def direct_shape(kernel: Kernel) -> tuple[int, int, int]:
    """pipeline mode=direct: (MI, NI, U), a warp's m16 blocks (BM=8 counts one, half fed), n8 blocks and 32-element
    K chunks per k step (l2ir.indexing.DirectFeed)."""
    bm, bn, bk = kernel.tile.block
    return max(1, bm // 16), bn // (8 * kernel.tile.warps[1]), bk // 32


def direct_half_fed(kernel: Kernel) -> bool:
    """pipeline mode=direct with BM=8: each m16 MMA is fed rows g only; rows g + 8 are zero registers and belong to
    no output row of the tile."""
    return kernel.tile.bm == 8


def direct_registers(kernel: Kernel) -> int:
    """pipeline mode=direct: accumulators plus `stages` k steps of raw vectors (4 registers each; pad.align < 8 keeps
    two per row, the aligned pair around it) of B (NI columns) and A (rows g and g + 8 of each m16 block, g only at
    BM=8) per chunk, plus overhead. ptxas spilled where this passed 255 (8x8x512 and 8x32x256 align 1, stages 2)."""
    mi, ni, u = direct_shape(kernel)
    rows = 1 if direct_half_fed(kernel) else 2
    raw = 2 if kernel.pad.align < 8 else 1
    # stages=auto is illegal here (the stage rule says so); count the most a direct pipeline may hold meanwhile.
    stages = kernel.pipeline.stages if isinstance(kernel.pipeline.stages, int) else 2
    return mi * ni * 4 + stages * u * (ni + mi * rows) * 4 * raw + REG_OVERHEAD


def direct_slices(kernel: Kernel) -> int:
    """pipeline mode=direct: the K slices of a block (splitk reduce=block), 1 without."""
    return kernel.splitk.slices if block_reduce(kernel) else 1


def direct_reduce_bytes(kernel: Kernel) -> int:
    """pipeline mode=direct with K slices: the fp32 accumulators of slices 1 .. S-1, which slice 0 adds from shared
    memory (l2ir.indexing.DirectFeed.slice_step)."""
    mi, ni, _ = direct_shape(kernel)
    return (direct_slices(kernel) - 1) * kernel.tile.warps[1] * WARP_THREADS * mi * ni * 4 * 4


def acc_registers(kernel: Kernel, acc_bytes: int = 4) -> int:
    """fp32 accumulator registers per math thread."""
    if kernel.pipeline.mode == "direct":
        mi, ni, _ = direct_shape(kernel)
        return mi * ni * 4 * acc_bytes // 4
    bm, bn, _ = kernel.tile.block
    wm, wn = kernel.tile.warps
    per_warp = (bm // wm) * (bn // wn)
    if kernel.mma.op == "wgmma":
        return (bm // warpgroups_m(kernel)) * (bn // wn) * acc_bytes // (4 * WARPGROUP_THREADS)
    return per_warp * acc_bytes // (4 * WARP_THREADS)


def estimated_registers(kernel: Kernel) -> int:
    """A register estimate for mma.sync kernels: accumulators + A/B fragments (x2 with register prefetch) + overhead."""
    if kernel.pipeline.mode == "direct":
        return direct_registers(kernel)
    bm, bn, _ = kernel.tile.block
    wm, wn = kernel.tile.warps
    # Per k16 step a thread holds 4 registers of each 16x16 A fragment and 2 of each 16x8 B fragment.
    frags = (bm // wm) // 16 * 4 + (bn // wn) // 8 * 2
    if kernel.pipeline.prefetch:
        frags *= 2
    return acc_registers(kernel) + frags + REG_OVERHEAD
