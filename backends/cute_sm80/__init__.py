"""cute_sm80: lower an sm80-style kernel (mma.sync m16n8k16, cp.async multistage) to CuTe C++.

    lower(kernel, problem) -> LaunchPlan

A pure, deterministic function: the same IR and problem class give byte-identical source. `problem` supplies only
dtypes, layouts and the accumulator; M, N, K are run-time arguments, so one compiled kernel serves every shape its
Pad policy admits. Unsupported combinations raise NotImplementedError naming the field; the registry
(`l2ir.backends.registry`) attaches the IR and reports any other failure as a LoweringError carrying it.
"""

from __future__ import annotations

from l2ir.indexing import Const, Var, cdiv
from l2ir.nodes import Kernel, Problem
from l2ir.text import print_problem_class

from l2ir.runtime import Launch, LaunchPlan

from .config import REDUCE_THREADS, Plan, derive
from .emit import CONVERT_ENTRY, GEMM_ENTRY, REDUCE_ENTRY, emit_source

__all__ = ["lower", "derive", "Plan"]

M, N, K = Var("m"), Var("n"), Var("k")


def _launches(p: Plan) -> tuple[Launch, ...]:
    tiles = cdiv(M, p.bm) * cdiv(N, p.bn)
    gemm = Launch(entry=GEMM_ENTRY, grid=(tiles, Const(1), Const(p.slices)), block=(p.threads, 1, 1),
                  smem=p.smem_bytes, pdl=True)
    if p.splitk == "none":
        return (gemm,)
    entry = REDUCE_ENTRY if p.splitk == "workspace" else CONVERT_ENTRY
    reduce = Launch(entry=entry, grid=(cdiv(M * N, REDUCE_THREADS * p.reduce_vector), Const(1), Const(1)),
                    block=(REDUCE_THREADS, 1, 1), smem=0, pdl=True)
    return (gemm, reduce)


def _workspace(p: Plan):
    if p.splitk == "workspace":
        return Const(p.slices) * M * N * 4      # one fp32 partial per slice
    if p.splitk == "atomic":
        return M * N * 4                        # one fp32 sum, zeroed by the harness
    return Const(0)


def lower(kernel: Kernel, problem: Problem) -> LaunchPlan:
    p = derive(kernel, problem)
    return LaunchPlan(
        source=emit_source(kernel, p, print_problem_class(problem)),
        arch=p.arch,
        form="kernels",
        launches=_launches(p),
        workspace_bytes=_workspace(p),
        zero_workspace=p.splitk == "atomic",
        needs_cutlass=True,
    )
