"""What every backend owes the verifier and the runtime, checked on generated kernels:

- most legal kernels lower with their default backend, and the ones that do not name the field they lack
  (a backend that quietly stops lowering half the space fails here, not on the GPU);
- lowering is deterministic and carries the IR and the problem class;
- a "kernels" plan launches entries its source defines, with the shared memory the verifier budgeted, at most 1024
  threads, a positive grid for every shape and a cluster of at most 8 blocks;
- a "host_shim" plan defines the ABI's two C functions and uses the runtime's status codes (l2ir/runtime.py), so
  the launcher can name every refusal;
- every shipped sweep lowers with the backend it is meant for;
- every mma.sync kernel has one default: cuda_ptx_sm80 exactly for the pad.align=1 kernels it lowers, CuTe
  otherwise.
"""

import re
from collections import Counter

import pytest
from hypothesis import given, settings

from l2ir import runtime
from l2ir.analysis import smem_bytes
from l2ir.backends.registry import BACKENDS, backend_for, lower
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile
from l2ir.target import SMEM_LIMIT
from l2ir.testing import kernels, mma_sync_kernels
from l2ir.verify import verify
from l2ir.text import print_problem_class

PROBLEM = Problem(1, 1, 1)
SHAPES = ((1, 1, 1), (127, 129, 67), (4096, 4096, 4096), (64, 16384, 512))
FIELD = re.compile(r"^\w+: (tile|mma|pipeline|swizzle|pad|splitk|epilogue|target|source)(\.\w+)?: ")
STATUS = re.compile(r"constexpr int L2IR_STATUS_(\w+) = (\d+);")


def check_plan(kernel, plan):
    assert plan.source == lower(kernel, PROBLEM).source                  # deterministic
    assert plan.ir_text == kernel.text() and plan.problem_text == print_problem_class(PROBLEM)
    if plan.form == "kernels":
        assert plan.launches
        for launch in plan.launches:
            assert re.search(rf'extern "C" __global__\s+void\s+(__launch_bounds__\([^)]*\)\s*)?'
                             rf'{re.escape(launch.entry)}\s*\(', plan.source), launch.entry
            assert launch.smem <= smem_bytes(kernel) <= SMEM_LIMIT[kernel.target.arch]
            assert launch.block[0] * launch.block[1] * launch.block[2] <= 1024
            assert launch.cluster[0] * launch.cluster[1] * launch.cluster[2] <= 8
            for shape in SHAPES:
                assert min(launch.grid_for(*shape)) >= 1, (launch.entry, shape)
    else:
        assert plan.form == "host_shim" and not plan.launches
        assert re.search(r'extern "C" size_t l2ir_workspace_size\(int M, int N, int K\)', plan.source)
        assert re.search(r'extern "C" int l2ir_run\(const void\* A, const void\* B, void\* C, int M, int N, int K,',
                         plan.source)
        codes = dict(STATUS.findall(plan.source))
        assert codes, "a shim names its refusals with the runtime's status codes"
        for name, code in codes.items():
            assert int(code) == getattr(runtime, f"STATUS_{name}"), f"L2IR_STATUS_{name} = {code}"
        if "divisible" in (kernel.pad.m, kernel.pad.n, kernel.pad.k):
            assert "NOT_DIVISIBLE" in codes         # the shim refuses a shape that breaks the promise
    for shape in SHAPES:
        assert plan.workspace_for(*shape) >= 0


def test_most_generated_kernels_lower_and_every_plan_keeps_the_contract():
    lowered, refused, reasons = Counter(), Counter(), Counter()

    @settings(max_examples=300, database=None, derandomize=True)
    @given(kernels())
    def collect(kernel):
        backend = backend_for(kernel).name
        try:
            plan = lower(kernel, PROBLEM)
        except NotImplementedError as e:
            refused[backend] += 1
            first = str(e).splitlines()[0]
            assert FIELD.match(first), f"the refusal names no field: {first}"
            reasons[first.split(":")[1].strip()] += 1
            return
        lowered[backend, plan.form] += 1
        check_plan(kernel, plan)

    collect()
    for name in {b for b, _ in lowered} | set(refused):
        ok = sum(n for (b, _), n in lowered.items() if b == name)
        assert ok > refused[name], (f"{name} lowers only {ok} of {ok + refused[name]} generated kernels; "
                                    f"refusals by field: {dict(reasons)}")
    # every default backend for schedules (not free-form source) was reached and lowered something
    assert {b for b, _ in lowered} == {b.name for b in BACKENDS.values() if b.default is not False
                                       and b.name != "source"}
    assert ("cutlass_sm90", "host_shim") in lowered and ("cute_sm80", "kernels") in lowered


def test_every_kernel_kind_has_one_default_backend():
    from l2ir.search.sweeps import load_sweep

    sm80, sm90 = load_sweep("sm80").values(), load_sweep("sm90a").values()
    assert {backend_for(k).name for k in sm80} == {"cute_sm80"}
    assert {backend_for(k).name for k in sm90} == {"cutlass_sm90"}
    assert {backend_for(k, "cuda_ptx").module for k in sm90} == {"l2ir.backends.cuda_ptx.sm90a"}
    assert {backend_for(k, "cuda_ptx_sm80").module for k in sm80} == {"l2ir.backends.cuda_ptx.sm80"}
    # Split-K reduced in a thread-block cluster: only cuda_ptx lowers it, so it is that kind's one default; CUTLASS
    # names the field it does not take.
    cluster = [k for k in load_sweep("cuda_ptx").values() if k.splitk is not None and k.splitk.reduce == "cluster"]
    assert cluster and {backend_for(k).name for k in cluster} == {"cuda_ptx"}
    with pytest.raises(NotImplementedError, match="splitk.reduce=cluster"):
        backend_for(cluster[0], "cutlass_sm90")
    # Split-K inside one block likewise.
    block = [k for k in load_sweep("cuda_ptx").values() if k.splitk is not None and k.splitk.reduce == "block"]
    assert block and {backend_for(k).name for k in block} == {"cuda_ptx"}
    with pytest.raises(NotImplementedError, match="splitk.reduce=block"):
        backend_for(block[0], "cutlass_sm90")
    # The repack node likewise: cuda_ptx is the one default of every repack kernel.
    repack = [k for k in load_sweep("cuda_ptx").values() if k.repack is not None]
    assert repack and {backend_for(k).name for k in repack} == {"cuda_ptx"}
    with pytest.raises(NotImplementedError, match="repack"):
        backend_for(repack[0], "cutlass_sm90")


def test_every_shipped_sweep_lowers_with_its_backend():
    from l2ir.search.bench import default_sweep
    from l2ir.search.sweeps import load_sweep, sweep_names

    for sweep in sweep_names():
        backend = sweep if sweep in BACKENDS else None        # sm80/sm90a sweeps: the default backends
        assert default_sweep(sweep, backend) == sweep
        for name, kernel in load_sweep(sweep).items():
            plan = lower(kernel, PROBLEM, backend)
            check_plan(kernel, plan) if backend is None else None
            assert plan.source and plan.ir_text == kernel.text(), f"{sweep}/{name}"


# ---------------------------------------------------------------------------------------------------------------
# The mma.sync default: cuda_ptx_sm80 for the pad.align=1 kernels it lowers, CuTe for the rest.
# ---------------------------------------------------------------------------------------------------------------


def _sm80(block=(64, 128, 32), warps=(2, 2), align=1, **changes) -> Kernel:
    k = Kernel(target=Target("sm80"), tile=Tile(block, warps), mma=Mma("mma_sync", (16, 8, 16)),
               pipeline=Pipeline("multistage", 3, prefetch=True), swizzle=Swizzle((2, 3, 3)),
               pad=Pad("predicate", "predicate", "zero_fill", align), epilogue=Epilogue("smem", min(align, 8)))
    return verify(k.replace(**changes))


@settings(max_examples=200, database=None, derandomize=True)
@given(mma_sync_kernels())
def test_mma_sync_default_is_the_raw_rule_exactly_where_it_lowers_odd_rows(kernel):
    """One default for every generated mma.sync kernel (never "2 default backends"), and it is cuda_ptx_sm80 exactly
    when pad.align=1 and that rule lowers the kernel: its predicate is the rule's own refusals. A kernel with the
    interleave node, which only that rule lowers, defaults to it even where it refuses the kernel: the refusal then
    names the field."""
    try:
        lower(kernel, PROBLEM, "cuda_ptx_sm80")
        lowers = True
    except NotImplementedError:
        lowers = False
    if kernel.interleave is not None and not lowers:
        assert backend_for(kernel).name == "cuda_ptx_sm80"
        with pytest.raises(NotImplementedError, match=r"^cuda_ptx: (tile|mma|pipeline|swizzle|pad|splitk|epilogue)"):
            lower(kernel, PROBLEM)
        return
    default = backend_for(kernel).name
    assert default == ("cuda_ptx_sm80" if kernel.pad.align == 1 and lowers else "cute_sm80")


@pytest.mark.parametrize("align", [8, 4, 2])
def test_mma_sync_kernels_with_wider_rows_default_to_cute(align):
    """The raw rule lowers these too; CuTe stays their default (at align 2 and 4 its kernels were the faster on an
    H200: backends/registry.py)."""
    for arch in ("sm80", "sm86", "sm90a"):
        k = _sm80((128, 128, 32), align=align).replace(target=Target(arch))
        lower(k, PROBLEM, "cuda_ptx_sm80")
        assert backend_for(k).name == "cute_sm80"
        assert "l2ir_cute_sm80_gemm" in lower(k, PROBLEM).source


@pytest.mark.parametrize("field,kernel", [
    ("splitk.reduce", _sm80(splitk=SplitK("split_k", 2, "atomic"))),
    # align 1 realigns 8-element chunks per thread: 16x32 A tiles are not whole passes of 8 x 128 threads
    ("pad.align", _sm80((16, 128, 32), (1, 4))),
    # one ldmatrix.x4 yields the B fragments of two n8 blocks: BN/WN = 8 is refused
    ("tile.warps", _sm80((64, 64, 32), (1, 8))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_odd_k_kernels_the_raw_rule_refuses_stay_on_cute(field, kernel):
    assert kernel.pad.align == 1
    with pytest.raises(NotImplementedError, match=field):
        lower(kernel, PROBLEM, "cuda_ptx_sm80")
    assert backend_for(kernel).name == "cute_sm80"
    assert "l2ir_cute_sm80_gemm" in lower(kernel, PROBLEM).source
