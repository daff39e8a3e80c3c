"""The runtime: what a backend hands to the compiler and how a compiled kernel is launched.

This is the one layer that the evaluator and `l2ir.matmul` both import; it never imports the search.

A LaunchPlan comes in two forms:
- `kernels`: a CUDA translation unit whose `extern "C" __global__` entry points all take the L2IR ABI
      (const void* A, const void* B, void* C, int M, int N, int K, void* workspace)
  and are launched by the harness, in order, on one stream, each over its grid (expressions of m, n, k). The
  candidate's code never runs host code: this is the form for generated schedules and LLM-written Source.
- `host_shim`: a shared library built from backend-generated (trusted) host code, for libraries such as CUTLASS 3.x
  whose kernels need host-side setup (TMA descriptors, tile-scheduler params). It exports
      extern "C" size_t l2ir_workspace_size(int M, int N, int K);
      extern "C" int    l2ir_run(const void* A, const void* B, void* C, int M, int N, int K,
                                 void* workspace, size_t workspace_bytes, void* stream);   // 0 = success
  and returns one of the STATUS codes below. It also exports the same call through one pointer,
      extern "C" int    l2ir_run_args(const L2irRunArgs* args);   // the fields of RunArgs below
  which l2ir.matmul uses: a route binds the shape once and fills five fields a call (ctypes converts one argument
  instead of nine).

Launching (GPU side):
- "kernels" plans: the cubin is loaded with the driver API (cuModuleLoadData) into the primary context that torch
  uses, each entry launched in plan order with cuLaunchKernel (cuLaunchKernelEx when the launch has a cluster).
  Launches go to `torch.cuda.current_stream()` at call time, so they are captured by `torch.cuda.graph`.
- "host_shim" plans: the shared library's l2ir_run is called through ctypes with the same stream.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

from .indexing import Const, Expr, eval_launch_expr


@dataclass(frozen=True)
class Launch:
    entry: str
    grid: tuple[Expr, Expr, Expr]
    block: tuple[int, int, int]
    smem: int = 0                                 # dynamic shared memory, bytes
    cluster: tuple[int, int, int] = (1, 1, 1)     # thread-block cluster (sm90), launched with cuLaunchKernelEx
    # Programmatic dependent launch (sm90): the kernel executes griddepcontrol.wait before its first global memory
    # access, so it may be launched while the stream's previous grid drains; its blocks are placed and run their
    # prologue meanwhile instead of after the previous grid's completion and memory flush. Its backend sets it for
    # code that holds the wait (guarded by __CUDA_ARCH__ >= 900); the launcher applies it on sm90+ GPUs only, whose
    # cubins are all built at compute_90 or later (backends.compile.gencode), so the wait is compiled in.
    pdl: bool = False

    def grid_for(self, m: int, n: int, k: int) -> tuple[int, int, int]:
        return tuple(eval_launch_expr(e, m, n, k) for e in self.grid)  # type: ignore[return-value]


@dataclass(frozen=True)
class LaunchPlan:
    source: str                                   # the whole .cu file
    arch: str                                     # nvcc arch, e.g. "sm_80" or "sm_90a"
    form: str = "kernels"                         # "kernels" or "host_shim"
    launches: tuple[Launch, ...] = ()             # for form == "kernels"
    workspace_bytes: Expr = Const(0)              # expression of m, n, k
    # The harness memsets the workspace once, before the first launch; every launch must leave it as it found it
    # where that matters (split-K pair counters, atomic sums): the evaluator times and checks repeated launches on
    # one workspace and l2ir.matmul reuses one per stream, so no per-call memset is paid or hidden.
    zero_workspace: bool = False
    needs_cutlass: bool = False                   # add the CUTLASS/CuTe include path
    ir_text: str = ""                             # the kernel's IR text, kept beside the source in the cache
    problem_text: str = ""                        # the problem class (dtypes, layouts) the source was lowered for
    extra_flags: tuple[str, ...] = field(default=())

    def workspace_for(self, m: int, n: int, k: int) -> int:
        return eval_launch_expr(self.workspace_bytes, m, n, k)


# ---------------------------------------------------------------------------------------------------------------
# The host-shim ABI: l2ir_run's return codes, one table for every backend that emits a shim.
# 1..11 are cutlass::Status values (CUTLASS's can_implement / initialize / run refusals); L2IR's own codes start at
# 101 so they never collide with them. A shim that is not CUTLASS uses 1 for a misaligned operand, as CUTLASS does.
# ---------------------------------------------------------------------------------------------------------------

STATUS_SUCCESS = 0
STATUS_MISALIGNED = 1                 # cutlass::Status::kErrorMisalignedOperand; TMA's 16-byte rule, store vectors
STATUS_WORKSPACE_TOO_SMALL = 101      # the library needs more workspace than the harness passed
STATUS_NOT_DIVISIBLE = 102            # the shape breaks a pad=divisible promise
STATUS_BAD_ARGUMENT = 103             # null pointer or non-positive size
STATUS_CUDA_ERROR = 104               # a CUDA runtime call failed (launch, attribute, device query)
STATUS_EXCEPTION = 105                # a C++ exception escaped the library
STATUS_TENSOR_MAP = 106               # cuTensorMapEncodeTiled is unavailable or refused an operand

OWN_STATUS_NAMES = {
    STATUS_WORKSPACE_TOO_SMALL: "workspace too small", STATUS_NOT_DIVISIBLE: "shape violates pad=divisible",
    STATUS_BAD_ARGUMENT: "bad argument", STATUS_CUDA_ERROR: "CUDA runtime error", STATUS_EXCEPTION: "C++ exception",
    STATUS_TENSOR_MAP: "tensor map encode failed",
}
CUTLASS_STATUS_NAMES = (
    "kSuccess", "kErrorMisalignedOperand", "kErrorInvalidDataType", "kErrorInvalidLayout", "kErrorInvalidProblem",
    "kErrorNotSupported", "kErrorWorkspaceNull", "kErrorInternal", "kErrorArchMismatch", "kErrorInsufficientDriver",
    "kErrorMemoryAllocation", "kInvalid",
)


def status_name(code: int) -> str:
    """A readable name for an l2ir_run return code."""
    if code in OWN_STATUS_NAMES:
        return OWN_STATUS_NAMES[code]
    if 0 <= code < len(CUTLASS_STATUS_NAMES):
        return "cutlass::Status::" + CUTLASS_STATUS_NAMES[code]
    return f"unknown status {code}"


def status_constants_cpp(*codes: str) -> list[str]:
    """`constexpr int L2IR_STATUS_<NAME> = <code>;` lines for a shim's source, e.g. ("NOT_DIVISIBLE", "BAD_ARGUMENT")."""
    return [f"constexpr int L2IR_STATUS_{name} = {globals()['STATUS_' + name]};" for name in codes]

# Programmatic dependent launch in a host shim: l2ir_run launches with programmatic stream serialization while this
# macro is non-zero. The backend picks the default; building with -DL2IR_PDL=0 gives the ordinary launch of the
# same kernel (bench/pdl_probe.py compares the two).
PDL_MACRO = "L2IR_PDL"


def pdl_macro_cpp(default_on: bool) -> list[str]:
    """The lines that define PDL_MACRO in a shim's source unless the build already did."""
    return [f"#ifndef {PDL_MACRO}", f"#define {PDL_MACRO} {int(default_on)}", "#endif"]


def grid_wait_lines(indent: str = "  ") -> list[str]:
    """griddepcontrol.wait before the kernel's first global memory access: under programmatic dependent launch the
    grid may start while the stream's previous grid still runs; the wait returns once that grid has completed and
    its stores are visible (its reads are done too, so C may be overwritten). A no-op on an ordinary launch."""
    return [
        f"{indent}// Programmatic dependent launch (runtime.Launch.pdl): no global access before the previous grid is done.",
        "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900",
        f'{indent}asm volatile("griddepcontrol.wait;" ::: "memory");',
        "#endif",
    ]


def grid_launch_dependents_lines(indent: str = "  ") -> list[str]:
    """griddepcontrol.launch_dependents once a block's main loop is done: when every block of this grid has passed
    it (or exited), the stream's next grid may be placed on the SMs this one frees and run its prologue up to its own
    wait, instead of starting after this grid's completion. It orders nothing; the next grid's wait does."""
    return [
        f"{indent}// The next grid may start its prologue once every block is past its main loop (its wait orders it).",
        "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900",
        f'{indent}asm volatile("griddepcontrol.launch_dependents;" ::: "memory");',
        "#endif",
    ]


# l2ir_run's arguments as one block (l2ir_run_args): (name, C type, ctypes type), in l2ir_run's order. The C struct
# and the ctypes Structure are both made from this list, so their layouts agree (natural alignment on both sides).
RUN_ARGS_FIELDS = (("a", "const void*", ctypes.c_void_p), ("b", "const void*", ctypes.c_void_p),
                   ("c", "void*", ctypes.c_void_p), ("m", "int", ctypes.c_int), ("n", "int", ctypes.c_int),
                   ("k", "int", ctypes.c_int), ("workspace", "void*", ctypes.c_void_p),
                   ("workspace_bytes", "size_t", ctypes.c_size_t), ("stream", "void*", ctypes.c_void_p))


class RunArgs(ctypes.Structure):
    """The argument block l2ir_run_args reads."""
    _fields_ = [(name, ctype) for name, _, ctype in RUN_ARGS_FIELDS]


def run_args_cpp() -> list[str]:
    """The C++ lines of l2ir_run_args, which every host shim ends with (after l2ir_run): the block, unpacked."""
    return [
        "// l2ir_run through one pointer to its arguments (l2ir.runtime.RUN_ARGS_FIELDS): a caller that binds a shape",
        "// once fills five fields a call.",
        "struct L2irRunArgs {",
        *(f"  {ctype} {name};" for name, ctype, _ in RUN_ARGS_FIELDS),
        "};",
        "",
        'extern "C" int l2ir_run_args(const L2irRunArgs* p) {',
        "  if (p == nullptr) return L2IR_STATUS_BAD_ARGUMENT;",
        "  return l2ir_run(" + ", ".join(f"p->{name}" for name, _, _ in RUN_ARGS_FIELDS) + ");",
        "}",
        "",
    ]


# Above 48 KiB, dynamic shared memory must be opted into per function (the default carve-out limit of every SM
# since Volta); H100/H200 allow up to 227 KiB per block.
DEFAULT_DYNAMIC_SMEM = 48 * 1024




# ---------------------------------------------------------------------------------------------------------------
# Launchers (GPU side: cuda-python and torch are imported on first use).
# ---------------------------------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """The driver refused a launch or a module (bad smem size, missing entry, no SASS for this GPU)."""


def _check(result, what: str):
    """cuda-python returns (CUresult, *values); raise LaunchError with the error's name on failure."""
    from cuda.bindings import driver as cu

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        raise LaunchError(f"{what}: {name.decode() if name else err} ({text.decode() if text else ''})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def current_stream() -> int:
    import torch

    return torch.cuda.current_stream().cuda_stream


class CubinLauncher:
    """Loads a "kernels" plan's cubin; calling it runs every launch of the plan for one problem size."""

    def __init__(self, plan: LaunchPlan, binary: Path, device: int = 0):
        from cuda.bindings import driver as cu

        self.plan = plan
        _check(cu.cuInit(0), "cuInit")
        dev = _check(cu.cuDeviceGet(device), "cuDeviceGet")
        # torch's runtime API lives in the device's primary context; loading the module there lets the kernels use
        # torch's buffers and streams directly.
        self._ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._module = _check(cu.cuModuleLoadData(Path(binary).read_bytes()), f"cuModuleLoadData({binary})")
        # Programmatic dependent launch exists from sm90 on; elsewhere a pdl launch is an ordinary one.
        major = _check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
        self._pdl_device = major >= 9
        self._funcs = []
        for launch in plan.launches:
            fn = _check(cu.cuModuleGetFunction(self._module, launch.entry.encode()),
                        f"cuModuleGetFunction('{launch.entry}')")
            if launch.smem > DEFAULT_DYNAMIC_SMEM:
                _check(cu.cuFuncSetAttribute(
                    fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.smem),
                    f"cuFuncSetAttribute('{launch.entry}', max dynamic smem = {launch.smem})")
            csize = launch.cluster[0] * launch.cluster[1] * launch.cluster[2]
            if csize > 8:
                # Clusters above 8 blocks are "non-portable" and must be allowed explicitly (Hopper allows 16).
                _check(cu.cuFuncSetAttribute(
                    fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                    f"cuFuncSetAttribute('{launch.entry}', non-portable cluster)")
            self._funcs.append(fn)

    def workspace_bytes(self, m: int, n: int, k: int) -> int:
        return self.plan.workspace_for(m, n, k)

    def __call__(self, a: int, b: int, c: int, m: int, n: int, k: int, ws: int, ws_bytes: int,
                 stream: int | None = None):
        from cuda.bindings import driver as cu

        hstream = cu.CUstream(current_stream() if stream is None else stream)
        # The ABI: (const void* A, const void* B, void* C, int M, int N, int K, void* workspace). kernelParams is
        # an array of pointers to each argument's value; the driver copies the values at launch (and at capture).
        args = [ctypes.c_void_p(a), ctypes.c_void_p(b), ctypes.c_void_p(c), ctypes.c_int(m), ctypes.c_int(n),
                ctypes.c_int(k), ctypes.c_void_p(ws)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
        for fn, launch in zip(self._funcs, self.plan.launches):
            gx, gy, gz = launch.grid_for(m, n, k)
            if gx * gy * gz == 0:
                continue
            bx, by, bz = launch.block
            pdl = launch.pdl and self._pdl_device
            if launch.cluster == (1, 1, 1) and not pdl:
                _check(cu.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, launch.smem, hstream,
                                         ctypes.addressof(params), 0),
                       f"cuLaunchKernel('{launch.entry}', grid=({gx},{gy},{gz}), block={launch.block}, "
                       f"smem={launch.smem})")
                continue
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
            config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
            config.sharedMemBytes = launch.smem
            config.hStream = hstream
            attrs = []
            if launch.cluster != (1, 1, 1):
                attr = cu.CUlaunchAttribute()
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = launch.cluster
                attrs.append(attr)
            if pdl:
                attr = cu.CUlaunchAttribute()
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
                attrs.append(attr)
            config.attrs = attrs
            config.numAttrs = len(attrs)
            _check(cu.cuLaunchKernelEx(config, fn, ctypes.addressof(params), 0),
                   f"cuLaunchKernelEx('{launch.entry}', grid=({gx},{gy},{gz}), cluster={launch.cluster}, "
                   f"pdl={pdl})")

    def close(self):
        from cuda.bindings import driver as cu

        if self._module is not None:
            cu.cuModuleUnload(self._module)
            self._module = None


class ShimLauncher:
    """A host_shim plan's shared library (trusted backend code that sets up TMA descriptors and launches)."""

    def __init__(self, plan: LaunchPlan, binary: Path, device: int = 0):
        self.plan = plan
        self._lib = ctypes.CDLL(str(binary), mode=ctypes.RTLD_LOCAL)
        self._lib.l2ir_workspace_size.argtypes = [ctypes.c_int] * 3
        self._lib.l2ir_workspace_size.restype = ctypes.c_size_t
        self._lib.l2ir_run.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_size_t,
                                                                                      ctypes.c_void_p]
        self._lib.l2ir_run.restype = ctypes.c_int

    def workspace_bytes(self, m: int, n: int, k: int) -> int:
        return int(self._lib.l2ir_workspace_size(m, n, k))

    def __call__(self, a: int, b: int, c: int, m: int, n: int, k: int, ws: int, ws_bytes: int,
                 stream: int | None = None):
        s = current_stream() if stream is None else stream
        rc = self._lib.l2ir_run(a, b, c, m, n, k, ws, ws_bytes, s)
        if rc != STATUS_SUCCESS:
            raise LaunchError(f"l2ir_run returned {rc} ({status_name(rc)}) for m={m} n={n} k={k}")

    def close(self):
        pass


def load(plan: LaunchPlan, binary: Path, device: int = 0):
    if plan.form == "kernels":
        return CubinLauncher(plan, binary, device)
    if plan.form == "host_shim":
        return ShimLauncher(plan, binary, device)
    raise LaunchError(f"unknown plan form '{plan.form}'")
