"""`l2ir tune --gpus all` on a machine with two or more GPUs: every device's worker evaluates candidates, and the
run's records are the GPU's (skipped cleanly with fewer than two GPUs)."""

import re
import subprocess
import sys

import pytest
from l2ir.search.db import RecordsDB
from test_evaluator_gpu import (
    SKIP,  # the evaluator's readiness check: torch on a GPU, cuda-python, nvcc
)


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch, no driver: no GPU
        return 0


WHY = SKIP or (None if _gpus() >= 2 else f"needs 2 or more GPUs ({_gpus()} visible)")


@pytest.mark.gpu
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_tune_on_every_gpu(tmp_path):
    db = tmp_path / "r.db"
    cmd = [sys.executable, "-m", "l2ir.cli", "tune", "--shape", "2048x2048x2048", "--gpus", "all", "--policy",
           "rules", "--budget-candidates", "10", "--init-size", "6", "--batch", "4", "--db", str(db)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "could not start" not in res.stderr
    found = re.search(r"evaluations per GPU: (.*)$", res.stderr, re.MULTILINE)
    assert found, res.stderr[-3000:]
    counts = {int(d): int(n) for d, n in (x.split(": ") for x in found.group(1).split(", "))}
    assert sorted(counts) == list(range(_gpus()))
    assert all(n > 0 for n in counts.values()), counts           # every device evaluated candidates
    rdb = RecordsDB(db)
    (run,) = rdb.runs()
    assert run["status"] == "done" and run["candidates"] >= 4
    search_rows = rdb.measurements(run=run["id"], purpose="search")
    assert search_rows and all(not rdb.record(r.id).environment.get("standin") for r in search_rows)
    winners = [e for e in rdb.edits(run["id"]) if e["verdict"] == "done"]
    assert len(winners) == 1


@pytest.mark.gpu
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_pool_evaluates_at_once_and_a_crash_restarts_only_its_worker(tmp_path):
    # Gates only (nothing timed), so with one GPU its two workers may share it.
    from l2ir.search.evaluator import EvalConfig, Evaluator
    from l2ir.search.pool import EvaluatorPool, Job
    from test_evaluator_gpu import PROBLEM, build, planted_kernel

    config = EvalConfig(scenarios=(), phase_timeout_s=60)
    pool = (EvaluatorPool.on_devices("all", config) if _gpus() >= 2 else
            EvaluatorPool([Evaluator(config), Evaluator(config)]))
    cache = str(tmp_path / "cache")
    good, bad = planted_kernel(), planted_kernel("CRASH")
    built = {id(k): build(k, cache) for k in (good, bad)}
    kernels = [good, bad, good, good, good, good]
    with pool:
        out = pool.evaluate_many([Job(k, PROBLEM, *built[id(k)], time_kernel=False) for k in kernels])
        assert [ms[0].passed for ms in out] == [k is good for k in kernels]
        assert any("illegal" in e.lower() or "died" in e for e in out[1][0].errors), out[1][0].errors
        assert sum(pool.jobs_per_worker) == len(kernels)
        crashed = pool.evaluated_by[1]
        # The other worker never restarted: a crash costs only the worker that ran it.
        assert all(w.starts == 1 for i, w in enumerate(pool.workers) if i != crashed)
        assert pool.size == len(pool.workers)
