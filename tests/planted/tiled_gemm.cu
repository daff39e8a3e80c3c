// A plain tiled HGEMM in the L2IR Source ABI, and planted defects, one per correctness gate.
//
// Problem class: a=f16:row (M x K, K contiguous), b=f16:col (stored N x K, K contiguous), c=f16:row, acc=f32.
// Launch: grid (cdiv(n, 32), cdiv(m, 32), 1), block (32, 8, 1). Each block computes a 32x32 tile of C; thread
// (tx, ty) owns column tx of rows ty, ty+8, ty+16, ty+24.
//
// The test prepends exactly one `#define PLANT_<NAME> 1` (or none, for the correct kernel):
//   PLANT_FP16_ACC     accumulates in fp16 (__hfma) although the problem says acc=f32  -> precision_probe
//   PLANT_OOB_WRITE    also writes a few elements just past the end of C               -> guard_bands
//   PLANT_UNWRITTEN    never stores the last tile of C                                 -> all_written
//   PLANT_DIVISIBLE    no bounds checks: correct only when 32 divides M, N and K       -> ragged_shapes
//   PLANT_STALE        computes only on its first call, then returns the cached C      -> stale_output
//   PLANT_CRASH        stores through a wild pointer (illegal address)                 -> worker restarted
//   PLANT_HANG         spins forever                                                   -> worker killed

#include <cuda_fp16.h>

#define BM 32
#define BN 32
#define BK 32

#ifdef PLANT_HANG
__device__ volatile int l2ir_never_set = 0;
#endif

#ifdef PLANT_STALE
// Blocks that finished a full call. Once a whole grid has run, later calls skip all work and leave C as it was.
__device__ unsigned int l2ir_blocks_done = 0;
#endif

extern "C" __global__ void __launch_bounds__(256)
tiled_gemm(const void* A_, const void* B_, void* C_, int M, int N, int K, void* workspace) {
    const __half* A = static_cast<const __half*>(A_);
    const __half* B = static_cast<const __half*>(B_);
    __half* C = static_cast<__half*>(C_);
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;

#ifdef PLANT_HANG
    // Spin on a device global that nothing sets: the host could, so the compiler must keep the loop (a volatile
    // local was seen optimized away by nvcc 13.0, and the "hang" kernel then ran to completion).
    while (l2ir_never_set == 0) { __nanosleep(1000); }
#endif
#ifdef PLANT_CRASH
    if (tx == 0 && ty == 0) reinterpret_cast<__half*>(0x10)[blockIdx.x] = __float2half(1.f);
#endif
#ifdef PLANT_STALE
    if (l2ir_blocks_done >= gridDim.x * gridDim.y) return;
#endif

    // +1 column of padding: threads of a warp read one column of the tile, 32 different banks.
    __shared__ float As[BM][BK + 1];
    __shared__ float Bs[BN][BK + 1];
#ifdef PLANT_FP16_ACC
    __half acc[4] = {__float2half(0.f), __float2half(0.f), __float2half(0.f), __float2half(0.f)};
#else
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#endif

    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int r = ty; r < BM; r += 8) {
            const int gk = k0 + tx, ga = row0 + r, gb = col0 + r;
#ifdef PLANT_DIVISIBLE
            As[r][tx] = __half2float(A[(size_t)ga * K + gk]);
            Bs[r][tx] = __half2float(B[(size_t)gb * K + gk]);
#else
            // Out-of-range elements load as zero, so the residue tile needs no special case in the math.
            As[r][tx] = (ga < M && gk < K) ? __half2float(A[(size_t)ga * K + gk]) : 0.f;
            Bs[r][tx] = (gb < N && gk < K) ? __half2float(B[(size_t)gb * K + gk]) : 0.f;
#endif
        }
        __syncthreads();
        for (int kk = 0; kk < BK; ++kk) {
            const float b = Bs[tx][kk];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#ifdef PLANT_FP16_ACC
                acc[i] = __hfma(__float2half(As[ty + 8 * i][kk]), __float2half(b), acc[i]);
#else
                acc[i] = fmaf(As[ty + 8 * i][kk], b, acc[i]);
#endif
            }
        }
        __syncthreads();
    }

#ifdef PLANT_UNWRITTEN
    if (blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1) return;
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = row0 + ty + 8 * i, c = col0 + tx;
#ifdef PLANT_FP16_ACC
        const __half v = acc[i];
#else
        const __half v = __float2half(acc[i]);
#endif
#ifdef PLANT_DIVISIBLE
        C[(size_t)r * N + c] = v;
#else
        if (r < M && c < N) C[(size_t)r * N + c] = v;
#endif
    }
#ifdef PLANT_OOB_WRITE
    if (blockIdx.x == 0 && blockIdx.y == 0 && ty == 0 && tx < 4) C[(size_t)M * N + 16 + tx] = __float2half(1.f);
#endif
#ifdef PLANT_STALE
    __syncthreads();
    if (tx == 0 && ty == 0) atomicAdd(&l2ir_blocks_done, 1u);
#endif
}
