"""The candidate pipeline on a real GPU: every registry backend's seed and two kernels of its sweep go through
legalize -> dedupe -> lower -> compile -> the evaluator's gates -> the records, at one aligned and one ragged shape;
a second run of the same candidates reuses every record; one kernel is timed against torch.matmul.

The cases are tests/test_backends_gpu.py's registry cases (one list of what each backend must run); that file
evaluates them directly, this one through the pipeline that `l2ir bench`, the search and the policies use.
About a minute of GPU time after the compiles. Run on the device:
    python -m pytest -q -m gpu tests/test_pipeline_gpu.py
"""

from __future__ import annotations

import pytest

from l2ir.backends.compile import CompileOptions
from l2ir.backends.registry import BACKENDS
from l2ir.nodes import Problem
from l2ir.search.pipeline import Candidate, Pipeline, PipelineConfig
from l2ir.search.records import JsonlStore
from test_backends_gpu import ALIGNED, RAGGED, registry_cases
from test_evaluator_gpu import SKIP

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


class Counting:
    """The real evaluator, counting the candidates it was asked to run."""

    def __init__(self, evaluator):
        self.inner, self.config, self.calls = evaluator, evaluator.config, 0

    def evaluate(self, *args, **kwargs):
        self.calls += 1
        return self.inner.evaluate(*args, **kwargs)


@pytest.fixture(scope="module")
def device_sm():
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (9, 0):
        pytest.skip(f"the sm90a kernels need a Hopper GPU; this one is sm_{major}{minor}")
    return f"sm_{major}{minor}"


def by_backend() -> dict[str, list[Candidate]]:
    out: dict[str, list[Candidate]] = {}
    for (backend, name), (kernel, problem) in registry_cases().items():
        assert problem == Problem(1, 1, 1)          # the registry cases share the default problem class
        out.setdefault(backend, []).append(Candidate(f"{backend}:{name}", kernel, "test"))
    return out


def test_every_backend_through_the_pipeline_and_the_gates(tmp_path, device_sm):
    from l2ir.search.evaluator import EvalConfig, Evaluator

    cases = by_backend()
    assert set(cases) == {name for name in BACKENDS if name != "source"}
    problems = [Problem(1, 1, 1).with_shape(*ALIGNED), Problem(1, 1, 1).with_shape(*RAGGED)]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), device_sm=device_sm)
    store_path = tmp_path / "records.jsonl"

    def pipelines(evaluator):
        # a backend that is not the default for its kernels is asked for by name, one pipeline each
        return {backend: Pipeline(PipelineConfig(backend=None if BACKENDS[backend].default is True else backend,
                                                 compile=options), evaluator, JsonlStore(store_path))
                for backend in cases}

    with Evaluator(EvalConfig(scenarios=(), phase_timeout_s=120)) as ev:
        counting = Counting(ev)
        first = pipelines(counting)
        for backend, pipe in first.items():        # every compile before the GPU work starts
            prepared = pipe.prepare(cases[backend], Problem(1, 1, 1))
            failed = [f"{p.candidate.name}: {p.status} {p.error}" for p in prepared if p.status != "compiled"
                      and p.status != "duplicate"]
            assert not failed, failed
        outcomes = [o for backend, pipe in first.items() for o in pipe.run(cases[backend], problems)]
        measured = [o for o in outcomes if o.status == "evaluated"]
        assert measured and counting.calls == len(measured)
        for o in outcomes:
            where = f"{o.candidate.name} at {o.problem.shape}"
            if o.status == "illegal":                # only a pad=divisible promise may keep a kernel off a shape
                assert o.problem.shape == RAGGED and "divisible" in o.error, (where, o.error)
                continue
            assert o.status in ("evaluated", "duplicate"), (where, o.status, o.error)
            if o.status == "evaluated":
                (m,) = o.measurements
                failed = [f"{v.name}: {v.detail}" for v in m.verdicts if not v.passed]
                assert o.passed, f"{where}: errors {m.errors}; failed gates {failed}"
                ran = {v.name for v in m.verdicts if not v.skipped}
                assert {"accuracy", "all_written", "guard_bands"} <= ran, (where, ran)
        for backend in cases:                        # every backend ran at both shapes
            shapes = {o.problem.shape for o in measured if o.candidate.name.startswith(backend + ":")}
            assert shapes == {ALIGNED, RAGGED}, (backend, shapes)

        # the same candidates again: every verdict comes from the records, nothing runs on the GPU
        again = [o for backend, pipe in pipelines(counting).items() for o in pipe.run(cases[backend], problems)]
        assert counting.calls == len(measured)
        assert sorted(o.status for o in again if o.status in ("evaluated", "reused")) == ["reused"] * len(measured)
        assert all(o.passed for o in again if o.status == "reused")

    # one kernel timed against torch.matmul through the same pipeline
    from l2ir.search.timing import TimingConfig

    timing = TimingConfig(trials=3, target_ms=5.0, server_samples=4)
    with Evaluator(EvalConfig(scenarios=("offline",), timing=timing, phase_timeout_s=120)) as ev:
        pipe = Pipeline(PipelineConfig(compile=options), ev, JsonlStore(store_path))
        seed = next(c for c in cases["cutlass_sm90"] if c.name.endswith(":seed"))
        (o,) = pipe.run([seed], problems[:1])
        assert o.status == "evaluated" and o.passed, (o.error, [v for m in o.measurements for v in m.verdicts])
        assert o.speedup is not None and 0.1 < o.speedup < 10, o.speedup
