"""The search loop's real path on a GPU: proposals lowered and compiled by nvcc, gated and timed by the evaluator
against torch.matmul, recorded in the DB under the GPU's environment, the winner re-timed in both scenarios, class
gates reused on a second shape, and a kill -9 in the middle of a run resumed."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from l2ir.search.db import RecordsDB, environment_id
from l2ir.search.loop import CLASS_GATES, DONE, Search, TuneConfig
from test_evaluator_gpu import _gpu_ready


SKIP = _gpu_ready()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

# Two shapes of one problem class; the second shares every kernel of the first (compile once, class gates once).
SHAPES = ((2048, 2048, 1024), (1024, 2048, 1024))


def evaluators():
    from l2ir.search.evaluator import EvalConfig, Evaluator
    from l2ir.search.timing import TimingConfig

    fast = TimingConfig(trials=5, target_ms=5.0)
    return (Evaluator(EvalConfig(scenarios=("offline",), timing=fast)),
            Evaluator(EvalConfig(scenarios=("offline", "server"), timing=fast)))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compile cache for the module: the second test reuses the first one's builds."""
    return str(tmp_path_factory.mktemp("cache"))


def test_the_loop_on_the_gpu(tmp_path, cache):
    db = RecordsDB(tmp_path / "r.db")
    cfg = TuneConfig(shapes=SHAPES, mode="gpu", budget_candidates=5, init_size=3, batch=2, seed=1, cache_dir=cache)
    ev, rt = evaluators()
    with ev, rt:
        s = Search(cfg, db, ev, rt)
        s.run()
    assert db.run(s.run_id)["status"] == "done"
    env = ev.environment
    assert env.get("gpu") and not env.get("standin")
    eid = environment_id(env)
    for st in s.states:
        w = st.done["winner"]
        assert w is not None, st.done
        retimed = db.measurements(problem=st.ptext, kernel=w["kernel"], run=s.run_id, purpose="finalist")
        assert {r.scenario for r in retimed} == {"offline", "server"}
        chosen = db.measurements(problem=st.ptext, run=s.run_id, purpose="retime")
        assert {r.scenario: r.kernel for r in chosen} == {"offline": w["kernel"],
                                                          "server": st.done["server_winner"]["kernel"]}
        assert all(r.passed and r.environment == eid for r in retimed)
        assert w["offline_speedup"] == pytest.approx(next(r.speedup for r in chosen if r.scenario == "offline"))
        assert db.ranking(st.ptext, eid)                                 # gate-clean timed candidates exist
        measured = [e for e in db.edits(s.run_id, st.ptext) if e["verdict"] == "measured"]
        assert measured and all(e["gpu_seconds"] > 0 for e in measured)
    # Kernels measured on the first shape kept their class gates for the second.
    first = {e["child"] for e in db.edits(s.run_id, s.states[0].ptext) if e["verdict"] == "measured"}
    cls = s.cls_text
    assert any(db.class_gates(h, cls, eid) is not None for h in first)
    gates = db.class_gates(next(h for h in first if db.class_gates(h, cls, eid)), cls, eid)
    assert {g["name"] for g in gates} == set(CLASS_GATES)
    # ... and the evaluator skipped them there: the second shape's record carries them as reused verdicts.
    second = [e["child"] for e in db.edits(s.run_id, s.states[1].ptext) if e["verdict"] == "measured"]
    shared = [h for h in second if h in first]
    assert shared
    rec = db.record(db.measurements(problem=s.states[1].ptext, kernel=shared[0], purpose="search")[0].id)
    assert all("reused" in v.detail for v in rec.verdicts if v.name in CLASS_GATES)


KILLED = textwrap.dedent("""
    import sys
    from l2ir.search.db import RecordsDB
    from l2ir.search.loop import Search, TuneConfig
    sys.path.insert(0, {tests!r})
    from test_loop_gpu import SHAPES, evaluators
    cfg = TuneConfig(shapes=SHAPES[:1], mode="gpu", budget_candidates=6, init_size=3, batch=2, seed=2,
                     cache_dir={cache!r})
    ev, rt = evaluators()
    Search(cfg, RecordsDB(sys.argv[1]), ev, rt, progress=lambda st, e: print(e, flush=True)).run()
""")


def test_kill_9_then_resume_on_the_gpu(tmp_path, cache):
    path = tmp_path / "r.db"
    code = KILLED.format(tests=os.path.dirname(__file__), cache=cache)
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    seen = 0
    for line in proc.stdout:
        seen += line.strip() in ("measured", "failed")
        if seen >= 3:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    db = RecordsDB(path)
    before = [e for e in db.edits(1)]
    assert 3 <= len([e for e in before if e["verdict"] in ("measured", "failed")]) < 6
    ev, rt = evaluators()
    with ev, rt:
        Search.resume(db, 1, ev, rt).run()
    # (the cache dir of the resumed run is the killed one's, from the config stored with the run)
    after = db.edits(1)
    assert after[:len(before)] == before                      # nothing recorded before the kill was redone
    assert sum(e["verdict"] in ("measured", "failed") for e in after) == 6
    assert after[-1]["verdict"] == DONE and db.run(1)["status"] == "done"
