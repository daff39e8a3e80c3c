#!/usr/bin/env python3
"""Build, check and time the raw CUDA + PTX sm90a lowerings (backends/cuda_ptx) on a Hopper GPU against torch.matmul.

For each configuration: lower the IR with backends.cuda_ptx, build the host-shim shared library with nvcc (all
configurations in parallel), then run it in a child process of its own, so that an illegal address, a trap or a hung
mbarrier in one configuration cannot take the others down. In the child, for each shape:
  - refuse-or-run: a non-zero l2ir_run status (e.g. a shape that breaks pad=divisible) is reported, not a failure;
  - correctness: C poisoned with NaN, one call, then every element must be written; the relative Frobenius error
    against a float64 reference must be below --tol and the worst element within --elem-tol of the reference's scale;
    the first wrong element and the fraction of wrong ones are printed to help locate a layout bug; re-checked after
    timing;
  - hang watchdog: a first call that has not finished after --hang-s seconds is reported as HANG and the child exits;
  - timing: CUDA-graph replay of --iters back-to-back calls (inputs rotated over buffer sets so A and B do not sit in
    L2), median of --trials, interleaved trial by trial with torch.matmul(a, b_nk.t()) on the same buffers; falls back
    to CUDA events around plain launches when capture fails.
Results print as a table (TFLOP/s, speedup vs torch) and are written as JSON, with the environment, to --out.

Usage (repository root on the GPU host; torch with CUDA, nvcc 12.4+):
    python bench/cuda_ptx_check.py [--configs a,b] [--shapes 4096x4096x4096,...] [--out bench/results]
    python bench/cuda_ptx_check.py --build-only        # compile and report registers / spills / HGMMA only
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from l2ir.backends.cuda_ptx import lower, sm90a  # noqa: E402
from l2ir.runtime import status_name  # noqa: E402
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, Swizzle, Target, Tile  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# What is checked.
# ---------------------------------------------------------------------------------------------------------------


def coop(block=(128, 256, 64), epilogue=("direct", 2), persistent=True, raster=("along_n", 8), stages="auto",
         swizzle=(3, 3, 3)) -> Kernel:
    return Kernel(target=Target("sm90a"), tile=Tile(block, (8, 1), (1, 1)), mma=Mma("wgmma", (64, block[1], 16)),
                  pipeline=Pipeline("tma_ws", stages, "cooperative", persistent=persistent),
                  swizzle=Swizzle(swizzle, *raster), pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
                  epilogue=Epilogue(*epilogue))


CONFIGS: dict[str, Kernel] = {
    "coop_128x256x64_direct": coop(),
    "coop_128x256x64_smem8": coop(epilogue=("smem", 8)),
    "coop_256x128x64_smem8": coop(block=(256, 128, 64), epilogue=("smem", 8), raster=("along_m", 8)),
    "coop_128x128x64_direct": coop(block=(128, 128, 64)),
    "coop_128x256x64_direct_nonpersistent": coop(persistent=False, raster=("along_n", 1)),
}

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 512), (1000, 1000, 1000), (256, 256, 256)]

PROBLEM_CLASS = Problem(m=1, n=1, k=1)   # a=f16:row b=f16:col c=f16:row acc=f32


# ---------------------------------------------------------------------------------------------------------------
# Build (parent).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Built:
    name: str
    ir: str = ""
    lib_path: Path | None = None
    seconds: float = 0.0
    error: str = ""
    registers: str = ""
    spills: str = ""
    hgmma: str = "n/a"
    stages: int = 0
    smem: int = 0


def tool_path() -> str:
    """PATH plus the bin folders of the NVIDIA wheels (cuobjdump, nvdisasm) when installed."""
    extra = []
    try:
        import nvidia.cu13
        extra.append(str(Path(nvidia.cu13.__path__[0]) / "bin"))
    except ImportError:
        pass
    return os.pathsep.join([os.environ.get("PATH", ""), *extra])


def count_hgmma(lib: Path) -> str:
    path = tool_path()
    cuobjdump = shutil.which("cuobjdump", path=path)
    if cuobjdump is None:
        return "n/a"
    try:
        proc = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": path})
    except Exception:
        return "n/a"
    if proc.returncode != 0:
        return "n/a"
    shapes = sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", proc.stdout)))
    return f"{proc.stdout.count('HGMMA')} ({'/'.join(shapes)})" if shapes else "0"


def build_one(name: str, kernel: Kernel, work: Path, nvcc: str) -> Built:
    out = Built(name)
    try:
        plan = lower(kernel, PROBLEM_CLASS)
        cfg = sm90a.canonicalize(kernel, PROBLEM_CLASS)
        out.ir, out.stages, out.smem = plan.ir_text, cfg.stages, cfg.layout["total"]
        key = hashlib.sha256((plan.source + nvcc + " ".join(sm90a.NVCC_FLAGS)).encode()).hexdigest()[:16]
        d = work / f"{name}-{key}"
        d.mkdir(parents=True, exist_ok=True)
        src, lib, log = d / "kernel.cu", d / "libkernel.so", d / "nvcc.log"
        src.write_text(plan.source)
        (d / "kernel.l2").write_text(plan.ir_text)
        cmd = sm90a.nvcc_command(plan, str(src), str(lib), nvcc=nvcc, verbose_ptxas=True)
        if not (lib.exists() and log.exists()):
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            out.seconds = time.time() - t0
            log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
            if proc.returncode != 0:
                lib.unlink(missing_ok=True)
                out.error = f"nvcc rc={proc.returncode}; reproduce: {' '.join(cmd)}\n" + (proc.stdout + proc.stderr)[-3000:]
                return out
        text = log.read_text()
        out.registers = ",".join(sorted(set(re.findall(r"Used (\d+) registers", text))))
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        out.spills = "none" if spills and all(s == ("0", "0") for s in spills) else str(spills)
        if "C7510" in text or "C7515" in text:
            out.spills += " WGMMA-SERIALIZED"
        out.lib_path = lib
        out.hgmma = count_hgmma(lib)
    except Exception:
        out.error = traceback.format_exc()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Run (child process, one configuration).
# ---------------------------------------------------------------------------------------------------------------


class Lib:
    def __init__(self, path: Path):
        self.so = ctypes.CDLL(str(path))
        self.so.l2ir_run.restype = ctypes.c_int
        self.so.l2ir_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def run(self, a, bt, c, m, n, k, stream) -> int:
        return int(self.so.l2ir_run(a.data_ptr(), bt.data_ptr(), c.data_ptr(), m, n, k, None, 0, stream))


def median_spread(xs):
    xs = sorted(xs)
    med = xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])
    return med, (xs[-1] - xs[0]) / med if med > 0 else float("nan")


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


def compare(torch, c, ref, tol, elem_tol) -> tuple[str, dict]:
    """Status and error figures of one output against the float64 reference."""
    info = {}
    nan = torch.isnan(c)
    unwritten = int(nan.sum())
    diff = (c.double() - ref).abs()
    diff[nan] = float("inf")
    scale = float(ref.abs().max()) or 1.0
    info["rel_err"] = float(torch.linalg.norm(torch.nan_to_num(c.double(), nan=0.0) - ref) / torch.linalg.norm(ref))
    info["max_err_over_scale"] = float(diff.max()) / scale
    bad = diff > elem_tol * scale
    nbad = int(bad.sum())
    if nbad:
        idx = int(torch.nonzero(bad.flatten())[0])
        r, col = divmod(idx, c.shape[1])
        info["first_bad"] = [r, col, float(c[r, col]), float(ref[r, col])]
        info["bad_fraction"] = nbad / c.numel()
    if unwritten:
        return f"FAIL: {unwritten} elements unwritten (NaN)", info
    if not info["rel_err"] < tol:
        return f"FAIL: rel err {info['rel_err']:.2e}", info
    if nbad:
        return f"FAIL: {nbad} elements off by > {elem_tol:g} x max|ref|", info
    return "ok", info


def child_main(args) -> int:
    import torch

    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    out = open(args.result, "a")

    def emit(rec):
        out.write(json.dumps(rec) + "\n")
        out.flush()

    lib = Lib(Path(args.lib))
    for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]:
        m, n, k = shape
        rec = {"config": args.child, "shape": shape}
        try:
            per_set = 2 * (m * k + n * k + 2 * m * n)
            nsets = max(1, min(8, math.ceil((args.rotate_mb << 20) / per_set)))
            g = torch.Generator(device="cuda").manual_seed(0)
            a = [torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g) for _ in range(nsets)]
            bt = [torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g) for _ in range(nsets)]
            c = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(nsets)]
            ct = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(nsets)]
            ref = a[0].double() @ bt[0].double().t()
            errors = []

            def launch_ours(i):
                rc = lib.run(a[i], bt[i], c[i], m, n, k, torch.cuda.current_stream().cuda_stream)
                if rc != 0:
                    errors.append(rc)

            def launch_torch(i):
                torch.matmul(a[i], bt[i].t(), out=ct[i])

            c[0].fill_(float("nan"))
            torch.cuda.synchronize()
            done = torch.cuda.Event()
            launch_ours(0)
            done.record()
            deadline = time.time() + args.hang_s
            while not done.query():
                if time.time() > deadline:
                    rec["status"] = f"HANG: first call not finished after {args.hang_s:g} s (mbarrier deadlock?)"
                    emit(rec)
                    out.close()
                    os._exit(3)
                time.sleep(0.001)
            torch.cuda.synchronize()
            if errors:
                rec["status"] = f"refused: {status_name(errors[0])} ({errors[0]})"
                emit(rec)
                continue
            status, info = compare(torch, c[0], ref, args.tol, args.elem_tol)
            rec.update(info)
            if status != "ok":
                rec["status"] = status
                emit(rec)
                continue
            (ours, ours_sp), (tor, tor_sp), mode = time_interleaved(torch, launch_ours, launch_torch, nsets,
                                                                     args.iters, args.trials)
            torch.cuda.synchronize()
            rec.update(ours_us=ours, ours_spread=ours_sp, torch_us=tor, torch_spread=tor_sp, timing=mode,
                       tflops=2 * m * n * k / (ours * 1e-6) / 1e12, torch_tflops=2 * m * n * k / (tor * 1e-6) / 1e12,
                       speedup=tor / ours)
            if errors:
                rec["status"] = f"FAIL during timing: {status_name(errors[0])}"
            else:
                status, info = compare(torch, c[0], ref, args.tol, args.elem_tol)
                rec["rel_err_after"] = info["rel_err"]
                rec["status"] = "ok" if status == "ok" else "FAIL after timing: " + status
            emit(rec)
            del a, bt, c, ct, ref
            torch.cuda.empty_cache()
        except Exception as e:
            rec["status"] = f"FAIL: {type(e).__name__}: {str(e)[:300]}"
            emit(rec)
            try:
                torch.cuda.synchronize()
            except Exception:
                out.close()
                return 2   # the context is gone; the parent reports the shapes not reached
    out.close()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Parent: build, run each configuration in a child, report.
# ---------------------------------------------------------------------------------------------------------------


def run_config(b: Built, shapes: list, args) -> list[dict]:
    result = Path(args.work) / f"{b.name}-{os.getpid()}.jsonl"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", b.name, "--lib", str(b.lib_path),
           "--result", str(result), "--shapes", ",".join("x".join(map(str, s)) for s in shapes),
           "--tol", str(args.tol), "--elem-tol", str(args.elem_tol), "--iters", str(args.iters),
           "--trials", str(args.trials), "--rotate-mb", str(args.rotate_mb), "--hang-s", str(args.hang_s)]
    note = ""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.config_timeout_s)
        if proc.returncode != 0:
            note = f"child rc={proc.returncode}: {(proc.stdout + proc.stderr).strip()[-600:]}"
    except subprocess.TimeoutExpired:
        note = f"child killed after {args.config_timeout_s} s"
    recs = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
    seen = {tuple(r["shape"]) for r in recs}
    for s in shapes:
        if tuple(s) not in seen:
            recs.append({"config": b.name, "shape": list(s), "status": "FAIL: not reached (" + (note or "?") + ")"})
    return recs


def environment(nvcc: str) -> dict:
    env = {"host": platform.node(), "python": platform.python_version(), "nvcc": ""}
    try:
        env["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except Exception:
        pass
    try:
        import torch
        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return env


def print_table(builds: dict[str, Built], rows: list[dict]) -> None:
    print("\n== builds ==")
    print(f"{'config':38} {'nvcc s':>7} {'stages':>6} {'smem':>7} {'regs':>5} {'spills':>8} {'HGMMA (SASS)':>18}  error")
    for b in builds.values():
        err = b.error.strip().splitlines()[-1][:80] if b.error else ""
        print(f"{b.name:38} {b.seconds:7.1f} {b.stages:>6} {b.smem:>7} {b.registers:>5} {b.spills:>8} "
              f"{b.hgmma:>18}  {err}")
    print("\n== runs ==")
    print(f"{'config':38} {'shape':>16} {'status':>8} {'rel err':>9} {'ours us':>9} {'TFLOP/s':>8} "
          f"{'torch us':>9} {'TFLOP/s':>8} {'speedup':>8} {'spread':>7}  notes")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        timed = "ours_us" in r
        rel = r.get("rel_err", float("nan"))
        notes = [] if r["status"] == "ok" else [r["status"]]
        if "first_bad" in r:
            rr, cc, got, want = r["first_bad"]
            notes.append(f"first bad C[{rr},{cc}]={got:.4g} (ref {want:.4g}), {r['bad_fraction']:.1%} bad")
        if timed and r.get("timing", "graph") != "graph":
            notes.append(r["timing"])
        print(f"{r['config']:38} {shape:>16} {r['status'][:8]:>8} {rel:9.1e} "
              + (f"{r['ours_us']:9.1f} {r['tflops']:8.1f} {r['torch_us']:9.1f} {r['torch_tflops']:8.1f} "
                 f"{r['speedup']:7.3f}x {max(r['ours_spread'], r['torch_spread']):6.1%}" if timed else
                 f"{'-':>9} {'-':>8} {'-':>9} {'-':>8} {'-':>8} {'-':>7}")
              + ("  " + "; ".join(notes) if notes else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from: " + ", ".join(CONFIGS))
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for the JSON results")
    ap.add_argument("--work", default="/tmp/l2ir_cuda_ptx_check", help="build folder (reused as a cache)")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("--jobs", type=int, default=max(1, min(len(CONFIGS), os.cpu_count() or 2)))
    ap.add_argument("--iters", type=int, default=20, help="calls per graph replay")
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--tol", type=float, default=1e-3, help="max relative Frobenius error vs float64")
    ap.add_argument("--elem-tol", type=float, default=1e-2, help="max |C - ref| per element, as a fraction of max|ref|")
    ap.add_argument("--rotate-mb", type=int, default=256, help="rotate inputs until this many MB are touched")
    ap.add_argument("--hang-s", type=float, default=20.0, help="a first call slower than this is a hang")
    ap.add_argument("--config-timeout-s", type=int, default=300, help="per-configuration child process limit")
    ap.add_argument("--build-only", action="store_true")
    # child mode (internal)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lib", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)

    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs: {unknown}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futs = {n: pool.submit(build_one, n, CONFIGS[n], work, args.nvcc) for n in names}
        builds = {n: f.result() for n, f in futs.items()}
    print(f"built {sum(b.lib_path is not None for b in builds.values())}/{len(builds)} in {time.time() - t0:.0f} s")
    for b in builds.values():
        if b.error:
            print(f"--- {b.name} build failed:\n{b.error}\n")

    rows: list[dict] = []
    if not args.build_only:
        for b in builds.values():
            if b.lib_path is None:
                continue
            recs = run_config(b, shapes, args)
            for r in recs:
                print(f"  {r['config']:38} {'x'.join(map(str, r['shape'])):>16}  {r['status']}"
                      + (f"  {r['speedup']:.3f}x" if "speedup" in r else ""), flush=True)
            rows += recs

    print_table(builds, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "script": "bench/cuda_ptx_check.py", "argv": sys.argv[1:], "utc": stamp, "environment": environment(args.nvcc),
        "builds": [{"config": b.name, "ir": b.ir, "nvcc_seconds": round(b.seconds, 1), "stages": b.stages,
                    "smem_bytes": b.smem, "registers": b.registers, "spills": b.spills, "hgmma": b.hgmma,
                    "error": b.error[-2000:]} for b in builds.values()],
        "runs": rows,
    }
    path = out / f"cuda_ptx_check-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {path}")
    failed = [r for r in rows if not (r["status"] == "ok" or r["status"].startswith("refused"))]
    return 1 if failed or any(b.error for b in builds.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
