"""`l2ir.matmul` on the CPU: dispatch rules, every fallback reason, the custom op's fake implementation, the
environment variable, the import chain.

The dispatcher runs here with CPU tensors standing in for the device (`device_type = "cpu"`) and a runner that
computes C from the data pointers it is handed (numpy over the raw memory), so the pointers, sizes and layouts
the dispatcher passes are checked, not only its decisions.
"""

import ctypes
import json
import os
import subprocess
import sys
import threading
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_export import CLS_COL, CLS_ROW, ENV, K3, SOURCE, fake_build, make_db, record, standard_db

import l2ir
from l2ir import dispatch, export

pytestmark = pytest.mark.filterwarnings("default")


def _array(ptr, count):
    return np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(ptr)).view(np.float16)


class HostRunner:
    """C = A @ B from raw pointers, in fp32, for the problem class it was loaded for (the Runner protocol:
    `bind(m, n, k)` -> (go, workspace bytes), `go(a, b, c, ws, stream)`)."""

    def __init__(self, spec, index):
        self.b_col = ":col" in spec.problem_class.split()[1]
        self.calls = 0
        self.binds = []

    def bind(self, m, n, k):
        self.binds.append((m, n, k))
        return (lambda a, b, c, ws, stream: self(a, b, c, m, n, k)), 0

    def __call__(self, a, b, c, m, n, k):
        self.calls += 1
        A = _array(a, m * k).reshape(m, k).astype(np.float32)
        B = _array(b, k * n).reshape(n, k).T if self.b_col else _array(b, k * n).reshape(k, n)
        _array(c, m * n)[:] = (A @ B.astype(np.float32)).astype(np.float16).ravel()


class CpuDispatcher(dispatch.Dispatcher):
    device_type = "cpu"
    capture = False              # stands in for torch.cuda.is_current_stream_capturing()

    def capturing(self):
        return self.capture

    def __init__(self, package, env=None, runner=HostRunner):
        super().__init__(package)
        self.env = dict(ENV) if env is None else env
        self.runner_cls = runner

    def device_env(self, index):
        return self.env

    def current_stream(self, index):
        return 0

    def make_runner(self, spec, index):
        return self.runner_cls(spec, index)


@pytest.fixture(scope="module")
def pkg_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dispatch")
    with standard_db(tmp / "r.db") as db:
        export.export(db, tmp / "pkg", cache_dir=str(tmp / "cache"), build=fake_build, fastpath=False, log=lambda s: None)
    return tmp / "pkg"


@pytest.fixture
def disp(pkg_dir):
    d = CpuDispatcher(dispatch.read_package(pkg_dir))
    dispatch._reset(d)
    yield d
    dispatch._reset()


def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


def check(c, a, b):
    ref = (a.double() @ b.double())
    assert c.shape == ref.shape and c.dtype == a.dtype
    torch.testing.assert_close(c.double(), ref, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch rules.
# ---------------------------------------------------------------------------------------------------------------


def test_tuned_shape_is_served_by_its_kernel(disp):
    a, w = rand(64, 256), rand(512, 256)
    c = l2ir.matmul(a, w.t())                       # b = W.t(): problem class b=f16:col
    check(c, a, w.t())
    assert disp.stats == {"l2ir": 1}
    b = rand(128, 128)
    a2 = rand(128, 128)
    check(l2ir.matmul(a2, b), a2, b)               # b row-major: the b=f16:row table (Source kernel K3)
    assert disp.stats == {"l2ir": 2}


def test_table_decides_tuned_shapes(disp):
    assert disp.package.resolve(1024, 64, 64, CLS_COL) == (None, "cublas")
    assert disp.package.resolve(512, 512, 512, CLS_COL)[1] == "l2ir"


def test_nearest_neighbour_rule(disp):
    pkg = disp.package
    k1 = pkg.tuned[(256, 256, 256, CLS_COL)]
    # Near 256^3 (log2 distance 0.05): its kernel admits the shape (multiples of 8: align=8), in as many tiles.
    assert pkg.resolve(248, 256, 256, CLS_COL) == (k1, "l2ir")
    assert pkg.predicted_speedup(k1, (256, 256, 256), (248, 256, 256), CLS_COL) == pytest.approx(1.2 * 248 / 256)
    # 264 rows need a third 128-row tile: 1.20 x 1.03 (FLOPs) / 1.5 (tiles) = 0.83 < BORROW_MIN_PREDICTED.
    assert pkg.predicted_speedup(k1, (256, 256, 256), (264, 256, 256), CLS_COL) == pytest.approx(1.2 * 264 / 256 / 1.5)
    assert pkg.resolve(264, 256, 256, CLS_COL) == (None, "unpromising")
    assert pkg.route(264, 256, 256, CLS_COL) == (None, "unpromising")       # 12.5 us predicted against 10.3 + 1
    # 248x256x264 needs a ninth 32-wide K tile for 0.999x the work: 1.2 x 0.999 / 1.125 = 1.07 predicted, below the
    # bound; but its predicted device time (8.33 us x 1.125 = 9.4 us) is within the eager slack of cuBLAS's
    # (10 us x 0.999 + 1 us): eager calls run the kernel, CUDA graphs cuBLAS.
    assert pkg.predicted_speedup(k1, (256, 256, 256), (248, 256, 264), CLS_COL) == pytest.approx(
        1.2 * (248 * 264 / 256**2) / 1.125)
    assert pkg.resolve(248, 256, 264, CLS_COL) == (None, "unpromising")
    assert pkg.route(248, 256, 264, CLS_COL) == (k1, "eager") and pkg.resolve_eager(248, 256, 264, CLS_COL) == k1
    # Nearest tuned shape is 1024x64x64, won by cuBLAS: the measurement there decides.
    assert pkg.resolve(1000, 64, 64, CLS_COL) == (None, "cublas")
    # Near, but K=255 breaks the kernel's align=8 rule (B is column-major: its rows run along K).
    assert pkg.resolve(256, 256, 255, CLS_COL) == (None, "not_admitted")
    assert not dispatch.rows_aligned(256, 256, 255, CLS_COL) and not dispatch.rows_aligned(256, 1001, 256, CLS_COL)
    assert dispatch.rows_aligned(248, 256, 256, CLS_COL)
    # A column-major B has its rows along K; a row-major B along N.
    assert dispatch.rows_aligned(256, 256, 1000, CLS_ROW) and not dispatch.rows_aligned(256, 1001, 256, CLS_ROW)
    # Too far from any tuned shape.
    assert pkg.resolve(16, 16, 16, CLS_COL) == (None, "untuned")
    # Beyond the package's max distance by a hair: untuned; the manifest holds the bound.
    assert pkg.max_distance == export.DEFAULT_MAX_DISTANCE
    assert pkg.resolve(512, 256, 256, CLS_COL) == (k1, "l2ir")         # distance exactly 1
    assert pkg.resolve(536, 256, 256, CLS_COL) == (None, "untuned")
    # A problem class without kernels in the package.
    assert pkg.resolve(1024, 1024, 1024, "a=bf16:row b=bf16:col c=bf16:row acc=f32") == (None, "layout")


def test_neighbours_carry_alignment(tmp_path):
    """A kernel tuned on an unaligned shape (an odd K: cuBLAS's slow path) serves unaligned neighbours, whichever
    dimension is odd there, but not an aligned one, where cuBLAS runs its fast kernels (the reason says why)."""
    with make_db(tmp_path / "r.db", [record(K3, (333, 555, 777), 2.0)], {K3: SOURCE}) as db:
        export.export(db, tmp_path / "pkg", cache_dir=str(tmp_path / "cache"), build=fake_build, fastpath=False, log=lambda s: None)
    pkg = dispatch.read_package(tmp_path / "pkg")
    key = pkg.tuned[(333, 555, 777, CLS_COL)]
    assert pkg.resolve(333, 624, 777, CLS_COL) == (key, "l2ir")          # K still odd
    assert pkg.resolve(333, 555, 776, CLS_COL) == (key, "l2ir")          # N still odd (C's rows)
    assert pkg.resolve(336, 560, 776, CLS_COL) == (None, "alignment")    # every row aligned
    # cuBLAS winning on an aligned shape says nothing about its slow path: an unaligned shape between the two walks
    # past that verdict to the kernel that admits it.
    with make_db(tmp_path / "r2.db", [record(K3, (333, 555, 777), 2.0), record(K3, (336, 560, 776), 0.9)],
                 {K3: SOURCE}) as db:
        export.export(db, tmp_path / "pkg2", cache_dir=str(tmp_path / "cache"), build=fake_build, fastpath=False, log=lambda s: None)
    pkg2 = dispatch.read_package(tmp_path / "pkg2")
    assert pkg2.tuned[(336, 560, 776, CLS_COL)] is None                   # cuBLAS there
    assert pkg2.resolve(335, 559, 777, CLS_COL) == (pkg2.tuned[(333, 555, 777, CLS_COL)], "l2ir")
    assert pkg2.resolve(336, 560, 784, CLS_COL) == (None, "cublas")      # aligned: the aligned verdict decides
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert "16-byte aligned" in manifest["rule"]["untuned"]


def test_untuned_shape_through_matmul_is_resolved_once(disp):
    a, w = rand(248, 256), rand(256, 256)
    for _ in range(3):
        check(l2ir.matmul(a, w.t()), a, w.t())
    assert disp.stats == {"l2ir": 3}
    assert list(disp._routes) == [(248, 256, 256, torch.float16, "row", "col")]


def test_batched_a_is_flattened(disp):
    a, w = rand(4, 16, 256), rand(512, 256)
    c = l2ir.matmul(a, w.t())
    check(c, a, w.t())
    assert c.shape == (4, 16, 512) and disp.stats == {"l2ir": 1}


def test_out_argument(disp):
    a, w = rand(64, 256), rand(512, 256)
    out = torch.empty(64, 512, dtype=torch.float16)
    assert l2ir.matmul(a, w.t(), out=out) is out
    check(out, a, w.t())
    assert disp.stats == {"l2ir": 1}


# ---------------------------------------------------------------------------------------------------------------
# Every fallback reason, counted, with torch.matmul's answer.
# ---------------------------------------------------------------------------------------------------------------


def _misaligned(m, k):
    buf = rand(m * k + 1)
    return buf[1:].view(m, k)                       # 2 bytes past a 16-byte boundary


CASES = {
    "dtype": lambda: (rand(64, 256, dtype=torch.float32), rand(512, 256, dtype=torch.float32).t()),
    "layout": lambda: (rand(256, 64).t(), rand(512, 256).t()),              # A column-major: no a=col kernels
    "noncontiguous": lambda: (rand(64, 512)[:, ::2], rand(512, 256).t()),
    "misaligned": lambda: (_misaligned(64, 256), rand(512, 256).t()),
    "batch": lambda: (rand(2, 64, 256), rand(2, 256, 512)),
    "empty": lambda: (rand(0, 256), rand(512, 256).t()),
    "cublas": lambda: (rand(64, 64), rand(64, 64).t()),      # no gate-clean kernel measured there: no eager route
    "untuned": lambda: (rand(16, 16), rand(16, 16).t()),
    "not_admitted": lambda: (rand(256, 255), rand(256, 255).t()),
    # One row past 256: K1 (128x128 tiles, 1.20x at 256^3) would run 3 tile rows for 1.03x the work: 0.82x predicted.
    "unpromising": lambda: (rand(264, 256), rand(256, 256).t()),
    # Aligned, near 256^3, which is made to look unaligned below (tests/test_dispatch.py's package tunes aligned
    # shapes only; test_neighbours_carry_alignment uses the real rule).
    "alignment": lambda: (rand(248, 256), rand(256, 256).t()),
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_fallback_reason_is_counted(disp, reason, monkeypatch):
    if reason == "alignment":
        monkeypatch.setattr(dispatch, "rows_aligned", lambda m, n, k, cls: (m, n, k) != (256, 256, 256))
    a, b = CASES[reason]()
    c = l2ir.matmul(a, b)
    torch.testing.assert_close(c, torch.matmul(a, b))
    assert disp.stats == {reason: 1}


def test_cublas_shape_with_an_eager_kernel_runs_it_eagerly_and_cublas_under_capture(disp):
    # 1024x64x64: cuBLAS in the table (K3's 1.01x is within its spread), K3 within the eager slack of cuBLAS.
    assert disp.package.resolve(1024, 64, 64, CLS_COL) == (None, "cublas")
    k3 = disp.package.resolve_eager(1024, 64, 64, CLS_COL)
    assert k3 is not None
    assert disp.package.kernels[k3].hash == "c3" * 32
    a, b = rand(1024, 64), rand(64, 64).t()
    check(l2ir.matmul(a, b), a, b)
    assert disp.stats == {"l2ir": 1}
    disp.capture = True                            # the same route, inside a CUDA-graph capture: cuBLAS
    torch.testing.assert_close(l2ir.matmul(a, b), torch.matmul(a, b))
    assert disp.stats == {"l2ir": 1, "cublas": 1}
    disp.capture = False
    # An untuned shape whose nearest tuned shape is that cuBLAS shape takes its eager kernel too (K3 admits it).
    assert disp.package.resolve_eager(1000, 64, 64, CLS_COL) == k3
    a2 = rand(1000, 64)
    check(l2ir.matmul(a2, b), a2, b)
    assert disp.stats == {"l2ir": 2, "cublas": 1}


def test_eager_route_first_seen_inside_a_capture_loads_nothing_and_keeps_nothing(disp):
    made = []
    disp.runner_cls = lambda spec, index: made.append(spec.key) or HostRunner(spec, index)
    disp.capture = True
    a, b = rand(1024, 64), rand(64, 64).t()
    torch.testing.assert_close(l2ir.matmul(a, b), torch.matmul(a, b))
    assert disp.stats == {"cublas": 1} and made == []          # no module load inside the capture
    disp.capture = False
    check(l2ir.matmul(a, b), a, b)                 # the next eager call decides the route: the eager kernel
    assert disp.stats == {"cublas": 1, "l2ir": 1} and len(made) == 1


def test_cpu_tensors_fall_back(pkg_dir):
    d = dispatch.Dispatcher(dispatch.read_package(pkg_dir))      # device_type "cuda": CPU tensors are not served
    dispatch._reset(d)
    try:
        a, w = rand(64, 256), rand(512, 256)
        torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
        assert dispatch.dispatch_stats() == {"cpu": 1}
    finally:
        dispatch._reset()


def test_no_package(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch._reset()
    a, b = rand(8, 8), rand(8, 8)
    torch.testing.assert_close(l2ir.matmul(a, b), a @ b)
    assert dispatch.dispatch_stats() == {"no_package": 1}
    dispatch._reset()


def test_out_of_wrong_shape(disp):
    a, w = rand(64, 256), rand(512, 256)
    out = torch.empty(64, 512, dtype=torch.float32)
    with pytest.raises(RuntimeError):
        l2ir.matmul(a, w.t(), out=out)              # torch.matmul's own error: nothing silently cast
    assert disp.stats == {"out": 1}


def test_out_that_aliases_an_operand_goes_to_torch(disp, monkeypatch):
    w, x = rand(512, 256), rand(64, 256)
    # out's first row is A's last: a kernel writing C while reading A would race; torch decides what it does.
    both = torch.zeros(63 * 256 + 64 * 512, dtype=torch.float16)
    a, out = both[:64 * 256].view(64, 256), both[63 * 256:63 * 256 + 64 * 512].view(64, 512)
    a.copy_(x)
    calls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *args, **kw: calls.append(kw.get("out")) or real(*args, **kw))
    l2ir.matmul(a, w.t(), out=out)
    assert len(calls) == 1 and calls[0] is out and disp.stats == {"out": 1}
    out2 = torch.empty(64, 512, dtype=torch.float16)
    l2ir.matmul(x, w.t(), out=out2)
    check(out2, x, w.t())
    assert len(calls) == 1 and disp.stats == {"out": 1, "l2ir": 1}


def test_autograd_inputs_go_to_torch(disp):
    a, w = rand(64, 256).requires_grad_(), rand(512, 256)
    c = l2ir.matmul(a, w.t())
    c.float().sum().backward()
    assert a.grad is not None and disp.stats == {"autograd": 1}
    with torch.no_grad():
        l2ir.matmul(a, w.t())
    assert disp.stats == {"autograd": 1, "l2ir": 1}


def test_other_gpu_warns_once_and_falls_back(pkg_dir):
    d = CpuDispatcher(dispatch.read_package(pkg_dir), env=dict(ENV, gpu="NVIDIA A100-SXM4-80GB", sms=108))
    dispatch._reset(d)
    a, w = rand(64, 256), rand(512, 256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "A100" in msgs[0] and "sms 108" in msgs[0]
    assert d.stats == {"environment": 3}
    dispatch._reset()


def test_other_driver_warns_once(pkg_dir):
    d = CpuDispatcher(dispatch.read_package(pkg_dir), env=dict(ENV, driver="570.86.15"))
    dispatch._reset(d)
    with pytest.warns(RuntimeWarning, match="driver '570.86.15'"):
        l2ir.matmul(rand(64, 256), rand(512, 256).t())
    assert d.stats == {"environment": 1}
    dispatch._reset()


def test_kernel_that_fails_to_load(pkg_dir):
    def broken(spec, index):
        raise OSError("cuModuleLoadData: CUDA_ERROR_NO_BINARY_FOR_GPU")

    d = CpuDispatcher(dispatch.read_package(pkg_dir), runner=broken)
    dispatch._reset(d)
    a, w = rand(64, 256), rand(512, 256)
    with pytest.warns(RuntimeWarning, match="failed to load"):
        torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # the second call: counted, not warned again
        l2ir.matmul(a, w.t())
    assert d.stats == {"load_failed": 2}
    dispatch._reset()


def test_refused_launch_falls_back_and_is_remembered(pkg_dir):
    class Refuses(HostRunner):
        def __call__(self, *args):
            raise RuntimeError("cuLaunchKernel returned CUresult 1")

    d = CpuDispatcher(dispatch.read_package(pkg_dir), runner=Refuses)
    dispatch._reset(d)
    a, w = rand(64, 256), rand(512, 256)
    with pytest.warns(RuntimeWarning, match="launch failed"):
        torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
    l2ir.matmul(a, w.t())
    assert d.stats == {"launch_failed": 1, "load_failed": 1}
    dispatch._reset()


def test_autocast_and_forward_ad_on_a_served_route_go_to_torch(disp):
    """Under autocast torch.matmul's result takes autocast's dtype; inside a forward-AD level it carries a tangent:
    a served route answers neither, so both calls are torch's."""
    import torch.autograd.forward_ad as fwAD

    a, w = rand(64, 256), rand(512, 256)
    check(l2ir.matmul(a, w.t()), a, w.t())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = l2ir.matmul(a, w.t()), torch.matmul(a, w.t())
    assert got.dtype == want.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):       # autocast to the operands' own dtype: the kernel's answer
        check(l2ir.matmul(a, w.t()), a, w.t())
    with fwAD.dual_level():
        dual = fwAD.make_dual(a, torch.ones_like(a))
        tangent = fwAD.unpack_dual(l2ir.matmul(dual, w.t())).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, torch.ones_like(a) @ w.t())
    assert disp.stats == {"l2ir": 2, "autocast": 1, "autograd": 1}


def test_every_documented_reason_has_a_test_here():
    tested = set(CASES) | {"l2ir", "cpu", "no_package", "out", "autograd", "environment", "load_failed",
                           "launch_failed", "autocast"}
    assert tested == set(dispatch.REASONS)


# ---------------------------------------------------------------------------------------------------------------
# Threads, the debug log, nn.Linear, the custom op.
# ---------------------------------------------------------------------------------------------------------------


def checked_calls_from_threads(a, b, calls: int, threads: int = 8) -> list:
    """`calls` checked l2ir.matmul(a, b) calls in each of `threads` threads at once; the exceptions they raised."""
    errors = []

    def work():
        try:
            for _ in range(calls):
                check(l2ir.matmul(a, b), a, b)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return errors


def test_threads_share_one_runner_and_count_every_call(disp):
    a, w = rand(64, 256), rand(512, 256)
    errors = checked_calls_from_threads(a, w.t(), 10)
    assert not errors and disp.stats == {"l2ir": 80}
    (state,) = disp._devices.values()
    assert len(state["runners"]) == 1 and next(iter(state["runners"].values())).calls == 80


def test_debug_log_names_each_route_once(disp, caplog):
    with caplog.at_level("DEBUG", logger="l2ir.dispatch"):
        for _ in range(2):
            l2ir.matmul(rand(64, 256), rand(512, 256).t())
            l2ir.matmul(rand(16, 16).t(), rand(16, 16))
    assert caplog.text.count("64x512x256 -> L2IR kernel") == 1
    assert caplog.text.count("16x16x16 -> torch.matmul (layout)") == 1
    assert disp.stats == {"l2ir": 2, "layout": 2}


def test_patch_linear_routes_nn_linear(disp):
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256,
                                                                                              bias=False)).half()
    x = rand(64, 256)
    with torch.no_grad():
        want = model.float()(x.float())
        model.half()
        with l2ir.patch_linear():
            got = model(x)
        assert torch.nn.functional.linear is not None and disp.stats["l2ir"] == 1   # 64x512x256 is tuned
        assert sum(disp.stats.values()) == 2
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    # Outside the block F.linear is torch's again.
    before = dict(disp.stats)
    with torch.no_grad():
        model(x)
    assert disp.stats == before


def test_patch_linear_leaves_torch_routes_to_torchs_linear_and_adds_a_served_bias_in_place(disp):
    x, w, bias = rand(64, 256), rand(512, 256), rand(512)
    served_want = x.double() @ w.double().t() + bias.double()
    x2, w2, bias2 = rand(16, 16), rand(24, 16), rand(24)          # untuned: torch's route
    torch_linear, calls = torch.nn.functional.linear, []

    def counted(*args):
        calls.append(args[0].shape)
        return torch_linear(*args)

    torch.nn.functional.linear = counted                           # what patch_linear will call torch's
    try:
        with torch.no_grad(), l2ir.patch_linear():
            y = torch.nn.functional.linear(x, w, bias)             # 64x512x256 is tuned: an L2IR kernel
            y2 = torch.nn.functional.linear(x2, w2, bias2)
    finally:
        torch.nn.functional.linear = torch_linear
    torch.testing.assert_close(y.double(), served_want, rtol=2e-2, atol=5e-2)
    assert calls == [(16, 16)]                                     # torch's own F.linear (bias fused), once
    assert torch.equal(y2, torch_linear(x2, w2, bias2))
    assert disp.stats == {"l2ir": 1, "untuned": 1}
    # A bias of another dtype than the input is torch's to handle (its error or its answer), not an in-place add.
    with torch.no_grad(), l2ir.patch_linear():
        with pytest.raises(RuntimeError):
            torch.nn.functional.linear(x, w, bias.float())
    assert disp.stats["dtype"] == 1
    # With autograd on, torch's F.linear runs (counted) and gradients flow.
    xg = x.clone().float().requires_grad_()
    with l2ir.patch_linear():
        torch.nn.functional.linear(xg, w.float(), bias.float()).sum().backward()
    assert xg.grad is not None and disp.stats["autograd"] == 1


def test_fake_impl_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(4, 64, 1024, dtype=torch.float16)
        b = torch.empty(1024, 4096, dtype=torch.float16)
        c = torch.ops.l2ir.matmul(a, b)
        assert c.shape == (4, 64, 4096) and c.dtype == torch.float16
        c2 = l2ir.matmul(a[0], b.t().contiguous().t())
        assert c2.shape == (64, 4096)
        out = torch.empty(64, 4096, dtype=torch.bfloat16)
        torch.ops.l2ir.matmul_out(a[0].bfloat16(), b.bfloat16(), out)
    torch.library.opcheck(torch.ops.l2ir.matmul.default, (rand(64, 128), rand(128, 32)))


def test_torch_compile_fullgraph_traces_the_op(disp):
    calls = []

    def count(gm, example_inputs):
        calls.append(str(gm.graph))
        return gm

    f = torch.compile(lambda a, b: l2ir.matmul(a, b) * 2, fullgraph=True, backend=count)
    a, w = rand(64, 256), rand(512, 256)
    torch.testing.assert_close(f(a, w.t()).double(), 2 * (a.double() @ w.t().double()), rtol=2e-2, atol=4e-2)
    assert calls and "l2ir.matmul" in calls[0]
    assert disp.stats == {"l2ir": 1}


# ---------------------------------------------------------------------------------------------------------------
# Process-level behaviour (fresh interpreters).
# ---------------------------------------------------------------------------------------------------------------


def _python(code, env=None):
    full = dict(os.environ)
    full.pop(dispatch.ENV_VAR, None)
    full.update(env or {})
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=full,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_l2ir_is_light():
    out = _python("import sys, l2ir; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('l2ir')))")
    assert out == "['l2ir']"


def test_runtime_import_chain_never_imports_search(pkg_dir):
    code = f"""
import sys, torch, l2ir
l2ir.load({str(pkg_dir)!r})
from l2ir import dispatch
d = dispatch._dispatcher()
d.package.resolve(248, 256, 256, {CLS_COL!r})      # the untuned rule: parses IR, runs the problem rules
l2ir.matmul(torch.randn(8, 8).half(), torch.randn(8, 8).half())
bad = sorted(m for m in sys.modules if m.startswith(('l2ir.search', 'l2ir.backends', 'l2ir.policy', 'l2ir.export')))
print(bad, l2ir.dispatch_stats())
"""
    assert _python(code) == "[] {'cpu': 1}"


def test_environment_variable_is_read_at_first_use(pkg_dir):
    code = """
import os, l2ir, torch
from l2ir import dispatch
os.environ['L2IR_DISPATCH'] = os.environ.pop('PKG')         # set after import: still honoured
l2ir.matmul(torch.randn(8, 8).half(), torch.randn(8, 8).half())
print(dispatch._dispatcher().package.manifest['content_hash'][:12], l2ir.dispatch_stats())
"""
    want = dispatch.read_package(pkg_dir).manifest["content_hash"][:12]
    assert _python(code, {"PKG": str(pkg_dir)}) == f"{want} {{'cpu': 1}}"


def test_bad_environment_variable_warns_and_falls_back(tmp_path):
    code = """
import warnings, l2ir, torch
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    l2ir.matmul(torch.randn(8, 8).half(), torch.randn(8, 8).half())
print(len(w), 'no manifest.json' in str(w[0].message), l2ir.dispatch_stats())
"""
    assert _python(code, {dispatch.ENV_VAR: str(tmp_path)}) == "1 True {'no_package': 1}"


def test_one_package_per_process(pkg_dir, tmp_path):
    dispatch._reset()
    try:
        man = l2ir.load(pkg_dir)
        assert l2ir.load(str(pkg_dir)) is man                   # the same package: already loaded
        other = tmp_path / "other"
        with standard_db(tmp_path / "r.db") as db:
            export.export(db, other, cache_dir=str(tmp_path / "c"), build=fake_build, fastpath=False, log=lambda s: None)
        with pytest.raises(dispatch.PackageError, match="already loaded"):
            l2ir.load(other)
    finally:
        dispatch._reset()


# ---------------------------------------------------------------------------------------------------------------
# The eager fast path: routes kept per fast key, launches bound once per shape (stub libcuda, no GPU).
# ---------------------------------------------------------------------------------------------------------------

STUB_DRIVER = r"""
#include <stddef.h>
#include <stdint.h>
/* libcuda's eager-launch entry points and the host-shim ABI, recording what they were handed. rec[18] counts every
   kernel launch, rec[19] those through cuLaunchKernelEx: its attribute count and first attribute are rec[31..33],
   its grid, block x, smem, stream and function rec[34..40], the config's and kernelParams' addresses rec[41..42]. */
static uint64_t rec[48];
int stub_rc = 0;
int cuCtxSetCurrent(void* ctx) { rec[0] = (uint64_t)ctx; return 0; }
int cuCtxGetCurrent(void** ctx) { *ctx = (void*)rec[0]; return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void* stream, void** params, void** extra) {
  rec[1] = (uint64_t)f; rec[2] = gx; rec[3] = gy; rec[4] = gz; rec[5] = bx; rec[6] = by; rec[7] = bz;
  rec[8] = smem; rec[9] = (uint64_t)stream; rec[10] = (uint64_t)extra;
  rec[11] = *(uint64_t*)params[0]; rec[12] = *(uint64_t*)params[1]; rec[13] = *(uint64_t*)params[2];
  rec[14] = (uint64_t)*(int*)params[3]; rec[15] = (uint64_t)*(int*)params[4]; rec[16] = (uint64_t)*(int*)params[5];
  rec[17] = *(uint64_t*)params[6]; rec[18] += 1;
  return stub_rc; }
/* cuda.h's CUlaunchAttribute and CUlaunchConfig, written out as the driver's ABI has them. */
struct attribute { unsigned id; char pad[4]; union { int value; char bytes[64]; } v; };
struct config { unsigned gx, gy, gz, bx, by, bz, smem; void* stream; struct attribute* attrs; unsigned n_attrs; };
int cuLaunchKernelEx(const struct config* c, void* f, void** params, void** extra) {
  rec[19] += 1; rec[31] = c->n_attrs; rec[32] = c->n_attrs ? c->attrs[0].id : 99;
  rec[33] = c->n_attrs ? (uint64_t)c->attrs[0].v.value : 99;
  rec[34] = c->gx; rec[35] = c->gy; rec[36] = c->gz; rec[37] = c->bx; rec[38] = c->smem; rec[39] = (uint64_t)c->stream;
  rec[40] = (uint64_t)f; rec[41] = (uint64_t)c; rec[42] = (uint64_t)params;
  return cuLaunchKernel(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->smem, c->stream, params, extra); }
size_t l2ir_workspace_size(int m, int n, int k) { return (size_t)m * 4096; }
int l2ir_run(const void* a, const void* b, void* c, int m, int n, int k, void* ws, size_t wsb, void* s) {
  rec[20] = (uint64_t)a; rec[21] = (uint64_t)b; rec[22] = (uint64_t)c; rec[23] = m; rec[24] = n; rec[25] = k;
  rec[26] = (uint64_t)ws; rec[27] = wsb; rec[28] = (uint64_t)s; return stub_rc; }
struct run_args { const void* a; const void* b; void* c; int m, n, k; void* ws; size_t wsb; void* s; };
int l2ir_run_args(const struct run_args* p) {
  rec[29] += 1; rec[30] = (uint64_t)p; return l2ir_run(p->a, p->b, p->c, p->m, p->n, p->k, p->ws, p->wsb, p->s); }
void stub_record(uint64_t* out) { for (int i = 0; i < 48; i++) out[i] = rec[i]; }
"""


@pytest.fixture(scope="module")
def stub_driver(tmp_path_factory):
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stub driver")
    d = tmp_path_factory.mktemp("stub")
    (d / "stub.c").write_text(STUB_DRIVER)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(d / "libstub.so"), str(d / "stub.c")], check=True)
    lib = ctypes.CDLL(str(d / "libstub.so"))

    def record():
        out = (ctypes.c_uint64 * 48)()
        lib.stub_record(out)
        return list(out)

    return SimpleNamespace(path=str(d / "libstub.so"), lib=lib, record=record,
                           rc=ctypes.c_int.in_dll(lib, "stub_rc"))


def calls_from_live_threads(call, record, threads: int = 4, calls: int = 2) -> dict[int, list]:
    """`call(i)` `calls` times from each of `threads` threads, one call at a time (the stub records globally),
    every thread alive until all have called, so no finished thread's per-thread state can be freed and its address
    handed to another's. Returns i -> the record after each of thread i's calls."""
    lock, done, seen = threading.Lock(), threading.Barrier(threads), {}

    def work(i):
        for _ in range(calls):
            with lock:
                call(i)
                seen.setdefault(i, []).append(record())
        done.wait()

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return seen


def test_kernel_launch_packs_the_abi(pkg_dir, stub_driver):
    pkg = dispatch.read_package(pkg_dir)
    spec = next(s for s in pkg.kernels.values() if s.problem_class == CLS_COL)
    plan = dispatch.launch_plan(spec)
    (ln,) = plan.launches
    kl = dispatch.KernelLaunch(dispatch.Driver(stub_driver.path), 0x7F00_1234_5000, [0x7F00_AAAA_0000], plan)
    go, ws = kl.bind(1000, 512, 264)
    assert ws == plan.workspace_for(1000, 512, 264) == 0
    a, b, c, s = 0x7F12_0000_0010, 0x7F13_0000_0020, 0x7F14_0000_0030, 0x5555_0000_1234
    go(a, b, c, 0, s)
    r = stub_driver.record()
    assert r[0] == 0x7F00_1234_5000 and r[1] == 0x7F00_AAAA_0000
    assert tuple(r[2:5]) == ln.grid_for(1000, 512, 264) and tuple(r[5:8]) == ln.block and r[8] == ln.smem
    assert r[9] == s and r[10] == 0
    assert r[11:18] == [a, b, c, 1000, 512, 264, 0]
    # A second shape bound beside the first keeps its own argument block.
    go2, _ = kl.bind(8, 16, 32)
    go2(c, b, a, 0, 0)
    assert stub_driver.record()[11:18] == [c, b, a, 8, 16, 32, 0]
    go(a, b, c, 0, s)
    assert stub_driver.record()[11:18] == [a, b, c, 1000, 512, 264, 0]
    # Threads fill their own blocks.
    seen = []

    def work(i):
        go(a + 16 * i, b, c, 0, s)
        seen.append(stub_driver.record()[11])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 4
    stub_driver.rc.value = 700                       # CUDA_ERROR_ILLEGAL_ADDRESS
    try:
        from l2ir.runtime import LaunchError

        with pytest.raises(LaunchError, match="CUresult 700 for m=1000 n=512 k=264"):
            go(a, b, c, 0, s)
    finally:
        stub_driver.rc.value = 0


def pdl_plan(spec, second: bool = False):
    """The package kernel's plan with PDL asked for; `second`: a plain launch of the same entry after it."""
    import dataclasses

    plan = dispatch.launch_plan(spec)
    (ln,) = plan.launches
    launches = (dataclasses.replace(ln, pdl=True),) + ((dataclasses.replace(ln, pdl=False),) if second else ())
    return dataclasses.replace(plan, launches=launches)


@pytest.mark.parametrize("pdl_device", [True, False], ids=["sm90", "sm80"])
def test_kernel_launch_with_pdl_goes_through_launch_ex(pkg_dir, stub_driver, pdl_device):
    """A launch whose plan asks for programmatic dependent launch goes through cuLaunchKernelEx with the one
    attribute (programmatic stream serialization = 1) on a GPU that has it, and through cuLaunchKernel elsewhere;
    either way the grid, block, stream and arguments arrive as they do for a plain launch. A plain launch after it
    in the same plan stays plain."""
    pkg = dispatch.read_package(pkg_dir)
    spec = next(s for s in pkg.kernels.values() if s.problem_class == CLS_COL)
    plan = pdl_plan(spec, second=True)
    ln = plan.launches[0]
    kl = dispatch.KernelLaunch(dispatch.Driver(stub_driver.path), 0x7F00_1234_5000, [0x7F00_AAAA_0000, 0x7F00_BBBB_0000],
                               plan, pdl_device=pdl_device)
    go, _ = kl.bind(1000, 512, 264)
    a, b, c, s = 0x7F12_0000_0010, 0x7F13_0000_0020, 0x7F14_0000_0030, 0x5555_0000_1234
    for stream in (s, 0, s + 16):                     # the stream is the call's, also on a config kept per thread
        before = stub_driver.record()
        go(a, b, c, 0, stream)
        r = stub_driver.record()
        assert r[18] - before[18] == 2                                  # both launches ran
        assert r[19] - before[19] == (1 if pdl_device else 0)           # the first through cuLaunchKernelEx
        if pdl_device:                                                  # the PDL launch as it arrived
            assert r[31:34] == [1, dispatch.LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1]
            assert r[34:41] == [*ln.grid_for(1000, 512, 264), ln.block[0], ln.smem, stream, 0x7F00_AAAA_0000]
        assert r[1] == 0x7F00_BBBB_0000                                 # the plain launch came last
        assert tuple(r[2:5]) == ln.grid_for(1000, 512, 264) and tuple(r[5:8]) == ln.block and r[8] == ln.smem
        assert r[9] == stream and r[10] == 0 and r[11:18] == [a, b, c, 1000, 512, 264, 0]
    native_grids = kl.native(1000, 512, 264)[4]
    assert [g[-1] for g in native_grids] == [int(pdl_device), 0]
    assert (kl.native(1000, 512, 264)[5] != 0) == pdl_device
    # One PDL launch alone, from other threads: each fills its own argument block and config, the same one on each
    # of its calls.
    solo = dispatch.KernelLaunch(dispatch.Driver(stub_driver.path), 0x7F00_1234_5000, [0x7F00_AAAA_0000],
                                 pdl_plan(spec), pdl_device=True)
    go1, _ = solo.bind(8, 16, 32)
    seen = {i: [(r[11], r[39], r[14:17], r[41], r[42]) for r in records] for i, records in
            calls_from_live_threads(lambda i: go1(a + 16 * i, b, c, 0, s + i), stub_driver.record).items()}
    assert all(a_ == a + 16 * i and st == s + i and mnk == [8, 16, 32]
               for i, calls in seen.items() for a_, st, mnk, _, _ in calls)
    configs = {i: {(cfg, par) for *_, cfg, par in calls} for i, calls in seen.items()}
    assert all(len(c_) == 1 for c_ in configs.values()), configs             # one config per thread
    assert len(set.union(*configs.values())) == 4, configs                    # no two threads share one
    stub_driver.rc.value = 700
    try:
        from l2ir.runtime import LaunchError

        with pytest.raises(LaunchError, match="CUresult 700 for m=8 n=16 k=32"):
            go1(a, b, c, 0, s)
    finally:
        stub_driver.rc.value = 0


@pytest.mark.nvcc
def test_launch_config_layout_is_cuda_h(tmp_path):
    """The ctypes CUlaunchConfig and CUlaunchAttribute that the PDL launch hands cuLaunchKernelEx have cuda.h's
    sizes, field offsets and attribute id (l2ir/fastpath.cpp static_asserts the same sizes)."""
    import shutil

    from l2ir.backends.compile import nvcc_include_dirs

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("nvcc") is None:
        pytest.skip("needs a C compiler and nvcc's cuda.h")
    (tmp_path / "layout.c").write_text(r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), _Alignof(CUlaunchConfig),
         offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
         offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute), _Alignof(CUlaunchAttribute),
         offsetof(CUlaunchAttribute, value), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
""")
    includes = [f"-I{d}" for d in nvcc_include_dirs("nvcc")]
    subprocess.run([cc, *includes, "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                                          check=True).stdout.split()]
    cfg, attr = dispatch._LaunchConfig, dispatch._LaunchAttribute
    assert got == [ctypes.sizeof(cfg), ctypes.alignment(cfg), cfg.smem.offset, cfg.stream.offset, cfg.attrs.offset,
                   cfg.num_attrs.offset, ctypes.sizeof(attr), ctypes.alignment(attr), attr.value.offset,
                   dispatch.LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]


@pytest.mark.parametrize("packed", [True, False], ids=["l2ir_run_args", "l2ir_run"])
def test_shim_launch_passes_pointers_sizes_and_stream(stub_driver, packed):
    """Through l2ir_run_args (one block, l2ir.runtime.RunArgs) where the library has it, else l2ir_run: the same
    pointers, sizes and stream arrive; two shapes bound side by side and other threads keep their own blocks."""
    from l2ir.runtime import LaunchError

    shim = dispatch.ShimLaunch(stub_driver.path)
    assert shim.run_args is not None
    if not packed:
        shim.run_args = None                     # a library built before l2ir_run_args
    packed_calls = stub_driver.record()[29]
    go, ws = shim.bind(100, 200, 300)
    assert ws == 100 * 4096
    go(0x7F00_0000_0100, 0x7F00_0000_0200, 0x7F00_0000_0300, 0x7F00_0000_0400, 0x7F00_0000_0500)
    assert stub_driver.record()[20:29] == [0x7F00_0000_0100, 0x7F00_0000_0200, 0x7F00_0000_0300, 100, 200, 300,
                                           0x7F00_0000_0400, 100 * 4096, 0x7F00_0000_0500]
    go2, _ = shim.bind(8, 16, 32)
    go2(0x10, 0x20, 0x30, 0, 0)
    assert stub_driver.record()[20:29] == [0x10, 0x20, 0x30, 8, 16, 32, 0, 8 * 4096, 0]
    go(0x7F00_0000_0100, 0x7F00_0000_0200, 0x7F00_0000_0300, 0, 0x7F00_0000_0500)
    assert stub_driver.record()[20:29] == [0x7F00_0000_0100, 0x7F00_0000_0200, 0x7F00_0000_0300, 100, 200, 300,
                                           0, 100 * 4096, 0x7F00_0000_0500]
    # Each thread: its own pointers arrive, and (packed) one block of its own, the same on each of its calls.
    seen = {i: [(r[20], r[23:26], r[30]) for r in records] for i, records in
            calls_from_live_threads(lambda i: go(0x1000 * (i + 1), 0x20, 0x30, 0, 0), stub_driver.record).items()}
    assert all(a == 0x1000 * (i + 1) and mnk == [100, 200, 300] for i, calls in seen.items() for a, mnk, _ in calls)
    if packed:
        blocks = {i: {blk for _, _, blk in calls} for i, calls in seen.items()}
        assert all(len(b) == 1 for b in blocks.values()), blocks               # one block per thread
        assert len(set.union(*blocks.values())) == 4, blocks                    # no two threads share one
    assert stub_driver.record()[29] - packed_calls == (11 if packed else 0)
    stub_driver.rc.value = 102
    try:
        with pytest.raises(LaunchError, match=r"l2ir_run returned 102 \(shape violates pad=divisible\) for m=100"):
            go(16, 32, 48, 0, 0)
    finally:
        stub_driver.rc.value = 0


def test_a_route_is_decided_once_and_bound_once(disp):
    a, w = rand(64, 256), rand(512, 256)
    for _ in range(3):
        check(l2ir.matmul(a, w.t()), a, w.t())
    assert list(disp._fast) == [dispatch.fast_key(a, w.t())]       # matmul's inline key
    check(disp.eager(a, w.t()), a, w.t())
    assert list(disp._fast) == [dispatch.fast_key(a, w.t())]       # Dispatcher.eager's inline key
    # Every inline key (matmul's, Dispatcher.eager's, patch_linear's) finds the kept route: no decision again.
    prepared, prepare = [], disp._prepare
    disp._prepare = lambda *args: prepared.append(1) or prepare(*args)
    with torch.no_grad(), l2ir.patch_linear():
        y = torch.nn.functional.linear(a, w)
    l2ir.matmul(a, w.t())
    disp.eager(a, w.t())
    del disp._prepare
    check(y, a, w.t())
    assert prepared == []
    (state,) = disp._devices.values()
    (runner,) = state["runners"].values()
    assert runner.binds == [(64, 512, 256)] and runner.calls == 7
    # Another tensor of the same shapes, strides, dtype and device takes the same route; a new layout does not.
    a2 = rand(64, 256)
    check(l2ir.matmul(a2, w.t()), a2, w.t())
    check(l2ir.matmul(a2, w.t().contiguous()), a2, w.t())           # b row-major: 64x512x256 is untuned there
    assert len(disp._fast) == 2 and runner.binds == [(64, 512, 256)]
    assert disp.lookup(a, w.t()).reason == "l2ir"
    row_reason = disp.package.resolve(64, 512, 256, CLS_ROW)[1]
    assert row_reason != "l2ir" and disp.lookup(a2, w.t().contiguous()).reason == row_reason
    assert disp.stats == {"l2ir": 8, row_reason: 1}


def test_misaligned_call_on_a_served_route_falls_back_per_call(disp):
    a, w = rand(64, 256), rand(512, 256)
    check(l2ir.matmul(a, w.t()), a, w.t())
    mis = _misaligned(64, 256)
    mis.copy_(a)
    assert dispatch.fast_key(mis, w.t()) == dispatch.fast_key(a, w.t())  # same route: the pointer decides
    torch.testing.assert_close(l2ir.matmul(mis, w.t()), torch.matmul(mis, w.t()))
    check(l2ir.matmul(a, w.t()), a, w.t())
    assert disp.stats == {"l2ir": 2, "misaligned": 1}


def test_fallback_calls_torch_mm_for_2d_operands(disp, monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: calls.append(a.shape) or real_mm(a, b, **kw))
    a, b = rand(16, 16), rand(16, 16).t()
    torch.testing.assert_close(l2ir.matmul(a, b), a @ b)
    assert calls == [(16, 16)] and disp.stats == {"untuned": 1}
    a3 = rand(2, 16, 16)
    torch.testing.assert_close(l2ir.matmul(a3, b), torch.matmul(a3, b))    # batched A: torch.matmul folds it
    assert calls == [(16, 16)]


def test_counts_from_many_threads_add_up(disp):
    a, b = rand(16, 16), rand(16, 16).t()
    a_served, w = rand(64, 256), rand(512, 256)

    def work():
        for _ in range(200):
            l2ir.matmul(a, b)
            l2ir.matmul(a_served, w.t())

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert disp.stats == {"untuned": 1200, "l2ir": 1200} and dispatch.dispatch_stats() == dict(disp.stats)


def test_fast_cache_is_bounded(disp, monkeypatch):
    monkeypatch.setattr(dispatch, "_FAST_MAX", 4)
    for m in range(1, 10):
        a, b = rand(m, 8), rand(8, 8)
        torch.testing.assert_close(l2ir.matmul(a, b), a @ b)
    assert 0 < len(disp._fast) <= 4 and sum(disp.stats.values()) == 9


def test_entry_points_are_bound_on_the_package():
    """`l2ir.matmul` must not go through the package's lazy module __getattr__ (an import statement per access)."""
    code = """
import l2ir
before = 'matmul' in vars(l2ir)
f = l2ir.matmul
from l2ir import dispatch
print(before, all(vars(l2ir)[n] is getattr(dispatch, n) for n in l2ir._DISPATCH))
"""
    assert _python(code) == "False True"


class SplitKRunner(HostRunner):
    """A split-K-like kernel: asks for a zeroed workspace, relies on its first 4 bytes being zero on entry (its
    tile counter) and leaves them zero; the bytes after are scratch it overwrites."""

    zero_workspace = True

    def bind(self, m, n, k):
        def go(a, b, c, ws, stream):
            counter = _array(ws, 8)                   # float16 view of the first 16 bytes
            assert (counter[:2] == 0).all(), "tile counter not zero on entry"
            counter[2:] = 7.0                          # partial sums: scratch, never cleared
            self(a, b, c, m, n, k)
            self.workspaces.append(ws)
        return go, 64

    workspaces: list = []


def test_zeroed_workspace_is_kept_per_route_and_stream(pkg_dir, monkeypatch):
    """The memset of a zero_workspace kernel is paid once per route and stream, not per call; another route gets
    its own (its counters may sit where this one keeps partial sums); past the budget every call zeroes a new one."""
    SplitKRunner.workspaces = []
    d = CpuDispatcher(dispatch.read_package(pkg_dir), runner=SplitKRunner)
    dispatch._reset(d)
    try:
        w = rand(256, 256)
        routes = [(rand(m, 256), w.t()) for m in (256, 248, 240)]       # b = W.t(): the b=f16:col class
        assert all(d.lookup(a, b).reason == "l2ir" for a, b in routes)
        (a, b), (a2, b2), (a3, b3) = routes
        for _ in range(3):
            check(d.eager(a, b), a, b)
        assert len(set(SplitKRunner.workspaces)) == 1 and d._kept_bytes == 64
        check(d.eager(a2, b2), a2, b2)
        assert len(set(SplitKRunner.workspaces)) == 2 and d._kept_bytes == 128
        monkeypatch.setattr(dispatch, "_KEPT_WORKSPACE_BUDGET", 128)
        for _ in range(2):                          # past the budget: a fresh zeroed workspace per call
            check(d.eager(a3, b3), a3, b3)
        assert d._kept_bytes == 128 and d.stats == {"l2ir": 6}
    finally:
        dispatch._reset()


class ScratchRunner(HostRunner):
    """A repack-like kernel: asks for a scratch workspace it overwrites on every call (no zeroing needed)."""

    def bind(self, m, n, k):
        def go(a, b, c, ws, stream):
            _array(ws, 8)[:] = 3.0                     # the copies: overwritten every call
            self(a, b, c, m, n, k)
            self.workspaces.append(ws)
        return go, 64

    workspaces: list = []


def test_scratch_workspace_is_kept_per_route_and_stream(pkg_dir):
    """A workspace that needs no zeroing is kept per route and stream as well (no allocation per call, and a stable
    address for the shim's cached tensor maps)."""
    ScratchRunner.workspaces = []
    d = CpuDispatcher(dispatch.read_package(pkg_dir), runner=ScratchRunner)
    dispatch._reset(d)
    try:
        w = rand(256, 256)
        a, b = rand(256, 256), w.t()
        for _ in range(3):
            check(d.eager(a, b), a, b)
        assert len(set(ScratchRunner.workspaces)) == 1 and d._kept_bytes == 64 and d.stats == {"l2ir": 3}
        # The route cache cleared (too many shapes): the route prepared again finds its workspace, counted once.
        d._fast.clear()
        dispatch._ROUTES.clear()
        check(d.eager(a, b), a, b)
        assert len(set(ScratchRunner.workspaces)) == 1 and d._kept_bytes == 64
    finally:
        dispatch._reset()
