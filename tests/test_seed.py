"""The seed generator gives a legal kernel that can run the problem, for every problem and target."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from l2ir.interp import error_bound, interpret, random_inputs, reference
from l2ir.nodes import ARCHS, Problem
from l2ir.seed import seed
from l2ir.verify import check_problem
from l2ir.testing import problems


@given(problems(max_dim=16384), st.sampled_from(ARCHS))
def test_seed_is_legal_and_applicable(problem, arch):
    kernel = seed(problem, arch)
    assert check_problem(kernel, problem) is kernel
    assert kernel.target.arch == arch
    # TMA needs 16-byte aligned rows (A and B loaded, C stored by TMA): aligned problems get the wgmma path, and so
    # does an odd K with M >= 64 in the class the repack kernels are generated for (A and B copied aligned first).
    from l2ir.seed import REPACK_MIN_M, cuda_ptx_lowered, alignment, store_vector
    repack = arch == "sm90a" and alignment(problem) < 8 and problem.m >= REPACK_MIN_M and cuda_ptx_lowered(problem)
    assert (kernel.mma.op == "wgmma") == (arch == "sm90a" and store_vector(problem) == 8 or repack)
    assert (kernel.repack is not None) == repack


@pytest.mark.parametrize("shape,arch,expect", [
    ((4096, 4096, 4096), "sm90a", ("wgmma", "pingpong", (128, 128, 64), None)),
    ((64, 16384, 512), "sm90a", ("wgmma", "pingpong", (64, 256, 64), None)),
    # 64 (resp. 4) output tiles cannot fill 132 SMs and K is long: stream-K spreads the K loop over the SMs.
    ((1000, 1000, 1000), "sm90a", ("wgmma", "cooperative", (128, 128, 64), "stream_k")),
    # M <= 64 with few tiles and a long K: 64x64 tiles, split in a cluster, one wave of blocks.
    ((64, 4096, 4096), "sm90a", ("wgmma", "pingpong", (64, 64, 64), "split_k")),
    ((1, 4096, 4096), "sm90a", ("wgmma", "pingpong", (64, 64, 64), "split_k")),
    ((64, 16384, 16384), "sm90a", ("wgmma", "pingpong", (64, 256, 64), None)),     # 256 tiles fill the SMs
    ((1001, 1000, 1000), "sm90a", ("wgmma", "cooperative", (128, 128, 64), "stream_k")),  # M is no leading dim
    # 64 < M <= 128 with a long K: cooperative 128x64 tiles, split in two in a cluster, one wave of blocks.
    ((127, 4096, 4096), "sm90a", ("wgmma", "cooperative", (128, 64, 64), "split_k")),
    ((100, 3000, 4104), "sm90a", ("wgmma", "cooperative", (128, 64, 64), "split_k")),
    ((128, 8192, 8192), "sm90a", ("wgmma", "cooperative", (128, 128, 64), "stream_k")),    # 128 tiles: two waves
    # An odd K: A and B copied to aligned rows (repack), then TMA; by output size 64x64, 128x128 or 128x256 tiles.
    ((1000, 1000, 1001), "sm90a", ("wgmma", "cooperative", (128, 128, 64), None)),
    ((333, 555, 777), "sm90a", ("wgmma", "pingpong", (64, 64, 64), None)),
    ((4096, 4096, 1001), "sm90a", ("wgmma", "cooperative", (128, 256, 64), None)),
    ((17, 9999, 3333), "sm90a", ("mma_sync", "none", (64, 128, 32), None)),   # skinny M: the copy of B costs more
    ((1000, 1000, 1001), "sm80", ("mma_sync", "none", (128, 128, 64), "split_k")),  # the sm80 target: narrow loads
    ((4096, 4096, 4096), "sm80", ("mma_sync", "none", (128, 128, 64), None)),
    ((128, 128, 8192), "sm80", ("mma_sync", "none", (64, 128, 32), "split_k")),
    ((4096, 256, 256), "sm80", ("mma_sync", "none", (64, 128, 32), None)),
    ((64, 48, 64), "sm80", ("mma_sync", "none", (64, 64, 32), None)),
])
def test_seed_regimes(shape, arch, expect):
    k = seed(Problem(*shape), arch)
    split = k.splitk.mode if k.splitk else None
    assert (k.mma.op, k.pipeline.schedule, k.tile.block, split) == expect


def test_seed_coop_split_computes_the_product_and_keeps_to_its_problem_class():
    """The cooperative 128x64 cluster split seed (64 < M <= 128; 33 tiles x 2 slices here) computes the product in the
    interpreter; a B stored K x N (not the raw-PTX kernels' K-major B) keeps the CUTLASS stream-K seed."""
    p = Problem(65, 2112, 512)
    k = seed(p, "sm90a")
    assert (k.tile.block, k.splitk.slices, k.splitk.reduce) == ((128, 64, 64), 2, "cluster")
    a, b = random_inputs(p, np.random.default_rng(1))
    c = interpret(k, p, a, b).c.astype(np.float64)
    assert np.all(np.abs(c - reference(a, b)) <= error_bound(p, a, b))
    row_b = Problem(65, 2112, 512, b=("f16", "row"))
    assert seed(row_b, "sm90a").splitk.mode == "stream_k"


def test_seed_cluster_split_for_m_up_to_64_computes_the_product_and_keeps_to_its_problem_class():
    """The 64x64 cluster split seed (M <= 64: 33 tiles here, split so the blocks near one wave) computes the product
    in the interpreter; a B stored K x N (not the raw-PTX kernels' K-major B) keeps the CUTLASS stream-K seed."""
    p = Problem(3, 2112, 1024)
    k = seed(p, "sm90a")
    assert (k.tile.block, k.splitk.reduce) == ((64, 64, 64), "cluster") and k.splitk.slices in (2, 4)
    a, b = random_inputs(p, np.random.default_rng(2))
    c = interpret(k, p, a, b).c.astype(np.float64)
    assert np.all(np.abs(c - reference(a, b)) <= error_bound(p, a, b))
    assert seed(Problem(3, 2112, 1024, b=("f16", "row")), "sm90a").splitk.mode == "stream_k"
    # The seed is, byte for byte, the sweep configuration its measurements name (l2ir.seed.cluster_split_kernel).
    from l2ir.search.sweeps import load_sweep

    sweep = load_sweep("cuda_ptx")
    for shape, config in (((1, 4096, 4096), "ptx_splitk_cluster_w4x1_64x64x64_s2"),
                          ((64, 2048, 8192), "ptx_splitk_cluster_w4x1_64x64x64_s4"),
                          ((64, 256, 2048), "ptx_splitk_cluster_w4x1_64x64x64_s8")):
        assert seed(Problem(*shape), "sm90a").content_hash() == sweep[config].content_hash(), shape


@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (67, 131, 257), (200, 64, 512), (96, 200, 40)])
def test_seed_computes_the_product(arch, shape):
    p = Problem(*shape)
    a, b = random_inputs(p, np.random.default_rng(0))
    c = interpret(seed(p, arch), p, a, b).c.astype(np.float64)
    assert np.all(np.abs(c - reference(a, b)) <= error_bound(p, a, b))
