"""Raw CUDA with inline PTX: no CUTLASS, every instruction written out.

`lower(kernel, problem) -> LaunchPlan` picks the lowering rule registered for the kernel's target; a target with no rule
is a clear `UnsupportedLowering` (a NotImplementedError that is also an L2IRError, so the search prunes it).

Rules:
  sm90a   wgmma + TMA + mbarrier warp-specialized kernels (backends/cuda_ptx/sm90a.py), form "host_shim"

The sm80 half of this backend (mma.sync / ldmatrix / cp.async) is not written yet.
"""

from __future__ import annotations

from typing import Callable

from l2ir.nodes import Kernel, Problem

from ..plan import LaunchPlan
from . import sm90a
from .common import UnsupportedLowering

RULES: dict[str, Callable[[Kernel, Problem], LaunchPlan]] = {
    "sm90a": sm90a.lower,
}


def lower(kernel: Kernel, problem: Problem, **options) -> LaunchPlan:
    """IR -> LaunchPlan for the kernel's target. `options` go to the target's rule (e.g. num_sms for sm90a)."""
    if kernel.is_source:
        raise UnsupportedLowering("source", "free-form CUDA is lowered by backends/source.py, not generated here")
    rule = RULES.get(kernel.target.arch)
    if rule is None:
        raise UnsupportedLowering("target.arch", f"'{kernel.target.arch}': cuda_ptx lowers "
                                  f"{', '.join(sorted(RULES))} only")
    return rule(kernel, problem, **options)


__all__ = ["lower", "RULES", "UnsupportedLowering", "sm90a"]
