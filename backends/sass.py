"""Read the machine code of a built kernel: which matrix instructions it issues and whether it touches local memory.

A Hopper GEMM whose SASS shows HGMMA runs on the warpgroup tensor cores; one that shows only HMMA is on the
mma.sync path (about half the rate), and LDL/STL (local loads/stores) mean register spills or a run-time-indexed
register array. cuobjdump (which calls nvdisasm for SASS) comes from the CUDA toolkit or the NVIDIA wheels.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


def tool_path() -> str:
    """PATH plus the bin folders of the NVIDIA wheels that carry cuobjdump and nvdisasm."""
    dirs = [os.environ.get("PATH", "")]
    try:
        import nvidia.cu13

        dirs += [str(Path(p) / "bin") for p in nvidia.cu13.__path__]
    except ImportError:
        pass
    return os.pathsep.join(d for d in dirs if d)


def disassemble(binary: str | Path, timeout_s: float = 120.0) -> str | None:
    """SASS of a cubin or of the kernels embedded in a shared library; None when the tools are missing."""
    path = tool_path()
    cuobjdump = shutil.which("cuobjdump", path=path)
    if cuobjdump is None:
        return None
    try:
        proc = subprocess.run([cuobjdump, "-sass", str(binary)], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PATH": path})
    except (subprocess.TimeoutExpired, OSError):
        return None          # a report without SASS beats no report
    if proc.returncode != 0:
        return None
    return proc.stdout


_COUNTS = {
    "hgmma": re.compile(r"\bHGMMA\."),
    "hmma": re.compile(r"\bHMMA\."),
    "local_loads": re.compile(r"\bLDL(\.|\s)"),
    "local_stores": re.compile(r"\bSTL(\.|\s)"),
    "tma_loads": re.compile(r"\bUTMALDG\."),
}


def summarize(sass: str) -> dict[str, int]:
    """Counts of the instructions that say which path a GEMM kernel is on."""
    return {name: len(rx.findall(sass)) for name, rx in _COUNTS.items()}


def inspect(binary: str | Path) -> dict[str, int] | None:
    sass = disassemble(binary)
    return summarize(sass) if sass is not None else None
