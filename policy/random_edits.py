"""Random legal edits over the whole IR and every backend: the baseline every other policy must beat.

Each proposal draws a knob uniformly (tile, warps, cluster, stages, schedule, persistence, raster order and group,
shared-memory swizzle, split-K / stream-K and slices, epilogue path and vector, padding, alignment, a move between
the sm80 and sm90a rules, target, backend), then a value uniformly, applies it (`policy.actions`) and keeps the child
only if the verifier, the problem rules and the backend accept it. An illegal draw is redrawn, at most `tries`
times per wanted proposal; duplicates of the parent or of an earlier proposal are dropped. With `depth` > 1 a
proposal chains 1..depth such draws. The draws depend only on the context (its seed, problem and parent).
"""

from __future__ import annotations

from .actions import KNOBS, Action, apply_action, diff_edits
from .base import Context, Dedupe, Proposal, StatelessPolicy, try_legalize


class RandomEdits(StatelessPolicy):
    name = "random"

    def __init__(self, depth: int = 1, tries: int = 40, knobs: tuple[str, ...] | None = None):
        if depth < 1 or tries < 1:
            raise ValueError(f"RandomEdits: depth and tries must be >= 1, got depth={depth} tries={tries}")
        unknown = set(knobs or ()) - set(KNOBS)
        if unknown:
            raise ValueError(f"RandomEdits: unknown knobs {', '.join(sorted(unknown))} (knobs: {', '.join(KNOBS)})")
        self.depth = depth
        self.tries = tries
        self.knobs = tuple(knobs or KNOBS)

    def propose(self, context: Context) -> list[Proposal]:
        rng = context.rng(salt=1)
        seen = Dedupe.of(context)
        out: list[Proposal] = []
        for _ in range(self.tries * context.count):
            if len(out) >= context.count:
                break
            kernel, backend, steps = context.parent, context.backend, []
            for _ in range(int(rng.integers(1, self.depth + 1))):
                knob = self.knobs[int(rng.integers(len(self.knobs)))]
                values = KNOBS[knob]
                action = Action(knob, values[int(rng.integers(len(values)))])
                made = apply_action(kernel, context.problem, action, context.arch, backend)
                if made is None:
                    break
                kernel, backend = made
                steps.append(action)
            if not steps or try_legalize(kernel, context.problem, backend) is None:
                continue
            if not seen.fresh(kernel, backend):
                continue
            edits = diff_edits(context.parent, kernel)
            note = "random: " + ", ".join(map(str, steps))
            out.append(Proposal(edits=edits, note=note, backend=backend) if edits
                       else Proposal(kernel=kernel, note=note, backend=backend))
        return out
