// y = x @ W^T (+ b) for the few rows of a decode step, in float32 (AVX-512, or AVX2 + FMA,
// multiply-adds) or bfloat16 (the CPU's bfloat16 dot-product instruction, AVX512-BF16 vdpbf16ps:
// 16 lanes, each the sum of two bfloat16 products added to a float32 accumulator).
//
// Why: a decode step multiplies 1-16 rows by every weight of the model, so its time is the time to
// stream the weights from memory. oneDNN's kernels are built for many rows; at 1-8 bfloat16 rows
// they reached 12-25 GB/s of this project's 51 GB/s machine (AMD Zen 4, no AMX), where this loop
// reaches 25-40 GB/s (bench/small_linear.py). Many-row steps (prefills) keep oneDNN.
//
// Weight layout (packed once, by prefixkv/model/cpu_kernels.small_linear_weight): the output columns
// in blocks of 16 and the blocks in pairs; for each pair, the K inputs in steps of 2 x 64 bytes - one
// input of the pair's 32 columns in float32 ([ceil(N/32)][K][2][16]), or a pair of inputs side by
// side in bfloat16 ([ceil(N/32)][K/2][2][16][2]) - so one 64-byte load feeds one multiply-add (or one
// vdpbf16ps) for every row of the tile, and a tile reads its weights as one contiguous stream, which
// the CPU's own prefetcher follows (software prefetches 8-16 steps ahead were 5-10% slower).
// (Blocks one after the other, [blocks][K][16], made a tile read two streams 18-48 KB apart: at 8
// rows one thread then read 15 GB/s where the paired layout reads 20-23 on this machine; the sums
// are the same, in the same order, bit for bit.) Output columns past N (the padding of the last
// pair) are zero and never stored.
// x [M, K] (rows ldx apart), y [M, N] contiguous, both of the weight's dtype; bias [N] float32 or null.
// Accumulation is in float32; a bfloat16 result is rounded once, to nearest even, as oneDNN and
// PyTorch round a bfloat16 linear's float32 accumulator (the products' order differs: results agree
// with them up to rounding, not bit for bit).
#include "target.h"  // first: what the file compiles for

#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "linear_step.h"

#if defined(PREFIXKV_LINEAR_AVX512) || defined(PREFIXKV_LINEAR_AVX2)
#define PREFIXKV_SMALL_LINEAR_F32 1
#endif
#ifdef PREFIXKV_LINEAR_AVX2
#define PREFIXKV_SMALL_LINEAR_AVX2 1
#endif
#ifdef PREFIXKV_LINEAR_BF16
#define PREFIXKV_SMALL_LINEAR_BF16 1
#endif

namespace {

#ifdef PREFIXKV_SMALL_LINEAR_F32
template <typename T>
using Step = prefixkv::LinearStep<T>;


constexpr int kBlock = prefixkv::kLinearBlock;
constexpr int kPair = prefixkv::kLinearPair;  // one tile's columns: a pair of blocks
constexpr int kGroup = 4;       // blocks per task: a 4 x 16-column slab (K x 256 bytes at most) stays in L2
constexpr int kRowTile = 8;     // rows per pass over a slab: 8 x 2 accumulators
static_assert(kGroup % kPair == 0, "a task takes whole pairs");

#ifdef PREFIXKV_SMALL_LINEAR_AVX2
// AVX2 (16 registers): one row at a time over both pairs of a task, the two pairs' weights read
// side by side - two streams from memory in flight, not one. On an AMD Zen 2 (2 threads) one pair
// streamed at a time (up to 3 rows in registers, the next rows from L2) read gpt-oss-20b's 5,760 x
// 2,880 expert product at 21-31 GB/s with one row, two streams at 28-38; the default model's
// products 1.3-1.6x faster at 1-8 rows (bench/small_linear.py, docs/benchmarks.md). Two streams
// for 2-3 rows at once would need 16-24 accumulators: more than the registers.
// So K goes in chunks of kChunk steps: the first row reads a chunk from memory, every other row
// reads it again from L1 (2 pairs x 128 steps x 128 bytes = 32 KB), and each row's accumulators
// wait in `park` between chunks. Every output lane still sums its products over K in order, with
// the same instructions as the AVX-512 tile and the blocked kernel: the same bits.
constexpr int64_t kChunk = 128;
constexpr int kTaskFloats = kGroup * kBlock;  // one row's outputs of a task: 64 columns

// one row, NP pairs (pair_floats apart) from `w`, steps [p0, p1), accumulators from and to park
template <int NP>
inline void row_chunk(const float* x, const float* w, int64_t pair_floats, int64_t p0, int64_t p1, float* park) {
    constexpr int kStep = kPair * kBlock;  // floats of one step of a pair
    constexpr int kVectors = NP * kStep / 8;
    __m256 acc[kVectors];
#pragma GCC unroll 8
    for (int j = 0; j < kVectors; ++j) acc[j] = _mm256_load_ps(park + 8 * j);
    w += p0 * kStep;
    for (int64_t p = p0; p < p1; ++p, w += kStep) {
        const __m256 xp = _mm256_broadcast_ss(x + p);
#pragma GCC unroll 8
        for (int j = 0; j < kVectors; ++j) {
            const float* wj = w + (j / 4) * pair_floats + 8 * (j % 4);
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(wj), xp, acc[j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kVectors; ++j) _mm256_store_ps(park + 8 * j, acc[j]);
}

// one task (the pairs [q0, q0 + NP)) for MT rows, K in chunks
template <int NP>
inline void task_rows(const float* x, int64_t ldx, const float* wp, int64_t steps, int64_t q0, int64_t mt, int64_t N,
                      const float* bias, float* y, int64_t ldy) {
    alignas(32) float park[kRowTile][kTaskFloats];
    memset(park, 0, sizeof park);
    constexpr int kStep = kPair * kBlock;
    const int64_t pair_floats = steps * kStep;
    const float* w = wp + q0 * pair_floats;
    for (int64_t p0 = 0; p0 < steps; p0 += kChunk) {
        const int64_t p1 = steps - p0 < kChunk ? steps : p0 + kChunk;
        for (int64_t m = 0; m < mt; ++m) row_chunk<NP>(x + m * ldx, w, pair_floats, p0, p1, park[m]);
    }
    for (int b = 0; b < NP * kPair; ++b) {
        const int64_t col = (q0 * kPair + b) * kBlock;
        if (col >= N) break;  // the zero block padding the last pair
        const int valid = N - col < kBlock ? static_cast<int>(N - col) : kBlock;
        for (int64_t m = 0; m < mt; ++m) {
            float* dst = y + m * ldy + col;
            const float* src = park[m] + b * kBlock;
            if (bias == nullptr)
                memcpy(dst, src, valid * sizeof(float));
            else
                for (int i = 0; i < valid; ++i) dst[i] = src[i] + bias[col + i];
        }
    }
}

// one task: the pairs of blocks [b0, b0 + kGroup), both at once where the task has both
template <typename T, int MT>
inline void slab(const T* x, int64_t ldx, const T* wp, int64_t steps, int64_t b0, int64_t blocks, int64_t N,
                 const float* bias, T* y, int64_t ldy) {
    constexpr int kTaskPairs = kGroup / kPair;
    static_assert(kTaskPairs == 2, "a task is two pairs: two streams");
    const int64_t q0 = b0 / kPair, pairs = (blocks + kPair - 1) / kPair;
    if (q0 + kTaskPairs <= pairs)
        task_rows<2>(x, ldx, wp, steps, q0, MT, N, bias, y, ldy);
    else
        task_rows<1>(x, ldx, wp, steps, q0, MT, N, bias, y, ldy);
}
#else
// MT rows (<= kRowTile) times the blocks of NP pairs from pair q on: MT x 2NP accumulators in
// registers, each 64-byte weight load used by all MT rows, each pair's weights read front to back.
template <typename T, int MT, int NP>
inline void tile(const T* x, int64_t ldx, const T* wp, int64_t steps, int64_t q, int64_t N, const float* bias, T* y,
                 int64_t ldy) {
    constexpr int64_t kStepElems = 64 / sizeof(T);  // elements of one block's step
    constexpr int NB = NP * kPair;
    __m512 acc[MT][NB];
    for (int m = 0; m < MT; ++m)
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    const int64_t pair_elems = steps * kPair * kStepElems;
    const T* w0 = wp + q * pair_elems;
    for (int64_t p = 0; p < steps; ++p) {
        __m512i w[NB];
        for (int j = 0; j < NP; ++j)
            for (int b = 0; b < kPair; ++b)
                w[j * kPair + b] = _mm512_loadu_si512(w0 + j * pair_elems + (p * kPair + b) * kStepElems);
        for (int m = 0; m < MT; ++m) {
            const T* xm = x + m * ldx + Step<T>::kInputs * p;
            for (int b = 0; b < NB; ++b) acc[m][b] = Step<T>::madd(acc[m][b], w[b], xm);
        }
    }
    for (int b = 0; b < NB; ++b) {
        const int64_t col = (q * kPair + b) * kBlock;
        if (col >= N) break;  // the zero block padding the last pair
        const int valid = N - col < kBlock ? static_cast<int>(N - col) : kBlock;
        __m512 add = _mm512_setzero_ps();
        if (bias != nullptr) add = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1), bias + col);
        for (int m = 0; m < MT; ++m) Step<T>::store(y + m * ldy + col, _mm512_add_ps(acc[m][b], add), valid);
    }
}

// one task: the pairs of blocks [b0, b0 + kGroup) (fewer at the end) for MT rows; up to 4 rows
// take both pairs at once (two streams in flight), more rows one pair at a time (registers)
template <typename T, int MT>
inline void slab(const T* x, int64_t ldx, const T* wp, int64_t steps, int64_t b0, int64_t blocks, int64_t N,
                 const float* bias, T* y, int64_t ldy) {
    constexpr int kTaskPairs = kGroup / kPair;
    const int64_t q0 = b0 / kPair, pairs = (blocks + kPair - 1) / kPair;
    if (MT <= 4 && q0 + kTaskPairs <= pairs) {
        tile<T, MT, kTaskPairs>(x, ldx, wp, steps, q0, N, bias, y, ldy);
        return;
    }
    for (int64_t q = q0; q < q0 + kTaskPairs && q < pairs; ++q) tile<T, MT, 1>(x, ldx, wp, steps, q, N, bias, y, ldy);
}
#endif  // PREFIXKV_SMALL_LINEAR_AVX2

template <typename T>
void rows(int64_t mt, const T* x, int64_t ldx, const T* wp, int64_t steps, int64_t b0, int64_t blocks, int64_t N,
          const float* bias, T* y, int64_t ldy) {
    switch (mt) {
        case 1: slab<T, 1>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
        case 2: slab<T, 2>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
        case 3: slab<T, 3>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
        case 4: slab<T, 4>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
        case 5: slab<T, 5>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
        case 6: slab<T, 6>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
        case 7: slab<T, 7>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
        default: slab<T, 8>(x, ldx, wp, steps, b0, blocks, N, bias, y, ldy); break;
    }
}

// one task: its slab of weights streamed once per 8 rows, for every row
template <typename T>
__attribute__((noinline)) void linear_task(int64_t t, const T* x, int64_t ldx, const T* wp, const float* bias, T* y,
                                           int64_t M, int64_t K, int64_t N) {
    const int64_t steps = K / Step<T>::kInputs, blocks = (N + kBlock - 1) / kBlock;
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
        const int64_t mt = M - m0 < kRowTile ? M - m0 : kRowTile;
        rows<T>(mt, x + m0 * ldx, ldx, wp, steps, t * kGroup, blocks, N, bias, y + m0 * N, N);
    }
}

int64_t task_count(int64_t N) { return ((N + kBlock - 1) / kBlock + kGroup - 1) / kGroup; }

template <typename T>
void linear(const T* x, int64_t ldx, const T* wp, const float* bias, T* y, int64_t M, int64_t K, int64_t N,
            int num_threads) {
    const int64_t tasks = task_count(N);  // threads split the slabs
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K >= (1 << 16))
    for (int64_t t = 0; t < tasks; ++t) linear_task(t, x, ldx, wp, bias, y, M, K, N);
}

#endif

}  // namespace

bool prefixkv::small_linear_built(int dtype) {
#ifdef PREFIXKV_SMALL_LINEAR_F32
    if (dtype == 0) return true;
#endif
#ifdef PREFIXKV_SMALL_LINEAR_BF16
    if (dtype == 1) return true;
#endif
    (void)dtype;
    return false;
}

int64_t prefixkv::small_linear_tasks(int64_t N) {
#ifdef PREFIXKV_SMALL_LINEAR_F32
    return task_count(N);
#else
    (void)N;
    return 0;
#endif
}

// the caller checked small_linear_built(dtype) (and an even K for bfloat16)
void prefixkv::small_linear_task(int dtype, int64_t task, const void* x, int64_t ldx, const void* wp,
                                 const float* bias, void* y, int64_t M, int64_t K, int64_t N) {
#ifdef PREFIXKV_SMALL_LINEAR_F32
    if (dtype == 0)
        linear_task(task, static_cast<const float*>(x), ldx, static_cast<const float*>(wp), bias, static_cast<float*>(y),
                    M, K, N);
#endif
#ifdef PREFIXKV_SMALL_LINEAR_BF16
    if (dtype == 1)
        linear_task(task, static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(wp), bias,
                    static_cast<uint16_t*>(y), M, K, N);
#endif
    (void)dtype, (void)task, (void)x, (void)ldx, (void)wp, (void)bias, (void)y, (void)M, (void)K, (void)N;
}

// Which dtypes this build has the kernel for: bit 0 float32 (AVX-512 or AVX2 + FMA), bit 1 bfloat16
// (AVX512-BF16).
extern "C" int prefixkv_small_linear_available() { return prefixkv::linear_dtypes(); }

// dtype 0: float32, 1: bfloat16. x [M, K] (rows ldx apart), wp packed as above for N outputs,
// bias [N] float32 or null, y [M, N]. Returns 0, or non-zero for what it does not handle (bfloat16
// with K odd, or no kernel for the dtype in this build).
extern "C" int prefixkv_small_linear(int dtype, const void* x, int64_t ldx, const void* wp, const float* bias, void* y,
                             int64_t M, int64_t K, int64_t N, int num_threads) {
    return prefixkv::call_linear(dtype, x, ldx, wp, y, M, K, N, num_threads, [&](auto* xs, auto* ws, auto* ys) {
        linear(xs, ldx, ws, bias, ys, M, K, N, num_threads);
    });
}
