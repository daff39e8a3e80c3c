"""The evaluator's arithmetic on CPU: error bounds, the precision probe's separation, poison and guard checks,
ragged shapes, timing statistics, the Measurement record."""

import json
import math

import numpy as np
import pytest

from l2ir.indexing import Const, Var, cdiv
from l2ir.nodes import Epilogue, Kernel, Mma, Pad, Pipeline, Problem, Source, Target, Tile
from l2ir.search.gates import (GuardedBuffer, Verdict, admits, check_accuracy, f16_accumulated_dot, poison,
                          probe_f16_error, probe_inputs, probe_k, probe_pattern, ragged_shapes, tolerance, unwritten)
from l2ir.search.timing import TimingConfig, reps_for, sets_for, summarize

torch = pytest.importorskip("torch")


def f16_matmul_accumulated(a: np.ndarray, b: np.ndarray, group: int) -> np.ndarray:
    """C = A @ B with an fp16 accumulator updated once per group of `group` exact products."""
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float16)
    for s in range(0, a.shape[1], group):
        acc = (acc.astype(np.float64) + a[:, s:s + group] @ b[s:s + group, :]).astype(np.float16)
    return acc


def rel(c, ref):
    return float(np.linalg.norm(c.astype(np.float64) - ref) / np.linalg.norm(ref))


# At small K an fp16 accumulator's error hides under the output rounding; catching it there is the probe's job.
@pytest.mark.parametrize("k", [256, 1024, 4096])
def test_accuracy_bound_passes_fp32_and_fails_fp16_accumulation(k):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((24, k)).astype(np.float16).astype(np.float64)
    b = rng.standard_normal((k, 24)).astype(np.float16).astype(np.float64)
    ref = a @ b
    fp32 = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    assert rel(fp32, ref) <= tolerance(k, "f32", "f16")
    for group in (1, 16):
        assert rel(f16_matmul_accumulated(a, b, group), ref) > tolerance(k, "f32", "f16")
    # A kernel that declares acc=f16 is held to the looser fp16 bound, and meets it.
    assert rel(f16_matmul_accumulated(a, b, 16), ref) <= tolerance(k, "f16", "f16")


@pytest.mark.parametrize("k", [64, 100, 256, 257, 1000, 4096, 16384])
def test_precision_probe_separates_fp16_from_fp32_accumulation(k):
    a, b = probe_pattern(k)
    for v in (a, b):
        assert np.array_equal(v.astype(np.float16).astype(np.float64), v), "probe values must be exact in fp16"
    exact = float(np.dot(a, b))
    tol = tolerance(k, "f32", "f16")
    # fp32 accumulation, sequential or in any grouping, is exact; only the fp16 output rounding remains.
    acc32 = np.float32(0)
    for p in a * b:
        acc32 = np.float32(acc32 + np.float32(p))
    assert float(acc32) == exact
    assert abs(float(np.float16(acc32)) - exact) / exact <= tol
    # fp16 accumulation loses at least half of the sum for every plausible rounding group.
    assert probe_f16_error(k) >= 0.5
    assert probe_f16_error(k) > 100 * tol
    for group in (1, 16, 32):
        assert abs(f16_accumulated_dot(a, b, group) - exact) / exact > 100 * tol


def test_probe_matrix_gate_verdicts_on_cpu():
    m, n, k = 16, 24, 512
    av, bv, r, s, dot = probe_inputs(m, n, k, np.random.default_rng(0))
    A, B = np.outer(r, av), np.outer(bv, s)
    exact = torch.tensor(np.outer(r, s) * dot)
    good = torch.tensor((A.astype(np.float32) @ B.astype(np.float32)).astype(np.float16))
    bad = torch.tensor(f16_matmul_accumulated(A, B, 16))
    assert check_accuracy("precision_probe", good, exact, k, "f32", "f16").passed
    v = check_accuracy("precision_probe", bad, exact, k, "f32", "f16")
    assert not v.passed and "worst at C[" in v.detail


def test_probe_scales_change_with_the_seed():
    x = probe_inputs(8, 8, 256, np.random.default_rng(1))
    y = probe_inputs(8, 8, 256, np.random.default_rng(2))
    assert not (np.array_equal(x[2], y[2]) and np.array_equal(x[3], y[3]))


def source_kernel():
    return Kernel(target=Target(arch="sm80"), source=Source(
        entry="f", grid=(cdiv(Var("n"), 32), cdiv(Var("m"), 32), Const(1)), block=(256, 1, 1), smem=0,
        code='extern "C" __global__ void f(const void* A, const void* B, void* C, int M, int N, int K, void* w) {}'))


def schedule_kernel(pad):
    return Kernel(target=Target(arch="sm80"), tile=Tile(block=(128, 128, 32), warps=(2, 2)),
                  mma=Mma(op="mma_sync", shape=(16, 8, 16)), pipeline=Pipeline(mode="multistage", stages=3),
                  pad=pad, epilogue=Epilogue())


def test_probe_k_grows_small_k_by_multiples():
    p = Problem(m=64, n=64, k=16)
    kp = probe_k(source_kernel(), p)
    assert kp is not None and kp % 16 == 0 and kp >= 64
    assert probe_k(source_kernel(), Problem(m=64, n=64, k=4096)) == 4096


def test_ragged_shapes_are_divisible_by_no_tile():
    p = Problem(m=4096, n=4096, k=4096)
    shapes = ragged_shapes(p)
    assert p.shape not in shapes and len(shapes) == len(set(shapes))
    for shape in shapes:
        assert any(d % 16 for d in shape), shape
    assert any(all(d % 2 for d in s) for s in shapes)           # fully prime shapes
    assert any(all(d % 8 == 0 and d % 16 for d in s) for s in shapes)   # 16-byte aligned, still ragged


def test_admits_follows_pad():
    ragged = Problem(m=4099, n=4096, k=4096)
    assert admits(source_kernel(), ragged)[0]
    ok, why = admits(schedule_kernel(Pad(m="divisible")), ragged)
    assert not ok and why
    assert admits(schedule_kernel(Pad(m="divisible")), Problem(m=4096, n=4096, k=4096))[0]


def test_guard_bands_detect_writes_before_and_after():
    buf = GuardedBuffer("C", 1000, "cpu", guard_bytes=512)
    assert buf.check_guards() is None
    buf.interior.fill_(7)                        # writing the whole interior is fine
    assert buf.check_guards() is None
    buf.raw[512 + 1000 + 3] = buf.raw[512 + 1000 + 3] + 1
    msg = buf.check_guards()
    assert msg and "past its end" in msg and "+3" in msg
    buf.fill_guards()
    buf.raw[510] = buf.raw[510] + 1
    assert "before its start" in buf.check_guards()


def test_guard_bands_on_empty_workspace():
    buf = GuardedBuffer("workspace", 0, "cpu", guard_bytes=256)
    assert buf.check_guards() is None
    buf.raw[0] = buf.raw[0] + 1
    assert buf.check_guards()


@pytest.mark.parametrize("out,dtype", [("f16", "float16"), ("bf16", "bfloat16"), ("f32", "float32")])
def test_poison_then_unwritten(out, dtype):
    c = torch.empty((64, 96), dtype=getattr(torch, dtype))
    poison(c, out)
    assert torch.isnan(c).all()
    assert unwritten(c, out)[0] == 64 * 96
    c[:, :64] = 1.0
    count, where = unwritten(c, out, tile=(32, 32))
    assert count == 64 * 32 and "C[0,64]" in where and "2x1" in where
    c.fill_(0.5)
    assert unwritten(c, out) == (0, "")


def test_accuracy_flags_nan_output():
    ref = torch.ones((4, 4), dtype=torch.float64)
    c = torch.ones((4, 4), dtype=torch.float16)
    c[1, 2] = float("nan")
    v = check_accuracy("accuracy", c, ref, 64, "f32", "f16")
    assert not v.passed and "1 non-finite" in v.detail


def test_timing_helpers():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0 and math.isclose(s["rel_spread"], 3.6)
    assert summarize([])["median"] is None
    cfg = TimingConfig()
    l2 = 50 << 20
    assert sets_for(64 * 64 * 6, l2, cfg) == cfg.max_sets           # tiny sets: capped
    assert sets_for(3 * 4096 * 4096 * 2, l2, cfg) == 2              # 96 MiB sets already exceed L2
    assert sets_for(10 << 20, l2, cfg) == 10                        # 100 MiB of rotation
    reps = reps_for(5.0, 10, cfg)
    assert reps % 10 == 0 and reps * 5.0 >= cfg.target_ms * 1000


def test_measurement_json_round_trip():
    from l2ir.search.evaluator import Measurement

    m = Measurement(kernel_hash="ab" * 32, problem="gemm m=1 n=1 k=1 a=f16:row b=f16:col c=f16:row acc=f32",
                    scenario="offline", environment={"gpu": "X"},
                    verdicts=[Verdict("accuracy", True, "ok"), Verdict("ragged_shapes", True, "none", skipped=True)],
                    kernel_us=[1.0, 2.0], baseline_us=[2.0, 4.0], kernel_median_us=1.5, baseline_median_us=3.0,
                    speedup=2.0, seed=7)
    back = Measurement.from_json(json.loads(m.dumps()))
    assert back == m and back.passed
    failed = Measurement(kernel_hash="x", problem="p", scenario="gates", verdicts=[Verdict("accuracy", False)])
    assert not failed.passed and failed.verdict("accuracy").name == "accuracy"


# ---------------------------------------------------------------------------------------------------------------
# The whole gate flow of the worker, on CPU: a numpy "kernel" reads and writes the raw buffers through their
# pointers exactly as a GPU kernel would, with the same planted defects as tests/planted/tiled_gemm.cu.
# ---------------------------------------------------------------------------------------------------------------

import ctypes  # noqa: E402


class NumpyKernel:
    """C = A @ B for a=f16:row, b=f16:col, c=f16:row, read and written through raw host pointers."""

    def __init__(self, defect=None, tile=32):
        self.defect, self.tile, self.calls = defect, tile, 0

    def workspace_bytes(self, m, n, k):
        return 0

    @staticmethod
    def _array(ptr, count):
        return np.frombuffer((ctypes.c_uint16 * count).from_address(ptr), dtype=np.float16)

    def __call__(self, a, b, c, m, n, k, ws, ws_bytes, stream=None):
        self.calls += 1
        t = self.tile
        if self.defect == "stale" and self.calls > 1:
            return
        if self.defect == "divisible":
            # No bounds checks: whole tiles in M and N (reading and writing past the ends, into the guards),
            # the K residue dropped, and C written with the padded row pitch.
            mp, np_, kd = -(-m // t) * t, -(-n // t) * t, k // t * t
            A = self._array(a, mp * k).reshape(mp, k)[:, :kd].astype(np.float32)
            B = self._array(b, np_ * k).reshape(np_, k)[:, :kd].astype(np.float32)
            self._array(c, mp * np_)[:] = (A @ B.T).astype(np.float16).reshape(-1)
            return
        A = self._array(a, m * k).reshape(m, k).astype(np.float64)
        B = self._array(b, n * k).reshape(n, k).astype(np.float64)
        if self.defect == "fp16_acc":
            acc = np.zeros((m, n), dtype=np.float16)
            for s in range(0, k, 16):      # one fp16 rounding per k16 MMA, as mma.sync with f16 C/D does
                acc = (acc.astype(np.float64) + A[:, s:s + 16] @ B[:, s:s + 16].T).astype(np.float16)
            out = acc
        else:
            out = (A.astype(np.float32) @ B.T.astype(np.float32)).astype(np.float16)
        C = self._array(c, m * n).reshape(m, n)
        if self.defect == "unwritten":
            out = out.copy()
            out[:t, :t] = C[:t, :t]            # the first tile keeps whatever C held
        C[:] = out
        if self.defect == "oob":
            self._array(c, m * n + 20)[m * n + 16:] = 1.0

    def close(self):
        pass


class _Plan:
    zero_workspace = False


@pytest.mark.parametrize("defect,gate", [(None, None), ("fp16_acc", "precision_probe"), ("oob", "guard_bands"),
                                         ("unwritten", "all_written"), ("divisible", "ragged_shapes"),
                                         ("stale", "stale_output")])
def test_gate_flow_on_cpu(defect, gate):
    from l2ir.search.evaluator import EvalConfig, run_job

    sent = []
    job = {"kernel": source_kernel(), "problem": Problem(m=64, n=96, k=256), "plan": _Plan(),
           "config": EvalConfig(scenarios=()), "binary": ""}
    run_job(job, lambda kind, body: sent.append((kind, body)), launcher=NumpyKernel(defect), device="cpu")
    assert [b for k, b in sent if k == "phase"][:2] == ["load", "gate:accuracy"]
    v = {b["name"]: Verdict.from_json(b) for k, b in sent if k == "verdict"}
    assert set(v) == {"accuracy", "all_written", "stale_output", "precision_probe", "guard_bands", "ragged_shapes"}
    if gate is None:
        assert all(x.passed and not x.skipped for x in v.values()), v
        return
    assert not v[gate].passed, v[gate]
    if defect in ("oob", "divisible", "stale"):
        assert v["accuracy"].passed and v["all_written"].passed
    if defect == "divisible":
        assert v["guard_bands"].passed and v["precision_probe"].passed and v["stale_output"].passed
