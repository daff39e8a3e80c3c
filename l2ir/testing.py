"""Hypothesis strategies for fuzzing L2IR: legal kernels for any target, problems they can run, edit records; and the
check that a kernel computes `A @ B` in the reference interpreter. Needs the `test` extra (hypothesis).

Fuzz your own pass (Kernel -> Kernel) against the interpreter (examples/fuzz_my_pass.py does exactly this):

    from hypothesis import given
    from l2ir.testing import kernel_problem_pairs, assert_computes_matmul

    @given(kernel_problem_pairs(max_dim=128))
    def test_my_pass(pair):
        kernel, problem = pair
        assert_computes_matmul(my_pass(kernel), problem)

Kernels are built legal by construction where the rules are local (warp tiles are whole MMAs, swizzles fit BK,
vectors fit the alignment, stream-K runs persistent) and filtered through the verifier for the global budgets
(registers, shared memory, copy partition). Problems are drawn after the kernel so that they respect its alignment,
divisibility and split-K slices; with align=1 and predicated padding every size, primes included, is fair game.
"""

from __future__ import annotations

try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError("l2ir.testing needs hypothesis: pip install 'l2ir[test]'") from None

import numpy as np

from .edits import Edit, InsertNode, RemoveNode, ReplaceNode, SetField
from .nodes import ARCHS, Epilogue, Interleave, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile
from .verify import DIRECT_BM, problem_violations, violations

PAD_MODES = ("predicate", "zero_fill", "divisible")
MMA_SYNC_ARCHS = ARCHS                              # mma.sync + cp.async run on every target from sm80 on
WGMMA_ARCHS = ("sm90a",)                            # wgmma and TMA exist only on the arch-specific sm_90a


@st.composite
def mma_sync_kernels(draw, archs=MMA_SYNC_ARCHS) -> Kernel:
    """mma.sync m16n8k16 fed by a cp.async multistage ring (any target)."""
    wm = draw(st.sampled_from([1, 2, 4]))
    wn = draw(st.sampled_from([1, 2, 4]))
    bm = wm * draw(st.sampled_from([16, 32, 64]))
    bn = wn * draw(st.sampled_from([8, 16, 32, 64]))
    bk = draw(st.sampled_from([16, 32, 64]))
    align = draw(st.sampled_from([1, 2, 4, 8]))
    smem = draw(st.sampled_from([None, (1, 3, 3), (2, 3, 3), (3, 3, 3)]))
    if smem is not None and (1 << (smem[0] + 3)) > bk:
        smem = None
    swizzle = draw(st.one_of(st.none(), st.builds(
        Swizzle, smem=st.just(smem), raster=st.sampled_from(["along_m", "along_n"]), group=st.integers(1, 16))))
    splitk = draw(st.one_of(st.none(), st.builds(
        SplitK, mode=st.just("split_k"), slices=st.integers(2, 4), reduce=st.sampled_from(["workspace", "atomic"]))))
    kernel = Kernel(
        target=Target(draw(st.sampled_from(archs))),
        tile=Tile(block=(bm, bn, bk), warps=(wm, wn)),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("multistage", draw(st.integers(1, 6)), prefetch=draw(st.booleans())),
        swizzle=swizzle,
        pad=Pad(draw(st.sampled_from(PAD_MODES)), draw(st.sampled_from(PAD_MODES)),
                draw(st.sampled_from(PAD_MODES)), align),
        splitk=splitk,
        epilogue=Epilogue(draw(st.sampled_from(["direct", "smem"])),
                          draw(st.sampled_from([v for v in (1, 2, 4, 8) if v <= align]))),
    )
    # The interleave node (columns 8 apart per block), half the time where the verifier admits it.
    if draw(st.booleans()) and not violations(kernel.replace(interleave=Interleave())):
        kernel = kernel.replace(interleave=Interleave())
    assume(not violations(kernel))
    return kernel


@st.composite
def wgmma_kernels(draw) -> Kernel:
    """wgmma fed by TMA, warp-specialized (cooperative or ping-pong), on sm90a."""
    schedule = draw(st.sampled_from(["cooperative", "pingpong"]))
    if schedule == "cooperative":
        warps, bm = (8, 1), draw(st.sampled_from([128, 256]))
    else:
        warps, bm = (4, 1), draw(st.sampled_from([64, 128]))
    bn = draw(st.sampled_from([64, 128, 256]))
    bk = draw(st.sampled_from([32, 64]))
    # TMA swizzles whole BK rows: 128-byte rows (BK=64 halves) take <3,3,3>, 64-byte rows <2,3,3>; that is what the
    # CUTLASS builder lays out, so it comes up most often. The others are legal and stay in the mix.
    natural = (3, 3, 3) if bk == 64 else (2, 3, 3)
    smem = draw(st.sampled_from([natural, natural, natural, (1, 3, 3), (2, 3, 3), (3, 3, 3)]))
    if (1 << (smem[0] + 3)) > bk:
        smem = natural
    splitk = draw(st.sampled_from([None, None, None, SplitK("stream_k"), SplitK("split_k", 2),
                                   SplitK("split_k", 2, "cluster")]))
    if splitk is not None and splitk.reduce == "cluster":
        splitk = SplitK("split_k", draw(st.integers(2, 16)), "cluster")
    # stream-K is a persistent tile scheduler (a non-persistent grid has nothing to hand partial tiles to), and
    # CUTLASS runs split-K on that same scheduler; a cluster reduction is one cluster per tile, never persistent.
    in_cluster = splitk is not None and splitk.reduce == "cluster"
    persistent = (not in_cluster) if splitk is not None else draw(st.booleans())
    pad_modes = ("zero_fill", "divisible")
    kernel = Kernel(
        target=Target("sm90a"),
        tile=Tile(block=(bm, bn, bk), warps=warps,
                  cluster=(1, 1) if in_cluster else draw(st.sampled_from([(1, 1), (2, 1), (1, 2)]))),
        mma=Mma("wgmma", (64, bn, 16)),
        pipeline=Pipeline("tma_ws", draw(st.sampled_from(["auto", 2, 3, 4, 5])), schedule=schedule,
                          persistent=persistent),
        swizzle=Swizzle(smem=smem, raster=draw(st.sampled_from(["along_m", "along_n"])),
                        group=draw(st.sampled_from([1, 2, 4, 8]))),
        pad=Pad(draw(st.sampled_from(pad_modes)), draw(st.sampled_from(pad_modes)), draw(st.sampled_from(pad_modes)), 8),
        splitk=splitk,
        # the TMA store is how Hopper kernels write C; staging through shared memory or storing directly stay in
        # a cluster reduction stores each block's share straight from registers (the others are legal IR that the
        # backends refuse, naming the field)
        epilogue=(draw(st.sampled_from([Epilogue("direct", 2)] * 3 + [Epilogue("smem", 8)])) if in_cluster else
                  Epilogue(draw(st.sampled_from(["tma", "tma", "smem", "direct"])), 8)),
    )
    # reduce=block: the two consumer warpgroups of a cooperative block split one tile's K loop, each over all BM
    # rows (BM 64 or 128, one tile per block, an even ring of at least 4 stages, direct stores). Made, with no draw of its own,
    # from the cooperative kernels that stage C through shared memory outside a cluster split, which CUTLASS
    # refuses anyway (its shared-memory epilogue is the TMA store), so the other kernels stay as they were.
    if schedule == "cooperative" and kernel.epilogue.path == "smem" and not in_cluster:
        bm = 64 if bk == 64 else 128
        stages = kernel.pipeline.stages if kernel.pipeline.stages in ("auto", 4, 6) else 4
        kernel = kernel.replace(
            tile=Tile(block=(bm, bn, bk), warps=warps, cluster=(1, 1)),
            pipeline=Pipeline("tma_ws", stages, schedule=schedule, persistent=False),
            splitk=SplitK("split_k", 2, "block"), epilogue=Epilogue("direct", 2))
    assume(not violations(kernel))
    return kernel


@st.composite
def direct_kernels(draw, archs=MMA_SYNC_ARCHS) -> Kernel:
    """mma.sync fed from global memory by each lane (pipeline mode=direct; any target): BM rows of A per warp,
    n8 blocks over 1 x WN warps, 32-element K chunks, 1 to 4 register stages, any alignment."""
    wn, ni = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
    align = draw(st.sampled_from([1, 2, 4, 8]))
    raster = draw(st.sampled_from(["along_n", "along_m"]))
    kernel = Kernel(
        target=Target(draw(st.sampled_from(archs))),
        tile=Tile(block=(draw(st.sampled_from(DIRECT_BM)), 8 * wn * ni, 32 * draw(st.sampled_from([1, 2, 4]))),
                  warps=(1, wn)),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("direct", draw(st.sampled_from([1, 2, 2, 3, 4]))),
        swizzle=Swizzle(None, raster, draw(st.sampled_from([1, 2, 8]))),
        pad=Pad(draw(st.sampled_from(PAD_MODES)), draw(st.sampled_from(PAD_MODES)),
                draw(st.sampled_from(PAD_MODES)), align),
        epilogue=Epilogue("direct", draw(st.sampled_from([v for v in (1, 2) if v <= align]))),
        splitk=draw(st.sampled_from([None, None, SplitK("split_k", 2, "block"), SplitK("split_k", 4, "block")])),
    )
    assume(not violations(kernel))
    return kernel


def kernels(targets=None) -> st.SearchStrategy[Kernel]:
    """Legal kernels for the given targets (default: every target; wgmma/TMA kernels where sm90a is among them)."""
    targets = tuple(targets) if targets is not None else ARCHS
    unknown = [t for t in targets if t not in ARCHS]
    if unknown or not targets:
        raise ValueError(f"unknown target(s) {unknown or targets} (targets: {', '.join(ARCHS)})")
    parts = [mma_sync_kernels(archs=targets), direct_kernels(archs=targets)]
    if any(t in WGMMA_ARCHS for t in targets):
        parts.append(wgmma_kernels())
    return st.one_of(*parts)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@st.composite
def problems_for(draw, kernel: Kernel, max_dim: int = 300) -> Problem:
    """A problem this kernel can run: sizes respect its alignment, any divisible padding and its split-K slices."""
    a = ("f16", draw(st.sampled_from(["row", "col"])))
    b = ("f16", draw(st.sampled_from(["row", "col"])))
    acc = draw(st.sampled_from(["f32", "f32", "f16"]))
    align = kernel.pad.align

    def size(dim: str, tile: int, at_least: int = 1) -> int:
        step = tile if getattr(kernel.pad, dim) == "divisible" else 1
        step = step * align // _gcd(step, align)
        lo = -(-at_least // step)
        hi = max(lo, max(1, max_dim // step))
        return step * draw(st.integers(lo, hi))

    bm, bn, bk = kernel.tile.block
    # every split-K slice must own a k tile: start K at one tile per slice
    slices = kernel.splitk.slices if kernel.splitk is not None and kernel.splitk.mode == "split_k" else 1
    p = Problem(size("m", bm), size("n", bn), size("k", bk, (slices - 1) * bk + 1), a, b, ("f16", "row"), acc)
    assume(not problem_violations(kernel, p))
    return p


@st.composite
def kernel_problem_pairs(draw, max_dim: int = 300, targets=None):
    """(kernel, problem) with the problem applicable to the kernel."""
    k = draw(kernels(targets))
    return k, draw(problems_for(k, max_dim))


@st.composite
def problems(draw, max_dim: int = 4096) -> Problem:
    """Any valid problem: sizes from 1 (primes and odd sizes included), f16 or bf16, any layouts."""
    dt = draw(st.sampled_from(["f16", "bf16"]))
    acc = "f32" if dt == "bf16" else draw(st.sampled_from(["f32", "f16"]))
    dims = st.one_of(st.integers(1, 300), st.integers(1, max_dim), st.sampled_from([64, 128, 4096, 8192, 16384]))
    return Problem(draw(dims), draw(dims), draw(dims), (dt, draw(st.sampled_from(["row", "col"]))),
                   (dt, draw(st.sampled_from(["row", "col"]))), (dt, "row"), acc)


def edits() -> st.SearchStrategy[Edit]:
    """Edit records as a policy proposes them: set a field, insert or remove a node, replace the MMA. Many are
    illegal for a given kernel; applying one returns a verified kernel or raises a typed error."""
    values = {
        ("pipeline", "stages"): st.one_of(st.integers(1, 16), st.just("auto")),
        ("pipeline", "prefetch"): st.booleans(),
        ("tile", "block"): st.tuples(st.sampled_from([32, 64, 128, 256]), st.sampled_from([32, 64, 128, 256]),
                                     st.sampled_from([16, 32, 64])),
        ("tile", "warps"): st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4])),
        ("tile", "cluster"): st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2])),
        ("swizzle", "smem"): st.sampled_from([None, (1, 3, 3), (2, 3, 3), (3, 3, 3)]),
        ("swizzle", "group"): st.integers(1, 16),
        ("pad", "align"): st.sampled_from([1, 2, 4, 8]),
        ("epilogue", "vector"): st.sampled_from([1, 2, 4, 8]),
        ("target", "arch"): st.sampled_from(["sm80", "sm90a"]),
    }
    sets = st.sampled_from(sorted(values)).flatmap(lambda nf: values[nf].map(lambda v: SetField(nf[0], nf[1], v)))
    others = st.sampled_from([InsertNode(SplitK("split_k", 2)), RemoveNode("splitk"), RemoveNode("swizzle"),
                              InsertNode(SplitK("stream_k")), ReplaceNode(Mma("mma_sync", (16, 8, 16))),
                              InsertNode(Interleave()), RemoveNode("interleave")])
    return st.one_of(sets, others)


def assert_computes_matmul(kernel: Kernel, problem: Problem, seed: int = 0, integers: bool = False) -> None:
    """Run the kernel's schedule in the reference interpreter on random inputs and fail (AssertionError) unless every
    element is written exactly once and C equals float64 `A @ B` within the error bound (exactly, with integers)."""
    from .interp import error_bound, interpret, random_inputs, reference

    rng = np.random.default_rng(seed)
    a, b = random_inputs(problem, rng, integers=integers)
    result = interpret(kernel, problem, a, b)
    assert (result.c_writes == 1).all(), "some elements of C were not written exactly once"
    c, ref = result.c.astype(np.float64), reference(a, b)
    if integers:
        wrong = int(np.count_nonzero(c != ref))
        assert wrong == 0, f"{wrong} elements of C differ from A @ B on small integers"
    else:
        err, bound = np.abs(c - ref), error_bound(problem, a, b)
        assert np.all(err <= bound), f"C differs from A @ B by {float(np.max(err / bound)):.2f}x the error bound"
