"""What a backend hands to the compiler and the evaluator: source text plus how to launch it.

Two forms:
- `kernels`: a CUDA translation unit whose `extern "C" __global__` entry points all take the L2IR ABI
      (const void* A, const void* B, void* C, int M, int N, int K, void* workspace)
  and are launched by the harness, in order, on one stream, each over its grid (expressions of m, n, k). The
  candidate's code never runs host code: this is the form for generated schedules and LLM-written Source.
- `host_shim`: a shared library built from backend-generated (trusted) host code, for libraries such as CUTLASS 3.x
  whose kernels need host-side setup (TMA descriptors, tile-scheduler params). It exports
      extern "C" size_t l2ir_workspace_size(int M, int N, int K);
      extern "C" int    l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,
                                 void* workspace, size_t workspace_bytes, void* stream);   // 0 = success
"""

from __future__ import annotations

from dataclasses import dataclass, field

from l2ir.indexing import Const, Expr, eval_launch_expr


@dataclass(frozen=True)
class Launch:
    entry: str
    grid: tuple[Expr, Expr, Expr]
    block: tuple[int, int, int]
    smem: int = 0                                 # dynamic shared memory, bytes
    cluster: tuple[int, int, int] = (1, 1, 1)     # thread-block cluster (sm90), launched with cuLaunchKernelEx

    def grid_for(self, m: int, n: int, k: int) -> tuple[int, int, int]:
        return tuple(eval_launch_expr(e, m, n, k) for e in self.grid)  # type: ignore[return-value]


@dataclass(frozen=True)
class LaunchPlan:
    source: str                                   # the whole .cu file
    arch: str                                     # nvcc arch, e.g. "sm_80" or "sm_90a"
    form: str = "kernels"                         # "kernels" or "host_shim"
    launches: tuple[Launch, ...] = ()             # for form == "kernels"
    workspace_bytes: Expr = Const(0)              # expression of m, n, k
    zero_workspace: bool = False                  # the harness memsets the workspace before the first launch
    needs_cutlass: bool = False                   # add the CUTLASS/CuTe include path
    ir_text: str = ""                             # the kernel's IR text, kept beside the source in the cache
    problem_text: str = ""                        # the problem class (dtypes, layouts) the source was lowered for
    extra_flags: tuple[str, ...] = field(default=())

    def workspace_for(self, m: int, n: int, k: int) -> int:
        return eval_launch_expr(self.workspace_bytes, m, n, k)
