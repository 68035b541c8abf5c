// Rotary position embedding (Neox/HF rotate_half) in place, for the CPU: each head's row x of
// width D becomes x * cos + rotate_half(x) * signed_sin, where the tables hold cos on both halves
// and -sin / +sin on the first / second half (layers.RotaryEmbedding), so
//   x'[j]        = x[j] * c[j]               + x[j + D/2] * s[j]
//   x'[j + D/2]  = x[j + D/2] * c[j + D/2]   + x[j] * s[j + D/2]
// Rounded exactly as the PyTorch formulation (two products, each rounded to the dtype, then their
// sum rounded): no fused multiply-add in this file, so float32 results are bit for bit PyTorch's.
// Eager PyTorch runs it as four operators over q and k (mul, cat, mul_, add_) into a new tensor:
// ~6 ms of a 478-token bfloat16 prefill of the default model. Built and loaded like
// decode_attention.cpp (prefixkv/model/cpu_kernels.py).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "target.h"  // first: what the file compiles for

#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "vec16.h"

namespace {

using prefixkv::load16;
using prefixkv::store16;
using prefixkv::round_to;
using prefixkv::vec16;

// one token: its H heads of D, contiguous, rotated in place by its table rows c and s
template <typename T>
__attribute__((noinline)) void rotate_row(T* x, int64_t H, int64_t D, const T* c, const T* s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < H; ++h) {
        T* row = x + h * D;
        int64_t j = 0;
        if (half % 16 == 0) {
            for (; j < half; j += 16) {
                const vec16 a = load16(row + j), b = load16(row + j + half);
                const vec16 first = round_to(row, a * load16(c + j)) + round_to(row, b * load16(s + j));
                const vec16 second = round_to(row, b * load16(c + j + half)) + round_to(row, a * load16(s + j + half));
                store16(row + j, first);
                store16(row + j + half, second);
            }
        }
        for (; j < half; ++j) {  // head dims whose half is not a multiple of 16
            const float a = prefixkv::load(row, j), b = prefixkv::load(row, j + half);
            const float first =
                prefixkv::round_to(row, a * prefixkv::load(c, j)) + prefixkv::round_to(row, b * prefixkv::load(s, j));
            const float second = prefixkv::round_to(row, b * prefixkv::load(c, j + half)) +
                                 prefixkv::round_to(row, a * prefixkv::load(s, j + half));
            prefixkv::store(row, j, first);
            prefixkv::store(row, j + half, second);
        }
    }
}

template <typename T>
void rotate(T* x, int64_t row_stride, int64_t T_rows, int64_t H, int64_t D, const T* cos, const T* sin,
            int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T_rows * H * D >= (1 << 15)) schedule(static)
    for (int64_t t = 0; t < T_rows; ++t) rotate_row(x + t * row_stride, H, D, cos + t * D, sin + t * D);
}

}  // namespace

void prefixkv::rotate_token(int dtype, void* x, int64_t H, int64_t D, const void* cos, const void* sin) {
    if (dtype == 0)
        rotate_row(static_cast<float*>(x), H, D, static_cast<const float*>(cos), static_cast<const float*>(sin));
    else
        rotate_row(static_cast<uint16_t*>(x), H, D, static_cast<const uint16_t*>(cos),
                   static_cast<const uint16_t*>(sin));
}

extern "C" int prefixkv_rotary(int dtype, void* x, int64_t row_stride, int64_t T, int64_t H, int64_t D,
                               const void* cos, const void* sin, int num_threads) {
    if (T < 0 || H < 1 || D < 2 || D % 2 || row_stride < H * D || num_threads < 1) return 1;
    if (dtype == 0) {
        rotate(static_cast<float*>(x), row_stride, T, H, D, static_cast<const float*>(cos),
               static_cast<const float*>(sin), num_threads);
        return 0;
    }
    if (dtype == 1) {
        rotate(static_cast<uint16_t*>(x), row_stride, T, H, D, static_cast<const uint16_t*>(cos),
               static_cast<const uint16_t*>(sin), num_threads);
        return 0;
    }
    return 3;
}
