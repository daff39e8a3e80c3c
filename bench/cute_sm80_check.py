"""Standalone GPU check of the cute_sm80 backend: lower, compile, run, compare, time.

    python bench/cute_sm80_check.py [--cutlass DIR] [--sm 90] [--only NAME ...] [--compile-only] [--out FILE]

Lowers a set of sm80-style kernels that cover the schedule's fields (stages 1/2/3/4, prefetch, swizzle, raster,
every pad mode, alignment 8/4/2/1, both epilogue paths, split-K workspace/atomic, layouts, bf16, fp16 accumulate),
compiles each with nvcc directly (no dependency on backends/compile.py), then runs every config on a set of shapes
its Pad policy admits (the verifier decides: `check_problem`), each in its own subprocess so that a kernel that
faults cannot take the others down. Every run:
  - fills C with NaN (every element must be written) inside guard bands (no out-of-bounds writes);
  - poisons a split-K workspace with NaN unless the plan asks for it zeroed (the reduction reads only partials);
  - compares with a float64 reference by relative error max|C - ref| / max|ref|;
  - times the largest shape with CUDA events against torch.matmul on the same layouts.

--cutlass DIR: a directory holding the `cutlass_library` package (e.g. a `pip install --target` of the
nvidia-cutlass wheel), or the CUTLASS include directory itself. Without it, `import cutlass_library` must work.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from l2ir.errors import L2IRError  # noqa: E402
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, SplitK, Swizzle, Target, Tile  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# Configs and shapes.
# ---------------------------------------------------------------------------------------------------------------


def K_(block, warps, stages, *, prefetch=True, swizzle=(2, 3, 3), raster="along_n", group=1,
       pad=("predicate", "predicate", "zero_fill"), align=8, splitk=None, epilogue=("smem", 8)) -> Kernel:
    return Kernel(
        target=Target("sm80"),
        tile=Tile(block=block, warps=warps),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("multistage", stages, prefetch=prefetch),
        swizzle=Swizzle(smem=swizzle, raster=raster, group=group),
        pad=Pad(*pad, align=align),
        splitk=SplitK("split_k", splitk[0], splitk[1]) if splitk else None,
        epilogue=Epilogue(*epilogue),
    )


def P_(a="row", b="col", dtype="f16", acc="f32", c=None) -> Problem:
    return Problem(m=1, n=1, k=1, a=(dtype, a), b=(dtype, b), c=(c or dtype, "row"), acc=acc)


@dataclass(frozen=True)
class Config:
    name: str
    kernel: Kernel
    problem: Problem   # the problem class: dtypes and layouts


CONFIGS = [
    # The three seed-like schedules.
    Config("seed_128x128x32_s3", K_((128, 128, 32), (2, 2), 3, group=8), P_()),
    Config("seed_128x256x32_s3", K_((128, 256, 32), (2, 4), 3, group=8), P_()),
    Config("seed_64x64x32_s3", K_((64, 64, 32), (2, 2), 3), P_()),
    # A row + B row (N-contiguous B: ldmatrix.trans), 4 stages, along_m raster, direct epilogue.
    Config("nn_128x128x32_s4_direct", K_((128, 128, 32), (2, 2), 4, raster="along_m", group=4,
                                         epilogue=("direct", 8)), P_(b="row")),
    # Split-K through the workspace + reduction kernel; no register prefetch; BK=64 with <3,3,3>.
    Config("splitk4_ws_64x64x64", K_((64, 64, 64), (2, 2), 3, prefetch=False, swizzle=(3, 3, 3),
                                     splitk=(4, "workspace"), epilogue=("direct", 8)), P_()),
    # Split-K with fp32 atomics into a zeroed workspace, smem epilogue, predicate K, 2 stages, bf16.
    Config("splitk3_atomic_bf16_s2", K_((128, 64, 32), (2, 2), 2, pad=("zero_fill", "predicate", "predicate"),
                                        splitk=(3, "atomic")), P_(dtype="bf16")),
    # One stage, no swizzle, align 1 (plain loads), zero_fill everywhere, scalar direct stores: any shape at all.
    Config("s1_align1_noswz", K_((64, 64, 32), (2, 2), 1, swizzle=None, pad=("zero_fill",) * 3, align=1,
                                 epilogue=("direct", 1)), P_()),
    # align 4 (8-byte cp.async.ca), A col (M-contiguous), fp16 accumulate, BK=48 (3 k-blocks: odd fragment ring).
    Config("acol_align4_f16acc_bk48", K_((64, 128, 48), (2, 2), 3, pad=("predicate", "zero_fill", "predicate"),
                                         align=4, epilogue=("smem", 4)), P_(a="col", acc="f16")),
    # Everything divisible: no bounds checks at all.
    Config("divisible_128x128x64_s3", K_((128, 128, 64), (2, 2), 3, swizzle=(3, 3, 3),
                                         pad=("divisible",) * 3), P_()),
    # align 2, BK=16 (one k-block per tile), f32 output.
    Config("align2_bk16_f32out", K_((64, 128, 16), (1, 4), 4, swizzle=(1, 3, 3), align=2,
                                    epilogue=("smem", 2)), P_(c="f32")),
]

SHAPES = [
    (4096, 4096, 4096),
    (1000, 1000, 1000),
    (131, 264, 520),
    (127, 129, 67),
    (1, 1, 1),
    (8, 8, 8),
    (128, 128, 4096),
    (512, 512, 64),
    (256, 512, 1024),
    (33, 17, 5),
]

TOL = {"f32": 1e-3, "f16": 1e-2}          # by accumulator
TOL_BF16 = 1e-2                            # bf16 output rounding is 2^-8

# ---------------------------------------------------------------------------------------------------------------
# Compile.
# ---------------------------------------------------------------------------------------------------------------


def cutlass_include(arg: str | None) -> str:
    if arg:
        p = Path(arg)
        if (p / "cute").is_dir():
            return str(p)
        sys.path.insert(0, str(p))
    import cutlass_library  # noqa: PLC0415

    return os.path.join(cutlass_library.source_path, "include")


def nvcc_cmd(cu: Path, cubin: Path, include: str, sm: int) -> list[str]:
    return ["nvcc", "-cubin", "-std=c++17", "--expt-relaxed-constexpr", "-O3", "-Xptxas", "-v",
            f"-gencode=arch=compute_80,code=sm_{sm}", f"-I{include}", str(cu), "-o", str(cubin)]


def compile_one(cfg: Config, workdir: Path, include: str, sm: int) -> dict:
    from l2ir.backends.cute_sm80 import lower  # noqa: PLC0415

    rec = {"name": cfg.name}
    try:
        plan = lower(cfg.kernel, cfg.problem)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"lower: {type(e).__name__}: {e}"
        return rec
    cu, cubin = workdir / f"{cfg.name}.cu", workdir / f"{cfg.name}.cubin"
    cu.write_text(plan.source)
    t0 = time.time()
    r = subprocess.run(nvcc_cmd(cu, cubin, include, sm), capture_output=True, text=True)
    rec["compile_s"] = round(time.time() - t0, 1)
    rec["ptxas"] = [ln.strip() for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln]
    if r.returncode != 0:
        rec["error"] = "nvcc failed:\n" + r.stderr[-4000:] + "\nrepro: " + " ".join(nvcc_cmd(cu, cubin, include, sm))
        return rec
    rec["cubin"] = str(cubin)
    return rec


# ---------------------------------------------------------------------------------------------------------------
# Run (inside a subprocess per config).
# ---------------------------------------------------------------------------------------------------------------


def _check(res, what):
    from cuda.bindings import driver  # noqa: PLC0415

    err = res[0] if isinstance(res, tuple) else res
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err}")
    return res[1] if isinstance(res, tuple) and len(res) == 2 else res


class Module:
    def __init__(self, cubin: bytes):
        from cuda.bindings import driver  # noqa: PLC0415

        self.driver = driver
        _check(driver.cuInit(0), "cuInit")
        self.mod = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.funcs = {}

    def func(self, name: str, smem: int):
        d = self.driver
        if name not in self.funcs:
            f = _check(d.cuModuleGetFunction(self.mod, name.encode()), f"cuModuleGetFunction {name}")
            if smem > 0:
                _check(d.cuFuncSetAttribute(f, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            smem), "cuFuncSetAttribute")
            self.funcs[name] = f
        return self.funcs[name]

    def launch(self, launch, m, n, k, a, b, c, ws, stream: int):
        d = self.driver
        f = self.func(launch.entry, launch.smem)
        grid = launch.grid_for(m, n, k)
        vals = [ctypes.c_void_p(a), ctypes.c_void_p(b), ctypes.c_void_p(c), ctypes.c_int(m), ctypes.c_int(n),
                ctypes.c_int(k), ctypes.c_void_p(ws)]
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        _check(d.cuLaunchKernel(f, *grid, *launch.block, launch.smem, d.CUstream(stream), ctypes.addressof(ptrs), 0),
               f"cuLaunchKernel {launch.entry} grid={grid}")


def run_config(cfg: Config, cubin_path: str, shapes, time_iters: int) -> list[dict]:
    import torch  # noqa: PLC0415

    from l2ir.backends.cute_sm80 import lower  # noqa: PLC0415
    from l2ir.verify import check_problem  # noqa: PLC0415

    plan = lower(cfg.kernel, cfg.problem)
    # torch creates the device's primary context and makes it current; the driver-API module loads into it.
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    mod = Module(Path(cubin_path).read_bytes())
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = []
    for (m, n, k) in shapes:
        prob = cfg.problem.with_shape(m, n, k)
        row = {"config": cfg.name, "shape": f"{m}x{n}x{k}"}
        try:
            check_problem(cfg.kernel, prob)
        except L2IRError as e:
            row["status"] = "skip"
            row["why"] = str(e)[:100]
            out.append(row)
            continue
        try:
            ta, tb, tc = tdt[prob.a[0]], tdt[prob.b[0]], tdt[prob.c[0]]
            # Logical A (MxK) and B (KxN) with the problem's storage order.
            a_store = torch.randn(m, k, device=dev).to(ta) if prob.a[1] == "row" else \
                torch.randn(k, m, device=dev).to(ta)
            b_store = torch.randn(k, n, device=dev).to(tb) if prob.b[1] == "row" else \
                torch.randn(n, k, device=dev).to(tb)
            A = a_store if prob.a[1] == "row" else a_store.t()
            B = b_store if prob.b[1] == "row" else b_store.t()
            guard = 4096
            sentinel = 1234.0
            cbuf = torch.full((m * n + 2 * guard,), sentinel, dtype=tc, device=dev)
            cbuf[guard:guard + m * n] = float("nan")
            C = cbuf[guard:guard + m * n].view(m, n)
            wsb = plan.workspace_for(m, n, k)
            wbuf = torch.empty(max(wsb, 4) // 4 + 2 * guard, dtype=torch.float32, device=dev)
            wbuf.fill_(sentinel)
            wbuf[guard:guard + wsb // 4] = 0.0 if plan.zero_workspace else float("nan")
            ws_ptr = wbuf.data_ptr() + guard * 4
            stream = torch.cuda.current_stream().cuda_stream

            def run_once():
                if plan.zero_workspace:
                    wbuf[guard:guard + wsb // 4].zero_()
                for ln in plan.launches:
                    mod.launch(ln, m, n, k, a_store.data_ptr(), b_store.data_ptr(), C.data_ptr(), ws_ptr, stream)

            run_once()
            torch.cuda.synchronize()
            ref = A.double() @ B.double()
            got = C.double()
            nan = int(torch.isnan(got).sum().item())
            denom = ref.abs().max().item() or 1.0
            err = (got - ref).abs().nan_to_num(float("inf")).max().item() / denom
            guards_ok = bool((cbuf[:guard] == sentinel).all() and (cbuf[guard + m * n:] == sentinel).all()
                             and (wbuf[:guard] == sentinel).all() and (wbuf[guard + wsb // 4:] == sentinel).all())
            tol = TOL_BF16 if "bf16" in (prob.a[0], prob.c[0]) else TOL[prob.acc]
            ok = nan == 0 and err <= tol and guards_ok
            row.update(status="ok" if ok else "FAIL", rel_err=err, nan=nan, guards_ok=guards_ok)
            if ok and m * n * k >= 4096 ** 3 and time_iters > 0:
                row.update(_time(run_once, lambda: torch.matmul(A, B), time_iters, m, n, k))
                # Re-check after timing: the output must not have drifted.
                got2 = C.double()
                row["recheck_ok"] = bool(((got2 - ref).abs().max().item() / denom) <= tol)
        except Exception as e:  # noqa: BLE001
            row.update(status="ERROR", error=f"{type(e).__name__}: {e}")
            out.append(row)
            break   # a fault poisons the context: stop this config (its subprocess), keep the others
        out.append(row)
    return out


def _time(fn, baseline, iters, m, n, k) -> dict:
    import torch  # noqa: PLC0415

    def measure(f):
        for _ in range(3):
            f()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            f()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        times.sort()
        return times[len(times) // 2]

    ours, theirs = measure(fn), measure(baseline)
    flops = 2.0 * m * n * k
    return {"ms": ours, "torch_ms": theirs, "tflops": flops / ours / 1e9, "torch_tflops": flops / theirs / 1e9,
            "speedup": theirs / ours}


# ---------------------------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------------------------


def _fmt(row: dict) -> str:
    s = f"{row['config']:<28} {row['shape']:<16} {row['status']:<5}"
    if "rel_err" in row:
        s += f" err={row['rel_err']:.2e} nan={row['nan']} guards={'ok' if row['guards_ok'] else 'BAD'}"
    if "ms" in row:
        s += (f" | {row['ms']:.3f} ms {row['tflops']:.0f} TF vs torch {row['torch_ms']:.3f} ms "
              f"{row['torch_tflops']:.0f} TF  x{row['speedup']:.2f} recheck={'ok' if row['recheck_ok'] else 'BAD'}")
    if "why" in row:
        s += f" ({row['why']})"
    if "error" in row:
        s += f" {row['error']}"
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cutlass", help="dir with cutlass_library (pip --target) or the CUTLASS include dir")
    ap.add_argument("--sm", type=int, default=None, help="SASS target, e.g. 90 (default: this GPU, else 90)")
    ap.add_argument("--only", nargs="*", help="config names to run")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--iters", type=int, default=20, help="timing iterations for the 4096^3 shape (0: no timing)")
    ap.add_argument("--workdir", help="where .cu/.cubin go (default: a temp dir)")
    ap.add_argument("--out", help="write all rows as JSON here")
    ap.add_argument("--_run", help=argparse.SUPPRESS)        # internal: run one config in this process
    ap.add_argument("--_cubin", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    by_name = {c.name: c for c in CONFIGS}
    if args._run:
        rows = run_config(by_name[args._run], args._cubin, SHAPES, args.iters)
        print("@@ROWS@@" + json.dumps(rows))
        return 0

    include = cutlass_include(args.cutlass)
    sm = args.sm
    if sm is None:
        try:
            import torch  # noqa: PLC0415

            major, minor = torch.cuda.get_device_capability()
            sm = major * 10 + minor
        except Exception:  # noqa: BLE001
            sm = 90
    configs = [by_name[n] for n in args.only] if args.only else CONFIGS
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cute_sm80_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"# compiling {len(configs)} configs for sm_{sm} in {workdir} ({args.jobs} jobs)", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        compiled = list(pool.map(lambda c: compile_one(c, workdir, include, sm), configs))
    for rec in compiled:
        info = "; ".join(rec.get("ptxas", []))
        status = "ERROR " + rec["error"] if "error" in rec else f"ok {rec.get('compile_s')}s"
        print(f"{rec['name']:<28} compile {status} {info}", flush=True)
    if args.compile_only:
        return 0 if all("error" not in r for r in compiled) else 1

    all_rows = []
    for cfg, rec in zip(configs, compiled):
        if "error" in rec:
            all_rows.append({"config": cfg.name, "shape": "-", "status": "ERROR", "error": rec["error"][:300]})
            print(_fmt(all_rows[-1]), flush=True)
            continue
        cmd = [sys.executable, __file__, "--_run", cfg.name, "--_cubin", rec["cubin"], "--iters", str(args.iters)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            rows = None
            for line in r.stdout.splitlines():
                if line.startswith("@@ROWS@@"):
                    rows = json.loads(line[len("@@ROWS@@"):])
            if rows is None:
                rows = [{"config": cfg.name, "shape": "-", "status": "ERROR",
                         "error": f"subprocess rc={r.returncode}: {(r.stderr or r.stdout)[-800:]}"}]
        except Exception:  # noqa: BLE001
            rows = [{"config": cfg.name, "shape": "-", "status": "ERROR", "error": traceback.format_exc()[-800:]}]
        for row in rows:
            row["ptxas"] = rec.get("ptxas")
            print(_fmt(row), flush=True)
        all_rows.extend(rows)
    bad = [r for r in all_rows if r["status"] in ("FAIL", "ERROR")]
    print(f"# {len(all_rows)} rows, {sum(r['status'] == 'ok' for r in all_rows)} ok, "
          f"{sum(r['status'] == 'skip' for r in all_rows)} skipped (not admitted by the kernel's pad/align), "
          f"{len(bad)} failed")
    if args.out:
        Path(args.out).write_text(json.dumps(all_rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
