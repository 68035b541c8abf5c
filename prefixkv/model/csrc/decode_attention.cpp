// Paged decode attention for the CPU: one query token per sequence, K and V read in place from the
// paged cache through each sequence's slot list - no gathered copy of the context (which the
// PyTorch path makes with index_select before SDPA: the context read, written and read again).
//
// Built by prefixkv/model/cpu_kernels.py with the system C++ compiler, and linked against the
// OpenMP runtime torch already loaded, so its threads are torch's threads. Plain C ABI, called
// through ctypes: no torch headers, so the build takes seconds.
//
// Layout (all contiguous):
//   q     [B, Hkv, G, D]   the query heads of a KV head next to each other (GQA groups)
//   k, v  [slots, Hkv, D]  one layer's cache, flattened over blocks and offsets
//   slots [B, L] int64     slot of each context position of each sequence (padding never read)
//   lens  [B] int64        valid positions per sequence
//   out   [B, Hkv, G, D]
//   lse   [B, Hkv, G] float32, or null: the log-sum-exp of each row's scaled scores, for merging
//         with attention over another part of the context (the cascade's shared prefix)
// Scores, softmax and the weighted sum are computed in float32 for both float32 and bfloat16 (on
// AVX512-BF16 the softmax weights are rounded to bfloat16 for the weighted sum, see ValueRows).
#include "target.h"  // first: what the file compiles for

#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp.h"
#include "kernels.h"
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
constexpr int kChunk = 16;  // keys per step

// A query head, for the dot products against the K rows of its context. float32 (and bfloat16
// where the CPU lacks AVX512-BF16): D / 16 vectors of sixteen floats, and a K row is widened to
// match. bfloat16 on AVX512-BF16: the query's own D / 32 vectors of bfloat16 pairs, and a K row is
// multiplied as stored (vdpbf16ps: two exact products a float32 lane), D / 32 instructions a row.
template <typename T, int D>
struct QueryRow {
    vec16 v[D / 16];
    explicit QueryRow(const T* q) {
        for (int c = 0; c < D / 16; ++c) v[c] = load16(q + 16 * c);
    }
    vec16 dot(const T* row) const {  // sixteen partial sums of q . row
        vec16 acc = v[0] * load16(row);
        for (int c = 1; c < D / 16; ++c) acc += v[c] * load16(row + 16 * c);
        return acc;
    }
};

#if defined(__AVX512BF16__)
template <int D>
struct QueryRow<uint16_t, D> {
    static_assert(D % 32 == 0, "head dim a multiple of 32");
    __m512bh v[D / 32];
    explicit QueryRow(const uint16_t* q) {
        for (int c = 0; c < D / 32; ++c) v[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    }
    vec16 dot(const uint16_t* row) const {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[0], (__m512bh)_mm512_loadu_si512(row));
        for (int c = 1; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, v[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
        return (vec16)acc;
    }
};
#endif

// acc[c] += sum over the chunk's `count` rows of weight[i] * row i: float32 weights and vectors
// (a bfloat16 row widened as it is read).
template <typename T, int D>
struct ValueRows {
    const T* rows[kChunk];
    int count;
    ValueRows(const T* const (&r)[kChunk], int n) : count(n) {
        for (int i = 0; i < kChunk; ++i) rows[i] = r[i];
    }
    void accumulate(vec16* acc, const float* weight, const uint16_t*) const {
        vec16 a[D / 16];
        for (int c = 0; c < D / 16; ++c) a[c] = acc[c];
        for (int i = 0; i < count; ++i) {
            const vec16 w = splat(weight[i]);
            for (int c = 0; c < D / 16; ++c) a[c] += w * load16(rows[i] + 16 * c);
        }
        for (int c = 0; c < D / 16; ++c) acc[c] = a[c];
    }
    static void finish(vec16*) {}
};

#if defined(__AVX512BF16__)
// bfloat16 on AVX512-BF16: two keys per instruction. The weights are rounded to bfloat16 (as
// PyTorch's flash kernel and prefixkv's prefill kernels do; their sum, the normalizer, stays the
// float32 one). Two V rows are interleaved element by element within 128-bit lanes (unpacklo /
// unpackhi: dims 0-3, 8-11, ... of 32 in one vector, 4-7, 12-15, ... in the other), once a chunk
// for all query heads of the group, and vdpbf16ps adds w_j v_j[d] + w_j+1 v_j+1[d] into each lane;
// finish() puts the dims back in order. Half the multiplies of the float32 path, no widening.
template <int D>
struct ValueRows<uint16_t, D> {
    static constexpr int V = D / 16;
    __m512bh pairs[kChunk / 2][V];
    int num_pairs;
    ValueRows(const uint16_t* const (&r)[kChunk], int n) : num_pairs((n + 1) / 2) {
        for (int p = 0; p < num_pairs; ++p)
            for (int c = 0; c < D / 32; ++c) {  // a short chunk's odd last row pairs with a repeated one, weight 0
                const __m512i x = _mm512_loadu_si512(r[2 * p] + 32 * c), y = _mm512_loadu_si512(r[2 * p + 1] + 32 * c);
                pairs[p][2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                pairs[p][2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
            }
    }
    void accumulate(vec16* acc, const float*, const uint16_t* weight) const {
        __m512 a[V];
        for (int c = 0; c < V; ++c) a[c] = (__m512)acc[c];
        for (int p = 0; p < num_pairs; ++p) {
            int32_t w;
            memcpy(&w, weight + 2 * p, sizeof w);
            const __m512bh wv = (__m512bh)_mm512_set1_epi32(w);
            for (int c = 0; c < V; ++c) a[c] = _mm512_dpbf16_ps(a[c], pairs[p][c], wv);
        }
        for (int c = 0; c < V; ++c) acc[c] = (vec16)a[c];
    }
    static void finish(vec16* acc) {
        for (int c = 0; c < D / 32; ++c) {
            const vec16 lo = acc[2 * c], hi = acc[2 * c + 1];
            acc[2 * c] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            acc[2 * c + 1] = __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        }
    }
};
constexpr bool kBf16Weights = true;
#else
constexpr bool kBf16Weights = false;
#endif

// Fetch the next chunk's rows of a KV head while this one is computed (the slots are scattered
// block to block, which no hardware prefetcher guesses). Into L2 (prefetcht2), not L1: the lines
// of a chunk would fill L1's miss buffers and stall the loads of the chunk at hand (24 sequences x
// 500 bfloat16 keys from memory, Zen 4: 1,040 us a layer prefetching into L1, 600 into L2; two or
// four chunks ahead, or V during the K pass, were no better).
template <typename T>
inline void prefetch_chunk(const T* cache, const int64_t* seq_slots, int64_t j0, int64_t n, int64_t Hkv, int64_t h,
                           int64_t D) {
    for (int64_t j = j0; j < j0 + kChunk && j < n; ++j) {
        const char* row = reinterpret_cast<const char*>(cache + (seq_slots[j] * Hkv + h) * D);
        for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(row + off, 0, 1);
    }
}

// Per-thread room for one task's scores, bfloat16 weights and sums (DecodeAttention::make_scratch).
using Scratch = prefixkv::DecodeScratch;

// Attention of the G query heads `q_task` over keys [lo, hi) of one sequence and KV head: per query
// head the scores' maximum best[g], the sum of exp(score - best) total[g], and the weighted sum of V
// rows with those weights, unnormalized, in scratch.acc (an empty range: -inf, 0, zeros).
// Keys go sixteen at a time: each query head's dot products against the sixteen K rows are summed
// across lanes together (hsum16: ~3 shuffles a key instead of 8), the exponentials run sixteen at a
// time, and the V rows of a chunk are read once for all query heads of the group. Scores, softmax
// and sums in float32 for both float32 and bfloat16. (One pass with an online softmax, a chunk's K
// and V fetched together, was 6-8% faster in bfloat16 and 5-12% slower in float32 at 8-64
// sequences, from memory: the two passes stay.)
#if defined(PREFIXKV_VEC8)
// AVX2: the same three passes in 8-float vectors (a vec16 goes through the stack there: the
// vec16 version lost to PyTorch's gather + SDPA 2x at one sequence). Each key's score is its own
// dot product reduced across lanes (hsum8); weights, sums and the weighted V rows as below.
template <typename T, int D>
void attend(const T* q_task, const T* k, const T* v, const int64_t* seq_slots, int64_t lo, int64_t hi, int64_t Hkv,
            int64_t h, int64_t G, float scale, int64_t stride, Scratch& scratch, float* best_out, float* total) {
    using prefixkv::load8;
    using prefixkv::splat8;
    using prefixkv::store8;
    using prefixkv::vec8;
    constexpr int W = D / 8;
    float* scores = scratch.scores.data();
    float best[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) best[g] = -INFINITY;
    // pass 1: scores
    for (int64_t g = 0; g < G; ++g) {
        vec8 query[W];
        for (int c = 0; c < W; ++c) query[c] = load8(q_task + g * D + 8 * c);
        float* row = scores + g * stride - lo;
        for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
            if (g == 0) prefetch_chunk(k, seq_slots, j0 + kChunk, hi, Hkv, h, D);
            const int64_t end = hi - j0 < kChunk ? hi : j0 + kChunk;
            for (int64_t j = j0; j < end; ++j) {
                const T* key = k + (seq_slots[j] * Hkv + h) * D;
                vec8 acc = query[0] * load8(key);
                for (int c = 1; c < W; ++c) acc += query[c] * load8(key + 8 * c);
                const float sc = prefixkv::hsum8(acc) * scale;
                row[j] = sc;
                best[g] = std::max(best[g], sc);
            }
        }
    }
    // pass 2: softmax weights (unnormalized) and their sums
    const int64_t n = hi > lo ? hi - lo : 0;
    for (int64_t g = 0; g < G; ++g) {
        float* row = scores + g * stride;
        const float m = best[g];
        best_out[g] = m;
        vec8 sum_v = vec8{};
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const vec8 e = prefixkv::exp_nonpositive8(load8(row + j) - m);
            store8(row + j, e);
            sum_v += e;
        }
        float t = prefixkv::hsum8(sum_v);
        for (; j < n; ++j) {
            const float e = prefixkv::exp_nonpositive(row[j] - m);
            row[j] = e;
            t += e;
        }
        total[g] = t;
    }
    // pass 3: every V row once, weighted into the G query heads (accumulators: scratch.acc's floats)
    float* acc = reinterpret_cast<float*>(scratch.acc.data());
    for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.0f;
    for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
        prefetch_chunk(v, seq_slots, j0 + kChunk, hi, Hkv, h, D);
        const int64_t end = hi - j0 < kChunk ? hi : j0 + kChunk;
        for (int64_t g = 0; g < G; ++g) {
            vec8 a[W];
            for (int c = 0; c < W; ++c) a[c] = load8(acc + g * D + 8 * c);
            const float* weight = scores + g * stride - lo;
            for (int64_t j = j0; j < end; ++j) {
                const T* value = v + (seq_slots[j] * Hkv + h) * D;
                const vec8 w = splat8(weight[j]);
                for (int c = 0; c < W; ++c) a[c] += w * load8(value + 8 * c);
            }
            for (int c = 0; c < W; ++c) store8(acc + g * D + 8 * c, a[c]);
        }
    }
}
#else
template <typename T, int D>
void attend(const T* q_task, const T* k, const T* v, const int64_t* seq_slots, int64_t lo, int64_t hi, int64_t Hkv,
            int64_t h, int64_t G, float scale, int64_t stride, Scratch& scratch, float* best_out, float* total) {
    constexpr int V = D / 16;
    float* scores = scratch.scores.data();
    vec16 best[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) best[g] = splat(-INFINITY);
    // pass 1: scores, a chunk at a time (a short last chunk repeats its first row, masked)
    for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
        const int count = static_cast<int>(hi - j0 < kChunk ? hi - j0 : kChunk);
        prefetch_chunk(k, seq_slots, j0 + kChunk, hi, Hkv, h, D);
        const vec16 mask = prefixkv::lane_index() < count ? splat(0.0f) : splat(-INFINITY);
        const T* rowp[kChunk];
        for (int i = 0; i < kChunk; ++i) rowp[i] = k + (seq_slots[j0 + (i < count ? i : 0)] * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
            const QueryRow<T, D> query(q_task + g * D);
            vec16 part[kChunk];
            for (int i = 0; i < kChunk; ++i) part[i] = query.dot(rowp[i]);
            const vec16 s = prefixkv::hsum16(part) * scale + mask;
            storev(scores + g * stride + (j0 - lo), s);
            best[g] = prefixkv::vmax(best[g], s);
        }
    }
    // pass 2: softmax weights (unnormalized), their sums, and the bfloat16 copy where used
    const int64_t n = hi > lo ? hi - lo : 0;
    for (int64_t g = 0; g < G; ++g) {
        float* row = scores + g * stride;
        const float m = prefixkv::hmax(best[g]);
        best_out[g] = m;
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
        if (kBf16Weights) {
            uint16_t* w = scratch.weights.data() + g * stride;
            for (j = 0; j < n; j += 16) store16(w + j, loadv(row + j));
            w[n] = 0;  // the partner of an odd last key (stride > n: always room)
        }
    }
    // pass 3: every V row once, weighted into the G query heads
    vec16* acc = scratch.acc.data();
    for (int64_t i = 0; i < G * V; ++i) acc[i] = splat(0.0f);
    for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
        const int count = static_cast<int>(hi - j0 < kChunk ? hi - j0 : kChunk);
        prefetch_chunk(v, seq_slots, j0 + kChunk, hi, Hkv, h, D);
        const T* rowp[kChunk];
        for (int i = 0; i < kChunk; ++i) rowp[i] = v + (seq_slots[j0 + (i < count ? i : 0)] * Hkv + h) * D;
        const ValueRows<T, D> values(rowp, count);
        for (int64_t g = 0; g < G; ++g)
            values.accumulate(acc + g * V, scores + g * stride + (j0 - lo),
                              kBf16Weights ? scratch.weights.data() + g * stride + (j0 - lo) : nullptr);
    }
    for (int64_t g = 0; g < G; ++g) ValueRows<T, D>::finish(acc + g * V);
}
#endif  // PREFIXKV_VEC8

// A task is one sequence and one KV head with its G query heads (a task for all of a sequence's KV
// heads, reading whole cache rows, was no faster in bfloat16 and 25-30% slower in float32). When
// there are too few tasks to keep the threads busy (one sequence: 3 tasks for the default model),
// each sequence's keys are split into `parts` ranges of whole chunks, attended apart and merged by
// their log-sum-exps, as flash-decoding does on GPUs. The split follows the CPUs this process may
// run on (read once), not the threads of the call: the merge order changes the last bits, and the
// engine runs a step on fewer or more threads under CPU contention (engine/cpu_threads.py) -
// outputs must not depend on that.
constexpr int64_t kMinKeysPerPart = 128;

int64_t split_target() {
    static const int64_t target = [] {
        cpu_set_t set;
        const int64_t cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
        return 2 * (cpus > 1 ? cpus : 1);
    }();
    return target;
}

// One task: attend, then either the final rows (normalized, with their log-sum-exp) or, when the
// keys are split, this part's maximum, sum and unnormalized output for the merge.
template <typename T, int D>
void run_task_typed(int64_t task, const T* q, int64_t q_stride, const T* k, const T* v, const int64_t* slots,
                    const int64_t* lens, T* out, float* lse, int64_t L, int64_t Hkv, int64_t G, float scale,
                    int64_t parts, int64_t span, int64_t stride, Scratch& scratch, float* part_best, float* part_total,
                    float* part_acc) {
    constexpr int V = D / 16;
    float best[kMaxGroup], total[kMaxGroup];
    const int64_t head = task / parts, p = task % parts;
    const int64_t b = head / Hkv, h = head % Hkv, n = lens[b];
    const int64_t lo = p * span < n ? p * span : n, hi = lo + span < n ? lo + span : n;
    attend<T, D>(q + b * q_stride + h * G * D, k, v, slots + b * L, lo, hi, Hkv, h, G, scale, stride, scratch, best,
                 total);
    const vec16* acc = scratch.acc.data();
    for (int64_t g = 0; g < G; ++g) {
        if (parts > 1) {
            const int64_t row = task * G + g;
            part_best[row] = best[g];
            part_total[row] = total[g];
            for (int c = 0; c < V; ++c) storev(part_acc + row * D + 16 * c, acc[g * V + c]);
            continue;
        }
        // an empty context (n == 0) gives zeros and a log-sum-exp of -inf: it merges as nothing
        const float inv = n > 0 ? 1.0f / total[g] : 0.0f;
        T* orow = out + (head * G + g) * D;
        for (int c = 0; c < V; ++c) store16(orow + 16 * c, acc[g * V + c] * inv);
        if (lse != nullptr) lse[head * G + g] = n > 0 ? best[g] + logf(total[g]) : -INFINITY;
    }
}

// One query row of a split call: its parts merged by their log-sum-exps.
template <typename T, int D>
void merge_row_typed(int64_t row, int64_t parts, int64_t G, const float* part_best, const float* part_total,
                     const float* part_acc, T* out, float* lse) {
    constexpr int V = D / 16;
    const int64_t head = row / G, g = row % G;
    float m = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, part_best[(head * parts + p) * G + g]);
    float sum = 0.0f;
    vec16 o[V];
    for (int c = 0; c < V; ++c) o[c] = splat(0.0f);
    for (int64_t p = 0; p < parts; ++p) {
        const int64_t r = (head * parts + p) * G + g;
        if (part_total[r] == 0.0f) continue;  // an empty part
        const float f = expf(part_best[r] - m);
        sum += part_total[r] * f;
        for (int c = 0; c < V; ++c) o[c] += loadv(part_acc + r * D + 16 * c) * f;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* orow = out + row * D;
    for (int c = 0; c < V; ++c) store16(orow + 16 * c, o[c] * inv);
    if (lse != nullptr) lse[row] = sum > 0.0f ? m + logf(sum) : -INFINITY;
}

}  // namespace

prefixkv::DecodeAttention::DecodeAttention(int dtype, int64_t D, const void* q, int64_t q_stride,
                                           const int64_t* slots, const int64_t* lens, void* out, float* lse, int64_t B,
                                           int64_t L, int64_t Hkv, int64_t G, float scale)
    : dtype_(dtype), D_(D), q_(q), q_stride_(q_stride), slots_(slots), lens_(lens), out_(out), lse_(lse), B_(B),
      L_(L), Hkv_(Hkv), G_(G), scale_(scale) {
    supported_ = (dtype == 0 || dtype == 1) && (D == 32 || D == 64 || D == 128) && G >= 1 && G <= kMaxGroup &&
                 B >= 0 && L >= 1 && Hkv >= 1;
    if (!supported_) return;
    const int64_t heads = B * Hkv;
    const int64_t target = split_target();
    if (heads < target) {
        parts_ = (target + heads - 1) / heads;
        const int64_t most = L / kMinKeysPerPart;
        parts_ = parts_ < most ? parts_ : (most > 1 ? most : 1);
    }
    const int64_t chunks_per_part = (L + kChunk * parts_ - 1) / (kChunk * parts_);
    span_ = chunks_per_part * kChunk;              // keys per part
    stride_ = (span_ / kChunk + 1) * kChunk;       // whole chunks and one more key a score row
    if (parts_ > 1) {
        part_best_.resize(static_cast<size_t>(heads * parts_ * G));
        part_total_.resize(part_best_.size());
        part_acc_.resize(part_best_.size() * D);
    }
}

void prefixkv::DecodeAttention::make_scratch(DecodeScratch& scratch) const {
    scratch.scores.assign(static_cast<size_t>(G_ * stride_), 0.0f);
    scratch.weights.assign(kBf16Weights ? static_cast<size_t>(G_ * stride_) : 0, 0);
    scratch.acc.assign(static_cast<size_t>(G_ * (D_ / 16)), vec16{});
}

namespace {

// f(T{}, std::integral_constant<int, D>{}) for the call's dtype and head dim (checked supported)
template <typename F>
void with_types(int dtype, int64_t D, F f) {
    const auto head_dim = [&](auto t) {
        if (D == 32) f(t, std::integral_constant<int, 32>{});
        if (D == 64) f(t, std::integral_constant<int, 64>{});
        if (D == 128) f(t, std::integral_constant<int, 128>{});
    };
    if (dtype == 0)
        head_dim(float{});
    else
        head_dim(uint16_t{});
}

}  // namespace

void prefixkv::DecodeAttention::run_task(int64_t task, const void* k, const void* v, DecodeScratch& scratch) {
    with_types(dtype_, D_, [&](auto t, auto dim) {
        using T = decltype(t);
        run_task_typed<T, decltype(dim)::value>(task, static_cast<const T*>(q_), q_stride_, static_cast<const T*>(k),
                                                static_cast<const T*>(v), slots_, lens_, static_cast<T*>(out_), lse_, L_,
                                                Hkv_, G_, scale_, parts_, span_, stride_, scratch, part_best_.data(),
                                                part_total_.data(), part_acc_.data());
    });
}

void prefixkv::DecodeAttention::merge_row(int64_t row) {
    with_types(dtype_, D_, [&](auto t, auto dim) {
        using T = decltype(t);
        merge_row_typed<T, decltype(dim)::value>(row, parts_, G_, part_best_.data(), part_total_.data(),
                                                 part_acc_.data(), static_cast<T*>(out_), lse_);
    });
}

// dtype 0: float32, 1: bfloat16. Returns 0, or non-zero for a shape it does not handle
// (the caller then takes the PyTorch path).
extern "C" int prefixkv_decode_attention(int dtype, int64_t D, const void* q, const void* k, const void* v,
                                         const int64_t* slots, const int64_t* lens, void* out, float* lse, int64_t B,
                                         int64_t L, int64_t Hkv, int64_t G, float scale, int num_threads) {
    if (G < 1 || G > kMaxGroup || B < 0 || L < 1 || Hkv < 1 || num_threads < 1) return 1;
    if (dtype != 0 && dtype != 1) return 3;
    if (D != 32 && D != 64 && D != 128) return 2;
    prefixkv::DecodeAttention call(dtype, D, q, Hkv * G * D, slots, lens, out, lse, B, L, Hkv, G, scale);
    const int64_t tasks = call.tasks(), merge_rows = call.merge_rows();
#pragma omp parallel num_threads(num_threads)
    {
        prefixkv::DecodeScratch scratch;
        call.make_scratch(scratch);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) call.run_task(task, k, v, scratch);
        // (the omp for above ends with a barrier: every part is done before the merge)
#pragma omp for schedule(static)
        for (int64_t row = 0; row < merge_rows; ++row) call.merge_row(row);
    }
    return 0;
}
