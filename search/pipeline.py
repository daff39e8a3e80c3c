"""The candidate pipeline: every kernel that `l2ir bench`, the search loop or a policy wants measured goes through it.

    candidates -> legalize -> dedupe -> lower -> compile_many -> evaluate -> record

- legalize: the verifier; a typed error is the candidate's verdict ("illegal"), never a crash. Rules that depend on
  the shape (divisibility, alignment, split-K vs K) are checked per problem, so one kernel can be legal for one
  shape and "illegal" for another.
- dedupe: by content hash (the sha256 of the canonical text); a second candidate with the same kernel is a
  "duplicate" of the first, and a kernel that the store already measured with the same binary is "reused".
- lower: `backends.registry`; a field the backend does not support is "unsupported", a backend bug
  "lowering_failed".
- compile: `backends.compile.compile_many`, parallel and content-addressed. Kernels are problem-independent (M, N, K
  are run-time arguments), so compile cost is paid once per kernel and problem class (dtypes, layouts), never per
  shape; a compiler error is "compile_failed" with the command that reproduces it.
- evaluate: an evaluator object with `evaluate(kernel, problem, plan, artifact, time_kernel=True) ->
  list[Measurement]` and `config.scenarios` (search/evaluator.py's `Evaluator`; tests pass a deterministic stand-in),
  then every measurement goes to the store (search/records.py). A caller that writes more than the measurements
  of a candidate in one transaction (the search loop: kernel row, measurements, edit, class gates) sets
  `record=False` and writes `Outcome.measurements` itself.
- class gates: the gates named in `PipelineConfig.class_gates` depend only on the kernel and the problem class, not
  on M, N, K. With a store that keeps them (`class_gates` / `add_class_gates`, search/db.py) they run once per
  kernel, class and environment: a kernel that failed one fails on every later shape without an evaluation, one
  that passed them is evaluated with `skip_gates` and the kept verdicts are written into its measurement, marked
  as reused.

Usage:
    with Evaluator(EvalConfig()) as ev:
        outcomes = Pipeline(PipelineConfig(), ev, JsonlStore("run.jsonl")).run(candidates, problems)
    best = max((o for o in outcomes if o.passed), key=lambda o: o.speedup)
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from l2ir.backends.compile import CompileOptions, CompileResult, compile_many
from l2ir.backends.registry import lower
from l2ir.errors import VerifyError
from l2ir.nodes import Kernel, Problem
from l2ir.runtime import LaunchPlan
from l2ir.text import print_problem, print_problem_class
from l2ir.verify import check_problem, verify

from .db import environment_id
from .evaluator import Measurement
from .gates import Verdict
from .records import MemoryStore, Store

# Every scenario a measurement can carry (search/evaluator.py; "gates" = gates only, not timed).
ALL_SCENARIOS = ("offline", "server", "gates")
STATUSES = ("illegal", "duplicate", "unsupported", "lowering_failed", "compile_failed", "evaluated", "reused")
_MEASUREMENT_FIELDS = frozenset(Measurement.__dataclass_fields__)


@dataclass(frozen=True)
class Candidate:
    name: str
    kernel: Kernel
    origin: str = ""                 # who proposed it: "seed", "sweep:sm90a", a policy's name
    backend: str | None = None       # lower with this backend (default: PipelineConfig.backend)


@dataclass(frozen=True)
class PipelineConfig:
    backend: str | None = None       # force a backend by name; None: the registry's one default backend
    compile: CompileOptions = CompileOptions()
    time_kernel: bool = True         # False: correctness gates only
    # A stored measurement that ended in an error (out of memory, a dead worker) says nothing about the kernel:
    # measure it again instead of reusing it.
    remeasure_errors: bool = True
    # True: reuse a stored measurement whatever binary made it (a report rebuilt on a machine that compiled
    # nothing new); False: only one made with this very binary (same source, flags, toolchain).
    any_binary: bool = False
    # False: lower only, no compile (the evaluator is the stand-in cost model, search/standin.py); the artifact is
    # UNCOMPILED.
    compile_kernels: bool = True
    # False: never answer from the store, measure every candidate (a search's selection samples must be its own).
    reuse: bool = True
    # False: the measurements are only returned (Outcome.measurements, Outcome.class_verdicts); the caller records.
    record: bool = True
    # Gates kept per kernel and problem class and reused across shapes (see the module docstring).
    class_gates: tuple[str, ...] = ()
    reuse_class_gates: bool = True   # False: run them on every shape (still kept for later runs)


class _Uncompiled:
    """The artifact of a kernel lowered but not compiled (PipelineConfig.compile_kernels=False)."""

    ok = True
    key = "uncompiled"
    reason = ""
    repro = ""
    compile_seconds = 0.0
    cached = True
    resources: dict = {}

    def summary(self) -> str:
        return "not compiled"


UNCOMPILED = _Uncompiled()


@dataclass
class Prepared:
    """One candidate after legalize, dedupe, lower and compile, for one problem class."""

    candidate: Candidate
    kernel_hash: str
    status: str = "compiled"         # "compiled" or one of the failure statuses of STATUSES
    error: str = ""
    plan: LaunchPlan | None = None
    artifact: CompileResult | None = None

    @property
    def ok(self) -> bool:
        return self.status == "compiled"


@dataclass
class Outcome:
    """What happened to one candidate on one problem."""

    candidate: Candidate
    problem: Problem
    status: str                      # one of STATUSES
    error: str = ""
    plan: LaunchPlan | None = None
    artifact: CompileResult | None = None
    measurements: list[Measurement] = field(default_factory=list)
    cost_s: float = 0.0              # GPU seconds the evaluation cost (the evaluator's own count, else wall time)
    # The class gates' verdicts this evaluation produced, to keep for the kernel (None: none new to keep).
    class_verdicts: list[dict] | None = None

    @property
    def kernel_hash(self) -> str:
        return self.candidate.kernel.content_hash()

    @property
    def measured(self) -> bool:
        return self.status in ("evaluated", "reused") and bool(self.measurements)

    @property
    def passed(self) -> bool:
        """Measured, every gate passed in every scenario, no error."""
        return self.measured and all(m.passed for m in self.measurements)

    @property
    def speedups(self) -> dict[str, float]:
        """Speedup over the baseline per timed scenario (only for a candidate that passed)."""
        if not self.passed:
            return {}
        return {m.scenario: m.speedup for m in self.measurements if m.speedup}

    @property
    def speedup(self) -> float | None:
        """The speedup of the first timed scenario (the evaluator's primary one), None unless it passed."""
        return next(iter(self.speedups.values()), None)


@dataclass
class _Pending:
    """An evaluation `Pipeline.evaluate` has decided to run, with what its result is finished with."""

    item: Prepared
    problem: Problem
    evaluator: object
    timed: bool
    options: dict
    skip: tuple[str, ...]
    gates: tuple[str, ...]
    kept: list[dict] | None
    cls_text: str


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"[{type(e).__name__}] " + (text.splitlines()[0] if text else "")


def _class_of(problem: Problem) -> Problem:
    """The problem class: dtypes, layouts and accumulator, sizes dropped (kernels take M, N, K at run time)."""
    return problem.with_shape(1, 1, 1)


def _measurements(records: list[dict]) -> list[Measurement]:
    return [Measurement.from_json({k: v for k, v in r.items() if k in _MEASUREMENT_FIELDS}) for r in records]


def _takes(evaluator, option: str) -> bool:
    """Whether the evaluator's `evaluate` accepts the keyword (an evaluator written before the option existed)."""
    if callable(getattr(evaluator, "takes", None)):      # a pool answers for the evaluators it forwards to
        return bool(evaluator.takes(option))
    try:
        return option in inspect.signature(evaluator.evaluate).parameters
    except (TypeError, ValueError):
        return False


def _scenarios(evaluator, time_kernel: bool) -> tuple[str, ...]:
    """The scenarios the evaluator's measurements will carry (search/evaluator.py: "gates" when not timed)."""
    scenarios = tuple(getattr(getattr(evaluator, "config", None), "scenarios", ()) or ())
    return scenarios if (scenarios and time_kernel) else ("gates",)


class Pipeline:
    """Runs candidates through the steps above. A candidate that fails any step becomes an Outcome with that status;
    nothing a candidate does (illegal IR, a backend bug, a compiler crash, a kernel that faults) stops the run."""

    def __init__(self, config: PipelineConfig = PipelineConfig(), evaluator=None, store: Store | None = None,
                 log: Callable[[str], None] | None = None):
        self.config = config
        self.evaluator = evaluator
        self.store: Store = store if store is not None else MemoryStore()
        self._log = log or (lambda msg: None)
        self._prepared: dict[tuple, Prepared] = {}     # (problem class text, kernel hash, backend)
        self.compile_wall_s = 0.0
        # The environment class gates are kept under: the evaluator's, once it reports one (a caller that resumes
        # from records may set it before).
        self.env_id: str | None = None

    # ---- legalize, dedupe, lower, compile -------------------------------------------------------------------

    def prepare(self, candidates: Iterable[Candidate], problem_class: Problem) -> list[Prepared]:
        """One Prepared per candidate, in order. Each distinct kernel is lowered and compiled once per problem
        class (later calls reuse it); a repeated kernel is a "duplicate" of the first candidate that had it."""
        pclass = _class_of(problem_class)
        ctext = print_problem(pclass)
        out: list[Prepared] = []
        first: dict[tuple[str, str | None], str] = {}
        to_compile: list[Prepared] = []
        for cand in candidates:
            try:
                h = cand.kernel.content_hash()
            except Exception as e:  # noqa: BLE001 - a kernel that cannot even be printed is no kernel
                out.append(Prepared(cand, "", "illegal", f"cannot print the kernel: {_first_line(e)}"))
                continue
            backend = cand.backend or self.config.backend
            if (h, backend) in first:
                out.append(Prepared(cand, h, "duplicate", f"same kernel as '{first[h, backend]}'"))
                continue
            first[h, backend] = cand.name
            known = self._prepared.get((ctext, h, backend))
            if known is not None:
                out.append(Prepared(cand, h, known.status, known.error, known.plan, known.artifact))
                continue
            item = self._lower(cand, h, pclass)
            self._prepared[(ctext, h, backend)] = item
            out.append(item)
            if item.ok:
                to_compile.append(item)
        if to_compile and not self.config.compile_kernels:
            for item in to_compile:
                item.artifact = UNCOMPILED
        elif to_compile:
            t0 = time.perf_counter()
            try:
                results = compile_many([p.plan for p in to_compile], self.config.compile)
            except Exception as e:  # noqa: BLE001 - compile_many guards each job; this is the pool itself failing
                results = [None] * len(to_compile)
                self._log(f"compile pool failed: {_first_line(e)}")
            self.compile_wall_s += time.perf_counter() - t0
            for item, art in zip(to_compile, results):
                item.artifact = art
                if art is None or not art.ok:
                    item.status = "compile_failed"
                    item.error = (f"compile {art.reason}: {art.summary()} (reproduce: {art.repro or '-'})"
                                  if art is not None else "compile pool failed")
                    self._log(f"compile failed: {item.candidate.name} {item.kernel_hash[:12]}: {item.error}")
        return out

    def _lower(self, cand: Candidate, h: str, pclass: Problem) -> Prepared:
        try:
            verify(cand.kernel)
        except VerifyError as e:
            return Prepared(cand, h, "illegal", _first_line(e))
        except Exception as e:  # noqa: BLE001 - a verifier bug is reported on the candidate, not raised
            return Prepared(cand, h, "illegal", f"the verifier failed: {_first_line(e)}")
        try:
            plan = lower(cand.kernel, pclass, cand.backend or self.config.backend)
        except NotImplementedError as e:
            self._log(f"not lowered: {cand.name} {h[:12]}: {_first_line(e)}")
            return Prepared(cand, h, "unsupported", _first_line(e))
        except VerifyError as e:
            return Prepared(cand, h, "illegal", _first_line(e))
        except Exception as e:  # noqa: BLE001 - LoweringError and anything a backend bug throws
            self._log(f"lowering failed: {cand.name} {h[:12]}: {_first_line(e)}")
            return Prepared(cand, h, "lowering_failed", _first_line(e))
        return Prepared(cand, h, "compiled", "", plan)

    # ---- evaluate and record ---------------------------------------------------------------------------------

    def evaluate(self, item: Prepared, problem: Problem, evaluator=None, time_kernel: bool | None = None,
                 scenarios: tuple[str, ...] | None = None, class_gates: bool = True, **options) -> Outcome | None:
        """One prepared candidate on one problem: its failure status, a stored measurement ("reused") or a new one
        ("evaluated", recorded in the store unless `record` is off). `evaluator` overrides the pipeline's for this
        call. Without any evaluator only stored measurements count (of `scenarios`, default all, whatever binary
        made them, even if this machine could not compile the kernel): a candidate with none gives None.
        `class_gates=False` runs every gate whatever is kept (a winner gated again). `options` go to the
        evaluator's `evaluate` as they are."""
        evaluator = evaluator if evaluator is not None else self.evaluator
        job = self._prepare_evaluation(item, problem, evaluator, time_kernel, scenarios, class_gates, options)
        return self._run(job) if isinstance(job, _Pending) else job

    def _prepare_evaluation(self, item: Prepared, problem: Problem, evaluator, time_kernel: bool | None,
                            scenarios: tuple[str, ...] | None, class_gates: bool, options: dict):
        """Everything of `evaluate` before the evaluator runs: the Outcome when none has to run (a failure status,
        a stored or kept answer), else the evaluation to run (_Pending)."""
        cand = item.candidate
        if not item.ok and not (evaluator is None and item.status == "compile_failed"):
            return Outcome(cand, problem, item.status, item.error, item.plan, item.artifact)
        try:
            check_problem(cand.kernel, problem)
        except VerifyError as e:
            return Outcome(cand, problem, "illegal", _first_line(e), item.plan, item.artifact)
        timed = self.config.time_kernel if time_kernel is None else time_kernel
        ptext = print_problem(problem)
        if evaluator is None:
            stored = [self.store.lookup(item.kernel_hash, ptext, s) for s in (scenarios or ALL_SCENARIOS)]
            stored = [r for r in stored if r is not None]
            return Outcome(cand, problem, "reused", "", item.plan, item.artifact, _measurements(stored)) \
                if stored else None
        if self.config.reuse:
            binary = None if self.config.any_binary else item.artifact.key
            stored = [self.store.lookup(item.kernel_hash, ptext, s, binary) for s in _scenarios(evaluator, timed)]
            if all(r is not None for r in stored) and not (
                    self.config.remeasure_errors and any(r.get("errors") for r in stored)):
                return Outcome(cand, problem, "reused", "", item.plan, item.artifact, _measurements(stored))
        gates = self.config.class_gates if class_gates else ()
        cls_text = print_problem_class(problem)
        kept = self._kept_class_gates(item.kernel_hash, cls_text, evaluator) if gates else None
        if kept is not None and not all(v["passed"] for v in kept):
            bad = next(v for v in kept if not v["passed"])
            verdict = Verdict(bad["name"], False, f"reused from an earlier shape: {bad['detail']}")
            ms = [Measurement(kernel_hash=item.kernel_hash, problem=ptext, scenario=s, verdicts=[verdict],
                              environment=dict(getattr(evaluator, "environment", None) or {}))
                  for s in _scenarios(evaluator, timed)]
            return self._recorded(Outcome(cand, problem, "evaluated", "", item.plan, item.artifact, ms), cls_text)
        skip = tuple(gates) if (kept is not None and _takes(evaluator, "skip_gates")) else ()
        if skip:
            options = {**options, "skip_gates": skip}
        return _Pending(item, problem, evaluator, timed, options, skip, gates, kept, cls_text)

    def _run(self, job: _Pending) -> Outcome:
        t0 = time.perf_counter()
        try:
            ms = job.evaluator.evaluate(job.item.candidate.kernel, job.problem, job.item.plan, job.item.artifact,
                                        time_kernel=job.timed, **job.options)
        except Exception as e:  # noqa: BLE001 - the evaluator promises not to raise; if it does, the run goes on
            return self._failed(job, e)
        cost = getattr(job.evaluator, "last_cost_s", None)
        return self._finish(job, ms, (time.perf_counter() - t0) if cost is None else cost)

    @staticmethod
    def _failed(job: _Pending, e: BaseException) -> Outcome:
        item = job.item
        return Outcome(item.candidate, job.problem, "evaluated", f"the evaluator failed: {_first_line(e)}",
                       item.plan, item.artifact)

    def _finish(self, job: _Pending, ms: list[Measurement], cost: float) -> Outcome:
        item, evaluator, skip, gates, kept = job.item, job.evaluator, job.skip, job.gates, job.kept
        if self.env_id is None and getattr(evaluator, "environment", None):
            self.env_id = environment_id(evaluator.environment)
        new_class = None
        if skip:
            for m in ms:
                m.verdicts += [Verdict(v["name"], v["passed"], f"reused (kernel and problem class): {v['detail']}",
                                       v.get("skipped", False)) for v in kept]
        elif gates and ms and not ms[0].errors:
            got = [v.to_json() for v in ms[0].verdicts if v.name in gates]
            if len(got) == len(gates):
                new_class = got
        errors = [e for m in ms for e in m.errors]
        return self._recorded(Outcome(item.candidate, job.problem, "evaluated", errors[0] if errors else "",
                                      item.plan, item.artifact, list(ms), cost, new_class), job.cls_text)

    def evaluate_many(self, jobs: Iterable[tuple[Prepared, Problem]], evaluator=None, time_kernel: bool | None = None,
                      class_gates: bool = True, **options) -> list[Outcome | None]:
        """`evaluate` for several (prepared candidate, problem) pairs, in that order; the evaluations an evaluator
        pool can run at once (`evaluate_many`, search/pool.py) run concurrently, any other evaluator takes them one
        by one. Outcomes (and records, with `record` on) come in job order. The jobs must not depend on each other:
        class gates one job keeps are not seen by another job of the same call (give a kernel once per call)."""
        jobs = list(jobs)
        evaluator = evaluator if evaluator is not None else self.evaluator
        if evaluator is None or not callable(getattr(evaluator, "evaluate_many", None)):
            return [self.evaluate(item, p, evaluator, time_kernel, class_gates=class_gates, **options)
                    for item, p in jobs]
        from .pool import Job

        before = [self._prepare_evaluation(item, p, evaluator, time_kernel, None, class_gates, options)
                  for item, p in jobs]
        pending = [b for b in before if isinstance(b, _Pending)]
        try:
            results = evaluator.evaluate_many([Job(b.item.candidate.kernel, b.problem, b.item.plan,
                                                   b.item.artifact, b.timed, b.options) for b in pending])
            costs = list(getattr(evaluator, "last_costs_s", None) or [0.0] * len(pending))
        except Exception as e:  # noqa: BLE001 - a pool promises not to raise; if it does, the run goes on
            results, costs = [e] * len(pending), [0.0] * len(pending)
        done = {id(b): (self._failed(b, r) if isinstance(r, BaseException) else self._finish(b, r, c))
                for b, r, c in zip(pending, results, costs)}
        return [done[id(b)] if isinstance(b, _Pending) else b for b in before]

    def _kept_class_gates(self, kernel_hash: str, cls_text: str, evaluator) -> list[dict] | None:
        env_id = self.env_id
        if env_id is None and getattr(evaluator, "environment", None):
            env_id = environment_id(evaluator.environment)
        if not self.config.reuse_class_gates or env_id is None or not hasattr(self.store, "class_gates"):
            return None
        return self.store.class_gates(kernel_hash, cls_text, env_id)

    def _recorded(self, outcome: Outcome, cls_text: str) -> Outcome:
        if self.config.record:
            cand = outcome.candidate
            for m in outcome.measurements:
                self.store.add(m, cand.name, cand.origin)
            if outcome.class_verdicts is not None and self.env_id and hasattr(self.store, "add_class_gates"):
                self.store.add_class_gates(outcome.kernel_hash, cls_text, self.env_id, outcome.class_verdicts)
        return outcome

    def run(self, candidates: Iterable[Candidate], problems: Iterable[Problem]) -> list[Outcome]:
        """Every candidate on every problem: one Outcome per (problem, candidate), problems in order, candidates in
        order within each. Problems of one class share one lowering and compile of each kernel."""
        candidates, problems = list(candidates), list(problems)
        prepared: dict[str, list[Prepared]] = {}
        for p in problems:
            ctext = print_problem(_class_of(p))
            if ctext not in prepared:
                prepared[ctext] = self.prepare(candidates, p)
        outcomes = []
        for p in problems:
            for item in prepared[print_problem(_class_of(p))]:
                o = self.evaluate(item, p)
                if o is not None:
                    outcomes.append(o)
        return outcomes

    @property
    def prepared(self) -> list[Prepared]:
        """Every distinct kernel prepared so far (all problem classes), in the order first seen."""
        return list(self._prepared.values())
