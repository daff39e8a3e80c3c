"""The GPU evaluator: correctness gates, then timing against torch.matmul, in a worker process that owns the GPU.

A candidate kernel can fault (illegal address: the CUDA context is then unusable) or hang. Both only cost the
worker: the parent (`Evaluator`) watches it through a pipe with a per-phase timeout, kills it on a hang, records
the candidate as failed with the phase and the reason, and starts a fresh worker for the next candidate. The
worker reports each phase and each verdict as it goes, so a crash is attributed to the gate that was running.

Usage:
    with Evaluator(EvalConfig()) as ev:
        measurements = ev.evaluate(kernel, problem, plan, artifact)   # one Measurement per scenario
"""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from l2ir.backends.compile import CompileResult, cutlass_version
from l2ir.runtime import LaunchPlan
from l2ir.text import print_problem
from l2ir.nodes import Kernel, Problem
from l2ir.target import DTYPE_BYTES, TORCH_DTYPE

from .gates import (GuardedBuffer, Verdict, admits, bits_differing, check_accuracy, check_ulps, poison,
                    poisoned_count, ragged_shapes, relative_error, reproducible, ulp_allowed, ulp_excess, unwritten,
                    wrong_lines)
from .timing import (CudaClock, Guard, HostClock, TimingConfig, l2_bytes, refresh_spills_l2, replay_gain, sets_for,
                     summarize, time_offline, time_server)

SCENARIOS = ("offline", "server")


@dataclass(frozen=True)
class EvalConfig:
    device: int = 0
    scenarios: tuple[str, ...] = SCENARIOS       # () = gates only
    timing: TimingConfig = TimingConfig()
    phase_timeout_s: float = 180.0               # no progress for this long = hang; the worker is killed
    startup_timeout_s: float = 300.0             # worker start: import torch, create the CUDA context
    # cuBLAS may reduce split-K partials in fp16 unless told not to; the contract is fp32 accumulation, so by
    # default the baseline is held to it too.
    baseline_reduced_precision: bool = False
    # repeated_calls: as many calls as fit this much kernel time (by the timed median), within the bounds. A race
    # that goes wrong once in 1000 calls is seen with probability 1 - 0.999^calls: 63% at 1000 calls, 2% at 16.
    repeat_budget_ms: float = 50.0
    repeat_calls: tuple[int, int] = (16, 1024)


@dataclass
class Measurement:
    """One kernel on one problem in one scenario: gate verdicts, errors, and the time distributions."""

    kernel_hash: str
    problem: str
    scenario: str
    environment: dict = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    kernel_us: list[float] = field(default_factory=list)
    baseline_us: list[float] = field(default_factory=list)
    kernel_stats: dict = field(default_factory=dict)
    baseline_stats: dict = field(default_factory=dict)
    kernel_median_us: float | None = None
    baseline_median_us: float | None = None
    speedup: float | None = None                  # baseline median / kernel median (> 1: the kernel is faster)
    baseline: str = "torch.matmul"
    reps: int | None = None                       # offline: launches per graph replay
    sets: int | None = None                       # input sets rotated over
    warmup: int | None = None                     # warm-up rotations (offline) or calls (server), drawn per run
    artifact_key: str = ""
    compile_seconds: float | None = None
    seed: int | None = None

    @property
    def passed(self) -> bool:
        return not self.errors and bool(self.verdicts) and all(v.passed for v in self.verdicts)

    def verdict(self, name: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.name == name), None)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["verdicts"] = [v.to_json() for v in self.verdicts]
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @staticmethod
    def from_json(d: dict) -> "Measurement":
        d = dict(d)
        d["verdicts"] = [Verdict.from_json(v) for v in d.get("verdicts", [])]
        return Measurement(**d)


# ---------------------------------------------------------------------------------------------------------------
# Environment.
# ---------------------------------------------------------------------------------------------------------------


def environment(device: int) -> dict:
    """GPU, clocks, driver, CUDA, torch, CUTLASS: what a number needs beside it to mean anything."""
    import importlib.metadata

    import torch

    props = torch.cuda.get_device_properties(device)
    env = {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "l2_bytes": int(getattr(props, "L2_cache_size", 0)) or None,
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cutlass": cutlass_version(),
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        env["cuda_bindings"] = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        env["cuda_bindings"] = None
    try:
        from cuda.bindings import driver as cu

        err, ver = cu.cuDriverGetVersion()
        env["cuda_driver_api"] = f"{ver // 1000}.{ver % 1000 // 10}"
    except Exception:  # noqa: BLE001 - the record is still useful without it
        env["cuda_driver_api"] = None
    env.update(clocks(device))
    return env


def clocks(device: int) -> dict:
    """Driver version and SM clocks (current and max) via NVML, else nvidia-smi; empty if neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device)
        out = {"driver": pynvml.nvmlSystemGetDriverVersion(),
               "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
               "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
               "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)}
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in out.items()}
    except Exception:  # noqa: BLE001 - NVML missing or not answering: fall back to nvidia-smi
        pass
    try:
        res = subprocess.run(["nvidia-smi", "-i", str(device), "--query-gpu=driver_version,clocks.sm,clocks.max.sm,"
                              "clocks.mem", "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20)
        drv, sm, sm_max, mem = [x.strip() for x in res.stdout.strip().splitlines()[0].split(",")]
        return {"driver": drv, "sm_clock_mhz": int(sm), "sm_clock_max_mhz": int(sm_max), "mem_clock_mhz": int(mem)}
    except Exception:  # noqa: BLE001
        return {}


# ---------------------------------------------------------------------------------------------------------------
# Worker side: buffers, gates, timing.
# ---------------------------------------------------------------------------------------------------------------

def _tdtype(name: str):
    import torch

    return getattr(torch, TORCH_DTYPE[name])


class Case:
    """One problem size's guarded A, B, C and workspace, in the problem's layouts, and the call that runs on them.

    The stored inputs are copied (`snapshot`) whenever they get new values. After a call the copy says whether the
    kernel changed its inputs, and the float64 reference is computed from it then (`reference`): no reference to the
    current inputs exists in device memory while the kernel runs, so there is none for it to find and copy into C,
    and a kernel that zeroes A cannot make the reference zero with it."""

    def __init__(self, problem: Problem, shape: tuple[int, int, int], launcher, zero_workspace: bool, device,
                 workspace: GuardedBuffer | None = None):
        m, n, k = shape
        self.problem, self.shape, self.launcher, self.zero_workspace = problem, shape, launcher, zero_workspace
        self.ta, self.tb, self.tc = _tdtype(problem.a[0]), _tdtype(problem.b[0]), _tdtype(problem.c[0])
        self.a_stored = (m, k) if problem.a[1] == "row" else (k, m)
        self.b_stored = (k, n) if problem.b[1] == "row" else (n, k)
        self.A = GuardedBuffer("A", m * k * DTYPE_BYTES[problem.a[0]], device)
        self.B = GuardedBuffer("B", k * n * DTYPE_BYTES[problem.b[0]], device)
        self.C = GuardedBuffer("C", m * n * DTYPE_BYTES[problem.c[0]], device)
        self.ws_bytes = launcher.workspace_bytes(m, n, k)
        self.W = workspace if workspace is not None else GuardedBuffer("workspace", self.ws_bytes, device)
        self._a0 = self._b0 = None

    def _logical(self, raw, dtype, stored, layout):
        s = raw.view(dtype).view(stored)
        return s if layout == "row" else s.t()

    def a(self):
        return self._logical(self.A.interior, self.ta, self.a_stored, self.problem.a[1])

    def b(self):
        return self._logical(self.B.interior, self.tb, self.b_stored, self.problem.b[1])

    def c(self):
        return self.C.view(self.tc, self.shape[:2])

    def set_inputs(self, a, b):
        """Write logical A (m x k) and B (k x n) into the stored layouts (rounded to the input dtype) and copy them."""
        self.a().copy_(a)
        self.b().copy_(b)
        self.snapshot()

    def refresh(self, gen, copy: bool = True):
        """New randn values in place (the pointers stay, as a CUDA graph needs), then the copy (not needed for the
        baseline's inputs)."""
        self.A.view(self.ta, self.a_stored).normal_(generator=gen)
        self.B.view(self.tb, self.b_stored).normal_(generator=gen)
        if copy:
            self.snapshot()

    def refresh_bytes(self, copy: bool = True) -> int:
        """Bytes `refresh` writes: A and B, and their copy unless copy=False."""
        return (self.A.interior.nbytes + self.B.interior.nbytes) * (2 if copy else 1)

    def snapshot(self):
        """Copy the stored inputs (after every change the evaluator makes to them)."""
        if self._a0 is None:
            self._a0, self._b0 = self.A.interior.clone(), self.B.interior.clone()
        else:
            self._a0.copy_(self.A.interior)
            self._b0.copy_(self.B.interior)

    def inputs_changed(self):
        """Bytes of A and B that differ from the copy, as a 0-d tensor (no host sync)."""
        return (self.A.interior != self._a0).sum() + (self.B.interior != self._b0).sum()

    def reference(self):
        """The float64 product of the copied inputs (call it after the kernel's call)."""
        import torch

        a = self._logical(self._a0, self.ta, self.a_stored, self.problem.a[1])
        b = self._logical(self._b0, self.tb, self.b_stored, self.problem.b[1])
        return torch.matmul(a.to(torch.float64), b.to(torch.float64))

    def run(self):
        if self.ws_bytes:
            # A plan that asks for a zeroed workspace gets one; any other starts on all-ones bytes (NaN as fp32),
            # so a reduction that reads a partial nobody wrote poisons C and fails the accuracy gates.
            self.W.interior.fill_(0 if self.zero_workspace else 0xFF)
        self.launch()

    def launch(self):
        """The call alone, on the workspace as it stands (the timed calls: zeroed or filled once, before the first)."""
        m, n, k = self.shape
        self.launcher(self.A.data_ptr(), self.B.data_ptr(), self.C.data_ptr(), m, n, k, self.W.data_ptr(),
                      self.ws_bytes)

    def guard_problems(self) -> list[str]:
        return [p for p in (buf.check_guards() for buf in (self.A, self.B, self.C, self.W)) if p]

    def problems(self) -> list[str]:
        """Guard bands written or inputs changed since the last snapshot (host sync)."""
        changed = int(self.inputs_changed())
        return self.guard_problems() + ([f"the kernel changed {changed} bytes of its inputs A and B"]
                                        if changed else [])


def _randn(shape, gen, device):
    import torch

    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_job(job: dict, send, launcher=None, device=None) -> dict:
    """Gates then timing for one candidate. `send(kind, payload)` reports phases and verdicts to the parent.
    `launcher` and `device` replace the artifact's launcher and the GPU (the gate flow is tested on CPU that way)."""
    import torch

    from l2ir.runtime import load

    kernel: Kernel = job["kernel"]
    problem: Problem = job["problem"]
    plan: LaunchPlan = job["plan"]
    cfg: EvalConfig = job["config"]
    dev = torch.device(device) if device is not None else torch.device("cuda", cfg.device)
    out, acc = problem.c[0], problem.acc
    tile = (kernel.tile.bm, kernel.tile.bn) if kernel.tile is not None else (64, 64)
    seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    rng = np.random.default_rng(seed)
    result: dict = {"seed": seed, "errors": [], "timings": {}}
    verdicts: list[Verdict] = []
    torch.backends.cuda.matmul.allow_tf32 = False       # no reference or baseline may silently drop to TF32

    def record(v: Verdict):
        verdicts.append(v)
        send("verdict", v.to_json())

    send("phase", "load")
    if launcher is None:
        launcher = load(plan, Path(job["binary"]), cfg.device)
    try:
        m, n, k = problem.shape
        main = Case(problem, problem.shape, launcher, plan.zero_workspace, dev)
        guard_log: list[str] = []

        # accuracy + all_written: one run on poisoned C with fresh randn inputs.
        send("phase", "gate:accuracy")
        main.set_inputs(_randn((m, k), gen, dev), _randn((k, n), gen, dev))
        poison(main.c(), out)
        main.run()
        _sync(dev)
        ref_x = main.reference()
        count, where = unwritten(main.c(), out, tile)
        record(check_accuracy("accuracy", main.c(), ref_x, k, acc, out, note=f"seed {seed}"))
        record(check_ulps("ulp", main.c(), ref_x, k, acc, out))
        record(Verdict("all_written", count == 0, where or f"all {m * n} elements written"))
        guard_log += [f"after the accuracy run: {p}" for p in main.problems()]

        # stale_output: fresh inputs in the same buffers, C not re-poisoned; C must be the new product.
        skip = set(job.get("skip_gates", ()))
        if "stale_output" not in skip:
            send("phase", "gate:stale_output")
            main.set_inputs(_randn((m, k), gen, dev), _randn((k, n), gen, dev))
            main.run()
            _sync(dev)
            ref_y = main.reference()
            v = check_accuracy("stale_output", main.c(), ref_y, k, acc, out)
            if not v.passed and relative_error(main.c(), ref_x) < relative_error(main.c(), ref_y):
                v = Verdict("stale_output", False, v.detail + "; C is closer to the previous call's product")
            record(v)
            guard_log += [f"after the second call: {p}" for p in main.problems()]
            del ref_y
        del ref_x

        # partial_refresh: a few random rows of A, then a few random columns of B, get new values in place; C keeps
        # the previous product. A kernel that decides "same inputs as last time" from the pointers and a few sampled
        # values skips the call and leaves the refreshed rows (columns) stale.
        send("phase", "gate:partial_refresh")
        record(_partial_refresh(main, m, n, k, acc, out, gen, rng, dev, guard_log))

        record(Verdict("guard_bands", not guard_log, "; ".join(guard_log) or
                       "A, B, C and workspace guards intact, inputs unchanged by every call"))

        # ragged_shapes: every check again on shapes that no tile divides (once per kernel and problem class when
        # the caller reuses the verdict: it is the kernel's predication that is checked, not this shape).
        send("phase", "gate:ragged_shapes")
        ran, failures, skipped = [], [], []
        ragged = [] if "ragged_shapes" in skip else ragged_shapes(
            problem, kernel.tile.block if kernel.tile is not None else None)
        for shape in ragged:
            ok, why = admits(kernel, problem.with_shape(*shape))
            if not ok:
                skipped.append(f"{shape}: {why}")
                continue
            rm, rn, rk = shape
            case = Case(problem, shape, launcher, plan.zero_workspace, dev)
            case.set_inputs(_randn((rm, rk), gen, dev), _randn((rk, rn), gen, dev))
            poison(case.c(), out)
            send("phase", f"gate:ragged_shapes {rm}x{rn}x{rk}")
            case.run()
            _sync(dev)
            ref = case.reference()
            va = check_accuracy("ragged", case.c(), ref, rk, acc, out)
            if va.passed:
                va = check_ulps("ragged", case.c(), ref, rk, acc, out)
            cnt, where = unwritten(case.c(), out, tile)
            probs = case.problems()
            ran.append(shape)
            if not va.passed or cnt or probs:
                failures.append(f"m={rm} n={rn} k={rk}: " + "; ".join(
                    ([va.detail] if not va.passed else []) + ([where] if cnt else []) + probs))
            del case, ref
        if "ragged_shapes" in skip:
            pass
        elif not ran:
            record(Verdict("ragged_shapes", True, "no ragged shape is accepted by the kernel: "
                           + "; ".join(skipped), skipped=True))
        else:
            record(Verdict("ragged_shapes", not failures, "; ".join(failures) or
                           f"{len(ran)} shapes passed: " + ", ".join("x".join(map(str, s)) for s in ran)))
        del main

        # Only a kernel that passed every gate is timed: a wrong kernel's speed is not a number worth keeping.
        if cfg.scenarios and job.get("time", True) and all(v.passed for v in verdicts):
            result.update(_timing(problem, plan, launcher, cfg, gen, rng, dev, send, record, reproducible(kernel)))
    finally:
        launcher.close()
    return result


# A refresh touches 1/32 of the rows (columns), at least one, at random positions: a kernel that samples a few fixed
# positions to recognise its inputs misses the change in both refreshes with probability about (1/32)^2, and one
# that samples everything costs as much as reading its inputs (the replay-gain check then sees it skip repeats).
REFRESH_FRACTION = 1 / 32


def _partial_refresh(main: Case, m, n, k, acc, out, gen, rng, dev, guard_log: list[str]) -> Verdict:
    import torch

    notes, bad = [], []
    for what, dim in (("rows of A", m), ("columns of B", n)):
        idx = np.sort(rng.choice(dim, size=max(1, int(dim * REFRESH_FRACTION)), replace=False))
        t = torch.as_tensor(idx, device=dev)
        if what == "rows of A":
            main.a()[t] = _randn((len(idx), k), gen, dev).to(main.ta)
        else:
            main.b()[:, t] = _randn((k, len(idx)), gen, dev).to(main.tb)
        main.snapshot()
        main.run()
        _sync(dev)
        ref = main.reference()
        guard_log += [f"after refreshing {what}: {p}" for p in main.problems()]
        v = check_accuracy("partial_refresh", main.c(), ref, k, acc, out)
        shown = ", ".join(map(str, idx[:6])) + (", ..." if len(idx) > 6 else "")
        notes.append(f"{len(idx)} {what} ({shown})")
        if not v.passed:
            lines = wrong_lines(main.c(), ref, k, acc, out, rows=(what == "rows of A"))
            bad.append(f"after refreshing {len(idx)} {what}: {v.detail}; {lines}")
    if bad:
        return Verdict("partial_refresh", False, "; ".join(bad) + " (C kept its previous product there: the kernel "
                       "skipped the call on inputs it took for the previous ones)")
    return Verdict("partial_refresh", True, "refreshed in place, C kept, one call each: " + "; ".join(notes))


class _TimingGuard(Guard):
    """Fresh inputs, poisoned outputs and the check of every set the timed calls wrote (search/timing.py).

    The kernel's sets are guarded Cases, laid out as in the gates (a kernel that looks at the bytes around its
    pointers sees the same thing in both), and the baseline computes on guarded inputs of its own (the same
    layout in memory, so neither side's page walks are cheaper): a kernel that found the baseline's output would
    find the product of other inputs. Each written set is checked after the trial or round
    against the float64 product of the copy of its inputs, in ulps as the `ulp` gate counts them, and its inputs
    against that copy."""

    def __init__(self, sets: list[Case], baseline_sets: list[Case], gen, out, k, acc, workspace: GuardedBuffer):
        self.sets, self.baseline_sets, self.gen, self.out, self.k, self.acc = sets, baseline_sets, gen, out, k, acc
        self.workspace = workspace
        self.problems: list[str] = []
        self.pending: list = []
        self.checked = 0

    def refresh(self, sets):
        for i in sets:
            self.sets[i].refresh(self.gen)
            self.baseline_sets[i].refresh(self.gen, copy=False)

    @property
    def round_bytes(self) -> int:
        """Bytes one round of `refresh` and `poison` over every set writes: each set's inputs three times (the
        kernel's, their copy, the baseline's) and both sides' outputs (search.timing.refresh_spills_l2)."""
        return sum(case.refresh_bytes() + base.refresh_bytes(copy=False) + case.c().nbytes + base.c().nbytes
                   for case, base in zip(self.sets, self.baseline_sets))

    def poison(self, sets):
        for i in sets:
            poison(self.sets[i].c(), self.out)
            poison(self.baseline_sets[i].c(), self.out)

    def check(self, sets, where):
        # Queued on the device (counts stay tensors until `finish`): no host sync inside the timing loops.
        for i in sets:
            case = self.sets[i]
            c = case.c()
            self.pending.append((where, i, c.numel(), poisoned_count(c, self.out), case.inputs_changed(),
                                 *ulp_excess(c, case.reference(), self.k, self.acc, self.out)))

    def finish(self):
        for where, i, numel, left, changed, over1, over2 in self.pending:
            self.checked += 1
            left, changed, over1, over2 = int(left), int(changed), int(over1), int(over2)
            if changed:
                self.problems.append(f"{where}, set {i}: the kernel changed {changed} bytes of its inputs A and B")
            if left:
                self.problems.append(f"{where}, set {i}: {left} of {numel} elements still hold the poison")
            elif over2 or over1 > ulp_allowed(numel):
                self.problems.append(f"{where}, set {i}: {over1} of {numel} elements beyond 1 ulp of the float64 "
                                     f"product (allowed {ulp_allowed(numel)}), {over2} beyond 2 (allowed 0)")
        self.pending.clear()

    def guard_problems(self) -> list[str]:
        """Guard bands the timed calls wrote (read once, after every scenario)."""
        bufs = [buf for case in self.sets for buf in (case.A, case.B, case.C)] + [self.workspace]
        return [p for p in (buf.check_guards() for buf in bufs) if p]


def _timing(problem, plan, launcher, cfg: EvalConfig, gen, rng, dev, send, record, exact: bool) -> dict:
    import torch

    m, n, k = problem.shape
    out, acc = problem.c[0], problem.acc
    ta, tb, tc = _tdtype(problem.a[0]), _tdtype(problem.b[0]), _tdtype(problem.c[0])
    on_gpu = dev.type == "cuda"
    l2 = l2_bytes(dev) if on_gpu else 50 << 20
    set_bytes = m * k * ta.itemsize + k * n * tb.itemsize + m * n * tc.itemsize
    n_sets = sets_for(set_bytes, l2, cfg.timing)

    ws_bytes = launcher.workspace_bytes(m, n, k)
    # zero_workspace means zeroed once, before the first launch (l2ir/runtime.py): a split-K kernel's pair counters
    # must be left at zero by the kernel itself, so no memset is timed and none is paid by l2ir.matmul. A kernel that
    # does not clean up computes wrong results on the later timed calls and fails the timed_outputs gate. Any other
    # plan gets all-ones bytes (NaN as fp32), as in Case.run.
    ws = GuardedBuffer("workspace", ws_bytes, dev)
    ws.interior.fill_(0 if plan.zero_workspace else 0xFF)
    sets = [Case(problem, problem.shape, launcher, plan.zero_workspace, dev, workspace=ws) for _ in range(n_sets)]
    baseline_sets = [Case(problem, problem.shape, launcher, plan.zero_workspace, dev, workspace=ws)
                     for _ in range(n_sets)]
    for case, base in zip(sets, baseline_sets):
        case.refresh(gen)
        base.refresh(gen, copy=False)

    def kernel_call(i: int):
        sets[i].launch()

    same_dtype = ta == tb == tc

    baseline_views = [(base.a(), base.b(), base.c()) for base in baseline_sets]    # made once: no host work per call

    def baseline_call(i: int):
        a, b, c = baseline_views[i]
        if same_dtype:
            torch.matmul(a, b, out=c)
        else:
            c.copy_(torch.matmul(a, b))

    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = cfg.baseline_reduced_precision
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = cfg.baseline_reduced_precision
    guard = _TimingGuard(sets, baseline_sets, gen, out, k, acc, ws)
    clock = (CudaClock if on_gpu else HostClock)(cfg.timing, dev)
    timings, gains = {}, []
    for scenario in cfg.scenarios:
        send("phase", f"timing:{scenario}")
        if scenario == "offline":
            t = time_offline(kernel_call, baseline_call, n_sets, cfg.timing, guard, rng, clock,
                             clean_l2=refresh_spills_l2(guard.round_bytes, l2))
            gains.append(replay_gain(t))
        elif scenario == "server":
            t = time_server(kernel_call, baseline_call, n_sets, cfg.timing, guard, rng, clock)
        else:
            raise ValueError(f"unknown scenario '{scenario}' (expected one of {', '.join(SCENARIOS)})")
        timings[scenario] = {"kernel_us": t.kernel_us, "baseline_us": t.baseline_us, "reps": t.reps,
                             "sets": t.sets, "warmup": t.warmup}

    send("phase", "gate:timed_outputs")
    clock.sync()
    guard.problems += [f"after the timed calls: {p}" for p in guard.guard_problems()]
    record(Verdict("timed_outputs", not guard.problems, "; ".join(guard.problems[:8]) +
                   (f"; ... {len(guard.problems) - 8} more" if len(guard.problems) > 8 else "") or
                   f"{guard.checked} output sets checked after the timed calls against the float64 product of "
                   "their inputs (fresh inputs and poison before each trial or round; inputs unchanged)"))
    if gains:
        record(Verdict("replay_gain", gains[0][0], gains[0][1]))

    # post_timing: a kernel that counts its launches and stops computing after some number of them fails here,
    # whatever number it picked: fresh inputs, fresh poison, one call, checked against float64.
    send("phase", "gate:post_timing")
    guard.refresh([0])
    guard.poison([0])
    kernel_call(0)
    clock.sync()
    case = sets[0]
    ref = case.reference()
    v = check_accuracy("post_timing", case.c(), ref, k, acc, out)
    if v.passed:
        v = check_ulps("post_timing", case.c(), ref, k, acc, out)
    probs = case.problems()
    checked = v.passed and not probs
    record(Verdict("post_timing", checked, "one call on fresh inputs after timing: " + "; ".join([v.detail, *probs])))

    send("phase", "gate:repeated_calls")
    if not checked:
        record(Verdict("repeated_calls", True, "not run: post_timing failed, so no checked output to repeat",
                       skipped=True))
    else:
        per_call_us = min(statistics.median(t["kernel_us"]) for t in timings.values())
        lo, hi = cfg.repeat_calls
        calls = max(lo, min(hi, int(cfg.repeat_budget_ms * 1e3 / max(per_call_us, 1e-3))))
        record(_repeated_calls(case, ref, calls, exact, k, acc, out, clock))
    return {"timings": timings}


def _repeated_calls(case: Case, ref, calls: int, exact: bool, k: int, acc: str, out: str, clock) -> Verdict:
    """Many calls on the inputs whose output post_timing checked, C poisoned before each. A race that goes wrong
    now and then (a missing barrier, a split-K counter left dirty, a TMA store not waited for) shows in a few of
    them; the gates before this look at one call each, the timed outputs at the last call on each set. Where the
    schedule sums in a fixed order every output must equal the checked one bit for bit (a race that only changes
    the rounding is still a race); otherwise it must pass the ulp count against the float64 product."""
    import torch

    c = case.c()
    first = c.clone()
    allowed = ulp_allowed(first.numel())
    counts = []
    for _ in range(calls):
        poison(c, out)
        case.launch()
        if exact:
            counts.append(bits_differing(c, first, out))
        else:
            over1, over2 = ulp_excess(c, ref, k, acc, out)
            counts.append(over2 + (over1 - allowed).clamp(min=0))
    clock.sync()
    bad = torch.stack(counts).cpu()
    probs = case.problems()
    how = "bit for bit equal to the checked output" if exact else "within the ulp count of the float64 product"
    failed = bad.nonzero().flatten().tolist()
    if failed:
        shown = ", ".join(f"call {i + 1}: {int(bad[i])} elements" for i in failed[:4])
        what = "differ from the checked output" if exact else "lie beyond the ulp count or still hold the poison"
        return Verdict("repeated_calls", False, f"{len(failed)} of {calls} calls on the same inputs left elements "
                       f"that {what} ({shown}{', ...' if len(failed) > 4 else ''}): a race"
                       + "".join(f"; {p}" for p in probs))
    return Verdict("repeated_calls", not probs, f"{calls} calls on the same inputs, C poisoned before each: every "
                   f"output {how}" + "".join(f"; {p}" for p in probs))


def _context_healthy(device: int) -> bool:
    """False once the CUDA context has a sticky error (illegal address, ...): the worker must then be replaced."""
    try:
        import torch

        torch.cuda.synchronize(device)
        torch.empty(1, device=f"cuda:{device}").add_(1)
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001
        return False


def _worker_main(conn, device: int):
    try:
        import torch

        torch.cuda.set_device(device)
        torch.empty(1, device=f"cuda:{device}")          # creates the primary context the launcher loads into
        env = environment(device)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which records it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", env))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        phase = ["load"]

        def send(kind, payload):
            if kind == "phase":
                phase[0] = payload
            conn.send((kind, payload))

        try:
            result = run_job(msg[1], send)
        except BaseException as e:  # noqa: BLE001
            fatal = not _context_healthy(device)
            result = {"errors": [f"{type(e).__name__}: {e}"], "fatal": fatal, "phase": phase[0]}
            if fatal:
                conn.send(("done", result))
                os._exit(3)
        # Give the job's buffers back to the device: several workers share one GPU (the bench runs one per
        # scenario), and a cache of 16k^2 operands, float64 references and ragged cases left in one worker was seen
        # to make the other run out of memory.
        gc.collect()
        torch.cuda.empty_cache()
        conn.send(("done", result))


# ---------------------------------------------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------------------------------------------


class Evaluator:
    """Owns one worker process per GPU and turns every outcome, crash and hang included, into Measurements."""

    def __init__(self, config: EvalConfig = EvalConfig()):
        self.config = config
        self._proc = None
        self._conn = None
        self.environment: dict = {}
        self.starts = 0          # worker starts (more than one = a candidate crashed or hung it)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._proc is not None:
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._proc = self._conn = None

    def _kill(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
        self._proc = self._conn = None

    def _ensure_worker(self) -> str | None:
        """Start the worker if none is alive; returns an error message if it cannot start."""
        if self._proc is not None and self._proc.is_alive():
            return None
        self._proc = self._conn = None
        ctx = mp.get_context("spawn")    # fork would copy the parent's CUDA state, which CUDA does not support
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, self.config.device), daemon=True,
                           name=f"l2ir-eval-gpu{self.config.device}")
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(self.config.startup_timeout_s):
            self._kill()
            return f"evaluator worker did not start within {self.config.startup_timeout_s:.0f} s"
        try:
            kind, payload = parent.recv()
        except (EOFError, OSError):
            code = proc.exitcode
            self._kill()
            return f"evaluator worker died while starting (exit code {code})"
        if kind != "ready":
            self._kill()
            return f"evaluator worker could not start: {payload}"
        self.environment = payload
        self.starts += 1
        return None

    def evaluate(self, kernel: Kernel, problem: Problem, plan: LaunchPlan, artifact: CompileResult,
                 time_kernel: bool = True, skip_gates: tuple[str, ...] = ()) -> list[Measurement]:
        """Gates, then (if all pass and time_kernel) timing per scenario. Never raises for a bad candidate.
        `skip_gates` names gates (stale_output, ragged_shapes) the caller has already passed for this kernel and
        problem class; they are not run and not reported (the search loop reuses its recorded verdicts)."""
        scenarios = self.config.scenarios if (self.config.scenarios and time_kernel) else ("gates",)
        base = dict(kernel_hash=kernel.content_hash(), problem=print_problem(problem),
                    artifact_key=artifact.key, compile_seconds=artifact.compile_seconds)
        if not artifact.ok:
            err = f"compile {artifact.reason}: {artifact.summary()} (reproduce: {artifact.repro})"
            return [Measurement(scenario=s, errors=[err], **base) for s in scenarios]
        start_error = self._ensure_worker()
        if start_error is not None:
            return [Measurement(scenario=s, errors=[start_error], **base) for s in scenarios]

        verdicts: list[Verdict] = []
        errors: list[str] = []
        payload: dict = {}
        phase = "send"
        job = {"kernel": kernel, "problem": problem, "plan": plan, "binary": str(artifact.binary),
               "config": self.config, "time": time_kernel, "skip_gates": tuple(skip_gates)}
        try:
            self._conn.send(("eval", job))
        except (OSError, ValueError) as e:
            self._kill()
            errors.append(f"could not send the job to the worker: {e}")
        while not errors:
            if not self._conn.poll(self.config.phase_timeout_s):
                self._kill()
                errors.append(f"hang: no progress for {self.config.phase_timeout_s:.0f} s during {phase}; "
                              "worker killed")
                self._fail_phase(verdicts, phase, "the kernel hung (timeout); worker killed")
                break
            try:
                kind, body = self._conn.recv()
            except (EOFError, OSError):
                code = self._proc.exitcode if self._proc is not None else None
                self._kill()
                errors.append(f"worker died during {phase} (exit code {code})")
                self._fail_phase(verdicts, phase, f"the worker died (exit code {code})")
                break
            if kind == "phase":
                phase = body
            elif kind == "verdict":
                verdicts.append(Verdict.from_json(body))
            elif kind == "done":
                payload = body
                errors += body.get("errors", [])
                if body.get("errors"):
                    self._fail_phase(verdicts, body.get("phase", phase), body["errors"][0])
                if body.get("fatal"):
                    self._proc.join(10)
                    self._kill()
                break
        return self._measurements(base, scenarios, verdicts, errors, payload)

    @staticmethod
    def _fail_phase(verdicts: list[Verdict], phase: str, reason: str):
        """A crash or hang inside a gate fails that gate (so the record says which check the kernel broke)."""
        if phase.startswith("gate:"):
            name = phase[len("gate:"):].split()[0]
            if not any(v.name == name for v in verdicts):
                verdicts.append(Verdict(name, False, f"{reason} (during {phase})"))

    def _measurements(self, base, scenarios, verdicts, errors, payload) -> list[Measurement]:
        out = []
        timings = payload.get("timings", {})
        for s in scenarios:
            t = timings.get(s, {})
            ks, bs = t.get("kernel_us", []), t.get("baseline_us", [])
            kstat, bstat = summarize(ks), summarize(bs)
            speed = (bstat["median"] / kstat["median"]) if ks and bs and kstat["median"] else None
            out.append(Measurement(scenario=s, environment=dict(self.environment), verdicts=list(verdicts),
                                   errors=list(errors), kernel_us=ks, baseline_us=bs, kernel_stats=kstat,
                                   baseline_stats=bstat, kernel_median_us=kstat["median"],
                                   baseline_median_us=bstat["median"], speedup=speed, reps=t.get("reps"),
                                   sets=t.get("sets"), warmup=t.get("warmup"), seed=payload.get("seed"), **base))
        return out


def write_measurements(path: str | Path, measurements: list[Measurement]):
    """Append measurements as JSON lines (the bench/results format)."""
    with open(path, "a") as fh:
        for m in measurements:
            fh.write(m.dumps() + "\n")

