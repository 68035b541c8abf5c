// y = x @ W^T (+ b) in bfloat16 for the few rows of a decode step, on the CPU's bfloat16 dot-product
// instruction (AVX512-BF16 vdpbf16ps: 16 lanes, each the sum of two bfloat16 products added to a
// float32 accumulator).
//
// Why: a decode step multiplies 1-8 rows by every weight of the model, so its time is the time to
// stream the weights from memory. oneDNN's bfloat16 kernels are built for many rows; at 1-8 rows
// they reached ~12 GB/s of this project's 51 GB/s machine (AMD Zen 4, no AMX), where this loop
// reaches 25-35 GB/s (bench/small_linear.py). Many-row steps (prefills) keep oneDNN.
//
// Weight layout (packed once, by prefixkv/model/cpu_kernels.small_linear_weight):
//   wp [ceil(N/16)][K/2][16][2]  - for each block of 16 output columns, for each pair of inputs, the
//   16 columns' two weights side by side: one 64-byte load feeds one vdpbf16ps. Output columns past
//   N (the last block's padding) are zero and never stored.
// x [M, K] bfloat16 (rows ldx apart), y [M, N] bfloat16 contiguous, bias [N] float32 or null.
// Accumulation is in float32; the result is rounded to bfloat16 once, to nearest even, as oneDNN
// and PyTorch round a bfloat16 linear's float32 accumulator (the products' order differs: results
// agree with them up to bfloat16 rounding, not bit for bit).
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PREFIXKV_SMALL_LINEAR 1
#endif

namespace {

#ifdef PREFIXKV_SMALL_LINEAR

constexpr int kBlock = 16;      // output columns per weight block (one vector of float32 lanes)
constexpr int kGroup = 4;       // blocks per task: a 4 x 16-column slab (K x 128 bytes) stays in L2
constexpr int kRowTile = 8;     // rows per pass over a slab
constexpr int kPrefetch = 8;    // input pairs ahead

inline void store_block(uint16_t* y, __m512 v, int valid) {
    // round to nearest even (inputs are finite sums of finite products; a NaN cannot arise from
    // finite weights and activations, and an infinite one stays infinite)
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
    const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
    if (valid == kBlock) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), half);
    } else {
        _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << valid) - 1), half);
    }
}

// MT rows (<= kRowTile) times NB blocks starting at block b0: MT * NB accumulators in registers,
// each 64-byte weight load used by all MT rows.
template <int MT, int NB>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t pairs, int64_t b0, int64_t N,
                 const float* bias, uint16_t* y, int64_t ldy) {
    __m512 acc[MT][NB];
    for (int m = 0; m < MT; ++m)
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    const uint16_t* w0 = wp + b0 * pairs * 2 * kBlock;
    for (int64_t p = 0; p < pairs; ++p) {
        __m512i w[NB];
        for (int b = 0; b < NB; ++b) {
            const uint16_t* at = w0 + (b * pairs + p) * 2 * kBlock;
            w[b] = _mm512_loadu_si512(at);
            _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetch * 2 * kBlock), _MM_HINT_T0);
        }
        for (int m = 0; m < MT; ++m) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)w[b], xb);
        }
    }
    for (int b = 0; b < NB; ++b) {
        const int64_t col = (b0 + b) * kBlock;
        const int valid = N - col < kBlock ? static_cast<int>(N - col) : kBlock;
        __m512 add = _mm512_setzero_ps();
        if (bias != nullptr) add = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1), bias + col);
        for (int m = 0; m < MT; ++m) store_block(y + m * ldy + col, _mm512_add_ps(acc[m][b], add), valid);
    }
}

// one task: blocks [b0, b0 + kGroup) (fewer at the end) for MT rows
template <int MT>
inline void slab(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t pairs, int64_t b0, int64_t blocks,
                 int64_t N, const float* bias, uint16_t* y, int64_t ldy) {
    if (b0 + kGroup <= blocks) {
        if (MT <= 4) {  // 4 x 4 accumulators at most
            tile<MT, 4>(x, ldx, wp, pairs, b0, N, bias, y, ldy);
        } else {  // 8 x 2 at most, twice
            tile<MT, 2>(x, ldx, wp, pairs, b0, N, bias, y, ldy);
            tile<MT, 2>(x, ldx, wp, pairs, b0 + 2, N, bias, y, ldy);
        }
        return;
    }
    for (int64_t b = b0; b < blocks; ++b) tile<MT, 1>(x, ldx, wp, pairs, b, N, bias, y, ldy);
}

void rows(int64_t mt, const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t pairs, int64_t b0, int64_t blocks,
          int64_t N, const float* bias, uint16_t* y, int64_t ldy) {
    switch (mt) {
        case 1: slab<1>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
        case 2: slab<2>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
        case 3: slab<3>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
        case 4: slab<4>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
        case 5: slab<5>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
        case 6: slab<6>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
        case 7: slab<7>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
        default: slab<8>(x, ldx, wp, pairs, b0, blocks, N, bias, y, ldy); break;
    }
}

#endif

}  // namespace

// Whether this build has the kernel (the CPU and compiler support AVX512-BF16).
extern "C" int prefixkv_small_linear_available() {
#ifdef PREFIXKV_SMALL_LINEAR
    return 1;
#else
    return 0;
#endif
}

// x [M, K] (rows ldx apart), wp packed as above for N outputs, bias [N] float32 or null, y [M, N].
// Returns 0, or non-zero for what it does not handle (K odd, or no kernel in this build).
extern "C" int prefixkv_small_linear(const void* x, int64_t ldx, const void* wp, const float* bias, void* y, int64_t M,
                                     int64_t K, int64_t N, int num_threads) {
#ifdef PREFIXKV_SMALL_LINEAR
    if (M < 0 || K < 2 || K % 2 || N < 1 || ldx < K || num_threads < 1) return 1;
    const uint16_t* xt = static_cast<const uint16_t*>(x);
    const uint16_t* wt = static_cast<const uint16_t*>(wp);
    uint16_t* yt = static_cast<uint16_t*>(y);
    const int64_t pairs = K / 2, blocks = (N + kBlock - 1) / kBlock;
    const int64_t tasks = (blocks + kGroup - 1) / kGroup;
    // each task streams its slab of weights once per 8 rows; threads split the slabs
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K >= (1 << 16))
    for (int64_t t = 0; t < tasks; ++t) {
        for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
            const int64_t mt = M - m0 < kRowTile ? M - m0 : kRowTile;
            rows(mt, xt + m0 * ldx, ldx, wt, pairs, t * kGroup, blocks, N, bias, yt + m0 * N, N);
        }
    }
    return 0;
#else
    (void)x, (void)ldx, (void)wp, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)num_threads;
    return 4;
#endif
}
