"""`l2ir.matmul(a, b, out=None)`: torch.matmul that runs L2IR's tuned kernels where a dispatch package says they win.

    import l2ir
    l2ir.load("pkg/")                      # or L2IR_DISPATCH=pkg/ in the environment (read at the first call)
    c = l2ir.matmul(a, b)                  # a (..., M, K) row-major, b (K, N) row- or column-major, fp16/bf16
    with l2ir.patch_linear():              # nn.Linear / F.linear go through l2ir.matmul
        y = model(x)
    l2ir.dispatch_stats()                  # {"l2ir": 120, "cublas": 8, "misaligned": 1, ...}

It is a torch custom op (`torch.ops.l2ir.matmul`, `torch.ops.l2ir.matmul_out`) with fake implementations, so it
works under CUDA graph capture (launches go to the current stream) and inside torch.compile(fullgraph=True). In eager
mode the wrapper calls the same implementation directly: the dispatcher's per-call cost is a dict lookup keyed by
(m, n, k, dtype, layouts), the output allocation, and one cuLaunchKernel through ctypes with argument arrays built
once per thread.

It never gives a wrong answer: whatever it cannot serve goes to torch.matmul, and each such call is counted under
its reason (REASONS below), also logged at DEBUG level on the "l2ir.dispatch" logger. A call captured in a CUDA graph
is counted once, at capture; replays do not run Python.

The runtime import chain is l2ir.dispatch -> l2ir.runtime, l2ir.indexing (launch expressions) and, for untuned
shapes only, l2ir.text + l2ir.verify (the problem rules on the kernel's IR). It never imports l2ir.search,
l2ir.backends or a compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import math
import os
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

ENV_VAR = "L2IR_DISPATCH"
FORMAT = "l2ir-dispatch"                  # the one home of these two is l2ir/export.py; repeated here so that
FORMAT_VERSION = 1                        # loading never imports the export tool (a test checks they agree)

REASONS = {
    "l2ir": "served by an L2IR kernel",
    "cublas": "the table says cuBLAS for this shape (tuned there, or its nearest tuned shape)",
    "untuned": "no tuned shape of this problem class within the package's distance",
    "not_admitted": "no nearby kernel admits the shape (the verifier's problem rules)",
    "no_package": "no dispatch package loaded",
    "cpu": "a tensor is not on a CUDA device (or the two are on different devices)",
    "dtype": "not fp16/bf16, or A and B differ in dtype",
    "layout": "a problem class (layouts, dtype) the package has no kernels for",
    "noncontiguous": "an operand is neither row- nor column-major contiguous",
    "misaligned": "an operand's data pointer is not 16-byte aligned",
    "batch": "batch dimensions not covered (B batched, A batched but not contiguous, or a 1-D operand)",
    "empty": "a zero-sized dimension",
    "out": "out= is not a contiguous, aligned tensor of the result's shape, dtype and device",
    "autograd": "an input requires grad (torch.matmul keeps the graph)",
    "environment": "the GPU or driver differs from the package's manifest",
    "load_failed": "the kernel's binary failed to load on this device",
    "launch_failed": "the driver refused the launch",
}

log = logging.getLogger("l2ir.dispatch")

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}


class PackageError(Exception):
    """A dispatch package that cannot be used (missing file, wrong format or version, content hash mismatch)."""


# ---------------------------------------------------------------------------------------------------------------
# The package: manifest, table, routes.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class KernelSpec:
    key: str
    hash: str
    problem_class: str
    dir: Path
    binary: str
    plan: dict
    ir_file: str
    _ir_kernel: object = None

    def admits(self, m: int, n: int, k: int) -> bool:
        """The verifier's problem rules for this kernel on (m, n, k) (divisibility, alignment, split-K, grid)."""
        from .nodes import Problem
        from .text import parse_kernel, parse_problem
        from .verify import applicable

        if self._ir_kernel is None:
            self._ir_kernel = parse_kernel((self.dir / self.ir_file).read_text())
        base = parse_problem(f"gemm m=1 n=1 k=1 {self.problem_class}")
        assert isinstance(base, Problem)
        return applicable(self._ir_kernel, base.with_shape(m, n, k))


@dataclass
class Package:
    path: Path
    manifest: dict
    tuned: dict[tuple[int, int, int, str], str | None]      # (m, n, k, class) -> kernel key or None (cuBLAS)
    kernels: dict[str, KernelSpec]
    max_distance: float
    by_class: dict[str, list[tuple[tuple[float, float, float], tuple[int, int, int]]]] = field(default_factory=dict)

    def resolve(self, m: int, n: int, k: int, cls: str) -> tuple[str | None, str]:
        """(kernel key or None, reason) for one shape: the table for a tuned shape, else the neighbour rule."""
        if (m, n, k, cls) in self.tuned:
            key = self.tuned[(m, n, k, cls)]
            return (key, "l2ir") if key else (None, "cublas")
        if cls not in self.by_class:
            return None, "layout"
        here = (math.log2(m), math.log2(n), math.log2(k))
        near = sorted((math.dist(here, logs), shape) for logs, shape in self.by_class[cls])
        seen = False
        for d, shape in near:
            if d > self.max_distance:
                break
            seen = True
            key = self.tuned[(*shape, cls)]
            if key is None:
                return None, "cublas"
            if self.kernels[key].admits(m, n, k):
                return key, "l2ir"
        return None, ("not_admitted" if seen else "untuned")


def read_package(path: str | Path) -> Package:
    """Read and check a package folder (format, version, every file's hash)."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise PackageError(f"{path}: no manifest.json (not a dispatch package)") from None
    except json.JSONDecodeError as e:
        raise PackageError(f"{path}/manifest.json: not JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise PackageError(f"{path}/manifest.json: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") != FORMAT_VERSION:
        raise PackageError(f"{path}/manifest.json: version {manifest.get('version')}, this L2IR reads "
                           f"{FORMAT_VERSION}")
    files = manifest.get("files") or {}
    for rel, digest in files.items():
        p = path / rel
        if not p.is_file():
            raise PackageError(f"{path}: {rel} is listed in the manifest but missing")
        if hashlib.sha256(p.read_bytes()).hexdigest() != digest:
            raise PackageError(f"{path}: {rel} does not match its hash in the manifest (modified or corrupt)")
    if hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest() != manifest.get("content_hash"):
        raise PackageError(f"{path}/manifest.json: content hash does not match the listed files")
    table = json.loads((path / "table.json").read_text())
    kernels = {key: KernelSpec(key, spec["hash"], spec["problem_class"], path / spec["dir"], spec["binary"],
                               spec["plan"], spec["ir"]) for key, spec in table["kernels"].items()}
    tuned: dict[tuple[int, int, int, str], str | None] = {}
    by_class: dict[str, list] = {}
    for e in table["entries"]:
        key = e.get("kernel_key")
        if key is not None and key not in kernels:
            raise PackageError(f"{path}/table.json: entry {e['m']}x{e['n']}x{e['k']} names unknown kernel {key}")
        tuned[(e["m"], e["n"], e["k"], e["problem_class"])] = key
        by_class.setdefault(e["problem_class"], []).append(
            ((math.log2(e["m"]), math.log2(e["n"]), math.log2(e["k"])), (e["m"], e["n"], e["k"])))
    return Package(path, manifest, tuned, kernels, float(manifest["rule"]["max_distance"]), by_class)


# ---------------------------------------------------------------------------------------------------------------
# Launching a kernel from the package.
# ---------------------------------------------------------------------------------------------------------------


class _Args(ctypes.Structure):
    # The L2IR ABI's argument values, one block per thread; the driver copies them at launch (and at capture).
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p), ("m", ctypes.c_int),
                ("n", ctypes.c_int), ("k", ctypes.c_int), ("ws", ctypes.c_void_p)]


def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuCtxSetCurrent.restype = ctypes.c_int
    return lib


class Runner:
    """One kernel loaded on one device. `__call__(a, b, c, m, n, k, like, stream)` takes data pointers; `like`
    is a tensor on the device (a workspace is allocated beside it)."""

    def __init__(self, spec: KernelSpec, device: int):
        from .indexing import parse_expr
        from .runtime import Launch, LaunchPlan, load

        p = spec.plan
        self.plan = LaunchPlan(
            source="", arch=p["arch"], form=p["form"],
            launches=tuple(Launch(ln["entry"], tuple(parse_expr(g) for g in ln["grid"]), tuple(ln["block"]),
                                  ln["smem"], tuple(ln["cluster"])) for ln in p["launches"]),
            workspace_bytes=parse_expr(p["workspace_bytes"]), zero_workspace=p["zero_workspace"])
        self.launcher = load(self.plan, spec.dir / spec.binary, device)
        self._geom: dict[tuple[int, int, int], tuple] = {}
        self._tls = threading.local()
        self._fast = None
        if self.plan.form == "kernels" and all(ln.cluster == (1, 1, 1) for ln in self.plan.launches):
            try:
                lib = _libcuda()
                self._fast = (lib.cuLaunchKernel, lib.cuCtxSetCurrent, int(self.launcher._ctx),
                              [int(fn) for fn in self.launcher._funcs])
            except (OSError, TypeError, AttributeError):
                self._fast = None     # the cuda-python launcher below is slower but equivalent

    def _geometry(self, m: int, n: int, k: int) -> tuple:
        grids = []
        for ln in self.plan.launches:
            g = ln.grid_for(m, n, k)
            grids.append((g, ln.block, ln.smem))
        ws = self.launcher.workspace_bytes(m, n, k)
        geo = (tuple(grids), ws)
        self._geom[(m, n, k)] = geo
        return geo

    def __call__(self, a: int, b: int, c: int, m: int, n: int, k: int, like: torch.Tensor, stream: int):
        grids, ws_bytes = self._geom.get((m, n, k)) or self._geometry(m, n, k)
        ws_ptr, ws_t = 0, None
        if ws_bytes:
            ws_t = (torch.zeros if self.plan.zero_workspace else torch.empty)(ws_bytes, dtype=torch.uint8,
                                                                              device=like.device)
            ws_ptr = ws_t.data_ptr()
        if self._fast is None:
            self.launcher(a, b, c, m, n, k, ws_ptr, ws_bytes, stream)
            return ws_t
        launch, set_ctx, ctx, fns = self._fast
        args = getattr(self._tls, "args", None)
        if args is None:
            args = self._tls.args = _Args()
            off = [getattr(_Args, f).offset for f, _ in _Args._fields_]
            base = ctypes.addressof(args)
            self._tls.params = (ctypes.c_void_p * 7)(*[base + o for o in off])
        args.a, args.b, args.c, args.m, args.n, args.k, args.ws = a, b, c, m, n, k, ws_ptr
        params = self._tls.params
        # torch binds the primary context to a thread lazily; the module lives there, so make it current.
        set_ctx(ctx)
        for fn, ((gx, gy, gz), (bx, by, bz), smem) in zip(fns, grids):
            if gx * gy * gz == 0:
                continue
            rc = launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, None)
            if rc:
                from .runtime import LaunchError

                raise LaunchError(f"cuLaunchKernel returned CUresult {rc} for m={m} n={n} k={k}")
        return ws_t


# ---------------------------------------------------------------------------------------------------------------
# The dispatcher.
# ---------------------------------------------------------------------------------------------------------------


def _driver_version() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for tok in text.split():
        if tok.count(".") >= 1 and tok.replace(".", "").isdigit():
            return tok
    return None


def _layout(t: torch.Tensor, rows: int, cols: int) -> str | None:
    """'row' or 'col' for a 2-D view, None if neither contiguous form (size-1 dims have arbitrary strides)."""
    s0, s1 = t.stride()
    if (s1 == 1 or cols == 1) and (s0 == cols or rows == 1):
        return "row"
    if (s0 == 1 or rows == 1) and (s1 == rows or cols == 1):
        return "col"
    return None


class Dispatcher:
    """Routes calls to package kernels or torch.matmul. One per process (see `_dispatcher()`)."""

    device_type = "cuda"

    def __init__(self, package: Package | None):
        self.package = package
        self.stats: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._routes: dict[tuple, str | None | tuple] = {}
        self._devices: dict[int, dict] = {}            # index -> {"ok": bool, "runners": {key: Runner|Exception}}
        self._classes: dict[tuple, str] = {}
        for dt, name in _DTYPES.items():
            for la in ("row", "col"):
                for lb in ("row", "col"):
                    self._classes[(dt, la, lb)] = f"a={name}:{la} b={name}:{lb} c={name}:row acc=f32"

    # -- what the GPU is, and whether the package was measured on one like it --------------------------------

    def device_env(self, index: int) -> dict:
        props = torch.cuda.get_device_properties(index)
        return {"gpu": props.name, "sms": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}", "driver": _driver_version()}

    def current_stream(self, index: int) -> int:
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # the handle alone, no Stream object
        return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream

    def make_runner(self, spec: KernelSpec, index: int):
        return Runner(spec, index)

    def _device(self, index: int) -> dict:
        state = self._devices.get(index)
        if state is not None:
            return state
        with self._lock:
            if index in self._devices:
                return self._devices[index]
            want = self.package.manifest["environment"]
            have = self.device_env(index)
            diffs = [f"{key} {have.get(key)!r} (package: {want.get(key)!r})" for key in ("gpu", "sms", "capability")
                     if str(have.get(key)) != str(want.get(key))]
            if have.get("driver") and want.get("driver") and have["driver"] != want["driver"]:
                diffs.append(f"driver {have['driver']!r} (package: {want['driver']!r})")
            if diffs:
                warnings.warn(f"l2ir: dispatch package {self.package.path} was measured on another machine: "
                              f"device {index} has {'; '.join(diffs)}; every call on it goes to torch.matmul",
                              RuntimeWarning, stacklevel=4)
            state = {"ok": not diffs, "runners": {}}
            self._devices[index] = state
            return state

    def _runner(self, state: dict, key: str, index: int):
        r = state["runners"].get(key)
        if r is not None:
            return r
        with self._lock:
            r = state["runners"].get(key)
            if r is None:
                try:
                    r = self.make_runner(self.package.kernels[key], index)
                except Exception as e:  # noqa: BLE001 - a kernel that does not load falls back, once, loudly
                    warnings.warn(f"l2ir: kernel {key} failed to load on device {index}: {e}; its shapes go to "
                                  f"torch.matmul", RuntimeWarning, stacklevel=4)
                    r = e
                state["runners"][key] = r
            return r

    # -- one call --------------------------------------------------------------------------------------------

    def _count(self, reason: str, m=None, n=None, k=None):
        with self._lock:
            self.stats[reason] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("l2ir.matmul %sx%sx%s -> %s", m, n, k,
                      "L2IR kernel" if reason == "l2ir" else f"torch.matmul ({reason})")

    def route(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None):
        """(reason, runner, m, n, k, device index): runner is None for every fallback reason."""
        if self.package is None:
            return "no_package", None, 0, 0, 0, 0
        dev = a.device
        if dev.type != self.device_type or b.device != dev:
            return "cpu", None, 0, 0, 0, 0
        dt = a.dtype
        if dt not in _DTYPES or b.dtype != dt:
            return "dtype", None, 0, 0, 0, 0
        nd = a.dim()
        if b.dim() != 2 or nd < 2:
            return "batch", None, 0, 0, 0, 0
        k, n = b.shape
        if nd == 2:
            m, ka = a.shape
            la = _layout(a, m, k)
        elif a.is_contiguous():
            ka = a.shape[-1]
            m = a.numel() // k if k else 0
            la = "row"
        else:
            return "batch", None, 0, 0, 0, 0
        if ka != k:
            return "batch", None, 0, 0, 0, 0    # torch.matmul raises its own shape error
        if m == 0 or n == 0 or k == 0:
            return "empty", None, m, n, k, 0
        lb = _layout(b, k, n)
        if la is None or lb is None:
            return "noncontiguous", None, m, n, k, 0
        if (a.data_ptr() | b.data_ptr()) & 15:
            return "misaligned", None, m, n, k, 0
        if out is not None and (out.device != dev or out.dtype != dt or not out.is_contiguous()
                                or out.shape != a.shape[:-1] + (n,) or out.data_ptr() & 15):
            return "out", None, m, n, k, 0
        rkey = (m, n, k, dt, la, lb)
        hit = self._routes.get(rkey)
        if hit is None:
            hit = self.package.resolve(m, n, k, self._classes[(dt, la, lb)])
            self._routes[rkey] = hit
        key, reason = hit
        if key is None:
            return reason, None, m, n, k, 0
        index = dev.index or 0
        state = self._devices.get(index) or self._device(index)
        if not state["ok"]:
            return "environment", None, m, n, k, index
        runner = state["runners"].get(key) or self._runner(state, key, index)
        if isinstance(runner, Exception):
            return "load_failed", None, m, n, k, index
        return "l2ir", runner, m, n, k, index

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        reason, runner, m, n, k, index = self.route(a, b, out)
        if runner is not None:
            if out is not None:
                c = out
            else:
                c = a.new_empty((m, n)) if a.dim() == 2 else a.new_empty(a.shape[:-1] + (n,))
            try:
                runner(a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k, a, self.current_stream(index))
            except Exception as e:  # noqa: BLE001 - a refused launch is answered by torch.matmul, and remembered
                self._devices[index]["runners"][next(key for key, r in self._devices[index]["runners"].items()
                                                     if r is runner)] = e
                warnings.warn(f"l2ir: launch failed ({e}); this kernel's shapes go to torch.matmul",
                              RuntimeWarning, stacklevel=3)
                reason = "launch_failed"
            else:
                self._count("l2ir", m, n, k)
                return c
        self._count(reason, m, n, k)
        if out is not None:
            return torch.matmul(a, b, out=out)
        return torch.matmul(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Process-wide state: one package, one dispatcher.
# ---------------------------------------------------------------------------------------------------------------

_STATE: dict = {"dispatcher": None}
_STATE_LOCK = threading.Lock()


def load(path: str | Path) -> dict:
    """Load a dispatch package for this process; returns its manifest. Loading the same package again is free;
    another one while one is loaded is an error (binaries are loaded once per device and kept)."""
    path = Path(path).resolve()
    with _STATE_LOCK:
        d = _STATE["dispatcher"]
        if d is not None and d.package is not None:
            if d.package.path == path:
                return d.package.manifest
            raise PackageError(f"a dispatch package is already loaded ({d.package.path}); one per process")
        pkg = read_package(path)
        _STATE["dispatcher"] = Dispatcher(pkg)
        log.info("loaded dispatch package %s (%d tuned shapes, %d kernels)", path, len(pkg.tuned), len(pkg.kernels))
        return pkg.manifest


def _dispatcher() -> Dispatcher:
    d = _STATE["dispatcher"]
    if d is not None:
        return d
    with _STATE_LOCK:
        if _STATE["dispatcher"] is None:
            pkg = None
            where = os.environ.get(ENV_VAR)
            if where:
                try:
                    pkg = read_package(Path(where).resolve())
                except PackageError as e:
                    warnings.warn(f"l2ir: {ENV_VAR}={where}: {e}; l2ir.matmul runs torch.matmul", RuntimeWarning)
            _STATE["dispatcher"] = Dispatcher(pkg)
        return _STATE["dispatcher"]


def _reset(dispatcher: Dispatcher | None = None) -> None:
    """Forget the loaded package (tests); `dispatcher` installs a prepared one."""
    with _STATE_LOCK:
        _STATE["dispatcher"] = dispatcher


def dispatch_stats() -> dict[str, int]:
    """Calls per path since the process started: "l2ir" or the fallback reason (see REASONS)."""
    d = _STATE["dispatcher"]
    if d is None:
        return {}
    with d._lock:
        return dict(d.stats)


# ---------------------------------------------------------------------------------------------------------------
# The torch op and the user-facing functions.
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("l2ir::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _dispatcher().run(a, b)


@_matmul_op.register_fake
def _matmul_fake(a, b):
    return torch.matmul(a, b)      # on fake tensors: shape, dtype and device only


@torch.library.custom_op("l2ir::matmul_out", mutates_args=("out",))
def _matmul_out_op(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    _dispatcher().run(a, b, out)


@_matmul_out_op.register_fake
def _matmul_out_fake(a, b, out):
    return None


_is_compiling = torch.compiler.is_compiling


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.matmul(a, b, out=out), through L2IR's tuned kernels where the loaded package serves the shape."""
    if (a.requires_grad or b.requires_grad) and torch.is_grad_enabled():
        if not _is_compiling():
            _dispatcher()._count("autograd")
        return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
    if type(a) is torch.Tensor and type(b) is torch.Tensor and not _is_compiling():
        # Eager: the op's own implementation, without the op dispatch (a few microseconds a call).
        return (_STATE["dispatcher"] or _dispatcher()).run(a, b, out)
    if out is None:
        return torch.ops.l2ir.matmul(a, b)
    torch.ops.l2ir.matmul_out(a, b, out)
    return out


@contextlib.contextmanager
def patch_linear():
    """Route torch.nn.functional.linear (and so nn.Linear) through l2ir.matmul inside the block.
    y = x @ W.t() is problem b=...:col (W is row-major (N, K)); the bias is added by torch."""
    import torch.nn.functional as F

    original = F.linear

    def linear(input, weight, bias=None):
        y = matmul(input, weight.t())
        return y if bias is None else y + bias

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original
