"""The benchmark driver's pure parts: shape selection, sweeps as data, resume records, summary arithmetic."""

import json
import math
from importlib import resources
from typing import ClassVar

import pytest
from l2ir.search.bench import GRID, default_sweep, grid_shapes
from l2ir.search.records import JsonlStore, MemoryStore, first_failure, passed
from l2ir.search.report import RunStats, ShapeResult, geomean, short_symbol, summarize
from l2ir.search.sweeps import load_sweep, sweep_names

from l2ir.errors import L2IRError
from l2ir.text import print_kernel
from l2ir.verify import verify


def test_grid_shapes_spread_over_the_flop_range():
    shapes = grid_shapes(40)
    assert len(shapes) == 40 and len(set(shapes)) == 40
    assert shapes[0] == (64, 64, 64) and shapes[-1] == (16384, 16384, 16384)
    flops = [m * n * k for m, n, k in shapes]
    assert flops == sorted(flops)
    assert all(d in GRID for s in shapes for d in s)
    big = grid_shapes(20, min_gflop=1000)
    assert len(big) == 20 and all(2 * m * n * k >= 1e12 for m, n, k in big)
    assert len(grid_shapes(5000)) == 1000
    assert grid_shapes(1) == [(16384, 16384, 16384)] and grid_shapes(0) == []


def test_the_shipped_sweeps_are_there():
    assert set(sweep_names()) >= {"sm80", "sm90a", "cuda_ptx", "cuda_ptx_sm80"}
    assert len(load_sweep("sm90a")) == 8 and len(load_sweep("sm80")) == 5
    assert default_sweep("sm90a", None) == "sm90a" and default_sweep("sm90a", "cuda_ptx") == "cuda_ptx"
    assert default_sweep("sm86", None) == "sm80"


@pytest.mark.parametrize("name", ["sm80", "sm90a", "cuda_ptx", "cuda_ptx_sm80"])
def test_every_sweep_file_is_a_legal_kernel_in_canonical_text(name):
    folder = resources.files("l2ir.search.sweeps") / name
    for config, kernel in load_sweep(name).items():
        assert verify(kernel) is kernel
        text = (folder / f"{config}.l2").read_text()
        body = "".join(ln + "\n" for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        assert body == print_kernel(kernel), f"{name}/{config}.l2 is not in canonical text (l2ir fmt)"


def test_sweep_names_and_bad_sweep_files_are_errors(tmp_path, monkeypatch):
    with pytest.raises(L2IRError, match="unknown sweep 'nope'"):
        load_sweep("nope")
    from l2ir.search import sweeps

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.l2").write_text("kernel {\n  target arch=sm80\n  tile block=128x128x32 warps=2x2\n"
                                           "  mma op=wgmma shape=64x128x16\n}\n")
    monkeypatch.setattr(sweeps, "_root", lambda: tmp_path)
    with pytest.raises(L2IRError, match=r"sweeps/bad/x\.l2"):
        load_sweep("bad")


def test_a_kept_sweep_follows_its_files(tmp_path, monkeypatch):
    """load_sweep keeps a parsed sweep, but a changed, added or removed file is read again, and the caller's dict
    is its own."""
    import os

    from l2ir.search import sweeps

    from l2ir.text import print_kernel

    real = load_sweep("sm80")
    names = sorted(real)[:2]
    (tmp_path / "mine").mkdir()
    monkeypatch.setattr(sweeps, "_root", lambda: tmp_path)
    first = tmp_path / "mine" / "a.l2"
    first.write_text(print_kernel(real[names[0]]))
    got = load_sweep("mine")
    assert list(got) == ["a"] and got["a"] == real[names[0]]
    got.clear()
    assert list(load_sweep("mine")) == ["a"]                 # the caller's dict was a copy
    first.write_text(print_kernel(real[names[1]]))
    os.utime(first, ns=(1, 1))                                # a new stamp even on a coarse clock
    assert load_sweep("mine")["a"] == real[names[1]]
    (tmp_path / "mine" / "b.l2").write_text(print_kernel(real[names[0]]))
    assert list(load_sweep("mine")) == ["a", "b"]
    first.unlink()
    assert list(load_sweep("mine")) == ["b"]


def test_resume_records_survive_a_cut_line(tmp_path):
    path = tmp_path / "r.jsonl"
    rec = {"kernel_hash": "h", "problem": "gemm m=1", "scenario": "offline", "speedup": 1.5}
    # the second line was cut by a kill; the third is valid JSON but no measurement
    path.write_text(json.dumps(rec) + "\n" + json.dumps(rec)[:20] + "\n" + json.dumps({"note": 1}) + "\n")
    store = JsonlStore(path)
    assert list(store) == [rec]
    assert store.lookup("h", "gemm m=1", "offline", "") == rec         # same (empty) binary key
    assert store.lookup("h", "gemm m=1", "offline", "other-binary") is None
    assert store.lookup("h", "gemm m=1", "offline") == rec             # whatever binary: report-only
    assert list(JsonlStore(tmp_path / "missing.jsonl")) == []
    JsonlStore(path, resume=False)
    assert not path.exists()                     # a fresh run starts from nothing


def test_records_keep_the_latest_measurement_and_read_back(tmp_path):
    from l2ir.search.evaluator import Measurement
    from l2ir.search.gates import Verdict

    path = tmp_path / "r.jsonl"
    store = JsonlStore(path)
    bad = Measurement("h", "gemm", "offline", errors=["out of memory"], artifact_key="b1")
    good = Measurement("h", "gemm", "offline", verdicts=[Verdict("accuracy", True)], speedup=1.2, artifact_key="b1")
    store.add(bad, "cfg", "seed")
    store.add(good, "cfg", "seed")
    again = JsonlStore(path)
    rec = again.lookup("h", "gemm", "offline", "b1")
    assert rec["speedup"] == 1.2 and rec["config"] == "cfg" and rec["origin"] == "seed" and passed(rec)
    assert len(list(again)) == 2 and not passed(next(iter(again)))
    assert first_failure(next(iter(again))) == "out of memory"
    assert first_failure({"verdicts": [{"name": "guard_bands", "passed": False, "detail": "wrote past C"}]}) == \
        "gate guard_bands: wrote past C"
    assert MemoryStore().lookup("h", "gemm", "offline") is None


def test_summary_groups_by_regime_and_ignores_missing_speedups():
    rows = [ShapeResult((64, 64, 64), offline={"speedup": 2.0}), ShapeResult((128, 128, 128), offline={"speedup": 0.5}),
            ShapeResult((4096, 4096, 4096), offline={}),       # no candidate passed: no speedup to average
            ShapeResult((16384, 16384, 16384), offline={"speedup": 1.1}, server={"speedup": 0.9})]
    stats = RunStats(evaluations=8, passes=6, compile_seconds=[10.0, 20.0], compile_wall=5.0, kernels=2)
    s = summarize(rows, stats, target="sm80", problem_class="a=f16:row", command="l2ir bench",
                  environment={"gpu": "test"}, shapes_planned=4)
    assert s["by_regime"]["< 1 GFLOP"]["shapes"] == 2
    assert s["by_regime"]["< 1 GFLOP"]["offline_geomean_speedup"] == pytest.approx(1.0)
    assert s["by_regime"]["< 1 GFLOP"]["shapes_faster_offline"] == 1
    assert s["by_regime"]["0.1-1 TFLOP"]["offline_geomean_speedup"] is None
    assert s["by_regime"][">= 1 TFLOP"]["server_geomean_speedup"] == pytest.approx(0.9)
    assert s["gate_pass_rate"] == 0.75 and s["compile_seconds_per_kernel"] == 15.0
    assert s["compile_seconds_per_kernel_fresh"] is None
    assert s["environment"] == {"gpu": "test"} and s["shapes_done"] == 4
    assert geomean([None, 4.0, 1.0]) == pytest.approx(2.0)


def test_short_symbols_stay_distinct():
    a, b = "x" * 200 + "a", "x" * 200 + "b"
    assert len(short_symbol(a)) <= 72 and short_symbol(a) != short_symbol(b)
    assert short_symbol("l2ir_cute_sm80_gemm") == "l2ir_cute_sm80_gemm"


# ---- the whole driver on a machine without a GPU: compile and evaluator replaced by deterministic stand-ins ----


def _fake_build(monkeypatch):
    import hashlib
    from pathlib import Path

    from l2ir.backends import sass
    from l2ir.backends.compile import Artifact
    from l2ir.search import pipeline

    built = []

    def compile_many(plans, options):
        built.extend(plans)
        return [Artifact(key="bin-" + hashlib.sha256(p.source.encode()).hexdigest()[:12], binary=Path("k.cubin"),
                         compile_seconds=2.0) for p in plans]

    monkeypatch.setattr(pipeline, "compile_many", compile_many)
    monkeypatch.setattr(sass, "inspect", lambda binary: None)
    return built


class _Evaluator:
    """Passes every gate with a speedup read from the kernel hash; `flaky` passes offline and fails the re-check."""

    calls: ClassVar[list] = []
    flaky: ClassVar[set] = set()

    def __init__(self, config):
        self.config = config
        self.environment = {"gpu": "stand-in"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def evaluate(self, kernel, problem, plan, artifact, time_kernel=True):
        from l2ir.search.evaluator import Measurement
        from l2ir.search.gates import Verdict

        from l2ir.text import print_problem

        h = kernel.content_hash()
        type(self).calls.append((self.config.scenarios, h, problem.shape))
        ok = not (h in self.flaky and self.config.scenarios == ("server",))
        return [Measurement(h, print_problem(problem), s, environment=dict(self.environment),
                            verdicts=[Verdict("accuracy", True), Verdict("post_timing", ok)],
                            speedup=1 + int(h[:4], 16) / 65536, kernel_median_us=10.0, baseline_median_us=12.0,
                            artifact_key=artifact.key) for s in self.config.scenarios]


def test_bench_runs_the_pipeline_resumes_and_rebuilds_its_report(tmp_path, monkeypatch):
    import csv

    from l2ir.search import evaluator
    from l2ir.search.bench import BenchConfig, run_bench

    built = _fake_build(monkeypatch)
    monkeypatch.setattr(evaluator, "Evaluator", _Evaluator)
    sweep = load_sweep("sm80")
    # the offline winner on every shape fails its re-check: the next best becomes the result
    fastest = max(sweep.values(), key=lambda k: int(k.content_hash()[:4], 16))
    _Evaluator.calls, _Evaluator.flaky = [], {fastest.content_hash()}
    cfg = BenchConfig(out=tmp_path / "r" / "sm80", shapes=((256, 256, 256), (1000, 1000, 1000)),
                      sweep=tuple(sweep.items()), sweep_name="sm80", target="sm80", command="l2ir bench test")
    s = run_bench(cfg)
    assert s["shapes_done"] == 2 and s["environment"] == {"gpu": "stand-in"}
    assert s["gate_pass_rate"] == 1.0
    assert len(built) == s["kernels_compiled"] <= len(sweep) + 2          # once per kernel, not per shape
    flaky_name = next(n for n, k in sweep.items() if k == fastest)
    failed_recheck = [row for row in s["shapes"] if row["gates"][flaky_name].get("recheck") is False]
    assert s["recheck_failures"] == len(failed_recheck) >= 1
    for row in s["shapes"]:
        assert row["best_name"] and row["best_hash"] != fastest.short_hash
        assert row["offline"]["speedup"] > 1 and row["server"]["speedup"] > 1
    records = [json.loads(line) for line in (tmp_path / "r" / "sm80.jsonl").read_text().splitlines()]
    assert {r["origin"] for r in records} == {"seed", "sweep:sm80"} and all(r["config"] for r in records)
    with open(tmp_path / "r" / "sm80.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0][:3] == ["M", "N", "K"] and len(rows) == 3
    assert json.loads((tmp_path / "r" / "sm80.json").read_text())["command"] == "l2ir bench test"

    # a rerun measures nothing again (same binaries) and reaches the same table
    calls = len(_Evaluator.calls)
    again = run_bench(cfg)
    assert len(_Evaluator.calls) == calls
    assert [r["best_name"] for r in again["shapes"]] == [r["best_name"] for r in s["shapes"]]

    # report-only: no evaluator at all, the table rebuilt from the records
    monkeypatch.setattr(evaluator, "Evaluator", None)
    report = run_bench(BenchConfig(**{**cfg.__dict__, "report_only": True}))
    assert [r["best_name"] for r in report["shapes"]] == [r["best_name"] for r in s["shapes"]]
    assert report["recheck_failures"] == s["recheck_failures"]


def test_bench_families_name_their_backend_and_report_winners_on_fresh_samples(tmp_path, monkeypatch):
    from l2ir.search import evaluator
    from l2ir.search.bench import BenchConfig, run_bench

    _fake_build(monkeypatch)
    monkeypatch.setattr(evaluator, "Evaluator", _Evaluator)
    _Evaluator.calls, _Evaluator.flaky = [], set()
    families = (("cuda_ptx_sm80", "cuda_ptx_sm80", tuple(load_sweep("cuda_ptx_sm80").items())),
                ("cute_sm80", "sm80", tuple(load_sweep("sm80").items())))
    shapes = ((100, 256, 256), (1000, 1000, 1000))
    cfg = BenchConfig(out=tmp_path / "fam", shapes=shapes, sweep=(), target="sm80", families=families)
    s = run_bench(cfg)
    records = [json.loads(line) for line in (tmp_path / "fam.jsonl").read_text().splitlines()]
    assert {r["config"].split("/")[0] for r in records if r["origin"] != "seed"} == {"cuda_ptx_sm80", "cute_sm80"}
    fresh = [json.loads(line) for line in (tmp_path / "fam-fresh.jsonl").read_text().splitlines()]
    assert len(fresh) == len(shapes) and {r["scenario"] for r in fresh} == {"offline"}
    for row in s["shapes"]:
        assert row["fresh"]["speedup"] == row["offline"]["speedup"]      # the stand-in is deterministic
        assert row["best_name"] == "seed" or row["best_name"].split("/")[0] in ("cuda_ptx_sm80", "cute_sm80")
        # the winner was timed offline twice: once among the candidates, once on fresh samples
        offline_calls = [c for c in _Evaluator.calls if c[0] == ("offline",) and c[2] == tuple(row["shape"])
                         and c[1].startswith(row["best_hash"])]
        assert len(offline_calls) == 2
    assert sum(s["wins_by_family"].values()) == len(shapes)
    assert s["groups"]["unaligned"]["shapes"] == 1                       # M=100 is not a multiple of 8
    assert s["repeat_check"]["torch_fresh_over_selection"]["geomean"] == pytest.approx(1.0)
    assert s["overall_fresh_geomean_speedup"] == pytest.approx(s["overall_offline_geomean_speedup"])
    # a rerun measures nothing again, the fresh timings included
    calls = len(_Evaluator.calls)
    run_bench(cfg)
    assert len(_Evaluator.calls) == calls


def test_bench_family_flag_checks_backend_sweep_and_configs(capsys):
    from l2ir.cli import main

    for spec, why in (("cuda_ptx", "expected BACKEND=SWEEP"), ("nope=sm80", "unknown backend 'nope'"),
                      ("cute_sm80=sm80:missing", "unknown config(s) missing")):
        assert main(["bench", "--report-only", "--shapes", "0", "--shape", "64x64x64", "--family", spec,
                     "--out", "/tmp/x"]) != 0
        assert why in capsys.readouterr().err


def _bench_script(name: str):
    """bench/NAME.py as a module, with bench/ on sys.path as when the script runs from there (derive_families
    imports server_race, server_race sweep_cases, cold_terms_fit model_check)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _derive_module():
    return _bench_script("derive_families")


def _bench_run(folder, name, rows, evaluated):
    """A bench result prefix: the summary (shapes with winner and fresh times) and the evaluations' JSONL."""
    cls = "a=f16:row b=f16:col c=f16:row acc=f32"
    shapes = [{"shape": list(s), "best_name": f"cfg/{h}", "best_hash": h + "0" * 52,
               "fresh": {"speedup": x, "kernel_us": 10.0 / x, "torch_us": 10.0}} for s, h, x in rows]
    (folder / f"{name}.json").write_text(json.dumps({"problem_class": cls, "shapes": shapes, "environment": {}}))
    lines = [json.dumps({"problem": f"gemm m={m} n={n} k={k} {cls}", "kernel_hash": h + "0" * 52,
                         "scenario": "offline"})
             for (m, n, k), hs in evaluated.items() for h in hs]
    (folder / f"{name}.jsonl").write_text("\n".join(lines + ['{"cut by a kill']) + "\n")   # a killed run's last line
    return str(folder / name)


@pytest.mark.nvcc
def test_source_variants_race_an_earlier_commits_stored_sources(tmp_path, capsys):
    """--save-sources writes each case's source as lowered; --stored NAME=DIR in a later run races it as variant
    NAME beside what that run lowers (compile only here: both build, with the same registers when the lowering has
    not changed); a case the folder lacks is that row's error, and a --stored that names no folder exits 2."""
    probe = _bench_script("release_probe")
    case = "64x64x2048:cuda_ptx:ptx_splitk_cluster_w4x1_64x64x64_s8_st4"
    saved, out = tmp_path / "saved", tmp_path / "out.json"
    assert probe.main(["--case", case, "--compile-only", "--out", str(out), "--save-sources", str(saved)]) == 0
    (source,) = saved.iterdir()
    assert source.name == "64x64x2048_cuda_ptx_ptx_splitk_cluster_w4x1_64x64x64_s8_st4.cu"
    assert "st_async_f4" in source.read_text()
    assert probe.main(["--case", case, "--case", "128x128x16384:cuda_ptx:ptx_splitk_cluster_w4x1_64x64x64_s16",
                       "--compile-only", "--out", str(out), "--stored", f"earlier={saved}"]) == 0
    rows = {(r["shape"][0], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert "error" not in rows[(64, "earlier")] and rows[(64, "earlier")]["registers"] == rows[(64, "as_lowered")]["registers"]
    assert "no stored source" in rows[(128, "earlier")]["error"]
    assert probe.main(["--case", case, "--compile-only", "--out", str(out), "--stored", "earlier"]) == 2
    assert "expected NAME=DIR" in capsys.readouterr().err


def test_derive_families_replaces_a_row_only_where_the_later_run_raced_its_winner(tmp_path):
    """A later run's row replaces the base row of a shape only if the later run evaluated the base winner on that
    shape (one selection, not a best-of-runs pick); a shape outside the base set is ignored; the groups are
    recomputed from the rows kept."""
    derive = _derive_module()
    base = _bench_run(tmp_path, "base", [((64, 64, 64), "aaaaaaaaaaaa", 0.8), ((128, 4096, 4096), "bbbbbbbbbbbb", 0.7)],
                      {(64, 64, 64): ["aaaaaaaaaaaa"], (128, 4096, 4096): ["bbbbbbbbbbbb"]})
    later = _bench_run(tmp_path, "later",
                       [((64, 64, 64), "cccccccccccc", 1.2), ((128, 4096, 4096), "dddddddddddd", 1.5),
                        ((8, 8, 8), "eeeeeeeeeeee", 3.0)],
                       {(64, 64, 64): ["aaaaaaaaaaaa", "cccccccccccc"], (128, 4096, 4096): ["dddddddddddd"],
                        (8, 8, 8): ["eeeeeeeeeeee"]})
    out = derive.derive([base, later])
    assert [r["shape"] for r in out["replaced"]] == [[64, 64, 64]]
    speeds = {tuple(r["shape"]): r["fresh"]["speedup"] for r in out["rows"]}
    assert speeds == {(64, 64, 64): 1.2, (128, 4096, 4096): 0.7}
    assert out["fresh_by_regime"]["< 1 GFLOP"]["fresh_geomean_speedup"] == pytest.approx(1.2)
    assert out["below_0.9x"]["1-100 GFLOP"] == [[[128, 4096, 4096], 0.7]]
    # Bad input: a clear one-line error naming the file, exit status 2.
    assert derive.main([str(tmp_path / "missing"), "--out", str(tmp_path / "o.json")]) == 2
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(derive.DeriveError, match=r"bad\.json: not JSON"):
        derive.derive([str(tmp_path / "bad")])


def test_derive_families_ceiling_adds_each_dram_bound_shapes_stream_ceiling(tmp_path):
    """--ceiling: each DRAM-bound row gets the stream kernel's time and the share of it the winner reaches (the
    winner's time over the ceiling's, not the roofline floor's); a file that is not the probe's output is a
    DeriveError naming it."""
    derive = _derive_module()
    shape = (128, 4096, 16384)
    base = _bench_run(tmp_path, "base", [(shape, "bbbbbbbbbbbb", 0.5)], {shape: ["bbbbbbbbbbbb"]})
    summary = json.loads((tmp_path / "base.json").read_text())
    summary["environment"] = {"gpu": "NVIDIA H200"}        # the roofline's ceilings are the H200's
    (tmp_path / "base.json").write_text(json.dumps(summary))
    out = derive.derive([base])
    (row,) = out["groups"]["dram_bound"]["rows"]
    kernel_us = row["floor_us"] / row["kernel_share"]
    assert kernel_us == pytest.approx(20.0, rel=1e-4)     # 10 us of torch / 0.5x (floor_us is rounded)
    ceiling = tmp_path / "ceiling.json"
    ceiling.write_text(json.dumps({"rows": [{"shape": list(shape), "ceiling_us": 16.0},
                                            {"shape": [1, 2, 3], "ceiling_us": 1.0}]}))
    derive.add_ceiling(out, ceiling)
    (row,) = out["groups"]["dram_bound"]["rows"]
    assert row["ceiling_us"] == 16.0
    assert row["kernel_share_of_ceiling"] == pytest.approx(16.0 / kernel_us)
    assert row["ceiling_share"] == pytest.approx(row["floor_us"] / 16.0)
    assert out["groups"]["dram_bound"]["median_kernel_share_of_ceiling"] == pytest.approx(16.0 / kernel_us)
    ceiling.write_text(json.dumps({"shapes": []}))
    with pytest.raises(derive.DeriveError, match=r"ceiling\.json: not a dram_ceiling_probe output"):
        derive.add_ceiling(out, ceiling)


def _server_race_module():
    return _bench_script("server_race")


def test_server_race_takes_the_best_passing_offline_candidates_and_always_the_winner(tmp_path):
    """Per derived row: the --top kernels of the row's own run by offline speedup, counting only records that
    passed every gate and each kernel once (its best record), and the offline winner among them even where a
    kernel ranked above it; the groups report the fresh server speedups by regime and name the shapes below
    0.9x; a derived file whose run lacks a kernel's IR is a one-line error naming the run."""
    race = _server_race_module()
    from l2ir.seed import seed
    from l2ir.text import parse_problem, print_kernel

    cls = "a=f16:row b=f16:col c=f16:row acc=f32"
    shape = (64, 64, 64)
    ptext = f"gemm m=64 n=64 k=64 {cls}"
    kernel_text = print_kernel(seed(parse_problem(ptext), "sm80"))
    ok = [{"name": "accuracy", "passed": True}]
    recs = [("a" * 12, 1.3, ok), ("b" * 12, 1.5, [{"name": "ulp", "passed": False}]),   # fastest, but failed a gate
            ("c" * 12, 1.2, ok), ("c" * 12, 1.25, ok), ("d" * 12, 1.1, ok), ("w" * 12, 1.0, ok)]
    lines = [json.dumps({"problem": ptext, "kernel_hash": h + "0" * 52, "scenario": "offline", "speedup": x,
                         "verdicts": v, "errors": []}) for h, x, v in recs]
    (tmp_path / "run.jsonl").write_text("\n".join(lines) + "\n")
    kernels = {h: {"config": f"fam/{h[0]}", "backend": "fam", "kernel": kernel_text} for h in
               ("a" * 12, "b" * 12, "c" * 12, "d" * 12, "w" * 12)}
    (tmp_path / "run.json").write_text(json.dumps({"problem_class": cls, "kernels": kernels, "shapes": [
        {"shape": list(shape), "best_hash": "w" * 12, "best_name": "fam/w"}]}))
    derived = tmp_path / "derived.json"
    derived.write_text(json.dumps({"problem_class": cls, "rows": [
        {"shape": list(shape), "source": "run", "winner": "fam/w", "fresh": {"speedup": 1.05}}]}))
    pclass, (entry,) = race.race_entries(derived, 3)
    assert pclass == cls
    assert [(c["hash"][0], c["offline_speedup"]) for c in entry["candidates"]] == [("a", 1.3), ("c", 1.25), ("w", 1.0)]
    assert entry["candidates"][-1]["name"] == "fam/w" and entry["candidates"][0]["backend"] == "fam"
    _, (entry,) = race.race_entries(derived, 1, [((64, 64, 64), "cuda_ptx_sm80", "ptx_sm80_64x64x32_w2x2_s3"),
                                                 ((128, 128, 128), "cuda_ptx_sm80", "ptx_sm80_64x64x32_w2x2_s3")])
    assert [c["hash"][0] for c in entry["candidates"][:1]] == ["w"]
    assert entry["candidates"][1]["name"] == "cuda_ptx_sm80/ptx_sm80_64x64x32_w2x2_s3"
    assert entry["candidates"][1]["backend"] == "cuda_ptx_sm80" and entry["candidates"][1]["offline_speedup"] is None
    with pytest.raises(race.RaceError, match=r"--case 64x64x64:cuda_ptx_sm80:nope: no configuration 'nope'"):
        race.race_entries(derived, 1, [((64, 64, 64), "cuda_ptx_sm80", "nope")])
    groups = race.group_summary([{"shape": [64, 64, 64], "fresh_server": {"speedup": 1.2}},
                                 {"shape": [63, 64, 64], "fresh_server": {"speedup": 0.8}},
                                 {"shape": [128, 4096, 4096]}])
    assert groups["< 1 GFLOP"]["timed"] == 2 and groups["< 1 GFLOP"]["fresh_min_speedup"] == 0.8
    assert groups["< 1 GFLOP"]["below_0.9x"] == [[[63, 64, 64], 0.8]]
    assert groups["1-100 GFLOP"] == {"shapes": 1, "timed": 0, "fresh_geomean_speedup": None,
                                     "fresh_min_speedup": None, "below_0.9x": []}
    assert groups["unaligned"]["timed"] == 1
    del kernels["a" * 12]
    (tmp_path / "run.json").write_text(json.dumps({"problem_class": cls, "kernels": kernels, "shapes": []}))
    with pytest.raises(race.RaceError, match=r"run\.json: kernel aaaaaaaaaaaa .* not in its 'kernels' section"):
        race.race_entries(derived, 3)
    assert race.main(["--derived", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")]) == 2


def test_derive_families_server_adds_each_rows_server_winner_and_the_groups(tmp_path):
    """--server: a row the race timed gets its server winner and fresh server times, a row it did not time gets
    none, and the race's groups come along; a file that is not the race's output is a DeriveError naming it."""
    derive = _derive_module()
    base = _bench_run(tmp_path, "base", [((64, 64, 64), "aaaaaaaaaaaa", 1.1), ((64, 64, 128), "bbbbbbbbbbbb", 1.0)],
                      {(64, 64, 64): ["aaaaaaaaaaaa"], (64, 64, 128): ["bbbbbbbbbbbb"]})
    out = derive.derive([base])
    server = tmp_path / "server.json"
    groups = {"< 1 GFLOP": {"shapes": 2, "timed": 1, "fresh_geomean_speedup": 0.95, "fresh_min_speedup": 0.95,
                            "below_0.9x": []}}
    server.write_text(json.dumps({"scenario": "server", "groups": groups, "rows": [
        {"shape": [64, 64, 64], "server_winner": "cfg/x", "fresh_server": {"speedup": 0.95}},
        {"shape": [64, 64, 128], "server_winner": "cfg/y"}]}))
    derive.add_server(out, server)
    rows = {tuple(r["shape"]): r for r in out["rows"]}
    assert rows[(64, 64, 64)]["server_winner"] == "cfg/x" and rows[(64, 64, 64)]["fresh_server"]["speedup"] == 0.95
    assert "fresh_server" not in rows[(64, 64, 128)]
    assert out["server"]["groups"] == groups
    server.write_text(json.dumps({"rows": []}))
    with pytest.raises(derive.DeriveError, match=r"server\.json: not a server_race output"):
        derive.add_server(out, server)


def test_derive_families_refuses_numbers_from_another_card(tmp_path):
    """A later run, a ceiling or a server race measured on another GPU than the base run is a DeriveError naming
    the file and both cards; a file that does not name its GPU passes."""
    derive = _derive_module()
    shape = (64, 64, 64)
    base = _bench_run(tmp_path, "base", [(shape, "aaaaaaaaaaaa", 1.0)], {shape: ["aaaaaaaaaaaa"]})
    later = _bench_run(tmp_path, "later", [(shape, "bbbbbbbbbbbb", 1.2)], {shape: ["aaaaaaaaaaaa"]})
    for name, gpu in (("base", "NVIDIA H200"), ("later", "NVIDIA H100 80GB HBM3")):
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        summary["environment"] = {"gpu": gpu}
        (tmp_path / f"{name}.json").write_text(json.dumps(summary))
    with pytest.raises(derive.DeriveError, match=r"later\.json: measured on an NVIDIA H100 80GB HBM3, the base run "
                                                 r"on an NVIDIA H200"):
        derive.derive([base, later])
    out = derive.derive([base])
    race = {"scenario": "server", "groups": {}, "rows": [{"shape": list(shape), "server_winner": "cfg/x",
                                                          "fresh_server": {"speedup": 1.1}}]}
    server = tmp_path / "server.json"
    server.write_text(json.dumps(dict(race, environment={"gpu": "NVIDIA H100 80GB HBM3"})))
    with pytest.raises(derive.DeriveError, match=r"server\.json: measured on an NVIDIA H100"):
        derive.add_server(out, server)
    server.write_text(json.dumps(race))
    derive.add_server(out, server)
    assert out["rows"][0]["fresh_server"]["speedup"] == 1.1
    ceiling = tmp_path / "ceiling.json"
    ceiling.write_text(json.dumps({"environment": {"gpu": "NVIDIA H100 80GB HBM3"}, "rows": []}))
    with pytest.raises(derive.DeriveError, match=r"ceiling\.json: measured on an NVIDIA H100"):
        derive.add_ceiling(out, ceiling)


def test_derive_families_later_server_race_replaces_its_rows_win_or_lose(tmp_path):
    """Two --server files: the later one's rows replace the earlier's for the shapes it raced, a slower fresh
    number too (no best-of-two-fresh-reports pick), a shape it raced without a fresh time loses its numbers, the
    rest keep the earlier's; the groups are recomputed from the rows kept."""
    derive = _derive_module()
    shapes = [(64, 64, 64), (64, 64, 128), (128, 64, 64)]
    base = _bench_run(tmp_path, "base", [(s, h * 12, 1.0) for s, h in zip(shapes, "abc")],
                      {s: [h * 12] for s, h in zip(shapes, "abc")})
    out = derive.derive([base])
    first, later = tmp_path / "first.json", tmp_path / "later.json"
    first.write_text(json.dumps({"scenario": "server", "groups": {}, "rows": [
        {"shape": list(s), "server_winner": f"cfg/{h}", "fresh_server": {"speedup": x}}
        for s, h, x in zip(shapes, "abc", (1.2, 1.0, 0.95))]}))
    later.write_text(json.dumps({"scenario": "server", "groups": {}, "rows": [
        {"shape": [64, 64, 64], "server_winner": "cfg/z", "fresh_server": {"speedup": 1.1}},
        {"shape": [128, 64, 64], "server_winner": "cfg/y", "fresh_failure": "ulp gate"}]}))
    derive.add_server(out, first, later)
    rows = {tuple(r["shape"]): r for r in out["rows"]}
    assert rows[(64, 64, 64)]["server_winner"] == "cfg/z" and rows[(64, 64, 64)]["fresh_server"]["speedup"] == 1.1
    assert rows[(64, 64, 64)]["server_source"] == "later.json"
    assert rows[(64, 64, 128)]["fresh_server"]["speedup"] == 1.0 and rows[(64, 64, 128)]["server_source"] == "first.json"
    assert "fresh_server" not in rows[(128, 64, 64)] and "server_winner" not in rows[(128, 64, 64)]
    g = out["server"]["groups"]["< 1 GFLOP"]
    assert (g["shapes"], g["timed"]) == (3, 2)
    assert g["fresh_geomean_speedup"] == pytest.approx((1.1 * 1.0) ** 0.5)
    assert out["server"]["source"] == "first.json, later.json"


def test_server_race_sweeps_add_the_models_fastest_admitted_configs_to_the_raced_shapes(tmp_path):
    """--sweep SWEEP:N: each raced shape gets the N configurations of the sweep the verifier admits for it, in the
    cost model's order (a configuration the shape's rules refuse is never picked); --shape races only those rows;
    an unknown sweep, a malformed SWEEP:N or a --shape outside the derivation is a one-line error."""
    race = _server_race_module()
    from l2ir.search.gates import admits
    from l2ir.search.standin import kernel_time_us
    from l2ir.search.sweeps import load_sweep

    from l2ir.nodes import Problem

    cls = "a=f16:row b=f16:col c=f16:row acc=f32"
    shapes = [(64, 64, 64), (100, 3000, 4104)]
    (tmp_path / "run.jsonl").write_text("")
    (tmp_path / "run.json").write_text(json.dumps({"problem_class": cls, "kernels": {}, "shapes": []}))
    derived = tmp_path / "derived.json"
    derived.write_text(json.dumps({"problem_class": cls, "rows": [
        {"shape": list(s), "source": "run", "winner": "seed", "fresh": {"speedup": 1.0}} for s in shapes]}))
    sweep = load_sweep("cuda_ptx_sm80")
    for shape in shapes:
        picks = race.modelled_configs("cuda_ptx_sm80", shape, 4)
        problem = Problem(*shape)
        assert len(picks) == 4 and all(admits(sweep[c], problem)[0] for c in picks)
        times = [kernel_time_us(sweep[c], problem) for c in picks]
        assert times == sorted(times)
        refused = [c for c, k in sweep.items() if not admits(k, problem)[0]]
        assert all(kernel_time_us(sweep[c], problem) >= times[-1] for c in sweep
                   if c not in picks and c not in refused)
    assert race.modelled_configs("cuda_ptx_sm80", (64, 64, 64), 4) != race.modelled_configs(
        "cuda_ptx_sm80", (100, 3000, 4104), 4)
    _, entries = race.race_entries(derived, 3, sweeps=[("cuda_ptx_sm80", 2), ("cuda_ptx_direct", 1)],
                                   shapes={(100, 3000, 4104)})
    (entry,) = entries
    assert entry["shape"] == [100, 3000, 4104]
    assert [c["name"] for c in entry["candidates"]] == (
        [f"cuda_ptx_sm80/{c}" for c in race.modelled_configs("cuda_ptx_sm80", (100, 3000, 4104), 2)]
        + [f"cuda_ptx_direct/{c}" for c in race.modelled_configs("cuda_ptx_direct", (100, 3000, 4104), 1)])
    assert all(c["offline_speedup"] is None for c in entry["candidates"])
    with pytest.raises(race.RaceError, match=r"--sweep: unknown sweep 'nope'"):
        race.race_entries(derived, 3, sweeps=[("nope", 2)])
    out = str(tmp_path / "o")
    assert race.main(["--derived", str(derived), "--shape", "8x8x8", "--standin", "--out", out]) == 2
    with pytest.raises(SystemExit):
        race.main(["--derived", str(derived), "--sweep", "cuda_ptx_sm80", "--out", out])
    with pytest.raises(SystemExit):
        race.main(["--derived", str(derived), "--sweep", "cuda_ptx_sm80:0", "--out", out])


def _race_fixture(tmp_path):
    """A derivation of two shapes whose bench run holds the sm80 and sm90a seeds (offline 1.0x and 1.1x)."""
    from l2ir.seed import seed
    from l2ir.text import parse_problem, print_kernel

    cls = "a=f16:row b=f16:col c=f16:row acc=f32"
    rows, lines, kernels, shapes = [], [], {}, []
    for (m, n, k) in ((64, 64, 64), (1024, 1024, 1024)):
        problem = parse_problem(f"gemm m={m} n={n} k={k} {cls}")
        for i, target in enumerate(("sm80", "sm90a")):
            kern = seed(problem, target)
            h = kern.content_hash()[:12]
            kernels[h] = {"config": f"seed_{target}", "backend": None, "kernel": print_kernel(kern)}
            lines.append(json.dumps({"problem": f"gemm m={m} n={n} k={k} {cls}", "kernel_hash": h + "0" * 52,
                                     "scenario": "offline", "speedup": 1.0 + i / 10, "errors": [],
                                     "verdicts": [{"name": "accuracy", "passed": True}]}))
        shapes.append({"shape": [m, n, k], "best_hash": h, "best_name": "seed_sm90a"})
        rows.append({"shape": [m, n, k], "source": "run", "winner": "seed_sm90a", "fresh": {"speedup": 1.1}})
    (tmp_path / "run.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "run.json").write_text(json.dumps({"problem_class": cls, "kernels": kernels, "shapes": shapes}))
    (tmp_path / "derived.json").write_text(json.dumps({"problem_class": cls, "rows": rows}))


def test_server_race_runs_end_to_end_on_the_standin_and_resumes(tmp_path, capsys, monkeypatch):
    """--standin: every candidate is timed in the server scenario (selection file), the best re-timed on fresh
    samples (fresh file), the summary names the server winner; a rerun measures nothing new. The summary's
    environment is the one the evaluator learns on its first call (the GPU evaluator's worker reports it then)."""
    race = _server_race_module()
    from l2ir.search.standin import StandinEvaluator

    init, evaluate = StandinEvaluator.__init__, StandinEvaluator.evaluate

    def late_init(self, *a, **kw):
        init(self, *a, **kw)
        self._env, self.environment = self.environment, {}

    def first_call_learns(self, *a, **kw):
        self.environment = self._env
        return evaluate(self, *a, **kw)

    monkeypatch.setattr(StandinEvaluator, "__init__", late_init)
    monkeypatch.setattr(StandinEvaluator, "evaluate", first_call_learns)
    _race_fixture(tmp_path)
    argv = ["--derived", str(tmp_path / "derived.json"), "--top", "2", "--standin", "--out", str(tmp_path / "race")]
    assert race.main(argv) == 0
    out = json.loads((tmp_path / "race.json").read_text())
    assert out["environment"]["standin"] is True
    assert [len(r["candidates"]) for r in out["rows"]] == [2, 2]
    for r in out["rows"]:
        speeds = {c["name"]: c["server_speedup"] for c in r["candidates"]}
        assert r["server_winner"] == max(speeds, key=speeds.get)
        assert r["fresh_server"]["speedup"] > 0
    assert out["groups"]["< 1 GFLOP"]["timed"] == 1 and out["groups"]["1-100 GFLOP"]["timed"] == 1
    selection = (tmp_path / "race.jsonl").read_text().splitlines()
    fresh = (tmp_path / "race-fresh.jsonl").read_text().splitlines()
    assert (len(selection), len(fresh)) == (4, 2)
    assert race.main(argv) == 0                       # resumed: every measurement is reused
    assert len((tmp_path / "race.jsonl").read_text().splitlines()) == 4
    assert json.loads((tmp_path / "race.json").read_text())["environment"] == out["environment"]   # from the records
    assert "server fresh geomean" in capsys.readouterr().out
    # The summary names every raced kernel's IR, so the records DB gets them with the race's records.
    from l2ir.search.db import open_db

    db = open_db(tmp_path / "records.db")
    assert db.import_jsonl(tmp_path / "race.jsonl") == 4 and db.import_jsonl(tmp_path / "race-fresh.jsonl") == 2
    raced = {c["hash"] for r in out["rows"] for c in r["candidates"]}
    assert set(out["kernels"]) == raced
    for rec in selection + fresh:
        h = json.loads(rec)["kernel_hash"]
        assert db.kernel(h)["ir"] == out["kernels"][h[:12]]["kernel"]


def test_server_race_winner_is_the_fastest_steady_candidate_unless_every_one_is_bimodal():
    """A kernel at 59 or 80 us by turns loses the race to a steady slower one; among candidates that are all bimodal
    the fastest still wins; a 5 us kernel whose samples straddle the timer's grid is steady; a candidate without
    stats counts as steady."""
    race = _server_race_module()
    from l2ir.search.timing import summarize

    def entry(name, speedup, samples):
        return {"name": name, "server_speedup": speedup, **race.kernel_spread({"kernel_stats": summarize(samples)})}, {}

    fast = entry("fast", 0.94, [59, 59, 60, 60, 60, 60, 60, 60, 60, 61, 80, 81, 81, 83, 80])
    slow = entry("slow", 0.79, [70, 71, 72, 71, 70, 72, 71, 73, 70, 71])
    assert not race.steady(fast[0]) and race.steady(slow[0])
    assert race.server_winner([fast, slow])[0]["name"] == "slow"
    assert race.server_winner([fast])[0]["name"] == "fast"
    tiny = entry("tiny", 1.2, [4.5, 5.25, 4.5, 5.25, 5.5, 4.5, 5.25, 5.5, 4.5, 5.0])
    assert tiny[0]["kernel_iqr_us"] > race.BIMODAL_IQR_SHARE * tiny[0]["kernel_median_us"]
    assert race.steady(tiny[0]) and race.server_winner([slow, tiny])[0]["name"] == "tiny"
    unknown = ({"name": "unknown", "server_speedup": 0.80, **race.kernel_spread({})}, {})
    assert race.server_winner([fast, slow, unknown])[0]["name"] == "unknown"
    assert race.server_winner([]) is None


def test_server_race_winner_discounts_the_gpus_noise_and_a_slowed_baseline():
    """A kernel spread that torch's in the same rounds matches is the GPU's moment, not bimodality; a candidate whose
    torch rounds ran 40% slower than the shape's usual does not win on the speedup that bought it."""
    race = _server_race_module()
    from l2ir.search.timing import summarize

    def entry(name, speedup, kernel, torch):
        rec = {"kernel_stats": summarize(kernel), "baseline_stats": summarize(torch)}
        return {"name": name, "server_speedup": speedup, **race.kernel_spread(rec)}, {}

    noisy = [59, 60, 60, 61, 70, 72, 80, 81, 59, 60]
    noisy_gpu = entry("noisy_gpu", 1.0, noisy, [58, 59, 60, 61, 70, 71, 79, 80, 59, 60])
    bimodal = entry("bimodal", 1.0, noisy, [60, 60, 61, 60, 60, 61, 60, 60, 61, 60])
    assert race.steady(noisy_gpu[0]) and not race.steady(bimodal[0])
    honest = [entry(f"honest{i}", 1.0 + i / 100, [50] * 10, [50 + i] * 10) for i in range(3)]
    slowed = entry("slowed", 1.4, [50] * 10, [70] * 10)
    assert race.server_winner(honest + [slowed])[0]["name"] == "honest2"


def test_server_aa_times_torch_against_itself_per_shape_and_group_on_the_host(tmp_path, capsys):
    """--cpu: every shape of --rows (below --max-gflop) and --shape gets --trials ratios, each a median over the
    bench's server rounds; groups take one geomean per trial; bad input is a one-line error and exit 2."""
    aa = _bench_script("server_aa")
    rows = tmp_path / "derived.json"
    rows.write_text(json.dumps({"rows": [{"shape": [16, 24, 8]}, {"shape": [4096, 4096, 4096]}]}))
    out = tmp_path / "aa.json"
    assert aa.main(["--rows", str(rows), "--shape", "9x16x32", "--trials", "2", "--cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["shape"] for r in res["rows"]] == [[9, 16, 32], [16, 24, 8]]       # 4096^3 is above 100 GFLOP
    assert all(len(r["ratios"]) == 2 and all(x > 0 for x in r["ratios"]) for r in res["rows"])
    assert all(len(r["second_over_first"]) == 2 and all(x > 0 for x in r["second_over_first"]) for r in res["rows"])
    g = res["groups"]["< 1 GFLOP"]
    assert g["shapes"] == 2 and len(g["trial_geomeans"]) == 2
    assert g["trial_geomeans"][1] == pytest.approx(math.sqrt(res["rows"][0]["ratios"][1] * res["rows"][1]["ratios"][1]))
    assert res["groups"]["unaligned"]["shapes"] == 1 and res["environment"]["cpu_check"] is True
    assert "A/A geomean" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert aa.main(["--rows", str(tmp_path / "bad.json"), "--cpu", "--out", str(out)]) == 2
    assert aa.main(["--shape", "8x8x8", "--trials", "0", "--cpu", "--out", str(out)]) == 2
    assert "--trials 0" in capsys.readouterr().err
    from l2ir.search import timing

    balanced = timing.kernel_first_orders
    assert aa.main(["--shape", "8x8x8", "--trials", "1", "--coin", "--cpu", "--out", str(out)]) == 0
    assert "by a coin" in json.loads(out.read_text())["scenario"] and timing.kernel_first_orders is balanced


def test_server_rounds_lead_with_each_side_equally_often_in_a_seeded_shuffle():
    """Balanced orders: each side first in half the rounds (the odd one drawn), shuffled by the seed; the same seed
    gives the same order; without an rng the sides alternate. time_server records the order it used."""
    import numpy as np
    from l2ir.search import timing

    for seed in range(40):
        for rounds in (15, 16):
            orders = timing.kernel_first_orders(np.random.default_rng(seed), rounds)
            assert len(orders) == rounds and rounds // 2 <= sum(orders) <= (rounds + 1) // 2
    same = [timing.kernel_first_orders(np.random.default_rng(3), 15) for _ in range(2)]
    assert same[0] == same[1]
    assert len({tuple(timing.kernel_first_orders(np.random.default_rng(s), 16)) for s in range(20)}) > 10
    assert timing.kernel_first_orders(None, 4) == [True, False, True, False]
    assert {sum(timing.kernel_first_orders(np.random.default_rng(s), 15)) for s in range(20)} == {7, 8}
    calls = []
    cfg = timing.TimingConfig(server_samples=16, warmup=0)
    t = timing.time_server(lambda i: calls.append("k"), lambda i: calls.append("b"), 2, cfg,
                           rng=np.random.default_rng(5), clock=timing.HostClock(cfg))
    assert sum(t.kernel_first) == 8 and len(t.kernel_us) == len(t.baseline_us) == 16
    timed = calls[-32:]
    assert [timed[2 * r] == "k" for r in range(16)] == t.kernel_first


def test_server_race_fresh_trials_report_the_median_trial_and_resume(tmp_path):
    """--fresh-trials 3: each winner re-timed in three fresh files (OUT-fresh, OUT-t2-fresh, OUT-t3-fresh), the row
    reports the trial with the median speedup and every trial's; a rerun measures nothing new."""
    race = _server_race_module()
    _race_fixture(tmp_path)
    argv = ["--derived", str(tmp_path / "derived.json"), "--top", "2", "--standin", "--fresh-trials", "3",
            "--out", str(tmp_path / "race")]
    assert race.main(argv) == 0
    out = json.loads((tmp_path / "race.json").read_text())
    for r in out["rows"]:
        trials = r["fresh_server"]["trial_speedups"]
        assert len(trials) == 3 and r["fresh_server"]["speedup"] == sorted(trials)[1]
    names = ("race-fresh.jsonl", "race-t2-fresh.jsonl", "race-t3-fresh.jsonl")
    sizes = [len((tmp_path / n).read_text().splitlines()) for n in names]
    assert sizes == [2, 2, 2]
    assert race.main(argv) == 0
    assert [len((tmp_path / n).read_text().splitlines()) for n in names] == sizes
    assert race.median_trial([{"speedup": 1.0}, {"speedup": 0.9}])["speedup"] == 0.9     # even: the lower
    odd = race.median_trial([{"speedup": 1.2, "kernel_us": 5.0}, {"speedup": 0.8, "kernel_us": 7.5},
                             {"speedup": 1.0, "kernel_us": 6.0}])
    assert (odd["speedup"], odd["kernel_us"], odd["trial_speedups"]) == (1.0, 6.0, [1.2, 0.8, 1.0])
    with pytest.raises(SystemExit):
        race.main(argv[:-2] + ["--fresh-trials", "0", "--out", str(tmp_path / "race")])


def test_server_race_carry_brings_an_earlier_races_winner_and_runner_up(tmp_path, capsys):
    """--carry RACE.json: a race with --top 1 still races the earlier race's winner and runner-up on each shape
    (their IR from its 'kernels'), each kernel once; a file that is not a race summary is a one-line error."""
    race = _server_race_module()
    _race_fixture(tmp_path)
    first = ["--derived", str(tmp_path / "derived.json"), "--top", "2", "--standin", "--out", str(tmp_path / "a")]
    assert race.main(first) == 0
    earlier = json.loads((tmp_path / "a.json").read_text())
    second = ["--derived", str(tmp_path / "derived.json"), "--top", "1", "--standin", "--carry",
              str(tmp_path / "a.json"), "--out", str(tmp_path / "b")]
    assert race.main(second) == 0
    later = json.loads((tmp_path / "b.json").read_text())
    for old, new in zip(earlier["rows"], later["rows"]):
        names = [c["name"] for c in new["candidates"]]
        assert len(names) == len(set(names)) == 2 and old["server_winner"] in names
        assert {c["hash"] for c in new["candidates"]} == {c["hash"] for c in old["candidates"]}
    only_top1 = ["--derived", str(tmp_path / "derived.json"), "--top", "1", "--standin", "--out", str(tmp_path / "c")]
    assert race.main(only_top1) == 0
    assert [len(r["candidates"]) for r in json.loads((tmp_path / "c.json").read_text())["rows"]] == [1, 1]
    capsys.readouterr()
    assert race.main(second[:-2] + ["--carry", str(tmp_path / "derived.json"), "--out", str(tmp_path / "d")]) == 2
    assert "not a server_race summary" in capsys.readouterr().err


def test_model_check_ranks_a_races_candidates_against_the_stand_in(tmp_path, capsys):
    """Spearman per shape between the stand-in's times and the measured medians: +1 when the measurement orders
    the kernels as the model does, -1 when reversed; ties share a rank; a race without medians is an error."""
    check = _bench_script("model_check")
    from l2ir.search.standin import kernel_time_us
    from l2ir.search.sweeps import load_sweep

    from l2ir.nodes import Problem
    from l2ir.text import print_kernel

    shape = (1024, 1024, 1024)
    by_time = {}
    for k in load_sweep("cuda_ptx").values():             # four kernels the model tells apart
        by_time.setdefault(kernel_time_us(k, Problem(*shape)), k)
    kernels = list(by_time.values())[:4]
    model = [kernel_time_us(k, Problem(*shape)) for k in kernels]
    assert len(set(model)) == 4
    section = {k.content_hash()[:12]: {"kernel": print_kernel(k)} for k in kernels}

    def race(medians):
        cands = [{"name": f"k{i}", "hash": k.content_hash()[:12], "kernel_median_us": m}
                 for i, (k, m) in enumerate(zip(kernels, medians))]
        return {"rows": [{"shape": list(shape), "candidates": cands}], "kernels": section}

    same = check.check(race(model))
    assert same["rows"][0]["spearman"] == pytest.approx(1.0) and same["model_fastest_is_measured_fastest"] == [1, 1]
    reversed_ = check.check(race([-t for t in model]))
    assert reversed_["rows"][0]["spearman"] == pytest.approx(-1.0)
    assert reversed_["model_fastest_is_measured_fastest"] == [0, 1]
    assert list(check.ranks([3.0, 1.0, 3.0])) == [2.5, 1.0, 2.5]
    (tmp_path / "old.json").write_text(json.dumps(race([None] * 4)))
    assert check.main([str(tmp_path / "old.json")]) == 2
    assert "no row has 3 candidates" in capsys.readouterr().err


def test_cold_terms_fit_recovers_known_terms_and_scores_per_shape():
    """Relative least squares recovers the coefficients that made the data; per-shape Spearman is taken over each
    shape's kernels (a kernel's repeated records averaged), shapes of fewer than 3 kernels left out."""
    import numpy as np

    fit = _bench_script("cold_terms_fit")
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(40), rng.uniform(5, 50, 40), rng.integers(0, 2, 40)])
    y = x @ np.array([3.0, 0.9, 5.0])
    assert np.allclose(fit.fit(x, y), [3.0, 0.9, 5.0])
    rows = [((1, 1, 1), f"k{i}", None, t) for i, t in enumerate([1.0, 2.0, 3.0, 4.0])]
    rows += [((1, 1, 1), "k0", None, 1.2), ((2, 2, 2), "a", None, 1.0), ((2, 2, 2), "b", None, 2.0)]
    scores = fit.shape_spearman(rows, [4.0, 3.0, 2.0, 1.0, 4.0, 1.0, 2.0])
    assert list(scores) == [(1, 1, 1)] and scores[(1, 1, 1)] == pytest.approx(-1.0)


def test_standin_stream_k_fills_the_sms_with_a_fractional_wave_and_pays_its_fixup():
    """Stream-K over fewer tiles than SMs shares every tile's k iterations among all SMs, so a long-K shape of 47
    tiles runs in about 47/132 of the data-parallel kernel's time, plus the fixup of the tiles that span SMs; with
    a whole number of waves of tiles no tile is split and no fixup is paid."""
    from l2ir.search.standin import SMS, kernel_time_us
    from l2ir.search.sweeps import load_sweep

    from l2ir.nodes import Problem, SplitK

    stream = load_sweep("sm90a_skinny")["coop_128x64x64_c1x1_streamk"]
    plain = stream.replace(splitk=None)
    skinny = Problem(100, 3000, 16384)                          # 47 tiles of 128x64
    assert kernel_time_us(stream, skinny) < 0.6 * kernel_time_us(plain, skinny)
    whole = Problem(128 * 2, 64 * SMS // 2, 16384)               # exactly one wave of tiles: nothing split
    assert kernel_time_us(stream, whole) == pytest.approx(kernel_time_us(plain, whole) * 1.06, rel=0.02)
    assert stream.splitk == SplitK("stream_k")


def test_package_check_refuses_a_folder_without_a_table_and_a_table_without_f16_shapes(tmp_path, capsys):
    """bench/package_check.py's input errors: one line naming the folder, exit 2, before any GPU work."""
    check = _bench_script("package_check")

    def run(*extra):
        code = check.main(["--package", str(tmp_path / "pkg"), "--out", str(tmp_path / "o.json"), *extra])
        return code, capsys.readouterr().err

    code, err = run()                                                  # no folder at all
    assert code == 2 and "no readable table.json" in err
    (tmp_path / "pkg").mkdir()
    for bad in ("{not json", json.dumps({"scenario": "server"}), json.dumps({"entries": [{"m": 1}]})):
        (tmp_path / "pkg" / "table.json").write_text(bad)
        code, err = run()
        assert code == 2 and "no readable table.json" in err and len(err.strip().splitlines()) == 1, err
    row = {"m": 64, "n": 64, "k": 64, "problem_class": "a=f16:row b=f16:row c=f16:row acc=f32"}
    (tmp_path / "pkg" / "table.json").write_text(json.dumps({"scenario": "server", "entries": [row]}))
    code, err = run()
    assert code == 2 and "no tuned f16 row x col shape" in err
    row["problem_class"] = "a=f16:row b=f16:col c=f16:row acc=f32"
    (tmp_path / "pkg" / "table.json").write_text(json.dumps({"scenario": "server", "entries": [row]}))
    code, err = run("--shape", "128x64x64")
    assert code == 2 and "no tuned shape 128x64x64" in err
    assert not (tmp_path / "o.json").exists()


def test_placement_probe_instruments_the_split_k_kernel_it_studies():
    """bench/placement_probe.py edits the generated source: the entry record must land inside the kernel, before its
    first statement, the exit record be the kernel's last statement (after the final cluster barrier, if any), with
    the device array declared before the kernel and the read-out after; a source without the kernel, or a kernel
    with an early return (which would skip the exit record), is refused in one line."""
    probe = _bench_script("placement_probe")
    from sweep_cases import lower_case

    for config in ("ptx_splitk_w4x1_64x256x64_s2", "ptx_splitk_w4x1_64x256x64_s2_c2x1"):
        _, _, plan = lower_case((512, 2048, 16384), "cuda_ptx", config)
        src = probe.instrumented(plan.source)
        entry = src.index(probe.ENTRY)
        body = src.index("{", entry)
        assert src.index(probe.BUFFER) < entry < body < src.index("%%smid") < src.index("extern __shared__", body)
        end = probe._body_end(src, body)
        assert src.index(probe.EXIT) + len(probe.EXIT) == end            # nothing after it but the closing brace
        assert src.rfind("cluster_sync();", body, end) < src.index(probe.EXIT) and "%%clock64" in src[body:end]
        assert src.rstrip().endswith("}") and src.index("l2ir_probe_read") > src.index("int l2ir_run(")
        assert src.count("placement_probe") == 4
    with pytest.raises(ValueError, match="one exit"):
        probe.instrumented(plan.source.replace("  const int tiles_m", "  if (M == 0) return;\n  const int tiles_m", 1))
    with pytest.raises(ValueError, match="no longer applies"):
        probe.instrumented("__global__ void other() {}")


def test_launch_bounds_probe_bounds_the_kernel_and_ptxas_answers(tmp_path, capsys):
    """bench/launch_bounds_probe.py promises B blocks per SM on the generated mma.sync kernel (the entry's
    `__launch_bounds__(THREADS)` becomes `(THREADS, B)`, nothing else changes); a source without the bound is
    refused in one line; --compile-only builds every variant and reports ptxas's registers, which the bound caps at
    65536 / (B x THREADS) (here 256 threads: 85 at three blocks), without a GPU."""
    import shutil

    probe = _bench_script("launch_bounds_probe")
    from sweep_cases import lower_case

    case = ((17, 9999, 3333), "cuda_ptx_sm80", "ptx_sm80_32x128x64_w2x4_s3_splitk3_interleave")
    _, _, plan = lower_case(*case)
    bounded = probe.min_blocks(3)(plan.source)
    assert "__launch_bounds__(256)" in plan.source and "__launch_bounds__(256, 3)" in bounded
    assert bounded.replace("__launch_bounds__(256, 3)", "__launch_bounds__(256)") == plan.source
    with pytest.raises(ValueError, match="0 GEMM entries"):
        probe.min_blocks(3)("__global__ void k() {}")
    # A direct decode kernel's entry is bounded too; a repack source's bare bound is the copy kernel's (its GEMM entry
    # is already bounded by the sm90a rule): refused, not a variant of the copy reported as the GEMM's.
    _, _, direct = lower_case((1, 4096, 4096), "cuda_ptx_direct", "direct_8x32x128_w1x4_s2_k4")
    assert probe.min_blocks(2)(direct.source).count(", 2)") == direct.source.count(", 2)") + 1
    _, _, repack = lower_case((512, 512, 4097), "cuda_ptx", "ptx_repack_coop_128x128x64")
    with pytest.raises(ValueError, match="0 GEMM entries"):
        probe.min_blocks(2)(repack.source)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    out = tmp_path / "lb.json"
    assert probe.main(["--case", "17x9999x3333:cuda_ptx_sm80:ptx_sm80_32x128x64_w2x4_s3_splitk3_interleave",
                       "--blocks", "3", "--compile-only", "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"as_lowered", "min3"} and rows["min3"]["registers"] <= 65536 // (3 * 256)
    assert rows["as_lowered"]["registers"] > rows["min3"]["registers"] and "kernel_us" not in rows["min3"]
    assert "min3" in capsys.readouterr().out


def test_export_rule_check_rereads_the_v16_race_and_holds_out_the_fresh_trials(tmp_path, capsys):
    """bench/export_rule_check.py on the committed v16 server race: the paired bound serves every shape the spread
    rule serves and more below 1 GFLOP, and decided on the selection rounds alone it serves no shape that then
    measured below 1x on the fresh trials; a prefix without its fresh trials is a one-line error."""
    check = _bench_script("export_rule_check")
    from pathlib import Path

    race = Path(__file__).parents[1] / "bench" / "results" / "families_server_v16_h200"
    assert check.main(["--race", str(race), "--out", str(tmp_path / "r.json")]) == 0
    out = json.loads((tmp_path / "r.json").read_text())
    rows = out["rows"]
    assert len(rows) == 60
    assert all(r["export"]["bound_rule"] for r in rows if r["export"]["spread_rule"])
    small = "< 1 GFLOP"
    assert out["groups"]["export/bound_rule"][small]["served"] > out["groups"]["export/spread_rule"][small]["served"]
    for group in out["groups"]["held_out/bound_rule"].values():
        assert group["served_below_1"] == []
    with pytest.raises(SystemExit, match="not found"):
        check.main(["--race", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.json")])


def test_standin_charges_a_multicast_cluster_its_blocks_past_the_grid():
    """A multicast cluster's grid is whole clusters: 2 tiles along N in clusters of 1x8 launch 8 blocks per tile
    row, so 65 tile rows take 520 blocks, four waves on 132 SMs, where the plain twin's 130 tiles fit one; where the
    clusters tile the grid exactly the model gives both the same time (no multicast saving: L2 serves the re-reads
    either way)."""
    import dataclasses

    from l2ir.search.standin import SMS, kernel_time_us
    from l2ir.search.sweeps import load_sweep

    from l2ir.nodes import Problem

    clustered = load_sweep("cuda_ptx")["ptx_w4x1_64x64x64_c1x8"]
    plain = clustered.replace(tile=dataclasses.replace(clustered.tile, cluster=(1, 1)))
    assert SMS == 132
    ragged = Problem(64 * 65, 64 * 2, 4096)                     # 130 tiles; 65 clusters of 8 = 520 blocks
    assert kernel_time_us(clustered, ragged) > 2.5 * kernel_time_us(plain, ragged)
    whole = Problem(64, 64 * 128, 4096)                         # 16 whole clusters, one wave either way
    assert kernel_time_us(clustered, whole) == kernel_time_us(plain, whole)


def test_ncu_split_parts_each_run_of_launches_into_active_and_idle(tmp_path, capsys):
    """ncu's raw CSV: a header, a units row, then one row per launch (numbers with thousands separators), with the
    profiler's chatter and the program's output between. Consecutive launches of one kernel and grid make one
    entry; the idle part is the elapsed cycles the busiest SM held no block, in us at the counters' own clock."""
    split = _bench_script("ncu_split")
    head = '"ID","Kernel Name","launch__grid_size","gpu__time_duration.sum","sm__cycles_elapsed.max",' \
           '"sm__cycles_active.max"\n'
    units = '"","","","ns","cycle","cycle"\n'

    def row(i, name, grid, ns, elapsed, active):
        return f'"{i}","{name}","{grid}","{ns}","{elapsed}","{active}"\n'

    text = ("==PROF== Connected to process 1\n" + head + units
            + row(0, "l2ir_gemm", 128, "5,000", "10,000", "6,000") + "64x64x64 ok\n"
            + row(1, "l2ir_gemm", 128, "6,000", "12,000", "6,500")
            + row(2, "l2ir_gemm", 128, "5,500", "11,000", "6,200")
            + row(3, "void nvjet<int>(float)", 96, "4,000", "8,000", "4,400")
            + row(4, "l2ir_gemm", 256, "7,000", "14,000", "10,000"))
    parts = split.split(split.read_rows(text))
    assert [(p["kernel"], p["grid"], p["launches"]) for p in parts] == [
        ("l2ir_gemm", "128", 3), ("void nvjet<int>(float)", "96", 1), ("l2ir_gemm", "256", 1)]
    first = parts[0]
    assert first["time_us"] == 5.5 and first["idle_cycles"] == 11000 - 6200
    assert abs(first["idle_us"] - 4800 / 2.0 / 1000) < 1e-9         # 11,000 cycles in 5,500 ns: 2 GHz
    assert abs(parts[1]["active_us"] - 2.2) < 1e-9
    assert split.short_name("void nvjet<int>(float)") == "nvjet"

    good = tmp_path / "ncu.csv"
    good.write_text(text)
    out_json = tmp_path / "split.json"
    assert split.main([str(good), "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["rows"][2]["grid"] == "256"
    lacking = tmp_path / "lacking.csv"
    lacking.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","ns"\n"0","k","5"\n')
    assert split.main([str(lacking)]) == 2
    assert "sm__cycles_active.max" in capsys.readouterr().err
    assert split.main([str(tmp_path / "missing.csv")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("scenario", ["offline", "server"])
def test_pdl_probe_runs_each_case_off_on_off_on_in_the_asked_scenario(tmp_path, monkeypatch, scenario):
    """pdl_probe's A/B with the evaluator and the compiler stood in: each case is evaluated four times, PDL off,
    on, off, on, each time in the scenario asked for (server at the server race's timing), and the variant it
    builds really differs: the "kernels" plan's launches ask for PDL only in the "on" runs."""
    import l2ir.backends.compile as compile_module
    import l2ir.search.evaluator as evaluator_module
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import Measurement
    from l2ir.search.gates import Verdict

    probe = _bench_script("pdl_probe")
    seen = []

    class FakeEvaluator:
        def __init__(self, config):
            self.config = config

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def evaluate(self, kernel, problem, plan, built):
            pdl = any(launch.pdl for launch in plan.launches)
            seen.append((self.config.scenarios, self.config.timing, pdl))
            us = 4.0 if pdl else 5.0
            return (Measurement(kernel.content_hash(), str(problem), self.config.scenarios[0],
                                verdicts=[Verdict("accuracy", True)], kernel_median_us=us,
                                baseline_median_us=5.0, speedup=5.0 / us),)

    monkeypatch.setattr(evaluator_module, "Evaluator", FakeEvaluator)
    monkeypatch.setattr(compile_module, "compile_plan", lambda plan, options: None)
    out = tmp_path / "pdl.json"
    case = "64x64x64:cuda_ptx_sm80:ptx_sm80_64x64x32_w2x2_s3"       # a "kernels" plan with one PDL launch
    assert probe.main(["--scenario", scenario, "--case", case, "--out", str(out)]) == 0
    assert [pdl for _, _, pdl in seen] == [False, True, False, True]
    assert {scenarios for scenarios, _, _ in seen} == {(scenario,)}
    timings = {timing for _, timing, _ in seen}
    assert timings == ({BENCH_TIMING} if scenario == "server" else {evaluator_module.EvalConfig().timing})
    result = json.loads(out.read_text())
    assert result["scenario"] == scenario
    assert [r["kernel_us"] for r in result["rows"]] == [5.0, 4.0, 5.0, 4.0]


def test_release_probe_edits_the_multicast_release_and_exit(tmp_path, capsys):
    """bench/release_probe.py puts back, one at a time, what the multicast kernel's release and exit did before:
    the per-k-tile mapa of the remote empty barrier, the entry's release arrival, and the release-and-wait cluster
    barrier at the exit in place of the producer's load tail; on a reduce=cluster kernel the entry's arrival is a
    release again. A source without them is refused in one line, and --compile-only builds every variant without a
    GPU."""
    import shutil

    probe = _bench_script("release_probe")
    from sweep_cases import lower_case

    one = lower_case((100, 3000, 4104), "cuda_ptx", "ptx_w4x1_64x64x64_c2x4")[2].source
    coop = lower_case((100, 3000, 4104), "cuda_ptx", "ptx_coop_128x64x64_c1x4")[2].source
    for source in (one, coop):
        # as lowered: mapped once, a relaxed entry, one cluster barrier, the load tail
        assert probe.RELEASE in source and "mapa" not in source[source.index("auto release"):]
        assert source.count("cluster_sync();") == 1 and len(probe.TAIL.findall(source)) == 1
        assert probe.ARRIVE_RELAXED in source and probe.ARRIVE_RELEASE not in source
        looped = probe.VARIANTS["mapa_in_loop"](source)
        assert probe.RELEASE not in looped and probe.RELEASE_MAPA in looped
        old = probe.VARIANTS["exit_barrier"](source)
        assert not probe.TAIL.findall(old) and old.count(probe.ARRIVE_RELEASE) == 2 and probe.ARRIVE_RELAXED not in old
        assert old.rindex(probe.EXIT_BARRIER) > old.index("// ---- consumer warpgroups")
        entry = probe.VARIANTS["entry_release"](source)
        assert entry.count(probe.ARRIVE_RELEASE) == 1 and probe.TAIL.findall(entry)
    # reduce=cluster pushes: its one arrival (the entry's) is relaxed; entry_release makes it a release (the pull
    # that 9cca87e lowered is raced as stored sources, recipe push-reduce)
    reduce = lower_case((128, 128, 16384), "cuda_ptx", "ptx_splitk_cluster_w4x1_64x64x64_s16")[2].source
    assert reduce.count("cluster_arrive_relaxed();") == 1 and probe.ARRIVE_RELEASE not in reduce
    assert probe.VARIANTS["entry_release"](reduce).count(probe.ARRIVE_RELEASE) == 1
    cutlass = lower_case((100, 3000, 4104), "sm90a_skinny", "pingpong_64x64x64_c1x4_np")[2].source
    with pytest.raises(ValueError, match="load tail"):
        probe.VARIANTS["exit_barrier"](cutlass)
    with pytest.raises(ValueError, match="no longer applies"):
        probe.VARIANTS["mapa_in_loop"](cutlass)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    out = tmp_path / "rel.json"
    assert probe.main(["--case", "100x3000x4104:cuda_ptx:ptx_w4x1_64x64x64_c1x4", "--compile-only",
                       "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"as_lowered", "mapa_in_loop", "entry_release", "exit_barrier"}
    assert all("error" not in r and r["spill_bytes"] == 0 and "kernel_us" not in r for r in rows.values())
    assert "mapa_in_loop" in capsys.readouterr().out

def test_derive_families_dram_group_counts_the_long_floor_shapes_apart(tmp_path):
    """The DRAM-bound group's long_floor subset holds exactly the rows whose roofline floor is at least
    LONG_FLOOR_US, with their own median shares."""
    from l2ir.search.report import LONG_FLOOR_US

    derive = _derive_module()
    short, long = (128, 512, 8192), (128, 4096, 16384)          # floors of about 2.5 and 32 us on an H200
    base = _bench_run(tmp_path, "base", [(short, "aaaaaaaaaaaa", 0.5), (long, "bbbbbbbbbbbb", 0.8)],
                      {short: ["aaaaaaaaaaaa"], long: ["bbbbbbbbbbbb"]})
    summary = json.loads((tmp_path / "base.json").read_text())
    summary["environment"] = {"gpu": "NVIDIA H200"}
    (tmp_path / "base.json").write_text(json.dumps(summary))
    group = derive.derive([base])["groups"]["dram_bound"]
    rows = {tuple(r["shape"]): r for r in group["rows"]}
    assert rows[short]["floor_us"] < LONG_FLOOR_US <= rows[long]["floor_us"]
    assert group["long_floor"]["shapes"] == 1
    assert group["long_floor"]["median_kernel_share"] == rows[long]["kernel_share"]
    assert group["median_kernel_share"] == pytest.approx((rows[short]["kernel_share"] + rows[long]["kernel_share"]) / 2)


def test_aa_probe_builds_each_case_twice(tmp_path):
    """aa_probe: every case as lowered and again, the same source (the A/A's second timing), one row each."""
    probe = _bench_script("aa_probe")
    out = tmp_path / "aa.json"
    assert probe.main(["--case", "64x64x2048:cuda_ptx:ptx_splitk_cluster_w4x1_64x64x64_s8", "--compile-only",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["as_lowered", "again"]
    assert rows[0]["registers"] == rows[1]["registers"] > 0 and "error" not in rows[1]
