"""Compile a LaunchPlan to a loadable artifact (a cubin, or a shared library for host-shim plans).

Stages, each left on disk in a content-addressed cache entry:
    kernel.l2 (IR text), problem.txt, kernel.cu  ->  nvcc or NVRTC  ->  kernel.cubin | kernel.so,
    compile.log (ptxas -v included), resources.json (registers, smem, stack, spills per function), command.sh.
The key is sha256(source, flags, toolchain version, CUTLASS version), so a changed flag or compiler never reuses an old
binary, and the same candidate proposed twice by the search compiles once.

Every compile runs in a child process in its own process group (nvcc forks cicc and ptxas; NVRTC runs in a Python
child), so a per-job timeout kills the whole tree and a compiler crash never takes the caller down. Failures come
back as `CompileFailure` records carrying the log and a one-line shell command that reproduces them.

Arch handling. A plan's `arch` is the feature level its code uses (sm_80: mma.sync/cp.async; sm_90a: wgmma/TMA).
The SASS must be built for the GPU that runs it: an sm_80 cubin does not load on an sm_90 GPU, so sm_80-level code
is built as `-gencode=arch=compute_90,code=sm_90` for an H200: at the device's own feature level, where the kernels'
guarded griddepcontrol.wait exists (`__CUDA_ARCH__ >= 900`), so every cubin an sm90 GPU loads holds it and may be
launched with programmatic dependent launch (runtime.Launch.pdl). Arch-specific ("a") plans only exist for one SM, so
they keep `code=sm_90a`. Never `-arch=sm_90a -c`: that also builds compute_90 PTX, which rejects wgmma.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from l2ir.errors import L2IRError
from l2ir.target import DEVICE_SM

from l2ir.runtime import LaunchPlan

REPO_ROOT = Path(__file__).resolve().parents[1]


class CompileError(L2IRError):
    """A plan that did not compile; `failure` is the recorded CompileFailure (log, repro command)."""

    def __init__(self, failure: "CompileFailure"):
        self.failure = failure
        super().__init__(f"compile {failure.reason} (key {failure.key[:12]}): {failure.summary()}\n"
                         f"reproduce: {failure.repro}")


class ArchError(L2IRError):
    """The plan's arch cannot be built for the device SM (e.g. sm_90a code for an sm_80 GPU)."""


@dataclass(frozen=True)
class CompileOptions:
    """How to compile. Passed in explicitly; nothing here is read from the environment."""

    device_sm: str = DEVICE_SM               # the GPU that will run the code (H200 = sm_90)
    compiler: str = "nvcc"                   # "nvcc" or "nvrtc" (NVRTC: "kernels" plans only)
    cache_dir: str = ".l2ir-cache"
    nvcc: str = "nvcc"                       # nvcc executable (name on PATH or a path)
    python: str = sys.executable             # interpreter for the NVRTC child process
    opt: str = "-O3"
    lineinfo: bool = True                    # source lines in SASS for the profiler; does not change codegen
    keep: bool = False                       # nvcc -keep: the PTX and device cubins stay in the cache entry
    timeout_s: float = 600.0                 # per job; CUTLASS 3.x translation units take minutes
    jobs: int = 0                            # parallel compiles; 0 = per CPU and memory (default_jobs)
    cuda_include: tuple[str, ...] | None = None     # None: ask nvcc where its headers are
    cutlass_include: tuple[str, ...] | None = None  # None: from the nvidia-cutlass wheel


# ---------------------------------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FunctionResources:
    """What ptxas reports for one function (-Xptxas -v)."""

    registers: int = 0
    smem_static: int = 0        # bytes of static __shared__ (dynamic smem is set at launch)
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0
    entry: bool = False         # a __global__ entry point (not a non-inlined device function)


@dataclass(frozen=True)
class Artifact:
    ok: bool = field(default=True, init=False)
    key: str = ""
    dir: Path = Path()
    binary: Path = Path()             # kernel.cubin or kernel.so
    form: str = "kernels"
    compile_seconds: float = 0.0      # of the compile that built it (also when served from the cache)
    cached: bool = False
    resources: dict[str, FunctionResources] = field(default_factory=dict)
    command: str = ""
    log: str = ""

    def ptx(self) -> str:
        """The PTX the compile produced, when it was built with CompileOptions(keep=True); "" otherwise."""
        return "\n".join(p.read_text() for p in sorted(self.dir.glob("*.ptx")))


@dataclass(frozen=True)
class CompileFailure:
    ok: bool = field(default=False, init=False)
    key: str = ""
    reason: str = "error"             # "error" (compiler rejected it), "timeout", "toolchain" (compiler missing)
    log: str = ""
    repro: str = ""                   # one shell line that reproduces the failure
    dir: Path | None = None
    compile_seconds: float = 0.0
    cached: bool = False

    def summary(self) -> str:
        """The first error line of the log (what a search record shows)."""
        for line in self.log.splitlines():
            if "error" in line.lower():
                return line.strip()
        lines = [ln for ln in self.log.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else self.reason

    def raise_(self):
        raise CompileError(self)


CompileResult = Artifact | CompileFailure


# ---------------------------------------------------------------------------------------------------------------
# Arch, toolchain, flags.
# ---------------------------------------------------------------------------------------------------------------

_ARCH = re.compile(r"^sm_(\d+)(a?)$")


def gencode(plan_arch: str, device_sm: str) -> tuple[str, str]:
    """(virtual, real) arch for a plan on a device: ("compute_90", "sm_90") builds sm_80-level code for an sm_90 GPU, at
    the device's feature level (the code uses sm_80's instructions; guarded sm_90 ones, such as griddepcontrol for
    programmatic dependent launch, then compile in too)."""
    pm, dm = _ARCH.match(plan_arch), _ARCH.match(device_sm)
    if not pm:
        raise ArchError(f"plan arch '{plan_arch}' is not of the form sm_XY or sm_XYa")
    if not dm:
        raise ArchError(f"device SM '{device_sm}' is not of the form sm_XY")
    p, specific, d = int(pm.group(1)), pm.group(2) == "a", int(dm.group(1))
    if specific:
        # Arch-specific features (wgmma, setmaxnreg) exist on that one SM only: no other SASS target can hold them.
        if p != d:
            raise ArchError(f"{plan_arch} code runs only on sm_{p} GPUs; the device is {device_sm}")
        return f"compute_{p}a", f"sm_{p}a"
    if p > d:
        raise ArchError(f"{plan_arch} code uses features the {device_sm} device does not have")
    return f"compute_{d}", f"sm_{d}"


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise FileNotFoundError(f"{nvcc} --version failed: {out.stderr.strip()}")
    return out.stdout.strip()


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return f"nvrtc {major}.{minor}"


@functools.lru_cache(maxsize=None)
def host_compiler_version() -> str:
    """The host C++ compiler nvcc uses for host code (part of a host shim's cache key)."""
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def cutlass_version() -> str | None:
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def nvcc_include_dirs(nvcc: str) -> tuple[str, ...]:
    """The CUDA headers nvcc itself uses (NVRTC has no search path of its own for cuda_fp16.h and friends)."""
    out = subprocess.run([nvcc, "--dryrun", "-cubin", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True, timeout=60)
    dirs: list[str] = []
    for line in (out.stdout + out.stderr).splitlines():
        m = re.search(r'INCLUDES="(.*)"', line)
        if m:
            dirs += [tok[2:] for tok in shlex.split(m.group(1)) if tok.startswith("-I")]
        if "SYSTEM_INCLUDES" in line:
            m = re.search(r'SYSTEM_INCLUDES="(.*)"', line)
            toks = shlex.split(m.group(1).replace('"', " ")) if m else []
            dirs += [t for t in toks if not t.startswith("-")]
    return tuple(os.path.normpath(d) for d in dirs if os.path.isdir(d))


def cutlass_include_dirs() -> tuple[str, ...]:
    try:
        import cutlass_library
    except ImportError:
        raise FileNotFoundError("the plan needs CUTLASS/CuTe headers: pip install nvidia-cutlass") from None
    root = Path(cutlass_library.source_path)
    dirs = [root / "include", root / "tools" / "util" / "include"]
    return tuple(str(d) for d in dirs if d.is_dir())


def _flags(plan: LaunchPlan, options: CompileOptions) -> tuple[list[str], list[str]]:
    """(flags, include flags). Flags enter the cache key as they are; includes enter as the CUTLASS version, so
    the same headers at another path still hit the cache."""
    virt, real = gencode(plan.arch, options.device_sm)
    includes: list[str] = []
    if options.compiler == "nvcc":
        flags = [f"-gencode=arch={virt},code={real}", options.opt, "-std=c++17", "-Xptxas=-v"]
    else:
        # NVRTC builds SASS for one real arch directly (the feature level is the SASS target's).
        flags = [f"--gpu-architecture={real}", "-std=c++17", "-Xptxas", "-v"]
        cuda_inc = options.cuda_include if options.cuda_include is not None else nvcc_include_dirs(options.nvcc)
        includes += [f"-I{d}" for d in cuda_inc]
    if options.lineinfo:
        flags.append("-lineinfo")
    if options.keep and options.compiler == "nvcc":
        flags.append("-keep")
    if plan.needs_cutlass:
        # CuTe's layout algebra is constexpr host/device code; NDEBUG removes CUTE_STATIC/runtime asserts in kernels.
        flags += ["--expt-relaxed-constexpr", "-DNDEBUG"]
        inc = options.cutlass_include if options.cutlass_include is not None else cutlass_include_dirs()
        includes += [f"-I{d}" for d in inc]
    flags += list(plan.extra_flags)
    return flags, includes


def cache_key(plan: LaunchPlan, options: CompileOptions) -> str:
    flags, _ = _flags(plan, options)
    toolchain = nvcc_version(options.nvcc) if options.compiler == "nvcc" else nvrtc_version()
    material = {
        "source": plan.source,
        "form": plan.form,
        "compiler": options.compiler,
        "flags": flags,
        "toolchain": toolchain,
        "cutlass": cutlass_version() if plan.needs_cutlass else None,
        # Environment variables nvcc reads change the binary too; host shims also contain host-compiled code.
        "nvcc_env": {v: os.environ.get(v) for v in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")},
        "host_compiler": host_compiler_version() if plan.form == "host_shim" else None,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _command(plan: LaunchPlan, options: CompileOptions) -> tuple[list[str], dict[str, str] | None, str]:
    """(argv, extra env, binary name), run with cwd = the cache entry."""
    flags, includes = _flags(plan, options)
    if options.compiler == "nvrtc":
        if plan.form != "kernels":
            raise ArchError("NVRTC builds device code only; a host_shim plan needs nvcc")
        argv = [options.python, "-m", "l2ir.backends.compile", "--nvrtc", "kernel.cu", "-o", "kernel.cubin", "--",
                *flags, *includes]
        # The child sees the packages this process sees (wheels installed with --target, a venv, the repo).
        path = os.pathsep.join(dict.fromkeys([str(REPO_ROOT)] + [p for p in sys.path if p]))
        return argv, {"PYTHONPATH": path}, "kernel.cubin"
    if plan.form == "kernels":
        return [options.nvcc, "-cubin", *flags, *includes, "-o", "kernel.cubin", "kernel.cu"], None, "kernel.cubin"
    if plan.form == "host_shim":
        # The shim's host code launches through the runtime, linked statically so dlopen needs no rpath to a
        # libcudart.so. No -lcuda: CUTLASS reaches driver calls (cuTensorMapEncodeTiled) through
        # cudaGetDriverEntryPoint, and a GPU-less build machine has no libcuda to link; a plan that calls the driver
        # directly adds -lcuda to its extra_flags.
        return ([options.nvcc, "-shared", "-Xcompiler", "-fPIC", *flags, *includes, "-o", "kernel.so", "kernel.cu"],
                None, "kernel.so")
    raise ArchError(f"unknown plan form '{plan.form}' (expected kernels or host_shim)")


def _repro(entry_dir: Path, argv: list[str], env: dict[str, str] | None) -> str:
    env_part = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return f"cd {shlex.quote(str(entry_dir))} && " + (env_part + " " if env_part else "") + shlex.join(argv)


# ---------------------------------------------------------------------------------------------------------------
# ptxas -v parsing.
# ---------------------------------------------------------------------------------------------------------------

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_PROPS = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_BARRIERS = re.compile(r"used (\d+) barriers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, FunctionResources]:
    """Per-function resources from `-Xptxas -v` output (nvcc's stderr or NVRTC's program log)."""
    found: dict[str, dict] = {}
    entries: set[str] = set()
    current: str | None = None
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = m.group(1)
            entries.add(current)
            found.setdefault(current, {})
            continue
        if m := _PTXAS_PROPS.search(line):
            current = m.group(1).rstrip(":")
            found.setdefault(current, {})
            continue
        if current is None:
            continue
        if m := _PTXAS_STACK.search(line):
            found[current].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
        if m := _PTXAS_USED.search(line):
            found[current]["registers"] = int(m.group(1))
            if b := _PTXAS_BARRIERS.search(line):
                found[current]["barriers"] = int(b.group(1))
            if s := _PTXAS_SMEM.search(line):
                found[current]["smem_static"] = int(s.group(1))
    return {name: FunctionResources(entry=name in entries, **vals) for name, vals in found.items()}


# ---------------------------------------------------------------------------------------------------------------
# One compile, cached.
# ---------------------------------------------------------------------------------------------------------------


def _entry_dir(options: CompileOptions, key: str) -> Path:
    return Path(options.cache_dir).resolve() / key[:2] / key


def _load_cached(entry: Path, key: str) -> CompileResult | None:
    meta_path = entry / "result.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    log = (entry / "compile.log").read_text() if (entry / "compile.log").is_file() else ""
    if meta["status"] != "ok":
        return CompileFailure(key=key, reason=meta["status"], log=log, repro=meta["command"], dir=entry,
                              compile_seconds=meta["compile_seconds"], cached=True)
    resources = {name: FunctionResources(**r)
                 for name, r in json.loads((entry / "resources.json").read_text()).items()}
    return Artifact(key=key, dir=entry, binary=entry / meta["binary"], form=meta["form"],
                    compile_seconds=meta["compile_seconds"], cached=True, resources=resources,
                    command=meta["command"], log=log)


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None, timeout_s: float) -> tuple[int | None, str]:
    """Run a compiler in its own process group; on timeout kill the group. Returns (returncode or None, output)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace")
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return None, out + f"\n[killed after {timeout_s:.0f} s]\n"


# What nvcc -keep leaves beside the PTX and the cubins: the preprocessed translation units (.ii: 2 MB for a raw CUDA
# kernel, tens of MB for a CUTLASS 3.x one), the front end's host and stub sources, the fatbinary and the host object.
# None of them is read again (the PTX and SASS are), and the command in command.sh recreates them.
_INTERMEDIATE_SUFFIXES = (".ii", ".cudafe1.c", ".cudafe1.cpp", ".cudafe1.gpu", ".stub.c", ".fatbin", ".fatbin.c",
                          ".module_id", ".o", ".reg.c")


def _drop_intermediates(entry: Path, binary: str) -> None:
    for path in entry.iterdir():
        if path.name != binary and path.name.endswith(_INTERMEDIATE_SUFFIXES) and path.is_file():
            path.unlink()


def compile_plan(plan: LaunchPlan, options: CompileOptions = CompileOptions()) -> CompileResult:
    """Compile one plan (or fetch it from the cache). Never raises for a bad kernel: returns a CompileFailure."""
    t0 = time.perf_counter()
    try:
        key = cache_key(plan, options)
        argv, env, binary = _command(plan, options)
    except (FileNotFoundError, RuntimeError, ImportError) as e:
        return CompileFailure(key="", reason="toolchain", log=str(e), repro="",
                              compile_seconds=time.perf_counter() - t0)
    except ArchError as e:
        return CompileFailure(key="", reason="error", log=str(e), repro="",
                              compile_seconds=time.perf_counter() - t0)
    entry = _entry_dir(options, key)
    cached = _load_cached(entry, key)
    if cached is not None:
        return cached

    tmp = entry.parent.parent / ".tmp" / f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    (tmp / "kernel.cu").write_text(plan.source)
    (tmp / "kernel.l2").write_text(plan.ir_text)
    (tmp / "problem.txt").write_text(plan.problem_text + "\n")
    repro = _repro(entry, argv, env)
    (tmp / "command.sh").write_text(repro + "\n")

    t1 = time.perf_counter()
    code, log = _run(argv, tmp, env, options.timeout_s)
    seconds = time.perf_counter() - t1
    (tmp / "compile.log").write_text(log)

    if code is None or code < 0:
        # Not cached: a timeout or a compiler killed by a signal (the OOM killer, with many CUTLASS builds in
        # parallel) says as much about the machine's load as about the kernel.
        shutil.rmtree(tmp, ignore_errors=True)
        reason = "timeout" if code is None else "killed"
        return CompileFailure(key=key, reason=reason, log=log + f"\n(compiler {reason})", repro=repro,
                              compile_seconds=seconds)

    _drop_intermediates(tmp, binary)
    status = "ok" if code == 0 and (tmp / binary).is_file() else "error"
    resources = parse_ptxas(log) if status == "ok" else {}
    (tmp / "resources.json").write_text(json.dumps({n: asdict(r) for n, r in resources.items()}, indent=1,
                                                   sort_keys=True))
    meta = {"status": status, "binary": binary, "form": plan.form, "compile_seconds": round(seconds, 3),
            "command": repro, "returncode": code}
    (tmp / "result.json").write_text(json.dumps(meta, indent=1))
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(entry)
    except OSError:
        # Another process finished the same key first; its entry is identical in content.
        shutil.rmtree(tmp, ignore_errors=True)
    if status != "ok":
        return CompileFailure(key=key, reason="error", log=log, repro=repro, dir=entry, compile_seconds=seconds)
    return Artifact(key=key, dir=entry, binary=entry / binary, form=plan.form, compile_seconds=seconds,
                    cached=False, resources=resources, command=repro, log=log)


# Peak resident memory of one compile. The front end of a CUTLASS 3.x translation unit reached 3.2 GB on one sm90a
# kernel (sweep sm90a pingpong_128x128x64_c1x1, nvcc 13.0, CUTLASS 4.2); raw CUDA kernels stay well under 1 GB.
# A machine with many CPUs and less than this much memory per CPU runs out of memory at one job per CPU, and the
# kernel's OOM killer then takes compilers mid-build.
COMPILE_PEAK_BYTES_CUTLASS = 3_500_000_000
COMPILE_PEAK_BYTES = 1_000_000_000


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask (taskset, cpusets), no more than a cgroup v2 CPU quota
    (cpu.max, how containers usually limit CPUs) allows, at least one."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def available_memory_bytes() -> int | None:
    """Memory a new process can take: /proc/meminfo's MemAvailable, and no more than a cgroup v2 limit leaves
    (memory.max - memory.current, counting the cgroup's inactive page cache as free: the kernel reclaims it first).
    None where neither can be read (not Linux)."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            stat = dict(line.split() for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines()
                        if line.count(" ") == 1)
            used -= int(stat.get("inactive_file", 0))
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def machine_jobs(peak_bytes: int) -> int:
    """Compiles this machine runs at once: one per usable CPU, but no more than the available memory holds at
    `peak_bytes` each. At least one. Each process decides alone: several processes compiling at once on one
    machine (parallel test workers, several searches) must be given `CompileOptions.jobs` explicitly."""
    jobs = usable_cpus()
    memory = available_memory_bytes()
    if memory is not None:
        jobs = min(jobs, memory // peak_bytes)
    return max(1, jobs)


def default_jobs(plans: list[LaunchPlan]) -> int:
    """Parallel compiles when CompileOptions.jobs is 0: machine_jobs at the plans' peak (CUTLASS builds take
    several GB each)."""
    return machine_jobs(max((COMPILE_PEAK_BYTES_CUTLASS if p.needs_cutlass else COMPILE_PEAK_BYTES for p in plans),
                            default=COMPILE_PEAK_BYTES))


def compile_many(plans: list[LaunchPlan], options: CompileOptions = CompileOptions()) -> list[CompileResult]:
    """Compile plans in parallel, results in input order. Each job is its own compiler process (group) with the
    per-job timeout; the pool threads only wait on them, so a hung or crashing compiler costs one slot. With
    options.jobs = 0 the machine decides (default_jobs): its usable CPUs and the memory the builds need."""
    jobs = options.jobs or default_jobs(plans)
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(plans) or 1))) as pool:
        futures = [pool.submit(_guarded_compile, plan, options) for plan in plans]
        return [f.result() for f in futures]


def _guarded_compile(plan: LaunchPlan, options: CompileOptions) -> CompileResult:
    try:
        return compile_plan(plan, options)
    except Exception as e:  # noqa: BLE001 - a broken cache entry or disk error must not stop a whole batch
        return CompileFailure(key="", reason="error", log=f"{type(e).__name__}: {e}", repro="")


# ---------------------------------------------------------------------------------------------------------------
# The NVRTC child process: `python -m l2ir.backends.compile --nvrtc kernel.cu -o kernel.cubin -- <nvrtc options>`.
# ---------------------------------------------------------------------------------------------------------------


def nvrtc_compile(source: str, name: str, opts: list[str]) -> tuple[bytes | None, str]:
    """(cubin or None, program log). NVRTC needs no GPU: it is the compiler, not the driver."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if err != ok:
        return None, f"nvrtcCreateProgram: {err}"
    try:
        enc = [o.encode() for o in opts]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\x00 ").decode(errors="replace")
        if cerr != ok:
            return None, log + f"\nnvrtcCompileProgram: {cerr}\n"
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        (gerr,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if gerr != ok:
            return None, log + f"\nnvrtcGetCUBIN: {gerr}\n"
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_main(argv: list[str]) -> int:
    """argv: kernel.cu -o kernel.cubin -- <nvrtc options>. Parsed by hand: NVRTC options such as -std=c++17 or
    -Xptxas would be taken by an option parser as its own."""
    if "--" not in argv or argv[1:2] != ["-o"] or len(argv) < 4:
        sys.stderr.write("usage: python -m l2ir.backends.compile --nvrtc kernel.cu -o kernel.cubin -- <nvrtc options>\n")
        return 2
    source, output, opts = argv[0], argv[2], argv[argv.index("--") + 1:]
    cubin, log = nvrtc_compile(Path(source).read_text(), source, opts)
    sys.stdout.write(log + ("\n" if log and not log.endswith("\n") else ""))
    if cubin is None:
        return 1
    Path(output).write_bytes(cubin)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--nvrtc"]:
        sys.exit("usage: python -m l2ir.backends.compile --nvrtc kernel.cu -o kernel.cubin -- <nvrtc options>")
    sys.exit(_nvrtc_main(sys.argv[2:]))
