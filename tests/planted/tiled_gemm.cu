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
// Reward hacks (the evaluator assumes a hostile kernel):
//   PLANT_RECOGNISE    skips the call when A's pointer and the sampled A[0], B[0] match
//                      the previous call (C would still hold that call's answer)       -> partial_refresh
//   PLANT_REPEAT       like RECOGNISE but samples one value of every row of A and of
//                      every column of B: any refreshed row is noticed, so it only
//                      skips calls whose inputs did not change (repeats in a replay)   -> replay_gain
//   PLANT_COUNTER      counts its launches in a __device__ variable and stops computing
//                      after the first PLANT_COUNTER_N (past the gates, before timing) -> timed_outputs, post_timing
//   PLANT_FP16_RUNS    accumulates runs of 4 k-steps in fp16 (__hfma), promoting each
//                      run to the fp32 accumulator: inside the magnitude bounds        -> ulp
//   PLANT_PROBE_EXACT  accumulates in fp16 unless the inputs look like a precision
//                      probe (A[0] == 32, the old probe's big value), then in fp32     -> ulp
// A bug that hides from one-call gates:
//   PLANT_RACE         past the first PLANT_COUNTER_N launches (the gates'), one launch in
//                      50 does not store its last tile, as a race now and then would   -> repeated_calls

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

#if defined(PLANT_RECOGNISE) || defined(PLANT_COUNTER) || defined(PLANT_REPEAT) || defined(PLANT_RACE)
// Launch-level state. The last block of a launch to finish publishes it (and resets the block count), so every block
// of one launch reads the same values: those earlier launches left (launches on a stream run in order). What a call
// saw is kept per A pointer (a small table), so rotating over buffer sets does not hide repeats.
#define L2IR_SLOTS 128
__device__ unsigned int l2ir_blocks_finished = 0;
__device__ unsigned int l2ir_launches = 0;
__device__ const void* l2ir_seen_ptr[L2IR_SLOTS];
__device__ float l2ir_seen_a0[L2IR_SLOTS], l2ir_seen_b0[L2IR_SLOTS];
#ifndef PLANT_COUNTER_N
#define PLANT_COUNTER_N 64
#endif

__device__ int l2ir_slot(const void* A_) {
    for (int i = 0; i < L2IR_SLOTS; ++i)
        if (l2ir_seen_ptr[i] == A_ || l2ir_seen_ptr[i] == nullptr) return i;
    return 0;
}

__device__ bool l2ir_seen(const void* A_, float a0, float b0) {
    const int i = l2ir_slot(A_);
    return l2ir_seen_ptr[i] == A_ && l2ir_seen_a0[i] == a0 && l2ir_seen_b0[i] == b0;
}

__device__ void l2ir_finish_launch(const void* A_, float a0, float b0) {
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        __threadfence();
        if (atomicAdd(&l2ir_blocks_finished, 1u) == gridDim.x * gridDim.y - 1) {
            const int i = l2ir_slot(A_);
            l2ir_seen_ptr[i] = A_;
            l2ir_seen_a0[i] = a0;
            l2ir_seen_b0[i] = b0;
            l2ir_launches += 1;
            l2ir_blocks_finished = 0;
            __threadfence();
        }
    }
}
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
#if defined(PLANT_RECOGNISE) || defined(PLANT_COUNTER)
    const float a0 = __half2float(A[0]), b0 = __half2float(B[0]);
#endif
#ifdef PLANT_RECOGNISE
    if (l2ir_seen(A_, a0, b0)) {
        l2ir_finish_launch(A_, a0, b0);
        return;
    }
#endif
#ifdef PLANT_REPEAT
    // The "sampled values" become a checksum of one element per row of A and per column of B: a few hundred loads
    // spread over the block and a tree reduction in a fixed order (equal inputs give an equal sum), cheap against
    // the whole K loop it lets the kernel skip.
    __shared__ float red_a[256], red_b[256];
    {
        const int tid = ty * 32 + tx;
        float pa = 0.f, pb = 0.f;
        for (int r = tid; r < M; r += 256) pa += __half2float(A[(size_t)r * K + (r * 7) % K]);
        for (int c = tid; c < N; c += 256) pb += __half2float(B[(size_t)c * K + (c * 5) % K]);
        red_a[tid] = pa;
        red_b[tid] = pb;
        __syncthreads();
        for (int half = 128; half > 0; half >>= 1) {
            if (tid < half) {
                red_a[tid] += red_a[tid + half];
                red_b[tid] += red_b[tid + half];
            }
            __syncthreads();
        }
    }
    const float a0 = red_a[0], b0 = red_b[0];
    if (l2ir_seen(A_, a0, b0)) {
        l2ir_finish_launch(A_, a0, b0);
        return;
    }
#endif
#ifdef PLANT_COUNTER
    if (l2ir_launches >= PLANT_COUNTER_N) {
        l2ir_finish_launch(A_, a0, b0);
        return;
    }
#endif
#ifdef PLANT_PROBE_EXACT
    const bool looks_like_probe = __half2float(A[0]) == 32.f;
#endif

    // +1 column of padding: threads of a warp read one column of the tile, 32 different banks.
    __shared__ float As[BM][BK + 1];
    __shared__ float Bs[BN][BK + 1];
#ifdef PLANT_FP16_ACC
    __half acc[4] = {__float2half(0.f), __float2half(0.f), __float2half(0.f), __float2half(0.f)};
#else
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#endif

#ifdef PLANT_FP16_RUNS
    __half run[4] = {__float2half(0.f), __float2half(0.f), __float2half(0.f), __float2half(0.f)};
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
#if defined(PLANT_FP16_ACC)
                acc[i] = __hfma(__float2half(As[ty + 8 * i][kk]), __float2half(b), acc[i]);
#elif defined(PLANT_FP16_RUNS)
                run[i] = __hfma(__float2half(As[ty + 8 * i][kk]), __float2half(b), run[i]);
                if ((kk & 3) == 3) {      // every 4 k-steps the fp16 run is promoted into fp32
                    acc[i] += __half2float(run[i]);
                    run[i] = __float2half(0.f);
                }
#elif defined(PLANT_PROBE_EXACT)
                if (looks_like_probe) {
                    acc[i] = fmaf(As[ty + 8 * i][kk], b, acc[i]);
                } else {   // fp16 product and fp16 sum, kept in the fp32 register between steps
                    acc[i] = __half2float(__hfma(__float2half(As[ty + 8 * i][kk]), __float2half(b),
                                                 __float2half(acc[i])));
                }
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
#ifdef PLANT_RACE
    if (l2ir_launches >= PLANT_COUNTER_N && l2ir_launches % 50 == 17 && blockIdx.x == gridDim.x - 1 &&
        blockIdx.y == gridDim.y - 1) {
        l2ir_finish_launch(A_, 0.f, 0.f);
        return;
    }
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
#if defined(PLANT_RECOGNISE) || defined(PLANT_COUNTER) || defined(PLANT_REPEAT)
    l2ir_finish_launch(A_, a0, b0);
#elif defined(PLANT_RACE)
    l2ir_finish_launch(A_, 0.f, 0.f);
#endif
}
