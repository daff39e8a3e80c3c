"""The compile step: nvcc and NVRTC, the content-addressed cache, resources, failures, parallel jobs.

Runs where nvcc is installed; no GPU is needed (NVRTC and nvcc are compilers, not the driver)."""

import json
import shutil

import pytest

from l2ir.backends.compile import (ArchError, CompileOptions, cache_key, compile_many, compile_plan, gencode,
                              parse_ptxas)
from l2ir.runtime import Launch, LaunchPlan
from l2ir.indexing import Const

HAVE_NVCC = shutil.which("nvcc") is not None
nvcc = [pytest.mark.nvcc, pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")]


def _have_nvrtc():
    try:
        from l2ir.backends.compile import nvrtc_version
        nvrtc_version()                     # loads libnvrtc (the nvidia-cuda-nvrtc wheel)
    except Exception:  # noqa: BLE001 - bindings or library missing
        return False
    return True


SOURCE = """#include <cuda_fp16.h>
extern "C" __global__ void copy_tile(const void* A, const void* B, void* C, int M, int N, int K, void* ws) {
    __shared__ float tile[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < M * N ? __half2float(static_cast<const __half*>(A)[i]) : 0.f;
    __syncthreads();
    if (i < M * N) static_cast<__half*>(C)[i] = __float2half(tile[255 - threadIdx.x]);
}
"""

SHIM = """#include <cuda_runtime.h>
#include <cstddef>
__global__ void fill(float* c, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) c[i] = 1.f; }
extern "C" size_t l2ir_workspace_size(int M, int N, int K) { return 0; }
extern "C" int l2ir_run(const void* A, const void* B, void* C, int M, int N, int K, void* ws, size_t wsb,
                        void* stream) {
    fill<<<(M * N + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<float*>(C), M * N);
    return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
"""


def plan(source=SOURCE, arch="sm_80", **kw):
    launch = Launch(entry="copy_tile", grid=(Const(4), Const(1), Const(1)), block=(256, 1, 1))
    return LaunchPlan(source=source, arch=arch, launches=(launch,), ir_text="target sm80\n",
                      problem_text="gemm m=32 n=32 k=32", **kw)


# ---------------------------------------------------------------------------------------------------------------
# Pure logic: no compiler needed.
# ---------------------------------------------------------------------------------------------------------------


def test_gencode_builds_sm80_features_as_device_sass():
    # An sm_80 cubin does not load on an sm_90 GPU: the SASS must be the device's, built at the device's feature
    # level so the kernels' guarded griddepcontrol.wait (programmatic dependent launch) compiles in.
    assert gencode("sm_80", "sm_90") == ("compute_90", "sm_90")
    assert gencode("sm_80", "sm_80") == ("compute_80", "sm_80")
    assert gencode("sm_90", "sm_90") == ("compute_90", "sm_90")


def test_gencode_keeps_arch_specific_features():
    # wgmma exists only in compute_90a/sm_90a; building compute_90 would reject it.
    assert gencode("sm_90a", "sm_90") == ("compute_90a", "sm_90a")


@pytest.mark.parametrize("plan_arch,device", [("sm_90a", "sm_80"), ("sm_90", "sm_80"), ("sm_90a", "sm_100"),
                                              ("sm90", "sm_90"), ("sm_90", "90")])
def test_gencode_rejects_impossible_pairs(plan_arch, device):
    with pytest.raises(ArchError):
        gencode(plan_arch, device)


def test_parse_ptxas_per_function():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gemm' for 'sm_90a'
ptxas info    : Function properties for gemm
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 512 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for _Z6helperv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    res = parse_ptxas(log)
    g = res["gemm"]
    assert (g.registers, g.barriers, g.smem_static, g.stack_frame, g.spill_stores, g.spill_loads, g.entry) == \
        (168, 1, 512, 8, 12, 16, True)
    assert not res["_Z6helperv"].entry


# ---------------------------------------------------------------------------------------------------------------
# With nvcc.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_compile_then_cache_hit(tmp_path, compiler):
    if compiler == "nvrtc" and not _have_nvrtc():
        pytest.skip("cuda-python NVRTC bindings are not installed")
    opts = CompileOptions(cache_dir=str(tmp_path), compiler=compiler)
    first = compile_plan(plan(), opts)
    assert first.ok, first.log
    assert not first.cached and first.compile_seconds > 0
    assert first.binary.name == "kernel.cubin" and first.binary.stat().st_size > 0
    res = first.resources["copy_tile"]
    assert res.entry and res.registers > 0 and res.smem_static == 1024
    for name in ("kernel.l2", "problem.txt", "kernel.cu", "compile.log", "resources.json", "command.sh"):
        assert (first.dir / name).is_file(), name
    assert (first.dir / "kernel.cu").read_text() == SOURCE
    assert json.loads((first.dir / "resources.json").read_text())["copy_tile"]["registers"] == res.registers

    second = compile_plan(plan(), opts)
    assert second.ok and second.cached and second.key == first.key
    assert second.binary.read_bytes() == first.binary.read_bytes()
    assert second.resources == first.resources


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_nvcc_command_uses_gencode_for_the_device(tmp_path):
    art = compile_plan(plan(), CompileOptions(cache_dir=str(tmp_path), device_sm="sm_90"))
    assert art.ok
    assert "-gencode=arch=compute_90,code=sm_90" in art.command and " -cubin " in art.command
    assert "-arch" not in art.command.replace("-gencode=arch", "")


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_cache_key_changes_with_flags_and_source(tmp_path):
    opts = CompileOptions(cache_dir=str(tmp_path))
    base = cache_key(plan(), opts)
    assert cache_key(plan(), opts) == base
    assert cache_key(plan(extra_flags=("-DTILE=64",)), opts) != base
    assert cache_key(plan(), CompileOptions(cache_dir=str(tmp_path), opt="-O2")) != base
    assert cache_key(plan(), CompileOptions(cache_dir=str(tmp_path), device_sm="sm_100")) != base
    assert cache_key(plan(source=SOURCE + "// edited\n"), opts) != base
    # The cache directory is where entries live, not what they are.
    assert cache_key(plan(), CompileOptions(cache_dir=str(tmp_path / "other"))) == base


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_syntax_error_is_recorded_not_raised(tmp_path):
    bad = plan(source=SOURCE + "\nint broken = ;\n")
    results = compile_many([bad, plan()], CompileOptions(cache_dir=str(tmp_path), jobs=2))
    fail, ok = results
    assert ok.ok
    assert not fail.ok and fail.reason == "error"
    assert "expected an expression" in fail.log
    assert "error" in fail.summary()
    assert fail.repro.startswith("cd ") and "nvcc" in fail.repro and "\n" not in fail.repro
    assert (fail.dir / "compile.log").read_text() == fail.log
    assert (fail.dir / "command.sh").read_text().strip() == fail.repro
    # The recorded command really reproduces the failure.
    import subprocess
    rerun = subprocess.run(fail.repro, shell=True, capture_output=True, text=True)
    assert rerun.returncode != 0 and "expected an expression" in rerun.stdout + rerun.stderr
    again = compile_plan(bad, CompileOptions(cache_dir=str(tmp_path)))
    assert not again.ok and again.cached


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_timeout_kills_the_compiler(tmp_path):
    res = compile_plan(plan(), CompileOptions(cache_dir=str(tmp_path), timeout_s=0.01))
    assert not res.ok and res.reason == "timeout" and "killed" in res.log
    # A timeout is not cached: the next try compiles.
    assert compile_plan(plan(), CompileOptions(cache_dir=str(tmp_path))).ok


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_host_shim_builds_a_shared_library(tmp_path):
    shim = LaunchPlan(source=SHIM, arch="sm_80", form="host_shim")
    art = compile_plan(shim, CompileOptions(cache_dir=str(tmp_path)))
    assert art.ok, art.log
    assert art.binary.name == "kernel.so" and "-shared" in art.command
    import ctypes
    lib = ctypes.CDLL(str(art.binary))        # loads without a GPU: the runtime is linked statically
    assert hasattr(lib, "l2ir_run") and hasattr(lib, "l2ir_workspace_size")


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
@pytest.mark.parametrize("form", ["kernels", "host_shim"])
def test_keep_leaves_the_ptx_and_cubins_not_the_intermediates(tmp_path, form):
    """-keep's PTX and device cubins stay in the entry; the preprocessed sources, host-side files and objects
    (tens of MB a CUTLASS unit, which filled a test machine's disk) are removed, failures' entries too."""
    p = plan() if form == "kernels" else LaunchPlan(source=SHIM, arch="sm_80", form="host_shim")
    art = compile_plan(p, CompileOptions(cache_dir=str(tmp_path), keep=True))
    assert art.ok, art.log
    names = {f.name for f in art.dir.iterdir()}
    assert ".entry" in art.ptx() and "-keep" in art.command
    assert any(n.endswith(".cubin") for n in names) and art.binary.name in names
    assert {"kernel.cu", "compile.log", "command.sh", "result.json"} <= names
    assert not [n for n in names if n.endswith((".ii", ".o", ".fatbin", ".fatbin.c", ".module_id"))
                or ".cudafe1." in n], sorted(names)
    bad = compile_plan(plan(source=SOURCE.replace("__syncthreads();", "__syncthreads()")),
                       CompileOptions(cache_dir=str(tmp_path), keep=True))
    assert not bad.ok and not [f for f in bad.dir.iterdir() if f.name.endswith(".ii")]


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_nvrtc_refuses_host_shim(tmp_path):
    pytest.importorskip("cuda.bindings", reason="NVRTC needs cuda-python: pip install 'l2ir[cuda]'")
    res = compile_plan(LaunchPlan(source=SHIM, arch="sm_80", form="host_shim"),
                       CompileOptions(cache_dir=str(tmp_path), compiler="nvrtc"))
    assert not res.ok and "host_shim" in res.log


@pytest.mark.nvcc
@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not on PATH")
def test_compile_many_in_parallel_keeps_order(tmp_path):
    plans = [plan(extra_flags=(f"-DVARIANT={i}",)) for i in range(4)]
    results = compile_many(plans, CompileOptions(cache_dir=str(tmp_path), jobs=4))
    assert all(r.ok for r in results)
    assert len({r.key for r in results}) == 4
    for i, r in enumerate(results):
        assert f"-DVARIANT={i}" in r.command


def test_default_jobs_follow_usable_cpus_and_the_memory_the_builds_need(monkeypatch):
    """jobs=0: one compile per usable CPU, unless the available memory holds fewer builds at their peak (a CUTLASS
    translation unit takes several GB); never fewer than one; unknown memory leaves the CPU count."""
    from l2ir.backends import compile as comp

    cutlass = LaunchPlan(source="", arch="sm_90a", needs_cutlass=True)
    raw = LaunchPlan(source="", arch="sm_90a")
    monkeypatch.setattr(comp, "usable_cpus", lambda: 16)
    monkeypatch.setattr(comp, "available_memory_bytes", lambda: 128 * 2 ** 30)
    assert comp.default_jobs([raw] * 20) == 16
    assert comp.default_jobs([raw, cutlass]) == 16          # 39 CUTLASS builds fit; the CPUs bound it
    monkeypatch.setattr(comp, "available_memory_bytes", lambda: 20 * 2 ** 30)
    assert comp.default_jobs([raw] * 20) == 16              # 21 raw builds fit
    assert comp.default_jobs([raw, cutlass]) == 20 * 2 ** 30 // comp.COMPILE_PEAK_BYTES_CUTLASS == 6
    monkeypatch.setattr(comp, "available_memory_bytes", lambda: 10 ** 8)
    assert comp.default_jobs([cutlass]) == 1
    monkeypatch.setattr(comp, "available_memory_bytes", lambda: None)
    assert comp.default_jobs([cutlass]) == 16


def test_available_memory_is_the_lower_of_meminfo_and_the_cgroup_limit(monkeypatch, tmp_path):
    from l2ir.backends import compile as comp

    files = {"/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:   8000000 kB\n",
             "/sys/fs/cgroup/memory.max": "4000000000\n", "/sys/fs/cgroup/memory.current": "1500000000\n",
             "/sys/fs/cgroup/memory.stat": "anon 900000000\ninactive_file 500000000\nactive_file 100000000\n"}

    def read_text(self, *a, **k):
        if str(self) not in files:
            raise FileNotFoundError(str(self))
        return files[str(self)]

    monkeypatch.setattr(comp.Path, "read_text", read_text)
    assert comp.available_memory_bytes() == 3_000_000_000       # 4 GB limit - (1.5 GB used - 0.5 GB reclaimable)
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert comp.available_memory_bytes() == 8_000_000 * 1024
    del files["/proc/meminfo"]
    assert comp.available_memory_bytes() is None
    monkeypatch.setattr(comp.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert comp.usable_cpus() == 16                             # no cpu.max: the affinity mask
    files["/sys/fs/cgroup/cpu.max"] = "250000 100000\n"
    assert comp.usable_cpus() == 3                              # a 2.5-CPU quota: 3 jobs
    files["/sys/fs/cgroup/cpu.max"] = "max 100000\n"
    assert comp.usable_cpus() == 16
