"""Programmatic dependent launch: every backend kernel may be launched while the stream's previous grid drains, so
each must wait (griddepcontrol.wait) before its first global memory access, and only kernels that do are launched
that way. CPU checks of the generated sources and of the flag's path from the plan to the package; the GPU gates
(tests/test_backends_gpu.py, bench/pdl_probe.py) check the results under the real launch."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lark")

from l2ir.backends.compile import gencode  # noqa: E402
from l2ir.backends.registry import lower  # noqa: E402
from l2ir.dispatch import KernelSpec, launch_plan  # noqa: E402
from l2ir.export import plan_json  # noqa: E402
from l2ir.nodes import Problem, Target  # noqa: E402
from l2ir.search.sweeps import load_sweep  # noqa: E402
from l2ir.text import parse_kernel_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = Problem(256, 512, 1024)
WAIT = 'asm volatile("griddepcontrol.wait;" ::: "memory");'
TRIGGER = 'asm volatile("griddepcontrol.launch_dependents;" ::: "memory");'
GUARD = "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900"


def _kernels_form_cases():
    """One sweep kernel of each "kernels"-form backend that waits, on its own target and on Hopper's."""
    out = []
    for backend, sweep, config, first_load in (
            ("cuda_ptx_sm80", "cuda_ptx_sm80", "ptx_sm80_64x64x32_w2x2_s3", "_a(smem_base"),
            ("cuda_ptx_sm80", "cuda_ptx_sm80", "ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode", "_a(smem_base"),
            ("cuda_ptx_direct", "cuda_ptx_direct", "direct_8x32x128_w1x4_s2_k4", "load_step(s0"),
            ("cuda_ptx_direct", "cuda_ptx_direct", "direct_16x32x64_w1x4_s2_align1", "load_step(s0")):
        kernel = load_sweep(sweep)[config]
        for arch in (kernel.target.arch, "sm90a"):
            out.append(pytest.param(backend, kernel.replace(target=Target(arch)), first_load,
                                    id=f"{config}-{arch}"))
    return out


@pytest.mark.parametrize("backend,kernel,first_load", _kernels_form_cases())
def test_kernels_form_waits_before_its_first_load_and_asks_for_pdl(backend, kernel, first_load):
    problem = PROBLEM if kernel.pad.align == 8 else Problem(17, 999, 333)
    plan = lower(kernel, problem, backend=backend)
    src = plan.source
    entry = src[src.index('extern "C" __global__'):]
    # The wait is compiled for sm90+ device code only (compute_80 has no griddepcontrol); every cubin an sm90 GPU
    # loads is built at compute_90 or later (gencode), so under a pdl launch the wait is always there.
    assert f"{GUARD}\n  {WAIT}" in entry
    assert entry.index(WAIT) < entry.index(first_load), "a global load before the wait"
    assert "C[" not in entry[:entry.index(WAIT)], "a store to C before the wait"
    # The trigger after the main loop, before the epilogue: the next grid's prologue overlaps this one's stores.
    assert entry.index(WAIT) < entry.index(TRIGGER) < entry.index("epilogue")
    assert all(launch.pdl for launch in plan.launches)


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


def test_cutlass_stream_k_launches_the_ordinary_way():
    """CUTLASS 4.2's stream-K scheduler does not compile with GDC (seen on the H200 host: a const is_last_tile binds a
    non-const reference), so its kernels neither enable GDC nor ask for the launch attribute."""
    kernel = load_sweep("sm90a_skinny")["coop_128x128x64_c1x2_splitk2"]
    src = lower(kernel, PROBLEM).source
    assert "#ifndef L2IR_PDL\n#define L2IR_PDL 0\n#endif" in src
    assert "#define CUTLASS_ENABLE_GDC_FOR_SM90" not in src
