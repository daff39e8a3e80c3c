"""A custom policy in twenty lines: try deeper and shallower pipelines around the parent.

    l2ir tune --shape 4096x4096x4096 --policy examples.my_policy:StagesPolicy --standin
    # or in Python: Search(config, db, evaluator, policy=StagesPolicy()), get_policy(StagesPolicy())
"""

import dataclasses

from l2ir.edits import SetField
from l2ir.policy.base import Context, Proposal, StatelessPolicy, try_legalize


class StagesPolicy(StatelessPolicy):
    name = "stages"

    def propose(self, context: Context) -> list[Proposal]:
        pipe = context.parent.pipeline
        if pipe is None or pipe.stages == "auto":
            return []   # a Source kernel, or the TMA carve-out that already fills shared memory
        out = []
        for stages in (pipe.stages + 1, pipe.stages - 1, pipe.stages + 2):
            child = context.parent.replace(pipeline=dataclasses.replace(pipe, stages=max(1, stages)))
            if try_legalize(child, context.problem, context.backend) is not None:
                out.append(Proposal(edits=(SetField("pipeline", "stages", child.pipeline.stages),),
                                    note=f"{stages} stages: more copies in flight hide more latency"))
        return out[: context.count]
