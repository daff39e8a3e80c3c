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
from l2ir.text import print_problem
from l2ir.verify import verify

from l2ir.runtime import Launch, LaunchPlan

# nvcc spelling of each IR arch. The "a" suffix (sm_90a) is the arch-specific feature set (wgmma, setmaxnreg):
# its code runs only on that exact SM, so it must be kept all the way to the SASS target.
NVCC_ARCH = {"sm80": "sm_80", "sm86": "sm_86", "sm89": "sm_89", "sm90": "sm_90", "sm90a": "sm_90a"}

# Code that includes CuTe or CUTLASS headers needs their include path (LLM-written kernels are often CuTe).
_CUTLASS_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](cute|cutlass)/', re.MULTILINE)


def nvcc_arch(arch: str) -> str:
    try:
        return NVCC_ARCH[arch]
    except KeyError:
        raise SourceError("target", "known_arch",
                          f"no nvcc arch for target '{arch}' (known: {', '.join(NVCC_ARCH)})") from None


def problem_text(problem: Problem) -> str:
    """The canonical one-line problem text, e.g. 'gemm m=4096 n=4096 k=4096 a=f16:row b=f16:col c=f16:row acc=f32'."""
    return print_problem(problem)


def kernel_text(kernel: Kernel) -> str:
    return kernel.text()


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
        arch=nvcc_arch(kernel.target.arch),
        form="kernels",
        launches=(launch,),
        needs_cutlass=bool(_CUTLASS_INCLUDE.search(src.code)),
        ir_text=kernel_text(kernel),
        problem_text=problem_text(problem),
    )


lower = lower_source   # the name every backend module exports
