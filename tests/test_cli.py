"""The command line: each subcommand's output and exit status, and located errors instead of tracebacks."""

import io
import shutil
import subprocess
import sys

import pytest

from l2ir.cli import main
from l2ir.text import parse_kernel_file

EX = "examples/sm80_128x128x32.l2"


def run(capsys, *argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fmt_prints_canonical_text(capsys):
    code, out, _ = run(capsys, "fmt", EX)
    assert code == 0
    problem, kernel, _ = parse_kernel_file(out)
    assert out.startswith("gemm m=1000 n=1000 k=1000")
    assert "# " not in out                      # comments are not part of the canonical form
    assert kernel == parse_kernel_file(open(EX).read())[1]


def test_fmt_reads_stdin(capsys, monkeypatch):
    code, out, _ = run(capsys, "fmt", "-", stdin="kernel { target arch=sm80 }", monkeypatch=monkeypatch)
    assert (code, out) == (0, "kernel {\n  target arch=sm80\n}\n")


def test_verify_ok_and_violations(capsys, tmp_path):
    code, out, _ = run(capsys, "verify", EX)
    assert code == 0 and out.startswith(f"{EX}: ok (")
    bad = tmp_path / "bad.l2"
    bad.write_text(open(EX).read().replace("stages=4", "stages=13"))
    code, _, err = run(capsys, "verify", str(bad))
    assert code == 1
    assert f"{bad}:11: error [ResourceError] pipeline: needs 208.0 KB" in err


def test_verify_reports_problem_rules(capsys, tmp_path):
    bad = tmp_path / "p.l2"
    bad.write_text(open(EX).read().replace("k=1000", "k=1001"))
    code, _, err = run(capsys, "verify", str(bad))
    assert code == 1 and "[PadError]" in err and "got K=1001" in err


def test_edit(capsys):
    code, out, _ = run(capsys, "edit", EX, "set pipeline.stages = 3", "set swizzle.group = 4; set pad.align = 8")
    assert code == 0
    assert "stages=3" in out and "group=4" in out


def test_edit_errors(capsys):
    code, _, err = run(capsys, "edit", EX, "set pipeline.stages = 3", "set pipeline.stages = 13")
    assert code == 1 and err.startswith("error: edit 2 (set pipeline.stages = 13): [ResourceError]")
    code, _, err = run(capsys, "edit", EX, "set pipeline stages = 3")
    assert code == 1 and err.startswith("error: edit 1:1:14: unexpected 'stages'; expected '.'")


def test_interp(capsys):
    code, out, _ = run(capsys, "interp", EX, "--shape", "67x136x40")
    assert code == 0 and "PASS" in out and "m=67 n=136 k=40" in out
    code, out, _ = run(capsys, "interp", EX, "--shape", "64x64x64", "--integers")
    assert code == 0 and "0.000e+00" in out


def test_interp_problem_errors(capsys):
    code, _, err = run(capsys, "interp", EX, "--shape", "64x64x63")
    assert code == 1 and "[PadError]" in err and "got K=63" in err
    with pytest.raises(SystemExit) as info:
        main(["interp", EX, "--shape", "64x64"])
    assert info.value.code == 2


def test_seed(capsys):
    code, out, _ = run(capsys, "seed", "--shape", "4096x4096x4096", "--target", "sm90a")
    assert code == 0
    problem, kernel, _ = parse_kernel_file(out)
    assert problem.shape == (4096, 4096, 4096) and kernel.mma.op == "wgmma"


def test_malformed_input_is_located_not_a_traceback(capsys, tmp_path):
    bad = tmp_path / "bad.l2"
    bad.write_text("kernel {\n  target arch=sm80\n  tile block=12x8 warps=2x2\n}\n")
    for cmd in ("fmt", "verify", "edit", "interp"):
        argv = [cmd, str(bad)] + (["set pad.align = 1"] if cmd == "edit" else []) + \
            (["--shape", "8x8x8"] if cmd == "interp" else [])
        code, out, err = run(capsys, *argv)
        assert code == 1
        assert f"{bad}:3:14: tile.block: expected dims like" in err
        assert "Traceback" not in err
    code, _, err = run(capsys, "fmt", str(tmp_path / "missing.l2"))
    assert code == 1 and "cannot read" in err


@pytest.mark.skipif(shutil.which("l2ir") is None, reason="console script not installed")
def test_console_script():
    r = subprocess.run(["l2ir", "verify", EX], capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_compile_reports_stages_and_resources(capsys, tmp_path):
    cache = str(tmp_path / "cache")
    code, out, _ = run(capsys, "compile", "examples/source_naive.l2", "--cache-dir", cache, "--no-sass")
    assert code == 0
    assert "backend source, kernels for sm_80" in out
    assert f"stages in {cache}" in out
    assert "naive_gemm:" in out and "registers" in out and "spills 0/0 B" in out
    code, out, _ = run(capsys, "compile", "examples/source_naive.l2", "--cache-dir", cache, "--no-sass")
    assert code == 0 and "(from the cache)" in out
    bad = tmp_path / "bad.l2"
    bad.write_text(open("examples/source_naive.l2").read().replace("float acc = 0.f;", "float acc = 0.f"))
    code, _, err = run(capsys, "compile", str(bad), "--cache-dir", cache, "--no-sass")
    assert code == 1 and "compile error" in err and "reproduce: " in err


def test_unreadable_and_oversized_inputs_are_refused(capsys, tmp_path):
    binary = tmp_path / "b.l2"
    binary.write_bytes(b"\xff\xfe")
    code, _, err = run(capsys, "fmt", str(binary))
    assert code == 1 and "not UTF-8 text (byte 0" in err
    code, _, err = run(capsys, "interp", EX, "--shape", "100000x100000x100000")
    assert code == 1 and "GiB in the interpreter" in err


def test_bench_without_a_gpu_says_so_in_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    from l2ir.search import bench, preflight

    monkeypatch.setattr(preflight, "_toolchain", lambda nvcc: [])
    monkeypatch.setattr(preflight, "_gpu", lambda: [f"no CUDA GPU on this machine; {preflight.GPU_HINT}"])
    monkeypatch.setattr(bench, "run_bench", lambda cfg: pytest.fail("bench started work on a machine without a GPU"))
    code, out, err = run(capsys, "bench", "--shapes", "3", "--out", str(tmp_path / "r" / "x"))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: l2ir bench cannot run here: no CUDA GPU on this machine; "
                                                   "run it on a machine with an NVIDIA GPU")
    assert not (tmp_path / "r").exists()
    # a report rebuilt from the records needs no GPU: it gets past the check (and finds nothing to report)
    monkeypatch.setattr(bench, "run_bench", lambda cfg: {"reached": cfg.report_only})
    monkeypatch.setattr("l2ir.search.report.print_summary", lambda s: print(s))
    code, out, _ = run(capsys, "bench", "--shapes", "3", "--out", str(tmp_path / "x"), "--report-only")
    assert code == 0 and "'reached': True" in out


def test_preflight_names_what_to_install(monkeypatch):
    import importlib.util

    from l2ir.search import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("cutlass_library", "cuda") else real(name, *a))
    problems = preflight.missing()
    assert problems == ["no 'nvcc' on PATH (install the CUDA toolkit, 12.4 or newer)",
                        "no CUTLASS headers (pip install 'l2ir[cuda]', which brings nvidia-cutlass)",
                        "no cuda-python (pip install 'l2ir[cuda]')"]
    with pytest.raises(preflight.PreflightError) as e:
        preflight.require("l2ir tune", gpu=False)
    assert str(e.value).startswith("l2ir tune cannot run here: no 'nvcc' on PATH") and "\n" not in str(e.value)


def test_preflight_on_this_machine_matches_its_gpu():
    pytest.importorskip("cuda.bindings", reason="needs the cuda extra")
    torch = pytest.importorskip("torch")
    from l2ir.search import preflight

    gpu_problems = preflight.missing(gpu=True, toolchain=False)
    assert bool(gpu_problems) == (not torch.cuda.is_available()), gpu_problems
