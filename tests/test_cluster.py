"""The search on a Dask cluster (search/cluster.py) on the CPU: a local cluster of two worker processes with fake GPU
resources runs the stand-in evaluator. The same seed gives the local pool's run; a worker SIGKILLed in the middle
of an evaluation loses nothing; a candidate that kills every worker it runs on is recorded as a crash; a driver
killed with SIGKILL resumes to the uninterrupted run; compiles are content-addressed and shipped to the driver's
cache; a bad --cluster address is one line and exit status 1. A scheduler and GPU workers started as separate
processes by `dask scheduler` / `dask worker` (as a SLURM job starts them, examples/slurm_tune.sh) run `l2ir tune
--cluster SCHEDULER_FILE` to the local pool's run, also with a worker process SIGKILLed mid-run. The GPU test
runs `l2ir tune --cluster local`."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from l2ir.search.cluster import Cluster, ClusterEvaluator, compile_on_cluster, distribute, standin_makers
from l2ir.search.db import RecordsDB
from l2ir.search.loop import DONE, Search, TuneConfig
from l2ir.search.pool import Job
from l2ir.search.standin import StandinConfig, StandinEvaluator
from test_loop import SHAPES, trace

from l2ir.cli import main
from l2ir.seed import seed as rule_seed
from l2ir.text import parse_problem

PCLASS = parse_problem("gemm m=1 n=1 k=1 a=f16:row b=f16:col c=f16:row acc=f32")


@pytest.fixture(scope="module")
def cluster():
    with Cluster.local(fake_gpus=2) as c:
        yield c


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                      # a zombie child of this process is dead too
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


class Marking(StandinEvaluator):
    """A stand-in whose evaluation takes wall time (as a GPU's does) and leaves a file per evaluation started:
    `<dir>/<pid>.<n>` holding the problem, removed when it ends (so what is in flight, and where, can be seen)."""

    def __init__(self, config, where: str, sleep_s: float = 0.1):
        super().__init__(config)
        self.where, self.sleep_s, self.n = Path(where), sleep_s, 0

    def evaluate(self, kernel, problem, plan=None, artifact=None, time_kernel=True, skip_gates=()):
        self.n += 1
        mark = self.where / f"{os.getpid()}.{self.n}"
        mark.write_text(f"{kernel.content_hash()} {problem.shape}")
        (self.where / f"{os.getpid()}.{self.n}.log").write_text(mark.read_text())
        time.sleep(self.sleep_s)
        out = super().evaluate(kernel, problem, plan, artifact, time_kernel, skip_gates)
        mark.unlink()
        return out


class Killer(StandinEvaluator):
    """A stand-in that dies (SIGKILL of its own worker process) on the problem 664x664x664, as a kernel that takes
    its whole process down would."""

    def evaluate(self, kernel, problem, plan=None, artifact=None, time_kernel=True, skip_gates=()):
        if problem.shape == (664, 664, 664):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().evaluate(kernel, problem, plan, artifact, time_kernel, skip_gates)


def _search(db, ev, rt, cluster=None, **kw):
    kw.setdefault("shapes", SHAPES)
    kw.setdefault("budget_candidates", 12)
    s = Search(TuneConfig(mode="standin", **kw), db, ev, rt)
    if cluster is not None:
        distribute(s, cluster)
    s.run()
    return s


def test_tune_on_a_local_cluster_makes_the_local_pools_run(tmp_path, capsys):
    # The same command with the local pool and with --cluster local (2 worker processes, fake GPU resources).
    argv = ["tune", "--shape", "300x200x104", "--shape", "1024x1024x1024", "--standin", "--budget-candidates", "8",
            "--gpus", "2", "--seed", "2"]
    assert main(argv + ["--db", str(tmp_path / "pool.db")]) == 0
    assert main(argv + ["--db", str(tmp_path / "cluster.db"), "--cluster", "local"]) == 0
    err = capsys.readouterr().err
    counts = [int(n) for n in re.search(r"evaluations per Dask worker: gpu-0: (\d+), gpu-1: (\d+)$", err,
                                        re.MULTILINE).groups()]
    assert all(n > 0 for n in counts) and sum(counts) >= 16      # both workers evaluated; every candidate once
    _assert_same_run(RecordsDB(tmp_path / "pool.db"), RecordsDB(tmp_path / "cluster.db"))


def _assert_same_run(pool, dist):
    """Run 1 of `dist` (on a Dask cluster) is run 1 of `pool` (the local pool, same command and seed): the same
    edits, verdicts and winners, and the same measurements, each written once by the driver (a finalist is timed
    once per round, three rounds)."""
    assert trace(dist, 1) == trace(pool, 1)
    winners = lambda db: [e["detail"] for e in db.edits(1) if e["verdict"] == DONE]  # noqa: E731
    assert winners(dist) == winners(pool) and all('"winner": {' in w for w in winners(dist))
    rows = [(r.kernel, r.problem, r.scenario, r.purpose) for r in dist.measurements(run=1)]
    once = [r for r in rows if r[3] != "finalist"]
    assert len(once) == len(set(once)) and all(rows.count(r) == 3 for r in rows if r[3] == "finalist")
    assert sorted(rows) == sorted((r.kernel, r.problem, r.scenario, r.purpose) for r in pool.measurements(run=1))
    assert dist.run(1)["status"] == "done"


def test_a_worker_killed_mid_evaluation_costs_nothing(tmp_path, cluster):
    ref = _search(RecordsDB(tmp_path / "ref.db"), *(StandinEvaluator(StandinConfig(s, 4)) for s in
                                                     (("offline",), ("offline", "server"))),
                  seed=4, shapes=SHAPES[:2])
    marks = tmp_path / "marks"
    marks.mkdir()
    ev = ClusterEvaluator(cluster, lambda: Marking(StandinConfig(("offline",), 4), str(marks)))
    _, rt_make = standin_makers(4)
    rt = ClusterEvaluator(cluster, rt_make)
    before = set(cluster.worker_pids().values())
    killed = {}

    def kill_one_in_flight():
        # After a few evaluations, SIGKILL a worker while it is inside one (its mark file exists).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            logs = list(marks.glob("*.log"))
            # An evaluation that began under 40 ms ago has 60 ms of its sleep left: the kill lands inside it.
            flying = [p for p in marks.iterdir() if not p.name.endswith(".log") and _age(p) < 0.04]
            if len(logs) >= 6 and flying:
                try:
                    job = flying[0].read_text()
                except FileNotFoundError:
                    continue
                killed["pid"], killed["job"] = int(flying[0].name.split(".")[0]), job
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_one_in_flight, daemon=True)
    killer.start()
    s = _search(RecordsDB(tmp_path / "r.db"), ev, rt, cluster, seed=4, shapes=SHAPES[:2])
    killer.join()
    assert killed, "no evaluation was caught in flight"
    assert killed["pid"] in before and not _alive(killed["pid"])
    # The killed evaluation ran again on a live worker; the run is the uninterrupted one, nothing lost or doubled.
    runs = [p.read_text() for p in marks.glob("*.log")]
    assert runs.count(killed["job"]) >= 2
    assert trace(s.db, s.run_id) == trace(ref.db, ref.run_id)
    assert [x.done for x in s.states] == [x.done for x in ref.states]
    assert s.db.run(s.run_id)["status"] == "done"
    assert ev.crashes == 0
    # The nanny restarted the killed worker: the cluster has its two GPU workers again.
    cluster.wait_for_gpu_workers(2, timeout_s=30)


def test_a_candidate_that_kills_every_worker_it_runs_on_is_recorded_as_a_crash(cluster):
    k = rule_seed(PCLASS.with_shape(512, 512, 512), "sm80")
    shapes = [(512, 512, 512), (664, 664, 664), (1024, 512, 256), (256, 256, 256)]
    jobs = [Job(k, PCLASS.with_shape(*s)) for s in shapes]
    ev = ClusterEvaluator(cluster, lambda: Killer(StandinConfig(("offline",), 1)), log=lambda msg: None)
    t0 = time.monotonic()
    out = ev.evaluate_many(jobs)
    assert time.monotonic() - t0 < 45
    assert out[1][0].errors and out[1][0].errors[0].startswith("crash: the evaluation killed every Dask worker")
    assert ev.crashes == 1
    # Every other job got the stand-in's own answer, as one evaluator gives it.
    one = StandinEvaluator(StandinConfig(("offline",), 1))
    for i in (0, 2, 3):
        assert [m.to_json() for m in out[i]] == [m.to_json() for m in one.evaluate(jobs[i].kernel, jobs[i].problem)]
    cluster.wait_for_gpu_workers(2, timeout_s=30)


# One phase of a run whose driver holds a local Dask cluster of two stand-in workers: DRIVER DB (run | resume).
DRIVER = textwrap.dedent("""
    import sys
    from l2ir.search.cluster import Cluster, distribute, evaluators, standin_makers
    from l2ir.search.db import RecordsDB
    from l2ir.search.loop import Search, TuneConfig
    shapes = tuple(tuple(s) for s in {shapes!r})
    cluster = Cluster.local(fake_gpus=2)
    print("pids", *cluster.worker_pids().values(), flush=True)
    ev, rt = evaluators(cluster, *standin_makers(7))
    db = RecordsDB(sys.argv[1])
    progress = lambda st, e: print(st.candidates, flush=True)
    if sys.argv[2] == "resume":
        s = Search.resume(db, 1, ev, rt, progress=progress)
    else:
        s = Search(TuneConfig(shapes=shapes, mode="standin", budget_candidates=16, seed=7), db, ev, rt,
                   progress=progress)
    distribute(s, cluster).run()
    cluster.close()
""")


def test_a_driver_killed_with_sigkill_resumes_to_the_uninterrupted_run(tmp_path):
    shapes = SHAPES[:2]
    ref = _search(RecordsDB(tmp_path / "ref.db"), *(StandinEvaluator(StandinConfig(s, 7)) for s in
                                                     (("offline",), ("offline", "server"))),
                  shapes=shapes, budget_candidates=16, seed=7)
    code = DRIVER.format(shapes=shapes)
    path = tmp_path / "r.db"
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), "run"], stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in proc.stdout.readline().split()[1:]]
    try:
        assert len(workers) == 2
        for _ in range(10):
            proc.stdout.readline()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # The driver's workers go with it (they watch their parent), nothing left holding a GPU.
        end = time.monotonic() + 20
        while any(_alive(p) for p in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers)
    finally:
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    db = RecordsDB(path)
    assert 0 < len(db.edits(1)) < len(trace(ref.db, ref.run_id))
    assert db.run(1)["status"] == "running"
    subprocess.run([sys.executable, "-c", code, str(path), "resume"], check=True, capture_output=True, timeout=120)
    assert trace(db, 1) == trace(ref.db, ref.run_id)
    assert db.run(1)["status"] == "done"


# Loaded by each `dask worker` of the external cluster (--preload): the stand-in's evaluation takes wall time, as a
# GPU's does, and leaves a mark file per evaluation started, `<L2IR_TEST_MARKS>/<pid>.<n>`, removed when it ends
# (Marking's files, for the evaluator the CLI builds on the worker).
PRELOAD = textwrap.dedent("""
    import itertools, os, time
    from pathlib import Path
    from l2ir.search.standin import StandinEvaluator

    # Dask imports a preload file again into the same module: wrap the stand-in's own evaluate, once.
    _evaluate = StandinEvaluator.__dict__.get("unslowed", StandinEvaluator.evaluate)
    StandinEvaluator.unslowed, _n = _evaluate, itertools.count(1)

    def evaluate(self, kernel, problem, *args, **kw):
        where = Path(os.environ["L2IR_TEST_MARKS"])
        mark = where / f"{os.getpid()}.{next(_n)}"
        mark.write_text(f"{kernel.content_hash()} {problem.shape}")
        (where / (mark.name + ".log")).write_text(mark.read_text())
        time.sleep(0.1)
        out = _evaluate(self, kernel, problem, *args, **kw)
        mark.unlink()
        return out

    StandinEvaluator.evaluate = evaluate
""")


class DaskProcesses:
    """A scheduler and workers started as separate processes by Dask's command-line tools, as a batch script starts
    them (examples/slurm_tune.sh): `dask scheduler --scheduler-file F` and `dask worker --scheduler-file F
    --nthreads 1 --resources GPU=1` per GPU, each worker under its nanny. Each runs in a session of its own, which
    `stop` ends whole (nanny, worker and anything they started)."""

    def __init__(self, where: Path):
        self.where, self.procs = where, []
        self.scheduler_file = where / "scheduler.json"
        self.marks = where / "marks"
        self.marks.mkdir(parents=True)
        (where / "l2ir_slow_standin.py").write_text(PRELOAD)

    def start(self, *args: str, env: dict | None = None):
        with open(self.where / f"dask-{len(self.procs)}.log", "w") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "dask", *args, "--no-dashboard"],
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, **(env or {})}, cwd=self.where))

    def up(self, gpu_workers: int):
        self.start("scheduler", "--scheduler-file", str(self.scheduler_file), "--host", "127.0.0.1", "--port", "0")
        for i in range(gpu_workers):
            # DAEMON=False: the GPU evaluator starts a process of its own (search/cluster.py refuses daemonic GPU
            # workers in GPU mode); the stand-in does not need it, but this is the command a GPU node runs.
            self.start("worker", "--scheduler-file", str(self.scheduler_file), "--nthreads", "1", "--resources",
                       "GPU=1", "--name", f"gpu-{i}", "--host", "127.0.0.1", "--memory-limit", "0",
                       # its scratch space in this test's directory, not the node's shared /tmp/dask-scratch-space
                       "--local-directory", str(self.where / f"scratch-{i}"),
                       "--preload", str(self.where / "l2ir_slow_standin.py"),
                       env={"DASK_DISTRIBUTED__WORKER__DAEMON": "False", "CUDA_VISIBLE_DEVICES": "",
                            "L2IR_TEST_MARKS": str(self.marks)})
        end = time.monotonic() + 60
        while not self.scheduler_file.is_file():
            assert time.monotonic() < end and self.procs[0].poll() is None, self.logs()
            time.sleep(0.1)
        with Cluster.connect(str(self.scheduler_file)) as c:
            c.wait_for_gpu_workers(gpu_workers, timeout_s=60)
            return c.worker_pids()

    def logs(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.where.glob("dask-*.log")))

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            try:                      # a worker whose nanny died first is in the same session
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def dask_processes(tmp_path):
    procs = DaskProcesses(tmp_path / "dask")
    try:
        yield procs
    finally:
        procs.stop()


STANDIN_TUNE = ["tune", "--shape", "300x200x104", "--shape", "1024x1024x1024", "--standin", "--budget-candidates",
                "8", "--gpus", "2", "--seed", "2"]


def test_tune_on_dask_cli_processes_makes_the_local_pools_run_and_survives_a_killed_worker(tmp_path, capsys,
                                                                                           dask_processes):
    # The way a cluster runs it: `dask scheduler --scheduler-file F`, two `dask worker --resources GPU=1`, and
    # `l2ir tune ... --cluster F` (the stand-in search compiles nothing, so no CPU worker is needed).
    assert main(STANDIN_TUNE + ["--db", str(tmp_path / "pool.db")]) == 0
    pids = dask_processes.up(gpu_workers=2)
    assert sorted(pids) == ["gpu-0", "gpu-1"]
    cluster_file = str(dask_processes.scheduler_file)
    assert main(STANDIN_TUNE + ["--db", str(tmp_path / "cluster.db"), "--cluster", cluster_file]) == 0
    err = capsys.readouterr().err
    assert f"Dask cluster {cluster_file}: 2 GPU worker(s), 2 in all" in err
    counts = [int(n) for n in re.search(r"evaluations per Dask worker: gpu-0: (\d+), gpu-1: (\d+)$", err,
                                        re.MULTILINE).groups()]
    assert all(n > 0 for n in counts) and sum(counts) >= 16
    _assert_same_run(RecordsDB(tmp_path / "pool.db"), RecordsDB(tmp_path / "cluster.db"))

    # Again, with a worker process SIGKILLed inside an evaluation: its nanny starts it again, the scheduler runs the
    # evaluation again on a live worker, and the driver records the uninterrupted run.
    marks = dask_processes.marks
    for p in marks.iterdir():
        p.unlink()
    killed = {}

    def kill_one_in_flight():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = list(marks.glob("*.log"))
            # An evaluation that began under 40 ms ago has 60 ms of its sleep left: the kill lands inside it.
            flying = [p for p in marks.iterdir() if not p.name.endswith(".log") and _age(p) < 0.04]
            if len(logs) >= 6 and flying:
                try:
                    job = flying[0].read_text()
                except FileNotFoundError:
                    continue
                killed["pid"], killed["job"] = int(flying[0].name.split(".")[0]), job
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_one_in_flight, daemon=True)
    killer.start()
    assert main(STANDIN_TUNE + ["--db", str(tmp_path / "killed.db"), "--cluster", cluster_file]) == 0
    killer.join()
    assert killed, "no evaluation was caught in flight"
    assert killed["pid"] in pids.values() and not _alive(killed["pid"])
    assert [p.read_text() for p in marks.glob("*.log")].count(killed["job"]) >= 2
    assert "candidate(s) recorded as crashed" not in capsys.readouterr().err
    _assert_same_run(RecordsDB(tmp_path / "pool.db"), RecordsDB(tmp_path / "killed.db"))
    # The nanny restarted the killed worker under its name: the cluster has its two GPU workers again.
    with Cluster.connect(cluster_file) as c:
        c.wait_for_gpu_workers(2, timeout_s=30)
        again = c.worker_pids()
    assert sorted(again) == ["gpu-0", "gpu-1"] and killed["pid"] not in again.values()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bad_cluster_address_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    import dask

    argv = ["tune", "--shape", "512x512x512", "--standin", "--db", str(tmp_path / "r.db")]
    address = f"tcp://127.0.0.1:{_closed_port()}"
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        for bad, where in ((["--cluster", address], address), (["--cluster", "nowhere.json"], "nowhere.json")):
            assert main(argv + bad) == 1
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and err.startswith(f"error: --cluster {where}:"), err
        # Dask's own variable names the scheduler when --cluster is not given.
        monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", address)
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cannot reach a Dask scheduler" in err and address in err
    assert not (tmp_path / "r.db").exists()          # nothing started, nothing written


@pytest.mark.nvcc
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")
def test_compiles_run_on_workers_once_per_key_into_the_drivers_cache(tmp_path, cluster):
    from l2ir.backends.compile import CompileOptions
    from l2ir.backends.registry import lower
    from l2ir.search.sweeps import load_sweep

    kernels = list(load_sweep("cuda_ptx_sm80").values())[:2]
    plans = [lower(k, PCLASS, "cuda_ptx_sm80") for k in kernels]
    opts = CompileOptions(cache_dir=str(tmp_path / "cache"), device_sm="sm_80")
    assert not (tmp_path / "cache").exists()
    out = compile_on_cluster(cluster, [plans[0], plans[1], plans[0]], opts)
    assert all(a.ok for a in out), [getattr(a, "log", "")[-500:] for a in out]
    assert out[0].key == out[2].key != out[1].key
    # Each key built once (the duplicate is the same build: a node's own cache may hold it from an earlier run),
    # filed under the driver's empty cache with every stage.
    assert out[0].dir == out[2].dir and out[0].compile_seconds == out[2].compile_seconds
    for a in out:
        assert Path(a.binary).is_file() and str(a.binary).startswith(str(tmp_path / "cache"))
        assert {"kernel.cu", "kernel.l2", "compile.log", "resources.json", "result.json"} <= \
            {p.name for p in Path(a.dir).iterdir()}
        assert a.command.startswith(f"cd {a.dir} && ")         # the repro command runs in the driver's entry
    again = compile_on_cluster(cluster, plans, opts)
    assert all(a.cached for a in again) and [a.key for a in again] == [out[0].key, out[1].key]
    # The search's pipeline with its compile step on the cluster (a fresh driver cache): the kernels of one batch
    # are built on the workers and filed under the driver's cache; a repeated kernel is the pipeline's duplicate.
    from l2ir.search.cluster import ClusterPipeline
    from l2ir.search.pipeline import Candidate, Pipeline, PipelineConfig

    opts2 = CompileOptions(cache_dir=str(tmp_path / "cache2"), device_sm="sm_80")
    pipe = ClusterPipeline.adopt(Pipeline(PipelineConfig(compile=opts2, backend="cuda_ptx_sm80")), cluster)
    prepared = pipe.prepare([Candidate("a", kernels[0]), Candidate("b", kernels[1]), Candidate("c", kernels[0])],
                            PCLASS.with_shape(512, 512, 512))
    assert [p.status for p in prepared] == ["compiled", "compiled", "duplicate"]
    assert [p.artifact.key for p in prepared[:2]] == [out[0].key, out[1].key]
    assert all(Path(p.artifact.binary).is_file() and str(p.artifact.binary).startswith(str(tmp_path / "cache2"))
               for p in prepared[:2])


@pytest.mark.gpu
def test_a_search_on_a_local_cluster_of_the_gpus_survives_a_worker_killed_mid_evaluation(tmp_path):
    # bench/cluster_bench.py's run on every visible GPU (raw CUDA + PTX kernels: seconds to build), with a GPU
    # worker SIGKILLed in the middle of its 3rd evaluation: the nanny restarts it, Dask runs the candidate again.
    import importlib.util

    from test_evaluator_gpu import SKIP

    if SKIP:
        pytest.skip(SKIP)
    spec = importlib.util.spec_from_file_location("cluster_bench", Path(__file__).parents[1] / "bench" /
                                                  "cluster_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from l2ir.search.pool import parse_gpus

    args = bench.parse_args(["--shapes", "2", "--budget", "6", "--init-size", "3", "--batch", "3",
                             "--cache-dir", str(tmp_path / "cache"), "--budget-seconds", "400"])
    r = bench.run_once("gpu_test", len(parse_gpus("all")), args, tmp_path, kill_after=3)
    assert r["run_status"] == "done", r
    assert r["killed"] and r["killed"]["after_evaluations"] >= 3
    assert r["evaluated"] >= 6 and sum(r["per_worker"].values()) == r["evaluated"]
    assert all(w.startswith("gpu-") for w in r["per_worker"])
    assert not r["environment"].get("standin") and r["environment"].get("gpu")
    assert r["search_measurements"] == r["distinct_search_measurements"] > 0       # each candidate recorded once
    assert not r["crashes"] and not any("died" in e or "crash" in e for e in r["measurement_errors"]), r
    assert all(n >= 3 for n in r["candidates"].values()), r["candidates"]
    assert all(w is not None for w in r["winners"].values())                       # gated, timed, re-timed
