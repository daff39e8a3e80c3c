"""backends/cutlass_sm90: golden source, determinism, one test per IR field, the refusals, and nvcc builds.

Regenerate the golden sources after an intended change to the lowering:
    python tests/test_cutlass_sm90.py --update-golden
and review the diff of tests/golden/cutlass_sm90/ like any other code change.

The nvcc tests build one configuration by default (about 60 s and 3.5 GB on two cores): the skinny sweep's stream-K
split-K kernel built for PDL (-DL2IR_PDL=1), the one with the most L2IR code inside CUTLASS (its own tile scheduler,
GDC turned on for it); the others are marked `slow` and run only when the mark expression names them:
    pytest -m "nvcc and slow" tests/test_cutlass_sm90.py
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builds import build_all, built, shim_library  # noqa: E402
from golden_sources import GoldenSources  # noqa: E402
from l2ir.backends.sass import disassemble  # noqa: E402
from l2ir.backends import cutlass_sm90 as sm90  # noqa: E402
from l2ir.runtime import STATUS_BAD_ARGUMENT, STATUS_NOT_DIVISIBLE, STATUS_WORKSPACE_TOO_SMALL, status_name  # noqa: E402
from l2ir.backends.cutlass_sm90 import UnsupportedLowering  # noqa: E402
from l2ir.errors import L2IRError, MmaError, ResourceError, TileError  # noqa: E402
from l2ir.nodes import (Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target,  # noqa: E402
                        Tile)

PROBLEM = Problem(m=4096, n=4096, k=4096)


def coop(**changes) -> Kernel:
    """128x256x64 cooperative, cluster 2x1: two consumer warpgroups of 64x256 each, B multicast along the cluster."""
    k = Kernel(target=Target("sm90a"), tile=Tile((128, 256, 64), (8, 1), (2, 1)), mma=Mma("wgmma", (64, 256, 16)),
               pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=True), pad=Pad(),
               epilogue=Epilogue("tma", 8))
    return k.replace(**changes)


def pingpong(**changes) -> Kernel:
    k = Kernel(target=Target("sm90a"), tile=Tile((128, 128, 64), (4, 1), (1, 1)), mma=Mma("wgmma", (64, 128, 16)),
               pipeline=Pipeline("tma_ws", "auto", "pingpong", persistent=True), pad=Pad(),
               epilogue=Epilogue("tma", 8))
    return k.replace(**changes)


CASES: dict[str, tuple[Kernel, Problem]] = {
    "coop_128x256x64_c2x1": (coop(), PROBLEM),
    "pingpong_128x128x64": (pingpong(), PROBLEM),
    "coop_stream_k": (coop(splitk=SplitK("stream_k"), tile=Tile((128, 256, 64), (8, 1), (1, 1))), PROBLEM),
    "coop_split_k4_atomic_along_m": (coop(splitk=SplitK("split_k", 4, "atomic"), swizzle=Swizzle(None, "along_m", 4)),
                                     PROBLEM),
    "pingpong_direct_stages5_nonpersistent": (
        pingpong(epilogue=Epilogue("direct", 8), pipeline=Pipeline("tma_ws", 5, "pingpong", persistent=False),
                 pad=Pad(m="divisible", n="divisible")), PROBLEM),
    "coop_bf16_colA_rowB_f32out": (
        coop(epilogue=Epilogue("tma", 4)),
        Problem(m=1, n=1, k=1, a=("bf16", "col"), b=("bf16", "row"), c=("f32", "row"))),
}


GOLDENS = GoldenSources("cutlass_sm90", CASES, __file__)
lower = GOLDENS.lower           # the backend through the registry, the one dispatch (it attaches IR and problem)
test_golden_source, test_deterministic_in_process, test_deterministic_across_processes = GOLDENS.tests()


def test_plan_fields():
    plan = lower(coop(), PROBLEM)
    assert plan.form == "host_shim" and plan.arch == "sm_90a" and plan.needs_cutlass
    assert plan.launches == () and not plan.zero_workspace
    assert 'extern "C" size_t l2ir_workspace_size(int M, int N, int K)' in plan.source
    assert 'extern "C" int l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,' in plan.source
    assert plan.problem_text == "a=f16:row b=f16:col c=f16:row acc=f32"
    assert plan.workspace_for(4096, 4096, 4096) == 0


# ---------------------------------------------------------------------------------------------------------------
# Each IR field changes its place in the source.
# ---------------------------------------------------------------------------------------------------------------

FIELD_CASES = [
    # (field, kernel, problem, text that must appear)
    ("tile.block", coop(tile=Tile((256, 128, 64), (8, 1), (2, 1)), mma=Mma("wgmma", (64, 128, 16))), PROBLEM,
     "using TileShape = cute::Shape<cute::_256, cute::_128, cute::_64>;"),
    ("tile.block.k", coop(tile=Tile((128, 256, 32), (8, 1), (2, 1))), PROBLEM,
     "using TileShape = cute::Shape<cute::_128, cute::_256, cute::_32>;"),
    ("tile.cluster", coop(tile=Tile((128, 256, 64), (8, 1), (1, 2))), PROBLEM,
     "using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;"),
    ("mma.shape", coop(tile=Tile((128, 192, 64), (8, 1), (2, 1)), mma=Mma("wgmma", (64, 192, 16))), PROBLEM,
     "cute::size<1>(typename TiledMma::AtomShape_MNK{}) == 192"),
    ("pipeline.schedule", pingpong(), PROBLEM,
     "using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;"),
    ("pipeline.stages", coop(pipeline=Pipeline("tma_ws", 3, "cooperative", persistent=True)), PROBLEM,
     "using StageCountType = cutlass::gemm::collective::StageCount<3>;"),
    ("pipeline.persistent", coop(pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False)), PROBLEM,
     "hw_info.max_active_clusters = int(clusters);"),
    ("splitk.mode=stream_k", coop(splitk=SplitK("stream_k")), PROBLEM,
     "DecompositionMode::StreamK;"),
    ("splitk.mode=split_k", coop(splitk=SplitK("split_k", 3)), PROBLEM,
     "args.scheduler.splits = 3;"),
    ("splitk.reduce", coop(splitk=SplitK("split_k", 3, "atomic")), PROBLEM,
     "ReductionMode::Nondeterministic;"),
    ("swizzle.raster", coop(swizzle=Swizzle(None, "along_m", 1)), PROBLEM,
     "RasterOrderOptions::AlongM;"),
    ("swizzle.group", coop(swizzle=Swizzle(None, "along_n", 8)), PROBLEM,
     "args.scheduler.max_swizzle_size = 8;"),
    ("pad.m", coop(pad=Pad(m="divisible")), PROBLEM,
     "if (M % 128 != 0) return L2IR_STATUS_NOT_DIVISIBLE;"),
    ("pad.n", coop(pad=Pad(n="divisible")), PROBLEM,
     "if (N % 256 != 0) return L2IR_STATUS_NOT_DIVISIBLE;"),
    ("pad.k", coop(pad=Pad(k="divisible")), PROBLEM,
     "if (K % 64 != 0) return L2IR_STATUS_NOT_DIVISIBLE;"),
    ("epilogue.path", coop(epilogue=Epilogue("direct", 8)), PROBLEM,
     "using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;"),
    ("epilogue.vector", coop(epilogue=Epilogue("direct", 4)), PROBLEM,
     "constexpr int AlignmentD = 4;"),
    ("problem.a", coop(), Problem(m=1, n=1, k=1, a=("f16", "col")), "using LayoutA = cutlass::layout::ColumnMajor;"),
    ("problem.b", coop(), Problem(m=1, n=1, k=1, b=("f16", "row")), "using LayoutB = cutlass::layout::RowMajor;"),
    ("problem.dtype", coop(), Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col")),
     "using ElementA = cutlass::bfloat16_t;"),
    ("problem.c", coop(epilogue=Epilogue("tma", 4)), Problem(m=1, n=1, k=1, c=("f32", "row")),
     "using ElementD = float;"),
    ("problem.acc", pingpong(), Problem(m=1, n=1, k=1, acc="f16"),
     "using ElementAccumulator = cutlass::half_t;"),
]


@pytest.mark.parametrize("field,kernel,problem,expected", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_field_changes_source(field, kernel, problem, expected):
    GOLDENS.check_field(field, (coop(), PROBLEM), kernel, problem, expected)


def test_baseline_lines():
    src = lower(coop(), PROBLEM).source
    for line in ("using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;",
                 "using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;",
                 "using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;",
                 "using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;",
                 "using TileScheduler = cutlass::gemm::PersistentScheduler;",
                 "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>;",
                 "RasterOrderOptions::AlongN;", "args.scheduler.max_swizzle_size = 1;",
                 "constexpr int AlignmentA = 8;", "constexpr int AlignmentB = 8;",
                 "using LayoutA = cutlass::layout::RowMajor;", "using LayoutB = cutlass::layout::ColumnMajor;",
                 "using ElementC = void;", "#define NDEBUG"):
        assert line in src, line
    pp = lower(pingpong(), PROBLEM).source
    assert "using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;" in pp
    assert "cute::size(TiledMma{}) == 128" in pp


def test_stream_k_uses_stream_k_scheduler():
    src = lower(coop(splitk=SplitK("stream_k")), PROBLEM).source
    assert "using TileScheduler = l2ir::StreamKScheduler;" in src      # CUTLASS's, under L2IR's tag (test_pdl)
    assert "PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape>" in src
    assert "ReductionMode::Deterministic;" in src


# ---------------------------------------------------------------------------------------------------------------
# Workspace bound.
# ---------------------------------------------------------------------------------------------------------------


def test_workspace_bound():
    assert lower(coop(), PROBLEM).workspace_for(8192, 8192, 8192) == 0
    plan = lower(coop(splitk=SplitK("stream_k")), PROBLEM)
    # 8192/128 = 64 tile rows (+2 for swizzle x cluster rounding), 8192/256 = 32 tile columns (+1).
    assert plan.workspace_for(8192, 8192, 512) == 66 * 33 * (128 * 256 * 4 + 8) + sm90.WORKSPACE_SLACK
    assert plan.workspace_for(8192, 8192, 512) >= 8192 * 8192 * 4   # one fp32 partial per output element
    assert plan.workspace_for(1, 1, 1) > 0
    assert plan.workspace_bytes.free_vars() <= {"m", "n", "k"}


# ---------------------------------------------------------------------------------------------------------------
# Refusals: each names the field; inconsistent IR raises a VerifyError subclass.
# ---------------------------------------------------------------------------------------------------------------

UNSUPPORTED = [
    ("target.arch", coop(target=Target("sm90")), PROBLEM),
    ("mma.op", coop(mma=Mma("mma_sync", (16, 8, 16))), PROBLEM),
    ("pipeline.mode", coop(pipeline=Pipeline("multistage", 4, "cooperative", persistent=True)), PROBLEM),
    ("pipeline.schedule", coop(pipeline=Pipeline("tma_ws", "auto", "none", persistent=True)), PROBLEM),
    ("pipeline.prefetch", coop(pipeline=Pipeline("tma_ws", "auto", "cooperative", True, True)), PROBLEM),
    ("pipeline.stages", coop(pipeline=Pipeline("tma_ws", 1, "cooperative", persistent=True)), PROBLEM),
    ("pipeline.persistent", coop(splitk=SplitK("stream_k"),
                                 pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False)), PROBLEM),
    ("splitk.slices", coop(splitk=SplitK("stream_k", 4)), PROBLEM),
    ("splitk", pingpong(splitk=SplitK("stream_k")), PROBLEM),
    ("swizzle.group", coop(swizzle=Swizzle(None, "along_n", 16)), PROBLEM),
    ("swizzle.smem", coop(swizzle=Swizzle((2, 3, 3), "along_n", 1)), PROBLEM),
    ("tile.cluster", coop(tile=Tile((128, 256, 64), (8, 1), (3, 1))), PROBLEM),
    ("tile.cluster", coop(tile=Tile((128, 256, 64), (8, 1), (4, 4))), PROBLEM),
    ("pad.align", coop(pad=Pad(align=4)), PROBLEM),
    ("epilogue.path", coop(epilogue=Epilogue("smem", 8)), PROBLEM),
    ("epilogue.vector", coop(epilogue=Epilogue("tma", 4)), PROBLEM),
    ("epilogue.vector", coop(epilogue=Epilogue("direct", 8)), Problem(m=1, n=1, k=1, c=("f32", "row"))),
    ("problem.b", coop(), Problem(m=1, n=1, k=1, a=("f16", "row"), b=("bf16", "col"))),
    ("problem.acc", coop(), Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), acc="f16")),
]


@pytest.mark.parametrize("field,kernel,problem", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_names_field(field, kernel, problem):
    with pytest.raises(UnsupportedLowering) as info:
        sm90.lower(kernel, problem)       # the backend's own check (the registry refuses mma.op / mode earlier)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, L2IRError)


def test_matching_smem_swizzle_is_accepted():
    # K-major fp16 with BK=64: 128-byte rows, Swizzle<3,3,3> in element units (CuTe's byte-level Sw<3,4,3>).
    assert lower(coop(swizzle=Swizzle((3, 3, 3), "along_n", 1)), PROBLEM).source


INCONSISTENT = [
    (TileError, coop(tile=Tile((128, 256, 64), (4, 1), (2, 1)))),          # cooperative needs 8 warps
    (TileError, pingpong(tile=Tile((128, 128, 64), (8, 1), (1, 1)))),      # pingpong tile is one warpgroup
    (TileError, coop(tile=Tile((64, 256, 64), (8, 1), (1, 1)))),           # 2 warpgroups x 64 rows > 64
    (TileError, coop(tile=Tile((128, 256, 24), (8, 1), (1, 1)))),          # K not a multiple of 16
    (MmaError, coop(mma=Mma("wgmma", (64, 128, 16)))),                     # builder picks 64x256x16 for BN=256
    (MmaError, coop(tile=Tile((128, 160, 64), (8, 1), (1, 1)), mma=Mma("wgmma", (64, 160, 16)))),  # 160 -> 32
    (ResourceError, coop(pipeline=Pipeline("tma_ws", 8, "cooperative", persistent=True))),  # 8 x 48 KiB
]


@pytest.mark.parametrize("error,kernel", INCONSISTENT)
def test_inconsistent_ir_raises_verify_error(error, kernel):
    with pytest.raises(error):
        lower(kernel, PROBLEM)


def test_status_names():
    assert status_name(0) == "cutlass::Status::kSuccess"
    assert status_name(1) == "cutlass::Status::kErrorMisalignedOperand"
    assert status_name(STATUS_WORKSPACE_TOO_SMALL) == "workspace too small"


# ---------------------------------------------------------------------------------------------------------------
# nvcc builds (skip cleanly without nvcc or the nvidia-cutlass wheel).
# ---------------------------------------------------------------------------------------------------------------


def _require_slow_selected(request):
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("slow nvcc build: select with -m 'nvcc and slow'")


def build(kernel: Kernel, problem: Problem, cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> dict:
    """Build the shared library through backends/compile.py, keeping the PTX and the ptxas report."""
    plan = lower(kernel, problem)
    plan = dataclasses.replace(plan, extra_flags=(*plan.extra_flags, *extra_flags))
    art = built(build_all({"plan": plan}, cache_dir)["plan"])
    return {"lib": art.binary, "log": art.log, "ptx": art.ptx(), "plan": plan}


def check_build(result: dict, wgmma: str) -> None:
    log = result["log"]
    # ptxas reports one line per function; every one must be spill-free.
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), f"register spills: {spills}"
    # C7510: a call inside the kernel serializes every wgmma (the NDEBUG define guards against asserts).
    assert "C7510" not in log, "wgmma serialized across a function call"
    assert wgmma in result["ptx"], f"{wgmma} not in the PTX"
    assert re.search(r"Used (\d+) registers", log)


def check_abi_without_gpu(lib: Path) -> None:
    """The shim loads and refuses cleanly on a machine without a GPU (or any machine, for bad arguments)."""
    so = shim_library(lib)
    assert so.l2ir_run(None, None, None, 256, 256, 256, None, 0, None) == STATUS_BAD_ARGUMENT
    # A misaligned (but non-null) operand is refused before any CUDA call: TMA needs 16-byte bases.
    assert so.l2ir_run(8, 16, 16, 256, 256, 256, None, 0, None) == 1   # kErrorMisalignedOperand
    assert so.l2ir_workspace_size(0, 64, 64) == 0


@pytest.fixture(scope="module")
def default_build(tmp_path_factory):
    from l2ir.search.sweeps import load_sweep

    kernel = load_sweep("sm90a_skinny")["coop_128x128x64_c1x2_splitk2"]
    return build(kernel, PROBLEM, tmp_path_factory.mktemp("stream_k"), extra_flags=("-DL2IR_PDL=1",))


@pytest.mark.nvcc
def test_nvcc_stream_k_built_for_pdl(default_build):
    """It builds spill-free with wgmma, refuses bad arguments without a GPU, and its PTX waits on the previous grid
    (griddepcontrol.wait) but never hints an early release (L2IR's stream-K scheduler does not ask for one)."""
    check_build(default_build, "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16")
    check_abi_without_gpu(default_build["lib"])
    ptx = default_build["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" not in ptx


@pytest.mark.nvcc
def test_sass_has_hgmma(default_build):
    sass = disassemble(default_build["lib"])
    if sass is None:
        pytest.skip("cuobjdump/nvdisasm not found (PATH or the NVIDIA wheels)")
    assert "HGMMA.64x128x16.F32" in sass


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name,wgmma", [
    ("coop_128x256x64_c2x1", "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16"),
    ("pingpong_128x128x64", "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"),
    ("coop_stream_k", "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16"),
    ("coop_split_k4_atomic_along_m", "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16"),
    ("pingpong_direct_stages5_nonpersistent", "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"),
    ("coop_bf16_colA_rowB_f32out", "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"),
])
def test_nvcc_slow(request, tmp_path, name, wgmma):
    _require_slow_selected(request)
    result = build(*CASES[name], tmp_path)
    check_build(result, wgmma)
    check_abi_without_gpu(result["lib"])
    if name == "pingpong_direct_stages5_nonpersistent":   # pad.m = divisible by BM = 128
        so = shim_library(result["lib"])
        assert so.l2ir_run(16, 16, 16, 100, 256, 256, None, 0, None) == STATUS_NOT_DIVISIBLE


if __name__ == "__main__":
    GOLDENS.main(sys.argv[1:], __doc__)
