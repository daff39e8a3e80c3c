"""The compiled eager path of `l2ir.matmul` (l2ir/fastpath.cpp): building it and loading it.

`l2ir export` builds it into the package (`fastpath/`), for the Python and torch it runs under; `l2ir.load` imports
it when the running Python, torch and fastpath.cpp are the ones it was built for (the file name says which), and
otherwise runs the Python path, which decides the same routes. Loading never compiles. `L2IR_FASTPATH=0` in the
environment turns it off (the benchmark's A/B switch, and an escape hatch).

The build is one g++ call against torch's headers and libraries (the CPU wheel has both, so the CPU tests build it
too); it needs no CUDA header: the driver's and the host shims' entry points are called through addresses that
l2ir/dispatch.py hands over.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(__file__).with_name("fastpath.cpp")
MODULE = "l2ir_fastpath"          # PyInit_l2ir_fastpath in fastpath.cpp
ENV_VAR = "L2IR_FASTPATH"


class FastPathError(Exception):
    """The fast path cannot be built here (no compiler, no headers, a failed compile): one line saying why."""


def tag() -> str:
    """What a build is tied to: the Python ABI, the torch version (its C++ ABI), the machine and fastpath.cpp."""
    import torch

    src = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    raw = f"{sys.implementation.cache_tag}-torch{torch.__version__}-{platform.machine()}-{src}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)


def file_name() -> str:
    return f"{MODULE}.{tag()}.so"


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "off", "false", "no")


def build(out_dir: str | Path, cxx: str | None = None, timeout: float = 600) -> Path:
    """Compile fastpath.cpp into out_dir/<file_name()>; returns the path (FastPathError if it cannot)."""
    import torch
    from torch.utils import cpp_extension

    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise FastPathError("no C++ compiler (g++ or $CXX) to build the fast path")
    py_inc = sysconfig.get_paths()["include"]
    if not (Path(py_inc) / "Python.h").is_file():
        raise FastPathError(f"no Python.h under {py_inc} (the Python development headers)")
    torch_lib = Path(torch.__file__).parent / "lib"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / file_name()
    tmp = out_dir / f".{target.name}.{os.getpid()}.tmp"
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{py_inc}",
           str(SOURCE), "-o", str(tmp), f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
           f"-Wl,-rpath,{torch_lib}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise FastPathError(f"{cxx} did not finish building the fast path in {timeout:.0f} s") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:300])
        raise FastPathError(f"{cxx} failed to build the fast path: {first}")
    os.replace(tmp, target)
    return target


def load(folder: str | Path):
    """(module, None) from folder/<file_name()>, or (None, why not) — a missing or mismatched build is not an
    error: the Python path serves the same routes."""
    if not enabled():
        return None, f"{ENV_VAR}={os.environ.get(ENV_VAR)}"
    path = Path(folder) / file_name()
    if not path.is_file():
        return None, f"no build for this Python and torch in {folder} (expected {path.name})"
    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as e:
        return None, f"{path.name} failed to load: {e}"
    return mod, None


def main(argv: list[str] | None = None) -> int:
    """`python -m l2ir.fastpath DIR`: build the fast path into DIR (e.g. a package's fastpath/ after a torch
    upgrade; the package's manifest does not list it, so its content hash is unchanged)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m l2ir.fastpath DIR", file=sys.stderr)
        return 2
    try:
        path = build(argv[0])
    except FastPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
