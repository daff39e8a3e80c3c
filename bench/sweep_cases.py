"""The MxNxK:SWEEP:CONFIG cases the probes take (bench/pdl_probe.py, bench/ncu_probe.py): one sweep configuration on
one shape, lowered by the backend its sweep is named after (cuda_ptx, cuda_ptx_sm80, cuda_ptx_direct: the registry's
names, as `l2ir bench` pairs them), else by the kernel's default backend; the sets a probe times on; and the check of a
probe's answer."""

from __future__ import annotations

import argparse

from l2ir.cli import shape_arg

# A probe's answer this far from the fp32 reference (relative to max |ref|) is wrong: fp16 output rounding is 2^-11
# of |C|, and fp32 accumulation over K <= 16384 adds far less than 1e-2.
MAX_REL_ERR = 1e-2


def answer_error(c, a, w) -> float:
    """max |C - A W^T| / max |A W^T| in fp32, for C = A @ W.t() with W stored N x K (the probes' operands); a NaN
    or an inf in C gives a NaN or an inf, which no `<= MAX_REL_ERR` test passes."""
    ref = a.float() @ w.float().t()
    return ((c.float() - ref).abs().max() / ref.abs().max()).item()


def offline_sets(m: int, n: int, k: int, l2_bytes: int, cfg):
    """The input sets a probe times on in the offline scenario, rotated so their bytes exceed L2
    (search.timing.sets_for): each (A, B stored N x K, C for the kernel, C for torch.matmul); and the baseline call,
    torch.matmul on set i into its own C."""
    import torch

    from l2ir.search.timing import sets_for

    sets = [(torch.randn(m, k, device="cuda").half(), torch.randn(n, k, device="cuda").half(),
             torch.empty(m, n, device="cuda", dtype=torch.half), torch.empty(m, n, device="cuda", dtype=torch.half))
            for _ in range(sets_for(2 * (m * k + n * k + m * n), l2_bytes, cfg))]

    def baseline(i):
        a, b, _, cb = sets[i]
        torch.matmul(a, b.t(), out=cb)

    return sets, baseline


def case_arg(text: str):
    """argparse type: MxNxK:SWEEP:CONFIG -> ((m, n, k), sweep, config)."""
    try:
        shape, sweep, config = text.split(":")
    except ValueError:
        raise argparse.ArgumentTypeError(f"case '{text}' is not MxNxK:SWEEP:CONFIG") from None
    return shape_arg(shape), sweep, config


def lower_case(shape, sweep: str, config: str):
    """(kernel, problem, plan) of a case; a configuration the sweep does not have is a ValueError naming it."""
    from l2ir.backends.registry import BACKENDS, lower
    from l2ir.nodes import Problem
    from l2ir.search.sweeps import load_sweep

    kernels = load_sweep(sweep)
    if config not in kernels:
        raise ValueError(f"unknown configuration '{config}' in sweep '{sweep}'")
    kernel, problem = kernels[config], Problem(*shape)
    return kernel, problem, lower(kernel, problem, backend=sweep if sweep in BACKENDS else None)
