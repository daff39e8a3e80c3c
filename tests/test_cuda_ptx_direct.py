"""pipeline mode=direct and the cuda_ptx direct rule: verifier rules, the interpreter's model of the feed
(l2ir.indexing.DirectFeed) with planted bugs it must catch, Hypothesis against A @ B, golden sources, dispatch and
nvcc builds (skip cleanly without nvcc). The GPU gates run in tests/test_backends_gpu.py.

Regenerate the golden sources after an intended change to the lowering:
    python tests/test_cuda_ptx_direct.py --update-golden
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builds import build_all, built  # noqa: E402
from golden_sources import GoldenSources  # noqa: E402
from l2ir.analysis import direct_registers, smem_bytes, threads  # noqa: E402
from l2ir.backends.registry import backend_for  # noqa: E402
from l2ir.errors import InterpError, PipelineError, TileError, VerifyError  # noqa: E402
from l2ir.indexing import DirectFeed  # noqa: E402
from l2ir.interp import error_bound, interpret, random_inputs, reference  # noqa: E402
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile  # noqa: E402
from l2ir.search.sweeps import load_sweep  # noqa: E402
from l2ir.verify import DIRECT_BM, verify  # noqa: E402

PROBLEM = Problem(m=1, n=4096, k=4096)
ODD_K = Problem(m=17, n=9999, k=3333)


def direct(block=(8, 32, 256), wn=4, stages=2, align=8, vector=2, pad=("predicate", "predicate", "zero_fill"),
           arch="sm80", swizzle=None, **changes) -> Kernel:
    k = Kernel(target=Target(arch), tile=Tile(block, (1, wn)), mma=Mma("mma_sync", (16, 8, 16)),
               pipeline=Pipeline("direct", stages), swizzle=swizzle, pad=Pad(*pad, align),
               epilogue=Epilogue("direct", vector))
    return k.replace(**changes)


CASES: dict[str, tuple[Kernel, Problem]] = {
    "8x32x256_w1x4_s2_decode": (direct(), PROBLEM),
    "16x32x128_w1x4_s1_raster_along_m": (
        direct((16, 32, 128), stages=1, swizzle=Swizzle(None, "along_m", 4)), PROBLEM),
    "32x64x64_w1x8_s2_divisible_bf16": (
        direct((32, 64, 64), 8, pad=("divisible", "divisible", "divisible")),
        Problem(m=1, n=1, k=1, a=("bf16", "row"), b=("bf16", "col"), c=("bf16", "row"))),
    "16x32x64_w1x4_s2_align1_direct1": (direct((16, 32, 64), align=1, vector=1), ODD_K),
    "sm90a_8x32x64_w1x4_s2_align2": (direct((8, 32, 64), align=2, vector=2, arch="sm90a"), PROBLEM),
    # K split between the block's warps (4 groups of 1x4), added in slice order through shared memory.
    "8x32x128_w1x4_s2_k4_decode": (direct((8, 32, 128), splitk=SplitK("split_k", 4, "block")), PROBLEM),
    "16x32x64_w1x4_s1_k3_align1_direct1": (
        direct((16, 32, 64), stages=1, align=1, vector=1, splitk=SplitK("split_k", 3, "block")), ODD_K),
    # Deeper register sets: 2 and 3 steps load ahead of the one that multiplies (more bytes in flight per warp).
    "8x32x128_w1x4_s3_k2_decode": (direct((8, 32, 128), stages=3, splitk=SplitK("split_k", 2, "block")), PROBLEM),
    "8x32x64_w1x4_s4_k4_decode": (direct((8, 32, 64), stages=4, splitk=SplitK("split_k", 4, "block")), PROBLEM),
    "16x32x64_w1x4_s4_direct1": (direct((16, 32, 64), stages=4, vector=1), PROBLEM),
}

GOLDENS = GoldenSources("cuda_ptx_direct", CASES, __file__)
lower = GOLDENS.lower
test_golden_source, test_deterministic_in_process, test_deterministic_across_processes = GOLDENS.tests()


# ---------------------------------------------------------------------------------------------------------------
# The IR and the verifier.
# ---------------------------------------------------------------------------------------------------------------


def test_direct_kernels_have_no_shared_memory_and_one_warp_row():
    k = direct()
    assert smem_bytes(k) == 0 and threads(k) == 128
    assert backend_for(k).name == "cuda_ptx_direct"
    assert verify(k) is k


@pytest.mark.parametrize("bad, error, words", [
    (direct().replace(tile=Tile((8, 32, 256), (2, 4))), TileError, "warps=1x"),
    (direct((24, 32, 256)), TileError, "BM in"),
    (direct((8, 36, 256)), TileError, "n8 blocks"),
    (direct((8, 32, 48)), TileError, "multiple of 32"),
    (direct(stages=5), PipelineError, "stages=1..4"),
    (direct((16, 32, 64), stages=3, align=1, vector=1), PipelineError, "needs pad.align=8"),
    (direct(swizzle=Swizzle((3, 3, 3), "along_n", 1)), PipelineError, "no shared memory"),
    (direct(splitk=SplitK("split_k", 2)), PipelineError, "reduce=block"),
    (direct((8, 8, 64), 1, splitk=SplitK("split_k", 16, "block")), PipelineError, "2..8 K slices"),
    (direct((16, 32, 128), splitk=SplitK("split_k", 8, "block")), VerifyError, "registers of an SM"),
    (direct(epilogue=Epilogue("smem", 8)), PipelineError, "path=direct"),
    (direct(mma=Mma("wgmma", (64, 32, 16)), arch="sm90a"), VerifyError, "wgmma"),
    (direct((8, 8, 512), 1, align=1, vector=1), VerifyError, "registers"),
    (direct(epilogue=Epilogue("direct", 4)), PipelineError, "stores 1 or 2"),
    (direct(mma=Mma("mma_sync", (16, 8, 8))), PipelineError, "two m16n8k16"),
])
def test_verifier_refuses(bad, error, words):
    with pytest.raises(error, match=re.escape(words)):
        verify(bad)


def test_register_estimate_counts_the_raw_vectors():
    """The estimate grows with stages, chunks and the realigned pair, the three things ptxas spilled on."""
    base = direct_registers(direct((8, 32, 128)))
    assert direct_registers(direct((8, 32, 256))) > base
    assert direct_registers(direct((8, 32, 128), stages=1)) < base
    assert direct_registers(direct((8, 32, 128), align=1, vector=1)) > base


def test_every_sweep_kernel_lowers_to_the_direct_rule():
    for name, k in load_sweep("cuda_ptx_direct").items():
        assert k.pipeline.mode == "direct" and k.tile.bm in DIRECT_BM, name
        problem = ODD_K if k.pad.align == 1 else PROBLEM.with_shape(17, 999, 1000)
        plan = lower(k, problem)
        assert plan.launches[0].smem == smem_bytes(k) and "ld.global.nc" in plan.source, name
        assert (k.splitk is None) == (smem_bytes(k) == 0), name


# ---------------------------------------------------------------------------------------------------------------
# The interpreter: the feed it models is the one the backend renders.
# ---------------------------------------------------------------------------------------------------------------


def _run(kernel, shape, seed=0):
    p = Problem(*shape)
    a, b = random_inputs(p, np.random.default_rng(seed))
    res = interpret(kernel, p, a, b)
    ok = np.abs(res.c.astype(np.float64) - reference(a, b)) <= error_bound(p, a, b)
    return res, bool(ok.all())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bm=st.sampled_from(DIRECT_BM), wn=st.sampled_from((1, 2, 4)), ni=st.sampled_from((1, 2)),
       chunks=st.sampled_from((1, 2, 4)), stages=st.sampled_from((1, 2, 3, 4)), align=st.sampled_from((1, 2, 4, 8)),
       slices=st.sampled_from((1, 1, 2, 3, 4)),
       raster=st.sampled_from(("along_n", "along_m")), group=st.sampled_from((1, 3)),
       m=st.integers(1, 70), n=st.integers(1, 80), k=st.integers(1, 300), data=st.data())
def test_interpreter_matches_reference(bm, wn, ni, chunks, stages, align, slices, raster, group, m, n, k, data):
    k = max(k - k % align, align, slices * 32 * chunks - 31)     # every K slice gets a k step
    k += -k % align
    vector = 2 if n % 2 == 0 and align >= 2 else 1
    kernel = direct((bm, 8 * wn * ni, 32 * chunks), wn, stages, align, vector,
                    swizzle=Swizzle(None, raster, group),
                    splitk=SplitK("split_k", slices, "block") if slices > 1 else None)
    try:
        verify(kernel)
    except VerifyError:
        return                   # e.g. over the register budget
    res, ok = _run(kernel, (m, n, k), data.draw(st.integers(0, 2 ** 16)))
    assert ok and (res.c_writes == 1).all()


def test_planted_word_swap_gives_a_wrong_sum(monkeypatch):
    """A and B taking their registers' words by different tables multiply different K elements."""
    monkeypatch.setattr(DirectFeed, "B_WORD", (1, 0))
    _, ok = _run(direct((16, 32, 64)), (16, 32, 64))
    assert not ok


def test_planted_fragment_position_is_caught(monkeypatch):
    monkeypatch.setattr(DirectFeed, "A_KPOS", (0, 0, 0, 8))
    with pytest.raises(InterpError, match="K positions"):
        _run(direct((16, 32, 64)), (16, 32, 64))


def test_planted_chunk_stride_is_caught(monkeypatch):
    from l2ir.indexing import Q, STEP, U

    monkeypatch.setattr(DirectFeed, "chunk_k", classmethod(lambda cls, bk: STEP * bk + U * 32 + Q * 4))
    with pytest.raises(InterpError, match="K vector"):
        _run(direct((16, 32, 64)), (16, 32, 64))


def test_planted_realign_offset_is_caught(monkeypatch):
    from l2ir.indexing import ELEM

    monkeypatch.setattr(DirectFeed, "realign_offset", staticmethod(lambda: ELEM & 3))
    with pytest.raises(InterpError, match="not 16-byte aligned"):
        _run(direct((16, 32, 64), align=1, vector=1), (17, 33, 333))


def test_planted_slice_steps_are_caught(monkeypatch):
    """Slices that take the same k step twice (or skip one) must not pass as a sum."""
    from l2ir.indexing import SLICE, STEP_I

    monkeypatch.setattr(DirectFeed, "slice_step", staticmethod(lambda slices: SLICE * 0 + STEP_I * slices))
    with pytest.raises(InterpError, match="k step"):
        _run(direct((8, 32, 64), splitk=SplitK("split_k", 2, "block")), (3, 32, 256))


def test_split_blocks_take_their_threads_and_shared_memory():
    k = direct((8, 32, 128), splitk=SplitK("split_k", 4, "block"))
    assert threads(k) == 512 and smem_bytes(k) == 3 * 4 * 32 * 4 * 4
    (launch,) = lower(k, PROBLEM).launches
    assert launch.block == (512, 1, 1) and launch.smem == smem_bytes(k)
    with pytest.raises(VerifyError, match="without a k step"):
        from l2ir.verify import check_problem
        check_problem(k, PROBLEM.with_shape(1, 64, 3 * 128))


def test_upper_vector_only_inside_the_row():
    """The last row's upper vector would start past the operand: realign_needs_upper must not load it."""
    assert not DirectFeed.realign_needs_upper(0, 0, 8)          # aligned: one vector
    assert DirectFeed.realign_needs_upper(3, 0, 8)              # elements 5.. of the row are in the upper vector
    assert not DirectFeed.realign_needs_upper(3, 0, 5)          # the row ends inside the lower vector
    res, ok = _run(direct((8, 32, 64), align=1, vector=1), (1, 3, 5))
    assert ok and (res.c_writes == 1).all()


def test_rendered_source_follows_the_tables(monkeypatch):
    """The words each register takes come from DirectFeed: a planted table changes the generated code."""
    k, p = CASES["8x32x256_w1x4_s2_decode"]
    before = lower(k, p).source
    monkeypatch.setattr(DirectFeed, "B_WORD", (1, 0))
    assert lower(k, p).source != before


# ---------------------------------------------------------------------------------------------------------------
# nvcc builds.
# ---------------------------------------------------------------------------------------------------------------


# The sweep's realigned kernels too: the realign temporaries are what the register estimate undercounts.
SWEEP_ALIGN1 = {f"sweep:{name}": (k.replace(target=Target("sm90a")), ODD_K)
                for name, k in load_sweep("cuda_ptx_direct").items() if k.pad.align < 8}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return build_all({name: lower(*case) for name, case in {**CASES, **SWEEP_ALIGN1}.items()},
                     tmp_path_factory.mktemp("cache"))


@pytest.mark.nvcc
@pytest.mark.parametrize("name", list(CASES) + list(SWEEP_ALIGN1))
def test_nvcc_builds_without_spills(builds, name):
    b = built(builds[name], name)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", b.log)
    assert spills and all(s == ("0", "0") for s in spills), f"register spills: {spills}"
    ptx = b.ptx()
    assert ptx and "mma.sync.aligned.m16n8k16" in ptx
    # Operands never pass through shared memory; a K split only adds its accumulators there once.
    shared = len(re.findall(r"(?:ld|st)\.shared", ptx))
    k, _ = {**CASES, **SWEEP_ALIGN1}[name]
    assert (shared == 0) == (k.splitk is None), shared
    assert not re.search(r"(?:ld|st)\.local", ptx), "local-memory array"


if __name__ == "__main__":
    GOLDENS.main(sys.argv[1:], __doc__)


def test_policies_propose_from_a_direct_parent_without_crashing():
    """A direct kernel as the parent: the rules and random edits propose children (illegal ones are the verifier's
    to refuse; the verifier's rules must not crash on a direct kernel whose other fields are illegal, e.g.
    stages=auto)."""
    from l2ir.policy.base import Context
    from l2ir.policy.random_edits import RandomEdits
    from l2ir.policy.rules import Rules

    parent = load_sweep("cuda_ptx_direct")["direct_16x32x64_w1x4_s2_align1"]
    made = 0
    for problem in (PROBLEM, ODD_K):
        for s in range(3):
            made += len(Rules().propose(Context(problem, parent, seed=s, count=8, arch="sm90a")))
            made += len(RandomEdits().propose(Context(problem, parent, seed=s, count=16, arch="sm80")))
    assert made > 0
    auto = parent.replace(pipeline=Pipeline("direct", "auto"))
    with pytest.raises(PipelineError, match="stages=1..4"):
        verify(auto)


def test_rules_propose_the_direct_decode_kernel_where_it_won():
    """M <= 8 rows with 16-byte rows and K long enough for 4 slices: the rules propose the measured winner (it ran
    1x4096x4096 at 1.25x torch), then its four-stage variant; 9 rows, an odd K or a short K get no direct
    proposal."""
    from l2ir.policy.base import Context
    from l2ir.policy.rules import Rules, direct_decode_kernel
    from l2ir.seed import seed

    def direct_children(shape, arch="sm90a"):
        p = Problem(*shape)
        parent = seed(p, arch)
        children = [x.apply(parent, p) for x in Rules().propose(Context(p, parent, seed=0, count=8, arch=arch))]
        return [c for c in children if c.pipeline.mode == "direct"]

    got, deep = direct_children((1, 4096, 4096))
    assert got == direct_decode_kernel(PROBLEM, "sm90a") == load_sweep("cuda_ptx_direct")[
        "direct_8x32x128_w1x4_s2_k4"].replace(target=Target("sm90a"))
    assert deep == direct_decode_kernel(PROBLEM, "sm90a", deep=True) == load_sweep("cuda_ptx_direct")[
        "direct_8x32x64_w1x4_s4_k4"].replace(target=Target("sm90a"))
    assert verify(deep) is deep
    assert direct_children((8, 4096, 4096), "sm80")
    assert not direct_children((9, 4096, 4096)) and not direct_children((1, 4096, 4097))
    assert not direct_children((1, 4096, 256))


# ---------------------------------------------------------------------------------------------------------------
# Whole kernels on the host (tests/sm80_block_emulation.cpp.in, shared with the sm80 rule): every block and thread,
# the global vector loads checked for alignment and bounds, C compared bit for bit with the correctly rounded
# product. This checks what the interpreter does not model: the register sets of the stage loop (which set holds
# which k step when it multiplies), the slices' shared-memory reduction and the masked stores.
# ---------------------------------------------------------------------------------------------------------------

HOST_RUNS = {
    "8x32x256_w1x4_s2_decode": [(1, 72, 600), (9, 40, 256)],
    "16x32x128_w1x4_s1_raster_along_m": [(17, 40, 296)],
    "16x32x64_w1x4_s2_align1_direct1": [(17, 45, 333)],
    "8x32x128_w1x4_s2_k4_decode": [(1, 40, 1096), (5, 34, 520)],
    "16x32x64_w1x4_s1_k3_align1_direct1": [(17, 45, 333)],
    "8x32x128_w1x4_s3_k2_decode": [(1, 40, 1096), (5, 34, 1536), (3, 8, 640)],
    "8x32x64_w1x4_s4_k4_decode": [(1, 40, 1096), (5, 34, 2048), (3, 8, 200)],
    "16x32x64_w1x4_s4_direct1": [(17, 45, 336), (3, 5, 72), (16, 32, 448)],
}


@pytest.mark.parametrize("name", list(HOST_RUNS))
def test_kernel_runs_right_on_the_host(tmp_path, name):
    from test_cuda_ptx_sm80 import run_on_host

    from l2ir.backends.cuda_ptx.direct import GEMM_ENTRY

    kernel, problem = CASES[name]
    run_on_host(tmp_path, name, kernel, problem, lower(kernel, problem), HOST_RUNS[name], GEMM_ENTRY,
                wrappers=("mma_16816", "ld_stream", "ld_cached"))
