"""The verifier: declarative rules over a kernel (and over a kernel paired with a problem).

Each rule is a small function registered with the node it belongs to, its name and the error class it raises. A
rule returns None when the kernel obeys it, or a message saying what is wrong. `verify(kernel)` runs every kernel
rule and raises the first violation as its typed error; `violations(kernel)` lists them all (for the CLI).
`check_problem(kernel, problem)` adds the rules that depend on the problem: divisibility, alignment, split-K vs K.

The hardware numbers come from l2ir.target and the derived quantities (smem bytes, resolved stages, registers)
from l2ir.analysis, each defined once; the rules only compare them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .errors import (EpilogueError, ExprError, MmaError, PadError, PipelineError, ProblemError, ResourceError,
                     SourceError, SplitKError, SwizzleError, TargetError, TileError, VerifyError)
from .indexing import LAUNCH_VARS, REPACK_ALIGN, BlockSplit, DirectFeed, Interleave, ceil_div, leaves_empty_slice
from .nodes import OPTIONAL_NODES, SCHEDULE_NODES, Kernel, Problem
from .analysis import (acc_registers, block_reduce, cluster_receive_bytes, elem_bytes,
                       estimated_registers, resolved_stages, ring_bytes, ring_description, smem_bytes, threads,
                       warpgroups_m)
from .target import (BLOCK_DIM_MAX, CLUSTER_ARCHS, DTYPE_BYTES, KB, MAX_CLUSTER, MAX_CLUSTER_NONPORTABLE, MAX_REGS,
                     MAX_THREADS, REGS_PER_SM, MAX_WGMMA_ACC_REGS, MMA_SYNC_SHAPES, SMEM_LIMIT, TMA_BOX_MAX)


# ---------------------------------------------------------------------------------------------------------------
# The rule registry.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    node: str
    name: str
    error: type[VerifyError]
    check: Callable
    doc: str


KERNEL_RULES: list[Rule] = []
PROBLEM_RULES: list[Rule] = []


def rule(node: str, name: str, error: type[VerifyError], schedule_only: bool = True, problem: bool = False):
    """Register a rule. Schedule-only rules are skipped for Source kernels."""

    def deco(fn):
        def check(*args):
            kernel = args[0]
            if schedule_only and kernel.is_source:
                return None
            return fn(*args)

        r = Rule(node, name, error, check, (fn.__doc__ or "").strip())
        (PROBLEM_RULES if problem else KERNEL_RULES).append(r)
        return fn

    return deco


def violations(kernel: Kernel) -> list[VerifyError]:
    """Every kernel rule that fails, as typed errors, in rule order."""
    structural = _structure(kernel)
    if structural:
        return [structural]
    out = []
    for r in KERNEL_RULES:
        msg = r.check(kernel)
        if msg:
            out.append(r.error(r.node, r.name, msg))
    return out


def verify(kernel: Kernel) -> Kernel:
    """Raise the first violated rule as its typed error; return the kernel when legal."""
    errs = violations(kernel)
    if errs:
        raise errs[0]
    return kernel


def problem_violations(kernel: Kernel, problem: Problem) -> list[VerifyError]:
    out = violations(kernel)
    if out:
        return out
    for r in PROBLEM_RULES:
        msg = r.check(kernel, problem)
        if msg:
            out.append(r.error(r.node, r.name, msg))
    return out


def check_problem(kernel: Kernel, problem: Problem) -> Kernel:
    """Raise unless the kernel is legal and can run this problem (divisibility, alignment, split-K vs K)."""
    errs = problem_violations(kernel, problem)
    if errs:
        raise errs[0]
    return kernel


def applicable(kernel: Kernel, problem: Problem) -> bool:
    return not problem_violations(kernel, problem)


def _structure(kernel: Kernel) -> VerifyError | None:
    present = [n for n in SCHEDULE_NODES + OPTIONAL_NODES if getattr(kernel, n) is not None]
    if kernel.is_source:
        if present:
            return SourceError("source", "source_excludes_schedule",
                               f"a Source kernel carries its own schedule; remove {', '.join(present)}")
        return None
    missing = [n for n in SCHEDULE_NODES if getattr(kernel, n) is None]
    if missing:
        return TileError(missing[0], "schedule_complete",
                         f"a schedule kernel needs {', '.join(SCHEDULE_NODES)}; missing {', '.join(missing)}")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Target: instruction availability.
# ---------------------------------------------------------------------------------------------------------------


@rule("mma", "wgmma_needs_sm90a", TargetError)
def _wgmma_target(k: Kernel):
    """wgmma exists only in the arch-specific sm90a target."""
    if k.mma.op == "wgmma" and k.target.arch != "sm90a":
        return f"wgmma needs target sm90a, not {k.target.arch}"


@rule("pipeline", "tma_needs_sm90", TargetError)
def _tma_target(k: Kernel):
    """TMA bulk tensor copies and mbarrier transaction counts are Hopper features."""
    if k.pipeline.mode == "tma_ws" and not k.target.is_hopper:
        return f"TMA warp-specialized pipelines need sm90/sm90a, not {k.target.arch}"


@rule("tile", "cluster_needs_sm90", TargetError)
def _cluster_target(k: Kernel):
    """Thread-block clusters (distributed shared memory, TMA multicast) start with sm90."""
    if k.tile.cluster != (1, 1) and not k.target.is_hopper:
        return f"cluster {k.tile.cluster[0]}x{k.tile.cluster[1]} needs sm90/sm90a; {k.target.arch} has no clusters"


@rule("epilogue", "tma_store_needs_sm90", TargetError)
def _tma_epilogue_target(k: Kernel):
    """The TMA store epilogue uses bulk tensor copies from shared memory: Hopper only."""
    if k.epilogue.path == "tma" and not k.target.is_hopper:
        return f"epilogue path=tma needs sm90/sm90a, not {k.target.arch}"


# ---------------------------------------------------------------------------------------------------------------
# MMA and tile.
# ---------------------------------------------------------------------------------------------------------------


@rule("mma", "shape_exists", MmaError)
def _mma_shape(k: Kernel):
    """mma.sync on 16-bit inputs is m16n8k16 (or m16n8k8); wgmma is m64nNk16 with N a multiple of 8 up to 256."""
    m, n, kk = k.mma.shape
    if k.mma.op == "mma_sync" and (m, n, kk) not in MMA_SYNC_SHAPES:
        return f"mma_sync has shapes 16x8x16 and 16x8x8 for 16-bit inputs, not {m}x{n}x{kk}"
    if k.mma.op == "wgmma" and not (m == 64 and kk == 16 and n % 8 == 0 and 8 <= n <= 256):
        return f"wgmma has shapes 64xNx16 with N in 8..256 step 8, not {m}x{n}x{kk}"


@rule("tile", "mma_divides_warp_tile", TileError)
def _warp_tile(k: Kernel):
    """Each warp's tile (block / warps) must be a whole number of MMA instructions."""
    bm, bn, bk = k.tile.block
    wm, wn = k.tile.warps
    mm, mn, mk = k.mma.shape
    if k.mma.op == "wgmma":
        if wm % 4:
            return f"wgmma is issued by warpgroups of 4 warps stacked along M; warps={wm}x{wn} has {wm} along M"
        gm = warpgroups_m(k)
        if bm % (gm * 64):
            return f"BM={bm} must split into {gm} warpgroup tile(s) of a multiple of 64 rows"
        if bn % wn or bn // wn != mn:
            return (f"each warpgroup covers BN/warps_n={bn}/{wn} columns, which must equal the wgmma N={mn} "
                    f"(one instruction spans the warpgroup's whole N)")
    elif k.pipeline.mode == "direct":
        return None                       # the direct rule (direct_tile) says what its tile must be
    else:
        if bm % (wm * mm):
            return f"BM={bm} is not a multiple of warps_m*{mm}={wm * mm}"
        if bn % (wn * mn):
            return f"BN={bn} is not a multiple of warps_n*{mn}={wn * mn}"
    if bk % mk:
        return f"BK={bk} is not a multiple of the MMA K={mk}"


@rule("tile", "thread_count", TileError)
def _thread_count(k: Kernel):
    """A block has at most 1024 threads."""
    t = threads(k)
    if t > MAX_THREADS:
        return f"{t} threads per block exceeds {MAX_THREADS}"


@rule("tile", "copy_partition", TileError)
def _copy_partition(k: Kernel):
    """cp.async pipelines split each A and B tile evenly over the block, one aligned vector per thread per copy."""
    if k.pipeline.mode != "multistage":
        return None
    bm, bn, bk = k.tile.block
    chunk = threads(k) * k.pad.align
    for name, rows in (("A", bm), ("B", bn)):
        if (rows * bk) % chunk:
            return (f"the {name} tile {rows}x{bk} is not a multiple of threads*align={threads(k)}*{k.pad.align}: "
                    f"the block cannot load it in whole vectors")
    if bk % k.pad.align:
        return f"BK={bk} is not a multiple of pad.align={k.pad.align}"


@rule("tile", "cluster_size", TileError)
def _cluster_size(k: Kernel):
    """Portable clusters hold at most 8 blocks, in powers of two per dimension."""
    cm, cn = k.tile.cluster
    if cm & (cm - 1) or cn & (cn - 1):
        return f"cluster {cm}x{cn}: each dimension must be a power of two"
    if cm * cn > MAX_CLUSTER:
        return f"cluster {cm}x{cn} has {cm * cn} blocks; the portable limit is {MAX_CLUSTER}"


@rule("tile", "wgmma_k_tile", TileError)
def _wgmma_bk(k: Kernel):
    """A TMA tile row of BK 16-bit elements must fill at least one 32-byte swizzle atom."""
    if k.pipeline.mode == "tma_ws" and k.tile.bk % 32:
        return f"BK={k.tile.bk} must be a multiple of 32 for TMA tiles (>= 64-byte rows)"


@rule("tile", "tma_box", TileError)
def _tma_box(k: Kernel):
    """A TMA copy moves a box of at most 256 elements per dimension; each operand tile is one box."""
    if k.pipeline.mode == "tma_ws" and max(k.tile.block) > TMA_BOX_MAX:
        return f"tile {k.tile.bm}x{k.tile.bn}x{k.tile.bk}: TMA boxes span at most {TMA_BOX_MAX} elements per dimension"


# ---------------------------------------------------------------------------------------------------------------
# Pipeline.
# ---------------------------------------------------------------------------------------------------------------


@rule("pipeline", "feeds_mma", PipelineError)
def _pipeline_mma(k: Kernel):
    """cp.async multistage pipelines feed mma.sync through ldmatrix; TMA pipelines feed wgmma from shared memory."""
    if k.pipeline.mode == "tma_ws" and k.mma.op != "wgmma":
        return "a tma_ws pipeline feeds wgmma; use mode=multistage with mma_sync"
    if k.pipeline.mode in ("multistage", "direct") and k.mma.op != "mma_sync":
        return "wgmma reads operands through TMA-filled shared memory; use mode=tma_ws"


@rule("pipeline", "stage_count", PipelineError)
def _stages(k: Kernel):
    """cp.async rings hold 1..13 stages; TMA rings need >= 2 so the producer can run ahead."""
    s = k.pipeline.stages
    if k.pipeline.mode == "multistage":
        if s == "auto":
            return "stages=auto is only for tma_ws pipelines (the CUTLASS carve-out); give a number"
        if not 1 <= s <= 13:
            return f"multistage pipelines take 1..13 stages, not {s}"
    elif k.pipeline.mode == "direct":
        if s not in DIRECT_STAGES:
            return (f"direct pipelines keep 1 to {DIRECT_STAGES[-1]} k steps of A and B vectors in registers "
                    f"(stages=1..{DIRECT_STAGES[-1]}), not {s}")
        if s > 2 and k.pad.align < 8:
            # Realigned rows keep two raw vectors per row and chunk and shift them into place: ptxas spilled such
            # kernels at 3 stages under the register rule's bound (8x32x128 align 1: 16 bytes, nvcc 13).
            return (f"direct stages={s} needs pad.align=8: realigned rows (align {k.pad.align}) hold twice the "
                    "vectors per stage and spill beyond 2 stages")
    else:
        if resolved_stages(k) < 2:
            return f"a TMA pipeline needs at least 2 stages, has {resolved_stages(k)}"


@rule("pipeline", "schedule", PipelineError)
def _schedule(k: Kernel):
    """Warp-specialized kernels are cooperative (2 consumer warpgroups share a tile: warps 8x1) or ping-pong
    (2 consumer warpgroups alternate tiles, one warpgroup each: warps 4x1)."""
    p = k.pipeline
    if p.mode in ("multistage", "direct"):
        if p.schedule != "none":
            return f"schedule={p.schedule} is for tma_ws pipelines; {p.mode} takes schedule=none"
        return None
    if p.schedule == "none":
        return "tma_ws pipelines need schedule=cooperative or schedule=pingpong"
    want = (8, 1) if p.schedule == "cooperative" else (4, 1)
    if k.tile.warps != want:
        return f"schedule={p.schedule} uses warps={want[0]}x{want[1]} consumer warps per tile, not " \
               f"{k.tile.warps[0]}x{k.tile.warps[1]}"


@rule("pipeline", "prefetch_needs_fragments", PipelineError)
def _prefetch(k: Kernel):
    """Register prefetch double-buffers ldmatrix fragments; wgmma reads B (and here A) straight from shared memory."""
    if k.pipeline.prefetch and k.mma.op == "wgmma":
        return "prefetch=true double-buffers ldmatrix fragments; wgmma has none (set prefetch=false)"


@rule("pipeline", "persistent_needs_tma_ws", PipelineError)
def _persistent(k: Kernel):
    """The persistent tile scheduler belongs to the warp-specialized kernels."""
    if k.pipeline.persistent and k.pipeline.mode != "tma_ws":
        return "persistent=true needs a tma_ws pipeline"


# pipeline mode=direct (l2ir.indexing.DirectFeed): rows of A per block (one m16 MMA fed half: rows g + 8 are
# zeros; or whole m16 blocks), K chunks per k step, the stages of A and B vectors held in registers, and the K slices of a block.
DIRECT_BM = (8, 16, 32, 48, 64)
DIRECT_STAGES = (1, 2, 3, 4)   # 3 and 4 with aligned rows only; the register rule bounds them by the tile's size
DIRECT_MAX_SLICES = 8


@rule("tile", "direct_registers_per_sm", ResourceError)
def _direct_block_registers(k: Kernel):
    """A block's threads x registers must fit one SM's register file, or it never launches. Direct kernels keep
    their loads in flight in registers, so their blocks are the ones that get there."""
    if k.pipeline.mode != "direct":
        return None
    need = threads(k) * estimated_registers(k)
    if need > REGS_PER_SM:
        return (f"{threads(k)} threads x about {estimated_registers(k)} registers = {need} exceeds the "
                f"{REGS_PER_SM} registers of an SM: use fewer K slices or chunks")


@rule("tile", "direct_tile", TileError)
def _direct_tile(k: Kernel):
    """A direct kernel's warps each take all BM rows of A (warps=1xWN) and BN/WN columns in n8 blocks; a k step is
    whole 32-element chunks (4 lanes x 8 elements per row); BM is 8 (half an m16 block) or m16 blocks up to 64."""
    if k.pipeline.mode != "direct":
        return None
    bm, bn, bk = k.tile.block
    wm, wn = k.tile.warps
    if wm != 1:
        return (f"direct kernels give every warp all BM rows (its A fragments come from global memory): "
                f"warps=1x{wn}, not {wm}x{wn}")
    if bm not in DIRECT_BM:
        return f"direct kernels take BM in {', '.join(map(str, DIRECT_BM))} (rows of A in m16 blocks), not {bm}"
    if bn % (8 * wn):
        return f"BN={bn} must split into n8 blocks over {wn} warps (a multiple of {8 * wn})"
    if bk % DirectFeed.CHUNK_K:
        return (f"BK={bk} must be a multiple of {DirectFeed.CHUNK_K}: a chunk is 4 lanes x 8 elements of each row")
    if k.tile.cluster != (1, 1):
        return "direct kernels share nothing between blocks: tile.cluster must be 1x1"


@rule("pipeline", "direct_operands_in_registers", PipelineError)
def _direct_shared(k: Kernel):
    """Direct kernels keep operands in registers: no shared-memory swizzle, repack or staged epilogue, and K split
    only between the block's own warps (reduce=block, whose accumulators alone pass through shared memory)."""
    if k.pipeline.mode != "direct":
        return None
    if k.swizzle is not None and k.swizzle.smem is not None:
        return "a direct pipeline has no shared memory to swizzle: set swizzle.smem=none"
    if k.pipeline.prefetch:
        return "prefetch=true double-buffers ldmatrix fragments; a direct pipeline has none (stages holds B ahead)"
    if k.splitk is not None:
        sk = k.splitk
        if sk.mode != "split_k" or sk.reduce != "block":
            return (f"a direct pipeline splits K only between its own warps: splitk mode=split_k reduce=block, not "
                    f"mode={sk.mode} reduce={sk.reduce}")
        if not 2 <= sk.slices <= DIRECT_MAX_SLICES:
            return f"a direct block holds 2..{DIRECT_MAX_SLICES} K slices of 1x{k.tile.warps[1]} warps, not {sk.slices}"
    if k.repack is not None:
        return "a direct pipeline realigns rows itself (pad.align < 8); remove the repack node"
    if k.epilogue.path != "direct":
        return f"a direct pipeline stores its accumulators from registers: epilogue path=direct, not {k.epilogue.path}"
    if k.epilogue.vector > 2:
        return (f"epilogue vector={k.epilogue.vector}: a lane's m16n8 accumulator fragment holds 2 adjacent columns; a "
                "direct pipeline stores 1 or 2")
    if tuple(k.mma.shape) != (16, 8, 16):
        return (f"mma {'x'.join(map(str, k.mma.shape))}: a direct pipeline's chunk feeds two m16n8k16 MMAs "
                "(l2ir.indexing.DirectFeed)")


# ---------------------------------------------------------------------------------------------------------------
# Resources.
# ---------------------------------------------------------------------------------------------------------------


@rule("pipeline", "smem_budget", ResourceError)
def _smem(k: Kernel):
    """Pipeline ring plus epilogue staging must fit the target's per-block shared memory."""
    need, limit = smem_bytes(k), SMEM_LIMIT[k.target.arch]
    if need > limit:
        receive = cluster_receive_bytes(k)
        return (f"needs {need / KB:.1f} KB of shared memory ({ring_description(k)} + epilogue"
                + (f" + reduce=cluster's {receive / KB:.0f} KB receive buffer" if receive else "") + "); "
                f"{k.target.arch} allows {limit // KB} KB")


@rule("splitk", "block_partial_fits", ResourceError)
def _block_partial(k: Kernel):
    """reduce=block: each consumer warpgroup leaves the half of its fp32 partial that the other one stores over the
    block's finished stage rings, so the rings must hold BM x BN x 4 bytes. (reduce=cluster pushes into a receive
    buffer of its own, which smem_budget counts.)"""
    if k.is_source or not block_reduce(k) or k.pipeline.mode == "direct":
        return None
    partial, ring = k.tile.bm * k.tile.bn * 4, ring_bytes(k)
    if partial > ring:
        return (f"reduce=block keeps the {k.tile.bm}x{k.tile.bn} fp32 partial ({partial / KB:.0f} KB) "
                f"over the stage rings, which hold {ring / KB:.0f} KB ({ring_description(k)}): raise pipeline.stages")


@rule("tile", "register_budget", ResourceError)
def _registers(k: Kernel):
    """Accumulators and fragments must fit the 255-register file of a thread, or the kernel spills."""
    if k.mma.op == "wgmma":
        acc = acc_registers(k)
        if acc > MAX_WGMMA_ACC_REGS:
            return (f"{acc} accumulator registers per consumer thread (tile {k.tile.bm}x{k.tile.bn} over "
                    f"{warpgroups_m(k)} warpgroup(s) along M) exceeds {MAX_WGMMA_ACC_REGS}")
        return None
    est = estimated_registers(k)
    if est > MAX_REGS:
        return (f"about {est} registers per thread ({acc_registers(k)} accumulators + fragments + overhead) "
                f"exceeds {MAX_REGS}: use more warps or a smaller tile")


# ---------------------------------------------------------------------------------------------------------------
# Swizzle and rasterization.
# ---------------------------------------------------------------------------------------------------------------


@rule("swizzle", "smem_swizzle_fits_row", SwizzleError)
def _swizzle_row(k: Kernel):
    """Swizzle<B,M,S> XORs B bits of the row index into the 16-byte-chunk index: the unit must be a 16-byte vector
    (M=3 for 16-bit data), the source bits must not overlap the target bits (S >= B), and a K-major tile row of BK
    elements must hold the 2^(B+M) elements the XOR permutes."""
    if k.swizzle is None or k.swizzle.smem is None:
        return None
    b, m, s = k.swizzle.smem
    if m != 3:
        return f"swizzle <{b},{m},{s}>: M must be 3 (16-byte units of 16-bit elements, one ldmatrix/cp.async row)"
    if s < b:
        return f"swizzle <{b},{m},{s}>: S={s} < B={b} makes the XOR source and target bits overlap"
    if (1 << (b + m)) > k.tile.bk:
        return f"swizzle <{b},{m},{s}> permutes rows of {1 << (b + m)} elements but BK={k.tile.bk}"
    atom = 1 << (b + m + s)
    if (min(k.tile.bm, k.tile.bn) * k.tile.bk) % atom:
        return (f"swizzle <{b},{m},{s}> permutes blocks of {atom} elements; a {min(k.tile.bm, k.tile.bn)}x"
                f"{k.tile.bk} tile is not a whole number of them")
    if k.pipeline.mode == "tma_ws" and s != 3:
        return f"TMA supports the 32/64/128-byte swizzles <1..3,3,3>, not <{b},{m},{s}>"


@rule("swizzle", "raster_group", SwizzleError)
def _raster_group(k: Kernel):
    """CUTLASS's tile scheduler takes a swizzle size of 1, 2, 4 or 8."""
    if k.swizzle is not None and k.pipeline.mode == "tma_ws" and k.swizzle.group not in (1, 2, 4, 8):
        return f"tma_ws kernels take raster group 1, 2, 4 or 8, not {k.swizzle.group}"


# ---------------------------------------------------------------------------------------------------------------
# Pad, split-K, epilogue.
# ---------------------------------------------------------------------------------------------------------------


@rule("pad", "tma_bounds_and_alignment", PadError)
def _tma_pad(k: Kernel):
    """TMA fills out-of-bounds boxes with zeros in hardware (no predication exists) and needs 16-byte strides."""
    if k.pipeline.mode != "tma_ws":
        return None
    for dim in ("m", "n", "k"):
        if getattr(k.pad, dim) == "predicate":
            return f"pad.{dim}=predicate: TMA has no predicated loads; use zero_fill (hardware OOB fill) or divisible"
    if k.interleave is not None:
        return None     # the interleave view's row pitch is 8K elements, 16K bytes, for any K (its own rule)
    if k.pad.align != 8:
        return f"TMA needs 16-byte aligned global strides: pad.align must be 8, not {k.pad.align}"


@rule("repack", "copies_are_aligned", PadError)
def _repack(k: Kernel):
    """The repack kernel pads copied rows to 8 elements (l2ir.indexing.REPACK_ALIGN): the GEMM reads them with
    8-element (16-byte) loads, so pad.align must say so; a narrower align would give up what the copy buys."""
    if k.repack is not None and k.pad.align != REPACK_ALIGN:
        return (f"repack copies misaligned operands into rows of a multiple of {REPACK_ALIGN} elements; set "
                f"pad.align={REPACK_ALIGN}, not {k.pad.align}")


# reduce=block: accumulators per consumer thread (BM x BN / 128, both warpgroups span the tile) that still fit.
BLOCK_REDUCE_MAX_ACC = 128


@rule("interleave", "residue_columns", PadError)
def _interleave(k: Kernel):
    """The interleave node gives a block columns 8 apart whose B rows share one alignment (l2ir.indexing.Interleave),
    one block per output tile, split-K (if any) over each tile's own view. It is for rows on any 2-byte boundary
    (pad.align=1, which also keeps stores to one element: a thread's two accumulator columns are 8 apart in C), a
    residue's view ends past N and starts each row up to 7 elements early (K and N are checked). It answers the
    misaligned rows the repack node would copy: the repack node needs pad.align=8, so the two never meet.
    Two forms: a cp.async ring (mode=multistage, mma.sync), and the tensor-map form (mode=tma_ws, wgmma: B's view
    is one TMA map, A's stages written by threads; Interleave.tma_view_rows) on one consumer warpgroup
    (schedule=pingpong, non-persistent), which zeroes the view's columns outside the row in shared memory itself."""
    if k.interleave is None:
        return None
    if k.pipeline.mode == "tma_ws":
        p = k.pipeline
        if k.tile.cluster != (1, 1) or p.persistent or p.schedule != "pingpong":
            return (f"interleave on a tma_ws pipeline is one tile per block on one consumer warpgroup (schedule="
                    f"pingpong, persistent=false, cluster 1x1), not schedule={p.schedule} persistent="
                    f"{str(p.persistent).lower()} cluster {k.tile.cluster[0]}x{k.tile.cluster[1]}")
        if k.epilogue.path != "direct":
            return (f"interleave on a tma_ws pipeline stores single elements 8 columns apart from registers "
                    f"(epilogue path=direct), not path={k.epilogue.path}")
    elif k.pipeline.mode != "multistage" or k.tile.cluster != (1, 1):
        return (f"interleave is defined for one block per output tile fed by a cp.async ring (pipeline "
                f"mode=multistage, cluster 1x1) or a TMA ring (mode=tma_ws), not mode={k.pipeline.mode} with "
                f"cluster {k.tile.cluster[0]}x{k.tile.cluster[1]}")
    if k.splitk is not None and (k.splitk.mode != "split_k" or k.splitk.reduce not in ("workspace", "atomic")):
        return (f"interleave splits K through a workspace or atomics only (each tile's slices share its view of "
                f"B), not {k.splitk.mode} reduce={k.splitk.reduce}")
    if k.pad.align != 1:
        return (f"interleave reads B's rows from their common offset inside a 16-byte vector, for rows on any "
                f"2-byte boundary: set pad.align=1, not {k.pad.align}")
    for dim in ("n", "k"):
        if getattr(k.pad, dim) == "divisible":
            return (f"interleave needs pad.{dim}=predicate or zero_fill: a residue's view of B "
                    + ("ends past N" if dim == "n" else "starts up to 7 elements before each row"))


@rule("splitk", "mode_settings", SplitKError)
def _splitk(k: Kernel):
    """split_k needs >= 2 slices; stream_k is a persistent tile scheduler of the warp-specialized kernels."""
    sk = k.splitk
    if sk is None:
        return None
    if sk.mode == "split_k" and sk.slices < 2:
        return "split_k needs slices >= 2 (remove the splitk node for no split)"
    if sk.mode == "stream_k":
        if k.pipeline.mode != "tma_ws":
            return "stream_k needs a tma_ws pipeline (a persistent tile scheduler)"
        if sk.reduce != "workspace":
            return f"stream_k fixes up partial tiles through the workspace; reduce={sk.reduce} is for split_k"
        if not k.pipeline.persistent:
            return "stream_k splits the MAC loop over a persistent grid: set pipeline.persistent=true"
    if sk.reduce == "cluster":
        # The slices of a tile must be co-resident to push into each other's shared memory: a thread-block cluster
        # (sm90 and later) guarantees it, and one launch holds at most MAX_CLUSTER_NONPORTABLE blocks per cluster.
        if k.target.arch not in CLUSTER_ARCHS:
            return (f"reduce=cluster needs thread-block clusters ({', '.join(CLUSTER_ARCHS)}), not "
                    f"{k.target.arch}; use reduce=workspace")
        if k.mma.op != "wgmma":
            return ("reduce=cluster shares the tile out by the wgmma accumulator fragment layout "
                    f"(l2ir.indexing.ClusterReduce), which mma.op={k.mma.op} does not have: use reduce=workspace")
        if sk.slices > MAX_CLUSTER_NONPORTABLE:
            return (f"reduce=cluster runs the {sk.slices} slices of a tile as one cluster; a cluster holds at most "
                    f"{MAX_CLUSTER_NONPORTABLE} blocks")
        if k.tile.cluster != (1, 1):
            return (f"reduce=cluster makes each tile's slices the cluster; tile.cluster="
                    f"{k.tile.cluster[0]}x{k.tile.cluster[1]} would nest a second one (use 1x1)")
        if k.pipeline.persistent:
            return ("reduce=cluster launches one cluster per tile (one block per slice), not a persistent grid: set "
                    "pipeline.persistent=false")
    if sk.reduce == "block" and k.pipeline.mode == "direct":
        return None                       # the direct rule (direct_operands_in_registers) says which splits it takes
    if sk.reduce == "block":
        # The slices are the block's two consumer warpgroups, fed from one stage ring in turn
        # (l2ir.indexing.BlockSplit), and they add up through shared memory with the wgmma fragment ownership.
        if k.mma.op != "wgmma" or k.pipeline.mode != "tma_ws":
            return ("reduce=block splits the K loop between the consumer warpgroups of a warp-specialized wgmma "
                    f"kernel, not mma.op={k.mma.op} pipeline.mode={k.pipeline.mode}: use reduce=workspace")
        if sk.slices != BlockSplit.SLICES:
            return (f"reduce=block gives each of the block's {BlockSplit.SLICES} consumer warpgroups one slice: "
                    f"slices={BlockSplit.SLICES}, not {sk.slices}")
        if k.pipeline.schedule != "cooperative":
            return ("reduce=block needs the 2 consumer warpgroups of schedule=cooperative (warps=8x1), not "
                    f"schedule={k.pipeline.schedule}")
        if k.pipeline.persistent:
            return "reduce=block reduces one tile per block: set pipeline.persistent=false"
        if k.tile.cluster != (1, 1):
            return (f"reduce=block reduces inside one block; tile.cluster={k.tile.cluster[0]}x{k.tile.cluster[1]} "
                    "is not generated with it (use 1x1)")
        if acc_registers(k) > BLOCK_REDUCE_MAX_ACC:
            # ptxas allocates for the 384-thread launch bound (168 registers) before setmaxnreg: 192 accumulators
            # and the share loop's float4s spilled (128x192 and 256x96 tiles, 8 bytes each).
            return (f"reduce=block keeps all {acc_registers(k)} accumulators of its {k.tile.bm}x{k.tile.bn} tile per "
                    f"consumer thread (each warpgroup spans BM); above {BLOCK_REDUCE_MAX_ACC} they spill: use a "
                    "smaller tile")
        stages = resolved_stages(k)
        if stages < 4 or stages % 2:
            # The consumers take alternate ring positions. With an odd ring a stage's next phase belongs to the
            # other warpgroup, whose load may still be in flight: an mbarrier parity wait two phases ahead passes
            # at once and reads the stage before its TMA lands. With an even ring each warpgroup owns its stages,
            # and it has waited on a stage's previous phase itself. Two stages deadlock: a consumer releases its
            # previous stage only once its next one, two positions on, has landed.
            return (f"reduce=block needs an even number of stages, at least 4 (has {stages}): the consumer "
                    "warpgroups take alternate ring positions, so each must own its stages; an odd ring lets a "
                    "parity wait pass on a stage the other warpgroup's load has not filled yet")


@rule("epilogue", "path_and_vector", EpilogueError)
def _epilogue(k: Kernel):
    """Vector stores need rows aligned to the vector; the TMA store belongs to the TMA pipeline."""
    e = k.epilogue
    if e.path == "tma" and k.pipeline.mode != "tma_ws":
        return "epilogue path=tma needs a tma_ws pipeline"
    if e.vector > k.pad.align:
        return f"epilogue vector={e.vector} exceeds pad.align={k.pad.align}: rows may start unaligned"


# ---------------------------------------------------------------------------------------------------------------
# Source.
# ---------------------------------------------------------------------------------------------------------------


@rule("source", "well_formed", SourceError, schedule_only=False)
def _source(k: Kernel):
    """The entry point is defined as a __global__ function, launch expressions use only m, n, k and evaluate to
    positive sizes, the block has <= 1024 threads and the dynamic shared memory fits the target."""
    src = k.source
    if src is None:
        return None
    if not re.search(r"__global__[^;{]*\b" + re.escape(src.entry) + r"\s*\(", src.code):
        return f"code defines no __global__ function named '{src.entry}'"
    if not re.search(r'extern\s+"C"[^;{]*\b' + re.escape(src.entry) + r"\s*\(", src.code):
        return (f"'{src.entry}' must be declared extern \"C\": the harness looks the entry point up by its "
                "unmangled name")
    for axis, size, lim in zip("xyz", src.block, BLOCK_DIM_MAX):
        if size > lim:
            return f"block.{axis}={size} exceeds the hardware limit {lim}"
    for axis, e in zip("xyz", src.grid):
        extra = e.free_vars() - LAUNCH_VARS
        if extra:
            return f"grid.{axis} = {e} uses {', '.join(sorted(extra))}; only m, n, k are bound"
        for shape in ((1, 1, 1), (127, 129, 67), (4096, 4096, 4096)):
            try:
                v = e.eval(dict(zip("mnk", shape)))
            except ExprError as err:
                return f"grid.{axis} = {e} fails at m,n,k={shape}: {err}"
            if v < 1:
                return f"grid.{axis} = {e} is {v} at m,n,k={shape}; grid sizes must be >= 1"
    t = threads(k)
    if t > MAX_THREADS:
        return f"block {src.block} has {t} threads; the limit is {MAX_THREADS}"
    if src.smem > SMEM_LIMIT[k.target.arch]:
        return f"smem={src.smem} bytes exceeds {k.target.arch}'s {SMEM_LIMIT[k.target.arch]} bytes"


# ---------------------------------------------------------------------------------------------------------------
# Problem rules.
# ---------------------------------------------------------------------------------------------------------------


def verify_problem(problem: Problem) -> Problem:
    """The problem's own consistency (the gemm rules that need no kernel)."""
    for r in PROBLEM_RULES:
        if r.node == "gemm":
            msg = r.check(None, problem)
            if msg:
                raise r.error(r.node, r.name, msg)
    return problem


@rule("gemm", "input_dtypes", ProblemError, schedule_only=False, problem=True)
def _input_dtypes(k: Kernel, p: Problem):
    """A and B share one dtype (no mixed-input MMA)."""
    if p.a[0] != p.b[0]:
        return f"A is {p.a[0]} but B is {p.b[0]}; mixed inputs are not supported"


@rule("gemm", "accumulator", ProblemError, schedule_only=False, problem=True)
def _accumulator(k: Kernel, p: Problem):
    """fp16 accumulation exists only for fp16 inputs (mma.sync/wgmma f16.f16.f16)."""
    if p.acc == "f16" and p.a[0] != "f16":
        return f"acc=f16 needs f16 inputs, not {p.a[0]}"


@rule("pipeline", "smem_budget_output", ResourceError, problem=True)
def _smem_with_output(k: Kernel, p: Problem):
    """The epilogue stages C in the problem's output dtype: an fp32 C doubles the smem epilogue's tile."""
    out_bytes = DTYPE_BYTES[p.c[0]]
    if out_bytes == 2:
        return None                       # the kernel rule already counted 16-bit output
    need = smem_bytes(k, out_bytes=out_bytes)
    if need > SMEM_LIMIT[k.target.arch]:
        return (f"with c={p.c[0]} the kernel needs {need / KB:.1f} KB of shared memory; "
                f"{k.target.arch} allows {SMEM_LIMIT[k.target.arch] // KB} KB")


@rule("pipeline", "direct_operands", PipelineError, problem=True)
def _direct_operands(k: Kernel, p: Problem):
    """A direct kernel's lanes read 8 consecutive K elements of a row of A and a column of B (both K-major) and
    its MMAs accumulate in f32 (l2ir.indexing.DirectFeed)."""
    if k.pipeline.mode != "direct":
        return None
    if p.a[1] != "row" or p.b[1] != "col":
        return (f"direct kernels load K-contiguous vectors: a must be row-major and b col-major (K-major), not "
                f"a={p.a[1]} b={p.b[1]}")
    if p.acc != "f32":
        return "direct kernels accumulate in f32 (acc=f32)"


@rule("pad", "divisible", PadError, problem=True)
def _divisible(k: Kernel, p: Problem):
    """pad=divisible removes the bounds checks, so the problem must be a multiple of the tile in that dimension."""
    for dim, size, tile in (("m", p.m, k.tile.bm), ("n", p.n, k.tile.bn), ("k", p.k, k.tile.bk)):
        if getattr(k.pad, dim) == "divisible" and size % tile:
            return f"pad.{dim}=divisible requires {dim} % {tile} == 0, got {dim}={size}"


def leading_dims(p: Problem) -> dict[str, tuple[str, int]]:
    """The contiguous extent of each operand's rows: what vector loads and TMA strides must be aligned to."""
    return {
        "A": ("K" if p.a[1] == "row" else "M", p.k if p.a[1] == "row" else p.m),
        "B": ("N" if p.b[1] == "row" else "K", p.n if p.b[1] == "row" else p.k),
        "C": ("N", p.n),
    }


@rule("pad", "alignment", PadError, problem=True)
def _alignment(k: Kernel, p: Problem):
    """Loads of `pad.align` elements need every row of A and B to start on such a boundary; stores of
    `epilogue.vector` elements need every row of C to. The two are separate because an odd N (a vocabulary of
    50257) leaves A and B rows 16-byte aligned when B is K-major: only C's stores narrow, the loads stay wide. An
    operand the repack node copies is exempt: the GEMM reads its aligned copy."""
    layouts = {"A": p.a[1], "B": p.b[1], "C": p.c[1]}
    copied = k.repack.operands.upper() if k.repack is not None else ""   # rows re-laid out by the repack kernel
    for op, (dim, size) in leading_dims(p).items():
        if op in copied:
            continue
        field, width = ("epilogue.vector", k.epilogue.vector) if op == "C" else ("pad.align", k.pad.align)
        if size % width:
            return (f"{field}={width} assumes {width * elem_bytes(p)}-byte aligned rows: {op} is {layouts[op]}-major, "
                    f"so {dim} must be a multiple of {width}, got {dim}={size}")


@rule("interleave", "tma_view_rows", PadError, problem=True)
def _interleave_view_rows(k: Kernel, p: Problem):
    """The tensor-map form's B map covers floor(N / 8) view rows of 8 rows of B (Interleave.tma_view_rows): below
    8 columns it has none (a map's extents are positive), and its coordinates (up to 8K) are 32-bit."""
    if k.interleave is None or k.pipeline.mode != "tma_ws":
        return None
    if p.n < Interleave.STRIDE:
        return (f"interleave on a tma_ws pipeline maps B's view rows of {Interleave.STRIDE} columns; N={p.n} has "
                "none (use the cp.async form)")
    if Interleave.STRIDE * p.k >= 2 ** 31:
        return f"interleave on a tma_ws pipeline addresses B's view rows of 8K elements by 32-bit coordinates: K={p.k}"


@rule("splitk", "slices_vs_k", SplitKError, problem=True)
def _slices_vs_k(k: Kernel, p: Problem):
    """Each split-K slice must own at least one k tile, or it only adds a zero partial and a workspace pass."""
    if k.splitk is None or k.splitk.mode != "split_k":
        return None
    slices = k.splitk.slices
    k_tiles = ceil_div(p.k, k.tile.bk)
    if k.pipeline.mode == "direct":       # interleaved k steps (DirectFeed.slice_step): one each at least
        if k_tiles < slices:
            return (f"split_k slices={slices} over K={p.k} ({k_tiles} k step(s) of BK={k.tile.bk}) leaves a slice "
                    "of warps without a k step")
        return None
    per = ceil_div(k_tiles, slices)   # the partition of indexing.splitk_range
    if leaves_empty_slice(k_tiles, slices):
        return (f"split_k slices={slices} over K={p.k} ({k_tiles} tile(s) of BK={k.tile.bk}, {per} per slice) "
                f"leaves the last slice(s) without a k tile")


@rule("source", "grid_limits", SourceError, schedule_only=False, problem=True)
def _source_grid(k: Kernel, p: Problem):
    """grid.y and grid.z are limited to 65535 blocks, grid.x to 2^31-1."""
    if k.source is None:
        return None
    for axis, e, lim in zip("xyz", k.source.grid, ((1 << 31) - 1, 65535, 65535)):
        try:
            v = e.eval({"m": p.m, "n": p.n, "k": p.k})
        except ExprError as err:
            return f"grid.{axis} = {e}: {err}"
        if not 1 <= v <= lim:
            shown = v if abs(v) < 10 ** 12 else f"about 2^{int(v).bit_length() - 1}"
            return f"grid.{axis} = {e} is {shown} for m,n,k={p.shape}; allowed 1..{lim}"
