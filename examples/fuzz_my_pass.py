"""Fuzz your own lowering pass against the reference interpreter.

A pass is a pure function Kernel -> Kernel. Whatever it does, the kernel it returns must still be legal, still run
every problem the original ran, and still compute A @ B. Hypothesis draws legal kernels and problems they can run
(l2ir.testing); the interpreter executes the new schedule tile by tile and compares with float64 A @ B. A failure
prints the smallest kernel and problem that break the pass.

    python examples/fuzz_my_pass.py              # the pass below holds
    python examples/fuzz_my_pass.py --broken     # a pass with a bug: Hypothesis finds a shape it breaks

Needs the test extra: pip install 'l2ir[test]'.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hypothesis import given, settings

from l2ir.errors import VerifyError
from l2ir.nodes import Kernel
from l2ir.testing import assert_computes_matmul, kernel_problem_pairs
from l2ir.verify import check_problem, verify


def deepen_pipeline(kernel: Kernel) -> Kernel:
    """One more cp.async stage hides more global-memory latency, where shared memory has room for it."""
    if kernel.pipeline.mode != "multistage":
        return kernel
    deeper = kernel.replace(pipeline=dataclasses.replace(kernel.pipeline, stages=kernel.pipeline.stages + 1))
    try:
        return verify(deeper)
    except VerifyError:
        return kernel          # no room: the pass leaves the kernel as it was


def deepen_and_drop_k_guard(kernel: Kernel) -> Kernel:
    """The same pass with a bug: it also drops the K-residue handling ("the guard costs instructions"), which is
    only right when K is a multiple of BK."""
    k = deepen_pipeline(kernel)
    return k.replace(pad=dataclasses.replace(k.pad, k="divisible"))


def fuzz(my_pass, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None)
    @given(kernel_problem_pairs(max_dim=128))
    def check(pair):
        kernel, problem = pair
        new = verify(my_pass(kernel))          # still legal
        check_problem(new, problem)            # still runs every problem the original ran
        assert_computes_matmul(new, problem)   # still A @ B, every element written once

    check()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=100, help="kernel/problem pairs to try")
    ap.add_argument("--broken", action="store_true", help="fuzz the pass with a bug instead")
    args = ap.parse_args()
    my_pass = deepen_and_drop_k_guard if args.broken else deepen_pipeline
    try:
        fuzz(my_pass, args.examples)
    except (AssertionError, VerifyError, ExceptionGroup) as e:
        # Hypothesis raises a group when it finds failures of more than one kind (at different lines): each is
        # reported with its own smallest failing kernel and problem.
        for err in (e.exceptions if isinstance(e, ExceptionGroup) else (e,)):
            print(f"{my_pass.__name__} is wrong: [{type(err).__name__}] {err}")
            for note in getattr(err, "__notes__", []):      # Hypothesis's smallest failing kernel and problem
                print(note)
        return 1
    print(f"{my_pass.__name__}: {args.examples} kernel/problem pairs legal, applicable and equal to A @ B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
