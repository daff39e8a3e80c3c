"""Per-call host cost of the Python steps an eager l2ir.matmul call can take, beside torch.matmul's whole call.

    python3 bench/host_parts_probe.py --out bench/results/host_parts_probe_h200.json

Question: which way of allocating the output, and of building the route key, costs least on this host? Each variant
is timed as the median over --trials of --calls back-to-back calls (no synchronize inside the timed region), on a
64x64x64 f16 problem (a row-major, B = W.t() with W row-major (N, K)), where every step is host-bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from l2ir.cli import positive_int


def per_call_us(fn, calls: int, trials: int) -> float:
    for _ in range(calls // 10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(out)


_SHIM_STANDIN = r"""
#include <stddef.h>
int l2ir_run(const void* a, const void* b, void* c, int m, int n, int k, void* ws, size_t wsb, void* stream) {
  return (a == 0) + (b == 0) + (c == 0) + (m < 0) + (n < 0) + (k < 0) + (ws != 0) + (wsb != 0) + (stream != 0) - 6;
}
struct args { const void* a; const void* b; void* c; void* ws; void* stream; };
int l2ir_run_args(const struct args* p) { return (p->a == 0) + (p->b == 0) + (p->c == 0) - 3; }
"""


def _ctypes_variants() -> dict:
    """The ctypes call of a host shim's l2ir_run (9 arguments, pointers as c_void_p) against one pointer to a packed
    argument block, on a do-nothing stand-in compiled here with cc; empty if no C compiler is found."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("host_parts_probe: no C compiler (cc, gcc): the ctypes variants are left out", file=sys.stderr)
        return {}
    with tempfile.TemporaryDirectory() as d:
        src, so = Path(d) / "s.c", Path(d) / "s.so"
        src.write_text(_SHIM_STANDIN)
        built = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], capture_output=True, text=True)
        if built.returncode != 0:
            print(f"host_parts_probe: {cc} failed on the stand-in shim ({built.stderr.strip()[:200]}): the ctypes "
                  "variants are left out", file=sys.stderr)
            return {}
        lib = ctypes.CDLL(str(so))          # mapped: the file may go with the folder
    run, run_args, vp, wsb = lib.l2ir_run, lib.l2ir_run_args, ctypes.c_void_p, ctypes.c_size_t(0)

    class Args(ctypes.Structure):
        _fields_ = [(name, ctypes.c_void_p) for name in ("a", "b", "c", "ws", "stream")]

    block = Args()
    ref = ctypes.byref(block)
    pa, pb, pc = 1 << 40, 2 << 40, 3 << 40

    def packed():
        block.a = pa
        block.b = pb
        block.c = pc
        block.ws = 0
        block.stream = 0
        return run_args(ref)

    return {"ctypes: l2ir_run, 9 arguments, 5 c_void_p": lambda: run(vp(pa), vp(pb), vp(pc), 64, 64, 64, vp(0), wsb,
                                                                       vp(0)),
            "ctypes: one packed block, 5 fields set": packed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=positive_int, default=2000)
    ap.add_argument("--trials", type=positive_int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_parts_probe: no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    from l2ir.search.evaluator import environment

    dev = torch.device("cuda", 0)
    a = torch.randn((64, 64), device=dev, dtype=torch.half)
    w = torch.randn((64, 64), device=dev, dtype=torch.half)
    b = w.t()
    shape = (64, 64)
    size = torch.Size(shape)
    half = torch.half
    expanded = torch.empty(1, device=dev, dtype=half).expand(shape)      # one element, every output's shape
    full = torch.empty(shape, device=dev, dtype=half)
    empty, empty_like, empty_strided = torch.empty, torch.empty_like, torch.empty_strided
    stride = (64, 1)
    variants = {
        "torch.matmul": lambda: torch.matmul(a, b),
        "torch.mm": lambda: torch.mm(a, b),
        "alloc: a.new_empty(shape)": lambda: a.new_empty(shape),
        "alloc: a.new_empty(torch.Size)": lambda: a.new_empty(size),
        "alloc: torch.empty(shape, dtype, device)": lambda: empty(shape, dtype=half, device=dev),
        "alloc: torch.empty_strided(shape, stride, dtype, device)": lambda: empty_strided(shape, stride, dtype=half,
                                                                                          device=dev),
        "alloc: torch.empty_like(expanded 1-element template)": lambda: empty_like(expanded),
        "alloc: torch.empty_like(full template)": lambda: empty_like(full),
        "key: shape, stride, dtype, get_device (both)": lambda: (a.shape, a.stride(), b.shape, b.stride(), a.dtype,
                                                                 b.dtype, a.get_device(), b.get_device()),
        "key: shape, stride (both)": lambda: (a.shape, a.stride(), b.shape, b.stride()),
        "key: data_ptr (both)": lambda: (a.data_ptr(), b.data_ptr()),
        "noop lambda": lambda: None,
    }
    variants.update(_ctypes_variants())
    rows = {}
    for name, fn in variants.items():
        rows[name] = round(per_call_us(fn, args.calls, args.trials), 3)
        print(f"{rows[name]:8.3f} us  {name}", flush=True)
    e = empty_like(expanded)
    if not (e.is_contiguous() and e.shape == size and e.dtype == half and e.device == dev):
        print(f"host_parts_probe: empty_like of the template gave {e.shape} {e.stride()} {e.dtype} {e.device}",
              file=sys.stderr)
        return 1
    result = {"command": "python3 bench/host_parts_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(0),
              "scenario": f"host time per call, median of {args.trials} trials of {args.calls} calls, 64x64x64 f16",
              "per_call_us": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
