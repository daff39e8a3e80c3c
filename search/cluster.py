"""The search on a Dask cluster: compiles as CPU tasks wherever cores are, evaluations as GPU tasks on GPU workers,
and the records DB written by the driver alone.

    l2ir tune --shape 4096x4096x4096 --cluster local          one GPU worker per visible GPU (--gpus) + CPU workers
    l2ir tune --grid --cluster tcp://head:8786                 an existing scheduler (dask-jobqueue on SLURM, ...)
    l2ir tune --grid --cluster scheduler.json                  its scheduler file (examples/slurm_tune.sh on SLURM)
    DASK_SCHEDULER_ADDRESS=tcp://head:8786 l2ir tune ...       the same, by Dask's own variable

Why Dask distributed: it is pure Python and small (dask + distributed and their dependencies are a few MB of
wheels; Ray's one wheel is 79 MB), it runs on a laptop, a multi-GPU host and a SLURM cluster (dask-jobqueue starts
the workers as batch jobs) with the same client code, and its per-worker resources (`--resources GPU=1`) are all
the GPU scheduling the search needs: one evaluation at a time per GPU.

Roles:
- A GPU worker holds one GPU (local: CUDA_VISIBLE_DEVICES pinned to its device, one thread; a remote worker must see
  exactly one GPU, as `dask cuda worker` and SLURM's per-task GPUs arrange) and the resource GPU=1. It keeps one
  evaluator per evaluator spec for its lifetime (search/evaluator.py: its own process per GPU, so a kernel that
  faults or hangs costs that process, never the Dask worker).
- Compiles (`compile_on_cluster`) are tasks without resources, so any worker's threads take them. The driver looks
  in its own content-addressed cache first (backends/compile.py: sha256 of source, flags, toolchain, CUTLASS), a
  batch submits each missing key once (the key is the Dask task's key), and a worker builds into its node's own
  cache and ships the finished entry back, binary, log and repro command included, which the driver files under
  the same key: no shared filesystem is needed, and the driver's cache is the one every later run and `l2ir export`
  read. A worker whose toolchain gives another key than the driver's is a compile failure that says so: binaries of
  two toolchains never share a key.
- Evaluations (`ClusterEvaluator`, the evaluator pool's interface, search/pool.py) are tasks with resources GPU=1,
  at most one in flight per GPU worker, so a worker that dies takes exactly one candidate with it. Dask resubmits
  that task elsewhere; a task that was running on `allowed-failures` + 1 workers that died is a KilledWorker, which
  the candidate records as its crash verdict instead of being retried forever. The binary travels with the job.
- The driver runs the search loop (search/loop.py) and is the only process that writes the records DB: workers
  return measurements, and the loop records each candidate once, in candidate order, in one transaction. A killed
  driver is resumed with `l2ir tune --resume RUN --cluster ...` (the loop's own resume).

A lost scheduler, or no GPU worker for `no_worker_timeout_s`, stops the run with a ClusterError (nothing of the
candidates in flight is recorded; --resume continues it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import queue
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from l2ir.backends.compile import (
    COMPILE_PEAK_BYTES_CUTLASS,
    Artifact,
    CompileFailure,
    CompileOptions,
    CompileResult,
    _entry_dir,
    _load_cached,
    cache_key,
    compile_plan,
    machine_jobs,
)

from .pipeline import Pipeline, Prepared, _class_of, _first_line
from .pool import Job, _error_measurements

GPU = "GPU"                        # the Dask resource a GPU worker declares (dask worker --resources GPU=1)
ADDRESS_VARIABLE = "DASK_SCHEDULER_ADDRESS"
KILLS_ALLOWED = 2                  # local scheduler's allowed-failures: the 3rd worker death marks the task crashed


class ClusterError(Exception):
    """The cluster cannot serve the run (unreachable scheduler, no GPU worker, lost scheduler): one line."""


def _dask():
    try:
        import dask
        import distributed
    except ImportError:
        raise ClusterError("--cluster needs Dask distributed: pip install 'l2ir[cluster]'") from None
    return dask, distributed


# ---------------------------------------------------------------------------------------------------------------
# The cluster: a local one this process owns, or a client of an existing scheduler.
# ---------------------------------------------------------------------------------------------------------------


class Cluster:
    """A Dask client and, for a local cluster, the cluster it owns (closed with it)."""

    def __init__(self, client, owned=None, address: str = ""):
        self.client, self.owned, self.address = client, owned, address or client.scheduler.address

    @classmethod
    def local(cls, gpus: Sequence[int] = (), fake_gpus: int = 0, cpu_threads: int = 0,
              kills_allowed: int = KILLS_ALLOWED) -> Cluster:
        """A scheduler on 127.0.0.1 and, each in its own process under a nanny that restarts it if it dies: one
        worker per device of `gpus` (CUDA_VISIBLE_DEVICES = that device, one thread, resources GPU=1), `fake_gpus`
        workers with resources GPU=1 and no device (the stand-in evaluator's), and one CPU worker with
        `cpu_threads` threads for compiles (none if 0). This is Dask's LocalCluster with per-worker settings (its
        SpecCluster base, as dask-cuda's LocalCUDACluster does)."""
        dask, distributed = _dask()
        # The evaluator starts a process of its own for the GPU (a faulting kernel kills that, not the worker);
        # Dask's worker processes are daemonic by default, and daemonic processes cannot have children. Read by
        # the nanny at every (re)start, so it stays set for this process.
        dask.config.set({"distributed.worker.daemon": False})
        # Workers log a closing connection as an error when the cluster shuts down under them; their real
        # failures reach the driver as task errors or as a cluster that does not start.
        quiet = dict(silence_logs=logging.CRITICAL, host="127.0.0.1", memory_limit=0)
        workers = {}
        for d in gpus:
            workers[f"gpu-{d}"] = {"cls": distributed.Nanny, "options": {
                **quiet, "nthreads": 1, "resources": {GPU: 1}, "env": {"CUDA_VISIBLE_DEVICES": str(d)}}}
        for i in range(fake_gpus):
            workers[f"gpu-{i}"] = {"cls": distributed.Nanny, "options": {
                **quiet, "nthreads": 1, "resources": {GPU: 1}, "env": {"CUDA_VISIBLE_DEVICES": ""}}}
        if cpu_threads > 0:
            workers["cpu"] = {"cls": distributed.Nanny, "options": {**quiet, "nthreads": cpu_threads}}
        if not workers:
            raise ClusterError("--cluster local: no worker to start (no GPU visible and nothing to compile)")
        scheduler = {"cls": distributed.Scheduler, "options": {
            "host": "127.0.0.1", "dashboard": False, "allowed_failures": kills_allowed}}
        try:
            # The scheduler runs in this process: a worker lost mid-task is logged there as an error, and is
            # expected (the task runs again); what the run cannot survive it raises as a ClusterError.
            spec = distributed.SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.CRITICAL,
                                           name="l2ir")
        except Exception as e:  # noqa: BLE001 - a worker that cannot start: say which, in one line
            raise ClusterError(f"--cluster local: the local Dask cluster did not start: {_first_line(e)}") from None
        client = distributed.Client(spec, set_as_default=False)
        return cls(client, spec, "local")

    @classmethod
    def connect(cls, address: str, timeout_s: float | None = None) -> Cluster:
        """A client of the scheduler at `address` (tcp://host:port, or a scheduler file written by `dask scheduler
        --scheduler-file`). `timeout_s` defaults to Dask's connect timeout (distributed.comm.timeouts.connect)."""
        dask, distributed = _dask()
        if timeout_s is None:
            timeout_s = dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
        where = {"scheduler_file": address} if address.endswith(".json") else {"address": address}
        if "scheduler_file" in where and not Path(address).is_file():
            raise ClusterError(f"--cluster {address}: no such scheduler file")
        try:
            client = distributed.Client(**where, timeout=timeout_s, set_as_default=False)
        except Exception as e:  # noqa: BLE001 - OSError (refused, timed out), ValueError (bad address), ...
            raise ClusterError(f"--cluster {address}: cannot reach a Dask scheduler there "
                               f"({type(e).__name__}: {_first_line(e)})") from None
        return cls(client, None, address)

    def wait_for_gpu_workers(self, n: int = 1, timeout_s: float = 60.0):
        """Block until `n` workers with the GPU resource are up (batch-scheduled workers come late)."""
        end = time.monotonic() + timeout_s
        while len(self.gpu_workers()) < n:
            if time.monotonic() > end:
                raise ClusterError(f"--cluster {self.address}: {len(self.gpu_workers())} worker(s) with the {GPU} "
                                   f"resource after {timeout_s:.0f} s, {n} needed (start GPU workers with "
                                   f"`dask worker ADDRESS --resources {GPU}=1 --nthreads 1`, one per GPU, "
                                   "as examples/slurm_tune.sh does)")
            time.sleep(0.2)

    def workers(self) -> dict[str, dict]:
        return dict(self.client.scheduler_info(n_workers=-1).get("workers", {}))

    def gpu_workers(self) -> list[str]:
        return sorted(a for a, w in self.workers().items() if (w.get("resources") or {}).get(GPU, 0) >= 1)

    def worker_pids(self) -> dict[str, int]:
        """Worker name -> process id (what a test kills)."""
        pids = self.client.run(os.getpid)
        names = {a: str(w.get("name", a)) for a, w in self.workers().items()}
        return {names.get(a, a): pid for a, pid in pids.items()}

    def close(self):
        try:
            if self.owned is None:
                # Workers outlive this driver: give their GPUs back (the evaluators' processes hold contexts).
                self.client.run(_close_worker_evaluators)
        except Exception:  # noqa: BLE001 - closing after a lost scheduler has nothing left to close
            pass
        self.client.close()
        if self.owned is not None:
            self.owned.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_cluster(spec: str, mode: str, devices: Sequence[int] = (), compile_threads: int | None = None) -> Cluster:
    """`--cluster SPEC` for a tuning run in `mode`: "local" starts the workers the mode needs (GPU mode: one per
    device; stand-in: len(devices) fake GPU workers; a CPU worker for compiles unless stand-in), anything else is a
    scheduler's address, which must have a GPU worker unless nothing is evaluated."""
    if spec == "local":
        # A search may compile CUTLASS kernels: as many compile threads as the CPUs and memory hold for those.
        threads = 0 if mode == "standin" else (compile_threads or machine_jobs(COMPILE_PEAK_BYTES_CUTLASS))
        if mode == "gpu" and not devices:
            raise ClusterError("--cluster local: no GPU visible (--standin runs stand-in workers)")
        return Cluster.local(gpus=devices if mode == "gpu" else (), fake_gpus=len(devices) if mode == "standin"
                             else 0, cpu_threads=threads)
    cluster = Cluster.connect(spec)
    try:
        if mode != "compile_only":
            cluster.wait_for_gpu_workers(1)
        if mode == "gpu":
            daemonic = [a for a, d in cluster.client.run(_daemonic, workers=cluster.gpu_workers()).items() if d]
            if daemonic:
                raise ClusterError(f"--cluster {spec}: GPU worker(s) {', '.join(daemonic)} run as daemonic "
                                   "processes, which cannot start the evaluator's GPU process: start them with "
                                   "DASK_DISTRIBUTED__WORKER__DAEMON=False")
    except ClusterError:
        cluster.close()
        raise
    return cluster


def _daemonic() -> bool:
    import multiprocessing

    return bool(multiprocessing.current_process().daemon)


# ---------------------------------------------------------------------------------------------------------------
# Compiles: CPU tasks, each cache key once, entries shipped back to the driver's cache.
# ---------------------------------------------------------------------------------------------------------------


def compile_on_cluster(cluster: Cluster, plans: Sequence, options: CompileOptions) -> list[CompileResult]:
    """`backends.compile.compile_many` on the cluster's workers: results in input order, each cache key built at
    most once (none if the driver's cache has it), every entry filed in the driver's cache."""
    results: list[CompileResult | None] = [None] * len(plans)
    keys: list[str | None] = [None] * len(plans)
    futures = {}
    for i, plan in enumerate(plans):
        try:
            key = cache_key(plan, options)
        except Exception:  # noqa: BLE001 - toolchain or arch problems: compile_plan gives them their record
            results[i] = compile_plan(plan, options)
            continue
        keys[i] = key
        cached = _load_cached(_entry_dir(options, key), key)
        if cached is not None:
            results[i] = cached
        elif key not in futures:
            futures[key] = cluster.client.submit(_compile_task, plan, options, key=f"l2ir-compile-{key}",
                                                 pure=False)
    shipped = {}
    for key, fut in futures.items():
        try:
            shipped[key] = _unpack(fut.result(), key, options)
        except Exception as e:  # noqa: BLE001 - a compile task lost for good (KilledWorker, ...) fails its kernel
            shipped[key] = CompileFailure(key=key, reason="error", log=f"the compile task failed: "
                                          f"[{type(e).__name__}] {_first_line(e)}")
        fut.release()
    for i in range(len(plans)):
        if results[i] is None:
            results[i] = shipped[keys[i]]
    return results


def _compile_task(plan, options: CompileOptions) -> dict:
    """On a worker: compile into this node's own cache (content-addressed like the driver's, so a node builds a
    key once whichever driver asks) and pack the entry for the driver."""
    opts = dataclasses.replace(options, python=sys.executable, jobs=1,
                               cache_dir=str(Path(tempfile.gettempdir()) / "l2ir-worker-cache"))
    try:
        art = compile_plan(plan, opts)
    except Exception as e:  # noqa: BLE001 - as compile_many's guard: a broken entry fails one kernel
        art = CompileFailure(key="", reason="error", log=f"{type(e).__name__}: {e}")
    files = {}
    entry = getattr(art, "dir", None)
    if entry is not None and Path(entry).is_dir():
        files = {p.name: p.read_bytes() for p in Path(entry).iterdir() if p.is_file()}
    return {"result": art, "files": files}


def _unpack(packed: dict, key: str, options: CompileOptions) -> CompileResult:
    """File a worker's entry under the driver's cache (once: entries are immutable) and load it from there."""
    art: CompileResult = packed["result"]
    if art.key and art.key != key:
        return CompileFailure(key=key, reason="toolchain", log=(
            f"the worker's toolchain gives cache key {art.key[:12]}, the driver's {key[:12]}: install the same nvcc, "
            "CUTLASS and host compiler on the driver and the workers"))
    if not packed["files"]:
        return art                      # not cached anywhere (a timeout, a killed compiler, a missing toolchain)
    entry = _entry_dir(options, key)
    if not (entry / "result.json").is_file():
        tmp = entry.parent.parent / ".tmp" / f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        worker_entry = str(art.dir).encode()
        for name, blob in packed["files"].items():
            if name in ("command.sh", "result.json"):
                # The reproducing command runs in the entry: this one, not the worker's.
                blob = blob.replace(worker_entry, str(entry).encode())
            (tmp / Path(name).name).write_bytes(blob)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp.rename(entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)          # another process filed the same key first
    local = _load_cached(entry, key)
    # Built fresh on the worker: its compile seconds are this run's to count.
    return dataclasses.replace(local, cached=art.cached) if local is not None else art


class ClusterPipeline(Pipeline):
    """The candidate pipeline whose compile step runs on the cluster (everything else is Pipeline's)."""

    cluster: Cluster

    @classmethod
    def adopt(cls, pipeline: Pipeline, cluster: Cluster) -> ClusterPipeline:
        """This pipeline's state (config, evaluator, store, kernels prepared so far) with cluster compiles."""
        new = cls.__new__(cls)
        new.__dict__.update(pipeline.__dict__)
        new.cluster = cluster
        return new

    def prepare(self, candidates, problem_class):
        """Lower the kernels not yet prepared for this class and compile them on the cluster in one batch; then
        Pipeline.prepare orders, dedupes and answers from what is prepared."""
        candidates = list(candidates)
        if not self.config.compile_kernels:
            return super().prepare(candidates, problem_class)
        pclass = _class_of(problem_class)
        from l2ir.text import print_problem

        ctext = print_problem(pclass)
        fresh: list[Prepared] = []
        for cand in candidates:
            try:
                h = cand.kernel.content_hash()
            except Exception:  # noqa: BLE001 - Pipeline.prepare gives it its verdict
                continue
            slot = (ctext, h, cand.backend or self.config.backend)
            if slot in self._prepared:
                continue
            item = self._prepared[slot] = self._lower(cand, h, pclass)
            if item.ok:
                fresh.append(item)
        if fresh:
            t0 = time.perf_counter()
            try:
                results = compile_on_cluster(self.cluster, [p.plan for p in fresh], self.config.compile)
            except Exception as e:  # noqa: BLE001 - the cluster itself failing: stop the run, resumable
                raise ClusterError(f"compiling on the cluster failed: {_first_line(e)}") from e
            self.compile_wall_s += time.perf_counter() - t0
            for item, art in zip(fresh, results):
                item.artifact = art
                if not art.ok:
                    item.status = "compile_failed"
                    item.error = f"compile {art.reason}: {art.summary()} (reproduce: {art.repro or '-'})"
                    self._log(f"compile failed: {item.candidate.name} {item.kernel_hash[:12]}: {item.error}")
        return super().prepare(candidates, problem_class)


# ---------------------------------------------------------------------------------------------------------------
# Evaluations: GPU tasks, one in flight per GPU worker.
# ---------------------------------------------------------------------------------------------------------------

_WORKER_EVALUATORS: dict[str, object] = {}     # on a worker: spec id -> its evaluator, kept for the worker's life


def _worker_evaluator(spec_id: str, make: Callable):
    ev = _WORKER_EVALUATORS.get(spec_id)
    if ev is None:
        ev = _WORKER_EVALUATORS[spec_id] = make()
    return ev


def _warm_task(spec_id: str, make: Callable):
    """On a GPU worker: make this spec's evaluator and start its GPU process now. (why it cannot start, env)."""
    ev = _worker_evaluator(spec_id, make)
    ensure = getattr(ev, "_ensure_worker", None)
    why = ensure() if callable(ensure) else None
    return why, dict(getattr(ev, "environment", None) or {})


def _evaluate_task(spec_id: str, make: Callable, job: Job, blob: bytes | None):
    """On a GPU worker: this spec's evaluator (made once per worker) evaluates one job. The evaluator's own failure
    is the candidate's (its measurements carry the error), as in the local pool."""
    from distributed import get_worker

    ev = _worker_evaluator(spec_id, make)
    artifact = _local_artifact(job.artifact, blob)
    t0 = time.perf_counter()
    try:
        ms = list(ev.evaluate(job.kernel, job.problem, job.plan, artifact, time_kernel=job.time_kernel,
                              **job.options))
        cost = getattr(ev, "last_cost_s", None)
    except Exception as e:  # noqa: BLE001 - the evaluator promises not to raise; if it does, the job fails
        ms = _error_measurements(job, f"the evaluator failed: [{type(e).__name__}] {_first_line(e)}",
                                 getattr(ev, "environment", {}), getattr(ev, "config", None))
        cost = None
    cost = (time.perf_counter() - t0) if cost is None else float(cost)
    return ms, cost, str(get_worker().name), os.getpid()


def _local_artifact(artifact, blob: bytes | None):
    """The artifact with a binary this worker can read: the driver's path where this worker sees it (the same host
    or a shared filesystem: the path holds the cache key, so the same path is the same binary), else the shipped
    bytes written once under the worker's temporary directory."""
    if blob is None or not isinstance(artifact, Artifact) or Path(artifact.binary).is_file():
        return artifact
    where = Path(tempfile.gettempdir()) / "l2ir-binaries" / artifact.key
    path = where / Path(artifact.binary).name
    if not path.is_file():
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".{uuid.uuid4().hex}"
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    return dataclasses.replace(artifact, dir=where, binary=path)


def _close_worker_evaluators():
    for ev in _WORKER_EVALUATORS.values():
        close = getattr(ev, "close", None)
        if close is not None:
            close()
    _WORKER_EVALUATORS.clear()


class ClusterEvaluator:
    """The evaluator pool's interface (search/pool.py) over the cluster's GPU workers. `make` is a picklable
    callable that builds the evaluator on a worker (functools.partial(Evaluator, EvalConfig(...)) or the
    stand-in's); the driver builds one too, unstarted, to read its config."""

    def __init__(self, cluster: Cluster, make: Callable, no_worker_timeout_s: float = 300.0,
                 log: Callable[[str], None] | None = None):
        self.cluster, self.make = cluster, make
        import cloudpickle

        # The key its evaluator is kept under on every worker: what `make` builds (Dask pickles it the same way).
        self.spec_id = hashlib.sha256(cloudpickle.dumps(make)).hexdigest()[:16]
        probe = make()
        self.config = getattr(probe, "config", None)
        self.measured = getattr(probe, "measured", True)
        self.environment: dict = dict(getattr(probe, "environment", None) or {})
        self._evaluate = probe.evaluate             # its signature answers `takes`
        self.no_worker_timeout_s = no_worker_timeout_s
        self._log = log or (lambda msg: print(msg, file=sys.stderr))
        self.last_cost_s: float | None = None
        self.last_costs_s: list[float] = []
        self.evaluated_by: list[str] = []
        self.jobs_per_worker: dict[str, int] = {}
        self.crashes = 0                             # candidates recorded as crashed (they killed workers)
        self.wall_s = 0.0                            # wall seconds spent in evaluate_many (throughput measures)

    # -- the evaluator interface --------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """GPU workers in the cluster now."""
        return len(self.cluster.gpu_workers())

    def takes(self, option: str) -> bool:
        import inspect

        try:
            return option in inspect.signature(self._evaluate).parameters
        except (TypeError, ValueError):
            return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass                 # the workers' evaluators go with the workers (Cluster.close gives remote ones back)

    def warm(self) -> dict[str, str | None]:
        """Make and start this evaluator on every GPU worker at once (a GPU evaluator's process imports torch and
        creates its context: seconds each), instead of on each worker's first job. Returns worker -> None, or why
        its evaluator could not start; the environment is the first started one's."""
        client = self.cluster.client
        futures = {w: client.submit(_warm_task, self.spec_id, self.make, workers=[w], allow_other_workers=False,
                                    resources={GPU: 1}, pure=False, key=f"l2ir-warm-{uuid.uuid4().hex}")
                   for w in self.cluster.gpu_workers()}
        out = {}
        for w, fut in futures.items():
            try:
                why, env = fut.result()
            except Exception as e:  # noqa: BLE001 - reported per worker, as the pool reports a device
                why, env = f"[{type(e).__name__}] {_first_line(e)}", {}
            out[w] = why
            if why is None and env and not self.environment:
                self.environment = env
        return out

    def evaluate(self, kernel, problem, plan=None, artifact=None, time_kernel: bool = True, **options):
        out = self.evaluate_many([Job(kernel, problem, plan, artifact, time_kernel, options)])[0]
        self.last_cost_s = self.last_costs_s[0]
        return out

    def evaluate_many(self, jobs: Sequence[Job | tuple]) -> list[list]:
        """Every job on some GPU worker, at most one in flight per worker; results in job order."""
        from distributed.scheduler import KilledWorker

        jobs = [j if isinstance(j, Job) else Job(*j) for j in jobs]
        results: list = [None] * len(jobs)
        costs = [0.0] * len(jobs)
        by = [""] * len(jobs)
        todo = list(range(len(jobs)))[::-1]
        flying: dict = {}
        finished: queue.Queue = queue.Queue()        # futures as they finish (Dask calls back from its thread)
        idle_since = None
        client = self.cluster.client
        t0 = time.perf_counter()
        try:
            while todo or flying:
                room = max(1, self.size) - len(flying)
                while todo and room > 0:
                    i = todo.pop()
                    fut = client.submit(_evaluate_task, self.spec_id, self.make, jobs[i], _binary(jobs[i].artifact),
                                        resources={GPU: 1}, pure=False, key=f"l2ir-eval-{uuid.uuid4().hex}")
                    flying[fut.key] = (fut, i)
                    fut.add_done_callback(finished.put)
                    room -= 1
                try:
                    done = [finished.get(timeout=2.0)]
                except queue.Empty:
                    done = []
                if not done:
                    if self.size:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > self.no_worker_timeout_s:
                        raise ClusterError(f"no worker with the {GPU} resource at {self.cluster.address} for "
                                           f"{self.no_worker_timeout_s:.0f} s")
                    continue
                for fut in done:
                    if fut.key not in flying:
                        continue
                    fut, i = flying.pop(fut.key)
                    status = fut.status
                    if status == "cancelled":       # the scheduler forgot it (lost, restarted)
                        raise ClusterError(f"the Dask scheduler at {self.cluster.address} dropped an evaluation")
                    try:
                        # A result whose worker died before it was fetched is computed again: this waits for it.
                        ms, costs[i], by[i], _ = fut.result()
                    except KilledWorker as e:
                        self.crashes += 1
                        why = (f"crash: the evaluation killed every Dask worker it ran on (the scheduler's "
                               f"allowed-failures is {getattr(e, 'allowed_failures', '?')}); not retried")
                        self._log(f"l2ir: {jobs[i].kernel.content_hash()[:12]} on {jobs[i].problem.shape}: {why}")
                        ms = _error_measurements(jobs[i], why, self.environment, self.config)
                    except Exception as e:  # noqa: BLE001 - the task's own error fails the job; a lost link stops
                        if status != "error":
                            raise
                        ms = _error_measurements(jobs[i], f"the evaluation task failed: [{type(e).__name__}] "
                                                          f"{_first_line(e)}", self.environment, self.config)
                    else:
                        self.jobs_per_worker[by[i]] = self.jobs_per_worker.get(by[i], 0) + 1
                        if not self.environment and ms and ms[0].environment:
                            self.environment = dict(ms[0].environment)
                    results[i] = ms
                    fut.release()
        except ClusterError:
            raise
        except Exception as e:  # noqa: BLE001 - the connection to the scheduler is gone: stop, resumable
            raise ClusterError(f"lost the Dask scheduler at {self.cluster.address}: [{type(e).__name__}] "
                               f"{_first_line(e)}") from e
        finally:
            for fut, _ in flying.values():
                fut.cancel()
            self.wall_s += time.perf_counter() - t0
        self.last_costs_s, self.evaluated_by = costs, by
        self.last_cost_s = sum(costs)
        return results

    def summary(self) -> str:
        counts = ", ".join(f"{w}: {n}" for w, n in sorted(self.jobs_per_worker.items()))
        return (f"evaluations per Dask worker: {counts or 'none'}"
                + (f"; {self.crashes} candidate(s) recorded as crashed" if self.crashes else ""))


def _binary(artifact) -> bytes | None:
    """The bytes a worker without the driver's filesystem needs (a cubin is ~100 KB, an evaluation seconds)."""
    if isinstance(artifact, Artifact) and Path(artifact.binary).is_file():
        return Path(artifact.binary).read_bytes()
    return None


# ---------------------------------------------------------------------------------------------------------------
# What `l2ir tune --cluster` builds.
# ---------------------------------------------------------------------------------------------------------------


def evaluators(cluster: Cluster, search_make: Callable | None, retime_make: Callable | None):
    """(search evaluator, re-timer) on the cluster's GPU workers; None for what is not evaluated."""
    return (ClusterEvaluator(cluster, search_make) if search_make is not None else None,
            ClusterEvaluator(cluster, retime_make) if retime_make is not None else None)


def distribute(search, cluster: Cluster):
    """Route a Search's compiles through the cluster (its evaluators are ClusterEvaluators already)."""
    search.pipeline = ClusterPipeline.adopt(search.pipeline, cluster)
    return search


def standin_makers(seed: int):
    from .standin import StandinConfig, StandinEvaluator

    return (functools.partial(StandinEvaluator, StandinConfig(("offline",), seed)),
            functools.partial(StandinEvaluator, StandinConfig(("offline", "server"), seed)))
