// One step of the native linear layout (small_linear.cpp): 64 bytes of weights - 16 output
// columns times the inputs of one step - multiplied by one row's inputs of that step and added to
// the row's 16 float32 accumulators; and the accumulators stored in the row's dtype. Shared by the
// few-row kernel (small_linear.cpp) and the many-row one (blocked_linear.cpp), so the two compute
// every output with the same instructions in the same order: a row's result is the same bits
// whichever kernel, and however many rows, the call had.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PREFIXKV_LINEAR_AVX512 1
#if defined(__AVX512BF16__)
#define PREFIXKV_LINEAR_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PREFIXKV_LINEAR_AVX2 1  // float32 only: no bfloat16 arithmetic there
#endif

namespace prefixkv {

constexpr int kLinearBlock = 16;  // output columns per weight block (one vector of float32 lanes)
constexpr int kLinearPair = 2;    // blocks side by side in each step of the layout

template <typename T>
struct LinearStep;

template <>
struct LinearStep<float> {  // one input per step: a float32 multiply-add
    static constexpr int kInputs = 1;
#ifdef PREFIXKV_LINEAR_AVX512
    static inline __m512 madd(__m512 acc, __m512i w, const float* x) {
        return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_set1_ps(*x), acc);
    }
    static inline void store(float* y, __m512 v, int valid) {
        if (valid == kLinearBlock)
            _mm512_storeu_ps(y, v);
        else
            _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << valid) - 1), v);
    }
#endif
};

#ifdef PREFIXKV_LINEAR_BF16
template <>
struct LinearStep<uint16_t> {  // two inputs per step: the pair's two bfloat16 products in one instruction
    static constexpr int kInputs = 2;
    static inline __m512 madd(__m512 acc, __m512i w, const uint16_t* x) {
        int32_t pair;
        memcpy(&pair, x, sizeof pair);
        return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
    }
    // round to nearest even (inputs are finite sums of finite products; a NaN cannot arise from
    // finite weights and activations, and an infinite one stays infinite)
    static inline void store(uint16_t* y, __m512 v, int valid) {
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
        const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
        if (valid == kLinearBlock)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), half);
        else
            _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << valid) - 1), half);
    }
};
#endif

// Which dtypes this build has the linear kernels for: bit 0 float32 (AVX-512 or AVX2 + FMA), bit 1
// bfloat16 (AVX512-BF16).
inline int linear_dtypes() {
    int dtypes = 0;
#if defined(PREFIXKV_LINEAR_AVX512) || defined(PREFIXKV_LINEAR_AVX2)
    dtypes |= 1;
#endif
#ifdef PREFIXKV_LINEAR_BF16
    dtypes |= 2;
#endif
    return dtypes;
}

// The linear kernels' entry points (dtype 0: float32, 1: bfloat16; x [M, K], rows ldx apart; wp laid
// out as small_linear.cpp says for N outputs; bias [N] float32 or null; y [M, N]): checks the
// arguments and calls run(x, wp, y) with the pointers of the dtype's element type. Returns 0, or
// non-zero for what the kernels do not take (bfloat16 with K odd; no kernel for the dtype in this
// build: 4).
template <typename Run>
inline int call_linear(int dtype, const void* x, int64_t ldx, const void* wp, void* y, int64_t M, int64_t K,
                       int64_t N, int num_threads, Run run) {
    if (M < 0 || K < 1 || N < 1 || ldx < K || num_threads < 1) return 1;
#if defined(PREFIXKV_LINEAR_AVX512) || defined(PREFIXKV_LINEAR_AVX2)
    if (dtype == 0) {
        run(static_cast<const float*>(x), static_cast<const float*>(wp), static_cast<float*>(y));
        return 0;
    }
#endif
#ifdef PREFIXKV_LINEAR_BF16
    if (dtype == 1) {
        if (K % 2) return 1;
        run(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(wp), static_cast<uint16_t*>(y));
        return 0;
    }
#endif
    (void)dtype, (void)x, (void)wp, (void)y, (void)run;
    return 4;
}

}  // namespace prefixkv
