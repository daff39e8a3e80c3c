"""Timing a kernel against the baseline, in one process, interleaved trial by trial.

offline: the device time per call of back-to-back launches. Each trial replays a CUDA graph of `reps` launches that
         rotate over several input sets (enough sets to exceed 2x L2, up to max_sets: below ~1 MB per set the
         64 sets still fit in L2, and tiny problems are timed with warm operands on both sides), timed with events around the replay. The graph
         removes host launch overhead, which for small shapes is larger than the kernel.
server:  one call after the L2 has been flushed (a write of >= 2x its size) and an idle gap, timed with events. A
         short device-side spin is queued first, so the start event is stamped after the launch has reached the
         GPU and host launch latency is not counted.
Kernel and baseline alternate inside each trial (the order flips every trial), so clock and thermal drift hit both.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class TimingConfig:
    trials: int = 7                   # offline: graph replays per side; the median is reported
    target_ms: float = 25.0           # offline: length of one replay (reps chosen to reach it)
    max_reps: int = 5000
    rotate_bytes: int = 0             # offline: input bytes to rotate over; 0 = 2x the L2 size
    max_sets: int = 64
    server_samples: int = 21          # server: single calls per side
    idle_gap_s: float = 0.002         # server: host-side pause before each call
    flush_bytes: int = 0              # server: L2 flush write; 0 = 2x the L2 size (at least 128 MiB)
    # server: a device spin queued before the start event (~0.5 ms at 2 GHz), long enough that the host has queued
    # the timed call (a ctypes or cuda-python launch, a host shim's setup) before the spin ends; a 20 us spin was
    # seen to let 60-140 us of host launch latency into small kernels' "device time". The spin does no memory
    # traffic, so L2 stays flushed.
    spin_cycles: int = 1_000_000
    warmup: int = 3


def summarize(samples: Sequence[float]) -> dict:
    """Median and spread of timing samples (microseconds)."""
    if not samples:
        return {"median": None, "min": None, "max": None, "q25": None, "q75": None, "rel_spread": None}
    s = sorted(samples)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    med = statistics.median(s)
    return {"median": med, "min": s[0], "max": s[-1], "q25": q[0], "q75": q[2],
            "rel_spread": (s[-1] - s[0]) / med if med else None}


def sets_for(set_bytes: int, l2_bytes: int, cfg: TimingConfig) -> int:
    """How many input sets to rotate over: enough to exceed the rotation volume, at least 2, at most max_sets."""
    volume = cfg.rotate_bytes or 2 * l2_bytes
    return max(2, min(cfg.max_sets, math.ceil(volume / max(1, set_bytes))))


def reps_for(est_us: float, n_sets: int, cfg: TimingConfig) -> int:
    """Launches per graph: enough for target_ms, a whole number of rotations."""
    reps = max(n_sets, math.ceil(cfg.target_ms * 1000.0 / max(est_us, 0.5)))
    reps = min(reps, max(cfg.max_reps, n_sets))
    return math.ceil(reps / n_sets) * n_sets


def _event_time_ms(fn: Callable[[], None]) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _capture(call: Callable[[int], None], reps: int, n_sets: int):
    """A CUDA graph of `reps` calls rotating over the sets. Warm-up runs on a side stream first, as capture
    requires (cuBLAS picks its algorithm and workspace there, not during capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_sets):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            call(r % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_offline(kernel: Callable[[int], None], baseline: Callable[[int], None], n_sets: int,
                 cfg: TimingConfig) -> tuple[list[float], list[float], int]:
    """(kernel us per call per trial, baseline us per call per trial, reps per graph)."""
    import torch

    for _ in range(cfg.warmup):
        for i in range(n_sets):
            kernel(i)
            baseline(i)
    torch.cuda.synchronize()
    est = _event_time_ms(lambda: [kernel(i % n_sets) for i in range(2 * n_sets)]) * 1000 / (2 * n_sets)
    reps = reps_for(est, n_sets, cfg)
    g_kernel = _capture(kernel, reps, n_sets)
    g_base = _capture(baseline, reps, n_sets)
    ks, bs = [], []
    for t in range(cfg.trials):
        order = ((g_kernel, ks), (g_base, bs)) if t % 2 == 0 else ((g_base, bs), (g_kernel, ks))
        for graph, out in order:
            out.append(_event_time_ms(graph.replay) * 1000.0 / reps)
    del g_kernel, g_base
    return ks, bs, reps


def time_server(kernel: Callable[[int], None], baseline: Callable[[int], None], l2_bytes: int,
                cfg: TimingConfig) -> tuple[list[float], list[float]]:
    """(kernel us per single call, baseline us per single call), each after an L2 flush and an idle gap."""
    import torch

    flush = torch.empty(cfg.flush_bytes or max(2 * l2_bytes, 128 << 20), dtype=torch.uint8, device="cuda")
    spin = getattr(torch.cuda, "_sleep", None)
    for _ in range(cfg.warmup):
        kernel(0)
        baseline(0)
    torch.cuda.synchronize()
    ks, bs = [], []
    for s in range(cfg.server_samples):
        order = ((kernel, ks), (baseline, bs)) if s % 2 == 0 else ((baseline, bs), (kernel, ks))
        for fn, out in order:
            flush.fill_(s & 0xFF)            # every line of L2 now holds flush data; the operands come from HBM
            torch.cuda.synchronize()
            time.sleep(cfg.idle_gap_s)
            if spin is not None:
                spin(cfg.spin_cycles)
            out.append(_event_time_ms(lambda: fn(0)) * 1000.0)
    del flush
    return ks, bs
