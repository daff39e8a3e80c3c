"""Which server number is right? One kernel of the Hopper sweep against torch.matmul, timed both ways and in between.

The bench (before issue 8) reported 0.957x for single calls on large shapes; an independent harness following
/work/shared/MEASURE.md measured about 1.03x on the same shapes. The two differ in several ways at once; this script
times the same kernel and torch on the same buffers with each method, and with MEASURE.md's method changed one
factor at a time, so the factor that moves the ratio is visible:

  old          the bench's former time_server: fill a 128 MiB buffer with a byte, synchronize, sleep 2 ms (the GPU
               idles), a 0.5 ms spin, events around the call, always buffer set 0, kernel/torch alternating
  measure_md   search/timing.time_server as it is now (MEASURE.md): zero 256 MiB, 0.5 ms spin, events around the
               call, no host sleep or sync between rounds, shuffled order, a fresh set per round
  +idle        measure_md plus the old synchronize + 2 ms sleep before the spin
  +fill128     measure_md with the old flush (fill 128 MiB with a byte instead of zeroing 256 MiB)
  +set0        measure_md on one fixed buffer set, inputs never refreshed
  offline      CUDA-graph replay over rotated sets (search/timing.time_offline), for reference

It also reports each contender's host-side launch cost (time for the Python call to return): if it exceeds the
spin, host latency enters the measured interval. And it runs the kernel through every evaluator gate once per shape.

Usage (on the GPU host, after installing the .whl/ wheels; see bench/gpu_smoke.sh):
    python bench/server_check.py --out bench/results/server_check_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# The largest and the furthest apart in sm90_large_v2 (server 0.89-0.93x, offline 1.04-1.06x).
DEFAULT_SHAPES = ("8192x8192x8192", "4096x8192x12288", "8192x2048x12288", "16384x1024x8192")


def fail(msg: str):
    print(f"server_check: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        fail(f"--shape {text!r}: expected MxNxK, e.g. 8192x8192x8192")
    return m, n, k


def sweep_kernel(results: Path, config: str):
    """The IR of a named sweep config, as recorded in a bench summary's `kernels` section."""
    from l2ir.text import parse_kernel

    try:
        summary = json.loads(results.read_text())
    except (OSError, ValueError) as e:
        fail(f"{results}: cannot read the bench summary ({e})")
    for entry in summary.get("kernels", {}).values():
        if entry.get("config") == config:
            return parse_kernel(entry["kernel"])
    names = sorted({e.get("config") for e in summary.get("kernels", {}).values()})
    fail(f"{results}: no kernel named {config!r} (have: {', '.join(map(str, names))})")


def old_server(kernel, baseline, l2_bytes: int, samples: int, spin_cycles: int) -> tuple[list, list]:
    """The bench's time_server before issue 8, verbatim in method."""
    import torch

    flush = torch.empty(max(2 * l2_bytes, 128 << 20), dtype=torch.uint8, device="cuda")
    for _ in range(3):
        kernel(0)
        baseline(0)
    torch.cuda.synchronize()
    ks, bs = [], []
    for s in range(samples):
        order = ((kernel, ks), (baseline, bs)) if s % 2 == 0 else ((baseline, bs), (kernel, ks))
        for fn, out in order:
            flush.fill_(s & 0xFF)
            torch.cuda.synchronize()
            time.sleep(0.002)
            torch.cuda._sleep(spin_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(0)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1000.0)
    return ks, bs


class FillClock:
    """CudaClock with the old flush: fill a 128 MiB (or 2x L2) buffer with a byte."""

    def __init__(self, base, l2_bytes):
        import torch

        self.base = base
        self.buf = torch.empty(max(2 * l2_bytes, 128 << 20), dtype=torch.uint8, device="cuda")
        self.n = 0

    def flush(self):
        self.n += 1
        self.buf.fill_(self.n & 0xFF)

    def __getattr__(self, name):
        return getattr(self.base, name)


def host_cost_us(fn, reps: int = 20) -> float:
    """Median time for the host call to return (the GPU work is queued, not waited for)."""
    import torch

    costs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)          # keep the GPU busy so the queue never blocks the host
        t0 = time.perf_counter()
        fn(0)
        costs.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(costs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="pingpong_128x128x64_c1x2", help="sweep config name (default %(default)s)")
    ap.add_argument("--results", type=Path, default=ROOT / "bench/results/sm90_large_v2_h200.json",
                    help="bench summary holding the config's IR")
    ap.add_argument("--shape", action="append", help="MxNxK (repeatable); default: four large shapes")
    ap.add_argument("--samples", type=int, default=16, help="server rounds per method")
    ap.add_argument("--cache", default=".l2ir-cache")
    ap.add_argument("--no-gates", action="store_true", help="skip running the evaluator gates on each shape")
    ap.add_argument("--compile-only", action="store_true", help="build the kernel into the cache and stop "
                    "(start it in the background while other GPU work runs; it needs no GPU)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.samples < 2:
        fail(f"--samples {args.samples}: need at least 2")

    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.backends.registry import lower
    from l2ir.nodes import Problem

    shapes = [parse_shape(s) for s in (args.shape or DEFAULT_SHAPES)]
    kernel = sweep_kernel(args.results, args.config)
    cls = Problem(m=shapes[0][0], n=shapes[0][1], k=shapes[0][2])
    plan = lower(kernel, cls)
    t0 = time.perf_counter()
    # sm_90 (the H200 the sweep ran on): the build needs no GPU, so --compile-only can run beside other work.
    art = compile_plan(plan, CompileOptions(cache_dir=args.cache, device_sm="sm_90"))
    if not art.ok:
        fail(f"compile failed: {art.summary()} (reproduce: {art.repro})")
    print(f"compiled {args.config} in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.compile_only:
        return 0

    import torch

    from l2ir.runtime import load
    from l2ir.search.evaluator import EvalConfig, Evaluator, environment
    from l2ir.search.timing import CudaClock, Guard, TimingConfig, l2_bytes, summarize, time_offline, time_server

    if not torch.cuda.is_available():
        fail("no CUDA GPU")
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        fail(f"the sweep's kernels are sm90a (Hopper); this GPU is sm_{major}{minor}")
    launcher = load(plan, Path(art.binary), 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    l2 = l2_bytes(0)
    base_cfg = TimingConfig(trials=7, target_ms=10.0, server_samples=args.samples)
    report = {"config": args.config, "kernel": kernel.text(), "environment": environment(0), "shapes": []}
    methods = ("old", "measure_md", "+idle", "+fill128", "+set0", "offline")
    ratios = {mth: [] for mth in methods}
    ev = None if args.no_gates else Evaluator(EvalConfig(scenarios=()))

    for m, n, k in shapes:
        gen = torch.Generator(device="cuda").manual_seed(m * 31 + n * 7 + k)
        sets = []
        for _ in range(2):      # >= 2 x L2 per pair at these sizes; rounds alternate between them
            a = torch.randn((m, k), generator=gen, device="cuda").half()
            b = torch.randn((n, k), generator=gen, device="cuda").half().t()
            sets.append((a, b, torch.empty((m, n), dtype=torch.half, device="cuda"),
                         torch.empty((m, n), dtype=torch.half, device="cuda")))
        ws_bytes = launcher.workspace_bytes(m, n, k)
        ws = torch.zeros(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")

        def kcall(i):
            a, b, c, _ = sets[i]
            if plan.zero_workspace and ws_bytes:
                ws.zero_()
            launcher(a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k, ws.data_ptr(), ws_bytes)

        def tcall(i):
            a, b, _, cb = sets[i]
            torch.matmul(a, b, out=cb)

        class Fresh(Guard):
            def refresh(self, idx):
                for i in idx:
                    sets[i][0].normal_(generator=gen)
                    sets[i][1].normal_(generator=gen)

        row = {"shape": [m, n, k], "tflop": 2 * m * n * k / 1e12,
               "host_launch_us": {"kernel": host_cost_us(kcall), "torch": host_cost_us(tcall)},
               "spin_us": base_cfg.spin_cycles / (report["environment"].get("sm_clock_mhz") or 1980)}
        rng = np.random.default_rng(m + n + k)
        runners = {
            "old": lambda: old_server(kcall, tcall, l2, args.samples, base_cfg.spin_cycles),
            "measure_md": lambda: time_server(kcall, tcall, 2, base_cfg, Fresh(), rng, CudaClock(base_cfg)),
            "+idle": lambda: time_server(kcall, tcall, 2, replace(base_cfg, idle_gap_s=0.002), Fresh(), rng,
                                         CudaClock(base_cfg)),
            "+fill128": lambda: time_server(kcall, tcall, 2, base_cfg, Fresh(), rng,
                                            FillClock(CudaClock(base_cfg), l2)),
            "+set0": lambda: time_server(lambda i: kcall(0), lambda i: tcall(0), 1, base_cfg, None, rng,
                                         CudaClock(base_cfg)),
            "offline": lambda: time_offline(kcall, tcall, 2, base_cfg)[:2],
        }
        # Two passes, the second in reverse order, samples pooled: a slow drift (clocks, temperature) over the
        # seconds this takes does not favour the methods that ran first.
        results = {name: ([], []) for name in methods}
        for order in (methods, methods[::-1]):
            for name in order:
                got = runners[name]()
                ks, bs = (got.kernel_us, got.baseline_us) if hasattr(got, "kernel_us") else got
                results[name][0].extend(ks)
                results[name][1].extend(bs)
        row["methods"] = {}
        for name, (ks, bs) in results.items():
            sk, sb = summarize(ks), summarize(bs)
            ratio = sb["median"] / sk["median"]
            ratios[name].append(ratio)
            row["methods"][name] = {"kernel_us": ks, "torch_us": bs, "kernel_median_us": sk["median"],
                                    "torch_median_us": sb["median"], "speedup": ratio}
        print(f"{m}x{n}x{k}: host launch kernel {row['host_launch_us']['kernel']:.0f} us, torch "
              f"{row['host_launch_us']['torch']:.0f} us (spin ~{row['spin_us']:.0f} us)")
        for name in methods:
            r = row["methods"][name]
            print(f"  {name:11s} kernel {r['kernel_median_us']:9.1f} us  torch {r['torch_median_us']:9.1f} us  "
                  f"speedup {r['speedup']:.3f}", flush=True)
        sets.clear()              # the closures above die with this iteration; give the memory back now
        ws = None
        torch.cuda.empty_cache()
        if not args.no_gates:
            ms = ev.evaluate(kernel, cls.with_shape(m, n, k), plan, art)
            row["gates"] = {v.name: {"passed": v.passed, "detail": v.detail} for v in ms[0].verdicts}
            row["gate_errors"] = ms[0].errors
            failed = [v.name for v in ms[0].verdicts if not v.passed]
            print(f"  gates: {'all passed' if ms[0].passed else 'FAILED ' + ', '.join(failed)}"
                  f"; ulp: {row['gates'].get('ulp', {}).get('detail', '?')}", flush=True)
        report["shapes"].append(row)

    report["geomean_speedup"] = {name: math.exp(sum(map(math.log, r)) / len(r)) for name, r in ratios.items() if r}
    print("geomean speedup by method: " + ", ".join(f"{k} {v:.3f}" for k, v in report["geomean_speedup"].items()))
    launcher.close()
    if ev is not None:
        ev.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
