"""Build launch plans for a test through the one compile path (l2ir.backends.compile), or skip the test cleanly
when the toolchain is missing (no nvcc, or no CUTLASS headers for a plan that needs them)."""

from __future__ import annotations

import shutil

import pytest

from l2ir.backends.compile import Artifact, CompileOptions, compile_many
from l2ir.runtime import LaunchPlan, ShimLauncher


def build_all(plans: dict[str, LaunchPlan], cache_dir, **options) -> dict[str, Artifact]:
    """Compile every plan in parallel (PTX kept) for the default device, an H200 (sm_90). A compile error fails
    with the log and the command that reproduces it."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    opts = CompileOptions(cache_dir=str(cache_dir), keep=True, **options)
    results = dict(zip(plans, compile_many(list(plans.values()), opts)))
    for name, r in results.items():
        if not r.ok and r.reason == "toolchain":
            pytest.skip(f"toolchain missing for {name}: {r.log.strip()}")
    return results


def built(result, name: str = "") -> Artifact:
    """The artifact, or a test failure that shows the compiler log and the reproducing command."""
    assert result.ok, f"{name}: compile {result.reason}; reproduce with:\n  {result.repro}\n{result.log[-4000:]}"
    return result


def shim_library(lib):
    """A built host-shim library with l2ir_run / l2ir_workspace_size typed as l2ir.runtime declares the ABI, so a
    test can read the raw status codes (the launcher itself turns them into LaunchError)."""
    return ShimLauncher(LaunchPlan(source="", arch="sm_90a", form="host_shim"), lib)._lib
