"""How close to the DRAM roofline can any kernel get on the DRAM-bound shapes? (the ceiling of issue 11's target)

    python bench/dram_ceiling_probe.py [--from bench/results/families_derived_v11_h200.json] [--shape MxNxK ...]
                                       [--writes] [--reads] --out bench/results/dram_ceiling_h200.json

The roofline floor of a shape is its least DRAM traffic (read A and B once, write C once) over the H200's measured
copy rate (l2ir.target.H200_DRAM_BYTES_PER_S). A GEMM cannot move fewer bytes than that, and it cannot move them
faster than a kernel that does nothing else. So for each shape this times, in the evaluator's offline scenario
(search.timing.time_offline: CUDA-graph replay over input sets rotated past 2x L2, interleaved with torch.matmul on
the same sets), kernels that only stream those bytes:
  - read A and B once with 16-byte streaming loads (ld.global.cs: read once, evict first) and write C once with
    16-byte streaming stores, grid-stride over every SM, at several grid sizes and block sizes (the best is the
    ceiling: no multiply, no tiles, no epilogue, every load independent);
  - an empty kernel of the same launch shape: the per-call cost of a launch in a replay, paid by any kernel.
The share a stream kernel reaches is the most a GEMM kernel on the same bytes can reach in this harness; where it is
under 0.90, the roofline target cannot be met by any kernel in the IR or outside it.
The kernels are checked: C must hold the stream kernel's fill value after each timing (a kernel that wrote nothing
would look fast), and the XOR of what was read goes to the workspace, so no load is dead code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from sweep_cases import offline_sets

STREAM_SOURCE = r"""
#include <stdint.h>
// Reads A (M*K halves) and B (N*K halves) once and writes C (M*N halves) once: the least traffic of a GEMM, with
// nothing else to do. Grid-stride over 16-byte vectors, UNROLL independent loads in flight per thread (the
// bytes in flight per SM are what sets DRAM throughput); the last bytes that do not fill a vector go by halves.
#define UNROLL 4

__device__ __forceinline__ uint32_t fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

__device__ __forceinline__ uint32_t read_once(const void* base, size_t bytes, size_t tid, size_t nthreads) {
  const uint4* p = reinterpret_cast<const uint4*>(base);
  size_t n = bytes / 16, i = tid;
  uint32_t acc = 0;
  for (; i + (UNROLL - 1) * nthreads < n; i += UNROLL * nthreads) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(p + i + u * nthreads);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= fold(v[u]);
  }
  for (; i < n; i += nthreads) acc ^= fold(__ldcs(p + i));
  const uint16_t* h = reinterpret_cast<const uint16_t*>(base);
  for (size_t j = n * 8 + tid; j < bytes / 2; j += nthreads) acc ^= __ldcs(h + j);
  return acc;
}

__device__ __forceinline__ void write_once(void* base, size_t bytes, size_t tid, size_t nthreads, uint32_t word) {
  uint4* p = reinterpret_cast<uint4*>(base);
  size_t n = bytes / 16, i = tid;
  uint4 v = make_uint4(word, word, word, word);
  for (; i + (UNROLL - 1) * nthreads < n; i += UNROLL * nthreads) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) __stcs(p + i + u * nthreads, v);
  }
  for (; i < n; i += nthreads) __stcs(p + i, v);
  uint16_t* h = reinterpret_cast<uint16_t*>(base);
  for (size_t j = n * 8 + tid; j < bytes / 2; j += nthreads) h[j] = (uint16_t)word;
}

extern "C" __global__ void l2ir_stream_gemm_bytes(const void* A, const void* B, void* C, int M, int N, int K,
                                                  void* workspace) {
  size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, nthreads = (size_t)gridDim.x * blockDim.x;
  // The stores do not wait for the loads: a GEMM's C depends on its reads, so this is an upper bound.
  write_once(C, (size_t)M * N * 2, tid, nthreads, 0x3c003c00u);   // fp16 1.0 in every element
  uint32_t acc = read_once(A, (size_t)M * K * 2, tid, nthreads) ^ read_once(B, (size_t)N * K * 2, tid, nthreads);
  if (acc == 0x9e3779b9u) atomicXor(reinterpret_cast<uint32_t*>(workspace), acc);   // keeps every load live
}

// Write-only kernels: C alone, linear or tile by tile (TBM x TBN tiles in the order a persistent GEMM visits them,
// consecutive tiles along N or along M), with default write-back stores (st.global) or streaming ones (.cs).
template <bool TILED, bool ALONG_N, bool STREAMING>
__device__ __forceinline__ void write_c(void* C, int M, int N) {
  constexpr int TBM = 128, TBN = 256;
  uint4 v = make_uint4(0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u);
  uint4* c = reinterpret_cast<uint4*>(C);
  if (!TILED) {
    size_t n = (size_t)M * N / 8;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
      if (STREAMING) __stcs(c + i, v); else c[i] = v;
    }
    return;
  }
  int tm = M / TBM, tn = N / TBN;   // the probe's shapes divide into whole tiles
  for (int t = blockIdx.x; t < tm * tn; t += gridDim.x) {
    int r0 = (ALONG_N ? t / tn : t % tm) * TBM, c0 = (ALONG_N ? t % tn : t / tm) * TBN;
    for (int i = threadIdx.x; i < TBM * TBN / 8; i += blockDim.x) {
      size_t at = ((size_t)(r0 + i / (TBN / 8)) * N + c0) / 8 + i % (TBN / 8);
      if (STREAMING) __stcs(c + at, v); else c[at] = v;
    }
  }
}
#define WRITE_KERNEL(name, tiled, along_n, streaming) \
  extern "C" __global__ void name(const void*, const void*, void* C, int M, int N, int, void*) { \
    write_c<tiled, along_n, streaming>(C, M, N); }
WRITE_KERNEL(l2ir_write_linear_wb, false, true, false)
WRITE_KERNEL(l2ir_write_linear_cs, false, true, true)
WRITE_KERNEL(l2ir_write_tiles_n_wb, true, true, false)
WRITE_KERNEL(l2ir_write_tiles_n_cs, true, true, true)
WRITE_KERNEL(l2ir_write_tiles_m_wb, true, false, false)
WRITE_KERNEL(l2ir_write_tiles_m_cs, true, false, true)

// Read-only kernels on B (N x K, K contiguous) in a GEMM's pattern: block (tile, slice) reads the RB = 64 rows of its
// column tile over its K slice, CHUNK bytes of each row per step (a k tile's row: 128 bytes at BK = 64), DEPTH steps
// in flight (8 or 16 16-byte loads per thread: 32-64 KB per block, a ring's worth). Against the linear read of the
// same B: does visiting 64 rows 32 KB apart, CHUNK bytes at a time, cost DRAM throughput?
template <int CHUNK, int DEPTH>
__device__ __forceinline__ void read_b_tiles(const void* B, int N, int K, void* workspace) {
  constexpr int RB = 64, THREADS = 256, VECS = RB * CHUNK / 16, PER_THREAD = VECS * DEPTH / THREADS;
  static_assert(VECS * DEPTH % THREADS == 0, "whole loads per thread");
  const size_t row = (size_t)K * 2;
  const int tiles = N / RB, slices = gridDim.x / tiles;
  const size_t per = row / slices / (CHUNK * DEPTH) * (CHUNK * DEPTH);   // the host counts the bytes this leaves
  const char* base = reinterpret_cast<const char*>(B) + (size_t)(blockIdx.x / slices) * RB * row
                     + (blockIdx.x % slices) * per;
  uint32_t acc = 0;
  for (size_t k0 = 0; k0 < per; k0 += CHUNK * DEPTH) {
    uint4 v[PER_THREAD];
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
      const int j = threadIdx.x + u * THREADS, step = j / VECS, r = j % VECS / (CHUNK / 16), c = j % (CHUNK / 16);
      v[u] = __ldcs(reinterpret_cast<const uint4*>(base + r * row + k0 + step * CHUNK + c * 16));
    }
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) acc ^= fold(v[u]);
  }
  if (acc == 0x9e3779b9u) atomicXor(reinterpret_cast<uint32_t*>(workspace), acc);
}
#define READ_KERNEL(chunk, depth) \
  extern "C" __global__ void __launch_bounds__(256) l2ir_read_b_##chunk##x##depth(const void*, const void* B, void*, \
                                                                                  int, int N, int K, void* ws) { \
    read_b_tiles<chunk, depth>(B, N, K, ws); }
READ_KERNEL(128, 4)
READ_KERNEL(128, 8)
READ_KERNEL(256, 2)
READ_KERNEL(256, 4)
READ_KERNEL(512, 1)
READ_KERNEL(512, 2)
READ_KERNEL(1024, 1)
extern "C" __global__ void l2ir_read_b_linear(const void*, const void* B, void*, int, int N, int K, void* ws) {
  size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, nthreads = (size_t)gridDim.x * blockDim.x;
  uint32_t acc = read_once(B, (size_t)N * K * 2, tid, nthreads);
  if (acc == 0x9e3779b9u) atomicXor(reinterpret_cast<uint32_t*>(ws), acc);
}

extern "C" __global__ void l2ir_empty(const void* A, const void* B, void* C, int M, int N, int K, void* workspace) {}
"""

FILL_FP16 = 1.0
# (blocks per SM, threads per block): from one block per SM to oversubscribed grids (the tail of a small grid-stride
# is short; a large grid hides more latency per SM).
VARIANTS = ((1, 1024), (4, 512), (8, 256), (32, 128))
# --writes: the write-only kernels, each at one block of 256 threads per SM (a persistent GEMM's grid) and at four.
WRITE_KERNELS = ("linear_wb", "linear_cs", "tiles_n_wb", "tiles_n_cs", "tiles_m_wb", "tiles_m_cs")
WRITE_GRIDS = (1, 4)
# --reads: (CHUNK bytes per row and step, DEPTH steps in flight, blocks per SM) of the tiled B reads.
READ_KERNELS = ((128, 4, 1), (128, 4, 2), (128, 8, 1), (256, 2, 1), (256, 4, 1), (512, 1, 1), (512, 2, 1), (1024, 1, 1))
READ_ROWS = 64


def read_grid(n: int, k: int, per_sm: int, sms: int, chunk: int, depth: int) -> tuple[int, int]:
    """(blocks, bytes read) of a tiled B read: N / 64 column tiles, each split into the K slices that bring the grid
    nearest per_sm blocks per SM, each slice a whole number of CHUNK x DEPTH steps (what is left over is not read)."""
    tiles = n // READ_ROWS
    slices = max(1, round(per_sm * sms / tiles))
    per = (2 * k // slices) // (chunk * depth) * (chunk * depth)
    return tiles * slices, tiles * slices * READ_ROWS * per


def shape_arg(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected MxNxK, e.g. 64x4096x12288") from None
    return m, n, k


PROBLEM_CLASS = "a=f16:row b=f16:col c=f16:row"   # the evaluator's: B stored N x K


def floor_us(m: int, n: int, k: int) -> float:
    """The DRAM side of the bench's roofline (search.report.roofline): the least bytes at the measured copy rate."""
    from l2ir.search.report import roofline

    from l2ir.target import H200_DRAM_BYTES_PER_S, H200_TENSOR_F16_FLOPS

    roof = roofline((m, n, k), PROBLEM_CLASS, (H200_TENSOR_F16_FLOPS, H200_DRAM_BYTES_PER_S))
    return roof["bytes"] / H200_DRAM_BYTES_PER_S * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="derived", default="bench/results/families_derived_v11_h200.json",
                    help="derive_families output whose dram_bound group gives the shapes and the best kernels' shares")
    ap.add_argument("--shape", type=shape_arg, action="append", default=[], help="MxNxK (repeatable; adds shapes)")
    ap.add_argument("--writes", action="store_true",
                    help="also time write-only kernels on C (linear or tile by tile, write-back or streaming stores) "
                         "for the shapes whose M and N divide into 128x256 tiles")
    ap.add_argument("--reads", action="store_true",
                    help="also time read-only kernels on B: linear, and in a GEMM's pattern (64 rows per block, a "
                         "chunk of each row per step) for the shapes whose N divides into 64-row tiles")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    derived_rows = {}
    if args.derived:
        try:
            group = json.loads(Path(args.derived).read_text())["groups"]["dram_bound"]["rows"]
        except (OSError, KeyError, ValueError) as e:
            ap.error(f"--from {args.derived}: no dram_bound group ({e})")
        derived_rows = {tuple(r["shape"]): r for r in group}
    shapes = list(derived_rows) + [s for s in args.shape if s not in derived_rows]
    if not shapes:
        ap.error("no shapes: give --from or --shape")

    import torch

    if not torch.cuda.is_available():
        print("dram_ceiling_probe: no CUDA GPU here", file=sys.stderr)
        return 1
    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.search.evaluator import environment
    from l2ir.search.timing import TimingConfig, l2_bytes, time_offline

    from l2ir.indexing import Const
    from l2ir.runtime import CubinLauncher, Launch, LaunchPlan
    from l2ir.target import H200_DRAM_BYTES_PER_S

    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, l2_bytes(0)
    launches = tuple(Launch(entry="l2ir_stream_gemm_bytes", grid=(Const(sms * per_sm), Const(1), Const(1)),
                            block=(threads, 1, 1)) for per_sm, threads in VARIANTS)
    launches += (Launch(entry="l2ir_empty", grid=(Const(sms * 4), Const(1), Const(1)), block=(512, 1, 1)),)
    plans = [LaunchPlan(source=STREAM_SOURCE, arch="sm_90a", launches=(ln,)) for ln in launches]
    built = compile_plan(plans[0], CompileOptions())
    if not built.ok:
        print(f"dram_ceiling_probe: the stream kernel did not compile: {built.summary()}", file=sys.stderr)
        return 1
    names = [f"stream_{per_sm}x{threads}" for per_sm, threads in VARIANTS] + ["empty"]
    if args.writes:
        for w in WRITE_KERNELS:
            for per_sm in WRITE_GRIDS:
                plans.append(LaunchPlan(source=STREAM_SOURCE, arch="sm_90a", launches=(Launch(
                    entry=f"l2ir_write_{w}", grid=(Const(sms * per_sm), Const(1), Const(1)), block=(256, 1, 1)),)))
                names.append(f"write_{w}_{per_sm}")
    if args.reads:
        plans.append(LaunchPlan(source=STREAM_SOURCE, arch="sm_90a", launches=(Launch(
            entry="l2ir_read_b_linear", grid=(Const(sms * 4), Const(1), Const(1)), block=(512, 1, 1)),)))
        names.append("read_b_linear")
    launchers = [CubinLauncher(p, built.binary) for p in plans]
    cfg = TimingConfig()
    ws = torch.zeros(16, dtype=torch.uint8, device="cuda")
    rows = []
    for m, n, k in shapes:
        sets, baseline = offline_sets(m, n, k, l2, cfg)
        n_sets = len(sets)
        row = {"shape": [m, n, k], "floor_us": floor_us(m, n, k), "sets": n_sets, "kernels": {}}
        torch_us = []
        # (name, launcher, bytes read: set for the read-only kernels, which write no C)
        runs = [(name, launcher, 2 * n * k if name == "read_b_linear" else None)
                for name, launcher in zip(names, launchers)]
        tiled = []       # the tiled reads' grids depend on the shape: their launchers are made and closed per shape
        if args.reads and n % READ_ROWS == 0:
            for chunk, depth, per_sm in READ_KERNELS:
                blocks, nbytes = read_grid(n, k, per_sm, sms, chunk, depth)
                if nbytes:
                    tiled.append((f"read_b_{chunk}x{depth}_{per_sm}", CubinLauncher(LaunchPlan(
                        source=STREAM_SOURCE, arch="sm_90a", launches=(Launch(
                            entry=f"l2ir_read_b_{chunk}x{depth}", grid=(Const(blocks), Const(1), Const(1)),
                            block=(256, 1, 1)),)), built.binary), nbytes))
        for name, launcher, nbytes in runs + tiled:
            if name.startswith("write_tiles") and (m % 128 or n % 256):
                continue
            def kernel(i, launcher=launcher, sets=sets, mnk=(m, n, k)):
                a, b, c, _ = sets[i]
                launcher(a.data_ptr(), b.data_ptr(), c.data_ptr(), *mnk, ws.data_ptr(), 16)

            for _, _, c, _ in sets:
                c.fill_(0)
            k_us, b_us, reps = time_offline(kernel, baseline, n_sets, cfg)
            written = name == "empty" or nbytes is not None or all(bool((c == FILL_FP16).all()) for _, _, c, _ in sets)
            row["kernels"][name] = {"us": statistics.median(k_us), "spread": (max(k_us) - min(k_us)) / min(k_us),
                                    "reps": reps, "wrote_c": written}
            if nbytes is not None:
                row["kernels"][name].update(bytes=nbytes, tbps=nbytes / statistics.median(k_us) / 1e6)
            torch_us.append(statistics.median(b_us))
        streams = {nm: r for nm, r in row["kernels"].items() if nm.startswith("stream") and r["wrote_c"]}
        best = min(streams, key=lambda nm: streams[nm]["us"]) if streams else None
        row["torch_us"] = statistics.median(torch_us)
        row["torch_share"] = row["floor_us"] / row["torch_us"]
        row["launch_us"] = row["kernels"]["empty"]["us"]
        if best:
            row["ceiling_kernel"], row["ceiling_us"] = best, streams[best]["us"]
            row["ceiling_share"] = row["floor_us"] / row["ceiling_us"]
        d = derived_rows.get((m, n, k))
        if d:
            row["best_l2ir_share"] = d["kernel_share"]
            row["best_l2ir_us"] = d["floor_us"] / d["kernel_share"]
        rows.append(row)
        for _, launcher, _ in tiled:
            launcher.close()
        reads = {nm: round(r["tbps"], 2) for nm, r in row["kernels"].items() if nm.startswith("read_b")}
        if reads:
            print(f"{m}x{n}x{k} B read-only, TB/s: {reads}", flush=True)
        writes = {nm: round(r["us"], 2) for nm, r in row["kernels"].items() if nm.startswith("write")}
        if writes:
            print(f"{m}x{n}x{k} write-only (C floor {2 * m * n / H200_DRAM_BYTES_PER_S * 1e6:.2f} us): {writes}",
                  flush=True)
        print(f"{m}x{n}x{k}: floor {row['floor_us']:.2f} us, ceiling {row.get('ceiling_us', float('nan')):.2f} "
              f"({best}), torch {row['torch_us']:.2f}, launch {row['launch_us']:.2f}", flush=True)
    for launcher in launchers:
        launcher.close()

    def median(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {"command": "python3 bench/dram_ceiling_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(0),
           "scenario": "offline (CUDA-graph replay over rotated input sets, interleaved with torch.matmul)",
           "floor": "2 * (MK + NK + MN) bytes / l2ir.target.H200_DRAM_BYTES_PER_S",
           "median_ceiling_share": median("ceiling_share"), "median_torch_share": median("torch_share"),
           "median_best_l2ir_share": median("best_l2ir_share"),
           "shapes_ceiling_at_least_0.90": sum(1 for r in rows if (r.get("ceiling_share") or 0) >= 0.90),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'shape':>18} {'floor':>7} {'ceiling':>8} {'launch':>7} {'torch':>7} {'L2IR':>7} "
          f"{'ceil share':>10} {'torch sh':>8} {'L2IR sh':>8}")
    for r in rows:
        s = "x".join(map(str, r["shape"]))
        print(f"{s:>18} {r['floor_us']:7.2f} {r.get('ceiling_us', float('nan')):8.2f} {r['launch_us']:7.2f} "
              f"{r['torch_us']:7.2f} {r.get('best_l2ir_us', float('nan')):7.2f} {r.get('ceiling_share', 0):10.3f} "
              f"{r['torch_share']:8.3f} {r.get('best_l2ir_share', float('nan')):8.3f}")
    print(f"median shares: ceiling {out['median_ceiling_share']:.3f}, torch {out['median_torch_share']:.3f}, "
          f"best L2IR {out['median_best_l2ir_share']}; shapes whose ceiling reaches 0.90: "
          f"{out['shapes_ceiling_at_least_0.90']} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
