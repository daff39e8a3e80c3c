"""The policy protocol: what a search asks of a proposer of kernel edits, and what it gives back.

A search step is data. The loop hands a policy a `Context` (the problem, the parent kernel and what is known about
it, the earlier steps on this problem, the GPU's target, a seed and how many proposals it wants); the policy
answers with `Proposal`s (an edit list, or a whole kernel, with a note saying why). The loop legalizes each one
(`Proposal.apply`: the verifier, the problem rules and the backend's lowering checks), dedupes, compiles and times
them, and hands the outcomes back as `Feedback` (the reward and a verdict: illegal, failed or measured). A policy
that learns keeps what it learned in `state_dict()`, which the records DB stores and a later run reloads.

    class Policy(Protocol):
        name: str
        def propose(self, context: Context) -> list[Proposal]
        def update(self, feedback: list[Feedback]) -> None
        def state_dict(self) -> dict | bytes               # JSON-able, or bytes
        def load_state_dict(self, state: dict | bytes) -> None

Shipped policies are looked up by name with `get_policy("random" | "rules" | "learned", **kwargs)`; a user plugs in
their own by passing the object itself, by `register_policy(name, factory)`, or as "package.module:Factory".
examples/my_policy.py is a complete custom policy in twenty lines.

Rewards: `Feedback.reward` is the natural log of the candidate's speedup over the baseline (torch.matmul) when the
verdict is "measured", and None otherwise; each policy decides what an illegal or failed proposal costs it.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from l2ir.edits import Edit, apply_edits, print_edits
from l2ir.errors import L2IRError
from l2ir.nodes import Kernel, Problem
from l2ir.seed import H200_SMS
from l2ir.verify import check_problem

Verdict = Literal["illegal", "failed", "measured"]
VERDICTS = ("illegal", "failed", "measured")


@dataclass(frozen=True)
class Measured:
    """What the loop knows about a kernel on this problem. Every field may be unknown (None)."""

    speedup: float | None = None      # baseline time / kernel time (offline scenario); > 1 beats torch.matmul
    time_us: float | None = None      # the kernel's median device time
    registers: int | None = None      # registers per thread, from the compiled binary
    spills: int | None = None         # bytes spilled to local memory


@dataclass(frozen=True)
class Step:
    """One earlier step on this problem: the kernel that came out, the edits that made it, its reward (None when
    it was illegal or failed)."""

    kernel: Kernel
    edits: tuple[Edit, ...] = ()
    reward: float | None = None


@dataclass(frozen=True)
class Context:
    """Everything a policy may look at to propose edits to `parent` for `problem`.

    `arch` is the target of the GPU the search runs on (sm90a on an H100/H200): a policy may move a kernel to any
    rule that GPU runs (the sm80 rules run on Hopper too), never to a newer one. `backend` names the backend the
    parent is lowered by (None: the registry's default for the kernel). `seed` makes proposals reproducible: the
    same context gives the same proposals."""

    problem: Problem
    parent: Kernel
    measured: Measured = Measured()
    history: tuple[Step, ...] = ()
    arch: str = "sm90a"
    num_sms: int = H200_SMS
    seed: int = 0
    count: int = 8
    backend: str | None = None

    def rng(self, salt: int = 0) -> np.random.Generator:
        """A generator fixed by the seed, the problem and the parent, so two contexts differing in any of them draw
        differently and the same context always draws the same."""
        key = int(self.parent.content_hash()[:15], 16)
        return np.random.default_rng([self.seed & 0xFFFFFFFF, self.problem.m, self.problem.n, self.problem.k,
                                      key, salt])

    @property
    def parent_reward(self) -> float | None:
        s = self.measured.speedup
        return math.log(s) if s is not None and s > 0 else None


@dataclass(frozen=True)
class Proposal:
    """Edits to the parent, applied in order (intermediate kernels need not be legal: a tile change and the MMA
    shape that must follow it are one step), or a whole kernel. `backend` asks for a backend by name (None: the
    registry's default for the resulting kernel). `note` says why, for the records and the reader."""

    edits: tuple[Edit, ...] = ()
    kernel: Kernel | None = None
    note: str = ""
    backend: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "edits", tuple(self.edits))
        if self.kernel is None and not self.edits:
            raise ValueError("a Proposal needs edits or a kernel")
        if self.kernel is not None and self.edits:
            raise ValueError("a Proposal is edits or a whole kernel, not both")

    def text(self) -> str:
        """The edit lines (`set pipeline.stages = 5` ...), or the kernel's text."""
        return print_edits(self.edits) if self.edits else self.kernel.text()

    def apply(self, parent: Kernel, problem: Problem | None = None, lowerable: bool = True) -> Kernel:
        """The legal child kernel, or the typed error that makes it illegal: the verifier's rules, the problem's
        rules (when a problem is given) and, with `lowerable`, the backend's own checks (an UnsupportedLowering,
        which is a NotImplementedError, or a VerifyError)."""
        child = self.kernel if self.kernel is not None else apply_edits(parent, self.edits, check=False)
        return legalize(child, problem, self.backend if lowerable else False)


_NO_BACKEND_CHECK = False


def legalize(kernel: Kernel, problem: Problem | None, backend: str | None | bool = None) -> Kernel:
    """Verify `kernel` (and its fit to `problem`), then lower it with `backend` (None: the default backend; False:
    skip lowering). Lowering is a pure IR -> source function, so this costs no compile; it rejects what the verifier
    allows but the backend does not build (e.g. a shared-memory epilogue on CUTLASS sm90)."""
    if problem is None:
        from l2ir.verify import verify

        return verify(kernel)
    check_problem(kernel, problem)
    if backend is not _NO_BACKEND_CHECK and not kernel.is_source:
        from l2ir.backends.registry import lower

        lower(kernel, problem, backend)
    return kernel


def try_legalize(kernel: Kernel, problem: Problem | None, backend: str | None | bool = None) -> Kernel | None:
    """`legalize`, with None for an illegal kernel."""
    try:
        return legalize(kernel, problem, backend)
    except (L2IRError, NotImplementedError):
        return None


@dataclass(frozen=True)
class Feedback:
    """The outcome of one proposal. `reward` is log(speedup) when `verdict` is "measured", else None; `detail` is
    the error text of an illegal or failed candidate (or any note from the evaluator); `kernel` the legal child when
    there was one."""

    context: Context
    proposal: Proposal
    verdict: Verdict
    reward: float | None = None
    detail: str = ""
    kernel: Kernel | None = None

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Feedback.verdict must be one of {', '.join(VERDICTS)}, not {self.verdict!r}")
        if self.verdict == "measured" and self.reward is None:
            raise ValueError("a measured Feedback needs its reward (log speedup)")


@runtime_checkable
class Policy(Protocol):
    name: str

    def propose(self, context: Context) -> list[Proposal]: ...

    def update(self, feedback: list[Feedback]) -> None: ...

    def state_dict(self) -> dict | bytes: ...

    def load_state_dict(self, state: dict | bytes) -> None: ...


class StatelessPolicy:
    """A base for policies that learn nothing: update ignores feedback and the state is empty."""

    name = "stateless"

    def propose(self, context: Context) -> list[Proposal]:
        raise NotImplementedError

    def update(self, feedback: list[Feedback]) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | bytes) -> None:
        return None


# ---------------------------------------------------------------------------------------------------------------
# The registry.
# ---------------------------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Policy]] = {}
_BUILTIN = {"random": "l2ir.policy.random_edits:RandomEdits", "rules": "l2ir.policy.rules:Rules",
            "learned": "l2ir.policy.learned:Learned", "llm": "l2ir.policy.llm:LLMPolicy"}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Make `get_policy(name, **kwargs)` build `factory(**kwargs)`."""
    if not callable(factory):
        raise TypeError(f"register_policy('{name}'): the factory must be callable")
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def _import(spec: str) -> Callable[..., Policy]:
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"policy '{spec}': cannot import {attr} from {module} ({e})") from None


def policy_factory(name: str) -> Callable[..., Policy]:
    """What `get_policy(name, **kwargs)` calls: a registered factory, a built-in policy's class, or
    "package.module:Factory"."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN:
        return _import(_BUILTIN[name])
    if ":" in name:
        return _import(name)
    raise ValueError(f"unknown policy '{name}' (policies: {', '.join(policy_names())}, or module:Factory)")


def get_policy(policy: str | Policy, **kwargs: Any) -> Policy:
    """A policy by name ("random", "rules", "learned", a registered name, or "package.module:Factory"), or the
    policy object itself when one is passed."""
    if not isinstance(policy, str):
        if not isinstance(policy, Policy):
            raise TypeError(f"{type(policy).__name__} is not a policy: it needs name, propose, update, state_dict "
                            f"and load_state_dict")
        return policy
    made = policy_factory(policy)(**kwargs)
    if not isinstance(made, Policy):
        raise TypeError(f"policy '{policy}' built a {type(made).__name__}, which is not a policy")
    return made


def _lowered_as(kernel: Kernel, backend: str | None) -> str:
    """A kernel and the backend that would lower it: a backend named explicitly and the registry's default for the
    kernel are the same child (cuda_ptx keeps its name on cluster split-K kernels, which it also lowers by default)."""
    if backend is None:
        from l2ir.backends.registry import backend_for

        try:
            backend = backend_for(kernel).name
        except NotImplementedError:
            backend = ""
    return kernel.content_hash() + "|" + backend


@dataclass
class Dedupe:
    """Keeps proposals whose legal child is new (not the parent, not proposed before in this batch)."""

    parent: Kernel
    parent_backend: str | None = None
    seen: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.seen.add(_lowered_as(self.parent, self.parent_backend))

    @classmethod
    def of(cls, context: Context) -> "Dedupe":
        """Also drops the kernels this problem has already seen (the context's history, on the default backend):
        a search counts a repeat as a wasted step, and stops a shape after several."""
        d = cls(context.parent, context.backend)
        d.seen.update(_lowered_as(step.kernel, None) for step in context.history)
        return d

    def fresh(self, child: Kernel, backend: str | None = None) -> bool:
        key = _lowered_as(child, backend)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True
