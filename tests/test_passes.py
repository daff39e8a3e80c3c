"""Lowering passes as public API: the pass pipeline (verifier after each pass, every stage kept), the shipped
passes, `l2ir lower`, and the README's example pass, run as written."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
from pathlib import Path

import pytest

from l2ir.analysis import resolved_stages
from l2ir.backends.registry import lower
from l2ir.cli import main
from l2ir.errors import ResourceError, VerifyError
from l2ir.nodes import Problem
from l2ir.passes import PassError, PassPipeline, resolve_stages
from l2ir.text import parse_kernel_file

ROOT = Path(__file__).resolve().parents[1]
SM80 = ROOT / "examples" / "sm80_128x128x32.l2"
SM90 = ROOT / "examples" / "sm90a_pingpong_128x128x64.l2"


def load(path: Path):
    problem, kernel, _ = parse_kernel_file(path.read_text(), path.name)
    return problem or Problem(1, 1, 1), kernel


def with_stages(kernel, stages):
    return kernel.replace(pipeline=dataclasses.replace(kernel.pipeline, stages=stages))


def test_no_passes_is_the_backend():
    problem, kernel = load(SM80)
    lowered = PassPipeline().run(kernel, problem)
    assert lowered.plan == lower(kernel, problem)
    assert [s.name for s in lowered.stages] == ["input", "plan", "source cute_sm80"]
    assert lowered.stages[0].text == kernel.text() and lowered.stages[-1].text == lowered.plan.source


def test_passes_run_in_order_and_each_stage_is_kept():
    problem, kernel = load(SM80)

    def two(k):
        return with_stages(k, 2)

    def plus_one(k):
        return with_stages(k, k.pipeline.stages + 1)

    lowered = PassPipeline((two, plus_one)).run(kernel, problem)
    assert [s.name for s in lowered.stages[:3]] == ["input", "two", "plus_one"]
    assert "stages=2 " in lowered.stages[1].text and "stages=3 " in lowered.stages[2].text
    assert lowered.kernel.pipeline.stages == 3
    assert lowered.plan == lower(with_stages(kernel, 3), problem)
    reverse = PassPipeline((plus_one, two)).run(kernel, problem)
    assert reverse.kernel.pipeline.stages == 2


def test_verifier_runs_after_each_pass_and_names_it():
    problem, kernel = load(SM80)

    def too_deep(k):
        return with_stages(k, 13)       # 13 x 16 KB > the A100's 163 KB

    with pytest.raises(ResourceError) as info:
        PassPipeline((too_deep,)).run(kernel, problem)
    assert "after pass 'too_deep'" in getattr(info.value, "__notes__", [])


def test_illegal_input_is_refused_before_any_pass():
    problem, kernel = load(SM80)
    calls = []
    with pytest.raises(VerifyError):
        PassPipeline((lambda k: calls.append(k) or k,)).apply(with_stages(kernel, 13))
    assert calls == []


def test_a_pass_must_return_a_kernel():
    problem, kernel = load(SM80)

    def broken(k):
        return k.text()

    with pytest.raises(PassError, match="pass 'broken' returned str, not a Kernel"):
        PassPipeline((broken,)).run(kernel, problem)


def test_resolve_stages_makes_auto_explicit_without_changing_the_kernel_s_smem():
    problem, kernel = load(SM90)
    assert kernel.pipeline.stages == "auto"
    out = resolve_stages(kernel)
    assert out.pipeline.stages == resolved_stages(kernel) >= 2
    assert resolve_stages(out) == out                  # idempotent
    sm80 = load(SM80)[1]
    assert resolve_stages(sm80) is sm80                # explicit stages are left alone


def test_dump_writes_every_stage(tmp_path):
    problem, kernel = load(SM90)
    lowered = PassPipeline((resolve_stages,)).run(kernel, problem)
    paths = lowered.dump(tmp_path)
    assert [p.name for p in paths] == ["00-input.l2", "01-resolve_stages.l2", "02-plan.txt",
                                       "03-source-cutlass_sm90.cu"]
    assert paths[-1].read_text() == lowered.plan.source
    assert "form=host_shim arch=sm_90a" in paths[2].read_text()


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_cli_lower_prints_the_source_without_compiling():
    problem, kernel = load(SM80)
    code, out, _ = run_cli("lower", str(SM80))
    assert code == 0 and out == lower(kernel, problem).source


def test_cli_lower_dump_and_backend():
    problem, kernel = load(SM80)
    code, out, _ = run_cli("lower", str(SM80), "--backend", "cuda_ptx_sm80", "--dump")
    assert code == 0
    assert re.findall(r"^// ===== stage \d: (.+) =====$", out, re.M) == ["input", "plan", "source cuda_ptx_sm80"]
    assert out.endswith(lower(kernel, problem, "cuda_ptx_sm80").source)
    code, out, _ = run_cli("lower", str(SM90), "--pass", "resolve_stages", "--dump")
    assert code == 0 and f"stages={resolved_stages(load(SM90)[1])} " in out


def test_cli_lower_refusals_are_one_line_errors():
    code, _, err = run_cli("lower", str(SM80), "--backend", "cutlass_sm90")
    assert code == 1 and "not lowered" in err and "mma.op=mma_sync (lowers wgmma)" in err
    assert len(err.strip().splitlines()) == 1, err


def test_readme_example_pass_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### A lowering pass"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)                      # the example opens examples/... relative to the checkout
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    finally:
        os.chdir(cwd)
    names, stages = out.getvalue().splitlines()
    assert names == "['input', 'deepest_ring', 'plan', 'source cute_sm80']"
    # Eight 16 KB stages (128+128 rows x 32 halves) fit 163 KB; the pass stops at its cap of 8.
    assert stages == "8"
