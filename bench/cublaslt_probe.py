"""Host cost of a cuBLASLt call bound once per shape (ctypes) against torch.mm / torch.matmul, on small shapes.

    python3 bench/cublaslt_probe.py --out bench/results/cublaslt_probe_h200.json

Question: can l2ir.matmul's route to cuBLAS (shapes no L2IR kernel serves) cost less host time than torch.matmul
itself? torch.mm resolves a cuBLAS handle, stream and workspace and runs cuBLAS's heuristic on every call; a
cublasLtMatmul with its descriptors and algorithm chosen once per shape skips all of that. Prints per-call issue time
(no synchronize inside the timed region), eager time (until the GPU is done), device time (CUDA graph) and the
max error against torch.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path


def loaded_library(fragment: str) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            if fragment in line:
                return line.split()[-1]
    raise RuntimeError(f"{fragment} is not loaded")


class Lt:
    """cublasLt bound for one (m, n, k): a row-major (M, K), b = W.t() with W row-major (N, K), c row-major (M, N).
    cuBLAS is column-major: C^T (N x M, ld N) = op(W^T-storage) @ A^T, i.e. Lt's A = W storage (K x N, ld K) with
    TRANSA=T and Lt's B = A storage (K x M, ld K) with TRANSB=N."""

    def __init__(self, lib, m, n, k, ws_bytes, ws_ptr):
        vp = ctypes.c_void_p
        self.lib = lib
        check = self.check
        self.handle = vp()
        check(lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.desc = vp()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), ctypes.c_int(68), ctypes.c_int(0)), "desc")
        t, nn = ctypes.c_int32(1), ctypes.c_int32(0)
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, ctypes.c_int(3), ctypes.byref(t), ctypes.c_size_t(4)), "ta")
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, ctypes.c_int(4), ctypes.byref(nn), ctypes.c_size_t(4)), "tb")
        self.la, self.lb, self.lc = vp(), vp(), vp()
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.la), ctypes.c_int(2), u64(k), u64(n), i64(k)), "la")
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.lb), ctypes.c_int(2), u64(k), u64(m), i64(k)), "lb")
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.lc), ctypes.c_int(2), u64(n), u64(m), i64(n)), "lc")
        pref = vp()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        wsz = ctypes.c_uint64(ws_bytes)
        check(lib.cublasLtMatmulPreferenceSetAttribute(pref, ctypes.c_int(1), ctypes.byref(wsz), ctypes.c_size_t(8)),
              "pref ws")
        self.result = (ctypes.c_char * 96 * 4)()        # cublasLtMatmulHeuristicResult_t: algo[64], ws, state, waves, reserved
        got = ctypes.c_int(0)
        check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.la, self.lb, self.lc, self.lc, pref,
                                                   ctypes.c_int(4), self.result, ctypes.byref(got)), "heuristic")
        if got.value < 1:
            raise RuntimeError("no algorithm")
        self.algo_ws = ctypes.c_size_t.from_buffer(self.result, 64).value
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.fixed = (self.handle, self.desc, ctypes.byref(self.alpha))
        self.ws = (vp(ws_ptr), ctypes.c_size_t(ws_bytes))
        self.algo = ctypes.byref(self.result)
        self.fn = lib.cublasLtMatmul

    @staticmethod
    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"cublasLt {what}: status {rc}")

    def __call__(self, pa, pb, pc, stream):
        vp = ctypes.c_void_p
        h, d, al = self.fixed
        rc = self.fn(h, d, al, vp(pb), self.la, vp(pa), self.lb, ctypes.byref(self.beta), vp(pc), self.lc, vp(pc),
                     self.lc, self.algo, self.ws[0], self.ws[1], vp(stream))
        if rc:
            raise RuntimeError(f"cublasLtMatmul: status {rc}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from dispatch_bench import device_us, eager_us, issue_us

    from l2ir.search.evaluator import environment

    a0 = torch.randn(8, 8, device="cuda", dtype=torch.half)
    torch.mm(a0, a0)
    try:
        torch._C._cuda_clearCublasWorkspaces()
    except Exception:  # noqa: BLE001
        pass
    path = loaded_library("libcublasLt")
    lib = ctypes.CDLL(path)
    ws_bytes = 32 << 20
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    shapes = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (127, 136, 72), (512, 512, 512), (64, 4096, 4096),
              (1024, 1024, 1024), (333, 555, 776), (1, 4096, 4096), (4096, 4096, 4096)]
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.half)
        w = torch.randn(n, k, device="cuda", dtype=torch.half)
        b = w.t()
        lt = Lt(lib, m, n, k, ws_bytes, ws.data_ptr())
        pa, pb = a.data_ptr(), w.data_ptr()

        def via_lt():
            c = a.new_empty((m, n))
            lt(pa, pb, c.data_ptr(), torch.cuda.current_stream().cuda_stream)
            return c

        ref = a.double() @ b.double()
        err_lt = float((via_lt().double() - ref).abs().max())
        err_torch = float((torch.mm(a, b).double() - ref).abs().max())
        c_fixed = a.new_empty((m, n))
        st = torch.cuda.current_stream().cuda_stream
        row = {"m": m, "n": n, "k": k, "err_lt": err_lt, "err_torch": err_torch, "algo_ws": lt.algo_ws}
        for name, fn in [("torch.matmul", lambda: torch.matmul(a, b)), ("torch.mm", lambda: torch.mm(a, b)),
                         ("lt+alloc", via_lt), ("lt", lambda: lt(pa, pb, c_fixed.data_ptr(), st)),
                         ("new_empty", lambda: a.new_empty((m, n))),
                         ("empty", lambda: torch.empty((m, n), dtype=torch.half, device=a.device))]:
            row[name] = {"issue_us": issue_us(fn, args.calls, args.trials)}
            if name in ("torch.matmul", "lt+alloc"):
                row[name]["eager_us"] = eager_us(fn, args.calls, args.trials)
                row[name]["device_us"] = device_us(fn, 20, args.trials)
        rows.append(row)
        print(f"{m:>5}x{n:<5}x{k:<5} " + "  ".join(f"{nm} {v['issue_us']:.2f}" for nm, v in row.items()
                                                   if isinstance(v, dict))
              + f"  | eager torch {row['torch.matmul']['eager_us']:.2f} lt {row['lt+alloc']['eager_us']:.2f}"
              f"  device torch {row['torch.matmul']['device_us']:.2f} lt {row['lt+alloc']['device_us']:.2f}"
              f"  err {err_torch:.3g}/{err_lt:.3g}", flush=True)
    out = {"command": "python3 bench/cublaslt_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(0),
           "library": path, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("median issue us:", {nm: round(statistics.median(r[nm]["issue_us"] for r in rows), 2)
                               for nm in ("torch.matmul", "torch.mm", "lt+alloc", "lt", "new_empty", "empty")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
