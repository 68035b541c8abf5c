// Every decoder layer of a decode step (one new token per sequence, few sequences) in one call.
//
// Why: at one to a few sequences a decode step streams the weights once, and each layer's work is
// ten small pieces - the q/k/v product, rotary and the cache write, attention, the output product,
// add + norm, gate/up, SiLU x up, down, add + norm. Called one by one from Python, each piece cost
// a Python dispatch, a new tensor and an OpenMP region: ~170 us a layer beside ~230 us of weight
// streaming in a bfloat16 decode step of the default model on the 2-vCPU Zen 4
// (docs/benchmarks.md). Here the pieces run inside one OpenMP region, separated by barriers.
//
// Every piece is the function the separate kernel runs for the same unit of work (kernels.h), so
// the results are the layer-by-layer path's bit for bit (tests/model/test_decode_layers.py).
//
// Arguments (dtype 0 float32, 1 bfloat16; all tensors contiguous, of the dtype unless said):
//   dims    [9] int64: B sequences, H hidden, Hq query heads, Hkv KV heads, D head dim, I
//           intermediate, L slots a sequence (columns of `slots`), layers, kv_half (elements from a
//           layer cache's K to its V)
//   weights [layers][7] addresses: q/k/v, its bias (float32, or 0), o, gate/up, down - each laid out
//           for the small-batch linear (small_linear.cpp) -, the post-attention norm's weight and
//           the norm after the layer (the next layer's input norm, the final norm after the last)
//   caches  [layers] addresses of each layer's cache: K [slots, Hkv, D] there, V kv_half after it
//   h       [B, H] the residual stream, updated in place; x [B, H] the first layer's normed input,
//           and on return the final norm's output
//   cos, sin [B, D] rotary tables of each sequence's position; slot_mapping [B] int64, where each
//           new token's K and V go; slots [B, L] int64, lens [B] int64: each context's slots
// Returns 0, or non-zero for what it does not take (the caller then runs the layers one by one).
#include "target.h"  // first: what the file compiles for

#include <stdint.h>
#include <string.h>

#include <vector>

#include "kernels.h"

namespace {

constexpr int kSlots = 7;  // addresses per layer in `weights`
enum { kQkv, kQkvBias, kO, kGateUp, kDown, kPostNorm, kNextNorm };

template <typename P>
P* at(int64_t address) {
    return reinterpret_cast<P*>(static_cast<intptr_t>(address));
}

}  // namespace

extern "C" int prefixkv_decode_layers(int dtype, const int64_t* dims, const int64_t* weights, const int64_t* caches,
                                      void* h, void* x, const void* cos, const void* sin,
                                      const int64_t* slot_mapping, const int64_t* slots, const int64_t* lens,
                                      float eps, float scale, int num_threads) {
    const int64_t B = dims[0], H = dims[1], Hq = dims[2], Hkv = dims[3], D = dims[4], I = dims[5], L = dims[6];
    const int64_t layers = dims[7], kv_half = dims[8];
    if (B < 1 || H < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || I < 1 || L < 1 || layers < 0 || num_threads < 1) return 1;
    if ((dtype != 0 && dtype != 1) || !prefixkv::small_linear_built(dtype)) return 3;
    if (dtype == 1 && (H % 2 || (Hq * D) % 2 || I % 2)) return 1;  // the bfloat16 linear takes pairs of inputs
    const int64_t qkv_cols = (Hq + 2 * Hkv) * D, size = dtype == 0 ? 4 : 2;
    // the step's intermediates, each starting on a cache line
    const auto room = [&](int64_t elements) { return (elements * size + 63) / 64 * 64; };
    const int64_t at_attn = room(B * qkv_cols), at_delta = at_attn + room(B * Hq * D);
    const int64_t at_gu = at_delta + room(B * H), at_act = at_gu + room(B * 2 * I), total = at_act + room(B * I);
    std::vector<float> work(static_cast<size_t>(total / 4 + 16));
    char* base = reinterpret_cast<char*>(work.data());
    base += (64 - reinterpret_cast<intptr_t>(base) % 64) % 64;
    char* qkv = base;
    char* attn = base + at_attn;
    char* delta = base + at_delta;
    char* gu = base + at_gu;
    char* act = base + at_act;
    char* hc = static_cast<char*>(h);
    char* xc = static_cast<char*>(x);
    const char* cosc = static_cast<const char*>(cos);
    const char* sinc = static_cast<const char*>(sin);

    // the same split of the keys as the separate kernel's (decode_attention.cpp): the same bits
    prefixkv::DecodeAttention attention(dtype, D, qkv, qkv_cols, slots, lens, attn, nullptr, B, L, Hkv, Hq / Hkv,
                                        scale);
    if (!attention.supported()) return 2;
    const int64_t attention_tasks = attention.tasks(), merge_rows = attention.merge_rows();
    const int64_t qkv_tasks = prefixkv::small_linear_tasks(qkv_cols), h_tasks = prefixkv::small_linear_tasks(H);
    const int64_t gu_tasks = prefixkv::small_linear_tasks(2 * I);

#pragma omp parallel num_threads(num_threads)
    {
        prefixkv::DecodeScratch scratch;
        attention.make_scratch(scratch);
        for (int64_t layer = 0; layer < layers; ++layer) {
            const int64_t* w = weights + layer * kSlots;
            char* k_cache = at<char>(caches[layer]);
            char* v_cache = k_cache + kv_half * size;
            // each `omp for` ends with a barrier: a phase starts when the one before it is done
#pragma omp for schedule(static)
            for (int64_t t = 0; t < qkv_tasks; ++t)
                prefixkv::small_linear_task(dtype, t, xc, H, at<void>(w[kQkv]), at<float>(w[kQkvBias]), qkv, B, H,
                                            qkv_cols);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; ++b) {  // q and k rotated together, then K and V into the cache
                char* row = qkv + b * qkv_cols * size;
                prefixkv::rotate_token(dtype, row, Hq + Hkv, D, cosc + b * D * size, sinc + b * D * size);
                const int64_t to = slot_mapping[b] * Hkv * D * size;
                memcpy(k_cache + to, row + Hq * D * size, Hkv * D * size);
                memcpy(v_cache + to, row + (Hq + Hkv) * D * size, Hkv * D * size);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < attention_tasks; ++task) attention.run_task(task, k_cache, v_cache, scratch);
#pragma omp for schedule(static)
            for (int64_t row = 0; row < merge_rows; ++row) attention.merge_row(row);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < h_tasks; ++t)
                prefixkv::small_linear_task(dtype, t, attn, Hq * D, at<void>(w[kO]), nullptr, delta, B, Hq * D, H);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; ++b)
                prefixkv::add_rms_norm_row(dtype, hc + b * H * size, delta + b * H * size, at<void>(w[kPostNorm]),
                                           xc + b * H * size, H, eps);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < gu_tasks; ++t)
                prefixkv::small_linear_task(dtype, t, xc, H, at<void>(w[kGateUp]), nullptr, gu, B, H, 2 * I);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; ++b) prefixkv::silu_and_mul_row(dtype, gu + b * 2 * I * size, act + b * I * size, I);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < h_tasks; ++t)
                prefixkv::small_linear_task(dtype, t, act, I, at<void>(w[kDown]), nullptr, delta, B, I, H);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; ++b)
                prefixkv::add_rms_norm_row(dtype, hc + b * H * size, delta + b * H * size, at<void>(w[kNextNorm]),
                                           xc + b * H * size, H, eps);
        }
    }
    return 0;
}
