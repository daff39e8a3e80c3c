"""Named sweeps: one folder per sweep, one `.l2` kernel file per configuration (`<sweep>/<config>.l2`).

A sweep is data, not code: a file holds the kernel's canonical text (comments allowed, no gemm line: kernels are
problem-independent), its name is the configuration's name in every record. The files ship inside the wheel, so
`load_sweep("sm90a")` works wherever L2IR is installed.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from l2ir.errors import L2IRError
from l2ir.nodes import Kernel
from l2ir.text import parse_kernel_file
from l2ir.verify import verify


def _root():
    return resources.files(__name__)


def sweep_names() -> tuple[str, ...]:
    """Every sweep shipped with L2IR, sorted."""
    return tuple(sorted(p.name for p in _root().iterdir() if p.is_dir() and not p.name.startswith("_")))


def load_sweep(name: str) -> dict[str, Kernel]:
    """The sweep's configurations by name, sorted, each verified. An unknown sweep, a malformed file or an illegal
    kernel is an L2IRError naming the file. A search loads its sweeps for every shape it seeds; the parsed sweep
    is kept while its files (names, sizes, modification times) stay as they were."""
    folder = _root() / name
    if name not in sweep_names():
        raise L2IRError(f"unknown sweep '{name}' (sweeps: {', '.join(sweep_names())})")
    files = tuple(sorted((p for p in folder.iterdir() if p.name.endswith(".l2")), key=lambda p: p.name))
    if not isinstance(folder, Path):            # a zipped install: nothing to stat, parse every time
        return _parse_sweep(name, files)
    stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    return dict(_parse_sweep_kept(name, str(folder), stamp))


@lru_cache(maxsize=64)
def _parse_sweep_kept(name: str, folder: str, stamp: tuple) -> dict[str, Kernel]:
    return _parse_sweep(name, tuple(Path(folder) / entry[0] for entry in stamp))


def _parse_sweep(name: str, files) -> dict[str, Kernel]:
    out: dict[str, Kernel] = {}
    for path in files:
        where = f"sweeps/{name}/{path.name}"
        problem, kernel, _ = parse_kernel_file(path.read_text(encoding="utf-8"), where)
        if problem is not None:
            raise L2IRError(f"{where}: a sweep kernel is problem-independent; drop the gemm line")
        try:
            out[path.name[:-len(".l2")]] = verify(kernel)
        except L2IRError as e:
            raise L2IRError(f"{where}: [{type(e).__name__}] {e}") from None
    return out
