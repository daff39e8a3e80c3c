"""L2IR: a typed IR for GEMM kernels.

Data flows through the packages in this order (each folder installs under l2ir.*):
    l2ir/           the IR (nodes, text format, verifier, edits, index functions, reference interpreter, seeds,
                    hardware facts in target.py, derived quantities in analysis.py, passes, CLI), the runtime
                    (runtime.py: launch plans, the host-shim ABI, launchers), export and the l2ir.matmul dispatcher
    l2ir.backends   lowering to CUDA (CuTe sm80, CUTLASS 3.x sm90, raw CUDA/PTX, free-form Source) and compilation
    l2ir.search     the candidate pipeline, the GPU evaluator (correctness gates, timing against torch.matmul), the
                    records DB, the search loop and its worker pool, `l2ir bench` and `l2ir tune`
    l2ir.policy     proposers of IR edits: random, expert rules, a learned policy, a language model

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
