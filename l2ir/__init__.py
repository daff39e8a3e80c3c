"""L2IR: a typed IR for GEMM kernels.

Data flows through the packages in this order:
    l2ir/      the IR (nodes, text format, verifier, edits, index functions, reference interpreter, seeds, CLI)
    backends/  lowering to CUDA (CuTe sm80, CUTLASS 3.x sm90, raw CUDA/PTX, free-form Source) and compilation
    search/    the GPU evaluator (correctness gates, timing against torch.matmul) and the benchmark driver
    policy/    proposers of IR edits (to come)
"""

from .errors import L2IRError, ParseError, VerifyError
from .nodes import Kernel, Problem
from .text import parse_kernel, parse_problem, print_kernel, print_problem
from .verify import check_problem, verify

__all__ = ["Kernel", "Problem", "parse_kernel", "parse_problem", "print_kernel", "print_problem", "verify",
           "check_problem", "L2IRError", "ParseError", "VerifyError"]
