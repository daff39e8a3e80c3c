"""The verifier: each illegal mutation of a generated kernel fails with the right typed error (what the generators
cover is tested in test_testing.py)."""

import dataclasses

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from l2ir.errors import (EpilogueError, L2IRError, MmaError, PadError, PipelineError, ProblemError, ResourceError,
                         SourceError, SplitKError, SwizzleError, TargetError, TileError, VerifyError)
from l2ir.indexing import Const, Var
from l2ir.nodes import Kernel, Problem, Repack, Source, SplitK, Swizzle, Target
from l2ir.text import parse_kernel
from l2ir.analysis import smem_bytes
from l2ir.verify import check_problem, verify, violations
from l2ir.testing import kernels

SM80 = parse_kernel(open("examples/sm80_128x128x32.l2").read())
SM90 = parse_kernel(open("examples/sm90a_cooperative_128x256x64.l2").read())


def rep(kernel, node, **changes):
    return kernel.replace(**{node: dataclasses.replace(getattr(kernel, node), **changes)})


# split-K inside one block: cooperative 64x64 (both consumer warpgroups over all 64 rows), 4 stages, one tile a block.
BLOCK = rep(rep(rep(rep(SM90, "tile", block=(64, 64, 64), cluster=(1, 1)), "mma", shape=(64, 64, 16)), "pipeline",
                stages=4, persistent=False), "epilogue", path="direct", vector=2).replace(
    splitk=SplitK("split_k", 2, "block"))


# (name, kernel, error class, text the message must contain, rule)
ILLEGAL = [
    ("wgmma on sm80", rep(SM80, "mma", op="wgmma", shape=(64, 64, 16)), TargetError, "wgmma needs target sm90a",
     "wgmma_needs_sm90a"),
    ("tma on sm80", rep(SM90, "target", arch="sm80"), TargetError, "needs target sm90a", "wgmma_needs_sm90a"),
    ("tma pipeline on sm86", rep(rep(SM80, "pipeline", mode="tma_ws", schedule="cooperative"), "target", arch="sm86"),
     TargetError, "TMA warp-specialized pipelines need sm90", "tma_needs_sm90"),
    ("cluster on sm80", rep(SM80, "tile", cluster=(2, 1)), TargetError, "has no clusters", "cluster_needs_sm90"),
    ("tma store on sm80", rep(SM80, "epilogue", path="tma"), TargetError, "epilogue path=tma needs sm90",
     "tma_store_needs_sm90"),
    ("mma shape", rep(SM80, "mma", shape=(16, 8, 32)), MmaError, "not 16x8x32", "shape_exists"),
    ("wgmma shape", rep(SM90, "mma", shape=(64, 100, 16)), MmaError, "N in 8..256", "shape_exists"),
    ("BM not whole MMAs", rep(SM80, "tile", block=(120, 128, 32)), TileError, "BM=120 is not a multiple",
     "mma_divides_warp_tile"),
    ("BK not whole MMAs", rep(SM80, "tile", block=(128, 128, 24)), TileError, "BK=24 is not a multiple of the MMA K",
     "mma_divides_warp_tile"),
    ("wgmma N vs tile", rep(SM90, "mma", shape=(64, 128, 16)), TileError, "must equal the wgmma N=128",
     "mma_divides_warp_tile"),
    ("too many threads", rep(SM80, "tile", block=(256, 256, 32), warps=(8, 8)), TileError, "exceeds 1024",
     "thread_count"),
    ("copy does not tile", rep(SM80, "tile", block=(16, 16, 16), warps=(1, 2)), TileError,
     "is not a multiple of threads*align", "copy_partition"),
    ("cluster too big", rep(SM90, "tile", cluster=(4, 4)), TileError, "portable limit is 8", "cluster_size"),
    ("TMA box", rep(rep(SM90, "tile", block=(384, 128, 64)), "mma", shape=(64, 128, 16)), TileError,
     "at most 256 elements", "tma_box"),
    ("stream-k not persistent", rep(SM90, "pipeline", persistent=False).replace(splitk=SplitK("stream_k")),
     SplitKError, "persistent=true", "mode_settings"),
    ("cluster reduce on sm80", SM80.replace(splitk=SplitK("split_k", 4, "cluster")), SplitKError,
     "needs thread-block clusters", "mode_settings"),
    ("cluster reduce with mma.sync", rep(SM80, "target", arch="sm90a").replace(splitk=SplitK("split_k", 4, "cluster")),
     SplitKError, "wgmma accumulator fragment layout", "mode_settings"),
    # 128x128: the 128x256 tile's receive buffer for 16 other blocks would leave the ring one stage, an earlier rule
    ("cluster reduce of 17", rep(rep(rep(SM90, "pipeline", persistent=False), "tile", block=(128, 128, 64)), "mma",
                                 shape=(64, 128, 16)).replace(splitk=SplitK("split_k", 17, "cluster")),
     SplitKError, "at most 16 blocks", "mode_settings"),
    ("cluster reduce in a cluster", rep(SM90, "pipeline", persistent=False).replace(splitk=SplitK("split_k", 4, "cluster")),
     SplitKError, "would nest a second one", "mode_settings"),       # the example's tile.cluster is 2x1
    ("cluster reduce persistent", rep(rep(SM90, "pipeline", persistent=True), "tile", cluster=(1, 1))
     .replace(splitk=SplitK("split_k", 4, "cluster")), SplitKError, "set pipeline.persistent=false", "mode_settings"),
    ("cluster reduce stream-k", SM90.replace(splitk=SplitK("stream_k", 1, "cluster")), SplitKError,
     "reduce=cluster is for split_k", "mode_settings"),
    # reduce=block: the 2 slices are the cooperative block's consumer warpgroups, one tile per block, a ring deep
    # enough that a consumer holding its previous stage never stalls the producer.
    ("block reduce of 3", BLOCK.replace(splitk=SplitK("split_k", 3, "block")), SplitKError, "slices=2, not 3",
     "mode_settings"),
    ("block reduce pingpong", rep(rep(BLOCK, "pipeline", schedule="pingpong"), "tile", warps=(4, 1)), SplitKError,
     "needs the 2 consumer warpgroups", "mode_settings"),
    ("block reduce persistent", rep(BLOCK, "pipeline", persistent=True), SplitKError, "one tile per block",
     "mode_settings"),
    ("block reduce two stages", rep(BLOCK, "pipeline", stages=2), SplitKError, "at least 4", "mode_settings"),
    ("block reduce odd ring", rep(BLOCK, "pipeline", stages=5), SplitKError, "even number of stages", "mode_settings"),
    ("block reduce mma.sync", rep(SM80, "target", arch="sm90a").replace(splitk=SplitK("split_k", 2, "block")),
     SplitKError, "use reduce=workspace", "mode_settings"),
    ("block reduce stream-k", BLOCK.replace(splitk=SplitK("stream_k", 1, "block")), SplitKError,
     "reduce=block is for split_k", "mode_settings"),
    ("block reduce in a cluster", rep(BLOCK, "tile", cluster=(2, 1)), SplitKError, "inside one block",
     "mode_settings"),
    ("block reduce 128x192", rep(rep(BLOCK, "tile", block=(128, 192, 64)), "mma", shape=(64, 192, 16)), SplitKError,
     "above 128 they spill", "mode_settings"),
    ("block reduce BM 96", rep(rep(BLOCK, "tile", block=(96, 64, 64)), "mma", shape=(64, 64, 16)), TileError,
     "1 warpgroup tile(s) of a multiple of 64 rows", "mma_divides_warp_tile"),
    ("smem budget sm80", rep(SM80, "pipeline", stages=13), ResourceError, "sm80 allows 163 KB", "smem_budget"),
    ("smem budget sm90", rep(SM90, "pipeline", stages=6), ResourceError, "sm90a allows 227 KB", "smem_budget"),
    ("registers", rep(SM80, "tile", block=(256, 256, 32)), ResourceError, "exceeds 255", "register_budget"),
    ("wgmma registers", rep(rep(SM90, "tile", warps=(4, 1), block=(128, 256, 64)), "pipeline", schedule="pingpong"),
     ResourceError, "256 accumulator registers", "register_budget"),
    ("auto stages on cp.async", rep(SM80, "pipeline", stages="auto"), PipelineError, "only for tma_ws",
     "stage_count"),
    ("schedule on cp.async", rep(SM80, "pipeline", schedule="pingpong"), PipelineError, "multistage takes schedule=none",
     "schedule"),
    ("pingpong warps", rep(SM90, "pipeline", schedule="pingpong"), PipelineError, "uses warps=4x1", "schedule"),
    ("prefetch on wgmma", rep(SM90, "pipeline", prefetch=True), PipelineError, "wgmma has none",
     "prefetch_needs_fragments"),
    ("persistent cp.async", rep(SM80, "pipeline", persistent=True), PipelineError, "needs a tma_ws pipeline",
     "persistent_needs_tma_ws"),
    ("swizzle too wide", rep(SM80, "swizzle", smem=(3, 3, 3)), SwizzleError, "permutes rows of 64 elements but BK=32",
     "smem_swizzle_fits_row"),
    ("swizzle unit", rep(SM80, "swizzle", smem=(2, 2, 3)), SwizzleError, "M must be 3", "smem_swizzle_fits_row"),
    ("swizzle overlap", rep(SM80, "swizzle", smem=(2, 3, 1)), SwizzleError, "overlap", "smem_swizzle_fits_row"),
    ("raster group tma", rep(SM90, "swizzle", group=16), SwizzleError, "group 1, 2, 4 or 8", "raster_group"),
    ("tma predicate", rep(SM90, "pad", m="predicate"), PadError, "TMA has no predicated loads",
     "tma_bounds_and_alignment"),
    ("tma align", rep(rep(SM90, "pad", align=4), "epilogue", vector=4), PadError, "pad.align must be 8",
     "tma_bounds_and_alignment"),
    ("one slice", SM80.replace(splitk=SplitK("split_k", 1)), SplitKError, "slices >= 2", "mode_settings"),
    ("stream-k cp.async", SM80.replace(splitk=SplitK("stream_k")), SplitKError, "needs a tma_ws pipeline",
     "mode_settings"),
    ("vector past align", rep(SM80, "pad", align=4), EpilogueError, "vector=8 exceeds pad.align=4",
     "path_and_vector"),
    ("tma store, cp.async pipeline", rep(rep(SM80, "epilogue", path="tma"), "target", arch="sm90a"), EpilogueError,
     "needs a tma_ws pipeline", "path_and_vector"),
    ("source with schedule", SM80.replace(source=Source("k", (Const(1),) * 3, (32, 1, 1), 0,
                                                        "__global__ void k(){}")),
     SourceError, "remove tile", "source_excludes_schedule"),
    ("incomplete schedule", SM80.replace(pad=None), TileError, "missing pad", "schedule_complete"),
]

SOURCE = Kernel(target=Target("sm80"), source=Source("k", (Var("n"), Var("m"), Const(1)), (128, 1, 1), 0,
                                                      'extern "C" __global__ void k(const void* A) {}'))
ILLEGAL += [
    ("source entry", SOURCE.replace(source=dataclasses.replace(SOURCE.source, entry="other")), SourceError,
     "no __global__ function named 'other'", "well_formed"),
    ("source free var", SOURCE.replace(source=dataclasses.replace(SOURCE.source, grid=(Var("x"), Const(1), Const(1)))),
     SourceError, "only m, n, k are bound", "well_formed"),
    ("source zero grid", SOURCE.replace(source=dataclasses.replace(SOURCE.source, grid=(Var("m") - 1, Const(1),
                                                                                        Const(1)))),
     SourceError, "grid sizes must be >= 1", "well_formed"),
    ("source extern C", SOURCE.replace(source=dataclasses.replace(SOURCE.source, code="__global__ void k() {}")),
     SourceError, 'must be declared extern "C"', "well_formed"),
    ("source block z", SOURCE.replace(source=dataclasses.replace(SOURCE.source, block=(1, 1, 128))), SourceError,
     "block.z=128 exceeds the hardware limit 64", "well_formed"),
    ("source threads", SOURCE.replace(source=dataclasses.replace(SOURCE.source, block=(64, 32, 1))), SourceError,
     "the limit is 1024", "well_formed"),
    ("source smem", SOURCE.replace(source=dataclasses.replace(SOURCE.source, smem=200 * 1024)), SourceError,
     "exceeds sm80", "well_formed"),
]


@pytest.mark.parametrize("kernel,cls,text,rule", [pytest.param(*c[1:], id=c[0]) for c in ILLEGAL])
def test_illegal_kernel_raises_typed_error(kernel, cls, text, rule):
    with pytest.raises(cls) as info:
        verify(kernel)
    assert text in str(info.value)
    assert info.value.rule == rule
    assert isinstance(info.value, VerifyError) and isinstance(info.value, L2IRError)


PROBLEM_ILLEGAL = [
    ("divisible", rep(SM80, "pad", m="divisible"), Problem(100, 128, 64), PadError, "requires m % 128 == 0, got m=100"),
    ("align A", SM80, Problem(128, 128, 100), PadError, "A is row-major, so K must be a multiple of 8, got K=100"),
    ("align B row", SM80, Problem(128, 100, 128, b=("f16", "row")), PadError, "B is row-major, so N must be"),
    ("split vs K", SM80.replace(splitk=SplitK("split_k", 8)), Problem(128, 128, 64), SplitKError,
     "leaves the last slice(s) without a k tile"),
    ("mixed dtypes", SM80, Problem(128, 128, 128, a=("f16", "row"), b=("bf16", "col")), ProblemError,
     "A is f16 but B is bf16"),
    ("bf16 with f16 acc", SM80, Problem(128, 128, 128, a=("bf16", "row"), b=("bf16", "col"), acc="f16"), ProblemError,
     "acc=f16 needs f16 inputs"),
    ("fp32 output staging", rep(rep(SM80, "tile", block=(256, 256, 32), warps=(4, 4)), "pipeline", stages=3),
     Problem(1024, 1024, 1024, c=("f32", "row")), ResourceError, "with c=f32 the kernel needs"),
    ("source grid limit", SOURCE.replace(source=dataclasses.replace(SOURCE.source, grid=(Const(1), Var("m"),
                                                                                         Const(1)))),
     Problem(70000, 8, 8), SourceError, "allowed 1..65535"),
    # repack operands=b copies B only: A's odd-K rows still break pad.align=8.
    ("repack b only", SM90.replace(repack=Repack("b")), Problem(128, 128, 100), PadError,
     "A is row-major, so K must be a multiple of 8, got K=100"),
    ("repack leaves C", SM90.replace(repack=Repack()), Problem(128, 100, 128), PadError,
     "C is row-major, so N must be"),
]


def test_repack_exempts_the_copied_operands():
    """An odd K is legal once both K-major operands are copied; an aligned K needs no copy and stays legal; the
    node asks for pad.align=8 (the copies' alignment) and is refused on a Source kernel."""
    for k in (100, 4097, 1, 7):
        check_problem(SM90.replace(repack=Repack()), Problem(128, 128, k))
    check_problem(SM90.replace(repack=Repack()), Problem(128, 128, 4096))
    check_problem(SM90.replace(repack=Repack("a")), Problem(128, 128, 100, b=("f16", "row")))  # B row: N aligned
    with pytest.raises(PadError) as info:
        verify(rep(SM80, "pad", align=2).replace(repack=Repack()))
    assert info.value.rule == "copies_are_aligned" and "pad.align=8" in str(info.value)
    with pytest.raises(SourceError, match="remove repack"):
        verify(SOURCE.replace(repack=Repack()))
    assert parse_kernel(SM90.replace(repack=Repack("b")).text()) == SM90.replace(repack=Repack("b"))


@pytest.mark.parametrize("kernel,problem,cls,text", [pytest.param(*c[1:], id=c[0]) for c in PROBLEM_ILLEGAL])
def test_problem_rules(kernel, problem, cls, text):
    verify(kernel)
    with pytest.raises(cls) as info:
        check_problem(kernel, problem)
    assert text in str(info.value)


# Mutations that are illegal for every kernel they apply to, with the error class that must be among the violations.
MUTATIONS = {
    "target sm80 under wgmma": (lambda k: k.mma.op == "wgmma", lambda k: rep(k, "target", arch="sm80"), TargetError),
    "mma K=32": (lambda k: k.mma.op == "mma_sync", lambda k: rep(k, "mma", shape=(16, 8, 32)), MmaError),
    "BK not a multiple of 16": (lambda k: True, lambda k: rep(k, "tile", block=(k.tile.bm, k.tile.bn, k.tile.bk + 8)),
                                TileError),
    "cp.async stages 14+": (lambda k: k.pipeline.mode == "multistage", lambda k: rep(k, "pipeline", stages=14),
                            PipelineError),
    "predicate under TMA": (lambda k: k.pipeline.mode == "tma_ws", lambda k: rep(k, "pad", k="predicate"), PadError),
    "swizzle wider than BK": (lambda k: k.tile.bk <= 32,
                              lambda k: k.replace(swizzle=Swizzle(smem=(3, 3, 3))), SwizzleError),
    "single split": (lambda k: True, lambda k: k.replace(splitk=SplitK("split_k", 1)), SplitKError),
    # 13 stages of 256x256x64 halves = 832 KB: over every target's budget whatever else the kernel says.
    "oversized smem": (lambda k: k.pipeline.mode == "multistage",
                       lambda k: rep(rep(k, "pipeline", stages=13), "tile", block=(256, 256, 64)), ResourceError),
}


@given(kernels(), st.sampled_from(sorted(MUTATIONS)))
def test_illegal_mutations_are_rejected(kernel, name):
    applies, mutate, cls = MUTATIONS[name]
    assume(applies(kernel))
    try:
        bad = mutate(kernel)
    except L2IRError:
        return  # rejected at construction (field type), which is also a rejection
    errs = violations(bad)
    assert any(isinstance(e, cls) for e in errs), (name, [str(e) for e in errs])
    with pytest.raises(VerifyError):
        verify(bad)


def test_smem_accounting():
    # 4 stages x (128+128) x 32 halves x 2 bytes = 64 KB; the 32 KB C tile reuses the drained ring.
    assert smem_bytes(SM80) == 4 * 256 * 32 * 2
    # auto stages fill 227 KB after the 32 KB TMA-epilogue buffer: (227-32) KB / (48 KB + 16 B) = 4 stages.
    assert smem_bytes(SM90) == 4 * (384 * 64 * 2 + 16) + 32 * 1024


def test_alignment_rule_keeps_loads_and_stores_apart():
    """pad.align bounds A's and B's rows, epilogue.vector C's: an odd N narrows only the stores when B is K-major,
    an odd K narrows the loads, and a vector wider than C's rows allow is refused naming epilogue.vector."""
    from l2ir.nodes import Epilogue
    from l2ir.seed import alignment, seed, store_vector

    base = seed(Problem(256, 256, 256), "sm80")
    narrow = base.replace(epilogue=Epilogue("smem", 1))
    assert narrow.pad.align == 8
    check_problem(narrow, Problem(256, 1001, 512))                 # odd N: C's rows only
    with pytest.raises(PadError, match=r"epilogue.vector=8 .* N must be a multiple of 8, got N=1001"):
        check_problem(base.replace(epilogue=Epilogue("smem", 8)), Problem(256, 1001, 512))
    with pytest.raises(PadError, match=r"pad.align=8 .* K must be a multiple of 8, got K=999"):
        check_problem(narrow, Problem(256, 1000, 999))              # odd K: A's and B's rows
    # b=row stores B K x N, N contiguous: an odd N now narrows B's loads as well
    row_b = Problem(256, 1001, 512, b=("f16", "row"))
    with pytest.raises(PadError, match=r"pad.align=8 .* B is row-major, so N must be a multiple of 8"):
        check_problem(narrow, row_b)
    assert (alignment(Problem(64, 1001, 64)), store_vector(Problem(64, 1001, 64))) == (8, 1)
    assert (alignment(row_b), store_vector(row_b)) == (1, 1)
    assert (alignment(Problem(64, 1002, 999)), store_vector(Problem(64, 1002, 999))) == (1, 1)
    assert (alignment(Problem(64, 1002, 1000)), store_vector(Problem(64, 1002, 1000))) == (8, 2)
    odd_n = seed(Problem(4096, 1001, 4096), "sm90a")
    assert (odd_n.pad.align, odd_n.epilogue.vector, odd_n.mma.op) == (8, 1, "mma_sync")
