"""The reference interpreter equals float64 A @ B for every generated kernel/problem pair, exactly on small
integers, and catches schedules that do not write every element exactly once."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import l2ir.interp as interp_mod
from l2ir.errors import InterpError, PadError
from l2ir.interp import error_bound, interpret, random_inputs, reference
from l2ir.nodes import Problem, SplitK
from l2ir.testing import kernel_problem_pairs
from l2ir.text import parse_kernel

SM80 = parse_kernel(open("examples/sm80_128x128x32.l2").read())
SM90 = parse_kernel(open("examples/sm90a_cooperative_128x256x64.l2").read())


def _check(kernel, problem, seed, integers=False):
    rng = np.random.default_rng(seed)
    a, b = random_inputs(problem, rng, integers=integers)
    result = interpret(kernel, problem, a, b, workers=7)
    assert (result.c_writes == 1).all()
    c = result.c.astype(np.float64)
    ref = reference(a, b)
    if integers:
        np.testing.assert_array_equal(c, ref)
    else:
        err = np.abs(c - ref)
        bound = error_bound(problem, a, b)
        assert np.all(err <= bound), float(np.max(err / bound))
    return result


@given(kernel_problem_pairs(max_dim=200), st.integers(0, 2 ** 32 - 1))
def test_interpreter_matches_reference(pair, seed):
    kernel, problem = pair
    _check(kernel, problem, seed)


@given(kernel_problem_pairs(max_dim=200), st.integers(0, 2 ** 32 - 1))
def test_interpreter_is_exact_on_small_integers(pair, seed):
    kernel, problem = pair
    _check(kernel, problem, seed, integers=True)


@pytest.mark.parametrize("shape", [(1, 1, 1), (127, 129, 67), (257, 31, 300), (128, 256, 64)])
@pytest.mark.parametrize("kernel", [SM80, SM90, SM80.replace(splitk=SplitK("split_k", 2)),
                                    SM90.replace(splitk=SplitK("stream_k"))], ids=["sm80", "sm90", "splitk", "streamk"])
def test_examples_on_ragged_shapes(kernel, shape):
    problem = Problem(*shape)
    if shape[2] % 8 or shape[1] % 8:
        problem = dataclasses.replace(problem, k=shape[2] + (-shape[2]) % 8, n=shape[1] + (-shape[1]) % 8)
    if kernel.splitk is not None and kernel.splitk.mode == "split_k" and -(-problem.k // kernel.tile.bk) < 2:
        problem = problem.with_shape(problem.m, problem.n, 64)
    _check(kernel, problem, 0)


def test_fp16_accumulation_is_measurably_worse():
    """With fp16 accumulation every MMA rounds its running sum; at K=4096 that error dwarfs fp32's."""
    p32 = Problem(64, 64, 4096)
    p16 = dataclasses.replace(p32, acc="f16")
    rng = np.random.default_rng(1)
    a, b = random_inputs(p32, rng)
    ref = reference(a, b)
    kernel = SM80.replace(tile=dataclasses.replace(SM80.tile, block=(64, 64, 32)))
    rel = {}
    for p in (p32, p16):
        c = interpret(kernel, p, a, b).c.astype(np.float64)
        rel[p.acc] = np.linalg.norm(c - ref) / np.linalg.norm(ref)
        assert np.all(np.abs(c - ref) <= error_bound(p, a, b))
    assert rel["f16"] > 3 * rel["f32"], rel
    # ... and an fp16-accumulated result fails the fp32 contract's bound.
    c16 = interpret(kernel, p16, a, b).c.astype(np.float64)
    assert not np.all(np.abs(c16 - ref) <= error_bound(p32, a, b))


def test_divisible_padding_rejects_ragged_problems():
    kernel = SM80.replace(pad=dataclasses.replace(SM80.pad, m="divisible"))
    p = Problem(100, 128, 64)
    with pytest.raises(PadError, match="requires m % 128 == 0"):
        interpret(kernel, p, *random_inputs(p, np.random.default_rng(0)))


def test_predicate_padding_masks_poison():
    """Under predicate padding the slots past M/N/K hold NaN poison: a correct result proves it never leaks."""
    kernel = SM80.replace(pad=dataclasses.replace(SM80.pad, k="predicate"))
    _check(kernel, Problem(33, 40, 24), 3)


def test_broken_rasterization_is_caught(monkeypatch):
    """A rasterization that sends two blocks to one tile leaves another unwritten: the interpreter says so."""
    from l2ir.indexing import Var

    monkeypatch.setattr(interp_mod, "rasterize", lambda order, group: (Var("pid") // Var("tiles_n") // 2 * 2,
                                                                       Var("pid") % Var("tiles_n")))
    p = Problem(256, 128, 64)
    with pytest.raises(InterpError, match="written a wrong number of times"):
        interpret(SM80, p, *random_inputs(p, np.random.default_rng(0)))


def test_broken_splitk_partition_is_caught(monkeypatch):
    from l2ir.indexing import Var, emin

    # Every slice starts one k tile late: tile 0 is never accumulated.
    monkeypatch.setattr(interp_mod, "splitk_range",
                        lambda s: (emin(Var("slice") * 2 + 1, Var("k_tiles")), emin(Var("slice") * 2 + 2,
                                                                                   Var("k_tiles"))))
    kernel = SM80.replace(splitk=SplitK("split_k", 2))
    p = Problem(128, 128, 128)
    with pytest.raises(InterpError, match="k tiles"):
        interpret(kernel, p, *random_inputs(p, np.random.default_rng(0)))


def test_non_bijective_swizzle_is_caught(monkeypatch):
    from l2ir.indexing import Var

    monkeypatch.setattr(interp_mod, "smem_swizzle", lambda b, m, s: Var("offset") // 2)
    kernel = SM80.replace(swizzle=dataclasses.replace(SM80.swizzle or __import__("l2ir.nodes").nodes.Swizzle(),
                                                      smem=(2, 3, 3)))
    p = Problem(64, 64, 64)
    with pytest.raises(InterpError, match="does not permute"):
        interpret(kernel, p, *random_inputs(p, np.random.default_rng(0)))


def test_source_kernels_are_not_interpreted():
    k = parse_kernel(open("examples/source_naive.l2").read())
    p = Problem(16, 16, 16)
    with pytest.raises(InterpError, match="GPU evaluator"):
        interpret(k, p, *random_inputs(p, np.random.default_rng(0)))


def test_broken_stage_ring_gives_a_wrong_product(monkeypatch):
    """The producer runs stages-1 tiles ahead, so a ring that ignores its slot index consumes the wrong k tile."""
    p = Problem(64, 64, 256)
    a, b = random_inputs(p, np.random.default_rng(0), integers=True)
    good = interpret(SM80, p, a, b).c
    np.testing.assert_array_equal(good.astype(np.float64), reference(a, b))
    store, load = interp_mod._Ring.store, interp_mod._Ring.load
    monkeypatch.setattr(interp_mod._Ring, "store", lambda self, slot, tile: store(self, 0, tile))
    monkeypatch.setattr(interp_mod._Ring, "load", lambda self, slot: load(self, 0))
    bad = interpret(SM80, p, a, b).c
    assert not np.array_equal(bad.astype(np.float64), reference(a, b))


@pytest.mark.parametrize("stages", [1, 2, 3, 7])
def test_every_stage_count_is_exact(stages):
    kernel = SM80.replace(pipeline=dataclasses.replace(SM80.pipeline, stages=stages))
    _check(kernel, Problem(96, 72, 200), 5, integers=True)
