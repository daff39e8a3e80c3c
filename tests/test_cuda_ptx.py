"""backends/cuda_ptx (sm90a rule): golden source, determinism, one test per IR field, the refusals, and nvcc builds.

Regenerate the golden sources after an intended change to the lowering:
    python tests/test_cuda_ptx.py --update-golden
and review the diff of tests/golden/cuda_ptx/ like any other code change.

The nvcc tests build two configurations through backends/compile.py (raw CUDA: about 2 s each); they skip cleanly
without nvcc, and the SASS check skips without cuobjdump/nvdisasm (PATH, or the NVIDIA wheels).
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
from l2ir.backends import registry  # noqa: E402
from l2ir.backends.cuda_ptx import sm90a  # noqa: E402
from l2ir.backends.cuda_ptx.common import UnsupportedLowering  # noqa: E402
from l2ir.target import SMEM_LIMIT  # noqa: E402
from l2ir.runtime import STATUS_BAD_ARGUMENT, STATUS_MISALIGNED  # noqa: E402
from l2ir.errors import L2IRError  # noqa: E402
from l2ir.nodes import (Epilogue, Interleave, Kernel, Mma, Pad, Pipeline, Problem, Repack, SplitK,  # noqa: E402
                        Swizzle, Target, Tile)
from l2ir.analysis import resolved_stages  # noqa: E402

PROBLEM = Problem(m=4096, n=4096, k=4096)


def coop(block=(128, 256, 64), **changes) -> Kernel:
    """Cooperative 2-consumer-warpgroup kernel, wgmma 64 x BN x 16, direct epilogue with half2 stores."""
    k = Kernel(target=Target("sm90a"), tile=Tile(block, (8, 1), (1, 1)), mma=Mma("wgmma", (64, block[1], 16)),
               pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=True),
               swizzle=Swizzle((3, 3, 3), "along_n", 1), pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
               epilogue=Epilogue("direct", 2))
    return k.replace(**changes)


def lat(block=(64, 128, 64), **changes) -> Kernel:
    """Latency-bound family: tile.warps=4x1 (one consumer warpgroup, 256 threads), one tile per block, no cluster."""
    k = Kernel(target=Target("sm90a"), tile=Tile(block, (4, 1), (1, 1)), mma=Mma("wgmma", (64, block[1], 16)),
               pipeline=Pipeline("tma_ws", "auto", "pingpong", persistent=False),
               swizzle=Swizzle((3, 3, 3), "along_n", 1), pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
               epilogue=Epilogue("direct", 2))
    return k.replace(**changes)


CASES: dict[str, tuple[Kernel, Problem]] = {
    "coop_128x256x64_direct": (coop(), PROBLEM),
    "coop_256x128x64_smem8_along_m8": (
        coop((256, 128, 64), epilogue=Epilogue("smem", 8), swizzle=Swizzle((3, 3, 3), "along_m", 8)), PROBLEM),
    "coop_128x128x64_bf16_vec1_nonpersistent": (
        coop((128, 128, 64), epilogue=Epilogue("direct", 1),
             pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False)),
        Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), c=("bf16", "row"))),
    "coop_128x128x128_sw64_divisible_stages3": (
        coop((128, 128, 128), swizzle=Swizzle((2, 3, 3), "along_n", 4), epilogue=Epilogue("smem", 4),
             pad=Pad("divisible", "divisible", "divisible", 8),
             pipeline=Pipeline("tma_ws", 3, "cooperative", persistent=True)), PROBLEM),
    "w4x1_64x128x64_direct": (lat(), PROBLEM),
    "w4x1_64x256x64_smem8_bf16": (lat((64, 256, 64), epilogue=Epilogue("smem", 8)),
                                  Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), c=("bf16", "row"))),
    "w4x1_64x128x64_splitk8": (lat(splitk=SplitK("split_k", 8)), PROBLEM),
    "w4x1_64x128x64_s4_two_per_sm": (lat(pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False)), PROBLEM),
    "coop_128x128x64_splitk3_persistent_smem8": (
        coop((128, 128, 64), splitk=SplitK("split_k", 3), epilogue=Epilogue("smem", 8)), PROBLEM),
    "w4x1_64x64x64_s4_two_per_sm_splitk5": (
        lat((64, 64, 64), pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False), splitk=SplitK("split_k", 5)),
        PROBLEM),
    "w4x1_64x64x64_splitk8_cluster": (lat((64, 64, 64), splitk=SplitK("split_k", 8, "cluster")), PROBLEM),
    "w4x1_64x128x64_s4_two_per_sm_splitk16_cluster": (
        lat(pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False), splitk=SplitK("split_k", 16, "cluster")),
        PROBLEM),
    "coop_128x128x64_splitk4_cluster_nonpersistent": (
        coop((128, 128, 64), pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False),
             splitk=SplitK("split_k", 4, "cluster")), PROBLEM),
    "coop_128x128x64_repack": (coop((128, 128, 64), repack=Repack()), Problem(m=512, n=512, k=4097)),
    "w4x1_64x64x64_s4_two_per_sm_splitk4_repack": (
        lat((64, 64, 64), pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False), splitk=SplitK("split_k", 4),
            repack=Repack()), PROBLEM),
    "w4x1_64x64x64_splitk8_cluster_repack": (
        lat((64, 64, 64), splitk=SplitK("split_k", 8, "cluster"), repack=Repack()), PROBLEM),
    "coop_64x64x64_splitk2_block": (
        coop((64, 64, 64), pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False),
             splitk=SplitK("split_k", 2, "block")), PROBLEM),
    "coop_128x48x64_s4_splitk2_block_bf16": (
        coop((128, 48, 64), pipeline=Pipeline("tma_ws", 4, "cooperative", persistent=False),
             splitk=SplitK("split_k", 2, "block")),
        Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), c=("bf16", "row"))),
    "w4x1_64x64x64_cluster2x4": (lat((64, 64, 64), tile=Tile((64, 64, 64), (4, 1), (2, 4)),
                                     swizzle=Swizzle((3, 3, 3), "along_n", 8)), PROBLEM),
    "w4x1_64x128x64_cluster1x4_divisible": (
        lat(tile=Tile((64, 128, 64), (4, 1), (1, 4)), pad=Pad("divisible", "divisible", "zero_fill", 8)), PROBLEM),
    "coop_128x64x64_cluster2x1_smem8": (
        coop((128, 64, 64), tile=Tile((128, 64, 64), (8, 1), (2, 1)), epilogue=Epilogue("smem", 8),
             pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False)), PROBLEM),
    "coop_128x256x64_tma_store": (coop((128, 256, 64), epilogue=Epilogue("tma", 8)), PROBLEM),
    "w4x1_64x256x64_splitk2_cluster2x1": (
        lat((64, 256, 64), tile=Tile((64, 256, 64), (4, 1), (2, 1)), splitk=SplitK("split_k", 2)), PROBLEM),
    "w4x1_64x256x64_splitk2_cluster2x1_repack": (
        lat((64, 256, 64), tile=Tile((64, 256, 64), (4, 1), (2, 1)), splitk=SplitK("split_k", 2), repack=Repack()),
        PROBLEM),
    "coop_128x128x64_splitk3_cluster1x2": (
        coop((128, 128, 64), tile=Tile((128, 128, 64), (8, 1), (1, 2)), splitk=SplitK("split_k", 3),
             pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False)), PROBLEM),
    "w4x1_64x128x64_s4_two_per_sm_tma_store_bf16": (
        lat(pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False), epilogue=Epilogue("tma", 8)),
        Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), c=("bf16", "row"))),
    # The interleave node's tensor-map form: B's view through TMA, A's stages written by the producer warpgroup's other
    # warps, the k tail zeroed in shared memory, C's last N mod 8 columns dot products of the consumer warps.
    "w4x1_64x128x64_s4_two_per_sm_splitk3_interleave": (
        lat(pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False), splitk=SplitK("split_k", 3),
            pad=Pad("zero_fill", "zero_fill", "zero_fill", 1), epilogue=Epilogue("direct", 1),
            interleave=Interleave()), Problem(m=17, n=9999, k=3333)),
    "w4x1_64x64x128_interleave_bf16": (
        lat((64, 64, 128), pad=Pad("zero_fill", "zero_fill", "zero_fill", 1), epilogue=Epilogue("direct", 1),
            interleave=Interleave()),
        Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), c=("bf16", "row"))),
}


GOLDENS = GoldenSources("cuda_ptx", CASES, __file__)
lower = GOLDENS.lower           # the backend through the registry, the one dispatch (it attaches IR and problem)
test_golden_source, test_deterministic_in_process, test_deterministic_across_processes = GOLDENS.tests()


def test_plan_fields():
    plan = lower(coop(), PROBLEM)
    assert plan.form == "host_shim" and plan.arch == "sm_90a" and not plan.needs_cutlass
    assert plan.launches == () and not plan.zero_workspace and plan.workspace_for(4096, 4096, 4096) == 0
    assert 'extern "C" size_t l2ir_workspace_size(int M, int N, int K)' in plan.source
    assert 'extern "C" int l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,' in plan.source
    assert plan.problem_text == "a=f16:row b=f16:col c=f16:row acc=f32"
    assert plan.ir_text == coop().text()


def test_auto_stages_follow_verify():
    """stages=auto is the verifier's resolution (with epilogue.path=tma, of what this rule's whole-tile staging
    leaves: CUTLASS's TMA epilogue, which the verifier counts by default, double-buffers sub-tiles), and the layout
    fits the sm90 opt-in."""
    for kernel, problem in CASES.values():
        cfg = sm90a.canonicalize(kernel, problem)
        whole_tile = kernel.tile.bm * kernel.tile.bn * 2 if kernel.epilogue.path == "tma" else None
        assert cfg.stages == resolved_stages(kernel, epilogue_bytes=whole_tile)
        assert cfg.layout["total"] <= SMEM_LIMIT["sm90a"]
        assert f"constexpr int STAGES = {cfg.stages};" in sm90a.render(cfg)


def test_descriptor_and_tma_constants():
    """The wgmma descriptor's swizzle mode, stride offset and the TMA swizzle agree with swizzle.smem."""
    for bits, mode, tma, sbo in ((3, 1, "CU_TENSOR_MAP_SWIZZLE_128B", 1024), (2, 2, "CU_TENSOR_MAP_SWIZZLE_64B", 512),
                                 (1, 3, "CU_TENSOR_MAP_SWIZZLE_32B", 256)):
        src = lower(coop(swizzle=Swizzle((bits, 3, 3), "along_n", 1)), PROBLEM).source
        assert f"constexpr uint64_t DESC_SWIZZLE = {mode};" in src
        assert f"constexpr uint64_t DESC_SBO = {sbo} >> 4;" in src
        assert tma in src
        assert f"constexpr int ATOM_K = {8 << bits};" in src


# ---------------------------------------------------------------------------------------------------------------
# Each IR field changes the source (or is refused: see below).
# ---------------------------------------------------------------------------------------------------------------

FIELD_CASES = [
    ("tile.block", coop((128, 128, 64)), PROBLEM, "constexpr int BM = 128, BN = 128, BK = 64;"),
    ("tile.block.k", coop((128, 256, 128), pipeline=Pipeline("tma_ws", 2, "cooperative", persistent=True)), PROBLEM,
     "constexpr int BM = 128, BN = 256, BK = 128;"),
    ("mma.shape", coop((128, 192, 64)), PROBLEM, "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16"),
    ("pipeline.stages", coop(pipeline=Pipeline("tma_ws", 3, "cooperative", persistent=True)), PROBLEM,
     "constexpr int STAGES = 3;"),
    ("pipeline.persistent", coop(pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False)), PROBLEM,
     "for (int pid = blockIdx.x; pid < num_tiles; pid += num_tiles) {"),
    ("swizzle.smem", coop(swizzle=Swizzle((2, 3, 3), "along_n", 1)), PROBLEM, "CU_TENSOR_MAP_SWIZZLE_64B"),
    ("swizzle.smem=none", coop((128, 256, 32), swizzle=Swizzle(None, "along_n", 2)), PROBLEM,
     "swizzle none -> <2,3,3>"),
    ("swizzle.raster", coop(swizzle=Swizzle((3, 3, 3), "along_m", 1)), PROBLEM, "swizzle.raster=along_m group=1"),
    ("swizzle.group", coop(swizzle=Swizzle((3, 3, 3), "along_n", 8)), PROBLEM, "swizzle.raster=along_n group=8"),
    ("pad.m", coop(pad=Pad("divisible", "zero_fill", "zero_fill", 8)), PROBLEM,
     "if (M % BM != 0) return L2IR_STATUS_NOT_DIVISIBLE;"),
    ("pad.n", coop(pad=Pad("zero_fill", "divisible", "zero_fill", 8)), PROBLEM,
     "if (N % BN != 0) return L2IR_STATUS_NOT_DIVISIBLE;"),
    ("pad.k", coop(pad=Pad("zero_fill", "zero_fill", "divisible", 8)), PROBLEM,
     "if (K % BK != 0) return L2IR_STATUS_NOT_DIVISIBLE;"),
    ("epilogue.path", coop(epilogue=Epilogue("smem", 8)), PROBLEM, "// epilogue.path=smem"),
    ("epilogue.path.tma", coop(epilogue=Epilogue("tma", 8)), PROBLEM,
     "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"),
    ("epilogue.vector", coop(epilogue=Epilogue("direct", 1)), PROBLEM, "// epilogue.vector=1"),
    ("epilogue.vector.smem", coop(epilogue=Epilogue("smem", 4)), PROBLEM, "*reinterpret_cast<uint2*>(C"),
    ("problem.dtype", coop(), Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col")),
     "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"),
    ("problem.c", coop(), Problem(m=1, n=1, k=1, c=("bf16", "row")), "using OutT = __nv_bfloat16;"),
    ("repack", coop(repack=Repack()), PROBLEM, "l2ir_cuda_ptx_sm90a_repack<<<blocks, 256, 0,"),
]


@pytest.mark.parametrize("field,kernel,problem,expected", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_field_changes_source(field, kernel, problem, expected):
    GOLDENS.check_field(field, (coop(), PROBLEM), kernel, problem, expected)


def test_divisible_drops_predicates():
    base = lower(coop(), PROBLEM).source
    div = lower(coop(pad=Pad("divisible", "divisible", "zero_fill", 8)), PROBLEM).source
    assert "if (row < M && col < N)" in base
    assert "if (row < M" not in div and "*reinterpret_cast<Out2T*>(dst) = pack2(v0, v1);" in div


def test_one_consumer_warpgroup_family():
    """tile.warps=4x1 (pingpong, one tile per block) renders one consumer warpgroup in a 256-thread block, with no
    register hand-over (REG_BUDGET); 8x1 keeps two consumers, 384 threads and the 40/232 split."""
    one = sm90a.canonicalize(lat(), PROBLEM)
    two = sm90a.canonicalize(coop(), PROBLEM)
    assert (one.consumer_wgs, one.threads, one.wg_m, one.slabs) == (1, 256, 64, 1)
    assert (two.consumer_wgs, two.threads) == (2, 384)
    src1, src2 = sm90a.render(one), sm90a.render(two)
    assert "constexpr int CONSUMER_WGS = 1;" in src1 and "constexpr int CONSUMER_WGS = 2;" in src2
    assert "setmaxnreg.dec.sync.aligned.u32 40;" in src1 and "setmaxnreg.inc" not in src1
    assert "setmaxnreg.inc.sync.aligned.u32 232;" in src2
    assert "pid += num_tiles" in src1 and "const int grid = int(num_tiles);" in src1
    # BM=128 on one warpgroup: two 64-row slabs.
    assert sm90a.canonicalize(lat((128, 128, 64)), PROBLEM).slabs == 2
    assert "__launch_bounds__(THREADS, 1)" in src1 and one.blocks_per_sm == 1   # stages=auto fills the SM


def test_two_blocks_per_sm_when_the_ring_leaves_room():
    """A 4x1 ring of at most half the SM's shared memory (explicit stages) promises two blocks per SM: launch bounds
    (THREADS, 2) and the 40/216 register split of a 32K-register pool; BN > 128 (one wgmma's 128 accumulators do not
    fit the 128-register cap) and the cooperative kernel stay at one."""
    def cfg(kernel):
        return sm90a.canonicalize(kernel, PROBLEM)

    def staged(block, stages, **kw):
        return lat(block, pipeline=Pipeline("tma_ws", stages, "pingpong", persistent=False), **kw)

    two = cfg(staged((64, 128, 64), 4))
    assert two.blocks_per_sm == 2 and two.regs == (40, 216)
    assert 2 * (two.layout["total"] + 1024) <= SMEM_LIMIT["sm90a"] + 1024
    src = sm90a.render(two)
    assert "__launch_bounds__(THREADS, 2)" in src and "setmaxnreg.inc.sync.aligned.u32 216;" in src
    assert "cudaSharedmemCarveoutMaxShared" in src and "cudaSharedmemCarveoutMaxShared" not in sm90a.render(
        cfg(staged((64, 128, 64), 5)))
    assert cfg(staged((64, 128, 64), 5)).blocks_per_sm == 1          # 5 x 24 KB: no room for a second ring
    assert cfg(staged((64, 256, 64), 2)).blocks_per_sm == 1          # BN = 256
    assert cfg(coop(pipeline=Pipeline("tma_ws", 2, "cooperative", persistent=True))).blocks_per_sm == 1
    assert cfg(staged((64, 128, 64), 4, splitk=SplitK("split_k", 4))).reduce_chunk == 8


@pytest.mark.parametrize("name", list(CASES))
def test_short_prologue(name):
    """One thread prefetches the tensor maps (A, B, and C with epilogue.path=tma) before it initializes the barriers
    (the descriptor fetch overlaps the setup); one block-wide barrier in the whole kernel; the host shim encodes
    tensor maps only on a cache miss."""
    kernel, problem = CASES[name]
    src = lower(kernel, problem).source
    kernel_src = src[src.index("__launch_bounds__"):src.index("// ---- trusted host code")]
    assert kernel_src.count("__syncthreads()") == 1
    # (interleave: B's map alone; A's stages are written from plain loads)
    assert kernel_src.count("prefetch.tensormap") == (3 if kernel.epilogue.path == "tma" else
                                                      1 if kernel.interleave is not None else 2)
    assert kernel_src.index("prefetch.tensormap") < kernel_src.index("mbar_init(")
    host = src[src.index('extern "C" int l2ir_run'):]
    assert "thread_local MapCache cache_" in host and "encode_operand" not in host
    a_box, b_box = ("A_BOX_ROWS", "B_BOX_ROWS") if "CLUSTER_SIZE" in src else ("BM", "BN")   # tile.cluster: shares
    if kernel.interleave is not None:        # B's view of pitch VIEW * K; A is not a tensor map
        assert ("thread_local MapCache cache_b;" in host and "cache_a" not in host
                and "operand_map(cache_b, b_read, N / VIEW, view_pitch, view_pitch, BN)" in host)
    else:
        assert "thread_local MapCache cache_a, cache_b;" in host
        assert (f"operand_map(cache_a, a_read, M, K, lda, {a_box})" in host
                and f"operand_map(cache_b, b_read, N, K, ldb, {b_box})" in host)
    helper = src[src.index("const CUtensorMap* operand_map("):src.index('extern "C" int l2ir_run')]
    assert helper.index("return &cache.map;") < helper.index("encode_operand(")   # the hit returns before encoding
    if kernel.epilogue.path == "tma":
        assert "output_map(cache_c, C, M, N)" in host
        out = src[src.index("const CUtensorMap* output_map("):]
        assert out.index("return &cache.map;") < out.index("encode_output(")


def test_splitk_renders_the_pairwise_tree_reduction():
    """split_k reduce=workspace: slice ranges from l2ir.indexing.splitk_range; the tree's sibling, counter and merged
    slot rendered from l2ir.indexing.SplitKTree; per level a partial store, a release fence, the pair counter (reset by
    its last arrival), an acquire fence, the sibling's slot added; the workspace is tiles x (slices x BM x BN fp32 +
    (slices - 1) counters), zeroed once. Without splitk none of it is rendered and no workspace is asked for."""
    from l2ir.indexing import SplitKTree, splitk_range

    plan = lower(lat(splitk=SplitK("split_k", 8)), PROBLEM)
    src = plan.source
    begin, end = splitk_range(8)
    tree = SplitKTree(8)
    assert f"const int kt_begin = {begin.to_cpp()};" in src and f"const int kt_end = {end.to_cpp()};" in src
    assert "for (int kt = kt_begin; kt < kt_end; ++kt) {" in src
    assert "(kt > kt_begin || kk > 0) ? 1u : 0u" in src
    assert "constexpr int SLICES = 8;" in src and "const int grid = int(num_units);" in src
    # One unit per block, in a loop the compiler sees end after one pass (nothing of a next pass stays live).
    assert "for (int unit = blockIdx.x; unit < num_units; unit = num_units) {" in src
    assert "constexpr int TREE_LEVELS = 3;" in src and "constexpr int TREE_NODES = 7;" in src
    kernel_src = src[src.index("__launch_bounds__"):src.index("// ---- trusted host code")]
    order = ["int base = slice;", "for (int level = 0; level < TREE_LEVELS; ++level) {",
             f"const int sibling = {tree.sibling.to_cpp()};", "if (sibling >= SLICES) continue;",
             "__stcg(mine", "__threadfence();", f"const int node = {tree.counter.to_cpp()};",
             "atomicAdd(tile_counters + node, 1u) == 1u", "if (last) __threadfence();",
             "if (last) tile_counters[node] = 0u;", "{ carries = false; break; }", "__threadfence();",
             "__ldcg(src", f"base = {tree.merged.to_cpp()};", "if (!carries) continue;", "pack2("]
    positions, at = [], 0
    for x in order:     # each in turn, after the previous one
        at = kernel_src.index(x, at)
        positions.append(at)
    assert "tile_ws + (size_t)sibling * PARTIAL_FLOATS" in kernel_src
    assert "tile_ws + (size_t)base * PARTIAL_FLOATS" in kernel_src
    assert "for (int s = 0; s < SLICES; ++s)" not in kernel_src      # no serial pass over the slices
    assert plan.zero_workspace
    for m, n, k in ((64, 1024, 16384), (100, 3000, 4104), (1, 1, 8)):
        tiles = -(-m // 64) * -(-n // 128)
        assert plan.workspace_for(m, n, k) == tiles * (8 * 64 * 128 * 4 + 7 * 4)
    assert lower(lat(splitk=SplitK("split_k", 3)), PROBLEM).workspace_for(64, 128, 1) == 3 * 64 * 128 * 4 + 2 * 4
    plain = lower(lat(), PROBLEM)
    assert not plain.zero_workspace and plain.workspace_for(64, 1024, 16384) == 0
    assert "atomicAdd" not in plain.source and "kt_begin" not in plain.source and "TREE_" not in plain.source
    # Persistent split-K walks (tile, slice) units over a grid of at most NUM_SMS blocks.
    coop_src = lower(coop(splitk=SplitK("split_k", 3)), PROBLEM).source
    assert "for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {" in coop_src
    assert "const int grid = num_units < NUM_SMS ? int(num_units) : NUM_SMS;" in coop_src


def test_splitk_cluster_renders_the_cluster_reduction():
    """split_k reduce=cluster: one cluster of SLICES consecutive blocks per tile (slice = rank); every thread arrives
    (relaxed) at the entry's cluster barrier after the receive mbarrier's init and waits for it once, the consumers
    only after their last wgmma. Each consumer arms its block's receive barrier with ClusterReduce.receive_bytes,
    pushes the units other blocks own (l2ir.indexing.ClusterReduce.owner) with st.async at
    ClusterReduce.receive_vec, waits for its own barrier at cluster scope, adds the units it owns in slice order
    (its own from registers, the others' from the buffer at the same receive_vec) and the epilogue stores them (the
    same owner expression). No release, no second barrier, no DSMEM load; no workspace, counters, fences to global
    memory or atomics; the launch carries the cluster dimension, and above 8 blocks the non-portable opt-in."""
    from l2ir.indexing import ClusterReduce

    plan = lower(lat((64, 64, 64), splitk=SplitK("split_k", 8, "cluster")), PROBLEM)
    src = plan.source
    cr = ClusterReduce(8)
    owner, unit = cr.owner.to_cpp(), ClusterReduce.unit(64).to_cpp()
    vec, expected = cr.receive_vec(8, 128).to_cpp(), cr.receive_bytes(8, 128).to_cpp()
    assert "const int pid = unit / SLICES;" in src and "const int slice = unit % SLICES;" in src
    kernel_src = src[src.index("__launch_bounds__"):src.index("// ---- trusted host code")]
    entry = kernel_src[:kernel_src.index("// ---- producer warpgroup")]
    order = ["mbar_init(bars_recv, 1);", "fence.mbarrier_init.release.cluster;", "__syncthreads();",
             "cluster_arrive_relaxed();"]
    at = 0
    for x in order:
        at = entry.index(x, at) + 1
    consumer = kernel_src[kernel_src.index("// ---- consumer warpgroups"):]
    order = ["wgmma_wait<0>();", f"if (ct == 0) mbar_arrive_expect_tx(bars_recv, {expected});", "cluster_wait();",
             "const int sender = slice;", f"const int fragment = {unit};", f"const int owner = {owner};",
             "if (owner == sender) continue;", f"smem_base + SMEM_RECV + (uint32_t)({vec}) * 16u",
             "st_async_f4(cluster_map(local, owner),", "cluster_map(bars_recv, owner));",
             "mbar_wait_cluster(bars_recv, 0);", "const int owner = slice;", f"const int fragment = {unit};",
             f"if ({owner} != slice) continue;", "for (int sender = 0; sender < SLICES; ++sender)",
             f": recv[{vec}];", "if (sender == 0) sum = v;", f"const int fragment = {unit};",
             f"if ({owner} != slice) continue;", "pack2("]
    at = 0
    for x in order:     # each in turn, after the previous one
        at = consumer.index(x, at) + 1
    assert consumer.count("cluster_wait();") == 1 and "cluster_arrive" not in consumer
    producer = kernel_src[kernel_src.index("// ---- producer warpgroup"):kernel_src.index("// ---- consumer warpgroups")]
    assert producer.count("cluster_wait();") == 1 and "cluster_arrive" not in producer
    assert "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64" in src
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32" in src
    for absent in ("atomicAdd", "__threadfence", "TREE_", "__stcg", "__ldcg", "float* __restrict__ ws",
                   "barrier.cluster.arrive.release", "ld.shared::cluster", "fence.acq_rel", "PARTIAL_FLOATS"):
        assert absent not in src, absent
    assert not plan.zero_workspace and plan.workspace_for(64, 1024, 16384) == 0
    assert "attr[num_attrs].val.clusterDim.x = SLICES;" in src and "cudaLaunchKernelEx(&config" in src
    assert "NonPortableClusterSize" not in src
    assert "cudaFuncAttributeNonPortableClusterSizeAllowed, 1" in lower(
        lat((64, 64, 64), splitk=SplitK("split_k", 16, "cluster")), PROBLEM).source


def test_splitk_block_renders_the_block_reduction():
    """split_k reduce=block: one block per tile (the grid is the tiles), each empty barrier counted by one
    warpgroup's 4 warps, the producer loading ring position p's k tile (BlockSplit.k_tile) and each consumer reading
    its step-th tile at BlockSplit.position, over all BM rows. After both warpgroups' last wgmma: a barrier of the
    consumer threads, the units the other warpgroup owns stored over the ring, a second barrier, the owned units'
    other half added, the owned units stored. No workspace, cluster, fence to global memory or atomic."""
    from l2ir.indexing import BlockSplit, ClusterReduce

    plan = lower(coop((64, 64, 64), pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=False),
                      splitk=SplitK("split_k", 2, "block")), PROBLEM)
    src = plan.source
    kernel_src = src[src.index("__launch_bounds__"):src.index("// ---- trusted host code")]
    producer = kernel_src[kernel_src.index("// ---- producer warpgroup"):kernel_src.index("// ---- consumer warpgroups")]
    consumer = kernel_src[kernel_src.index("// ---- consumer warpgroups"):]
    assert "mbar_init(bars + 8 * (STAGES + s), 4);" in kernel_src
    assert f"const int kt = {BlockSplit.k_tile().to_cpp()};" in producer
    assert "for (int position = 0; position < k_tiles; ++position) {" in producer
    assert f"const int position = {BlockSplit.position().to_cpp()};" in consumer
    assert "stage * A_STAGE_BYTES;   // all BM rows" in consumer and "cw * WG_M" not in consumer
    owner, unit = ClusterReduce(2).owner.to_cpp(), ClusterReduce.unit(64).to_cpp()
    order = ["wgmma_wait<0>();", 'asm volatile("bar.sync 3, %0;"', "fence.proxy.async.shared::cta;",
             f"const int fragment = {unit};", f"if ({owner} == slice) continue;", "share[(fragment / SLICES) * 128] =",
             'asm volatile("bar.sync 3, %0;"', f"if ({owner} != slice) continue;",
             "other[(fragment / SLICES) * 128];", f"if ({owner} != slice) continue;", "pack2("]
    at = 0
    for x in order:     # each in turn, after the previous one
        at = consumer.index(x, at) + 1
    # The occupancy query at the end of the library counts single blocks (clusters of 1); the kernel and its
    # launch use no cluster.
    query = src.index('extern "C" int l2ir_max_active_clusters')
    assert "attr[0].val.clusterDim.x = 1;" in src[query:]
    for absent in ("atomicAdd", "__threadfence", "TREE_", "__stcg", "__ldcg", "float* __restrict__ ws", "cluster_",
                   "clusterDim"):
        assert absent not in src[:query], absent
    assert "const int grid = int(num_tiles);" in src
    assert not plan.zero_workspace and plan.workspace_for(64, 1024, 16384) == 0


def test_splitk_cluster_receive_buffer_counts_in_the_smem_budget():
    """reduce=cluster keeps a receive buffer beside the ring ((slices - 1) x the units a block owns, per consumer
    thread: l2ir.analysis.cluster_receive_bytes): the backend's layout reserves exactly that after the barriers,
    `auto` stages fill only what it leaves, and explicit stages that do not fit beside it are the verifier's
    ResourceError naming the buffer, not a kernel that writes past its shared memory."""
    from l2ir.analysis import cluster_receive_bytes, resolved_stages
    from l2ir.errors import ResourceError
    from l2ir.target import SMEM_LIMIT

    def kernel(stages, slices):
        return coop((128, 256, 64), pipeline=Pipeline("tma_ws", stages, "cooperative", persistent=False),
                    splitk=SplitK("split_k", slices, "cluster"))

    # 2 consumer warpgroups x 32 units a thread; 16 slices: each block owns 2 units of each of 15 others
    assert cluster_receive_bytes(kernel(2, 16)) == 15 * 2 * 256 * 16 + 16     # + the mbarrier and alignment
    cfg = sm90a.canonicalize(kernel(2, 16), PROBLEM)
    assert cfg.receive_bytes + 16 == cluster_receive_bytes(kernel(2, 16))
    assert cfg.layout["recv"] + cfg.receive_bytes <= cfg.layout["recv_bar"] + cluster_receive_bytes(kernel(2, 16))
    assert cfg.layout["recv"] % 16 == 0 and cfg.layout["total"] == cfg.layout["recv"] + cfg.receive_bytes
    assert cfg.layout["total"] <= SMEM_LIMIT["sm90a"]
    auto = kernel("auto", 16)
    assert resolved_stages(auto) == 2 and resolved_stages(kernel("auto", 2)) == 3
    lower(auto, PROBLEM)
    with pytest.raises(ResourceError, match="receive buffer"):
        lower(kernel(3, 16), PROBLEM)
    lower(kernel(3, 2), PROBLEM)


@pytest.mark.parametrize("block,stages,chunk", [
    ((64, 128, 64), "auto", 16),   # 16 float4 per thread, 64 accumulators, one block per SM: all in flight
    ((64, 64, 64), 4, 8),          # 8 float4: all of them
    ((64, 96, 64), 4, 6),          # 12 float4, two blocks per SM: the largest divisor up to 8
    ((64, 192, 64), "auto", 12),   # 24 float4, one block per SM: the largest divisor up to 16
    ((64, 256, 64), "auto", 16),   # 32 float4: two chunks of 16
])
def test_reduce_chunk_divides_the_float4s(block, stages, chunk):
    """The tree's sibling reads go in chunks that divide the thread's float4 count (no chunk reads past the fragment);
    the nvcc tests check that they leave the accumulators their registers (no spills)."""
    cfg = sm90a.canonicalize(lat(block, splitk=SplitK("split_k", 4),
                                 pipeline=Pipeline("tma_ws", stages, "pingpong", persistent=False)), PROBLEM)
    assert cfg.reduce_chunk == chunk
    assert f"constexpr int CHUNK = {chunk};" in sm90a.render(cfg)


def test_splitk_family_computes_matmul_in_the_interpreter():
    """The reference interpreter runs the split-K schedule (partials per slice, the pairwise tree, each C element
    written once) and equals A @ B, at an aligned and a ragged shape."""
    from l2ir.testing import assert_computes_matmul

    for problem in (Problem(m=64, n=256, k=1024), Problem(m=100, n=296, k=1000)):
        assert_computes_matmul(lat(splitk=SplitK("split_k", 4)), problem)
        assert_computes_matmul(lat((64, 64, 64)), problem)


def test_generated_wgmma_kernels_lower_or_name_the_field():
    """Every legal wgmma kernel Hypothesis draws (l2ir.testing) either lowers here or is refused with the
    UnsupportedLowering of the field it does not implement: never another error."""
    from hypothesis import given, settings

    from l2ir.testing import wgmma_kernels

    @settings(max_examples=200, database=None, derandomize=True)
    @given(wgmma_kernels())
    def check(kernel):
        try:
            lower(kernel, PROBLEM)
        except UnsupportedLowering as e:
            assert e.field and e.field in str(e)

    check()


def _family_kernels():
    """The space of the two families this rule generates: 8x1 cooperative and 4x1 one-warpgroup tiles, BN 64..256,
    BK 64/128, any swizzle that fits, persistent or not (4x1: not), split-K 2..16 or none, both epilogues, every pad."""
    from hypothesis import assume, strategies as st

    from l2ir.verify import verify

    @st.composite
    def draw(d):
        wgs = d(st.sampled_from([1, 2]))
        bm = d(st.sampled_from([64 * wgs, 128 * wgs] if wgs == 1 else [128, 256]))
        bn = d(st.sampled_from([64, 96, 128, 192, 256]))
        bk = d(st.sampled_from([64, 128]))
        epi = d(st.sampled_from([("direct", 1), ("direct", 2), ("smem", 8), ("smem", 4)]))
        splitk = d(st.one_of(st.none(), st.integers(2, 16).map(lambda s: SplitK("split_k", s))))
        pad = d(st.sampled_from(["zero_fill", "divisible"]))
        kernel = Kernel(
            target=Target("sm90a"), tile=Tile((bm, bn, bk), (4 * wgs, 1), (1, 1)), mma=Mma("wgmma", (64, bn, 16)),
            pipeline=Pipeline("tma_ws", d(st.sampled_from(["auto", 2, 3])), "cooperative" if wgs == 2 else "pingpong",
                              persistent=wgs == 2 and d(st.booleans())),
            swizzle=Swizzle(d(st.sampled_from([(3, 3, 3), (2, 3, 3), None])), d(st.sampled_from(["along_n", "along_m"])),
                            d(st.sampled_from([1, 2, 8]))),
            pad=Pad(pad, d(st.sampled_from(["zero_fill", "divisible"])), "zero_fill", 8),
            splitk=splitk, epilogue=Epilogue(*epi))
        try:
            return verify(kernel)
        except L2IRError:
            assume(False)

    return draw()


def test_every_legal_kernel_of_the_families_lowers():
    """Hypothesis over the families' space: every legal kernel lowers (no refusal), deterministically, with one or
    two consumer warpgroups as tile.warps says, a workspace exactly when split-K needs one (zeroed once), the
    runtime's status codes, and a layout that fits shared memory."""
    from hypothesis import given, settings

    from l2ir import runtime

    @settings(max_examples=120, database=None, derandomize=True)
    @given(_family_kernels())
    def check(kernel):
        plan = lower(kernel, PROBLEM)
        assert plan.source == lower(kernel, PROBLEM).source and plan.ir_text == kernel.text()
        for name, code in re.findall(r"constexpr int L2IR_STATUS_(\w+) = (\d+);", plan.source):
            assert int(code) == getattr(runtime, f"STATUS_{name}"), name
        cfg = sm90a.canonicalize(kernel, PROBLEM)
        assert cfg.consumer_wgs == kernel.tile.warps[0] // 4 and cfg.threads == 128 * (1 + cfg.consumer_wgs)
        assert f"constexpr int CONSUMER_WGS = {cfg.consumer_wgs};" in plan.source
        split = kernel.splitk is not None
        assert plan.zero_workspace == split == (plan.workspace_for(1000, 1000, 1000) > 0)
        assert ("atomicAdd(tile_counters + node, 1u)" in plan.source) == split
        assert cfg.layout["total"] <= SMEM_LIMIT["sm90a"]

    check()


def test_grid_is_explicit_sm_count():
    assert "constexpr int NUM_SMS = 132;" in lower(coop(), PROBLEM).source
    assert "constexpr int NUM_SMS = 114;" in lower(coop(), PROBLEM, num_sms=114).source


def test_repack_renders_the_copy_and_reads_it():
    """repack: the copy kernel's stores and loads and the shim's offsets are l2ir.indexing.Repack's expressions;
    the GEMM's tensor maps read the copy with its pitch; the plan's workspace is the copies' bytes and nothing on an
    aligned K; other backends refuse the node, and the registry makes cuda_ptx its default."""
    from l2ir.indexing import Repack as RepackLayout, Var

    kernel, problem = CASES["coop_128x128x64_repack"]
    plan = lower(kernel, problem)
    rp = RepackLayout()
    assert f"dst + {RepackLayout.dst().to_cpp()}" in plan.source
    assert f"src[{RepackLayout.src().to_cpp()}]" in plan.source
    assert f"ws_elems + ({rp.offset('A').to_cpp()})" in plan.source and rp.offset("B").to_cpp() == "0"
    for expr in (RepackLayout.chunk_row(), RepackLayout.chunk_col(), RepackLayout.chunks(Var("m"), Var("k"))):
        assert expr.to_cpp() in plan.source
    assert "operand_map(cache_a, a_read, M, K, lda, BM)" in plan.source
    assert "cuuint64_t(ld) * sizeof(InT)" in plan.source
    # Programmatic dependent launch: the copy lets the GEMM start early, the GEMM's producer waits for the copy
    # before its first TMA load. Every GEMM launch asks for it (L2IR_PDL), with or without a copy before it: a kernel
    # without repack waits the same way on whatever the stream ran before, and triggers nothing itself.
    src = plan.source
    assert src.index("griddepcontrol.launch_dependents") > src.index("l2ir_cuda_ptx_sm90a_repack(")
    producer = src[src.index("// ---- producer warpgroup"):]
    assert producer.index("griddepcontrol.wait") < producer.index("tma_load_2d(")
    assert "#if L2IR_PDL\n  // Programmatic dependent launch" in src
    plain = lower(coop((128, 128, 64)), problem).source
    plain_producer = plain[plain.index("// ---- producer warpgroup"):]
    assert plain_producer.index("griddepcontrol.wait") < plain_producer.index("tma_load_2d(")
    assert "programmaticStreamSerializationAllowed = 1" in plain
    assert 'asm volatile("griddepcontrol.launch_dependents' not in plain
    for m, n, k in ((512, 512, 4097), (1, 1, 1), (4096, 1001, 4096), (1023, 1025, 1027)):
        pitch = -(-k // 8) * 8
        copies = 0 if k % 8 == 0 else (-(-m * pitch // 64) + -(-n * pitch // 64)) * 64 * 2
        assert plan.workspace_for(m, n, k) == copies, (m, n, k)
    assert not plan.zero_workspace
    # The split-K tree's workspace follows the copies, 128-byte aligned.
    tree = lower(*CASES["w4x1_64x64x64_s4_two_per_sm_splitk4_repack"])
    plain = lower(lat((64, 64, 64), pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False),
                      splitk=SplitK("split_k", 4)), PROBLEM)
    for m, n, k in ((64, 1024, 16383), (100, 3000, 4104)):
        copies = 0 if k % 8 == 0 else sum(-(-rows * (-(-k // 8) * 8) // 64) * 64 * 2 for rows in (m, n))
        assert tree.workspace_for(m, n, k) == copies + plain.workspace_for(m, n, k)
    assert tree.zero_workspace
    assert registry.backend_for(kernel).name == "cuda_ptx"
    with pytest.raises(NotImplementedError, match="repack"):
        registry.backend_for(kernel, "cutlass_sm90")


# ---------------------------------------------------------------------------------------------------------------
# Refusals: every field this rule does not implement raises, naming the field.
# ---------------------------------------------------------------------------------------------------------------

REFUSALS = [
    ("tile.cluster", coop(tile=Tile((128, 256, 64), (8, 1), (2, 1))), PROBLEM),      # persistent
    ("tile.cluster", lat((64, 56, 64), tile=Tile((64, 56, 64), (4, 1), (2, 1))), PROBLEM),   # B shares of 28 rows
    ("tile.cluster", coop(tile=Tile((128, 256, 64), (8, 1), (1, 2)), splitk=SplitK("split_k", 4)), PROBLEM),  # persistent
    ("splitk", coop(splitk=SplitK("stream_k")), PROBLEM),
    ("splitk", coop(splitk=SplitK("split_k", 2, "atomic")), PROBLEM),
    ("epilogue.path", lat(splitk=SplitK("split_k", 4, "cluster"), epilogue=Epilogue("smem", 8)), PROBLEM),
    ("pipeline.schedule", coop((128, 128, 64), tile=Tile((128, 128, 64), (4, 1), (1, 1)),
                               pipeline=Pipeline("tma_ws", "auto", "pingpong", persistent=True)), PROBLEM),
    ("epilogue.path", coop((128, 96, 64), epilogue=Epilogue("tma", 8)), PROBLEM),          # BN not whole boxes
    ("epilogue.vector", coop(epilogue=Epilogue("tma", 4)), PROBLEM),                       # TMA moves 16 B units
    ("epilogue.path", lat(splitk=SplitK("split_k", 4), epilogue=Epilogue("tma", 8)), PROBLEM),
    ("epilogue.vector", coop(epilogue=Epilogue("direct", 8)), PROBLEM),
    ("problem.a", coop(), Problem(m=1, n=1, k=1, a=("f16", "col"))),
    ("problem.b", coop(), Problem(m=1, n=1, k=1, b=("f16", "row"))),
    ("problem.c", coop(), Problem(m=1, n=1, k=1, c=("f32", "row"))),
    ("problem.acc", coop(), Problem(m=1, n=1, k=1, acc="f16")),
    ("swizzle.smem", coop((128, 256, 96), pipeline=Pipeline("tma_ws", 2, "cooperative", persistent=True)), PROBLEM),
    ("repack.operands", coop(repack=Repack("a")), PROBLEM),
    ("repack.operands", coop(repack=Repack("b")), PROBLEM),
]


def test_other_backends_refuse_repack():
    """Only the cuda_ptx sm90a rule generates the copy; the others name the node rather than ignore it."""
    from l2ir.backends import cutlass_sm90
    from l2ir.backends.cuda_ptx import sm80
    from l2ir.backends.cute_sm80 import config as cute_config

    sm80_kernel = Kernel(target=Target("sm80"), tile=Tile((128, 128, 32), (2, 2)), mma=Mma("mma_sync", (16, 8, 16)),
                         pipeline=Pipeline("multistage", 3), pad=Pad(), epilogue=Epilogue("smem", 8), repack=Repack())
    for fn, kernel in ((cutlass_sm90.canonicalize, coop(repack=Repack())), (sm80.canonicalize, sm80_kernel),
                       (cute_config.derive, sm80_kernel)):
        with pytest.raises(NotImplementedError) as info:
            fn(kernel, PROBLEM)
        assert getattr(info.value, "field", "repack") == "repack" and "repack" in str(info.value)


def test_tma_store_tile_leaving_one_stage_is_refused():
    """128x256x128 with epilogue.path=tma: the whole-tile staging (64 KB) leaves room for one 96 KB stage, and a
    one-stage ring deadlocks (a stage is released only after the next is waited on): a ResourceError, not a kernel."""
    from l2ir.errors import ResourceError

    with pytest.raises(ResourceError, match="at least 2"):
        lower(coop((128, 256, 128), epilogue=Epilogue("tma", 8)), PROBLEM)


@pytest.mark.parametrize("field,kernel,problem", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_field(field, kernel, problem):
    with pytest.raises(UnsupportedLowering) as info:
        lower(kernel, problem)
    assert info.value.field == field
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, L2IRError)
    assert field in str(info.value)


def test_dispatch_by_schedule():
    """The registry is the only dispatch: mma.sync + cp.async kernels go to the sm80 rule's entry on every target,
    wgmma to the sm90a rule's; the sm90a entry refuses the others, and the rule itself refuses a Source kernel
    naming the field."""
    from l2ir.indexing import Const
    from l2ir.nodes import Source

    k = Kernel(target=Target("sm80"), tile=Tile((128, 128, 32), (2, 2)), mma=Mma("mma_sync", (16, 8, 16)),
               pipeline=Pipeline("multistage", 3), pad=Pad(), epilogue=Epilogue("smem", 8))
    for kernel in (k, k.replace(target=Target("sm90a"))):
        assert registry.backend_for(kernel, "cuda_ptx_sm80").module == "l2ir.backends.cuda_ptx.sm80"
        with pytest.raises(NotImplementedError, match="backend 'cuda_ptx' does not lower this kernel"):
            lower(kernel, PROBLEM)
    assert registry.backend_for(coop(), "cuda_ptx").module == "l2ir.backends.cuda_ptx.sm90a"
    src = Kernel(target=Target("sm90a"), source=Source("k", (Const(1),) * 3, (32, 1, 1), 0, "__global__ void k(){}"))
    with pytest.raises(UnsupportedLowering) as info:
        sm90a.lower(src, PROBLEM)
    assert info.value.field == "source"


def test_illegal_ir_raises_verify_error():
    from l2ir.errors import VerifyError
    with pytest.raises(VerifyError):
        lower(coop(mma=Mma("wgmma", (64, 128, 16))), PROBLEM)   # BN=256 but wgmma N=128


# ---------------------------------------------------------------------------------------------------------------
# nvcc builds (skip cleanly without nvcc).
# ---------------------------------------------------------------------------------------------------------------

def test_multicast_renders_shares_and_remote_releases():
    """tile.cluster=2x4: grid of whole clusters (ClusterMulticast.clusters) launched with the cluster dimension;
    the tile map, shares and masks rendered from l2ir.indexing; each k block loads A_BOX_ROWS of A and B_BOX_ROWS
    of B with .multicast::cluster; the empty barriers count every consumer warp of the row and column and are
    released at addresses mapped once (mapa) before the k loop; one cluster barrier, after setup, with a relaxed
    arrival; before the block exits its producer thread waits out one more pass over the ring (no cluster barrier
    at the exit, whose release would fence the C stores and hold every warp for the slowest block); blocks past
    the grid skip the epilogue."""
    from l2ir.indexing import ClusterMulticast

    kernel, problem = CASES["w4x1_64x64x64_cluster2x4"]
    src = lower(kernel, problem).source
    mc = ClusterMulticast(2, 4)
    tm, tn = mc.tile("along_n", 8)
    for line in ("constexpr int CLUSTER_M = 2, CLUSTER_N = 4;", "constexpr int A_BOX_ROWS = BM / CLUSTER_N;",
                 "constexpr int B_BOX_ROWS = BN / CLUSTER_M;", "constexpr uint32_t EMPTY_ARRIVALS = 20;",
                 f"const int num_blocks = CLUSTER_SIZE * {mc.clusters().to_cpp()};",
                 f"const int a_first = {mc.a_first(64).to_cpp()};", f"const uint16_t a_mask = {mc.a_mask().to_cpp()};",
                 f"const int b_first = {mc.b_first(64).to_cpp()};", f"const uint16_t b_mask = {mc.b_mask().to_cpp()};",
                 f"const uint32_t release_mask = {mc.release_mask().to_cpp()};",
                 f"const int tile_m = {tm.to_cpp()};", f"const int tile_n = {tn.to_cpp()};",
                 "tma_load_2d_multicast(smem_base + SMEM_A + stage * A_STAGE_BYTES + kb * A_KBLOCK_BYTES + a_first * "
                 "ROW_BYTES, &tmap_a, full, k0,", "tile_m * BM + a_first, a_mask);", "tile_n * BN + b_first, b_mask);",
                 "mbar_init(bars + 8 * (STAGES + s), EMPTY_ARRIVALS);",
                 "mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);   // tile.cluster: released by its row and column",
                 "const bool releases = lane < CLUSTER_SIZE && (release_mask >> lane & 1);",
                 "const uint32_t remote_empty = cluster_map(bars + 8 * STAGES, releases ? lane : 0);",
                 "if (releases) mbar_arrive_remote(remote_empty + 8 * s);",
                 "if (tile_m >= tiles_m || tile_n >= tiles_n) continue;",
                 "operand_map(cache_a, a_read, M, K, lda, A_BOX_ROWS);", "operand_map(cache_b, b_read, N, K, ldb, B_BOX_ROWS);",
                 "const int grid = int(num_blocks);", "attr[num_attrs].val.clusterDim.x = CLUSTER_SIZE;",
                 "attr[0].val.clusterDim.x = CLUSTER_SIZE;"):
        assert line in src, line
    assert src.count("cluster_sync();") == 1 and "barrier.cluster.arrive.relaxed;" in src
    assert "barrier.cluster.arrive.release" not in src
    tail = src.index("      for (int s = 0; s < STAGES; ++s) {\n        mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);")
    # in the producer thread's branch, after its loads, before the consumers' branch
    assert src.rindex("tma_load_2d_multicast(", 0, tail) < tail < src.index("// ---- consumer warpgroups")
    consumers_to_exit = src[src.index("// ---- consumer warpgroups"):src.index("// ---- trusted host code")]
    assert "cluster_sync" not in consumers_to_exit and "barrier.cluster" not in consumers_to_exit
    assert "mbar_arrive(bars" not in src and "tma_load_2d(smem" not in src
    # One dimension of 1 shares nothing along it: 1x4 multicasts A only and loads its whole B box.
    one = lower(*CASES["w4x1_64x128x64_cluster1x4_divisible"]).source
    assert "tile_n * BN);   // not shared: the whole box" in one and "b_mask" not in one
    assert "constexpr uint32_t EMPTY_ARRIVALS = 16;" in one


def test_multicast_split_k_launches_one_cluster_grid_per_slice():
    """tile.cluster with split-K through the workspace: the launch is SLICES cluster grids (ClusterMulticast.unit,
    rendered: a cluster's blocks share one slice's k tiles), the grid and its INT_MAX check count them, the last
    stage is released at the cluster's empty barriers only when the slice had a k tile, blocks past the grid skip
    the tree, and the in-grid ones index the workspace by output tile, not by their place in the cluster grid."""
    from l2ir.indexing import ClusterMulticast

    src = lower(*CASES["w4x1_64x256x64_splitk2_cluster2x1"]).source
    pid, slice_ = ClusterMulticast(2, 1).unit()
    for line in ("const int num_units = num_blocks * SLICES;", "for (int unit = blockIdx.x; unit < num_units; unit = num_units) {",
                 f"const int pid = {pid.to_cpp()};", f"const int slice = {slice_.to_cpp()};",
                 "const long long num_units = num_blocks * SLICES;", "if (num_units > INT_MAX) return L2IR_STATUS_BAD_ARGUMENT;",
                 "const int grid = int(num_units);", "if (prev >= 0) release(prev);",
                 f"const int tile_id = {ClusterMulticast.slot().to_cpp()};",
                 "float* tile_ws = ws + (size_t)tile_id * SLICES * PARTIAL_FLOATS;",
                 "tma_load_2d_multicast(smem_base + SMEM_B"):
        assert line in src, line
    assert src.index("if (tile_m >= tiles_m || tile_n >= tiles_n) continue;") < src.index("const int tile_id")
    assert "num_tiles * SLICES;   // (tile, slice)" not in src and src.count("cluster_sync();") == 1


def test_multicast_kernels_lower_for_every_cluster():
    """Every cluster shape up to 8 blocks on the one-consumer and cooperative tiles lowers, or is refused naming
    tile.cluster exactly when a share would not be whole 8-row atoms."""
    from hypothesis import given, settings, strategies as st

    from l2ir.verify import verify

    @settings(max_examples=60, database=None, derandomize=True)
    @given(st.sampled_from([(cm, cn) for cm in (1, 2, 4, 8) for cn in (1, 2, 4, 8) if 1 < cm * cn <= 8]),
           st.sampled_from([1, 2]), st.sampled_from([16, 24, 48, 56, 64, 96, 128, 256]),
           st.sampled_from([("direct", 2), ("smem", 8)]))
    def check(cluster, wgs, bn, epi):
        bm = 64 * wgs
        kernel = Kernel(target=Target("sm90a"), tile=Tile((bm, bn, 64), (4 * wgs, 1), cluster),
                        mma=Mma("wgmma", (64, bn, 16)),
                        pipeline=Pipeline("tma_ws", "auto", "cooperative" if wgs == 2 else "pingpong", persistent=False),
                        swizzle=Swizzle((3, 3, 3), "along_n", 8), pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
                        epilogue=Epilogue(*epi))
        try:
            verify(kernel)
        except L2IRError:
            return
        whole = bm % (8 * cluster[1]) == 0 and bn % (8 * cluster[0]) == 0
        if not whole:
            with pytest.raises(UnsupportedLowering, match="tile.cluster"):
                lower(kernel, PROBLEM)
            return
        src = lower(kernel, PROBLEM).source
        assert f"constexpr int CLUSTER_M = {cluster[0]}, CLUSTER_N = {cluster[1]};" in src
        assert ("tma_load_2d_multicast" in src) and src.count("cluster_sync();") == 1

    check()


def _sweep_splitk_cases() -> dict[str, tuple[Kernel, Problem]]:
    """Every split-K structure of the cuda_ptx sweep: each must build without spills under its launch bounds.
    Kernels that differ only in the slice count lower to the same code but for constants and the depth of the
    reduction tree, so each structure is built once, at its largest count (the deepest tree, the most values live
    in the reduction): 21 builds instead of 38."""
    from l2ir.search.sweeps import load_sweep
    from l2ir.text import print_kernel

    widest: dict[str, tuple[str, Kernel]] = {}
    for name, k in load_sweep("cuda_ptx").items():
        if k.splitk is None:
            continue
        structure = print_kernel(k.replace(splitk=dataclasses.replace(k.splitk, slices=2)))
        if structure not in widest or k.splitk.slices > widest[structure][1].splitk.slices:
            widest[structure] = (name, k)
    return {f"sweep/{name}": (k, PROBLEM) for name, k in widest.values()}


NVCC_CASES = ["coop_128x256x64_direct", "coop_256x128x64_smem8_along_m8", "w4x1_64x128x64_direct",
              "w4x1_64x256x64_smem8_bf16", "w4x1_64x128x64_splitk8", "coop_128x128x64_splitk3_persistent_smem8",
              "w4x1_64x128x64_s4_two_per_sm", "w4x1_64x64x64_s4_two_per_sm_splitk5", "w4x1_64x64x64_splitk8_cluster",
              "w4x1_64x128x64_s4_two_per_sm_splitk16_cluster", "coop_128x128x64_splitk4_cluster_nonpersistent",
              "coop_128x128x64_repack", "w4x1_64x64x64_s4_two_per_sm_splitk4_repack",
              "w4x1_64x64x64_splitk8_cluster_repack", "coop_128x48x64_s4_splitk2_block_bf16",
              "w4x1_64x64x64_cluster2x4", "w4x1_64x128x64_cluster1x4_divisible", "coop_128x64x64_cluster2x1_smem8",
              "w4x1_64x256x64_splitk2_cluster2x1", "coop_128x128x64_splitk3_cluster1x2",
              "w4x1_64x256x64_splitk2_cluster2x1_repack", "w4x1_64x128x64_s4_two_per_sm_splitk3_interleave",
              "w4x1_64x64x128_interleave_bf16"]
BUILD_CASES = {**{name: CASES[name] for name in NVCC_CASES}, **_sweep_splitk_cases()}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return build_all({name: lower(*case) for name, case in BUILD_CASES.items()}, tmp_path_factory.mktemp("cache"))


@pytest.mark.nvcc
@pytest.mark.parametrize("name", list(BUILD_CASES))
def test_nvcc_builds_without_spills(builds, name):
    b = built(builds[name], name)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", b.log)
    assert spills and all(s == ("0", "0") for s in spills), f"register spills: {spills}"
    assert "C7510" not in b.log and "C7515" not in b.log, "ptxas serialized the wgmma pipeline"
    assert "warning" not in b.log.lower(), b.log
    cfg = sm90a.canonicalize(*BUILD_CASES[name])
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", b.log)]
    # The launch-bound cap sm90a.REG_BUDGET's arithmetic assumes: 65536 / (threads x blocks per SM) rounded down
    # to 8, at most 255.
    cap = min(255, 65536 // (cfg.threads * cfg.blocks_per_sm) // 8 * 8)
    assert regs and max(regs) <= cap, (regs, cap)
    ptx = b.ptx()
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.bn}k16.f32.{cfg.in_dtype}.{cfg.in_dtype}" in ptx
    producer, consumer = cfg.regs
    for instr in ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
                  "prefetch.tensormap", "mbarrier.try_wait.parity.shared::cta.b64", "wgmma.wait_group.sync.aligned 1"):
        assert instr in ptx, instr
    # interleave: no setmaxnreg (its A writers keep the producer warpgroup's registers)
    assert (f"setmaxnreg.dec.sync.aligned.u32 {producer}" in ptx) if producer else ("setmaxnreg.dec" not in ptx)
    assert (f"setmaxnreg.inc.sync.aligned.u32 {consumer}" in ptx) if consumer else ("setmaxnreg.inc" not in ptx)


@pytest.mark.nvcc
@pytest.mark.parametrize("name", list(BUILD_CASES))
def test_sass_has_hgmma(builds, name):
    sass = disassemble(built(builds[name], name).binary)
    if sass is None:
        pytest.skip("cuobjdump/nvdisasm not found (PATH or the NVIDIA wheels)")
    kernel = BUILD_CASES[name][0]
    slabs = sm90a.canonicalize(*BUILD_CASES[name]).slabs
    hgmma = re.findall(rf"HGMMA\.64x{kernel.tile.bn}x16\.F32", sass)
    # One k-tile's wgmmas (BK/16 steps x slabs) appear once in the unrolled main loop.
    assert len(hgmma) == kernel.tile.bk // 16 * slabs, len(hgmma)
    assert "UTMALDG.2D" in sass


@pytest.mark.nvcc
@pytest.mark.parametrize("name", [n for n in NVCC_CASES if sm90a.canonicalize(*CASES[n]).cluster_reduce])
def test_sass_cluster_reduce_pays_no_gpu_membar(builds, name):
    """reduce=cluster: the push (STAS.128, st.async into the owners' shared memory) needs no release and no exit
    barrier: no MEMBAR.ALL.GPU anywhere (a release arrival or a cluster-scope fence compiles to one per warp), no
    load from another block's shared memory, and one cluster barrier (one arrival per thread: the entry's)."""
    sass = disassemble(built(builds[name], name).binary)
    if sass is None:
        pytest.skip("cuobjdump/nvdisasm not found (PATH or the NVIDIA wheels)")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    assert len(ops) > 100 and "STAS.128" in ops
    assert ops.count("MEMBAR.ALL.GPU") == 0 and "ERRBAR" not in ops and "CGAERRBAR" not in ops
    assert not any(op.startswith("LD.") for op in ops if op != "LD.E.128") and "LD.E.128" not in ops
    assert ops.count("UCGABAR_ARV") == 1, ops.count("UCGABAR_ARV")


@pytest.mark.nvcc
def test_host_shim_refuses_without_gpu(builds):
    """The shim loads and refuses bad arguments before any CUDA call (also on machines without a GPU)."""
    so = shim_library(built(builds["coop_128x256x64_direct"]).binary)
    assert so.l2ir_run(None, None, None, 64, 64, 64, None, 0, None) == STATUS_BAD_ARGUMENT
    assert so.l2ir_run(16, 16, 16, 0, 64, 64, None, 0, None) == STATUS_BAD_ARGUMENT
    assert so.l2ir_run(8, 16, 16, 64, 64, 64, None, 0, None) == STATUS_MISALIGNED      # A not 16-byte aligned
    assert so.l2ir_run(16, 16, 16, 64, 64, 60, None, 0, None) == STATUS_MISALIGNED     # K % 8 != 0
    assert so.l2ir_run(16, 16, 18, 64, 64, 64, None, 0, None) == STATUS_MISALIGNED     # C not 4-byte aligned
    assert so.l2ir_workspace_size(4096, 4096, 4096) == 0


@pytest.mark.nvcc
def test_host_shim_answers_its_occupancy_only_on_a_gpu(builds):
    """l2ir_max_active_clusters asks the library's own runtime (the one that registered the kernel): -1 where no
    device can be set up, a positive count of resident clusters (here: blocks) on a GPU."""
    import torch

    so = shim_library(built(builds["coop_128x256x64_direct"]).binary)
    active = so.l2ir_max_active_clusters()
    assert (active > 0) if torch.cuda.is_available() else (active == -1), active


@pytest.mark.nvcc
def test_run_args_block_reaches_l2ir_run_field_by_field(builds):
    """l2ir_run_args (the shim's one-pointer entry, l2ir.runtime.RunArgs) gives l2ir_run's answer for the same
    arguments: each refusal below is decided by one field of the block (a, b, c, m, n, k, workspace_bytes,
    workspace), so a layout that disagreed with the C struct would read the wrong field and answer otherwise. (The
    stream is passed through to the launch, which needs a GPU: tests/test_dispatch.py checks it with a stub.)"""
    import ctypes

    from l2ir.runtime import STATUS_WORKSPACE_TOO_SMALL, RunArgs

    so = shim_library(built(builds["w4x1_64x128x64_splitk8"]).binary)
    so.l2ir_run_args.argtypes = [ctypes.POINTER(RunArgs)]
    need = lower(*CASES["w4x1_64x128x64_splitk8"]).workspace_for(64, 1024, 16384)
    cases = [((None, 16, 16, 64, 1024, 16384, 256, need, None), STATUS_BAD_ARGUMENT),     # a null
             ((16, None, 16, 64, 1024, 16384, 256, need, None), STATUS_BAD_ARGUMENT),     # b null
             ((16, 16, 16, 64, 0, 16384, 256, need, None), STATUS_BAD_ARGUMENT),          # n
             ((16, 8, 16, 64, 1024, 16384, 256, need, None), STATUS_MISALIGNED),          # b misaligned
             ((16, 16, 16, 0, 1024, 16384, 256, need, None), STATUS_BAD_ARGUMENT),        # m
             ((8, 16, 16, 64, 1024, 16384, 256, need, None), STATUS_MISALIGNED),          # a misaligned
             ((16, 16, 16, 64, 1024, 16380, 256, need, None), STATUS_MISALIGNED),         # k % 8
             ((16, 16, 18, 64, 1024, 16384, 256, need, None), STATUS_MISALIGNED),         # c misaligned
             ((16, 16, 16, 64, 1024, 16384, 256, need - 1, None), STATUS_WORKSPACE_TOO_SMALL),  # workspace_bytes
             ((16, 16, 16, 64, 1024, 16384, None, need, None), STATUS_WORKSPACE_TOO_SMALL),     # workspace
             ((16, 16, 16, 64, 1024, 16384, 264, need, None), STATUS_MISALIGNED)]         # workspace misaligned
    for args, want in cases:
        assert so.l2ir_run(*args) == want, args
        assert so.l2ir_run_args(ctypes.byref(RunArgs(*args))) == want, args
    assert so.l2ir_run_args(None) == STATUS_BAD_ARGUMENT


@pytest.mark.nvcc
def test_splitk_shim_workspace_contract(builds):
    """The library's workspace size is the plan's expression, and l2ir_run refuses a short, missing or misaligned
    workspace before any CUDA call."""
    from l2ir.runtime import STATUS_WORKSPACE_TOO_SMALL

    plan = lower(*CASES["w4x1_64x128x64_splitk8"])
    so = shim_library(built(builds["w4x1_64x128x64_splitk8"]).binary)
    for m, n, k in ((64, 1024, 16384), (100, 3000, 4104), (64, 64, 64), (128, 16384, 4096), (1, 1, 8)):
        assert so.l2ir_workspace_size(m, n, k) == plan.workspace_for(m, n, k), (m, n, k)
    need = plan.workspace_for(64, 1024, 16384)
    assert so.l2ir_run(16, 16, 16, 64, 1024, 16384, 256, need - 1, None) == STATUS_WORKSPACE_TOO_SMALL
    assert so.l2ir_run(16, 16, 16, 64, 1024, 16384, None, need, None) == STATUS_WORKSPACE_TOO_SMALL
    assert so.l2ir_run(16, 16, 16, 64, 1024, 16384, 264, need, None) == STATUS_MISALIGNED


@pytest.mark.nvcc
def test_repack_shim_workspace_contract(builds):
    """The repack shim's workspace size is the plan's expression; on an odd K it needs the workspace for its copies
    and refuses without one or with a misaligned one; a K whose padded pitch would not fit an int is refused; an
    aligned K needs no workspace at all."""
    from l2ir.runtime import STATUS_WORKSPACE_TOO_SMALL

    for name in ("coop_128x128x64_repack", "w4x1_64x64x64_s4_two_per_sm_splitk4_repack"):
        plan = lower(*CASES[name])
        so = shim_library(built(builds[name]).binary)
        for m, n, k in ((512, 512, 4097), (1023, 1025, 1027), (17, 9999, 3333), (64, 64, 64), (1, 1, 1)):
            assert so.l2ir_workspace_size(m, n, k) == plan.workspace_for(m, n, k), (name, m, n, k)
    so = shim_library(built(builds["coop_128x128x64_repack"]).binary)
    need = so.l2ir_workspace_size(512, 512, 4097)
    assert need > 0 and so.l2ir_workspace_size(512, 512, 4096) == 0
    assert so.l2ir_run(16, 16, 16, 512, 512, 4097, None, need, None) == STATUS_WORKSPACE_TOO_SMALL
    assert so.l2ir_run(16, 16, 16, 512, 512, 4097, 256, need - 1, None) == STATUS_WORKSPACE_TOO_SMALL
    assert so.l2ir_run(16, 16, 16, 512, 512, 4097, 264, need, None) == STATUS_MISALIGNED
    assert so.l2ir_run(16, 16, 16, 1, 1, 2 ** 31 - 1, 256, 2 ** 62, None) == STATUS_BAD_ARGUMENT


if __name__ == "__main__":
    GOLDENS.main(sys.argv[1:], __doc__)
