"""Lower sm90a kernels (wgmma, TMA warp-specialized pipelines) to CUTLASS 3.x through its collective builders.

The lowering has two steps, both pure:
  canonicalize(kernel, problem) -> Sm90Config   every check, every IR field turned into the one CUTLASS choice it means
  render(cfg) -> str                            the .cu text: the kernel type built by the collective builders, plus
                                                trusted host code exporting the L2IR host_shim ABI
`lower()` composes them into a LaunchPlan(form="host_shim"). M, N, K are run-time arguments: one compiled library serves
every shape; the problem supplies only the dtypes and layouts.

Field -> CUTLASS map (each generated line that depends on a field names it in a comment):
  target.arch=sm90a, mma.op=wgmma, pipeline.mode=tma_ws       the only combination this backend lowers
  tile.block BMxBNxBK        TileShape<BM, BN, BK>
  tile.cluster CMxCN         ClusterShape<CM, CN, 1> (TMA multicast of A along N, of B along M)
  tile.warps                 consumer warps per tile: 8x1 cooperative (2 warpgroups split BM), 4x1 pingpong (1 warpgroup)
  mma.shape 64xNx16          checked against the wgmma atom the builder picks for BN (also a static_assert in the .cu)
  pipeline.schedule          KernelTmaWarpSpecializedCooperative | KernelTmaWarpSpecializedPingpong
  pipeline.stages            StageCount<S> | StageCountAutoCarveout<sizeof(epilogue shared storage)>
  pipeline.persistent        true: grid = SMs (CUTLASS persistent scheduler); false: one CTA per output tile
  splitk                     absent: PersistentScheduler; present: StreamKScheduler with DecompositionMode StreamK or
                             SplitK (splits = slices), ReductionMode Deterministic (reduce=workspace) | Nondeterministic
  swizzle.raster / group     RasterOrderOptions AlongM | AlongN, max_swizzle_size (1, 2, 4 or 8)
  swizzle.smem               must be none (builder's choice) or equal the swizzle the builder picks
  pad.align                  AlignmentA/B (TMA: 16-byte strides, so 8 elements of a 16-bit type)
  pad.m/n/k                  TMA zero-fills out-of-bounds loads and the epilogue predicates stores, so every mode is
                             handled; `divisible` makes l2ir_run refuse shapes that break the promise (STATUS_NOT_DIVISIBLE)
  epilogue.path              tma -> TmaWarpSpecialized(Cooperative); direct -> NoSmemWarpSpecialized; smem -> unsupported
  epilogue.vector            AlignmentD
  problem a/b/c/acc          element types, RowMajor/ColumnMajor tags; C is read as void (alpha = 1, beta = 0)

l2ir_run return codes: 0 success; 1..11 a cutlass::Status (can_implement, initialize or run refused, e.g. 1 =
kErrorMisalignedOperand for a K that is not a multiple of 8); the l2ir.runtime STATUS_* codes for L2IR's own refusals.

Workspace: the true size comes from the library (`l2ir_workspace_size`). LaunchPlan.workspace_bytes is an upper bound
written as an expression of m, n, k (see `workspace_bound`), and l2ir_run returns STATUS_WORKSPACE_TOO_SMALL rather than
run with less than `Gemm::get_workspace_size(args)`. CUTLASS zeroes its own barrier flags inside initialize() (a memset
on the given stream), so the harness need not.
"""

from __future__ import annotations

from dataclasses import dataclass

from l2ir.errors import MmaError, ResourceError, TileError
from l2ir.errors import UnsupportedLowering as _UnsupportedLowering
from l2ir.analysis import operand_stage_bytes
from l2ir.indexing import Const, Expr, Var, cdiv
from l2ir.nodes import Kernel, Problem, Swizzle
from l2ir.target import CUTLASS_TYPE, DTYPE_BYTES, MAX_CLUSTER, SMEM_LIMIT
from l2ir.text import print_problem_class

from l2ir.runtime import LaunchPlan, pdl_macro_cpp, run_args_cpp, status_constants_cpp

class UnsupportedLowering(_UnsupportedLowering):
    """cutlass_sm90's UnsupportedLowering: the shared error with the backend's name filled in."""

    def __init__(self, field: str, message: str):
        super().__init__("cutlass_sm90", field, message)


# wgmma N values the builder's ss_op_selector tries, largest first (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is off).
WGMMA_N = (256, 192, 128, 96, 64, 32, 16, 8)
# Kernel parameters each host thread keeps, by pointers and shape, for calls without a workspace (see _host_abi).
KEPT_PARAMS = 4
# CUTLASS rounds max_swizzle_size down to a power of two no larger than 8 (get_log_swizzle_size).
SWIZZLE_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Sm90Config:
    """The canonical form of one lowering: every value the source depends on, already checked."""

    element_a: str
    element_b: str
    element_d: str
    element_acc: str
    layout_a: str            # CUTLASS tag: "RowMajor" | "ColumnMajor"
    layout_b: str
    problem_class: str       # "a=f16:row b=f16:col c=f16:row acc=f32"
    bm: int
    bn: int
    bk: int
    cm: int
    cn: int
    schedule: str            # "cooperative" | "pingpong"
    consumer_warpgroups: int  # warpgroups computing one tile (cooperative 2, pingpong 1)
    wgmma_n: int
    stages: int | str        # int or "auto"
    persistent: bool
    splitk_mode: str         # "none" | "stream_k" | "split_k"
    splits: int
    reduce: str              # "workspace" | "atomic"
    raster: str              # "along_m" | "along_n"
    swizzle_group: int
    align_ab: int
    in_bytes: int
    epilogue_path: str       # "tma" | "direct"
    align_d: int
    out_bytes: int
    acc_bytes: int
    divisible: tuple[bool, bool, bool]   # pad.m/n/k == divisible


# ---------------------------------------------------------------------------------------------------------------
# canonicalize: IR -> Sm90Config, with every check.
# ---------------------------------------------------------------------------------------------------------------


def _smem_swizzle_for(major_k: bool, mn: int, bk: int, elem_bytes: int) -> tuple[int, int, int] | None:
    """The shared-memory swizzle the builder's ss_smem_selector picks for one operand, in element units (CuTe's
    Swizzle<B, M, S> with M = log2(16 B / element)). wgmma reads 128-, 64- or 32-byte swizzled rows; the selector
    takes the widest whose row (along K for K-major, along M/N for MN-major) divides the tile."""
    extent = bk if major_k else mn
    m = {2: 3, 4: 2, 1: 4}[elem_bytes]
    for bits, row_bytes in ((3, 128), (2, 64), (1, 32)):
        if extent % (row_bytes // elem_bytes) == 0:
            return (bits, m, 3)
    return None   # interleaved (no swizzle)


def canonicalize(kernel: Kernel, problem: Problem) -> Sm90Config:
    """Check that the kernel is one this backend lowers and turn each IR field into its CUTLASS choice."""
    if kernel.is_source:
        raise UnsupportedLowering("source", "free-form CUDA kernels go to the kernels form, not through CUTLASS")
    if kernel.repack is not None:
        raise UnsupportedLowering("repack", "the operand copy before the GEMM is generated by the cuda_ptx backend (sm90a wgmma); remove repack")
    if kernel.target.arch != "sm90a":
        raise UnsupportedLowering("target.arch", f"'{kernel.target.arch}': wgmma and setmaxnreg need sm90a")
    tile, mma, pipe, pad, epi = kernel.tile, kernel.mma, kernel.pipeline, kernel.pad, kernel.epilogue
    for name, node in (("tile", tile), ("mma", mma), ("pipeline", pipe), ("pad", pad), ("epilogue", epi)):
        if node is None:
            raise UnsupportedLowering(name, "a scheduled kernel needs this node")
    swz = kernel.swizzle or Swizzle()

    if mma.op != "wgmma":
        raise UnsupportedLowering("mma.op", f"'{mma.op}': the sm90 collective builders issue wgmma")
    if pipe.mode != "tma_ws":
        raise UnsupportedLowering("pipeline.mode", f"'{pipe.mode}': this backend lowers TMA warp-specialized pipelines")
    if pipe.schedule not in ("cooperative", "pingpong"):
        raise UnsupportedLowering("pipeline.schedule",
                                  f"'{pipe.schedule}': choose cooperative or pingpong for a tma_ws pipeline")
    if pipe.prefetch:
        raise UnsupportedLowering("pipeline.prefetch", "wgmma reads A and B from shared memory; there are no register "
                                  "fragments to double-buffer")

    # Problem class: both operands feed one wgmma, so they share a 16-bit type; acc f16 exists only for f16 inputs.
    (a_dt, a_lay), (b_dt, b_lay), (c_dt, _) = problem.a, problem.b, problem.c
    if a_dt != b_dt:
        raise UnsupportedLowering("problem.b", f"a={a_dt} with b={b_dt}: wgmma takes one 16-bit input type")
    if problem.acc == "f16" and a_dt != "f16":
        raise UnsupportedLowering("problem.acc", "wgmma accumulates bf16 inputs in f32 only")

    # Tile and warpgroups.
    bm, bn, bk = tile.block
    cooperative = pipe.schedule == "cooperative"
    wgs = 2 if cooperative else 1
    expected_warps = (4 * wgs, 1)
    if tile.warps != expected_warps:
        raise TileError("tile", "warpgroups_per_schedule",
                        f"warps={tile.warps[0]}x{tile.warps[1]} but a {pipe.schedule} tile is computed by {wgs} "
                        f"consumer warpgroup(s): warps must be {expected_warps[0]}x1")
    if bm % (64 * wgs):
        raise TileError("tile", "block_m_per_warpgroup",
                        f"block M={bm}: each of the {wgs} consumer warpgroup(s) issues 64-row wgmmas, so M must be a "
                        f"multiple of {64 * wgs}")
    if bk % 16:
        raise TileError("tile", "block_k_wgmma", f"block K={bk}: wgmma consumes K in steps of 16 for 16-bit inputs")
    if bn % 8:
        raise TileError("tile", "block_n_wgmma", f"block N={bn}: wgmma N is a multiple of 8")
    wgmma_n = next(n for n in WGMMA_N if bn % n == 0)
    if tuple(mma.shape) != (64, wgmma_n, 16):
        raise MmaError("mma", "builder_wgmma_shape",
                       f"shape={'x'.join(map(str, mma.shape))} but the collective builder tiles a {bm}x{bn} "
                       f"{pipe.schedule} block (per warpgroup {bm // wgs}x{bn}) with wgmma 64x{wgmma_n}x16")
    cm, cn = tile.cluster
    for dim, v in (("M", cm), ("N", cn)):
        if v & (v - 1):
            raise UnsupportedLowering("tile.cluster", f"cluster {dim}={v}: the tile scheduler needs powers of two")
    if cm * cn > MAX_CLUSTER:
        raise UnsupportedLowering("tile.cluster", f"{cm}x{cn} = {cm * cn} CTAs: portable clusters hold at most "
                                  f"{MAX_CLUSTER}")

    # Shared memory: the builder picks the swizzle; the IR may only restate it.
    in_bytes = DTYPE_BYTES[a_dt]
    if swz.smem is not None:
        picks = {_smem_swizzle_for(a_lay == "row", bm, bk, in_bytes), _smem_swizzle_for(b_lay == "col", bn, bk, in_bytes)}
        if picks != {tuple(swz.smem)}:
            shown = " and ".join(sorted("none" if p is None else "<{},{},{}>".format(*p) for p in picks))
            raise UnsupportedLowering("swizzle.smem", f"<{','.join(map(str, swz.smem))}>: the sm90 builder lays out "
                                      f"this tile with {shown}; set swizzle.smem = none to take its choice")

    # Stages: wgmma reads the stage ring directly, so each stage holds a full A and B tile.
    stage_bytes = operand_stage_bytes(kernel, in_bytes)
    if pipe.stages != "auto":
        if pipe.stages < 2:
            raise UnsupportedLowering("pipeline.stages", "the TMA producer needs at least 2 stages to overlap the MMAs")
        if pipe.stages * stage_bytes > SMEM_LIMIT["sm90a"]:
            raise ResourceError("pipeline", "smem_capacity",
                                f"{pipe.stages} stages x {stage_bytes} B = {pipe.stages * stage_bytes} B of A/B tiles "
                                f"exceed the {SMEM_LIMIT['sm90a']} B of shared memory per block on sm90")
    elif 2 * stage_bytes > SMEM_LIMIT["sm90a"]:
        raise ResourceError("pipeline", "smem_capacity", f"two {stage_bytes} B stages do not fit in {SMEM_LIMIT['sm90a']} B")

    # Tile scheduler.
    sk = kernel.splitk
    splitk_mode, splits, reduce = "none", 1, "workspace"
    if sk is not None:
        if sk.reduce in ("cluster", "block"):
            raise UnsupportedLowering("splitk.reduce", f"{sk.reduce}: CUTLASS's split-K reduces through the "
                                      "workspace (workspace or atomic); the cluster and in-block reductions are "
                                      "generated by cuda_ptx")
        if not pipe.persistent:
            raise UnsupportedLowering("pipeline.persistent", f"splitk mode={sk.mode} runs on CUTLASS's stream-K "
                                      "scheduler, which is persistent: set pipeline.persistent = true")
        if not cooperative:
            raise UnsupportedLowering("splitk", f"mode={sk.mode} with pipeline.schedule=pingpong: CUTLASS's pingpong "
                                      "kernel does not support the stream-K scheduler (it static_asserts against it); "
                                      "use cooperative")
        splitk_mode, reduce = sk.mode, sk.reduce
        if sk.mode == "split_k":
            splits = sk.slices
        elif sk.slices != 1:
            raise UnsupportedLowering("splitk.slices", f"{sk.slices} with mode=stream_k: CUTLASS's stream-K scheduler "
                                      "balances iterations itself and takes no cap on pieces per tile (use 1)")
    if swz.group not in SWIZZLE_SIZES:
        raise UnsupportedLowering("swizzle.group", f"{swz.group}: CUTLASS's max_swizzle_size takes "
                                  f"{', '.join(map(str, SWIZZLE_SIZES))}")

    # Alignment and epilogue.
    if pad.align * in_bytes < 16:
        raise UnsupportedLowering("pad.align", f"{pad.align} elements = {pad.align * in_bytes} B: TMA needs 16-byte "
                                  f"aligned strides, i.e. align = {16 // in_bytes}")
    out_bytes = DTYPE_BYTES[c_dt]
    if epi.path == "smem":
        raise UnsupportedLowering("epilogue.path", "smem: on sm90 the shared-memory-staged epilogue is the TMA store "
                                  "(path = tma); path = direct stores registers to global")
    if epi.path == "tma" and epi.vector * out_bytes < 16:
        raise UnsupportedLowering("epilogue.vector", f"{epi.vector} x {out_bytes} B: the TMA store needs 16-byte "
                                  f"aligned rows, i.e. vector = {16 // out_bytes}")
    if epi.vector * out_bytes > 16:
        raise UnsupportedLowering("epilogue.vector", f"{epi.vector} x {out_bytes} B: stores are at most 16 bytes")

    return Sm90Config(
        element_a=CUTLASS_TYPE[a_dt], element_b=CUTLASS_TYPE[b_dt], element_d=CUTLASS_TYPE[c_dt],
        element_acc=CUTLASS_TYPE[problem.acc],
        layout_a="RowMajor" if a_lay == "row" else "ColumnMajor",
        layout_b="ColumnMajor" if b_lay == "col" else "RowMajor",
        problem_class=print_problem_class(problem),
        bm=bm, bn=bn, bk=bk, cm=cm, cn=cn,
        schedule=pipe.schedule, consumer_warpgroups=wgs, wgmma_n=wgmma_n,
        stages=pipe.stages, persistent=pipe.persistent,
        splitk_mode=splitk_mode, splits=splits, reduce=reduce,
        raster=swz.raster, swizzle_group=swz.group,
        align_ab=pad.align, in_bytes=in_bytes,
        epilogue_path=epi.path, align_d=epi.vector, out_bytes=out_bytes, acc_bytes=DTYPE_BYTES[problem.acc],
        divisible=(pad.m == "divisible", pad.n == "divisible", pad.k == "divisible"),
    )


# ---------------------------------------------------------------------------------------------------------------
# Workspace bound.
# ---------------------------------------------------------------------------------------------------------------

M, N = Var("m"), Var("n")
# Slack for CUTLASS's alignment roundings (L2-line rounding of each workspace part, 16-byte kernel rounding).
WORKSPACE_SLACK = 4096


def workspace_bound(cfg: Sm90Config) -> Expr:
    """An upper bound on Gemm::get_workspace_size, as an expression of m, n.

    The persistent data-parallel scheduler needs none. The stream-K scheduler (stream_k and split_k decompositions)
    keeps, per output tile that is split, one BMxBN accumulator partial (the turnstile or atomic reduction target; the
    split-K variant reserves it for every tile, not per split) and a 32-bit barrier per MMA warpgroup. The tile grid is
    first rounded up to multiples of swizzle x cluster, hence the `+ group * cluster` terms.
    """
    if cfg.splitk_mode == "none":
        return Const(0)
    tiles_m = cdiv(M, cfg.bm) + cfg.swizzle_group * cfg.cm
    tiles_n = cdiv(N, cfg.bn) + cfg.swizzle_group * cfg.cn
    per_tile = cfg.bm * cfg.bn * cfg.acc_bytes + 4 * cfg.consumer_warpgroups
    return tiles_m * tiles_n * per_tile + WORKSPACE_SLACK


# ---------------------------------------------------------------------------------------------------------------
# render: Sm90Config -> CUDA source.
# ---------------------------------------------------------------------------------------------------------------


def _stride_lines(cfg: Sm90Config) -> list[str]:
    """Packed strides as CUTLASS's (M|N, K, L) cute strides; the unit-stride mode is the contiguous one."""
    a = ("cute::make_stride(int64_t(K), cute::Int<1>{}, int64_t(M) * K);   // A row: MxK, K contiguous"
         if cfg.layout_a == "RowMajor" else
         "cute::make_stride(cute::Int<1>{}, int64_t(M), int64_t(M) * K);   // A col: MxK, M contiguous")
    b = ("cute::make_stride(int64_t(K), cute::Int<1>{}, int64_t(N) * K);   // B col: NxK, K contiguous"
         if cfg.layout_b == "ColumnMajor" else
         "cute::make_stride(cute::Int<1>{}, int64_t(N), int64_t(N) * K);   // B row: KxN, N contiguous")
    d = "cute::make_stride(int64_t(N), cute::Int<1>{}, int64_t(M) * N);   // C row: MxN, N contiguous"
    return [f"  StrideA stride_a = {a}", f"  StrideB stride_b = {b}", f"  StrideD stride_d = {d}"]


def _scheduler_lines(cfg: Sm90Config) -> list[str]:
    raster = "AlongM" if cfg.raster == "along_m" else "AlongN"
    out = [
        "  // swizzle.raster: consecutive CTAs walk along " + ("M" if raster == "AlongM" else "N")
        + f", in strips of swizzle.group = {cfg.swizzle_group} tiles so concurrently",
        "  // running CTAs share A and B tiles in L2.",
        f"  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::{raster};",
        f"  args.scheduler.max_swizzle_size = {cfg.swizzle_group};",
    ]
    if cfg.splitk_mode == "stream_k":
        out += [
            "  // splitk mode=stream_k: the persistent grid splits all MAC-loop iterations evenly over the SMs, so the",
            "  // last wave has no idle SMs; tiles cut between CTAs are fixed up through the workspace.",
            "  args.scheduler.decomposition_mode = cutlass::gemm::kernel::detail::DecompositionMode::StreamK;",
            "  args.scheduler.splits = 1;",
        ]
    elif cfg.splitk_mode == "split_k":
        out += [
            f"  // splitk mode=split_k slices={cfg.splits}: each output tile's K loop is cut into {cfg.splits} pieces "
            "run by",
            "  // different CTAs (CUTLASS may lower the count to the SMs or K tiles available); partials meet in the",
            "  // workspace.",
            "  args.scheduler.decomposition_mode = cutlass::gemm::kernel::detail::DecompositionMode::SplitK;",
            f"  args.scheduler.splits = {cfg.splits};",
        ]
    if cfg.splitk_mode != "none":
        if cfg.reduce == "workspace":
            out += ["  // splitk.reduce=workspace: peers add into the workspace partial in K order under a lock "
                    "(turnstile),",
                    "  // so results are bitwise reproducible.",
                    "  args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;"]
        else:
            out += ["  // splitk.reduce=atomic: peers add into the workspace partial as they finish, without "
                    "ordering;",
                    "  // faster, but the fp32 sum order (and so rounding) varies run to run.",
                    "  args.scheduler.reduction_mode = "
                    "cutlass::gemm::kernel::detail::ReductionMode::Nondeterministic;"]
    return out


def _hw_lines(cfg: Sm90Config) -> list[str]:
    if cfg.persistent:
        return [
            "  // pipeline.persistent=true: the scheduler launches about one CTA per SM and each loops over output",
            "  // tiles, so the TMA prologue and the epilogue of one tile overlap the mainloop of the next.",
            "  hw_info.sm_count = sm_count;",
            "  hw_info.max_active_clusters = 0;   // 0: the scheduler sizes the grid from sm_count and the cluster shape",
        ]
    return [
        "  // pipeline.persistent=false: one CTA per output tile. The persistent scheduler is told the device holds",
        "  // as many clusters as there are tiles, so its loop runs once per CTA. The grid's y extent stays under",
        "  // the 65535 limit (beyond it CTAs take a second tile, which is still correct).",
        f"  int64_t tiles_m = (int64_t(M) + {cfg.bm * cfg.cm * cfg.swizzle_group} - 1) / "
        f"{cfg.bm * cfg.cm * cfg.swizzle_group} * {cfg.cm * cfg.swizzle_group};",
        f"  int64_t tiles_n = (int64_t(N) + {cfg.bn * cfg.cn * cfg.swizzle_group} - 1) / "
        f"{cfg.bn * cfg.cn * cfg.swizzle_group} * {cfg.cn * cfg.swizzle_group};",
        f"  int64_t clusters = tiles_m * tiles_n / {cfg.cm * cfg.cn};",
        f"  int64_t max_clusters = 65535 / {max(cfg.cm, cfg.cn)};",
        "  if (clusters > max_clusters) clusters = max_clusters;",
        "  (void)sm_count;",
        f"  hw_info.sm_count = int(clusters * {cfg.cm * cfg.cn});",
        "  hw_info.max_active_clusters = int(clusters);",
    ]


def _pdl_lines(cfg: Sm90Config) -> list[str]:
    """Programmatic dependent launch: CUTLASS's GDC makes the producer and the epilogue wait on the stream's previous
    grid (griddepcontrol.wait) before their first global access, so l2ir_run launches with programmatic stream
    serialization and the blocks may be placed while that grid drains. -DL2IR_PDL=0 builds an ordinary launch.
    The stream-K scheduler (splitk present) compiles with GDC through _stream_k_scheduler_lines, but its kernels are
    built for the ordinary launch until the GPU's gates and an A/B say otherwise: -DL2IR_PDL=1 builds the PDL launch
    (bench/pdl_probe.py asks for each variant by name)."""
    if cfg.splitk_mode != "none":
        return [
            "// Ordinary launch by default: the stream-K kernel with programmatic dependent launch (-DL2IR_PDL=1) has not",
            "// been through the GPU's gates yet. With it, the kernel's producer and epilogue wait on the stream's",
            "// previous grid (griddepcontrol.wait, CUTLASS's GDC) before their first global access.",
            *pdl_macro_cpp(False),
            "#if L2IR_PDL",
            "#define CUTLASS_ENABLE_GDC_FOR_SM90 1",
            "#endif",
        ]
    return [
        "// Programmatic dependent launch: the kernel's producer and epilogue wait on the stream's previous grid",
        "// (griddepcontrol.wait, CUTLASS's GDC) before their first global access, so l2ir_run launches it with",
        "// programmatic stream serialization and its blocks may be placed while that grid drains. -DL2IR_PDL=0 builds an",
        "// ordinary launch (bench/pdl_probe.py compares the two).",
        *pdl_macro_cpp(True),
        "#if L2IR_PDL",
        "#define CUTLASS_ENABLE_GDC_FOR_SM90 1",
        "#endif",
    ]


def _header(cfg: Sm90Config) -> list[str]:
    """What generated the file, from which IR, the host-shim ABI it exports, and the headers."""
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    return [
        "// Generated by L2IR backends/cutlass_sm90.py from the kernel IR. Do not edit: change the IR and lower again.",
        "//",
        f"// problem class: {cfg.problem_class} (M, N, K are run-time arguments)",
        f"// tile {bm}x{bn}x{bk}, cluster {cfg.cm}x{cfg.cn}, {cfg.schedule}, wgmma 64x{cfg.wgmma_n}x16, "
        f"stages {cfg.stages}, persistent {str(cfg.persistent).lower()}, splitk {cfg.splitk_mode}, "
        f"raster {cfg.raster}/{cfg.swizzle_group}, epilogue {cfg.epilogue_path}/{cfg.align_d}",
        "//",
        "// Exports the L2IR host_shim ABI:",
        "//   size_t l2ir_workspace_size(int M, int N, int K);",
        "//   int    l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,",
        "//                   void* workspace, size_t workspace_bytes, void* stream);",
        "// l2ir_run returns 0 on success, a cutlass::Status (1..11) when CUTLASS refuses the problem, or an",
        "// L2IR_STATUS_* code below.",
        "",
        "// Device-side assert() is a function call, and ptxas serializes every wgmma across a call (warning C7510),",
        "// which costs most of the tensor-core throughput: the kernel is built without asserts.",
        "#ifndef NDEBUG",
        "#define NDEBUG",
        "#endif",
        "",
        *_pdl_lines(cfg),
        "",
        "#include <atomic>",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "#include <cuda_runtime.h>",
        "",
        '#include "cutlass/cutlass.h"',
        '#include "cute/tensor.hpp"',
        '#include "cutlass/numeric_types.h"',
        '#include "cutlass/gemm/dispatch_policy.hpp"',
        '#include "cutlass/gemm/collective/collective_builder.hpp"',
        '#include "cutlass/epilogue/collective/collective_builder.hpp"',
        '#include "cutlass/gemm/kernel/gemm_universal.hpp"',
        '#include "cutlass/gemm/kernel/tile_scheduler.hpp"',
        '#include "cutlass/gemm/device/gemm_universal_adapter.h"',
        "",
        "#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)",
        '#error "wgmma needs sm_90a: compile with -gencode=arch=compute_90a,code=sm_90a"',
        "#endif",
        "",
        *(_stream_k_scheduler_lines() if cfg.splitk_mode != "none" else []),
    ]


def _stream_k_scheduler_lines() -> list[str]:
    """CUTLASS 4.2's stream-K scheduler under a tag of L2IR's own, at global scope (the selector is specialized in
    CUTLASS's namespace). With GDC, CUTLASS's const is_last_tile passes a member to a non-const reference and does
    not compile (seen on the H200 host and here); the kernel asks it only when to hint launch_dependent_grids, an
    early release of the next grid that changes timing, not results. Never hinting lets the next grid start at
    this one's end, as an ordinary launch does. Without GDC the method is never called: the kernel is CUTLASS's."""
    return [
        "namespace l2ir {",
        "template <class TileShape, class ClusterShape>",
        "class StreamKSchedulerGdc",
        "    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape> {",
        "  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape>;",
        "",
        " public:",
        "  using Base::Base;",
        "  // Asked under GDC only, for the early-release hint: never hint (the next grid starts at this one's end).",
        "  CUTLASS_DEVICE bool is_last_tile(typename Base::WorkTileInfo, uint32_t = 1) const { return false; }",
        "};",
        "struct StreamKScheduler {};   // the tile-scheduler tag the kernel type names",
        "}  // namespace l2ir",
        "",
        "namespace cutlass::gemm::kernel::detail {",
        "template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>",
        "struct TileSchedulerSelector<l2ir::StreamKScheduler, arch::Sm90, TileShape, ClusterShape,",
        "                             SchedulerPipelineStageCount> {",
        "  using Scheduler = l2ir::StreamKSchedulerGdc<TileShape, ClusterShape>;",
        "};",
        "}  // namespace cutlass::gemm::kernel::detail",
        "",
    ]


def _operands(cfg: Sm90Config) -> list[str]:
    """Status codes and the operand types and layouts of the problem class."""
    return [
        "namespace {",
        "",
        *status_constants_cpp("WORKSPACE_TOO_SMALL", "NOT_DIVISIBLE", "BAD_ARGUMENT", "CUDA_ERROR", "EXCEPTION"),
        "",
        "// ---- operands (problem class) ----",
        f"using ElementA = {cfg.element_a};",
        f"using LayoutA = cutlass::layout::{cfg.layout_a};"
        + ("   // problem a=row: K-major, wgmma's native operand order" if cfg.layout_a == "RowMajor"
           else "   // problem a=col: M-major, wgmma transposes it through the smem descriptor"),
        f"using ElementB = {cfg.element_b};",
        f"using LayoutB = cutlass::layout::{cfg.layout_b};"
        + ("   // problem b=col: NxK with K contiguous (K-major)" if cfg.layout_b == "ColumnMajor"
           else "   // problem b=row: KxN with N contiguous (N-major, transposed by the smem descriptor)"),
        "using ElementC = void;   // C is never read (beta = 0): no source loads, no source buffers in shared memory",
        f"using ElementD = {cfg.element_d};",
        "using LayoutD = cutlass::layout::RowMajor;   // problem c=row",
        f"using ElementAccumulator = {cfg.element_acc};   // problem acc",
        "using ElementCompute = ElementAccumulator;",
        "",
        f"// pad.align = {cfg.align_ab}: {cfg.align_ab} x {cfg.in_bytes} B = {cfg.align_ab * cfg.in_bytes} B; TMA "
        "descriptors need 16-byte-aligned global strides.",
        f"constexpr int AlignmentA = {cfg.align_ab};",
        f"constexpr int AlignmentB = {cfg.align_ab};",
        f"// epilogue.vector = {cfg.align_d}: elements per store"
        + (" (the TMA store moves whole rows; 16-byte alignment is its floor)." if cfg.epilogue_path == "tma"
           else " the epilogue may assume aligned."),
        f"constexpr int AlignmentD = {cfg.align_d};",
        "",
    ]


def _kernel_type(cfg: Sm90Config) -> list[str]:
    """The kernel type from CUTLASS's collective builders (schedule, tile, cluster, stages, epilogue, tile
    scheduler) and compile-time checks that the builder took what the IR says."""
    coop = cfg.schedule == "cooperative"
    kernel_schedule = ("cutlass::gemm::KernelTmaWarpSpecializedCooperative" if coop
                       else "cutlass::gemm::KernelTmaWarpSpecializedPingpong")
    if cfg.epilogue_path == "tma":
        epilogue_schedule = ("cutlass::epilogue::TmaWarpSpecializedCooperative" if coop
                             else "cutlass::epilogue::TmaWarpSpecialized")
        epilogue_comment = ("// epilogue.path=tma: accumulators go registers -> shared memory -> one TMA bulk store "
                            "per subtile, issued\n// by the consumer warpgroups" +
                            (" together (cooperative)" if coop else " of the tile's owner (pingpong)") +
                            "; the store overlaps the next tile's mainloop.")
    else:
        epilogue_schedule = "cutlass::epilogue::NoSmemWarpSpecialized"
        epilogue_comment = ("// epilogue.path=direct: each thread stores its accumulator fragment straight to global "
                            "memory, with no\n// shared-memory staging (frees the epilogue's shared memory for more "
                            "stages).")
    if cfg.splitk_mode == "none":
        scheduler = "cutlass::gemm::PersistentScheduler"
        scheduler_comment = "// splitk absent: data-parallel persistent tile scheduler, one output tile per work unit."
    else:
        scheduler = "l2ir::StreamKScheduler"
        scheduler_comment = (f"// splitk mode={cfg.splitk_mode}: CUTLASS's stream-K tile scheduler (l2ir::StreamKScheduler "
                             "above), which also runs\n// split-K decompositions.")
    if cfg.stages == "auto":
        stages = ("cutlass::gemm::collective::StageCountAutoCarveout<\n"
                  "    static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>")
        stages_comment = ("// pipeline.stages=auto: as many A/B stages as fit in shared memory after the epilogue's "
                          "buffers.")
    else:
        stages = f"cutlass::gemm::collective::StageCount<{cfg.stages}>"
        stages_comment = (f"// pipeline.stages={cfg.stages}: the TMA producer runs up to {cfg.stages - 1} k-tiles "
                          "ahead of the consumers.")
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    L = [
        "// ---- schedule ----",
        f"using TileShape = cute::Shape<cute::_{bm}, cute::_{bn}, cute::_{bk}>;   // tile.block",
        *(["// tile.cluster = 1x1: no multicast; each CTA loads its own A and B tiles."]
          if cfg.cm * cfg.cn == 1 else
          [f"// tile.cluster = {cfg.cm}x{cfg.cn}: the {cfg.cm} CTAs along M share each B tile and the {cfg.cn} "
           "along N share each A tile;",
           "// one TMA multicast feeds them all, dividing the L2->SM traffic for that operand."]),
        f"using ClusterShape = cute::Shape<cute::_{cfg.cm}, cute::_{cfg.cn}, cute::_1>;",
        (f"// pipeline.schedule=cooperative: both consumer warpgroups (tile.warps=8x1) split one {bm}x{bn} tile "
         f"along M,\n// {bm // 2} rows each; a producer warp issues the TMA loads." if coop else
         f"// pipeline.schedule=pingpong: two consumer warpgroups (tile.warps=4x1 each) own alternate {bm}x{bn} "
         "tiles; one runs\n// its mainloop while the other runs its epilogue, hiding the epilogue behind wgmma."),
        f"using KernelSchedule = {kernel_schedule};",
        epilogue_comment,
        f"using EpilogueSchedule = {epilogue_schedule};",
        scheduler_comment,
        f"using TileScheduler = {scheduler};",
        "",
        "using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<",
        "    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,",
        "    TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,",
        "    ElementAccumulator, ElementCompute,",
        "    ElementC, LayoutD, AlignmentD,",
        "    ElementD, LayoutD, AlignmentD,",
        "    EpilogueSchedule>::CollectiveOp;",
        "",
        stages_comment,
        f"using StageCountType = {stages};",
        "",
        "using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<",
        "    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,",
        "    ElementA, LayoutA, AlignmentA,",
        "    ElementB, LayoutB, AlignmentB,",
        "    ElementAccumulator,",
        "    TileShape, ClusterShape,",
        "    StageCountType,",
        "    KernelSchedule>::CollectiveOp;",
        "",
        "using GemmKernel = cutlass::gemm::kernel::GemmUniversal<",
        "    cute::Shape<int, int, int, int>,   // (M, N, K, L) at run time: one library serves every shape",
        "    CollectiveMainloop, CollectiveEpilogue, TileScheduler>;",
        "using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;",
        "",
        "// The IR's claims about what the builder chose, checked at compile time.",
        "using TiledMma = typename CollectiveMainloop::TiledMma;",
        "static_assert(cute::size<0>(typename TiledMma::AtomShape_MNK{}) == 64 &&",
        f"              cute::size<1>(typename TiledMma::AtomShape_MNK{{}}) == {cfg.wgmma_n} &&",
        "              cute::size<2>(typename TiledMma::AtomShape_MNK{}) == 16,",
        f'              "mma.shape: the builder\'s wgmma atom is not 64x{cfg.wgmma_n}x16");',
        f"static_assert(cute::size(TiledMma{{}}) == {128 * cfg.consumer_warpgroups},",
        f'              "tile.warps: the builder\'s consumer threads are not {cfg.consumer_warpgroups} warpgroup(s)");',
    ]
    if cfg.stages != "auto":
        L += [
            f"static_assert(CollectiveMainloop::DispatchPolicy::Stages == {cfg.stages}, "
            f'"pipeline.stages: the builder did not take {cfg.stages} stages");',
        ]
    L += [
        f"static_assert(sizeof(typename GemmKernel::SharedStorage) <= {SMEM_LIMIT['sm90a']},",
        '              "tile.block x pipeline.stages: shared storage exceeds the sm90 capacity");',
        "",
    ]
    return L


def _arguments(cfg: Sm90Config) -> list[str]:
    """Strides, the device's SM count and the Gemm::Arguments for one call."""
    return [
        "using StrideA = typename GemmKernel::StrideA;",
        "using StrideB = typename GemmKernel::StrideB;",
        "using StrideC = typename GemmKernel::StrideC;",
        "using StrideD = typename GemmKernel::StrideD;",
        "",
        "// SM count of the current device, queried once per device (the stream-K split and the persistent grid",
        "// depend on it, and l2ir_workspace_size must see the same number as l2ir_run).",
        "int current_sm_count() {",
        "  constexpr int kMaxDevices = 64;",
        "  static std::atomic<int> cache[kMaxDevices];",
        "  int device = 0;",
        "  if (cudaGetDevice(&device) != cudaSuccess) return 0;",
        "  if (device >= 0 && device < kMaxDevices) {",
        "    int cached = cache[device].load(std::memory_order_relaxed);",
        "    if (cached > 0) return cached;",
        "  }",
        "  int count = 0;",
        "  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;",
        "  if (device >= 0 && device < kMaxDevices) cache[device].store(count, std::memory_order_relaxed);",
        "  return count;",
        "}",
        "",
        "typename Gemm::Arguments make_arguments(const void* A, const void* B, void* C, int M, int N, int K,",
        "                                        int sm_count) {",
        *_stride_lines(cfg),
        "  StrideC stride_c = stride_d;   // unused: C is void",
        "",
        "  cutlass::KernelHardwareInfo hw_info;",
        "  cudaGetDevice(&hw_info.device_id);",
        *_hw_lines(cfg),
        "",
        "  typename Gemm::Arguments args{",
        "      cutlass::gemm::GemmUniversalMode::kGemm,",
        "      {M, N, K, 1},",
        "      {static_cast<ElementA const*>(A), stride_a, static_cast<ElementB const*>(B), stride_b},",
        "      {{}, nullptr, stride_c, static_cast<ElementD*>(C), stride_d},",
        "      hw_info};",
        "  // D = 1 * (A @ B) + 0 * C: a plain product rounded once to the output type.",
        "  args.epilogue.thread.alpha = ElementCompute(1);",
        "  args.epilogue.thread.beta = ElementCompute(0);",
        *_scheduler_lines(cfg),
        "  return args;",
        "}",
        "",
        "}  // namespace",
        "",
    ]


def _host_abi(cfg: Sm90Config) -> list[str]:
    """The exported host-shim functions: workspace size and the checked, launched run."""
    dm, dn, dk = cfg.divisible
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    d_ptr_align = 16 if cfg.epilogue_path == "tma" else cfg.align_d * cfg.out_bytes
    divisible_checks = []
    for flag, var, size, field in ((dm, "M", bm, "pad.m"), (dn, "N", bn, "pad.n"), (dk, "K", bk, "pad.k")):
        if flag:
            divisible_checks.append(
                f"  if ({var} % {size} != 0) return L2IR_STATUS_NOT_DIVISIBLE;   // {field}=divisible: the IR promises "
                f"{var} % {size} == 0")
    if not divisible_checks:
        divisible_checks.append("  // pad.m/n/k: no dimension is declared divisible; TMA zero-fills out-of-bounds "
                                "loads and the epilogue")
        divisible_checks.append("  // predicates its stores, so every M, N, K is computed.")
    return [
        "namespace {",
        "",
        "// The kernel parameters of this thread's last few calls that needed no workspace. Building them",
        "// (to_underlying_arguments: a TMA descriptor per operand, the scheduler's parameters) and initialize()'s",
        "// shared-memory attribute are host work that a host-bound shape pays on every call; the parameters depend",
        "// only on the pointers, the shape and the device, so a call that repeats all of them launches the kept ones.",
        "// A call that needs a workspace (split-K, stream-K) initializes every time: initialize() zeroes that call's",
        "// barrier flags on its stream. Keyed by device number, not context: a hit in another context of the same",
        "// device (a pushed context, after cudaDeviceReset) would miss initialize()'s shared-memory attribute and",
        "// fail to launch (an error, which l2ir.matmul answers with torch.matmul), never compute wrongly.",
        "struct KeptParams {",
        "  const void* a = nullptr;",
        "  const void* b = nullptr;",
        "  void* c = nullptr;",
        "  int m = 0, n = 0, k = 0, device = -1;",
        "  typename Gemm::Params params;",
        "};",
        "",
        "struct ParamsRing {",
        f"  KeptParams entry[{KEPT_PARAMS}];   // a few output buffers: the caching allocator cycles C through them",
        "  int next = 0;",
        "};",
        "",
        "ParamsRing& params_ring() {",
        "  thread_local ParamsRing ring;",
        "  return ring;",
        "}",
        "",
        "}  // namespace",
        "",
        'extern "C" size_t l2ir_workspace_size(int M, int N, int K) {',
        "  if (M <= 0 || N <= 0 || K <= 0) return 0;",
        "  int sm_count = current_sm_count();",
        "  if (sm_count <= 0) return 0;",
        "  return Gemm::get_workspace_size(make_arguments(nullptr, nullptr, nullptr, M, N, K, sm_count));",
        "}",
        "",
        'extern "C" int l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,',
        "                        void* workspace, size_t workspace_bytes, void* stream) {",
        "  try {",
        "    if (A == nullptr || B == nullptr || C == nullptr || M <= 0 || N <= 0 || K <= 0) {",
        "      return L2IR_STATUS_BAD_ARGUMENT;",
        "    }",
        *("  " + line for line in divisible_checks),
        "    // TMA descriptors need 16-byte-aligned base addresses"
        + (" (the TMA store too)." if cfg.epilogue_path == "tma" else "; direct stores need vector alignment."),
        "    if (reinterpret_cast<uintptr_t>(A) % 16 != 0 || reinterpret_cast<uintptr_t>(B) % 16 != 0 ||",
        f"        reinterpret_cast<uintptr_t>(C) % {d_ptr_align} != 0) {{",
        "      return int(cutlass::Status::kErrorMisalignedOperand);",
        "    }",
        "    cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);",
        "    int device = 0;",
        "    if (cudaGetDevice(&device) != cudaSuccess) return L2IR_STATUS_CUDA_ERROR;",
        "    ParamsRing& ring = params_ring();",
        "    for (KeptParams& e : ring.entry) {",
        "      if (e.device == device && e.a == A && e.b == B && e.c == C && e.m == M && e.n == N && e.k == K) {",
        "        // can_implement and initialize passed for these",
        "        return int(Gemm::run(e.params, cuda_stream, nullptr, L2IR_PDL != 0));",
        "      }",
        "    }",
        "    int sm_count = current_sm_count();",
        "    if (sm_count <= 0) return L2IR_STATUS_CUDA_ERROR;",
        "    typename Gemm::Arguments args = make_arguments(A, B, C, M, N, K, sm_count);",
        "    // can_implement checks what the compiled kernel assumes of this shape, e.g. 16-byte TMA strides.",
        "    cutlass::Status status = Gemm::can_implement(args);",
        "    if (status != cutlass::Status::kSuccess) return int(status);",
        "    size_t needed = Gemm::get_workspace_size(args);",
        "    if (workspace_bytes < needed || (needed > 0 && workspace == nullptr)) {",
        "      return L2IR_STATUS_WORKSPACE_TOO_SMALL;",
        "    }",
        "    Gemm gemm;",
        "    // initialize() builds the TMA descriptors and scheduler parameters, zeroes the stream-K barriers (a memset",
        "    // on this stream), and raises the kernel's dynamic shared-memory limit.",
        "    status = gemm.initialize(args, workspace, cuda_stream);",
        "    if (status != cutlass::Status::kSuccess) return int(status);",
        "    status = gemm.run(cuda_stream, nullptr, L2IR_PDL != 0);",
        "    if (status == cutlass::Status::kSuccess && needed == 0) {   // kept only once they launched",
        "      KeptParams& e = ring.entry[ring.next];",
        f"      ring.next = (ring.next + 1) % {KEPT_PARAMS};",
        "      e.a = A; e.b = B; e.c = C; e.m = M; e.n = N; e.k = K; e.device = device;",
        "      e.params = gemm.params();",
        "    }",
        "    return int(status);",
        "  } catch (...) {",
        "    return L2IR_STATUS_EXCEPTION;",
        "  }",
        "}",
        "",
        *run_args_cpp(),
    ]


def render(cfg: Sm90Config) -> str:
    """The .cu text for one configuration. Deterministic: the same Sm90Config gives the same bytes."""
    sections = (_header(cfg), _operands(cfg), _kernel_type(cfg), _arguments(cfg), _host_abi(cfg))
    return "\n".join(line for section in sections for line in section)


# ---------------------------------------------------------------------------------------------------------------
# lower: the backend's entry point.
# ---------------------------------------------------------------------------------------------------------------


def lower(kernel: Kernel, problem: Problem) -> LaunchPlan:
    """IR -> LaunchPlan(form="host_shim"): the .cu of a shared library exporting l2ir_workspace_size / l2ir_run."""
    cfg = canonicalize(kernel, problem)
    return LaunchPlan(
        source=render(cfg),
        arch="sm_90a",
        form="host_shim",
        workspace_bytes=workspace_bound(cfg),
        zero_workspace=False,       # CUTLASS's initialize() zeroes the barrier flags it needs on the stream
        needs_cutlass=True,
    )


__all__ = [
    "Sm90Config", "UnsupportedLowering", "canonicalize", "render", "workspace_bound", "lower",
]
