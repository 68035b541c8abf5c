// Sixteen floats as one value (GCC/Clang vector extensions): the compiler lowers them to the
// machine's vectors (one AVX-512 register, two AVX2 ones, four NEON ones), so the kernels of this
// folder need no intrinsics and build everywhere (exp_nonpositive adds two where AVX-512 has
// them). Loops written per element are not vectorized
// reliably (the row maximum and the exponential stayed scalar), hence these helpers.
#pragma once

#include <math.h>
#include <stdint.h>

#include "exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace prefixkv {

// The pieces shared by the 16- and 8-float vectors below (V: the float vector, IV / UV: its
// int32 / uint32 twin).
// exp(x) for x <= 0 lane by lane through integers: exp_nonpositive (exp.h) on a vector
template <typename V, typename IV>
inline V exp_nonpositive_lanes(V x, V t) {
    const IV truncated = __builtin_convertvector(t, IV);  // toward zero; t < 1 here
    V n = __builtin_convertvector(truncated, V);
    n = n > t ? n - 1.0f : n;  // floor
    const IV e = (__builtin_convertvector(n, IV) + 127) << 23;
    return exp_poly(x, n) * reinterpret_cast<const V&>(e);
}
// the bfloat16 nearest to each lane (ties to even; NaN stays a quiet NaN), in its high half
template <typename V, typename UV>
inline UV bf16_lanes(V x) {
    const UV bits = reinterpret_cast<const UV&>(x);
    const UV rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return x != x ? (bits | 0x00400000u) : rounded;
}

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));

inline vec16 loadv(const float* p) { return *reinterpret_cast<const vec16_unaligned*>(p); }
inline void storev(float* p, vec16 x) { *reinterpret_cast<vec16_unaligned*>(p) = x; }
// a broadcast written as one, not as `vec16{} + x`: 0 + x is not x for x = -0.0, so without
// -ffast-math GCC computed the scalar sum and then broadcast it from a register (an add and a
// shuffle before every multiply-add that used it); this form is one broadcast from memory
inline vec16 splat(float x) { return vec16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline vec16 vmax(vec16 a, vec16 b) { return a > b ? a : b; }
inline ivec16 lane_index() { return ivec16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

#if defined(__AVX2__) && !defined(__AVX512F__)
// Eight floats, one AVX2 register. GCC lowers a vec16 on a CPU without AVX-512 lane group by lane
// group through the stack (broadcasts and spills in every multiply-add: the float32 prefill kernel
// ran 12x slower than its AVX-512 build on the same core), so the hottest loops of the kernels
// spell their AVX2 variant in this type; the rest keeps vec16.
#define PREFIXKV_VEC8 1
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4)));
inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8_unaligned*>(p); }
inline void store8(float* p, vec8 x) { *reinterpret_cast<vec8_unaligned*>(p) = x; }
inline vec8 splat8(float x) { return vec8{x, x, x, x, x, x, x, x}; }  // as splat: one broadcast
inline vec8 vmax8(vec8 a, vec8 b) { return a > b ? a : b; }
typedef int32_t ivec8 __attribute__((vector_size(32)));
inline ivec8 lane_index8() { return ivec8{0, 1, 2, 3, 4, 5, 6, 7}; }
inline float hmax8(vec8 v) {
    v = vmax8(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax8(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax8(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}
inline float hsum8(vec8 v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}
// eight float32 or bfloat16 values of memory as one vec8, and back (as load16 / store16 below)
typedef uint16_t u16vec8 __attribute__((vector_size(16)));
typedef uint16_t u16vec8_unaligned __attribute__((vector_size(16), aligned(2)));
typedef uint32_t uvec8 __attribute__((vector_size(32)));
inline vec8 load8(const uint16_t* p) {
    const u16vec8 h = *reinterpret_cast<const u16vec8_unaligned*>(p);
    const uvec8 bits = __builtin_convertvector(h, uvec8) << 16;
    return reinterpret_cast<const vec8&>(bits);
}
inline uvec8 bf16_bits8(vec8 x) { return bf16_lanes<vec8, uvec8>(x); }
inline void store8(uint16_t* p, vec8 x) {
    *reinterpret_cast<u16vec8_unaligned*>(p) = __builtin_convertvector(bf16_bits8(x) >> 16, u16vec8);
}
inline vec8 round_to8(const float*, vec8 x) { return x; }
inline vec8 round_to8(const uint16_t*, vec8 x) {
    const uvec8 bits = bf16_bits8(x);
    return reinterpret_cast<const vec8&>(bits);
}

// exp(x) for x <= 0 on eight floats: the generic path of exp_nonpositive(vec16) below, lane for lane
inline vec8 exp_nonpositive8(vec8 x) {
    x = vmax8(x, splat8(kExpMin));
    return exp_nonpositive_lanes<vec8, ivec8>(x, x * kLog2e + 0.5f);
}
#endif

inline float hmax(vec16 v) {
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

inline float hsum(vec16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

// N horizontal reductions at once (N = 8 or 16): lane j < N of the result is a[j] reduced by `op`
// over the same lane pairs in the same order as hsum / hmax - (i, i+8), (i, i+4), (i, i+2),
// (i, i+1) - so a sum is bit for bit hsum's. A tree of two-source shuffles (30 shuffles and 15
// operations for 16 inputs, 15 and 8 for 8, against 4 and 4 for each input alone, and no chain of
// dependent shuffles per input): each level halves the partial results of every input and packs two
// inputs' halves into one vector.
template <int N, typename Op>
inline vec16 hreduce(const vec16 (&a)[N], Op op) {
    static_assert(N == 8 || N == 16, "8 or 16 inputs");
    vec16 r1[N / 2], r2[N / 4], r3[N / 8];
    for (int i = 0; i < N / 2; ++i) {  // lanes 0-7: a[2i]'s (j, j+8) pairs; 8-15: a[2i+1]'s
        const vec16 x = a[2 * i], y = a[2 * i + 1];
        r1[i] = op(__builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                   __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
    }
    for (int i = 0; i < N / 4; ++i) {  // four lanes per input: (j, j+4)
        const vec16 x = r1[2 * i], y = r1[2 * i + 1];
        r2[i] = op(__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                   __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
    }
    for (int i = 0; i < N / 8; ++i) {  // two lanes per input: (j, j+2)
        const vec16 x = r2[2 * i], y = r2[2 * i + 1];
        r3[i] = op(__builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
                   __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
    }
    // one lane per input: (j, j+1) (with 8 inputs the second operand repeats the first: lanes 8-15)
    const vec16 x = r3[0], y = r3[N / 8 - 1];
    return op(__builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
              __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}

// Sixteen horizontal sums at once: lane j of the result is hsum(a[j]).
inline vec16 hsum16(const vec16 (&a)[16]) {
    return hreduce(a, [](vec16 x, vec16 y) { return x + y; });
}

// Sixteen float32 or bfloat16 values of memory as one vec16 (bfloat16 travels as uint16_t), and
// back, rounding to the element type as PyTorch does (nearest, ties to even; NaN stays a quiet NaN).
typedef uint16_t u16vec16 __attribute__((vector_size(32)));
typedef uint16_t u16vec16_unaligned __attribute__((vector_size(32), aligned(2)));
typedef uint32_t uvec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) { return loadv(p); }
inline vec16 load16(const uint16_t* p) {
    const u16vec16 h = *reinterpret_cast<const u16vec16_unaligned*>(p);
    const uvec16 bits = __builtin_convertvector(h, uvec16) << 16;
    return reinterpret_cast<const vec16&>(bits);
}
// the bfloat16 nearest to x, in the high half of each lane
inline uvec16 bf16_bits(vec16 x) { return bf16_lanes<vec16, uvec16>(x); }
inline void store16(float* p, vec16 x) { storev(p, x); }
inline void store16(uint16_t* p, vec16 x) {
    *reinterpret_cast<u16vec16_unaligned*>(p) = __builtin_convertvector(bf16_bits(x) >> 16, u16vec16);
}
// the value a tensor of that element type would hold
inline vec16 round_to(const float*, vec16 x) { return x; }
inline vec16 round_to(const uint16_t*, vec16 x) {
    const uvec16 bits = bf16_bits(x);
    return reinterpret_cast<const vec16&>(bits);
}

// exp(x) for x <= 0, lane by lane: exp_nonpositive (exp.h) on sixteen floats at once.
inline vec16 exp_nonpositive(vec16 x) {
    x = vmax(x, splat(kExpMin));
    const vec16 t = x * kLog2e + 0.5f;
#if defined(__AVX512F__)
    // floor(t) in one rounding instruction and 2^n applied by vscalefps, where the generic path
    // below goes through integers (five instructions more a call; the softmax of the attention
    // kernels runs one per score). The same n and the same power of two: bit for bit its results
    // (n is in [-126, 0] after the clamp, so 2^n is a normal float and both multiply exactly).
    const __m512 n =
        _mm512_roundscale_ps(reinterpret_cast<const __m512&>(t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const vec16 p = exp_poly(x, reinterpret_cast<const vec16&>(n));
    const __m512 e = _mm512_scalef_ps(reinterpret_cast<const __m512&>(p), n);
    return reinterpret_cast<const vec16&>(e);
#else
    return exp_nonpositive_lanes<vec16, ivec16>(x, t);
#endif
}

}  // namespace prefixkv
