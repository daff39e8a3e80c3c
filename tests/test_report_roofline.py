"""`l2ir report`'s roofline: each shape's floor time, the share of it the winner and torch.matmul reach, the bound,
the regime medians, and a time under the floor flagged as suspicious (a DB built here; no GPU)."""

import json
import re

import pytest
from test_db import ENV_A, meas

from l2ir import target
from l2ir.cli import main
from l2ir.search.db import RecordsDB
from l2ir.search.report import ceilings_for, roofline

CLS = "a=f16:row b=f16:col c=f16:row acc=f32"
H200 = (target.H200_TENSOR_F16_FLOPS, target.H200_DRAM_BYTES_PER_S)


def problem(m, n, k):
    return f"gemm m={m} n={n} k={k} {CLS}"


def test_floor_is_the_longer_of_compute_and_traffic():
    r = roofline((4096, 4096, 4096), CLS, (1e15, 1e12))
    assert r["bound"] == "compute" and r["floor_us"] == pytest.approx(2 * 4096 ** 3 / 1e15 * 1e6)
    r = roofline((64, 64, 16384), CLS, (1e15, 1e12))
    assert r["bytes"] == (64 * 16384 + 16384 * 64 + 64 * 64) * 2
    assert r["bound"] == "memory" and r["floor_us"] == pytest.approx(r["bytes"] / 1e12 * 1e6)
    # f32 output doubles C's traffic only.
    r32 = roofline((64, 64, 16384), "a=bf16:row b=bf16:col c=f32:row", (1e15, 1e12))
    assert r32["bytes"] == r["bytes"] + 64 * 64 * 2


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="operand a .* dtype 'f8'"):
        roofline((64, 64, 64), "a=f8:row b=f16:col c=f16:row", H200)


def test_ceilings_only_for_a_known_gpu():
    assert ceilings_for(ENV_A) == H200
    assert ceilings_for(dict(ENV_A, gpu="NVIDIA A100-SXM4-80GB")) is None
    assert ceilings_for(dict(ENV_A, standin=True)) is None


def _floor_us(m, n, k):
    return max(2 * m * n * k / H200[0], (m * k + k * n + m * n) * 2 / H200[1]) * 1e6


def test_report_shows_shares_medians_and_flags_a_kernel_under_the_floor(tmp_path, capsys):
    # (shape, kernel us, torch us): two compute-bound shapes of one regime, a memory-bound one, and one timed under
    # its floor (2048x4096x4096 has an 86 us floor at the H200 tensor rate; 50 us is impossible).
    cases = [((4096, 4096, 4096), 200.0, 220.0), ((4096, 4096, 6144), 300.0, 290.0), ((64, 64, 16384), 2.0, 1.5),
             ((2048, 4096, 4096), 50.0, 100.0)]
    db = RecordsDB(tmp_path / "r.db")
    db.add_many([meas(f"{i}" * 64, problem(*s), ENV_A, t_torch / t_k, kus=[t_k] * 5)
                 for i, (s, t_k, t_torch) in enumerate(cases)])
    db.close()
    out = tmp_path / "rep"
    assert main(["report", "--db", str(tmp_path / "r.db"), "--out", str(out)]) == 0
    _, err = capsys.readouterr()
    md = (out / "report.md").read_text()

    for (m, n, k), t_k, t_torch in cases:
        floor = _floor_us(m, n, k)
        bound = "compute" if 2 * m * n * k / H200[0] > (m * k + k * n + m * n) * 2 / H200[1] else "memory"
        row = next(line for line in md.splitlines() if line.startswith(f"| {m} | {n} | {k} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[9]) == pytest.approx(floor, abs=0.006)
        assert cells[10] == bound
        for cell, t in ((cells[11], t_k), (cells[12], t_torch)):
            assert float(re.match(r"\**([\d.]+)%", cell).group(1)) == pytest.approx(100 * floor / t, abs=0.06)
            assert ("> floor!" in cell) == (floor > t)
    assert [c[0] for c in cases if _floor_us(*c[0]) > c[1]] == [(2048, 4096, 4096)]
    assert "SUSPICIOUS: 2048x4096x4096 ran faster than its roofline floor" in md
    assert "2048x4096x4096 ran faster than its roofline floor" in err
    assert "4096x4096x4096 ran faster" not in md + err

    # The 0.1-1 TFLOP regime holds the two compute-bound shapes: its medians are the means of their shares.
    regime = next(line for line in md.splitlines() if line.startswith("| 0.1-1 TFLOP |"))
    kernel_med, torch_med = (float(re.match(r"\**([\d.]+)%", c.strip()).group(1)) for c in regime.split("|")[6:8])
    f1, f2 = _floor_us(4096, 4096, 4096), _floor_us(4096, 4096, 6144)
    assert kernel_med == pytest.approx(100 * (f1 / 200 + f2 / 300) / 2, abs=0.06)
    assert torch_med == pytest.approx(100 * (f1 / 220 + f2 / 290) / 2, abs=0.06)

    summary = json.loads((out / "summary.json").read_text())
    (env,) = summary.values()
    assert env["suspicious"] == [problem(2048, 4096, 4096)]
    assert env["by_regime"]["< 1 GFLOP"]["kernel_roofline_median"] == pytest.approx(_floor_us(64, 64, 16384) / 2.0)


def test_report_of_an_unknown_gpu_has_no_roofline(tmp_path, capsys):
    db = RecordsDB(tmp_path / "r.db")
    db.add_many([meas("a" * 64, problem(4096, 4096, 4096), dict(ENV_A, gpu="Some GPU"), 1.0, kus=[1.0] * 5)])
    db.close()
    out = tmp_path / "rep"
    assert main(["report", "--db", str(tmp_path / "r.db"), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "No roofline" in md and "SUSPICIOUS" not in md         # 1 us would be under an H200's floor
    assert "| 4096 | 4096 | 4096 |" in md and md.count("| - | - | - | - |") == 1
