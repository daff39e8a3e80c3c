"""The cute_sm80 backend: golden sources, determinism, per-field effects, errors, launch plans, nvcc compiles.

Regenerate the golden sources after an intended change of the generated code (review the diff: it is the change):

    python tests/test_cute_sm80.py --update-goldens
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from builds import build_all, built  # noqa: E402
from golden_sources import GoldenSources  # noqa: E402
from l2ir.backends.cute_sm80 import derive  # noqa: E402
from l2ir.errors import LoweringError  # noqa: E402
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile  # noqa: E402



def kern(block=(128, 128, 32), warps=(2, 2), stages=3, *, prefetch=True, swizzle=(2, 3, 3), raster="along_n",
         group=8, pad=("predicate", "predicate", "zero_fill"), align=8, splitk=None, epilogue=("smem", 8)) -> Kernel:
    return Kernel(
        target=Target("sm80"),
        tile=Tile(block=block, warps=warps),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("multistage", stages, prefetch=prefetch),
        swizzle=Swizzle(smem=swizzle, raster=raster, group=group),
        pad=Pad(*pad, align=align),
        splitk=SplitK("split_k", splitk[0], splitk[1]) if splitk else None,
        epilogue=Epilogue(*epilogue),
    )


def prob(a="row", b="col", dtype="f16", acc="f32", c=None) -> Problem:
    return Problem(m=1000, n=1000, k=1000, a=(dtype, a), b=(dtype, b), c=(c or dtype, "row"), acc=acc)


SEED_128 = kern()
SEED_128x256 = kern(block=(128, 256, 32), warps=(2, 4))
SEED_64 = kern(block=(64, 64, 32), group=1)

GOLDEN = {
    "tn_128x128x32_s3_smem": (SEED_128, prob()),
    "nn_128x128x32_s4_direct_along_m": (kern(stages=4, raster="along_m", group=4, epilogue=("direct", 8)),
                                        prob(b="row")),
    "tn_64x64x64_splitk4_workspace": (kern(block=(64, 64, 64), prefetch=False, swizzle=(3, 3, 3),
                                           splitk=(4, "workspace"), epilogue=("direct", 8)), prob()),
    "tn_64x64x32_s1_align1_atomic": (kern(block=(64, 64, 32), stages=1, swizzle=None, group=1,
                                          pad=("zero_fill",) * 3, align=1, splitk=(2, "atomic"),
                                          epilogue=("smem", 1)), prob()),
}


GOLDENS = GoldenSources("cute_sm80", GOLDEN, __file__)
lower = GOLDENS.lower           # the backend through the registry, the one dispatch (it attaches IR and problem)
test_golden_source, test_deterministic_in_process, test_deterministic_across_processes = GOLDENS.tests()


def changed(a: str, b: str) -> list[str]:
    """Lines that differ between two sources (either side)."""
    return [ln[1:].strip() for ln in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def src(k: Kernel, p: Problem | None = None) -> str:
    return lower(k, p or prob()).source


def edit(kernel: Kernel, node: str, **fields) -> Kernel:
    return kernel.replace(**{node: dataclasses.replace(getattr(kernel, node), **fields)})


# ---------------------------------------------------------------------------------------------------------------
# Golden sources and determinism.
# ---------------------------------------------------------------------------------------------------------------


def test_stages_change_only_the_ring():
    d = changed(src(SEED_128), src(edit(SEED_128, "pipeline", stages=5)))
    assert "constexpr int kStages = 3;" in d and "constexpr int kStages = 5;" in d
    assert all("kStages" in ln or "stages=" in ln for ln in d), d


def test_one_and_two_stages():
    s1 = src(edit(SEED_128, "pipeline", stages=1))
    assert "pipeline.stages=1: one buffer" in s1 and "cp_async_wait<0>();" in s1
    assert "for (int s = 0; s < kStages - 1; ++s)" not in s1
    s2 = src(edit(SEED_128, "pipeline", stages=2))
    assert "constexpr int kStages = 2;" in s2 and "cp_async_wait<kStages - 2>();" in s2


def test_swizzle_changes_the_smem_atoms():
    d = changed(src(SEED_128), src(edit(SEED_128, "swizzle", smem=(3, 3, 3))))
    assert any("Swizzle<3, 3, 3>" in ln for ln in d), d
    assert all(re.search(r"Swizzle|smem=|Layout<Shape<Int<\d+>, Int<\d+>>|atoms of|XOR", ln) for ln in d), d
    plain = src(edit(SEED_128, "swizzle", smem=None))
    assert "Swizzle<" not in plain and "no swizzle (swizzle.smem=none)" in plain


def test_raster_renders_the_index_function():
    from l2ir.indexing import rasterize

    for order, group in (("along_m", 1), ("along_n", 4), ("along_m", 16)):
        s = src(edit(SEED_128, "swizzle", raster=order, group=group))
        tm, tn = rasterize(order, group)
        assert f"const int tile_m = {tm.to_cpp()};" in s
        assert f"const int tile_n = {tn.to_cpp()};" in s
    d = changed(src(SEED_128), src(edit(SEED_128, "swizzle", raster="along_m")))
    assert all("tile_m" in ln or "tile_n" in ln or "raster" in ln for ln in d), d


def test_no_swizzle_node_means_plain_smem_and_row_major_raster():
    k = SEED_128.replace(swizzle=None)
    s = src(k)
    assert "Swizzle<" not in s and "swizzle.raster=along_n, group=1" in s


def test_pad_modes_change_the_loads_and_stores():
    base = src(SEED_128)
    assert "if (get<0>(coord) < M) {" in base                      # predicate: skip rows past M
    zf = src(edit(SEED_128, "pad", m="zero_fill"))
    assert "copy_zfill(GmemCopyAZfill{}, get<0>(coord) < M && get<1>(coord) < K" in zf
    pk = src(edit(SEED_128, "pad", k="predicate"))
    assert "if (kt == k_tiles - 1) {" in pk                         # only the residue tile is checked
    div = src(edit(SEED_128, "pad", m="divisible", n="divisible", k="divisible"))
    assert "auto coord" not in div and "copy(GmemCopyA{}, tAgA(_, _, _, kt), tAsA(_, _, _, pipe));" in div
    assert "if (m < M" not in div and "n < N" not in div               # no store masks either
    only_m = src(edit(SEED_128, "pad", n="divisible"))
    assert "if (m < M) {" in only_m


def test_align_picks_the_copy_atom():
    atoms = {8: "SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>", 4: "SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint64_t>",
             2: "SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>", 1: "UniversalCopy<uint16_t>"}
    for align, atom in atoms.items():
        k = edit(edit(SEED_128, "pad", align=align), "epilogue", vector=min(8, align))
        assert atom in src(k), align


def test_prefetch_changes_the_register_pipeline():
    on, off = src(SEED_128), src(edit(SEED_128, "pipeline", prefetch=False))
    assert "constexpr int kRegDepth = 2;" in on and "Register prefetch across k-tiles" in on
    assert "constexpr int kRegDepth = 1;" in off and "No register prefetch" in off
    # One stage: the prefetch stays inside the tile.
    s1 = src(edit(SEED_128, "pipeline", stages=1))
    assert "Register prefetch inside the tile" in s1
    # An odd number of k-blocks keeps all of them (the ring index must repeat every tile).
    assert derive(kern(block=(64, 128, 48)), prob()).reg_depth == 3


def test_epilogue_paths_and_vectors():
    smem = src(SEED_128)
    assert "epilogue.path=smem" in smem and "constexpr int kVec = 8;" in smem
    assert "constexpr int kVec = 4;" in src(edit(SEED_128, "epilogue", vector=4))
    direct = src(edit(SEED_128, "epilogue", path="direct"))
    assert "epilogue.path=direct" in direct and "Vec<TC, 2> out;" in direct
    scalar = src(edit(SEED_128, "epilogue", path="direct", vector=1))
    assert "Scalar stores" in scalar


def test_splitk_plans():
    ws = lower(edit(SEED_64, "pad", k="zero_fill").replace(splitk=SplitK("split_k", 4, "workspace")), prob())
    assert [ln.entry for ln in ws.launches] == ["l2ir_cute_sm80_gemm", "l2ir_cute_sm80_splitk_reduce"]
    assert ws.launches[0].grid_for(1000, 1000, 1000) == (16 * 16, 1, 4)
    assert ws.workspace_for(1000, 1000, 1000) == 4 * 1000 * 1000 * 4
    assert not ws.zero_workspace
    from l2ir.indexing import splitk_range

    b, e = splitk_range(4)
    assert f"const int k_begin = {b.to_cpp()};" in ws.source and f"const int k_end = {e.to_cpp()};" in ws.source
    at = lower(SEED_64.replace(splitk=SplitK("split_k", 3, "atomic")), prob())
    assert at.zero_workspace and at.workspace_for(100, 200, 300) == 100 * 200 * 4
    assert at.launches[1].entry == "l2ir_cute_sm80_splitk_convert" and "atomicAdd" in at.source


def test_launch_plan_basics():
    plan = lower(SEED_128, prob())
    (ln,) = plan.launches
    assert ln.block == (128, 1, 1) and ln.grid_for(1000, 1000, 8) == (64, 1, 1)
    assert ln.smem == 3 * (128 + 128) * 32 * 2
    assert plan.arch == "sm_80" and plan.needs_cutlass and plan.form == "kernels"
    assert 'extern "C" __global__ void __launch_bounds__(128)' in plan.source
    assert "int M, int N, int K, void* workspace_" in plan.source
    assert plan.workspace_for(5, 5, 5) == 0


def test_dtypes_and_layouts():
    assert "SM80_16x8x16_F16F16F16F16_TN" in src(SEED_128, prob(acc="f16"))
    bf = src(SEED_128, prob(dtype="bf16"))
    assert "SM80_16x8x16_F32BF16BF16F32_TN" in bf and "using TC = cute::bfloat16_t;" in bf
    nn = src(SEED_128, prob(b="row"))
    assert "SM75_U16x8_LDSM_T, TB" in nn and "make_stride(_1{}, int64_t(N))" in nn
    tt = src(SEED_128, prob(a="col"))
    assert "SM75_U16x8_LDSM_T, TA" in tt and "make_stride(_1{}, int64_t(M))" in tt
    assert "using TC = float;" in src(SEED_128, prob(c="f32"))


# ---------------------------------------------------------------------------------------------------------------
# Unsupported combinations name the field.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,problem,field", [
    (SEED_128.replace(splitk=SplitK("stream_k")), prob(), "splitk.mode"),
    (edit(SEED_128, "epilogue", path="tma"), prob(), "epilogue.path"),
    (edit(SEED_128, "mma", op="wgmma", shape=(64, 128, 16)), prob(), "mma.op"),
    (edit(SEED_128, "mma", shape=(16, 8, 8)), prob(), "mma.shape"),
    (edit(SEED_128, "pipeline", mode="tma_ws"), prob(), "pipeline.mode"),
    (edit(SEED_128, "tile", cluster=(2, 1)), prob(), "tile.cluster"),
    (edit(SEED_128, "swizzle", smem=(2, 2, 3)), prob(), "swizzle.smem"),
    (SEED_128, prob(dtype="bf16", acc="f16"), "gemm.acc"),
])
def test_unsupported_names_the_field(kernel, problem, field):
    with pytest.raises(NotImplementedError, match=re.escape(field)):
        lower(kernel, problem)


def test_internal_failure_is_a_lowering_error(monkeypatch):
    import l2ir.backends.cute_sm80 as backend

    def boom(*a, **k):
        raise ValueError("emitter bug")

    monkeypatch.setattr(backend, "emit_source", boom)
    with pytest.raises(LoweringError, match="tile block=128x128x32"):
        lower(SEED_128, prob())


# ---------------------------------------------------------------------------------------------------------------
# nvcc: the generated CuTe compiles, and the seed configurations do not spill.
# ---------------------------------------------------------------------------------------------------------------


COMPILE_SET = {
    "seed_128x128x32": (SEED_128, prob(), True),
    "seed_128x256x32": (SEED_128x256, prob(), True),
    "seed_64x64x32": (SEED_64, prob(), True),
    "nn_splitk_s1_align1": (kern(block=(64, 64, 32), stages=1, swizzle=None, pad=("zero_fill",) * 3, align=1,
                                 splitk=(2, "workspace"), epilogue=("direct", 1)), prob(b="row"), False),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    plans = {name: lower(k, p) for name, (k, p, _) in COMPILE_SET.items()}
    return build_all(plans, tmp_path_factory.mktemp("cache"))


@pytest.mark.nvcc
@pytest.mark.parametrize("name", sorted(COMPILE_SET))
def test_nvcc_compiles(compiled, name):
    r = built(compiled[name], name)
    if COMPILE_SET[name][2]:
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.log)
        assert spills and all(s == ("0", "0") for s in spills), r.log


if __name__ == "__main__":
    GOLDENS.main(sys.argv[1:], __doc__)
