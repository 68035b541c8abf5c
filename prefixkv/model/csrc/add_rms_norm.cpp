// Residual add and RMSNorm in one pass over each row, for the CPU:
//   h     <- h + delta          (in h's dtype, as `h + delta` in PyTorch; skipped when delta is null)
//   out   <- weight * (h * rsqrt(mean(h^2) + eps))   (transformers' LlamaRMSNorm: the mean in float32,
//            the normalized row cast to the model dtype before the weight multiplies it)
// Eager PyTorch runs this as ~8 operators per norm (add, float cast, pow, mean, add, rsqrt, mul,
// cast, mul), each a pass over the rows and a dispatch: 61 norms per step of the default model.
// Rows are handed out 8 at a time (dynamic): a thread the OS preempts for a neighbour process
// holds up only its last few rows, not a static half of them.
// Built and loaded like decode_attention.cpp (prefixkv/model/cpu_kernels.py).
#include "target.h"  // first: what the file compiles for

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#include "kernels.h"

namespace {

using prefixkv::load;
using prefixkv::round_to;
using prefixkv::store;

template <typename T>
__attribute__((noinline)) void norm_row(T* hr, const T* dr, const T* weight, T* o, int64_t dim, float eps) {
    float sum = 0.0f;
    if (dr != nullptr) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) {
            const float x = round_to(hr, load(hr, i) + load(dr, i));
            store(hr, i, x);
            sum += x * x;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) {
            const float x = load(hr, i);
            sum += x * x;
        }
    }
    const float inv = 1.0f / sqrtf(sum / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) store(o, i, load(weight, i) * round_to(hr, load(hr, i) * inv));
}

template <typename T>
void add_rms_norm(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t dim, float eps,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= (1 << 16)) schedule(dynamic, 8)
    for (int64_t r = 0; r < rows; ++r)
        norm_row(h + r * dim, delta == nullptr ? nullptr : delta + r * dim, weight, out + r * dim, dim, eps);
}

}  // namespace

void prefixkv::add_rms_norm_row(int dtype, void* h, const void* delta, const void* weight, void* out, int64_t dim,
                                float eps) {
    if (dtype == 0)
        norm_row(static_cast<float*>(h), static_cast<const float*>(delta), static_cast<const float*>(weight),
                 static_cast<float*>(out), dim, eps);
    else
        norm_row(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta), static_cast<const uint16_t*>(weight),
                 static_cast<uint16_t*>(out), dim, eps);
}

extern "C" int prefixkv_add_rms_norm(int dtype, void* h, const void* delta, const void* weight, void* out, int64_t rows,
                                     int64_t dim, float eps, int num_threads) {
    if (rows < 0 || dim < 1 || num_threads < 1) return 1;
    if (dtype == 0) {
        add_rms_norm<float>(static_cast<float*>(h), static_cast<const float*>(delta), static_cast<const float*>(weight),
                            static_cast<float*>(out), rows, dim, eps, num_threads);
        return 0;
    }
    if (dtype == 1) {
        add_rms_norm<uint16_t>(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta),
                               static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows, dim, eps,
                               num_threads);
        return 0;
    }
    return 3;
}
