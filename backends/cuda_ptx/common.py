"""Shared pieces of the cuda_ptx backend: the refusal error and the problem class both rules generate."""

from __future__ import annotations

from l2ir.errors import UnsupportedLowering as _UnsupportedLowering
from l2ir.nodes import DTYPES_IN


class UnsupportedLowering(_UnsupportedLowering):
    """cuda_ptx's UnsupportedLowering: the shared error with the backend's name filled in."""

    def __init__(self, field: str, message: str):
        super().__init__("cuda_ptx", field, message)



def problem_refusal(problem, why_a_row: str = "") -> UnsupportedLowering | None:
    """The problem class both rules generate: K-major A (row) and B (col, NxK), one 16-bit input type, a 16-bit C,
    fp32 accumulation. Anything else is an UnsupportedLowering naming the problem field; None inside the class."""
    (a_dt, a_lay), (b_dt, b_lay), (c_dt, _) = problem.a, problem.b, problem.c
    if a_lay != "row":
        return UnsupportedLowering("problem.a", f"{a_dt}:{a_lay}: only K-major A (row) is generated{why_a_row}")
    if b_lay != "col":
        return UnsupportedLowering("problem.b", f"{b_dt}:{b_lay}: only K-major B (col, the NxK form) is generated")
    if a_dt not in DTYPES_IN or b_dt != a_dt:
        return UnsupportedLowering("problem.b", f"a={a_dt}, b={b_dt}: one 16-bit input type (f16 or bf16)")
    if c_dt not in DTYPES_IN:
        return UnsupportedLowering("problem.c", f"{c_dt}: the epilogue writes f16 or bf16")
    if problem.acc != "f32":
        return UnsupportedLowering("problem.acc", f"{problem.acc}: accumulators are f32")
    return None


def check_problem_class(problem, why_a_row: str = "") -> None:
    """Raise problem_refusal's error for a problem outside the class both rules generate."""
    refused = problem_refusal(problem, why_a_row)
    if refused is not None:
        raise refused
