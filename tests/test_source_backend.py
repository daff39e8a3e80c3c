"""Lowering of Source kernels to launch plans: arch mapping, geometry, determinism, errors."""

import pytest

from l2ir.runtime import LaunchPlan
from l2ir.backends.registry import lower
from l2ir.backends.source import lower_source
from l2ir.target import NVCC_ARCH
from l2ir.errors import SourceError
from l2ir.indexing import Const, Var, cdiv
from l2ir.nodes import Kernel, Problem, Source, Target

CODE = """#include <cuda_fp16.h>
extern "C" __global__ void naive(const void* A, const void* B, void* C, int M, int N, int K, void* ws) {}
"""

PROBLEM = Problem(m=300, n=200, k=64)


def source_kernel(arch="sm80", code=CODE, entry="naive", smem=0):
    grid = (cdiv(Var("n"), 64), cdiv(Var("m"), 32), Const(1))
    return Kernel(target=Target(arch=arch), source=Source(entry=entry, grid=grid, block=(128, 1, 1), code=code,
                                                          smem=smem))


@pytest.mark.parametrize("arch,nvcc", sorted(NVCC_ARCH.items()))
def test_arch_maps_to_nvcc_spelling(arch, nvcc):
    assert lower_source(source_kernel(arch), PROBLEM).arch == nvcc


def test_plan_launches_the_entry_over_the_grid_expressions():
    plan = lower_source(source_kernel(smem=4096), PROBLEM)
    assert isinstance(plan, LaunchPlan)
    assert plan.form == "kernels" and len(plan.launches) == 1
    launch = plan.launches[0]
    assert launch.entry == "naive" and launch.block == (128, 1, 1) and launch.smem == 4096
    assert launch.grid_for(300, 200, 64) == (4, 10, 1)
    assert plan.workspace_for(300, 200, 64) == 0
    assert plan.source == CODE
    assert not plan.needs_cutlass


def test_lowering_is_deterministic():
    assert lower_source(source_kernel(), PROBLEM) == lower_source(source_kernel(), PROBLEM)


def test_registry_attaches_ir_and_problem_class():
    plan = lower(source_kernel(), PROBLEM)
    assert plan.source == lower_source(source_kernel(), PROBLEM).source
    assert plan.problem_text == "a=f16:row b=f16:col c=f16:row acc=f32"
    assert plan.ir_text == source_kernel().text() and "naive" in plan.ir_text
    p = Problem(m=1, n=2, k=3, a=("bf16", "col"), b=("bf16", "row"), c=("f32", "row"), acc="f16")
    assert lower(source_kernel(), p).problem_text == "a=bf16:col b=bf16:row c=f32:row acc=f16"


def test_cute_includes_request_cutlass_headers():
    code = "#include <cute/tensor.hpp>\n" + CODE
    assert lower_source(source_kernel(code=code), PROBLEM).needs_cutlass


def test_schedule_kernel_is_rejected():
    with pytest.raises(SourceError, match="source node"):
        lower_source(Kernel(target=Target(arch="sm80")), PROBLEM)


def test_missing_entry_is_rejected():
    with pytest.raises(SourceError, match="other"):
        lower_source(source_kernel(entry="other"), PROBLEM)
