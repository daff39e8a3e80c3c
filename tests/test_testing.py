"""The public fuzzing strategies (l2ir.testing) reach every corner of the IR: each MMA op, pipeline mode, schedule,
split-K mode, epilogue path and pad mode the schema allows is generated within one run, for kernels alone and for
kernel/problem pairs (which the shape rules filter further). A strategy that silently stops producing one of them
(a tightened rule, a new choice in the schema) fails here instead of leaving that corner unfuzzed.
And the fuzzing example (examples/fuzz_my_pass.py) runs, and catches a pass that narrows what a kernel can run."""

import runpy
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

from l2ir.nodes import Epilogue, Mma, Pad, Pipeline, SplitK
from l2ir.testing import edits, kernel_problem_pairs, kernels

ROOT = Path(__file__).resolve().parents[1]

# Every value the schema allows, read from the node definitions (a choice added there must be generated here).
WANTED = {
    "mma.op": set(Mma.field_types()["op"].choices),
    "pipeline.mode": set(Pipeline.field_types()["mode"].choices),
    "pipeline.schedule": set(Pipeline.field_types()["schedule"].choices),
    "splitk.mode": set(SplitK.field_types()["mode"].choices) | {"none"},
    "splitk.reduce": set(SplitK.field_types()["reduce"].choices),
    "epilogue.path": set(Epilogue.field_types()["path"].choices),
    "pad.mode": set(Pad.field_types()["m"].choices),
    "pad.align": set(Pad.field_types()["align"].choices),
}


def features(kernel):
    yield "mma.op", kernel.mma.op
    yield "pipeline.mode", kernel.pipeline.mode
    yield "pipeline.schedule", kernel.pipeline.schedule
    yield "splitk.mode", kernel.splitk.mode if kernel.splitk is not None else "none"
    if kernel.splitk is not None:
        yield "splitk.reduce", kernel.splitk.reduce
    yield "epilogue.path", kernel.epilogue.path
    for dim in "mnk":
        yield "pad.mode", getattr(kernel.pad, dim)
    yield "pad.align", kernel.pad.align


def _covered(strategy, pick, examples=250):
    seen = {name: set() for name in WANTED}
    extra = set()

    @settings(max_examples=examples, database=None, derandomize=True)
    @given(strategy)
    def collect(value):
        kernel = pick(value)
        for name, v in features(kernel):
            seen[name].add(v)
        if isinstance(value, tuple):
            _, p = value
            bm, bn, bk = kernel.tile.block
            extra.update({("a", p.a[1]), ("b", p.b[1]), ("acc", p.acc)})
            if p.m % bm or p.n % bn or p.k % bk:
                extra.add("ragged")

    collect()
    missing = {name: sorted(WANTED[name] - seen[name]) for name in WANTED if WANTED[name] - seen[name]}
    return missing, extra


def test_kernels_cover_every_op_mode_schedule_splitk_epilogue_and_pad():
    missing, _ = _covered(kernels(), lambda k: k, examples=400)   # three kernel families share the draws
    assert not missing, f"never generated: {missing}"


def test_kernel_problem_pairs_cover_them_too_with_ragged_shapes_and_every_layout():
    missing, extra = _covered(kernel_problem_pairs(max_dim=300), lambda pair: pair[0], examples=400)
    assert not missing, f"never generated with a problem: {missing}"
    assert extra >= {("a", "row"), ("a", "col"), ("b", "row"), ("b", "col"), ("acc", "f32"), ("acc", "f16"),
                     "ragged"}, extra


def test_targets_restrict_the_kernels():
    seen = set()

    @settings(max_examples=60, database=None, derandomize=True)
    @given(kernels(targets=["sm80"]))
    def collect(k):
        seen.add((k.target.arch, k.mma.op))

    collect()
    assert seen == {("sm80", "mma_sync")}
    with pytest.raises(ValueError, match="unknown target"):
        kernels(targets=["sm70"])


def test_edits_cover_set_insert_remove_and_replace():
    kinds = set()

    @settings(max_examples=150, database=None, derandomize=True)
    @given(edits())
    def collect(e):
        kinds.add(type(e).__name__)

    collect()
    assert kinds == {"SetField", "InsertNode", "RemoveNode", "ReplaceNode"}


def test_the_fuzzing_example_passes_and_catches_a_broken_pass(monkeypatch, capsys):
    path = ROOT / "examples" / "fuzz_my_pass.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--examples", "15"])
    with pytest.raises(SystemExit) as ok:
        runpy.run_path(str(path), run_name="__main__")
    assert ok.value.code == 0, capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [str(path), "--examples", "40", "--broken"])
    with pytest.raises(SystemExit) as bad:
        runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr()
    text = out.out + out.err
    assert bad.value.code == 1 and "deepen_and_drop_k_guard is wrong: [PadError]" in text
    assert "Problem(" in text                    # Hypothesis's smallest failing kernel and problem
