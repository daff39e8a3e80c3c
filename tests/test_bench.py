"""The benchmark driver's pure parts: shape selection, sweeps, resume records, summary arithmetic."""

import json

import pytest

from l2ir.verify import verify
from l2ir.search.bench import (GRID, SWEEPS, BenchConfig, ShapeResult, _geomean, _load_done, _short, _summary,
                          grid_shapes)


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


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_every_sweep_kernel_is_legal(name):
    for kernel in SWEEPS[name].values():
        assert verify(kernel) is kernel


def test_resume_records_survive_a_cut_line(tmp_path):
    path = tmp_path / "r.jsonl"
    rec = {"kernel_hash": "h", "problem": "gemm m=1", "scenario": "offline", "speedup": 1.5}
    # the second line was cut by a kill; the third is valid JSON but no measurement
    path.write_text(json.dumps(rec) + "\n" + json.dumps(rec)[:20] + "\n" + json.dumps({"note": 1}) + "\n")
    done = _load_done(path)
    assert done == {("h", "gemm m=1", "offline", ""): rec, ("h", "gemm m=1", "offline"): rec}
    assert _load_done(tmp_path / "missing.jsonl") == {}


def test_summary_groups_by_regime_and_ignores_missing_speedups(tmp_path):
    rows = [ShapeResult((64, 64, 64), offline={"speedup": 2.0}), ShapeResult((128, 128, 128), offline={"speedup": 0.5}),
            ShapeResult((4096, 4096, 4096), offline={}),       # no candidate passed: no speedup to average
            ShapeResult((16384, 16384, 16384), offline={"speedup": 1.1}, server={"speedup": 0.9})]
    cfg = BenchConfig(out=tmp_path / "x", shapes=tuple(r.shape for r in rows), sweep=())
    s = _summary(cfg, rows, evals=8, passes=6, fresh=[], every=[10.0, 20.0], compile_wall=5.0, n_kernels=2,
                 n_failed=0, env={"gpu": "test"}, stopped=False, seconds=1.0)
    assert s["by_regime"]["< 1 GFLOP"]["shapes"] == 2
    assert s["by_regime"]["< 1 GFLOP"]["offline_geomean_speedup"] == pytest.approx(1.0)
    assert s["by_regime"]["< 1 GFLOP"]["shapes_faster_offline"] == 1
    assert s["by_regime"]["0.1-1 TFLOP"]["offline_geomean_speedup"] is None
    assert s["by_regime"][">= 1 TFLOP"]["server_geomean_speedup"] == pytest.approx(0.9)
    assert s["gate_pass_rate"] == 0.75 and s["compile_seconds_per_kernel"] == 15.0
    assert s["compile_seconds_per_kernel_fresh"] is None
    assert _geomean([None, 4.0, 1.0]) == pytest.approx(2.0)


def test_short_symbols_stay_distinct():
    a, b = "x" * 200 + "a", "x" * 200 + "b"
    assert len(_short(a)) <= 72 and _short(a) != _short(b)
    assert _short("l2ir_cute_sm80_gemm") == "l2ir_cute_sm80_gemm"
