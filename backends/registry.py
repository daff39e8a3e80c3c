"""Which backend lowers which kernel.

Each backend registers a predicate over the kernel; `lower` demands exactly one match (or the backend named by the
caller), so adding a backend can never silently change which code an existing kernel gets. A kernel no backend
accepts is a clear NotImplementedError.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from l2ir.errors import L2IRError, LoweringError
from l2ir.nodes import Kernel, Problem

from l2ir.runtime import LaunchPlan


@dataclass(frozen=True)
class Backend:
    name: str
    module: str                         # imported on first use: a backend's dependencies load only when needed
    accepts: Callable[[Kernel], bool]
    default: bool = True                # False: only used when asked for by name

    def lower(self, kernel: Kernel, problem: Problem) -> LaunchPlan:
        """The backend's lowering. Unsupported features are NotImplementedError naming the field and illegal IR the
        verifier's typed error; anything else is a bug of the backend, reported as a LoweringError with the IR so
        that a search records the candidate as failed instead of stopping."""
        mod = importlib.import_module(self.module)
        try:
            return mod.lower(kernel, problem)
        except (NotImplementedError, L2IRError):
            raise
        except Exception as e:  # noqa: BLE001
            raise LoweringError(f"{self.name} failed to lower a kernel: {type(e).__name__}: {e}\n"
                                f"{kernel.text()}") from e


def _schedule(op: str, mode: str) -> Callable[[Kernel], bool]:
    return lambda k: not k.is_source and k.mma.op == op and k.pipeline.mode == mode


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("source", "l2ir.backends.source", lambda k: k.is_source),
    Backend("cute_sm80", "l2ir.backends.cute_sm80", _schedule("mma_sync", "multistage")),
    Backend("cutlass_sm90", "l2ir.backends.cutlass_sm90", _schedule("wgmma", "tma_ws")),
    Backend("cuda_ptx", "l2ir.backends.cuda_ptx", _schedule("wgmma", "tma_ws"), default=False),
    # The same module's sm80 rule (mma.sync + cp.async multistage), asked for by name: cuda_ptx.lower dispatches on
    # the kernel's mma op and pipeline.
    Backend("cuda_ptx_sm80", "l2ir.backends.cuda_ptx", _schedule("mma_sync", "multistage"), default=False),
)}


def backend_for(kernel: Kernel, name: str | None = None) -> Backend:
    if name is not None:
        if name not in BACKENDS:
            raise NotImplementedError(f"unknown backend '{name}' (backends: {', '.join(BACKENDS)})")
        backend = BACKENDS[name]
        if not backend.accepts(kernel):
            raise NotImplementedError(f"backend '{name}' does not lower this kernel:\n{kernel.text()}")
        return backend
    matches = [b for b in BACKENDS.values() if b.default and b.accepts(kernel)]
    if len(matches) != 1:
        names = ", ".join(b.name for b in matches) or "none"
        raise NotImplementedError(f"{len(matches)} default backends accept this kernel ({names}); name one:\n"
                                  f"{kernel.text()}")
    return matches[0]


def lower(kernel: Kernel, problem: Problem, backend: str | None = None) -> LaunchPlan:
    return backend_for(kernel, backend).lower(kernel, problem)
