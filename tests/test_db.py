"""The records DB: schema and migrations, the store interface, rankings that never mix environments, the JSONL
import, and durability under kill -9."""

import gzip
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from l2ir.search.db import (MIGRATIONS, SCHEMA_VERSION, DBError, RecordsDB, environment_id, open_db, split_problem,
                            spread_of)
from l2ir.search.evaluator import Measurement
from l2ir.search.gates import Verdict
from l2ir.search.records import JsonlStore

REPO = Path(__file__).resolve().parent.parent
ENV_A = {"gpu": "NVIDIA H200", "sms": 132, "driver": "580.1", "cuda_runtime": "13.0", "torch": "2.11",
         "cutlass": "4.2", "sm_clock_mhz": 1980, "host": "a"}
ENV_B = dict(ENV_A, driver="575.0")
P1 = "gemm m=4096 n=4096 k=4096 a=f16:row b=f16:col c=f16:row acc=f32"
P2 = "gemm m=2048 n=4096 k=4096 a=f16:row b=f16:col c=f16:row acc=f32"
P3 = "gemm m=64 n=64 k=64 a=f16:row b=f16:col c=f16:row acc=f32"
GATES = ["accuracy", "all_written", "ragged_shapes"]


def meas(kernel, problem, env, speedup, passed=True, scenario="offline", kus=None):
    kus = kus or [10.0, 10.2, 9.9, 10.1, 10.0]
    bus = [x * speedup for x in kus]
    from l2ir.search.timing import summarize

    ks, bs = summarize(kus), summarize(bus)
    return Measurement(kernel_hash=kernel, problem=problem, scenario=scenario, environment=dict(env),
                       verdicts=[Verdict(g, passed or g != "ragged_shapes", "") for g in GATES], kernel_us=kus,
                       baseline_us=bus, kernel_stats=ks, baseline_stats=bs, kernel_median_us=ks["median"],
                       baseline_median_us=bs["median"], speedup=bs["median"] / ks["median"])


def test_new_db_has_current_schema_and_wal(tmp_path):
    db = RecordsDB(tmp_path / "r.db")
    assert db.version == SCHEMA_VERSION == len(MIGRATIONS)
    assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in db.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"environments", "kernels", "measurements", "runs", "edits", "llm_calls", "class_gates",
            "policy_state"} <= tables


def test_migration_from_v1_keeps_data(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0] + "\nPRAGMA user_version = 1;")
    conn.execute("INSERT INTO runs (command, status) VALUES ('l2ir tune', 'done')")
    conn.commit()
    conn.close()
    db = RecordsDB(path)
    assert db.version == SCHEMA_VERSION
    assert db.run(1)["status"] == "done"
    db.add_class_gates("k" * 64, "a=f16:row", "env", [{"name": "ragged_shapes", "passed": True, "detail": ""}])
    assert db.class_gates("k" * 64, "a=f16:row", "env")[0]["name"] == "ragged_shapes"


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "new.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(DBError, match="newer"):
        RecordsDB(path)


def test_not_a_db_is_one_clear_error(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is no sqlite file at all" * 100)
    with pytest.raises(DBError, match="not a records DB"):
        RecordsDB(path)


def test_environment_id_ignores_current_clock_and_host_but_not_driver():
    assert environment_id(ENV_A) == environment_id(dict(ENV_A, sm_clock_mhz=1200, host="b"))
    assert environment_id(ENV_A) != environment_id(ENV_B)


def test_store_interface_add_lookup_iter(tmp_path):
    db = RecordsDB(tmp_path / "r.db")
    m = meas("a" * 64, P1, ENV_A, 1.1)
    rec = db.add(m, "cfg1", "seed")
    assert rec["config"] == "cfg1"
    got = db.lookup("a" * 64, P1, "offline")
    assert got["speedup"] == pytest.approx(m.speedup) and got["origin"] == "seed"
    assert db.lookup("a" * 64, P1, "server") is None
    assert db.lookup("a" * 64, P1, "offline", artifact_key="other") is None
    assert [r["kernel_hash"] for r in db] == ["a" * 64]
    back = db.record(db.measurements()[0].id)
    assert back.verdicts == m.verdicts and back.kernel_us == m.kernel_us


def test_ranking_never_mixes_environments(tmp_path):
    db = RecordsDB(tmp_path / "r.db")
    db.add_many([meas("a" * 64, P1, ENV_A, 1.05), meas("b" * 64, P1, ENV_B, 3.0),
                 meas("c" * 64, P1, ENV_A, 1.20), meas("d" * 64, P1, ENV_A, 9.0, passed=False)])
    ea, eb = environment_id(ENV_A), environment_id(ENV_B)
    ranked = db.ranking(P1, ea)
    assert [r.kernel[0] for r in ranked] == ["c", "a"]          # B's 3x and the failed 9x are not in A's ranking
    assert all(r.environment == ea for r in ranked)
    assert [r.kernel[0] for r in db.ranking(P1, eb)] == ["b"]
    with pytest.raises(ValueError, match="environment"):
        db.ranking(P1, "")


def test_nearest_winners_by_log_distance(tmp_path):
    db = RecordsDB(tmp_path / "r.db")
    db.add_many([meas("a" * 64, P2, ENV_A, 1.1), meas("b" * 64, P3, ENV_A, 1.3), meas("c" * 64, P1, ENV_B, 2.0)])
    ea = environment_id(ENV_A)
    assert db.nearest_winners(P1, ea, count=1) == ["a" * 64]     # 2048x4096x4096 is nearer than 64^3
    assert db.nearest_winners(P1, ea, count=2) == ["a" * 64, "b" * 64]
    assert db.nearest_winners(P1, environment_id(ENV_B)) == []   # B's only solved problem is P1 itself


def test_spread_is_half_iqr_over_median_of_both_sides():
    m = meas("a" * 64, P1, ENV_A, 1.0, kus=[10.0, 10.0, 11.0, 12.0, 12.0])
    rec = m.to_json()
    expect = 2 * ((12.0 - 10.0) / (2 * 11.0))
    assert spread_of(rec) == pytest.approx(expect)
    assert spread_of({"kernel_stats": {}, "baseline_stats": {}}) is None


def test_split_problem():
    assert split_problem(P1) == ((4096, 4096, 4096), "a=f16:row b=f16:col c=f16:row acc=f32")


def test_import_jsonl_skips_cut_lines_takes_ir_and_is_idempotent(tmp_path):
    recs = [meas("a" * 64, P1, ENV_A, 1.1).to_json() | {"config": "seed"},
            meas("b" * 64, P2, ENV_A, 0.9).to_json() | {"config": "x"}]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n{\"kernel_hash\": \"cut")
    (tmp_path / "run.json").write_text(json.dumps({"kernels": {"a" * 12: {"kernel": "kernel {\n}\n"}}}))
    db = RecordsDB(tmp_path / "r.db")
    assert db.import_jsonl(path) == 2
    assert db.import_jsonl(path) == 0
    assert len(db.measurements()) == 2
    assert db.kernel("a" * 64)["ir"] == "kernel {\n}\n"
    assert db.kernel("b" * 64)["ir"] is None
    assert {r.purpose for r in db.measurements()} == {"import"}
    # The bench's fresh re-timing of its winners is a retime; IR and backend come from the run's summary.
    (tmp_path / "run.json").write_text(json.dumps({"kernels": {"a" * 12: {"kernel": "kernel {\n}\n",
                                                                          "backend": "cuda_ptx"}}}))
    fresh = tmp_path / "run-fresh.jsonl"
    fresh.write_text(json.dumps(recs[0]) + "\n")
    db2 = RecordsDB(tmp_path / "r2.db")
    assert db2.import_jsonl(fresh) == 1
    assert [r.purpose for r in db2.measurements()] == ["retime"]
    assert db2.kernel("a" * 64)["ir"] == "kernel {\n}\n" and db2.kernel("a" * 64)["backend"] == "cuda_ptx"
    # A server race's later fresh trials (server_race --fresh-trials) take the same summary.
    (tmp_path / "run-t2-fresh.jsonl").write_text(json.dumps(recs[0]) + "\n")
    db3 = RecordsDB(tmp_path / "r3.db")
    assert db3.import_jsonl(tmp_path / "run-t2-fresh.jsonl") == 1
    assert [r.purpose for r in db3.measurements()] == ["retime"] and db3.kernel("a" * 64)["backend"] == "cuda_ptx"


def test_an_archived_run_imports_as_the_plain_file_and_reads_back_read_only(tmp_path):
    """bench/results keeps superseded raw runs as .jsonl.gz: the import takes the summary beside the plain name, a
    -fresh archive is a retime, the plain and the archived file are one source, and the store will not append."""
    recs = [meas("a" * 64, P1, ENV_A, 1.1).to_json(), meas("b" * 64, P2, ENV_A, 0.9).to_json()]
    text = "\n".join(json.dumps(r) for r in recs) + "\n"
    with gzip.open(tmp_path / "run.jsonl.gz", "wt") as fh:
        fh.write(text)
    with gzip.open(tmp_path / "run-fresh.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(recs[0]) + "\n")
    (tmp_path / "run.json").write_text(json.dumps({"kernels": {"a" * 12: {"kernel": "kernel {\n}\n"}}}))
    db = RecordsDB(tmp_path / "r.db")
    assert db.import_results_dir(tmp_path) == 3
    assert sorted(r.purpose for r in db.measurements()) == ["import", "import", "retime"]
    assert db.kernel("a" * 64)["ir"] == "kernel {\n}\n"
    (tmp_path / "run.jsonl").write_text(text)              # the same run, unarchived: nothing new
    assert db.import_jsonl(tmp_path / "run.jsonl") == 0
    store = JsonlStore(tmp_path / "run.jsonl.gz")
    assert len(store) == 2 and store.lookup("b" * 64, P2, "offline")["speedup"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="read-only"):
        store.add(meas("c" * 64, P3, ENV_A, 1.0))
    with pytest.raises(ValueError, match="read-only"):
        JsonlStore(tmp_path / "run.jsonl.gz", resume=False)
    assert (tmp_path / "run.jsonl.gz").exists()
    # A reader that builds PREFIX.jsonl finds the archive where only that exists, and may not append to it.
    (tmp_path / "run.jsonl").unlink()
    by_prefix = JsonlStore(tmp_path / "run.jsonl")
    assert by_prefix.path.name == "run.jsonl.gz" and len(by_prefix) == 2
    with pytest.raises(ValueError, match="read-only"):
        by_prefix.add(meas("c" * 64, P3, ENV_A, 1.0))
    assert not (tmp_path / "run.jsonl").exists()
    # `db import` given the plain name a recipe wrote down before the run was archived imports the archive.
    db4 = RecordsDB(tmp_path / "r4.db")
    assert db4.import_jsonl(tmp_path / "run.jsonl") == 2 and db4.kernel("a" * 64)["ir"] == "kernel {\n}\n"
    # Not gzip at all, a deflate stream with an invalid block type (zlib.error), bytes that are not text: each
    # one line naming the file.
    good = gzip.compress(text.encode())
    for name, data in (("bad.jsonl.gz", b"not gzip"), ("cut.jsonl.gz", good[:10] + b"\xff" + good[11:]),
                       ("bin.jsonl.gz", gzip.compress(b"\xff\xfe\x00 not utf-8"))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DBError, match=rf"{name}: cannot read"):
            db.import_jsonl(tmp_path / name)


def test_import_of_the_committed_bench_results(tmp_path):
    results = REPO / "bench/results"
    texts = [p.read_text() for p in results.glob("*.jsonl")]
    texts += [gzip.decompress(p.read_bytes()).decode() for p in results.glob("*.jsonl.gz")]
    lines = sum(len([ln for ln in t.splitlines() if ln.strip()]) for t in texts)
    db = open_db(tmp_path / "r.db", REPO / "bench/results")
    assert len(db.measurements()) == lines > 0
    envs = db.environments()
    assert all(e[1]["gpu"] == "NVIDIA H200" for e in envs)
    # Every imported ranking of a shape is one environment's, fastest first.
    row = db.measurements()[0]
    ranked = db.ranking(row.problem, row.environment)
    assert [r.speedup for r in ranked] == sorted((r.speedup for r in ranked), reverse=True)


@pytest.mark.parametrize("bad,where", [("not json", 2), ('{"a": 1}', 2), ("[1, 2]", 2)])
def test_import_of_a_line_that_is_no_record_is_a_db_error_and_imports_nothing(tmp_path, bad, where):
    """Only the last line may be cut short (a kill mid-write); a bad line before it names file and line, and the
    file's good lines are not imported either."""
    good = json.dumps(meas("a" * 64, P1, ENV_A, 1.1).to_json())
    path = tmp_path / "run.jsonl"
    path.write_text(f"{good}\n{bad}\n{good}\n")
    db = RecordsDB(tmp_path / "r.db")
    with pytest.raises(DBError, match=rf"run.jsonl:{where}: not a measurement record"):
        db.import_jsonl(path)
    assert db.measurements() == []
    path.write_text(f"{good}\n\n{bad}\n")                 # blank lines pass; a bad last line was cut
    assert db.import_jsonl(path) == 1


def test_import_of_a_missing_file_is_a_db_error(tmp_path):
    with pytest.raises(DBError, match="cannot read"):
        RecordsDB(tmp_path / "r.db").import_jsonl(tmp_path / "none.jsonl")


def test_transaction_rolls_back_everything_of_a_candidate(tmp_path):
    db = RecordsDB(tmp_path / "r.db")
    with pytest.raises(RuntimeError):
        with db.transaction():
            db.add_kernel("a" * 64, ir="kernel {}")
            db.add_many([meas("a" * 64, P1, ENV_A, 1.1)], run=None)
            raise RuntimeError("killed mid-write")
    assert db.measurements() == [] and db.kernel("a" * 64) is None


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_db import meas, ENV_A, P1
    from l2ir.search.db import RecordsDB
    db = RecordsDB(sys.argv[1])
    run = db.start_run("writer", {{}}, 0, "random", {{}})
    i = 0
    print("ready", flush=True)
    while True:
        h = f"{{i:064x}}"
        with db.transaction():
            db.add_kernel(h, ir="kernel {{}}")
            db.add_many([meas(h, P1, ENV_A, 1.0 + i % 7 / 10), meas(h, P1, ENV_A, 1.0, scenario="server")], run=run)
            db.add_edit(run, P1, i, None, h, "random", "set x = 1", "measured", reward=0.1)
        i += 1
""")


def test_kill_9_loses_at_most_the_candidate_in_flight(tmp_path):
    path = tmp_path / "r.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=str(Path(__file__).parent)), str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    db = RecordsDB(path)
    assert db.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    edits = db.edits(1)
    assert len(edits) > 3                      # the writer got somewhere before the kill
    # Every committed candidate is whole: its edit, its kernel and both measurements; nothing else exists.
    children = [e["child"] for e in edits]
    assert children == [f"{i:064x}" for i in range(len(children))]
    rows = db.measurements(run=1)
    assert len(rows) == 2 * len(children)
    assert {r.kernel for r in rows} == set(children)
    assert all(db.kernel(c)["ir"] == "kernel {}" for c in children[-3:])
