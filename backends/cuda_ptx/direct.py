"""Lower pipeline mode=direct kernels (mma.sync fed straight from global memory; sm80 and later) to raw CUDA with
inline PTX: no shared memory, no CUTLASS.

For few rows of A (decode: M from 1 to 64) a GEMM is a stream of B: every element of B is read once and used for
M products. A shared-memory pipeline only adds latency there (a cp.async round trip, a barrier per stage) and
shared memory caps how many bytes a block keeps in flight. Here every lane loads its own m16n8k16 fragments: one
16-byte vector per row of A and per column of B and chunk (l2ir.indexing.DirectFeed), B with an L1 no-allocate
hint (it is read once), A through L1 (every warp of a block reads the same A). `stages` k steps of A and B vectors
sit in registers, so the loads of step s + 1 are in flight while step s multiplies, and a K split puts several
groups of warps on each block's columns, so an SM keeps enough loads in flight to stream B (measured: 1x4096x4096
in 11.1 us, 1.235x torch.matmul, bench/results/direct_split_h200.json). The tensor cores do M <= 64 rows at the
cost of 16 (the rows past M are zeros): at these shapes they are idle anyway; what counts is bytes in flight.

Two pure steps, like the other rules:
  canonicalize(kernel, problem) -> DirectConfig   every check; every IR field turned into the one value it means
  render(cfg) -> str                              the .cu text: one kernel, launched by the harness (no host code)

Field -> code map:
  target.arch          sm80 and later (mma.sync m16n8k16) -> plan.arch
  tile.block           BM rows of A per block (8: one m16 block fed half, rows g + 8 zero; else BM/16 m16 blocks),
                       BN columns per block, BK K elements per k step (BK/32 chunks)
  tile.warps           1 x WN: each warp takes all BM rows and BN/WN columns (NI n8 blocks)
  pipeline.stages      1: load a step's vectors, then multiply; 2: load step s + 1 while multiplying step s
  splitk               split_k reduce=block, 2..8 slices: that many groups of 1 x WN warps take interleaved k steps
                       (DirectFeed.slice_step); slice 0 adds the others' accumulators from shared memory in slice
                       order and stores C
  swizzle.raster/group block rasterization (l2ir.indexing.rasterize) over pid = blockIdx.x
  pad.m / pad.n        predicate / zero_fill: rows of A past M and columns of B past N are not loaded (zeros), stores
                       are masked; divisible: neither
  pad.k                zero_fill / predicate: vectors past K are zeros (each vector is checked); divisible: none
  pad.align            8: one 16-byte load per vector (rows 16-byte aligned); 1 / 2 / 4: the two aligned vectors
                       around it, shifted (DirectFeed.realign_offset), elements past K zeroed
  epilogue             path=direct; vector 2 stores a thread's 2 adjacent columns as one pair, 1 one element
  problem              a row (K-major), b col (K-major), f16 or bf16 in (same type), f16 or bf16 out, acc f32
"""

from __future__ import annotations

from dataclasses import dataclass

from l2ir.analysis import direct_slices
from l2ir.indexing import Const, DirectFeed, Var, cdiv, rasterize
from l2ir.nodes import Kernel, Problem, Swizzle
from l2ir.runtime import Launch, LaunchPlan
from l2ir.target import CUDA_FROM_FLOAT, CUDA_PAIR_FROM_FLOATS, CUDA_PAIR_TYPE, CUDA_TYPE, NVCC_ARCH
from l2ir.text import print_problem_class
from l2ir.verify import verify, verify_problem

from .common import UnsupportedLowering, check_problem_class

GEMM_ENTRY = "l2ir_cuda_ptx_direct_gemm"
ABI = "const void* A_, const void* B_, void* C_, int M, int N, int K, void* workspace_"
M_, N_ = Var("m"), Var("n")
F = DirectFeed


@dataclass(frozen=True)
class DirectConfig:
    """Everything the source depends on, already checked."""

    arch: str
    in_dtype: str
    out_dtype: str
    problem_class: str
    bm: int
    bn: int
    bk: int
    wn: int
    stages: int
    slices: int               # splitk reduce=block: groups of 1 x WN warps splitting the k steps (1: none)
    raster: str
    group: int
    pad_m: str
    pad_n: str
    pad_k: str
    align: int
    vector: int

    @property
    def threads(self) -> int:
        return 32 * self.wn * self.slices

    @property
    def reduce_bytes(self) -> int:
        """Shared memory for the accumulators of slices 1 .. S-1 (l2ir.analysis.direct_reduce_bytes)."""
        return (self.slices - 1) * self.wn * 32 * self.mi * self.ni * 4 * 4

    @property
    def mi(self) -> int:
        return max(1, self.bm // 16)

    @property
    def ni(self) -> int:
        return self.bn // (8 * self.wn)

    @property
    def chunks(self) -> int:
        return self.bk // F.CHUNK_K

    @property
    def half_m(self) -> bool:
        """BM=8: each m16 MMA is fed rows g only; rows g + 8 are zero registers (and belong to no output row)."""
        return self.bm == 8


def refusal(kernel: Kernel) -> UnsupportedLowering | None:
    """What this rule refuses in a kernel whatever the problem, or None when it lowers it."""
    if kernel.is_source:
        return UnsupportedLowering("source", "free-form CUDA is not generated by this rule")
    if kernel.target.arch not in NVCC_ARCH:
        return UnsupportedLowering("target.arch", f"'{kernel.target.arch}': no nvcc arch for it")
    if kernel.pipeline.mode != "direct":
        return UnsupportedLowering("pipeline.mode", f"'{kernel.pipeline.mode}': this rule lowers mode=direct")
    if kernel.mma.op != "mma_sync" or tuple(kernel.mma.shape) != (16, 8, 16):
        return UnsupportedLowering("mma", "direct kernels issue mma.sync m16n8k16")
    return None


def canonicalize(kernel: Kernel, problem: Problem) -> DirectConfig:
    """Check that the kernel is one this rule lowers and turn each IR field into its value in the source."""
    refused = refusal(kernel)
    if refused is not None:
        raise refused
    verify(kernel)
    verify_problem(problem)
    check_problem_class(problem)
    swz = kernel.swizzle or Swizzle()
    bm, bn, bk = kernel.tile.block
    return DirectConfig(
        arch=kernel.target.arch, in_dtype=problem.a[0], out_dtype=problem.c[0],
        problem_class=print_problem_class(problem), bm=bm, bn=bn, bk=bk, wn=kernel.tile.warps[1],
        stages=kernel.pipeline.stages, slices=direct_slices(kernel), raster=swz.raster, group=swz.group, pad_m=kernel.pad.m,
        pad_n=kernel.pad.n, pad_k=kernel.pad.k, align=kernel.pad.align, vector=kernel.epilogue.vector)


# ---------------------------------------------------------------------------------------------------------------
# render
# ---------------------------------------------------------------------------------------------------------------


def _header(cfg: DirectConfig, kernel_text: str) -> list[str]:
    return [
        "// Generated by L2IR backends/cuda_ptx (direct rule): mma.sync m16n8k16 fed from global memory by each lane,",
        "// no shared memory (l2ir.indexing.DirectFeed). Do not edit: regenerate from the kernel IR.",
        "// Kernel:",
        *["//   " + line if line else "//" for line in kernel_text.splitlines()],
        f"// Problem class: {cfg.problem_class}",
        f"// target.arch={cfg.arch}",
        "#include <cuda_fp16.h>",
        "#include <cuda_bf16.h>",
        "",
    ]


def _config(cfg: DirectConfig) -> list[str]:
    """Element types, the schedule's compile-time shape, the MMA and the loads."""
    ptx_t = {"f16": "f16", "bf16": "bf16"}[cfg.in_dtype]
    return [
        "namespace l2ir_ptx_direct {",
        "",
        f"using InT = {CUDA_TYPE[cfg.in_dtype]};",
        f"using OutT = {CUDA_TYPE[cfg.out_dtype]};",
        f"using Out2T = {CUDA_PAIR_TYPE[cfg.out_dtype]};",
        "",
        f"constexpr int BM = {cfg.bm}, BN = {cfg.bn}, BK = {cfg.bk};   // tile.block",
        f"constexpr int WN = {cfg.wn};                              // tile.warps = 1 x WN",
        f"constexpr int SLICES = {cfg.slices};   // splitk reduce=block: warp groups splitting the k steps",
        "constexpr int THREADS = 32 * WN * SLICES;",
        f"constexpr int MI = {cfg.mi}, NI = {cfg.ni};   // m16 blocks (all BM rows) and n8 blocks per warp",
        f"constexpr int CHUNKS = BK / {F.CHUNK_K};       // 32-element K chunks per k step",
        f"constexpr int STAGES = {cfg.stages};           // pipeline.stages: k steps of B vectors in registers",
        f"constexpr bool HALF_M = {'true' if cfg.half_m else 'false'};   // BM=8: rows g + 8 of each MMA are zeros",
        "",
        f"__device__ __forceinline__ OutT to_out(float a) {{ return {CUDA_FROM_FLOAT[cfg.out_dtype]}(a); }}",
        "__device__ __forceinline__ Out2T to_out2(float a, float b) { return "
        f"{CUDA_PAIR_FROM_FLOATS[cfg.out_dtype]}(a, b); }}",
        "",
        f"// D = A * B + D, m16n8k16, A row, B col, {ptx_t} in, fp32 accumulate.",
        "__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {",
        f'  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ptx_t}.{ptx_t}.f32 "',
        '               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"',
        '               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])',
        '               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));',
        "}",
        "",
        "__device__ __forceinline__ unsigned word(const uint4& v, int i) {",
        "  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;   // i is a constant after unrolling",
        "}",
        "",
        f"constexpr int V = {1 if cfg.align == 8 else 2};   // raw 16-byte vectors per row and chunk (pad.align < 8: lo, hi)",
        f"constexpr int RA = {1 if cfg.half_m else 2};  // A rows a lane feeds per m16 block (g, g + 8)",
        "",
        "// One k step in registers: the raw vectors of B and A, loaded together so every load of the step is in",
        "// flight at once; pipeline.stages of these (1 or 2) exist.",
        "struct Step {",
        "  uint4 b[CHUNKS][NI][V];",
        "  uint4 a[CHUNKS][MI][RA][V];",
        "};",
        "",
        "// Loads are volatile asm so they stay where the schedule puts them (a step ahead of their MMAs): the",
        "// compiler would otherwise sink them next to their use and expose the DRAM latency once per chunk.",
        "// B is read once: .L1::no_allocate keeps it out of L1, where A (read by every warp) stays.",
        "__device__ __forceinline__ uint4 ld_stream(const InT* p) {",
        "  uint4 v;",
        '  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\\n"',
        '               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));',
        "  return v;",
        "}",
        "__device__ __forceinline__ uint4 ld_cached(const InT* p) {",
        "  uint4 v;",
        '  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\\n"',
        '               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));',
        "  return v;",
        "}",
        "",
        *_realign_functions(cfg),
    ]


def _realign_functions(cfg: DirectConfig) -> list[str]:
    """pad.align < 8: the 8 elements at any 2-byte boundary from the two aligned 16-byte vectors around them."""
    if cfg.align == 8:
        return []
    return [
        "// pad.align < 8 (DirectFeed.realign_offset): the 8 elements at p come from the aligned 16-byte vector below",
        "// p (lo) and the next one (hi), loaded only when it holds an element of the row: `left` elements of the row",
        "// remain from p on (DirectFeed.realign_needs_upper). Both are loaded a step ahead, shifted at the MMA.",
        "__device__ __forceinline__ int realign_offset(const InT* p) {",
        "  return int((reinterpret_cast<unsigned long long>(p) >> 1) & 7);   // elem & 7",
        "}",
        "__device__ __forceinline__ void ld_raw(uint4 (&v)[V], const InT* p, int left, bool ok) {",
        "  const int off = realign_offset(p);",
        "  const InT* base = p - off;",
        "  const uint4 z = make_uint4(0u, 0u, 0u, 0u);",
        "  // lo through L1 even for B: lane q - 1 reads it again as its hi.",
        "  v[0] = ok ? ld_cached(base) : z;",
        "  v[1] = (ok && off > 0 && 8 - off < left) ? ld_cached(base + 8) : z;",
        "}",
        "// The 8 elements out of (lo, hi); elements at or past `left` are zero.",
        "__device__ __forceinline__ uint4 realign(const uint4 (&v)[V], const InT* p, int left) {",
        "  const int off = realign_offset(p);",
        "  const unsigned w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};",
        "  const int ws = off >> 1;",
        "  const unsigned sh = unsigned(off & 1) * 16u;",
        "  unsigned x[5];",
        "#pragma unroll",
        "  for (int j = 0; j < 5; ++j) x[j] = ws == 0 ? w[j] : ws == 1 ? w[j + 1] : ws == 2 ? w[j + 2] : w[j + 3];",
        "  unsigned r[4];",
        "#pragma unroll",
        "  for (int i = 0; i < 4; ++i) {",
        "    const unsigned t = __funnelshift_r(x[i], x[i + 1], sh);",
        "    // element 2i is the low half of word i; keep the elements before `left`",
        "    r[i] = left >= 2 * i + 2 ? t : left == 2 * i + 1 ? (t & 0xFFFFu) : 0u;",
        "  }",
        "  return make_uint4(r[0], r[1], r[2], r[3]);",
        "}",
        "",
    ]


def _loads(cfg: DirectConfig) -> list[str]:
    """One row's vector of A or B: bounds per pad.m / pad.n / pad.k, width per pad.align; raw now, usable later."""
    k_check = "k < K" if cfg.pad_k != "divisible" else ""
    m_ok = " && ".join(c for c in ("row < M" if cfg.pad_m != "divisible" else "", k_check) if c) or "true"
    n_ok = " && ".join(c for c in ("col < N" if cfg.pad_n != "divisible" else "", k_check) if c) or "true"
    if cfg.align == 8:
        def raw(op, ok):
            load = "ld_stream(p)" if op == "B" else "ld_cached(p)"
            return [f"  v[0] = ({ok}) ? {load} : make_uint4(0u, 0u, 0u, 0u);"]
        use = ["  (void)p; (void)left;", "  return v[0];"]
    else:
        def raw(op, ok):
            return [f"  ld_raw(v, p, K - k, {ok});"]
        use = ["  return realign(v, p, left);"]
    return [
        "// A row `row`, K elements k .. k + 7 (A is M x K, K-major).",
        "__device__ __forceinline__ const InT* a_at(const InT* A, int row, int k, int K) {",
        "  return A + (long long)row * K + k;",
        "}",
        "// B column `col`, K elements k .. k + 7 (B is stored N x K, K-major).",
        "__device__ __forceinline__ const InT* b_at(const InT* B, int col, int k, int K) {",
        "  return B + (long long)col * K + k;",
        "}",
        "__device__ __forceinline__ void load_a(uint4 (&v)[V], const InT* A, int row, int k, int M, int K) {",
        "  const InT* p = a_at(A, row, k, K);",
        *raw("A", m_ok),
        "}",
        "__device__ __forceinline__ void load_b(uint4 (&v)[V], const InT* B, int col, int k, int N, int K) {",
        "  const InT* p = b_at(B, col, k, K);",
        *raw("B", n_ok),
        "}",
        "// The 8 elements a raw vector holds (pad.align < 8: shifted out of lo and hi), given its row pointer.",
        "__device__ __forceinline__ uint4 use(const uint4 (&v)[V], const InT* p, int left) {",
        *use,
        "}",
        "",
    ]


def _step_functions(cfg: DirectConfig) -> list[str]:
    chunk_k = F.chunk_k(cfg.bk).to_cpp()
    a_regs = ", ".join(f"word(a{'hi' if row else 'lo'}, 2 * h + {word})"
                       if not (row and cfg.half_m) else "0u"
                       for row, word in zip(F.A_ROW, F.A_WORD))
    b_regs = ", ".join(f"word(bv[ni], 2 * h + {word})" for word in F.B_WORD)
    return [
        "// Issue every load of k step `step`: per chunk u (DirectFeed.chunk_k), this warp's B columns col0 + 8 ni and",
        "// A rows row0 + 16 mi (+ 8).",
        "__device__ __forceinline__ void load_step(Step& st, const InT* __restrict__ A, const InT* __restrict__ B,",
        "                                          int row0, int col0, int step, int q, int M, int N, int K) {",
        "#pragma unroll",
        "  for (int u = 0; u < CHUNKS; ++u) {",
        f"    const int k = {chunk_k};",
        "#pragma unroll",
        "    for (int ni = 0; ni < NI; ++ni) load_b(st.b[u][ni], B, col0 + 8 * ni, k, N, K);",
        "#pragma unroll",
        "    for (int mi = 0; mi < MI; ++mi)",
        "#pragma unroll",
        "      for (int ra = 0; ra < RA; ++ra) load_a(st.a[u][mi][ra], A, row0 + 16 * mi + 8 * ra, k, M, K);",
        "  }",
        "}",
        "",
        "// Multiply k step `step`: per chunk, two k16 MMAs per (m16, n8) block, each fed words 2h, 2h + 1 of every",
        "// vector (DirectFeed.A_WORD / B_WORD: the same K elements on both sides).",
        "__device__ __forceinline__ void mma_step(float (&acc)[MI][NI][4], const Step& st, const InT* __restrict__ A,",
        "                                         const InT* __restrict__ B, int row0, int col0, int step, int q,",
        "                                         int K) {",
        "#pragma unroll",
        "  for (int u = 0; u < CHUNKS; ++u) {",
        f"    const int k = {chunk_k};",
        "    uint4 bv[NI];",
        "#pragma unroll",
        "    for (int ni = 0; ni < NI; ++ni) bv[ni] = use(st.b[u][ni], b_at(B, col0 + 8 * ni, k, K), K - k);",
        "#pragma unroll",
        "    for (int mi = 0; mi < MI; ++mi) {",
        "      const uint4 alo = use(st.a[u][mi][0], a_at(A, row0 + 16 * mi, k, K), K - k);",
        "      const uint4 ahi = RA == 2 ? use(st.a[u][mi][RA - 1], a_at(A, row0 + 16 * mi + 8, k, K), K - k)",
        "                                : make_uint4(0u, 0u, 0u, 0u);",
        "      (void)ahi;",
        "#pragma unroll",
        f"      for (int h = 0; h < {F.MMAS_PER_CHUNK}; ++h) {{",
        f"        const unsigned a[4] = {{{a_regs}}};",
        "#pragma unroll",
        "        for (int ni = 0; ni < NI; ++ni) {",
        f"          const unsigned bb[2] = {{{b_regs}}};",
        "          mma_16816(acc[mi][ni], a, bb);",
        "        }",
        "      }",
        "    }",
        "  }",
        "}",
        "",
        "}  // namespace l2ir_ptx_direct",
    ]


def _gemm_entry(cfg: DirectConfig) -> list[str]:
    tile_m, tile_n = rasterize(cfg.raster, cfg.group)
    step_e = F.slice_step(cfg.slices)
    step_expr, step_cpp = str(step_e), step_e.to_cpp()
    reduce = [] if cfg.slices == 1 else [
        "",
        "  // splitk reduce=block: slices 1 .. S-1 leave their accumulators in shared memory ([slice - 1][warp][value]",
        "  // [lane]: consecutive lanes, consecutive banks); slice 0 adds them in slice order and stores C.",
        "  extern __shared__ float red[];",
        "  constexpr int VALUES = MI * NI * 4;",
        "  if (slice > 0) {",
        "    float* dst = red + ((slice - 1) * WN + warp) * VALUES * 32 + lane;",
        "#pragma unroll",
        "    for (int mi = 0; mi < MI; ++mi)",
        "#pragma unroll",
        "      for (int ni = 0; ni < NI; ++ni)",
        "#pragma unroll",
        "        for (int r = 0; r < 4; ++r) dst[((mi * NI + ni) * 4 + r) * 32] = acc[mi][ni][r];",
        "  }",
        "  __syncthreads();",
        "  if (slice > 0) return;",
        "  for (int s = 1; s < SLICES; ++s) {",
        "    const float* src = red + ((s - 1) * WN + warp) * VALUES * 32 + lane;",
        "#pragma unroll",
        "    for (int mi = 0; mi < MI; ++mi)",
        "#pragma unroll",
        "      for (int ni = 0; ni < NI; ++ni)",
        "#pragma unroll",
        "        for (int r = 0; r < 4; ++r) acc[mi][ni][r] += src[((mi * NI + ni) * 4 + r) * 32];",
        "  }",
    ]
    if cfg.stages == 1:
        loop = [
            "  for (int i = 0; i < my_steps; ++i) {",
            "    load_step(s0, A, B, row0, col0, STEP(i), q, M, N, K);",
            "    mma_step(acc, s0, A, B, row0, col0, STEP(i), q, K);",
            "  }",
        ]
    else:
        loop = [
            "  // stages=2: step s + 1's B vectors are in flight while step s multiplies (two register sets, so",
            "  // the loop advances two steps at a time and every index into them is a constant).",
            "  if (my_steps > 0) load_step(s0, A, B, row0, col0, STEP(0), q, M, N, K);",
            "  for (int i = 0; i < my_steps; i += 2) {",
            "    if (i + 1 < my_steps) load_step(s1, A, B, row0, col0, STEP(i + 1), q, M, N, K);",
            "    mma_step(acc, s0, A, B, row0, col0, STEP(i), q, K);",
            "    if (i + 2 < my_steps) load_step(s0, A, B, row0, col0, STEP(i + 2), q, M, N, K);",
            "    if (i + 1 < my_steps) mma_step(acc, s1, A, B, row0, col0, STEP(i + 1), q, K);",
            "  }",
        ]
    m_ok = " && r < M" if cfg.pad_m != "divisible" else ""
    n_ok1 = "c < N" if cfg.pad_n != "divisible" else "true"
    pair_ok = "c + 1 < N" if cfg.pad_n != "divisible" else "true"
    if cfg.vector == 2:
        store = [
            "        if (" + pair_ok + ") {",
            "          *reinterpret_cast<Out2T*>(C + (long long)r * N + c) = to_out2(acc[mi][ni][2 * half],"
            " acc[mi][ni][2 * half + 1]);",
            "        } else if (" + n_ok1 + ") {",
            "          C[(long long)r * N + c] = to_out(acc[mi][ni][2 * half]);",
            "        }",
        ]
    else:
        store = [
            "        if (" + n_ok1 + ") C[(long long)r * N + c] = to_out(acc[mi][ni][2 * half]);",
            "        if (" + pair_ok + ") C[(long long)r * N + c + 1] = to_out(acc[mi][ni][2 * half + 1]);",
        ]
    return [
        "",
        f'extern "C" __global__ void __launch_bounds__({cfg.threads})',
        f"{GEMM_ENTRY}({ABI}) {{",
        "  using namespace l2ir_ptx_direct;",
        "  const InT* __restrict__ A = static_cast<const InT*>(A_);",
        "  const InT* __restrict__ B = static_cast<const InT*>(B_);",
        "  OutT* __restrict__ C = static_cast<OutT*>(C_);",
        "  (void)workspace_;",
        f"  // swizzle.raster={cfg.raster} group={cfg.group}: linear block id -> output tile (l2ir.indexing.rasterize)",
        "  const int pid = int(blockIdx.x);",
        "  const int tiles_m = (M + BM - 1) / BM;",
        "  const int tiles_n = (N + BN - 1) / BN;",
        f"  const int tile_m = {tile_m.to_cpp()};",
        f"  const int tile_n = {tile_n.to_cpp()};",
        "  (void)tiles_n;",
        "  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32 % WN;",
        "  const int slice = int(threadIdx.x) / (32 * WN);   // splitk reduce=block: this warp group's K slice",
        "  const int g = lane >> 2, q = lane & 3;   // DirectFeed: row / column g of each block, K vector q",
        "  const int row0 = tile_m * BM + g;                    // A row of m16 block 0 (+ 16 mi, + 8)",
        "  const int col0 = tile_n * BN + warp * NI * 8 + g;    // B column of n8 block 0 (+ 8 ni)",
        "  float acc[MI][NI][4];",
        "#pragma unroll",
        "  for (int mi = 0; mi < MI; ++mi)",
        "#pragma unroll",
        "    for (int ni = 0; ni < NI; ++ni)",
        "#pragma unroll",
        "      for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.f;",
        "  Step s0;",
        *(["  Step s1;"] if cfg.stages == 2 else []),
        "  const int steps = (K + BK - 1) / BK;",
        f"  // This slice's k steps: step(i) = {step_expr} (DirectFeed.slice_step), i < my_steps.",
        f"  const int my_steps = {F.slice_steps(cfg.slices).to_cpp().replace('k_tiles', 'steps')};   // slice_steps",
        f"  const auto STEP = [slice](int i) {{ return {step_cpp}; }};",
        *loop,
        *reduce,
        "",
        f"  // epilogue path=direct vector={cfg.vector}: element r of a fragment is row g + C_ROW[r], column 2q + C_COL[r].",
        "#pragma unroll",
        "  for (int mi = 0; mi < MI; ++mi)",
        "#pragma unroll",
        "    for (int ni = 0; ni < NI; ++ni)",
        "#pragma unroll",
        f"      for (int half = 0; half < {1 if cfg.half_m else 2}; ++half) {{",
        "        const int r = tile_m * BM + 16 * mi + g + 8 * half;",
        "        const int c = tile_n * BN + warp * NI * 8 + 8 * ni + 2 * q;",
        f"        if (!(true{m_ok})) continue;",
        *store,
        "      }",
        "}",
    ]


def render(cfg: DirectConfig, kernel_text: str = "") -> str:
    """The .cu text for one configuration. Deterministic: the same config gives the same bytes."""
    sections = (_header(cfg, kernel_text), _config(cfg), _loads(cfg), _step_functions(cfg), _gemm_entry(cfg))
    return "\n".join(line for section in sections for line in section) + "\n"


def launches(cfg: DirectConfig) -> tuple[Launch, ...]:
    return (Launch(entry=GEMM_ENTRY, grid=(cdiv(M_, cfg.bm) * cdiv(N_, cfg.bn), Const(1), Const(1)),
                   block=(cfg.threads, 1, 1), smem=cfg.reduce_bytes),)


def lower(kernel: Kernel, problem: Problem) -> LaunchPlan:
    """IR -> LaunchPlan(form="kernels"): one launch, no workspace."""
    cfg = canonicalize(kernel, problem)
    return LaunchPlan(source=render(cfg, kernel.text()), arch=NVCC_ARCH[cfg.arch], form="kernels",
                      launches=launches(cfg))


__all__ = ["DirectConfig", "refusal", "canonicalize", "render", "launches", "lower", "GEMM_ENTRY"]
