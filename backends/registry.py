"""Which backend lowers which kernel: the one dispatch of L2IR.

Each entry names one lowering rule (a module's `lower(kernel, problem) -> LaunchPlan`) and the predicate of the
kernels it takes; `lower` demands exactly one default match (or the entry named by the caller), so adding a backend
can never silently change which code an existing kernel gets. A kernel no entry accepts is a clear
NotImplementedError. There is no second level: a backend module does canonicalize -> render and nothing else.
Kernels are problem-independent, so the default is chosen by the kernel; only a default that generates fewer
problem classes than the backend it displaces hands the problems outside them back to that backend
(Backend.yields_to).

The registry does what every backend would otherwise repeat: it attaches the kernel's IR text and the problem class
to the plan (they travel with the source into the compile cache), and wraps a backend's own bugs as a LoweringError
that carries the IR, so a search records the candidate as failed instead of stopping.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable

from l2ir.analysis import block_reduce, cluster_reduce
from l2ir.errors import L2IRError, LoweringError
from l2ir.nodes import Kernel, Problem
from l2ir.runtime import LaunchPlan
from l2ir.text import print_problem_class


@dataclass(frozen=True)
class Backend:
    name: str
    module: str                         # imported on first use: a backend's dependencies load only when needed
    accepts: Callable[[Kernel], bool]
    default: bool | Callable[[Kernel], bool] = True   # False: only when asked for by name; a predicate: the
    #                                                   default for the kernels it selects (among those accepted)
    function: str = "lower"             # the module's (kernel, problem, **options) -> LaunchPlan
    # A predicate default that generates fewer problem classes than the backend it displaces: (the problem classes
    # it generates, that backend's name). A problem outside them is lowered by that backend.
    yields_to: tuple[Callable[[Problem], bool], str] | None = None

    def lower(self, kernel: Kernel, problem: Problem, **options) -> LaunchPlan:
        """The backend's lowering, with the IR and the problem class attached. Unsupported features are
        NotImplementedError naming the field and illegal IR the verifier's typed error; anything else is a bug of
        the backend, reported as a LoweringError with the IR. `options` go to the backend (e.g. num_sms)."""
        mod = importlib.import_module(self.module)
        try:
            plan = getattr(mod, self.function)(kernel, problem, **options)
        except (NotImplementedError, L2IRError):
            raise
        except Exception as e:  # noqa: BLE001
            raise LoweringError(f"{self.name} failed to lower a kernel: {type(e).__name__}: {e}\n"
                                f"{kernel.text()}") from e
        return dataclasses.replace(plan, ir_text=kernel.text(), problem_text=print_problem_class(problem))


@dataclass(frozen=True)
class Schedule:
    """The predicate of a generated-code backend: the mma op and pipeline mode it lowers."""

    op: str
    mode: str
    reduces: tuple[str, ...] | None = None     # the splitk.reduce kinds it lowers (None: every kind)
    repacks: bool = False                       # lowers the repack node (the operand copy before the GEMM)
    interleaves: bool = False                   # lowers the interleave node (columns 8 apart per block)

    def mismatch(self, k: Kernel) -> str | None:
        """None if the backend takes `k`, else the fields that rule it out."""
        if k.is_source:
            return "source: free-form CUDA is lowered by the source backend"
        wrong = [f"{name}={have} (lowers {want})" for name, have, want in
                 (("mma.op", k.mma.op, self.op), ("pipeline.mode", k.pipeline.mode, self.mode)) if have != want]
        if self.reduces is not None and k.splitk is not None and k.splitk.reduce not in self.reduces:
            wrong.append(f"splitk.reduce={k.splitk.reduce} (lowers {' or '.join(self.reduces)})")
        if k.repack is not None and not self.repacks:
            wrong.append("repack (not lowered here)")
        if k.interleave is not None and not self.interleaves:
            wrong.append("interleave (not lowered here)")
        return ", ".join(wrong) or None

    def __call__(self, k: Kernel) -> bool:
        return self.mismatch(k) is None


def realigned_sm80(k: Kernel) -> bool:
    """An mma.sync kernel whose rows may start on any 2-byte boundary (pad.align=1: an odd K) that the cuda_ptx sm80
    rule lowers. CuTe reads such rows with one 2-byte load per element (no cp.async form copies 2 bytes); the raw
    rule stages the aligned 16-byte blocks around each row by cp.async and realigns them in shared memory. On an
    H200 the sm80 seeds ran 3.8-15x faster on the raw rule (bench/results/seed_align_default_h200.json against
    seed_align_cute_h200.json, recipe seed-align-default: 17x9999x3333 1557 -> 102 us, 333x555x777 76.6 -> 19.9 us,
    1024x1024x999 310 -> 39 us). At pad.align 2 and 4 both copy with 4- or 8-byte cp.async; an unrecorded probe
    found CuTe faster on every align-2/4 seed tried (1.1-5.8x; the raw rule's 128x128 tiles used 192-255 registers
    and spilled), so those stay CuTe's. The check is the rule's own list of kernel refusals (cuda_ptx.sm80.refusal):
    this default never picks a kernel the rule refuses whatever the problem."""
    if k.pad.align != 1:
        return False
    from l2ir.backends.cuda_ptx.sm80 import refusal
    return refusal(k) is None


def _cuda_ptx_problems(problem: Problem) -> bool:
    """The problem class the cuda_ptx rules generate (K-major A and B, 16-bit in and out, fp32 accumulation)."""
    from l2ir.backends.cuda_ptx.common import problem_refusal
    return problem_refusal(problem) is None


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("source", "l2ir.backends.source", lambda k: k.is_source, function="lower_source"),
    # mma.sync + cp.async kernels: CuTe, except the odd-K ones the raw sm80 rule lowers (realigned_sm80).
    Backend("cute_sm80", "l2ir.backends.cute_sm80", Schedule("mma_sync", "multistage"),
            default=lambda k: not realigned_sm80(k)),
    Backend("cutlass_sm90", "l2ir.backends.cutlass_sm90", Schedule("wgmma", "tma_ws", ("workspace", "atomic"))),
    # Raw CUDA + inline PTX. Rules are keyed by what the kernel computes with, not by its target: an mma.sync +
    # cp.async schedule on sm90 is the sm80 rule's kernel. The sm90a rule is the default for what only it lowers:
    # split-K reduced in a thread-block cluster or inside one block, the repack node and the interleave node's
    # tensor-map form; the sm80 rule for the mma.sync kernels with pad.align=1 it lowers and for every mma.sync
    # kernel with the interleave node (which only it lowers among the mma.sync rules: where it refuses one, the
    # refusal names the field), except in a problem class it does not generate (CuTe's then).
    Backend("cuda_ptx", "l2ir.backends.cuda_ptx.sm90a", Schedule("wgmma", "tma_ws", repacks=True, interleaves=True),
            default=lambda k: cluster_reduce(k) or block_reduce(k) or k.repack is not None or k.interleave is not None),
    Backend("cuda_ptx_sm80", "l2ir.backends.cuda_ptx.sm80", Schedule("mma_sync", "multistage", interleaves=True),
            default=lambda k: realigned_sm80(k) or k.interleave is not None,
            yields_to=(_cuda_ptx_problems, "cute_sm80")),
    # mma.sync fed from global memory (pipeline mode=direct): only the cuda_ptx direct rule generates it.
    Backend("cuda_ptx_direct", "l2ir.backends.cuda_ptx.direct", Schedule("mma_sync", "direct")),
)}


def _why_not(backend: Backend, kernel: Kernel) -> str:
    """The fields that keep `backend` from taking `kernel` (its Schedule's mismatch), for a refusal message."""
    return backend.accepts.mismatch(kernel) if isinstance(backend.accepts, Schedule) else "a schedule"


def backend_for(kernel: Kernel, name: str | None = None, problem: Problem | None = None) -> Backend:
    """The backend named, else the one default for `kernel`; given the problem, a default outside whose problem
    classes it lies yields to the backend it displaced (Backend.yields_to)."""
    if name is not None:
        if name not in BACKENDS:
            raise NotImplementedError(f"unknown backend '{name}' (backends: {', '.join(BACKENDS)})")
        backend = BACKENDS[name]
        if not backend.accepts(kernel):
            raise NotImplementedError(f"backend '{name}' does not lower this kernel: {_why_not(backend, kernel)}\n"
                                      f"{kernel.text()}")
        return backend
    matches = [b for b in BACKENDS.values()
               if b.accepts(kernel) and (b.default(kernel) if callable(b.default) else b.default)]
    if len(matches) != 1:
        names = ", ".join(b.name for b in matches) or "none"
        raise NotImplementedError(f"{len(matches)} default backends accept this kernel ({names}); name one:\n"
                                  f"{kernel.text()}")
    backend = matches[0]
    if problem is not None and backend.yields_to is not None and not backend.yields_to[0](problem):
        other = BACKENDS[backend.yields_to[1]]
        if not other.accepts(kernel):
            raise NotImplementedError(f"{backend.name} does not generate the problem class "
                                      f"{print_problem_class(problem)} and {other.name} does not lower this kernel: "
                                      f"{_why_not(other, kernel)}")
        return other
    return backend


def lower(kernel: Kernel, problem: Problem, backend: str | None = None, **options) -> LaunchPlan:
    return backend_for(kernel, backend, problem).lower(kernel, problem, **options)
