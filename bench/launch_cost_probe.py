"""What a single cold launch costs, part by part: kernels that do no GEMM, each timed in the server scenario
(search/timing.time_server: 256 MiB flush, 0.5 ms spin, one call) and again with the flush shrunk to 1 MiB, each
interleaved with an empty torch launch (torch.cuda._sleep(1), the floor cold_start_probe reports).

    python3 bench/launch_cost_probe.py --out bench/results/launch_cost_h200.json

Each variant changes one thing against `empty` (one block of 128 threads, no shared memory, an ordinary launch):
the dynamic shared memory it reserves (an SM whose L1/shared split does not hold it must be drained and
reconfigured first), the grid, a thread-block cluster, programmatic dependent launch, one cold 16-byte load, or
straight-line code that must come from HBM after the flush (instruction fetch), and the same instructions executed
from a rolled loop (what the fetch costs beyond executing them). Every variant launches through
l2ir.runtime's CubinLauncher with the GEMM ABI, as L2IR's "kernels" plans do. Not a GEMM measurement: there is
nothing to gate; the numbers say where a small GEMM's cold time can go.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

SOURCE = r"""
#include <cstdint>
// PROBE_* macros select what the kernel does besides returning (bench/launch_cost_probe.py).
extern "C" __global__ void __launch_bounds__(128) l2ir_probe(const void* A, const void* B, void* C, int M, int N,
                                                            int K, void* ws) {
#if PROBE_PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if PROBE_SMEM
  extern __shared__ uint32_t smem[];
  smem[threadIdx.x] = M;                 // the reservation is the point; touch it so it cannot be dropped
  __syncthreads();
  if (smem[(threadIdx.x + 1) % 128] == 0x7fc00001u) static_cast<int*>(C)[0] = 1;
#endif
#if PROBE_LOAD
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    uint4 v = *static_cast<const uint4*>(A);   // one cold line: HBM latency plus a TLB walk
    if (v.x == 0x7fc00001u) static_cast<int*>(C)[0] = 1;
  }
#endif
#if PROBE_CODE
  // PROBE_CODE steps of 4 independent IMADs. Unrolled (PROBE_UNROLL 0): 64 bytes of SASS per step, fetched once
  // and executed once. Rolled by PROBE_UNROLL steps: the same instructions executed, from a loop body in cache.
  uint32_t x0 = M, x1 = N, x2 = K, x3 = threadIdx.x;
#if PROBE_UNROLL
#pragma unroll 1
  for (int j = 0; j < PROBE_CODE; j += PROBE_UNROLL)
#pragma unroll
    for (int i = j; i < j + PROBE_UNROLL; ++i) {
#else
#pragma unroll
  for (int i = 0; i < PROBE_CODE; ++i) {
#endif
    x0 = x0 * x0 + i; x1 = x1 * x1 + 3 * i; x2 = x2 * x2 + 5 * i; x3 = x3 * x3 + 7 * i;
  }
  if ((x0 ^ x1 ^ x2 ^ x3) == 0x7fc00001u) static_cast<int*>(C)[threadIdx.x] = 1;
#endif
}
"""


@dataclass(frozen=True)
class Variant:
    name: str
    grid: int = 1
    smem: int = 0
    cluster: int = 1
    pdl: bool = False
    load: bool = False
    code_steps: int = 0
    unroll: int = 0          # 0: the code loop fully unrolled; n: rolled, n steps per iteration


VARIANTS = (
    Variant("empty"),
    Variant("pdl", pdl=True),
    Variant("smem_16k", smem=16 << 10),
    Variant("smem_48k", smem=48 << 10),
    Variant("smem_100k", smem=100 << 10),
    Variant("smem_160k", smem=160 << 10),
    Variant("smem_227k", smem=227 << 10),
    Variant("grid_132", grid=132),
    Variant("grid_132_smem_227k", grid=132, smem=227 << 10),
    Variant("grid_264_smem_100k", grid=264, smem=100 << 10),
    Variant("cluster_2", grid=132, cluster=2),
    Variant("cluster_4", grid=132, cluster=4),
    Variant("cluster_4_smem_227k", grid=132, cluster=4, smem=227 << 10),
    Variant("load_1", load=True),
    Variant("code_4k", code_steps=64),
    Variant("code_16k", code_steps=256),
    Variant("code_16k_rolled", code_steps=256, unroll=4),
    Variant("code_64k", code_steps=1024),
    Variant("code_64k_rolled", code_steps=1024, unroll=4),
)


def plan_for(v: Variant):
    from l2ir.indexing import Const
    from l2ir.runtime import Launch, LaunchPlan

    flags = (f"-DPROBE_PDL={int(v.pdl)}", f"-DPROBE_SMEM={int(v.smem > 0)}", f"-DPROBE_LOAD={int(v.load)}",
             f"-DPROBE_CODE={v.code_steps}", f"-DPROBE_UNROLL={v.unroll}")
    launch = Launch("l2ir_probe", grid=(Const(v.grid), Const(1), Const(1)), block=(128, 1, 1), smem=v.smem,
                    cluster=(v.cluster, 1, 1), pdl=v.pdl)
    return LaunchPlan(source=SOURCE, arch="sm_90a", launches=(launch,), extra_flags=flags)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--samples", type=int, default=61, help="server rounds per variant and flush size")
    ap.add_argument("--only", action="append", default=[], help="variant names to run (default: all)")
    args = ap.parse_args(argv)
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only]
    unknown = set(args.only) - {v.name for v in VARIANTS}
    if unknown:
        ap.error(f"unknown variant(s) {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")

    import torch
    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.search.bench import BENCH_TIMING
    from l2ir.search.evaluator import environment
    from l2ir.search.timing import time_server

    from l2ir import runtime

    if not torch.cuda.is_available():
        print("launch_cost_probe: no CUDA GPU", file=sys.stderr)
        return 2
    timings = {"server": replace(BENCH_TIMING, server_samples=args.samples),
               "server_no_flush": replace(BENCH_TIMING, server_samples=args.samples, flush_bytes=1 << 20)}
    started = time.time()
    n_sets = 8
    a_sets = [torch.randn(1 << 19, device="cuda", dtype=torch.float16) for _ in range(n_sets)]   # 1 MiB each
    c = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)

    def empty_torch(_):
        torch.cuda._sleep(1)

    rows = []
    for v in chosen:
        art = compile_plan(plan_for(v), CompileOptions(device_sm="sm_90"))
        if not art.ok:
            print(f"launch_cost_probe: {v.name} did not build: {art.summary()}", file=sys.stderr)
            return 1
        launcher = runtime.load(plan_for(v), art.binary)

        def kernel(i, launcher=launcher):
            launcher(a_sets[i].data_ptr(), a_sets[i].data_ptr(), c.data_ptr(), 64, 64, 64, 0, 0)

        row = {"variant": v.name, **{k: getattr(v, k) for k in ("grid", "smem", "cluster", "pdl", "load",
                                                               "code_steps", "unroll")}}
        for scenario, cfg in timings.items():
            t = time_server(kernel, empty_torch, n_sets, cfg)
            row[scenario] = {"kernel_us": statistics.median(t.kernel_us),
                             "empty_torch_us": statistics.median(t.baseline_us)}
        torch.cuda.synchronize()
        launcher.close()
        rows.append(row)
        s, f = row["server"], row["server_no_flush"]
        print(f"{v.name:22s} server {s['kernel_us']:6.2f} us (torch empty {s['empty_torch_us']:5.2f})  "
              f"no flush {f['kernel_us']:6.2f} us (torch empty {f['empty_torch_us']:5.2f})", flush=True)
    out = {"command": " ".join(["python3", "bench/launch_cost_probe.py", *(argv or sys.argv[1:])]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - started, 1),
           "environment": environment(0), "samples": args.samples,
           "scenario": "server (search/timing.time_server) with a 256 MiB and a 1 MiB flush, each call interleaved "
                       "with torch.cuda._sleep(1); medians", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    base = next((r for r in rows if r["variant"] == "empty"), rows[0])
    print(f"{'variant':22} {'server':>7} {'- empty':>8} {'no flush':>8} {'- empty':>8} {'flush cost':>10}")
    for r in rows:
        s, f = r["server"]["kernel_us"], r["server_no_flush"]["kernel_us"]
        print(f"{r['variant']:22} {s:7.2f} {s - base['server']['kernel_us']:+8.2f} {f:8.2f} "
              f"{f - base['server_no_flush']['kernel_us']:+8.2f} {s - f:+10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
