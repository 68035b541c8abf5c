// y = x @ W^T (+ b) for many rows (a prefill), on the same weight layout as the few-row kernel
// (small_linear.cpp), so that one copy of the weights serves both: without it, prefills needed a
// second copy laid out for oneDNN, which doubled the weights' memory and, past what fits, left the
// decode steps on oneDNN's slower weight streaming.
//
// A blocked matrix product (GotoBLAS's scheme). The layout already is what such a product packs its
// weights into: a pair of 16-column blocks, K steps of 2 x 64 contiguous bytes. The rows are
// copied per chunk (kSpanBytes of them per span of steps) into tiles of kRows rows, step-major ([steps][rows], the inputs of
// one step side by side), so that the inner loop reads one short stream of inputs besides the
// weights: read in place, kRows rows kLdx apart compete for the same few L1 sets (rows 8 KB apart
// map onto one set) and the kernel ran at 0.65x oneDNN's speed. A tile holds kRows x 32 float32
// accumulators in registers over kSpan steps of a pair's weights (kept in L1/L2 across the chunk's
// tiles); a task takes kGroupPairs pairs of a chunk, so each span of the chunk's copied inputs is
// reused by those pairs while in L2.
//
// Every output lane sums its products over K in order, from zero, with the instruction the few-row
// kernel uses (linear_step.h), partial sums kept in float32 between spans, and adds the bias last as
// it does: a row's result is the few-row kernel's bit for bit, whichever kernel and however many rows
// the call had, and however the tasks were shared out (by rows and column pairs, never by the
// thread count). Tasks are handed out as threads come free, so a thread slowed by a neighbour on its
// core takes fewer.
//
// AVX-512 (float32 multiply-adds; bfloat16 by vdpbf16ps where AVX512-BF16 is there) and AVX2 + FMA
// (float32, tiles of 6 rows x one block: 12 of the 16 ymm registers).
#include "target.h"  // first: what the file compiles for

#include <stdint.h>
#include <string.h>

#include <vector>

#include "linear_step.h"

namespace {

#if defined(PREFIXKV_LINEAR_AVX512) || defined(PREFIXKV_LINEAR_AVX2)
#define PREFIXKV_BLOCKED_LINEAR 1

using prefixkv::kLinearBlock;
using prefixkv::kLinearPair;
template <typename T>
using Step = prefixkv::LinearStep<T>;

// Steps per pass, and rows copied at a time: a span of a chunk's copied inputs (kSpanBytes: 120 rows
// x 1,024 steps x 4 bytes) and a task's pairs' span of weights (2 x 128 KB) share the L2 (1 MB on a
// Zen 4); fewer steps, more rows (at most kMaxChunkRows), so that a short K reads each weight once
// for more rows (SmolLM2's products at 256-478 rows, one thread: 1.04-1.08x oneDNN's time with up
// to 240 rows, 1.07-1.10x with 120). Timed against 240 x 512, 240 x 1,024 and 480 x 256 / 512 on Llama 3.2 1B's and
// SmolLM2-135M's products at 478 rows (2 threads, AMD Zen 4): in that sweep the largest, down
// (8,192 -> 2,048), ran 1.03x oneDNN's time, against 1.06-1.27x (1.07x re-measured later, noisier).
constexpr int64_t kSpan = 1024;
constexpr int64_t kSpanBytes = 120 * kSpan * 4;
constexpr int64_t kMaxChunkRows = 240;
constexpr int64_t kGroupPairs = 2;   // pairs of column blocks per task
#ifdef PREFIXKV_LINEAR_AVX512
// 12 rows x 2 blocks: 24 accumulators of the 32 zmm registers. 14 rows (28) timed the same; the
// inputs as the multiply-adds' own broadcast operands ({1to16}, no vbroadcastss) 2.1x slower
constexpr int kRows = 12;
#else
constexpr int kRows = 6;  // 6 rows x 1 block (2 ymm each): 12 accumulators of the 16 ymm registers
#endif

// The inputs of one step of one row, as the layout steps: a float32, or two bfloat16 (one 32-bit unit)
typedef uint32_t Unit;

// the outputs of the tile's rows at columns [col, col + 16) of N; partial sums, when not last, go
// to `part` (kLinearBlock floats a row, rows 2 * kLinearBlock apart)
#ifdef PREFIXKV_LINEAR_AVX512
template <typename T, int MT>
inline void tile(const Unit* a, const T* w, int64_t s0, int64_t s1, float* part, bool first, bool last, int64_t q,
                 int64_t N, const float* bias, T* y, int64_t ldy) {
    constexpr int64_t kElems = 64 / sizeof(T);  // elements of one block's step
    __m512 acc0[MT], acc1[MT];
    for (int m = 0; m < MT; ++m) {
        acc0[m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + m * 32);
        acc1[m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + m * 32 + 16);
    }
    a += s0 * MT;
    for (int64_t p = s0; p < s1; ++p, w += kLinearPair * kElems, a += MT) {
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + kElems);
        // in registers: GCC otherwise folds the loads into every multiply-add, 24 loads a step for 2
        // (one 64-byte load a cycle on Zen 4: load-bound at 2/3 of the multiply-add rate)
        asm("" : "+v"(w0), "+v"(w1));
        for (int m = 0; m < MT; ++m) {
            const T* xm = reinterpret_cast<const T*>(a + m);
            acc0[m] = Step<T>::madd(acc0[m], w0, xm);
            acc1[m] = Step<T>::madd(acc1[m], w1, xm);
        }
    }
    if (!last) {
        for (int m = 0; m < MT; ++m) {
            _mm512_storeu_ps(part + m * 32, acc0[m]);
            _mm512_storeu_ps(part + m * 32 + 16, acc1[m]);
        }
        return;
    }
    for (int b = 0; b < kLinearPair; ++b) {
        const int64_t col = (q * kLinearPair + b) * kLinearBlock;
        if (col >= N) break;  // the zero block padding the last pair
        const int valid = N - col < kLinearBlock ? static_cast<int>(N - col) : kLinearBlock;
        __m512 add = _mm512_setzero_ps();  // as small_linear.cpp's tile: + 0 without a bias
        if (bias != nullptr) add = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1), bias + col);
        for (int m = 0; m < MT; ++m) Step<T>::store(y + m * ldy + col, _mm512_add_ps(b ? acc1[m] : acc0[m], add), valid);
    }
}
#else
// AVX2: one block of the pair per pass (b), 16 columns as two 8-lane vectors; as small_linear.cpp's
// AVX2 tile, the result is copied out and the bias added only where there is one.
//
// Every loop over the tile's rows unrolled: where one stayed a loop (the copy out), GCC 12 kept the
// accumulators in memory and stored all 12 of them each step, one store a cycle against two
// multiply-adds, so the kernel ran at half of them (45 GFLOP/s on one thread of an AMD Zen 2,
// oneDNN 80; unrolled, 78-80)
#define PREFIXKV_ROWS_UNROLLED _Pragma("GCC unroll 16")
template <typename T, int MT>
inline void tile_block(const Unit* a, const float* w, int64_t s0, int64_t s1, float* part, bool first, bool last,
                       int64_t col, int64_t N, const float* bias, float* y, int64_t ldy) {
    __m256 acc[MT][2];
    PREFIXKV_ROWS_UNROLLED for (int m = 0; m < MT; ++m)
        for (int j = 0; j < 2; ++j)
            acc[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * 2 * kLinearBlock + 8 * j);
    a += s0 * MT;
    for (int64_t p = s0; p < s1; ++p, w += kLinearPair * kLinearBlock, a += MT) {
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        asm("" : "+v"(w0), "+v"(w1));
        PREFIXKV_ROWS_UNROLLED for (int m = 0; m < MT; ++m) {
            const __m256 xm = _mm256_broadcast_ss(reinterpret_cast<const float*>(a + m));
            acc[m][0] = _mm256_fmadd_ps(w0, xm, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, xm, acc[m][1]);
        }
    }
    if (!last) {
        PREFIXKV_ROWS_UNROLLED for (int m = 0; m < MT; ++m)
            for (int j = 0; j < 2; ++j) _mm256_storeu_ps(part + m * 2 * kLinearBlock + 8 * j, acc[m][j]);
        return;
    }
    if (col >= N) return;  // the zero block padding the last pair
    const int valid = N - col < kLinearBlock ? static_cast<int>(N - col) : kLinearBlock;
    PREFIXKV_ROWS_UNROLLED for (int m = 0; m < MT; ++m) {
        alignas(32) float out[kLinearBlock];
        _mm256_store_ps(out, acc[m][0]);
        _mm256_store_ps(out + 8, acc[m][1]);
        float* dst = y + m * ldy + col;
        if (bias == nullptr)
            memcpy(dst, out, valid * sizeof(float));
        else
            for (int i = 0; i < valid; ++i) dst[i] = out[i] + bias[col + i];
    }
}

template <typename T, int MT>
inline void tile(const Unit* a, const T* w, int64_t s0, int64_t s1, float* part, bool first, bool last, int64_t q,
                 int64_t N, const float* bias, T* y, int64_t ldy) {
    for (int b = 0; b < kLinearPair; ++b)
        tile_block<T, MT>(a, w + b * kLinearBlock, s0, s1, part + b * kLinearBlock, first, last,
                          (q * kLinearPair + b) * kLinearBlock, N, bias, y, ldy);
}
#endif

template <typename T>
void tile_rows(int mt, const Unit* a, const T* w, int64_t s0, int64_t s1, float* part, bool first, bool last,
               int64_t q, int64_t N, const float* bias, T* y, int64_t ldy) {
    switch (mt) {
#define PREFIXKV_TILE(n)                                                     \
    case n:                                                                  \
        if constexpr (n <= kRows) tile<T, n>(a, w, s0, s1, part, first, last, q, N, bias, y, ldy); \
        break;
        PREFIXKV_TILE(1)
        PREFIXKV_TILE(2)
        PREFIXKV_TILE(3)
        PREFIXKV_TILE(4)
        PREFIXKV_TILE(5)
        PREFIXKV_TILE(6)
        PREFIXKV_TILE(7)
        PREFIXKV_TILE(8)
        PREFIXKV_TILE(9)
        PREFIXKV_TILE(10)
        PREFIXKV_TILE(11)
        PREFIXKV_TILE(12)
#undef PREFIXKV_TILE
        default:
            break;
    }
}

// one task: pairs [q0, q1) for rows [r0, r1) of the chunk (`a`: its copied inputs; y: its first row)
template <typename T>
void task(const Unit* a, int64_t r0, int64_t r1, const T* wp, int64_t steps, int64_t q0, int64_t q1, int64_t N,
          const float* bias, T* y, float* part, int64_t part_rows) {
    constexpr int64_t kElems = 64 / sizeof(T);
    const int64_t pair_elems = steps * kLinearPair * kElems;
    for (int64_t s0 = 0; s0 < steps; s0 += kSpan) {
        const int64_t s1 = s0 + kSpan < steps ? s0 + kSpan : steps;
        for (int64_t q = q0; q < q1; ++q) {
            const T* w = wp + q * pair_elems + s0 * kLinearPair * kElems;
            float* pq = part + (q - q0) * part_rows * kLinearPair * kLinearBlock;
            for (int64_t m = r0; m < r1; m += kRows) {
                const int mt = r1 - m < kRows ? static_cast<int>(r1 - m) : kRows;
                tile_rows<T>(mt, a + m * steps, w, s0, s1, pq + (m - r0) * kLinearPair * kLinearBlock, s0 == 0,
                             s1 == steps, q, N, bias, y + m * N, N);
            }
        }
    }
}

// rows [m0, m0 + rows) of x as tiles of kRows rows (the last fewer), each [steps][its rows]
template <typename T>
void copy_tile(const T* x, int64_t ldx, int64_t m0, int64_t rows, int64_t steps, int64_t t, Unit* a) {
    const int64_t first = t * kRows, mt = rows - first < kRows ? rows - first : kRows;
    Unit* dst = a + first * steps;
    for (int64_t m = 0; m < mt; ++m) {
        const T* src = x + (m0 + first + m) * ldx;
        for (int64_t p = 0; p < steps; ++p) memcpy(dst + p * mt + m, src + p * Step<T>::kInputs, sizeof(Unit));
    }
}

template <typename T>
void linear(const T* x, int64_t ldx, const T* wp, const float* bias, T* y, int64_t M, int64_t K, int64_t N,
            int num_threads) {
    if (M == 0) return;
    const int64_t steps = K / Step<T>::kInputs, pairs = (N + 2 * kLinearBlock - 1) / (2 * kLinearBlock);
    // tasks: kGroupPairs pairs (fewer where the pairs would not keep every thread busy) times a
    // share of the chunk's tiles (more than one share where the pairs alone are too few tasks)
    const int64_t wanted = 16 * static_cast<int64_t>(num_threads);
    int64_t group = pairs / wanted;
    group = group < 1 ? 1 : group > kGroupPairs ? kGroupPairs : group;
    const int64_t groups = (pairs + group - 1) / group;
    // chunks of equal size (whole tiles), not the most rows and a remainder: 128 rows as 72 + 56, where
    // 120 + 8 read every weight a second time for one partial tile
    const int64_t span_steps = steps < kSpan ? steps : kSpan;
    int64_t max_rows = kSpanBytes / (span_steps * static_cast<int64_t>(sizeof(Unit))) / kRows * kRows;
    max_rows = max_rows < kRows ? kRows : max_rows > kMaxChunkRows ? kMaxChunkRows / kRows * kRows : max_rows;
    const int64_t chunks = (M + max_rows - 1) / max_rows;
    const int64_t chunk_rows = ((M + chunks - 1) / chunks + kRows - 1) / kRows * kRows;
    // the copied inputs of one chunk, kept by the calling thread from call to call (at most
    // kMaxChunkRows x K values, and 120 x K past 1,024 steps: 3.9 MB for K = 8,192 in float32)
    static thread_local std::vector<Unit> copied;
    if (copied.size() < static_cast<size_t>(chunk_rows * steps)) copied.resize(chunk_rows * steps);
    Unit* a = copied.data();
#pragma omp parallel num_threads(num_threads)
    {
        static thread_local std::vector<float> part;
        if (part.size() < static_cast<size_t>(kGroupPairs * chunk_rows * kLinearPair * kLinearBlock))
            part.resize(kGroupPairs * chunk_rows * kLinearPair * kLinearBlock);
        for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
            const int64_t rows = M - m0 < chunk_rows ? M - m0 : chunk_rows, tiles = (rows + kRows - 1) / kRows;
            int64_t shares = (wanted + groups - 1) / groups;
            shares = shares > tiles ? tiles : shares;
            const int64_t share_rows = (tiles + shares - 1) / shares * kRows;
            shares = (rows + share_rows - 1) / share_rows;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) copy_tile(x, ldx, m0, rows, steps, t, a);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < groups * shares; ++i) {
                const int64_t g = i / shares, r0 = i % shares * share_rows;
                const int64_t r1 = r0 + share_rows < rows ? r0 + share_rows : rows;
                const int64_t q0 = g * group, q1 = q0 + group < pairs ? q0 + group : pairs;
                task(a, r0, r1, wp, steps, q0, q1, N, bias, y + m0 * N, part.data(), chunk_rows);
            }
        }
    }
}
#endif

}  // namespace

// Which dtypes this build has the kernel for: bit 0 float32 (AVX-512 or AVX2 + FMA), bit 1 bfloat16
// (AVX512-BF16) - those of small_linear.cpp.
extern "C" int prefixkv_blocked_linear_available() { return prefixkv::linear_dtypes(); }

// dtype 0: float32, 1: bfloat16. x [M, K] (rows ldx apart), wp laid out as for small_linear.cpp for
// N outputs, bias [N] float32 or null, y [M, N]. Returns 0, or non-zero for what it does not handle.
extern "C" int prefixkv_blocked_linear(int dtype, const void* x, int64_t ldx, const void* wp, const float* bias, void* y,
                             int64_t M, int64_t K, int64_t N, int num_threads) {
    return prefixkv::call_linear(dtype, x, ldx, wp, y, M, K, N, num_threads, [&](auto* xs, auto* ws, auto* ys) {
        linear(xs, ldx, ws, bias, ys, M, K, N, num_threads);
    });
}
