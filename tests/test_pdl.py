"""Programmatic dependent launch: every backend kernel may be launched while the stream's previous grid drains, so
each must wait (griddepcontrol.wait) before its first global memory access, and only kernels that do are launched
that way. CPU checks of the generated sources and of the flag's path from the plan to the package; the GPU gates
(tests/test_backends_gpu.py, bench/pdl_probe.py) check the results under the real launch."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("lark")

from l2ir.backends.compile import gencode  # noqa: E402
from l2ir.backends.registry import lower  # noqa: E402
from l2ir.dispatch import KernelSpec, launch_plan  # noqa: E402
from l2ir.export import plan_json  # noqa: E402
from l2ir.nodes import Problem  # noqa: E402
from l2ir.search.sweeps import load_sweep  # noqa: E402
from l2ir.text import parse_kernel_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = Problem(256, 512, 1024)
WAIT = 'asm volatile("griddepcontrol.wait;" ::: "memory");'
TRIGGER = 'asm volatile("griddepcontrol.launch_dependents;" ::: "memory");'
GUARD = "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900"


# A global memory access in generated code: the loaders and storers the rules define, the PTX and intrinsic ones,
# and direct indexing of an operand, C, or the workspace.
GLOBAL_ACCESS = re.compile(r"\b(load_\w*|copy_\w*|ld_\w*|cp_async_zfill|cp_async_16|tma_load_\w*|tma_store_\w*|"
                           r"__stcg|__ldcg|__ldg|atomic\w*)\s*\(|\b(A|B|C|ws|part|counters|tile_counters|tile_ws)\s*[\[+]")


def _kernels_form_cases():
    """Sweep kernels of the "kernels"-form backends that wait: plain, split-K through the workspace tree, realigned
    (odd K), the direct decode kernel with and without realignment."""
    out = []
    for backend, config in (
            ("cuda_ptx_sm80", "ptx_sm80_64x64x32_w2x2_s3"),
            ("cuda_ptx_sm80", "ptx_sm80_16x128x64_w1x4_s6_splitk8_decode"),
            ("cuda_ptx_sm80", "ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode"),
            ("cuda_ptx_direct", "direct_8x32x128_w1x4_s2_k4"),
            ("cuda_ptx_direct", "direct_16x32x64_w1x4_s2_align1"),
            ("cute_sm80", "64x128x32_w2x2_s4"),
            ("cute_sm80", "64x64x32_w2x2_s3_splitk4")):
        sweep = "sm80" if backend == "cute_sm80" else backend
        out.append(pytest.param(backend, load_sweep(sweep)[config], id=f"{backend}-{config}"))
    return out


@pytest.mark.parametrize("backend,kernel", _kernels_form_cases())
def test_kernels_form_waits_before_any_global_access_and_asks_for_pdl(backend, kernel):
    problem = PROBLEM if kernel.pad.align == 8 else Problem(17, 999, 333)
    plan = lower(kernel, problem, backend=backend)
    src = plan.source
    head = 'extern "C" __global__'
    entries = [head + part for part in src.split(head)[1:]]
    assert len(entries) == len(plan.launches), "one entry per launch"
    for entry in entries:
        # The wait is compiled for sm90+ device code only (compute_80 has no griddepcontrol); every cubin an sm90
        # GPU loads is built at compute_90 or later (gencode), so under a pdl launch the wait is always there. Every
        # thread runs it, once, at the top level of the kernel: a split-K reduction's too, which reads the
        # partials the grid before it wrote.
        assert entry.count(WAIT) == 1 and f"{GUARD}\n  {WAIT}" in entry
        before = entry[:entry.index(WAIT)]
        assert GLOBAL_ACCESS.search(entry), "the pattern must see this kernel's accesses"
        found = GLOBAL_ACCESS.search(before)
        assert found is None, f"a global access before the wait: {found.group(0) if found else ''}"
    # The GEMM's trigger after the main loop, before the epilogue: the next grid's prologue overlaps its stores.
    gemm = entries[0]
    assert gemm.index(WAIT) < gemm.index(TRIGGER) < gemm.index("epilogue")
    assert all(launch.pdl for launch in plan.launches)


@pytest.mark.parametrize("config", ["ptx_coop_128x64x64", "ptx_splitk_cluster_coop_128x128x64_s4",
                                    "ptx_splitk_w4x1_64x64x64_s8", "ptx_splitk_block_64x32x64",
                                    "ptx_repack_coop_128x128x64", "ptx_w4x1_64x64x64"])
def test_sm90a_producer_and_consumers_wait_before_global_access(config):
    """The producer waits before its first TMA load; the consumers wait themselves before storing C, partials or
    pair counters (an empty K slice reaches its partial without waiting on any data the producer loaded)."""
    kernel = load_sweep("cuda_ptx")[config]
    problem = Problem(256, 512, 1001) if kernel.repack is not None else Problem(256, 512, 64)
    src = lower(kernel, problem, backend="cuda_ptx").source
    body = src[src.index("// ---- producer warpgroup"):]
    producer, consumers = body.split("// ---- consumer warpgroups", 1)
    assert producer.index("griddepcontrol.wait") < producer.index("tma_load_2d(")
    found = GLOBAL_ACCESS.search(consumers)
    assert found is not None and consumers.index(WAIT) < found.start(), "a consumer access before its wait"


def test_the_wait_is_in_compute_90_code_only(tmp_path):
    """What the gencode invariant buys, in the compiled PTX: the guarded wait is absent from compute_80 code and
    present in compute_90 code."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    kernel = load_sweep("cuda_ptx_sm80")["ptx_sm80_64x64x32_w2x2_s3"]
    cu = tmp_path / "k.cu"
    cu.write_text(lower(kernel, PROBLEM, backend="cuda_ptx_sm80").source)
    counts = {}
    for virt in ("compute_80", "compute_90"):
        out = tmp_path / f"{virt}.ptx"
        subprocess.run([nvcc, "-ptx", f"-arch={virt}", "-std=c++17", "-o", str(out), str(cu)], check=True,
                       capture_output=True, timeout=300)
        counts[virt] = out.read_text().count("griddepcontrol.wait")
    assert counts == {"compute_80": 0, "compute_90": 1}


def test_free_form_source_kernels_never_launch_with_pdl():
    """A Source kernel's author promised nothing about griddepcontrol: it launches the ordinary way."""
    _, kernel, _ = parse_kernel_file((ROOT / "examples" / "source_naive.l2").read_text(), "source_naive.l2")
    plan = lower(kernel, PROBLEM)
    assert plan.form == "kernels" and not any(launch.pdl for launch in plan.launches)


@pytest.mark.parametrize("sweep,config", [("cuda_ptx", "ptx_coop_128x64x64"),
                                          ("cuda_ptx", "ptx_splitk_cluster_coop_128x128x64_s4"),
                                          ("sm90a_skinny", "coop_128x64x64_c1x1")])
def test_host_shims_launch_with_pdl_unless_built_without(sweep, config):
    kernel = load_sweep(sweep)[config]
    plan = lower(kernel, PROBLEM, backend="cuda_ptx" if sweep == "cuda_ptx" else None)
    src = plan.source
    assert "#ifndef L2IR_PDL\n#define L2IR_PDL 1\n#endif" in src     # bench/pdl_probe.py builds -DL2IR_PDL=0
    if plan.needs_cutlass:
        # CUTLASS's GDC: its producer and epilogue wait; the adapter launches with the attribute.
        assert "#define CUTLASS_ENABLE_GDC_FOR_SM90 1" in src
        assert src.count("L2IR_PDL != 0") == 2, "both launches (kept params, first call) ask for it"
        assert src.index("CUTLASS_ENABLE_GDC_FOR_SM90") < src.index('#include "cutlass/cutlass.h"')
    else:
        launch = src[src.index("cudaLaunchConfig_t config"):]
        assert "#if L2IR_PDL" in src[:src.index("cudaLaunchConfig_t config")]
        assert "cudaLaunchKernelEx(&config" in launch and "<<<grid" not in src
        producer = src[src.index("// ---- producer warpgroup"):]
        assert producer.index("griddepcontrol.wait") < producer.index("tma_load_2d(")


def test_sm80_code_is_built_at_the_devices_feature_level():
    """The invariant the pdl launch rests on: on an sm90 GPU every non-arch-specific plan is compute_90 code."""
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):
        assert gencode(arch, "sm_90")[0] == "compute_90"


def test_pdl_travels_with_the_exported_plan():
    kernel = load_sweep("cuda_ptx_direct")["direct_8x32x128_w1x4_s2_k4"]
    plan = lower(kernel, PROBLEM, backend="cuda_ptx_direct")
    table = plan_json(plan)
    assert [ln["pdl"] for ln in table["launches"]] == [True]
    spec = KernelSpec(key="k", hash="h", problem_class="", dir=Path("."), binary="kernel.cubin", plan=table,
                      ir_file="kernel.l2")
    assert [ln.pdl for ln in launch_plan(spec).launches] == [True]
    # A package written before the flag existed loads with ordinary launches.
    old = dict(table, launches=[{k: v for k, v in ln.items() if k != "pdl"} for ln in table["launches"]])
    spec_old = KernelSpec(key="k", hash="h", problem_class="", dir=Path("."), binary="kernel.cubin", plan=old,
                          ir_file="kernel.l2")
    assert [ln.pdl for ln in launch_plan(spec_old).launches] == [False]


def test_cutlass_stream_k_launches_the_ordinary_way_unless_built_for_pdl():
    """CUTLASS 4.2's stream-K scheduler does not compile with GDC as it ships (seen on the H200 host: a const
    is_last_tile binds a non-const reference); the kernel names L2IR's tag for it, whose scheduler never asks for
    the early-release hint. Built by default for the ordinary launch (not yet through the GPU's gates with PDL),
    GDC only under -DL2IR_PDL=1."""
    kernel = load_sweep("sm90a_skinny")["coop_128x128x64_c1x2_splitk2"]
    src = lower(kernel, PROBLEM).source
    assert "#ifndef L2IR_PDL\n#define L2IR_PDL 0\n#endif\n#if L2IR_PDL\n#define CUTLASS_ENABLE_GDC_FOR_SM90 1\n#endif" in src
    assert src.count("#define CUTLASS_ENABLE_GDC_FOR_SM90") == 1
    assert "using TileScheduler = l2ir::StreamKScheduler;" in src
    assert "struct TileSchedulerSelector<l2ir::StreamKScheduler, arch::Sm90," in src
    # The specialization stands at global scope, before the anonymous namespace of the shim's own code.
    assert src.index("namespace cutlass::gemm::kernel::detail {") < src.index("namespace {")
    assert "l2ir::StreamKScheduler" not in lower(load_sweep("sm90a_skinny")["coop_128x64x64_c1x1"], PROBLEM).source
    # nvcc builds it with -DL2IR_PDL=1 in tests/test_cutlass_sm90.py (test_nvcc_stream_k_built_for_pdl).


@pytest.mark.parametrize("pdl,device_sm90,cluster,expect", [
    (True, True, (1, 1, 1), "ex+pdl"), (True, False, (1, 1, 1), "plain"), (False, True, (1, 1, 1), "plain"),
    (True, True, (2, 1, 1), "ex+cluster+pdl"), (False, True, (2, 1, 1), "ex+cluster"),
    (True, False, (2, 1, 1), "ex+cluster")])
def test_cubin_launcher_asks_for_pdl_only_where_it_may(monkeypatch, pdl, device_sm90, cluster, expect):
    """CubinLauncher's launch, against a recording driver: the programmatic-serialization attribute exactly when the
    plan's launch asks for it and the GPU is sm90 or later; cuLaunchKernelEx whenever an attribute is needed."""
    cu = pytest.importorskip("cuda.bindings.driver")
    from l2ir import runtime
    from l2ir.indexing import Const

    calls = []
    monkeypatch.setattr(cu, "cuLaunchKernel", lambda *a: calls.append(("plain", None)) or (cu.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(cu, "cuLaunchKernelEx", lambda config, *a: calls.append(("ex", config))
                        or (cu.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(runtime, "current_stream", lambda: 0)
    launch = runtime.Launch(entry="k", grid=(Const(4), Const(1), Const(1)), block=(128, 1, 1), cluster=cluster, pdl=pdl)
    launcher = object.__new__(runtime.CubinLauncher)      # no module to load: only the launch path is under test
    launcher.plan = runtime.LaunchPlan(source="", arch="sm_90", launches=(launch,))
    launcher._funcs = [0]
    launcher._pdl_device = device_sm90
    launcher(0, 0, 0, 64, 64, 64, 0, 0)
    (kind, config), = calls
    if expect == "plain":
        assert kind == "plain"
        return
    ids = [a.id for a in config.attrs]
    PSS = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    CLUSTER = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert kind == "ex" and config.numAttrs == len(ids)
    assert (PSS in ids) == ("pdl" in expect) and (CLUSTER in ids) == ("cluster" in expect)
