#!/usr/bin/env python3
"""Build, check and time CUTLASS sm90 lowerings on a Hopper GPU against torch.matmul (cuBLAS).

For each configuration: lower the IR with backends/cutlass_sm90, build the shared library with nvcc (all configurations
in parallel), load it with ctypes, and for each shape
  - refuse-or-run: shapes the kernel cannot take (e.g. K not a multiple of 8: TMA needs 16-byte strides) must come back
    as a non-zero l2ir_run status, which is reported, not counted as a failure;
  - correctness: C poisoned with NaN, one call, then every element must be written and the relative error against a
    float64 reference (||C - ref||_F / ||ref||_F) below --tol; re-checked after timing;
  - workspace: the library's l2ir_workspace_size must not exceed the plan's bound expression;
  - timing: CUDA-graph replay of --iters back-to-back calls (inputs rotated over buffer sets so that A and B do not sit in
    L2), median of --trials, interleaved trial by trial with torch.matmul(a, bt.t()) on the same buffers; falls back to
    CUDA events around plain launches when graph capture fails.
A failing configuration or shape is reported and the rest go on. Results print as a table and are written as JSON
(with the environment) to --out.

Usage (repository root on the GPU host):
    python bench/cutlass_sm90_check.py [--out bench/results] [--configs a,b] [--shapes 4096x4096x4096,...]
    PYTHONPATH=/path/to/cutlass-target python bench/cutlass_sm90_check.py     # nvidia-cutlass installed with --target
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import datetime as dt
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from l2ir.backends import cutlass_sm90 as sm90  # noqa: E402
from l2ir.runtime import status_name  # noqa: E402
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Tile, Target  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# What is checked.
# ---------------------------------------------------------------------------------------------------------------


def coop(block=(128, 256, 64), cluster=(2, 1), **changes) -> Kernel:
    wgmma_n = next(n for n in sm90.WGMMA_N if block[1] % n == 0)
    k = Kernel(target=Target("sm90a"), tile=Tile(block, (8, 1), cluster), mma=Mma("wgmma", (64, wgmma_n, 16)),
               pipeline=Pipeline("tma_ws", "auto", "cooperative", persistent=True), pad=Pad(),
               epilogue=Epilogue("tma", 8))
    return k.replace(**changes)


def pingpong(block=(128, 128, 64), cluster=(1, 1), **changes) -> Kernel:
    wgmma_n = next(n for n in sm90.WGMMA_N if block[1] % n == 0)
    k = Kernel(target=Target("sm90a"), tile=Tile(block, (4, 1), cluster), mma=Mma("wgmma", (64, wgmma_n, 16)),
               pipeline=Pipeline("tma_ws", "auto", "pingpong", persistent=True), pad=Pad(),
               epilogue=Epilogue("tma", 8))
    return k.replace(**changes)


CONFIGS: dict[str, Kernel] = {
    "coop_128x256x64_c2x1": coop(cluster=(2, 1)),
    "coop_128x256x64_c1x2": coop(cluster=(1, 2)),
    "coop_128x256x64_c1x1": coop(cluster=(1, 1)),
    "coop_256x128x64_c1x1": coop(block=(256, 128, 64), cluster=(1, 1)),
    "pingpong_128x128x64_c1x1": pingpong(),
    "coop_128x256x64_c2x1_streamk": coop(cluster=(2, 1), splitk=SplitK("stream_k")),
    "coop_128x128x64_c1x1_splitk2": coop(block=(128, 128, 64), cluster=(1, 1), splitk=SplitK("split_k", 2)),
}

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 512), (16384, 16384, 256), (1000, 1000, 1000),
          (127, 129, 67)]

PROBLEM_CLASS = Problem(m=1, n=1, k=1)   # a=f16:row b=f16:col c=f16:row acc=f32


# ---------------------------------------------------------------------------------------------------------------
# Build.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Built:
    name: str
    plan: object = None
    lib_path: Path | None = None
    seconds: float = 0.0
    error: str = ""
    registers: str = ""
    spills: str = ""
    hgmma: str = "n/a"
    log_path: Path | None = None


def build_one(name: str, kernel: Kernel, work: Path, nvcc: str, includes: tuple[str, ...]) -> Built:
    out = Built(name)
    try:
        plan = sm90.lower(kernel, PROBLEM_CLASS)
        out.plan = plan
        key = hashlib.sha256((plan.source + nvcc + " ".join(sm90.NVCC_FLAGS)).encode()).hexdigest()[:16]
        d = work / f"{name}-{key}"
        d.mkdir(parents=True, exist_ok=True)
        src, lib, log = d / "kernel.cu", d / "libkernel.so", d / "nvcc.log"
        src.write_text(plan.source)
        (d / "kernel.l2ir").write_text(plan.ir_text)
        out.log_path = log
        cmd = sm90.nvcc_command(plan, str(src), str(lib), nvcc=nvcc, includes=includes, verbose_ptxas=True)
        if not (lib.exists() and log.exists()):
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            out.seconds = time.time() - t0
            log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
            if proc.returncode != 0:
                lib.unlink(missing_ok=True)
                out.error = f"nvcc rc={proc.returncode}; reproduce: {' '.join(cmd)}\n" + (proc.stdout + proc.stderr)[-3000:]
                return out
        text = log.read_text()
        regs = sorted(set(re.findall(r"Used (\d+) registers", text)))
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        out.registers = ",".join(regs)
        out.spills = "none" if all(s == ("0", "0") for s in spills) else str(spills)
        if "C7510" in text:
            out.spills += " WGMMA-SERIALIZED(C7510)"
        out.lib_path = lib
        out.hgmma = count_hgmma(lib, nvcc)
    except Exception:
        out.error = traceback.format_exc()
    return out


def count_hgmma(lib: Path, nvcc: str) -> str:
    """HGMMA instructions in the library's SASS (needs cuobjdump and nvdisasm; 'n/a' otherwise)."""
    beside = Path(nvcc).resolve().parent / "cuobjdump"
    cuobjdump = shutil.which("cuobjdump") or (str(beside) if beside.exists() else None)
    if cuobjdump is None:
        return "n/a"
    try:
        proc = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True, timeout=300)
    except Exception:
        return "n/a"
    if proc.returncode != 0:
        return "n/a"
    shapes = sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", proc.stdout)))
    return f"{proc.stdout.count('HGMMA')} ({'/'.join(shapes)})" if shapes else "0"


def build_all(names: list[str], work: Path, nvcc: str, includes: tuple[str, ...], jobs: int) -> dict[str, Built]:
    with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {n: pool.submit(build_one, n, CONFIGS[n], work, nvcc, includes) for n in names}
        return {n: f.result() for n, f in futs.items()}


# ---------------------------------------------------------------------------------------------------------------
# Run.
# ---------------------------------------------------------------------------------------------------------------


class Lib:
    def __init__(self, path: Path):
        self.so = ctypes.CDLL(str(path))
        self.so.l2ir_run.restype = ctypes.c_int
        self.so.l2ir_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.so.l2ir_workspace_size.restype = ctypes.c_size_t
        self.so.l2ir_workspace_size.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]

    def workspace_size(self, m, n, k) -> int:
        return int(self.so.l2ir_workspace_size(m, n, k))

    def run(self, a, bt, c, m, n, k, ws, ws_bytes, stream) -> int:
        return int(self.so.l2ir_run(a.data_ptr(), bt.data_ptr(), c.data_ptr(), m, n, k,
                                    ws.data_ptr() if ws is not None else None, ws_bytes, stream))


@dataclass
class Row:
    config: str
    shape: tuple[int, int, int]
    status: str = ""
    rel_err: float = float("nan")
    rel_err_after: float = float("nan")
    ours_us: float = float("nan")
    ours_spread: float = float("nan")
    torch_us: float = float("nan")
    torch_spread: float = float("nan")
    timing: str = ""
    ws_lib: int = -1
    ws_bound: int = -1
    notes: list = field(default_factory=list)

    @property
    def tflops(self):
        m, n, k = self.shape
        return 2 * m * n * k / (self.ours_us * 1e-6) / 1e12

    @property
    def torch_tflops(self):
        m, n, k = self.shape
        return 2 * m * n * k / (self.torch_us * 1e-6) / 1e12


def median_spread(xs):
    xs = sorted(xs)
    med = xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])
    return med, (xs[-1] - xs[0]) / med if med > 0 else float("nan")


def rel_error(torch, c, ref) -> float:
    return float(torch.linalg.norm(c.double() - ref) / torch.linalg.norm(ref))


class Inputs:
    """Buffer sets for one shape, the float64 reference of set 0, and torch baselines."""

    def __init__(self, torch, m, n, k, rotate_bytes, seed=0):
        self.m, self.n, self.k = m, n, k
        per_set = 2 * (m * k + n * k + m * n)
        self.nsets = max(1, min(8, math.ceil(rotate_bytes / per_set)))
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.a = [torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g) for _ in range(self.nsets)]
        self.bt = [torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g) for _ in range(self.nsets)]
        self.c = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(self.nsets)]
        self.c_torch = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(self.nsets)]
        self.ref = self.a[0].double() @ self.bt[0].double().t()


def time_interleaved(torch, launch_ours, launch_torch, nsets, iters, trials):
    """Median per-call microseconds (and spread) of two launchers, graph-replayed and interleaved trial by trial."""

    def capture(launch):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(3):
                launch(i % nsets)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(iters):
                launch(i % nsets)
        g.replay()
        torch.cuda.synchronize()
        return g.replay

    mode = "graph"
    try:
        runners = [capture(launch_ours), capture(launch_torch)]
    except Exception as e:   # capture refused: time plain launches instead
        mode = f"events ({type(e).__name__}: {str(e)[:80]})"
        torch.cuda.synchronize()

        def loop(launch):
            def go():
                for i in range(iters):
                    launch(i % nsets)
            return go
        runners = [loop(launch_ours), loop(launch_torch)]
        for r in runners:
            r()
        torch.cuda.synchronize()
    times = [[], []]
    for _ in range(trials):
        for which, run in enumerate(runners):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times[which].append(start.elapsed_time(end) * 1e3 / iters)
    return median_spread(times[0]), median_spread(times[1]), mode


def check_one(torch, lib: Lib, built: Built, inp: Inputs, args) -> Row:
    m, n, k = inp.m, inp.n, inp.k
    row = Row(built.name, (m, n, k))
    row.ws_bound = built.plan.workspace_for(m, n, k)
    row.ws_lib = lib.workspace_size(m, n, k)
    if row.ws_lib > row.ws_bound:
        row.notes.append(f"WORKSPACE BOUND VIOLATED: library needs {row.ws_lib} > plan bound {row.ws_bound}")
    ws_bytes = max(row.ws_bound, row.ws_lib)
    ws = torch.empty(max(ws_bytes, 1), device="cuda", dtype=torch.uint8)
    errors = []

    def launch_ours(i):
        rc = lib.run(inp.a[i], inp.bt[i], inp.c[i], m, n, k, ws, ws_bytes, torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            errors.append(rc)

    def launch_torch(i):
        torch.matmul(inp.a[i], inp.bt[i].t(), out=inp.c_torch[i])

    inp.c[0].fill_(float("nan"))
    launch_ours(0)
    torch.cuda.synchronize()
    if errors:
        row.status = f"refused: {status_name(errors[0])}"
        return row
    unwritten = int(torch.isnan(inp.c[0]).sum())
    row.rel_err = rel_error(torch, inp.c[0], inp.ref)
    if unwritten:
        row.status = f"FAIL: {unwritten} elements unwritten"
        return row
    if not row.rel_err < args.tol:
        row.status = f"FAIL: rel err {row.rel_err:.2e}"
        return row
    (row.ours_us, row.ours_spread), (row.torch_us, row.torch_spread), row.timing = time_interleaved(
        torch, launch_ours, launch_torch, inp.nsets, args.iters, args.trials)
    torch.cuda.synchronize()
    if errors:
        row.status = f"FAIL during timing: {status_name(errors[0])}"
        return row
    row.rel_err_after = rel_error(torch, inp.c[0], inp.ref)
    row.status = "ok" if row.rel_err_after < args.tol else f"FAIL after timing: rel err {row.rel_err_after:.2e}"
    return row


# ---------------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------------


def environment(torch, nvcc: str, includes) -> dict:
    env = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "nvcc": "", "cutlass_include": includes[0], "cutlass": ""}
    try:
        env["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except Exception:
        pass
    try:
        import importlib.metadata as md
        env["cutlass"] = md.version("nvidia-cutlass")
    except Exception:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1))
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        env["nvidia_smi"] = q
    return env


def print_table(builds: dict[str, Built], rows: list[Row]) -> None:
    print("\n== builds ==")
    print(f"{'config':34} {'nvcc s':>7} {'regs':>6} {'spills':>8} {'HGMMA (SASS)':>22}  error")
    for b in builds.values():
        err = b.error.strip().splitlines()[-1][:80] if b.error else ""
        print(f"{b.name:34} {b.seconds:7.1f} {b.registers:>6} {b.spills:>8} {b.hgmma:>22}  {err}")
    print("\n== runs ==")
    print(f"{'config':34} {'shape':>18} {'status':>10} {'rel err':>9} {'ours us':>9} {'TFLOP/s':>8} "
          f"{'torch us':>9} {'TFLOP/s':>8} {'speedup':>8} {'spread':>7}  notes")
    for r in rows:
        shape = "x".join(map(str, r.shape))
        timed = not math.isnan(r.ours_us)
        print(f"{r.config:34} {shape:>18} {r.status.split(':')[0][:10]:>10} {r.rel_err:9.1e} "
              + (f"{r.ours_us:9.1f} {r.tflops:8.1f} {r.torch_us:9.1f} {r.torch_tflops:8.1f} "
                 f"{r.torch_us / r.ours_us:7.3f}x {max(r.ours_spread, r.torch_spread):6.1%}" if timed else
                 f"{'-':>9} {'-':>8} {'-':>9} {'-':>8} {'-':>8} {'-':>7}")
              + "  " + "; ".join(([r.status] if ":" in r.status else []) + r.notes
                                 + ([r.timing] if r.timing not in ("", "graph") else [])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from: " + ", ".join(CONFIGS))
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for the JSON results")
    ap.add_argument("--work", default="/tmp/l2ir_cutlass_sm90_check", help="build folder (reused as a cache)")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("--cutlass-include", default=None, help="CUTLASS include dir (default: from cutlass_library)")
    ap.add_argument("--jobs", type=int, default=max(1, min(len(CONFIGS), (os.cpu_count() or 2))))
    ap.add_argument("--iters", type=int, default=20, help="calls per graph replay")
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--tol", type=float, default=2e-3,
                    help="max relative Frobenius error vs float64 (fp16 output rounding alone is about 2e-4)")
    ap.add_argument("--rotate-mb", type=int, default=256, help="rotate inputs until this many MB are touched")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args(argv)

    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs: {unknown}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    if args.cutlass_include:
        includes = (args.cutlass_include, str(Path(args.cutlass_include).parent / "tools" / "util" / "include"))
    else:
        includes = sm90.cutlass_includes()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    builds = build_all(names, work, args.nvcc, includes, args.jobs)
    print(f"built {sum(b.lib_path is not None for b in builds.values())}/{len(builds)} in {time.time() - t0:.0f} s")
    for b in builds.values():
        if b.error:
            print(f"--- {b.name} build failed:\n{b.error}\n")

    rows: list[Row] = []
    torch = None
    if not args.build_only:
        import torch as _torch
        torch = _torch
        if not torch.cuda.is_available():
            print("no CUDA device: builds only")
        else:
            libs = {}
            for name, b in builds.items():
                if b.lib_path is None:
                    continue
                try:
                    libs[name] = Lib(b.lib_path)
                except OSError as e:
                    b.error = f"dlopen: {e}"
            for shape in shapes:
                try:
                    inp = Inputs(torch, *shape, rotate_bytes=args.rotate_mb << 20)
                except Exception as e:
                    rows += [Row(n, shape, status=f"FAIL: inputs: {e}") for n in libs]
                    continue
                for name, lib in libs.items():
                    try:
                        row = check_one(torch, lib, builds[name], inp, args)
                    except Exception as e:
                        row = Row(name, shape, status=f"FAIL: {type(e).__name__}: {e}")
                        traceback.print_exc()
                        try:
                            torch.cuda.synchronize()
                        except Exception:
                            print("CUDA context lost; stopping the runs here")
                            rows.append(row)
                            break
                    rows.append(row)
                    print(f"  {name:34} {'x'.join(map(str, shape)):>18}  {row.status}"
                          + (f"  {row.torch_us / row.ours_us:.3f}x" if not math.isnan(row.ours_us) else ""),
                          flush=True)
                del inp
                torch.cuda.empty_cache()

    print_table(builds, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "script": "bench/cutlass_sm90_check.py", "argv": sys.argv[1:], "utc": stamp,
        "environment": environment(torch, args.nvcc, includes) if torch is not None else {},
        "builds": [{"config": b.name, "ir": b.plan.ir_text if b.plan else "", "nvcc_seconds": round(b.seconds, 1),
                    "registers": b.registers, "spills": b.spills, "hgmma": b.hgmma, "error": b.error[-2000:]}
                   for b in builds.values()],
        "runs": [{"config": r.config, "shape": r.shape, "status": r.status, "rel_err": r.rel_err,
                  "rel_err_after": r.rel_err_after, "ours_us": r.ours_us, "ours_spread": r.ours_spread,
                  "torch_us": r.torch_us, "torch_spread": r.torch_spread, "timing": r.timing,
                  "speedup": (r.torch_us / r.ours_us) if r.ours_us == r.ours_us else None,
                  "workspace_lib": r.ws_lib, "workspace_bound": r.ws_bound, "notes": r.notes} for r in rows],
    }
    path = out / f"cutlass_sm90_check-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {path}")
    failed = [r for r in rows if r.status.startswith("FAIL")] + [b for b in builds.values() if b.error]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
