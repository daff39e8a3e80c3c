"""The candidate pipeline on a machine without a GPU: every status a candidate can end in, compile once per kernel
and problem class, resume from the records, and a crashing candidate or evaluator never stopping the run.

The evaluator is a deterministic stand-in with the real one's interface; compilation is real where nvcc is there
(`test_real_compile_*`) and a recording stand-in elsewhere."""

import dataclasses
import shutil
from pathlib import Path

import pytest

from l2ir.backends.compile import Artifact, CompileFailure, CompileOptions
from l2ir.nodes import Problem
from l2ir.search import pipeline as pipeline_mod
from l2ir.search.evaluator import EvalConfig, Measurement
from l2ir.search.gates import Verdict
from l2ir.search.pipeline import STATUSES, Candidate, Pipeline, PipelineConfig
from l2ir.search.records import JsonlStore, MemoryStore
from l2ir.search.sweeps import load_sweep
from l2ir.text import parse_kernel, parse_kernel_file, print_problem

ROOT = Path(__file__).resolve().parents[1]
SM80 = parse_kernel((ROOT / "examples/sm80_128x128x32.l2").read_text())
SWEEP = load_sweep("sm80")
CLASS = Problem(1, 1, 1)


class StandIn:
    """Evaluator stand-in: passes every gate, speedup from the kernel hash; fails or raises for chosen kernels."""

    def __init__(self, scenarios=("offline",), fail=(), crash=(), errors=()):
        self.config = EvalConfig(scenarios=scenarios)
        self.fail, self.crash, self.errors = set(fail), set(crash), set(errors)
        self.calls = []

    def evaluate(self, kernel, problem, plan, artifact, time_kernel=True):
        h = kernel.content_hash()
        self.calls.append((h, problem.shape))
        if h in self.crash:
            raise RuntimeError("the harness broke")
        scenarios = self.config.scenarios if time_kernel else ("gates",)
        speed = 0.5 + int(h[:4], 16) / 65536
        return [Measurement(h, print_problem(problem), s, verdicts=[Verdict("accuracy", h not in self.fail, "" if h not in self.fail else "off")],
                            errors=["out of memory"] if h in self.errors else [], speedup=speed,
                            artifact_key=artifact.key) for s in scenarios]


@pytest.fixture
def compiles(monkeypatch):
    """Stand-in for compile_many: records every plan; a plan whose IR has 'stages=3' fails to compile."""
    seen = []

    def fake(plans, options):
        seen.extend(plans)
        return [CompileFailure(key="bad", reason="error", log="kernel.cu(1): error: no", repro="nvcc ...")
                if "stages=3" in p.ir_text else Artifact(key="bin-" + str(hash(p.source)), binary=Path("k.cubin"))
                for p in plans]

    monkeypatch.setattr(pipeline_mod, "compile_many", fake)
    return seen


def rep(kernel, node, **changes):
    return kernel.replace(**{node: dataclasses.replace(getattr(kernel, node), **changes)})


def test_every_status_and_nothing_stops_the_run(compiles, monkeypatch):
    broken = rep(SM80, "swizzle", group=3)
    real_lower = pipeline_mod.lower

    def lower(kernel, problem, backend=None):
        if kernel == broken:
            raise ZeroDivisionError("a backend bug")
        return real_lower(kernel, problem, backend)

    monkeypatch.setattr(pipeline_mod, "lower", lower)
    divisible = rep(SWEEP["128x128x32_w2x2_s4"], "pad", m="divisible")
    crashing = rep(SM80, "swizzle", group=5)
    cands = [Candidate("example", SM80, "user"),
             Candidate("again", SM80, "user"),                                               # same kernel
             Candidate("wgmma_on_sm80", rep(SM80, "mma", op="wgmma", shape=(64, 64, 16))),  # verifier says no
             Candidate("backend_bug", broken),
             Candidate("three_stages", SWEEP["128x256x32_w2x4_s3"]),                        # compiler says no
             Candidate("divisible", divisible),
             Candidate("harness_breaks", crashing)]
    ev = StandIn(crash={crashing.content_hash()})
    pipe = Pipeline(PipelineConfig(), ev, MemoryStore())
    outcomes = pipe.run(cands, [Problem(1000, 1000, 1000), Problem(1024, 1024, 1024)])
    by = {(o.candidate.name, o.problem.m): o for o in outcomes}
    assert len(outcomes) == 2 * len(cands)
    assert {o.status for o in outcomes} <= set(STATUSES)
    assert by["example", 1000].status == "evaluated" and by["example", 1000].passed
    assert by["example", 1000].speedup == pytest.approx(0.5 + int(SM80.content_hash()[:4], 16) / 65536)
    assert by["again", 1000].status == "duplicate" and "'example'" in by["again", 1000].error
    assert by["wgmma_on_sm80", 1000].status == "illegal" and "TargetError" in by["wgmma_on_sm80", 1000].error
    assert by["backend_bug", 1000].status == "lowering_failed" and "a backend bug" in by["backend_bug", 1000].error
    assert by["three_stages", 1000].status == "compile_failed" and "nvcc ..." in by["three_stages", 1000].error
    # shape rules are per problem: 1000 is no multiple of 128, 1024 is
    assert by["divisible", 1000].status == "illegal" and "PadError" in by["divisible", 1000].error
    assert by["divisible", 1024].status == "evaluated"
    assert by["harness_breaks", 1000].status == "evaluated" and not by["harness_breaks", 1000].passed
    assert "the evaluator failed" in by["harness_breaks", 1000].error
    # compile cost is per kernel, never per shape: 4 distinct lowered kernels, one compile each
    assert len(compiles) == 4
    assert sorted(ev.calls) == sorted([(SM80.content_hash(), (1000, 1000, 1000)),
                                       (SM80.content_hash(), (1024, 1024, 1024)),
                                       (divisible.content_hash(), (1024, 1024, 1024)),
                                       (crashing.content_hash(), (1000, 1000, 1000)),
                                       (crashing.content_hash(), (1024, 1024, 1024))])
    # every measurement is in the store; the same candidates again are reused, nothing compiled or evaluated anew
    assert len(list(pipe.store)) == 3
    again = pipe.run(cands[:1], [Problem(1000, 1000, 1000)])
    assert [o.status for o in again] == ["reused"] and again[0].passed and len(compiles) == 4 and len(ev.calls) == 5


def test_a_candidate_may_name_its_backend(compiles):
    pipe = Pipeline(PipelineConfig(), StandIn())
    cands = [Candidate("cute", SM80), Candidate("ptx", SM80, backend="cuda_ptx_sm80"),
             Candidate("ptx_again", SM80, backend="cuda_ptx_sm80"), Candidate("sm90_only", SM80, backend="cutlass_sm90")]
    prepared = pipe.prepare(cands, CLASS)
    assert [p.status for p in prepared] == ["compiled", "compiled", "duplicate", "unsupported"]
    assert "l2ir_cute" in prepared[0].plan.source and prepared[1].plan.source != prepared[0].plan.source


def test_unsupported_kernels_and_a_second_problem_class(compiles):
    pipe = Pipeline(PipelineConfig(backend="cutlass_sm90"), StandIn())
    [o] = pipe.run([Candidate("sm80", SM80)], [Problem(64, 64, 64)])
    assert o.status == "unsupported" and "does not lower" in o.error and not o.passed and o.speedup is None
    pipe = Pipeline(PipelineConfig(), StandIn())
    bf16 = Problem(64, 64, 64, ("bf16", "row"), ("bf16", "col"), ("bf16", "row"))
    out = pipe.run([Candidate("sm80", SM80)], [Problem(64, 64, 64), bf16, Problem(128, 64, 64)])
    assert [o.status for o in out] == ["evaluated"] * 3
    assert len(compiles) == 2                       # one build per problem class (f16, bf16), not per shape
    assert {p.problem_text for p in compiles} == {"a=f16:row b=f16:col c=f16:row acc=f32",
                                                  "a=bf16:row b=bf16:col c=bf16:row acc=f32"}


def test_resume_reuses_records_of_the_same_binary_and_remeasures_errors(compiles, tmp_path):
    path = tmp_path / "run.jsonl"
    sick = SWEEP["64x128x32_w2x2_s4"]
    cands = [Candidate("example", SM80, "user"), Candidate("sick", sick, "user")]
    first = StandIn(scenarios=("offline", "server"), errors={sick.content_hash()})
    out = Pipeline(PipelineConfig(), first, JsonlStore(path)).run(cands, [Problem(256, 256, 256)])
    assert [o.status for o in out] == ["evaluated", "evaluated"] and not out[1].passed
    assert len(path.read_text().splitlines()) == 4              # two scenarios each
    # a killed run resumes: the good record is reused, the one that ended in an error is measured again
    second = StandIn(scenarios=("offline", "server"))
    out = Pipeline(PipelineConfig(), second, JsonlStore(path)).run(cands, [Problem(256, 256, 256)])
    assert [o.status for o in out] == ["reused", "evaluated"] and all(o.passed for o in out)
    assert [h for h, _ in second.calls] == [sick.content_hash()]
    assert set(out[0].speedups) == {"offline", "server"}
    # without an evaluator only stored records count (a report rebuilt on a machine with no GPU)
    out = Pipeline(PipelineConfig(any_binary=True), None, JsonlStore(path)).run(cands, [Problem(256, 256, 256),
                                                                                     Problem(512, 512, 512)])
    assert [(o.candidate.name, o.status) for o in out] == [("example", "reused"), ("sick", "reused")]


HAVE_NVCC = shutil.which("nvcc") is not None


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_real_compile_of_a_source_kernel_and_a_broken_one(tmp_path):
    _, naive, _ = parse_kernel_file((ROOT / "examples/source_naive.l2").read_text())
    broken = naive.replace(source=dataclasses.replace(naive.source, code=naive.source.code.replace("float acc",
                                                                                                    "floot acc")))
    pipe = Pipeline(PipelineConfig(compile=CompileOptions(cache_dir=str(tmp_path))), StandIn())
    prepared = pipe.prepare([Candidate("naive", naive), Candidate("broken", broken)], CLASS)
    assert [p.status for p in prepared] == ["compiled", "compile_failed"]
    assert prepared[0].artifact.ok and prepared[0].artifact.binary.is_file()
    assert "floot" in prepared[1].error and "reproduce:" in prepared[1].error
    out = pipe.run([Candidate("naive", naive), Candidate("broken", broken)], [Problem(256, 256, 256, b=("f16", "col"))])
    assert [o.status for o in out] == ["evaluated", "compile_failed"]


def test_the_search_loops_options_lower_only_measure_afresh_and_leave_recording_to_the_caller(compiles):
    from l2ir.search.pipeline import UNCOMPILED

    ev = StandIn()
    store = MemoryStore()
    pipe = Pipeline(PipelineConfig(compile_kernels=False, reuse=False, record=False), ev, store)
    [item] = pipe.prepare([Candidate("example", SM80)], CLASS)
    assert item.ok and item.plan is not None and item.artifact is UNCOMPILED and not compiles
    first = pipe.evaluate(item, Problem(256, 256, 256))
    again = pipe.evaluate(item, Problem(256, 256, 256))
    assert [first.status, again.status] == ["evaluated", "evaluated"] and len(ev.calls) == 2
    assert first.measurements and not list(store)        # the caller records
    # The same kernel named for another backend is another build, not a duplicate.
    ptx = pipe.prepare([Candidate("ptx", SM80, backend="cuda_ptx_sm80")], CLASS)
    assert ptx[0].ok and ptx[0].plan.source != item.plan.source


class SkipCounting:
    """The stand-in cost model, recording which gates each call was told to skip."""

    def __init__(self, fail_one_in=10 ** 9):
        from l2ir.search.standin import StandinConfig, StandinEvaluator

        self.inner = StandinEvaluator(StandinConfig(("offline",), fail_one_in=fail_one_in))
        self.config, self.environment, self.skips = self.inner.config, self.inner.environment, []

    def evaluate(self, kernel, problem, plan=None, artifact=None, time_kernel=True, skip_gates=()):
        self.skips.append((problem.shape, tuple(skip_gates)))
        return self.inner.evaluate(kernel, problem, plan, artifact, time_kernel, skip_gates)


@pytest.mark.parametrize("record", [True, False])
def test_class_gates_run_once_per_kernel_and_class(tmp_path, record):
    from l2ir.search.db import RecordsDB
    from l2ir.search.loop import CLASS_GATES

    db = RecordsDB(tmp_path / "r.db")
    ev = SkipCounting()
    pipe = Pipeline(PipelineConfig(compile_kernels=False, reuse=False, record=record, class_gates=CLASS_GATES), ev,
                    db)
    [item] = pipe.prepare([Candidate("example", SM80)], CLASS)
    a = pipe.evaluate(item, Problem(256, 256, 256))
    assert a.passed and {v["name"] for v in a.class_verdicts} == set(CLASS_GATES)
    if not record:                       # the caller keeps them, with its other records
        assert db.class_gates(item.kernel_hash, "a=f16:row b=f16:col c=f16:row acc=f32", pipe.env_id) is None
        assert not db.measurements()
        db.add_class_gates(item.kernel_hash, "a=f16:row b=f16:col c=f16:row acc=f32", pipe.env_id, a.class_verdicts)
    else:
        assert len(db.measurements()) == 1
    b = pipe.evaluate(item, Problem(512, 256, 256))
    assert b.passed and b.class_verdicts is None
    assert ev.skips == [((256, 256, 256), ()), ((512, 256, 256), CLASS_GATES)]
    assert all("reused" in v.detail for v in b.measurements[0].verdicts if v.name in CLASS_GATES)
    # A winner gated again runs every gate.
    c = pipe.evaluate(item, Problem(512, 256, 256), class_gates=False)
    assert ev.skips[-1] == ((512, 256, 256), ()) and c.passed


def test_a_kernel_that_failed_a_class_gate_fails_later_shapes_without_an_evaluation(tmp_path):
    from l2ir.search.db import RecordsDB
    from l2ir.search.loop import CLASS_GATES

    ev = SkipCounting(fail_one_in=1)                      # every kernel fails the ragged-shapes gate
    pipe = Pipeline(PipelineConfig(compile_kernels=False, reuse=False, class_gates=CLASS_GATES), ev,
                    RecordsDB(tmp_path / "r.db"))
    [item] = pipe.prepare([Candidate("example", SM80)], CLASS)
    assert not pipe.evaluate(item, Problem(256, 256, 256)).passed and len(ev.skips) == 1
    later = pipe.evaluate(item, Problem(512, 256, 256))
    assert later.status == "evaluated" and not later.passed and len(ev.skips) == 1 and later.cost_s == 0.0
    [v] = later.measurements[0].verdicts
    assert v.name == "ragged_shapes" and "reused from an earlier shape" in v.detail
