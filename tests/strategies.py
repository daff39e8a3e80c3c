"""Hypothesis strategies for legal kernels and the problems they can run.

Kernels are built legal by construction where the rules are local (warp tiles are whole MMAs, swizzles fit BK,
vectors fit the alignment) and filtered through the verifier for the global budgets (registers, shared memory).
Problems are drawn after the kernel so that they respect its alignment and divisibility; with align=1 and
predicated padding every size, primes included, is fair game.
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile
from l2ir.verify import problem_violations, violations

PAD_MODES = ("predicate", "zero_fill", "divisible")


@st.composite
def sm80_kernels(draw, archs=("sm80", "sm86", "sm89", "sm90", "sm90a")) -> Kernel:
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
    assume(not violations(kernel))
    return kernel


@st.composite
def sm90a_kernels(draw) -> Kernel:
    schedule = draw(st.sampled_from(["cooperative", "pingpong"]))
    if schedule == "cooperative":
        warps, bm = (8, 1), draw(st.sampled_from([128, 256]))
    else:
        warps, bm = (4, 1), draw(st.sampled_from([64, 128]))
    bn = draw(st.sampled_from([64, 128, 256]))
    bk = draw(st.sampled_from([32, 64]))
    smem = draw(st.sampled_from([(1, 3, 3), (2, 3, 3), (3, 3, 3)]))
    if (1 << (smem[0] + 3)) > bk:
        smem = (2, 3, 3)
    splitk = draw(st.sampled_from([None, SplitK("stream_k"), SplitK("split_k", 2)]))
    pad_modes = ("zero_fill", "divisible")
    kernel = Kernel(
        target=Target("sm90a"),
        tile=Tile(block=(bm, bn, bk), warps=warps, cluster=draw(st.sampled_from([(1, 1), (2, 1), (1, 2)]))),
        mma=Mma("wgmma", (64, bn, 16)),
        pipeline=Pipeline("tma_ws", draw(st.sampled_from(["auto", 2, 3, 4, 5])), schedule=schedule,
                          persistent=draw(st.booleans())),
        swizzle=Swizzle(smem=smem, raster=draw(st.sampled_from(["along_m", "along_n"])),
                        group=draw(st.sampled_from([1, 2, 4, 8]))),
        pad=Pad(draw(st.sampled_from(pad_modes)), draw(st.sampled_from(pad_modes)), draw(st.sampled_from(pad_modes)), 8),
        splitk=splitk,
        epilogue=Epilogue(draw(st.sampled_from(["tma", "smem", "direct"])), 8),
    )
    assume(not violations(kernel))
    return kernel


def kernels() -> st.SearchStrategy[Kernel]:
    return st.one_of(sm80_kernels(), sm90a_kernels())


@st.composite
def problems_for(draw, kernel: Kernel, max_dim: int = 300) -> Problem:
    """A problem this kernel can run: sizes respect its alignment and any divisible padding."""
    a = ("f16", draw(st.sampled_from(["row", "col"])))
    b = ("f16", draw(st.sampled_from(["row", "col"])))
    acc = draw(st.sampled_from(["f32", "f32", "f16"]))
    align = kernel.pad.align

    def size(dim: str, tile: int) -> int:
        step = tile if getattr(kernel.pad, dim) == "divisible" else 1
        step = step * align // _gcd(step, align)
        hi = max(1, max_dim // step)
        return step * draw(st.integers(1, hi))

    bm, bn, bk = kernel.tile.block
    p = Problem(size("m", bm), size("n", bn), size("k", bk), a, b, ("f16", "row"), acc)
    assume(not problem_violations(kernel, p))
    return p


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@st.composite
def kernel_problem_pairs(draw, max_dim: int = 300):
    k = draw(kernels())
    return k, draw(problems_for(k, max_dim))


@st.composite
def problems(draw, max_dim: int = 4096) -> Problem:
    """Any valid problem: sizes from 1 (primes and odd sizes included), f16 or bf16, any layouts."""
    dt = draw(st.sampled_from(["f16", "bf16"]))
    acc = "f32" if dt == "bf16" else draw(st.sampled_from(["f32", "f16"]))
    dims = st.one_of(st.integers(1, 300), st.integers(1, max_dim), st.sampled_from([64, 128, 4096, 8192, 16384]))
    return Problem(draw(dims), draw(dims), draw(dims), (dt, draw(st.sampled_from(["row", "col"]))),
                   (dt, draw(st.sampled_from(["row", "col"]))), (dt, "row"), acc)
