"""The interleave node (columns 8 apart per block, only A realigned): its text form, the verifier's rules, which
backend lowers it, the index functions (l2ir.indexing.Interleave) and the reference interpreter's model of it.

The generated kernels run on the host emulator in tests/test_cuda_ptx_sm80.py (every block and thread, operands on
every 2-byte offset, C bit for bit) and on the GPU through every gate in tests/test_backends_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from l2ir.analysis import smem_bytes  # noqa: E402
from l2ir.backends.registry import backend_for  # noqa: E402
from l2ir.edits import InsertNode, RemoveNode, apply_edits  # noqa: E402
from l2ir.errors import InterpError, ParseError, PadError  # noqa: E402
from l2ir.indexing import Interleave as Index  # noqa: E402
from l2ir.indexing import Var  # noqa: E402
from l2ir.interp import interpret, random_inputs  # noqa: E402
from l2ir.nodes import (Epilogue, Interleave, Kernel, Mma, Pad, Pipeline, Problem, Repack, SplitK,  # noqa: E402
                        Swizzle, Target, Tile)
from l2ir.testing import assert_computes_matmul, kernel_problem_pairs  # noqa: E402
from l2ir.text import parse_kernel  # noqa: E402
from l2ir.verify import verify, violations  # noqa: E402


def decode(stages=4, slices=3, modes=("predicate", "zero_fill", "zero_fill"), **changes) -> Kernel:
    """The odd-K decode kernel of the sweep (32x128x64, 2x4 warps) with the interleave node."""
    k = Kernel(target=Target("sm80"), tile=Tile((32, 128, 64), (2, 4)), mma=Mma("mma_sync", (16, 8, 16)),
               pipeline=Pipeline("multistage", stages, prefetch=True), swizzle=Swizzle((3, 3, 3), "along_n", 1),
               pad=Pad(*modes, 1), splitk=SplitK("split_k", slices) if slices > 1 else None,
               epilogue=Epilogue("direct", 1), interleave=Interleave())
    return k.replace(**changes)


# ---- text and edits ---------------------------------------------------------------------------------------------

def test_text_round_trips_and_other_kernels_keep_their_text():
    k = decode()
    assert "  interleave n=8\n" in k.text()
    assert parse_kernel(k.text()) == k
    plain = k.replace(interleave=None)
    assert "interleave" not in plain.text()        # an absent node prints nothing: every older hash stands
    assert apply_edits(plain, [InsertNode(Interleave())]) == k
    assert apply_edits(k, [RemoveNode("interleave")]) == plain


def test_only_the_vector_stride_parses():
    with pytest.raises(ParseError, match="interleave.n"):
        parse_kernel(decode().text().replace("interleave n=8", "interleave n=4"))


# ---- verifier -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(pad=Pad("predicate", "zero_fill", "zero_fill", 8)), "set pad.align=1, not 8"),
    (dict(pad=Pad("predicate", "divisible", "zero_fill", 1)), "pad.n=predicate or zero_fill"),
    (dict(pad=Pad("predicate", "zero_fill", "divisible", 1)), "pad.k=predicate or zero_fill"),
    (dict(splitk=SplitK("stream_k"), pipeline=Pipeline("tma_ws", 4, schedule="cooperative", persistent=True),
          mma=Mma("wgmma", (64, 128, 16)), target=Target("sm90a"), tile=Tile((128, 128, 64), (8, 1))),
     "schedule=pingpong, persistent=false"),
    (dict(pipeline=Pipeline("direct", 2)), "not mode=direct"),
    (dict(splitk=SplitK("stream_k")), "not stream_k"),
], ids=["align8", "n_divisible", "k_divisible", "tma_ws", "direct", "stream_k"])
def test_verifier_names_what_interleave_needs(change, words):
    """The interleave rule fails, naming what it needs (other rules may fail beside it on such a kernel)."""
    errors = [str(e) for e in violations(decode(**change)) if isinstance(e, PadError) and "interleave" in str(e)]
    assert errors and words in errors[0], errors
    assert not violations(decode())                  # the kernel itself is legal


def test_repack_and_interleave_never_meet():
    """Both answer misaligned rows: the repack node needs pad.align=8, the interleave node pad.align=1."""
    for align in (1, 8):
        with pytest.raises(PadError, match="pad.align"):
            verify(decode(repack=Repack()).replace(pad=Pad("predicate", "zero_fill", "zero_fill", align)))


# ---- which backend --------------------------------------------------------------------------------------------------

def test_only_the_raw_sm80_rule_lowers_it():
    k = decode()
    assert backend_for(k).name == "cuda_ptx_sm80"
    with pytest.raises(NotImplementedError, match="interleave"):
        backend_for(k, "cute_sm80")
    # A problem class the raw rule does not generate cannot fall back to CuTe, which does not lower the node.
    with pytest.raises(NotImplementedError, match="cute_sm80 does not lower this kernel: interleave"):
        backend_for(k, problem=Problem(1, 1, 1, c=("f32", "row")))


def test_shared_memory_holds_b_once():
    """B's tile sits in its ring stage (no raw copy, no realigned copy): 4 stages of 32x128x64 take 90 KB, where
    staging and realigning both operands takes 134 KB."""
    k = decode()
    assert smem_bytes(k) == ((4 * 72 + 2 * 64) * 32 + 4 * 64 * 128) * 2
    assert smem_bytes(k.replace(interleave=None)) == (4 * 72 + 2 * 64) * (32 + 128) * 2


# ---- index functions ------------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), bn=st.sampled_from([8, 16, 64, 128, 256]), k=st.integers(1, 100))
def test_columns_cover_n_once_and_share_an_offset(n, bn, k):
    tiles = int(Index.tiles_n(n, bn).eval({}))
    cols, offsets = [], set()
    for tile_n in range(tiles):
        env = {"tile_n": tile_n}
        r = int(Index.residue().eval(env))
        j = int(Index.first_row(bn).eval(env)) + np.arange(bn)
        c = np.asarray(Index.column().eval({"j": j, "r": r}))
        assert (np.diff(c) == Index.STRIDE).all()
        inside = c[c < n]
        cols.append(inside)
        # every row of the tile starts at the same offset inside a 16-byte vector
        offs = {int(Index.offset().eval({"elem": int(col) * k})) for col in inside}
        assert len(offs) <= 1
        offsets |= offs
    every = np.sort(np.concatenate(cols))
    assert (every == np.arange(n)).all(), "each column of C belongs to exactly one tile"
    assert offsets <= set(range(8))


# ---- the reference interpreter --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", [decode(), decode(slices=1), decode(stages=1, slices=1, swizzle=None),
                                    decode(modes=("zero_fill", "predicate", "predicate"), slices=2)],
                         ids=["s4_split3", "s4", "s1_noswizzle", "kpredicate_split2"])
@pytest.mark.parametrize("shape", [(17, 999, 333), (1, 8, 321), (33, 1000, 130), (40, 2049, 4095), (3, 3, 129)])
def test_interpreter_computes_matmul(kernel, shape):
    problem = Problem(*shape)
    assert_computes_matmul(kernel, problem, integers=True)
    assert_computes_matmul(kernel, problem, seed=3)


@settings(max_examples=40, deadline=None)
@given(pair=kernel_problem_pairs(max_dim=160, targets=("sm80",)))
def test_fuzzed_interleave_kernels_compute_matmul(pair):
    kernel, problem = pair
    if kernel.interleave is None:
        kernel = kernel.replace(interleave=Interleave())
        try:
            verify(kernel)
        except Exception:
            return                                   # not a kernel the node applies to
    assert_computes_matmul(kernel, problem, integers=True)


@pytest.mark.parametrize("name,wrong,error", [
    # every run of a residue starting at view row 0: later runs write over the first's columns
    ("first_row", classmethod(lambda cls, bn: Var("tile_n") * 0), "written"),
    # the residue dropped: eight tiles on the same columns, whose rows start at other offsets
    ("column", classmethod(lambda cls: Var("j") * 8), "16-byte boundary|written"),
])
def test_a_wrong_column_map_is_caught(monkeypatch, name, wrong, error):
    """The interpreter evaluates the same index functions the backend renders, so a wrong map shows there."""
    monkeypatch.setattr(Index, name, wrong)
    problem = Problem(17, 2100, 333)                 # 3 runs of 128 view rows per residue
    a, b = random_inputs(problem, np.random.default_rng(0))
    with pytest.raises(InterpError, match=error):
        interpret(decode(slices=1), problem, a, b)


def test_a_wrong_view_offset_is_caught(monkeypatch):
    """The view is read in whole 16-byte vectors: an offset that leaves a row's view start off a 16-byte boundary
    (in the model, operands start on one) is refused, whatever product it would give."""
    monkeypatch.setattr(Index, "offset", staticmethod(lambda: (Var("elem") + 1) & 7))
    with pytest.raises(InterpError, match="16-byte boundary"):
        assert_computes_matmul(decode(slices=1), Problem(17, 999, 333), integers=True)


def test_schedules_it_does_not_model_are_refused():
    k = decode(slices=1).replace(splitk=SplitK("stream_k"), pipeline=Pipeline("multistage", 4, prefetch=True))
    a, b = random_inputs(Problem(17, 64, 65), np.random.default_rng(0))
    with pytest.raises(Exception, match="stream_k|interleave"):
        interpret(k, Problem(17, 64, 65), a, b)


# ---- the edit operator (policy.actions) ---------------------------------------------------------------------------

def test_the_interleave_action_makes_a_legal_child_that_computes_matmul():
    """`Action("interleave", 8)` turns the odd-K sm80 seed into an interleave kernel (pad.align=1, single-element
    stores, cuda_ptx_sm80 named) that the verifier and backend admit, whose edits replay it, which the interpreter
    runs correctly; `Action("interleave", None)` takes the node away again. It does not apply where every row is
    16-byte aligned or to a TMA kernel (the node is an mma.sync ring's)."""
    from l2ir.policy.actions import Action, apply_action, diff_edits, legal_children, to_sm90a
    from l2ir.policy.base import Dedupe, Proposal, legalize
    from l2ir.seed import seed

    problem = Problem(17, 999, 333)
    parent = seed(problem, "sm80")
    child, backend = apply_action(parent, problem, Action("interleave", 8))
    assert child.interleave == Interleave() and backend == "cuda_ptx_sm80"
    assert child.pad.align == 1 and child.epilogue.vector == 1 and "divisible" not in (child.pad.n, child.pad.k)
    legalize(child, problem, backend)
    assert Proposal(edits=diff_edits(parent, child)).apply(parent, problem) == child
    assert_computes_matmul(child, problem, integers=True)
    assert any(a == Action("interleave", 8) for _, a, _, _ in legal_children(parent, problem, "sm90a", None, Dedupe(parent)))
    plain, _ = apply_action(child, problem, Action("interleave", None))
    assert plain.interleave is None

    aligned = Problem(17, 1000, 336)
    assert apply_action(seed(aligned, "sm80"), aligned, Action("interleave", 8)) is None
    assert apply_action(to_sm90a(parent), problem, Action("interleave", 8)) is None


def test_output_tiles_and_the_stand_in_count_residue_runs():
    """One count of output tiles (l2ir.analysis.output_tiles) for the policy's features, the rules' wave fill and the
    stand-in model: with the node each of the 8 residues has its own runs of BN view rows (17x9999: 80 tiles of
    32x128, not 79). The stand-in prices the node's 16-byte B stream: faster than realigning both operands, as on
    the GPU (32.9 against 47.3 us at 17x9999x3333)."""
    from l2ir.analysis import output_tiles
    from l2ir.policy.rules import decode_align_kernel, interleave_decode_kernel
    from l2ir.search.standin import kernel_time_us

    problem = Problem(17, 9999, 3333)
    inter, plain = interleave_decode_kernel(problem, "sm80", 3), decode_align_kernel(problem, "sm80", 4, 3)
    assert (output_tiles(inter, problem), output_tiles(plain, problem)) == (80, 79)
    assert kernel_time_us(inter, problem) < 0.8 * kernel_time_us(plain, problem)


# ---- the tensor-map form (cuda_ptx sm90a) -------------------------------------------------------------------------

def tma_form(slices=3, **changes) -> Kernel:
    """The interleave node on a TMA ring: one consumer warpgroup, 64x128x64, 4 stages (two blocks per SM)."""
    k = Kernel(target=Target("sm90a"), tile=Tile((64, 128, 64), (4, 1)), mma=Mma("wgmma", (64, 128, 16)),
               pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False), swizzle=Swizzle((3, 3, 3), "along_n", 1),
               pad=Pad("zero_fill", "zero_fill", "zero_fill", 1),
               splitk=SplitK("split_k", slices) if slices > 1 else None, epilogue=Epilogue("direct", 1),
               interleave=Interleave())
    return k.replace(**changes)


@pytest.mark.parametrize("change,words", [
    (dict(pipeline=Pipeline("tma_ws", 4, "cooperative", persistent=False), tile=Tile((128, 128, 64), (8, 1))),
     "schedule=pingpong"),
    (dict(pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=True)), "persistent=false"),
    (dict(tile=Tile((64, 128, 64), (4, 1), (1, 2))), "cluster 1x1"),
    (dict(epilogue=Epilogue("smem", 1)), "path=direct"),
    (dict(splitk=SplitK("split_k", 2, "cluster")), "workspace or atomics"),
    (dict(pad=Pad("zero_fill", "zero_fill", "zero_fill", 8)), "set pad.align=1"),
], ids=["cooperative", "persistent", "cluster", "smem_epilogue", "cluster_reduce", "align8"])
def test_verifier_names_what_the_tma_form_needs(change, words):
    errors = [str(e) for e in violations(tma_form(**change)) if isinstance(e, PadError) and "interleave" in str(e)]
    assert errors and words in errors[0], errors
    assert not violations(tma_form())                # the kernel itself is legal: TMA takes pad.align=1 here


def test_tma_form_needs_a_view_row():
    """Below 8 columns B's map would have no view row: the problem rule refuses, naming the cp.async form."""
    a, b = random_inputs(Problem(3, 7, 300), np.random.default_rng(0))
    with pytest.raises(PadError, match="N=7 has none"):
        interpret(tma_form(slices=1), Problem(3, 7, 300), a, b)
    interpret(decode(slices=1), Problem(3, 7, 300), a, b)        # the cp.async form takes it


def test_tma_form_lowers_on_the_sm90a_rule():
    k = tma_form()
    assert backend_for(k).name == "cuda_ptx" and backend_for(decode()).name == "cuda_ptx_sm80"
    with pytest.raises(NotImplementedError, match="interleave"):
        backend_for(k, "cutlass_sm90")
    src = backend_for(k).lower(k, Problem(17, 9999, 3333)).source
    # B's box starts on the 16-byte boundary `offset` elements before the residue's row (Interleave.offset); A's
    # stages are written by the producer warpgroup's warps 1-3 from loads shifted by the same offset, swizzled as
    # TMA writes B, fenced for the async proxy, then counted on the stage's full barrier beside the TMA bytes
    assert f"const int offset = {Index.offset().to_cpp().replace('elem', '(residue * K)')};" in src
    assert "&tmap_b, full, residue * K - offset + k0," in src and "const int k = kt * BK + 8 * (q % (BK / 8)) - offset;" in src
    assert "tmap_a" not in src and "mbar_init(bars + 8 * s, 1 + A_WRITERS);" in src and "setmaxnreg." not in src
    writers = src[src.index("} else if (threadIdx.x >= 32) {"):src.index("// ---- consumer warpgroups")]
    assert (writers.index("mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);") < writers.index("__ldg(")
            < writers.index("st.shared.v4.b32") < writers.index("fence.proxy.async.shared::cta")
            < writers.index("mbar_arrive(bars + 8 * stage);"))
    assert "wgmma_m64n128k16(acc[j], da, db," in src and "wgmma_rs" not in src
    assert "operand_map(cache_b, b_read, N / VIEW, view_pitch, view_pitch, BN)" in src
    # the k tail zeroed in both operands before wgmma reads them, behind the async-proxy fence
    tail = src[src.index("if (k_lo > 0 || k_hi < BK)"):]
    assert tail.index("st.shared.u16") < tail.index("fence.proxy.async.shared::cta") < tail.index("bar.sync 4, 128")
    # the tail's rows and columns are Interleave.tail_row / tail_column rendered
    assert f"const int col = {Index.tail_column(Var('N')).to_cpp()};" in src
    assert "if (N < VIEW ||" in src


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(8, 3000), bn=st.sampled_from([64, 128, 256]))
def test_tma_form_tiles_and_tail_store_every_column_once(m, n, bn):
    """The tiles store the view rows below Interleave.tma_view_rows, the tail the N mod 8 columns after them: every
    column of C once."""
    view_rows = int(Index.tma_view_rows(n).eval({}))
    cols = []
    for tile_n in range(int(Index.tiles_n(n, bn).eval({}))):
        env = {"tile_n": tile_n}
        j = int(Index.first_row(bn).eval(env)) + np.arange(bn)
        c = np.asarray(Index.column().eval({"j": j, "r": int(Index.residue().eval(env))}))
        cols.append(c[j < view_rows])
    t = int(Index.tail_columns(n).eval({}))
    if t:                                                  # (N a multiple of 8: no tail, nothing to divide by)
        o = np.arange(m * t)
        rows, tail = np.asarray(Index.tail_row(n).eval({"o": o})), np.asarray(Index.tail_column(n).eval({"o": o}))
        assert sorted(zip(rows.tolist(), tail.tolist())) == [(r, c) for r in range(m) for c in range(n - t, n)]
    every = np.sort(np.concatenate(cols + [np.arange(n - t, n)]))
    assert (every == np.arange(n)).all()


@pytest.mark.parametrize("kernel", [tma_form(), tma_form(slices=1), tma_form(slices=2, tile=Tile((64, 64, 128), (4, 1)),
                                                                            mma=Mma("wgmma", (64, 64, 16)))],
                         ids=["split3", "nosplit", "64x64x128_split2"])
@pytest.mark.parametrize("shape", [(17, 999, 333), (1, 8, 321), (33, 1000, 390), (70, 2049, 4095), (5, 15, 300)])
def test_tma_form_computes_matmul_in_the_interpreter(kernel, shape):
    problem = Problem(*shape)
    assert_computes_matmul(kernel, problem, integers=True)
    assert_computes_matmul(kernel, problem, seed=3)


def test_tma_form_tail_is_checked(monkeypatch):
    """A tail that skips a column leaves C's elements unwritten, which the interpreter catches."""
    monkeypatch.setattr(Index, "tail_column", classmethod(lambda cls, n: cls.STRIDE * cls.tma_view_rows(n)))
    with pytest.raises(InterpError, match="written|outside"):
        assert_computes_matmul(tma_form(slices=1), Problem(17, 999, 333), integers=True)
