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


def header_lines(what: tuple[str, str], kernel_text: str, problem_class: str, arch: str) -> list[str]:
    """The head of a generated .cu file: what generated it (two comment lines), from which IR and problem class,
    and the headers it needs."""
    return [
        *what,
        "// Kernel:",
        *["//   " + line if line else "//" for line in kernel_text.splitlines()],
        f"// Problem class: {problem_class}",
        f"// target.arch={arch}",
        "#include <cuda_fp16.h>",
        "#include <cuda_bf16.h>",
        "",
    ]


def mma_16816_lines(ptx_t: str) -> list[str]:
    """mma_16816(d, a, b): D = A * B + D with mma.sync m16n8k16, A row and B col (both K-major), `ptx_t` (f16 or
    bf16: PTX names the 16-bit types as the IR does) in, fp32 accumulators."""
    return [
        f"// D = A * B + D, m16n8k16, A row (K-major), B col (K-major), {ptx_t} in, fp32 accumulate.",
        "__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {",
        f'  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ptx_t}.{ptx_t}.f32 "',
        '               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"',
        '               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])',
        '               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));',
        "}",
    ]
