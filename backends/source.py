"""Lowering of a Source kernel (free-form CUDA) to a launch plan.

A Source node already is CUDA: the lowering only fixes how the harness launches it. Its entry point takes the L2IR
ABI (const void* A, const void* B, void* C, int M, int N, int K, void* workspace), is launched once over the node's
grid expressions and block, with the node's dynamic shared memory, and never runs host code of its own (form
"kernels"). The lowering is a pure function: the same kernel and problem give the same plan, byte for byte.
"""

from __future__ import annotations

import re

from l2ir.errors import SourceError
from l2ir.nodes import Kernel, Problem
from l2ir.target import NVCC_ARCH
from l2ir.verify import verify

from l2ir.runtime import Launch, LaunchPlan

# Code that includes CuTe or CUTLASS headers needs their include path (LLM-written kernels are often CuTe).
_CUTLASS_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](cute|cutlass)/', re.MULTILINE)


def lower_source(kernel: Kernel, problem: Problem) -> LaunchPlan:
    """Kernel with a Source node -> a one-launch plan of form "kernels"."""
    src = kernel.source
    if src is None:
        raise SourceError("source", "present", "lower_source needs a kernel with a source node; this kernel has a "
                          "schedule (lower it with its backend)")
    verify(kernel)   # the entry point is an extern "C" __global__, launch expressions are well formed, ...
    launch = Launch(entry=src.entry, grid=src.grid, block=src.block, smem=src.smem)
    return LaunchPlan(
        source=src.code if src.code.endswith("\n") else src.code + "\n",
        arch=NVCC_ARCH[kernel.target.arch],
        form="kernels",
        launches=(launch,),
        needs_cutlass=bool(_CUTLASS_INCLUDE.search(src.code)),
    )
