"""Lower sm90a kernels (wgmma, TMA warp-specialized pipelines) to raw CUDA with inline PTX.

Two pure steps, like the CUTLASS backend:
  canonicalize(kernel, problem, num_sms) -> PtxConfig   every check; every IR field turned into the one value it means
  render(cfg) -> str                                    the .cu text: the kernel plus trusted host code
`lower()` composes them into a LaunchPlan(form="host_shim").

Why a host shim. TMA copies name their global tensor through a 128-byte CUtensorMap that only the host can encode
(cuTensorMapEncodeTiled, a driver API call), and the harness launches "kernels" plans with the fixed L2IR ABI, which has
no place for it. So the backend emits, beside the kernel, a small trusted host function (generated here, never written
by a candidate) that exports the host_shim ABI of l2ir/runtime.py:
    size_t l2ir_workspace_size(int M, int N, int K);            // 0, or split-K's partials and pair counters
    int    l2ir_run(A, B, C, M, N, K, workspace, workspace_bytes, stream);
l2ir_run checks the shape, encodes one tensor map per operand (or re-uses the maps of the thread's previous call on
the same operands and sizes: encoding is a driver call), and launches the kernel with the maps as
`const __grid_constant__ CUtensorMap` parameters (they live in the kernel's parameter space, where TMA reads them).
The driver entry point is fetched through the runtime (cudaGetDriverEntryPointByVersion), so the library needs no
-lcuda at link time; the evaluator loads it like the CUTLASS shims. Return codes: l2ir.runtime.STATUS_*.

The kernel (a producer warpgroup and one or two consumer warpgroups):
  prologue     thread 0 prefetches both tensor maps, initializes the mbarriers; one __syncthreads.
  warpgroup 0  producer: setmaxnreg.dec to 40 registers; one thread issues, per stage, the TMA box copies of the A and
               B tiles into the stage's buffers and arms the stage's `full` mbarrier with the byte count.
  consumers    cooperative (tile.warps=8x1, 384 threads): warpgroups 1, 2 setmaxnreg.inc to 232, each owns BM/2 rows
               (with splitk reduce=block: all BM rows and half the K loop, below).
               latency-bound (tile.warps=4x1, schedule=pingpong, persistent=false; 256 threads): warpgroup 1 owns the
               whole tile, one tile per block. With a ring that leaves room for a second block (explicit stages,
               at most half the SM's shared memory) the launch bounds promise two blocks per SM and setmaxnreg hands
               the consumer 216 registers; otherwise one block, whose consumer keeps the per-thread maximum
               (REG_BUDGET).
               Each waits on `full`, issues BK/16 x slabs wgmma m64nBNk16 from shared-memory descriptors, keeps one
               k-tile's wgmma group in flight (wait_group 1), and releases the previous stage through its `empty`
               mbarrier.
  split-K      (splitk mode=split_k reduce=workspace) work units are (tile, slice); a unit accumulates the slice's k
               tiles (l2ir.indexing.splitk_range), then climbs the tile's pairwise tree (l2ir.indexing.SplitKTree):
               at each level whose sibling subtree exists it stores its fp32 registers to slot `base` (__stcg, L2
               only), fences (release) and counts itself in on the pair's counter; the first arrival is done, the
               second fences (acquire), adds the sibling's slot, zeroes the counter for the next launch and goes up
               with base = the lower subtree's slot. The block that completes the root runs the epilogue. fp32
               addition commutes, so each pair's sum, and C, is bit-identical whichever block arrives last; no block
               waits for another; the critical path reads ceil(log2 S) partials instead of S.
               (splitk reduce=cluster) the S slices of a tile are one thread-block cluster, launched with the cluster
               dimension (the non-portable opt-in above 8): after its K loop each block pushes the fragment units it
               does not own (l2ir.indexing.ClusterReduce) into their owners' receive buffers (st.async, counted in
               bytes by the owner's mbarrier), waits for its own, and adds its units' partials in slice order into
               its registers; the direct epilogue stores only those units. One relaxed cluster barrier at entry
               makes the receive mbarriers known; no block reads another's shared memory, so none waits at exit.
               No workspace, no counters, no GPU-scope fence.
               (splitk reduce=block, slices=2) the cooperative block's two consumer warpgroups split one tile's K
               loop instead of its rows (l2ir.indexing.BlockSplit): the producer fills ring position p with slice
               p % 2's k tile, consumer cw finds its step-th tile at position 2 step + cw, and each stage's empty
               barrier counts one warpgroup's 4 warps. After both warpgroups' last wgmma each leaves the fragment
               units the other owns (ClusterReduce(2).owner) over the ring, a named barrier of the consumer threads
               publishes them, and each adds the other's half to the units it owns and stores those. One tile per
               block; the ring has an even number of stages, at least 4, so that each warpgroup owns its stages
               (an odd ring hands a stage's next phase to the other warpgroup, whose parity wait could pass before
               the previous phase's load has landed).
  epilogue     registers -> global (path=direct) or registers -> swizzled shared memory -> 16-byte global stores
               (path=smem), predicated on M and N. K tails need nothing: TMA fills out-of-bounds boxes with zeros.

Field -> code map (the generated lines name their field in a comment):
  target.arch=sm90a, mma.op=wgmma, pipeline.mode=tma_ws      the only combination lowered here
  tile.block BMxBNxBK      tile constants, TMA box sizes, wgmma N (= BN), slabs per warpgroup, K steps per stage
  tile.warps               8x1: two consumer warpgroups split BM (cooperative), or K with reduce=block; 4x1: one
                           consumer warpgroup (pingpong)
  tile.cluster             1x1, or CMxCN with persistent=false (and split-K, if any, reduced through the workspace):
                           TMA multicast (l2ir.indexing.ClusterMulticast; split-K: one copy of the cluster grid per K
                           slice, ClusterMulticast.unit): clusters of CM x CN consecutive blocks own a CM x CN patch
                           of tiles; each block loads BM/CN rows of its A box into its patch row's blocks and BN/CM
                           rows of its B box into its patch column's (cp.async.bulk.tensor .multicast::cluster with
                           the rank masks), and each consumer warp releases a stage at the empty barriers of its row
                           and column (mapa + a cluster-scope arrive); a cluster barrier after the barrier setup,
                           and before the block exits its producer waits out one more pass over the ring (every
                           fill released, so no block arrives at its barriers again and its multicasts have landed)
  mma.shape                64xBNx16: the wgmma instruction emitted
  pipeline.schedule        cooperative; pingpong only with persistent=false (one tile per block, nothing to alternate)
  pipeline.stages          ring depth; auto resolved by l2ir.verify.resolved_stages
  pipeline.persistent      grid = min(units, NUM_SMS) with a += gridDim.x loop, or one unit (tile, or tile x slice)
                           per block
  swizzle.smem             TMA swizzle + wgmma descriptor layout: <3,3,3> 128B, <2,3,3> 64B, <1,3,3> 32B;
                           none = the widest whose row divides BK (the builder's choice, as in cutlass_sm90)
  swizzle.raster / group   l2ir.indexing.rasterize rendered to C++
  pad.m / pad.n            zero_fill: TMA zero-fills and stores are predicated; divisible: l2ir_run refuses other shapes
                           and the epilogue drops that predicate
  pad.k                    zero_fill: TMA zero-fills the K tail; divisible: l2ir_run refuses K % BK != 0
  pad.align                8 (16-byte TMA strides); l2ir_run refuses K % 8 != 0
  splitk                   split_k reduce=workspace: grid x slices, in-kernel pairwise-tree reduction; workspace =
                           every tile's slices x BM x BN fp32 slots, then every tile's slices - 1 4-byte pair
                           counters (SplitKTree.counters), zeroed once (plan.zero_workspace), left zero by every
                           launch; reduce=cluster: grid x slices in clusters of `slices`, no workspace, path=direct
                           only; reduce=block: one block per tile, the 2 slices its consumer warpgroups, no
                           workspace, path=direct only; reduce=atomic and stream_k raise
  epilogue.path            direct | smem | tma. tma: each consumer warpgroup stages its block of C as 128-byte-wide
                           boxes swizzled as TMA reads them (l2ir.indexing.tma_store_staging) and one thread stores
                           them with cp.async.bulk.tensor (clipped at M and N), so the warps go on to the next
                           tile's wgmma while the store drains; the buffer is reused after the store has read it
                           (cp.async.bulk.wait_group.read). fp16/bf16 C, BN a multiple of 64, vector=8, no split-K
  epilogue.vector          elements per global store (direct: 1 or 2, the accumulator fragment's adjacent pair)
  interleave n=8           columns 8 apart per block (l2ir.indexing.Interleave), pingpong, one tile per block:
                           B's view one TMA map of floor(N/8) rows of pitch 8K elements, each box starting on the
                           16-byte boundary `offset` elements before its row (Interleave.offset); A's stages
                           written by the producer warpgroup's other three warps (rows on any 2-byte boundary: plain
                           loads, shifted by the offset to meet B, zero outside the row and past M), so the
                           consumer's k loop is the general one; B's columns outside the row zeroed in the first
                           and last k tiles; C's last N mod 8 columns dot products of the consumer warps
                           (Interleave.tail_row / tail_column); no setmaxnreg (the A writers keep the producer
                           warpgroup's registers); pad.align=1
  problem                  a row (K-major), b col (K-major), f16 or bf16 in, f16 or bf16 out, acc f32
"""

from __future__ import annotations

from dataclasses import dataclass

from l2ir.errors import ResourceError
from l2ir.indexing import (REPACK_ALIGN, BlockSplit, ClusterMulticast, ClusterReduce, Const, Expr, Interleave, Repack,
                           SplitKTree, Var, cdiv, column_tiles,
                           tma_store_box_cols, tma_store_origin, tma_store_staging,
                           rasterize, splitk_range)
from l2ir.nodes import Kernel, Problem, Swizzle
from l2ir.text import print_problem_class
from l2ir.target import (KB, CUDA_FROM_FLOAT, CUDA_PAIR_FROM_FLOATS, CUDA_PAIR_TYPE, CUDA_TYPE, DTYPE_BYTES, H200_SMS,
                         MAX_CLUSTER, SMEM_LIMIT, TMA_BOX_MAX, TMA_DTYPE)
from l2ir.analysis import block_reduce, cluster_reduce, multicast, resolved_stages, warpgroups_m
from l2ir.verify import verify, verify_problem

from l2ir.runtime import LaunchPlan, pdl_macro_cpp, run_args_cpp, status_constants_cpp
from .common import UnsupportedLowering, check_problem_class

ENTRY = "l2ir_cuda_ptx_sm90a_gemm"
# setmaxnreg targets (producer, consumer) by (consumer warpgroups, blocks per SM). setmaxnreg moves registers only
# inside the block's own pool, which is fixed at launch: threads x the count ptxas compiled for, and with
# __launch_bounds__(THREADS, BLOCKS) and setmaxnreg in the kernel ptxas compiles for the bound's cap,
# 65536 / (THREADS x BLOCKS) rounded down to 8 (at most 255).
#   8x1, 384 threads, 1 block: cap 168, pool 384 x 168 = 64,512; producer 128 x 40 + consumers 256 x 232 = 64,512.
#   4x1, 256 threads, 1 block: cap 255 (the per-thread maximum), pool 256 x 256 = 65,536 (whole-warp allocation
#   rounds the 255 up to 256); the one consumer warpgroup already has the per-thread maximum, so there is nothing to
#   move: the producer releases its registers (40) and the consumer keeps what it has.
#   4x1, 256 threads, 2 blocks: cap 128, pool 256 x 128 = 32,768; producer 128 x 40 + consumer 128 x 216 = 32,768.
REG_BUDGET = {(2, 1): (40, 232), (1, 1): (40, None), (1, 2): (40, 216)}
# The interleave node's A writers: the producer warpgroup's warps 1-3 (thread 0 issues B's TMA boxes).
A_WRITERS = 96
# Shared memory of one SM: the per-block opt-in limit plus the 1 KB the hardware reserves per resident block
# (l2ir/target.py, SMEM_LIMIT). A second block fits when 2 x (its dynamic shared memory + 1 KB) fits in it.
SM_SMEM = SMEM_LIMIT["sm90a"] + KB
# wgmma swizzle modes in the descriptor's bits 62-63, by swizzle bits B of <B,3,3>.
DESC_SWIZZLE_MODE = {3: 1, 2: 2, 1: 3}      # 128B, 64B, 32B
TMA_SWIZZLE = {3: "CU_TENSOR_MAP_SWIZZLE_128B", 2: "CU_TENSOR_MAP_SWIZZLE_64B", 1: "CU_TENSOR_MAP_SWIZZLE_32B"}


@dataclass(frozen=True)
class PtxConfig:
    """Everything the source depends on, already checked."""

    in_dtype: str             # "f16" | "bf16"
    out_dtype: str            # "f16" | "bf16"
    problem_class: str
    bm: int
    bn: int
    bk: int
    consumer_wgs: int         # 2 (cooperative, tile.warps=8x1) | 1 (pingpong non-persistent, tile.warps=4x1)
    stages: int
    stages_field: str         # the IR's value ("auto" or the number), for comments
    persistent: bool
    num_sms: int
    raster: str
    group: int
    swizzle_bits: int         # B of <B,3,3>: 3 = 128-byte rows, 2 = 64, 1 = 32
    swizzle_field: str        # "<3,3,3>" or "none -> <3,3,3>"
    divisible: tuple[bool, bool, bool]
    epilogue: str             # "direct" | "smem"
    vector: int
    slices: int = 1           # splitk mode=split_k slices (1: no split)
    cluster_reduce: bool = False   # splitk reduce=cluster: the slices reduce in a cluster's shared memory
    block_reduce: bool = False     # splitk reduce=block: the 2 slices are the block's consumer warpgroups
    repack: str = ""          # repack operands=a|b|ab: operands copied to aligned rows when K % 8 != 0 ("" = none)
    cluster: tuple[int, int] = (1, 1)   # tile.cluster CM x CN: TMA multicast, one tile per block (1x1: none)
    interleave: bool = False  # the interleave node's tensor-map form: columns 8 apart, A staged by plain loads

    @property
    def multicast(self) -> ClusterMulticast | None:
        """The cluster's operand sharing, or None without a cluster."""
        return None if self.cluster == (1, 1) else ClusterMulticast(*self.cluster)

    @property
    def split(self) -> bool:
        """split-K across blocks: the grid has a work unit per (tile, slice). reduce=block splits inside a block."""
        return self.slices > 1 and not self.block_reduce

    @property
    def shares_fragments(self) -> bool:
        """The slices add up through shared memory and each stores the fragment units it owns
        (l2ir.indexing.ClusterReduce): a cluster's blocks (reduce=cluster) or a block's warpgroups (reduce=block)."""
        return self.cluster_reduce or self.block_reduce

    @property
    def tree(self) -> bool:
        """split-K through the workspace's pairwise tree (reduce=workspace), with its slots and counters."""
        return self.split and not self.cluster_reduce

    @property
    def uses_workspace(self) -> bool:
        """Whether l2ir_run may need the workspace: repack's copies or the split-K tree's partials."""
        return self.tree or bool(self.repack)

    @property
    def repack_layout(self) -> Repack:
        """Where the copies live (the problem class is K-major A and B: both copies are rows x K)."""
        return Repack(self.repack or "ab", "row", "col")

    @property
    def k_first(self) -> str:
        return "kt_begin" if self.split else "0"

    @property
    def k_last(self) -> str:
        return "kt_end" if self.split else "k_tiles"

    @property
    def schedule_text(self) -> str:
        if self.block_reduce:
            return "2 consumer warpgroups split the K loop (splitk reduce=block)"
        if self.consumer_wgs == 2:
            return f"cooperative (2 consumer warpgroups of {self.wg_m} rows)"
        return "one consumer warpgroup (pingpong, one tile per block)"

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM the launch bounds promise: two one-warpgroup blocks when their ring leaves room for
        a second (explicit stages; `auto` fills the SM), so one block's prologue, TMA waits and epilogue overlap the
        other's wgmma. The cooperative kernel keeps one (its consumers need 232 registers). So does BN > 128: ptxas
        must fit one wgmma's operands (BN/2 accumulators, the descriptors) under the launch bounds' 128-register cap,
        whatever setmaxnreg grants later (C7602 "insufficient registers" for m64n256k16)."""
        if self.consumer_wgs == 1 and self.bn <= 128 and 2 * (self.layout["total"] + KB) <= SM_SMEM:
            return 2
        return 1

    @property
    def reduce_chunk(self) -> int:
        """float4 loads in flight per thread in one pair's split-K reduction (fit the consumer's registers): the
        largest divisor of the thread's float4 count up to 16 (8 with two blocks per SM), so no chunk reads past the
        thread's fragment (BN = 96 or 192 give 12 or 24 float4)."""
        vecs, limit = self.units, (16 if self.blocks_per_sm == 1 else 8)
        return max(d for d in range(1, limit + 1) if vecs % d == 0)

    @property
    def regs(self) -> tuple[int | None, int | None]:
        """setmaxnreg's (producer, consumer) targets; None: no setmaxnreg. The interleave node's producer warpgroup
        stages A in three of its warps, whose loads and stores need more than the TMA thread's 40 registers, and its
        consumer reads A from shared memory, so both keep the launch bounds' share."""
        return (None, None) if self.interleave else REG_BUDGET[(self.consumer_wgs, self.blocks_per_sm)]

    @property
    def wg_m(self) -> int:
        """Rows per consumer warpgroup: BM split between the warpgroups, or all of BM when they split K."""
        return self.bm if self.block_reduce else self.bm // self.consumer_wgs

    @property
    def slabs(self) -> int:
        return self.wg_m // 64

    @property
    def atom_k(self) -> int:
        """Elements of one swizzled shared-memory row (the TMA box's inner extent)."""
        return 8 << self.swizzle_bits

    @property
    def row_bytes(self) -> int:
        return 16 << self.swizzle_bits

    @property
    def k_blocks(self) -> int:
        return self.bk // self.atom_k

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumer_wgs)

    @property
    def a_kblock_bytes(self) -> int:
        return _round_up(self.bm * self.row_bytes, 1024)

    @property
    def b_kblock_bytes(self) -> int:
        return _round_up(self.bn * self.row_bytes, 1024)

    @property
    def a_stage_bytes(self) -> int:
        return self.k_blocks * self.a_kblock_bytes

    @property
    def b_stage_bytes(self) -> int:
        return self.k_blocks * self.b_kblock_bytes

    @property
    def tx_bytes(self) -> int:
        """Bytes the TMA boxes of one stage deliver (out-of-bounds fill included: a box always lands whole)."""
        return (self.bm + self.bn) * self.bk * DTYPE_BYTES[self.in_dtype]

    @property
    def c_stage_bytes(self) -> int:
        return self.bm * self.bn * DTYPE_BYTES[self.out_dtype] if self.epilogue in ("smem", "tma") else 0

    @property
    def layout(self) -> dict[str, int]:
        """Byte offsets in dynamic shared memory. The rings come first so every stage buffer starts on a 1024-byte
        boundary, the period of the 128-byte swizzle (TMA and wgmma both apply it to address bits [4, 10))."""
        a = 0
        b = a + self.stages * self.a_stage_bytes
        c = b + self.stages * self.b_stage_bytes
        bars = _round_up(c + self.c_stage_bytes, 8)
        flag = bars + 2 * self.stages * 8                 # split-K: "this block reduces the tile" broadcast
        recv_bar = flag + (8 if self.tree else 0)         # reduce=cluster: the receive buffer's mbarrier
        recv = _round_up(recv_bar + 8, 16) if self.cluster_reduce else recv_bar
        tail = recv + self.receive_bytes                  # interleave: the tail's 4 warp sums
        total = tail + (16 if self.interleave else 0)
        return {"a": a, "b": b, "c": c, "bars": bars, "flag": flag, "recv_bar": recv_bar, "recv": recv,
                "tail": tail, "total": total}

    @property
    def units(self) -> int:
        """Fragment units (float4s of accumulators) per consumer thread (l2ir.indexing.ClusterReduce.units)."""
        return ClusterReduce.units(self.wg_m, self.bn)

    @property
    def receive_bytes(self) -> int:
        """reduce=cluster: the receive buffer the other blocks push this block's units into
        (l2ir.analysis.cluster_receive_bytes counts it with its mbarrier and alignment, 16 bytes more)."""
        if not self.cluster_reduce:
            return 0
        return 16 * ClusterReduce(self.slices).receive_vecs(self.units, 128 * self.consumer_wgs)

    @property
    def partial_floats(self) -> int:
        """fp32 values of one slice's partial tile in the workspace (BM x BN, in the accumulator fragment order)."""
        return self.bm * self.bn


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------------------------------------------------------
# canonicalize
# ---------------------------------------------------------------------------------------------------------------


def _swizzle_bits(swz: Swizzle, bk: int) -> tuple[int, str]:
    if swz.smem is None:
        for bits in (3, 2, 1):
            if bk % (8 << bits) == 0:
                return bits, f"none -> <{bits},3,3> (widest swizzle whose row divides BK={bk})"
        raise UnsupportedLowering("swizzle.smem", f"none: BK={bk} holds no whole 32-byte swizzle row")
    b, m, s = swz.smem
    if (m, s) != (3, 3) or b not in DESC_SWIZZLE_MODE:
        raise UnsupportedLowering("swizzle.smem", f"<{b},{m},{s}>: TMA and wgmma share the 32/64/128-byte swizzles "
                                  "<1,3,3>, <2,3,3>, <3,3,3> of 16-bit data")
    if bk % (8 << b):
        raise UnsupportedLowering("swizzle.smem", f"<{b},3,3> swizzles rows of {8 << b} elements; BK={bk} is not a "
                                  "whole number of them")
    return b, f"<{b},3,3>"


def canonicalize(kernel: Kernel, problem: Problem, num_sms: int = H200_SMS) -> PtxConfig:
    """Check that the kernel is one this backend lowers and turn each IR field into its value in the source."""
    if kernel.is_source:
        raise UnsupportedLowering("source", "free-form CUDA is not generated by this backend")
    if kernel.target.arch != "sm90a":
        raise UnsupportedLowering("target.arch", f"'{kernel.target.arch}': wgmma and setmaxnreg need sm90a")
    verify(kernel)
    verify_problem(problem)
    tile, mma, pipe, pad, epi = kernel.tile, kernel.mma, kernel.pipeline, kernel.pad, kernel.epilogue
    swz = kernel.swizzle or Swizzle()

    if mma.op != "wgmma":
        raise UnsupportedLowering("mma.op", f"'{mma.op}': the sm90a rule issues wgmma")
    if pipe.mode != "tma_ws":
        raise UnsupportedLowering("pipeline.mode", f"'{pipe.mode}': the sm90a rule lowers TMA warp-specialized "
                                  "pipelines")
    # The verifier ties the schedule to tile.warps: cooperative = 8x1, pingpong = 4x1 (one warpgroup per tile).
    # Without a persistent loop a block owns one tile, so ping-pong has no second tile to alternate with: it lowers to
    # one consumer warpgroup per block (256 threads), the latency-bound family. The alternating persistent form is not
    # generated.
    if pipe.schedule == "pingpong" and pipe.persistent:
        raise UnsupportedLowering("pipeline.schedule", "pingpong with persistent=true: two consumer warpgroups "
                                  "alternating tiles is not generated; set pipeline.persistent = false (one tile "
                                  "per block on one consumer warpgroup, tile.warps=4x1)")
    if pipe.schedule not in ("cooperative", "pingpong"):
        raise UnsupportedLowering("pipeline.schedule", f"'{pipe.schedule}': cooperative or pingpong")
    if pipe.prefetch:
        raise UnsupportedLowering("pipeline.prefetch", "wgmma reads shared memory; there are no fragments to prefetch")
    if tile.cluster != (1, 1) and multicast(kernel) is None:
        raise UnsupportedLowering("tile.cluster", f"{tile.cluster[0]}x{tile.cluster[1]} with "
                                  f"{'pipeline.persistent=true' if pipe.persistent else f'splitk mode={kernel.splitk.mode} reduce={kernel.splitk.reduce}'}: TMA multicast is "
                                  "generated for one tile per block (pipeline.persistent=false), with split-K only "
                                  "through the workspace")
    slices = 1
    if kernel.splitk is not None:
        sk = kernel.splitk
        if sk.mode != "split_k":
            raise UnsupportedLowering("splitk", f"mode={sk.mode}: stream-K is not generated; split_k is (slices "
                                      "reduced in the kernel through the workspace)")
        if sk.reduce == "atomic":
            raise UnsupportedLowering("splitk", f"reduce={sk.reduce}: fp32 atomics into C are not generated (and "
                                      "not deterministic); reduce=workspace or cluster sums the slices in a fixed "
                                      "order")
        if sk.reduce in ("cluster", "block") and epi.path != "direct":
            raise UnsupportedLowering("epilogue.path", f"{epi.path} with splitk reduce={sk.reduce}: each "
                                      f"{'block' if sk.reduce == 'cluster' else 'warpgroup'} stores only its share "
                                      "of the tile's fragments, straight from registers; use direct")
        slices = sk.slices

    # Problem class: K-major A and B are wgmma's native (non-transposed) descriptor layout.
    check_problem_class(problem)
    if kernel.repack is not None and kernel.repack.operands != "ab":
        raise UnsupportedLowering("repack.operands", f"{kernel.repack.operands}: K-major A and B share K, so an odd K "
                                  "misaligns both and a copy of one alone never lets the GEMM run; use ab")

    bm, bn, bk = tile.block
    wgs = 2 if pipe.schedule == "cooperative" else 1
    if tile.warps != (4 * wgs, 1):
        raise UnsupportedLowering("tile.warps", f"{tile.warps[0]}x{tile.warps[1]}: {pipe.schedule} uses "
                                  f"{4 * wgs}x1")
    stacked = warpgroups_m(kernel)       # 1 with reduce=block: both warpgroups cover all BM rows
    if bm % (64 * stacked):
        raise UnsupportedLowering("tile.block", f"BM={bm}: {stacked} warpgroup(s) of whole 64-row wgmma slabs need "
                                  f"BM % {64 * stacked} == 0")
    if bm > TMA_BOX_MAX or bn > TMA_BOX_MAX:
        raise UnsupportedLowering("tile.block", f"{bm}x{bn}: one TMA box spans at most {TMA_BOX_MAX} rows")
    if tuple(mma.shape) != (64, bn, 16):
        raise UnsupportedLowering("mma.shape", f"{'x'.join(map(str, mma.shape))}: each warpgroup issues "
                                  f"64x{bn}x16 (the whole BN in one instruction)")
    bits, swizzle_field = _swizzle_bits(swz, bk)
    cm, cn = tile.cluster
    if bm % (8 * cn) or bn % (8 * cm):
        raise UnsupportedLowering("tile.cluster", f"{cm}x{cn} with {bm}x{bn} tiles: each block multicasts BM/CN = "
                                  f"{bm / cn:g} rows of A and BN/CM = {bn / cm:g} rows of B, which must be whole "
                                  "8-row swizzle atoms")

    if kernel.interleave is not None:
        pass    # pad.align=1 (the verifier): B's view has a pitch of 8K elements and A's stages are plain loads
    elif pad.align != 8:
        raise UnsupportedLowering("pad.align", f"{pad.align}: TMA needs 16-byte strides (align 8)")
    for dim in ("m", "n", "k"):
        if getattr(pad, dim) not in ("zero_fill", "divisible"):
            raise UnsupportedLowering(f"pad.{dim}", f"{getattr(pad, dim)}: TMA loads are zero-filled, not predicated")

    if epi.path == "tma":
        if DTYPE_BYTES[problem.c[0]] != 2:
            raise UnsupportedLowering("epilogue.path", f"tma with c={problem.c[0]}: the store boxes are laid out for "
                                      "2-byte C (fp16, bf16)")
        box_cols = tma_store_box_cols(2)
        if tile.block[1] % box_cols:
            raise UnsupportedLowering("epilogue.path", f"tma with BN={tile.block[1]}: C is stored in boxes of "
                                      f"{box_cols} columns, so BN must be a multiple of {box_cols}")
        if epi.vector != 8:
            raise UnsupportedLowering("epilogue.vector", f"{epi.vector} with path=tma: TMA moves 16-byte units of "
                                      "C (set vector=8; N must be a multiple of 8)")
        if kernel.splitk is not None:
            raise UnsupportedLowering("epilogue.path", "tma with split-K: the reductions store through the direct "
                                      "or smem epilogue")
    if epi.path == "direct" and epi.vector > 2:
        raise UnsupportedLowering("epilogue.vector", f"{epi.vector} with path=direct: a thread's accumulator fragment "
                                  "holds 2 adjacent columns; use path=smem for wider stores")

    # epilogue.path=tma stages the whole BM x BN tile (CUTLASS's TMA epilogue, which analysis counts, double-buffers
    # sub-tiles), so an auto ring fills what that leaves.
    stages = resolved_stages(kernel, epilogue_bytes=(tile.block[0] * tile.block[1] * DTYPE_BYTES[problem.c[0]]
                                                     if epi.path == "tma" else None))
    if stages < 2:
        # One stage cannot be refilled while it is read: the consumer releases a stage only after waiting on the next.
        raise ResourceError("pipeline", "smem_layout", f"{stages} stage(s) of {tile.block[0]}x{tile.block[1]}x"
                            f"{tile.block[2]} fit beside the {epi.path} epilogue's staging; the ring needs at least 2 "
                            "(use a smaller tile or BK)")
    cfg = PtxConfig(
        in_dtype=problem.a[0], out_dtype=problem.c[0],
        problem_class=print_problem_class(problem),
        bm=bm, bn=bn, bk=bk, consumer_wgs=wgs, stages=stages, stages_field=str(pipe.stages),
        persistent=pipe.persistent, num_sms=num_sms, raster=swz.raster, group=swz.group,
        swizzle_bits=bits, swizzle_field=swizzle_field,
        divisible=(pad.m == "divisible", pad.n == "divisible", pad.k == "divisible"),
        epilogue=epi.path, vector=epi.vector, slices=slices,
        cluster_reduce=cluster_reduce(kernel), block_reduce=block_reduce(kernel),
        repack=kernel.repack.operands if kernel.repack is not None else "",
        cluster=tuple(tile.cluster),
        interleave=kernel.interleave is not None,
    )
    total, limit = cfg.layout["total"], SMEM_LIMIT["sm90a"]
    if total > limit:
        raise ResourceError("pipeline", "smem_layout", f"{stages} stages of {cfg.a_stage_bytes + cfg.b_stage_bytes} B "
                            f"+ {cfg.c_stage_bytes} B epilogue + barriers = {total} B exceed {limit} B")
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# render
# ---------------------------------------------------------------------------------------------------------------


def _wgmma_function(cfg: PtxConfig) -> list[str]:
    """One wgmma m64nNk16 with both operands from shared memory. scale-d = 0 on a tile's first k-step makes the
    instruction overwrite the accumulators, so they are never zeroed by other instructions between wgmmas."""
    n, nr, t = cfg.bn, cfg.bn // 2, cfg.in_dtype
    regs = [f"%{i}" for i in range(nr)]
    reg_lines = [", ".join(regs[i:i + 16]) for i in range(0, nr, 16)]
    outs = [f'"+f"(d[{i}])' for i in range(nr)]
    out_lines = [", ".join(outs[i:i + 8]) for i in range(0, nr, 8)]
    lines = [
        f"// wgmma.mma_async m64n{n}k16, A and B from shared memory (descriptors), fp32 accumulators: {nr} per thread.",
        "// imm-scale-a/b = 1, imm-trans-a/b = 0: both operands K-major, as TMA wrote them.",
        f"__device__ __forceinline__ void wgmma_m64n{n}k16(float (&d)[{nr}], uint64_t desc_a, uint64_t desc_b,",
        "                                                  uint32_t scale_d) {",
        "  asm volatile(",
        '      "{\\n"',
        '      ".reg .pred p;\\n"',
        f'      "setp.ne.b32 p, %{nr + 2}, 0;\\n"',
        f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}\\n"',
    ]
    for i, rl in enumerate(reg_lines):
        open_, close = ("{" if i == 0 else ""), ("}," if i == len(reg_lines) - 1 else ",")
        lines.append(f'      "  {open_}{rl}{close}\\n"')
    lines += [
        f'      "  %{nr}, %{nr + 1}, p, 1, 1, 0, 0;\\n"',
        '      "}\\n"',
    ]
    for i, ol in enumerate(out_lines):
        lines.append(("      : " if i == 0 else "        ") + ol + ("," if i < len(out_lines) - 1 else ""))
    lines += [
        '      : "l"(desc_a), "l"(desc_b), "r"(scale_d));',
        "}",
    ]
    return lines


def _tile_loop(cfg: PtxConfig, indent: str) -> list[str]:
    """The tile loop header, the rasterized tile coordinates (l2ir.indexing.rasterize, rendered) and, with split-K,
    the slice's k-tile range (l2ir.indexing.splitk_range, rendered: the interpreter's and the verifier's partition)."""
    mc = cfg.multicast
    tile_m, tile_n = rasterize(cfg.raster, cfg.group) if mc is None else mc.tile(cfg.raster, cfg.group)
    if mc is not None and cfg.split:
        pid, slice_ = mc.unit()
        head = [
            f"{indent}// tile.cluster={mc.cm}x{mc.cn} with splitk slices={cfg.slices}: the launch is SLICES copies of the cluster",
            f"{indent}// grid, slice after slice (l2ir.indexing.ClusterMulticast.unit), so a cluster's blocks load one K",
            f"{indent}// slice's k tiles for each other. Block pid of its slice is rank pid % CLUSTER_SIZE of cluster",
            f"{indent}// pid / CLUSTER_SIZE, whose patch of tiles is rasterized over the patch grid (ClusterMulticast.tile).",
            f"{indent}for (int unit = blockIdx.x; unit < num_units; unit = num_units) {{",
            f"{indent}  const int pid = {pid.to_cpp()};",
            f"{indent}  const int slice = {slice_.to_cpp()};",
        ]
    elif mc is not None:
        head = [
            f"{indent}// tile.cluster={mc.cm}x{mc.cn}: one tile per block. Block pid is rank pid % CLUSTER_SIZE of cluster",
            f"{indent}// pid / CLUSTER_SIZE, whose CLUSTER_M x CLUSTER_N patch of tiles is rasterized over the patch grid",
            f"{indent}// (l2ir.indexing.ClusterMulticast.tile). Every block runs the K loop, its tile in the grid or not.",
            f"{indent}for (int pid = blockIdx.x; pid < num_blocks; pid = num_blocks) {{",
        ]
    elif cfg.cluster_reduce:
        head = [
            f"{indent}// splitk mode=split_k slices={cfg.slices} reduce=cluster: one cluster of SLICES consecutive blocks per",
            f"{indent}// tile, so work unit = tile * SLICES + slice and the slice is the block's rank in its cluster",
            f"{indent}// (%cluster_ctarank = blockIdx.x % SLICES for a 1-D cluster). One unit per block.",
            f"{indent}for (int unit = blockIdx.x; unit < num_units; unit = num_units) {{",
            f"{indent}  const int pid = unit / SLICES;",
            f"{indent}  const int slice = unit % SLICES;",
        ]
    elif cfg.split:
        # Non-persistent: `unit = num_units` ends the loop after one pass in a way the compiler sees, so nothing
        # of a next pass (k_tiles, the raster divisors) stays live across the main loop and the reduction.
        step = "unit += gridDim.x" if cfg.persistent else "unit = num_units"
        head = [
            f"{indent}// splitk mode=split_k slices={cfg.slices}: work unit = slice * num_tiles + tile, so blocks that run",
            f"{indent}// together cover the tiles of one K range and share its A slice in L2.",
            f"{indent}// " + ("pipeline.persistent=true: grid = min(units, NUM_SMS); each block walks units unit, "
                              "unit + gridDim.x, ..." if cfg.persistent else
                              "pipeline.persistent=false: one block per (tile, slice) unit."),
            f"{indent}for (int unit = blockIdx.x; unit < num_units; {step}) {{",
            f"{indent}  const int pid = unit % num_tiles;",
            f"{indent}  const int slice = unit / num_tiles;",
        ]
    elif cfg.persistent:
        head = [f"{indent}// pipeline.persistent=true: grid = min(tiles, NUM_SMS); each block walks tiles pid, "
                "pid + gridDim.x, ...",
                f"{indent}for (int pid = blockIdx.x; pid < num_tiles; pid += gridDim.x) {{"]
    else:
        head = [f"{indent}// pipeline.persistent=false: one block per output tile.",
                f"{indent}for (int pid = blockIdx.x; pid < num_tiles; pid += num_tiles) {{"]
    split = []
    if cfg.split:
        begin, end = splitk_range(cfg.slices)
        split = [f"{indent}  // k tiles [kt_begin, kt_end) of this slice (l2ir.indexing.splitk_range)",
                 f"{indent}  const int kt_begin = {begin.to_cpp()};",
                 f"{indent}  const int kt_end = {end.to_cpp()};"]
    coords = [
        f"{indent}  // swizzle.raster={cfg.raster} group={cfg.group} (l2ir.indexing."
        + ("rasterize)" if mc is None else "ClusterMulticast.tile)"),
        f"{indent}  const int tile_m = {tile_m.to_cpp()};",
        f"{indent}  const int tile_n = {tile_n.to_cpp()};",
    ]
    if not cfg.interleave:
        return head + split + coords
    # interleave: the tile's k tiles depend on its residue's offset, so its slice range follows its coordinates.
    return head + coords + [
        f"{indent}  // interleave: column tile tile_n is residue r of n mod VIEW, view rows [view0, view0 + BN): C's",
        f"{indent}  // columns VIEW * j + r. A TMA box starts on a 16-byte boundary (an element start is an illegal",
        f"{indent}  // instruction), so the view reads each row from `offset` elements before it, the boundary below",
        f"{indent}  // element r * K (every row of the residue shares it): K + offset elements, whose first `offset`",
        f"{indent}  // belong to the row before (l2ir.indexing.Interleave).",
        f"{indent}  const int residue = {Interleave.residue().to_cpp()};",
        f"{indent}  const int view0 = {Interleave.first_row(cfg.bn).to_cpp()};",
        f"{indent}  const int offset = {Interleave.offset().to_cpp().replace('elem', '(residue * K)')};",
        f"{indent}  const int k_tiles = {Interleave.k_tiles(Var('K'), Var('offset'), cfg.bk).to_cpp()};   // this tile's",
    ] + split


def _splitk_reduce(cfg: PtxConfig) -> list[str]:
    """split-K, reduce=workspace: the pairwise tree of l2ir.indexing.SplitKTree. At each level whose sibling subtree
    exists the block stores its registers (its subtree's sum) to slot `base`, fences and counts itself in on the
    pair's counter; the first arrival is done with the tile, the second adds the sibling's slot to its registers,
    resets the counter and goes up a level. The block that completes the root runs the epilogue. Each pair's sum has
    the same bits whichever of its blocks arrives last (fp32 addition commutes), so C is bit-identical run to run and
    equals l2ir.interp's reduction; no block ever waits for another, so no schedule of the grid can deadlock; the
    critical path reads ceil(log2 S) partials instead of S."""
    nr = cfg.bn // 2
    tree = SplitKTree(cfg.slices)
    tile = "pid" if cfg.multicast is None else "tile_id"
    return [
        "      // ---- splitk reduce=workspace: a pairwise tree over the slices (l2ir.indexing.SplitKTree) ----",
        "      const int ct = threadIdx.x - 128;   // consumer thread 0 .. CONSUMER_THREADS - 1",
        "      if (kt_begin == kt_end) {   // an empty K range (the verifier admits none) contributes zeros",
        "#pragma unroll",
        "        for (int j = 0; j < SLABS; ++j)",
        "#pragma unroll",
        f"          for (int i = 0; i < {nr}; ++i) acc[j][i] = 0.f;",
        "      }",
        "      // A slot keeps the accumulator fragment order, float4 u of every consumer thread side by side: each warp",
        "      // stores 512 contiguous bytes, and the sibling's block reads them back in the same order (thread ct only",
        "      // ever touches its own float4s of a slot, in both blocks).",
        *([] if cfg.multicast is None else [
            "      // tile.cluster: pid numbers the cluster grid's blocks; the workspace is laid out by output tile.",
            f"      const int tile_id = {ClusterMulticast.slot().to_cpp()};   // ClusterMulticast.slot"]),
        f"      float* tile_ws = ws + (size_t){tile} * SLICES * PARTIAL_FLOATS;",
        f"      unsigned* tile_counters = counters + (size_t){tile} * TREE_NODES;",
        "      volatile uint32_t* reduce_flag = reinterpret_cast<volatile uint32_t*>(smem + SMEM_FLAG);",
        "      int base = slice;      // the slot (and lowest slice) of the subtree whose sum the registers hold",
        "      // A warp's 16 rows of slab j all at or past M (a skinny M in a 64-row slab): C never gets them, so their",
        "      // partials are neither stored nor added (warp-uniform; at M = 17 half the tile's bytes).",
        "      bool rows_live[SLABS];",
        "#pragma unroll",
        "      for (int j = 0; j < SLABS; ++j) rows_live[j] = tile_m * BM + cw * WG_M + 64 * j + 16 * warp < M;",
        "      bool carries = true;   // false once a sibling's block carries this block's sum on",
        "#pragma unroll 1",
        "      for (int level = 0; level < TREE_LEVELS; ++level) {",
        f"        const int sibling = {tree.sibling.to_cpp()};   // SplitKTree.sibling",
        "        if (sibling >= SLICES) continue;   // no sibling subtree (S not a power of two): up a level, no wait",
        "        {",
        "          float4* mine = reinterpret_cast<float4*>(tile_ws + (size_t)base * PARTIAL_FLOATS) + ct;",
        "#pragma unroll",
        "          for (int j = 0; j < SLABS; ++j)",
        "#pragma unroll",
        "            for (int q = 0; q < WGMMA_N / 8; ++q)   // float4 u = j * (WGMMA_N / 8) + q of this thread",
        "              if (rows_live[j])",
        "                __stcg(mine + (j * (WGMMA_N / 8) + q) * CONSUMER_THREADS,   // L2 only: another SM reads it",
        "                       make_float4(acc[j][4 * q], acc[j][4 * q + 1], acc[j][4 * q + 2], acc[j][4 * q + 3]));",
        "        }",
        "        // Release: this thread's partial is visible device-wide before the arrival that announces it.",
        "        __threadfence();",
        "        // Named barrier 3 (1 and 2 belong to the warpgroups' epilogues): the consumer threads only.",
        '        asm volatile("bar.sync 3, %0;" :: "n"(CONSUMER_THREADS) : "memory");',
        "        if (ct == 0) {",
        f"          const int node = {tree.counter.to_cpp()};   // SplitKTree.counter",
        "          const bool last = atomicAdd(tile_counters + node, 1u) == 1u;",
        "          if (last) __threadfence();   // acquire before the barrier hands the decision to the other threads",
        "          // Self-cleaning: both subtrees of this pair have arrived, so nothing reads its counter again in this",
        "          // launch; zero it for the next one (the workspace is zeroed once, before the first launch).",
        "          if (last) tile_counters[node] = 0u;",
        "          *reduce_flag = last ? 1u : 0u;",
        "        }",
        '        asm volatile("bar.sync 3, %0;" :: "n"(CONSUMER_THREADS) : "memory");',
        "        if (*reduce_flag == 0u) { carries = false; break; }   // the sibling's block carries the sum on",
        "        // Acquire: the sibling's partial, announced before its arrival, is visible from here on.",
        "        __threadfence();",
        "        // registers += sibling, the same bits as sibling + registers: whichever block is last, the pair's sum is",
        "        // one value. The float4s go in chunks (PtxConfig.reduce_chunk): 8-16 loads in flight per thread keep the",
        "        // SM's L2 reads busy, while a whole BN=256 slab (32 float4 = 128 registers on top of the 128",
        "        // accumulators) would spill.",
        "        const float4* src = reinterpret_cast<const float4*>(tile_ws + (size_t)sibling * PARTIAL_FLOATS) + ct;",
        "        constexpr int VECS = SLABS * WGMMA_N / 8;   // float4s per consumer thread",
        f"        constexpr int CHUNK = {cfg.reduce_chunk};   // divides VECS",
        "#pragma unroll",
        "        for (int u0 = 0; u0 < VECS; u0 += CHUNK) {",
        "          float4 v[CHUNK];",
        "#pragma unroll",
        "          for (int i = 0; i < CHUNK; ++i)",
        "            if (rows_live[(u0 + i) / (WGMMA_N / 8)]) v[i] = __ldcg(src + (u0 + i) * CONSUMER_THREADS);",
        "#pragma unroll",
        "          for (int i = 0; i < CHUNK; ++i) {",
        "            const int j = (u0 + i) / (WGMMA_N / 8), q = (u0 + i) % (WGMMA_N / 8);",
        "            if (!rows_live[j]) continue;",
        "            acc[j][4 * q] += v[i].x; acc[j][4 * q + 1] += v[i].y;",
        "            acc[j][4 * q + 2] += v[i].z; acc[j][4 * q + 3] += v[i].w;",
        "          }",
        "        }",
        f"        base = {tree.merged.to_cpp()};   // SplitKTree.merged: the pair's sum is the lower subtree's",
        "      }",
        "      if (!carries) continue;   // another block of this tile completes the tree and stores it",
    ]


def _interleave_a_writers(cfg: PtxConfig) -> list[str]:
    """interleave: the producer warpgroup's warps 1-3 write A's stage of each k tile, the tile's BM rows shifted by
    the view's offset to meet B's (A's columns kt * BK - offset + [0, BK)), zero outside the row and past M, in the
    swizzled K-major layout TMA would have written, so the consumer's wgmma reads A from a descriptor as in every
    other kernel. TMA cannot take these rows: with K mod 8 != 0 each row of A starts on its own 2-byte boundary, and a
    box's inner start off a 16-byte boundary is an illegal instruction. The writers run ahead of the consumer by the
    ring's depth like the TMA thread, so A's L2 round trips overlap B's stream (with A's fragments loaded into
    registers one k tile ahead instead, this form ran 1.1-1.26x slower than the cp.async form on the H100,
    bench/NOTES.md). Each writer thread takes 16-byte chunks (8 columns of a row): all its loads first, then its
    stores, then the proxy fence that orders its generic stores before wgmma's async-proxy reads, then its arrival
    on the stage's `full` barrier (1 + A_WRITERS arrivals, the TMA bytes besides)."""
    return [
        "    } else if (threadIdx.x >= 32) {",
        "      // ---- interleave: warps 1-3 write A's stages (the TMA thread's warp keeps to B) ----",
        '      asm volatile("griddepcontrol.wait;" ::: "memory");   // A may be the previous grid\'s output',
        "      const int wt = threadIdx.x - 32;",
        "      const unsigned short* a16 = reinterpret_cast<const unsigned short*>(A);",
        "      int stage = 0;",
        "      uint32_t phase = 0;",
        *_tile_loop(cfg, "      "),
        "        (void)view0;   // B's rows; A's are the tile's rows of M",
        f"        for (int kt = {cfg.k_first}; kt < {cfg.k_last}; ++kt) {{",
        "          mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);   // the stage is free (as for the TMA thread)",
        "          const uint32_t a_stage = smem_base + SMEM_A + stage * A_STAGE_BYTES;",
        "          for (int i0 = 0; i0 < A_ROUNDS; i0 += A_BATCH) {",
        "            uint32_t v[A_BATCH][4];",
        "#pragma unroll",
        "            for (int i = 0; i < A_BATCH; ++i) {",
        "              // chunk q: row q / (BK / 8) of the tile, its columns 8 (q % (BK / 8)) + [0, 8) of the k tile",
        "              const int q = wt + A_WRITERS * (i0 + i);",
        "              const int row = tile_m * BM + q / (BK / 8);",
        "              const int k = kt * BK + 8 * (q % (BK / 8)) - offset;   // the view's column -> A's",
        "              const bool live = q < A_CHUNKS && row < M;",
        "              const unsigned short* p = a16 + (size_t)row * K + k;",
        "#pragma unroll",
        "              for (int e = 0; e < 4; ++e) {",
        "                const uint32_t lo = live && k + 2 * e >= 0 && k + 2 * e < K ? __ldg(p + 2 * e) : 0u;",
        "                const uint32_t hi = live && k + 2 * e + 1 >= 0 && k + 2 * e + 1 < K ? __ldg(p + 2 * e + 1) : 0u;",
        "                v[i][e] = lo | (hi << 16);",
        "              }",
        "            }",
        "#pragma unroll",
        "            for (int i = 0; i < A_BATCH; ++i) {",
        "              const int q = wt + A_WRITERS * (i0 + i);",
        "              if (q >= A_CHUNKS) break;",
        "              const int r = q / (BK / 8), c = 8 * (q % (BK / 8));",
        "              // byte offset of the chunk in its k block, before the swizzle",
        "              const uint32_t o = r * ROW_BYTES + (c % ATOM_K) * sizeof(InT);",
        "              const uint32_t dst = a_stage + (c / ATOM_K) * A_KBLOCK_BYTES + swizzled(o);",
        '              asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"',
        '                           :: "r"(dst), "r"(v[i][0]), "r"(v[i][1]), "r"(v[i][2]), "r"(v[i][3]) : "memory");',
        "            }",
        "          }",
        '          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic stores -> wgmma\'s reads',
        "          mbar_arrive(bars + 8 * stage);",
        "          if (++stage == STAGES) { stage = 0; phase ^= 1; }",
        "        }",
        "      }",
    ]


def _interleave_k_tail() -> list[str]:
    """interleave: the first k tile's columns before `offset` and the last one's past K + offset hold the
    neighbouring rows' elements (a view row starts inside the row before and runs on into the next), which TMA
    cannot fill with zeros: the consumer warpgroup zeroes B's (A's writers store zeros there, and 0 x Inf is NaN:
    zeros in one operand are not enough), then makes its generic stores visible to the async proxy wgmma reads
    through, and meets at a named barrier before any warp issues the k tile."""
    return [
        "        // interleave: the view's columns before the row (k < offset) and past it (k >= K + offset).",
        "        const int k_lo = max(0, offset - kt * BK), k_hi = min(BK, K + offset - kt * BK);",
        "        if (k_lo > 0 || k_hi < BK) {   // the first or the last k tile of the view",
        "          const int width = k_lo + BK - k_hi;   // columns [0, k_lo) and [k_hi, BK)",
        "          const uint32_t b_base = smem_base + SMEM_B + stage * B_STAGE_BYTES;",
        "          for (int e = tid; e < BN * width; e += 128) {",
        "            const int r = e / width, c = e % width, k = c < k_lo ? c : k_hi + c - k_lo;",
        "            // byte offset of the element in its k block, before the swizzle",
        "            const uint32_t o = r * ROW_BYTES + (k % ATOM_K) * sizeof(InT);",
        "            const uint32_t dst = b_base + (k / ATOM_K) * B_KBLOCK_BYTES + swizzled(o);",
        '            asm volatile("st.shared.u16 [%0], %1;" :: "r"(dst), "h"((unsigned short)0) : "memory");',
        "          }",
        '          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic stores -> wgmma\'s reads',
        '          asm volatile("bar.sync 4, 128;" ::: "memory");   // named barrier 4: this warpgroup\'s 128 threads',
        "        }",
    ]


def _epilogue_interleave(cfg: PtxConfig) -> list[str]:
    """interleave: the direct epilogue with the tile's columns VIEW apart: fragment column c of the tile is view
    row view0 + c, C's column VIEW * (view0 + c) + residue, stored one element at a time where that view row is one
    of the map's (the tail stores the columns past them) and the row is inside M."""
    return [
        "      // epilogue.path=direct, interleave: fragment d[4c + 2h + e] of slab s is row 64s + 16*warp + lane/4 + 8h and view row",
        "      // view0 + 8c + 2*(lane%4) + e, C's column VIEW * (view row) + residue: single 2-byte stores.",
        "      const int row0 = tile_m * BM + warp * 16 + lane / 4;",
        "      const int j0 = view0 + 2 * (lane % 4);",
        "#pragma unroll",
        "      for (int s = 0; s < SLABS; ++s) {",
        "#pragma unroll",
        "        for (int c = 0; c < WGMMA_N / 8; ++c) {",
        "#pragma unroll",
        "          for (int h = 0; h < 2; ++h) {",
        "            const int row = row0 + 64 * s + 8 * h;",
        "            if (row >= M) continue;",
        "#pragma unroll",
        "            for (int e = 0; e < 2; ++e) {",
        "              const int j = j0 + 8 * c + e;",
        "              if (j < view_rows)",
        "                C[(size_t)row * N + (size_t)VIEW * j + residue] = to_out(acc[s][4 * c + 2 * h + e]);",
        "            }",
        "          }",
        "        }",
        "      }",
    ]


def _interleave_tail() -> list[str]:
    """interleave: the N mod VIEW columns past the view (Interleave.tail_row / tail_column, rendered), one fp32 dot
    product per output, by the consumer warpgroup before its first k tile, while the ring's first TMA loads are in
    flight: block b takes outputs b, b + gridDim.x, ... (at 17x9999, 119 outputs: one for each of the first 119
    blocks), its 4 warps a quarter of K each, 16 loads of each operand in flight per lane, the warp sums met in
    shared memory. The loop is latency-bound (B's tail rows come from DRAM): one warp per output with 4 loads in
    flight ran 26 dependent rounds at K = 3333 and held its block's k loop back by about 15 us on the H100, the SMs
    active 66% of the kernel (bench/NOTES.md)."""
    n = Var("N")
    return [
        "    {",
        "      // ---- interleave: the tail, C's last N mod VIEW columns (Interleave.tail_row / tail_column) ----",
        f"      const int tail = M * ({Interleave.tail_columns(n).to_cpp()});",
        "      volatile float* sums = reinterpret_cast<volatile float*>(smem + SMEM_TAIL);",
        "      const int quarter = (K + 3) / 4;",
        "      for (int o = blockIdx.x; o < tail; o += gridDim.x) {",
        f"        const int row = {Interleave.tail_row(n).to_cpp()};",
        f"        const int col = {Interleave.tail_column(n).to_cpp()};",
        "        const InT* a = A + (size_t)row * K;",
        "        const InT* b = B + (size_t)col * K;   // B is K-major: column col of C is row col of B",
        "        const int k_end = min(K, (warp + 1) * quarter);",
        "        float sum = 0.f;",
        "#pragma unroll 16",
        "        for (int k = warp * quarter + lane; k < k_end; k += 32) sum += float(a[k]) * float(b[k]);",
        "#pragma unroll",
        "        for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);",
        "        if (lane == 0) sums[warp] = sum;",
        '        asm volatile("bar.sync 4, 128;" ::: "memory");   // named barrier 4: this warpgroup\'s 128 threads',
        "        if (tid == 0) C[(size_t)row * N + col] = to_out((sums[0] + sums[1]) + (sums[2] + sums[3]));",
        '        asm volatile("bar.sync 4, 128;" ::: "memory");   // the sums are read before the next output\'s',
        "      }",
        "    }",
    ]


def _epilogue_direct(cfg: PtxConfig) -> list[str]:
    if cfg.interleave:
        return _epilogue_interleave(cfg)
    dm, dn, _ = cfg.divisible
    lines = [
        "      // epilogue.path=direct: each thread stores its fragment straight to global memory. Fragment layout of",
        "      // wgmma m64nN f32: d[4c + 2h + e] is row 16*warp + lane/4 + 8h, column 8c + 2*(lane%4) + e.",
        ("      const int row0 = tile_m * BM + warp * 16 + lane / 4;   // reduce=block: each warpgroup spans BM"
         if cfg.block_reduce else "      const int row0 = tile_m * BM + cw * WG_M + warp * 16 + lane / 4;"),
        "      const int col0 = tile_n * BN + 2 * (lane % 4);",
        "#pragma unroll",
        "      for (int j = 0; j < SLABS; ++j) {",
        "#pragma unroll",
        "        for (int c = 0; c < WGMMA_N / 8; ++c) {",
        *([f"          const int fragment = {ClusterReduce(cfg.slices).unit(cfg.bn).to_cpp()};   // ClusterReduce.unit",
           f"          if ({ClusterReduce(cfg.slices).owner.to_cpp()} != slice) continue;   // reduce="
           + ("cluster: another block" if cfg.cluster_reduce else "block: the other warpgroup")
           + " stores this unit"] if cfg.shares_fragments else []),
        "          const int col = col0 + 8 * c;",
        "#pragma unroll",
        "          for (int h = 0; h < 2; ++h) {",
        "            const int row = row0 + 64 * j + 8 * h;",
        "            const float v0 = acc[j][4 * c + 2 * h], v1 = acc[j][4 * c + 2 * h + 1];",
        "            OutT* dst = C + (size_t)row * N + col;",
    ]
    guard_m = "" if dm else "row < M"
    if cfg.vector == 2:
        cond = " && ".join(x for x in (guard_m, "" if dn else "col < N") if x)
        note = ("pad.m/n=divisible: no bounds checks" if not cond else
                "bounds: N % 2 == 0 (checked by l2ir_run), so col < N covers the pair")
        lines += [f"            // epilogue.vector=2: one 4-byte store of the adjacent pair; {note}."]
        if cond:
            lines += [f"            if ({cond}) *reinterpret_cast<Out2T*>(dst) = pack2(v0, v1);"]
        else:
            lines += ["            *reinterpret_cast<Out2T*>(dst) = pack2(v0, v1);"]
    else:
        c0 = " && ".join(x for x in (guard_m, "" if dn else "col < N") if x)
        c1 = " && ".join(x for x in (guard_m, "" if dn else "col + 1 < N") if x)
        lines += ["            // epilogue.vector=1: two 2-byte stores, each predicated (any N)."]
        lines += [f"            {'if (' + c0 + ') ' if c0 else ''}dst[0] = to_out(v0);",
                  f"            {'if (' + c1 + ') ' if c1 else ''}dst[1] = to_out(v1);"]
    lines += ["          }", "        }", "      }"]
    return lines


def _stage_fragments(buffer: str, offset_lines: list[str]) -> list[str]:
    """The staged epilogues' fragment writes: each thread's accumulator pairs (row r, columns 8 c + 2 (lane % 4) and
    the next) as one packed store at byte `off` of `buffer`, which `offset_lines` compute from r, c and lane."""
    return [
        "#pragma unroll",
        "      for (int j = 0; j < SLABS; ++j) {",
        "#pragma unroll",
        "        for (int c = 0; c < WGMMA_N / 8; ++c) {",
        "#pragma unroll",
        "          for (int h = 0; h < 2; ++h) {",
        "            const int r = 64 * j + 16 * warp + lane / 4 + 8 * h;",
        *("            " + line for line in offset_lines),
        f"            *reinterpret_cast<Out2T*>({buffer} + off) = pack2(acc[j][4 * c + 2 * h], acc[j][4 * c + 2 * h + 1]);",
        "          }",
        "        }",
        "      }",
    ]


def _epilogue_smem(cfg: PtxConfig) -> list[str]:
    dm, dn, _ = cfg.divisible
    v = cfg.vector
    vec_t = {8: "uint4", 4: "uint2", 2: "uint32_t", 1: "uint16_t"}[v]
    cond = " && ".join(x for x in ("" if dm else "grow < M", "" if dn else "gcol < N") if x)
    store = f"*reinterpret_cast<{vec_t}*>(C + (size_t)grow * N + gcol) = *reinterpret_cast<const {vec_t}*>(c_tile + off);"
    return [
        "      // epilogue.path=smem: stage this warpgroup's WG_M x BN block in shared memory, then store whole rows",
        f"      // with {v * DTYPE_BYTES[cfg.out_dtype]}-byte vectors (epilogue.vector={v}), consecutive threads on "
        "consecutive addresses.",
        "      // The 16-byte chunk index is XORed with the row (C_SWZ_MASK): the 8 rows a warp writes per store land",
        "      // in 8 different chunks, so neither the fragment writes nor the row reads conflict on banks.",
        "      uint8_t* c_tile = smem + SMEM_C + cw * (WG_M * BN * (int)sizeof(OutT));",
        *_stage_fragments("c_tile", ["const int chunk = c ^ (r & C_SWZ_MASK);",
                                     "const int off = (r * BN + 8 * chunk + 2 * (lane % 4)) * (int)sizeof(OutT);"]),
        "      // Named barrier 1 + cw: only this warpgroup's 128 threads (the other one and the producer run on).",
        '      asm volatile("bar.sync %0, 128;" :: "r"(1 + cw) : "memory");',
        f"      constexpr int VEC = {v};",
        "      for (int i = tid; i < WG_M * BN / VEC; i += 128) {",
        "        const int r = i / (BN / VEC), col = (i % (BN / VEC)) * VEC;",
        "        const int off = (r * BN + 8 * ((col / 8) ^ (r & C_SWZ_MASK)) + col % 8) * (int)sizeof(OutT);",
        "        const int grow = tile_m * BM + cw * WG_M + r, gcol = tile_n * BN + col;",
        (f"        // bounds: N % VEC == 0 (checked by l2ir_run), so gcol < N covers the whole vector.\n"
         f"        if ({cond}) {store}" if cond else
         f"        // pad.m/n=divisible: l2ir_run admitted only whole tiles; no bounds checks.\n        {store}"),
        "      }",
        "      // The next tile's fragment writes must not overtake this tile's reads.",
        '      asm volatile("bar.sync %0, 128;" :: "r"(1 + cw) : "memory");',
    ]


def _epilogue_tma(cfg: PtxConfig) -> list[str]:
    box_cols = tma_store_box_cols(DTYPE_BYTES[cfg.out_dtype])
    offset = tma_store_staging(cfg.wg_m, box_cols).to_cpp()
    row0, col0 = tma_store_origin(cfg.bm, cfg.bn, cfg.wg_m, box_cols)
    return [
        "      // epilogue.path=tma: stage this warpgroup's WG_M x BN block as C_BOXES boxes of WG_M rows x 128 bytes,",
        "      // swizzled as TMA reads them (l2ir.indexing.tma_store_staging: the 16-byte chunk XOR row % 8, so the 8",
        "      // rows of a fragment store land on all 32 banks); one thread then hands the boxes to TMA, which clips",
        "      // rows past M and columns past N, and the warps go on to the next tile's wgmma while the store drains.",
        "      uint8_t* c_stage = smem + SMEM_C + cw * (WG_M * BN * (int)sizeof(OutT));",
        "      // The previous tile's bulk stores must have read this buffer before it is overwritten: the issuing",
        "      // thread waits for their reads (not their writes to global memory), then the warpgroup meets.",
        '      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");',
        '      asm volatile("bar.sync %0, 128;" :: "r"(1 + cw) : "memory");',
        *_stage_fragments("c_stage", ["const int col = 8 * c + 2 * (lane % 4);   // and col + 1: the same 16-byte chunk",
                                      f"const int off = ({offset}) * (int)sizeof(OutT);"]),
        "      // The fragment writes are generic-proxy stores; TMA reads through the async proxy.",
        '      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
        '      asm volatile("bar.sync %0, 128;" :: "r"(1 + cw) : "memory");',
        "      if (tid == 0) {",
        "#pragma unroll",
        "        for (int box = 0; box < C_BOXES; ++box) {",
        "          tma_store_2d(&tmap_c, smem_addr(c_stage) + box * (WG_M * C_BOX_COLS * (int)sizeof(OutT)),",
        f"                       {col0.to_cpp()}, {row0.to_cpp()});",
        "        }",
        '        asm volatile("cp.async.bulk.commit_group;" ::: "memory");',
        "      }",
    ]


def _c_swz_mask(bn: int) -> int:
    """XOR mask for the C staging swizzle: the largest power of two dividing the 16-byte chunks per row, up to 8
    (XORing inside an aligned group of chunks keeps every index inside the row)."""
    chunks = bn // 8
    p = 1
    while p < 8 and chunks % (2 * p) == 0:
        p *= 2
    return p - 1


def _header(cfg: PtxConfig) -> list[str]:
    """What generated the file, from which IR, the host-shim ABI, and the headers (sm_90a only)."""
    return [
        "// Generated by L2IR backends/cuda_ptx/sm90a.py from the kernel IR. Do not edit: change the IR and lower again.",
        "//",
        f"// problem class: {cfg.problem_class} (M, N, K are run-time arguments)",
        f"// tile {cfg.bm}x{cfg.bn}x{cfg.bk} {cfg.schedule_text}, wgmma 64x{cfg.bn}x16, "
        f"stages {cfg.stages} (pipeline.stages={cfg.stages_field}),",
        f"// swizzle {cfg.swizzle_field}, raster {cfg.raster}/{cfg.group}, persistent "
        f"{str(cfg.persistent).lower()}, epilogue {cfg.epilogue}/{cfg.vector}"
        + ("" if cfg.multicast is None else f", cluster {cfg.cluster[0]}x{cfg.cluster[1]} (TMA multicast)")
        + ("" if cfg.slices == 1 else f", splitk {cfg.slices} slices reduced in the "
           + ("cluster" if cfg.cluster_reduce else "block" if cfg.block_reduce else "workspace")),
        "//",
        "// Host shim ABI (l2ir/runtime.py):",
        "//   size_t l2ir_workspace_size(int M, int N, int K);   // "
        + " + ".join([*(["the repack copies"] if cfg.repack else []),
                      *(["split-K partials and pair counters"] if cfg.tree else [])] or ["0"]),
        "//   int    l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,",
        "//                   void* workspace, size_t workspace_bytes, void* stream);   // 0 = success",
        "",
        "#include <atomic>",
        "#include <climits>",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "#include <cuda.h>           // CUtensorMap and its enums (no libcuda link: see tensor_map_encoder)",
        "#include <cudaTypedefs.h>   // PFN_cuTensorMapEncodeTiled",
        "#include <cuda_runtime.h>",
        "#include <cuda_fp16.h>",
        "#include <cuda_bf16.h>",
        "",
        "// Programmatic dependent launch (see l2ir_run's launch); -DL2IR_PDL=0 builds an ordinary launch.",
        *pdl_macro_cpp(True),
        "",
        "#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)",
        '#error "wgmma and setmaxnreg need sm_90a: compile with -gencode=arch=compute_90a,code=sm_90a"',
        "#endif",
        "",
    ]


def _config(cfg: PtxConfig) -> list[str]:
    """Status codes, element types, and the compile-time tile, ring and shared-memory layout."""
    lay = cfg.layout
    in_t, out_t = CUDA_TYPE[cfg.in_dtype], CUDA_TYPE[cfg.out_dtype]
    sbo = 8 * cfg.row_bytes
    out2 = CUDA_PAIR_TYPE[cfg.out_dtype]
    return [
        "namespace {",
        "",
        *status_constants_cpp("MISALIGNED", *(["NOT_DIVISIBLE"] if any(cfg.divisible) else []), "BAD_ARGUMENT",
                              "CUDA_ERROR", "TENSOR_MAP", *(["WORKSPACE_TOO_SMALL"] if cfg.uses_workspace else [])),
        "",
        f"using InT = {in_t};     // problem a/b",
        f"using OutT = {out_t};   // problem c",
        f"using Out2T = {out2};",
        "",
        "// ---- tile (tile.block, tile.warps, mma.shape) ----",
        f"constexpr int BM = {cfg.bm}, BN = {cfg.bn}, BK = {cfg.bk};",
        f"constexpr int CONSUMER_WGS = {cfg.consumer_wgs};        // tile.warps={4 * cfg.consumer_wgs}x1: "
        + ("two consumer warpgroups split the K loop" if cfg.block_reduce else
           "two consumer warpgroups split BM" if cfg.consumer_wgs == 2 else "one consumer warpgroup owns the tile"),
        ("constexpr int WG_M = BM;   // rows per consumer warpgroup: splitk reduce=block, each covers the tile"
         if cfg.block_reduce else "constexpr int WG_M = BM / CONSUMER_WGS;   // rows per consumer warpgroup"),
        "constexpr int SLABS = WG_M / 64;          // wgmma m64 slabs per consumer warpgroup",
        f"constexpr int WGMMA_N = {cfg.bn};            // mma.shape=64x{cfg.bn}x16: one instruction spans BN",
        "constexpr int THREADS = 128 * (1 + CONSUMER_WGS);   // producer warpgroup + consumers",
        *(["constexpr int CONSUMER_THREADS = 128 * CONSUMER_WGS;",
           f"constexpr int SLICES = {cfg.slices};   // splitk mode=split_k slices={cfg.slices} reduce="
           + ("cluster: the cluster size" if cfg.cluster_reduce else "workspace"),
           *([] if cfg.cluster_reduce else
             ["constexpr int PARTIAL_FLOATS = BM * BN;   // one slice's fp32 partial tile in the workspace"])]
          if cfg.split else []),
        *(["constexpr int CONSUMER_THREADS = 128 * CONSUMER_WGS;",
           "constexpr int SLICES = 2;   // splitk mode=split_k slices=2 reduce=block: consumer warpgroup cw is slice cw",
           "// Fragment units per consumer thread (wgmma slabs x 8-column groups), and the float4 slots each warpgroup",
           "// leaves for the other: the units the other one owns (ClusterReduce(2).owner), unit u at slot u / SLICES.",
           "constexpr int UNITS = SLABS * (WGMMA_N / 8);",
           "constexpr int SHARE_VECS = (UNITS + SLICES - 1) / SLICES;"] if cfg.block_reduce else []),
        *([f"constexpr int TREE_LEVELS = {SplitKTree(cfg.slices).levels};   // ceil(log2 SLICES): pair levels",
           f"constexpr int TREE_NODES = {SplitKTree(cfg.slices).counters};   // SLICES - 1 pair counters per tile"]
          if cfg.tree else []),
        *([f"constexpr int NUM_SMS = {cfg.num_sms};            // persistent grid size (H200: 132 SMs)"]
          if cfg.persistent else []),
        *([] if cfg.multicast is None else [
            f"constexpr int CLUSTER_M = {cfg.cluster[0]}, CLUSTER_N = {cfg.cluster[1]};   // tile.cluster: a patch of "
            "tiles per cluster",
            "constexpr int CLUSTER_SIZE = CLUSTER_M * CLUSTER_N;",
            "constexpr int A_BOX_ROWS = BM / CLUSTER_N;   // each block's share of its A box (its patch row shares it)",
            "constexpr int B_BOX_ROWS = BN / CLUSTER_M;   // ... of its B box (its patch column shares it)",
            f"constexpr uint32_t EMPTY_ARRIVALS = {cfg.multicast.release_arrivals(4 * cfg.consumer_wgs)};   "
            "// (CLUSTER_M + CLUSTER_N - 1) x consumer warps",
            "static_assert(A_BOX_ROWS % 8 == 0 && B_BOX_ROWS % 8 == 0, \"shares are whole 8-row swizzle atoms\");"]),
        "",
        f"// ---- shared memory (swizzle.smem = {cfg.swizzle_field}, pipeline.stages) ----",
        f"// A tile row of ATOM_K elements is one {cfg.row_bytes}-byte swizzle row: the TMA box's inner extent and the",
        "// unit wgmma's descriptor walks. A BK-wide stage holds K_BLOCKS such column blocks per operand.",
        f"constexpr int STAGES = {cfg.stages};",
        f"constexpr int ATOM_K = {cfg.atom_k};",
        f"constexpr int ROW_BYTES = {cfg.row_bytes};",
        "constexpr int K_BLOCKS = BK / ATOM_K;",
        f"constexpr int A_KBLOCK_BYTES = {cfg.a_kblock_bytes};   // BM rows x ROW_BYTES, 1024-aligned",
        f"constexpr int B_KBLOCK_BYTES = {cfg.b_kblock_bytes};   // BN rows x ROW_BYTES, 1024-aligned",
        "constexpr int A_STAGE_BYTES = K_BLOCKS * A_KBLOCK_BYTES;",
        "constexpr int B_STAGE_BYTES = K_BLOCKS * B_KBLOCK_BYTES;",
        *([f"constexpr uint32_t STAGE_TX_BYTES = {cfg.tx_bytes};   // (BM + BN) x BK x 2: the boxes land whole, "
           "out-of-bounds zeros included"] if not cfg.interleave else [
           f"constexpr uint32_t B_TX_BYTES = {cfg.bn * cfg.bk * DTYPE_BYTES[cfg.in_dtype]};   // interleave: B's box "
           "lands whole (A's stage is written by threads)",
           f"constexpr int A_WRITERS = {A_WRITERS};   // interleave: the producer warpgroup's warps 1-3 write A's stages",
           "constexpr int A_CHUNKS = BM * BK / 8;   // 16-byte chunks of one A stage",
           "constexpr int A_ROUNDS = (A_CHUNKS + A_WRITERS - 1) / A_WRITERS;   // chunks per writer thread",
           "constexpr int A_BATCH = A_ROUNDS < 6 ? A_ROUNDS : 6;   // chunks loaded before they are stored: 24 registers",
           f"constexpr int VIEW = {Interleave.STRIDE};   // interleave n: columns of one block are VIEW apart",
           f"constexpr int SWZ_MASK = {(1 << cfg.swizzle_bits) - 1};   // swizzle <B,4,3> on byte offsets: "
           "16-byte chunk ^= (offset >> 7) & SWZ_MASK",
           f"constexpr int SMEM_TAIL = {lay['tail']};   // the tail's 4 warp sums (16 bytes)"]),
        f"constexpr int SMEM_A = {lay['a']}, SMEM_B = {lay['b']}, SMEM_BARS = {lay['bars']};",
        *([f"constexpr int SMEM_C = {lay['c']};   // epilogue.path=smem: the C staging tile",
           f"constexpr int C_SWZ_MASK = {_c_swz_mask(cfg.bn)};   // XOR of the 16-byte chunk index with the row"]
          if cfg.epilogue == "smem" else []),
        *([f"constexpr int SMEM_C = {lay['c']};   // epilogue.path=tma: each consumer warpgroup's store boxes",
           f"constexpr int C_BOX_COLS = {tma_store_box_cols(DTYPE_BYTES[cfg.out_dtype])};   // 128 bytes of C: "
           "the widest box row SWIZZLE_128B allows",
           "constexpr int C_BOXES = BN / C_BOX_COLS;",
           "static_assert(SMEM_C % 1024 == 0 && (WG_M * C_BOX_COLS * sizeof(OutT)) % 1024 == 0,",
           '              "each store box must start on the 128-byte swizzle\'s 1024-byte period");']
          if cfg.epilogue == "tma" else []),
        *([f"constexpr int SMEM_FLAG = {lay['flag']};   // split-K: the block reduces its tile (1) or not (0)"]
          if cfg.tree else []),
        *([f"constexpr int SMEM_RECV_BAR = {lay['recv_bar']};   // reduce=cluster: counts the bytes pushed into",
           f"constexpr int SMEM_RECV = {lay['recv']};   // this block's receive buffer, of {cfg.receive_bytes} B"]
          if cfg.cluster_reduce else []),
        *(["constexpr int SMEM_PARTIAL = 0;   // reduce=block: both warpgroups' shares, over the finished stage rings",
           "static_assert(SLICES * SHARE_VECS * 128 * 16 <= SMEM_BARS, \"the shares must fit over the rings\");"]
          if cfg.block_reduce else []),
        f"constexpr int SMEM_BYTES = {lay['total']};",
        *(["static_assert((SLICES - 1) * ((SLABS * (WGMMA_N / 8) + SLICES - 1) / SLICES) * CONSUMER_THREADS * 16",
           "              == SMEM_BYTES - SMEM_RECV && SMEM_RECV % 16 == 0,",
           '              "the receive buffer: a row of the largest share of units per other block, a float4 per thread");']
          if cfg.cluster_reduce else []),
        "",
        "// wgmma shared-memory matrix descriptor (PTX ISA, matrix descriptor format):",
        "//   bits  0-13 start address >> 4        bits 16-29 leading-dimension byte offset >> 4",
        "//   bits 32-45 stride-dimension byte offset >> 4   bits 49-51 base offset   bits 62-63 swizzle mode",
        "// K-major swizzled operands: the 16-element K step (32 bytes) stays inside one swizzle row, so the leading",
        "// offset is unused (1 by convention); the stride offset steps between 8-row core-matrix groups = 8 rows.",
        "// Every atom starts 1024-byte aligned, so the base offset is 0.",
        "constexpr uint64_t DESC_LBO = 1;",
        f"constexpr uint64_t DESC_SBO = {sbo} >> 4;   // 8 rows x {cfg.row_bytes} B",
        f"constexpr uint64_t DESC_SWIZZLE = {DESC_SWIZZLE_MODE[cfg.swizzle_bits]};   // 1 = 128B, 2 = 64B, 3 = 32B",
        "constexpr uint64_t DESC_TEMPLATE = (DESC_LBO << 16) | (DESC_SBO << 32) | (DESC_SWIZZLE << 62);",
        "",
        ("static_assert(BK % ATOM_K == 0 && BM % 64 == 0 && BN % 8 == 0 && BN <= 256, \"tile.block\");"
         if cfg.block_reduce else
         "static_assert(BK % ATOM_K == 0 && BM % (64 * CONSUMER_WGS) == 0 && BN % 8 == 0 && BN <= 256, \"tile.block\");"),
        f"static_assert(SMEM_BYTES <= {SMEM_LIMIT['sm90a']}, \"shared memory exceeds the 227 KB sm90 opt-in\");",
        "",
    ]


def _device_functions(cfg: PtxConfig) -> list[str]:
    """PTX wrappers: mbarriers, TMA loads, wgmma descriptors and the wgmma itself, the output conversion."""
    nr = cfg.bn // 2
    pack = f"{CUDA_PAIR_FROM_FLOATS[cfg.out_dtype]}(a, b)"
    to_out = f"{CUDA_FROM_FLOAT[cfg.out_dtype]}(a)"
    return [
        "// ---- PTX wrappers ----",
        "__device__ __forceinline__ uint32_t smem_addr(const void* p) {",
        "  return static_cast<uint32_t>(__cvta_generic_to_shared(p));",
        "}",
        "",
        "__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {",
        "  return DESC_TEMPLATE | (uint64_t)((addr & 0x3FFFF) >> 4);",
        "}",
        "",
        "__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {",
        '  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");',
        "}",
        "",
        "// Arms the stage's `full` barrier: one arrival plus the bytes the TMA boxes will deliver. The phase completes",
        "// only when the arrival count and the transaction count both reach zero.",
        "__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {",
        '  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");',
        "}",
        "",
        *(["__device__ __forceinline__ void mbar_arrive(uint32_t bar) {",
           '  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");',
           "}",
           ""] if cfg.multicast is None else []),   # tile.cluster releases through mbar_arrive_remote
        "// Wait until the phase with this parity has completed. try_wait has acquire semantics, so the TMA bytes that",
        "// completed the phase are visible to the wgmma reads that follow.",
        "__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {",
        "  uint32_t done = 0;",
        "  do {",
        "    asm volatile(",
        '        "{\\n"',
        '        ".reg .pred p;\\n"',
        '        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\\n"',
        '        "selp.u32 %0, 1, 0, p;\\n"',
        '        "}\\n"',
        '        : "=r"(done) : "r"(bar), "r"(parity) : "memory");',
        "  } while (!done);",
        "}",
        "",
        *([
            "// 2D TMA load of one box into shared memory, completing `bytes` on the mbarrier. c0 is the innermost (K)",
            "// coordinate, c1 the row. Out-of-bounds elements arrive as zeros (the K, M and N tails).",
            "__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {",
            "  asm volatile(",
            '      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"',
            '      :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");',
            "}",
            "",
        ] if cfg.multicast is None or 1 in cfg.cluster else []),   # a box not shared along one cluster dimension
        *(_cluster_functions() if cfg.cluster_reduce else []),
        *(_multicast_functions() if cfg.multicast is not None else []),
        *([
            "// 2D TMA store of one box of C from shared memory (epilogue.path=tma); c0 is the column, c1 the row.",
            "// Elements outside the tensor map's M x N are not written. Completion is tracked per bulk group.",
            "__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {",
            "  asm volatile(\"cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\"",
            "               :: \"l\"(reinterpret_cast<uint64_t>(map)), \"r\"(src), \"r\"(c0), \"r\"(c1) : \"memory\");",
            "}",
            "",
        ] if cfg.epilogue == "tma" else []),
        "__device__ __forceinline__ void wgmma_fence() { asm volatile(\"wgmma.fence.sync.aligned;\" ::: \"memory\"); }",
        "__device__ __forceinline__ void wgmma_commit() { asm volatile(\"wgmma.commit_group.sync.aligned;\" ::: \"memory\"); }",
        "template <int N>",
        "__device__ __forceinline__ void wgmma_wait() {",
        '  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");',
        "}",
        "",
        "// Pins the accumulators at this point of the instruction stream: the compiler may not move reads or writes of",
        "// them across an in-flight wgmma (which would make ptxas serialize the wgmma pipeline).",
        f"__device__ __forceinline__ void fence_acc(float (&d)[{nr}]) {{",
        "#pragma unroll",
        f"  for (int i = 0; i < {nr}; ++i) asm volatile(\"\" : \"+f\"(d[i]) :: \"memory\");",
        "}",
        "",
        *_wgmma_function(cfg),
        "",
        *(["// interleave: where TMA puts byte offset o of a k block's rows (swizzle <B,4,3>: the 16-byte chunk XORed",
           "// with the row's low bits), for the threads that write A's stages and zero B's k tail.",
           "__device__ __forceinline__ uint32_t swizzled(uint32_t o) { return o ^ (((o >> 7) & SWZ_MASK) << 4); }",
           ""] if cfg.interleave else []),
        (f"__device__ __forceinline__ OutT to_out(float a) {{ return {to_out}; }}" if cfg.vector == 1
         and cfg.epilogue == "direct" else
         f"__device__ __forceinline__ Out2T pack2(float a, float b) {{ return {pack}; }}"),
        "",
        "}  // namespace",
        "",
    ]


def _cluster_reduce(cfg: PtxConfig) -> list[str]:
    """split-K, reduce=cluster (l2ir.indexing.ClusterReduce): the tile's SLICES blocks are one thread-block cluster.
    Each pushes the fragment units it does not own into their owners' receive buffers (st.async: the data and a
    byte count on the owner's mbarrier in one remote store), waits until its own buffer holds what the others owe
    it, and adds each unit it owns in slice order 0, 1, ... (its own partial from registers) into the registers the
    direct epilogue stores. The blocks are co-resident by construction, the sum's order is fixed (C is
    bit-identical run to run), and nothing touches global memory but C. A block whose slice has no k tile (l2ir_run
    does not refuse such a K) contributes the zeros its accumulators were initialized with: one unit per block.
    The consumers' wait for the entry barrier sits inside the unit loop, which runs exactly once (grid = units,
    persistent=false), and the producer's after its loop: every thread waits once for the phase it arrived at.
    Why push, not pull: a block that reads the others' partials (ld.shared::cluster) must publish its own with a
    release (a GPU-scope MEMBAR per warp) and keep its shared memory alive until the last remote read (a second
    cluster barrier at exit); st.async needs neither, and the mbarrier's byte count is the only handshake."""
    cr = ClusterReduce(cfg.slices)
    unit, owner = cr.unit(cfg.bn).to_cpp(), cr.owner.to_cpp()
    vec = cr.receive_vec(cfg.units, 128 * cfg.consumer_wgs).to_cpp()
    expected = cr.receive_bytes(cfg.units, 128 * cfg.consumer_wgs).to_cpp()
    return [
        "      // ---- splitk reduce=cluster: the tile's slices add up in the owners' shared memory ----",
        "      const int ct = threadIdx.x - 128;   // consumer thread 0 .. CONSUMER_THREADS - 1",
        "      // This block's receive barrier: one arrival, which arms it with the bytes the others push",
        "      // (ClusterReduce.receive_bytes; a push that lands first leaves the byte count below zero until then).",
        f"      if (ct == 0) mbar_arrive_expect_tx(bars_recv, {expected});",
        "      cluster_wait();   // the entry barrier: every block's receive barrier is initialized",
        "      // Push each unit another block owns (ClusterReduce.owner) into its buffer at ClusterReduce.receive_vec:",
        "      // one 16-byte st.async per unit and thread, coalesced across the consumer threads.",
        "      {",
        "        const int sender = slice;",
        "#pragma unroll",
        "        for (int j = 0; j < SLABS; ++j)",
        "#pragma unroll",
        "          for (int c = 0; c < WGMMA_N / 8; ++c) {",
        f"            const int fragment = {unit};   // ClusterReduce.unit",
        f"            const int owner = {owner};   // ClusterReduce.owner",
        "            if (owner == sender) continue;",
        f"            const uint32_t local = smem_base + SMEM_RECV + (uint32_t)({vec}) * 16u;   // ClusterReduce.receive_vec",
        "            st_async_f4(cluster_map(local, owner), acc[j][4 * c], acc[j][4 * c + 1], acc[j][4 * c + 2],",
        "                        acc[j][4 * c + 3], cluster_map(bars_recv, owner));",
        "          }",
        "      }",
        "      // Every byte owed to this block has landed (the phase completes at a zero byte count; its acquire at",
        "      // cluster scope makes the other blocks' stores visible here).",
        "      mbar_wait_cluster(bars_recv, 0);",
        "      // The units this block owns: the SLICES partials added in slice order 0, 1, ... (ClusterReduce.reduce).",
        "      {",
        "        const int owner = slice;",
        "        const float4* recv = reinterpret_cast<const float4*>(smem + SMEM_RECV);",
        "#pragma unroll",
        "        for (int j = 0; j < SLABS; ++j) {",
        "#pragma unroll",
        "          for (int c = 0; c < WGMMA_N / 8; ++c) {",
        f"            const int fragment = {unit};   // ClusterReduce.unit",
        f"            if ({owner} != slice) continue;   // ClusterReduce.owner",
        "            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);",
        "#pragma unroll",
        "            for (int sender = 0; sender < SLICES; ++sender) {",
        "              const float4 v = sender == owner",
        "                  ? make_float4(acc[j][4 * c], acc[j][4 * c + 1], acc[j][4 * c + 2], acc[j][4 * c + 3])",
        f"                  : recv[{vec}];   // ClusterReduce.receive_vec",
        "              if (sender == 0) sum = v;",
        "              else { sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w; }",
        "            }",
        "            acc[j][4 * c] = sum.x; acc[j][4 * c + 1] = sum.y; acc[j][4 * c + 2] = sum.z; acc[j][4 * c + 3] = sum.w;",
        "          }",
        "        }",
        "      }",
    ]


def _block_reduce(cfg: PtxConfig) -> list[str]:
    """split-K, reduce=block (l2ir.indexing.BlockSplit): the block's two consumer warpgroups add their partials
    through shared memory with ClusterReduce(2)'s fragment ownership. Each leaves the units the other owns over the
    finished stage ring; after a barrier each adds the other's values to the units it owns, which the direct
    epilogue then stores. acc = own + other is the bits of slice 0 + slice 1 whichever warpgroup adds (fp32
    addition commutes), the interpreter's sum."""
    cr = ClusterReduce(BlockSplit.SLICES)
    unit, owner = cr.unit(cfg.bn).to_cpp(), cr.owner.to_cpp()
    return [
        "      // ---- splitk reduce=block: the two warpgroups' partials add up in shared memory ----",
        "      // Both warpgroups are past their last wgmma, which reads the ring, before a share overwrites it; the",
        "      // producer is done too (each stage it filled has been waited on). wgmma.wait_group and the mbarrier waits",
        "      // order the async proxy's accesses before these generic stores; the proxy fence states it.",
        '      asm volatile("bar.sync 3, %0;" :: "n"(CONSUMER_THREADS) : "memory");',
        '      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
        "      // Each warpgroup leaves the units the other owns, unit u at float4 slot u / SLICES of its share, thread",
        "      // tid's float4s side by side with its warpgroup's (16-byte stores, conflict-free).",
        "      {",
        "        float4* share = reinterpret_cast<float4*>(smem + SMEM_PARTIAL) + slice * SHARE_VECS * 128 + tid;",
        "#pragma unroll",
        "        for (int j = 0; j < SLABS; ++j)",
        "#pragma unroll",
        "          for (int c = 0; c < WGMMA_N / 8; ++c) {",
        f"            const int fragment = {unit};   // ClusterReduce.unit",
        f"            if ({owner} == slice) continue;   // ClusterReduce.owner: this warpgroup adds and stores it",
        "            share[(fragment / SLICES) * 128] =",
        "                make_float4(acc[j][4 * c], acc[j][4 * c + 1], acc[j][4 * c + 2], acc[j][4 * c + 3]);",
        "          }",
        "      }",
        '      asm volatile("bar.sync 3, %0;" :: "n"(CONSUMER_THREADS) : "memory");',
        "      {",
        "        const float4* other =",
        "            reinterpret_cast<const float4*>(smem + SMEM_PARTIAL) + (SLICES - 1 - slice) * SHARE_VECS * 128 + tid;",
        "#pragma unroll",
        "        for (int j = 0; j < SLABS; ++j)",
        "#pragma unroll",
        "          for (int c = 0; c < WGMMA_N / 8; ++c) {",
        f"            const int fragment = {unit};   // ClusterReduce.unit",
        f"            if ({owner} != slice) continue;   // ClusterReduce.owner: the other warpgroup stores it",
        "            const float4 v = other[(fragment / SLICES) * 128];",
        "            acc[j][4 * c] += v.x; acc[j][4 * c + 1] += v.y; acc[j][4 * c + 2] += v.z; acc[j][4 * c + 3] += v.w;",
        "          }",
        "      }",
    ]


def _cluster_functions() -> list[str]:
    """reduce=cluster: the entry's cluster barrier (relaxed arrival, acquire wait; not .aligned: the producer
    warpgroup waits from diverged lanes), the push (st.async of one float4 into another block's shared memory,
    completing 16 bytes on its mbarrier) and the owner's wait for its receive barrier at cluster scope."""
    return [
        "__device__ __forceinline__ void cluster_arrive_relaxed() {",
        '  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");',
        "}",
        "",
        "__device__ __forceinline__ void cluster_wait() {",
        '  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");',
        "}",
        "",
        "// The address of this block's shared-memory offset `addr` in the block of cluster rank `rank`.",
        "__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t rank) {",
        "  uint32_t remote;",
        '  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));',
        "  return remote;",
        "}",
        "",
        "// One float4 into another block's shared memory (`remote`, a cluster address), completing 16 bytes on its",
        "// mbarrier `remote_bar`: the owner sees the data once its barrier's phase completes.",
        "__device__ __forceinline__ void st_async_f4(uint32_t remote, float x, float y, float z, float w,",
        "                                            uint32_t remote_bar) {",
        '  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"',
        '               :: "r"(remote), "f"(x), "f"(y), "f"(z), "f"(w), "r"(remote_bar) : "memory");',
        "}",
        "",
        "// mbar_wait with acquire at cluster scope: the bytes that completed the phase came from other blocks.",
        "__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {",
        "  uint32_t done = 0;",
        "  do {",
        "    asm volatile(",
        '        "{\\n"',
        '        ".reg .pred p;\\n"',
        '        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\\n"',
        '        "selp.u32 %0, 1, 0, p;\\n"',
        '        "}\\n"',
        '        : "=r"(done) : "r"(bar), "r"(parity) : "memory");',
        "  } while (!done);",
        "}",
        "",
    ]


def _multicast_functions() -> list[str]:
    """tile.cluster: the cluster barrier, the multicast TMA load, and the empty barriers' remote release and wait."""
    return [
        "// tile.cluster: every thread of every block of the cluster arrives and waits (acquire) once, after the barrier",
        "// setup. The arrival is relaxed: the other blocks need to see only the mbarrier inits, which thread 0's",
        "// fence.mbarrier_init.release.cluster has released; a release arrival adds a GPU-scope MEMBAR per warp.",
        "__device__ __forceinline__ void cluster_sync() {",
        '  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");',
        '  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");',
        "}",
        "",
        "// 2D TMA load of one box into the same shared-memory offset of every block of the cluster named in `mask`",
        "// (bit r = cluster rank r), completing `bytes` on the mbarrier at the same offset in each of them.",
        "__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,",
        "                                                      int c1, uint16_t mask) {",
        "  asm volatile(",
        '      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"',
        '      " [%0], [%1, {%3, %4}], [%2], %5;"',
        '      :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask) : "memory");',
        "}",
        "",
        "// The address of this block's shared-memory offset `addr` in the block of cluster rank `rank`. A block's",
        "// window of the cluster's shared memory is contiguous, so an offset added after the mapping lands where it",
        "// would before: the consumers map their empty barriers once, not per k tile (mapa reads the block's",
        "// cluster id, a special-register read the loop would wait on).",
        "__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t rank) {",
        "  uint32_t remote;",
        '  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));',
        "  return remote;",
        "}",
        "",
        "// One arrival at the mbarrier at cluster address `remote` (another block's, from cluster_map), with the",
        "// arrive's default (release, CTA scope) semantics: the warp's wgmma reads of the stage completed at its",
        "// wait_group, before this arrival, and the refill that the arrival allows is that block's own TMA write.",
        "// A cluster-scope release here costs a fence per k tile: it ran the 64x64 kernel 2.4x slower",
        "// (bench/results/multicast_ptx_release_cluster_h200.json).",
        "__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote) {",
        '  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");',
        "}",
        "",
    ]


def _multicast_ranks(cfg: PtxConfig) -> list[str]:
    """tile.cluster: the grid's blocks and this block's rank, share of each box and the blocks each share goes to
    (l2ir.indexing.ClusterMulticast, rendered)."""
    mc = cfg.multicast
    if mc is None:
        return []
    return [
        f"  const int num_blocks = CLUSTER_SIZE * {mc.clusters().to_cpp()};   // whole clusters",
        "  const int rank = blockIdx.x % CLUSTER_SIZE;   // %cluster_ctarank of the 1-D cluster",
        *([f"  const int a_first = {mc.a_first(cfg.bm).to_cpp()};   // this block's A_BOX_ROWS rows of the A box",
           f"  const uint16_t a_mask = {mc.a_mask().to_cpp()};   // ... go to its patch row"] if mc.cn > 1 else []),
        *([f"  const int b_first = {mc.b_first(cfg.bn).to_cpp()};   // this block's B_BOX_ROWS rows of the B box",
           f"  const uint16_t b_mask = {mc.b_mask().to_cpp()};   // ... go to its patch column"] if mc.cm > 1 else []),
        f"  const uint32_t release_mask = {mc.release_mask().to_cpp()};   // row and column: where stages are released",
    ]


def _multicast_loads(cfg: PtxConfig) -> list[str]:
    """The producer's TMA loads of one k block: its own A and B boxes, or with tile.cluster its share of each,
    multicast to the blocks that use it (l2ir.indexing.ClusterMulticast)."""
    mc = cfg.multicast
    a_dst = "smem_base + SMEM_A + stage * A_STAGE_BYTES + kb * A_KBLOCK_BYTES"
    b_dst = "smem_base + SMEM_B + stage * B_STAGE_BYTES + kb * B_KBLOCK_BYTES"
    if cfg.interleave:
        return [
            "            // interleave: B's box of the residue's view (pitch VIEW * K) starts `offset` elements before",
            "            // element residue * K + k0 of view row view0, on a 16-byte boundary; the first and last k tiles",
            "            // take elements of the neighbouring rows (zeroed there). A's stage is written by warps 1-3,",
            "            // shifted by the same offset.",
            f"            tma_load_2d({b_dst}, &tmap_b, full, residue * K - offset + k0,",
            "                        view0);"]
    if mc is None:
        return [f"            tma_load_2d({a_dst}, &tmap_a, full, k0,",
                "                        tile_m * BM);",
                f"            tma_load_2d({b_dst}, &tmap_b, full, k0,",
                "                        tile_n * BN);"]
    out = []
    for op, dst, tile, box, share in (("a", a_dst, "tile_m * BM", "A", mc.cn), ("b", b_dst, "tile_n * BN", "B", mc.cm)):
        if share == 1:
            out += [f"            tma_load_2d({dst}, &tmap_{op}, full, k0, {tile});   // not shared: the whole box"]
        else:
            out += [f"            tma_load_2d_multicast({dst} + {op}_first * ROW_BYTES, &tmap_{op}, full, k0,",
                    f"                                  {tile} + {op}_first, {op}_mask);"]
    return out


def _block_ranges(cfg: PtxConfig) -> list[str]:
    """reduce=block: the k tiles of consumer warpgroup `slice` (l2ir.indexing.splitk_range with 2 slices, rendered),
    which the producer and both consumers use."""
    if not cfg.block_reduce:
        return []
    begin, end = splitk_range(BlockSplit.SLICES)
    return [
        "  // splitk reduce=block: consumer warpgroup `slice` owns k tiles [slice_begin(slice), slice_end(slice))",
        "  // (l2ir.indexing.splitk_range, 2 slices: slice 0 has the longer range).",
        f"  auto slice_begin = [&](int slice) {{ return {begin.to_cpp()}; }};",
        f"  auto slice_end = [&](int slice) {{ return {end.to_cpp()}; }};",
    ]


def _block_producer_loop() -> list[str]:
    """reduce=block: ring position p holds k tile BlockSplit.k_tile (rendered): the slices' tiles in turn. Opens
    the one brace block the k loop's body closes."""
    return [
        "        // splitk reduce=block: ring position p holds slice p % 2's (p / 2)-th k tile, so both consumer",
        "        // warpgroups find work in every pair of stages (l2ir.indexing.BlockSplit.k_tile).",
        "        for (int position = 0; position < k_tiles; ++position) {",
        f"          const int kt = {BlockSplit.k_tile().to_cpp()};   // BlockSplit.k_tile",
    ]


def _block_consumer_loop() -> list[str]:
    """reduce=block: a consumer warpgroup's k loop over its slice; each k tile's stage and phase come from its ring
    position (l2ir.indexing.BlockSplit.position, rendered), which the interpreter checks against the producer's order."""
    return [
        "      const int kt_begin = slice_begin(slice), kt_end = slice_end(slice);",
        "      for (int step = 0; step < kt_end - kt_begin; ++step) {",
        f"        const int position = {BlockSplit.position().to_cpp()};   // BlockSplit.position",
        "        const int stage = position % STAGES;",
        "        const uint32_t phase = (position / STAGES) & 1;",
    ]


def _kernel(cfg: PtxConfig) -> list[str]:
    """The warp-specialized kernel: producer warpgroup (TMA), consumer warpgroups (wgmma), epilogue."""
    nr = cfg.bn // 2
    return [
        "// ---- the kernel ----",
        *(["// One block per SM (__launch_bounds__(THREADS, 1)): the stage ring takes nearly all shared memory, and",
           "// setmaxnreg redistributes the register file between the warpgroups."] if cfg.blocks_per_sm == 1 else
          ["// Two blocks per SM (__launch_bounds__(THREADS, 2)): each ring takes at most half of the SM's shared memory,",
           "// and each block's pool is half the register file, which setmaxnreg hands from producer to consumer."]),
        f'extern "C" __global__ void __launch_bounds__(THREADS, {cfg.blocks_per_sm})',
        (f"{ENTRY}(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,"
         if not cfg.interleave else
         f"{ENTRY}(const __grid_constant__ CUtensorMap tmap_b,   // interleave: B's view; A by plain loads"),
        *(["        const InT* __restrict__ A, const InT* __restrict__ B,   // A's stages, the tail's dot products"]
          if cfg.interleave else []),
        *(["        const __grid_constant__ CUtensorMap tmap_c,   // epilogue.path=tma"] if cfg.epilogue == "tma" else []),
        ("        OutT* __restrict__ C, int M, int N, int K, float* __restrict__ ws, unsigned* __restrict__ counters) {"
         if cfg.tree else "        OutT* __restrict__ C, int M, int N, int K) {"),
        "  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows x 128 B, and TMA and wgmma both",
        "  // compute it from the absolute shared-memory address.",
        "  extern __shared__ __align__(1024) uint8_t smem[];",
        "  const uint32_t smem_base = smem_addr(smem);",
        "  if (smem_base & 1023) __trap();   // never expected; a misaligned ring would corrupt every tile",
        "  const uint32_t bars = smem_base + SMEM_BARS;",
        "  // full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s)",
        *(["  const uint32_t bars_recv = smem_base + SMEM_RECV_BAR;"] if cfg.cluster_reduce else []),
        "",
        "  const int tiles_m = (M + BM - 1) / BM;",
        (f"  const int tiles_n = {column_tiles(Var('N'), cfg.bn, True).to_cpp()};   // interleave: VIEW residues x "
         "runs of BN view rows (Interleave.tiles_n)" if cfg.interleave else "  const int tiles_n = (N + BN - 1) / BN;"),
        *([f"  const int view_rows = {Interleave.tma_view_rows(Var('N')).to_cpp()};   // B's map: view rows whose "
           "VIEW rows all exist (Interleave.tma_view_rows)"] if cfg.interleave else []),
        *(["  const int num_tiles = tiles_m * tiles_n;"] if cfg.multicast is None else []),
        *(["  const int num_units = num_tiles * SLICES;   // (tile, slice) work units; l2ir_run checked the product"]
          if cfg.split and cfg.multicast is None else []),
        *(["  const int k_tiles = (K + BK - 1) / BK;   // the K tail is a zero-filled box (pad.k)"]
          if not cfg.interleave else []),   # interleave: each tile's, K + its offset
        *_block_ranges(cfg),
        *_multicast_ranks(cfg),
        *(["  const int num_units = num_blocks * SLICES;   // one cluster grid a slice; l2ir_run checked the product"]
          if cfg.split and cfg.multicast is not None else []),
        "  const int wg = threadIdx.x / 128;",
        "",
        "  if (threadIdx.x == 0) {",
        "    // The tensor maps live in the kernel's parameter space; fetching them into the TMA unit's descriptor cache",
        "    // now overlaps that latency with the barrier setup and the block-wide barrier below.",
        *(['    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<uint64_t>(&tmap_a)) : "memory");']
          if not cfg.interleave else []),
        '    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<uint64_t>(&tmap_b)) : "memory");',
        *(['    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<uint64_t>(&tmap_c)) : "memory");']
          if cfg.epilogue == "tma" else []),
        "    for (int s = 0; s < STAGES; ++s) {",
        ("      mbar_init(bars + 8 * s, 1);                           // full: the producer's arrive.expect_tx"
         if not cfg.interleave else
         "      mbar_init(bars + 8 * s, 1 + A_WRITERS);   // full: the TMA thread's arrive.expect_tx, each A writer's"),
        *(["      mbar_init(bars + 8 * (STAGES + s), 4);   // empty: one warpgroup reads a stage (reduce=block), one "
           "arrival per warp"] if cfg.block_reduce else
          ["      mbar_init(bars + 8 * (STAGES + s), CONSUMER_WGS * 4);  // empty: one arrival per consumer warp"]
          if cfg.multicast is None else
          ["      mbar_init(bars + 8 * (STAGES + s), EMPTY_ARRIVALS);   // empty: every consumer warp of its row and "
           "column"]),
        "    }",
        *(["    mbar_init(bars_recv, 1);   // reduce=cluster: this block's arrive.expect_tx; the others' pushes count bytes"]
          if cfg.cluster_reduce else []),
        "    // Make the initialized barriers visible to the other threads and to the async proxy (TMA complete_tx).",
        '    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");',
        '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
        "  }",
        "  // The one block-wide barrier: no thread may wait on or arrive at an mbarrier before it is initialized.",
        "  // After it the warpgroups meet only through mbarriers, named barriers among the consumers and, with",
        "  // splitk reduce=cluster, the cluster barriers.",
        "  __syncthreads();",
        *(["  // tile.cluster: nor may another block of the cluster multicast into this one or arrive at its barriers.",
           "  cluster_sync();"] if cfg.multicast is not None else []),
        *(["  // reduce=cluster: nor may another block push into this one before its receive mbarrier is initialized.",
           "  // Every thread arrives now (relaxed: thread 0's fence.mbarrier_init.release.cluster released the init)",
           "  // and waits only where it next needs the cluster, so the barrier's latency hides behind the K loop.",
           "  cluster_arrive_relaxed();"] if cfg.cluster_reduce else []),
        "",
        "  if (wg == 0) {",
        ("    // ---- producer warpgroup: TMA only, so it releases its registers (REG_BUDGET) ----" if not cfg.interleave
         else "    // ---- producer warpgroup: B's TMA boxes (thread 0) and A's stages (warps 1-3) ----"),
        (f'    asm volatile("setmaxnreg.dec.sync.aligned.u32 {cfg.regs[0]};" ::: "memory");' if cfg.regs[0] else
         "    // interleave: no setmaxnreg (PtxConfig.regs): warps 1-3 write A's stages"),
        "    if (threadIdx.x == 0) {",
        "      // Programmatic dependent launch: this grid may start while the stream's previous grid (a repack copy,",
        "      // or any kernel) still runs; wait for it, and for its stores to be visible, before the first TMA load.",
        '      asm volatile("griddepcontrol.wait;" ::: "memory");',
        "      int stage = 0;",
        "      uint32_t phase = 0;",
        *_tile_loop(cfg, "      "),
        *(_block_producer_loop() if cfg.block_reduce else
          [f"        for (int kt = {cfg.k_first}; kt < {cfg.k_last}; ++kt) {{"]),
        "          // Wait until the consumers released this stage. On the first pass (phase 0) parity 1 refers to the",
        "          // phase before initialization, which counts as complete, so the ring fills without waiting.",
        ("          mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);" if cfg.multicast is None else
         "          mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);   // tile.cluster: released by its row and column"),
        "          const uint32_t full = bars + 8 * stage;",
        ("          mbar_arrive_expect_tx(full, STAGE_TX_BYTES);" if not cfg.interleave else
         "          mbar_arrive_expect_tx(full, B_TX_BYTES);   // interleave: B's box alone"),
        "#pragma unroll",
        "          for (int kb = 0; kb < K_BLOCKS; ++kb) {",
        "            const int k0 = kt * BK + kb * ATOM_K;",
        *_multicast_loads(cfg),
        "          }",
        "          if (++stage == STAGES) { stage = 0; phase ^= 1; }",
        "        }",
        "      }",
        *(_interleave_a_writers(cfg) if cfg.interleave else []),
        *(["      // tile.cluster: the block may leave only when no block of its row or column will arrive at its empty",
           "      // barriers again, and every share it multicast has landed: one more pass over the ring waits until",
           "      // each stage's last fill was released by all of them (this thread keeps the block resident). A",
           "      // cluster barrier at the exit would instead hold every warp for the cluster's slowest block, behind",
           "      // a release whose GPU-scope MEMBAR waits for the block's C stores (bench/NOTES.md, release probe).",
           "      for (int s = 0; s < STAGES; ++s) {",
           "        mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);",
           "        if (++stage == STAGES) { stage = 0; phase ^= 1; }",
           "      }"] if cfg.multicast is not None else []),
        "    }",
        *(["    // reduce=cluster: every thread pairs its entry arrival with a wait (this warpgroup's, at its end,",
           "    // costs nothing).",
           "    cluster_wait();"] if cfg.cluster_reduce else []),
        "  } else {",
        "    // ---- consumer warpgroups: wgmma and the epilogue ----",
        *([f'    asm volatile("setmaxnreg.inc.sync.aligned.u32 {cfg.regs[1]};" ::: "memory");']
          if cfg.regs[1] else
          ["    // interleave: no setmaxnreg; the consumer keeps the launch bounds' share (PtxConfig.regs)."]
          if cfg.interleave else
          ["    // 256 threads: the consumer already holds the per-thread maximum and keeps it (REG_BUDGET)."]),
        *(["    const int cw = wg - 1;   // consumer warpgroup: all BM rows, k tiles of slice cw",
           "    const int slice = cw;    // splitk reduce=block: this warpgroup's half of the K loop"]
          if cfg.block_reduce else
          ["    const int cw = wg - 1;   // consumer warpgroup: rows [cw * WG_M, (cw + 1) * WG_M) of the tile"]),
        "    // Programmatic dependent launch: the consumers' own global accesses (C, split-K partials and pair counters)",
        "    // wait too. Most follow data the producer loaded after its wait, but a K slice with no k tile (a run-time",
        "    // shape the lowered one did not promise) goes straight to its partial and counter.",
        '    asm volatile("griddepcontrol.wait;" ::: "memory");',
        "    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;",
        *(_interleave_tail() if cfg.interleave else []),
        f"    float acc[SLABS][{nr}];",
        "#pragma unroll",
        "    for (int j = 0; j < SLABS; ++j)",
        "#pragma unroll",
        f"      for (int i = 0; i < {nr}; ++i) acc[j][i] = 0.f;",
        *([] if cfg.block_reduce else ["    int stage = 0;", "    uint32_t phase = 0;"]),
        *([] if cfg.multicast is None else [
            "    // tile.cluster: a stage is filled from every block of this block's patch row and column, so a warp",
            "    // releases it at each of their empty barriers: lane r signals cluster rank r, at rank r's empty",
            "    // barriers mapped once here.",
            "    const bool releases = lane < CLUSTER_SIZE && (release_mask >> lane & 1);",
            "    const uint32_t remote_empty = cluster_map(bars + 8 * STAGES, releases ? lane : 0);",
            "    auto release = [&](int s) {",
            "      if (releases) mbar_arrive_remote(remote_empty + 8 * s);",
            "    };"]),
        *_tile_loop(cfg, "    "),
        *([
            "      int prev = -1;",
            *(_block_consumer_loop() if cfg.block_reduce else
              [f"      for (int kt = {cfg.k_first}; kt < {cfg.k_last}; ++kt) {{"]),
            "        mbar_wait(bars + 8 * stage, phase);",
            *(_interleave_k_tail() if cfg.interleave else []),
            "#pragma unroll",
            "        for (int j = 0; j < SLABS; ++j) fence_acc(acc[j]);",
            "        wgmma_fence();   // order earlier register accesses of the accumulators before the async reads",
            ("        const uint32_t a_stage = smem_base + SMEM_A + stage * A_STAGE_BYTES;   // all BM rows"
             if cfg.block_reduce else
             "        const uint32_t a_stage = smem_base + SMEM_A + stage * A_STAGE_BYTES + cw * WG_M * ROW_BYTES;"),
            "        const uint32_t b_stage = smem_base + SMEM_B + stage * B_STAGE_BYTES;",
            "#pragma unroll",
            "        for (int kk = 0; kk < BK / 16; ++kk) {",
            "          // k step kk: column block kk / (ATOM_K / 16), then 32 bytes per 16 elements inside the swizzle row",
            "          // (the hardware applies the XOR pattern to the advanced address).",
            "          const uint32_t koff = (kk % (ATOM_K / 16)) * 32;",
            "          const int kb = kk / (ATOM_K / 16);",
            "          const uint64_t db = smem_desc(b_stage + kb * B_KBLOCK_BYTES + koff);",
            "#pragma unroll",
            "          for (int j = 0; j < SLABS; ++j) {",
            "            const uint64_t da = smem_desc(a_stage + kb * A_KBLOCK_BYTES + j * 64 * ROW_BYTES + koff);",
            f"            wgmma_m64n{cfg.bn}k16(acc[j], da, db, "
            + ("(step > 0 || kk > 0) ? 1u : 0u);" if cfg.block_reduce else f"(kt > {cfg.k_first} || kk > 0) ? 1u : 0u);"),
            "          }",
            "        }",
            "        wgmma_commit();",
            "        // Keep this k-tile's wgmma group in flight; wait for the previous one, whose stage can then be",
            "        // handed back to the producer while the tensor cores work on this one.",
            "        wgmma_wait<1>();",
            "#pragma unroll",
            "        for (int j = 0; j < SLABS; ++j) fence_acc(acc[j]);",
            ("        if (prev >= 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + prev));" if cfg.multicast is None else
             "        if (prev >= 0) release(prev);"),
            "        prev = stage;",
            *([] if cfg.block_reduce else ["        if (++stage == STAGES) { stage = 0; phase ^= 1; }"]),
            "      }",
            "      wgmma_wait<0>();",
            "#pragma unroll",
            "      for (int j = 0; j < SLABS; ++j) fence_acc(acc[j]);",
            *(["      if (prev >= 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + prev));"]
              if (cfg.split or cfg.block_reduce) and cfg.multicast is None else
              ["      if (lane == 0) mbar_arrive(bars + 8 * (STAGES + prev));"] if cfg.multicast is None else
              [("      if (prev >= 0) release(prev);" if cfg.split else "      release(prev);"),
               "      if (tile_m >= tiles_m || tile_n >= tiles_n) continue;   // a cluster's block past the grid stores nothing"]),
        ]),
        "",
        *(_splitk_reduce(cfg) if cfg.tree else _cluster_reduce(cfg) if cfg.cluster_reduce else
          _block_reduce(cfg) if cfg.block_reduce else []),
        *(_epilogue_direct(cfg) if cfg.epilogue == "direct" else
          _epilogue_tma(cfg) if cfg.epilogue == "tma" else _epilogue_smem(cfg)),
        "    }",
        *(["    // The last bulk stores must have read the staging buffers before the block's shared memory is freed.",
           '    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");']
          if cfg.epilogue == "tma" else []),
        "  }",
        "}",
        "",
    ]


REPACK_ENTRY = "l2ir_cuda_ptx_sm90a_repack"
REPACK_THREADS = 256
REPACK_BLOCKS_PER_SM = 8     # grid-stride cap: enough blocks in flight to cover DRAM latency on every SM


def _repack_kernel(cfg: PtxConfig) -> list[str]:
    """repack: the copy kernel launched before the GEMM (l2ir.indexing.Repack renders its index arithmetic)."""
    if not cfg.repack:
        return []
    chunk = REPACK_ALIGN
    return [
        f"// ---- repack operands={cfg.repack}: misaligned operands copied to aligned rows (l2ir.indexing.Repack) ----",
        "// A K-major operand with K % 8 != 0 starts each row on a 2-byte boundary, which TMA (16-byte strides) cannot",
        f"// read. This kernel copies it to rows of pitch = K rounded up to {chunk}: one thread per {chunk}-element chunk",
        f"// of a copy's row, {chunk} 2-byte loads (the source rows have no wider alignment) and one 16-byte store, zeros",
        "// in the pad columns. A grid-stride loop covers A's chunks, then B's; a null dst means the operand is not",
        "// copied this call.",
        "struct RepackOperand {",
        "  const uint16_t* src;   // the operand's bits (f16 and bf16 alike: a copy moves bits)",
        "  uint16_t* dst;         // its copy in the workspace, 16-byte aligned; nullptr: not copied",
        "  long long rows;",
        "  long long cols;",
        "};",
        "",
        f"__global__ void __launch_bounds__({REPACK_THREADS}) {REPACK_ENTRY}(RepackOperand op_a, RepackOperand op_b) {{",
        "  // The GEMM launched next may start its prologue now (programmatic dependent launch); its producer waits",
        "  // for this grid's completion before reading the copies.",
        '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");',
        f"  const long long chunks_a = op_a.dst ? {Repack.chunks(Var('op_a.rows'), Var('op_a.cols')).to_cpp()} : 0;",
        f"  const long long chunks_b = op_b.dst ? {Repack.chunks(Var('op_b.rows'), Var('op_b.cols')).to_cpp()} : 0;",
        f"  for (long long i = blockIdx.x * (long long){REPACK_THREADS} + threadIdx.x; i < chunks_a + chunks_b;",
        f"       i += (long long)gridDim.x * {REPACK_THREADS}) {{",
        "    const bool in_a = i < chunks_a;",
        "    const uint16_t* src = in_a ? op_a.src : op_b.src;",
        "    uint16_t* dst = in_a ? op_a.dst : op_b.dst;",
        "    const long long cols = in_a ? op_a.cols : op_b.cols;",
        "    const long long chunk = in_a ? i : i - chunks_a;   // of this operand's copy",
        f"    const long long row = {Repack.chunk_row().to_cpp()};",
        f"    const long long col0 = {Repack.chunk_col().to_cpp()};",
        f"    alignas(16) uint16_t v[{chunk}];",
        "#pragma unroll",
        f"    for (int e = 0; e < {chunk}; ++e) {{",
        "      const long long col = col0 + e;",
        f"      v[e] = col < cols ? src[{Repack.src().to_cpp()}] : uint16_t(0);   // pad columns: +0.0",
        "    }",
        "    {",
        "      const long long col = col0;",
        f"      *reinterpret_cast<uint4*>(dst + {Repack.dst().to_cpp()}) = *reinterpret_cast<const uint4*>(v);",
        "    }",
        "  }",
        "}",
        "",
    ]


def _repack_setup(cfg: PtxConfig) -> list[str]:
    """l2ir_run's repack step: which operands are copied this call, where, and the copy kernel's launch."""
    rp = cfg.repack_layout
    return [
        f"  // repack operands={cfg.repack}: an operand whose rows are not {REPACK_ALIGN}-element aligned is copied into the",
        "  // workspace (l2ir.indexing.Repack: offsets and pitch) and the GEMM reads the copy.",
        "  const long long m = M, n = N, k = K;",
        f"  const bool copy_a = ({rp.copy_elems('A').to_cpp()}) != 0;",
        f"  const bool copy_b = ({rp.copy_elems('B').to_cpp()}) != 0;",
        "  if (K > INT_MAX - 8) return L2IR_STATUS_BAD_ARGUMENT;   // the padded pitch must fit an int",
        f"  const int pitch = int({Repack.pitch(Var('k')).to_cpp()});",
        "  if ((copy_a || copy_b) && (workspace == nullptr || workspace_bytes < l2ir_workspace_size(M, N, K))) {",
        "    return L2IR_STATUS_WORKSPACE_TOO_SMALL;",
        "  }",
        "  if ((copy_a || copy_b) && reinterpret_cast<uintptr_t>(workspace) % 16 != 0) return L2IR_STATUS_MISALIGNED;",
        "  uint16_t* ws_elems = static_cast<uint16_t*>(workspace);",
        f"  const void* a_read = copy_a ? static_cast<const void*>(ws_elems + ({rp.offset('A').to_cpp()})) : A;",
        f"  const void* b_read = copy_b ? static_cast<const void*>(ws_elems + ({rp.offset('B').to_cpp()})) : B;",
        "  const int lda = copy_a ? pitch : K, ldb = copy_b ? pitch : K;",
    ]


def _repack_launch(cfg: PtxConfig) -> list[str]:
    cap = cfg.num_sms * REPACK_BLOCKS_PER_SM
    return [
        "  if (copy_a || copy_b) {",
        "    const RepackOperand op_a{static_cast<const uint16_t*>(A), copy_a ? const_cast<uint16_t*>(",
        "        static_cast<const uint16_t*>(a_read)) : nullptr, M, K};",
        "    const RepackOperand op_b{static_cast<const uint16_t*>(B), copy_b ? const_cast<uint16_t*>(",
        "        static_cast<const uint16_t*>(b_read)) : nullptr, N, K};",
        f"    const long long chunks = (copy_a ? {Repack.chunks(Var('m'), Var('k')).to_cpp()} : 0) + "
        f"(copy_b ? {Repack.chunks(Var('n'), Var('k')).to_cpp()} : 0);",
        f"    const long long want = (chunks + {REPACK_THREADS} - 1) / {REPACK_THREADS};",
        f"    const int blocks = int(want < {cap} ? want : {cap});   // {REPACK_BLOCKS_PER_SM} blocks per SM at most",
        f"    {REPACK_ENTRY}<<<blocks, {REPACK_THREADS}, 0, static_cast<cudaStream_t>(stream)>>>(op_a, op_b);",
        "    // A refused copy must not be followed by a GEMM that reads its workspace.",
        "    if (cudaGetLastError() != cudaSuccess) return L2IR_STATUS_CUDA_ERROR;",
        "  }",
    ]


def _host_shim(cfg: PtxConfig) -> list[str]:
    """Trusted host code: tensor-map encoding, argument checks (pad, align), the launch."""
    dm, dn, dk = cfg.divisible
    store_bytes = cfg.vector * DTYPE_BYTES[cfg.out_dtype]
    units = "num_units" if cfg.split else "num_tiles"
    if cfg.persistent:
        grid_line = f"  const int grid = {units} < NUM_SMS ? int({units}) : NUM_SMS;   // pipeline.persistent=true"
    elif cfg.split and cfg.multicast is not None:
        grid_line = "  const int grid = int(num_units);   // tile.cluster: whole clusters, one cluster grid a K slice"
    elif cfg.split:
        grid_line = "  const int grid = int(num_units);   // pipeline.persistent=false: one block per (tile, slice)"
    elif cfg.multicast is not None:
        grid_line = "  const int grid = int(num_blocks);   // tile.cluster: whole clusters, one tile per block"
    else:
        grid_line = "  const int grid = int(num_tiles);   // pipeline.persistent=false: one block per tile"
    L: list[str] = [
        "// ---- trusted host code: tensor maps and the launch ----",
        "namespace {",
        "",
        "using EncodeTiledFn = PFN_cuTensorMapEncodeTiled_v12000;",
        "",
        "// cuTensorMapEncodeTiled is a driver API function. Fetching it through the runtime keeps the library free of a",
        "// link-time libcuda dependency (it resolves against the driver the process already loaded).",
        "EncodeTiledFn tensor_map_encoder() {",
        "  static EncodeTiledFn fn = []() -> EncodeTiledFn {",
        "    void* p = nullptr;",
        "    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;",
        "    if (cudaGetDriverEntryPointByVersion(\"cuTensorMapEncodeTiled\", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||",
        "        q != cudaDriverEntryPointSuccess) {",
        "      return nullptr;",
        "    }",
        "    return reinterpret_cast<EncodeTiledFn>(p);",
        "  }();",
        "  return fn;",
        "}",
        "",
        "// A K-major operand (rows x K, K contiguous) as a 2D tensor {K, rows}; each box is ATOM_K x box_rows, written",
        f"// to shared memory with the {cfg.row_bytes}-byte swizzle the wgmma descriptors expect. OOB_FILL_NONE fills zeros.",
        "bool encode_operand(EncodeTiledFn encode, CUtensorMap* map, const void* ptr, int rows, int K, int ld,",
        "                    int box_rows) {",
        "  cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(rows)};",
        "  cuuint64_t strides[1] = {cuuint64_t(ld) * sizeof(InT)};   // bytes between rows (K, or a repack copy's pitch):",
        "  //                                                             a multiple of 16",
        "  cuuint32_t box[2] = {cuuint32_t(ATOM_K), cuuint32_t(box_rows)};",
        "  cuuint32_t elem_strides[2] = {1, 1};",
        f"  CUresult r = encode(map, {TMA_DTYPE[cfg.in_dtype]}, 2, const_cast<void*>(ptr), dims, strides, box,",
        f"                      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, {TMA_SWIZZLE[cfg.swizzle_bits]},",
        "                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);",
        "  return r == CUDA_SUCCESS;",
        "}",
        "",
        *([] if cfg.epilogue != "tma" else [
            "// epilogue.path=tma: C (M x N, N contiguous) as a 2D tensor {N, M}; each box is C_BOX_COLS x WG_M, read",
            "// from shared memory with the 128-byte swizzle the epilogue staged it in.",
            "bool encode_output(EncodeTiledFn encode, CUtensorMap* map, void* ptr, int M, int N) {",
            "  cuuint64_t dims[2] = {cuuint64_t(N), cuuint64_t(M)};",
            "  cuuint64_t strides[1] = {cuuint64_t(N) * sizeof(OutT)};   // a multiple of 16 (N % 8 == 0, checked)",
            "  cuuint32_t box[2] = {cuuint32_t(C_BOX_COLS), cuuint32_t(WG_M)};",
            "  cuuint32_t elem_strides[2] = {1, 1};",
            f"  CUresult r = encode(map, {TMA_DTYPE[cfg.out_dtype]}, 2, ptr, dims, strides, box, elem_strides,",
            "                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,",
            "                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);",
            "  return r == CUDA_SUCCESS;",
            "}",
            ""]),
        "// One operand's encoded map from the last call (per host thread, per operand, so a layer's fixed weights hit",
        "// while its activations change). CUtensorMap's own declaration carries the alignment the driver requires.",
        "struct MapCache {",
        "  CUtensorMap map;",
        "  const void* ptr = nullptr;",
        "  int rows = 0, k = 0, ld = 0;",
        "  bool valid = false;",
        "};",
        "",
        "// The operand's map, encoded only when the pointer or the sizes changed since this thread's previous call: the",
        "// map holds only the address, the extents and the box, so these decide it (the unified address implies the",
        "// device). nullptr if the driver refuses the operand.",
        "const CUtensorMap* operand_map(MapCache& cache, const void* ptr, int rows, int K, int ld, int box_rows) {",
        "  if (cache.valid && cache.ptr == ptr && cache.rows == rows && cache.k == K && cache.ld == ld) return &cache.map;",
        "  cache.valid = false;",
        "  EncodeTiledFn encode = tensor_map_encoder();",
        "  if (encode == nullptr || !encode_operand(encode, &cache.map, ptr, rows, K, ld, box_rows)) return nullptr;",
        "  cache.ptr = ptr; cache.rows = rows; cache.k = K; cache.ld = ld; cache.valid = true;",
        "  return &cache.map;",
        "}",
        "",
        *([] if cfg.epilogue != "tma" else [
            "// C's map, encoded only when the pointer or the shape changed (as operand_map).",
            "const CUtensorMap* output_map(MapCache& cache, void* ptr, int M, int N) {",
            "  if (cache.valid && cache.ptr == ptr && cache.rows == M && cache.k == N) return &cache.map;",
            "  cache.valid = false;",
            "  EncodeTiledFn encode = tensor_map_encoder();",
            "  if (encode == nullptr || !encode_output(encode, &cache.map, ptr, M, N)) return nullptr;",
            "  cache.ptr = ptr; cache.rows = M; cache.k = N; cache.ld = N; cache.valid = true;",
            "  return &cache.map;",
            "}",
            ""]),
        "// Opt the kernel into SMEM_BYTES of dynamic shared memory (above the 48 KB default), once per device, so",
        "// calls captured into a CUDA graph issue only the launch.",
        "bool configure_kernel() {",
        "  static std::atomic<unsigned long long> configured{0};   // bit d: device d done",
        "  int device = 0;",
        "  if (cudaGetDevice(&device) != cudaSuccess) return false;",
        "  const unsigned long long bit = device < 64 ? 1ull << device : 0;",
        "  if (bit & configured.load(std::memory_order_acquire)) return true;",
        f"  if (cudaFuncSetAttribute({ENTRY}, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES) != cudaSuccess) {{",
        "    return false;",
        "  }",
        *([] if cfg.blocks_per_sm == 1 else [
            "  // Two blocks per SM need the whole 228 KB as shared memory: ask for the largest carve-out rather than",
            "  // leave the L1/shared split to the driver's heuristic.",
            f"  if (cudaFuncSetAttribute({ENTRY}, cudaFuncAttributePreferredSharedMemoryCarveout,",
            "                           cudaSharedmemCarveoutMaxShared) != cudaSuccess) {",
            "    return false;",
            "  }"]),
        *([] if not (cfg.cluster_reduce and cfg.slices > MAX_CLUSTER) else [
            f"  // reduce=cluster with {cfg.slices} slices: clusters above the portable {MAX_CLUSTER} blocks are an opt-in.",
            f"  if (cudaFuncSetAttribute({ENTRY}, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {{",
            "    return false;",
            "  }"]),
        "  configured.fetch_or(bit, std::memory_order_release);",
        "  return true;",
        "}",
        "",
        "}  // namespace",
        "",
        *_workspace_size(cfg),
        "",
        'extern "C" int l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,',
        "                        void* workspace, size_t workspace_bytes, void* stream) {",
        *([] if cfg.uses_workspace else ["  (void)workspace; (void)workspace_bytes;"]),
        "  if (A == nullptr || B == nullptr || C == nullptr || M <= 0 || N <= 0 || K <= 0) return L2IR_STATUS_BAD_ARGUMENT;",
    ]
    for flag, var, size, fld in ((dm, "M", "BM", "pad.m"), (dn, "N", "BN", "pad.n"), (dk, "K", "BK", "pad.k")):
        if flag:
            L.append(f"  if ({var} % {size} != 0) return L2IR_STATUS_NOT_DIVISIBLE;   // {fld}=divisible")
    L += [
        *(_repack_setup(cfg) if cfg.repack else [
            *(["  const void* a_read = A;"] if not cfg.interleave else []),
            "  const void* b_read = B;",
            *(["  const int lda = K, ldb = K;"] if not cfg.interleave else [])]),
        *([
            "  // interleave: B's view is a 2D map of floor(N / VIEW) rows of VIEW * K elements (a pitch of 16K bytes for",
            "  // any K), its coordinates 32-bit (the verifier's interleave.tma_view_rows rule); fewer than VIEW columns",
            "  // leave the map no row.",
            "  if (N < VIEW || (long long)VIEW * K >= INT_MAX) return L2IR_STATUS_BAD_ARGUMENT;",
            "  const int view_pitch = VIEW * K;",
            "  // TMA: B's 16-byte aligned base; A's stages are written from plain 2-byte loads, any alignment.",
            "  if (reinterpret_cast<uintptr_t>(b_read) % 16 != 0) return L2IR_STATUS_MISALIGNED;"] if cfg.interleave else [
            "  // TMA: 16-byte aligned base addresses and row strides (pad.align=8: K % 8 == 0, or a repack copy).",
            "  if (reinterpret_cast<uintptr_t>(a_read) % 16 != 0 || reinterpret_cast<uintptr_t>(b_read) % 16 != 0 ||",
            "      lda % 8 != 0 || ldb % 8 != 0) {",
            "    return L2IR_STATUS_MISALIGNED;",
            "  }"]),
        f"  // epilogue.vector={cfg.vector}: {store_bytes}-byte stores need aligned rows and base.",
        f"  if (reinterpret_cast<uintptr_t>(C) % {store_bytes} != 0 || N % {cfg.vector} != 0) "
        "return L2IR_STATUS_MISALIGNED;",
        ("  const long long num_tiles = (long long)((M + BM - 1) / BM) * ((N + BN - 1) / BN);" if not cfg.interleave else
         f"  const long long num_tiles = (long long)((M + BM - 1) / BM) * ({column_tiles(Var('N'), cfg.bn, True).to_cpp()});"
         "   // interleave: Interleave.tiles_n"),
        "  if (num_tiles > INT_MAX) return L2IR_STATUS_BAD_ARGUMENT;",
        *([] if not cfg.split or cfg.multicast is not None else [
            "  const long long num_units = num_tiles * SLICES;"
            + ("   // reduce=cluster: SLICES blocks (one cluster) a tile" if cfg.cluster_reduce else ""),
            "  if (num_units > INT_MAX) return L2IR_STATUS_BAD_ARGUMENT;"]),
        *([] if cfg.multicast is None else [
            "  const long long tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;",
            f"  const long long num_blocks = CLUSTER_SIZE * {cfg.multicast.clusters().to_cpp()};   // whole clusters",
            "  if (num_blocks > INT_MAX) return L2IR_STATUS_BAD_ARGUMENT;",
            *(["  const long long num_units = num_blocks * SLICES;   // one cluster grid a K slice",
               "  if (num_units > INT_MAX) return L2IR_STATUS_BAD_ARGUMENT;"] if cfg.split else [])]),
        *([] if not cfg.tree else [
            "  // splitk: the partials, then SLICES - 1 pair counters per tile (zero before the first launch:",
            "  // plan.zero_workspace; every launch leaves them zero). float4 partial stores need 16-byte alignment.",
            "  if (workspace == nullptr || workspace_bytes < l2ir_workspace_size(M, N, K)) {",
            "    return L2IR_STATUS_WORKSPACE_TOO_SMALL;",
            "  }",
            "  if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) return L2IR_STATUS_MISALIGNED;",
            ("  float* ws = reinterpret_cast<float*>(static_cast<char*>(workspace) + "
             f"({cfg.repack_layout.end.to_cpp()}) * sizeof(InT));   // after the repack copies"
             if cfg.repack else "  float* ws = static_cast<float*>(workspace);"),
            "  unsigned* counters = reinterpret_cast<unsigned*>(ws + num_tiles * SLICES * PARTIAL_FLOATS);"]),
        "  // Encoding a tensor map is a driver call: a repeated call on the same operand re-uses its map.",
        ("  thread_local MapCache cache_a, cache_b;" if not cfg.interleave else "  thread_local MapCache cache_b;"),
        *([f"  const CUtensorMap* tmap_a = operand_map(cache_a, a_read, M, K, lda, {'BM' if cfg.multicast is None else 'A_BOX_ROWS'});",
           f"  const CUtensorMap* tmap_b = operand_map(cache_b, b_read, N, K, ldb, {'BN' if cfg.multicast is None else 'B_BOX_ROWS'});"]
          if not cfg.interleave else [
           "  const CUtensorMap* tmap_b = operand_map(cache_b, b_read, N / VIEW, view_pitch, view_pitch, BN);   // the view"]),
        ("  if (tmap_a == nullptr || tmap_b == nullptr) return L2IR_STATUS_TENSOR_MAP;" if not cfg.interleave else
         "  if (tmap_b == nullptr) return L2IR_STATUS_TENSOR_MAP;"),
        *([] if cfg.epilogue != "tma" else [
            "  thread_local MapCache cache_c;",
            "  const CUtensorMap* tmap_c = output_map(cache_c, C, M, N);",
            "  if (tmap_c == nullptr) return L2IR_STATUS_TENSOR_MAP;"]),
        "  if (!configure_kernel()) return L2IR_STATUS_CUDA_ERROR;",
        *(_repack_launch(cfg) if cfg.repack else []),
        grid_line,
        *_launch_ex(cfg),
        "  return cudaGetLastError() == cudaSuccess ? 0 : L2IR_STATUS_CUDA_ERROR;",
        "}",
        "",
        *run_args_cpp(),
        *_max_active_clusters(cfg),
    ]
    return L


def _max_active_clusters(cfg: PtxConfig) -> list[str]:
    """l2ir_max_active_clusters: how many of the GEMM's clusters (reduce=cluster: SLICES blocks; otherwise one block)
    the GPU holds at once, asked of the runtime that registered the kernel (the library's own, linked statically:
    no other runtime can name its function). A cluster's blocks must share a GPC, so a GPU holds fewer four-block
    clusters than its SM count / 4; bench/cluster_occupancy_probe.py compares the answer with the shape's grid."""
    size = "SLICES" if cfg.cluster_reduce else "CLUSTER_SIZE" if cfg.multicast is not None else "1"
    return [
        "// The GEMM's clusters resident at once (cudaOccupancyMaxActiveClusters), or -1 if the runtime refuses.",
        'extern "C" int l2ir_max_active_clusters() {',
        "  if (!configure_kernel()) return -1;",
        "  cudaLaunchAttribute attr[1];",
        "  attr[0].id = cudaLaunchAttributeClusterDimension;",
        f"  attr[0].val.clusterDim.x = {size};",
        "  attr[0].val.clusterDim.y = 1;",
        "  attr[0].val.clusterDim.z = 1;",
        "  cudaLaunchConfig_t config = {};",
        f"  config.gridDim = dim3({size}, 1, 1);   // the grid only has to be a whole number of clusters",
        "  config.blockDim = dim3(THREADS, 1, 1);",
        "  config.dynamicSmemBytes = SMEM_BYTES;",
        "  config.attrs = attr;",
        "  config.numAttrs = 1;",
        "  int clusters = 0;",
        f"  if (cudaOccupancyMaxActiveClusters(&clusters, {ENTRY}, &config) != cudaSuccess) return -1;",
        "  return clusters;",
        "}",
        "",
    ]


def _launch_ex(cfg: PtxConfig) -> list[str]:
    """The GEMM's launch through cudaLaunchKernelEx, for what <<<>>> cannot say: reduce=cluster's cluster of SLICES
    blocks, and programmatic dependent launch (the GEMM's blocks may be placed while the stream's previous grid, a
    repack copy or any kernel, drains; its producer waits with griddepcontrol.wait before the first TMA load).
    Built with -DL2IR_PDL=0 it is an ordinary launch (bench/pdl_probe.py compares the two)."""
    args = ("*tmap_a, *tmap_b, " if not cfg.interleave else
            "*tmap_b, static_cast<const InT*>(A), static_cast<const InT*>(B), ")
    args = (args
            + ("*tmap_c, " if cfg.epilogue == "tma" else "") + "static_cast<OutT*>(C), M, N, K"
            + (", ws, counters" if cfg.tree else ""))
    L = ["  cudaLaunchAttribute attr[2];", "  unsigned num_attrs = 0;"]
    if cfg.multicast is not None:
        L += [
            "  // tile.cluster: clusters of CLUSTER_SIZE consecutive blocks, a patch of tiles each; the hardware",
            "  // co-schedules a cluster's blocks on one GPC, which is what lets TMA write into all of them.",
            "  attr[num_attrs].id = cudaLaunchAttributeClusterDimension;",
            "  attr[num_attrs].val.clusterDim.x = CLUSTER_SIZE;",
            "  attr[num_attrs].val.clusterDim.y = 1;",
            "  attr[num_attrs].val.clusterDim.z = 1;",
            "  ++num_attrs;",
        ]
    if cfg.cluster_reduce:
        L += [
            "  // splitk reduce=cluster: clusters of SLICES consecutive blocks, one per tile; the hardware co-schedules a",
            "  // cluster's blocks on one GPC, which is what lets them push into each other's shared memory.",
            "  attr[num_attrs].id = cudaLaunchAttributeClusterDimension;",
            "  attr[num_attrs].val.clusterDim.x = SLICES;",
            "  attr[num_attrs].val.clusterDim.y = 1;",
            "  attr[num_attrs].val.clusterDim.z = 1;",
            "  ++num_attrs;",
        ]
    L += [
        "#if L2IR_PDL",
        "  // Programmatic dependent launch: the grid may be placed while the stream's previous grid drains (a repack",
        "  // copy lets it start early with griddepcontrol.launch_dependents); the producer's griddepcontrol.wait",
        "  // orders every global access after that grid.",
        "  attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;",
        "  attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;",
        "  ++num_attrs;",
        "#endif",
    ]
    L += [
        "  cudaLaunchConfig_t config = {};",
        "  config.gridDim = dim3(grid, 1, 1);",
        "  config.blockDim = dim3(THREADS, 1, 1);",
        "  config.dynamicSmemBytes = SMEM_BYTES;",
        "  config.stream = static_cast<cudaStream_t>(stream);",
        "  config.attrs = attr;",
        "  config.numAttrs = num_attrs;",
        f"  if (cudaLaunchKernelEx(&config, {ENTRY}, {args}) != cudaSuccess) {{",
        "    return L2IR_STATUS_CUDA_ERROR;",
        "  }",
    ]
    return L


def _workspace_size(cfg: PtxConfig) -> list[str]:
    """l2ir_workspace_size: workspace_bytes(cfg) rendered, so the shim and LaunchPlan.workspace_bytes agree."""
    expr = workspace_bytes(cfg)
    parts = ["repack's copies"] * bool(cfg.repack) + ["split-K's partials and pair counters"] * cfg.tree
    return [
        f"// {' then '.join(parts) or 'nothing'} (workspace_bytes() in sm90a.py, the plan's workspace_bytes).",
        'extern "C" size_t l2ir_workspace_size(int M, int N, int K) {',
        *([f"  (void){v.upper()};" for v in "mnk" if v not in expr.free_vars()]),
        *([f"  const long long {v} = {v.upper()};" for v in "mnk" if v in expr.free_vars()]),
        f"  return size_t({expr.to_cpp()});",
        "}",
    ]


def workspace_bytes(cfg: PtxConfig) -> Expr:
    """Workspace as an expression of m, n, k: repack's copies (l2ir.indexing.Repack; 0 bytes on an aligned K), then
    split-K's partials and pair counters: tiles x (slices x BM x BN fp32 + (slices - 1) 4-byte counters)."""
    total: Expr = Const(0)
    if cfg.repack:
        total = cfg.repack_layout.end * DTYPE_BYTES[cfg.in_dtype]
    if cfg.tree:
        tiles = cdiv(Var("m"), cfg.bm) * column_tiles(Var("n"), cfg.bn, cfg.interleave)
        tree = tiles * Const(cfg.slices * cfg.partial_floats * 4 + SplitKTree(cfg.slices).counters * 4)
        total = tree if not cfg.repack else total + tree
    return total


def render(cfg: PtxConfig) -> str:
    """The .cu text for one configuration. Deterministic: the same PtxConfig gives the same bytes."""
    sections = (_header(cfg), _config(cfg), _device_functions(cfg), _kernel(cfg), _repack_kernel(cfg), _host_shim(cfg))
    return "\n".join(line for section in sections for line in section)


# ---------------------------------------------------------------------------------------------------------------
# lower
# ---------------------------------------------------------------------------------------------------------------


def lower(kernel: Kernel, problem: Problem, num_sms: int = H200_SMS) -> LaunchPlan:
    """IR -> LaunchPlan(form="host_shim"): a shared library exporting l2ir_workspace_size / l2ir_run."""
    cfg = canonicalize(kernel, problem, num_sms)
    return LaunchPlan(
        source=render(cfg),
        arch="sm_90a",
        form="host_shim",
        workspace_bytes=workspace_bytes(cfg),
        # split-K's pair counters must be zero before the first launch; every launch leaves them zero (each pair's
        # last arrival resets its counter), so one zeroing at allocation serves every later call. The partials
        # are always written before they are read.
        zero_workspace=cfg.tree,
        needs_cutlass=False,
    )


__all__ = ["PtxConfig", "canonicalize", "render", "lower", "ENTRY"]
