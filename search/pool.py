"""A pool of evaluators, one per visible GPU: independent candidates are evaluated at the same time.

Each worker is an `Evaluator` (search/evaluator.py) bound to one device, so each GPU keeps its own worker process
and its own recovery: a candidate that crashes or hangs a GPU restarts only that GPU's worker. The pool feeds the
workers from one queue, one thread per worker (the threads only wait on the worker processes), and hands results
back in job order, so a caller that records them in that order writes what a single evaluator would have written.

    with EvaluatorPool.on_devices("all", EvalConfig(scenarios=("offline",))) as pool:
        pool.evaluate(kernel, problem, plan, artifact)             # a drop-in evaluator
        pool.evaluate_many([Job(kernel, problem, plan, artifact), ...])   # concurrently, results in job order

A device whose worker cannot start at all is dropped and said so once; the pool goes on with the others. A worker
that raises gives the job's measurements carrying the error (the candidate's failure), never an exception.
GPU-seconds are per job (`last_costs_s`): a budget sums them over the workers.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from l2ir.nodes import Kernel, Problem
from l2ir.text import print_problem

from .evaluator import Measurement


@dataclass
class Job:
    kernel: Kernel
    problem: Problem
    plan: object = None
    artifact: object = None
    time_kernel: bool = True
    options: dict = field(default_factory=dict)     # e.g. skip_gates


def parse_gpus(text: str | int | None, visible: int | None = None) -> list[int]:
    """`--gpus`: N (the first N devices), "all", or a list "0,2". Raises ValueError naming what is wrong."""
    if visible is None:
        visible = _device_count()
    text = "all" if text is None else str(text).strip()
    if text == "all":
        return list(range(visible))
    try:
        if "," in text:
            devices = [int(x) for x in text.split(",") if x.strip()]
        else:
            n = int(text)
            if n < 1:
                raise ValueError
            if n > visible:
                raise ValueError(f"--gpus {n}: only {visible} GPU(s) visible")
            return list(range(n))
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("--gpus") else
                         f"--gpus '{text}': expected N, 'all' or a list like 0,1") from None
    bad = [d for d in devices if not 0 <= d < visible]
    if bad or len(set(devices)) != len(devices) or not devices:
        raise ValueError(f"--gpus '{text}': devices must be distinct and in 0..{visible - 1} ({visible} visible)")
    return devices


def _device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPU to pool
        return 0


class EvaluatorPool:
    """One evaluator per device, used as one evaluator. `workers` are evaluator objects (each used by one thread at
    a time); build GPU ones with `EvaluatorPool.on_devices`."""

    def __init__(self, workers: Sequence, log: Callable[[str], None] | None = None):
        if not workers:
            raise ValueError("EvaluatorPool: no workers (no GPU visible?)")
        self.workers = list(workers)
        self.config = getattr(self.workers[0], "config", None)
        self.measured = getattr(self.workers[0], "measured", True)
        self._log = log or (lambda msg: print(msg, file=sys.stderr))
        self._dead: dict[int, str] = {}          # worker index -> why it could not start
        self._lock = threading.Lock()
        self.last_cost_s: float | None = None
        self.last_costs_s: list[float] = []
        self.evaluated_by: list[int] = []         # worker index per job of the last evaluate_many
        self.jobs_per_worker = [0] * len(self.workers)

    @classmethod
    def on_devices(cls, devices: Sequence[int] | str | int | None, config=None, log=None) -> EvaluatorPool:
        """One `Evaluator(config with device=d)` per device of `devices` (a list, or `--gpus` text)."""
        from .evaluator import EvalConfig, Evaluator

        config = config if config is not None else EvalConfig()
        if not isinstance(devices, (list, tuple)):
            devices = parse_gpus(devices)
        if not devices:
            raise ValueError("EvaluatorPool: no GPU visible (torch.cuda.device_count() is 0)")
        return cls([Evaluator(dataclasses.replace(config, device=d)) for d in devices], log)

    # -- the evaluator interface --------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Workers that can still take jobs."""
        return len(self.workers) - len(self._dead)

    @property
    def environment(self) -> dict:
        for i, w in enumerate(self.workers):
            env = getattr(w, "environment", None)
            if env and i not in self._dead:
                return env
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for w in self.workers:
            close = getattr(w, "close", None)
            if close is not None:
                close()

    def takes(self, option: str) -> bool:
        """Whether every worker's `evaluate` accepts the keyword `option` (the pool passes options through)."""
        from .pipeline import _takes

        return all(_takes(w, option) for w in self.workers)

    def evaluate(self, kernel: Kernel, problem: Problem, plan=None, artifact=None, time_kernel: bool = True,
                 **options) -> list[Measurement]:
        out = self.evaluate_many([Job(kernel, problem, plan, artifact, time_kernel, options)])[0]
        self.last_cost_s = self.last_costs_s[0]
        return out

    def evaluate_many(self, jobs: Sequence[Job | tuple]) -> list[list[Measurement]]:
        """Every job on some worker, concurrently; the results (and `last_costs_s`, `evaluated_by`) in job order."""
        jobs = [j if isinstance(j, Job) else Job(*j) for j in jobs]
        with self._lock:
            results: list = [None] * len(jobs)
            costs = [0.0] * len(jobs)
            by = [-1] * len(jobs)
            todo: queue.Queue = queue.Queue()
            for i in range(len(jobs)):
                todo.put(i)
            live = [i for i in range(len(self.workers)) if i not in self._dead]
            threads = [threading.Thread(target=self._feed, args=(w, jobs, todo, results, costs, by), daemon=True,
                                        name=f"l2ir-pool-{w}") for w in live]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # Every worker died while starting: the jobs left carry that as their error.
            for i, r in enumerate(results):
                if r is None:
                    why = "; ".join(f"worker {w}: {m}" for w, m in sorted(self._dead.items())) or "no worker"
                    results[i] = _error_measurements(jobs[i], f"no evaluator could start ({why})", {},
                                                     self.config)
            self.last_costs_s, self.evaluated_by = costs, by
            self.last_cost_s = sum(costs)
            return results

    # -- one thread per worker ----------------------------------------------------------------------------------

    def _feed(self, w: int, jobs, todo: queue.Queue, results, costs, by):
        worker = self.workers[w]
        ensure = getattr(worker, "_ensure_worker", None)
        if ensure is not None:
            try:
                why = ensure()
            except Exception as e:  # noqa: BLE001 - a start that raises is a start that failed
                why = f"[{type(e).__name__}] {e}"
            if why is not None and getattr(worker, "starts", 1) == 0:
                # Never started: this device is out of the pool (its jobs go to the others). A worker that ran
                # before and died keeps restarting through the evaluator's own recovery instead.
                self._dead[w] = why
                names = getattr(getattr(worker, "config", None), "device", w)
                self._log(f"l2ir: GPU {names} could not start an evaluator ({why}); "
                          + (f"continuing on {self.size} other worker(s)" if self.size else "no worker left"))
                return
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            job = jobs[i]
            t0 = time.perf_counter()
            try:
                ms = worker.evaluate(job.kernel, job.problem, job.plan, job.artifact, time_kernel=job.time_kernel,
                                     **job.options)
                cost = getattr(worker, "last_cost_s", None)
            except Exception as e:  # noqa: BLE001 - the evaluator promises not to raise; if it does, the job fails
                text = str(e).strip().splitlines()
                ms = _error_measurements(job, f"the evaluator failed: [{type(e).__name__}] "
                                              f"{text[0] if text else ''}", getattr(worker, "environment", {}),
                                        self.config)
                cost = None
            results[i] = list(ms)
            costs[i] = (time.perf_counter() - t0) if cost is None else float(cost)
            by[i] = w
            self.jobs_per_worker[w] += 1


def _error_measurements(job: Job, error: str, environment: dict, config=None) -> list[Measurement]:
    """What a job that got no evaluation records: one measurement per scenario it would have had, with the error."""
    h = job.kernel.content_hash()
    scenarios = tuple(getattr(config, "scenarios", ()) or ())
    scenarios = scenarios if (scenarios and job.time_kernel) else ("gates",)
    return [Measurement(kernel_hash=h, problem=print_problem(job.problem), scenario=s, errors=[error],
                        environment=dict(environment or {})) for s in scenarios]
