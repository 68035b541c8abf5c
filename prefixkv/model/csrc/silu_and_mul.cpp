// SiLU(gate) * up for the CPU, in one pass over the fused gate/up projection's output:
//   gu  [rows, 2 * I]  (gate in the first I columns, up in the last I, as GatedMLP splits it)
//   out [rows, I]      silu(gate) * up
// Eager PyTorch runs it as two operators (silu, then mul), each a pass over [rows, I] and, in
// bfloat16, a widening and a rounding per element: ~9% of a bfloat16 prefill of the default model.
// Rounding as PyTorch: in bfloat16 silu(gate) is rounded to bfloat16 before the product, which is
// rounded again. Built and loaded like decode_attention.cpp (prefixkv/model/cpu_kernels.py).
#include "target.h"  // first: what the file compiles for

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "kernels.h"
#include "vec16.h"

namespace {

using prefixkv::exp_nonpositive;
using prefixkv::load16;
using prefixkv::store16;
using prefixkv::round_to;
using prefixkv::vec16;

// silu(x) = x / (1 + exp(-x)), with the exponential only ever of a non-positive argument
inline vec16 silu(vec16 x) {
    const vec16 z = exp_nonpositive(x < 0 ? x : -x);  // exp(-|x|)
    const vec16 inv = 1.0f / (1.0f + z);
    return x < 0 ? x * z * inv : x * inv;
}

inline float silu(float x) {
    const float z = exp_nonpositive(x < 0 ? x : -x);
    return x < 0 ? x * z / (1.0f + z) : x / (1.0f + z);
}

#if defined(PREFIXKV_VEC8)
// AVX2: eight lanes a vector (a vec16 is lowered through the stack there: 8x slower than PyTorch)
inline prefixkv::vec8 silu(prefixkv::vec8 x) {
    const prefixkv::vec8 z = prefixkv::exp_nonpositive8(x < 0 ? x : -x);  // exp(-|x|)
    const prefixkv::vec8 inv = 1.0f / (1.0f + z);
    return x < 0 ? x * z * inv : x * inv;
}
#endif

template <typename T>
__attribute__((noinline)) void silu_row(const T* g, T* o, int64_t I) {
    const T* u = g + I;
    int64_t c = 0;
#if defined(PREFIXKV_VEC8)
    using prefixkv::load8;
    for (; c + 8 <= I; c += 8) prefixkv::store8(o + c, prefixkv::round_to8(o, silu(load8(g + c))) * load8(u + c));
#endif
    for (; c + 16 <= I; c += 16) store16(o + c, round_to(o, silu(load16(g + c))) * load16(u + c));
    for (; c < I; ++c) {  // the tail, one by one
        const float a = prefixkv::round_to(o, silu(prefixkv::load(g, c)));
        prefixkv::store(o, c, a * prefixkv::load(u, c));
    }
}

template <typename T>
void silu_and_mul(const T* gu, T* out, int64_t rows, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * I >= (1 << 15)) schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r) silu_row(gu + r * 2 * I, out + r * I, I);
}

}  // namespace

void prefixkv::silu_and_mul_row(int dtype, const void* gu, void* out, int64_t I) {
    if (dtype == 0)
        silu_row(static_cast<const float*>(gu), static_cast<float*>(out), I);
    else
        silu_row(static_cast<const uint16_t*>(gu), static_cast<uint16_t*>(out), I);
}

extern "C" int prefixkv_silu_and_mul(int dtype, const void* gu, void* out, int64_t rows, int64_t I, int num_threads) {
    if (rows < 0 || I < 1 || num_threads < 1) return 1;
    if (dtype == 0) {
        silu_and_mul(static_cast<const float*>(gu), static_cast<float*>(out), rows, I, num_threads);
        return 0;
    }
    if (dtype == 1) {
        silu_and_mul(static_cast<const uint16_t*>(gu), static_cast<uint16_t*>(out), rows, I, num_threads);
        return 0;
    }
    return 3;
}
