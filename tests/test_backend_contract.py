"""What every backend owes the verifier: a legal kernel lowers (or names the unsupported field), and the shared
memory it asks for never exceeds what the verifier budgeted."""

from hypothesis import given

from l2ir.backends.registry import backend_for, lower
from l2ir.nodes import Problem
from l2ir.verify import SMEM_LIMIT, smem_bytes
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
    from l2ir.search.bench import SM80_SWEEP, SM90_SWEEP

    assert {backend_for(k).name for k in SM80_SWEEP.values()} == {"cute_sm80"}
    assert {backend_for(k).name for k in SM90_SWEEP.values()} == {"cutlass_sm90"}
    assert backend_for(next(iter(SM90_SWEEP.values())), "cuda_ptx").name == "cuda_ptx"
