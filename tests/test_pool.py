"""The evaluator pool (search/pool.py) on the CPU, with stand-in evaluators (search/standin.py) as its workers: the
search makes the same run on N workers as on one, evaluations overlap, a failing worker fails only its candidate,
and a killed run resumes exactly."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from l2ir.policy.base import Proposal, StatelessPolicy
from l2ir.search.db import RecordsDB
from l2ir.search.loop import DONE, Search, TuneConfig
from l2ir.search.pool import EvaluatorPool, Job, parse_gpus
from l2ir.search.standin import StandinConfig, StandinEvaluator
from l2ir.search.sweeps import load_sweep
from test_loop import RUNNER, SHAPES, killed_run, trace

from l2ir.cli import main
from l2ir.seed import seed as rule_seed
from l2ir.text import parse_problem


def pool_of(n, seed=0, cls=StandinEvaluator, **kw):
    return EvaluatorPool([cls(StandinConfig(("offline",), seed), **kw) for _ in range(n)])


def retimer(seed=0):
    return StandinEvaluator(StandinConfig(("offline", "server"), seed))


def search(db, ev, **kw):
    kw.setdefault("shapes", SHAPES)
    kw.setdefault("budget_candidates", 12)
    cfg = TuneConfig(mode="standin", **kw)
    s = Search(cfg, db, ev, retimer(cfg.seed))
    s.run()
    return s


def measurements(db, run):
    return [(r.kernel, r.problem, r.scenario, r.purpose, r.speedup) for r in db.measurements(run=run)]


@pytest.mark.parametrize("interleave,budget_gpu_s", [(False, None), (True, None), (False, 6.0), (True, 6.0)])
def test_a_pool_makes_the_same_run_as_one_evaluator(tmp_path, interleave, budget_gpu_s):
    # With a GPU-seconds budget, a step's batch is evaluated at once but recorded only up to where the budget
    # (the sum of the workers' GPU seconds) stops one evaluator.
    kw = dict(seed=3, interleave=interleave, budget_candidates=30 if budget_gpu_s else 12)
    if budget_gpu_s:
        kw["budget_gpu_s"] = budget_gpu_s
    one = search(RecordsDB(tmp_path / "one.db"), StandinEvaluator(StandinConfig(("offline",), 3)), **kw)
    pool = pool_of(3, seed=3, cls=Sleepy, sleep_s=0.01)     # jobs take time, so every worker gets some
    batches = []
    real = pool.evaluate_many
    pool.evaluate_many = lambda jobs: batches.append(len(jobs)) or real(jobs)
    many = search(RecordsDB(tmp_path / "many.db"), pool, **kw)
    assert max(batches) >= 3             # whole steps (rounds) evaluated at once, not one candidate at a time
    if budget_gpu_s:
        assert any(st.done["stopped_by"] == "GPU-seconds budget" for st in one.states)
    assert trace(many.db, many.run_id) == trace(one.db, one.run_id)
    assert measurements(many.db, many.run_id) == measurements(one.db, one.run_id)
    assert [s.done for s in many.states] == [s.done for s in one.states]
    assert [s.gpu_s for s in many.states] == pytest.approx([s.gpu_s for s in one.states])
    # The pool really spread the candidates: every worker evaluated some.
    assert all(n > 0 for n in pool.jobs_per_worker), pool.jobs_per_worker
    assert sum(pool.jobs_per_worker) >= sum(s.candidates for s in many.states) * 0.5


class SameForAll(StatelessPolicy):
    """Proposes the same whole kernels to every shape at a step (from the sm80 sweep): a round evaluates each of
    them on every shape, and all shapes after the first reuse its class gates."""

    name = "same-for-all"

    def propose(self, context):
        kernels = list(load_sweep("sm80").values())
        return [Proposal(kernel=kernels[(2 * context.seed + j) % len(kernels)]) for j in range(3)]


def full_records(db, run):
    return [db.record(r.id).to_json() for r in db.measurements(run=run)]


def test_a_round_evaluating_one_kernel_on_several_shapes_reuses_its_class_gates_as_one_gpu(tmp_path):
    kw = dict(shapes=SHAPES, mode="standin", budget_candidates=10, init_size=2, sweeps=False, interleave=True)
    runs = []
    for name, ev in (("one", StandinEvaluator(StandinConfig(("offline",)))),
                     ("many", pool_of(2, cls=Sleepy, sleep_s=0.01))):
        db = RecordsDB(tmp_path / f"{name}.db")
        s = Search(TuneConfig(**kw), db, ev, retimer(), policy=SameForAll())
        s.run()
        runs.append(s)
    one, many = runs
    assert trace(many.db, many.run_id) == trace(one.db, one.run_id)
    assert full_records(many.db, many.run_id) == full_records(one.db, one.run_id)
    reused = [v for rec in full_records(many.db, many.run_id) for v in rec["verdicts"]
              if v["detail"].startswith("reused")]
    assert reused                        # the case this test is about happened


class Sleepy(StandinEvaluator):
    """A stand-in whose evaluation takes wall time (as a GPU's does), noting when each call ran."""

    def __init__(self, config=None, sleep_s=0.15, log=None):
        super().__init__(config or StandinConfig())
        self.sleep_s, self.log = sleep_s, log if log is not None else []

    def evaluate(self, kernel, problem, plan=None, artifact=None, time_kernel=True, skip_gates=()):
        t0 = time.perf_counter()
        time.sleep(self.sleep_s)
        out = super().evaluate(kernel, problem, plan, artifact, time_kernel, skip_gates)
        self.log.append((t0, time.perf_counter(), threading.get_ident()))
        return out


def jobs(n):
    pc = parse_problem("gemm m=1 n=1 k=1 a=f16:row b=f16:col c=f16:row acc=f32")
    kernels = [rule_seed(pc.with_shape(512, 512, 512), a) for a in ("sm90a", "sm80")]
    return [Job(kernels[i % 2], pc.with_shape(256 * (1 + i), 512, 512)) for i in range(n)]


def test_two_workers_overlap_their_evaluations():
    work = jobs(8)
    log1, log2 = [], []
    one = EvaluatorPool([Sleepy(StandinConfig(), log=log1)])
    two = EvaluatorPool([Sleepy(StandinConfig(), log=log2), Sleepy(StandinConfig(), log=log2)])
    t0 = time.perf_counter()
    r1 = one.evaluate_many(work)
    t1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    r2 = two.evaluate_many(work)
    t2 = time.perf_counter() - t0
    assert t2 < 0.8 * t1, (t1, t2)
    # Same answers, in job order, whichever worker ran each job.
    assert [[m.to_json() for m in ms] for ms in r2] == [[m.to_json() for m in ms] for ms in r1]
    assert [ms[0].problem for ms in r2] == [ms[0].problem for ms in r1]
    assert sorted(set(two.evaluated_by)) == [0, 1]
    # Some two calls ran at the same time, on different threads.
    assert any(a[0] < b[1] and b[0] < a[1] and a[2] != b[2] for a in log2 for b in log2 if a is not b)
    # GPU seconds are each job's own, summed over workers (not the wall time of the batch).
    assert two.last_cost_s == pytest.approx(sum(two.last_costs_s))
    assert two.last_costs_s == pytest.approx(one.last_costs_s)


class Raising(StandinEvaluator):
    """A stand-in that raises on some kernels (by their hash, so whichever worker gets them)."""

    def evaluate(self, kernel, problem, plan=None, artifact=None, time_kernel=True, skip_gates=()):
        if int(kernel.content_hash()[-4:], 16) % 3 == 0:
            raise RuntimeError("worker exploded\nsecond line")
        return super().evaluate(kernel, problem, plan, artifact, time_kernel, skip_gates)


def test_a_worker_that_raises_fails_only_its_candidate(tmp_path):
    s = search(RecordsDB(tmp_path / "r.db"), pool_of(2, cls=Raising), shapes=SHAPES[:2], budget_candidates=10)
    edits = [e for e in s.db.edits(s.run_id) if e["verdict"] != DONE]
    blown = [e for e in edits if "worker exploded" in (e["detail"] or "")]
    assert blown and all(e["verdict"] == "failed" and e["reward"] == -1.0 for e in blown)
    assert all("the evaluator failed: [RuntimeError] worker exploded" in e["detail"] for e in blown)
    assert all("second line" not in e["detail"] for e in blown)
    # The run went on: every shape got its budget and a winner among the kernels that did not raise.
    assert s.db.run(s.run_id)["status"] == "done"
    assert all(st.candidates == 10 and st.done["winner"] is not None for st in s.states)


class NeverStarts(StandinEvaluator):
    """A worker whose device cannot start (the Evaluator's start check fails every time)."""

    starts = 0

    def _ensure_worker(self):
        return "CUDA error: no device"

    def evaluate(self, *a, **k):
        raise AssertionError("a worker that never started was given a job")


def test_a_device_that_cannot_start_is_left_out_and_said_once():
    said = []
    pool = EvaluatorPool([NeverStarts(StandinConfig()), StandinEvaluator(StandinConfig())], log=said.append)
    out = pool.evaluate_many(jobs(4))
    out += pool.evaluate_many(jobs(3))
    assert all(ms and ms[0].passed or ms[0].verdicts for ms in out)
    assert not any(m.errors for ms in out for m in ms)
    assert pool.jobs_per_worker == [0, 7] and pool.size == 1
    assert len(said) == 1 and "could not start" in said[0] and "no device" in said[0]
    # No worker at all: every job carries why, nothing raises.
    dead = EvaluatorPool([NeverStarts(StandinConfig())], log=said.append)
    (ms,) = dead.evaluate_many(jobs(1))
    assert ms[0].errors and "no evaluator could start" in ms[0].errors[0] and "no device" in ms[0].errors[0]


def killed(db, cfg, method, n, workers=2):
    """A pooled run of `cfg` killed at the n-th call of `db.<method>` (inside a candidate's transaction)."""
    return killed_run(db, cfg, method, n, (pool_of(workers, cfg.seed), retimer(cfg.seed)))


@pytest.mark.parametrize("interleave", [False, True])
def test_a_pooled_run_killed_mid_batch_resumes_to_the_uninterrupted_run(tmp_path, interleave):
    ref = search(RecordsDB(tmp_path / "ref.db"), StandinEvaluator(StandinConfig(("offline",), 5)), seed=5,
                 interleave=interleave)
    db = RecordsDB(tmp_path / "r.db")
    cfg = TuneConfig(shapes=SHAPES, mode="standin", budget_candidates=12, seed=5, interleave=interleave)
    s = killed(db, cfg, "add_edit", 19)
    assert len(db.edits(s.run_id)) == 18
    resumed = Search.resume(db, s.run_id, pool_of(2, 5), retimer(5))
    resumed.run()
    key = sorted if interleave else list      # rounds interleave shapes; each shape's own order must match
    assert key(trace(db, s.run_id)) == key(trace(ref.db, ref.run_id))
    assert [x.done for x in resumed.states] == [x.done for x in ref.states]
    assert db.run(s.run_id)["status"] == "done"


def test_a_pooled_run_resumes_after_a_real_kill_9(tmp_path):
    code = RUNNER.format(shapes=SHAPES[:2])
    # The reference on one evaluator; the killed run and its resume on a pool of 2 (then 3) workers.
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "ref.db"), "run", "1"], check=True,
                   capture_output=True)
    path = tmp_path / "r.db"
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), "run", "2"], stdout=subprocess.PIPE, text=True)
    for _ in range(25):
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    db, ref = RecordsDB(path), RecordsDB(tmp_path / "ref.db")
    assert 0 < len(db.edits(1)) < len(trace(ref, 1))
    assert db.run(1)["status"] == "running"
    subprocess.run([sys.executable, "-c", code, str(path), "resume", "3"], check=True, capture_output=True)
    assert trace(db, 1) == trace(ref, 1)
    assert db.run(1)["status"] == "done"


def test_gpus_option(tmp_path, capsys):
    assert parse_gpus("all", visible=2) == [0, 1]
    assert parse_gpus("2", visible=4) == [0, 1]
    assert parse_gpus("1,3", visible=4) == [1, 3]
    for bad, why in (("3", "only 2"), ("0,5", "0..1"), ("0,0", "distinct"), ("x", "expected N"), ("0", "expected N")):
        with pytest.raises(ValueError, match=why):
            parse_gpus(bad, visible=2)
    db = tmp_path / "r.db"
    argv = ["tune", "--shape", "300x200x100", "--standin", "--budget-candidates", "6", "--db", str(db), "--seed", "2"]
    assert main(argv + ["--gpus", "2"]) == 0
    err = capsys.readouterr().err
    counts = [int(n) for n in re.search(r"evaluations per stand-in worker: 0: (\d+), 1: (\d+)$", err, re.MULTILINE).groups()]
    assert sum(counts) == 6           # each of the shape's 6 candidates evaluated once, on one of the two workers
    assert main(argv + ["--gpus", "two"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --gpus 'two'")


class LateEnv(Sleepy):
    """Knows its GPU only once it has run a job (as search/evaluator.Evaluator, whose worker reports it)."""

    def __init__(self, config=None, sleep_s=0.01):
        super().__init__(config, sleep_s)
        self.known, self.environment = self.environment, {}

    def evaluate(self, kernel, problem, plan=None, artifact=None, time_kernel=True, skip_gates=()):
        self.environment = self.known
        return super().evaluate(kernel, problem, plan, artifact, time_kernel, skip_gates)


def test_a_second_run_reuses_kept_class_gates_on_a_pool_as_on_one_gpu(tmp_path):
    # Run 2 on the same DB finds run 1's class gates, once a worker has said which GPU it is on.
    got = []
    for name, make in (("one", lambda: LateEnv(StandinConfig(("offline",)))),
                       ("many", lambda: EvaluatorPool([LateEnv(StandinConfig(("offline",))) for _ in range(3)]))):
        db = RecordsDB(tmp_path / f"{name}.db")
        for seed in (1, 2):
            s = Search(TuneConfig(shapes=SHAPES, mode="standin", budget_candidates=8, seed=seed), db, make(),
                       retimer(seed))
            s.run()
        got.append((trace(db, s.run_id), full_records(db, s.run_id)))
    assert got[1] == got[0]
    assert any(v["detail"].startswith("reused") for rec in got[1][1] for v in rec["verdicts"])


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(_cuda(), reason="a GPU is visible: its evaluator would start")
def test_real_evaluators_that_cannot_start_say_so_once_each_and_fail_the_jobs():
    from l2ir.search.evaluator import EvalConfig

    said = []
    with EvaluatorPool.on_devices([0, 1], EvalConfig(scenarios=("offline",), startup_timeout_s=120),
                                  log=said.append) as pool:
        out = pool.evaluate_many(jobs(3))
        out += pool.evaluate_many(jobs(1))
    assert [len(ms) for ms in out] == [1] * 4 and [ms[0].scenario for ms in out] == ["offline"] * 4
    assert all("no evaluator could start" in ms[0].errors[0] for ms in out)
    assert sorted(s.split(" could not")[0] for s in said) == ["l2ir: GPU 0", "l2ir: GPU 1"]
    assert pool.size == 0 and pool.jobs_per_worker == [0, 0]


def test_a_pooled_retimer_times_a_round_of_finalists_at_once_and_resumes_after_a_kill(tmp_path):
    cfg = TuneConfig(shapes=SHAPES[:2], mode="standin", budget_candidates=8, init_size=4, seed=3)
    ref = Search(cfg, RecordsDB(tmp_path / "ref.db"), StandinEvaluator(StandinConfig(("offline",), 3)), retimer(3))
    ref.run()

    def pooled_retimer(batches):
        pool = EvaluatorPool([StandinEvaluator(StandinConfig(("offline", "server"), 3)) for _ in range(3)])
        real = pool.evaluate_many
        pool.evaluate_many = lambda jobs: batches.append(len(jobs)) or real(jobs)
        return pool

    batches: list[int] = []
    db = RecordsDB(tmp_path / "r.db")
    # Killed writing the first shape's second round (the 5th finalist record): its first round stays.
    search_rows = len([e for e in ref.db.edits(ref.run_id, ref.states[0].ptext) if e["verdict"] in ("measured",
                                                                                                     "failed")])
    s = killed_run(db, cfg, "add_many", search_rows + 5, (pool_of(2, 3), pooled_retimer(batches)))
    assert batches == [3, 3]                        # each round's three finalists as one batch
    assert len(db.measurements(run=s.run_id, purpose="finalist")) == 3 * 2
    batches.clear()
    resumed = Search.resume(db, s.run_id, pool_of(2, 3), pooled_retimer(batches))
    resumed.run()
    assert batches == [3] * 5                       # the first shape's rounds 1-2, the second's 0-2
    assert trace(db, s.run_id) == trace(ref.db, ref.run_id)
    assert [x.done for x in resumed.states] == [x.done for x in ref.states]
    ours = [(r.kernel, r.scenario, r.purpose, r.speedup) for r in db.measurements(run=s.run_id)]
    theirs = [(r.kernel, r.scenario, r.purpose, r.speedup) for r in ref.db.measurements(run=ref.run_id)]
    assert sorted(ours, key=str) == sorted(theirs, key=str)
