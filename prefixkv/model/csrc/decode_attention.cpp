// Paged decode attention for the CPU: one query token per sequence, K and V read in place from the
// paged cache through each sequence's slot list - no gathered copy of the context (which the
// PyTorch path makes with index_select before SDPA: the context read, written and read again).
//
// Built by prefixkv/model/cpu_kernels.py with the system C++ compiler, and linked against the
// OpenMP runtime torch already loaded, so its threads are torch's threads. Plain C ABI, called
// through ctypes: no torch headers, so the build takes well under a second.
//
// Layout (all contiguous):
//   q     [B, Hkv, G, D]   the query heads of a KV head next to each other (GQA groups)
//   k, v  [slots, Hkv, D]  one layer's cache, flattened over blocks and offsets
//   slots [B, L] int64     slot of each context position of each sequence (padding never read)
//   lens  [B] int64        valid positions per sequence
//   out   [B, Hkv, G, D]
//   lse   [B, Hkv, G] float32, or null: the log-sum-exp of each row's scaled scores, for merging
//         with attention over another part of the context (the cascade's shared prefix)
// Scores, softmax and the weighted sum are computed in float32 for both float32 and bfloat16.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "bf16.h"
#include "exp.h"
#include "vec16.h"

namespace {

using prefixkv::exp_nonpositive;
using prefixkv::hsum;
using prefixkv::load16;
using prefixkv::loadv;
using prefixkv::splat;
using prefixkv::store16;
using prefixkv::storev;
using prefixkv::vec16;

constexpr int kMaxGroup = 16;
constexpr int64_t kPrefetchAhead = 16;  // rows: the slots are scattered, so the hardware prefetcher cannot guess them

template <typename T, int D>
inline void prefetch_row(const T* row) {
    for (size_t off = 0; off < D * sizeof(T); off += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + off);
}

// Rows are D / 16 vectors of sixteen floats (vec16.h): each K row is loaded and widened once and
// meets the G query heads of its group in registers; the exponentials run sixteen at a time.
template <typename T, int D>
void decode(const T* q, const T* k, const T* v, const int64_t* slots, const int64_t* lens, T* out, float* lse,
            int64_t B, int64_t L, int64_t Hkv, int64_t G, float scale, int num_threads) {
    constexpr int V = D / 16;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores(static_cast<size_t>(G * L));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hkv; ++task) {
            const int64_t b = task / Hkv, h = task % Hkv, n = lens[b];
            const int64_t* seq_slots = slots + b * L;
            vec16 qv[kMaxGroup][V];
            float best[kMaxGroup];
            for (int64_t g = 0; g < G; ++g) {
                const T* qr = q + ((b * Hkv + h) * G + g) * D;
                for (int c = 0; c < V; ++c) qv[g][c] = load16(qr + 16 * c) * scale;
                best[g] = -INFINITY;
            }
            // pass 1: every K row once, the G dot products of the group against it
            for (int64_t j = 0; j < n; ++j) {
                if (j + kPrefetchAhead < n) prefetch_row<T, D>(k + (seq_slots[j + kPrefetchAhead] * Hkv + h) * D);
                const T* kr = k + (seq_slots[j] * Hkv + h) * D;
                vec16 kv[V];
                for (int c = 0; c < V; ++c) kv[c] = load16(kr + 16 * c);
                for (int64_t g = 0; g < G; ++g) {
                    vec16 acc = qv[g][0] * kv[0];
                    for (int c = 1; c < V; ++c) acc += qv[g][c] * kv[c];
                    const float s = hsum(acc);
                    scores[g * L + j] = s;
                    best[g] = s > best[g] ? s : best[g];
                }
            }
            // pass 2: softmax weights (unnormalized) and their sums
            float total[kMaxGroup];
            for (int64_t g = 0; g < G; ++g) {
                float* row = scores.data() + g * L;
                const float m = best[g];
                vec16 sum_v = splat(0.0f);
                int64_t j = 0;
                for (; j + 16 <= n; j += 16) {
                    const vec16 e = exp_nonpositive(loadv(row + j) - m);
                    storev(row + j, e);
                    sum_v += e;
                }
                float t = hsum(sum_v);
                for (; j < n; ++j) {
                    const float e = prefixkv::exp_nonpositive(row[j] - m);
                    row[j] = e;
                    t += e;
                }
                total[g] = t;
            }
            // pass 3: every V row once, weighted into the G outputs
            vec16 acc[kMaxGroup][V];
            for (int64_t g = 0; g < G; ++g)
                for (int c = 0; c < V; ++c) acc[g][c] = splat(0.0f);
            for (int64_t j = 0; j < n; ++j) {
                if (j + kPrefetchAhead < n) prefetch_row<T, D>(v + (seq_slots[j + kPrefetchAhead] * Hkv + h) * D);
                const T* vr = v + (seq_slots[j] * Hkv + h) * D;
                vec16 vv[V];
                for (int c = 0; c < V; ++c) vv[c] = load16(vr + 16 * c);
                for (int64_t g = 0; g < G; ++g) {
                    const vec16 p = splat(scores[g * L + j]);
                    for (int c = 0; c < V; ++c) acc[g][c] += p * vv[c];
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                // an empty context (n == 0) gives zeros and a log-sum-exp of -inf: it merges as nothing
                const float inv = n > 0 ? 1.0f / total[g] : 0.0f;
                T* orow = out + ((b * Hkv + h) * G + g) * D;
                for (int c = 0; c < V; ++c) store16(orow + 16 * c, acc[g][c] * inv);
                if (lse != nullptr) lse[(b * Hkv + h) * G + g] = n > 0 ? best[g] + logf(total[g]) : -INFINITY;
            }
        }
    }
}

template <typename T>
int dispatch_head_dim(int64_t D, const void* q, const void* k, const void* v, const int64_t* slots,
                      const int64_t* lens, void* out, float* lse, int64_t B, int64_t L, int64_t Hkv, int64_t G,
                      float scale, int num_threads) {
    const T* qt = static_cast<const T*>(q);
    const T* kt = static_cast<const T*>(k);
    const T* vt = static_cast<const T*>(v);
    T* ot = static_cast<T*>(out);
    switch (D) {
        case 32: decode<T, 32>(qt, kt, vt, slots, lens, ot, lse, B, L, Hkv, G, scale, num_threads); return 0;
        case 64: decode<T, 64>(qt, kt, vt, slots, lens, ot, lse, B, L, Hkv, G, scale, num_threads); return 0;
        case 128: decode<T, 128>(qt, kt, vt, slots, lens, ot, lse, B, L, Hkv, G, scale, num_threads); return 0;
        default: return 2;
    }
}

}  // namespace

// dtype 0: float32, 1: bfloat16. Returns 0, or non-zero for a shape it does not handle
// (the caller then takes the PyTorch path).
extern "C" int prefixkv_decode_attention(int dtype, int64_t D, const void* q, const void* k, const void* v,
                                         const int64_t* slots, const int64_t* lens, void* out, float* lse, int64_t B,
                                         int64_t L, int64_t Hkv, int64_t G, float scale, int num_threads) {
    if (G < 1 || G > kMaxGroup || B < 0 || L < 1 || Hkv < 1 || num_threads < 1) return 1;
    if (dtype == 0) return dispatch_head_dim<float>(D, q, k, v, slots, lens, out, lse, B, L, Hkv, G, scale, num_threads);
    if (dtype == 1) return dispatch_head_dim<uint16_t>(D, q, k, v, slots, lens, out, lse, B, L, Hkv, G, scale, num_threads);
    return 3;
}
