"""`l2ir tune`, `runs`, `best`, `report`, `db import` from the command line (stand-in evaluator: no GPU here)."""

import argparse
import json

import pytest

from l2ir.cli import main
from l2ir.search import tune as tune_mod
from l2ir.search.db import RecordsDB
from l2ir.search.report import REGIMES
from l2ir.text import parse_kernel_file


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def tuned(tmp_path, capsys):
    db = tmp_path / "r.db"
    code, out, err = run(["tune", "--shape", "300x200x100", "--shape", "2048x2048x1024", "--standin",
                          "--budget-candidates", "6", "--db", str(db), "--seed", "2"], capsys)
    assert code == 0, err
    return db, out, err


def test_tune_standin_is_labelled_and_recorded(tuned):
    db, out, err = tuned
    assert "NOT measured" in out and "NOT measured" in err
    rdb = RecordsDB(db)
    (r,) = rdb.runs()
    assert r["config"]["mode"] == "standin" and r["status"] == "done" and r["candidates"] == 12
    assert r["command"].startswith("l2ir ")


def test_runs_lists_the_run(tuned, capsys):
    db, _, _ = tuned
    code, out, _ = run(["runs", "--db", str(db)], capsys)
    assert code == 0 and "standin" in out and "done" in out


def test_best_prints_the_ir_and_the_retimed_numbers(tuned, capsys):
    db, _, _ = tuned
    code, out, _ = run(["best", "--shape", "300x200x100", "--db", str(db)], capsys)
    assert code == 0
    assert "NOT measured" in out and "re-timed winner" in out and "server:" in out
    assert "95.0% lower bound" in out and "paired rounds" in out    # the stand-in's samples are paired too
    ir = "".join(line + "\n" for line in out.splitlines() if not line.startswith("#"))
    _, kernel, _ = parse_kernel_file(ir, "best")
    rdb = RecordsDB(db)
    summary = [json.loads(e["detail"]) for e in rdb.edits(1) if e["verdict"] == "done"][0]
    assert kernel.content_hash() == summary["winner"]["kernel"]
    assert f"{summary['winner']['offline_speedup']:.3f}x" in out


def test_best_of_an_unknown_shape_is_one_line(tuned, capsys):
    db, _, _ = tuned
    code, _, err = run(["best", "--shape", "7x7x7", "--db", str(db)], capsys)
    assert code == 1 and err.startswith("error: no gate-clean measurement") and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--budget-candidates", "--batch", "--init-size", "--finalists", "--sample"])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_tune_counts_below_one_are_usage_errors(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--shape", "64x64x64", "--standin", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: " in err.splitlines()[-1]


@pytest.mark.parametrize("argv", [["runs"], ["best", "--shape", "64x64x64"], ["report", "--out", "rep"]],
                         ids=["runs", "best", "report"])
def test_reading_commands_never_make_a_db(tmp_path, capsys, argv, monkeypatch):
    """runs, best and report only read: a missing DB or a file that is not one is a one-line error, and no DB (nor
    an import of bench/results into one) is made."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run([*argv, "--db", "none.db"], capsys)
    assert code == 1 and err == "error: none.db: no such file\n"
    (tmp_path / "text.db").write_text("not sqlite\n")
    code, _, err = run([*argv, "--db", "text.db"], capsys)
    assert code == 1 and err.startswith("error: text.db: not a records DB") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.db"]


def test_report_writes_markdown_and_plots(tuned, tmp_path, capsys):
    db, _, _ = tuned
    out_dir = tmp_path / "rep"
    code, out, _ = run(["report", "--db", str(db), "--out", str(out_dir)], capsys)
    assert code == 0
    md = (out_dir / "report.md").read_text()
    assert "NOT measured" in md
    for _, _, name in REGIMES:
        assert f"| {name} |" in md
    assert "| 300 | 200 | 100 |" in md
    pytest.importorskip("matplotlib")
    pngs = sorted(p.name.split("_")[0] for p in out_dir.glob("*.png"))
    assert {"heatmap", "regimes", "curves"} <= set(pngs)


def test_resume_of_a_finished_run_adds_nothing(tuned, capsys):
    db, _, _ = tuned
    before = len(RecordsDB(db).edits(1))
    code, _, err = run(["tune", "--resume", "1", "--db", str(db), "--standin"], capsys)
    assert code == 0, err
    assert len(RecordsDB(db).edits(1)) == before


def test_bad_input_is_one_line_with_exit_1(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("# shapes\n128x128x128\n12x12\n")
    for argv, expect in ((["tune", "--standin", "--db", db], "no shapes"),
                         (["tune", "--standin", "--shapes-file", str(shapes), "--db", db],
                          f"{shapes}:3: expected MxNxK"),
                         (["tune", "--standin", "--shapes-file", str(tmp_path / "none"), "--db", db], "cannot read"),
                         (["tune", "--standin", "--resume", "99", "--db", db], "no run 99"),
                         (["tune", "--standin", "--shape", "64x64x64", "--policy", "nosuch", "--db", db],
                          "unknown policy")):
        code, _, err = run(argv, capsys)
        assert code == 1 and expect in err and err.count("\n") == 1, (argv, err)


def test_a_stored_policy_state_this_version_cannot_load_is_one_line(tmp_path, capsys):
    """A learned-policy state in the DB that this version cannot place (here: none of its input features exists)
    stops `l2ir tune --policy learned` with one line naming the DB and the state, before a run is recorded; so does
    one whose weights do not fit the network, or a garbled blob."""
    pytest.importorskip("torch")
    from l2ir.policy.learned import Learned

    db_path = tmp_path / "r.db"
    state = Learned().state_dict()
    other_shape = dict(state, weights=dict(state["weights"], **{"net.0.weight": state["weights"]["net.2.weight"]}))
    for blob in (b"J" + json.dumps(dict(state, features=[f"x.{f}" for f in state["features"]])).encode(),
                 b"J" + json.dumps(other_shape).encode(), b"J[1, 2]", b"J{not json"):
        db = RecordsDB(str(db_path))
        db.save_policy_state("policy:learned", blob)
        db.close()
        code, _, err = run(["tune", "--standin", "--shape", "256x256x512", "--policy", "learned",
                            "--budget-candidates", "2", "--db", str(db_path)], capsys)
        assert code == 1 and err.startswith(f"error: {db_path}: the stored policy state 'policy:learned'"), err
        assert err.count("\n") == 1
        db = RecordsDB(str(db_path))
        assert not db.runs()
        db.close()


def test_without_a_gpu_tune_says_so_and_takes_the_compile_only_path(monkeypatch):
    import l2ir.search.preflight as pf

    monkeypatch.setattr(pf, "missing", lambda gpu=True, toolchain=True, nvcc="nvcc":
                        (["no CUDA GPU on this machine"] if gpu else []))
    args = argparse.Namespace(standin=False, compile_only=False)
    mode, note = tune_mod._mode(args)
    assert mode == "compile_only" and "no CUDA GPU" in note and "--compile-only" in note and "\n" not in note
    assert "4 candidates per shape" in note.format(n=tune_mod.FALLBACK_CANDIDATES)
    # Without nvcc either, nothing can be built: one line, and the search runs on the labelled cost model.
    monkeypatch.setattr(pf, "missing", lambda gpu=True, toolchain=True, nvcc="nvcc":
                        (["no CUDA GPU"] if gpu else []) + (["no 'nvcc' on PATH"] if toolchain else []))
    mode, note = tune_mod._mode(args)
    assert mode == "standin" and "no 'nvcc'" in note and "NOT measured" in note and "\n" not in note
    # A GPU without nvcc cannot tune, and asking for --compile-only without nvcc is refused: one line each.
    monkeypatch.setattr(pf, "missing", lambda gpu=True, toolchain=True, nvcc="nvcc":
                        (["no 'nvcc' on PATH"] if toolchain else []))
    with pytest.raises(tune_mod.TuneError, match="--standin"):
        tune_mod._mode(args)
    with pytest.raises(tune_mod.TuneError, match="--compile-only cannot run here"):
        tune_mod._mode(argparse.Namespace(standin=False, compile_only=True))


def test_grid_sample_takes_an_equal_share_of_each_regime():
    shapes = tune_mod.regime_sample(48)
    assert len(shapes) == len(set(shapes)) == 48
    for lo, hi, _ in REGIMES:
        assert sum(1 for m, n, k in shapes if lo <= 2 * m * n * k < hi) == 12


def test_db_import(tmp_path, capsys):
    from test_db import ENV_A, P1, meas

    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps(meas("a" * 64, P1, ENV_A, 1.2).to_json()) + "\n")
    db = str(tmp_path / "r.db")
    code, out, _ = run(["db", "import", str(f), "--db", db], capsys)
    assert code == 0 and "1 measurements imported" in out
    code, out, _ = run(["db", "import", str(f), "--db", db], capsys)
    assert "0 measurements imported (already imported" in out
    # An explicit import into a new DB takes only the files it names, not the repository's bench/results.
    from l2ir.search.db import RecordsDB

    assert len(RecordsDB(db).measurements()) == 1


def test_report_of_one_run_has_only_its_shapes(tuned, tmp_path, capsys):
    db, _, _ = tuned
    code, _, err = run(["tune", "--shape", "640x640x640", "--shape", "64x64x64", "--standin", "--interleave",
                        "--budget-candidates", "4", "--db", str(db)], capsys)
    assert code == 0, err
    out_dir = tmp_path / "rep2"
    assert run(["report", "--db", str(db), "--run", "2", "--out", str(out_dir)], capsys)[0] == 0
    md = (out_dir / "report.md").read_text()
    assert "| 640 | 640 | 640 |" in md and "| 64 | 64 | 64 |" in md and "| 300 | 200 | 100 |" not in md
    summary = json.loads((out_dir / "summary.json").read_text())
    (env,) = summary.values()
    assert env["cost"]["shapes"] == 2 and env["cost"]["gpu_seconds_per_shape"] > 0
    import math
    assert env["overall"]["offline_geomean"] == pytest.approx(math.sqrt(env["shapes"][0]["offline"]
                                                                        * env["shapes"][1]["offline"]))
    assert RecordsDB(db).run(2)["config"]["interleave"] is True
