"""backends/cuda_ptx (sm80 rule): golden source, determinism, dispatch, one test per IR field, the refusals, and nvcc
builds.

Regenerate the golden sources after an intended change to the lowering:
    python tests/test_cuda_ptx_sm80.py --update-golden
and review the diff of tests/golden/cuda_ptx_sm80/ like any other code change.

The nvcc tests build two configurations as the harness does for an H200 (sm_80-level code, sm_90 SASS); they skip
cleanly without nvcc.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builds import build_all, built  # noqa: E402
from golden_sources import GoldenSources  # noqa: E402
from l2ir.backends import registry  # noqa: E402
from l2ir.backends.cuda_ptx import sm80  # noqa: E402
from l2ir.backends.cuda_ptx.common import UnsupportedLowering  # noqa: E402
from l2ir.target import NVCC_ARCH  # noqa: E402
from l2ir.errors import L2IRError, VerifyError  # noqa: E402
from l2ir.indexing import smem_swizzle  # noqa: E402
from l2ir.nodes import (Epilogue, Interleave, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle,  # noqa: E402
                        Target, Tile)
from l2ir.analysis import smem_bytes  # noqa: E402

PROBLEM = Problem(m=4096, n=4096, k=4096)


def ms(block=(128, 128, 32), warps=(2, 2), stages=4, arch="sm80", **changes) -> Kernel:
    """The base sm80 schedule: mma.sync 16x8x16, cp.async ring with register prefetch, <2,3,3>, smem epilogue."""
    k = Kernel(target=Target(arch), tile=Tile(block, warps), mma=Mma("mma_sync", (16, 8, 16)),
               pipeline=Pipeline("multistage", stages, prefetch=True),
               swizzle=Swizzle((2, 3, 3), "along_n", 8), pad=Pad("predicate", "predicate", "zero_fill", 8),
               epilogue=Epilogue("smem", 8))
    return k.replace(**changes)


CASES: dict[str, tuple[Kernel, Problem]] = {
    "128x128x32_w2x2_s4_prefetch_smem8": (ms(), PROBLEM),
    "128x256x32_w2x4_s3_direct2_along_m": (
        ms((128, 256, 32), (2, 4), 3, epilogue=Epilogue("direct", 2), swizzle=Swizzle((2, 3, 3), "along_m", 4)),
        PROBLEM),
    "64x64x32_w2x2_s3_splitk4_smem8": (ms((64, 64, 32), stages=3, splitk=SplitK("split_k", 4)), PROBLEM),
    "sm86_64x128x48_s1_direct1_divisible_bf16": (
        ms((64, 128, 48), stages=1, arch="sm86", swizzle=None, epilogue=Epilogue("direct", 1),
           pad=Pad("divisible", "zero_fill", "predicate", 8)),
        Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), c=("bf16", "row"))),
    "sm90_64x128x48_s2_noprefetch_splitk3_direct2": (
        ms((64, 128, 48), stages=2, arch="sm90", swizzle=Swizzle(None, "along_n", 1),
           pipeline=Pipeline("multistage", 2, prefetch=False), pad=Pad("zero_fill", "predicate", "divisible", 8),
           splitk=SplitK("split_k", 3), epilogue=Epilogue("direct", 2)), PROBLEM),
    # Decode family: M <= 16 rows per tile, 4 warps side by side along N, a 6-deep ring, 8 slices fixed up in-kernel.
    "16x128x64_w1x4_s6_splitk8_direct2_decode": (
        ms((16, 128, 64), (1, 4), 6, swizzle=Swizzle((3, 3, 3), "along_n", 1), splitk=SplitK("split_k", 8),
           epilogue=Epilogue("direct", 2)), PROBLEM),
    # Unaligned K: 8-byte cp.async.ca (align 4) and realigned 16-byte loads (align 1).
    "64x128x32_w2x2_s4_align4_smem4": (
        ms((64, 128, 32), stages=4, pad=Pad("predicate", "predicate", "zero_fill", 4), epilogue=Epilogue("smem", 4)),
        PROBLEM),
    "64x64x32_w2x2_s4_align1_splitk2_smem1": (
        ms((64, 64, 32), stages=4, pad=Pad("predicate", "zero_fill", "zero_fill", 1), splitk=SplitK("split_k", 2),
           epilogue=Epilogue("smem", 1)), PROBLEM),
    # Odd K at large tiles: blocks staged by cp.async and realigned in shared memory feed 128x128 tiles.
    "128x128x32_w2x4_s4_align1_smem1": (
        ms(warps=(2, 4), pad=Pad("predicate", "predicate", "zero_fill", 1), epilogue=Epilogue("smem", 1)), PROBLEM),
    "128x128x32_w2x2_s4_align1_kpredicate_smem1": (
        ms(pad=Pad("predicate", "predicate", "predicate", 1), epilogue=Epilogue("smem", 1)), PROBLEM),
    # 128x128x64 with 4 stages of staged blocks and two realigned tiles: 208 KB, an sm90-class carve-out.
    "sm90a_128x128x64_w2x4_s4_align1_smem1": (
        ms((128, 128, 64), (2, 4), arch="sm90a", swizzle=Swizzle((3, 3, 3), "along_n", 1),
           pad=Pad("predicate", "predicate", "zero_fill", 1), epilogue=Epilogue("smem", 1)), PROBLEM),
    # Decode tile for an odd K: 16 rows, 4 in-kernel split-K slices, 3 stages (one realigned tile ahead).
    "16x128x64_w1x4_s3_align1_splitk4_decode_direct1": (
        ms((16, 128, 64), (1, 4), 3, swizzle=Swizzle((3, 3, 3), "along_n", 1),
           pad=Pad("predicate", "zero_fill", "zero_fill", 1), splitk=SplitK("split_k", 4),
           epilogue=Epilogue("direct", 1)), PROBLEM),
    # BK=48: an odd number of k-steps (the fragment double buffer's last step is also the next tile's first).
    "64x128x48_w2x2_s3_align1_kpredicate_smem1": (
        ms((64, 128, 48), stages=3, swizzle=Swizzle((2, 3, 3), "along_n", 1),
           pad=Pad("zero_fill", "predicate", "predicate", 1), epilogue=Epilogue("smem", 1)), PROBLEM),
    # Fewer than 3 stages: one realigned tile, behind a second barrier (with and without the fragment prefetch).
    "64x64x64_w2x2_s2_align1_smem1": (
        ms((64, 64, 64), stages=2, swizzle=Swizzle((3, 3, 3), "along_n", 1),
           pad=Pad("predicate", "predicate", "zero_fill", 1), epilogue=Epilogue("smem", 1)), PROBLEM),
    "64x64x32_w2x2_s1_align1_zero_fill_direct1": (
        ms((64, 64, 32), stages=1, pad=Pad("zero_fill", "zero_fill", "zero_fill", 1), epilogue=Epilogue("direct", 1)),
        PROBLEM),
    "64x128x32_w2x2_s2_noprefetch_align1_zero_fill_direct1": (
        ms((64, 128, 32), stages=2, pipeline=Pipeline("multistage", 2, prefetch=False),
           pad=Pad("zero_fill", "zero_fill", "zero_fill", 1), epilogue=Epilogue("direct", 1)), PROBLEM),
    "64x128x32_w2x2_s4_align1_divisible_direct1": (
        ms((64, 128, 32), pad=Pad("divisible", "divisible", "divisible", 1), epilogue=Epilogue("direct", 1)), PROBLEM),
    # The interleave node: columns 8 apart per block, B straight into its stages, only A staged and realigned.
    "32x128x64_w2x4_s4_align1_splitk3_interleave_direct1": (
        ms((32, 128, 64), (2, 4), 4, swizzle=Swizzle((3, 3, 3), "along_n", 1),
           pad=Pad("predicate", "zero_fill", "zero_fill", 1), splitk=SplitK("split_k", 3),
           epilogue=Epilogue("direct", 1), interleave=Interleave()), PROBLEM),
    "16x128x64_w1x4_s3_align1_splitk4_interleave_direct1": (
        ms((16, 128, 64), (1, 4), 3, swizzle=Swizzle((3, 3, 3), "along_n", 1),
           pad=Pad("zero_fill", "predicate", "predicate", 1), splitk=SplitK("split_k", 4),
           epilogue=Epilogue("direct", 1), interleave=Interleave()), PROBLEM),
    "64x64x32_w2x2_s2_noprefetch_align1_interleave_smem1": (
        ms((64, 64, 32), stages=2, pipeline=Pipeline("multistage", 2, prefetch=False),
           pad=Pad("predicate", "predicate", "zero_fill", 1), epilogue=Epilogue("smem", 1),
           interleave=Interleave()), PROBLEM),
    "64x64x48_w2x2_s1_align1_interleave_direct1": (
        ms((64, 64, 48), stages=1, swizzle=None, pad=Pad("zero_fill", "zero_fill", "predicate", 1),
           epilogue=Epilogue("direct", 1), interleave=Interleave()), PROBLEM),
}


GOLDENS = GoldenSources("cuda_ptx_sm80", CASES, __file__)
lower = GOLDENS.lower           # the backend through the registry, the one dispatch (it attaches IR and problem)
test_golden_source, test_deterministic_in_process, test_deterministic_across_processes = GOLDENS.tests()


def test_plan_fields():
    plan = lower(ms(), PROBLEM)
    assert plan.form == "kernels" and plan.arch == "sm_80" and not plan.needs_cutlass
    assert not plan.zero_workspace and plan.workspace_for(4096, 4096, 4096) == 0
    (launch,) = plan.launches
    assert launch.entry == sm80.GEMM_ENTRY and launch.block == (128, 1, 1)
    assert launch.grid_for(1000, 1000, 1000) == (8 * 8, 1, 1)
    assert launch.smem == 4 * (128 + 128) * 32 * 2 == smem_bytes(ms())
    assert f'extern "C" __global__ void __launch_bounds__(128)\n{sm80.GEMM_ENTRY}(const void* A_, const void* B_, ' \
           'void* C_, int M, int N, int K, void* workspace_)' in plan.source
    assert plan.problem_text == "a=f16:row b=f16:col c=f16:row acc=f32"
    assert plan.ir_text == ms().text()
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                  "cp.async.cg.shared.global [%0], [%1], 16, %2;", "cp.async.commit_group;",
                  "cp.async.wait_group %0;"):
        assert instr in plan.source, instr
    assert "cute" not in plan.source.lower() and "cutlass" not in plan.source.lower()


def test_splitk_plan():
    """Split-K is one launch: grid.z = slices, the slices reduce inside the kernel. The workspace holds every tile's
    fp32 slots (one per slice), then SLICES - 1 pair counters per tile, and must be zero before the first launch
    only."""
    kernel = ms((64, 64, 32), stages=3, splitk=SplitK("split_k", 4))
    plan = lower(kernel, PROBLEM)
    (gemm,) = plan.launches
    assert gemm.entry == sm80.GEMM_ENTRY and gemm.grid_for(1000, 1000, 1000) == (16 * 16, 1, 4)
    assert plan.workspace_for(1000, 1000, 1000) == 16 * 16 * (4 * 64 * 64 * 4 + 3 * 4)
    assert plan.zero_workspace
    assert gemm.smem <= smem_bytes(kernel)           # the C stage is f16 now: the slices sum in registers
    assert "splitk_reduce" not in plan.source


@pytest.mark.parametrize("block,warps,slices", [((64, 64, 32), (2, 2), 4), ((16, 128, 64), (1, 4), 8),
                                                ((128, 32, 64), (4, 1), 3), ((64, 64, 64), (2, 2), 5)])
def test_splitk_fixup_is_rendered(block, warps, slices):
    """The in-kernel reduction climbs l2ir.indexing.SplitKTree: at each level with a sibling the block stores its
    registers to slot `base` (L2 only), fences before counting in on the pair's counter, and only the pair's second
    arrival (count 1) resets the counter (self-cleaning), reads the sibling through L2, adds it and goes up with the
    merged base; a first arrival leaves, and the root's block runs the one epilogue. The expressions are the tree's
    own, and the counters (SLICES - 1 per tile) start right after the slots, where workspace_bytes puts them."""
    from l2ir.indexing import SplitKTree

    tree = SplitKTree(slices)
    kernel = ms(block, warps, 4, splitk=SplitK("split_k", slices))
    plan = lower(kernel, PROBLEM)
    src = plan.source
    order = [f"constexpr int TREE_LEVELS = {tree.levels};", f"constexpr int TREE_NODES = {tree.counters};",
             "int base = slice;", "for (int level = 0; level < TREE_LEVELS; ++level) {",
             f"const int sibling = {tree.sibling.to_cpp()};", "if (sibling >= SLICES) continue;",
             "__stcg(&part[((tile_slot + base) * (MI * NI) + mi * NI + ni) * THREADS + int(threadIdx.x)],",
             "__threadfence();", "__syncthreads();", f"const int node = {tree.counter.to_cpp()};",
             "const unsigned arrived = atomicAdd(&tile_counters[node], 1u);", "is_last = arrived == 1u;",
             "if (is_last) tile_counters[node] = 0u;", "if (!is_last) { carries = false; break; }",
             "__threadfence();",
             "__ldcg(&part[((tile_slot + sibling) * (MI * NI) + mi * NI + ni) * THREADS + int(threadIdx.x)]);",
             f"base = {tree.merged.to_cpp()};", "if (!carries) return;", "// epilogue.path=smem"]
    at = 0
    for piece in order:
        found = src.find(piece, at)
        assert found >= 0, f"{piece!r} missing or out of order"
        at = found + len(piece)
    assert f"constexpr int SLICES = {slices};" in src
    assert "reinterpret_cast<unsigned*>(ws + (long long)tiles * SLICES * BM * BN)" in src
    assert "unsigned* __restrict__ tile_counters = counters + (long long)pid * TREE_NODES;" in src
    bm, bn, _ = block
    for m, n in ((1000, 1000), (16, 4096), (4096, 64)):
        tiles = -(-m // bm) * -(-n // bn)
        assert plan.workspace_for(m, n, 4096) == tiles * slices * bm * bn * 4 + tiles * (slices - 1) * 4
    assert src.count("__global__") == 1 and len(plan.launches) == 1


def test_dispatch_on_mma_op_and_pipeline():
    """Rules are chosen by what the kernel computes with: mma.sync multistage on sm90/sm90a is the sm80 rule's."""
    for arch in ("sm80", "sm86", "sm89", "sm90", "sm90a"):
        assert registry.backend_for(ms(arch=arch), "cuda_ptx_sm80").module == "l2ir.backends.cuda_ptx.sm80"
        assert lower(ms(arch=arch), PROBLEM).arch == NVCC_ARCH[arch]
    wgmma = Kernel(target=Target("sm90a"), tile=Tile((128, 128, 64), (8, 1)), mma=Mma("wgmma", (64, 128, 16)),
                   pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=True),
                   pad=Pad("zero_fill", "zero_fill", "zero_fill", 8), epilogue=Epilogue("smem", 8))
    assert registry.backend_for(wgmma, "cuda_ptx").module == "l2ir.backends.cuda_ptx.sm90a"
    with pytest.raises(NotImplementedError, match="backend 'cuda_ptx_sm80' does not lower this kernel"):
        lower(wgmma, PROBLEM)


def test_registry_entry():
    assert registry.backend_for(ms()).name == "cute_sm80"       # aligned rows: CuTe is the default
    assert lower(ms(), PROBLEM).source == sm80.lower(ms(), PROBLEM).source
    unaligned = CASES["64x64x32_w2x2_s4_align1_splitk2_smem1"][0]
    assert registry.backend_for(unaligned).name == "cuda_ptx_sm80"
    assert registry.lower(unaligned, PROBLEM).source == lower(unaligned, PROBLEM).source


# Seeds of odd-K problems: with fewer than REPACK_MIN_M rows of A on sm90a (the repack's copy of B would cost more
# than the GEMM) and on sm80 they are pad.align=1 mma.sync kernels, which this rule lowers by default. CuTe ran the
# 17x9999x3333 seed in 1.56 ms, this rule in 103 us (backends/registry.py).
ODD_K_SEEDS = {"17x9999x3333_sm90a": (Problem(m=17, n=9999, k=3333), "sm90a"),
                   "333x555x777_sm80": (Problem(m=333, n=555, k=777), "sm80"),
                   "64x128x1025_sm80_bf16": (Problem(m=64, n=128, k=1025, a=("bf16", "row"), b=("bf16", "col"),
                                                     c=("bf16", "row")), "sm80")}


def _seed_plans():
    from l2ir.seed import seed
    out = {}
    for name, (problem, arch) in ODD_K_SEEDS.items():
        kernel = seed(problem, arch)
        assert kernel.mma.op == "mma_sync" and kernel.pad.align == 1, name
        assert registry.backend_for(kernel).name == "cuda_ptx_sm80", name
        plan = registry.lower(kernel, problem)           # the default, with nothing named
        assert plan.source == lower(kernel, problem).source, name
        out[name] = plan
    return out


def test_odd_k_seeds_default_to_this_rule():
    plans = _seed_plans()
    assert all(GEMM_ENTRY_DEFINED.search(plan.source) for plan in plans.values())


def test_seeds_with_wider_rows_stay_on_cute():
    """K % 8 = 2 or 4: 4- or 8-byte cp.async on both backends, where CuTe's kernels were the faster."""
    from l2ir.seed import seed
    for k, align in ((1026, 2), (1028, 4)):
        kernel = seed(Problem(m=333, n=555, k=k), "sm80")
        assert kernel.pad.align == align and registry.backend_for(kernel).name == "cute_sm80"


def test_odd_k_seed_in_another_problem_class_stays_on_cute():
    """The kernel alone picks this rule; a problem class it does not generate (here an M-major A) is CuTe's."""
    from l2ir.seed import seed
    problem = Problem(m=333, n=555, k=777, a=("f16", "col"))
    kernel = seed(problem, "sm80")
    assert kernel.pad.align == 1 and registry.backend_for(kernel).name == "cuda_ptx_sm80"
    assert registry.backend_for(kernel, problem=problem).name == "cute_sm80"
    assert registry.lower(kernel, problem).source == registry.lower(kernel, problem, "cute_sm80").source
    with pytest.raises(UnsupportedLowering, match="problem.a"):
        lower(kernel, problem)


GEMM_ENTRY_DEFINED = re.compile(rf'extern "C" __global__\s+void\s+(__launch_bounds__\([^)]*\)\s*)?'
                                rf'{sm80.GEMM_ENTRY}\s*\(')


def test_sweep_lowers():
    from l2ir.search.sweeps import load_sweep
    sweep = load_sweep("cuda_ptx_sm80")
    assert len(sweep) >= 2
    for kernel in sweep.values():
        plan = lower(kernel, Problem(1, 1, 1))
        assert plan.launches[0].smem <= smem_bytes(kernel)


# ---------------------------------------------------------------------------------------------------------------
# Each IR field changes the source (or is refused: see below).
# ---------------------------------------------------------------------------------------------------------------

BF16 = Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"))
FIELD_CASES = [
    ("target.arch", ms(arch="sm89"), PROBLEM, "// target.arch=sm89"),
    ("tile.block", ms((128, 128, 64)), PROBLEM, "constexpr int BM = 128, BN = 128, BK = 64;"),
    ("tile.warps", ms(warps=(4, 1)), PROBLEM, "constexpr int WM = 4, WN = 1;"),
    ("pipeline.stages", ms(stages=3), PROBLEM, "constexpr int STAGES = 3;"),
    ("pipeline.stages=1", ms(stages=1), PROBLEM, "// pipeline.stages=1"),
    ("pipeline.prefetch", ms(pipeline=Pipeline("multistage", 4, prefetch=False)), PROBLEM,
     "// pipeline.prefetch=false"),
    ("swizzle.smem", ms(swizzle=Swizzle((1, 3, 3), "along_n", 8)), PROBLEM,
     f"return {smem_swizzle(1, 3, 3).to_cpp()};"),
    ("swizzle.smem=none", ms(swizzle=Swizzle(None, "along_n", 8)), PROBLEM, "// swizzle.smem=none"),
    ("swizzle.raster", ms(swizzle=Swizzle((2, 3, 3), "along_m", 8)), PROBLEM, "// swizzle.raster=along_m group=8"),
    ("swizzle.group", ms(swizzle=Swizzle((2, 3, 3), "along_n", 2)), PROBLEM, "// swizzle.raster=along_n group=2"),
    ("pad.m=zero_fill", ms(pad=Pad("zero_fill", "predicate", "zero_fill", 8)), PROBLEM, "// pad.m=zero_fill"),
    ("pad.m=divisible", ms(pad=Pad("divisible", "predicate", "zero_fill", 8)), PROBLEM, "// pad.m=divisible"),
    ("pad.n=zero_fill", ms(pad=Pad("predicate", "zero_fill", "zero_fill", 8)), PROBLEM, "// pad.n=zero_fill"),
    ("pad.n=divisible", ms(pad=Pad("predicate", "divisible", "zero_fill", 8)), PROBLEM, "// pad.n=divisible"),
    ("pad.k=predicate", ms(pad=Pad("predicate", "predicate", "predicate", 8)), PROBLEM, "// pad.k=predicate"),
    ("pad.k=divisible", ms(pad=Pad("predicate", "predicate", "divisible", 8)), PROBLEM, "// pad.k=divisible"),
    ("splitk", ms(splitk=SplitK("split_k", 2)), PROBLEM, "const unsigned arrived = atomicAdd(&tile_counters[node], 1u);"),
    ("splitk.slices", ms(splitk=SplitK("split_k", 3)), PROBLEM, "constexpr int SLICES = 3;"),
    ("pad.align=4", ms(pad=Pad("predicate", "predicate", "zero_fill", 4), epilogue=Epilogue("smem", 4)), PROBLEM,
     'asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\\n"'),
    ("pad.align=2", ms(pad=Pad("predicate", "predicate", "zero_fill", 2), epilogue=Epilogue("smem", 2)), PROBLEM,
     'asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\\n"'),
    ("pad.align=1", ms(pad=Pad("predicate", "predicate", "zero_fill", 1), epilogue=Epilogue("smem", 1)), PROBLEM,
     "constexpr int RAW_PITCH = BK + 8;"),
    ("tile.warps=1x4", ms((16, 128, 64), (1, 4)), PROBLEM, "constexpr int WM = 1, WN = 4;"),
    ("epilogue.path", ms(epilogue=Epilogue("direct", 2)), PROBLEM, "// epilogue.path=direct"),
    ("epilogue.vector", ms(epilogue=Epilogue("smem", 4)), PROBLEM, "constexpr int VEC = 4;"),
    ("epilogue.vector.direct", ms(epilogue=Epilogue("direct", 1)), PROBLEM, "// epilogue.vector=1"),
    ("problem.dtype", ms(), BF16, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
    ("problem.c", ms(), Problem(m=1, n=1, k=1, c=("bf16", "row")), "using OutT = __nv_bfloat16;"),
]


@pytest.mark.parametrize("field,kernel,problem,expected", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_field_changes_source(field, kernel, problem, expected):
    GOLDENS.check_field(field, (ms(), PROBLEM), kernel, problem, expected)


def test_divisible_drops_predicates():
    base = lower(ms(), PROBLEM).source
    div = lower(ms(pad=Pad("divisible", "divisible", "divisible", 8)), PROBLEM).source
    assert "if (m < M && n < N)" in base and "if (grow < M)" in base
    for guard in ("m < M", "n < N", "grow < M", "grow < N", "(!check_k || k < K)"):
        assert guard not in div, guard
    assert "cp_async(dst, src);" in div and "cp_async_zfill(dst," not in div


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("prefetch", [True, False])
def test_align1_stages_raw_blocks_with_cp_async(prefetch, stages):
    """pad.align=1 keeps the cp.async ring: raw 16-byte blocks are staged asynchronously, and a realign pass after a
    wait and a barrier moves them into the tile ldmatrix reads. With 3+ stages the next k-tile is realigned while
    this one is multiplied (one barrier per k-tile, two realigned buffers); with fewer, just before its MMAs behind a
    second barrier. Nothing is held in registers across k-tiles."""
    kernel = ms((64, 64, 32), pipeline=Pipeline("multistage", stages, prefetch=prefetch),
                pad=Pad("predicate", "predicate", "zero_fill", 1), epilogue=Epilogue("smem", 1))
    plan = lower(kernel, PROBLEM)
    src = plan.source
    assert 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"' in src
    assert "Raw ra[" not in src and "gather_a(" not in src and "__ldg(" not in src
    lookahead = 1 if stages >= 3 else 0
    assert f"constexpr int BUFS = {lookahead + 1};" in src
    bufs = lookahead + 1
    assert plan.launches[0].smem == (stages * (32 + 8) + bufs * 32) * 128 * 2 == smem_bytes(kernel)
    loop = src[src.index("for (int t = 0; t < k_count; ++t) {"):src.index("// epilogue.path=smem")]
    copy, realign, mma = loop.index("copy_a(smem_base,"), loop.index("realign_a(smem_base,"), loop.index("mma_all(")
    if stages == 1:
        barriers = [m.start() for m in re.finditer(r"__syncthreads\(\);", loop)]
        assert len(barriers) == 3 and barriers[0] < copy < loop.index("cp_async_wait<0>();") < barriers[1] < realign
        assert realign < barriers[2] < mma
        return
    wait = f"cp_async_wait<STAGES - {2 + lookahead}>();"
    assert wait in loop
    if lookahead:
        assert loop.count("__syncthreads();") == 1
        ahead = "t + 2" if prefetch else "t + 1"
        assert f"realign_a(smem_base, A, a_rows, K, k_begin + {ahead}, ({ahead}) % STAGES, ({ahead}) % BUFS," in loop
        assert loop.index("__syncthreads();") < mma < loop.rindex("realign_a(")
    else:
        assert loop.count("__syncthreads();") == 2
        first, second = loop.index("__syncthreads();"), loop.rindex("__syncthreads();")
        assert loop.index(wait) < first < realign < second
    assert copy < mma


# Both operands staged and realigned (the interleave cases stage A only; the whole-kernel emulation below runs them).
ALIGN1 = [name for name in CASES if "align1" in name and "interleave" not in name]


@pytest.mark.parametrize("name", ALIGN1)
def test_align1_realigns_16_byte_blocks(name):
    """pad.align=1 stages whole aligned 16-byte blocks (a row's extra block only by the thread owning its last chunk,
    read only when the row does not start on a block), and realigns a run of G chunks from G + 1 16-byte shared loads
    with register selects and a funnel shift: no 2-byte load and no dynamically indexed register array remain."""
    kernel, problem = CASES[name]
    src = lower(kernel, problem).source
    copy = _function(src, "copy_a")
    realign_a = _function(src, "realign_a")
    realign = _function(src, "realign")
    assert "cp_async_zfill(dst, ok ? src : A, ok);" in copy
    assert "if (kc == BK - CHUNK) {" in copy and "ok2 ? src + CHUNK : A" in copy
    assert "for (int g = 0; g <= G; ++g) blk[g] = ld_shared_16(src + 16u * unsigned(g));" in realign_a
    assert "x.lo = blk[g];" in realign_a and "x.hi = blk[g + 1];" in realign_a
    assert "realign(x, w);" in realign_a and "swz(r * BK + kc)" in realign_a
    assert "__funnelshift_r(v[j], v[j + 1], (c.s & 1) * 16)" in realign
    for two_byte in ("unsigned short h[", "__ldg(", "unsigned short*"):
        assert two_byte not in src, two_byte
    # Only compile-time indices into w/u/v (unrolled loops over constant bounds), never the runtime offset s.
    assert not re.search(r"\b[wuv]\[[^\]]*\bs\b", realign), "register array indexed by s"
    assert ("x.n = 8;" in realign_a) == (kernel.pad.k == "divisible")


# The rendered copy_a / copy_b (cp.async staging) and realign_a / realign_b (the realign pass), compiled for the host
# with the device primitives they use modelled exactly (16-byte cp.async with src-size 0 or 16, 16-byte shared loads
# and stores, __funnelshift_r, the swizzle as rendered), run for every thread of a block, every k-tile, odd K, ragged
# M / N and every 2-byte offset of the matrix base: every element of the realigned (swizzled) tile must be its
# matrix element or zero past M / N / K, every realigned chunk and every staged block written exactly once, and no
# 16-byte block read unless it holds an element of the k-tile being staged (past the matrix it may be unmapped).
STAGING_HARNESS = r"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __restrict__
using std::max;
using std::min;
struct uint4 { unsigned x, y, z, w; };
struct { unsigned x; } threadIdx;
using InT = unsigned short;
@CONSTANTS@
static std::vector<unsigned char> g_smem;
static std::vector<int> g_staged, g_realigned;   // writes per staged 16-byte block / per realigned chunk
// The bytes of the elements of the k-tile being staged (existing rows only): a block read must overlap one.
static std::vector<std::pair<const unsigned char*, const unsigned char*>> g_valid;
static long g_bad_reads = 0, g_misaligned = 0, g_bad_smem = 0;
inline void cp_async_zfill(unsigned dst, const void* src, bool valid) {
  if (dst % 16 || dst + 16 > g_smem.size()) { ++g_bad_smem; return; }
  ++g_staged[dst / 16];
  if (!valid) { std::memset(&g_smem[dst], 0, 16); return; }
  const unsigned char* b = static_cast<const unsigned char*>(src);
  if (reinterpret_cast<uintptr_t>(b) % 16) ++g_misaligned;
  bool holds_valid = false;
  for (auto& [lo, hi] : g_valid) holds_valid = holds_valid || (b < hi && b + 16 > lo);
  if (!holds_valid) ++g_bad_reads;
  std::memcpy(&g_smem[dst], b, 16);
}
inline uint4 ld_shared_16(unsigned src) {
  uint4 v{};
  if (src % 16 || src + 16 > g_smem.size()) { ++g_bad_smem; return v; }
  std::memcpy(&v, &g_smem[src], 16); return v;
}
inline void st_shared_16(unsigned dst, const unsigned (&w)[4]) {
  if (dst % 16 || dst + 16 > g_smem.size()) { ++g_bad_smem; return; }
  ++g_realigned[dst / 16];
  std::memcpy(&g_smem[dst], w, 16);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  return unsigned(((uint64_t(hi) << 32) | lo) >> (shift & 31));
}
@FUNCTIONS@
int main(int argc, char** argv) {
  const int rows = atoi(argv[1]), K = atoi(argv[2]), base = atoi(argv[3]), is_b = atoi(argv[4]);
  const int row_pred = atoi(argv[5]), k_every = atoi(argv[6]);   // pad.m/n=predicate; check K on every k-tile
  const int TILE_ROWS = is_b ? BN : BM, CH = is_b ? CHUNKS_B : CHUNKS_A;
  const int tile0 = is_b ? SMEM_B : SMEM_A, tile_size = is_b ? B_STAGE : A_STAGE;
  const int raw0 = is_b ? RAW_A : 0;
  // 64 guard bytes either side, the matrix `base` elements past a 16-byte boundary.
  std::vector<unsigned char> buf(64 + 2 * base + 2 * size_t(rows) * K + 64 + 16);
  unsigned char* aligned = buf.data() + (16 - reinterpret_cast<uintptr_t>(buf.data()) % 16) % 16;
  unsigned short* X = reinterpret_cast<unsigned short*>(aligned + 64 + 2 * base);
  std::memset(buf.data(), 0xEE, buf.size());
  for (long i = 0; i < long(rows) * K; ++i) X[i] = (unsigned short)(1 + i % 65521);
  g_smem.assign(2 * size_t(SMEM_RAW + STAGES * RAW_STAGE), 0);
  const int k_tiles = (K + BK - 1) / BK;
  long wrong = 0, bad_counts = 0;
  for (int row0 = 0; row0 < rows; row0 += TILE_ROWS)
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int stage = kt % STAGES, rbuf = kt % BUFS;
      const bool check_k = k_every || kt == k_tiles - 1;   // pad.k=zero_fill / predicate's contracts
      std::memset(g_smem.data(), 0xA5, g_smem.size());    // stale shared memory
      g_staged.assign(g_smem.size() / 16, 0);
      g_realigned.assign(g_smem.size() / 16, 0);
      g_valid.clear();
      for (int r = 0; r < TILE_ROWS && row0 + r < rows; ++r) {
        const int n = min(BK, K - kt * BK);
        const unsigned char* first = reinterpret_cast<unsigned char*>(X + long(row0 + r) * K + kt * BK);
        g_valid.push_back({first, first + 2 * n});
      }
      for (unsigned t = 0; t < unsigned(THREADS); ++t) {
        threadIdx.x = t;
        if (is_b) copy_b(0u, X, row0, 0, rows, K, kt, stage, check_k);
        else copy_a(0u, X, row0, rows, 0, K, kt, stage, check_k);
      }
      // __syncthreads(): every thread's staged blocks are visible to the realign pass.
      for (unsigned t = 0; t < unsigned(THREADS); ++t) {
        threadIdx.x = t;
        if (is_b) realign_b(0u, X, row0, K, kt, stage, rbuf, check_k);
        else realign_a(0u, X, row0, K, kt, stage, rbuf, check_k);
      }
      for (int r = 0; r < TILE_ROWS; ++r) {
        const bool row_ok = row0 + r < rows;
        for (int j = 0; j < RAW_PITCH / 8; ++j) {   // staged blocks: once each for a staged row, never otherwise
          const int got = g_staged[(SMEM_RAW + stage * RAW_STAGE + raw0 + r * RAW_PITCH + 8 * j) / 8];
          if (got != ((row_ok || !row_pred) ? 1 : 0) && bad_counts++ < 5) printf("row %d block %d staged %d times\n", r, j, got);
        }
        for (int kc = 0; kc < BK; kc += 8) {      // realigned chunks: once each
          const int at = tile0 + rbuf * tile_size + swz(r * BK + kc);
          if (g_realigned[at / 8] != 1 && bad_counts++ < 5) printf("row %d chunk %d realigned %d times\n", r, kc, g_realigned[at / 8]);
          if (!row_ok && row_pred) continue;      // stale rows only reach outputs that are never stored
          for (int e = 0; e < 8; ++e) {
            const int k = kt * BK + kc + e;
            unsigned short got; std::memcpy(&got, &g_smem[2 * size_t(at + e)], 2);
            const unsigned want = (row_ok && k < K) ? X[long(row0 + r) * K + k] : 0u;
            if (got != want && wrong++ < 5) printf("row %d k %d: got %u want %u\n", row0 + r, k, got, want);
          }
        }
      }
    }
  printf("wrong %ld bad_counts %ld bad_reads %ld misaligned %ld bad_smem %ld\n", wrong, bad_counts, g_bad_reads,
         g_misaligned, g_bad_smem);
  return wrong || bad_counts || g_bad_reads || g_misaligned || g_bad_smem;
}
"""


def _function(src: str, name: str) -> str:
    start = src.index(f"__device__ __forceinline__ void {name}(")
    return src[start:src.index("\n}\n", start) + 3]


@pytest.mark.parametrize("name", ALIGN1)
def test_align1_staging_runs_right_on_the_host(tmp_path, name):
    import shutil
    import subprocess

    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    kernel, problem = CASES[name]
    src = lower(kernel, problem).source
    constants = "\n".join(line for line in src.splitlines() if line.startswith(("constexpr int", "static_assert")))
    swz = next(line for line in src.splitlines() if line.startswith("__device__ __forceinline__ int swz("))
    raw = next(line for line in src.splitlines() if line.startswith("struct Raw "))
    functions = [swz, raw, *(_function(src, f) for f in ("realign", "copy_a", "copy_b", "realign_a", "realign_b"))]
    cpp = tmp_path / "staging.cpp"
    cpp.write_text(STAGING_HARNESS.replace("@CONSTANTS@", constants).replace("@FUNCTIONS@", "\n".join(functions)))
    exe = tmp_path / "staging"
    subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], check=True, capture_output=True)
    divisible = kernel.pad.k == "divisible"
    shapes = ([(kernel.tile.bm * 2, kernel.tile.bk * 3)] if divisible else
              [(67, 999), (129, 67), (5, 1001), (3, 17), (64, 8), (2, 1), (3, 7), (4, 9), (130, 4097)])
    k_every = "1" if kernel.pad.k == "zero_fill" else "0"
    for rows, k in shapes:
        for base in range(8):
            for is_b in (0, 1):
                tile_rows = kernel.tile.bn if is_b else kernel.tile.bm
                pad_rows = kernel.pad.n if is_b else kernel.pad.m
                rows_ = tile_rows * 2 if pad_rows == "divisible" and rows % tile_rows else rows
                run = subprocess.run([str(exe), str(rows_), str(k), str(base), str(is_b),
                                      "1" if pad_rows == "predicate" else "0", k_every],
                                     capture_output=True, text=True, check=False)
                assert run.returncode == 0, f"{'B' if is_b else 'A'} {rows_}x{k} base +{base}: {run.stdout}"


# Whole kernels on the host (tests/sm80_block_emulation.cpp.in): the generated source with its PTX wrappers swapped
# for exact host models, every block and thread of the grid run, C compared bit for bit with the correctly rounded
# product of small-integer inputs. This checks what the staging test cannot: the pipeline's wait counts, stage and
# buffer indices and barriers, and the split-K tree's slots and counters (two launches on one workspace, blocks in
# launch, reversed and shuffled orders). Aligned kernels run as the emulator's own control.
EMULATED = {name: shapes for name, shapes in {
    "64x64x32_w2x2_s3_splitk4_smem8": [(67, 48, 128), (130, 64, 512)],
    "sm90_64x128x48_s2_noprefetch_splitk3_direct2": [(64, 130, 480), (200, 64, 144)],
    "16x128x64_w1x4_s6_splitk8_direct2_decode": [(17, 130, 1024)],
    "64x64x32_w2x2_s4_align1_splitk2_smem1": [(67, 45, 77), (130, 129, 99)],
    "128x128x32_w2x2_s4_align1_kpredicate_smem1": [(67, 45, 77), (5, 7, 1), (33, 17, 9), (130, 129, 99)],
    "128x128x32_w2x4_s4_align1_smem1": [(130, 129, 99), (3, 5, 7)],
    "sm90a_128x128x64_w2x4_s4_align1_smem1": [(130, 129, 333), (9, 7, 9)],
    "16x128x64_w1x4_s3_align1_splitk4_decode_direct1": [(17, 200, 777), (1, 129, 999)],
    "64x128x32_w2x2_s2_noprefetch_align1_zero_fill_direct1": [(67, 45, 77), (5, 7, 1), (130, 129, 99)],
    "64x128x32_w2x2_s4_align1_divisible_direct1": [(128, 128, 256)],
    "64x128x48_w2x2_s3_align1_kpredicate_smem1": [(67, 130, 101), (5, 7, 1), (65, 129, 49)],
    "64x64x64_w2x2_s2_align1_smem1": [(67, 45, 333), (3, 5, 9)],
    "64x64x32_w2x2_s1_align1_zero_fill_direct1": [(67, 45, 77), (5, 7, 1)],
    "32x128x64_w2x4_s4_align1_splitk3_interleave_direct1": [(17, 999, 333), (33, 130, 300), (1, 8, 129)],
    "16x128x64_w1x4_s3_align1_splitk4_interleave_direct1": [(17, 200, 777), (1, 1029, 999), (5, 9, 251)],
    "64x64x32_w2x2_s2_noprefetch_align1_interleave_smem1": [(67, 45, 77), (5, 7, 1), (130, 129, 99)],
    "64x64x48_w2x2_s1_align1_interleave_direct1": [(67, 130, 101), (3, 5, 9)],
}.items()}
PTX_WRAPPERS = ("cp_async_zfill", "cp_async", "ld_shared_16", "st_shared_16", "ldmatrix_x4", "mma_16816",
                "ld_global_16")


def _host_kernel(src: str, wrappers: tuple[str, ...] = PTX_WRAPPERS) -> str:
    """The generated source with the CUDA headers and the inline-PTX wrappers taken out (the emulator defines them),
    its dynamic shared memory the emulator's."""
    src = "\n".join(line for line in src.splitlines() if not line.startswith("#include <cuda_"))
    for name in wrappers:
        found = re.search(rf"__device__ __forceinline__ \w+ {name}\(", src)
        if found:
            src = src[:found.start()] + src[src.index("\n}\n", found.start()) + 3:]
    src = re.sub(r"__device__ __forceinline__ void cp_async_commit\(\) \{[^\n]*\n", "", src)
    src = re.sub(r"template <int N>\n__device__ __forceinline__ void cp_async_wait\(\) \{\n[^\n]*\n\}\n", "", src)
    # Programmatic dependent launch's griddepcontrol (sm90 device code only): nothing to order on the host.
    src = re.sub(r"#if defined\(__CUDA_ARCH__\) && __CUDA_ARCH__ >= 900\n[^\n]*griddepcontrol[^\n]*\n#endif\n", "",
                 src)
    assert "asm volatile" not in src, "a PTX wrapper the emulator does not model"
    src = src.replace("extern __shared__ float red[];", "float* red = reinterpret_cast<float*>(g_smem.data());")
    return src.replace("extern __shared__ __align__(128) unsigned char smem[];", "unsigned char* smem = g_smem.data();")


@pytest.mark.parametrize("name", list(EMULATED))
def test_kernel_runs_right_on_the_host(tmp_path, name):
    kernel, problem = CASES[name]
    run_on_host(tmp_path, name, kernel, problem, lower(kernel, problem), EMULATED[name], sm80.GEMM_ENTRY)


def run_on_host(tmp_path, name, kernel, problem, plan, shapes, entry, wrappers=PTX_WRAPPERS):
    """Build the emulator around the generated kernel and run it on each shape (every block and thread), with
    operands on and off 16-byte boundaries (pad.align 1) and split-K blocks in several orders: C must be the
    correctly rounded product, guards and counters untouched, no access outside the operands or shared memory."""
    import shutil
    import subprocess

    from l2ir.search.gates import admits

    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    assert problem.a[0] == "f16", "the emulator models f16 inputs"
    (launch,) = plan.launches
    cp = re.search(r"cp\.async\.c[ag]\.shared\.global \[%0\], \[%1\], (\d+)", plan.source)
    assert cp or "cp.async" not in plan.source, "a cp.async form the emulator's CP_BYTES pattern does not match"
    template = (Path(__file__).parent / "sm80_block_emulation.cpp.in").read_text()
    cpp = tmp_path / "emulate.cpp"
    cpp.write_text(f"#define CP_BYTES {cp.group(1) if cp else 16}\n#define KERNEL {entry}\n"
                   + template.replace("// @KERNEL_SOURCE@", _host_kernel(plan.source, wrappers)))
    exe = tmp_path / "emulate"
    subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-o", str(exe), str(cpp)], check=True, capture_output=True)
    # Operand bases 0-7 elements past a 16-byte boundary (align 1 only); split-K blocks in both orders.
    offsets = ((0, 0, 0), (3, 5, 1), (7, 1, 0)) if kernel.pad.align == 1 else ((0, 0, 0), (0, 0, 1))
    for m, n, k in shapes:
        ok, why = admits(kernel, problem.with_shape(m, n, k))
        assert ok, f"{name} at {(m, n, k)}: {why}"
        gx, gy, gz = launch.grid_for(m, n, k)
        assert gy == 1
        for base_a, base_b, order in offsets:
            partials = gx * gz * kernel.tile.bm * kernel.tile.bn * 4 if kernel.splitk else 0
            args = [m, n, k, base_a, base_b, gx, gz, launch.block[0], launch.smem, plan.workspace_for(m, n, k), order,
                    partials]
            run = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, f"{name} at {(m, n, k)} bases +{base_a}/+{base_b}: {run.stdout}{run.stderr}"


@pytest.fixture(scope="module")
def align1_sweep_builds(tmp_path_factory):
    from l2ir.search.sweeps import load_sweep
    sweep = {name: k for name, k in load_sweep("cuda_ptx_sm80").items() if k.pad.align == 1}
    assert len(sweep) >= 5
    odd_k = Problem(m=4096, n=4096, k=4097)
    return build_all({name: lower(k.replace(target=Target("sm90a")), odd_k) for name, k in sweep.items()},
                     tmp_path_factory.mktemp("align1"))


@pytest.mark.nvcc
def test_align1_sweep_builds_without_spills(align1_sweep_builds):
    """The odd-K sweep kernels keep two raw 16-byte blocks per staged chunk in registers: none may spill."""
    for name, result in align1_sweep_builds.items():
        b = built(result, name)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", b.log)
        assert spills and all(s == ("0", "0") for s in spills), f"{name}: register spills {spills}"


# ---------------------------------------------------------------------------------------------------------------
# Refusals: every field this rule does not implement raises, naming the field.
# ---------------------------------------------------------------------------------------------------------------

REFUSALS = [
    ("problem.a", ms(), Problem(m=1, n=1, k=1, a=("f16", "col"))),
    ("problem.b", ms(), Problem(m=1, n=1, k=1, b=("f16", "row"))),
    ("problem.c", ms(), Problem(m=1, n=1, k=1, c=("f32", "row"))),
    ("problem.acc", ms(), Problem(m=1, n=1, k=1, acc="f16")),
    # align 1 fills 8-element register chunks: a 16x32 A tile is 512 elements, not a whole pass of 8 x 128 threads.
    ("pad.align", ms((16, 128, 32), (1, 4), pad=Pad("predicate", "predicate", "zero_fill", 1),
                     epilogue=Epilogue("smem", 1)), PROBLEM),
    ("splitk.reduce", ms(splitk=SplitK("split_k", 2, "atomic")), PROBLEM),
    ("epilogue.vector", ms(epilogue=Epilogue("direct", 8)), PROBLEM),
    ("tile.cluster", ms(arch="sm90", tile=Tile((128, 128, 32), (2, 2), (2, 1))), PROBLEM),
    ("mma.shape", ms(mma=Mma("mma_sync", (16, 8, 8))), PROBLEM),
    ("tile.warps", ms((64, 64, 32), (1, 8)), PROBLEM),
]


@pytest.mark.parametrize("field,kernel,problem", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_field(field, kernel, problem):
    with pytest.raises(UnsupportedLowering) as info:
        lower(kernel, problem)
    assert info.value.field == field
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, L2IRError)
    assert field in str(info.value)


def test_illegal_ir_raises_verify_error():
    with pytest.raises(VerifyError):
        lower(ms(stages=14), PROBLEM)


# ---------------------------------------------------------------------------------------------------------------
# nvcc builds (skip cleanly without nvcc).
# ---------------------------------------------------------------------------------------------------------------

NVCC_CASES = ["128x128x32_w2x2_s4_prefetch_smem8", "64x64x32_w2x2_s3_splitk4_smem8",
              "16x128x64_w1x4_s6_splitk8_direct2_decode", "64x128x32_w2x2_s4_align4_smem4",
              "64x64x32_w2x2_s4_align1_splitk2_smem1", "128x128x32_w2x4_s4_align1_smem1",
              "64x128x32_w2x2_s4_align1_divisible_direct1", "128x128x32_w2x2_s4_align1_kpredicate_smem1",
              "sm90a_128x128x64_w2x4_s4_align1_smem1", "16x128x64_w1x4_s3_align1_splitk4_decode_direct1",
              "64x128x32_w2x2_s2_noprefetch_align1_zero_fill_direct1", "64x128x48_w2x2_s3_align1_kpredicate_smem1",
              "64x64x64_w2x2_s2_align1_smem1", "64x64x32_w2x2_s1_align1_zero_fill_direct1"]


# The new families also as sm90a targets (native sm_90a code, what the search uses on an H200).
SM90A_CASES = {f"sm90a:{name}": (CASES[name][0].replace(target=Target("sm90a")), CASES[name][1])
               for name in NVCC_CASES[2:] if CASES[name][0].target.arch != "sm90a"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    plans = {name: lower(*CASES[name]) for name in NVCC_CASES}
    plans.update({name: lower(*case) for name, case in SM90A_CASES.items()})
    return build_all(plans, tmp_path_factory.mktemp("cache"))


@pytest.mark.nvcc
def test_odd_k_seeds_build(tmp_path):
    """The default lowering of the odd-K seeds compiles, without register spills."""
    results = build_all(_seed_plans(), tmp_path)
    for name, result in results.items():
        b = built(result, name)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", b.log)
        assert spills and all(s == ("0", "0") for s in spills), f"{name}: register spills {spills}"


@pytest.mark.nvcc
@pytest.mark.parametrize("name", NVCC_CASES + list(SM90A_CASES))
def test_nvcc_builds_without_spills(builds, name):
    b = built(builds[name], name)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", b.log)
    assert len(spills) == 1 and all(s == ("0", "0") for s in spills), f"register spills: {spills}"
    assert "warning" not in b.log.lower(), b.log
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", b.log)]
    assert regs and max(regs) <= 255, regs
    if "align1" in name:
        # pad.align=1 reads global memory only with 16-byte cp.async of aligned blocks (the 8x instruction count of
        # 2-byte loads is what made odd-K GEMMs slow) and realigns with 16-byte shared loads and stores.
        ptx = b.ptx()
        assert ptx, "no PTX kept"
        assert not re.search(r"ld\.global\.nc|ld\.global(\.\w+)*\.(u|b|s)16", ptx), "operand loads outside cp.async"
        assert "cp.async.cg.shared.global" in ptx and "ld.shared.v4.b32" in ptx and "st.shared.v4.b32" in ptx
        assert not re.search(r"(?:ld|st)\.local", ptx), "local-memory array"


if __name__ == "__main__":
    GOLDENS.main(sys.argv[1:], __doc__)
