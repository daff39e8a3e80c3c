"""Lowering passes: pure functions over the IR, run in order with the verifier after each.

A pass is a function `Kernel -> Kernel` that returns a new kernel (nodes are frozen, so it cannot change its
input). The last step of every pipeline is `Kernel -> LaunchPlan`: a backend from `l2ir.backends.registry`
renders the final kernel to CUDA source. Nothing here compiles.

    from l2ir.passes import PassPipeline

    def deeper_ring(kernel):                        # a pass: one more pipeline stage
        ring = dataclasses.replace(kernel.pipeline, stages=kernel.pipeline.stages + 1)
        return kernel.replace(pipeline=ring)

    lowered = PassPipeline((deeper_ring,)).run(kernel, problem)
    lowered.plan.source                             # the generated CUDA
    for stage in lowered.stages:                    # input IR, the IR after each pass, the plan, the source
        print(stage.name, stage.text)

An illegal kernel out of a pass raises the verifier's typed error with a note naming the pass; a pass that returns
something other than a Kernel is a PassError. `l2ir lower FILE --dump` prints every stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .analysis import resolved_stages
from .errors import L2IRError, VerifyError
from .nodes import Kernel, Problem
from .runtime import LaunchPlan
from .verify import verify

Pass = Callable[[Kernel], Kernel]


class PassError(L2IRError):
    """A pass broke the pass contract (it must return a Kernel)."""


@dataclass(frozen=True)
class Stage:
    """One dumped stage: its name ("input", a pass's name, "plan", "source <backend>") and its text."""

    name: str
    text: str
    suffix: str = ".l2"         # file ending when dumped to disk


@dataclass(frozen=True)
class Lowered:
    kernel: Kernel              # the kernel after every pass (what the backend rendered)
    plan: LaunchPlan
    backend: str
    stages: tuple[Stage, ...]

    def dump(self, folder: str | Path) -> list[Path]:
        """Write every stage to `folder` as 00-input.l2, 01-<pass>.l2, ..., NN-plan.txt, NN-source-<backend>.cu."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, stage in enumerate(self.stages):
            path = out / f"{i:02d}-{stage.name.replace(' ', '-')}{stage.suffix}"
            path.write_text(stage.text)
            paths.append(path)
        return paths


@dataclass(frozen=True)
class PassPipeline:
    """Passes run in order, the verifier after each; then the backend (None: the kernel's one default backend)."""

    passes: tuple[Pass, ...] = ()
    backend: str | None = None

    def apply(self, kernel: Kernel) -> tuple[Kernel, tuple[Stage, ...]]:
        """Run the passes only: the final kernel and the IR stages (input first)."""
        verify(kernel)
        stages = [Stage("input", kernel.text())]
        for p in self.passes:
            name = getattr(p, "__name__", type(p).__name__)     # a function, or a callable object
            out = p(kernel)
            if not isinstance(out, Kernel):
                raise PassError(f"pass '{name}' returned {type(out).__name__}, not a Kernel")
            try:
                verify(out)
            except VerifyError as e:
                e.add_note(f"after pass '{name}'")
                raise
            kernel = out
            stages.append(Stage(name, kernel.text()))
        return kernel, tuple(stages)

    def run(self, kernel: Kernel, problem: Problem, **options) -> Lowered:
        """Passes, then Kernel -> LaunchPlan by the backend. `options` go to the backend (e.g. num_sms)."""
        from l2ir.backends.registry import backend_for

        kernel, stages = self.apply(kernel)
        backend = backend_for(kernel, self.backend, problem)
        plan = backend.lower(kernel, problem, **options)
        tail = (Stage("plan", describe_plan(plan), ".txt"), Stage(f"source {backend.name}", plan.source, ".cu"))
        return Lowered(kernel, plan, backend.name, stages + tail)


def describe_plan(plan: LaunchPlan) -> str:
    """What the harness does with a plan: its form, arch, launches (grid as expressions of m, n, k), workspace."""
    lines = [f"form={plan.form} arch={plan.arch} needs_cutlass={str(plan.needs_cutlass).lower()} "
             f"problem_class='{plan.problem_text}'",
             f"workspace bytes = {plan.workspace_bytes}" + (" (zeroed)" if plan.zero_workspace else "")]
    for launch in plan.launches:
        grid = ", ".join(str(e) for e in launch.grid)
        lines.append(f"launch {launch.entry} grid=({grid}) block={launch.block} smem={launch.smem} "
                     f"cluster={launch.cluster}")
    if plan.form == "host_shim":
        lines.append("launch: the library's l2ir_run (host shim)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Passes shipped with L2IR.
# ---------------------------------------------------------------------------------------------------------------


def resolve_stages(kernel: Kernel) -> Kernel:
    """pipeline.stages=auto -> the number it resolves to (l2ir.analysis.resolved_stages), so the ring depth is
    explicit in the IR that later passes and the backend see."""
    if kernel.is_source or kernel.pipeline.stages != "auto":
        return kernel
    return kernel.replace(pipeline=dataclasses.replace(kernel.pipeline, stages=resolved_stages(kernel)))


# By name, for `l2ir lower --pass NAME`.
PASSES: dict[str, Pass] = {"resolve_stages": resolve_stages}
