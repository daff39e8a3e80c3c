"""Golden generated sources of one backend: where they live, how they are regenerated, and the checks every
backend's tests share (the source equals the golden file; lowering is deterministic in one process and across
interpreters with different hash seeds). A generated-kernel diff is a review signal, so a mismatch shows the diff.

    GOLDENS = GoldenSources("cute_sm80", CASES, __file__)    # CASES: name -> (kernel, problem)
    lower = GOLDENS.lower                                     # the backend through the registry
    test_golden_source, test_deterministic_in_process, test_deterministic_across_processes = GOLDENS.tests()
    python tests/test_<backend>.py --update-golden           # after an intended change; review the diff
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from l2ir.backends import registry

ROOT = Path(__file__).resolve().parents[1]


class GoldenSources:
    def __init__(self, backend: str, cases: dict, test_file: str):
        """`backend` names a registry entry; sources are lowered through the registry, the one dispatch."""
        self.backend, self.cases = backend, cases
        self.lower: Callable = functools.partial(registry.lower, backend=backend)
        self.folder = Path(__file__).parent / "golden" / backend
        self.module = "tests." + Path(test_file).stem
        self.script = f"python tests/{Path(test_file).name} --update-golden"

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.cu"

    def source(self, name: str) -> str:
        return self.lower(*self.cases[name]).source

    def update(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in self.cases:
            self.path(name).write_text(self.source(name))
            print("wrote", self.path(name))

    def check(self, name: str) -> None:
        path = self.path(name)
        assert path.exists(), f"missing golden {path}: run `{self.script}`"
        got, want = self.source(name), path.read_text()
        if got != want:
            diff = "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(), "golden", "now", lineterm=""))
            pytest.fail(f"generated source changed for {name} (if intended, regenerate with `{self.script}` and "
                        f"review the diff):\n{diff[:4000]}")

    def digest(self) -> str:
        return hashlib.sha256("".join(self.source(n) for n in sorted(self.cases)).encode()).hexdigest()

    def check_deterministic(self) -> None:
        for kernel, problem in self.cases.values():
            assert self.lower(kernel, problem) == self.lower(kernel, problem)

    def check_across_processes(self, attribute: str = "GOLDENS") -> None:
        """Fresh interpreters with different hash seeds produce byte-identical sources."""
        code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
                f"from {self.module} import {attribute} as g; print(g.digest())")
        outs = set()
        for seed in ("0", "1", "12345"):
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONHASHSEED": seed})
            assert r.returncode == 0, r.stderr
            outs.add(r.stdout.strip())
        assert len(outs) == 1, outs

    def check_field(self, field: str, base: tuple, kernel, problem, expected: str) -> None:
        """Changing one IR field (base (kernel, problem) -> kernel, problem) generates the expected line, which the
        base source does not already contain (else the check would prove nothing)."""
        assert expected in self.lower(kernel, problem).source, f"{field}: expected line not generated"
        assert expected not in self.lower(*base).source, \
            f"{field}: the base kernel already contains the line, so the test proves nothing"

    def tests(self):
        """The three tests every backend's test module runs: golden sources, in-process and cross-process
        determinism."""
        @pytest.mark.parametrize("name", sorted(self.cases))
        def test_golden_source(name):
            self.check(name)

        def test_deterministic_in_process():
            self.check_deterministic()

        def test_deterministic_across_processes():
            self.check_across_processes()

        return test_golden_source, test_deterministic_in_process, test_deterministic_across_processes

    def main(self, argv: list[str], doc: str | None = None) -> None:
        if "--update-golden" in argv or "--update-goldens" in argv:
            self.update()
        else:
            print(doc or f"usage: {self.script}")
