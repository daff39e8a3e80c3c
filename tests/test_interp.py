"""The reference interpreter equals float64 A @ B for every generated kernel/problem pair, exactly on small
integers, and catches schedules that do not write every element exactly once."""

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import l2ir.interp as interp_mod
from l2ir.errors import InterpError, L2IRError, PadError
from l2ir.interp import error_bound, interpret, random_inputs, reference
from l2ir.indexing import BASE, LEVEL, Const, Var
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
    from l2ir.indexing import BASE, LEVEL, Const, Var

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
    from l2ir.indexing import BASE, LEVEL, Const, Var

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


# ---------------------------------------------------------------------------------------------------------------
# Split-K: the pairwise tree (l2ir.indexing.SplitKTree) the backends reduce with, its write pattern and its bits.
# ---------------------------------------------------------------------------------------------------------------

SPLITK_SM90 = SM90.replace(splitk=SplitK("split_k", 2))


@pytest.mark.parametrize("slices", [2, 3, 5, 8, 16])
def test_splitk_tree_is_exact_and_writes_the_tree_pattern(slices):
    """Ragged M and N, every slice count the sm90a sweep uses (and the non-powers of two): exact on small integers,
    C written once, each workspace slot exactly SplitKTree.slot_writes() times, counters left at zero."""
    from l2ir.indexing import SplitKTree

    kernel = SPLITK_SM90.replace(splitk=SplitK("split_k", slices))
    problem = Problem(130, 264, 64 * (2 * slices - 1) - 24)    # 2S - 1 k tiles, the last one ragged
    result = _check(kernel, problem, slices, integers=True)
    want = SplitKTree(slices).slot_writes()
    for s in range(slices):
        assert (result.workspace_writes[s] == want[s]).all(), s


def test_splitk_tree_gives_the_same_bits_in_any_arrival_order(monkeypatch):
    """Whichever block of a pair arrives last, fp32 addition commutes: C has the same bits in launch order, reversed
    and shuffled, and they are the bits of the tree's sum of the slices' partials, not of their serial sum. Each
    slice's block of A and B is scaled by its own power of two, so every partial is exact in fp32 (small integers
    times 2^e) while their sum rounds, and the order of the additions shows in the fp32 output."""
    from l2ir.indexing import SplitKTree

    slices, bk = 5, 64
    problem = Problem(100, 136, bk * slices, c=("f32", "row"))
    kernel = SPLITK_SM90.replace(splitk=SplitK("split_k", slices),
                                 epilogue=dataclasses.replace(SM90.epilogue, path="direct", vector=2))
    a, b = random_inputs(problem, np.random.default_rng(4), integers=True)
    scale = np.repeat(2.0 ** np.array([12, -12, 0, 6, -6]), bk)
    a = (a.astype(np.float64) * scale[None, :]).astype(a.dtype)
    b = (b.astype(np.float64) * scale[:, None]).astype(b.dtype)
    first = interpret(kernel, problem, a, b)
    parts = [(a[:, bk * s:bk * (s + 1)].astype(np.float64) @ b[bk * s:bk * (s + 1)].astype(np.float64))
             .astype(np.float32) for s in range(slices)]
    tree = SplitKTree(slices).reduce(parts)
    serial = parts[0]
    for part in parts[1:]:
        serial = serial + part
    assert first.c.tobytes() == tree.tobytes()
    assert not np.array_equal(tree, serial)    # the scales make the order show
    for order in (lambda n: range(n - 1, -1, -1), lambda n: np.random.default_rng(9).permutation(n).tolist()):
        monkeypatch.setattr(interp_mod, "_splitk_arrivals", order)
        again = interpret(kernel, problem, a, b)
        assert again.c.tobytes() == first.c.tobytes()
        np.testing.assert_array_equal(again.workspace_writes, first.workspace_writes)


def _broken_tree(**exprs):
    from l2ir.indexing import SplitKTree

    return type("BrokenTree", (SplitKTree,), {name: property(lambda self, e=e: e) for name, e in exprs.items()})


@pytest.mark.parametrize("broken,match", [
    # The last arrival keeps its own slot for the pair's sum (merged = base) instead of the lower subtree's: the
    # right blocks still meet on the right counters, but the sums land in and are read from the wrong slots.
    ({"merged": lambda bit, base: base,
      "counter": lambda bit, base: ((base >> (LEVEL + 1)) << (LEVEL + 1)) + bit - 1},
     "workspace written a wrong number of times"),
    # One counter per level: two pairs of a level share a node, so a block takes another pair's arrival for its
    # sibling's (the interleaved arrival order below shows it) and a counter is left behind.
    ({"counter": lambda bit, base: Var("level")}, "left non-zero|written a wrong number of times"),
], ids=["sum_kept_in_own_slot", "counter_per_level"])
def test_broken_splitk_tree_is_caught(monkeypatch, broken, match):
    """A tree protocol that writes the workspace in another pattern than SplitKTree.slot_writes, or leaves a counter
    behind, fails the interpreter's checks."""
    bit = Const(1) << LEVEL
    monkeypatch.setattr(interp_mod, "SplitKTree", _broken_tree(**{k: f(bit, BASE) for k, f in broken.items()}))
    monkeypatch.setattr(interp_mod, "_splitk_arrivals", lambda n: [0, 2, 1, 3])
    kernel = SPLITK_SM90.replace(splitk=SplitK("split_k", 4))
    p = Problem(128, 256, 256)     # one output tile: the units are the four slices
    with pytest.raises(InterpError, match=match):
        interpret(kernel, p, *random_inputs(p, np.random.default_rng(0), integers=True))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 33), st.integers(1, 150), st.integers(1, 75), st.integers(0, 3), st.randoms(use_true_random=False))
def test_splitk_tree_fuzzed(slices, m, n_half, k_extra, rnd):
    """Any slice count (powers of two or not), ragged M, N and K tails, any arrival order: exact on small integers
    (a read of a slot no block has written yet would bring its NaN poison), the tree's workspace pattern, counters
    back at zero (else InterpError), the same bits in a shuffled arrival order."""
    from l2ir.indexing import SplitKTree
    from l2ir.search.sweeps import load_sweep

    kernel = load_sweep("cuda_ptx")["ptx_splitk_w4x1_64x64x64_s8_st4"].replace(splitk=SplitK("split_k", slices))
    k_tiles = slices + k_extra * (slices - 1)         # every slice owns a k tile
    problem = Problem(m, 2 * n_half, 64 * k_tiles - 8 * rnd.randrange(8))
    rng = np.random.default_rng(rnd.randrange(2 ** 32))
    a, b = random_inputs(problem, rng, integers=True)
    first = interpret(kernel, problem, a, b)
    np.testing.assert_array_equal(first.c.astype(np.float64), reference(a, b))
    want = np.array(SplitKTree(slices).slot_writes())[:, None, None]
    np.testing.assert_array_equal(first.workspace_writes, np.broadcast_to(want, first.workspace_writes.shape))
    order = list(range(slices * -(-m // 64) * -(-problem.n // 64)))
    rnd.shuffle(order)
    saved = interp_mod._splitk_arrivals
    interp_mod._splitk_arrivals = lambda units: order
    try:
        again = interpret(kernel, problem, a, b)
    finally:
        interp_mod._splitk_arrivals = saved
    assert again.c.tobytes() == first.c.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Split-K in a thread-block cluster (l2ir.indexing.ClusterReduce): each block stores its share, the sum in slice
# order.
# ---------------------------------------------------------------------------------------------------------------

def _cluster_kernel(slices, block=(64, 64, 64), warps=(4, 1), schedule="pingpong"):
    from l2ir.search.sweeps import load_sweep

    base = load_sweep("cuda_ptx")["ptx_splitk_cluster_w4x1_64x64x64_s8"]
    return base.replace(tile=dataclasses.replace(base.tile, block=block, warps=warps),
                        mma=dataclasses.replace(base.mma, shape=(64, block[1], 16)),
                        pipeline=dataclasses.replace(base.pipeline, schedule=schedule),
                        splitk=SplitK("split_k", slices, "cluster"))


def test_cluster_reduction_sums_in_slice_order():
    """C has the bits of partials[0] + partials[1] + ... in slice order (ClusterReduce.reduce), not the pairwise
    tree's: each slice's block of A and B is scaled by its own power of two, so every partial is exact in fp32 while
    their sum rounds, and the order of the additions shows in the fp32 output. No workspace is written."""
    from l2ir.indexing import ClusterReduce, SplitKTree

    slices, bk = 5, 64
    problem = Problem(100, 136, bk * slices, c=("f32", "row"))
    kernel = _cluster_kernel(slices)
    a, b = random_inputs(problem, np.random.default_rng(4), integers=True)
    scale = np.repeat(2.0 ** np.array([12, -12, 0, 6, -6]), bk)
    a = (a.astype(np.float64) * scale[None, :]).astype(a.dtype)
    b = (b.astype(np.float64) * scale[:, None]).astype(b.dtype)
    result = interpret(kernel, problem, a, b)
    parts = [(a[:, bk * s:bk * (s + 1)].astype(np.float64) @ b[bk * s:bk * (s + 1)].astype(np.float64))
             .astype(np.float32) for s in range(slices)]
    serial = ClusterReduce(slices).reduce(parts)
    assert result.c.tobytes() == serial.tobytes()
    assert not np.array_equal(serial, SplitKTree(slices).reduce(parts))    # the scales make the order show
    assert result.workspace_writes is None and (result.c_writes == 1).all()


@pytest.mark.parametrize("block,warps,schedule", [((64, 64, 64), (4, 1), "pingpong"),
                                                  ((128, 128, 64), (8, 1), "cooperative")])
def test_cluster_owner_shares_every_fragment_once(block, warps, schedule):
    """Every element of a tile has exactly one owner in 0..slices-1, each owner an equal share when slices divides
    the fragment units, and whole 8-column groups go to one owner (the epilogue's vector stores never straddle two)."""
    from l2ir.indexing import ClusterReduce

    bm, bn, _ = block
    wg_m = bm // (warps[0] // 4)
    rows, cols = np.arange(bm)[:, None], np.arange(bn)[None, :]
    fragment = ClusterReduce.fragment_of(wg_m, bn).eval({"row": rows, "col": cols})
    assert fragment.min() == 0 and fragment.max() == (wg_m // 64) * (bn // 8) - 1
    for slices in (2, 4, 8):
        owner = ClusterReduce(slices).owner.eval({"fragment": fragment})
        counts = np.bincount(owner.ravel(), minlength=slices)
        assert len(counts) == slices and (counts == bm * bn // slices).all(), counts
        assert (owner.reshape(bm, bn // 8, 8) == owner[:, ::8][:, :, None]).all()


@pytest.mark.parametrize("wg_m,bn", [(64, 64), (64, 256), (128, 128), (64, 96)])
def test_cluster_unit_of_the_backend_is_the_interpreters_fragment(wg_m, bn):
    """The backend renders ClusterReduce.unit over its loop variables (slab j, 8-column group c) in the partial's
    store, its remote read and the epilogue; the interpreter maps tile elements with fragment_of. They must agree on
    every element: each element of slab j, group c has fragment unit(j, c), and the units number 0..n-1 once each."""
    from l2ir.indexing import ClusterReduce

    rows, cols = np.arange(wg_m)[:, None], np.arange(bn)[None, :]
    of = ClusterReduce.fragment_of(wg_m, bn).eval({"row": rows, "col": cols})
    unit = ClusterReduce.unit(bn).eval({"j": rows // 64, "c": cols // 8})
    np.testing.assert_array_equal(of, unit)
    slabs, groups = np.meshgrid(np.arange(wg_m // 64), np.arange(bn // 8), indexing="ij")
    units = ClusterReduce.unit(bn).eval({"j": slabs, "c": groups})
    assert sorted(units.ravel().tolist()) == list(range((wg_m // 64) * (bn // 8)))


@pytest.mark.parametrize("owner", [
    Var("fragment") % 4 + 1,      # off by one: rank 4 does not exist
    Var("fragment") % 8,          # ranks 4..7 do not exist
], ids=["owner_off_by_one", "owners_outside_the_cluster"])
def test_broken_cluster_ownership_is_caught(monkeypatch, owner):
    """An ownership map that gives fragment units to ranks the cluster does not have: no block stores those
    elements of C, and rank 0 receives fewer bytes than its mbarrier expects for its round-robin share (the kernel
    would hang there); the interpreter says so."""
    from l2ir.indexing import ClusterReduce

    broken = type("BrokenCluster", (ClusterReduce,), {"owner": property(lambda self: owner)})
    monkeypatch.setattr(interp_mod, "ClusterReduce", broken)
    kernel = _cluster_kernel(4)
    p = Problem(128, 256, 512)
    with pytest.raises(InterpError, match="block 0 receives .* bytes, its mbarrier expects"):
        interpret(kernel, p, *random_inputs(p, np.random.default_rng(0), integers=True))


@pytest.mark.parametrize("method,replacement,match", [
    # every sender onto the owner's first row: the pushes of two senders collide
    ("receive_vec", lambda self, units, threads: (Var("fragment") // self.slices) * threads + Var("ct"),
     "two pushes land on one float"),
    # the sender row by rank, not after the owner: the last rank's row lies past the buffer
    ("receive_vec", lambda self, units, threads: (Var("sender") * self.share(units) + Var("fragment") // self.slices)
     * threads + Var("ct"), "pushes outside block .* receive buffer"),
    # the whole tile expected, not the owned share: the phase would never complete
    ("receive_bytes", lambda self, units, threads: Const(units * (self.slices - 1) * threads * 16),
     "mbarrier expects"),
], ids=["rows_collide", "row_by_rank", "expects_the_tile"])
def test_broken_cluster_push_is_caught(monkeypatch, method, replacement, match):
    """The receive buffer's layout and the mbarrier's byte count are the push's index arithmetic: a layout that
    puts two pushes on one float (a race), one that writes past the buffer, or an expected byte count other than
    what arrives (a hang, or a phase that completes before the data) is an InterpError."""
    from l2ir.indexing import ClusterReduce

    broken = type("BrokenPush", (ClusterReduce,), {method: replacement})
    monkeypatch.setattr(interp_mod, "ClusterReduce", broken)
    kernel = _cluster_kernel(4)
    p = Problem(128, 256, 512)
    with pytest.raises(InterpError, match=match):
        interpret(kernel, p, *random_inputs(p, np.random.default_rng(0), integers=True))


@pytest.mark.parametrize("slices", [2, 3, 8, 16])
@pytest.mark.parametrize("wg_m,bn,warpgroups", [(64, 64, 1), (64, 256, 1), (64, 128, 2), (64, 96, 1)])
def test_cluster_receive_buffer_is_filled_exactly(slices, wg_m, bn, warpgroups):
    """Over every sender and the units each owner owns, receive_vec puts each float4 at its own place in the
    owner's buffer (none twice), consecutive threads at consecutive float4s (the pushes coalesce), and the bytes
    that land are receive_bytes, what the owner's mbarrier expects; `owned` counts the units `owner` gives it."""
    from l2ir.indexing import ClusterReduce

    cr, threads = ClusterReduce(slices), 128 * warpgroups
    units = (wg_m // 64) * (bn // 8)
    for owner in range(slices):
        owned = [u for u in range(units) if int(cr.owner.eval({"fragment": u})) == owner]
        assert len(owned) == int(cr.owned(units).eval({"slice": owner}))
        hits = np.zeros(cr.receive_vecs(units, threads), dtype=int)
        for sender in set(range(slices)) - {owner}:
            for u in owned:
                vecs = cr.receive_vec(units, threads).eval(
                    {"sender": sender, "owner": owner, "fragment": u, "ct": np.arange(threads)})
                assert (np.diff(vecs) == 1).all()
                hits[vecs] += 1
        assert hits.max(initial=0) <= 1
        assert 16 * hits.sum() == int(cr.receive_bytes(units, threads).eval({"slice": owner}))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 16), st.integers(1, 150), st.integers(1, 150), st.integers(0, 3), st.booleans(),
       st.randoms(use_true_random=False))
def test_cluster_reduction_fuzzed(slices, m, n_half, k_extra, coop, rnd):
    """Any cluster size, ragged M, N and K tails, one or two consumer warpgroups: exact on small integers, each
    element of C stored once by its owner."""
    kernel = (_cluster_kernel(slices, (128, 128, 64), (8, 1), "cooperative") if coop else _cluster_kernel(slices))
    k_tiles = slices + k_extra * (slices - 1)         # every slice owns a k tile
    problem = Problem(m, 2 * n_half, 64 * k_tiles - 8 * rnd.randrange(8))
    a, b = random_inputs(problem, np.random.default_rng(rnd.randrange(2 ** 32)), integers=True)
    result = interpret(kernel, problem, a, b)
    np.testing.assert_array_equal(result.c.astype(np.float64), reference(a, b))
    assert (result.c_writes == 1).all()


# ---------------------------------------------------------------------------------------------------------------
# Split-K inside one block (l2ir.indexing.BlockSplit): two consumer warpgroups, one ring, fragment ownership.
# ---------------------------------------------------------------------------------------------------------------

def _block_kernel(block=(64, 64, 64), stages=4):
    from l2ir.search.sweeps import load_sweep

    base = load_sweep("cuda_ptx")["ptx_splitk_block_64x64x64"]
    return base.replace(tile=dataclasses.replace(base.tile, block=block),
                        mma=dataclasses.replace(base.mma, shape=(64, block[1], 16)),
                        pipeline=dataclasses.replace(base.pipeline, stages=stages))


def test_block_reduction_adds_the_two_slices():
    """C has the bits of partial(slice 0) + partial(slice 1) over splitk_range's two k ranges, not of one
    accumulation over all k tiles: slice 0's k tiles are scaled by 2^12 and slice 1's by 2^-12, so each partial is
    exact in fp32 and only their sum rounds. No workspace is written."""
    bk, k_tiles = 64, 5          # slice 0: tiles 0-2, slice 1: tiles 3-4
    problem = Problem(100, 136, bk * k_tiles, c=("f32", "row"))
    a, b = random_inputs(problem, np.random.default_rng(5), integers=True)
    scale = np.repeat(2.0 ** np.array([12, 12, 12, -12, -12]), bk)
    a = (a.astype(np.float64) * scale[None, :]).astype(a.dtype)
    b = (b.astype(np.float64) * scale[:, None]).astype(b.dtype)
    result = interpret(_block_kernel(), problem, a, b)
    parts = [(a[:, lo:hi].astype(np.float64) @ b[lo:hi].astype(np.float64)).astype(np.float32)
             for lo, hi in ((0, 3 * bk), (3 * bk, 5 * bk))]
    assert result.c.tobytes() == (parts[0] + parts[1]).tobytes()
    assert result.workspace_writes is None and (result.c_writes == 1).all()
    assert result.k_ranges[(0, 0)] == [(0, 3), (3, 5)]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(64, 64, 64), (64, 48, 64), (128, 64, 64), (64, 128, 64)]), st.sampled_from([4, 6, 8]),
       st.integers(1, 150), st.integers(1, 150), st.integers(2, 40), st.integers(0, 7),
       st.randoms(use_true_random=False))
def test_block_reduction_fuzzed(block, stages, m, n_half, k_tiles, k_short, rnd):
    """Any legal ring depth (even, from 4), ragged M, N and K tails, an even or odd count of k tiles (slice 0 then
    has one more): exact on small integers, each element of C stored once by the warpgroup that owns it, every k
    tile accumulated once."""
    kernel = _block_kernel(block, stages)
    problem = Problem(m, 2 * n_half, 64 * k_tiles - 8 * k_short)
    a, b = random_inputs(problem, np.random.default_rng(rnd.randrange(2 ** 32)), integers=True)
    result = interpret(kernel, problem, a, b)
    np.testing.assert_array_equal(result.c.astype(np.float64), reference(a, b))
    assert (result.c_writes == 1).all()


def test_block_reduction_needs_an_even_ring_of_four():
    """With two stages the release-after-next protocol deadlocks (the producer waits for a stage whose consumer
    waits for the producer's next load). With an odd ring a stage's phases alternate between the warpgroups, so
    one waits by parity on a phase whose predecessor, the other's load, it never saw land. The verifier refuses
    both rings, and the interpreter, run past it, raises for each; 4 and 6 stages run."""
    p = Problem(64, 64, 64 * 6)
    inputs = random_inputs(p, np.random.default_rng(0), integers=True)
    for stages in (2, 3, 5):
        with pytest.raises(L2IRError, match="even number of stages, at least 4"):
            interpret(_block_kernel(stages=stages), p, *inputs)
    sched = interp_mod._Schedule(_block_kernel(stages=2), p, *inputs)
    with pytest.raises(InterpError, match="deadlocks"):
        sched._block_split_partials(0, 0, {})
    for stages in (3, 5):
        sched.stages = stages
        with pytest.raises(InterpError, match="parity wait cannot tell"):
            sched._block_split_partials(0, 0, {})
    for stages in (4, 6):
        sched.stages = stages
        assert len(sched._block_split_partials(0, 0, {})) == 2


@pytest.mark.parametrize("position,match", [
    (Var("step") + Var("slice"), "not the producer's"),                 # the slices share positions
    (Var("step") * 2 + (Const(1) - Var("slice")), "expected k tile"),   # the slices' stages swapped
    (Var("step") * 2 + Var("slice") + 1, "not the producer's"),         # off by one: position 0 is never read
], ids=["shared_positions", "slices_swapped", "off_by_one"])
def test_broken_block_position_is_caught(monkeypatch, position, match):
    """A consumer position that disagrees with the producer's order of loads reads another k tile than its range
    says (or a stage nobody fills): the interpreter's ring remembers what it holds and raises."""
    from l2ir.indexing import BlockSplit

    broken = type("BrokenBlockSplit", (BlockSplit,), {"position": classmethod(lambda cls: position)})
    monkeypatch.setattr(interp_mod, "BlockSplit", broken)
    p = Problem(64, 64, 64 * 8)         # 8 k tiles: 4 a slice
    with pytest.raises(InterpError, match=match):
        interpret(_block_kernel(), p, *random_inputs(p, np.random.default_rng(0), integers=True))


# ---------------------------------------------------------------------------------------------------------------
# repack: the operand copy before the GEMM (l2ir.indexing.Repack).
# ---------------------------------------------------------------------------------------------------------------

def _repack_kernel(operands="ab"):
    from l2ir.nodes import Epilogue, Repack
    from l2ir.text import parse_kernel_file

    problem, kernel, _ = parse_kernel_file(open("examples/sm90a_repack_odd_k.l2").read())
    assert kernel.repack == Repack("ab") and problem.k % 8
    # Pairs of columns per store (the tests' N are even, not all multiples of 8).
    return kernel.replace(repack=Repack(operands), epilogue=Epilogue("direct", 2))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 150), st.integers(1, 150), st.integers(1, 300), st.sampled_from(["a", "b", "ab"]),
       st.sampled_from(["row", "col"]), st.sampled_from(["row", "col"]), st.integers(0, 2 ** 32 - 1))
def test_repack_fuzzed(m, n, k, operands, a_layout, b_layout, seed):
    """Any M, N, K and operand layout the verifier admits: exact on small integers; every element of each copy
    (pad columns included) written once, nothing else in the workspace; the workspace is the copies' size."""
    from hypothesis import assume
    from l2ir.indexing import Repack
    from l2ir.verify import applicable

    from l2ir.nodes import Epilogue

    kernel = _repack_kernel(operands).replace(epilogue=Epilogue("direct", 1))     # any N
    # An operand the node does not copy must be aligned already: round its leading dimension up to 8.
    dims = {"m": m, "n": n, "k": k}
    for op, lead in (("a", "k" if a_layout == "row" else "m"), ("b", "n" if b_layout == "row" else "k")):
        if op not in operands:
            dims[lead] = -(-dims[lead] // 8) * 8
    m, n, k = dims["m"], dims["n"], dims["k"]
    problem = Problem(m, n, k, a=("f16", a_layout), b=("f16", b_layout))
    assume(applicable(kernel, problem))
    a, b = random_inputs(problem, np.random.default_rng(seed), integers=True)
    result = interpret(kernel, problem, a, b)
    np.testing.assert_array_equal(result.c.astype(np.float64), reference(a, b))
    assert (result.c_writes == 1).all()
    rp = Repack(operands, a_layout, b_layout)
    env = {"m": m, "n": n, "k": k}
    assert result.repack_writes.size == int(rp.end.eval(env))
    copied = sum(rows * -(-cols // 8) * 8 for op, (rows, cols) in
                 (("A", (m, k) if a_layout == "row" else (k, m)), ("B", (k, n) if b_layout == "row" else (n, k)))
                 if op.lower() in operands and cols % 8)
    assert int(result.repack_writes.sum()) == copied and result.repack_writes.max(initial=0) <= 1


def test_repack_on_an_aligned_k_copies_nothing():
    p = Problem(70, 130, 256)
    result = interpret(_repack_kernel(), p, *random_inputs(p, np.random.default_rng(0), integers=True))
    assert result.repack_writes.size == 0


@pytest.mark.parametrize("attr,broken,match", [
    ("dst", lambda: Var("row") * Var("cols") + Var("col"), "not 16-byte aligned"),    # pitch ignored: rows start anywhere
    ("offset", lambda: (lambda self, op: Const(0)), "written a wrong number of times"),          # B over A
    ("pitch", lambda: staticmethod(lambda cols: cols if isinstance(cols, Var) else Const(cols)),
     "need both to be multiples of 8"),                                                           # rows unpadded
], ids=["dst_without_pitch", "b_copy_over_a", "pitch_unpadded"])
def test_broken_repack_is_caught(monkeypatch, attr, broken, match):
    """A copy that ignores the pitch puts its 16-byte stores off their boundaries; copies at one offset write workspace
    elements twice; rows left unpadded would break the GEMM's 16-byte loads. The interpreter refuses all three."""
    from l2ir.indexing import Repack

    members = {"dst": staticmethod(broken), "offset": broken(), "pitch": broken()}
    bad = type("BrokenRepack", (Repack,), {attr: members[attr]})
    monkeypatch.setattr(interp_mod, "Repack", bad)
    p = Problem(70, 130, 1027)
    with pytest.raises(InterpError, match=match):
        interpret(_repack_kernel(), p, *random_inputs(p, np.random.default_rng(0), integers=True))


def _multicast_kernel(cluster, schedule="pingpong", bn=64, slices=1):
    from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, SplitK, Swizzle, Target, Tile

    warps, bm = ((4, 1), 64) if schedule == "pingpong" else ((8, 1), 128)
    return Kernel(target=Target("sm90a"), tile=Tile((bm, bn, 64), warps, cluster), mma=Mma("wgmma", (64, bn, 16)),
                  pipeline=Pipeline("tma_ws", "auto", schedule, persistent=False),
                  swizzle=Swizzle((3, 3, 3), "along_n", 8), pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
                  splitk=SplitK("split_k", slices, "workspace") if slices > 1 else None,
                  epilogue=Epilogue("direct", 2))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 2), (4, 1)]),
       st.sampled_from(["pingpong", "cooperative"]), st.sampled_from([64, 32, 24]), st.integers(1, 300),
       st.integers(1, 40), st.integers(1, 30), st.integers(0, 2 ** 32 - 1))
def test_multicast_fuzzed(cluster, schedule, bn, m, n8, k8, seed):
    """tile.cluster with TMA multicast (one tile per block): every block's stages assembled from its cluster's
    shares give A @ B, the blocks past the grid store nothing, and every element of C is written once. Narrow B
    boxes (24 and 32 rows: 3 and 4 swizzle atoms) where the cluster's M extent splits them into whole atoms."""
    cm, cn = cluster
    assume(bn // cm % 8 == 0)
    kernel = _multicast_kernel(cluster, schedule, bn=bn)
    result = _check(kernel, Problem(m, 8 * n8, 8 * k8), seed)
    tiles = (-(-m // kernel.tile.bm), -(-(8 * n8) // bn))
    assert len(result.order) == cm * cn * -(-tiles[0] // cm) * -(-tiles[1] // cn)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(1, 2), (2, 1), (2, 2), (4, 1), (1, 4)]), st.sampled_from(["pingpong", "cooperative"]),
       st.integers(2, 5), st.integers(1, 300), st.integers(1, 40), st.integers(0, 2 ** 32 - 1))
def test_multicast_split_k_fuzzed(cluster, schedule, slices, m, n8, seed):
    """tile.cluster with TMA multicast and split-K through the workspace: the launch is one cluster grid per K
    slice, each cluster's blocks load one slice's k tiles for each other, every in-grid block climbs its tile's
    pairwise tree, the blocks past the grid only load, and C is A @ B with every element written once."""
    kernel = _multicast_kernel(cluster, schedule, slices=slices)
    k = 64 * slices * slices + 8 * (seed % 8)              # every slice gets k tiles (the verifier's rule)
    result = _check(kernel, Problem(m, 8 * n8, k), seed)
    cm, cn = cluster
    tiles = (-(-m // kernel.tile.bm), -(-(8 * n8) // 64))
    assert len(result.order) == cm * cn * -(-tiles[0] // cm) * -(-tiles[1] // cn)
    assert sorted(result.k_ranges) == [(tm, tn) for tm in range(tiles[0]) for tn in range(tiles[1])]
    assert all(len(ranges) == slices for ranges in result.k_ranges.values())


def test_multicast_split_k_after_the_repack_copies():
    """The repack node (an odd K: A and B copied to aligned rows first) under a multicast cluster with split-K:
    the cluster grid reads the copies, and C is A @ B with every element written once."""
    from l2ir.nodes import Repack

    kernel = _multicast_kernel((2, 1), slices=2).replace(repack=Repack())
    _check(kernel, Problem(130, 520, 1027), seed=11)


def test_multicast_split_k_slices_are_whole_cluster_grids(monkeypatch):
    """ClusterMulticast.unit: launch block slice * blocks + index is block `index` of `slice`; a mapping that
    runs the slices inside each cluster (its blocks in different K slices could not share a k tile) is refused."""
    from l2ir.indexing import UNIT, ClusterMulticast

    p = Problem(200, 512, 1024)
    a, b = random_inputs(p, np.random.default_rng(3))
    good = interpret(_multicast_kernel((2, 2), slices=2), p, a, b)
    assert good.workspace_writes is not None
    with monkeypatch.context() as mp:
        mp.setattr(ClusterMulticast, "unit", lambda self: (UNIT // 2, UNIT % 2))
        with pytest.raises(InterpError, match="ClusterMulticast.unit"):
            interpret(_multicast_kernel((2, 2), slices=2), p, a, b)
    # The workspace slot: the block's place in the cluster grid (pid) would run past the workspace when the grid
    # has blocks past the tiles; a slot shared by two tiles would sum one tile's partials into the other's.
    p = Problem(130, 512, 1024)                        # 3 M tiles in 2x2 clusters: a block row past the grid
    a, b = random_inputs(p, np.random.default_rng(4))
    interpret(_multicast_kernel((2, 2), slices=2), p, a, b)
    for broken, match in ((Var("tile_m") * 8 + Var("tile_n") * 0 + 64, "outside the workspace"),
                          (Var("tile_m") + Var("tile_n") * 0, "share split-K workspace slot")):
        with monkeypatch.context() as mp:
            mp.setattr(ClusterMulticast, "slot", staticmethod(lambda b=broken: b))
            with pytest.raises(InterpError, match=match):
                interpret(_multicast_kernel((2, 2), slices=2), p, a, b)


@pytest.mark.parametrize("attr, broken, match", [
    ("a_first", lambda self, bm: Var("rank") % self.cm * (bm // self.cn), "A stage"),     # the wrong rank digit
    # every column's B share to column 0 (the release mask, built from the masks, goes wrong first)
    ("b_mask", lambda self: Const((1 << self.cm) - 1), "empty barriers|B stage"),
    ("release_mask", lambda self: Const(1) << Var("rank"), "empty barriers"),              # release only itself
])
def test_broken_multicast_is_caught(monkeypatch, attr, broken, match):
    from l2ir.indexing import ClusterMulticast

    monkeypatch.setattr(ClusterMulticast, attr, broken)
    p = Problem(200, 512, 128)
    with pytest.raises(InterpError, match=match):
        interpret(_multicast_kernel((2, 4)), p, *random_inputs(p, np.random.default_rng(0)))


def test_multicast_share_of_another_tile_gives_a_wrong_product(monkeypatch):
    """A block that loads its share from its neighbour's tile still delivers every row once: only C shows it."""
    p = Problem(128, 512, 128)
    a, b = random_inputs(p, np.random.default_rng(1))
    good = interpret(_multicast_kernel((2, 4)), p, a, b).c
    orig_tile = interp_mod._Schedule._tile

    def neighbour(self, src, r0, rows, c0, cols, row_dim, col_dim):
        if row_dim == "n" and rows < self.bn:          # a B share: taken 64 columns further along N
            r0 = (r0 + self.bn) % src.shape[0]
        return orig_tile(self, src, r0, rows, c0, cols, row_dim, col_dim)

    monkeypatch.setattr(interp_mod._Schedule, "_tile", neighbour)
    bad = interpret(_multicast_kernel((2, 4)), p, a, b).c
    assert not np.array_equal(good, bad)


def _tma_store_kernel(schedule="cooperative", bm=128, bn=256, persistent=True):
    from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Swizzle, Target, Tile

    warps = (8, 1) if schedule == "cooperative" else (4, 1)
    return Kernel(target=Target("sm90a"), tile=Tile((bm, bn, 64), warps, (1, 1)), mma=Mma("wgmma", (64, bn, 16)),
                  pipeline=Pipeline("tma_ws", "auto", schedule, persistent=persistent),
                  swizzle=Swizzle((3, 3, 3), "along_n", 8), pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
                  epilogue=Epilogue("tma", 8))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([("cooperative", 128, 256, True), ("cooperative", 128, 128, True),
                        ("cooperative", 256, 128, True), ("pingpong", 64, 128, False), ("pingpong", 64, 64, False)]),
       st.integers(1, 400), st.integers(1, 60), st.integers(1, 30), st.integers(0, 2 ** 32 - 1))
def test_tma_store_fuzzed(config, m, n8, k8, seed):
    """epilogue.path=tma: every warpgroup's block staged through the swizzled box layout and stored box by box at
    the boxes' origins, clipped at M and N, gives A @ B with every element of C written once."""
    _check(_tma_store_kernel(*config), Problem(m, 8 * n8, 8 * k8), seed)


def test_broken_tma_store_is_caught(monkeypatch):
    """A staging layout that is not a bijection on the buffer raises; a box origin one box off writes some columns
    twice and others never, which the write count catches."""
    from l2ir.indexing import BOX, CONSUMER_WG, STAGE_COL, STAGE_ROW, TILE_M_, TILE_N_

    p = Problem(200, 512, 128)
    a, b = random_inputs(p, np.random.default_rng(0))
    monkeypatch.setattr(interp_mod, "tma_store_staging",
                        lambda wg_m, box_cols: STAGE_ROW * box_cols + STAGE_COL % box_cols)   # boxes overlap
    with pytest.raises(InterpError, match="staging layout"):
        interpret(_tma_store_kernel(), p, a, b)
    monkeypatch.undo()
    monkeypatch.setattr(interp_mod, "tma_store_origin", lambda bm, bn, wg_m, box_cols: (
        TILE_M_ * bm + CONSUMER_WG * wg_m, TILE_N_ * bn + (BOX // 2) * box_cols))              # boxes 2i, 2i+1 collide
    with pytest.raises(InterpError, match="written a wrong number of times"):
        interpret(_tma_store_kernel(), p, a, b)


def test_tma_store_staging_that_is_not_tmas_swizzle_gives_a_wrong_product(monkeypatch):
    """A staging layout that fills the buffer once but XORs the chunk with (r + 1) % 8 is read back by the
    interpreter's model of TMA's SWIZZLE_128B (not by the staging formula), so C comes out permuted."""
    from l2ir.indexing import STAGE_COL, STAGE_ROW, tma_store_staging

    p = Problem(128, 256, 64)
    a, b = random_inputs(p, np.random.default_rng(2))
    good = interpret(_tma_store_kernel(), p, a, b).c
    np.testing.assert_allclose(good.astype(np.float64), reference(a, b), atol=0.2)

    def shifted(wg_m, box_cols):
        within = STAGE_ROW * box_cols + STAGE_COL % box_cols
        chunk = (within // 8) % 8 ^ ((STAGE_ROW + 1) % 8)
        return ((STAGE_COL // box_cols) * (wg_m * box_cols) + (within // 64) * 64 + chunk * 8 + within % 8)

    assert tma_store_staging(64, 64) is not None
    monkeypatch.setattr(interp_mod, "tma_store_staging", shifted)
    bad = interpret(_tma_store_kernel(), p, a, b).c
    assert not np.array_equal(bad, good)


def test_tma_store_staging_swizzles_each_row_over_all_banks():
    """The staging layout is TMA's SWIZZLE_128B on 2-byte data: within a box, row r's 16-byte chunk j sits at
    chunk j ^ (r % 8), so the 8 rows of one fragment store (same chunk, rows r..r+7) hit 8 different chunks."""
    from l2ir.indexing import tma_store_staging

    off = tma_store_staging(64, 64)
    for r in range(16):
        chunks = {int(off.eval({"r": r + i, "col": 8 * 3})) % 64 // 8 for i in range(8)}
        assert len(chunks) == 8
    assert int(off.eval({"r": 0, "col": 64})) == 64 * 64      # the second box starts after the first's 64 rows
