// A step's new K and V rows into a layer's paged cache, for the CPU:
//   k, v    [T, row] rows `k_stride` / `v_stride` elements apart (views into the fused qkv output)
//   slots   [T] int64, where each token's K and V go: cache row slots[t] of [num_slots, row]
// Each token is two contiguous copies (Hkv * D elements each). Tensor.index_copy_ from the strided
// qkv views ran at ~2 GB/s on one thread (~0.17 ms per call at 478 tokens, two calls per layer:
// ~10 ms of a float32 478-token prefill of the default model); these copies take a few tens of
// microseconds. Element size only: the copy moves bytes, any dtype. Built and loaded like
// decode_attention.cpp (prefixkv/model/cpu_kernels.py).
#include "target.h"  // first: what the file compiles for

#include <stdint.h>
#include <string.h>

extern "C" int prefixkv_write_kv(int64_t elem_size, const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                                 const int64_t* slots, int64_t T, int64_t row, void* k_cache, void* v_cache,
                                 int64_t num_slots, int num_threads) {
    if (elem_size < 1 || T < 0 || row < 1 || k_stride < row || v_stride < row || num_threads < 1) return 1;
    for (int64_t t = 0; t < T; ++t)  // every slot checked before anything is written: all or nothing
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
    const int64_t bytes = row * elem_size;
    const char* ks = static_cast<const char*>(k);
    const char* vs = static_cast<const char*>(v);
    char* kc = static_cast<char*>(k_cache);
    char* vc = static_cast<char*>(v_cache);
#pragma omp parallel for num_threads(num_threads) if (T * bytes >= (1 << 17)) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        memcpy(kc + slots[t] * bytes, ks + t * k_stride * elem_size, bytes);
        memcpy(vc + slots[t] * bytes, vs + t * v_stride * elem_size, bytes);
    }
    return 0;
}
