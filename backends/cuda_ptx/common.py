"""Shared pieces of the cuda_ptx backend: the refusal error and the host-shim status codes."""

from __future__ import annotations

from l2ir.errors import UnsupportedLowering as _UnsupportedLowering


class UnsupportedLowering(_UnsupportedLowering):
    """cuda_ptx's UnsupportedLowering: the shared error with the backend's name filled in."""

    def __init__(self, field: str, message: str):
        super().__init__("cuda_ptx", field, message)


# l2ir_run return codes of the generated host shims (0 = success).
STATUS_MISALIGNED = 1            # an operand pointer or leading dimension breaks TMA's 16-byte rule or the store vector
STATUS_NOT_DIVISIBLE = 102       # the shape breaks a pad=divisible promise
STATUS_BAD_ARGUMENT = 103        # null pointer or non-positive size
STATUS_CUDA_ERROR = 104          # a CUDA runtime call failed (launch, attribute)
STATUS_TENSOR_MAP = 106          # cuTensorMapEncodeTiled is unavailable or refused the operand


def status_name(code: int) -> str:
    return {0: "success", STATUS_MISALIGNED: "misaligned operand", STATUS_NOT_DIVISIBLE: "shape violates pad=divisible",
            STATUS_BAD_ARGUMENT: "bad argument", STATUS_CUDA_ERROR: "CUDA runtime error",
            STATUS_TENSOR_MAP: "tensor map encode failed"}.get(code, f"unknown status {code}")
