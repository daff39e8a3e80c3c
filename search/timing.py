"""Timing a kernel against the baseline, in one process, interleaved trial by trial, on outputs that are checked.

offline: the device time per call of back-to-back launches. Each trial replays a CUDA graph of `reps` launches that
         rotate over several input sets (enough sets to exceed 2x L2, up to max_sets: below ~1 MB per set the
         64 sets still fit in L2, and tiny problems are timed with warm operands on both sides), timed with events
         around the replay. The graph removes host launch overhead, which for small shapes is larger than the kernel.
server:  /work/shared/MEASURE.md's method. Per round: zero a 256 MiB buffer (flushes the L2), a 0.5 ms device spin
         (so the host has queued the call before the GPU reaches it and host launch latency is not counted), then
         events around one call; the GPU never idles between rounds (no host sleep, no synchronize: events and
         output checks are queued and read at the end). Rounds order the contenders at random.

Every timed output is a fresh result (a kernel that skips work while being timed must fail):
- before each trial or round, outside the measured interval, the inputs are re-randomised in place (a graph bakes
  pointers, not values, so the replay computes on values the kernel has never seen) and every output set is
  poisoned; after it every output set written is checked (`Guard.check`);
- the number of warm-up rotations, of calls per replay and the order of the contenders vary from run to run
  (drawn from the evaluator's seed), so a kernel cannot count its way to the timed calls;
- a few single calls on fresh inputs and fresh poison are timed too: a kernel that computes the first call on a
  set and skips the later ones (C already holds the answer) is many times faster per call in a replay than alone,
  while an honest kernel gains about what the baseline gains (`replay_gain`);
- so are a few replays of one rotation (each set once since the refresh): they differ from the long replay only in
  how often a set comes back, so a kernel that skips even some of its repeated calls is faster in the long one.
  Where the sets exceed L2, each side's replay starts from a clean L2 (`CudaClock.clean`), so neither pays for
  writing back the refresh's dirty lines.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class TimingConfig:
    trials: int = 7                   # offline: graph replays per side (plus 0-2 more, drawn per run)
    target_ms: float = 25.0           # offline: length of one replay (reps chosen to reach it)
    max_reps: int = 5000
    rotate_bytes: int = 0             # offline: input bytes to rotate over; 0 = 2x the L2 size
    max_sets: int = 64
    singles: int = 3                  # offline: single calls per side on fresh inputs, for the replay-gain check
    rotations: int = 5                # offline: replays of one rotation (each set once) per side, the same check
    server_samples: int = 16          # server: rounds (MEASURE.md: 16)
    flush_bytes: int = 256 << 20      # server: L2 flush, a zeroed buffer (MEASURE.md: 256 MiB; >= 2x L2 on H200)
    # A device spin queued before the start event (~0.5 ms at 2 GHz, MEASURE.md), long enough that the host has
    # queued the timed call (a ctypes or cuda-python launch, a host shim's setup) before the spin ends; a 20 us spin
    # was seen to let 60-140 us of host launch latency into small kernels' "device time". The spin does no memory
    # traffic, so L2 stays flushed.
    spin_cycles: int = 1_000_000
    warmup: int = 3                   # rotations before capture (plus 0-3 more, drawn per run)
    idle_gap_s: float = 0.0           # server: host sleep after a synchronize before each call (0 = MEASURE.md)


def summarize(samples: Sequence[float]) -> dict:
    """Median and spread of timing samples (microseconds)."""
    if not samples:
        return {"median": None, "min": None, "max": None, "q25": None, "q75": None, "rel_spread": None}
    s = sorted(samples)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    med = statistics.median(s)
    return {"median": med, "min": s[0], "max": s[-1], "q25": q[0], "q75": q[2],
            "rel_spread": (s[-1] - s[0]) / med if med else None}


def median_lower_bound(values: Sequence[float], confidence: float = 0.95) -> float | None:
    """A distribution-free lower confidence bound for the median of `values`: the order statistic X_(j) with the
    largest j such that P(Binomial(n, 1/2) < j) <= 1 - confidence, so that the median lies below X_(j) with at most
    that probability, whatever the distribution (independent samples assumed). None when n is too small for the
    confidence (n = 4 at 95 %: even the smallest value is above the median with probability 1/16)."""
    s = sorted(values)
    n, alpha = len(s), 1.0 - confidence
    total, below = 1 << n, 0         # P(Binomial(n, 1/2) < j) = below / total, exact integers (no overflow at any n)
    j = 0
    while j < n:
        below_next = below + math.comb(n, j)
        if below_next / total > alpha:
            break
        below, j = below_next, j + 1
    return s[j - 1] if j else None


@dataclass(frozen=True)
class PairedSpeedup:
    """What a kernel's paired rounds say about its speedup (`paired_speedup`)."""

    bound: float | None        # lower confidence bound of the median per-round speedup (None: too few rounds)
    of_totals: float | None    # sum of baseline times over sum of kernel times: the rounds' total speedup
    rounds: int


def paired_speedup(pairs: Sequence[tuple[Sequence[float], Sequence[float]]],
                   confidence: float = 0.95) -> PairedSpeedup:
    """The paired view of measurements given as (kernel samples, baseline samples). Both sides of a round (or an
    offline trial) ran back to back on fresh inputs of the same shape, so baseline_i / kernel_i cancels what the
    round shares (clock state, the flush, the host's timing); a speedup's uncertainty is that of this median, not the
    spread of single calls, which on cold calls is 5-10 % while the median of 45 rounds is known to about a quarter
    of that.
    The median ignores a minority of catastrophic rounds (a kernel 1.06x faster in 70 % of rounds and 2x slower in
    the rest has a median bound of 1.06 and costs 1.3x cuBLAS's time in all), which the speedup of the totals shows.
    A measurement whose two sides differ in length adds nothing."""
    kept = [(k, b) for ks, bs in pairs if len(ks) == len(bs) for k, b in zip(ks, bs) if k > 0 and b > 0]
    ratios = [b / k for k, b in kept]
    total_k = sum(k for k, _ in kept)
    return PairedSpeedup(median_lower_bound(ratios, confidence),
                         sum(b for _, b in kept) / total_k if total_k > 0 else None, len(ratios))


def l2_bytes(device=None) -> int:
    """The GPU's L2 size in bytes (50 MiB, an H100's, where the device does not say)."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return int(getattr(props, "L2_cache_size", 0)) or (50 << 20)


def sets_for(set_bytes: int, l2_bytes: int, cfg: TimingConfig) -> int:
    """How many input sets to rotate over: enough to exceed the rotation volume, at least 2, at most max_sets."""
    volume = cfg.rotate_bytes or 2 * l2_bytes
    return max(2, min(cfg.max_sets, math.ceil(volume / max(1, set_bytes))))


def refresh_spills_l2(round_bytes: int, l2_bytes: int) -> bool:
    """Whether a round of refreshes (`round_bytes`: everything the guard writes to refresh and poison every set, the
    evaluator's `_TimingGuard.round_bytes`) can leave dirty lines that a replay must write back. Below L2 nothing
    written is evicted, and the replays keep the warm inputs the long replay has."""
    return round_bytes > l2_bytes


def reps_for(est_us: float, n_sets: int, cfg: TimingConfig) -> int:
    """Launches per graph: enough for target_ms, a whole number of rotations."""
    reps = max(n_sets, math.ceil(cfg.target_ms * 1000.0 / max(est_us, 0.5)))
    reps = min(reps, max(cfg.max_reps, n_sets))
    return math.ceil(reps / n_sets) * n_sets


# ---------------------------------------------------------------------------------------------------------------
# Clocks: the GPU one (events, CUDA graphs, L2 flush, device spin) and a host one with the same interface, so the
# whole checked timing flow also runs, and is tested, on CPU tensors.
# ---------------------------------------------------------------------------------------------------------------


class CudaClock:
    def __init__(self, cfg: TimingConfig, device=None):
        import torch

        self.cfg = cfg
        self.device = device
        self._flush = None
        self._clean = None
        self._spin = getattr(torch.cuda, "_sleep", None)

    def sync(self):
        import torch

        torch.cuda.synchronize(self.device)

    def start(self, fn: Callable[[], None]):
        """Queue fn between two events; the time is read later (`elapsed_ms`), so the host never waits for the GPU
        and the GPU never idles between samples."""
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return start, end

    @staticmethod
    def elapsed_ms(handle) -> float:
        start, end = handle
        end.synchronize()
        return start.elapsed_time(end)

    def time_ms(self, fn: Callable[[], None]) -> float:
        return self.elapsed_ms(self.start(fn))

    def capture(self, call: Callable[[int], None], order: Sequence[int]) -> Callable[[], None]:
        """A CUDA graph of calls over `order`. Warm-up runs on a side stream first, as capture requires (cuBLAS
        picks its algorithm and workspace there, not during capture)."""
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in sorted(set(order)):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in order:
                call(i)
        graph.replay()          # the first replay uploads the graph; keep that out of the timed ones
        torch.cuda.synchronize()
        return graph.replay

    def flush(self):
        """Zero a buffer larger than L2: every line of L2 then holds flush data and the operands come from HBM."""
        import torch

        if self._flush is None:
            self._flush = torch.empty(self.cfg.flush_bytes, dtype=torch.uint8, device="cuda")
        self._flush.zero_()

    def clean(self):
        """Read a buffer of 4x the L2 size: every dirty line is written back on its way out and L2 is left holding
        clean lines, so the next call pays for writing back nobody's data (a zeroing flush leaves dirty lines)."""
        import torch

        if self._clean is None:
            self._clean = torch.zeros(l2_bytes(self.device), dtype=torch.int32, device="cuda")   # 4 B each: 4x L2
        self._sum = self._clean.sum()

    def spin(self):
        if self._spin is not None:
            self._spin(self.cfg.spin_cycles)

    def close(self):
        self._flush = self._clean = None


class HostClock:
    """CPU stand-in: wall time around the calls, a "graph" that is a Python loop, no flush, no spin."""

    def __init__(self, cfg: TimingConfig, device=None):
        self.cfg = cfg

    def sync(self):
        pass

    def start(self, fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000.0

    @staticmethod
    def elapsed_ms(handle: float) -> float:
        return handle

    def time_ms(self, fn: Callable[[], None]) -> float:
        return self.start(fn)

    def capture(self, call: Callable[[int], None], order: Sequence[int]) -> Callable[[], None]:
        order = list(order)
        return lambda: [call(i) for i in order]

    def flush(self):
        pass

    def clean(self):
        pass

    def spin(self):
        pass

    def close(self):
        pass


class Guard:
    """What the checked timing needs from the evaluator: fresh inputs, poisoned outputs, and a check of what the
    timed calls wrote. Findings accumulate in `problems` (each one line naming scenario, trial and set)."""

    def refresh(self, sets: Sequence[int]):
        """Re-randomise the inputs of these sets in place (same pointers, new values)."""

    def poison(self, sets: Sequence[int]):
        """Poison the kernel's and the baseline's outputs of these sets."""

    def check(self, sets: Sequence[int], where: str):
        """Check the kernel's outputs of these sets (written since the last poison). The check may be queued on the
        device and resolved in `finish`, so the GPU is not left idle while the host reads results."""

    def finish(self):
        """Resolve the queued checks into `problems`."""


@dataclass
class Timed:
    kernel_us: list[float] = field(default_factory=list)
    baseline_us: list[float] = field(default_factory=list)
    reps: int = 1
    sets: int = 1
    warmup: int = 0
    single_kernel_us: list[float] = field(default_factory=list)
    single_baseline_us: list[float] = field(default_factory=list)
    rotation_kernel_us: list[float] = field(default_factory=list)     # per call, in replays of one rotation
    rotation_baseline_us: list[float] = field(default_factory=list)
    kernel_first: list[bool] = field(default_factory=list)      # server: per round, whether the kernel went first


def _draw(rng: np.random.Generator | None, low: int, high: int) -> int:
    """An integer in [low, high], from the evaluator's seed (low when no rng is given)."""
    return low if rng is None else int(rng.integers(low, high + 1))


def kernel_first_orders(rng: np.random.Generator | None, rounds: int) -> list[bool]:
    """Per round, whether the kernel goes first: each side first in half the rounds (an odd round drawn), in a
    shuffled order with a seed, else alternating. Leading a server round costs a few-microsecond GEMM 0.2-0.8% at
    the median and up to ~18% in a tenth of the trials (torch against itself, bench/results/server_aa*_h200.json); a
    coin per round lets the count of rounds a side leads (binomial: 5 to 10 of 15) move its median with it: the A/A
    geomean over 20 such shapes ranged 0.983-1.011 over five trials with coins, 0.987-1.005 balanced."""
    if rng is None:
        return [t % 2 == 0 for t in range(rounds)]
    firsts = [t < rounds // 2 for t in range(rounds)]
    if rounds % 2:
        firsts[-1] = bool(rng.integers(0, 2))
    return [bool(x) for x in rng.permutation(firsts)]


def time_offline(kernel: Callable[[int], None], baseline: Callable[[int], None], n_sets: int, cfg: TimingConfig,
                 guard: Guard | None = None, rng: np.random.Generator | None = None, clock=None,
                 clean_l2: bool = False):
    """Checked graph-replay timing. Without a guard and rng (the baseline probes): (kernel us per call per trial,
    baseline us per call per trial, reps). With them: a `Timed`, and every trial runs on fresh inputs and poisoned
    outputs, checked after the trial.

    clean_l2 (where `refresh_spills_l2`): each side's replay starts from a clean L2. The refresh writes every set,
    and the last L2's worth of those writes is still dirty when the first replay starts; that side pays for writing
    them back. Over a replay of one rotation (three or four calls of a skinny long-K shape) that was 20-50% of its
    time on the H100, charged to whichever side went first, and it made the rotation check reject honest kernels
    (bench/NOTES.md)."""
    clock = clock or CudaClock(cfg)
    g = guard or Guard()
    everything = list(range(n_sets))
    warm = cfg.warmup + _draw(rng, 0, 3)
    for _ in range(warm):
        for i in everything:
            kernel(i)
            baseline(i)
    clock.sync()
    est = clock.time_ms(lambda: [kernel(i % n_sets) for i in range(2 * n_sets)]) * 1000 / (2 * n_sets)
    # A whole number of rotations plus a drawn remainder and a drawn starting set: no kernel can know how many
    # calls a replay makes or which set comes first.
    reps = reps_for(est, n_sets, cfg) + _draw(rng, 0, n_sets - 1)
    first = _draw(rng, 0, n_sets - 1)
    order = [(first + r) % n_sets for r in range(reps)]
    out = Timed(reps=reps, sets=n_sets, warmup=warm)

    def checked_replays(calls: list[int], count: int, label: str) -> tuple[list[float], list[float]]:
        """Per-call us of `count` replays per side of a graph over `calls`, each on fresh inputs and poison, checked."""
        replay_k, replay_b = clock.capture(kernel, calls), clock.capture(baseline, calls)
        pending_k, pending_b = [], []
        for t, kernel_first in enumerate(kernel_first_orders(rng, count)):
            g.refresh(everything)
            g.poison(everything)
            pair = ((replay_k, pending_k), (replay_b, pending_b))
            for replay, pending in (pair if kernel_first else pair[::-1]):
                if clean_l2:
                    clock.clean()
                pending.append(clock.start(replay))
            g.check(everything, f"offline {label} {t}")
        return ([clock.elapsed_ms(h) * 1000.0 / len(calls) for h in pending_k],
                [clock.elapsed_ms(h) * 1000.0 / len(calls) for h in pending_b])

    out.kernel_us, out.baseline_us = checked_replays(order, cfg.trials + _draw(rng, 0, 2), "trial")
    # One rotation on fresh inputs: every set once, so no call meets inputs it has met before. An honest kernel's
    # per-call time is the replay's (the same calls in the same graph, the same cache state: the sets exceed L2 or
    # all fit in it either way); a kernel that skips some repeated calls is faster in the long replay.
    if guard is not None and cfg.rotations:
        out.rotation_kernel_us, out.rotation_baseline_us = checked_replays(order[:n_sets], cfg.rotations, "rotation")
    # Single calls on fresh inputs and fresh poison: what one call costs when nothing of it can be reused.
    singles = cfg.singles if guard is not None else 0
    for s, kernel_first in enumerate(kernel_first_orders(rng, singles)):
        i = (first + s) % n_sets
        g.refresh([i])
        g.poison([i])
        pair = ((kernel, out.single_kernel_us), (baseline, out.single_baseline_us))
        for fn, samples in (pair if kernel_first else pair[::-1]):
            clock.spin()
            samples.append(clock.time_ms(lambda: fn(i)) * 1000.0)
        g.check([i], f"offline single call {s}")
    g.finish()
    if guard is None and rng is None:
        return out.kernel_us, out.baseline_us, reps
    return out


def time_server(kernel: Callable[[int], None], baseline: Callable[[int], None], n_sets: int, cfg: TimingConfig,
                guard: Guard | None = None, rng: np.random.Generator | None = None, clock=None) -> Timed:
    """One call per side per round, each after an L2 flush and a device spin (MEASURE.md), on fresh inputs and
    poisoned outputs, checked after the round. Rounds walk through the sets, so consecutive rounds never share
    buffers."""
    clock = clock or CudaClock(cfg)
    g = guard or Guard()
    warm = cfg.warmup + _draw(rng, 0, 3)
    for r in range(warm):
        kernel(r % n_sets)
        baseline(r % n_sets)
    clock.sync()
    out = Timed(reps=1, sets=n_sets, warmup=warm)
    start = _draw(rng, 0, n_sets - 1)
    pending_k, pending_b = [], []
    out.kernel_first = kernel_first_orders(rng, cfg.server_samples)
    for r, kernel_first in enumerate(out.kernel_first):
        i = (start + r) % n_sets
        g.refresh([i])
        g.poison([i])
        pair = ((kernel, pending_k), (baseline, pending_b))
        for fn, pending in (pair if kernel_first else pair[::-1]):
            clock.flush()
            if cfg.idle_gap_s:
                clock.sync()
                time.sleep(cfg.idle_gap_s)
            clock.spin()
            pending.append(clock.start(lambda: fn(i)))
        g.check([i], f"server round {r}")
    out.kernel_us = [clock.elapsed_ms(h) * 1000.0 for h in pending_k]
    out.baseline_us = [clock.elapsed_ms(h) * 1000.0 for h in pending_b]
    g.finish()
    clock.close()
    return out


# An honest kernel called back to back gains from warm caches and no launch gaps about what the baseline gains; one
# that skips repeated calls on unchanged inputs gains up to the ratio of its compute to its check. Allowed: this
# factor over the baseline's gain (and never less than this factor over no gain at all). A single call pays its
# launch latency, which a replay hides, so that comparison needs a wide factor.
REPLAY_GAIN_FACTOR = 2.0
# A replay of one rotation and the long replay differ only in how often each set comes back: no launch latency,
# the same cache state, so an honest kernel's ratio is about 1, and the baseline's shows what the short graph
# itself costs (its launch, spread over fewer calls). A kernel that skips a fraction f of the repeated calls gains
# 1 / (1 - f): this factor over the baseline's ratio catches f above 20%. The baseline's ratio counts only up to
# the same factor: a larger one is noise (a microsecond baseline on a loaded host), not a cost the kernel shares.
ROTATION_GAIN_FACTOR = 1.25


def replay_gain(t: Timed) -> tuple[bool, str]:
    """(passed, detail) of the replay-gain check: single-call time / replay time per call, and one rotation's time /
    replay time per call, kernel vs baseline. Both ratios are reported; either one over its limit fails."""
    if not (t.single_kernel_us and t.single_baseline_us and t.kernel_us and t.baseline_us):
        return True, "no single calls were timed"
    med = statistics.median
    gk = med(t.single_kernel_us) / max(med(t.kernel_us), 1e-9)
    gb = med(t.single_baseline_us) / max(med(t.baseline_us), 1e-9)
    limit = REPLAY_GAIN_FACTOR * max(1.0, gb)
    parts = [f"single call / replay per call: kernel {gk:.2f}x, baseline {gb:.2f}x (limit {limit:.2f}x; "
             f"kernel single {med(t.single_kernel_us):.3g} us, replay {med(t.kernel_us):.3g} us per call)"]
    failures = []
    if gk > limit:
        failures.append("the kernel is much faster back to back than alone: it skips repeated work")
    if t.rotation_kernel_us and t.rotation_baseline_us:
        rk = med(t.rotation_kernel_us) / max(med(t.kernel_us), 1e-9)
        rb = med(t.rotation_baseline_us) / max(med(t.baseline_us), 1e-9)
        rlimit = ROTATION_GAIN_FACTOR * min(max(1.0, rb), ROTATION_GAIN_FACTOR)
        parts.append(f"one rotation / replay per call: kernel {rk:.2f}x, baseline {rb:.2f}x (limit {rlimit:.2f}x; "
                     f"kernel rotation {med(t.rotation_kernel_us):.3g} us per call)")
        if rk > rlimit:
            failures.append("the kernel is faster on sets it has met before in the replay than on fresh ones: it "
                            "skips repeated work")
    return not failures, "; ".join(parts + failures)
