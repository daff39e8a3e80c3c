"""Kernel IR + problem class -> the frozen set of C++ choices the emitter renders.

Every decision the generated code depends on is made here, once, from the IR fields; the emitter only renders.
Each choice carries the field that caused it, so an unsupported combination raises NotImplementedError that names
the field, and a test can check that changing a field changes exactly the choices it should.
"""

from __future__ import annotations

from dataclasses import dataclass

from l2ir.nodes import Kernel, Problem
from l2ir.target import CUTE_TYPE, DTYPE_BYTES, NVCC_ARCH

# The mma.sync instruction this backend emits: m16n8k16, one warp, operands from ldmatrix fragments.
MMA_SHAPE = (16, 8, 16)

# SM80 mma.sync atoms by (input dtype, accumulator). bf16 inputs accumulate in fp32 only: the hardware has no
# bf16 x bf16 -> f16 form.
MMA_ATOM = {
    ("f16", "f32"): "SM80_16x8x16_F32F16F16F32_TN",
    ("f16", "f16"): "SM80_16x8x16_F16F16F16F16_TN",
    ("bf16", "f32"): "SM80_16x8x16_F32BF16BF16F32_TN",
}

# Largest power of two that a smem layout atom's contiguous extent may take: 64 16-bit elements = 128 bytes, the
# widest row a bank-conflict-free swizzle of 16-byte chunks needs (8 chunks, <3,3,3>).
MAX_ATOM_WIDTH = 64

# The split-K reduction kernel's block: 256 threads, each reducing one vector of `store_vector` outputs.
REDUCE_THREADS = 256


def _unsupported(field: str, value, why: str) -> NotImplementedError:
    return NotImplementedError(f"cute_sm80: {field}={value} is not supported: {why}")


@dataclass(frozen=True)
class OperandPlan:
    """How one input operand (A or B) moves global -> shared -> registers.

    The operand is viewed as a (rows, K) matrix: rows are M for A, N for B. `k_major` means K is contiguous in
    global memory (A row / B col); otherwise rows are contiguous (A col / B row) and ldmatrix transposes.
    """

    name: str                 # "A" or "B"
    dtype: str                # C++ element type
    k_major: bool
    rows: int                 # BM or BN
    bk: int
    # Global -> shared copy: `vector` elements per thread per copy; threads_contig threads along the contiguous dim.
    vector: int
    threads_contig: int
    threads_other: int
    # Shared-memory layout atom: contig x other elements, with the swizzle composed on top (None = plain layout).
    atom_contig: int
    atom_other: int
    # Shared -> register: the ldmatrix atom and how many rows of the operand one warp's ldmatrix covers.
    ldsm: str
    warp_rows_per_ldsm: int

    @property
    def contig_extent(self) -> int:
        return self.bk if self.k_major else self.rows

    @property
    def other_extent(self) -> int:
        return self.rows if self.k_major else self.bk


@dataclass(frozen=True)
class Plan:
    """Everything the emitter needs, derived once from (kernel, problem)."""

    # Types
    ta: str
    tb: str
    tc: str
    tacc: str
    mma_atom: str
    # Tile and warps
    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    # Pipeline
    stages: int
    prefetch: bool
    reg_depth: int            # k-blocks of ldmatrix fragments held in registers
    loop: str                 # "single_stage" | "multistage" | "multistage_prefetch"
    # Swizzle / raster
    swizzle: tuple[int, int, int] | None
    raster: str
    group: int
    # Pad
    pad_m: str
    pad_n: str
    pad_k: str
    align: int
    copy_atom: str            # cp.async (or plain) atom for unchecked copies
    copy_atom_zfill: str      # the zero-filling variant
    copy_async: bool          # False when align=1: 2-byte copies have no cp.async form
    a: OperandPlan
    b: OperandPlan
    # Epilogue
    epilogue: str             # "direct" | "smem"
    epilogue_vector: int      # requested
    store_vector: int         # used: the requested vector narrowed to what pad.align guarantees
    reduce_vector: int        # outputs per thread of the split-K reduction kernel
    # Split-K
    splitk: str               # "none" | "workspace" | "atomic"
    slices: int
    arch: str

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def k_blocks(self) -> int:
        return self.bk // MMA_SHAPE[2]

    @property
    def stage_bytes_a(self) -> int:
        return self.bm * self.bk * 2

    @property
    def stage_bytes_b(self) -> int:
        return self.bn * self.bk * 2

    @property
    def ring_bytes(self) -> int:
        return self.stages * (self.stage_bytes_a + self.stage_bytes_b)

    @property
    def stage_type(self) -> str:
        """What the smem epilogue stages: fp32 partials for split-K (rounded only once, after the reduction)."""
        return "float" if self.splitk != "none" else self.tc

    @property
    def stage_elem_bytes(self) -> int:
        return 4 if self.stage_type == "float" else CPP_BYTES_BY_TYPE[self.stage_type]

    @property
    def c_row_pad(self) -> int:
        """Elements added to each staged C row: shifts consecutive rows by 16 bytes (4 banks) so the fragment
        writes of the 8 rows a warp touches at once land in different banks, while keeping every row aligned for
        the vector reads."""
        return max(16, self.store_vector * self.stage_elem_bytes) // self.stage_elem_bytes

    @property
    def epilogue_bytes(self) -> int:
        if self.epilogue != "smem":
            return 0
        return self.bm * (self.bn + self.c_row_pad) * self.stage_elem_bytes

    @property
    def smem_bytes(self) -> int:
        # The C tile reuses the drained pipeline ring.
        return max(self.ring_bytes, self.epilogue_bytes)


CPP_BYTES_BY_TYPE = {CUTE_TYPE[k]: v for k, v in DTYPE_BYTES.items()}


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap that divides x."""
    p = 1
    while p * 2 <= cap and x % (p * 2) == 0:
        p *= 2
    return p


def _copy_atoms(align: int, dtype_bytes: int) -> tuple[str, str, bool]:
    """cp.async atoms for `align`-element vectors. 16 bytes may bypass L1 (.cg: the tile is reused from shared
    memory, not L1); 4- and 8-byte cp.async exist only as .ca. 2-byte copies have no cp.async form."""
    nbytes = align * dtype_bytes
    if nbytes == 16:
        return "SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>", "SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>", True
    if nbytes in (4, 8):
        t = {4: "uint32_t", 8: "uint64_t"}[nbytes]
        return f"SM80_CP_ASYNC_CACHEALWAYS<{t}>", f"SM80_CP_ASYNC_CACHEALWAYS_ZFILL<{t}>", True
    return "UniversalCopy<uint16_t>", "UniversalCopy<uint16_t>", False


def _operand(name: str, dtype: str, k_major: bool, rows: int, bk: int, warps_rows: int, warps_other: int,
             threads: int, align: int, swizzle) -> OperandPlan:
    contig = bk if k_major else rows
    other = rows if k_major else bk
    vec = align
    if contig % vec:
        raise _unsupported("pad.align", align, f"the {name} tile's contiguous extent {contig} is not a multiple of it")
    # Threads along the contiguous dimension: as many as possible (wide coalesced rows) such that they divide the
    # row's vectors and the block, and one pass of the block covers a whole number of the tile's rows.
    per_contig = contig // vec
    fits = [d for d in range(1, min(per_contig, threads) + 1)
            if per_contig % d == 0 and threads % d == 0 and other % (threads // d) == 0]
    if not fits:
        raise _unsupported("tile.block", f"{rows}x{bk}",
                           f"{threads} threads cannot copy the {name} tile ({other} rows of {per_contig} "
                           f"{vec}-element vectors) in whole passes")
    t_contig = fits[-1]
    t_other = threads // t_contig
    # Layout atom: the contiguous extent is a power of two <= 64 elements that divides the tile; the other extent
    # covers the swizzle's full period 2^(B+M+S) so the XOR acts inside one atom.
    atom_contig = _pow2_divisor(contig, MAX_ATOM_WIDTH)
    atom_other = 8
    if swizzle is not None:
        b, m, s = swizzle
        atom_other = max(8, (1 << (b + m + s)) // atom_contig)
        if other % atom_other:
            raise _unsupported("swizzle.smem", "<{},{},{}>".format(*swizzle),
                               f"its {1 << (b + m + s)}-element period needs {atom_other} rows of {atom_contig}; "
                               f"the {name} tile has {other}")
    if atom_contig < 8:
        raise _unsupported("tile.block", f"{rows}x{bk}", f"the {name} tile's contiguous extent {contig} holds no "
                           f"16-byte ldmatrix row")
    # ldmatrix: x4 loads four 8x8 matrices = 16 operand rows x 16 k per warp; x2 when a warp owns only 8 rows (B).
    warp_rows = rows // warps_rows
    if warp_rows % 16 == 0:
        ldsm = "SM75_U32x4_LDSM_N" if k_major else "SM75_U16x8_LDSM_T"
        per = 16
    elif warp_rows % 8 == 0 and name == "B":
        ldsm = "SM75_U32x2_LDSM_N" if k_major else "SM75_U16x4_LDSM_T"
        per = 8
    else:
        raise _unsupported("tile.warps", f"{warps_rows}", f"each warp's {name} extent {warp_rows} is not a multiple "
                           f"of the mma tile")
    return OperandPlan(name=name, dtype=dtype, k_major=k_major, rows=rows, bk=bk, vector=vec,
                       threads_contig=t_contig, threads_other=t_other, atom_contig=atom_contig,
                       atom_other=atom_other, ldsm=ldsm, warp_rows_per_ldsm=per)


def derive(kernel: Kernel, problem: Problem) -> Plan:
    """The lowering decisions for `kernel` on the problem class of `problem` (its dtypes and layouts)."""
    if kernel.is_source:
        raise _unsupported("source", "...", "free-form Source kernels are compiled as written, not lowered")
    if kernel.repack is not None:
        raise _unsupported("repack", kernel.repack.operands, "the operand copy before the GEMM is generated by the cuda_ptx backend (sm90a wgmma); remove repack")
    tgt, tile, mma, pipe, pad, epi = kernel.target, kernel.tile, kernel.mma, kernel.pipeline, kernel.pad, kernel.epilogue
    if tgt.arch not in NVCC_ARCH:
        raise _unsupported("target.arch", tgt.arch, "unknown architecture")
    if mma.op != "mma_sync":
        raise _unsupported("mma.op", mma.op, "this backend emits mma.sync (wgmma is the cutlass_sm90 backend)")
    if tuple(mma.shape) != MMA_SHAPE:
        raise _unsupported("mma.shape", "x".join(map(str, mma.shape)), "only m16n8k16 is emitted")
    if pipe.mode != "multistage":
        raise _unsupported("pipeline.mode", pipe.mode, "this backend builds cp.async multistage pipelines")
    if pipe.schedule != "none":
        raise _unsupported("pipeline.schedule", pipe.schedule, "warp-specialized schedules need tma_ws")
    if pipe.persistent:
        raise _unsupported("pipeline.persistent", "true", "one block per output tile (no persistent scheduler)")
    if not isinstance(pipe.stages, int):
        raise _unsupported("pipeline.stages", pipe.stages, "a multistage ring needs an explicit stage count")
    if tuple(tile.cluster) != (1, 1):
        raise _unsupported("tile.cluster", "x".join(map(str, tile.cluster)), "clusters need sm90 and TMA")
    if epi.path == "tma":
        raise _unsupported("epilogue.path", "tma", "TMA stores need sm90 and a tma_ws pipeline")
    if kernel.splitk is not None and kernel.splitk.mode == "stream_k":
        raise _unsupported("splitk.mode", "stream_k", "stream-K needs a persistent tile scheduler; use split_k "
                           "here or the cutlass_sm90 backend")

    (da, la), (db, lb), (dc, lc) = problem.a, problem.b, problem.c
    if da != db:
        raise _unsupported("gemm.b", f"{db}:{lb}", f"A is {da}; mixed input types are not emitted")
    if (da, problem.acc) not in MMA_ATOM:
        raise _unsupported("gemm.acc", problem.acc, f"mma.sync has no {da} x {da} -> {problem.acc} form")
    if lc != "row":
        raise _unsupported("gemm.c", f"{dc}:{lc}", "C is row-major")

    bm, bn, bk = tile.block
    wm, wn = tile.warps
    threads = 32 * wm * wn
    if bk % MMA_SHAPE[2]:
        raise _unsupported("tile.block", f"{bm}x{bn}x{bk}", "BK must be a multiple of the mma K=16")
    if bm % (wm * 16):
        raise _unsupported("tile.block", f"{bm}x{bn}x{bk}", f"BM must be a multiple of warps_m*16={wm * 16}")
    if bn % (wn * 8):
        raise _unsupported("tile.block", f"{bm}x{bn}x{bk}", f"BN must be a multiple of warps_n*8={wn * 8}")
    swz = None
    if kernel.swizzle is not None and kernel.swizzle.smem is not None and kernel.swizzle.smem[0] > 0:
        swz = tuple(kernel.swizzle.smem)
        if swz[1] < 3:
            raise _unsupported("swizzle.smem", "<{},{},{}>".format(*swz), "M < 3 would split the 16-byte vectors "
                               "that cp.async writes and ldmatrix reads")
    raster = kernel.swizzle.raster if kernel.swizzle is not None else "along_n"
    group = kernel.swizzle.group if kernel.swizzle is not None else 1

    ebytes = DTYPE_BYTES[da]
    a = _operand("A", CUTE_TYPE[da], la == "row", bm, bk, wm, wn, threads, pad.align, swz)
    b = _operand("B", CUTE_TYPE[db], lb == "col", bn, bk, wn, wm, threads, pad.align, swz)
    copy_atom, copy_atom_zfill, copy_async = _copy_atoms(pad.align, ebytes)

    # Register fragments: with prefetch the next k-block's ldmatrix overlaps this k-block's MMAs, so two k-blocks
    # are live. The tile-crossing form needs the buffer index to repeat every tile: depth 2 when the k-blocks per
    # tile are even, else all of them. Without prefetch one k-block is live.
    kb = bk // MMA_SHAPE[2]
    stages = pipe.stages
    if pipe.prefetch and stages >= 2 and kb >= 2:
        loop = "multistage_prefetch"
        reg_depth = 2 if kb % 2 == 0 else kb
    else:
        loop = "single_stage" if stages == 1 else "multistage"
        reg_depth = 2 if (pipe.prefetch and kb >= 2) else 1

    store_vector = reduce_vector = min(epi.vector, pad.align)
    if epi.path == "direct":
        # A thread's m16n8 accumulators hold two adjacent columns of a row: at most a 2-element store.
        store_vector = min(store_vector, 2)

    if kernel.splitk is None:
        splitk, slices = "none", 1
    elif kernel.splitk.reduce == "cluster":
        raise _unsupported("splitk.reduce", "cluster", "the sm80 CuTe kernels have no thread-block clusters; "
                           "use workspace or atomic")
    else:
        splitk, slices = kernel.splitk.reduce, kernel.splitk.slices

    return Plan(
        ta=CUTE_TYPE[da], tb=CUTE_TYPE[db], tc=CUTE_TYPE[dc], tacc=CUTE_TYPE[problem.acc],
        mma_atom=MMA_ATOM[(da, problem.acc)],
        bm=bm, bn=bn, bk=bk, warps_m=wm, warps_n=wn,
        stages=stages, prefetch=pipe.prefetch, reg_depth=reg_depth, loop=loop,
        swizzle=swz, raster=raster, group=group,
        pad_m=pad.m, pad_n=pad.n, pad_k=pad.k, align=pad.align,
        copy_atom=copy_atom, copy_atom_zfill=copy_atom_zfill, copy_async=copy_async, a=a, b=b,
        epilogue=epi.path, epilogue_vector=epi.vector, store_vector=store_vector, reduce_vector=reduce_vector,
        splitk=splitk, slices=slices, arch=NVCC_ARCH[tgt.arch],
    )
