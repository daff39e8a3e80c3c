"""Before any GPU work: is this machine able to do it? One place that `l2ir bench`, `l2ir tune` and any other GPU
command ask, so a missing GPU, driver, toolchain or extra is one line naming what to install or where to run,
before anything is compiled or measured, instead of a FAIL row for every candidate.

    problems = missing(gpu=True, toolchain=True)     # [] when ready
    require("l2ir bench")                           # raises PreflightError with one line otherwise
"""

from __future__ import annotations

import importlib.util
import shutil

from l2ir.errors import L2IRError

GPU_HINT = "run it on a machine with an NVIDIA GPU (sm_80 or newer)"


class PreflightError(L2IRError):
    """This machine lacks what the command needs; the message is one line."""


def _toolchain(nvcc: str) -> list[str]:
    out = []
    if shutil.which(nvcc) is None:
        out.append(f"no '{nvcc}' on PATH (install the CUDA toolkit, 12.4 or newer)")
    if importlib.util.find_spec("cutlass_library") is None:
        out.append("no CUTLASS headers (pip install 'l2ir[cuda]', which brings nvidia-cutlass)")
    return out


def _gpu() -> list[str]:
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return ["no cuda-python (pip install 'l2ir[cuda]')"]
    if importlib.util.find_spec("torch") is None:
        return ["no torch (pip install torch, a CUDA build: it is the baseline and holds the test data)"]
    from cuda.bindings import driver as cu

    try:
        (err,) = cu.cuInit(0)
    except Exception as e:  # noqa: BLE001 - libcuda missing or broken: the bindings raise on load
        return [f"no NVIDIA driver (libcuda cannot be loaded: {type(e).__name__}); {GPU_HINT}"]
    if err != cu.CUresult.CUDA_SUCCESS:
        name = getattr(err, "name", str(err))
        if name in ("CUDA_ERROR_NO_DEVICE",):
            return [f"no CUDA GPU on this machine; {GPU_HINT}"]
        return [f"the NVIDIA driver does not start ({name}); {GPU_HINT}"]
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count == 0:
        return [f"no CUDA GPU on this machine; {GPU_HINT}"]
    import torch

    if torch.version.cuda is None:
        return [f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"]
    return []


def missing(gpu: bool = True, toolchain: bool = True, nvcc: str = "nvcc") -> list[str]:
    """What this machine lacks for the asked-for work; [] when it has everything."""
    out = _toolchain(nvcc) if toolchain else []
    if gpu:
        out += _gpu()
    return out


def require(command: str, gpu: bool = True, toolchain: bool = True, nvcc: str = "nvcc") -> None:
    """Raise PreflightError (one line: what is missing, what to do) unless the machine can run `command`."""
    problems = missing(gpu, toolchain, nvcc)
    if problems:
        raise PreflightError(f"{command} cannot run here: " + "; ".join(problems))
