"""Raw CUDA with inline PTX: no CUTLASS, every instruction written out.

`lower(kernel, problem) -> LaunchPlan` picks the one lowering rule whose predicate accepts the kernel. Rules are keyed
by what the kernel computes with (its mma op and pipeline), not only by the target: an mma.sync + cp.async schedule on
sm90 is the sm80 rule's kernel. A kernel no rule accepts is a clear `UnsupportedLowering` (a NotImplementedError that
is also an L2IRError, so the search prunes it).

Rules:
  sm90a   wgmma + TMA + mbarrier warp-specialized kernels on sm90a (backends/cuda_ptx/sm90a.py), form "host_shim"
  sm80    mma.sync + ldmatrix + cp.async multistage kernels on sm80/86/89/90/90a (backends/cuda_ptx/sm80.py),
          form "kernels"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from l2ir.nodes import ARCHS, Kernel, Problem

from l2ir.runtime import LaunchPlan
from . import sm80, sm90a
from .common import UnsupportedLowering


@dataclass(frozen=True)
class Rule:
    archs: tuple[str, ...]                       # targets the rule lowers
    accepts: Callable[[Kernel], bool]            # the schedule it lowers (mma op, pipeline)
    lower: Callable[..., LaunchPlan]


RULES: dict[str, Rule] = {
    "sm90a": Rule(("sm90a",), lambda k: k.mma.op == "wgmma", sm90a.lower),
    "sm80": Rule(tuple(a for a in ARCHS), sm80.accepts, sm80.lower),
}


def rule_for(kernel: Kernel) -> str:
    """The name of the one rule that lowers `kernel`, or UnsupportedLowering naming the field no rule matches."""
    if kernel.is_source:
        raise UnsupportedLowering("source", "free-form CUDA is lowered by backends/source.py, not generated here")
    by_arch = [name for name, r in RULES.items() if kernel.target.arch in r.archs]
    if not by_arch:
        raise UnsupportedLowering("target.arch", f"'{kernel.target.arch}': cuda_ptx lowers "
                                  f"{', '.join(sorted({a for r in RULES.values() for a in r.archs}))} only")
    matches = [name for name in by_arch if RULES[name].accepts(kernel)]
    if not matches:
        raise UnsupportedLowering("mma.op", f"'{kernel.mma.op}' with pipeline.mode={kernel.pipeline.mode} on "
                                  f"{kernel.target.arch}: no cuda_ptx rule (rules for this target: "
                                  f"{', '.join(by_arch)})")
    assert len(matches) == 1, f"cuda_ptx rules overlap: {matches}"
    return matches[0]


def lower(kernel: Kernel, problem: Problem, **options) -> LaunchPlan:
    """IR -> LaunchPlan by the kernel's rule. `options` go to the rule (e.g. num_sms for sm90a)."""
    return RULES[rule_for(kernel)].lower(kernel, problem, **options)


__all__ = ["lower", "rule_for", "RULES", "Rule", "UnsupportedLowering", "sm80", "sm90a"]
