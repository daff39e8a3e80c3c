"""A small greedy driver that scores a policy against an evaluator: how many evaluations it takes to reach a
speedup on a problem. It trains the learned policy and compares policies (tests, bench/policy_compare.py); the
search loop (l2ir.search.loop) is the full search, with populations, budgets and the records DB.

`evaluate(problem, kernel, backend) -> speedup | None` is any evaluator: the GPU pipeline, the deterministic
stand-in, or a synthetic cost model. None (or a non-positive value) is a failed candidate. Illegal proposals cost
no evaluation (nothing is compiled or timed); every legal one costs one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from l2ir.errors import L2IRError
from l2ir.nodes import Kernel, Problem
from l2ir.target import H200_SMS

from .base import Context, Feedback, Measured, Policy, Step

Evaluate = Callable[[Problem, Kernel, "str | None"], "float | None"]


@dataclass
class Climb:
    """The best speedup after each evaluation (curve[i] after i+1 evaluations, the start's included)."""

    problem: Problem
    curve: list[float] = field(default_factory=list)
    best: Kernel | None = None
    best_backend: str | None = None

    def evaluations_to(self, target: float) -> int | None:
        """Evaluations until the best speedup first reached `target`; None if it never did."""
        for i, s in enumerate(self.curve):
            if s >= target:
                return i + 1
        return None


def climb(policy: Policy, problem: Problem, evaluate: Evaluate, start: Kernel, budget: int, *, count: int = 8,
          seed: int = 0, arch: str = "sm90a", num_sms: int = H200_SMS, target: float | None = None,
          learn: bool = True, backend: str | None = None) -> Climb:
    """Hill-climb from `start`: ask for `count` proposals from the incumbent, evaluate each, feed the outcomes back
    (when `learn`), move to the best child if it beats the incumbent. Stops after `budget` evaluations, when the
    best reaches `target`, or when the policy has nothing new to propose twice in a row."""
    out = Climb(problem)
    s0 = evaluate(problem, start, backend)
    parent, parent_s, parent_be = start, (s0 if s0 and s0 > 0 else None), backend
    out.curve.append(parent_s or 0.0)
    out.best, out.best_backend = start, backend
    history: list[Step] = [Step(start, (), math.log(parent_s) if parent_s else None)]
    step, idle = 0, 0
    while len(out.curve) < budget and not (target is not None and out.curve[-1] >= target):
        ctx = Context(problem, parent, Measured(speedup=parent_s), tuple(history[-16:]), arch, num_sms,
                      seed=seed * 1_000_003 + step, count=min(count, budget - len(out.curve)), backend=parent_be)
        step += 1
        proposals = policy.propose(ctx)
        feedback, best_child = [], None
        for prop in proposals:
            if len(out.curve) >= budget:
                break
            try:
                child = prop.apply(parent, problem)
            except (L2IRError, NotImplementedError) as e:
                feedback.append(Feedback(ctx, prop, "illegal", detail=str(e)))
                continue
            s = evaluate(problem, child, prop.backend)
            if s is None or s <= 0:
                feedback.append(Feedback(ctx, prop, "failed", kernel=child))
                out.curve.append(out.curve[-1])
                continue
            feedback.append(Feedback(ctx, prop, "measured", reward=math.log(s), kernel=child))
            history.append(Step(child, prop.edits, math.log(s)))
            if s > out.curve[-1]:
                out.best, out.best_backend = child, prop.backend
            out.curve.append(max(out.curve[-1], s))
            if best_child is None or s > best_child[2]:
                best_child = (child, prop.backend, s)
        if learn and feedback:
            policy.update(feedback)
        idle = idle + 1 if not proposals else 0
        if idle >= 2:
            break
        if best_child is not None and (parent_s is None or best_child[2] > parent_s):
            parent, parent_be, parent_s = best_child
    return out
