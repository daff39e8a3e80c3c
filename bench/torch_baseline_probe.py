"""How much do layout, input rotation and interleaving move torch.matmul's time? (explains baseline differences)

    python bench/torch_baseline_probe.py [--out FILE]

For 4096^3 and 8192^3 fp16, times torch.matmul by CUDA-graph replay (device time per call, median of 7 replays of
~10 ms) with B stored KxN ("NN") and NxK ("TN", as the L2IR evaluator's b=f16:col problems), each with one hot
buffer set and with inputs rotated over sets exceeding 2x L2; and with PyTorch's default flags vs fp16
reduced-precision reductions off.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def graph_time_us(fn, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    from l2ir.search.timing import l2_bytes

    l2 = l2_bytes(0)
    rows = []
    for (m, n, k) in ((4096, 4096, 4096), (8192, 8192, 8192)):
        set_bytes = 2 * (m * k + k * n + m * n)
        for layout in ("NN", "TN"):
            for rotate in (False, True):
                sets = max(2, -(-2 * l2 // set_bytes)) if rotate else 1
                data = []
                for _ in range(sets):
                    a = torch.randn(m, k, device="cuda").half()
                    b = torch.randn(k, n, device="cuda").half() if layout == "NN" else \
                        torch.randn(n, k, device="cuda").half().t()
                    data.append((a, b, torch.empty(m, n, device="cuda", dtype=torch.half)))
                for reduced in (True, False):
                    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
                    est = 2 * m * n * k / 700e12 * 1e6
                    reps = max(sets, int(10_000 / est)) // sets * sets
                    us = graph_time_us(lambda i: torch.matmul(data[i % sets][0], data[i % sets][1],
                                                              out=data[i % sets][2]), reps)
                    row = dict(shape=f"{m}x{n}x{k}", b_layout=layout, sets=sets, reduced_precision=reduced,
                               us=round(us, 2), tflops=round(2 * m * n * k / us / 1e6, 1))
                    rows.append(row)
                    print(row, flush=True)
                del data
                torch.cuda.empty_cache()
    # A/A test of the evaluator's offline harness: torch.matmul timed against itself, interleaved exactly as a
    # candidate and its baseline are. A ratio away from 1.0 would be a bias of the harness, not of a kernel.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from l2ir.search.timing import TimingConfig, time_offline

    for (m, n, k) in ((4096, 4096, 4096), (8192, 8192, 512)):
        sets = max(2, -(-2 * l2 // (2 * (m * k + k * n + m * n))))
        data = [(torch.randn(m, k, device="cuda").half(), torch.randn(n, k, device="cuda").half().t(),
                 torch.empty(m, n, device="cuda", dtype=torch.half), torch.empty(m, n, device="cuda", dtype=torch.half))
                for _ in range(sets)]
        first = lambda i: torch.matmul(data[i][0], data[i][1], out=data[i][2])     # noqa: E731
        second = lambda i: torch.matmul(data[i][0], data[i][1], out=data[i][3])    # noqa: E731
        ks, bs, reps = time_offline(first, second, sets, TimingConfig(trials=7, target_ms=10.0))
        row = dict(shape=f"{m}x{n}x{k}", test="A/A torch vs torch in search.timing.time_offline", sets=sets,
                   reps=reps, first_us=round(statistics.median(ks), 2), second_us=round(statistics.median(bs), 2),
                   ratio=round(statistics.median(bs) / statistics.median(ks), 4))
        rows.append(row)
        print(row, flush=True)
        del data
    env = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(environment=env, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
