"""`l2ir.matmul(a, b, out=None)`: torch.matmul that runs L2IR's tuned kernels where a dispatch package says they win.

    import l2ir
    l2ir.load("pkg/")                      # or L2IR_DISPATCH=pkg/ in the environment (read at the first call)
    c = l2ir.matmul(a, b)                  # a (..., M, K) row-major, b (K, N) row- or column-major, fp16/bf16
    with l2ir.patch_linear():              # nn.Linear / F.linear go through l2ir.matmul
        y = model(x)
    l2ir.dispatch_stats()                  # {"l2ir": 120, "cublas": 8, "misaligned": 1, ...}

It is a torch custom op (`torch.ops.l2ir.matmul`, `torch.ops.l2ir.matmul_out`) with fake implementations, so it
works under CUDA graph capture (launches go to the current stream) and inside torch.compile(fullgraph=True). Outside
torch.compile the wrapper calls the implementation directly, without the op dispatcher. The first call of each
(shapes, strides, dtypes, device indices) decides its route under a lock and keeps it as a closure; every later call
is a lock-free dict lookup and that closure: a fallback counts its reason and calls torch, a served call checks the
data pointers' alignment, allocates the output and launches with everything else bound (grids, function handles,
argument block, workspace size). A shape the table gives to cuBLAS may name an eager kernel (l2ir/export.py's eager
rule, `eager_pays` here): its route runs that kernel on eager calls, which are host-bound on small GEMMs and issue an L2IR
launch sooner than torch.matmul, and cuBLAS when captured into a CUDA graph, where only device time counts.

The compiled eager path (l2ir/fastpath.cpp, built into the package by `l2ir export`, loaded by l2ir/fastpath.py when
the running Python and torch are the ones it was built for) holds the same routes in C++: `_prepare` adds each route
it keeps, and a repeated eager call without out= is answered there (a key of the operands' sizes, strides, dtypes and
devices; then at::mm, or the output allocation and the launch through the entry point the Python route bound), with
no Python executed past `matmul`'s first test. What it does not hold returns None and runs the Python route.

It never gives a wrong answer: whatever it cannot serve goes to torch.matmul, and each such call is counted under
its reason (REASONS below; a thread counts into its own dict, summed by `dispatch_stats()`); each route is logged
at DEBUG level on the "l2ir.dispatch" logger when it is decided. A call captured in a CUDA graph is counted once,
at capture; replays do not run Python.

The runtime import chain is l2ir.dispatch -> l2ir.runtime, l2ir.indexing (launch expressions) and, for untuned
shapes only, l2ir.text + l2ir.verify (the problem rules on the kernel's IR). It never imports l2ir.search,
l2ir.backends or a compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import math
import os
import sys
import threading
import warnings
from collections import Counter, defaultdict
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
    "unpromising": "the nearest tuned shape's kernel is predicted below BORROW_MIN_PREDICTED here: its measured speedup "
                   "times the FLOP ratio over the ratio of tiles it runs",
    "alignment": "the nearby tuned shapes are aligned otherwise: a kernel that beat cuBLAS's slow unaligned path says "
                 "nothing against its fast one, nor cuBLAS winning on an aligned shape about its slow path",
    "no_package": "no dispatch package loaded",
    "cpu": "a tensor is not on a CUDA device (or the two are on different devices)",
    "dtype": "not fp16/bf16, or A and B differ in dtype",
    "layout": "a problem class (layouts, dtype) the package has no kernels for, or an operand without strides (sparse)",
    "noncontiguous": "an operand is neither row- nor column-major contiguous",
    "misaligned": "an operand's data pointer is not 16-byte aligned",
    "batch": "batch dimensions not covered (B batched, A batched but not contiguous, a 1-D operand, or M, N or K "
             "beyond a 32-bit int)",
    "empty": "a zero-sized dimension",
    "out": "out= is not a contiguous, aligned tensor of the result's shape, dtype and device, or overlaps an operand",
    "autograd": "an input requires grad or carries a forward-mode tangent (torch.matmul keeps the graph)",
    "autocast": "autocast is on for the device with another dtype than the operands' (torch.matmul casts to it)",
    "environment": "the GPU or driver differs from the package's manifest",
    "load_failed": "the kernel's binary failed to load on this device",
    "launch_failed": "the driver refused the launch",
}

log = logging.getLogger("l2ir.dispatch")

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
_INT_MAX = 2**31 - 1
# An untuned shape borrows its nearest tuned shape's kernel only where Package.predicted_speedup says at least this
# (its eager calls may still run the kernel: Package._eager_of). Chosen on bench/results/
# dispatch_families_v4_fast_h200.json's 92 borrowed untuned neighbours (device time against torch, a declined shape
# counting 1.0): geomean 0.968 with every admitted kernel borrowed (32 below 0.97x), 1.013 at a bound of 1.0, 1.034
# at 1.1 (2 below 0.97x), 1.015 at 1.15; the same on the re-measured run dispatch_families_v5_fast_h200.json, and the
# unaligned package's runs 2.39 -> 2.38 (its one loss declined). bench/neighbour_rule.py recomputes these.
BORROW_MIN_PREDICTED = 1.1
COUNTERS = tuple(REASONS)           # the compiled fast path's counters, in this order


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

    def kernel(self):
        """The kernel's IR, parsed once."""
        from .text import parse_kernel

        if self._ir_kernel is None:
            self._ir_kernel = parse_kernel((self.dir / self.ir_file).read_text())
        return self._ir_kernel

    def tile(self) -> tuple[int, int, int] | None:
        """The block tile (BM, BN, BK); None for a free-form Source kernel."""
        k = self.kernel()
        return None if k.tile is None else tuple(k.tile.block)

    def admits(self, m: int, n: int, k: int) -> bool:
        """The verifier's problem rules for this kernel on (m, n, k) (divisibility, alignment, split-K, grid)."""
        from .verify import applicable

        return applicable(self.kernel(), _class_problem(self.problem_class).with_shape(m, n, k))


@dataclass
class Package:
    path: Path
    manifest: dict
    tuned: dict[tuple[int, int, int, str], str | None]      # (m, n, k, class) -> kernel key or None (cuBLAS)
    kernels: dict[str, KernelSpec]
    max_distance: float
    by_class: dict[str, list[tuple[tuple[float, float, float], tuple[int, int, int]]]] = field(default_factory=dict)

    # (m, n, k, class) -> the L2IR kernel eager calls run where the table says cuBLAS (l2ir/export.py's eager rule)
    eager: dict[tuple[int, int, int, str], str] = field(default_factory=dict)
    # (m, n, k, class) -> the table's measured speedup of the tuned shape's kernel (the neighbour rule's prediction)
    speedups: dict[tuple[int, int, int, str], float] = field(default_factory=dict)
    # (m, n, k, class) -> (kernel us, cuBLAS us) there (a cuBLAS shape: its eager kernel's): the eager predictions
    times: dict[tuple[int, int, int, str], tuple[float, float]] = field(default_factory=dict)

    def _nearest(self, m: int, n: int, k: int, cls: str):
        """The tuned shapes of `cls` within the package's distance of (m, n, k) in log2 space, nearest first, each
        with whether its rows are all aligned (`rows_aligned`)."""
        here = (math.log2(m), math.log2(n), math.log2(k))
        for d, shape in sorted((math.dist(here, logs), shape) for logs, shape in self.by_class.get(cls, ())):
            if d > self.max_distance:
                return
            yield shape, rows_aligned(*shape, cls)

    def _decide(self, m: int, n: int, k: int, cls: str) -> tuple[str | None, str, tuple | None]:
        """(kernel key or None, reason, the tuned shape that decided) by the table, else the neighbour rule."""
        if (m, n, k, cls) in self.tuned:
            key = self.tuned[(m, n, k, cls)]
            return (key, "l2ir", (m, n, k)) if key else (None, "cublas", (m, n, k))
        if cls not in self.by_class:
            return None, "layout", None
        seen = other_alignment = False
        aligned = rows_aligned(m, n, k, cls)
        for shape, shape_aligned in self._nearest(m, n, k, cls):
            key = self.tuned[(*shape, cls)]
            # An odd K or N sends cuBLAS down a path several times slower. So a kernel that beat it on an unaligned
            # shape can lose to it on an aligned neighbour (0.4-0.8x on the device, bench/results/
            # dispatch_unaligned_v4_h200.json), and cuBLAS winning on an aligned shape says nothing about its slow
            # path. What carries across: an aligned shape's kernel to an unaligned neighbour it admits (cuBLAS
            # only gets slower there).
            if shape_aligned != aligned and (key is None or not shape_aligned):
                other_alignment = True
                continue
            seen = True
            if key is None:
                return None, "cublas", shape
            if self.kernels[key].admits(m, n, k):
                if self.predicted_speedup(key, shape, (m, n, k), cls) < BORROW_MIN_PREDICTED:
                    return key, "unpromising", shape      # cuBLAS; the key for the eager prediction
                return key, "l2ir", shape
        return None, ("not_admitted" if seen else "alignment" if other_alignment else "untuned"), None

    def predicted_speedup(self, key: str, tuned: tuple[int, int, int], shape: tuple[int, int, int], cls: str) -> float:
        """`predicted_speedup` of the kernel `key` from the tuned shape's measured speedup (inf: a table without
        speedups, which predicts nothing)."""
        s = self.speedups.get((*tuned, cls))
        return math.inf if s is None else predicted_speedup(s, self.kernels[key].tile(), tuned, shape)

    def resolve(self, m: int, n: int, k: int, cls: str) -> tuple[str | None, str]:
        """(kernel key or None, reason) for one shape: the table for a tuned shape, else the neighbour rule."""
        key, reason, _ = self._decide(m, n, k, cls)
        return (None, reason) if reason == "unpromising" else (key, reason)

    def resolve_eager(self, m: int, n: int, k: int, cls: str) -> str | None:
        """For a shape `resolve` gives to cuBLAS: the kernel its eager calls run, or None."""
        return self._eager_of(m, n, k, cls, *self._decide(m, n, k, cls))

    def route(self, m: int, n: int, k: int, cls: str) -> tuple[str | None, str]:
        """`resolve`, except that a cuBLAS shape with an eager kernel is (that kernel, "eager"): one neighbour walk."""
        key, reason, shape = self._decide(m, n, k, cls)
        ekey = self._eager_of(m, n, k, cls, key, reason, shape)
        if ekey is not None:
            return ekey, "eager"
        return (None, reason) if reason == "unpromising" else (key, reason)

    def _eager_of(self, m: int, n: int, k: int, cls: str, key: str | None, reason: str,
                  shape: tuple | None) -> str | None:
        """The eager kernel of a cuBLAS decision: the deciding tuned shape's eager kernel, if it admits this shape;
        for an unpromising neighbour its borrowed kernel, if on its predicted device time (the tuned time times the
        tile ratio) against cuBLAS's (the tuned time times the FLOP ratio) an eager call pays (`eager_pays`)."""
        if reason == "unpromising":
            return key if self._eager_pays_at(key, shape, (m, n, k), cls) else None
        if reason != "cublas":
            return None
        ekey = self.eager.get((*shape, cls))
        if ekey is None or shape == (m, n, k):
            return ekey
        if not self.kernels[ekey].admits(m, n, k):
            return None
        # A neighbour up to twice the tuned shape's size may cross into GPU-bound calls: the same prediction; a
        # package without the eager kernel's times (or a Source kernel) keeps it.
        return None if self._eager_pays_at(ekey, shape, (m, n, k), cls) is False else ekey

    def _eager_pays_at(self, key: str, tuned: tuple, shape: tuple, cls: str) -> bool | None:
        """`eager_pays` for kernel `key` at `shape` on the times measured at the tuned shape, carried over: the
        kernel's by the ratio of tiles it runs, cuBLAS's by the FLOP ratio. None where they cannot be carried (no
        times in the table, a Source kernel without a tile)."""
        t, tile = self.times.get((*tuned, cls)), self.kernels[key].tile()
        if t is None or tile is None:
            return None
        kernel_us, cublas_us = t
        return eager_pays(kernel_us * tile_ratio(tile, tuned, shape), cublas_us * flop_ratio(tuned, shape),
                          self.manifest.get("rule", {}))


def predicted_speedup(speedup: float, tile: tuple[int, int, int] | None, tuned: tuple[int, int, int],
                      shape: tuple[int, int, int]) -> float:
    """A kernel's measured speedup on `tuned` carried to `shape`: times the FLOP ratio (torch's time taken to scale
    with the work) over the ratio of (M, N, K) tiles the kernel runs (its time scales with its tiles: a shape one row
    past a tile boundary pays a whole tile row). A Source kernel (no tile) keeps its speedup."""
    if tile is None:
        return speedup
    return speedup * flop_ratio(tuned, shape) / tile_ratio(tile, tuned, shape)


def eager_pays(kernel_us: float, cublas_us: float, rule: dict) -> bool:
    """Whether an eager call finishes sooner on the L2IR kernel than on cuBLAS (l2ir/export.py's eager rule, with
    the package's `rule` constants). One call: issue then run, so the kernel may be up to eager_slack_us slower on
    the device (below the host time its launch saves). Back-to-back calls: each costs the longer of its issue time
    and its device time, so where cuBLAS's device time is above torch's issue time (the call is GPU-bound) the
    kernel must also be faster on the device. A package without the issue times (an older export) keeps the slack
    alone."""
    if kernel_us > cublas_us + float(rule.get("eager_slack_us", 0.0)):
        return False
    l2ir_issue, torch_issue = rule.get("l2ir_issue_us"), rule.get("torch_issue_us")
    if l2ir_issue is None or torch_issue is None:
        return True
    return max(kernel_us, float(l2ir_issue)) < max(cublas_us, float(torch_issue))


def flop_ratio(tuned: tuple[int, int, int], shape: tuple[int, int, int]) -> float:
    """How much more work `shape` is than `tuned`."""
    return (shape[0] * shape[1] * shape[2]) / (tuned[0] * tuned[1] * tuned[2])


def tile_ratio(tile: tuple[int, int, int], tuned: tuple[int, int, int], shape: tuple[int, int, int]) -> float:
    """How many more (M, N, K) tiles a kernel with this block tile runs on `shape` than on `tuned`."""
    bm, bn, bk = tile

    def tiles(m, n, k):
        return math.ceil(m / bm) * math.ceil(n / bn) * math.ceil(k / bk)

    return tiles(*shape) / tiles(*tuned)


@functools.lru_cache(maxsize=64)
def _class_problem(cls: str):
    from .text import parse_problem

    return parse_problem(f"gemm m=1 n=1 k=1 {cls}")


def rows_aligned(m: int, n: int, k: int, cls: str) -> bool:
    """Whether every row of A, B and C starts 16-byte aligned (each leading dimension a multiple of 8 elements) in
    problem class `cls`: what keeps cuBLAS on its fast (TMA, 16-byte vector) kernels, and what the seed asks of a
    TMA problem (l2ir.seed.store_vector)."""
    from .seed import store_vector

    return store_vector(_class_problem(cls).with_shape(m, n, k)) == 8


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
    eager: dict[tuple[int, int, int, str], str] = {}
    speedups: dict[tuple[int, int, int, str], float] = {}
    times: dict[tuple[int, int, int, str], tuple[float, float]] = {}
    by_class: dict[str, list] = {}
    for e in table["entries"]:
        key, ekey = e.get("kernel_key"), e.get("eager_kernel_key")
        for k_ in (key, ekey):
            if k_ is not None and k_ not in kernels:
                raise PackageError(f"{path}/table.json: entry {e['m']}x{e['n']}x{e['k']} names unknown kernel {k_}")
        tuned[(e["m"], e["n"], e["k"], e["problem_class"])] = key
        if key is not None and e.get("speedup"):
            speedups[(e["m"], e["n"], e["k"], e["problem_class"])] = float(e["speedup"])
        if key is not None and e.get("kernel_us") and e.get("baseline_us"):
            times[(e["m"], e["n"], e["k"], e["problem_class"])] = (float(e["kernel_us"]), float(e["baseline_us"]))
        if ekey is not None and key is None:
            eager[(e["m"], e["n"], e["k"], e["problem_class"])] = ekey
            if e.get("eager_kernel_us") and e.get("baseline_us"):       # the eager kernel's and cuBLAS's times
                times[(e["m"], e["n"], e["k"], e["problem_class"])] = (float(e["eager_kernel_us"]),
                                                                      float(e["baseline_us"]))
        by_class.setdefault(e["problem_class"], []).append(
            ((math.log2(e["m"]), math.log2(e["n"]), math.log2(e["k"])), (e["m"], e["n"], e["k"])))
    return Package(path, manifest, tuned, kernels, float(manifest["rule"]["max_distance"]), by_class, eager, speedups,
                   times)


# ---------------------------------------------------------------------------------------------------------------
# Launching a kernel from the package.
#
# The eager call is host-bound on small shapes (a 64^3 GEMM runs ~2 us on an H200, torch.matmul's host path ~12 us),
# so everything that does not change between two calls of one shape is computed once, in `bind(m, n, k)`: the
# grids, the function handles and context as ctypes objects, the argument block (one per thread). A call fills
# three pointers and launches. The libcuda entry points are called WITHOUT ctypes argtypes (every argument is
# already a ctypes object or a small int), which saves ~0.8 us of per-argument conversion per launch.
# ---------------------------------------------------------------------------------------------------------------


class _Args(ctypes.Structure):
    # The L2IR ABI's argument values, one block per thread; the driver copies them at launch (and at capture).
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p), ("m", ctypes.c_int),
                ("n", ctypes.c_int), ("k", ctypes.c_int), ("ws", ctypes.c_void_p)]


_ARG_OFFSETS = tuple(getattr(_Args, name).offset for name, _ in _Args._fields_)


def _arg_block(m: int, n: int, k: int) -> tuple[_Args, ctypes.c_void_p]:
    """(argument values, kernelParams) for one thread and shape: kernelParams points at each value in the block."""
    args = _Args(None, None, None, m, n, k, None)
    base = ctypes.addressof(args)
    params = (ctypes.c_void_p * len(_ARG_OFFSETS))(*[base + off for off in _ARG_OFFSETS])
    args._params = params                                  # keep the pointer array alive with its block
    return args, ctypes.c_void_p(ctypes.addressof(params))


# Programmatic dependent launch (PDL) goes through cuLaunchKernelEx, which takes its grid, block, stream and
# attributes in one struct. The layouts of cuda.h (CUDA 12 and later; a test compiles cuda.h and compares):
# CUlaunchAttribute is a 4-byte id padded to 8 and a 64-byte value union; CUlaunchConfig is seven unsigned ints, the
# stream, the attribute array and its length.
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttributeValue(ctypes.Union):
    # 64 bytes, aligned as cuda.h's union (it holds pointers); the PDL attribute's value is its first int.
    _fields_ = [("programmatic_stream_serialization", ctypes.c_int), ("_bytes", ctypes.c_uint64 * 8)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint), ("_pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _pdl_config(gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int) -> _LaunchConfig:
    """A launch config that lets the grid start while the stream's previous kernel drains: the kernels wait
    (griddepcontrol.wait) before their first global access, so only their prologue overlaps the previous tail."""
    attr = _LaunchAttribute(LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, b"", _LaunchAttributeValue(1))
    return _LaunchConfig(gx, gy, gz, bx, by, bz, smem, None, ctypes.pointer(attr), 1)   # the pointer keeps attr


class Driver:
    """The libcuda entry points of the eager launch, as bare ctypes functions (no argtypes: see above).
    `path` may name another library with the same symbols (the CPU tests' stub driver)."""

    def __init__(self, path: str = "libcuda.so.1"):
        lib = ctypes.CDLL(path)          # a CDLL of its own: argtypes set on another handle do not reach it
        self.launch = lib.cuLaunchKernel
        # Programmatic dependent launch (CUDA 12 and later); None on an older driver, which launches plainly.
        self.launch_ex = getattr(lib, "cuLaunchKernelEx", None)
        self.set_ctx = lib.cuCtxSetCurrent
        self.get_ctx = lib.cuCtxGetCurrent      # the compiled path's check that the route's context is current


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _launch_failed(entry: str, rc: int, m: int, n: int, k: int):
    from .runtime import LaunchError

    raise LaunchError(f"{entry} returned CUresult {rc} for m={m} n={n} k={k}")


class KernelLaunch:
    """A "kernels" plan without clusters, loaded in `ctx` as `funcs` (one per launch): `bind(m, n, k)` gives
    (go, workspace bytes), `go(a, b, c, ws, stream)` launching every non-empty grid of the plan in order.
    `pdl_device`: the GPU has programmatic dependent launch (sm90 and later); a launch whose plan asks for it then
    goes through cuLaunchKernelEx, as l2ir.runtime.CubinLauncher launches it in the evaluator."""

    def __init__(self, driver: Driver, ctx: int, funcs: list[int], plan, pdl_device: bool = False):
        self.driver, self.ctx, self.funcs, self.plan = driver, ctypes.c_void_p(ctx), list(funcs), plan
        self.pdl_device = pdl_device and driver.launch_ex is not None

    def _grids(self, m: int, n: int, k: int) -> list[tuple]:
        """(function, grid x y z, block x y z, smem, pdl) of every non-empty launch at this shape."""
        grids = []
        for fn, ln in zip(self.funcs, self.plan.launches):
            g = ln.grid_for(m, n, k)
            if g[0] * g[1] * g[2]:
                grids.append((fn, *g, *ln.block, ln.smem, bool(ln.pdl and self.pdl_device)))
        return grids

    def bind(self, m: int, n: int, k: int):
        grids = self._grids(m, n, k)
        ws_bytes = self.plan.workspace_for(m, n, k)
        if len(grids) != 1 or grids[0][-1]:
            return self._bind_each(m, n, k, grids), ws_bytes
        # One ordinary launch, the common eager case: the shortest path, every value bound here.
        launch, set_ctx, ctx, vp = self.driver.launch, self.driver.set_ctx, self.ctx, ctypes.c_void_p
        tls = threading.local()
        ((fn, gx, gy, gz, bx, by, bz, smem, _),) = grids
        fn = vp(fn)

        def go(a: int, b: int, c: int, ws: int, stream: int) -> None:
            try:
                block, params = tls.block
            except AttributeError:
                block, params = tls.block = _arg_block(m, n, k)
            block.a = a
            block.b = b
            block.c = c
            block.ws = ws
            # torch binds the primary context to a thread lazily; the module lives there, so make it current.
            set_ctx(ctx)
            rc = launch(fn, gx, gy, gz, bx, by, bz, smem, vp(stream), params, None)
            if rc:
                _launch_failed("cuLaunchKernel", rc, m, n, k)
        return go, ws_bytes

    def _bind_each(self, m: int, n: int, k: int, grids: list[tuple]):
        """`go` for several launches or a PDL one: each PDL launch through cuLaunchKernelEx with a config of this
        thread's (the stream is set per call), the others through cuLaunchKernel, in the plan's order."""
        launch, launch_ex, set_ctx, ctx, vp = (self.driver.launch, self.driver.launch_ex, self.driver.set_ctx,
                                               self.ctx, ctypes.c_void_p)
        functions = [vp(g[0]) for g in grids]
        tls = threading.local()

        def state():
            block, params = _arg_block(m, n, k)
            configs = [_pdl_config(*g[1:8]) if g[-1] else None for g in grids]
            tls.state = block, params, [(cfg, None if cfg is None else ctypes.byref(cfg)) for cfg in configs]
            return tls.state

        def go(a: int, b: int, c: int, ws: int, stream: int) -> None:
            try:
                block, params, configs = tls.state
            except AttributeError:
                block, params, configs = state()
            block.a, block.b, block.c, block.ws = a, b, c, ws
            s = vp(stream)
            set_ctx(ctx)
            for fn, g, (cfg, ref) in zip(functions, grids, configs):
                if cfg is None:
                    rc = launch(fn, *g[1:8], s, params, None)
                    if rc:
                        _launch_failed("cuLaunchKernel", rc, m, n, k)
                else:
                    cfg.stream = stream
                    rc = launch_ex(ref, fn, params, None)
                    if rc:
                        _launch_failed("cuLaunchKernelEx", rc, m, n, k)
        return go

    def native(self, m: int, n: int, k: int) -> tuple:
        """The same launches for the compiled fast path (l2ir/fastpath.cpp): entry-point addresses and grids (each
        with its PDL flag), and the context the launches need current (it checks; the Python route makes it
        current)."""
        grids = tuple((fn, *rest, int(pdl)) for fn, *rest, pdl in self._grids(m, n, k))
        launch_ex = _address(self.driver.launch_ex) if self.pdl_device else 0
        return ("kernel", _address(self.driver.launch), _address(self.driver.get_ctx), self.ctx.value or 0, grids,
                launch_ex)


class ShimLaunch:
    """A host_shim plan's library: `bind(m, n, k)` gives (go, workspace bytes) calling l2ir_run. `path` is the
    shared library (loaded once more, here, without argtypes: ctypes objects in, an int status out). A library that
    exports l2ir_run_args (l2ir.runtime.RunArgs) takes one pointer to a per-thread block whose shape fields are set
    once: a call sets five fields, which costs about a third of converting l2ir_run's nine arguments
    (bench/results/host_parts_probe_h200.json)."""

    def __init__(self, path: str | Path, workspace_size=None, driver: Driver | None = None, ctx: int = 0):
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        self.driver, self.ctx = driver, ctx     # the device's primary context, for the compiled path's check
        self.run = lib.l2ir_run
        self.run_args = getattr(lib, "l2ir_run_args", None)      # None: a package built before the entry existed
        self.workspace_size = workspace_size or (lambda m, n, k: int(lib.l2ir_workspace_size(m, n, k)))

    def bind(self, m: int, n: int, k: int):
        from .runtime import LaunchError, RunArgs, status_name

        ws_bytes = int(self.workspace_size(m, n, k))

        def failed(rc):
            raise LaunchError(f"l2ir_run returned {rc} ({status_name(rc)}) for m={m} n={n} k={k}")

        if self.run_args is None:
            run, vp, wsb = self.run, ctypes.c_void_p, ctypes.c_size_t(ws_bytes)

            def go(a: int, b: int, c: int, ws: int, stream: int) -> None:
                rc = run(vp(a), vp(b), vp(c), m, n, k, vp(ws), wsb, vp(stream))
                if rc:
                    failed(rc)
            return go, ws_bytes

        run_args, tls = self.run_args, threading.local()

        def block():
            args = RunArgs(None, None, None, m, n, k, None, ws_bytes, None)
            tls.args = args, ctypes.byref(args)
            return tls.args

        def go(a: int, b: int, c: int, ws: int, stream: int) -> None:
            try:
                args, ref = tls.args
            except AttributeError:
                args, ref = block()
            args.a = a
            args.b = b
            args.c = c
            args.workspace = ws
            args.stream = stream
            rc = run_args(ref)
            if rc:
                failed(rc)
        return go, ws_bytes

    def native(self, m: int, n: int, k: int) -> tuple | None:
        """l2ir_run_args's address for the compiled fast path (None: a library without it), with the context that
        must be current: the shim launches on the current device."""
        if self.run_args is None or self.driver is None or not self.ctx:
            return None
        return ("shim", _address(self.run_args), _address(self.driver.get_ctx), self.ctx)


def launch_plan(spec: KernelSpec):
    """The runtime's LaunchPlan of a package kernel (its table entry: form, entries, grid expressions, workspace)."""
    from .indexing import parse_expr
    from .runtime import Launch, LaunchPlan

    p = spec.plan
    return LaunchPlan(
        source="", arch=p["arch"], form=p["form"],
        launches=tuple(Launch(ln["entry"], tuple(parse_expr(g) for g in ln["grid"]), tuple(ln["block"]),
                              ln["smem"], tuple(ln["cluster"]), ln.get("pdl", False)) for ln in p["launches"]),
        workspace_bytes=parse_expr(p["workspace_bytes"]), zero_workspace=p["zero_workspace"])


def _primary_context(device: int) -> int:
    """The device's primary context (torch's): where a host shim's kernels run when the device is current."""
    from cuda.bindings import driver as cu

    from .runtime import _check

    _check(cu.cuInit(0), "cuInit")
    return int(_check(cu.cuDevicePrimaryCtxRetain(_check(cu.cuDeviceGet(device), "cuDeviceGet")),
                      "cuDevicePrimaryCtxRetain"))


class Runner:
    """One kernel loaded on one device. `bind(m, n, k)` -> (go, workspace bytes) with `go(a, b, c, ws, stream)`
    taking data pointers and the raw stream handle; the dispatcher binds once per shape and keeps the result."""

    def __init__(self, spec: KernelSpec, device: int):
        from .runtime import load

        self.plan = launch_plan(spec)
        self.zero_workspace = self.plan.zero_workspace
        self.launcher = load(self.plan, spec.dir / spec.binary, device)
        self._fast = None
        try:
            if self.plan.form == "host_shim":
                try:
                    driver, ctx = Driver(), _primary_context(device)
                except (ImportError, RuntimeError, OSError):
                    driver, ctx = None, 0        # no context check possible: the compiled path calls back `go`
                self._fast = ShimLaunch(spec.dir / spec.binary, self.launcher.workspace_bytes, driver, ctx)
            elif all(ln.cluster == (1, 1, 1) for ln in self.plan.launches):
                self._fast = KernelLaunch(Driver(), int(self.launcher._ctx), [int(fn) for fn in self.launcher._funcs],
                                          self.plan, self.launcher._pdl_device)
        except (OSError, TypeError, AttributeError):
            self._fast = None     # the runtime's launcher below is slower but equivalent

    def bind(self, m: int, n: int, k: int):
        if self._fast is not None:
            return self._fast.bind(m, n, k)
        ws_bytes = self.launcher.workspace_bytes(m, n, k)
        launcher = self.launcher

        def go(a: int, b: int, c: int, ws: int, stream: int) -> None:
            launcher(a, b, c, m, n, k, ws, ws_bytes, stream)      # clusters: cuLaunchKernelEx through cuda-python
        return go, ws_bytes

    def native(self, m: int, n: int, k: int) -> tuple | None:
        """The launch for the compiled fast path, or None (it calls `go` back: clusters launch through cuda-python)."""
        return None if self._fast is None else self._fast.native(m, n, k)


# ---------------------------------------------------------------------------------------------------------------
# The dispatcher.
# ---------------------------------------------------------------------------------------------------------------


def _forward_ad():
    """torch.autograd.forward_ad, whose `_current_level` is >= 0 inside a dual_level() (read per served call)."""
    import torch.autograd.forward_ad as fwad

    return fwad


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


def fast_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """Everything a route depends on except the data pointers (checked on every call): shapes and strides (layout,
    batch, contiguity), dtypes, device indices (an int hashes in a fraction of a torch.device's time; -1 is any
    CPU-side tensor, and a served route also checks per call that both operands are CUDA tensors).
    `Dispatcher.eager` and `matmul` build the same tuple inline (a call costs ~0.1 us; tests/test_dispatch.py checks
    that the three agree)."""
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.get_device(), b.get_device())


_EAGER_IN_CAPTURE = "eager route first seen in a capture"   # decide() -> _prepare(), never counted
_FAST_MAX = 1 << 14          # routes kept per process; dynamic shapes beyond that start the cache over
# Workspaces kept per route and stream: split-K pair counters that each launch leaves at zero (the memset is paid
# once), and repack's copies (one allocation, and a stable address, so the shim's tensor maps of the copies are
# re-used). Past this many bytes per process a route allocates (and, where needed, zeroes) a fresh one per call.
_KEPT_WORKSPACE_BUDGET = 256 << 20


class _Counts:
    """Calls per reason with one dict per thread: a thread only ever increments its own, so the call path takes
    no lock; `total()` sums copies (a dict copy is atomic under the GIL)."""

    def __init__(self):
        self.tls = threading.local()
        self._all: list[defaultdict] = []
        self._lock = threading.Lock()

    def mine(self) -> defaultdict:
        try:
            return self.tls.d
        except AttributeError:
            d = self.tls.d = defaultdict(int)
            with self._lock:
                self._all.append(d)
            return d

    def total(self) -> Counter:
        with self._lock:
            dicts = list(self._all)
        out: Counter[str] = Counter()
        for d in dicts:
            out.update({r: v for r, v in d.copy().items() if v})
        return out


class Dispatcher:
    """Routes calls to package kernels or torch.matmul. One per process (see `_dispatcher()`).

    Each (shapes, strides, dtypes, devices) is decided once, under the lock, into a closure kept in `_fast`: a
    fallback closure counts its reason and calls torch (torch.mm for 2-D operands: the op torch.matmul itself ends
    in, without its dimension dispatch); a served closure holds the bound launch (grids, handles, argument block,
    workspace size, output shape). A repeated call is one dict lookup and that closure."""

    device_type = "cuda"

    def __init__(self, package: Package | None):
        self.package = package
        self._counts = _Counts()
        self._lock = threading.RLock()
        self._routes: dict[tuple, tuple] = {}
        self._fast: dict[tuple, object] = {}
        self._kept_bytes = 0                            # bytes held by routes' kept workspaces
        # (kernel key, m, n, k, device, stream) -> the route's kept workspace: held here, not by the route's
        # closure, so a route prepared again (the route cache was cleared) finds it and the bytes count once.
        self._kept_ws: dict = {}
        self._devices: dict[int, dict] = {}            # index -> {"ok": bool, "runners": {key: Runner|Exception}}
        self._classes: dict[tuple, str] = {}
        for dt, name in _DTYPES.items():
            for la in ("row", "col"):
                for lb in ("row", "col"):
                    self._classes[(dt, la, lb)] = f"a={name}:{la} b={name}:{lb} c={name}:row acc=f32"
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # the handle alone, no Stream object
        self._stream_of = (raw if raw is not None and type(self).current_stream is Dispatcher.current_stream
                           else self.current_stream)
        capt = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)   # torch.cuda's wrapper, one call less
        self._capturing = (capt if capt is not None and type(self).capturing is Dispatcher.capturing
                           else self.capturing)
        # The compiled fast path's route table (l2ir/fastpath.cpp), or None with the reason in `fastpath`: every
        # route kept in `_fast` is also added there, and both are cleared together.
        self._native = None
        self.fastpath = "not attached"

    def attach_fastpath(self, module=None) -> str:
        """Serve repeated eager calls through the compiled fast path: `module` (an imported l2ir_fastpath), or the
        package's own build (`fastpath/` in the package, l2ir/fastpath.py). Returns what `fastpath` then says."""
        from . import fastpath

        if module is None:
            if self.package is None:
                self.fastpath = "python (no package)"
                return self.fastpath
            listed = {Path(f).name for f in self.package.manifest.get("files", {}) if f.startswith("fastpath/")}
            module, why = fastpath.load(self.package.path / "fastpath", listed)
            if module is None:
                self.fastpath = f"python ({why})"
                log.info("l2ir.matmul fast path: %s", self.fastpath)
                return self.fastpath
        with self._lock:
            self._native = module.Table(COUNTERS, self._stream_of, self._capturing)
            self._forget_routes()
        self.fastpath = f"compiled ({Path(module.__file__).name})"
        if _STATE["dispatcher"] is self:
            _install(self)
        return self.fastpath

    @property
    def stats(self) -> Counter:
        """Calls per path: "l2ir" or the fallback reason (see REASONS)."""
        total = self._counts.total()
        if self._native is not None:
            total.update({name: c for name, c in zip(COUNTERS, self._native.counts()) if c})
        return total

    # -- what the GPU is, and whether the package was measured on one like it --------------------------------

    def device_env(self, index: int) -> dict:
        props = torch.cuda.get_device_properties(index)
        return {"gpu": props.name, "sms": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}", "driver": _driver_version()}

    def current_stream(self, index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

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
                              RuntimeWarning, stacklevel=5)
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
                                  f"torch.matmul", RuntimeWarning, stacklevel=5)
                    r = e
                state["runners"][key] = r
            return r

    # -- deciding a route (once per fast key) -----------------------------------------------------------------

    def _count(self, reason: str, m=None, n=None, k=None):
        self._counts.mine()[reason] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("l2ir.matmul %sx%sx%s -> %s", m, n, k,
                      "L2IR kernel" if reason == "l2ir" else f"torch.matmul ({reason})")

    def decide(self, a: torch.Tensor, b: torch.Tensor):
        """(reason, kernel key, runner, m, n, k, device index) from what `fast_key` holds: runner is None for
        every fallback reason. Data pointers and out= are checked per call, by the route's closure."""
        if self.package is None:
            return "no_package", None, None, 0, 0, 0, 0
        dev = a.device
        if dev.type != self.device_type or b.device != dev:
            return "cpu", None, None, 0, 0, 0, 0
        dt = a.dtype
        if dt not in _DTYPES or b.dtype != dt:
            return "dtype", None, None, 0, 0, 0, 0
        nd = a.dim()
        if b.dim() != 2 or nd < 2:
            return "batch", None, None, 0, 0, 0, 0
        k, n = b.shape
        if nd == 2:
            m, ka = a.shape
            la = _layout(a, m, k)
        elif a.is_contiguous():
            ka = a.shape[-1]
            m = a.numel() // k if k else 0
            la = "row"
        else:
            return "batch", None, None, 0, 0, 0, 0
        if ka != k:
            return "batch", None, None, 0, 0, 0, 0    # torch.matmul raises its own shape error
        if m == 0 or n == 0 or k == 0:
            return "empty", None, None, m, n, k, 0
        if max(m, n, k) > _INT_MAX:
            return "batch", None, None, m, n, k, 0     # the kernel ABI's sizes are 32-bit ints
        lb = _layout(b, k, n)
        if la is None or lb is None:
            return "noncontiguous", None, None, m, n, k, 0
        rkey = (m, n, k, dt, la, lb)
        hit = self._routes.get(rkey)
        if hit is None:
            hit = self.package.route(m, n, k, self._classes[(dt, la, lb)])
            self._routes[rkey] = hit
        key, reason = hit
        if key is None:
            return reason, None, None, m, n, k, 0
        if reason == "eager" and self._capturing():
            # First seen inside a CUDA-graph capture: the graph runs cuBLAS, and loading the kernel (module load,
            # attributes) is driver work a capture may refuse; the next eager call decides the route again.
            return _EAGER_IN_CAPTURE, None, None, m, n, k, 0
        index = dev.index or 0
        state = self._device(index)
        if not state["ok"]:
            return "environment", None, None, m, n, k, index
        runner = self._runner(state, key, index)
        if isinstance(runner, Exception):
            return ("cublas" if reason == "eager" else "load_failed"), key, None, m, n, k, index
        return ("eager" if reason == "eager" else "l2ir"), key, runner, m, n, k, index

    def lookup(self, a: torch.Tensor, b: torch.Tensor):
        """The route's closure for these operands (decided and kept on first sight); `.reason` names its path."""
        return self._fast.get(fast_key(a, b)) or self._prepare(a, b)

    def _prepare(self, a: torch.Tensor, b: torch.Tensor):
        key = fast_key(a, b)
        with self._lock:
            entry = self._fast.get(key)
            if entry is not None:
                return entry
            reason, kkey, runner, m, n, k, index = self.decide(a, b)
            two_d = a.dim() == 2 and b.dim() == 2
            fn = torch.mm if two_d else torch.matmul
            if reason == _EAGER_IN_CAPTURE:
                return self._fallback("cublas", fn)           # not kept: see decide()
            if runner is None:
                entry = self._fallback(reason, fn)
            else:
                shape = (m, n) if two_d else (*a.shape[:-1], n)
                entry = self._served(runner, kkey, m, n, k, index, shape, fn)
                if reason == "eager":
                    entry = self._eager_only(entry, self._fallback("cublas", fn))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("l2ir.matmul %sx%sx%s -> %s [route for %s]", m, n, k,
                          {"l2ir": "L2IR kernel", "eager": "L2IR kernel on eager calls, cuBLAS in CUDA graphs"}.get(
                              reason, f"torch.matmul ({reason})"), key)
            if len(self._fast) >= _FAST_MAX:
                self._forget_routes()
            self._fast[key] = entry
            if self._native is not None:
                self._add_native(a, b, entry, two_d)
            return entry

    def _forget_routes(self) -> None:
        """Every kept route, in Python and in the compiled table (under the lock): the next call decides again."""
        self._fast.clear()
        if self._native is not None:
            self._native.clear()

    def _add_native(self, a: torch.Tensor, b: torch.Tensor, entry, two_d: bool) -> None:
        """The kept route, for the compiled fast path too (under the lock). One it cannot hold (a B that is not 2-D,
        more than six dimensions of A) stays with the Python path."""
        try:
            if entry.reason != "l2ir":
                self._native.add_fallback(a, b, COUNTERS.index(entry.reason), not two_d)
                return
            launch = entry.launch or ("python", entry.go_guarded)
            self._native.add_served(a, b, launch, self.device_type == "cuda", bool(getattr(entry, "eager_only", False)),
                                    not two_d, entry.index, tuple(entry.shape), *entry.mnk, entry.workspace[0],
                                    entry.keep_workspace, entry.launch_failed)
        except (TypeError, ValueError, OverflowError) as e:
            log.debug("l2ir.matmul route not compiled (%s); the Python path serves it", e)

    def _fallback(self, reason: str, fn):
        tls, mine_slow = self._counts.tls, self._counts.mine

        def fallback(a, b, out=None):
            try:
                mine = tls.d
            except AttributeError:
                mine = mine_slow()
            mine[reason] += 1
            return fn(a, b) if out is None else fn(a, b, out=out)

        fallback.reason, fallback.fn = reason, fn          # what it is, for bench/dispatch_bench.py's parts
        return fallback

    def _served(self, runner, kkey: str, m: int, n: int, k: int, index: int, shape: tuple, fn):
        go, ws_bytes = runner.bind(m, n, k)
        native = getattr(runner, "native", None)
        launch = native(m, n, k) if native is not None else None
        zero_ws = bool(getattr(runner, "zero_workspace", False))
        tls, mine_slow, stream_of = self._counts.tls, self._counts.mine, self._stream_of
        u8 = torch.uint8
        on_cuda = self.device_type == "cuda"
        # A zero_workspace kernel leaves its workspace as it needs it (l2ir/runtime.py), so this route keeps one
        # zeroed workspace per stream (launches on one stream touch it in stream order: under programmatic
        # dependent launch a kernel may start early but waits, griddepcontrol.wait, before any global access) and
        # pays the memset once; any other workspace is kept too, which saves an allocation a call and keeps its
        # address (and so the shim's tensor maps of repack's copies) stable. Per route, not shared: another kernel
        # or shape puts its counters where this one keeps partial sums. Held by the dispatcher (`_kept_ws`), so a
        # route prepared again reuses it.
        kept: dict = {}                 # stream -> workspace: this closure's view of the dispatcher's
        over = []                       # non-empty once the budget refused this route: allocate per call, no lock
        prefix = (kkey, m, n, k, index)

        capturing = self._capturing
        autocast_on, autocast_dtype, fwad = torch.is_autocast_enabled, torch.get_autocast_dtype, _forward_ad()
        dev_type = self.device_type
        # The launch runs on the current device (a host shim) or in the device's context (the driver's launch): under
        # another current device, a device guard around it (restoring the caller's device after). With one device
        # the current one is always the route's.
        current_device = (getattr(torch._C, "_cuda_getDevice", None) if on_cuda and torch.cuda.device_count() > 1
                          else None)
        if current_device is None:
            go_guarded = go
        else:
            def go_guarded(pa, pb, pc, ws, st):
                if current_device() != index:
                    with torch.cuda.device(index):
                        return go(pa, pb, pc, ws, st)
                return go(pa, pb, pc, ws, st)
        fresh = (lambda a: a.new_zeros(ws_bytes, dtype=u8)) if zero_ws else (lambda a: a.new_empty(ws_bytes, dtype=u8))
        # The output: empty_like of a one-element tensor expanded to the output's shape allocates C (contiguous
        # strides, as torch.empty's) with no shape to parse, ~0.5 us less a call than new_empty(shape)
        # (bench/results/host_parts_probe_h200.json). Made on first use, on the caller's device and dtype (the route
        # key holds both); one made inside a CUDA-graph capture is not kept (it would hold a block of the graph's
        # private pool for the route's lifetime).
        like: list = []
        empty_like, contiguous = torch.empty_like, torch.contiguous_format

        def template(a):
            t = a.new_empty(()).expand(shape)
            if not capturing():
                like.append(t)
            return t

        def keep(a, st):
            if over:
                return fresh(a)
            with self._lock:
                w = self._kept_ws.get((*prefix, st))   # another thread, or an earlier closure of this route
                if w is None:
                    if self._kept_bytes + ws_bytes > _KEPT_WORKSPACE_BUDGET:
                        over.append(True)
                        return fresh(a)
                    w = fresh(a)
                    self._kept_bytes += ws_bytes
                    self._kept_ws[(*prefix, st)] = w
                kept[st] = w
            return w

        def serve(a, b, out=None):
            try:
                mine = tls.d
            except AttributeError:
                mine = mine_slow()
            try:
                pa = a.data_ptr()
                pb = b.data_ptr()
            except RuntimeError:        # no storage of its own (a functorch wrapper under vmap): torch's op
                mine["layout"] += 1
                return fn(a, b) if out is None else fn(a, b, out=out)
            if a.is_cuda is not on_cuda or b.is_cuda is not on_cuda:
                # The route key holds device indices, not types: another device type with the same index lands here.
                mine["cpu"] += 1
                return fn(a, b) if out is None else fn(a, b, out=out)
            if autocast_on(dev_type) and autocast_dtype(dev_type) is not a.dtype:
                mine["autocast"] += 1           # torch.matmul casts to autocast's dtype; the kernel does not
                return fn(a, b) if out is None else fn(a, b, out=out)
            if fwad._current_level >= 0:     # inside forward_ad.dual_level(): torch propagates the tangents
                mine["autograd"] += 1
                return fn(a, b) if out is None else fn(a, b, out=out)
            if (pa | pb) & 15:
                # TMA, cp.async and vector loads need 16-byte aligned operands; a view can start anywhere.
                mine["misaligned"] += 1
                return fn(a, b) if out is None else fn(a, b, out=out)
            c = empty_like(like[0] if like else template(a), memory_format=contiguous) if out is None else out
            st = stream_of(index)
            if ws_bytes:
                if a.is_cuda and capturing():
                    # Inside a CUDA-graph capture: the graph's own allocation (and memset), so a replay never
                    # shares a workspace with eager calls or outlives it.
                    w = fresh(a)
                else:
                    w = kept.get(st)
                    if w is None:
                        w = keep(a, st)
                ws = w.data_ptr()
            else:
                ws = 0
            try:
                go_guarded(pa, pb, c.data_ptr(), ws, st)
            except Exception as e:  # noqa: BLE001 - a refused launch is answered by torch, and remembered
                self._launch_failed(kkey, index, e)
                mine["launch_failed"] += 1
                return fn(a, b) if out is None else fn(a, b, out=out)
            mine["l2ir"] += 1
            return c

        serve.reason, serve.go, serve.shape, serve.index, serve.workspace = "l2ir", go, shape, index, (ws_bytes,
                                                                                                      zero_ws)
        # For the compiled fast path (`_add_native`): the launch (None: it calls `go_guarded`, as `serve` does), the
        # shape, the kept workspace with whether the budget kept it, and what a refused launch does.
        serve.launch, serve.mnk, serve.go_guarded = launch, (m, n, k), go_guarded
        serve.keep_workspace = lambda a, st: (keep(a, st), not over)

        def launch_failed(message: str) -> None:
            from .runtime import LaunchError

            self._launch_failed(kkey, index, LaunchError(f"{message} for m={m} n={n} k={k}"))
        serve.launch_failed = launch_failed
        return serve

    def _eager_only(self, served, fallback):
        """A cuBLAS shape with an eager alternative (l2ir/export.py): the L2IR kernel on eager calls, where the
        host-bound call ends sooner, cuBLAS when captured into a CUDA graph, where only device time counts."""
        capturing = self._capturing

        def eager_route(a, b, out=None):
            return (fallback if capturing() else served)(a, b, out)

        eager_route.__dict__.update(served.__dict__)       # reason "l2ir", go, shape, index, workspace (the bench)
        eager_route.eager_only = True
        return eager_route

    def _launch_failed(self, kkey: str, index: int, err: Exception) -> None:
        with self._lock:
            self._devices[index]["runners"][kkey] = err
            self._forget_routes()           # every route bound to that runner decides again: load_failed
        warnings.warn(f"l2ir: launch failed ({err}); this kernel's shapes go to torch.matmul", RuntimeWarning,
                      stacklevel=4)

    # -- one call --------------------------------------------------------------------------------------------

    def eager(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """l2ir.matmul(a, b) outside torch.compile: a dict lookup and the route's closure."""
        entry = self._fast.get((a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.get_device(), b.get_device()))
        if entry is None:
            entry = self._prepare(a, b)
        return entry(a, b)

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return self.eager(a, b)
        entry = self.lookup(a, b)
        if entry.reason == "l2ir" and (out.device != a.device or out.dtype != a.dtype or not out.is_contiguous()
                                       or out.shape != a.shape[:-1] + b.shape[-1:] or out.data_ptr() & 15
                                       or _overlap(out, a) or _overlap(out, b)):
            self._count("out", a.shape[-2], b.shape[-1], b.shape[0])
            return torch.matmul(a, b, out=out)      # torch's own answer, or its own error (e.g. out aliases a)
        return entry(a, b, out)


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the memory spans of two dense tensors intersect (a kernel writing C while reading A or B)."""
    px, py = x.data_ptr(), y.data_ptr()
    return px < py + y.numel() * y.element_size() and py < px + x.numel() * x.element_size()


# ---------------------------------------------------------------------------------------------------------------
# Process-wide state: one package, one dispatcher.
# ---------------------------------------------------------------------------------------------------------------

_STATE: dict = {"dispatcher": None}
_STATE_LOCK = threading.Lock()
# The loaded dispatcher's route dict (Dispatcher._fast, cleared in place, never replaced), a module global so that
# the eager call reaches it in one lookup; rebound by `_install` whenever the dispatcher changes. `_NATIVE` is the
# compiled fast path's call (None: the Python path only).
_ROUTES: dict = {}
_NATIVE = None


def _install(dispatcher: Dispatcher | None) -> None:
    global _ROUTES, _NATIVE
    _STATE["dispatcher"] = dispatcher
    _ROUTES = dispatcher._fast if dispatcher is not None else {}
    _NATIVE = dispatcher._native.call if dispatcher is not None and dispatcher._native is not None else None


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
        d = Dispatcher(pkg)
        d.attach_fastpath()
        _install(d)
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
            d = Dispatcher(pkg)
            d.attach_fastpath()
            _install(d)
        return _STATE["dispatcher"]


def _reset(dispatcher: Dispatcher | None = None) -> None:
    """Forget the loaded package (tests); `dispatcher` installs a prepared one."""
    with _STATE_LOCK:
        _install(dispatcher)


def dispatch_stats() -> dict[str, int]:
    """Calls per path since the process started: "l2ir" or the fallback reason (see REASONS)."""
    d = _STATE["dispatcher"]
    return {} if d is None else dict(d.stats)


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
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.matmul(a, b, out=out), through L2IR's tuned kernels where the loaded package serves the shape."""
    if out is None and _NATIVE is not None and not _is_compiling():
        c = _NATIVE(a, b)           # the compiled fast path: a route kept for these operands, else None
        if c is not None:
            return c
    if type(a) is _Tensor and type(b) is _Tensor and not _is_compiling():
        # Eager: Dispatcher.eager inlined, without the op dispatch (a few microseconds a call). Every step here is
        # paid by every call, the fallback included: each Python call, attribute and global lookup is ~0.05-0.1 us
        # of the ~1 us this path adds to torch's own (bench/dispatch_bench.py measures the parts).
        if (a.requires_grad or b.requires_grad) and _grad_enabled():
            (_STATE["dispatcher"] or _dispatcher())._count("autograd")
            return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
        if out is not None:
            return (_STATE["dispatcher"] or _dispatcher()).run(a, b, out)
        try:
            entry = _ROUTES.get((a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.get_device(),
                                 b.get_device()))
        except RuntimeError:        # no strides (a sparse operand): torch's own op, or its own error
            (_STATE["dispatcher"] or _dispatcher())._count("layout")
            return torch.matmul(a, b)
        if entry is None:
            entry = (_STATE["dispatcher"] or _dispatcher())._prepare(a, b)
        return entry(a, b)
    if (a.requires_grad or b.requires_grad) and torch.is_grad_enabled():
        return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
    if out is None:
        return torch.ops.l2ir.matmul(a, b)
    torch.ops.l2ir.matmul_out(a, b, out)
    return out


@contextlib.contextmanager
def patch_linear():
    """Route torch.nn.functional.linear (and so nn.Linear) through l2ir.matmul inside the block.
    y = x @ W.t() is problem b=...:col (W is row-major (N, K)). An eager call whose route is torch's runs torch's own
    F.linear, counted under its reason: cuBLAS fuses the bias into the GEMM there, where a separate add would cost a
    second launch and an output. A served call adds the bias in place, into the output it has just allocated."""
    import torch.nn.functional as F

    original = F.linear

    def linear(input, weight, bias=None):
        if type(input) is _Tensor and type(weight) is _Tensor and not _is_compiling():
            if (input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)) \
                    and _grad_enabled():
                (_STATE["dispatcher"] or _dispatcher())._count("autograd")
                return original(input, weight, bias)
            wt = weight.t()
            entry = _ROUTES.get((input.shape, input.stride(), wt.shape, wt.stride(), input.dtype, wt.dtype,
                                 input.get_device(), wt.get_device()))
            d = _STATE["dispatcher"] or _dispatcher()
            if entry is None:
                entry = d._prepare(input, wt)
            if entry.reason != "l2ir" or (bias is not None and (bias.dtype is not input.dtype
                                                                   or bias.get_device() != input.get_device())):
                # torch's route, or a bias the in-place add would cast or move: torch's F.linear, torch's answer
                d._counts.mine()[entry.reason if entry.reason != "l2ir" else "dtype"] += 1
                return original(input, weight, bias)
            y = entry(input, wt)
            return y if bias is None else y.add_(bias)
        y = matmul(input, weight.t())              # inside torch.compile: the custom op
        return y if bias is None else y + bias

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


# `l2ir.matmul` goes through the package's module __getattr__ (lazy, so that `import l2ir` loads no torch), which
# runs an import statement on every access (~2 us) until the attribute exists; once this module is loaded, the
# entry points are bound on the package and the access is a dict lookup.
_package = sys.modules[__package__]
for _name in _package._DISPATCH:
    setattr(_package, _name, globals()[_name])
