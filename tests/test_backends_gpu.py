"""Generated kernels of every backend on a real GPU, through the evaluator's gates (accuracy against float64, every
element written, guard bands, stale output, fp16-accumulation probe, ragged shapes).

Two sets, all built in one parallel compile through backends/compile.py and evaluated by one Evaluator:
- every registry backend's seed (where the backend lowers it) and two kernels of its sweep, at one aligned and one
  ragged shape;
- the coverage configurations that the standalone bench/*_check.py harnesses used to run, which reach every field a
  backend lowers (layouts, bf16, fp16 accumulation, f32 output, alignment 1-8, every pad mode, split-K workspace and
  atomic, stream-K, clusters, both epilogue paths, BK 16..64, stages 1..4), at the shapes their Pad admits.

Gates only (no timing: `l2ir bench` times). About a minute of GPU time after the compiles (CUTLASS ones take the
longest). Run on the device:  python -m pytest -q -m gpu tests/test_backends_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest

from l2ir.backends.compile import CompileOptions, compile_many
from l2ir.backends.registry import BACKENDS, lower
from l2ir.nodes import Epilogue, Interleave, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile
from l2ir.search.sweeps import load_sweep
from l2ir.seed import seed
from test_evaluator_gpu import SKIP     # the evaluator's readiness check: torch on a GPU, cuda-python, nvcc

ALIGNED = (1024, 768, 512)
RAGGED = (1000, 1000, 1000)      # not a multiple of any tile, still 16-byte rows (TMA and align-8 kernels take it)
ODD = (127, 129, 67)             # only kernels with align 1 and no divisibility promise take it

F16 = Problem(1, 1, 1)           # a=f16:row b=f16:col c=f16:row acc=f32


def problem_class(a="row", b="col", dtype="f16", acc="f32", c=None) -> Problem:
    return Problem(m=1, n=1, k=1, a=(dtype, a), b=(dtype, b), c=(c or dtype, "row"), acc=acc)


# ---------------------------------------------------------------------------------------------------------------
# Coverage configurations (formerly bench/cute_sm80_check.py, cutlass_sm90_check.py, cuda_ptx_check.py).
# ---------------------------------------------------------------------------------------------------------------


def sm80(block, warps, stages, *, prefetch=True, swizzle=(2, 3, 3), raster="along_n", group=1,
         pad=("predicate", "predicate", "zero_fill"), align=8, splitk=None, epilogue=("smem", 8)) -> Kernel:
    return Kernel(target=Target("sm80"), tile=Tile(block=block, warps=warps), mma=Mma("mma_sync", (16, 8, 16)),
                  pipeline=Pipeline("multistage", stages, prefetch=prefetch),
                  swizzle=Swizzle(smem=swizzle, raster=raster, group=group), pad=Pad(*pad, align=align),
                  splitk=SplitK("split_k", *splitk) if splitk else None, epilogue=Epilogue(*epilogue))


CUTE_SM80 = {
    "seed_128x128x32_s3": (sm80((128, 128, 32), (2, 2), 3, group=8), problem_class()),
    "seed_128x256x32_s3": (sm80((128, 256, 32), (2, 4), 3, group=8), problem_class()),
    "seed_64x64x32_s3": (sm80((64, 64, 32), (2, 2), 3), problem_class()),
    # B row (N-contiguous: ldmatrix.trans), 4 stages, along_m raster, direct epilogue.
    "nn_128x128x32_s4_direct": (sm80((128, 128, 32), (2, 2), 4, raster="along_m", group=4, epilogue=("direct", 8)),
                                problem_class(b="row")),
    # Split-K through the workspace and the reduction kernel; no register prefetch; BK=64 with <3,3,3>.
    "splitk4_ws_64x64x64": (sm80((64, 64, 64), (2, 2), 3, prefetch=False, swizzle=(3, 3, 3), splitk=(4, "workspace"),
                                 epilogue=("direct", 8)), problem_class()),
    # Split-K with fp32 atomics into a zeroed workspace, predicate K, 2 stages, bf16.
    "splitk3_atomic_bf16_s2": (sm80((128, 64, 32), (2, 2), 2, pad=("zero_fill", "predicate", "predicate"),
                                    splitk=(3, "atomic")), problem_class(dtype="bf16")),
    # One stage, no swizzle, align 1 (plain loads), zero_fill everywhere, scalar stores: any shape at all.
    "s1_align1_noswz": (sm80((64, 64, 32), (2, 2), 1, swizzle=None, pad=("zero_fill",) * 3, align=1,
                             epilogue=("direct", 1)), problem_class()),
    # align 4 (8-byte cp.async.ca), A col (M-contiguous), fp16 accumulation, BK=48 (an odd fragment ring).
    "acol_align4_f16acc_bk48": (sm80((64, 128, 48), (2, 2), 3, pad=("predicate", "zero_fill", "predicate"), align=4,
                                     epilogue=("smem", 4)), problem_class(a="col", acc="f16")),
    # Everything divisible: no bounds checks at all.
    "divisible_128x128x64_s3": (sm80((128, 128, 64), (2, 2), 3, swizzle=(3, 3, 3), pad=("divisible",) * 3),
                                problem_class()),
    # align 2, BK=16 (one k-block per tile), f32 output.
    "align2_bk16_f32out": (sm80((64, 128, 16), (1, 4), 4, swizzle=(1, 3, 3), align=2, epilogue=("smem", 2)),
                           problem_class(c="f32")),
}


def sm90(schedule, block, cluster=(1, 1), **changes) -> Kernel:
    warps = (8, 1) if schedule == "cooperative" else (4, 1)
    k = Kernel(target=Target("sm90a"), tile=Tile(block, warps, cluster), mma=Mma("wgmma", (64, block[1], 16)),
               pipeline=Pipeline("tma_ws", "auto", schedule, persistent=True),
               pad=Pad("zero_fill", "zero_fill", "zero_fill", 8), epilogue=Epilogue("tma", 8))
    return k.replace(**changes)


CUTLASS_SM90 = {
    "coop_128x256x64_c2x1": (sm90("cooperative", (128, 256, 64), (2, 1)), F16),
    "coop_128x256x64_c1x2": (sm90("cooperative", (128, 256, 64), (1, 2)), F16),
    "coop_256x128x64_c1x1": (sm90("cooperative", (256, 128, 64)), F16),
    "pingpong_128x128x64_c1x1": (sm90("pingpong", (128, 128, 64)), F16),
    "coop_128x256x64_c2x1_streamk": (sm90("cooperative", (128, 256, 64), (2, 1), splitk=SplitK("stream_k")), F16),
    "coop_128x128x64_c1x1_splitk2": (sm90("cooperative", (128, 128, 64), splitk=SplitK("split_k", 2)), F16),
}


def ptx(block=(128, 256, 64), epilogue=("direct", 2), persistent=True, raster=("along_n", 8)) -> Kernel:
    k = sm90("cooperative", block, epilogue=Epilogue(*epilogue), swizzle=Swizzle((3, 3, 3), *raster))
    return k.replace(pipeline=dataclasses.replace(k.pipeline, persistent=persistent))


CUDA_PTX = {
    "coop_128x256x64_direct": (ptx(), F16),
    "coop_128x256x64_smem8": (ptx(epilogue=("smem", 8)), F16),
    "coop_256x128x64_smem8_along_m": (ptx(block=(256, 128, 64), epilogue=("smem", 8), raster=("along_m", 8)), F16),
    "coop_128x128x64_direct": (ptx(block=(128, 128, 64)), F16),
    "coop_128x256x64_direct_nonpersistent": (ptx(persistent=False, raster=("along_n", 1)), F16),
}

COVERAGE = {"cute_sm80": CUTE_SM80, "cutlass_sm90": CUTLASS_SM90, "cuda_ptx": CUDA_PTX}

# ---------------------------------------------------------------------------------------------------------------
# Every registry backend: its seed (where it lowers it) and two kernels of its sweep.
# ---------------------------------------------------------------------------------------------------------------

SWEEP = {"cute_sm80": "sm80", "cutlass_sm90": "sm90a", "cuda_ptx": "cuda_ptx", "cuda_ptx_sm80": "cuda_ptx_sm80",
         "cuda_ptx_direct": "cuda_ptx_direct"}
SEED_ARCH = {"cute_sm80": "sm80", "cutlass_sm90": "sm90a", "cuda_ptx": "sm90a", "cuda_ptx_sm80": "sm80",
             "cuda_ptx_direct": "sm80"}


def registry_cases() -> dict[tuple[str, str], tuple[Kernel, Problem]]:
    cases = {}
    for backend, sweep in SWEEP.items():
        kernel = seed(F16.with_shape(*ALIGNED), SEED_ARCH[backend])
        try:
            lower(kernel, F16, backend)
            cases[(backend, "seed")] = (kernel, F16)
        except NotImplementedError:
            pass         # e.g. the seed is ping-pong and cuda_ptx generates cooperative kernels only
        for name, k in list(load_sweep(sweep).items())[:2]:
            cases[(backend, name)] = (k, F16)
    return cases


def all_cases() -> dict[tuple[str, str], tuple[Kernel, Problem]]:
    cases = registry_cases()
    for backend, configs in COVERAGE.items():
        for name, case in configs.items():
            cases[(backend, "coverage:" + name)] = case
    return cases


CASES = all_cases()


def test_every_registry_backend_is_covered():
    """Runs without a GPU: every generated-code backend has a seed or two sweep kernels here, they lower, and each
    runs at the aligned shape (and all but the divisible ones at the ragged shape too)."""
    from l2ir.search.gates import admits

    generated = {name for name in BACKENDS if name != "source"}    # source: tests/test_evaluator_gpu.py
    assert {backend for backend, _ in CASES} == generated
    for backend in generated:
        assert sum(1 for b, _ in CASES if b == backend) >= 2, backend
    for (backend, name), (kernel, problem) in CASES.items():
        assert lower(kernel, problem, backend).source, (backend, name)
        assert admits(kernel, problem.with_shape(*ALIGNED))[0], (backend, name)
        divisible = "divisible" in (kernel.pad.m, kernel.pad.n, kernel.pad.k)
        assert admits(kernel, problem.with_shape(*RAGGED))[0] != divisible, (backend, name)


# ---------------------------------------------------------------------------------------------------------------
# On the GPU.
# ---------------------------------------------------------------------------------------------------------------


gpu = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _skip_unless_hopper() -> tuple[int, int]:
    """The GPU's compute capability; skips the test unless it runs sm90a kernels."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (9, 0):
        pytest.skip(f"the sm90a kernels need a Hopper GPU; this one is sm_{major}{minor}")
    return major, minor


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    major, minor = _skip_unless_hopper()
    keys = list(CASES)
    plans = [lower(*CASES[key], key[0]) for key in keys]
    options = CompileOptions(cache_dir=str(tmp_path_factory.mktemp("cache")), device_sm=f"sm_{major}{minor}")
    return {key: (plan, art) for key, plan, art in zip(keys, plans, compile_many(plans, options))}


@pytest.fixture(scope="module")
def evaluator():
    from l2ir.search.evaluator import EvalConfig, Evaluator

    with Evaluator(EvalConfig(scenarios=(), phase_timeout_s=120)) as ev:
        yield ev


def _build_for_this_gpu(plan, cache_dir):
    """The plan compiled for the GPU the tests run on; a compile failure fails the test with its reproducer."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    (art,) = compile_many([plan], CompileOptions(cache_dir=str(cache_dir), device_sm=f"sm_{major}{minor}"))
    assert art.ok, f"compile {art.reason}: {art.summary()}\nreproduce: {art.repro}"
    return art


def _assert_passes_every_gate(evaluator, kernel, problem_cls, plan, art, shapes, label, must_run=frozenset()):
    """Each shape is admitted by the kernel's rules and passes every gate of the evaluator, which ran at least the
    gates named in `must_run`."""
    from l2ir.search.gates import admits

    for shape in shapes:
        problem = problem_cls.with_shape(*shape)
        ok, why = admits(kernel, problem)
        assert ok, f"{label} at {shape}: {why}"
        (m,) = evaluator.evaluate(kernel, problem, plan, art)
        failed = [f"{v.name}: {v.detail}" for v in m.verdicts if not v.passed]
        assert m.passed and not m.errors, f"{label} at {shape}: errors {m.errors}; failed gates {failed}"
        ran = {v.name for v in m.verdicts if not v.skipped}
        assert set(must_run) <= ran, (shape, ran)


def _assert_splitk_repeatable(kernel, plan, art, shape, seed, counters_per_tile=None):
    """Split-K reduced in the kernel: one workspace zeroed once and three launches. Every counter (all of the
    workspace after the tiles' fp32 partials) is back at zero after each launch (the next launch needs no memset),
    C has the same bits each time (the slices are summed in a fixed order whichever block arrives last) and is
    within fp32-accumulation error of fp64. `counters_per_tile`, where given, is the layout's count of counters.
    A kernel that asks for no workspace (reduce=cluster) is held to the same C checks."""
    import torch

    from l2ir.indexing import column_tiles
    from l2ir.runtime import load
    from l2ir.search.gates import relative_error, tolerance

    mm, nn, kk = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((mm, kk), generator=gen, device="cuda").half()
    b = torch.randn((nn, kk), generator=gen, device="cuda").half()          # B col: stored N x K, K contiguous
    ws_bytes = plan.workspace_for(mm, nn, kk)
    ws = torch.zeros(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    tiles = -(-mm // kernel.tile.bm) * int(column_tiles(nn, kernel.tile.bn, kernel.interleave is not None).eval({}))
    slices = kernel.splitk.slices if kernel.splitk is not None else 0      # no split: a repeatability check only
    partial_bytes = tiles * slices * kernel.tile.bm * kernel.tile.bn * 4
    counters = ws[partial_bytes:ws_bytes]
    if ws_bytes:
        assert counters.numel() >= 4 * tiles, (ws_bytes, partial_bytes)
    if counters_per_tile is not None:
        assert counters.numel() == 4 * tiles * counters_per_tile, (counters.numel(), tiles, counters_per_tile)
    launcher = load(plan, art.binary)
    try:
        outs = []
        for _ in range(3):
            c = torch.full((mm, nn), float("nan"), dtype=torch.half, device="cuda")
            launcher(a.data_ptr(), b.data_ptr(), c.data_ptr(), mm, nn, kk, ws.data_ptr(), ws_bytes)
            torch.cuda.synchronize()
            assert int(counters.count_nonzero()) == 0, "split-K left counters non-zero"
            outs.append(c)
    finally:
        launcher.close()
    ref = a.double() @ b.double().t()
    assert relative_error(outs[0], ref) <= tolerance(kk, "f32", "f16")
    assert (outs[0].double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    for c in outs[1:]:
        assert torch.equal(c.view(torch.int16), outs[0].view(torch.int16)), "split-K output differs run to run"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("key", list(CASES), ids=[f"{b}-{n}" for b, n in CASES])
def test_generated_kernel_passes_every_gate(built, evaluator, key):
    from l2ir.search.gates import admits

    kernel, problem_cls = CASES[key]
    plan, art = built[key]
    assert art.ok, f"compile {art.reason}: {art.summary()}\nreproduce: {art.repro}"
    shapes = [s for s in (ALIGNED, RAGGED, ODD) if admits(kernel, problem_cls.with_shape(*s))[0]]
    assert ALIGNED in shapes, admits(kernel, problem_cls.with_shape(*ALIGNED))[1]
    _assert_passes_every_gate(evaluator, kernel, problem_cls, plan, art, shapes, key,
                              {"accuracy", "all_written", "guard_bands"})


# ---------------------------------------------------------------------------------------------------------------
# cuda_ptx sm90a families for small and skinny shapes: the latency-bound one-warpgroup kernels (tile.warps=4x1, one
# tile per block) and split-K with the in-kernel reduction, from the cuda_ptx sweep plus a staged-epilogue variant,
# at the skinny, tiny and ragged shapes they are for (each also runs the evaluator's ragged_shapes gate).
# ---------------------------------------------------------------------------------------------------------------


def _cuda_ptx_small_families() -> dict[str, Kernel]:
    kernels = {name: k for name, k in load_sweep("cuda_ptx").items() if not name.startswith("ptx_coop")}
    base = kernels["ptx_w4x1_64x256x64"]
    kernels["w4x1_64x256x64_smem8"] = base.replace(epilogue=Epilogue("smem", 8))
    return kernels


CUDA_PTX_SMALL = _cuda_ptx_small_families()
# Skinny DRAM-bound, ragged (M, N and K tails), tiny, and a few-tiles shape; 100x1000x16264 (255 k tiles) is the
# ragged shape that every slice count up to 32 admits (every slice owns a k tile); 128x3072x4096 is whole tiles of
# every tile, BN = 48 included, and 128x3584x4096 of BN = 56.
CUDA_PTX_SMALL_SHAPES = ((64, 1024, 16384), (100, 3000, 4104), (64, 64, 64), (128, 16384, 4096), (100, 1000, 16264),
                         (128, 3072, 4096), (128, 3584, 4096))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(CUDA_PTX_SMALL))
def test_cuda_ptx_small_shape_families_pass_every_gate(evaluator, tmp_path_factory, name):
    from l2ir.search.gates import admits

    _skip_unless_hopper()
    kernel = CUDA_PTX_SMALL[name]
    plan = lower(kernel, F16, "cuda_ptx")
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("cuda_ptx_small"))
    # A multicast cluster also runs where its grid has blocks past the tiles along N (5 tiles of 256 in 2x2).
    extra = ((128, 1280, 8192),) if kernel.tile.cluster != (1, 1) else ()
    shapes = [s for s in CUDA_PTX_SMALL_SHAPES + extra if admits(kernel, F16.with_shape(*s))[0]]
    ragged = [any(d % t for d, t in zip(s, kernel.tile.block)) for s in shapes]
    assert any(ragged) and not all(ragged), (shapes, [admits(kernel, F16.with_shape(*s))[1]
                                                      for s in CUDA_PTX_SMALL_SHAPES])
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, shapes, name,
                              {"accuracy", "ulp", "all_written", "guard_bands", "ragged_shapes"})
    if kernel.splitk is not None:
        from l2ir.indexing import SplitKTree

        tree = kernel.splitk.reduce == "workspace"      # reduce=cluster and reduce=block ask for no workspace
        _assert_splitk_repeatable(kernel, plan, art, shapes[0], seed=7,
                                  counters_per_tile=SplitKTree(kernel.splitk.slices).counters if tree else None)


# ---------------------------------------------------------------------------------------------------------------
# cuda_ptx sm90a TMA multicast in thread-block clusters (tile.cluster, l2ir.indexing.ClusterMulticast): one tile per
# block, each block loading a share of its A box for its patch row and of its B box for its patch column. At shapes
# whose tile grid is not a whole number of clusters (blocks past the grid load for the others and store nothing:
# 64x64x64 is one tile in a cluster of 8), at the skinny shape the family is for, and at many clusters; every gate,
# then three launches bit-identical (no race between a remote release and a refill).
# ---------------------------------------------------------------------------------------------------------------


def _multicast_kernels() -> dict[str, Kernel]:
    def lat(block, cluster, epilogue=("direct", 2), pad="zero_fill"):
        return Kernel(target=Target("sm90a"), tile=Tile(block, (4, 1), cluster), mma=Mma("wgmma", (64, block[1], 16)),
                      pipeline=Pipeline("tma_ws", "auto", "pingpong", persistent=False),
                      swizzle=Swizzle((3, 3, 3), "along_n", 8), pad=Pad(pad, pad, "zero_fill", 8),
                      epilogue=Epilogue(*epilogue))

    kernels = {f"w4x1_64x64x64_c{cm}x{cn}": lat((64, 64, 64), (cm, cn))
               for cm, cn in ((1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 2), (8, 1))}
    kernels["w4x1_64x128x64_c1x4_smem8"] = lat((64, 128, 64), (1, 4), epilogue=("smem", 8))
    kernels["w4x1_64x64x64_c2x2_divisible"] = lat((64, 64, 64), (2, 2), pad="divisible")
    coop = ptx(block=(128, 64, 64), persistent=False)
    kernels["coop_128x64x64_c1x4"] = coop.replace(tile=Tile((128, 64, 64), (8, 1), (1, 4)))
    kernels["coop_128x64x64_c2x1_smem8"] = coop.replace(tile=Tile((128, 64, 64), (8, 1), (2, 1)),
                                                        epilogue=Epilogue("smem", 8))
    # The narrow-N sweep tiles: B boxes of 3 and 4 swizzle atoms (24 and 32 rows), A shared by 4 or 8 blocks.
    sweep = load_sweep("cuda_ptx")
    for name in ("ptx_coop_128x24x64_c1x4", "ptx_coop_128x32x64_c1x4", "ptx_coop_128x32x64_c1x8"):
        kernels[name.removeprefix("ptx_")] = sweep[name]
    return kernels


MULTICAST = _multicast_kernels()
MULTICAST_SHAPES = ((100, 3000, 4104), (130, 200, 136), (64, 64, 64), (1000, 1000, 2048), (256, 512, 1024))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(MULTICAST))
def test_cuda_ptx_multicast_passes_every_gate(evaluator, tmp_path_factory, name):
    from l2ir.search.gates import admits

    _skip_unless_hopper()
    kernel = MULTICAST[name]
    plan = lower(kernel, F16, "cuda_ptx")
    assert "tma_load_2d_multicast" in plan.source
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("multicast"))
    shapes = [s for s in MULTICAST_SHAPES if admits(kernel, F16.with_shape(*s))[0]]
    assert len(shapes) >= 2, shapes
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, shapes, name,
                              {"accuracy", "ulp", "all_written", "guard_bands"})
    _assert_splitk_repeatable(kernel, plan, art, shapes[0], seed=11, counters_per_tile=None)


# ---------------------------------------------------------------------------------------------------------------
# cuda_ptx sm90a with epilogue.path=tma: C staged as swizzled 64-column boxes and stored by cp.async.bulk.tensor
# (clipped at M and N), persistent cooperative tiles (the buffer reused once the previous tile's store has read it),
# a 256-row tile, and the two-blocks-per-SM one-warpgroup tile; ragged shapes, every gate, then repeated launches
# bit-identical.
# ---------------------------------------------------------------------------------------------------------------

TMA_STORE = {
    "coop_128x256x64_tma": ptx(epilogue=("tma", 8)),
    "coop_128x128x64_tma": ptx(block=(128, 128, 64), epilogue=("tma", 8)),
    "coop_256x128x64_tma_along_m": ptx(block=(256, 128, 64), epilogue=("tma", 8), raster=("along_m", 8)),
    "w4x1_64x128x64_s4_tma": Kernel(
        target=Target("sm90a"), tile=Tile((64, 128, 64), (4, 1), (1, 1)), mma=Mma("wgmma", (64, 128, 16)),
        pipeline=Pipeline("tma_ws", 4, "pingpong", persistent=False), swizzle=Swizzle((3, 3, 3), "along_n", 1),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8), epilogue=Epilogue("tma", 8)),
}
TMA_STORE_SHAPES = ((130, 200, 136), (8192, 4096, 128), (100, 3000, 4104), (64, 64, 64), (1000, 1000, 2048))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(TMA_STORE))
def test_cuda_ptx_tma_store_passes_every_gate(evaluator, tmp_path_factory, name):
    from l2ir.search.gates import admits

    _skip_unless_hopper()
    kernel = TMA_STORE[name]
    plan = lower(kernel, F16, "cuda_ptx")
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in plan.source
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("tma_store"))
    shapes = [s for s in TMA_STORE_SHAPES if admits(kernel, F16.with_shape(*s))[0]]
    assert len(shapes) >= 3, shapes
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, shapes, name,
                              {"accuracy", "ulp", "all_written", "guard_bands"})
    _assert_splitk_repeatable(kernel, plan, art, shapes[0], seed=13, counters_per_tile=None)


# ---------------------------------------------------------------------------------------------------------------
# cuda_ptx sm90a split-K reduced in the kernel, both ways:
# - the pairwise tree through the workspace (l2ir.indexing.SplitKTree), at slice counts that are and are not powers
#   of two, on the two-blocks-per-SM 64x64 tile, the one-block 64x128 tile and a persistent cooperative kernel (256
#   consumer threads, blocks walking several units);
# - the thread-block cluster (l2ir.indexing.ClusterReduce), 2-16 slices (above 8 the non-portable cluster opt-in),
#   deep rings and two blocks per SM, a 64x128 tile and a non-persistent cooperative kernel (two consumer warpgroups
#   share the tile's fragments); no workspace.
# Every gate at a ragged shape, then at every admitted shape three launches (on one workspace zeroed once):
# bit-identical C within fp32-accumulation error of fp64, every pair counter back at zero.
# ---------------------------------------------------------------------------------------------------------------


def _splitk_kernels() -> dict[str, Kernel]:
    def lat(block, stages, splitk):
        return Kernel(target=Target("sm90a"), tile=Tile(block, (4, 1), (1, 1)), mma=Mma("wgmma", (64, block[1], 16)),
                      pipeline=Pipeline("tma_ws", stages, "pingpong", persistent=False),
                      swizzle=Swizzle((3, 3, 3), "along_n", 1), pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
                      splitk=splitk, epilogue=Epilogue("direct", 2))

    kernels = {}
    for s in SPLITK_SLICES:
        kernels[f"tree_w4x1_64x64x64_st4_s{s}"] = lat((64, 64, 64), 4, SplitK("split_k", s))
        kernels[f"tree_w4x1_64x128x64_auto_s{s}"] = lat((64, 128, 64), "auto", SplitK("split_k", s))
        kernels[f"cluster_w4x1_64x64x64_auto_s{s}"] = lat((64, 64, 64), "auto", SplitK("split_k", s, "cluster"))
    kernels["tree_coop_128x128x64_persistent_smem8_s5"] = ptx(block=(128, 128, 64), epilogue=("smem", 8)).replace(
        splitk=SplitK("split_k", 5))
    kernels["cluster_w4x1_64x64x64_st4_s16"] = lat((64, 64, 64), 4, SplitK("split_k", 16, "cluster"))
    kernels["cluster_w4x1_64x128x64_auto_s4"] = lat((64, 128, 64), "auto", SplitK("split_k", 4, "cluster"))
    kernels["cluster_coop_128x128x64_nonpersistent_s4"] = ptx(
        block=(128, 128, 64), persistent=False, raster=("along_n", 1)).replace(splitk=SplitK("split_k", 4, "cluster"))
    # The seed's and the rules' tile for 64 < M <= 128 with a long K (l2ir.seed.coop_split_kernel): 128x64, two consumers.
    for s in (2, 4):
        kernels[f"cluster_coop_128x64x64_nonpersistent_s{s}"] = ptx(
            block=(128, 64, 64), persistent=False, raster=("along_n", 1)).replace(
                splitk=SplitK("split_k", s, "cluster"))
    # reduce=block (l2ir.indexing.BlockSplit): the two consumer warpgroups of one block split the K loop. The sweep's
    # tiles at the ring that fills shared memory, the shallowest legal ring (4 stages: each consumer owns two and
    # holds one two positions back), two 64-row slabs per warpgroup, and BN = 48 (an odd count of fragment units
    # per slab).
    for block, stages in (((64, 64, 64), "auto"), ((64, 128, 64), "auto"), ((64, 48, 64), "auto"),
                          ((64, 64, 64), 4), ((128, 64, 64), 4)):
        k = ptx(block=block, persistent=False, raster=("along_n", 1))
        kernels[f"block_coop_{'x'.join(map(str, block))}_st{stages}"] = k.replace(
            pipeline=dataclasses.replace(k.pipeline, stages=stages), splitk=SplitK("split_k", 2, "block"))
    return kernels


SPLITK_SLICES = (2, 3, 5, 8, 16)
SPLITK = _splitk_kernels()
# Ragged M and N with a few tiles; ragged M and N with hundreds of tiles (thousands of blocks racing on counters);
# the aligned skinny shape the family is for; a ragged K (65 k tiles: only the slice counts that leave no slice
# empty take it).
SPLITK_SHAPES = ((130, 200, 4096), (1000, 1000, 2048), (64, 2048, 8192), (127, 130, 4104))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(SPLITK))
def test_cuda_ptx_splitk_reduction(evaluator, tmp_path_factory, name):
    from l2ir.indexing import SplitKTree
    from l2ir.search.gates import admits

    _skip_unless_hopper()
    kernel = SPLITK[name]
    plan = lower(kernel, F16, "cuda_ptx")
    tree = kernel.splitk.reduce == "workspace"
    assert tree or (plan.workspace_for(1000, 1000, 2048) == 0 and not plan.zero_workspace)
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("splitk"))
    shapes = [s for s in SPLITK_SHAPES if admits(kernel, F16.with_shape(*s))[0]]
    assert (130, 200, 4096) in shapes and (1000, 1000, 2048) in shapes, shapes
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, [(130, 200, 4096)], name,
                              {"accuracy", "ulp", "all_written", "guard_bands"})
    for i, shape in enumerate(shapes):
        _assert_splitk_repeatable(kernel, plan, art, shape, seed=100 + i,
                                  counters_per_tile=SplitKTree(kernel.splitk.slices).counters if tree else None)


# ---------------------------------------------------------------------------------------------------------------
# cuda_ptx_sm80 kernel families: split-K reduced inside the kernel (one launch), decode / skinny tiles, unaligned K
# (pad.align 4 / 2 / 1). Each at the shapes it is for, aligned and ragged, through every gate; split-K kernels also
# launched three times on one workspace zeroed once: bit-identical C each time, counters left zero.
# ---------------------------------------------------------------------------------------------------------------

PTX_SM80_FAMILIES = {
    "decode_16x128x64_w1x4_s6_splitk8": (
        sm80((16, 128, 64), (1, 4), 6, swizzle=(3, 3, 3), raster="along_m", splitk=(8, "workspace"),
             epilogue=("direct", 2)),
        [(16, 4096, 4096), (64, 1024, 16384), (13, 3000, 4104)]),
    "decode_32x128x64_w1x4_s6_splitk4": (
        sm80((32, 128, 64), (1, 4), 6, swizzle=(3, 3, 3), raster="along_m", splitk=(4, "workspace")),
        [(64, 1024, 16384), (100, 3000, 4104)]),
    "decode_64x128x64_w2x4_s4_splitk16": (
        sm80((64, 128, 64), (2, 4), 4, swizzle=(3, 3, 3), raster="along_m", splitk=(16, "workspace")),
        [(64, 1024, 16384), (50, 1000, 10000)]),
    "skinny_n_128x32x64_w4x1_s6_splitk4": (
        sm80((128, 32, 64), (4, 1), 6, swizzle=(3, 3, 3), splitk=(4, "workspace")),
        [(12288, 64, 12288), (3000, 104, 4104)]),
    "skinny_n_128x64x64_w4x1_s4_splitk2": (
        sm80((128, 64, 64), (4, 1), 4, swizzle=(3, 3, 3), splitk=(2, "workspace")),
        [(12288, 64, 12288), (3000, 56, 4104)]),
    "small_64x64x64_w1x2_s8_splitk2": (
        sm80((64, 64, 64), (1, 2), 8, swizzle=(3, 3, 3), splitk=(2, "workspace")),
        [(1024, 768, 512), (100, 3000, 4104)]),
    # Slice counts that are not powers of two: a subtree without a sibling climbs a level unchanged.
    "tree_64x64x64_w2x2_s4_splitk3": (
        sm80((64, 64, 64), (2, 2), 4, swizzle=(3, 3, 3), splitk=(3, "workspace")), [(130, 200, 4096), (64, 64, 192)]),
    "tree_64x64x64_w2x2_s4_splitk5_align1": (
        sm80((64, 64, 64), (2, 2), 4, swizzle=(3, 3, 3), align=1, pad=("predicate", "zero_fill", "zero_fill"),
             splitk=(5, "workspace"), epilogue=("direct", 1)), [(333, 555, 777), (130, 200, 4097)]),
    "latency_64x64x64_w2x2_s4": (
        sm80((64, 64, 64), (2, 2), 4, swizzle=(3, 3, 3)), [(64, 64, 64), (1024, 768, 512), (100, 3000, 4104)]),
    "align4_64x128x32_w2x2_s4": (
        sm80((64, 128, 32), (2, 2), 4, align=4, epilogue=("smem", 4)), [(512, 512, 1004), (1000, 1000, 1004)]),
    "align2_64x64x64_w2x2_s4": (
        sm80((64, 64, 64), (2, 2), 4, swizzle=(3, 3, 3), align=2, pad=("zero_fill", "predicate", "predicate"),
             epilogue=("direct", 2)), [(512, 512, 1002), (1000, 1000, 998)]),
    # Odd K through 16-byte blocks staged by cp.async and realigned in shared memory: rows start on every 2-byte
    # offset, chunks straddle two blocks, the last k-tile and the rows past M / N are masked; tiny K (1, 7, 9) leaves
    # a single partial k-tile.
    "align1_64x64x32_w2x2_s4": (
        sm80((64, 64, 32), (2, 2), 4, align=1, epilogue=("smem", 1)),
        [(1000, 1000, 999), (127, 129, 67), (333, 555, 777), (5, 7, 1), (33, 17, 7), (65, 63, 9)]),
    "align1_16x128x64_w1x4_s4_splitk4": (
        sm80((16, 128, 64), (1, 4), 4, swizzle=(3, 3, 3), align=1, pad=("predicate", "zero_fill", "zero_fill"),
             splitk=(4, "workspace"), epilogue=("direct", 1)), [(16, 4096, 4097), (100, 3000, 999), (17, 9999, 3333)]),
    "align1_16x128x64_w1x4_s3_splitk4": (
        sm80((16, 128, 64), (1, 4), 3, swizzle=(3, 3, 3), align=1, pad=("predicate", "zero_fill", "zero_fill"),
             splitk=(4, "workspace"), epilogue=("direct", 1)), [(1, 777, 1001), (17, 9999, 3333)]),
    "align1_128x128x32_w2x4_s4": (
        sm80((128, 128, 32), (2, 4), 4, align=1, epilogue=("smem", 1)),
        [(4096, 4096, 1001), (1000, 1000, 999), (127, 129, 67), (3, 5, 9)]),
    "align1_128x128x32_w2x2_s4": (
        sm80((128, 128, 32), (2, 2), 4, align=1, epilogue=("smem", 1)), [(1024, 1024, 999), (333, 555, 777), (7, 9, 7)]),
    # 128x128x64 with 3 and 4 stages of staged blocks: 172 / 208 KB of shared memory, an sm90-class carve-out.
    "align1_128x128x64_w2x4_s4_sm90a": (
        sm80((128, 128, 64), (2, 4), 4, swizzle=(3, 3, 3), align=1, epilogue=("smem", 1)).replace(
            target=Target("sm90a")), [(4096, 4096, 1001), (333, 555, 777), (1023, 1025, 1027), (3, 5, 1)]),
    "align1_128x128x64_w2x4_s3_sm90a": (
        sm80((128, 128, 64), (2, 4), 3, swizzle=(3, 3, 3), align=1, epilogue=("smem", 1)).replace(
            target=Target("sm90a")), [(2000, 3000, 777), (512, 512, 4097), (9, 9, 9)]),
    # Fewer than 3 stages: one realigned tile, realigned just before its MMAs behind a second barrier.
    "align1_64x128x64_w2x2_s2": (
        sm80((64, 128, 64), (2, 2), 2, swizzle=(3, 3, 3), align=1, epilogue=("smem", 1)),
        [(333, 555, 777), (127, 129, 1)]),
    "align1_64x64x32_w2x2_s1": (
        sm80((64, 64, 32), (2, 2), 1, align=1, pad=("zero_fill",) * 3, epilogue=("direct", 1)),
        [(333, 555, 777), (100, 100, 7)]),
    "align1_128x64x32_w2x2_s4": (
        sm80((128, 64, 32), (2, 2), 4, align=1, epilogue=("smem", 1)), [(1000, 1000, 999), (127, 129, 67)]),
    "align1_128x128x32_w2x4_s4_kpredicate": (
        sm80((128, 128, 32), (2, 4), 4, align=1, pad=("predicate", "predicate", "predicate"), epilogue=("smem", 1)),
        [(1023, 1025, 1027), (127, 129, 67), (333, 555, 777)]),
    "align1_64x128x32_w2x2_s4_noprefetch": (
        sm80((64, 128, 32), (2, 2), 4, prefetch=False, align=1, pad=("zero_fill", "predicate", "zero_fill"),
             epilogue=("direct", 1)), [(1000, 1000, 999), (127, 129, 67), (31, 33, 7)]),
    "align1_64x128x32_w2x2_s2_noprefetch": (
        sm80((64, 128, 32), (2, 2), 2, prefetch=False, align=1, pad=("zero_fill", "predicate", "predicate"),
             epilogue=("direct", 1)), [(333, 555, 777), (127, 129, 9)]),
    "align1_64x64x64_w2x2_s4_splitk4": (
        sm80((64, 64, 64), (2, 2), 4, swizzle=(3, 3, 3), align=1, pad=("predicate", "zero_fill", "zero_fill"),
             splitk=(4, "workspace"), epilogue=("direct", 1)), [(1000, 1000, 999), (512, 512, 4097)]),
    "align1_32x128x64_w2x4_s4_splitk4": (
        sm80((32, 128, 64), (2, 4), 4, swizzle=(3, 3, 3), align=1, pad=("predicate", "zero_fill", "zero_fill"),
             splitk=(4, "workspace"), epilogue=("direct", 1)), [(127, 129, 1027), (33, 4096, 4097)]),
    # The interleave node: each block's columns 8 apart, B's rows of one residue read from their common offset
    # straight into the stages, only A realigned; odd, even and aligned K, N not a multiple of 8, M past the tile.
    "interleave_32x128x64_w2x4_s4_splitk3": (
        sm80((32, 128, 64), (2, 4), 4, swizzle=(3, 3, 3), align=1, pad=("predicate", "zero_fill", "zero_fill"),
             splitk=(3, "workspace"), epilogue=("direct", 1)).replace(interleave=Interleave()),
        [(17, 9999, 3333), (8, 11008, 4095), (33, 130, 300), (31, 4001, 2048)]),
    "interleave_16x128x64_w1x4_s3_splitk4_kpredicate": (
        sm80((16, 128, 64), (1, 4), 3, swizzle=(3, 3, 3), align=1, pad=("zero_fill", "predicate", "predicate"),
             splitk=(4, "workspace"), epilogue=("direct", 1)).replace(interleave=Interleave()),
        [(1, 777, 1001), (17, 1029, 999), (5, 9, 251)]),
    "interleave_64x64x32_w2x2_s2_noprefetch_smem": (
        sm80((64, 64, 32), (2, 2), 2, prefetch=False, align=1, epilogue=("smem", 1)).replace(
            interleave=Interleave()), [(333, 555, 777), (127, 129, 9), (5, 7, 1)]),
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(PTX_SM80_FAMILIES))
def test_cuda_ptx_sm80_families_pass_every_gate(evaluator, tmp_path, name):
    kernel, shapes = PTX_SM80_FAMILIES[name]
    plan = lower(kernel, F16, "cuda_ptx_sm80")
    art = _build_for_this_gpu(plan, tmp_path)
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, shapes, name,
                              {"accuracy", "all_written", "guard_bands"})
    if kernel.splitk is not None:
        from l2ir.indexing import SplitKTree

        _assert_splitk_repeatable(kernel, plan, art, shapes[-1], seed=11,
                                  counters_per_tile=SplitKTree(kernel.splitk.slices).counters)


# ---------------------------------------------------------------------------------------------------------------
# The interleave node's tensor-map form (cuda_ptx sm90a): B's view through one TMA map from each row's own start, A's
# fragments in registers, the last k tile's columns of B past K zeroed in shared memory, the N mod 8 last columns dot
# products of the consumer warps. Odd, even and aligned K; N a multiple of 8 (no tail) or not; M past one tile.
# ---------------------------------------------------------------------------------------------------------------


def interleave_sm90a(block=(64, 128, 64), stages=4, slices=3, dtype="f16") -> Kernel:
    return Kernel(target=Target("sm90a"), tile=Tile(block, (4, 1)), mma=Mma("wgmma", (64, block[1], 16)),
                  pipeline=Pipeline("tma_ws", stages, "pingpong", persistent=False),
                  swizzle=Swizzle((3, 3, 3), "along_n", 1), pad=Pad("zero_fill", "zero_fill", "zero_fill", 1),
                  splitk=SplitK("split_k", slices) if slices > 1 else None, epilogue=Epilogue("direct", 1),
                  interleave=Interleave())


INTERLEAVE_SM90A = {
    "w4x1_64x128x64_s4_splitk3": (interleave_sm90a(), [(17, 9999, 3333), (8, 11008, 4095), (33, 130, 300),
                                                         (31, 4001, 2048), (70, 1029, 999)]),
    "w4x1_64x64x64_s6": (interleave_sm90a((64, 64, 64), 6, 1), [(1, 8, 321), (5, 15, 251), (64, 1000, 77),
                                                                  (17, 9999, 3333)]),
    "w4x1_64x256x128_s2_splitk2": (interleave_sm90a((64, 256, 128), 2, 2), [(16, 8192, 4097), (100, 3000, 4103)]),
    "w4x1_128x128x64_s4_two_slabs": (interleave_sm90a((128, 128, 64), 4, 1), [(70, 1029, 999), (130, 4001, 2047)]),
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(INTERLEAVE_SM90A))
def test_cuda_ptx_interleave_passes_every_gate(evaluator, tmp_path_factory, name):
    _skip_unless_hopper()
    kernel, shapes = INTERLEAVE_SM90A[name]
    plan = lower(kernel, F16, "cuda_ptx")
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("interleave"))
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, shapes, name,
                              {"accuracy", "all_written", "guard_bands"})
    if kernel.splitk is not None:
        from l2ir.indexing import SplitKTree

        _assert_splitk_repeatable(kernel, plan, art, shapes[0], seed=11,
                                  counters_per_tile=SplitKTree(kernel.splitk.slices).counters)


@pytest.mark.gpu
@gpu
def test_cuda_ptx_interleave_zeroes_what_runs_past_k(tmp_path_factory):
    """The last k tile of a view row runs on into the next residue's row of B (an Inf there times A's zero is NaN):
    the kernel must zero those columns of B (A's fragments load zeros there). Inf in the first elements of every other row of A and B
    reaches only the rows and columns that hold it: the rest of C stays finite and matches fp64."""
    import torch

    from l2ir.runtime import load
    from l2ir.search.gates import relative_error, tolerance

    _skip_unless_hopper()
    kernel = interleave_sm90a(slices=1)
    plan = lower(kernel, F16, "cuda_ptx")
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("interleave_inf"))
    mm, nn, kk = 33, 1029, 999      # 999 = 15 x 64 + 39: the last k tile reads 25 elements of the next row
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn((mm, kk), generator=gen, device="cuda").half()
    b = torch.randn((nn, kk), generator=gen, device="cuda").half()
    a[1::2, :32] = float("inf")
    b[1::2, :32] = float("inf")
    c = torch.full((mm, nn), float("nan"), dtype=torch.half, device="cuda")
    launcher = load(plan, art.binary)
    try:
        launcher(a.data_ptr(), b.data_ptr(), c.data_ptr(), mm, nn, kk, 0, 0)   # raises on a non-zero status
        torch.cuda.synchronize()
    finally:
        launcher.close()
    clean = c[0::2][:, 0::2]
    assert bool(torch.isfinite(clean).all()), "a row or column without Inf came out Inf or NaN"
    ref = a[0::2].double() @ b[0::2].double().t()
    assert relative_error(clean, ref) <= tolerance(kk, "f32", "f16")
    assert not bool(torch.isfinite(c[1::2]).any()), "the rows of A that hold Inf must carry it"


# ---------------------------------------------------------------------------------------------------------------
# An odd N with wide loads: B is K-major, so its rows stay 16-byte aligned (pad.align=8); only C's rows are odd, and
# the stores narrow to epilogue.vector=1 (verify's alignment rule keeps the two apart). One kernel per backend.
# ---------------------------------------------------------------------------------------------------------------


def _odd_n_kernels() -> dict[str, tuple[str, Kernel]]:
    narrow = lambda k, path: k.replace(epilogue=Epilogue(path, 1))  # noqa: E731
    return {
        "cuda_ptx_sm80": ("cuda_ptx_sm80", narrow(load_sweep("cuda_ptx_sm80")["ptx_sm80_128x128x32_w2x2_s4"], "smem")),
        "cute_sm80": ("cute_sm80", narrow(load_sweep("sm80")["128x128x32_w2x2_s4"], "smem")),
        "cuda_ptx": ("cuda_ptx", narrow(load_sweep("cuda_ptx")["ptx_w4x1_64x128x64"], "direct")),
        "cutlass_sm90": ("cutlass_sm90", narrow(load_sweep("sm90a")["pingpong_128x128x64_c1x1"], "direct")),
        "seed": (None, seed(F16.with_shape(4096, 1001, 4096), "sm90a")),
    }


ODD_N = _odd_n_kernels()


def test_odd_n_kernels_keep_wide_loads():
    for name, (_, kernel) in ODD_N.items():
        assert kernel.pad.align == 8 and kernel.epilogue.vector == 1, name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(ODD_N))
def test_odd_n_with_wide_loads_passes_every_gate(evaluator, tmp_path, name):
    backend, kernel = ODD_N[name]
    plan = lower(kernel, F16, backend)
    art = _build_for_this_gpu(plan, tmp_path)
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, ((256, 1001, 512), (100, 50257, 64), (333, 999, 1000)),
                              name)


# ---------------------------------------------------------------------------------------------------------------
# cuda_ptx sm90a with the repack node: an odd K copies A and B into aligned rows before the GEMM, which then runs on
# TMA like an aligned problem. Every gate at odd-K, odd-N and aligned shapes; then the copy in the workspace is
# checked against l2ir.indexing.Repack's layout (the operand's bits at `dst`, zeros in the pad columns).
# ---------------------------------------------------------------------------------------------------------------


def _repack_kernels() -> dict[str, Kernel]:
    from l2ir.nodes import Repack

    sweep = load_sweep("cuda_ptx")
    vec1 = Epilogue("direct", 1)
    return {
        "coop_128x128x64": sweep["ptx_coop_128x128x64"].replace(repack=Repack(), epilogue=vec1),
        "w4x1_64x128x64": sweep["ptx_w4x1_64x128x64"].replace(repack=Repack(), epilogue=vec1),
        "tree_w4x1_64x64x64_s4_st4": sweep["ptx_splitk_w4x1_64x64x64_s4_st4"].replace(repack=Repack(),
                                                                                      epilogue=vec1),
        "cluster_w4x1_64x64x64_s8": sweep["ptx_splitk_cluster_w4x1_64x64x64_s8"].replace(repack=Repack(),
                                                                                         epilogue=vec1),
        # TMA multicast over the aligned copies: a cluster's blocks load shares of the copied rows for each other,
        # alone and with split-K through the workspace (one copy of the cluster grid per K slice).
        "multicast_w4x1_64x64x64_c2x1": sweep["ptx_w4x1_64x64x64_c2x1"].replace(repack=Repack(), epilogue=vec1),
        "multicast_splitk_w4x1_64x256x64_s2_c2x1": sweep["ptx_splitk_w4x1_64x256x64_s2_c2x1"].replace(
            repack=Repack(), epilogue=vec1),
    }


REPACK = _repack_kernels()
REPACK_SHAPES = ((512, 512, 4097), (1023, 1025, 1027), (333, 555, 777), (130, 200, 4104), (64, 64, 1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(REPACK))
def test_cuda_ptx_repack_passes_every_gate(evaluator, tmp_path_factory, name):
    import torch

    from l2ir.indexing import Repack
    from l2ir.runtime import load
    from l2ir.search.gates import admits

    _skip_unless_hopper()
    kernel = REPACK[name]
    plan = lower(kernel, F16, "cuda_ptx")
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("repack"))
    shapes = [s for s in REPACK_SHAPES if admits(kernel, F16.with_shape(*s))[0]]
    assert (512, 512, 4097) in shapes and (130, 200, 4104) in shapes, shapes
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, shapes, name,
                              {"accuracy", "ulp", "all_written", "guard_bands", "ragged_shapes"})
    # The copies the GEMM read: rows of `pitch` at Repack's offsets, the operand's bits then zeros.
    mm, nn, kk = 333, 555, 777
    a = torch.randn((mm, kk), device="cuda").half()
    b = torch.randn((nn, kk), device="cuda").half()
    c = torch.empty((mm, nn), device="cuda").half()
    ws_bytes = plan.workspace_for(mm, nn, kk)
    ws = torch.full((ws_bytes // 2,), float("nan"), dtype=torch.half, device="cuda")
    launcher = load(plan, art.binary)
    try:
        launcher(a.data_ptr(), b.data_ptr(), c.data_ptr(), mm, nn, kk, ws.data_ptr(), ws_bytes)
        torch.cuda.synchronize()
    finally:
        launcher.close()
    rp, env, pitch = Repack(), {"m": mm, "n": nn, "k": kk}, -(-kk // 8) * 8
    for op, x in (("A", a), ("B", b)):
        off = int(rp.offset(op).eval(env))
        copy = ws[off:off + x.shape[0] * pitch].view(x.shape[0], pitch)
        assert torch.equal(copy[:, :kk].view(torch.int16), x.view(torch.int16)), op
        assert int(copy[:, kk:].view(torch.int16).count_nonzero()) == 0, op


@pytest.mark.gpu
@gpu
def test_cutlass_kept_params_follow_pointers_and_shape(tmp_path_factory):
    """The CUTLASS shim keeps the kernel parameters of a thread's last few workspace-free calls, keyed by pointers,
    shape and device. Reused, they must never answer another call: new data behind the same pointers, more output
    buffers than the shim keeps (so kept entries are replaced), and another M, N or K on the same pointers (the
    operands and C laid out densely from the same base addresses) each give the fp64 product of the call's own
    operands, and leave the rest of C's buffer untouched (parameters of a larger shape would write past it)."""
    import torch

    from l2ir.backends.cutlass_sm90 import KEPT_PARAMS
    from l2ir.runtime import load
    from l2ir.search.gates import relative_error, tolerance

    _skip_unless_hopper()
    kernel, problem_cls = CUTLASS_SM90["pingpong_128x128x64_c1x1"]
    plan = lower(kernel, problem_cls, "cutlass_sm90")
    art = _build_for_this_gpu(plan, tmp_path_factory.mktemp("kept_params"))
    mm, nn, kk = 384, 256, 192
    a_buf = torch.empty(mm * kk, dtype=torch.half, device="cuda")
    b_buf = torch.empty(nn * kk, dtype=torch.half, device="cuda")
    outs = [torch.empty(mm * nn, dtype=torch.half, device="cuda") for _ in range(KEPT_PARAMS + 2)]
    gen = torch.Generator(device="cuda").manual_seed(7)
    launcher = load(plan, art.binary)

    def check(m, n, k, c_buf, label):
        a = a_buf[:m * k].view(m, k)
        b = b_buf[:n * k].view(n, k)                    # B col: stored N x K, K contiguous
        a.copy_(torch.randn((m, k), generator=gen, device="cuda"))
        b.copy_(torch.randn((n, k), generator=gen, device="cuda"))
        c_buf.fill_(float("nan"))
        launcher(a_buf.data_ptr(), b_buf.data_ptr(), c_buf.data_ptr(), m, n, k, 0, 0)
        torch.cuda.synchronize()
        ref = a.double() @ b.double().t()
        assert relative_error(c_buf[:m * n].view(m, n), ref) <= tolerance(k, "f32", "f16"), label
        assert bool(c_buf[m * n:].isnan().all()), f"{label}: wrote past its {m}x{n} output"

    try:
        for lap in range(2):                    # 6 outputs through a ring of 4: every call of lap 2 a miss
            for i, c in enumerate(outs):
                check(mm, nn, kk, c, f"lap {lap} output {i}")
        for i in range(3):                      # the same pointers again and again: kept parameters, new data
            check(mm, nn, kk, outs[-1], f"repeat {i}")
        check(mm - 128, nn, kk, outs[-1], "fewer rows on the same pointers")
        check(mm, nn - 64, kk, outs[-1], "fewer columns on the same pointers")
        check(mm, nn, kk - 64, outs[-1], "a shorter K on the same pointers")
        check(mm, nn, kk, outs[-1], "the first shape again")
    finally:
        launcher.close()


# ---------------------------------------------------------------------------------------------------------------
# pipeline mode=direct (the cuda_ptx direct rule): fragments loaded from global memory by each lane. Every sweep
# kernel on decode shapes (M = 1, rows past a tile, N not a multiple of BN); the align-1 kernels on odd K, where
# every row of A and B starts on a 2-byte boundary and the two aligned vectors around it are shifted.
# ---------------------------------------------------------------------------------------------------------------


def _direct_cases() -> dict[str, tuple[Kernel, list[tuple[int, int, int]]]]:
    cases = {}
    for name, k in load_sweep("cuda_ptx_direct").items():
        # K slices (splitk reduce=block) need a k step each: the short K gives the last slices exactly one.
        slices, bk = (k.splitk.slices if k.splitk is not None else 1), k.tile.bk
        shapes = [(1, 4096, 4096), (k.tile.bm + 3, 1000, 1000), (2, 96, slices * bk + 8)]
        if k.pad.align == 1:
            # Odd K: the last k step partial (7 of BK) with exactly one step per slice, and past it.
            shapes = [(17, 999, 333 + slices * bk), (1, 129, (slices - 1) * bk + 67),
                      (k.tile.bm + 1, 64, (slices - 1) * bk + 7)]
        cases[name] = (k, shapes)
    narrow = load_sweep("cuda_ptx_direct")["direct_16x32x64_w1x4_s2_align1"]
    cases["align1_odd_n_divisible_k"] = (narrow.replace(pad=Pad("predicate", "predicate", "zero_fill", 1)),
                                         [(5, 1001, 4096), (8, 33, 257)])
    return cases


DIRECT = _direct_cases()


@pytest.mark.parametrize("name", list(DIRECT))
def test_direct_cases_are_admitted(name):
    """Runs without a GPU: every shape the GPU test below gates is one its kernel's rules admit (a sweep kernel
    with BK=32 and K slices once made the short-K shape 25 elements short of zero)."""
    from l2ir.search.gates import admits

    kernel, shapes = DIRECT[name]
    for shape in shapes:
        ok, why = admits(kernel, F16.with_shape(*shape))
        assert ok, f"{name} at {shape}: {why}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(DIRECT))
def test_cuda_ptx_direct_passes_every_gate(evaluator, tmp_path, name):
    kernel, shapes = DIRECT[name]
    plan = lower(kernel, F16, "cuda_ptx_direct")
    art = _build_for_this_gpu(plan, tmp_path)
    _assert_passes_every_gate(evaluator, kernel, F16, plan, art, shapes, name,
                              {"accuracy", "all_written", "guard_bands"})
