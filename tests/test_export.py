"""`l2ir export`: winner selection from a records DB, the package format, its manifest and content hash.

The helpers at the top (a DB of hand-written measurements, a build step that lowers for real but writes a stand-in
binary) are shared with tests/test_dispatch.py and tests/test_dispatch_gpu.py.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from l2ir import dispatch, export, fastpath
from l2ir.cli import main
from l2ir.search.db import RecordsDB, open_readonly
from l2ir.search.tune import best_for

ROOT = Path(__file__).resolve().parents[1]
CLS_COL = "a=f16:row b=f16:col c=f16:row acc=f32"
CLS_ROW = "a=f16:row b=f16:row c=f16:row acc=f32"
ENV = {"gpu": "NVIDIA H200", "capability": "9.0", "sms": 132, "driver": "580.159.04", "cuda_runtime": "13.0",
       "torch": "2.11.0+cu130", "cutlass": "4.2.0.0", "sm_clock_max_mhz": 1980, "mem_clock_mhz": 3201}


def kernel_ir(example: str) -> str:
    """The kernel block of an example file (the gemm line and comments dropped)."""
    text = (ROOT / "examples" / example).read_text()
    return text[text.index("kernel {"):]


SM80 = kernel_ir("sm80_128x128x32.l2")         # pad align=8: admits only M, N, K that are multiples of 8
SOURCE = kernel_ir("source_naive.l2")          # any shape (one thread per output element)


def record(kernel, shape, speedup, spread=0.02, passed=True, cls=CLS_COL, scenario="offline", env=ENV,
           origin="hand-written test measurement", samples=None):
    """A measurement as the evaluator writes it (a spread of `spread`: half from each side's IQR); `samples`, the
    per-round (kernel us, baseline us) lists, where the test needs them (the export's paired bound)."""
    m, n, k = shape
    base = 10.0
    kmed = base / speedup

    def stats(med):
        return {"median": med, "q25": med * (1 - spread / 2), "q75": med * (1 + spread / 2)}

    kernel_us, baseline_us = samples or ([], [])
    return {"kernel_hash": kernel, "problem": f"gemm m={m} n={n} k={k} {cls}", "scenario": scenario,
            "environment": env, "verdicts": [{"name": "correctness", "passed": passed}], "errors": [],
            "kernel_median_us": kmed, "baseline_median_us": base, "speedup": speedup, "kernel_stats": stats(kmed),
            "baseline_stats": stats(base), "origin": origin, "kernel_us": list(kernel_us),
            "baseline_us": list(baseline_us)}


def make_db(path, rows, kernels):
    db = RecordsDB(path)
    db.add_many(rows, purpose="search", source="test")
    for h, ir in kernels.items():
        db.add_kernel(h, ir=ir)
    return db


def fake_build(ir, cls, backend, device_sm, cache_dir):
    """The real lowering with a stand-in binary (no compiler needed): the package format is what is under test."""
    from l2ir.backends.registry import lower
    from l2ir.text import parse_kernel, parse_problem

    plan = lower(parse_kernel(ir), parse_problem(f"gemm m=1 n=1 k=1 {cls}"), backend)
    binary = Path(cache_dir) / (str(abs(hash((ir, cls)))) + ".cubin")
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_bytes(b"stand-in cubin for " + cls.encode())
    return plan, SimpleNamespace(binary=binary)


K1, K2, K3 = "a1" * 32, "b2" * 32, "c3" * 32


def standard_db(path):
    """K1 (sm80, align 8) wins 256^3 and 64x512x256 clearly; 1024x64x64's best (K3) is not above 1 beyond its
    spread; K2 is the fastest on 512^3 but failed a gate on another shape; K3 (Source) wins b=row 128^3."""
    rows = [
        record(K1, (256, 256, 256), 1.20),
        record(K1, (64, 512, 256), 1.10),
        record(K3, (1024, 64, 64), 1.01, spread=0.05),
        record(K2, (512, 512, 512), 1.50),
        record(K1, (512, 512, 512), 1.05, spread=0.01),
        record(K2, (64, 64, 64), 0.50, passed=False),
        record(K3, (128, 128, 128), 1.30, cls=CLS_ROW),
    ]
    return make_db(path, rows, {K1: SM80, K2: SM80.replace("stages=4", "stages=3"), K3: SOURCE})


@pytest.fixture
def package(tmp_path):
    with standard_db(tmp_path / "r.db") as db:
        export.export(db, tmp_path / "pkg", cache_dir=str(tmp_path / "cache"), build=fake_build, fastpath=False, log=lambda s: None)
    return tmp_path / "pkg"


def entries(pkg):
    table = json.loads((pkg / "table.json").read_text())
    return {(e["m"], e["n"], e["k"], e["problem_class"]): e for e in table["entries"]}, table


# ---------------------------------------------------------------------------------------------------------------


def test_cublas_shapes_name_an_eager_kernel_within_the_slack(tmp_path, package):
    got, table = entries(package)
    e = got[(1024, 64, 64, CLS_COL)]               # cuBLAS (1.01x within a 5 % spread); K3 0.1 us slower at most
    assert e["kernel"] is None and e["eager_kernel"] == K3 and e["eager_kernel_key"] in table["kernels"]
    assert table["kernels"][e["eager_kernel_key"]]["hash"] == K3
    assert e["eager_kernel_us"] == pytest.approx(10 / 1.01) and e["baseline_us"] == pytest.approx(10.0)
    assert got[(64, 64, 64, CLS_COL)]["eager_kernel"] is None            # no gate-clean kernel at all
    assert got[(256, 256, 256, CLS_COL)]["eager_kernel"] is None         # served: no alternative needed
    manifest = json.loads((package / "manifest.json").read_text())
    assert manifest["rule"]["eager_slack_us"] == export.EAGER_SLACK_US
    # Slower than cuBLAS by more than the slack (12.5 us against 10): no eager kernel; within it (10.53): one.
    rows = [record(K1, (256, 256, 256), 0.80), record(K1, (512, 256, 256), 0.95)]
    with make_db(tmp_path / "slack.db", rows, {K1: SM80}) as db:
        export.export(db, tmp_path / "pkg2", cache_dir=str(tmp_path / "cache"), build=fake_build, fastpath=False, log=lambda s: None)
    got2, table2 = entries(tmp_path / "pkg2")
    assert got2[(256, 256, 256, CLS_COL)]["eager_kernel"] is None
    assert got2[(512, 256, 256, CLS_COL)]["eager_kernel"] == K1 and len(table2["kernels"]) == 1
    pkg = dispatch.read_package(tmp_path / "pkg2")
    assert pkg.resolve(512, 256, 256, CLS_COL) == (None, "cublas")
    assert pkg.resolve_eager(512, 256, 256, CLS_COL) == got2[(512, 256, 256, CLS_COL)]["eager_kernel_key"]
    assert pkg.resolve_eager(256, 256, 256, CLS_COL) is None
    assert pkg.resolve_eager(264, 256, 256, CLS_COL) is None      # nearest is 256^3: cuBLAS without an alternative


def test_a_cublas_shape_names_its_fastest_clean_kernel(tmp_path):
    """The reason a shape stays with cuBLAS quotes the fastest clean kernel, not the last one ranked."""
    rows = [record(K1, (256, 256, 256), 0.95), record(K2, (256, 256, 256), 0.40)]
    with make_db(tmp_path / "why.db", rows, {K1: SM80, K2: SM80.replace("stages=4", "stages=3")}) as db:
        (choice,) = export.choose(db, export.choose_environment(db, None))
    assert choice.kernel is None and "0.950" in choice.reason, choice.reason


def test_a_kernel_retimed_several_times_counts_by_its_median_trial(tmp_path):
    """Three fresh trials of one kernel (the server race's --fresh-trials): its lucky trial alone is above 1, its
    median is not, so the shape stays with cuBLAS; the ranking's best-of view would have served it."""
    search = [record(K1, (256, 256, 256), 1.40), record(K2, (256, 256, 256), 1.10)]
    trials = [record(K1, (256, 256, 256), s) for s in (1.30, 0.97, 0.98)]
    with make_db(tmp_path / "trials.db", search, {K1: SM80, K2: SM80.replace("stages=4", "stages=3")}) as db:
        db.add_many(trials, purpose="retime", source="test")
        env = export.choose_environment(db, None)
        problem = trials[0]["problem"]
        (best,) = db.ranking(problem, env, purpose="retime")
        (median,) = db.ranking(problem, env, purpose="retime", per_kernel="median")
        assert best.speedup == pytest.approx(1.30) and median.speedup == pytest.approx(0.98)
        (choice,) = export.choose(db, env)
        assert best_for(db, problem)["row"].speedup == pytest.approx(0.98)     # `l2ir best` says the same
        with pytest.raises(ValueError, match="per_kernel"):
            db.ranking(problem, env, per_kernel="mean")
    assert choice.kernel is None and "0.980" in choice.reason, choice.reason
    # Two trials: the lower one counts; kernels still rank fastest first by the trial that counts.
    rows = [record(K1, (128, 128, 128), s) for s in (1.20, 1.04)] + [record(K2, (128, 128, 128), 1.10)]
    with make_db(tmp_path / "two.db", [], {K1: SM80, K2: SM80.replace("stages=4", "stages=3")}) as db:
        db.add_many(rows, purpose="retime", source="test")
        env = export.choose_environment(db, None)
        ranked = db.ranking(rows[0]["problem"], env, per_kernel="median")
    assert [(r.kernel, round(r.speedup, 2)) for r in ranked] == [(K2, 1.10), (K1, 1.04)]


def cold_rounds(speedup, jitter, rounds=15, seed=0):
    """Per-round (kernel us, baseline us) of cold calls: both sides move together with the round's state (the
    flush, the clock) by up to +-`jitter`, and the kernel is `speedup` times faster within each round."""
    import random

    rng = random.Random(seed)
    base = [10.0 * (1 + rng.uniform(-jitter, jitter)) for _ in range(rounds)]
    kern = [b / speedup * (1 + rng.uniform(-0.01, 0.01)) for b in base]
    return kern, base


def test_a_noisy_but_consistent_win_is_served_and_a_coin_flip_is_not(tmp_path):
    """Cold calls scatter 8 % round to round, so speedup * (1 - spread) would refuse a steady 1.06x; paired by
    round, the 1.06x is certain and is served, while a kernel that wins only half its rounds (median 1.0x) is not."""
    steady = [record(K1, (256, 256, 256), 1.06, spread=0.08, scenario="server", samples=cold_rounds(1.06, 0.08, seed=s))
              for s in (1, 2, 3)]
    kern, base = cold_rounds(1.0, 0.08, seed=4)
    flips = [k * (1.04 if i % 2 else 0.96) for i, k in enumerate(kern)]       # +-4 %, alternating
    coin = [record(K2, (512, 256, 256), 1.02, spread=0.08, scenario="server", samples=(flips, base))]
    with make_db(tmp_path / "paired.db", [], {K1: SM80, K2: SM80.replace("stages=4", "stages=3")}) as db:
        db.add_many(steady + coin, purpose="retime", source="test")
        got = {(c.m, c.n, c.k): c for c in export.choose(db, export.choose_environment(db, None), "server")}
    win, flip = got[(256, 256, 256)], got[(512, 256, 256)]
    assert win.kernel == K1 and win.speedup_bound > 1.03 and "over 45 paired rounds" in win.reason, win.reason
    assert flip.kernel is None and "lower bound" in flip.reason and "over 15 paired rounds" in flip.reason, flip.reason


def test_the_eager_rule_keeps_gpu_bound_calls_on_cublas():
    """An eager kernel within the slack pays where the call is host-bound (cuBLAS below torch's issue time) and
    not where cuBLAS's own device time is above it: back-to-back calls then wait for the GPU."""
    rule = export.EAGER_RULE
    assert dispatch.eager_pays(5.8, 5.0, rule)                 # host-bound: issued 1.8 us sooner, runs 0.8 us longer
    assert not dispatch.eager_pays(18.5, 18.0, rule)           # GPU-bound: 0.5 us slower every call
    assert dispatch.eager_pays(17.9, 18.0, rule)               # GPU-bound but faster on the device
    assert not dispatch.eager_pays(6.5, 5.0, rule)             # beyond the slack
    assert not dispatch.eager_pays(11.9, 11.0, rule)           # becomes GPU-bound at 11.9 > 11.4
    older = {"eager_slack_us": 1.0}                            # a package exported before the issue times
    assert dispatch.eager_pays(18.5, 18.0, older) and not dispatch.eager_pays(19.5, 18.0, older)


def test_export_picks_gate_clean_winners_above_their_spread(package):
    got, table = entries(package)
    assert got[(256, 256, 256, CLS_COL)]["kernel"] == K1
    assert got[(64, 512, 256, CLS_COL)]["kernel"] == K1
    # K2 is faster on 512^3 but failed a gate on 64^3 in this environment: the next clean kernel serves it.
    assert got[(512, 512, 512, CLS_COL)]["kernel"] == K1
    assert got[(512, 512, 512, CLS_COL)]["speedup"] == pytest.approx(1.05)
    # 1.01 with a 5 % spread (and no paired samples to bound it by) could be a loss: cuBLAS, with the reason.
    e = got[(1024, 64, 64, CLS_COL)]
    assert e["kernel"] is None and e["kernel_key"] is None and "not above 1 with confidence" in e["reason"]
    assert "spread 0.050" in e["reason"]
    assert got[(64, 64, 64, CLS_COL)]["kernel"] is None
    assert got[(128, 128, 128, CLS_ROW)]["kernel"] == K3
    # One binary per (kernel, problem class), each with its plan and IR: K3 for b=row (128^3) and for b=col as
    # 1024x64x64's eager kernel.
    assert sorted((s["hash"], s["problem_class"]) for s in table["kernels"].values()) == [
        (K1, CLS_COL), (K3, CLS_COL), (K3, CLS_ROW)]
    for spec in table["kernels"].values():
        d = package / spec["dir"]
        assert (d / spec["binary"]).is_file() and (d / "kernel.l2").is_file() and (d / "kernel.cu").is_file()
        assert spec["plan"]["launches"] and spec["plan"]["launches"][0]["entry"]


def test_manifest_has_environment_and_content_hash(package):
    man = json.loads((package / "manifest.json").read_text())
    assert man["format"] == dispatch.FORMAT == export.FORMAT
    assert man["version"] == dispatch.FORMAT_VERSION == export.FORMAT_VERSION
    env = man["environment"]
    assert (env["gpu"], env["sms"], env["driver"], env["cuda_runtime"], env["torch"], env["cutlass"]) == (
        "NVIDIA H200", 132, "580.159.04", "13.0", "2.11.0+cu130", "4.2.0.0")
    assert man["device_sm"] == "sm_90"
    assert set(man["files"]) == {str(p.relative_to(package)) for p in package.rglob("*")
                                 if p.is_file() and p.name != "manifest.json"}
    assert man["content_hash"] == export.content_hash(man["files"])


def test_round_trip_reads_the_table(package):
    pkg = dispatch.read_package(package)
    got, _ = entries(package)
    assert len(pkg.tuned) == len(got)
    for (m, n, k, cls), e in got.items():
        key = pkg.tuned[(m, n, k, cls)]
        assert (pkg.kernels[key].hash if key else None) == e["kernel"]


def test_export_is_deterministic(package, tmp_path):
    first = json.loads((package / "manifest.json").read_text())["content_hash"]
    with RecordsDB(tmp_path / "r.db") as db:
        export.export(db, package, cache_dir=str(tmp_path / "cache"), build=fake_build, fastpath=False, log=lambda s: None)
    assert json.loads((package / "manifest.json").read_text())["content_hash"] == first


@pytest.mark.parametrize("damage", ["binary", "table", "version", "format", "missing"])
def test_damaged_package_is_refused(package, damage):
    spec = next(iter(json.loads((package / "table.json").read_text())["kernels"].values()))
    man_path = package / "manifest.json"
    man = json.loads(man_path.read_text())
    if damage == "binary":
        (package / spec["dir"] / spec["binary"]).write_bytes(b"tampered")
        match = "does not match its hash"
    elif damage == "table":
        (package / "table.json").write_text((package / "table.json").read_text().replace("1.2", "9.2"))
        match = "table.json does not match"
    elif damage == "missing":
        shutil.rmtree(package / spec["dir"])
        match = "missing"
    else:
        man[damage] = 99 if damage == "version" else "other"
        man_path.write_text(json.dumps(man))
        match = damage
    with pytest.raises(dispatch.PackageError, match=match):
        dispatch.read_package(package)


def test_build_failure_leaves_the_shapes_to_cublas(tmp_path):
    def broken(ir, cls, *a):
        if "source" in ir:
            raise export.ExportError("compile error: kernel.cu(3): error: expected a ';'")
        return fake_build(ir, cls, *a)

    with standard_db(tmp_path / "r.db") as db:
        export.export(db, tmp_path / "pkg", cache_dir=str(tmp_path / "c"), build=broken, fastpath=False,
                      log=lambda s: None)
    got, table = entries(tmp_path / "pkg")
    e = got[(128, 128, 128, CLS_ROW)]
    assert e["kernel"] is None and "binary not built" in e["reason"] and "expected a ';'" in e["reason"]
    assert [s["hash"] for s in table["kernels"].values()] == [K1]


def test_environment_must_be_named_when_several(tmp_path):
    other = dict(ENV, gpu="NVIDIA A100-SXM4-80GB", capability="8.0", sms=108)
    with make_db(tmp_path / "r.db", [record(K1, (1024,) * 3, 1.2), record(K1, (1024,) * 3, 1.3, env=other)],
                 {K1: SM80}) as db:
        with pytest.raises(export.ExportError, match="several environments"):
            export.export(db, tmp_path / "pkg", build=fake_build, fastpath=False, log=lambda s: None)
        a100 = [eid for eid, e, _ in db.environments() if e["sms"] == 108][0]
        man = export.export(db, tmp_path / "pkg", env=a100[:6], cache_dir=str(tmp_path / "c"), build=fake_build, fastpath=False,
                            log=lambda s: None)
    assert man["environment"]["gpu"] == "NVIDIA A100-SXM4-80GB" and man["device_sm"] == "sm_80"
    got, _ = entries(tmp_path / "pkg")
    assert got[(1024, 1024, 1024, CLS_COL)]["speedup"] == pytest.approx(1.3)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["export", "--db", str(tmp_path / "none.db"), "--out", str(tmp_path / "p")]) == 1
    assert "no such file" in capsys.readouterr().err
    with make_db(tmp_path / "e.db", [], {}):
        pass
    assert main(["export", "--db", str(tmp_path / "e.db"), "--out", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert "no measured environment" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "keep.txt").write_text("user data")
    with standard_db(tmp_path / "s.db"):
        pass
    assert main(["export", "--db", str(tmp_path / "s.db"), "--out", str(tmp_path / "q")]) == 1
    assert "not a dispatch package" in capsys.readouterr().err
    assert (tmp_path / "q" / "keep.txt").read_text() == "user data"


def test_cli_export_with_a_real_nvcc_compile(tmp_path, capsys, monkeypatch):
    """The whole command, the binary built by nvcc from the IR text (a Source kernel: seconds)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    with make_db(tmp_path / "r.db", [record(K3, (256, 256, 256), 1.4), record(K3, (96, 96, 96), 0.9)],
                 {K3: SOURCE}):
        pass
    code = main(["export", "--db", str(tmp_path / "r.db"), "--out", str(tmp_path / "pkg"),
                 "--cache", str(tmp_path / "cache")])
    out = capsys.readouterr()
    assert code == 0, out.err
    # 96^3: K3 at 0.9x (11.1 us against 10) is beyond the eager slack, so cuBLAS serves eager calls too.
    assert "2 tuned shapes (1 served by L2IR kernels, 1 by cuBLAS, 0 of those by an L2IR kernel on eager calls)" \
        in out.out
    pkg = dispatch.read_package(tmp_path / "pkg")
    (spec,) = pkg.kernels.values()
    cubin = (spec.dir / spec.binary).read_bytes()
    assert spec.binary == "kernel.cubin" and cubin[:4] == b"\x7fELF"
    assert spec.plan["launches"][0]["entry"] == "naive_gemm"
    assert "naive_gemm" in (spec.dir / "kernel.cu").read_text()
    # The compiled eager path is built into the package (g++ and torch's headers are here) and kept in the
    # cache: a second export copies it (with the fast path's compiler calls made to fail, so none is made).
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    fast = tmp_path / "pkg" / "fastpath" / manifest["fastpath"]
    assert manifest["files"][f"fastpath/{fast.name}"] == export.sha256_file(fast)

    def no_compiler(*args, **kwargs):
        raise AssertionError("the fast path was compiled again")

    monkeypatch.setattr(fastpath, "subprocess", SimpleNamespace(run=no_compiler))
    with open_readonly(tmp_path / "r.db") as db:
        again = export.export(db, tmp_path / "pkg2", cache_dir=str(tmp_path / "cache"), log=lambda s: None)
    assert again["fastpath"] == fast.name
    assert (tmp_path / "pkg2" / "fastpath" / fast.name).read_bytes() == fast.read_bytes()


def test_scenario_and_target_filter(tmp_path, capsys):
    rows = [record(K1, (256, 256, 256), 1.2), record(K1, (256, 256, 256), 0.9, scenario="server"),
            record(K3, (128, 128, 128), 1.3, scenario="server"), record(K3, (128, 128, 128), 1.3)]
    with make_db(tmp_path / "r.db", rows, {K1: SM80, K3: SOURCE}) as db:
        export.export(db, tmp_path / "srv", scenario="server", cache_dir=str(tmp_path / "c"), build=fake_build, fastpath=False,
                      log=lambda s: None)
        got, _ = entries(tmp_path / "srv")
        assert got[(256, 256, 256, CLS_COL)]["kernel"] is None              # offline's win does not count here
        assert got[(128, 128, 128, CLS_COL)]["kernel"] == K3
        export.export(db, tmp_path / "off", cache_dir=str(tmp_path / "c"), build=fake_build, fastpath=False, log=lambda s: None,
                      accept=lambda row: None if "source" not in row["ir"] else "no Source kernels")
        got, _ = entries(tmp_path / "off")
        assert got[(256, 256, 256, CLS_COL)]["kernel"] == K1
        assert got[(128, 128, 128, CLS_COL)]["kernel"] is None and "no Source kernels" in got[
            (128, 128, 128, CLS_COL)]["reason"]
    with pytest.raises(SystemExit) as exc:
        main(["export", "--db", str(tmp_path / "r.db"), "--out", str(tmp_path / "bad"), "--scenario", "x"])
    assert exc.value.code == 2 and "invalid choice: 'x'" in capsys.readouterr().err


def test_export_opens_the_db_read_only(tmp_path, capsys):
    """A DB file the user cannot write (0444), in rollback-journal mode (opening it as a RecordsDB would switch it
    to WAL, a write): it exports, and its bytes and mtime are unchanged afterwards."""
    import os
    import sqlite3

    with standard_db(tmp_path / "r.db"):
        pass
    with sqlite3.connect(tmp_path / "r.db") as c:
        assert c.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    db_file = tmp_path / "r.db"
    before, mtime = db_file.read_bytes(), db_file.stat().st_mtime_ns
    db_file.chmod(0o444)
    try:
        # The command (no kernel of target sm90a in this DB: nothing to compile, every shape to cuBLAS).
        assert main(["export", "--db", str(db_file), "--out", str(tmp_path / "pkg"), "--cache",
                     str(tmp_path / "c"), "--target", "sm90a", "--no-fastpath"]) == 0
        assert "0 served by L2IR kernels" in capsys.readouterr().out
        with open_readonly(db_file) as db:
            man = export.export(db, tmp_path / "pkg2", cache_dir=str(tmp_path / "c"), build=fake_build, fastpath=False,
                                log=lambda s: None)
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                db.conn.execute("DELETE FROM measurements")
        assert db_file.read_bytes() == before and db_file.stat().st_mtime_ns == mtime
        assert os.stat(db_file).st_mode & 0o777 == 0o444
    finally:
        db_file.chmod(0o644)
    got, _ = entries(tmp_path / "pkg2")
    assert got[(256, 256, 256, CLS_COL)]["kernel"] == K1 and man["content_hash"]


def test_export_reads_an_older_schema_without_migrating_it(tmp_path):
    import sqlite3

    with standard_db(tmp_path / "r.db"):
        pass
    with sqlite3.connect(tmp_path / "r.db") as c:
        c.execute("PRAGMA journal_mode=DELETE")
        c.execute("DROP INDEX llm_calls_run")             # back to schema v2: v3 is migrated again, in memory
        for col in ("problem", "parent", "cost", "verdict", "errors", "proposals", "outcomes"):
            c.execute(f"ALTER TABLE llm_calls DROP COLUMN {col}")
        c.execute("PRAGMA user_version = 2")
    before = (tmp_path / "r.db").read_bytes()
    with open_readonly(tmp_path / "r.db") as db:
        assert db.version == len(__import__("l2ir.search.db", fromlist=["MIGRATIONS"]).MIGRATIONS)
        export.export(db, tmp_path / "pkg", cache_dir=str(tmp_path / "c"), build=fake_build, fastpath=False, log=lambda s: None)
    assert (tmp_path / "r.db").read_bytes() == before
    got, _ = entries(tmp_path / "pkg")
    assert got[(256, 256, 256, CLS_COL)]["kernel"] == K1


def test_export_refuses_a_file_that_is_not_a_db(tmp_path, capsys):
    (tmp_path / "x.db").write_text("not sqlite")
    assert main(["export", "--db", str(tmp_path / "x.db"), "--out", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert "not a records DB" in err and len(err.strip().splitlines()) == 1


def test_the_paired_rule_refuses_too_few_rounds_a_bad_tail_and_a_lucky_fourth_kernel(tmp_path):
    """Rounds too few for the bound are a refusal (not the spread rule, which a single round passes with spread 0);
    a kernel 1.06x faster in 70 % of its rounds and 2x slower in the rest has a median bound above 1 but loses on
    its totals; and after three unsure kernels a fourth is not tried (among many ties one would pass by chance)."""
    few = record(K1, (256, 256, 256), 1.10, spread=0.0, scenario="server", samples=([9.0, 9.1], [10.0, 10.0]))
    kern, base = cold_rounds(1.06, 0.02, rounds=40, seed=5)
    tail = [k * (1.06 * 2.0 if i % 10 >= 7 else 1.0) for i, k in enumerate(kern)]           # rounds 7-9 of 10
    bad = record(K2, (512, 256, 256), 1.047, spread=0.02, scenario="server", samples=(tail, base))
    unsure = [record(h, (128, 256, 256), s, scenario="server", samples=cold_rounds(1.0, 0.08, seed=i))
              for i, (h, s) in enumerate(((K1, 1.03), (K2, 1.02), (K3, 1.01)))]
    sure = record("d4" * 32, (128, 256, 256), 1.005, scenario="server", samples=cold_rounds(1.005, 0.0, seed=9))
    kernels = {K1: SM80, K2: SM80.replace("stages=4", "stages=3"), K3: SOURCE, "d4" * 32: SM80.replace("stages=4", "stages=2")}
    with make_db(tmp_path / "rules.db", [few, bad, *unsure, sure], kernels) as db:
        got = {(c.m, c.n, c.k): c for c in export.choose(db, export.choose_environment(db, None), "server")}
    assert got[(256, 256, 256)].kernel is None and "only 2 paired rounds" in got[(256, 256, 256)].reason
    b = got[(512, 256, 256)]
    assert b.kernel is None and b.speedup_bound > 1.0 and "their totals 0.7" in b.reason, b.reason
    assert got[(128, 256, 256)].kernel is None             # the sure 1.005x comes fourth


def test_pooled_rounds_in_the_thousands_have_a_bound():
    """The binomial tail in exact integers: 2000 rounds (a kernel measured by many runs) give a bound, not an
    OverflowError."""
    from l2ir.search.timing import median_lower_bound

    assert median_lower_bound([float(i) for i in range(2000)]) == pytest.approx(963, abs=1)


def test_eager_kernels_of_gpu_bound_shapes_stay_off_tuned_and_neighbour_shapes(tmp_path):
    """choose() names no eager kernel where cuBLAS's call is GPU-bound and the kernel slower (20.5 against 20 us),
    the manifest carries the rule's constants, and the loader refuses the eager kernel of a host-bound cuBLAS shape
    (6.0 against 5.8 us) on a neighbour twice the work, where the prediction is GPU-bound (12.0 against 11.6 us,
    within the slack but above torch's 11.4 us issue time)."""
    rows = [record(K1, (256, 256, 256), 1.0, spread=0.0), record(K1, (512, 512, 512), 1.0, spread=0.0)]
    for r, (kernel_us, cublas_us) in zip(rows, ((20.5, 20.0), (6.0, 5.8))):
        r["kernel_median_us"], r["baseline_median_us"] = kernel_us, cublas_us
        r["speedup"] = cublas_us / kernel_us
    with make_db(tmp_path / "gpu.db", rows, {K1: SM80}) as db:
        export.export(db, tmp_path / "pkg", cache_dir=str(tmp_path / "cache"), build=fake_build, fastpath=False,
                      log=lambda s: None)
    got, _ = entries(tmp_path / "pkg")
    assert got[(256, 256, 256, CLS_COL)]["eager_kernel"] is None                   # GPU-bound: slower every call
    assert got[(512, 512, 512, CLS_COL)]["eager_kernel"] == K1                     # host-bound: issued sooner
    rule = json.loads((tmp_path / "pkg" / "manifest.json").read_text())["rule"]
    assert (rule["l2ir_issue_us"], rule["torch_issue_us"], rule["win_confidence"]) == (
        export.L2IR_ISSUE_US, export.TORCH_ISSUE_US, export.WIN_CONFIDENCE)
    pkg = dispatch.read_package(tmp_path / "pkg")
    assert pkg.resolve_eager(512, 512, 512, CLS_COL) is not None
    assert pkg.resolve(512, 512, 1024, CLS_COL) == (None, "cublas")                # borrows 512^3's decision
    assert pkg.resolve_eager(512, 512, 1024, CLS_COL) is None                       # predicted GPU-bound
    assert pkg.resolve_eager(512, 512, 600, CLS_COL) is not None                    # 1.17x the work: still pays
