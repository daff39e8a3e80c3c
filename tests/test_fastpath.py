# ruff: noqa: F401, F811 - the fixtures imported from test_dispatch (pkg_dir, stub_driver) are parameters below
"""The compiled eager path of `l2ir.matmul` (l2ir/fastpath.cpp) on the CPU: built here with g++ against torch's
headers, attached to the CPU stand-in dispatcher of tests/test_dispatch.py. The first call of a route is decided by
the Python path, which adds the route to the compiled table; the tests check that every later call is answered by
the table (the Python route is made unreachable), with the same pointers, sizes, counters and fallbacks."""

import ctypes
import warnings

import pytest
import torch
from test_dispatch import (CpuDispatcher, HostRunner, ScratchRunner, _misaligned, check, checked_calls_from_threads,
                           pdl_plan, pkg_dir, rand, stub_driver)

import l2ir
from l2ir import dispatch, fastpath
from l2ir.runtime import RunArgs


@pytest.fixture(scope="module")
def fast_module(tmp_path_factory):
    try:
        path = fastpath.build(tmp_path_factory.mktemp("fastpath"))
    except fastpath.FastPathError as e:
        pytest.skip(f"fast path not buildable here: {e}")
    mod, why = fastpath.load(path.parent)
    assert mod is not None, why
    return mod


def attached(pkg_dir, runner=HostRunner, module=None):
    d = CpuDispatcher(dispatch.read_package(pkg_dir), runner=runner)
    dispatch._reset(d)
    assert d.attach_fastpath(module).startswith("compiled")
    return d


def on_stub_driver(pkg_dir, runner, stub_driver, module, stream: int):
    """A dispatcher whose runners launch through the stub libcuda, on a fixed stream handle (the compiled table
    takes the stream function it is made with, so the fast path is attached again after setting it)."""
    runner.driver = stub_driver.path
    d = attached(pkg_dir, runner, module)
    d.current_stream = lambda index: stream
    d._stream_of = d.current_stream
    d.attach_fastpath(module)
    return d


@pytest.fixture
def fdisp(pkg_dir, fast_module):
    d = attached(pkg_dir, module=fast_module)
    yield d
    dispatch._reset()


def python_path_gone(d):
    """Make every kept Python route raise: a call that reaches one was not answered by the compiled table."""
    def boom(*args, **kw):
        raise AssertionError("the Python route ran")

    for key in list(d._fast):
        d._fast[key] = boom


def test_build_names_python_torch_and_source(tmp_path, fast_module, monkeypatch):
    name = fastpath.file_name()
    assert name.startswith("l2ir_fastpath.cpython-") and torch.__version__.split("+")[0] in name
    assert fast_module.RUN_ARGS_SIZE == ctypes.sizeof(RunArgs)            # l2ir_run_args's block, same layout
    assert fastpath.load(tmp_path) == (None, f"no build for this Python and torch in {tmp_path} (expected {name})")
    monkeypatch.setenv(fastpath.ENV_VAR, "0")
    assert fastpath.load(tmp_path)[0] is None and not fastpath.enabled()
    # A changed fastpath.cpp is another build: its tag carries the source's hash.
    monkeypatch.setattr(fastpath, "SOURCE", tmp_path / "other.cpp")
    (tmp_path / "other.cpp").write_text("// another version\n")
    assert fastpath.file_name() != name


def test_build_without_a_compiler_is_one_line(tmp_path):
    with pytest.raises(fastpath.FastPathError, match="failed to build the fast path|no C"):
        fastpath.build(tmp_path, cxx="/bin/false")


def test_repeated_calls_are_served_by_the_table(fdisp):
    a, w = rand(64, 256), rand(512, 256)
    check(l2ir.matmul(a, w.t()), a, w.t())          # decided by Python, added to the table
    assert fdisp._native.size() == 1
    python_path_gone(fdisp)
    for _ in range(3):
        a = rand(64, 256)
        check(l2ir.matmul(a, w.t()), a, w.t())      # the runner gets this call's pointers from C++
    (state,) = fdisp._devices.values()
    runner = next(iter(state["runners"].values()))
    assert runner.calls == 4 and runner.binds == [(64, 512, 256)]
    assert fdisp.stats == {"l2ir": 4}
    assert dict(zip(dispatch.COUNTERS, fdisp._native.counts()))["l2ir"] == 3


def test_fallback_routes_run_torch_from_the_table(fdisp):
    cases = {"cublas": (rand(64, 64), rand(64, 64).t()), "untuned": (rand(16, 16), rand(16, 16).t()),
             "dtype": (rand(64, 256, dtype=torch.float32), rand(512, 256, dtype=torch.float32).t()),
             "noncontiguous": (rand(64, 512)[:, ::2], rand(512, 256).t())}
    for a, b in cases.values():
        torch.testing.assert_close(l2ir.matmul(a, b), torch.matmul(a, b))
    python_path_gone(fdisp)
    for a, b in cases.values():
        torch.testing.assert_close(l2ir.matmul(a, b), torch.matmul(a, b))
    a3, b3 = rand(2, 16, 16), rand(16, 16)          # batched A: at::matmul, not at::mm
    torch.testing.assert_close(l2ir.matmul(a3, b3), torch.matmul(a3, b3))
    fdisp._fast.clear()
    dispatch._ROUTES.clear()
    torch.testing.assert_close(l2ir.matmul(a3, b3), torch.matmul(a3, b3))
    assert fdisp.stats == {"cublas": 2, "untuned": 4, "dtype": 2, "noncontiguous": 2}


def test_misaligned_pointer_on_a_kept_route_falls_back_per_call(fdisp):
    a, w = rand(64, 256), rand(512, 256)
    check(l2ir.matmul(a, w.t()), a, w.t())
    python_path_gone(fdisp)
    mis = _misaligned(64, 256)
    mis.copy_(a)
    torch.testing.assert_close(l2ir.matmul(mis, w.t()), torch.matmul(mis, w.t()))
    check(l2ir.matmul(a, w.t()), a, w.t())
    assert fdisp.stats == {"l2ir": 2, "misaligned": 1}


def test_what_the_table_leaves_to_python(fdisp):
    a, w = rand(64, 256), rand(512, 256)
    check(l2ir.matmul(a, w.t()), a, w.t())
    # An input that requires grad (grad mode on), a tensor subclass and out= go to the Python path.
    ag = a.clone().requires_grad_()
    assert fdisp._native.call(ag, w.t()) is None
    with torch.no_grad():
        assert fdisp._native.call(ag, w.t()) is not None            # no graph to keep: served

    class Sub(torch.Tensor):
        pass

    assert fdisp._native.call(a.as_subclass(Sub), w.t()) is None
    assert fdisp._native.call(a, w.t().contiguous()) is None       # another key: not decided yet
    l2ir.matmul(ag, w.t())
    assert fdisp.stats["autograd"] == 1


def test_eager_only_route_runs_torch_inside_a_capture(fdisp):
    a, b = rand(1024, 64), rand(64, 64).t()        # cuBLAS in the table, an eager kernel on eager calls
    check(l2ir.matmul(a, b), a, b)
    python_path_gone(fdisp)
    check(l2ir.matmul(a, b), a, b)
    fdisp.capture = True
    torch.testing.assert_close(l2ir.matmul(a, b), torch.matmul(a, b))
    fdisp.capture = False
    assert fdisp.stats == {"l2ir": 2, "cublas": 1}


def test_kept_workspace_comes_from_the_dispatcher_once(pkg_dir, fast_module):
    ScratchRunner.workspaces = []
    d = attached(pkg_dir, ScratchRunner, fast_module)
    try:
        a, b = rand(256, 256), rand(256, 256).t()
        for _ in range(4):
            check(l2ir.matmul(a, b), a, b)
        assert len(set(ScratchRunner.workspaces)) == 1 and d._kept_bytes == 64 and d.stats == {"l2ir": 4}
        python_path_gone(d)
        d.capture = True                           # a captured call with a workspace: the Python route makes it
        with pytest.raises(AssertionError, match="the Python route ran"):
            l2ir.matmul(a, b)
    finally:
        dispatch._reset()


def test_refused_launch_warns_clears_the_table_and_falls_back(pkg_dir, fast_module):
    class RefusesLater(HostRunner):
        refuse = False

        def __call__(self, *args):
            if RefusesLater.refuse:
                raise RuntimeError("CUresult 700")
            return super().__call__(*args)

    d = attached(pkg_dir, RefusesLater, fast_module)
    try:
        a, w = rand(64, 256), rand(512, 256)
        check(l2ir.matmul(a, w.t()), a, w.t())
        RefusesLater.refuse = True
        with pytest.warns(RuntimeWarning, match="launch failed .*CUresult 700"):
            torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
        assert d._native.size() == 0 and not d._fast
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
        assert d.stats == {"l2ir": 1, "launch_failed": 1, "load_failed": 1}
    finally:
        RefusesLater.refuse = False
        dispatch._reset()


def test_threads_count_every_call(fdisp):
    a, w = rand(64, 256), rand(512, 256)
    check(l2ir.matmul(a, w.t()), a, w.t())
    python_path_gone(fdisp)
    errors = checked_calls_from_threads(a, w.t(), 25)
    assert not errors and fdisp.stats == {"l2ir": 201}


class StubKernelRunner:
    """The package kernel through dispatch.KernelLaunch on the stub libcuda: what the driver receives is recorded."""

    driver = None

    def __init__(self, spec, index):
        self.launch = dispatch.KernelLaunch(dispatch.Driver(self.driver), 0x7F00_1234_5000, [0x7F00_AAAA_0000],
                                            dispatch.launch_plan(spec))

    def bind(self, m, n, k):
        return self.launch.bind(m, n, k)

    def native(self, m, n, k):
        return self.launch.native(m, n, k)


def test_kernel_route_calls_the_driver_with_the_abi(pkg_dir, fast_module, stub_driver):
    d = on_stub_driver(pkg_dir, StubKernelRunner, stub_driver, fast_module, 0x5555_0000_1234)
    try:
        a, w = rand(64, 256), rand(512, 256)
        l2ir.matmul(a, w.t())                      # Python: KernelLaunch through ctypes
        py = stub_driver.record()
        assert d._native.size() == 1
        python_path_gone(d)
        c = l2ir.matmul(a, w.t())                  # C++: the same launch
        r = stub_driver.record()
        assert r[18] == py[18] + 1                 # one more launch
        assert r[0:11] == py[0:11]                 # context, function, grid, block, smem, stream, extra
        assert r[11:13] == [a.data_ptr(), w.t().data_ptr()] and r[13] == c.data_ptr()
        assert r[14:18] == [64, 512, 256, 0] and c.shape == (64, 512) and c.dtype == a.dtype
        stub_driver.rc.value = 700
        with pytest.warns(RuntimeWarning, match="CUresult 700"):
            torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
        assert d._native.size() == 0 and d.stats == {"l2ir": 2, "launch_failed": 1}
    finally:
        stub_driver.rc.value = 0
        dispatch._reset()


class StubPdlRunner(StubKernelRunner):
    """The package kernel with PDL asked for, on a GPU that has it: a cuLaunchKernelEx launch, then (`second`) a
    plain one."""

    second = True

    def __init__(self, spec, index):
        funcs = [0x7F00_AAAA_0000, 0x7F00_BBBB_0000][:2 if self.second else 1]
        self.launch = dispatch.KernelLaunch(dispatch.Driver(self.driver), 0x7F00_1234_5000, funcs,
                                            pdl_plan(spec, second=self.second), pdl_device=True)


@pytest.mark.parametrize("second", [True, False], ids=["then-plain", "alone"])
def test_pdl_kernel_route_calls_launch_ex_as_the_python_path_does(pkg_dir, fast_module, stub_driver, second):
    stream = 0x5555_0000_1234
    runner = type("Runner", (StubPdlRunner,), {"second": second})
    d = on_stub_driver(pkg_dir, runner, stub_driver, fast_module, stream)
    launches = 2 if second else 1
    try:
        a, w = rand(64, 256), rand(512, 256)
        before = stub_driver.record()
        l2ir.matmul(a, w.t())                      # Python: cuLaunchKernelEx (then cuLaunchKernel) through ctypes
        py = stub_driver.record()
        assert py[18] - before[18] == launches and py[19] - before[19] == 1
        assert d._native.size() == 1
        python_path_gone(d)
        c = l2ir.matmul(a, w.t())                  # C++: the same launches
        r = stub_driver.record()
        assert r[18] == py[18] + launches and r[19] == py[19] + 1
        assert r[31:34] == [1, dispatch.LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1]
        assert r[34:41] == py[34:41] and r[39:41] == [stream, 0x7F00_AAAA_0000]    # the PDL launch's own fields
        assert r[42] != 0 and r[0:11] == py[0:11]  # context, last function, grid, block, smem, stream, extra
        assert r[11:13] == [a.data_ptr(), w.t().data_ptr()] and r[13] == c.data_ptr()
        assert r[14:18] == [64, 512, 256, 0]
        stub_driver.rc.value = 700
        with pytest.warns(RuntimeWarning, match="CUresult 700"):
            torch.testing.assert_close(l2ir.matmul(a, w.t()), torch.matmul(a, w.t()))
        assert d._native.size() == 0
    finally:
        stub_driver.rc.value = 0
        dispatch._reset()


def test_a_pdl_grid_without_launch_ex_is_refused(pkg_dir, fast_module):
    d = attached(pkg_dir, module=fast_module)
    try:
        a, w = rand(64, 256), rand(512, 256)
        grid = (0x7F00_AAAA_0000, 1, 1, 1, 128, 1, 1, 0, 1)          # asks for PDL
        with pytest.raises(ValueError, match="null entry point"):
            d._native.add_served(a, w.t(), ("kernel", 0x1000, 0, 0, (grid,), 0), False, False, False, 0, (64, 512),
                                 64, 512, 256, 0, None, lambda why: None)
    finally:
        dispatch._reset()


class StubShimRunner(StubKernelRunner):
    """The package kernel as a host shim (dispatch.ShimLaunch on the stub library: workspace m * 4096 bytes)."""

    CTX = 0x7F00_CCCC_0000        # the device's primary context, as the stub driver reports it current

    def __init__(self, spec, index):
        self.launch = dispatch.ShimLaunch(self.driver, driver=dispatch.Driver(self.driver), ctx=self.CTX)


def test_shim_route_passes_pointers_sizes_workspace_and_stream(pkg_dir, fast_module, stub_driver):
    d = on_stub_driver(pkg_dir, StubShimRunner, stub_driver, fast_module, 0x7F00_0000_0500)
    try:
        stub_driver.lib.cuCtxSetCurrent(ctypes.c_void_p(StubShimRunner.CTX))
        a, w = rand(64, 256), rand(512, 256)
        l2ir.matmul(a, w.t())
        py = stub_driver.record()
        python_path_gone(d)
        c = l2ir.matmul(a, w.t())
        r = stub_driver.record()
        assert r[29] == py[29] + 1 and r[30] != py[30]     # l2ir_run_args, from C++'s own block
        assert r[20:26] == [a.data_ptr(), w.t().data_ptr(), c.data_ptr(), 64, 512, 256]
        assert r[26] == py[26] != 0 and r[27] == 64 * 4096 and r[28] == 0x7F00_0000_0500   # the kept workspace
        assert d._kept_bytes == 64 * 4096 and d.stats == {"l2ir": 2}
        # Another context current (another current device): the table leaves the call to the Python route.
        stub_driver.lib.cuCtxSetCurrent(ctypes.c_void_p(0x7F00_DDDD_0000))
        assert d._native.call(a, w.t()) is None and stub_driver.record()[29] == r[29]
    finally:
        stub_driver.lib.cuCtxSetCurrent(ctypes.c_void_p(0))
        dispatch._reset()


def test_package_loads_its_own_build_when_its_manifest_lists_it(tmp_path, pkg_dir, fast_module, monkeypatch):
    import shutil

    pkg = tmp_path / "pkg"
    shutil.copytree(pkg_dir, pkg)
    d = dispatch.Dispatcher(dispatch.read_package(pkg))
    assert d.attach_fastpath().startswith("python (no build")
    (pkg / "fastpath").mkdir()
    shutil.copy(fast_module.__file__, pkg / "fastpath" / fastpath.file_name())
    d = dispatch.Dispatcher(dispatch.read_package(pkg))
    assert "not listed in the package's manifest" in d.attach_fastpath()       # not hash-checked: not loaded
    # `python -m l2ir.fastpath PACKAGE` builds it and lists it (here the build is the module built above).
    monkeypatch.setattr(fastpath, "build", lambda out: out / fastpath.file_name())
    before = dispatch.read_package(pkg).manifest["content_hash"]
    assert fastpath.main([str(pkg)]) == 0
    package = dispatch.read_package(pkg)                                         # every hash checks again
    assert package.manifest["content_hash"] != before and package.manifest["fastpath"] == fastpath.file_name()
    d = dispatch.Dispatcher(package)
    assert d.attach_fastpath() == f"compiled ({fastpath.file_name()})"
    monkeypatch.setenv(fastpath.ENV_VAR, "0")
    d = dispatch.Dispatcher(dispatch.read_package(pkg))
    assert d.attach_fastpath() == "python (L2IR_FASTPATH=0)"


def test_a_workspace_over_the_budget_lives_through_the_launch(pkg_dir, fast_module, monkeypatch):
    """Over the kept-workspace budget each call allocates its own workspace: it must not be freed (and handed to the
    output) before the kernel has run."""
    monkeypatch.setattr(dispatch, "_KEPT_WORKSPACE_BUDGET", 0)
    seen = []

    class Writes(HostRunner):
        def bind(self, m, n, k):
            def go(a, b, c, ws, stream):
                seen.append((ws, c))
                ctypes.memset(ws, 0x7F, 4096)          # the kernel's scratch, written before C
                self(a, b, c, m, n, k)
            return go, 4096

    d = attached(pkg_dir, Writes, fast_module)
    try:
        a, b = rand(256, 256), rand(256, 256).t()
        for _ in range(4):
            check(l2ir.matmul(a, b), a, b)
        assert d._kept_bytes == 0 and d.stats == {"l2ir": 4} and len(seen) == 4
        for ws, c in seen:
            assert ws + 4096 <= c or c + 256 * 256 * 2 <= ws, "the output overlaps the call's workspace"
    finally:
        dispatch._reset()


def test_a_dispatcher_with_a_table_is_collected(pkg_dir, fast_module):
    import gc
    import weakref

    d = attached(pkg_dir, module=fast_module)
    a, w = rand(64, 256), rand(512, 256)
    for _ in range(2):
        l2ir.matmul(a, w.t())
    assert d._native.size() == 1
    ref = weakref.ref(d)
    dispatch._reset()
    del d
    gc.collect()
    assert ref() is None, "the table's callbacks keep the dispatcher alive"


def test_torch_function_mode_sees_the_fallback(fdisp):
    from torch.overrides import TorchFunctionMode

    seen = []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    a, b = rand(16, 16), rand(16, 16).t()
    l2ir.matmul(a, b)                                  # untuned: a fallback route, kept in the table
    with Log():
        torch.testing.assert_close(l2ir.matmul(a, b), a @ b)
    assert "mm" in seen


def test_keyboard_interrupt_in_a_launch_is_not_a_launch_failure(pkg_dir, fast_module):
    class Interrupted(HostRunner):
        interrupt = False

        def __call__(self, *args):
            if Interrupted.interrupt:
                raise KeyboardInterrupt
            return super().__call__(*args)

    d = attached(pkg_dir, Interrupted, fast_module)
    try:
        a, w = rand(64, 256), rand(512, 256)
        l2ir.matmul(a, w.t())
        Interrupted.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            d._native.call(a, w.t())
        assert d._native.size() == 1 and d.stats == {"l2ir": 1}          # the runner is not disabled
    finally:
        Interrupted.interrupt = False
        dispatch._reset()


def test_autocast_and_forward_ad_are_left_to_python(fdisp):
    a, w = rand(64, 256), rand(512, 256)
    check(l2ir.matmul(a, w.t()), a, w.t())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fdisp._native.call(a, w.t()) is None
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        assert fdisp._native.call(fwAD.make_dual(a, torch.ones_like(a)), w.t()) is None
    assert fdisp._native.call(a, w.t()) is not None


def test_sparse_operands_go_to_torch(fdisp):
    """A sparse A reports strides of 0, as an expanded dense tensor would: the table keeps no route for it (its key
    would be a dense tensor's), and the Python path's fallback answers."""
    a, b = rand(64, 256).float().to_sparse(), rand(256, 512).float()
    for _ in range(2):
        torch.testing.assert_close(l2ir.matmul(a, b), torch.matmul(a, b))
    assert fdisp._native.size() == 0 and sum(fdisp.stats.values()) == 2 and "l2ir" not in fdisp.stats
    assert fdisp._native.call(a, b) is None


def test_fallback_result_is_what_torch_returns_for_autograd(fdisp):
    """The table's fallback dispatches below autograd only for operands with no autograd metadata; an operand that
    requires grad under no_grad, or a forward-mode dual tensor, keeps torch's full dispatch."""
    import torch.autograd.forward_ad as fwAD

    a, b = rand(16, 16).float(), rand(16, 16).float().t()
    torch.testing.assert_close(l2ir.matmul(a, b), a @ b)            # decided: dtype fallback, kept in the table
    c = fdisp._native.call(a, b)
    assert c is not None and c.grad_fn is None and not c.requires_grad
    with fwAD.dual_level():
        dual = fwAD.make_dual(a, torch.ones_like(a))
        out = fdisp._native.call(dual, b)
        assert out is not None
        tangent = fwAD.unpack_dual(out).tangent
        assert tangent is not None
        torch.testing.assert_close(tangent, torch.ones_like(a) @ b)
