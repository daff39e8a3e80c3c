"""L2IR: a typed IR for GEMM kernels.

Data flows through the packages in this order:
    l2ir/      the IR (nodes, text format, verifier, edits, index functions, reference interpreter, seeds, CLI)
    backends/  lowering to CUDA (CuTe sm80, CUTLASS 3.x sm90, raw CUDA/PTX, free-form Source) and compilation
    search/    the GPU evaluator (correctness gates, timing against torch.matmul) and the benchmark driver
    policy/    proposers of IR edits (to come)

Importing the package loads nothing: the compile and evaluator worker processes import single modules
(l2ir.errors, l2ir.nodes) without pulling in the parser's dependencies.
"""

# The PyTorch entry points live in l2ir/dispatch.py, imported on first use so that `import l2ir` loads no torch.
_DISPATCH = ("matmul", "load", "patch_linear", "dispatch_stats")


def __getattr__(name):
    if name in _DISPATCH:
        from . import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'l2ir' has no attribute {name!r}")
