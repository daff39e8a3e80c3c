"""Which kernels does torch.matmul (cuBLAS) run on the shapes L2IR still loses, with what grid, block and shared memory?

    python3 bench/cublas_kernels_probe.py --shape 127x4096x4096 [--shape MxNxK ...] --out FILE

The problem class is L2IR's a=f16:row b=f16:col: A row-major (M, K), B stored (N, K), called as
torch.matmul(a, w.t()). Each shape runs a few warm-up calls, then `--calls` calls under torch.profiler; every GPU
kernel event is kept with its launch configuration (the profiler's grid, block, registers per thread, shared memory)
and its median duration. The kernel names say the tile, the cluster and whether cuBLAS split K (a separate
reduction kernel, or a "segment_k" / "splitK" name), which is what the loser shapes' kernels are compared against.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from l2ir.cli import positive_int, shape_arg


def kernels_of(m: int, n: int, k: int, calls: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn((m, k), device="cuda", dtype=torch.half)
    w = torch.randn((n, k), device="cuda", dtype=torch.half)
    for _ in range(5):
        torch.matmul(a, w.t())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.matmul(a, w.t())
        torch.cuda.synchronize()
    by_name: dict[str, dict] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.name.startswith(("Memcpy", "Memset")):
            continue
        row = by_name.setdefault(ev.name, {"name": ev.name, "durations_us": []})
        row["durations_us"].append(ev.device_time)
    for trace_ev in _trace_kernels(prof):
        row = by_name.get(trace_ev.get("name"))
        if row is not None and "launch" not in row:
            args = trace_ev.get("args", {})
            row["launch"] = {key: args.get(key) for key in ("grid", "block", "registers per thread",
                                                            "shared memory", "blocks per SM", "warps per SM")}
    out = []
    for row in by_name.values():
        d = row.pop("durations_us")
        out.append(row | {"calls": len(d), "median_us": round(statistics.median(d), 3)})
    return out


def _trace_kernels(prof) -> list[dict]:
    """The kernel events of the profiler's Chrome trace (where the launch configuration lives)."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    finally:
        os.unlink(path)
    return [ev for ev in trace.get("traceEvents", []) if ev.get("cat") == "kernel"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=shape_arg, action="append", required=True)
    ap.add_argument("--calls", type=positive_int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cublas_kernels_probe: no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    from l2ir.search.evaluator import environment

    rows = []
    for m, n, k in args.shape:
        ks = kernels_of(m, n, k, args.calls)
        rows.append({"m": m, "n": n, "k": k, "kernels": ks})
        for kr in ks:
            launch = kr.get("launch", {})
            print(f"{m:>6}x{n:<6}x{k:<6} {kr['median_us']:8.2f} us  grid {launch.get('grid')} block "
                  f"{launch.get('block')} smem {launch.get('shared memory')}  {kr['name'][:110]}", flush=True)
    result = {"command": "python3 bench/cublas_kernels_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(0),
              "scenario": "torch.matmul(a, w.t()), f16 in and out, under torch.profiler", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
