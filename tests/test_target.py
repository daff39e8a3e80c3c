"""l2ir.target and l2ir.analysis: every arch and dtype the IR can name has each fact, and the derived quantities
agree with the numbers the hardware documents."""

import pytest

from l2ir import target
from l2ir.analysis import acc_registers, resolved_stages, smem_bytes, stage_bytes, threads
from l2ir.nodes import ARCHS, DTYPES_IN, DTYPES_OUT, Epilogue, Kernel, Mma, Pad, Pipeline, Target, Tile


def test_every_arch_has_its_facts():
    assert set(ARCHS) == set(target.NVCC_ARCH) == set(target.SMEM_LIMIT)
    for arch in ARCHS:
        assert target.NVCC_ARCH[arch] == "sm_" + arch[2:]          # sm90a -> sm_90a: the suffix is kept
    assert target.SMEM_LIMIT["sm90a"] == 232448                     # cudaDevAttrMaxSharedMemoryPerBlockOptin
    assert target.SMEM_LIMIT["sm80"] == 163 * 1024
    assert target.DEVICE_SM in target.NVCC_ARCH.values()


@pytest.mark.parametrize("table", ["DTYPE_BYTES", "CUDA_TYPE", "CUTLASS_TYPE", "CUTE_TYPE", "TORCH_DTYPE",
                                   "UNIT_ROUNDOFF"])
def test_every_dtype_has_its_facts(table):
    assert set(getattr(target, table)) >= set(DTYPES_IN) | set(DTYPES_OUT) | {"f32"}


@pytest.mark.parametrize("table", ["TMA_DTYPE", "CUDA_PAIR_TYPE", "CUDA_FROM_FLOAT", "CUDA_PAIR_FROM_FLOATS"])
def test_every_16_bit_dtype_has_its_facts(table):
    assert set(getattr(target, table)) == set(DTYPES_IN)


def test_unit_roundoff_is_half_an_ulp_of_one():
    import numpy as np

    assert target.UNIT_ROUNDOFF["f16"] == np.finfo(np.float16).eps / 2
    assert target.UNIT_ROUNDOFF["f32"] == np.finfo(np.float32).eps / 2
    assert target.DTYPE_BYTES["f16"] == np.dtype(np.float16).itemsize


def hopper(stages="auto", schedule="pingpong", warps=(4, 1), epilogue="tma"):
    return Kernel(target=Target("sm90a"), tile=Tile((128, 128, 64), warps), mma=Mma("wgmma", (64, 128, 16)),
                  pipeline=Pipeline("tma_ws", stages, schedule, persistent=True),
                  pad=Pad("zero_fill", "zero_fill", "zero_fill", 8), epilogue=Epilogue(epilogue, 8))


def test_derived_quantities():
    k = hopper()
    # pingpong: two consumer warpgroups of `warps` plus the producer warpgroup.
    assert threads(k) == 2 * 128 + target.PRODUCER_THREADS
    # (128 + 128) x 64 halves + the full/empty mbarrier pair.
    assert stage_bytes(k) == 32768 + target.TMA_BARRIER_BYTES
    # auto fills what the 32 KB TMA-epilogue buffer leaves of 227 KB.
    assert resolved_stages(k) == (target.SMEM_LIMIT["sm90a"] - 32 * 1024) // stage_bytes(k) == 6
    assert smem_bytes(k) == 6 * stage_bytes(k) + 32 * 1024 <= target.SMEM_LIMIT["sm90a"]
    # pingpong: each consumer warpgroup owns the whole 128x128 fp32 tile, 128 registers per thread; cooperative
    # splits it between two warpgroups (8x1 warps), 64 each.
    assert acc_registers(k) == 128
    assert acc_registers(hopper(schedule="cooperative", warps=(8, 1))) == 64
    assert smem_bytes(hopper(stages=3, epilogue="direct")) == 3 * stage_bytes(k)
