"""What every backend owes the verifier: a legal kernel lowers (or names the unsupported field), and the shared
memory it asks for never exceeds what the verifier budgeted."""

from hypothesis import given

from l2ir.backends.registry import backend_for, lower
from l2ir.nodes import Problem
from l2ir.target import SMEM_LIMIT
from l2ir.analysis import smem_bytes
from strategies import kernels

PROBLEM = Problem(1, 1, 1)


@given(kernels())
def test_lowering_stays_within_the_verified_budget(kernel):
    try:
        plan = lower(kernel, PROBLEM)
    except NotImplementedError:
        return
    assert plan.source == lower(kernel, PROBLEM).source          # deterministic
    for launch in plan.launches:
        assert launch.smem <= smem_bytes(kernel) <= SMEM_LIMIT[kernel.target.arch]
        assert launch.block[0] * launch.block[1] * launch.block[2] <= 1024


def test_every_kernel_kind_has_one_default_backend():
    from l2ir.search.sweeps import load_sweep

    sm80, sm90 = load_sweep("sm80").values(), load_sweep("sm90a").values()
    assert {backend_for(k).name for k in sm80} == {"cute_sm80"}
    assert {backend_for(k).name for k in sm90} == {"cutlass_sm90"}
    assert {backend_for(k, "cuda_ptx").module for k in sm90} == {"l2ir.backends.cuda_ptx.sm90a"}
    assert {backend_for(k, "cuda_ptx_sm80").module for k in sm80} == {"l2ir.backends.cuda_ptx.sm80"}
