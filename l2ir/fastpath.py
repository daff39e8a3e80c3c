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
    """What a build is tied to: the Python ABI (the extension suffix says the version, the platform and a
    free-threaded build), torch's version, commit and C++ ABI, and fastpath.cpp itself."""
    import torch

    src = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    ext = (sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag).strip(".").removesuffix(".so")
    git = (getattr(torch.version, "git_version", None) or "")[:12]
    raw = (f"{ext}-torch{torch.__version__}-{git}-abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}-{platform.machine()}"
           f"-{src}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)


def file_name() -> str:
    return f"{MODULE}.{tag()}.so"


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "off", "false", "no")


def build(out_dir: str | Path, cxx: str | None = None, timeout: float = 600, cache_dir: str | Path | None = None) -> Path:
    """Compile fastpath.cpp into out_dir/<file_name()>; returns the path (FastPathError if it cannot). With
    `cache_dir`, a build of the same command (compiler, flags, torch and Python paths; the file name already says
    fastpath.cpp's hash and torch's version) kept there is copied instead: the g++ call takes about 20 s, and
    every export of a records DB would repeat it."""
    import torch

    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise FastPathError("no C++ compiler (g++ or $CXX) to build the fast path")
    py_inc = sysconfig.get_paths()["include"]
    if not (Path(py_inc) / "Python.h").is_file():
        raise FastPathError(f"no Python.h under {py_inc} (the Python development headers)")
    torch_dir = Path(torch.__file__).parent
    torch_lib, torch_inc = torch_dir / "lib", torch_dir / "include"
    if not (torch_inc / "torch" / "csrc" / "autograd" / "python_variable.h").is_file():
        raise FastPathError(f"no torch C++ headers under {torch_inc}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / file_name()
    tmp = out_dir / f".{target.name}.{os.getpid()}.tmp"
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{torch_inc}", f"-I{torch_inc / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{py_inc}",
           str(SOURCE), "-o", str(tmp), f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
           f"-Wl,-rpath,{torch_lib}"]
    kept = None
    if cache_dir is not None:
        key = hashlib.sha256("\0".join(c for c in cmd if c != str(tmp)).encode()).hexdigest()[:16]
        kept = Path(cache_dir) / "fastpath" / key / target.name
        if kept.is_file():
            shutil.copyfile(kept, tmp)
            os.replace(tmp, target)
            return target
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise FastPathError(f"{cxx} did not finish building the fast path in {timeout:.0f} s") from None
    except OSError as e:
        raise FastPathError(f"{cxx} could not run: {e}") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:300])
        raise FastPathError(f"{cxx} failed to build the fast path: {first}")
    if kept is not None:
        # Kept through a temporary name and a rename, so a concurrent export never copies half a file.
        kept.parent.mkdir(parents=True, exist_ok=True)
        part = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
        shutil.copyfile(tmp, part)
        os.replace(part, kept)
    os.replace(tmp, target)
    return target


def load(folder: str | Path, listed=None):
    """(module, None) from folder/<file_name()>, or (None, why not) — a missing or mismatched build is not an
    error: the Python path serves the same routes. `listed`: the file names a package's manifest hash-checked; a
    build it does not list is not loaded."""
    if not enabled():
        return None, f"{ENV_VAR}={os.environ.get(ENV_VAR)}"
    path = Path(folder) / file_name()
    if not path.is_file():
        return None, f"no build for this Python and torch in {folder} (expected {path.name})"
    if listed is not None and path.name not in listed:
        return None, f"{path.name} is not listed in the package's manifest (python -m l2ir.fastpath PACKAGE adds it)"
    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as e:
        return None, f"{path.name} failed to load: {e}"
    return mod, None


def add_to_package(package: str | Path) -> Path:
    """Build into a dispatch package's fastpath/ for this Python and torch (e.g. after a torch upgrade) and list the
    file in its manifest: its sha256 joins `files`, so the content hash changes with it."""
    import json

    from l2ir.export import content_hash, sha256_file

    package = Path(package)
    manifest_path = package / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FastPathError(f"{package}: not a dispatch package ({e})") from None
    path = build(package / "fastpath")
    manifest["files"][str(path.relative_to(package))] = sha256_file(path)
    manifest["content_hash"] = content_hash(manifest["files"])
    manifest["fastpath"] = path.name
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m l2ir.fastpath PACKAGE`: build the fast path for this Python and torch into a dispatch package."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m l2ir.fastpath PACKAGE", file=sys.stderr)
        return 2
    try:
        path = add_to_package(argv[0])
    except FastPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
