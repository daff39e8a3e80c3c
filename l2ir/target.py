"""Hardware and dtype facts: the one home of every number the verifier, the seed, the backends and the evaluator
share. Each is here once, with the reason it is what it is; everything else imports it.

Per-arch tables are keyed by the IR's arch names (`l2ir.nodes.ARCHS`); per-dtype tables by the IR's dtype names
("f16", "bf16", "f32"). This module imports nothing from L2IR, so any module may import it.
"""

from __future__ import annotations

KB = 1024

# ---------------------------------------------------------------------------------------------------------------
# Architectures.
# ---------------------------------------------------------------------------------------------------------------

# nvcc spelling of each IR arch. The "a" suffix (sm_90a) is the arch-specific feature set (wgmma, setmaxnreg): code
# built for it runs only on that exact SM, so it is a separate target, not a newer sm_90.
NVCC_ARCH = {"sm80": "sm_80", "sm86": "sm_86", "sm89": "sm_89", "sm90": "sm_90", "sm90a": "sm_90a"}

# Largest shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin): A100 163 KB (of its
# 164 KB per SM, 1 KB is reserved per block), consumer Ampere/Ada 99 KB (of 100), Hopper 227 KB (of 228).
SMEM_LIMIT = {"sm80": 163 * KB, "sm86": 99 * KB, "sm89": 99 * KB, "sm90": 227 * KB, "sm90a": 227 * KB}

# The SASS target of the GPUs L2IR is tuned on (H100, H200): what nvcc builds for unless told which GPU runs the code.
DEVICE_SM = "sm_90"

# Streaming multiprocessors of the GPUs L2IR is tuned on: H100 SXM and H200 both have 132. A persistent or
# stream-K grid is sized to it; the seed sizes split-K by it.
H200_SMS = 132

# The H200's two roofline ceilings, as measured on the H200s L2IR is tuned on (not the datasheet's 989 TFLOP/s dense
# fp16/bf16 tensor and 4.8 TB/s HBM3e, which no real kernel reaches): an 8192^3 bf16 torch.matmul on random data ran
# at 769-798 TFLOP/s (the top is taken: a ceiling is the most seen; random bits keep the tensor cores' power-bound
# clock honest, zeros ran at 894), and a device-to-device copy moved 4.3 TB/s counting bytes read and written.
# fp16 and bf16 share the tensor-core rate. A kernel's time under max(FLOPs / the first, least DRAM bytes / the
# second) means the timing or a ceiling is wrong.
H200_TENSOR_F16_FLOPS = 798e12
H200_DRAM_BYTES_PER_S = 4.3e12

# blockDim limits: x and y up to 1024, z up to 64, and 1024 threads in all.
BLOCK_DIM_MAX = (1024, 1024, 64)
MAX_THREADS = 1024

# 255 registers per thread is the ISA limit.
MAX_REGS = 255
REGS_PER_SM = 65536      # 32-bit registers of one SM (sm80 and sm90): a block's threads x registers must fit

# A wgmma accumulator lives in the issuing warpgroup's registers; consumers are raised to 232-240 registers by
# setmaxnreg, so more than ~192 accumulator registers per thread leaves too few for the rest and spills.
MAX_WGMMA_ACC_REGS = 192

# mma.sync shapes for 16-bit inputs (m16n8k16, and the older m16n8k8).
MMA_SYNC_SHAPES = {(16, 8, 16), (16, 8, 8)}

# A warp is 32 threads; a warpgroup (the unit that issues one wgmma) is 4 warps.
WARP_THREADS = 32
WARPGROUP_THREADS = 128

# TMA warp-specialized kernels add one producer warpgroup that only issues bulk copies.
PRODUCER_THREADS = WARPGROUP_THREADS

# A TMA copy moves a box of at most 256 elements per dimension (cuTensorMapEncodeTiled's boxDim limit).
TMA_BOX_MAX = 256

# Per-stage mbarrier pair (full/empty, 8 bytes each) of a TMA pipeline.
TMA_BARRIER_BYTES = 16

# Largest portable thread-block cluster (without the non-portable opt-in).
MAX_CLUSTER = 8

# Largest cluster with cudaFuncAttributeNonPortableClusterSizeAllowed (H100/H200), and the targets with clusters.
MAX_CLUSTER_NONPORTABLE = 16
CLUSTER_ARCHS = ("sm90", "sm90a")

# ---------------------------------------------------------------------------------------------------------------
# Data types.
# ---------------------------------------------------------------------------------------------------------------

DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}

# C++ element types, by the headers a backend builds on: CUDA's own (cuda_fp16.h / cuda_bf16.h), CUTLASS and CuTe.
CUDA_TYPE = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
CUTLASS_TYPE = {"f16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "f32": "float"}
CUTE_TYPE = {"f16": "cute::half_t", "bf16": "cute::bfloat16_t", "f32": "float"}

# cuda_fp16.h / cuda_bf16.h names of the 16-bit outputs: the two-element vector type, and the round-to-nearest
# conversions from float (one value, and two values packed into the vector type).
CUDA_PAIR_TYPE = {"f16": "__half2", "bf16": "__nv_bfloat162"}
CUDA_FROM_FLOAT = {"f16": "__float2half_rn", "bf16": "__float2bfloat16_rn"}
CUDA_PAIR_FROM_FLOATS = {"f16": "__floats2half2_rn", "bf16": "__floats2bfloat162_rn"}

# CUtensorMapDataType of each 16-bit input (the TMA descriptor's element type).
TMA_DTYPE = {"f16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"}

# torch dtype attribute names (`getattr(torch, TORCH_DTYPE[d])`); the names keep torch an optional import.
TORCH_DTYPE = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}

# Unit roundoff u = 2^-p of each format (p = significand bits incl. the implicit one: 11, 8, 24): one correctly
# rounded result is within u relative error.
UNIT_ROUNDOFF = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "f32": 2.0 ** -24}

