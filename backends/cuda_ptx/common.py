"""Shared pieces of the cuda_ptx backend: the refusal error and the problem-class check."""

from __future__ import annotations

from l2ir.errors import UnsupportedLowering as _UnsupportedLowering
from l2ir.nodes import DTYPES_IN


class UnsupportedLowering(_UnsupportedLowering):
    """cuda_ptx's UnsupportedLowering: the shared error with the backend's name filled in."""

    def __init__(self, field: str, message: str):
        super().__init__("cuda_ptx", field, message)



def check_problem_class(problem, why_a_row: str = "") -> None:
    """The problem class both rules generate: K-major A (row) and B (col, NxK), one 16-bit input type, a 16-bit C,
    fp32 accumulation. Anything else is an UnsupportedLowering naming the problem field."""
    (a_dt, a_lay), (b_dt, b_lay), (c_dt, _) = problem.a, problem.b, problem.c
    if a_lay != "row":
        raise UnsupportedLowering("problem.a", f"{a_dt}:{a_lay}: only K-major A (row) is generated{why_a_row}")
    if b_lay != "col":
        raise UnsupportedLowering("problem.b", f"{b_dt}:{b_lay}: only K-major B (col, the NxK form) is generated")
    if a_dt not in DTYPES_IN or b_dt != a_dt:
        raise UnsupportedLowering("problem.b", f"a={a_dt}, b={b_dt}: one 16-bit input type (f16 or bf16)")
    if c_dt not in DTYPES_IN:
        raise UnsupportedLowering("problem.c", f"{c_dt}: the epilogue writes f16 or bf16")
    if problem.acc != "f32":
        raise UnsupportedLowering("problem.acc", f"{problem.acc}: accumulators are f32")
