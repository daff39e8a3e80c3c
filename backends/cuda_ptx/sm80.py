"""Lower mma.sync + cp.async multistage kernels (sm80 / sm86 / sm89, and sm90 / sm90a when the schedule is the sm80
one) to raw CUDA with inline PTX: no CUTLASS, no CuTe.

Two pure steps, like the sm90a rule:
  canonicalize(kernel, problem) -> Sm80Config   every check; every IR field turned into the one value it means
  render(cfg) -> str                            the .cu text: the GEMM kernel (split-K included: one launch)
`lower()` composes them into a LaunchPlan(form="kernels"): the harness launches the entry points with the L2IR ABI
    (const void* A, const void* B, void* C, int M, int N, int K, void* workspace)
so there is no host code at all.

The GEMM kernel (one block per output tile, WM x WN warps, each warp owns a (BM/WM) x (BN/WN) block of C):
  global -> shared   cp.async copies of pad.align elements (cg 16 bytes; ca 8 or 4 bytes) into a ring of `stages`
                     buffers; the src-size operand (full or 0) zero-fills chunks past M / N / K without reading
                     them. pad.align=1: 16-byte cp.async of the aligned blocks covering each row into a staging
                     ring of `stages`, then a realign pass (shared -> shared) into the swizzled tiles ldmatrix reads.
  shared -> regs     ldmatrix.x4: a 16x16 A fragment (m16n8k16's a0..a3) or two 8x16 B fragments (b0,b1 of two n8
                     blocks) per instruction, from the swizzled K-major tiles.
  math               mma.sync.aligned.m16n8k16.row.col.f32.{f16|bf16}.{f16|bf16}.f32, fp32 accumulators in registers.
  epilogue           registers -> global (path=direct), or registers -> shared -> coalesced vector stores (path=smem);
                     split-K: the slices climb the tile's pairwise tree (l2ir.indexing.SplitKTree): at each level a
                     block stores its fp32 registers to its subtree's slot and counts in on the pair's counter; the
                     second arrival adds the sibling's slot, resets the counter and goes up; the root's block runs
                     the epilogue (bit-identical run to run, no block waits). One launch.

Field -> code map (the generated lines name their field in a comment):
  target.arch          sm80/86/89/90/90a -> plan.arch sm_80/sm_86/sm_89/sm_90/sm_90a (the header names it too)
  tile.block           BM, BN, BK: stage sizes, copy passes, k-steps per tile
  tile.warps           WM x WN warps: threads, the warp tile (MI m16 x NI n8 fragments); BN/WN must be a multiple of 16
                       (B fragments come in pairs from one ldmatrix.x4). Small tiles are legal: BM=16 with 1x4 warps
                       (decode), BN=32 with 4x1 (skinny N)
  tile.cluster         1x1 only (clusters are sm90 TMA territory)
  mma.op / mma.shape   mma_sync 16x8x16 only
  pipeline.mode        multistage only; stages = ring depth (1 = load, wait, compute without overlap)
  pipeline.prefetch    register double buffer of ldmatrix fragments across k-steps and k-tiles
  swizzle.smem         XOR swizzle of each K-major tile's element offsets (l2ir.indexing.smem_swizzle); none = plain
  swizzle.raster/group block rasterization (l2ir.indexing.rasterize) over pid = blockIdx.x
  pad.m / pad.n        predicate: rows past M/N are not loaded (stale smem only reaches unstored outputs) and stores
                       are masked; zero_fill: rows past M/N are zero-filled and stores are masked; divisible: neither
  pad.k                zero_fill: every k-tile checks K; predicate: only the last k-tile checks (still zero-fills);
                       divisible: no check
  pad.align            8 / 4 / 2: cp.async of 16 / 8 / 4 bytes (K % align == 0, so a chunk is wholly in or out of
                       K; C vectors are at most align wide, by verify); 1 (any K): each row's k-tile is staged raw
                       as the BK/8 + 1 aligned 16-byte blocks that cover it (row start aligned down; a block holding
                       no element of the k-tile is zero-filled, not read), in a cp.async ring of `stages`; a realign
                       pass shifts each 8-element chunk out of two staged blocks (ld.shared, selects, a funnel
                       shift), zeroes elements past K and stores it to a swizzled tile. stages >= 3: tile t+1 is
                       realigned while tile t is multiplied (two realigned tiles, one barrier per k-tile); stages
                       1-2: one realigned tile, a second barrier (l2ir.analysis.realigned_ring_bytes). The A and B
                       tiles must split into whole passes of 8 elements per thread
  interleave           (pad.align=1) a block's BN columns are 8 apart, n = 8 j + res (l2ir.indexing.Interleave): B's rows
                       of one residue start at one offset inside a 16-byte vector, so B's view (read from that offset
                       before each row) is copied by whole 16-byte cp.async straight into a ring of `stages` that
                       ldmatrix reads, the vectors straddling a row end loaded into registers and masked; only A is
                       staged and realigned, shifted to meet the view; k-tiles run over K + offset; stores of one
                       element, 8 columns apart
  splitk               split_k + reduce=workspace: grid.z = slices, l2ir.indexing.splitk_range, fp32 slots and an
                       in-kernel pairwise-tree reduction (SplitKTree; slices - 1 pair counters per tile, zeroed
                       before the first launch only: the kernel leaves them zero); reduce=atomic and stream_k raise
  epilogue.path        direct | smem (tma raises)
  epilogue.vector      direct: 1 (scalar) or 2 (the accumulator pair); smem: 1/2/4/8 elements per global store
  problem              a row (K-major), b col (K-major), f16 or bf16 in (same type), f16 or bf16 out, acc f32
"""

from __future__ import annotations

from dataclasses import dataclass

from l2ir.analysis import C_ROW_PAD, realigned_buffers, realigned_ring_bytes
from l2ir.indexing import (Const, Interleave, SplitKTree, Var, cdiv, column_tiles, rasterize, smem_swizzle,
                           splitk_range, substitute)
from l2ir.nodes import Kernel, Problem, Swizzle
from l2ir.target import (CUDA_FROM_FLOAT, CUDA_PAIR_FROM_FLOATS, CUDA_PAIR_TYPE, CUDA_TYPE, DTYPE_BYTES, NVCC_ARCH,
                         SMEM_LIMIT)
from l2ir.text import print_problem_class
from l2ir.verify import verify, verify_problem

from l2ir.runtime import Launch, LaunchPlan, grid_launch_dependents_lines, grid_wait_lines
from .common import UnsupportedLowering, check_problem_class, header_lines, mma_16816_lines

GEMM_ENTRY = "l2ir_cuda_ptx_sm80_gemm"
ABI = "const void* A_, const void* B_, void* C_, int M, int N, int K, void* workspace_"
M_, N_ = Var("m"), Var("n")


@dataclass(frozen=True)
class Sm80Config:
    """Everything the source depends on, already checked."""

    arch: str                 # target.arch
    in_dtype: str             # "f16" | "bf16"
    out_dtype: str            # "f16" | "bf16"
    problem_class: str
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int
    prefetch: bool
    swizzle: tuple[int, int, int] | None
    raster: str
    group: int
    pad_m: str
    pad_n: str
    pad_k: str
    epilogue: str             # "direct" | "smem"
    vector: int
    slices: int               # 1 = no split-K
    align: int = 8            # pad.align: elements per global -> shared copy
    interleave: bool = False  # the interleave node: columns 8 apart per block, only A staged and realigned

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def warp_m(self) -> int:
        return self.bm // self.wm

    @property
    def warp_n(self) -> int:
        return self.bn // self.wn

    @property
    def split(self) -> bool:
        return self.slices > 1

    @property
    def staged(self) -> bool:
        """pad.align=1: raw 16-byte blocks are staged in shared memory by cp.async and realigned there."""
        return self.align == 1

    @property
    def bufs(self) -> int:
        """Buffers ldmatrix reads: the cp.async ring itself, or (pad.align=1) the realigned tiles."""
        return realigned_buffers(self.stages) if self.staged else self.stages

    @property
    def lookahead(self) -> int:
        """pad.align=1: how many k-tiles ahead of the MMAs the realign pass runs. 1 (two realigned buffers) realigns
        tile t+1 while tile t is multiplied, with one barrier per k-tile; 0 (one buffer) realigns the tile about to
        be multiplied, behind a second barrier."""
        return realigned_buffers(self.stages) - 1

    @property
    def ring_bytes(self) -> int:
        e = DTYPE_BYTES[self.in_dtype]
        if self.staged:
            return realigned_ring_bytes(self.bm, self.bn, self.bk, self.stages, e, self.interleave)
        return self.stages * (self.bm + self.bn) * self.bk * e

    @property
    def chunk(self) -> int:
        """Elements per global -> shared copy: one cp.async of pad.align elements, or (align 1) per realigned chunk."""
        return 8 if self.align == 1 else self.align

    @property
    def chunk_note(self) -> str:
        return ("pad.align=1: 16-byte cp.async of the aligned blocks covering each row, realigned in shared memory "
                "8 elements at a time" if self.align == 1 else f"pad.align={self.align}: one {2 * self.align}-byte cp.async")

    @property
    def epilogue_bytes(self) -> int:
        """The smem epilogue stages C in the output type: split-K sums the slices in registers (the fixup) first."""
        if self.epilogue != "smem":
            return 0
        return self.bm * (self.bn + C_ROW_PAD) * DTYPE_BYTES[self.out_dtype]

    @property
    def partial_floats(self) -> int:
        """fp32 values of one slice's partial tile in the workspace (the whole BM x BN accumulator tile)."""
        return self.bm * self.bn

    @property
    def smem_bytes(self) -> int:
        # The C tile reuses the ring after the main loop has drained it.
        return max(self.ring_bytes, self.epilogue_bytes)


# ---------------------------------------------------------------------------------------------------------------
# canonicalize
# ---------------------------------------------------------------------------------------------------------------


def refusal(kernel: Kernel) -> UnsupportedLowering | None:
    """What this rule refuses in a kernel whatever the problem (the problem class is check_problem_class's), or None
    when it lowers the kernel. The one list of the rule's kernel refusals: canonicalize raises it, and the registry
    makes the rule the default mma.sync backend of the pad.align=1 kernels it takes (backends/registry.py). Pure
    arithmetic on the fields, so it may be asked about a kernel the verifier has not seen."""
    tile, mma, pipe, pad, epi = kernel.tile, kernel.mma, kernel.pipeline, kernel.pad, kernel.epilogue
    if kernel.target.arch not in NVCC_ARCH:
        return UnsupportedLowering("target.arch", f"'{kernel.target.arch}': no nvcc arch for it")
    if mma.op != "mma_sync":
        return UnsupportedLowering("mma.op", f"'{mma.op}': the sm80 rule issues mma.sync")
    if tuple(mma.shape) != (16, 8, 16):
        return UnsupportedLowering("mma.shape", f"{'x'.join(map(str, mma.shape))}: only m16n8k16 is generated")
    if pipe.mode != "multistage":
        return UnsupportedLowering("pipeline.mode", f"'{pipe.mode}': the sm80 rule builds cp.async rings")
    if pipe.schedule != "none":
        return UnsupportedLowering("pipeline.schedule", f"'{pipe.schedule}': multistage kernels are not warp-specialized")
    if pipe.persistent:
        return UnsupportedLowering("pipeline.persistent", "one block per output tile; no persistent scheduler")
    if not isinstance(pipe.stages, int):
        return UnsupportedLowering("pipeline.stages", f"{pipe.stages}: a cp.async ring needs an explicit depth")
    if tile.cluster != (1, 1):
        return UnsupportedLowering("tile.cluster", f"{tile.cluster[0]}x{tile.cluster[1]}: clusters are not used by "
                                   "cp.async pipelines; use 1x1")

    bm, bn, bk = tile.block
    wm, wn = tile.warps
    # verify's mma_divides_warp_tile guarantees BM % (16 WM) == 0, BN % (8 WN) == 0 and BK % 16 == 0.
    if (bn // wn) % 16:
        return UnsupportedLowering("tile.warps", f"{wm}x{wn}: each warp's N extent BN/WN={bn // wn} must be a "
                                   "multiple of 16 (one ldmatrix.x4 yields the B fragments of two n8 blocks)")
    if pad.align == 1 and ((bm * bk) % (8 * 32 * wm * wn) or (bn * bk) % (8 * 32 * wm * wn)):
        return UnsupportedLowering("pad.align", f"1 with block {bm}x{bn}x{bk} and {32 * wm * wn} threads: align 1 realigns "
                                   "8-element chunks, each thread the same number, so each A and B tile must split into whole passes of "
                                   "8 * threads elements")

    smem = (kernel.swizzle or Swizzle()).smem
    if smem is not None and smem[0] != 0:
        b, m, s = smem
        if m < 3:
            return UnsupportedLowering("swizzle.smem", f"<{b},{m},{s}>: M < 3 would split the 16-byte chunks that "
                                       "cp.async writes and ldmatrix reads")
        if s < b:
            return UnsupportedLowering("swizzle.smem", f"<{b},{m},{s}>: S < B overlaps the XOR source and target "
                                       "bits, which is not a bijection")

    sk = kernel.splitk
    if sk is not None:
        if sk.mode != "split_k":
            return UnsupportedLowering("splitk.mode", f"{sk.mode}: needs a persistent tile scheduler; use split_k")
        if sk.reduce != "workspace":
            return UnsupportedLowering("splitk.reduce", f"{sk.reduce}: only the deterministic workspace reduction "
                                       "is generated")

    if epi.path not in ("direct", "smem"):
        return UnsupportedLowering("epilogue.path", f"{epi.path}: TMA stores need a tma_ws pipeline; use direct or "
                                   "smem")
    if epi.path == "direct" and epi.vector > 2:
        return UnsupportedLowering("epilogue.vector", f"{epi.vector} with path=direct: a thread's m16n8 accumulator "
                                   "fragment holds 2 adjacent columns; use path=smem for wider stores")
    return None


def canonicalize(kernel: Kernel, problem: Problem) -> Sm80Config:
    """Check that the kernel is one this rule lowers and turn each IR field into its value in the source."""
    if kernel.is_source:
        raise UnsupportedLowering("source", "free-form CUDA is not generated by this backend")
    if kernel.repack is not None:
        raise UnsupportedLowering("repack", "the operand copy before the GEMM is generated by the cuda_ptx backend's sm90a rule (pad.align narrows the loads here); remove repack")
    verify(kernel)
    verify_problem(problem)
    refused = refusal(kernel)
    if refused is not None:
        raise refused
    check_problem_class(problem, " (no ldmatrix.trans)")

    tile, pipe, pad, epi = kernel.tile, kernel.pipeline, kernel.pad, kernel.epilogue
    swz = kernel.swizzle or Swizzle()
    bm, bn, bk = tile.block
    wm, wn = tile.warps
    smem = swz.smem
    if smem is not None and smem[0] == 0:
        smem = None
    slices = kernel.splitk.slices if kernel.splitk is not None else 1

    cfg = Sm80Config(
        arch=kernel.target.arch, in_dtype=problem.a[0], out_dtype=problem.c[0],
        problem_class=print_problem_class(problem),
        bm=bm, bn=bn, bk=bk, wm=wm, wn=wn, stages=pipe.stages, prefetch=pipe.prefetch,
        swizzle=tuple(smem) if smem is not None else None, raster=swz.raster, group=swz.group,
        pad_m=pad.m, pad_n=pad.n, pad_k=pad.k, epilogue=epi.path, vector=epi.vector, slices=slices,
        align=pad.align, interleave=kernel.interleave is not None,
    )
    if cfg.smem_bytes > SMEM_LIMIT[cfg.arch]:
        from l2ir.errors import ResourceError
        raise ResourceError("pipeline", "smem_layout", f"{cfg.smem_bytes} B of shared memory exceed "
                            f"{SMEM_LIMIT[cfg.arch]} B on {cfg.arch}")
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# render
# ---------------------------------------------------------------------------------------------------------------


def _load_tile(cfg: Sm80Config, op: str) -> list[str]:
    """The copies of one k-tile of A or B (`op`) into stage `stage`: CHUNKS_<op> chunks of CHUNK elements over the
    block, thread tid taking chunks tid, tid + THREADS, ... Rows follow pad.m / pad.n; K follows pad.k.
    pad.align 8 / 4 / 2: one cp.async of 16 / 8 / 4 bytes per chunk. pad.align 1: staged and realigned in shared memory
    (_load_tile_align1)."""
    rows, dim, pad_rows = ("BM", "M", cfg.pad_m) if op == "A" else ("BN", "N", cfg.pad_n)
    fld = "pad.m" if op == "A" else "pad.n"
    ptr, base = ("A", "a_rows") if op == "A" else ("B", "b_rows")
    smem_off = "SMEM_A + stage * A_STAGE" if op == "A" else "SMEM_B + stage * B_STAGE"
    out = [
        f"// k-tile `kt` of {op} ({rows} x BK, K contiguous) into ring stage `stage`.",
        f"__device__ __forceinline__ void load_{op.lower()}(unsigned smem_base, const InT* __restrict__ {ptr}, "
        f"int {base}, int M, int N, int K, int kt, int stage, bool check_k) {{",
        "  (void)M; (void)N; (void)check_k;",
        "#pragma unroll",
        f"  for (int it = 0; it < CHUNKS_{op} / THREADS; ++it) {{",
        "    const int c = it * THREADS + int(threadIdx.x);",
        "    const int r = c / (BK / CHUNK);                // row of the tile",
        "    const int kc = (c % (BK / CHUNK)) * CHUNK;     // first K element of the chunk",
        "    const int k = kt * BK + kc;",
        f"    const int grow = {base} + r;",
        f"    const unsigned dst = smem_base + 2u * unsigned({smem_off} + swz(r * BK + kc));",
    ]
    k_ok = "(!check_k || k < K)" if cfg.pad_k != "divisible" else None
    row_ok = f"grow < {dim}"
    if cfg.interleave and op == "B":
        return _load_b_interleaved(cfg)
    if cfg.align == 1:
        return _load_tile_align1(cfg, op)
    out.append(f"    const InT* src = {ptr} + (long long)grow * K + k;")
    whole = (f"    // K % {cfg.align} == 0 (pad.align={cfg.align}), so a {cfg.align}-element chunk is wholly inside or "
             "wholly outside K.")
    if pad_rows == "divisible":
        out.append(f"    // {fld}=divisible: every row of the tile exists.")
        if k_ok:
            out += [whole, f"    cp_async_zfill(dst, {k_ok} ? src : {ptr}, {k_ok});"]
        else:
            out.append("    cp_async(dst, src);")
    elif pad_rows == "predicate":
        out.append(f"    // {fld}=predicate: a row past {dim} is not loaded; its stale shared memory only reaches "
                   "outputs that are never stored.")
        if k_ok:
            out += [whole, f"    if ({row_ok}) cp_async_zfill(dst, {k_ok} ? src : {ptr}, {k_ok});"]
        else:
            out += [f"    if ({row_ok}) cp_async(dst, src);"]
    else:
        cond = f"{row_ok} && {k_ok}" if k_ok else row_ok
        out += [f"    // {fld}=zero_fill: a row past {dim} is written as zeros (src-size 0 reads nothing).",
                *([whole] if k_ok else []),
                f"    const bool ok = {cond};",
                f"    cp_async_zfill(dst, ok ? src : {ptr}, ok);"]
    out += ["  }", "}", ""]
    return out


def _load_b_interleaved(cfg: Sm80Config) -> list[str]:
    """interleave: the block's B rows are columns n = 8 j + res (view rows j of residue res, l2ir.indexing.Interleave),
    which all start `off` elements past a 16-byte boundary; read from `off` elements before each row start, they are
    an aligned tile that goes straight into the ring stage ldmatrix reads, with whole 16-byte cp.async. Only a
    vector that straddles the row's ends (the first k-tile's first, the last k-tile's last) holds elements of the
    neighbouring rows, or bytes past the matrix: those vectors are loaded into registers, their outside elements
    zeroed (NaN or Inf there would turn the zeros of A into NaN), and stored to shared memory before the barrier
    that publishes the stage. A vector with no element of the row is zero-filled and not read."""
    rows_ok = "n < N" if cfg.pad_n != "divisible" else "true"
    return [
        "// k-tile `kt` of B's view (BN rows of residue res from view row j0, K contiguous, read from `off` elements",
        "// before each row start) into ring stage `stage`. Thread tid takes chunks tid, tid + THREADS, ...",
        "__device__ __forceinline__ void copy_b(unsigned smem_base, const InT* __restrict__ B, int j0, int res, int off, "
        "int M, int N, int K, int kt, int stage, bool check_k) {",
        "  (void)M; (void)check_k;",
        "#pragma unroll",
        "  for (int it = 0; it < CHUNKS_B / THREADS; ++it) {",
        "    const int c = it * THREADS + int(threadIdx.x);",
        "    const int r = c / (BK / CHUNK);                // view row of the tile",
        "    const int kc = (c % (BK / CHUNK)) * CHUNK;     // first element of the chunk in the k-tile",
        f"    const int n = {substitute(Interleave.column(), {'j': Var('j0') + Var('r'), 'r': Var('res')}).to_cpp()};"
        "   // column of C: row of B",
        "    const int k0 = kt * BK + kc - off;             // the row's k of the chunk's first element (may be < 0)",
        "    const InT* src = B + ((long long)n * K + k0);  // 16-byte aligned",
        "    const unsigned dst = smem_base + 2u * unsigned(SMEM_B + stage * B_STAGE + swz(r * BK + kc));",
        "    const int first = max(0, -k0), end = min(CHUNK, K - k0);   // the chunk's elements inside the row",
        f"    const bool row = {rows_ok};   // pad.n: a row past N is zero-filled (its columns are never stored)",
        "    if (row && first == 0 && end == CHUNK) {",
        "      cp_async_zfill(dst, src, true);",
        "    } else if (!row || end <= first) {",
        "      cp_async_zfill(dst, B, false);   // no element of the row: 16 zero bytes, nothing read",
        "    } else {",
        "      // Straddles a row end: the aligned 16-byte vector holding the row's elements cannot cross a page.",
        "      const uint4 v = ld_global_16(src);",
        "      const unsigned w[4] = {v.x, v.y, v.z, v.w};",
        "      unsigned out[4];",
        "#pragma unroll",
        "      for (int j = 0; j < 4; ++j)",
        "        out[j] = w[j] & (((2 * j >= first && 2 * j < end) ? 0x0000ffffu : 0u) |",
        "                         ((2 * j + 1 >= first && 2 * j + 1 < end) ? 0xffff0000u : 0u));",
        "      st_shared_16(dst, out);",
        "    }",
        "  }",
        "}",
        "",
    ]


def _realign_run(cfg: Sm80Config, op: str) -> int:
    """pad.align=1: chunks per realign work item. A run of G chunks reads G + 1 staged blocks instead of 2G, but
    holds 4(G + 1) registers of blocks while the accumulators and the fragment double buffer are live: runs of 2
    (one at a time) where the warp tile's fp32 accumulators take under 128 registers (ptxas spills longer runs, and
    runs of 2 beside 128 accumulators), else 1; either way every thread gets the same number of items."""
    rows = cfg.bm if op == "A" else cfg.bn
    chunks = cfg.bk // 8
    longest = 2 if cfg.warp_m * cfg.warp_n // 32 < 128 else 1
    return next(g for g in (2, 1) if g <= longest and chunks % g == 0 and (rows * chunks // g) % cfg.threads == 0)


def _load_tile_align1(cfg: Sm80Config, op: str) -> list[str]:
    """pad.align=1: no cp.async form copies 2 bytes, and an odd K leaves rows 2-byte aligned. copy_<op> stages the
    aligned 16-byte blocks that cover each row's k-tile with 16-byte cp.async (the row start aligned down, one more
    block when the row does not start on a block; a block holding no element of the row's k-tile is not read but
    zero-filled); realign_<op> moves each row's 8-element chunks out of the staged blocks (16-byte shared loads of a
    run of chunks, register selects and a funnel shift) into the swizzled tile that ldmatrix reads, zeroing elements
    past K. Nothing waits in registers across the pipeline: the cp.async ring keeps its depth."""
    rows, dim, pad_rows = ("BM", "M", cfg.pad_m) if op == "A" else ("BN", "N", cfg.pad_n)
    fld = "pad.m" if op == "A" else "pad.n"
    ptr, base = ("A", "a_rows") if op == "A" else ("B", "b_rows")
    o = op.lower()
    n_rows = cfg.bm if op == "A" else cfg.bn
    raw_off = "SMEM_RAW + stage * RAW_STAGE" + ("" if op == "A" else " + RAW_A")
    buf_off = "SMEM_A + buf * A_STAGE" if op == "A" else "SMEM_B + buf * B_STAGE"
    n_k = "(check_k ? min(BK, K - kt * BK) : BK)" if cfg.pad_k != "divisible" else "BK"
    need = "kc < s + n"
    # interleave (A only): the k-tile starts `shift` elements before the row's k = kt * BK (B's view of its rows,
    # l2ir.indexing.Interleave), so the first k-tile holds up to 7 elements before the row, and every k-tile is
    # checked at both ends: a block holding none of the row's elements is zero-filled, never read.
    shift = cfg.interleave and op == "A"
    if shift:
        n_k = "min(BK, K + shift - kt * BK)"
        need = "kc < s + n && kc + CHUNK > s + lo"
    # The extra block is zero-filled only where the row's elements are staged as zeros too; with s == 0 realign
    # never uses it, so a row that needs none leaves it as it was.
    two = ["    if (kc == BK - CHUNK) {",
           "      const bool ok2 = @ROW@BK < s + n;",
           f"      cp_async_zfill(dst + 16u, ok2 ? src + CHUNK : {ptr}, ok2);",
           "    }"]
    if pad_rows == "divisible":
        copy = [f"    // {fld}=divisible: every row of the tile exists.",
                f"    const bool ok = {need};",
                f"    cp_async_zfill(dst, ok ? src : {ptr}, ok);",
                *[line.replace("@ROW@", "") for line in two]]
    elif pad_rows == "predicate":
        copy = [f"    // {fld}=predicate: a row past {dim} is not staged; its stale shared memory only reaches outputs",
                "    // that are never stored.",
                f"    if (grow < {dim}) {{",
                f"      const bool ok = {need};",
                f"      cp_async_zfill(dst, ok ? src : {ptr}, ok);",
                *["  " + line.replace("@ROW@", "") for line in two],
                "    }"]
    else:
        copy = [f"    // {fld}=zero_fill: a row past {dim} is staged as zeros (src-size 0 reads nothing).",
                f"    const bool ok = grow < {dim} && {need};",
                f"    cp_async_zfill(dst, ok ? src : {ptr}, ok);",
                *[line.replace("@ROW@", f"grow < {dim} && ") for line in two]]
    n_chunk = "(check_k ? max(0, min(8, K - k)) : 8)" if cfg.pad_k != "divisible" else "8"
    if shift:
        n_chunk = "max(0, min(8, K + shift - k))"
    g = _realign_run(cfg, op)
    sh = "int shift, " if shift else ""
    row_start = f"unsigned(grow) * unsigned(K){' - unsigned(shift)' if shift else ''}"
    tile_start = f"kt * BK{' - shift' if shift else ''}"
    return [
        f"// k-tile `kt` of {op} ({rows} rows, K contiguous): the raw 16-byte blocks covering each row into staging stage",
        "// `stage`. Thread tid owns chunks tid, tid + THREADS, ... of 8 elements (as realign does) and copies block kc/8",
        "// of the chunk's row; the thread owning a row's last chunk also copies the row's extra block BK/8.",
        f"__device__ __forceinline__ void copy_{o}(unsigned smem_base, const InT* __restrict__ {ptr}, int {base}, "
        f"{sh}int M, int N, int K, int kt, int stage, bool check_k) {{",
        "  (void)M; (void)N; (void)check_k;",
        f"  const unsigned base_el = unsigned(reinterpret_cast<unsigned long long>({ptr}) >> 1);   // 2-byte units",
        "#pragma unroll",
        f"  for (int it = 0; it < CHUNKS_{op} / THREADS; ++it) {{",
        "    const int c = it * THREADS + int(threadIdx.x);",
        "    const int r = c / (BK / CHUNK);               // row of the tile",
        "    const int kc = (c % (BK / CHUNK)) * CHUNK;     // first K element of the chunk in the k-tile",
        f"    const int grow = {base} + r;",
        "    // The row's k-tile starts s elements past a 16-byte boundary. A k-tile is BK * 2 bytes, a multiple of",
        "    // 16, so s is the same for every k-tile of the row; only its low 3 bits matter, so 32-bit wrap is exact.",
        f"    const int s = int((base_el + {row_start}) & 7u);",
        f"    const InT* src = {ptr} + ((long long)grow * K + {tile_start} - s + kc);   // 16-byte aligned",
        f"    const unsigned dst = smem_base + 2u * unsigned({raw_off} + r * RAW_PITCH + kc);",
        "    // Block kc/8 holds row elements kc - s .. kc - s + 7 of the k-tile: it is read only when one of them",
        "    // exists (an aligned 16-byte block never crosses a page, so reading all of it cannot fault); otherwise",
        "    // it is zero-filled without a read. The extra block holds elements BK - s .. BK - s + 7.",
        f"    const int n = {n_k};   // elements of the row in this k-tile",
        *(["    const int lo = shift - kt * BK;   // elements before the row (k < 0) in this k-tile, if positive"]
          if shift else []),
        *copy,
        "  }",
        "}",
        f"// k-tile `kt` of {op} from staging stage `stage`, realigned, into buffer `buf` (swizzled as ldmatrix reads it).",
        f"// Work item c (items tid, tid + THREADS, ...) is a run of G={g} chunks of one row, in row-major order as the",
        "// copy's chunks (with G=1 a thread realigns exactly the chunks it staged, and their row offsets are computed",
        "// once): G + 1 staged blocks are read for G chunks.",
        f"__device__ __forceinline__ void realign_{o}(unsigned smem_base, const InT* __restrict__ {ptr}, int {base}, "
        f"{sh}int K, int kt, int stage, int buf, bool check_k) {{",
        "  (void)kt; (void)check_k;",
        f"  constexpr int G = {g}, ITEMS = {rows} * (BK / CHUNK) / G;",
        "  static_assert(ITEMS % THREADS == 0, \"whole realign passes\");",
        f"  const unsigned base_el = unsigned(reinterpret_cast<unsigned long long>({ptr}) >> 1);",
        *(["// One run at a time: unrolled, the runs' staged blocks would all be live beside the accumulators.",
           "#pragma unroll 1"] if g > 1 and n_rows * cfg.bk // 8 // g > cfg.threads else ["#pragma unroll"]),
        "  for (int it = 0; it < ITEMS / THREADS; ++it) {",
        "    const int c = it * THREADS + int(threadIdx.x);",
        "    const int r = c / (BK / CHUNK / G);                 // row of the tile",
        "    const int kc0 = (c % (BK / CHUNK / G)) * G * CHUNK;  // first K element of the run in the k-tile",
        *([f"    const int grow = {base} + r;",
           f"    const int s = int((base_el + {row_start}) & 7u);   // as in copy_{o}"] if shift else
          ["    const int s = int((base_el + unsigned(" + base + " + r) * unsigned(K)) & 7u);   // as in copy_" + o]),
        f"    const unsigned src = smem_base + 2u * unsigned({raw_off} + r * RAW_PITCH + kc0);",
        "    uint4 blk[G + 1];",
        "#pragma unroll",
        "    for (int g = 0; g <= G; ++g) blk[g] = ld_shared_16(src + 16u * unsigned(g));",
        "#pragma unroll",
        "    for (int g = 0; g < G; ++g) {",
        "      const int kc = kc0 + g * CHUNK;",
        *(["      const int k = kt * BK + kc;"] if cfg.pad_k != "divisible" or shift else []),
        "      Raw x;",
        "      x.lo = blk[g];",
        "      x.hi = blk[g + 1];",
        "      x.s = s;",
        "      // Elements past K are zeroed (they are the next row's, or past the matrix); rows past M / N come",
        "      // from the staging as the copy left them.",
        f"      x.n = {n_chunk};",
        *(["      x.first = shift - k;   // elements before the row (k < 0): B's view starts `shift` early"]
          if shift else []),
        "      unsigned w[4];",
        "      realign(x, w);",
        f"      st_shared_16(smem_base + 2u * unsigned({buf_off} + swz(r * BK + kc)), w);",
        "    }",
        "  }",
        "}",
        "",
    ]


def _k_check(cfg: Sm80Config, tile: str) -> tuple[str, str]:
    if cfg.pad_k == "predicate":
        return (f"k_begin + {tile} == k_tiles - 1",
                "pad.k=predicate: only the last k-tile can run past K, so only it checks (and zero-fills)")
    if cfg.pad_k == "zero_fill":
        return "true", "pad.k=zero_fill: every k-tile checks K; chunks past K are zero-filled"
    return "false", "pad.k=divisible: K % BK == 0, no k-tile runs past K"


def _issue(cfg: Sm80Config, tile: str, stage: str, indent: str) -> list[str]:
    """Issue both operands' copies of k-tile `tile` (relative to k_begin) into `stage`."""
    check, note = _k_check(cfg, tile)
    return [
        f"{indent}// {note}",
        f"{indent}load_a(smem_base, A, a_rows, M, N, K, k_begin + {tile}, {stage}, {check});",
        f"{indent}load_b(smem_base, B, b_rows, M, N, K, k_begin + {tile}, {stage}, {check});",
    ]


def _copy_staged(cfg: Sm80Config, tile: str, indent: str) -> list[str]:
    """pad.align=1: issue the staging copies of k-tile `tile` (relative to k_begin) into stage tile % STAGES
    (interleave: A's staging and B's ring stage)."""
    check, note = _k_check(cfg, tile)
    if cfg.interleave:
        return [
            f"{indent}// interleave: both ends of B's view are checked on every k-tile (the first starts before the row).",
            f"{indent}copy_a(smem_base, A, a_rows, b_off, M, N, K, k_begin + {tile}, ({tile}) % STAGES, true);",
            f"{indent}copy_b(smem_base, B, b_rows, b_res, b_off, M, N, K, k_begin + {tile}, ({tile}) % STAGES, true);",
        ]
    return [
        f"{indent}// {note}",
        f"{indent}copy_a(smem_base, A, a_rows, M, N, K, k_begin + {tile}, ({tile}) % STAGES, {check});",
        f"{indent}copy_b(smem_base, B, b_rows, M, N, K, k_begin + {tile}, ({tile}) % STAGES, {check});",
    ]


def _realign_staged(cfg: Sm80Config, tile: str, indent: str) -> list[str]:
    """pad.align=1: realign k-tile `tile` from its staging stage into realigned buffer tile % BUFS."""
    check, _ = _k_check(cfg, tile)
    if cfg.interleave:
        return [
            f"{indent}if ({tile} < k_count) {{   // interleave: only A is realigned (B's tile is read in its stage)",
            f"{indent}  realign_a(smem_base, A, a_rows, b_off, K, k_begin + {tile}, ({tile}) % STAGES, ({tile}) % BUFS, "
            "true);",
            f"{indent}}}",
        ]
    return [
        f"{indent}if ({tile} < k_count) {{",
        f"{indent}  realign_a(smem_base, A, a_rows, K, k_begin + {tile}, ({tile}) % STAGES, ({tile}) % BUFS, {check});",
        f"{indent}  realign_b(smem_base, B, b_rows, K, k_begin + {tile}, ({tile}) % STAGES, ({tile}) % BUFS, {check});",
        f"{indent}}}",
    ]


def _mainloop_staged(cfg: Sm80Config) -> list[str]:
    """pad.align=1: cp.async stages raw blocks in a ring of STAGES; a realign pass turns a staged k-tile into the
    swizzled tile ldmatrix reads (lookahead 1: tile t+1 while tile t is multiplied, one barrier per k-tile;
    lookahead 0: the tile about to be multiplied, behind a second barrier)."""
    i = "  "
    la = cfg.lookahead
    frags = ["#pragma unroll", "for (int kk = 0; kk < KSTEPS; ++kk) {",
             "  load_frags(smem_base, @BUF@, kk, fa[0], fb[0]);", "  mma_all(acc, fa[0], fb[0]);", "}"]
    # interleave: A's realigned buffer and B's ring stage (the staging stage the k-tile was copied to).
    bstage = (lambda buf, stage: f"{buf}, {stage}") if cfg.interleave else (lambda buf, stage: buf)
    if cfg.stages == 1:
        return [
            f"{i}// pipeline.stages=1: one staging buffer and one realigned buffer; a k-tile's copy cannot overlap the",
            f"{i}// MMAs that read the previous one.",
            f"{i}for (int t = 0; t < k_count; ++t) {{",
            f"{i}  __syncthreads();   // every warp has finished realigning and reading the previous k-tile",
            *_copy_staged(cfg, "t", i + "  "),
            f"{i}  cp_async_commit();",
            f"{i}  cp_async_wait<0>();",
            f"{i}  __syncthreads();   // every thread's staged blocks are visible to every warp",
            *_realign_staged(cfg, "t", i + "  "),
            f"{i}  __syncthreads();   // the realigned k-tile is visible to every warp",
            *[i + "  " + line.replace("@BUF@", bstage("0", "0")) for line in frags],
            f"{i}}}",
        ]
    staged_note = ("tile t+1 staged" if la else "tile t staged")
    lines = [
        f"{i}// pad.align=1, lookahead {la}: {cfg.stages} staging stages; "
        + (f"a k-tile is realigned while the one before it is multiplied, so {cfg.stages - 2} k-tile(s) are in flight "
           "during the MMAs." if la else "a k-tile is realigned just before its MMAs, behind a second barrier."),
        f"{i}// Prologue: put STAGES-1 k-tiles in flight. Every slot commits a group, even an empty one, so the group",
        f"{i}// count per k-tile stays uniform and cp.async.wait_group N means 'tile t landed'.",
        f"{i}#pragma unroll",
        f"{i}for (int s = 0; s < STAGES - 1; ++s) {{",
        f"{i}  if (s < k_count) {{",
        *_copy_staged(cfg, "s", i + "    "),
        f"{i}  }}",
        f"{i}  cp_async_commit();",
        f"{i}}}",
    ]
    if not cfg.prefetch:
        if la:
            lines += [
                f"{i}cp_async_wait<STAGES - 2>();   // k-tile 0 staged",
                f"{i}__syncthreads();",
                *_realign_staged(cfg, "0", i),
            ]
        return lines + [
            f"{i}// pipeline.prefetch=false: each k-step's fragments are loaded, then consumed.",
            f"{i}for (int t = 0; t < k_count; ++t) {{",
            f"{i}  // Groups committed so far: k-tiles up to t+STAGES-2; allowing STAGES-{2 + la} pending means {staged_note}.",
            f"{i}  cp_async_wait<STAGES - {2 + la}>();",
            f"{i}  // The staged k-tile is visible to every warp; every warp has finished realigning k-tile t-1 out of the",
            f"{i}  // stage refilled next" + (", and (lookahead 1) publishes realigned k-tile t and has finished reading "
                                           "the buffer k-tile t+1 goes to." if la else "."),
            f"{i}  __syncthreads();",
            f"{i}  if (t + STAGES - 1 < k_count) {{",
            *_copy_staged(cfg, "t + STAGES - 1", i + "    "),
            f"{i}  }}",
            f"{i}  cp_async_commit();",
            *([] if la else [*_realign_staged(cfg, "t", i + "  "),
                             f"{i}  __syncthreads();   // the realigned k-tile is visible to every warp"]),
            *[i + "  " + line.replace("@BUF@", bstage("t % BUFS", "t % STAGES")) for line in frags],
            *([f"{i}  // Realign k-tile t+1 while other warps still multiply: its buffer was last read by k-tile t-1.",
               *_realign_staged(cfg, "t + 1", i + "  ")] if la else []),
            f"{i}}}",
        ]
    odd = (cfg.bk // 16) % 2 == 1
    boundary = ([f"{i}      // Groups committed: tiles up to t+STAGES-1; allowing STAGES-3 pending means tile t+2 is staged.",
                 f"{i}      cp_async_wait<STAGES - 3>();",
                 f"{i}      // Every warp has finished reading k-tile t's buffer; realigned k-tile t+1 and staged k-tile",
                 f"{i}      // t+2 are visible to every warp.",
                 f"{i}      __syncthreads();"] if la else
                [f"{i}      // Groups committed: tiles up to t+STAGES-1; allowing STAGES-2 pending means tile t+1 is staged.",
                 f"{i}      cp_async_wait<STAGES - 2>();",
                 f"{i}      __syncthreads();   // every warp has finished reading k-tile t's buffer",
                 *_realign_staged(cfg, "t + 1", i + "      "),
                 f"{i}      __syncthreads();   // realigned k-tile t+1 is visible to every warp"])
    last_step = [f"{i}    if (kk == KSTEPS - 1) {{",
                 *boundary,
                 f"{i}      read_buf = (t + 1) % BUFS;",
                 *([f"{i}      read_stage = (t + 1) % STAGES;"] if cfg.interleave else []),
                 f"{i}    }}"]
    body_frags = [f"{i}    // Fragments of the next k-step (the next tile's first after the last step) into the other buffer.",
                  f"{i}    load_frags(smem_base, {bstage('read_buf', 'read_stage')}, (kk + 1) % KSTEPS, "
                  f"fa[((kk + 1) % KSTEPS) & 1], fb[((kk + 1) % KSTEPS) & 1]);"]
    if odd:
        body = [f"{i}    if (kk == KSTEPS - 1) {{",
                f"{i}      // KSTEPS={cfg.bk // 16} is odd: this step's buffer is also the next tile's first, so",
                f"{i}      // consume it before the loads below overwrite it.",
                f"{i}      mma_all(acc, fa[kk & 1], fb[kk & 1]);",
                f"{i}    }}",
                *last_step, *body_frags,
                f"{i}    if (kk != KSTEPS - 1) mma_all(acc, fa[kk & 1], fb[kk & 1]);"]
    else:
        body = [*last_step, *body_frags, f"{i}    mma_all(acc, fa[kk & 1], fb[kk & 1]);"]
    if la:
        body += [f"{i}    if (kk == KSTEPS - 1) {{",
                 f"{i}      // Realign k-tile t+2 into the buffer k-tile t used (every warp passed the barrier above after",
                 f"{i}      // reading it) while other warps multiply; the next tile boundary's barrier publishes it.",
                 *_realign_staged(cfg, "t + 2", i + "      "),
                 f"{i}    }}"]
    return lines + [
        f"{i}cp_async_wait<STAGES - {2 + la}>();   // k-tile 0" + (" and 1" if la else "") + " staged",
        f"{i}__syncthreads();",
        *_realign_staged(cfg, "0", i),
        *(_realign_staged(cfg, "1", i) if la else []),
        f"{i}__syncthreads();   // realigned k-tile 0 is visible to every warp",
        f"{i}int read_buf = 0;   // realigned buffer of the k-tile being multiplied",
        *([f"{i}int read_stage = 0;   // interleave: B's ring stage of the k-tile being multiplied"]
          if cfg.interleave else []),
        f"{i}// pipeline.prefetch=true: ldmatrix of k-step kk+1 (across the tile boundary too) is in flight while",
        f"{i}// k-step kk's MMAs run, so ldmatrix latency never stalls the tensor cores.",
        f"{i}load_frags(smem_base, {bstage('0', '0')}, 0, fa[0], fb[0]);",
        f"{i}for (int t = 0; t < k_count; ++t) {{",
        f"{i}#pragma unroll",
        f"{i}  for (int kk = 0; kk < KSTEPS; ++kk) {{",
        f"{i}    if (kk == 0) {{",
        f"{i}      // Refill the stage k-tile t-1 was staged in: every warp realigned it before an earlier barrier.",
        f"{i}      if (t + STAGES - 1 < k_count) {{",
        *_copy_staged(cfg, "t + STAGES - 1", i + "        "),
        f"{i}      }}",
        f"{i}      cp_async_commit();",
        f"{i}    }}",
        *body,
        f"{i}  }}",
        f"{i}}}",
    ]


def _mainloop(cfg: Sm80Config) -> list[str]:
    i = "  "
    if cfg.staged:
        return _mainloop_staged(cfg)
    if cfg.stages == 1:
        return [
            f"{i}// pipeline.stages=1: one buffer, so a k-tile's copy cannot overlap the MMAs that read the previous one.",
            f"{i}for (int t = 0; t < k_count; ++t) {{",
            f"{i}  __syncthreads();   // every warp has finished reading the previous k-tile",
            *_issue(cfg, "t", "0", i + "  "),
            f"{i}  cp_async_commit();",
            f"{i}  cp_async_wait<0>();",
            f"{i}  __syncthreads();   // the k-tile is in shared memory and visible to every warp",
            f"{i}#pragma unroll",
            f"{i}  for (int kk = 0; kk < KSTEPS; ++kk) {{",
            f"{i}    load_frags(smem_base, 0, kk, fa[0], fb[0]);",
            f"{i}    mma_all(acc, fa[0], fb[0]);",
            f"{i}  }}",
            f"{i}}}",
        ]
    lines = [
        f"{i}// Prologue: put STAGES-1 k-tiles in flight before the first MMA. Every slot commits a group, even an",
        f"{i}// empty one, so the group count per k-tile stays uniform and cp.async.wait_group N means 'tile t landed'.",
        f"{i}#pragma unroll",
        f"{i}for (int s = 0; s < STAGES - 1; ++s) {{",
        f"{i}  if (s < k_count) {{",
        *_issue(cfg, "s", "s", i + "    "),
        f"{i}  }}",
        f"{i}  cp_async_commit();",
        f"{i}}}",
        f"{i}int read_stage = 0;             // stage holding k-tile t",
        f"{i}int write_stage = STAGES - 1;   // stage k-tile t+STAGES-1 goes to: the one k-tile t-1 used",
    ]
    if not cfg.prefetch:
        return lines + [
            f"{i}// pipeline.prefetch=false: each k-step's fragments are loaded, then consumed.",
            f"{i}for (int t = 0; t < k_count; ++t) {{",
            f"{i}  // Groups committed so far: k-tiles up to t+STAGES-2. Allowing STAGES-2 pending means tile t landed.",
            f"{i}  cp_async_wait<STAGES - 2>();",
            f"{i}  // Make tile t visible to every warp; also every warp has finished reading tile t-1, whose stage",
            f"{i}  // is refilled next.",
            f"{i}  __syncthreads();",
            f"{i}  if (t + STAGES - 1 < k_count) {{",
            *_issue(cfg, "t + STAGES - 1", "write_stage", i + "    "),
            f"{i}  }}",
            f"{i}  cp_async_commit();",
            f"{i}#pragma unroll",
            f"{i}  for (int kk = 0; kk < KSTEPS; ++kk) {{",
            f"{i}    load_frags(smem_base, read_stage, kk, fa[0], fb[0]);",
            f"{i}    mma_all(acc, fa[0], fb[0]);",
            f"{i}  }}",
            f"{i}  write_stage = read_stage;",
            f"{i}  read_stage = (read_stage + 1 == STAGES) ? 0 : read_stage + 1;",
            f"{i}}}",
        ]
    odd = (cfg.bk // 16) % 2 == 1
    last_step = [f"{i}    if (kk == KSTEPS - 1) {{",
                 f"{i}      // The next k-tile's first k-step is read below. Groups committed: tiles up to t+STAGES-1,",
                 f"{i}      // so allowing STAGES-2 pending means tile t+1 landed; the barrier makes it visible.",
                 f"{i}      read_stage = (read_stage + 1 == STAGES) ? 0 : read_stage + 1;",
                 f"{i}      cp_async_wait<STAGES - 2>();",
                 f"{i}      __syncthreads();",
                 f"{i}    }}"]
    body_frags = [f"{i}    // Fragments of the next k-step (the next tile's first after the last step) into the other buffer.",
                  f"{i}    load_frags(smem_base, read_stage, (kk + 1) % KSTEPS, fa[((kk + 1) % KSTEPS) & 1], "
                  f"fb[((kk + 1) % KSTEPS) & 1]);"]
    body_mma = [f"{i}    mma_all(acc, fa[kk & 1], fb[kk & 1]);"]
    if odd:
        # With an odd number of k-steps the last step's buffer (kk & 1 == 0) is also the next tile's first: issue
        # its MMAs before overwriting it (the compiler renames registers, so the loads still overlap).
        body = [f"{i}    if (kk == KSTEPS - 1) {{",
                f"{i}      // KSTEPS={cfg.bk // 16} is odd: this step's buffer is also the next tile's first, so",
                f"{i}      // consume it before the loads below overwrite it.",
                f"{i}      mma_all(acc, fa[kk & 1], fb[kk & 1]);",
                f"{i}    }}",
                *last_step, *body_frags,
                f"{i}    if (kk != KSTEPS - 1) mma_all(acc, fa[kk & 1], fb[kk & 1]);"]
    else:
        body = [*last_step, *body_frags, *body_mma]
    return lines + [
        f"{i}// pipeline.prefetch=true: ldmatrix of k-step kk+1 (across the tile boundary too) is in flight while",
        f"{i}// k-step kk's MMAs run, so ldmatrix latency never stalls the tensor cores.",
        f"{i}cp_async_wait<STAGES - 2>();   // k-tile 0 landed",
        f"{i}__syncthreads();",
        f"{i}load_frags(smem_base, read_stage, 0, fa[0], fb[0]);",
        f"{i}for (int t = 0; t < k_count; ++t) {{",
        f"{i}#pragma unroll",
        f"{i}  for (int kk = 0; kk < KSTEPS; ++kk) {{",
        f"{i}    if (kk == 0) {{",
        f"{i}      // Refill the stage tile t-1 used: every warp passed the barrier after its last read of it.",
        f"{i}      if (t + STAGES - 1 < k_count) {{",
        *_issue(cfg, "t + STAGES - 1", "write_stage", i + "        "),
        f"{i}      }}",
        f"{i}      cp_async_commit();",
        f"{i}      write_stage = (write_stage + 1 == STAGES) ? 0 : write_stage + 1;",
        f"{i}    }}",
        *body,
        f"{i}  }}",
        f"{i}}}",
    ]


def _bounds(cfg: Sm80Config, m: str, n: str) -> str | None:
    conds = []
    if cfg.pad_m != "divisible":
        conds.append(f"{m} < M")
    if cfg.pad_n != "divisible":
        conds.append(f"{n} < N")
    return " && ".join(conds) if conds else None


def _guarded(cond: str | None, stmt: str, indent: str) -> str:
    return f"{indent}if ({cond}) {stmt}" if cond else f"{indent}{stmt}"


def _epilogue(cfg: Sm80Config) -> list[str]:
    i = "  "
    bounds_note = ("pad.m/n=divisible: whole tiles, no bounds checks" if _bounds(cfg, "m", "n") is None else
                   f"N % {cfg.vector} == 0 (epilogue.vector={cfg.vector}, by verify), so a vector is wholly "
                   "inside or wholly outside the matrix")
    if cfg.epilogue == "direct":
        head = [f"{i}// epilogue.path=direct: each thread stores its accumulators straight from registers. m16n8 f32",
                f"{i}// fragment: c0,c1 at (groupID, 2*tig + 0/1), c2,c3 at (groupID + 8, ...); groupID = lane/4, tig = lane%4."]
        coords = [f"{i}      const int n = tile_n * BN + warp_n * WARP_N + ni * 8 + (lane & 3) * 2;"]
        dst = "C + (long long)m * N + n"
        if cfg.interleave:
            head.append(f"{i}// interleave: view row j is column 8 j + b_res, so a thread's two columns are 8 apart.")
            col = _view_column(Var("jv"))
            coords = [f"{i}      const int jv = b_rows + warp_n * WARP_N + ni * 8 + (lane & 3) * 2;   // view row",
                      f"{i}      const int n = {col};"]
            stores = [f"{i}        // epilogue.vector=1 (verify): two scalar stores, each predicated.",
                      _guarded(_bounds(cfg, "m", "n"), f"({dst})[0] = to_out(acc[mi][ni][2 * h]);", i + "        "),
                      _guarded(_bounds(cfg, "m", "n + 8"), f"({dst})[8] = to_out(acc[mi][ni][2 * h + 1]);",
                               i + "        ")]
        elif cfg.vector == 2:
            st0 = f"*reinterpret_cast<Out2T*>({dst}) = pack2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);"
            stores = [f"{i}        // epilogue.vector=2: one store of the packed pair (4 bytes); {bounds_note}.",
                      _guarded(_bounds(cfg, "m", "n"), st0, i + "        ")]
        else:
            conv = "to_out"
            c1 = _bounds(cfg, "m", "n + 1")
            stores = [f"{i}        // epilogue.vector=1: two scalar stores, each predicated.",
                      _guarded(_bounds(cfg, "m", "n"), f"({dst})[0] = {conv}(acc[mi][ni][2 * h]);", i + "        "),
                      _guarded(c1, f"({dst})[1] = {conv}(acc[mi][ni][2 * h + 1]);", i + "        ")]
        return [
            *head,
            f"{i}#pragma unroll",
            f"{i}for (int mi = 0; mi < MI; ++mi) {{",
            f"{i}#pragma unroll",
            f"{i}  for (int ni = 0; ni < NI; ++ni) {{",
            f"{i}#pragma unroll",
            f"{i}    for (int h = 0; h < 2; ++h) {{",
            f"{i}      const int m = tile_m * BM + warp_m * WARP_M + mi * 16 + (lane >> 2) + 8 * h;",
            *coords,
            f"{i}      {{",
            *stores,
            f"{i}      }}",
            f"{i}    }}",
            f"{i}  }}",
            f"{i}}}",
        ]
    v = cfg.vector
    st = "OutT"
    frag_write = "*reinterpret_cast<Out2T*>(&c_tile[r * C_PITCH + c]) = pack2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);"
    dst = "C + (long long)m * N + n"
    what = "C"
    store = f"*reinterpret_cast<Vec<{st}, VEC>*>({dst}) = *reinterpret_cast<const Vec<{st}, VEC>*>(&c_tile[r * C_PITCH + cv]);"
    passes_exact = (cfg.bm * (cfg.bn // v)) % cfg.threads == 0
    return [
        f"{i}// epilogue.path=smem: stage the C tile in shared memory ({st}, rows padded by {C_ROW_PAD} elements), then store",
        f"{i}// whole rows with {v}-element vectors (epilogue.vector={v}) to {what}: consecutive threads write",
        f"{i}// consecutive addresses. The tile reuses the ring: drain every cp.async and wait for every warp's last read.",
        f"{i}cp_async_wait<0>();",
        f"{i}__syncthreads();",
        f"{i}{st}* c_tile = reinterpret_cast<{st}*>(smem);",
        f"{i}#pragma unroll",
        f"{i}for (int mi = 0; mi < MI; ++mi) {{",
        f"{i}#pragma unroll",
        f"{i}  for (int ni = 0; ni < NI; ++ni) {{",
        f"{i}#pragma unroll",
        f"{i}    for (int h = 0; h < 2; ++h) {{",
        f"{i}      const int r = warp_m * WARP_M + mi * 16 + (lane >> 2) + 8 * h;",
        f"{i}      const int c = warp_n * WARP_N + ni * 8 + (lane & 3) * 2;",
        f"{i}      {frag_write}",
        f"{i}    }}",
        f"{i}  }}",
        f"{i}}}",
        f"{i}__syncthreads();",
        f"{i}constexpr int VEC = {v};",
        f"{i}#pragma unroll",
        f"{i}for (int p = 0; p < (BM * (BN / VEC) + THREADS - 1) / THREADS; ++p) {{",
        f"{i}  const int idx = p * THREADS + int(threadIdx.x);",
        *([] if passes_exact else [f"{i}  if (idx >= BM * (BN / VEC)) break;"]),
        f"{i}  const int r = idx / (BN / VEC);",
        f"{i}  const int cv = (idx % (BN / VEC)) * VEC;",
        f"{i}  const int m = tile_m * BM + r;",
        (f"{i}  const int n = {_view_column(Var('b_rows') + Var('cv'))};   // interleave: view row b_rows + cv"
         if cfg.interleave else f"{i}  const int n = tile_n * BN + cv;"),
        f"{i}  // {bounds_note}.",
        _guarded(_bounds(cfg, "m", "n"), store, i + "  "),
        f"{i}}}",
    ]


def _view_column(row) -> str:
    """interleave: the column of C of view row `row` of the block's residue b_res (l2ir.indexing.Interleave)."""
    return substitute(Interleave.column(), {"j": row, "r": Var("b_res")}).to_cpp()


def _header(cfg: Sm80Config, kernel_text: str) -> list[str]:
    """What generated the file, from which IR and problem class, and the headers it needs."""
    return header_lines(
        ("// Generated by L2IR backends/cuda_ptx (sm80 rule): mma.sync m16n8k16 + ldmatrix + cp.async multistage,",
         "// raw CUDA with inline PTX. Do not edit: regenerate from the kernel IR."),
        kernel_text, cfg.problem_class, cfg.arch)


def _config(cfg: Sm80Config) -> list[str]:
    """Element types and the compile-time shape of the schedule: tile, warps, fragments, ring stages."""
    it, ot = CUDA_TYPE[cfg.in_dtype], CUDA_TYPE[cfg.out_dtype]
    out2 = CUDA_PAIR_TYPE[cfg.out_dtype]
    return [
        "namespace l2ir_ptx_sm80 {",
        "",
        f"using InT = {it};",
        f"using OutT = {ot};",
        f"using Out2T = {out2};",
        "",
        f"constexpr int BM = {cfg.bm}, BN = {cfg.bn}, BK = {cfg.bk};   // tile.block",
        f"constexpr int WM = {cfg.wm}, WN = {cfg.wn};                   // tile.warps",
        "constexpr int THREADS = 32 * WM * WN;",
        "constexpr int WARP_M = BM / WM, WARP_N = BN / WN;   // each warp's block of C",
        "constexpr int MI = WARP_M / 16, NI = WARP_N / 8;    // m16n8 accumulator fragments per warp",
        "constexpr int KSTEPS = BK / 16;                     // m16n8k16 k-steps per k-tile",
        f"constexpr int STAGES = {cfg.stages};                       // pipeline.stages",
        *(["constexpr int A_STAGE = BM * BK, B_STAGE = BN * BK;  // elements per ring stage",
           "constexpr int SMEM_A = 0, SMEM_B = STAGES * A_STAGE;  // element offsets of the two rings"]
          if not cfg.staged else
          ["constexpr int A_STAGE = BM * BK, B_STAGE = BN * BK;  // elements per A buffer and B ring stage "
           "(what ldmatrix reads)",
           f"constexpr int BUFS = {cfg.bufs};   // realigned A buffers: the k-tile multiplied + {cfg.lookahead} "
           "realigned ahead",
           "constexpr int SMEM_A = 0, SMEM_B = BUFS * A_STAGE;  // element offsets of the realigned A buffers and "
           "B's ring",
           "// interleave: B's view is aligned, so B's STAGES ring stages are what ldmatrix reads; only A is staged raw",
           "// (STAGES stages): each row holds the BK/8 + 1 aligned 16-byte blocks that cover its k-tile.",
           "constexpr int RAW_PITCH = BK + 8;   // elements per staged row: BK/8 + 1 blocks",
           "constexpr int RAW_A = BM * RAW_PITCH, RAW_STAGE = RAW_A;",
           "constexpr int SMEM_RAW = BUFS * A_STAGE + STAGES * B_STAGE;  // element offset of A's staging ring"]
          if cfg.interleave else
          ["constexpr int A_STAGE = BM * BK, B_STAGE = BN * BK;  // elements per realigned buffer (what ldmatrix reads)",
           f"constexpr int BUFS = {cfg.bufs};   // realigned buffers: the k-tile multiplied + {cfg.lookahead} realigned ahead",
           "constexpr int SMEM_A = 0, SMEM_B = BUFS * A_STAGE;  // element offsets of the realigned A and B buffers",
           "// pad.align=1 staging ring (STAGES stages, A's BM rows then B's BN rows): each row holds the BK/8 + 1",
           "// aligned 16-byte blocks that cover its k-tile, raw (the row's first element s elements into block 0).",
           "constexpr int RAW_PITCH = BK + 8;   // elements per staged row: BK/8 + 1 blocks",
           "constexpr int RAW_A = BM * RAW_PITCH, RAW_STAGE = (BM + BN) * RAW_PITCH;",
           "constexpr int SMEM_RAW = BUFS * (A_STAGE + B_STAGE);  // element offset of the staging ring"]),
        f"constexpr int CHUNK = {cfg.chunk};   // elements per global -> shared copy ({cfg.chunk_note})",
        "constexpr int CHUNKS_A = BM * BK / CHUNK, CHUNKS_B = BN * BK / CHUNK;   // copies per tile",
        "static_assert(CHUNKS_A % THREADS == 0 && CHUNKS_B % THREADS == 0, \"whole copy passes\");",
        "static_assert(NI % 2 == 0, \"B fragments come in pairs from one ldmatrix.x4\");",
        *([f"constexpr int C_PITCH = BN + {C_ROW_PAD};   // staged C row pitch (epilogue.path=smem)"]
          if cfg.epilogue == "smem" else []),
        "",
    ]


def _copy_functions(cfg: Sm80Config) -> list[str]:
    """The global -> shared copy primitives pad.align allows."""
    if cfg.align == 1:
        return [
            "// pad.align=1: rows may start on any 2-byte boundary, which no cp.async form copies. The aligned 16-byte",
            "// blocks covering each row are staged with cp.async.cg (bypassing L1: the tile is reused from shared",
            "// memory); src-size 0 writes 16 zero bytes and reads nothing (a block holding no element of the row's",
            "// k-tile). `src` must still be a valid address, so callers pass the operand's base when !valid.",
            "__device__ __forceinline__ void cp_async_zfill(unsigned dst, const void* src, bool valid) {",
            "  const int src_bytes = valid ? 16 : 0;",
            '  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(dst), "l"(src), "r"(src_bytes)',
            '               : "memory");',
            "}",
            *(["// interleave: a 16-byte vector of B that straddles a row end, loaded into registers to zero the other",
               "// rows' elements (read once: no L1 allocation).",
               "__device__ __forceinline__ uint4 ld_global_16(const InT* p) {",
               "  uint4 v;",
               '  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\\n"',
               '               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));',
               "  return v;",
               "}"] if cfg.interleave else []),
            "__device__ __forceinline__ uint4 ld_shared_16(unsigned src) {",
            "  uint4 v;",
            '  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)',
            '               : "r"(src) : "memory");',
            "  return v;",
            "}",
            "// 8 realigned elements are written with one 16-byte shared store (the swizzle keeps 8-element chunks whole",
            "// and aligned).",
            "__device__ __forceinline__ void st_shared_16(unsigned dst, const unsigned (&w)[4]) {",
            '  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\\n" :: "r"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]),',
            '               "r"(w[3]) : "memory");',
            "}",
            *(["// A chunk being realigned: the two staged 16-byte blocks around it, the element offset s of its first",
               "// element inside lo, and which of its 8 elements exist (first .. n - 1; interleave: the k-tile starts",
               "// before the row, so its first elements are the previous row's).",
               "struct Raw { uint4 lo, hi; int s, first, n; };",
               "// Elements s .. s+7 of lo:hi, elements before `first` and from n on zeroed (they are other rows' bytes,",
               "// or bytes past K). The offset s = 4*s4 + 2*s2 + s1 is applied with whole-register selects for s4 and",
               "// s2 (a dynamically indexed register array would live in local memory) and one funnel shift by 16 bits",
               "// for s1."] if cfg.interleave else
              ["// A chunk being realigned: the two staged 16-byte blocks around it, the element offset s of its first",
               "// element inside lo, and how many of its 8 elements exist (n).",
               "struct Raw { uint4 lo, hi; int s, n; };",
               "// Elements s .. s+7 of lo:hi, elements n .. 7 zeroed (they are other rows' bytes, or bytes past K). The",
               "// offset s = 4*s4 + 2*s2 + s1 is applied with whole-register selects for s4 and s2 (a dynamically indexed",
               "// register array would live in local memory) and one funnel shift by 16 bits for s1."]),
            "__device__ __forceinline__ void realign(const Raw& c, unsigned (&out)[4]) {",
            "  const unsigned w[8] = {c.lo.x, c.lo.y, c.lo.z, c.lo.w, c.hi.x, c.hi.y, c.hi.z, c.hi.w};",
            "  unsigned u[6], v[5];",
            "#pragma unroll",
            "  for (int j = 0; j < 6; ++j) u[j] = (c.s & 4) ? w[j + 2] : w[j];",
            "#pragma unroll",
            "  for (int j = 0; j < 5; ++j) v[j] = (c.s & 2) ? u[j + 1] : u[j];",
            "#pragma unroll",
            "  for (int j = 0; j < 4; ++j) {",
            "    const unsigned x = __funnelshift_r(v[j], v[j + 1], (c.s & 1) * 16);",
            ("    out[j] = x & (((2 * j >= c.first && 2 * j < c.n) ? 0x0000ffffu : 0u) |"
             " ((2 * j + 1 >= c.first && 2 * j + 1 < c.n) ? 0xffff0000u : 0u));" if cfg.interleave else
             "    out[j] = x & ((2 * j + 1 < c.n) ? 0xffffffffu : (2 * j < c.n) ? 0x0000ffffu : 0u);"),
            "  }",
            "}",
        ]
    nbytes = 2 * cfg.align
    cache = "cg" if nbytes == 16 else "ca"
    why = ("cp.async.cg: 16 bytes global -> shared, bypassing L1 (the tile is reused from shared memory, not L1)"
           if nbytes == 16 else
           f"cp.async.ca: {nbytes} bytes global -> shared (pad.align={cfg.align}: rows are only {nbytes}-byte aligned; "
           ".cg takes 16-byte copies only)")
    return [
        f"// {why}.",
        "__device__ __forceinline__ void cp_async(unsigned dst, const void* src) {",
        f'  asm volatile("cp.async.{cache}.shared.global [%0], [%1], {nbytes};\\n" :: "r"(dst), "l"(src) : "memory");',
        "}",
        f"// src-size 0 writes {nbytes} zero bytes and reads nothing: out-of-range chunks cost no traffic and add 0 to "
        "every",
        "// dot product. `src` must still be a valid address, so callers pass the operand's base when !valid.",
        "__device__ __forceinline__ void cp_async_zfill(unsigned dst, const void* src, bool valid) {",
        f"  const int src_bytes = valid ? {nbytes} : 0;",
        f'  asm volatile("cp.async.{cache}.shared.global [%0], [%1], {nbytes}, %2;\\n" :: "r"(dst), "l"(src), '
        '"r"(src_bytes)',
        '               : "memory");',
        "}",
    ]


def _device_functions(cfg: Sm80Config) -> list[str]:
    """The swizzle, the PTX wrappers (cp.async, ldmatrix, mma.sync), the fragment loads and the tile loads."""
    ptx_t = cfg.in_dtype      # PTX names the 16-bit types as the IR does: f16, bf16
    if cfg.swizzle is None:
        swz_expr, swz_note = "offset", "swizzle.smem=none: plain K-major rows (ldmatrix rows may share banks)"
    else:
        b, m, s = cfg.swizzle
        swz_expr = smem_swizzle(b, m, s).to_cpp()
        swz_note = (f"swizzle.smem=<{b},{m},{s}>: XOR {b} bit(s) at [{m + s}, {m + s + b}) into [{m}, {m + b}) of the "
                    "element offset, so the 8 rows one ldmatrix phase reads (and cp.async writes) hit distinct banks")
    pack = f"{CUDA_PAIR_FROM_FLOATS[cfg.out_dtype]}(a, b)"
    to_out = f"{CUDA_FROM_FLOAT[cfg.out_dtype]}(a)"
    return [
        f"// {swz_note}.",
        "// It acts on element offsets inside one K-major tile and keeps every 8-element (16-byte) chunk whole.",
        f"__device__ __forceinline__ int swz(int offset) {{ return {swz_expr}; }}",
        "",
        "// A vector of V elements, aligned to its size so one load/store instruction (two for 32 bytes) moves it.",
        "template <class T, int V>",
        "struct alignas(sizeof(T) * V) Vec { T v[V]; };",
        "",
        f"__device__ __forceinline__ Out2T pack2(float a, float b) {{ return {pack}; }}",
        f"__device__ __forceinline__ OutT to_out(float a) {{ return {to_out}; }}",
        "",
        *_copy_functions(cfg),
        "__device__ __forceinline__ void cp_async_commit() { asm volatile(\"cp.async.commit_group;\\n\" ::: \"memory\"); }",
        "template <int N>",
        "__device__ __forceinline__ void cp_async_wait() {",
        '  asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory");',
        "}",
        "",
        "// ldmatrix.x4: lanes 8j..8j+7 give the row addresses of 8x8 matrix j; register j of lane l receives row l/4,",
        "// columns 2(l%4), 2(l%4)+1 of matrix j, which is exactly the m16n8k16 fragment layout.",
        "__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {",
        '  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\\n"',
        '               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");',
        "}",
        "",
        *mma_16816_lines(ptx_t),
        "",
        *(["// One k-step's fragments of this warp: A from realigned buffer `stage`, B from ring stage `bstage`"
           " (interleave)."] if cfg.interleave else ["// One k-step's fragments of this warp from ring stage `stage`."]),
        "// A (m16 x k16 per mi): lane l addresses row l%16, k 8*(l/16): matrices (rows 0-7,k 0-7), (8-15,0-7),",
        "//   (0-7,8-15), (8-15,8-15) = a0, a1, a2, a3.",
        "// B (two n8 x k16 blocks per ldmatrix): lane l addresses n (l%8) + 8*(l/16), k 8*((l/8)%2): matrices",
        "//   (n 0-7,k 0-7), (0-7,8-15), (8-15,0-7), (8-15,8-15) = b0,b1 of block 2j and b0,b1 of block 2j+1.",
        ("__device__ __forceinline__ void load_frags(unsigned smem_base, int stage, int bstage, int kk, "
         "unsigned (&fa)[MI][4]," if cfg.interleave else
         "__device__ __forceinline__ void load_frags(unsigned smem_base, int stage, int kk, unsigned (&fa)[MI][4],"),
        "                                           unsigned (&fb)[NI][2]) {",
        "  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;",
        "  const int warp_m = warp / WN, warp_n = warp % WN;",
        "#pragma unroll",
        "  for (int mi = 0; mi < MI; ++mi) {",
        "    const int r = warp_m * WARP_M + mi * 16 + (lane & 15);",
        "    const int k = kk * 16 + (lane >> 4) * 8;",
        "    ldmatrix_x4(fa[mi], smem_base + 2u * unsigned(SMEM_A + stage * A_STAGE + swz(r * BK + k)));",
        "  }",
        "#pragma unroll",
        "  for (int nj = 0; nj < NI / 2; ++nj) {",
        "    const int r = warp_n * WARP_N + nj * 16 + (lane & 7) + ((lane >> 4) << 3);",
        "    const int k = kk * 16 + ((lane >> 3) & 1) * 8;",
        "    unsigned t[4];",
        f"    ldmatrix_x4(t, smem_base + 2u * unsigned(SMEM_B + {'bstage' if cfg.interleave else 'stage'} * B_STAGE + "
        "swz(r * BK + k)));",
        "    fb[2 * nj][0] = t[0]; fb[2 * nj][1] = t[1];",
        "    fb[2 * nj + 1][0] = t[2]; fb[2 * nj + 1][1] = t[3];",
        "  }",
        "}",
        "",
        "__device__ __forceinline__ void mma_all(float (&acc)[MI][NI][4], const unsigned (&fa)[MI][4],",
        "                                        const unsigned (&fb)[NI][2]) {",
        "#pragma unroll",
        "  for (int mi = 0; mi < MI; ++mi)",
        "#pragma unroll",
        "    for (int ni = 0; ni < NI; ++ni) mma_16816(acc[mi][ni], fa[mi], fb[ni]);",
        "}",
        "",
        *_load_tile(cfg, "A"),
        *_load_tile(cfg, "B"),
        "}  // namespace l2ir_ptx_sm80",
    ]


def _gemm_entry(cfg: Sm80Config) -> list[str]:
    """The GEMM kernel: tile coordinates (rasterized), the split-K range, accumulators, main loop, epilogue."""
    tile_m, tile_n = rasterize(cfg.raster, cfg.group)
    L = [
        "",
        f'extern "C" __global__ void __launch_bounds__({cfg.threads})',
        f"{GEMM_ENTRY}({ABI}) {{",
        "  using namespace l2ir_ptx_sm80;",
        "  // 16-byte alignment is all cp.async and ldmatrix need (the swizzle works on offsets inside each tile).",
        "  extern __shared__ __align__(128) unsigned char smem[];",
        "  const unsigned smem_base = static_cast<unsigned>(__cvta_generic_to_shared(smem));",
        "  const InT* __restrict__ A = static_cast<const InT*>(A_);",
        "  const InT* __restrict__ B = static_cast<const InT*>(B_);",
        "  OutT* __restrict__ C = static_cast<OutT*>(C_);",
        *(["  float* __restrict__ ws = static_cast<float*>(workspace_);   // splitk: partials, then pair counters"]
          if cfg.split else ["  (void)workspace_;"]),
        "",
        f"  // swizzle.raster={cfg.raster} group={cfg.group}: linear block id -> output tile (l2ir.indexing.rasterize);",
        "  // blocks that run together share A and B tiles in L2.",
        "  const int pid = int(blockIdx.x);",
        "  const int tiles_m = (M + BM - 1) / BM;",
        *([f"  const int tiles_n = {Interleave.tiles_n(Var('N'), cfg.bn).to_cpp()};   // interleave: 8 residues x runs"]
          if cfg.interleave else ["  const int tiles_n = (N + BN - 1) / BN;"]),
        f"  const int tile_m = {tile_m.to_cpp()};",
        f"  const int tile_n = {tile_n.to_cpp()};",
        "  (void)tiles_n;",
    ]
    if cfg.interleave:
        L += [
            "  // interleave (l2ir.indexing.Interleave): this block's columns are n = 8 j + b_res for view rows j from",
            "  // b_rows; B's rows of the residue all start b_off elements past a 16-byte boundary, and the k-tiles run",
            "  // over the view from b_off elements before each row start (K + b_off elements).",
            "  const int a_rows = tile_m * BM;   // first row of this tile in A",
            f"  const int b_res = {Interleave.residue().to_cpp()};",
            f"  const int b_rows = {Interleave.first_row(cfg.bn).to_cpp()};   // first view row",
            "  const int b_off = int((unsigned(reinterpret_cast<unsigned long long>(B) >> 1) + unsigned(b_res) * "
            "unsigned(K)) & 7u);",
            f"  const int k_tiles = {Interleave.k_tiles(Var('K'), Var('b_off'), cfg.bk).to_cpp()};",
        ]
    else:
        L += [
            "  const int a_rows = tile_m * BM, b_rows = tile_n * BN;   // first row of this tile in A (M) and B (N)",
            "  const int k_tiles = (K + BK - 1) / BK;",
        ]
    if cfg.split:
        kb, ke = splitk_range(cfg.slices)
        L += [
            f"  // splitk slices={cfg.slices} (grid.z, l2ir.indexing.splitk_range): this slice owns k-tiles "
            "[k_begin, k_end);",
            "  // an empty range still writes a zero partial, so the fixup never reads unwritten workspace.",
            "  const int slice = int(blockIdx.z);",
            f"  const int k_begin = {kb.to_cpp()};",
            f"  const int k_end = {ke.to_cpp()};",
        ]
    else:
        L += ["  const int k_begin = 0, k_end = k_tiles;"]
    L += [
        "  const int k_count = k_end - k_begin;",
        "  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;",
        "  const int warp_m = warp / WN, warp_n = warp % WN;",
        "  (void)lane; (void)warp_m; (void)warp_n;",
        "",
        "  float acc[MI][NI][4];",
        "#pragma unroll",
        "  for (int mi = 0; mi < MI; ++mi)",
        "#pragma unroll",
        "    for (int ni = 0; ni < NI; ++ni)",
        "#pragma unroll",
        "      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;",
        ("  unsigned fa[2][MI][4], fb[2][NI][2];   // pipeline.prefetch=true: two k-steps of fragments"
         if cfg.prefetch and cfg.stages > 1 else
         "  unsigned fa[1][MI][4], fb[1][NI][2];   // one k-step of fragments"),
        "",
        *grid_wait_lines(),
        *_mainloop(cfg),
        *grid_launch_dependents_lines(),
        "",
        *_splitk_fixup(cfg),
        *_epilogue(cfg),
        "}",
    ]
    return L


def _splitk_fixup(cfg: Sm80Config) -> list[str]:
    """split_k reduce=workspace, reduced inside the GEMM kernel through the pairwise tree of l2ir.indexing.SplitKTree:
    at each level whose sibling subtree exists the block stores its registers (its subtree's sum) to slot `base`,
    fences (release) and counts itself in on the pair's counter; the first arrival is done with the tile, the second
    fences (acquire), adds the sibling's slot to its registers, resets the counter and goes up with base = the lower
    subtree's slot. The block that completes the root falls through to the normal epilogue. fp32 addition commutes,
    so each pair's sum, and C, has the same bits whichever block arrives last (l2ir.interp reduces the same tree); no
    block waits for another; the critical path reads ceil(log2 S) partials instead of S. One launch."""
    if not cfg.split:
        return []
    tree = SplitKTree(cfg.slices)
    i = "  "
    frag = "((tile_slot + {s}) * (MI * NI) + mi * NI + ni) * THREADS + int(threadIdx.x)"
    return [
        f"{i}// splitk slices={cfg.slices} reduce=workspace, a pairwise tree over the slices (l2ir.indexing.SplitKTree),",
        f"{i}// in this kernel (no reduction kernel). Workspace:",
        f"{i}//   [tiles][slices][MI*NI][THREADS] float4 slots: each thread stores its accumulator fragments as",
        f"{i}//   float4s, consecutive threads at consecutive 16-byte addresses (coalesced, no bounds checks: the whole",
        f"{i}//   tile is stored, rows past M / N are never read into C); slot `base` holds the subtree based there;",
        f"{i}//   then [tiles][SLICES - 1] unsigned pair counters, zero before the first launch (plan.zero_workspace) and",
        f"{i}//   left zero by every launch: each pair's last arrival resets its counter, so repeated launches need no",
        f"{i}//   memset.",
        f"{i}cp_async_wait<0>();   // no copy may still target shared memory when a block leaves early",
        f"{i}{{",
        f"{i}  constexpr int SLICES = {cfg.slices};",
        f"{i}  constexpr int TREE_LEVELS = {tree.levels};   // ceil(log2 SLICES): pair levels",
        f"{i}  constexpr int TREE_NODES = {tree.counters};    // SLICES - 1 pair counters per tile",
        f"{i}  const int tiles = tiles_m * tiles_n;",
        f"{i}  float4* __restrict__ part = reinterpret_cast<float4*>(ws);",
        f"{i}  unsigned* __restrict__ counters = reinterpret_cast<unsigned*>(ws + (long long)tiles * SLICES * BM * BN);",
        f"{i}  unsigned* __restrict__ tile_counters = counters + (long long)pid * TREE_NODES;",
        f"{i}  const long long tile_slot = (long long)pid * SLICES;   // this tile's first slot",
        f"{i}  __shared__ int is_last;",
        f"{i}  int base = slice;      // the slot (and lowest slice) of the subtree whose sum the registers hold",
        f"{i}  bool carries = true;   // false once the sibling's block carries this block's sum on",
        f"{i}#pragma unroll 1",
        f"{i}  for (int level = 0; level < TREE_LEVELS; ++level) {{",
        f"{i}    const int sibling = {tree.sibling.to_cpp()};   // SplitKTree.sibling",
        f"{i}    if (sibling >= SLICES) continue;   // no sibling subtree (SLICES not a power of two): up a level, no wait",
        f"{i}#pragma unroll",
        f"{i}    for (int mi = 0; mi < MI; ++mi)",
        f"{i}#pragma unroll",
        f"{i}      for (int ni = 0; ni < NI; ++ni)   // L2 only (__stcg): another SM reads it",
        f"{i}        __stcg(&part[{frag.format(s='base')}],",
        f"{i}               make_float4(acc[mi][ni][0], acc[mi][ni][1], acc[mi][ni][2], acc[mi][ni][3]));",
        f"{i}    // Release: this block's subtree sum is visible GPU-wide before its arrival is counted.",
        f"{i}    __threadfence();",
        f"{i}    __syncthreads();",
        f"{i}    if (threadIdx.x == 0) {{",
        f"{i}      const int node = {tree.counter.to_cpp()};   // SplitKTree.counter",
        f"{i}      const unsigned arrived = atomicAdd(&tile_counters[node], 1u);",
        f"{i}      is_last = arrived == 1u;",
        f"{i}      if (is_last) __threadfence();   // acquire before the barrier hands the decision to the other threads",
        f"{i}      // Self-cleaning: both subtrees of this pair have arrived, nobody touches its counter again in this",
        f"{i}      // launch, so the next launch finds it zero.",
        f"{i}      if (is_last) tile_counters[node] = 0u;",
        f"{i}    }}",
        f"{i}    __syncthreads();",
        f"{i}    if (!is_last) {{ carries = false; break; }}   // the sibling's block carries the sum on",
        f"{i}    // Acquire: the sibling's slot, announced before its arrival, read through L2 (ld.global.cg; L1 is not",
        f"{i}    // coherent across SMs).",
        f"{i}    __threadfence();",
        f"{i}    // registers += sibling has the same bits as sibling + registers: whichever block is last, the pair's sum",
        f"{i}    // is one value, so C is bit-identical run to run.",
        f"{i}#pragma unroll",
        f"{i}    for (int mi = 0; mi < MI; ++mi)",
        f"{i}#pragma unroll",
        f"{i}      for (int ni = 0; ni < NI; ++ni) {{",
        f"{i}        const float4 v = __ldcg(&part[{frag.format(s='sibling')}]);",
        f"{i}        acc[mi][ni][0] += v.x; acc[mi][ni][1] += v.y; acc[mi][ni][2] += v.z; acc[mi][ni][3] += v.w;",
        f"{i}      }}",
        f"{i}    base = {tree.merged.to_cpp()};   // SplitKTree.merged: the pair's sum is the lower subtree's",
        f"{i}  }}",
        f"{i}  if (!carries) return;   // another block of this tile completes the tree and runs the epilogue",
        f"{i}}}",
        "",
    ]


def render(cfg: Sm80Config, kernel_text: str = "") -> str:
    """The .cu text for one configuration. Deterministic: the same config gives the same bytes."""
    sections = (_header(cfg, kernel_text), _config(cfg), _device_functions(cfg), _gemm_entry(cfg))
    return "\n".join(line for section in sections for line in section) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# lower
# ---------------------------------------------------------------------------------------------------------------


def _tiles(cfg: Sm80Config):
    return cdiv(M_, cfg.bm) * column_tiles(N_, cfg.bn, cfg.interleave)


def launches(cfg: Sm80Config) -> tuple[Launch, ...]:
    """One launch, split-K included (the slices reduce inside the kernel)."""
    return (Launch(entry=GEMM_ENTRY, grid=(_tiles(cfg), Const(1), Const(cfg.slices)), block=(cfg.threads, 1, 1),
                   smem=cfg.smem_bytes, pdl=True),)


def workspace_bytes(cfg: Sm80Config):
    """split-K: every tile's fp32 slots (one per slice), then every tile's SLICES - 1 4-byte pair counters."""
    if not cfg.split:
        return Const(0)
    return _tiles(cfg) * Const(cfg.slices * cfg.partial_floats * 4 + SplitKTree(cfg.slices).counters * 4)


def lower(kernel: Kernel, problem: Problem) -> LaunchPlan:
    """IR -> LaunchPlan(form="kernels")."""
    cfg = canonicalize(kernel, problem)
    return LaunchPlan(
        source=render(cfg, kernel.text()),
        arch=NVCC_ARCH[cfg.arch],
        form="kernels",
        launches=launches(cfg),
        workspace_bytes=workspace_bytes(cfg),
        # The pair counters must be zero before the first launch; every launch leaves them zero (each pair's last
        # arrival resets its counter), so zeroing once at allocation is enough. Without split-K there is no workspace.
        zero_workspace=cfg.split,
        needs_cutlass=False,
    )


__all__ = ["Sm80Config", "refusal", "canonicalize", "render", "launches", "workspace_bytes", "lower", "GEMM_ENTRY"]
