"""(GPU) l2ir.matmul against torch.matmul: device time and eager time per call, and who served the calls.

    python bench/dispatch_bench.py --out bench/results/dispatch_h200.json [--db bench/results/tune_grid48_h200.db]

The package is exported from the records DB with its sm80 kernels only (CuTe builds of seconds; the sm90a CUTLASS
winners take ~45 s each to build). The DB's measurements are copied into a scratch DB under this machine's
environment, so the package loads here; the JSON records both environments (`measured_on`, `environment`) and says
so (`relabelled`). For every tuned shape of the package up to --max-gflop and for untuned shapes near the served
ones (one dimension scaled by 9/8 or 7/8, kept a multiple of 8), with a (M, K) row-major and b = W.t() (F.linear's
layout):
  device_us   median over trials of a CUDA graph of --reps back-to-back calls, per call (inputs fixed)
  eager_us    median over trials of the wall time of --calls back-to-back eager calls, per call, synchronized at the
              end: the host cost wherever it exceeds the device time (small shapes)
  host_us     median over trials of the time to issue --calls back-to-back calls (the synchronize left out): the
              host cost alone, the number the issue's "eager call no slower than torch.matmul" is about
  parts_us    l2ir.matmul's host time split in its steps, each timed alone over --calls calls (issue time):
              entry (the wrapper's checks: grad, compile, tensor types; = host - Dispatcher.eager's time),
              route (key + dict lookup), then for a served route alloc (the output's new_empty), stream (the
              current stream's raw handle), launch (the bound launch: workspace if any, argument block,
              cuCtxSetCurrent, cuLaunchKernel or l2ir_run), and for a fallback torch (the torch.mm or
              torch.matmul it calls); other = Dispatcher.eager's time - those parts (counter, closure calls)
  served      "l2ir" or the fallback reason of the dispatcher for that shape
  neighbour   the neighbour rule's decision (deciding tuned shape, its kernel, the predicted speedup)
  eager_only  a cuBLAS shape whose eager calls run its eager kernel (l2ir/export.py): device_us is then cuBLAS's
              (a CUDA graph captures the table's choice) while eager_us and host_us are the L2IR kernel's
  host_aa_ratio  torch.matmul's host time over the same measurement repeated after l2ir's (A/A: the noise of a
              host_speedup)
  *_python    l2ir.matmul's eager and host time with the compiled fast path detached (the Python path alone), in
              the same run; the unsuffixed l2ir times use the package's compiled fast path when it loaded
              (`fastpath` in the JSON says whether it did)
torch.matmul runs with fp16 reduced-precision reductions off (fp32 accumulation, the contract both are held to).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_package(db_path: Path, work: Path, cache: str, targets: tuple[str, ...]) -> tuple[Path, dict]:
    """Copy the DB's offline measurements under this machine's environment and export its `targets` kernels."""
    import re

    from l2ir import export
    from l2ir.search.db import RecordsDB, open_readonly
    from l2ir.search.evaluator import environment

    here = environment(0)
    src = open_readonly(db_path)                  # read-only: the committed DB is never migrated or written
    eid = export.choose_environment(src, None)
    measured_on = src.environment(eid)
    dst = RecordsDB(work / "bench.db")
    recs = []
    for rec_json, purpose in src.conn.execute(
            "SELECT record, purpose FROM measurements WHERE environment=? AND scenario='offline' ORDER BY id", (eid,)):
        rec = json.loads(rec_json)
        rec["environment"] = here
        rec["origin"] = f"copied from {db_path.name}, measured on {measured_on.get('gpu')} {eid}"
        recs.append((purpose, rec))
    for purpose in sorted({p for p, _ in recs}):
        dst.add_many([r for p, r in recs if p == purpose], purpose=purpose, source=f"copy:{db_path.name}")
    for h, ir, backend in src.conn.execute("SELECT hash, ir, backend FROM kernels WHERE ir IS NOT NULL"):
        dst.add_kernel(h, ir=ir, backend=backend)

    def accept(row):
        m = re.search(r"target arch=(\S+)", row.get("ir") or "")
        return None if m and m.group(1) in targets else "target not exported by the benchmark"

    export.export(dst, work / "pkg", cache_dir=cache, accept=accept)
    dst.close()
    src.close()
    return work / "pkg", {"measured_on": {"id": eid, **{k: measured_on.get(k) for k in export.MANIFEST_ENV_KEYS}},
                          "relabelled": any(str(measured_on.get(k)) != str(here.get(k))
                                            for k in export.MANIFEST_ENV_KEYS)}


def device_us(fn, reps: int, trials: int) -> float:
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


def host_loop_us(fn, calls: int, trials: int, wait: bool) -> float:
    """Median per-call time of `calls` back-to-back calls: with `wait`, until the GPU has finished them (eager time:
    device throughput for long kernels, host cost for short ones); without, only the host time to issue them (the
    synchronize comes after the timed region)."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if wait:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6 / calls)
        if not wait:
            torch.cuda.synchronize()
    return statistics.median(times)


def eager_us(fn, calls: int, trials: int) -> float:
    return host_loop_us(fn, calls, trials, wait=True)


def issue_us(fn, calls: int, trials: int) -> float:
    """Median per-call host time to issue `calls` back-to-back calls (no synchronize inside the timed region)."""
    return host_loop_us(fn, calls, trials, wait=False)


def parts_us(d, a, b, host: float, eager: float, calls: int, trials: int) -> dict:
    """l2ir.matmul's host time by step (see the module doc); the steps are the route's own bound objects."""
    import torch

    entry = d.lookup(a, b)
    parts = {"entry": host - eager, "route": issue_us(lambda: d.lookup(a, b), calls, trials)}
    if entry.reason == "l2ir":
        c = a.new_empty(entry.shape)
        pa, pb, pc, index, go = a.data_ptr(), b.data_ptr(), c.data_ptr(), entry.index, entry.go
        stream = d._stream_of(index)
        parts["alloc"] = issue_us(lambda: a.new_empty(entry.shape), calls, trials)
        parts["stream"] = issue_us(lambda: d._stream_of(index), calls, trials)
        ws_bytes, zero_ws = entry.workspace

        def launch():
            # The workspace as the served call makes it (split-K partials; zeroed where the plan's reduction needs it).
            w = (a.new_zeros if zero_ws else a.new_empty)(ws_bytes, dtype=torch.uint8) if ws_bytes else None
            go(pa, pb, pc, w.data_ptr() if w is not None else 0, stream)

        parts["launch"] = issue_us(launch, calls, trials)
    else:
        parts["torch"] = issue_us(lambda: entry.fn(a, b), calls, trials)
    parts["other"] = eager - sum(v for k, v in parts.items() if k != "entry")
    return {k: round(v, 3) for k, v in parts.items()}


@contextlib.contextmanager
def python_path(d):
    """l2ir.matmul without the compiled fast path (the routes stay kept; only the table is detached)."""
    from l2ir import dispatch

    native = d._native
    d._native = None
    dispatch._install(d)
    try:
        yield
    finally:
        d._native = native
        dispatch._install(d)


def neighbour_decision(package, m: int, n: int, k: int, cls: str) -> dict:
    """The neighbour rule's decision for a shape: the deciding tuned shape, its kernel and the speedup that kernel is
    predicted to keep here (l2ir.dispatch.predicted_speedup). An `unpromising` shape's kernel is not served on the
    device, so bench/neighbour_rule.py reads it from here."""
    key, reason, tuned = package._decide(m, n, k, cls)
    predicted = None
    if key is not None and tuned is not None and tuned != (m, n, k):
        p = package.predicted_speedup(key, tuned, (m, n, k), cls)
        predicted = p if p != float("inf") else None
    return {"reason": reason, "tuned": tuned, "kernel": key, "predicted_speedup": predicted}


def near_shapes(shape):
    m, n, k = shape
    out = []
    for i in range(3):
        for f in (9 / 8, 7 / 8):
            s = [m, n, k]
            s[i] = max(8, int(round(s[i] * f / 8)) * 8)
            if tuple(s) != shape:
                out.append(tuple(s))
    return out


def without_pdl(make_runner):
    """A runner factory whose cubin launches, eager (dispatch.KernelLaunch) and through cuda-python
    (runtime.CubinLauncher), ignore the plan's PDL flag: every launch waits for the previous grid's end."""
    def make(spec, index):
        runner = make_runner(spec, index)
        if hasattr(runner.launcher, "_pdl_device"):
            runner.launcher._pdl_device = False
        if hasattr(runner._fast, "pdl_device"):
            runner._fast.pdl_device = False
        return runner
    return make


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=str(ROOT / "bench" / "results" / "tune_grid48_h200.db"))
    ap.add_argument("--out", required=True, help="JSON file")
    ap.add_argument("--cache", default=str(ROOT / ".l2ir-cache"), help="compile cache")
    ap.add_argument("--target", action="append", help="kernel targets to export (default: sm80)")
    ap.add_argument("--max-gflop", type=float, default=20.0, help="leave out tuned shapes above this size")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the package's cubins the ordinary way (the A of an A/B against programmatic "
                         "dependent launch; host shims keep the launch compiled into them)")
    args = ap.parse_args(argv)

    import torch

    import l2ir
    from l2ir import dispatch
    from l2ir.search.evaluator import environment

    if not torch.cuda.is_available():
        print("error: dispatch_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    work = Path(tempfile.mkdtemp(prefix="l2ir-dispatch-bench-"))
    t0 = time.time()
    pkg_dir, provenance = build_package(Path(args.db), work, args.cache, tuple(args.target or ("sm80",)))
    export_s = time.time() - t0
    manifest = l2ir.load(pkg_dir)
    d = dispatch._dispatcher()
    if args.no_pdl:
        d.make_runner = without_pdl(d.make_runner)
    cls = "a=f16:row b=f16:col c=f16:row acc=f32"

    tuned = sorted({(m, n, k) for (m, n, k, c) in d.package.tuned if c == cls and 2 * m * n * k <= args.max_gflop * 1e9},
                   key=lambda s: (s[0] * s[1] * s[2], s))
    served_tuned = [s for s in tuned if d.package.tuned[(*s, cls)]]
    shapes = [(s, "tuned") for s in tuned]
    seen = set(tuned)
    for s in served_tuned:
        for t in near_shapes(s):
            if t not in seen:
                seen.add(t)
                shapes.append((t, "untuned near " + "x".join(map(str, s))))

    rows = []
    for (m, n, k), kind in shapes:
        a = torch.rand(m, k, device="cuda").sub_(0.5).half()
        w = torch.rand(n, k, device="cuda").sub_(0.5).half()
        b = w.t()
        before = dict(d.stats)
        c = l2ir.matmul(a, b)
        served = next(r for r, v in d.stats.items() if v != before.get(r, 0))
        err = float((c.double() - a.double() @ b.double()).abs().max())
        kkey = d.package.route(m, n, k, cls)[0]
        spec = d.package.kernels.get(kkey) if kkey is not None else None
        row = {"m": m, "n": n, "k": k, "kind": kind, "served": served, "max_abs_err_vs_fp64": err,
               "neighbour": neighbour_decision(d.package, m, n, k, cls),
               # the package's kernel for the shape and how it launches ("kernels": cuLaunchKernel per entry,
               # "host_shim": the library's l2ir_run_args), so host costs can be told apart by launch path
               "kernel": kkey, "launch": spec.plan["form"] if spec is not None else None,
               "eager_only": bool(getattr(d.lookup(a, b), "eager_only", False)),
               "l2ir_device_us": device_us(lambda: l2ir.matmul(a, b), args.reps, args.trials),
               "torch_device_us": device_us(lambda: torch.matmul(a, b), args.reps, args.trials),
               "l2ir_eager_us": eager_us(lambda: l2ir.matmul(a, b), args.calls, args.trials),
               "torch_eager_us": eager_us(lambda: torch.matmul(a, b), args.calls, args.trials),
               "l2ir_host_us": issue_us(lambda: l2ir.matmul(a, b), args.calls, args.trials),
               "torch_host_us": issue_us(lambda: torch.matmul(a, b), args.calls, args.trials)}
        with python_path(d):
            row["l2ir_eager_us_python"] = eager_us(lambda: l2ir.matmul(a, b), args.calls, args.trials)
            row["l2ir_host_us_python"] = issue_us(lambda: l2ir.matmul(a, b), args.calls, args.trials)
        row["host_speedup_python"] = row["torch_host_us"] / row["l2ir_host_us_python"]
        # A/A: torch.matmul's host time measured again, after l2ir's: the run-to-run noise of one host_us ratio.
        row["torch_host_us_aa"] = issue_us(lambda: torch.matmul(a, b), args.calls, args.trials)
        row["host_aa_ratio"] = row["torch_host_us"] / row["torch_host_us_aa"]
        row["device_speedup"] = row["torch_device_us"] / row["l2ir_device_us"]
        row["eager_speedup"] = row["torch_eager_us"] / row["l2ir_eager_us"]
        row["host_speedup"] = row["torch_host_us"] / row["l2ir_host_us"]
        row["parts_us"] = parts_us(d, a, b, row["l2ir_host_us"], issue_us(lambda: d.eager(a, b), args.calls,
                                                                          args.trials), args.calls, args.trials)
        rows.append(row)
        print(f"{m:>6}x{n:<6}x{k:<6} {kind:<28} {served + ('/eager' if row['eager_only'] else ''):<12} device {row['l2ir_device_us']:8.2f} vs "
              f"{row['torch_device_us']:8.2f} us  eager {row['l2ir_eager_us']:7.2f} vs {row['torch_eager_us']:7.2f} us"
              f"  host {row['l2ir_host_us']:6.2f} (python {row['l2ir_host_us_python']:6.2f}) vs "
              f"{row['torch_host_us']:6.2f} us  "
              + " ".join(f"{p} {v:.2f}" for p, v in row["parts_us"].items()), flush=True)

    def median_parts(rs):
        names = {p for r in rs for p in r["parts_us"]}
        return {p: round(statistics.median(r["parts_us"][p] for r in rs if p in r["parts_us"]), 3)
                for p in sorted(names)}

    def gmean(xs):
        xs = list(xs)
        return statistics.geometric_mean(xs) if xs else None

    by_l2ir = [r for r in rows if r["served"] == "l2ir"]
    summary = {
        "shapes": len(rows), "served_by_l2ir": len(by_l2ir),
        "share_served_by_l2ir": len(by_l2ir) / len(rows) if rows else 0.0,
        "fallback_reasons": {r: sum(1 for x in rows if x["served"] == r) for r in {x["served"] for x in rows}},
        "served_eagerly_only": sum(1 for r in rows if r["eager_only"]),
        "geomean_device_speedup_where_served": gmean(r["device_speedup"] for r in by_l2ir),
        "geomean_eager_speedup_where_served": gmean(r["eager_speedup"] for r in by_l2ir),
        "geomean_eager_speedup_on_fallback": gmean(r["eager_speedup"] for r in rows if r["served"] != "l2ir"),
        "geomean_host_speedup_where_served": gmean(r["host_speedup"] for r in by_l2ir),
        # What a user of l2ir.matmul sees over the whole mix of small shapes, served and fallback together.
        "geomean_eager_speedup_all": gmean(r["eager_speedup"] for r in rows),
        "geomean_host_speedup_all": gmean(r["host_speedup"] for r in rows),
        "geomean_host_speedup_on_fallback": gmean(r["host_speedup"] for r in rows if r["served"] != "l2ir"),
        "python_path": {
            "geomean_host_speedup_where_served": gmean(r["host_speedup_python"] for r in by_l2ir),
            "geomean_host_speedup_on_fallback": gmean(r["host_speedup_python"] for r in rows
                                                      if r["served"] != "l2ir"),
            "geomean_host_speedup_all": gmean(r["host_speedup_python"] for r in rows)},
        # torch.matmul against itself (the same measurement repeated): how far a host_speedup of 1 strays
        "aa_host_ratio": {"geomean": gmean(r["host_aa_ratio"] for r in rows),
                          "min": min((r["host_aa_ratio"] for r in rows), default=None),
                          "max": max((r["host_aa_ratio"] for r in rows), default=None),
                          "median": statistics.median(r["host_aa_ratio"] for r in rows) if rows else None},
        "median_host_speedup_on_fallback": statistics.median(
            [r["host_speedup"] for r in rows if r["served"] != "l2ir"] or [float("nan")]),
        "host_no_slower_than_torch_all": all(r["l2ir_host_us"] <= r["torch_host_us"] * 1.02 for r in rows),
        "shapes_host_slower_than_torch": sum(1 for r in rows if r["l2ir_host_us"] > r["torch_host_us"]),
        "eager_no_slower_than_torch_where_served": all(r["l2ir_eager_us"] <= r["torch_eager_us"] * 1.02
                                                       for r in by_l2ir),
        "host_no_slower_than_torch_where_served": all(r["l2ir_host_us"] <= r["torch_host_us"] * 1.02
                                                      for r in by_l2ir),
        "geomean_host_speedup_where_served_by_launch": {
            form: gmean(r["host_speedup"] for r in by_l2ir if r["launch"] == form)
            for form in sorted({r["launch"] for r in by_l2ir if r["launch"]})},
        "median_parts_us_where_served": median_parts(by_l2ir),
        "median_parts_us_on_fallback": median_parts([r for r in rows if r["served"] != "l2ir"]),
    }
    result = {"command": "python bench/dispatch_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(0),
              "package": {"content_hash": manifest["content_hash"], "tuned_shapes": len(d.package.tuned),
                          "kernels": len(d.package.kernels), "export_seconds": round(export_s, 1), **provenance},
              "settings": {"reps": args.reps, "calls": args.calls, "trials": args.trials,
                           "cubin_launch": "ordinary (--no-pdl)" if args.no_pdl else "PDL where the plan asks",
                           "layout": "a row-major (M, K), b = W.t() with W row-major (N, K): problem " + cls},
              "fastpath": d.fastpath, "dispatch_stats": dispatch.dispatch_stats(), "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
