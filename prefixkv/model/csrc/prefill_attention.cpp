// Causal prefill attention for the CPU over the paged cache: the new tokens of each sequence (a
// whole prompt, or a chunk after cached context) attend to their context read in place through its
// slot list. PyTorch's path gathers a chunk's context first and runs its flash kernel, which on
// this machine's two cores reaches ~105 GFLOP/s in float32 and ~140 in bfloat16 at the default
// model's shapes (docs/benchmarks.md): 17% of a float32 and a third of a bfloat16 prefill.
//
// The work is split into items of (sequence, KV head, tile of query positions); the rows of an
// item are its positions x the G query heads sharing that KV head (GQA), so every K/V tile loaded
// serves G x positions rows. Per item, keys go by tiles of kKeyTile: the tile is packed once into
// float32 (K transposed, V as is), then for every group of R rows
//   scores = Q K^T      (register-blocked: R rows x 64 keys of accumulators)
//   online softmax      (running maximum and sum per row, the output rescaled when the max grows)
//   out   += P V        (R rows x 64 columns of accumulators)
// Vectors are GCC/Clang vector extensions, so the same source compiles to AVX-512, AVX2 or NEON.
// Everything is computed in float32 for float32 and bfloat16 (scores, softmax, the weighted sum),
// except where the CPU multiplies bfloat16 itself (the tile unit, block_amx, or the vector
// dot-product instruction, block_dot): there the products take bfloat16 operands and the softmax
// weights are rounded to bfloat16 before the second one.
//
// A row's arithmetic depends only on its own query, its keys and where the key tiles start (always
// at the first key read), never on which other rows share its item: how the rows are grouped does
// not change a single bit of the result.
//
// Layout (all contiguous):
//   q     [T, Hkv, G, D]   the step's query rows (token-major; a KV head's G query heads adjacent);
//                          rows q_stride elements apart (q may be a view into the fused q/k/v)
//   k, v  [slots, Hkv, D]  one layer's cache, flattened over blocks and offsets
//   seqs  [S, 4] int64     per sequence: first query row, new tokens n, keys read kv (the last n of
//                          them are the new tokens' own), offset of its first slot in `slots`
//   slots int64            the slots of each sequence's kv keys, one run per sequence
//   out   [T, Hkv, G, D]   only the sequences' rows are written
//   lse   [T, Hkv, G] float32, or null: log-sum-exp of each row's scaled scores (for merging)
#include "target.h"  // first: what the file compiles for

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "vec16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using prefixkv::exp_nonpositive;
using prefixkv::hreduce;
using prefixkv::lane_index;
using prefixkv::load;
using prefixkv::loadv;
using prefixkv::splat;
using prefixkv::store;
using prefixkv::storev;
using prefixkv::vec16;
using prefixkv::vmax;

constexpr int kKeyTile = 64;     // keys per tile: 4 vectors of scores per row
constexpr int kRowTarget = 48;   // rows (positions x G) per work item
constexpr int kRowBlock = 6;     // rows per register block: 6 x 4 accumulators of 16 floats
constexpr int kMaxGroup = 16;

// scores[r][0:16C] = q[r] . kt[:, 0:16C] for R rows (q pre-scaled); kt is [D][kKeyTile]. C < 4
// where no row of the block sees past key 16C of the tile (the causal diagonal): each key's score
// is its own dot product, so leaving the others out changes no bit of those computed.
template <int R, int D, int C>
inline void score_block(const float* q, const float* kt, float* scores) {
#if defined(PREFIXKV_VEC8)
    // AVX2: 16 AVX2 registers hold R x 2 accumulators (one group of 16 keys) at a time, not R x C x 2;
    // every lane still sums its products over d in the same order
    using prefixkv::load8;
    using prefixkv::splat8;
    using prefixkv::store8;
    using prefixkv::vec8;
    for (int c = 0; c < C; ++c) {
        vec8 acc[R][2];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vec8{};
        for (int d = 0; d < D; ++d) {
            const vec8 k0 = load8(kt + d * kKeyTile + 16 * c), k1 = load8(kt + d * kKeyTile + 16 * c + 8);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const vec8 x = splat8(q[r * D + d]);
                acc[r][0] += x * k0;
                acc[r][1] += x * k1;
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            store8(scores + r * kKeyTile + c * 16, acc[r][0]);
            store8(scores + r * kKeyTile + c * 16 + 8, acc[r][1]);
        }
    }
#else
    vec16 acc[R][C];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = vec16{};
    for (int d = 0; d < D; ++d) {
        vec16 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = loadv(kt + d * kKeyTile + 16 * c);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const float x = q[r * D + d];
            for (int c = 0; c < C; ++c) acc[r][c] += x * kv[c];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) storev(scores + r * kKeyTile + c * 16, acc[r][c]);
#endif
}

// out[r][cols] = out[r][cols] * alpha[r] + p[r][0:nk] . v[0:nk][cols] for R rows and NV x 16
// columns starting at `col`; v is [kKeyTile][D].
template <int R, int NV, int D>
inline void weigh_block(const float* p, const float* v, int nk, const float* alpha, float* out, int col) {
#if defined(PREFIXKV_VEC8)
    // AVX2: one group of 16 columns at a time (R x 2 accumulators), as in score_block
    using prefixkv::load8;
    using prefixkv::splat8;
    using prefixkv::store8;
    using prefixkv::vec8;
    for (int c = 0; c < NV; ++c) {
        float* o = out + col + c * 16;
        vec8 acc[R][2];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const vec8 a = splat8(alpha[r]);
            acc[r][0] = load8(o + r * D) * a;
            acc[r][1] = load8(o + r * D + 8) * a;
        }
        for (int j = 0; j < nk; ++j) {
            const vec8 v0 = load8(v + j * D + col + c * 16), v1 = load8(v + j * D + col + c * 16 + 8);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const vec8 x = splat8(p[r * kKeyTile + j]);
                acc[r][0] += x * v0;
                acc[r][1] += x * v1;
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            store8(o + r * D, acc[r][0]);
            store8(o + r * D + 8, acc[r][1]);
        }
    }
#else
    vec16 acc[R][NV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = loadv(out + r * D + col + c * 16) * alpha[r];
    for (int j = 0; j < nk; ++j) {
        vec16 vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = loadv(v + j * D + col + c * 16);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const float x = p[r * kKeyTile + j];
            for (int c = 0; c < NV; ++c) acc[r][c] += x * vv[c];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) storev(out + r * D + col + c * 16, acc[r][c]);
#endif
}

// The online softmax of R rows of scores (in place: scores * scale become unnormalized weights)
// and the factor alpha[r] each row's output must be rescaled by. visible[r]: the keys of the tile
// row r may see (0..nk); a row with none gets weights 0 and alpha 1 (its output is left as it is).
// Scaled false: the scores are scaled already (float32 queries are pre-scaled), scale is not read.
// Rows go by groups of 8: first every row's maximum, then every row's weights and their sum, each
// reduced across rows at once (hreduce, vec16.h).
template <int R, bool Scaled = true>
inline void online_softmax(float* scores, const int* visible, float scale, float* best, float* total, float* alpha) {
#if defined(PREFIXKV_VEC8)
    // AVX2: row by row in AVX2 registers (the vec16 version below goes through the stack there);
    // each row's maximum and sum reduced alone, so the grouping of rows changes no bit either
    using prefixkv::exp_nonpositive8;
    using prefixkv::lane_index8;
    using prefixkv::load8;
    using prefixkv::splat8;
    using prefixkv::store8;
    using prefixkv::vec8;
    using prefixkv::vmax8;
    for (int r = 0; r < R; ++r) {
        float* s = scores + r * kKeyTile;
        const int n = visible[r];
        if (n == 0) {  // a tile wholly in this row's future: weights 0, the output kept as it is
            for (int c = 0; c < kKeyTile / 8; ++c) store8(s + 8 * c, vec8{});
            alpha[r] = 1.0f;
            continue;
        }
        const int nv = (n + 7) / 8;
        auto visible_scores = [&](int c) {
            vec8 x = load8(s + 8 * c);
            if constexpr (Scaled) x *= scale;
            return n < kKeyTile ? (lane_index8() + 8 * c < n ? x : splat8(-INFINITY)) : x;
        };
        vec8 top = splat8(-INFINITY);
        for (int c = 0; c < nv; ++c) top = vmax8(top, visible_scores(c));
        const bool first = best[r] == -INFINITY;
        const float m = std::max(best[r], prefixkv::hmax8(top));
        vec8 sum = vec8{};
        for (int c = 0; c < nv; ++c) {
            vec8 e = exp_nonpositive8(visible_scores(c) - m);
            if (n < kKeyTile) e = lane_index8() + 8 * c < n ? e : vec8{};
            store8(s + 8 * c, e);
            sum += e;
        }
        for (int c = nv; c < kKeyTile / 8; ++c) store8(s + 8 * c, vec8{});
        alpha[r] = first ? 0.0f : prefixkv::exp_nonpositive(best[r] - m);  // out and total are 0 before
        best[r] = m;
        total[r] = total[r] * alpha[r] + prefixkv::hsum8(sum);
    }
#else
    static_assert(R <= 16, "the rescaling factors are computed as one vector");
    float shift[16] = {}, sums[16] = {};  // per row: old maximum - new one (<= 0), the new weights' sum
    bool first[16] = {};                  // the first tile the row sees: nothing to rescale
    // keys at or past n are masked: -inf for the maximum, weight 0 (a full tile needs no mask); only
    // the vectors holding a visible key are read (the others' lanes would be -inf for the maximum
    // and weight 0, and adding +0 to the sum keeps its bits)
    auto visible_scores = [&](int r, int c) {
        vec16 x = loadv(scores + r * kKeyTile + 16 * c);
        if constexpr (Scaled) x *= scale;
        const int n = visible[r];
        return n < kKeyTile ? (lane_index() + 16 * c < n ? x : splat(-INFINITY)) : x;
    };
    for (int g = 0; g < R; g += 8) {
        const int rows = std::min(8, R - g);
        vec16 part[8];
        for (int i = 0; i < 8; ++i) {
            const int r = g + i;
            part[i] = splat(-INFINITY);
            if (i >= rows) continue;
            for (int c = 0; c < (visible[r] + 15) / 16; ++c) part[i] = vmax(part[i], visible_scores(r, c));
        }
        const vec16 maxima = hreduce(part, [](vec16 a, vec16 b) { return vmax(a, b); });
        for (int i = 0; i < 8; ++i) {
            const int r = g + i;
            part[i] = vec16{};
            if (i >= rows) continue;
            float* s = scores + r * kKeyTile;
            const int n = visible[r];
            if (n == 0) {  // a tile wholly in this row's future: shift 0 gives alpha exactly 1
                for (int c = 0; c < 4; ++c) storev(s + 16 * c, vec16{});
                continue;
            }
            const float m = std::max(best[r], maxima[i]);
            first[r] = best[r] == -INFINITY;
            shift[r] = first[r] ? 0.0f : best[r] - m;
            best[r] = m;
            const int nv = (n + 15) / 16;
            for (int c = 0; c < nv; ++c) {
                vec16 e = exp_nonpositive(visible_scores(r, c) - m);
                if (n < kKeyTile) e = lane_index() + 16 * c < n ? e : vec16{};
                storev(s + 16 * c, e);
                part[i] += e;
            }
            for (int c = nv; c < 4; ++c) storev(s + 16 * c, vec16{});
        }
        const vec16 row_sums = hreduce(part, [](vec16 a, vec16 b) { return a + b; });
        for (int i = 0; i < rows; ++i) sums[g + i] = row_sums[i];
    }
    // every row's rescaling factor in one vector exponential (one per row cost as much as a tile's)
    const vec16 factors = exp_nonpositive(loadv(shift));
    for (int r = 0; r < R; ++r) {
        alpha[r] = first[r] ? 0.0f : factors[r];  // out and total are 0 before a row's first tile
        total[r] = total[r] * alpha[r] + sums[r];
    }
#endif
}

// One register block of R rows against one key tile in float32: scores, online softmax, weighted
// sum. q: R rows of D floats, pre-scaled; kt [D][kKeyTile]; v [kKeyTile][D].
// Only the keys some row of the block sees are multiplied (`reach`, at most the tile's keys): on
// the causal diagonal the rest have weight exactly 0 for every row of the block, and an
// accumulator that starts at +0 and adds a product of +0 keeps its bits, so the result is the
// same bit for bit.
template <int R, int D>
inline void block_against_tile(const float* q, const float* kt, const float* v, const int* visible,
                               float* scores, float* best, float* total, float* out) {
    int reach = 0;
    for (int r = 0; r < R; ++r) reach = std::max(reach, visible[r]);
    switch ((reach + 15) / 16) {  // scores past `reach` are masked by the softmax, whatever they hold
        case 1: score_block<R, D, 1>(q, kt, scores); break;
        case 2: score_block<R, D, 2>(q, kt, scores); break;
        case 3: score_block<R, D, 3>(q, kt, scores); break;
        default: score_block<R, D, 4>(q, kt, scores); break;
    }
    float alpha[R];
    online_softmax<R, false>(scores, visible, 1.0f, best, total, alpha);
    for (int col = 0; col < D; col += 64) {
        if constexpr (D >= 64)
            weigh_block<R, 4, D>(scores, v, reach, alpha, out, col);
        else
            weigh_block<R, D / 16, D>(scores, v, reach, alpha, out, col);
    }
}

template <int D>
void block_dispatch(int rows, const float* q, const float* kt, const float* v, const int* visible,
                    float* scores, float* best, float* total, float* out) {
    switch (rows) {
        case 6: block_against_tile<6, D>(q, kt, v, visible, scores, best, total, out); break;
        case 5: block_against_tile<5, D>(q, kt, v, visible, scores, best, total, out); break;
        case 4: block_against_tile<4, D>(q, kt, v, visible, scores, best, total, out); break;
        case 3: block_against_tile<3, D>(q, kt, v, visible, scores, best, total, out); break;
        case 2: block_against_tile<2, D>(q, kt, v, visible, scores, best, total, out); break;
        default: block_against_tile<1, D>(q, kt, v, visible, scores, best, total, out); break;
    }
}

#if defined(__AVX512BF16__)
// For the bfloat16 blocks (block_amx, block_dot): the online softmax of 16 rows of scores, then the
// weights rounded to bfloat16 (nearest even), keys in order, for the second product.
inline void softmax_to_bf16_weights(float* scores, const int* visible, float scale, float* best, float* total,
                                    float* alpha, uint16_t* weights) {
    online_softmax<16>(scores, visible, scale, best, total, alpha);
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 4; c += 2) {
            const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(scores + r * kKeyTile + (c + 1) * 16),
                                                      _mm512_loadu_ps(scores + r * kKeyTile + c * 16));
            _mm512_storeu_si512(weights + r * kKeyTile + c * 16, reinterpret_cast<const __m512i&>(pair));
        }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// bfloat16 on a CPU with AMX: both products on the tile unit (16 x 32 by 32 x 16 bfloat16 products
// accumulated in float32 per instruction), blocks of 16 rows; the softmax stays float32 on vectors
// and its weights are rounded to bfloat16 for the second product, as PyTorch's flash kernel does.
// Tiles: 0-3 accumulators (16 x 16 float32 each: 64 keys, or 64 output columns), 4 the left
// operand (16 rows x 32 bfloat16), 5-7 the right one. The key tile is packed in pairs along D
// (kp [D/2][kKeyTile][2]) and the value tile in pairs of keys (vp [kKeyTile/2][D][2]): the
// pair-interleaved layout the tile unit's right operand takes.
constexpr bool kAmxBuilt = true;
constexpr int kAmxRows = 16;

// Linux hands out the tile registers' state only on request, once per process.
bool amx_permitted() {
    static const bool ok = [] {
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
}

struct alignas(64) TileConfig {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

void amx_configure() {
    TileConfig config{};
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = kAmxRows;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

// Tiles 0-3 += A (tile 4, loaded from a) times the four 16-column blocks of b (row stride b_stride
// bytes, blocks 32 bfloat16 apart).
inline void amx_row_of_four(const uint16_t* a, int a_stride, const uint16_t* b, int b_stride) {
    _tile_loadd(4, a, a_stride);
    _tile_loadd(5, b, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, b_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 64, b_stride);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, b_stride);
    _tile_dpbf16ps(3, 4, 5);
}

inline void amx_release() { _tile_release(); }

inline void amx_zero_four() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

inline void amx_store_four(float* c, int stride) {
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    _tile_stored(2, c + 32, stride);
    _tile_stored(3, c + 48, stride);
}

// 16 rows (q bfloat16 [16][D], unscaled) against one packed key tile.
template <int D>
inline void block_amx(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, int nk, const int* visible,
                      float scale, float* scores, uint16_t* weights, float* partial, float* best, float* total,
                      float* out) {
    amx_zero_four();
    for (int step = 0; step < D / 32; ++step)  // 32 of D per step: 16 pairs of the packed keys
        amx_row_of_four(q + step * 32, D * 2, kp + step * 16 * 2 * kKeyTile, 2 * kKeyTile * 2);
    amx_store_four(scores, kKeyTile * 4);
    float alpha[kAmxRows];
    softmax_to_bf16_weights(scores, visible, scale, best, total, alpha, weights);
    for (int col = 0; col < D; col += 64) {
        amx_zero_four();
        for (int step = 0; step < (nk + 31) / 32; ++step)  // 32 keys per step (past nk: weights 0, values 0)
            amx_row_of_four(weights + step * 32, kKeyTile * 2, vp + step * 16 * 2 * D + col * 2, 2 * D * 2);
        amx_store_four(partial + col, D * 4);
    }
    for (int r = 0; r < kAmxRows; ++r) {
        const vec16 a = splat(alpha[r]);
        for (int c = 0; c < D / 16; ++c)
            storev(out + r * D + c * 16, loadv(out + r * D + c * 16) * a + loadv(partial + r * D + c * 16));
    }
}
#else
constexpr bool kAmxBuilt = false;
constexpr int kAmxRows = 16;
inline bool amx_permitted() { return false; }
inline void amx_configure() {}
template <int D>
inline void block_amx(const uint16_t*, const uint16_t*, const uint16_t*, int, const int*, float, float*, uint16_t*,
                      float*, float*, float*, float*) {}
inline void amx_release() {}
#endif

#if defined(__AVX512BF16__)
// bfloat16 on a CPU with AVX512-BF16 but no AMX (AMD Zen 4, Intel Cooper Lake): both products with
// the vector dot-product instruction (vdpbf16ps: per float32 lane, two bfloat16 products added to
// the accumulator, so a 64-byte load covers two of D or two keys), on the tile unit's packed
// layouts, 16 rows a block; like the tile unit, the softmax weights are rounded to bfloat16 for the
// second product (as PyTorch's flash kernel does). Twice the multiply-adds per instruction of the
// float32 path: 1.8 -> 1.0 ms a layer at 478 tokens on Zen 4 (bench/prefill_attention.py).
constexpr bool kDotBuilt = true;
constexpr int kDotRows = 4;  // rows per register block: 4 x 4 accumulators

template <int D>
inline void block_dot(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, int nk, const int* visible,
                      float scale, float* scores, uint16_t* weights, float* best, float* total, float* out) {
    for (int r0 = 0; r0 < kAmxRows; r0 += kDotRows) {  // scores = Q K^T, 4 rows x 64 keys at a time
        __m512 acc[kDotRows][4];
        for (int r = 0; r < kDotRows; ++r)
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; ++p) {
            __m512bh kv[4];
            for (int c = 0; c < 4; ++c)
                kv[c] = (__m512bh)_mm512_loadu_si512(kp + p * 2 * kKeyTile + c * 32);
            for (int r = 0; r < kDotRows; ++r) {
                int32_t pair;
                memcpy(&pair, q + (r0 + r) * D + 2 * p, sizeof pair);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kv[c], x);
            }
        }
        for (int r = 0; r < kDotRows; ++r)
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(scores + (r0 + r) * kKeyTile + c * 16, acc[r][c]);
    }
    float alpha[kAmxRows];
    softmax_to_bf16_weights(scores, visible, scale, best, total, alpha, weights);
    constexpr int NV = D < 64 ? D / 16 : 4;  // output columns per pass: NV vectors of 16
    const int key_pairs = (nk + 1) / 2;      // past nk: weights 0, values 0
    for (int r0 = 0; r0 < kAmxRows; r0 += kDotRows) {  // out = out * alpha + P V
        for (int col = 0; col < D; col += NV * 16) {
            __m512 acc[kDotRows][NV];
            for (int r = 0; r < kDotRows; ++r)
                for (int c = 0; c < NV; ++c)
                    acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + (r0 + r) * D + col + c * 16),
                                              _mm512_set1_ps(alpha[r0 + r]));
            for (int p = 0; p < key_pairs; ++p) {
                __m512bh vv[NV];
                for (int c = 0; c < NV; ++c)
                    vv[c] = (__m512bh)_mm512_loadu_si512(vp + p * 2 * D + (col + c * 16) * 2);
                for (int r = 0; r < kDotRows; ++r) {
                    int32_t pair;
                    memcpy(&pair, weights + (r0 + r) * kKeyTile + 2 * p, sizeof pair);
                    const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], x);
                }
            }
            for (int r = 0; r < kDotRows; ++r)
                for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + (r0 + r) * D + col + c * 16, acc[r][c]);
        }
    }
}
#else
constexpr bool kDotBuilt = false;
template <int D>
inline void block_dot(const uint16_t*, const uint16_t*, const uint16_t*, int, const int*, float, float*, uint16_t*,
                      float*, float*, float*) {}
#endif

struct Item {
    int64_t seq, head, first, count;  // query positions first..first+count-1 of the sequence's new tokens
    int64_t work;                     // keys x rows, for ordering the biggest first
};

template <typename T, int D>
void prefill(const T* q, int64_t q_stride, const T* k, const T* v, const int64_t* seqs, const int64_t* slots, T* out,
             float* lse, int64_t S, int64_t Hkv, int64_t G, float scale, int num_threads) {
    const int64_t positions_per_item = std::max<int64_t>(1, kRowTarget / G);
    std::vector<Item> items;
    for (int64_t s = 0; s < S; ++s) {
        const int64_t n = seqs[s * 4 + 1], kv = seqs[s * 4 + 2];
        for (int64_t first = 0; first < n; first += positions_per_item) {
            const int64_t count = std::min(positions_per_item, n - first);
            const int64_t keys = kv - n + first + count;  // keys its last position sees
            for (int64_t h = 0; h < Hkv; ++h) items.push_back({s, h, first, count, keys * count});
        }
    }
    // biggest first, so that the dynamic schedule ends with small items (causal: later tiles see more)
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.work > b.work; });
    const int64_t Hq = Hkv * G;
    // bfloat16 on the tile unit where there is one, else on the vector dot-product instruction
    // where there is that: both in blocks of 16 rows (an item's rows padded to 16) on bfloat16 tiles
    // packed in pairs ("paired")
    const bool amx = std::is_same_v<T, uint16_t> && kAmxBuilt && D >= 64 && amx_permitted();
    const bool dot = std::is_same_v<T, uint16_t> && !amx && kDotBuilt && D % 32 == 0;
    const bool paired = amx || dot;
    const int64_t row_block = paired ? kAmxRows : kRowBlock;
    const int64_t max_rows = (positions_per_item * G + row_block - 1) / row_block * row_block;
    const int64_t num_items = static_cast<int64_t>(items.size());
    // Every sequence's keys, packed once in float32 and shared by all items: per KV head, tiles of
    // K transposed ([D][kKeyTile]) and V ([kKeyTile][D]), the last tile padded with zeros. Packing
    // per item instead cost as much as the arithmetic (each key is read by every later item).
    std::vector<int64_t> packed_at(static_cast<size_t>(S) + 1, 0);
    struct Tile {
        int64_t seq, head, tile;
    };
    std::vector<Tile> tiles;
    for (int64_t s = 0; s < S; ++s) {
        const int64_t num_tiles = (seqs[s * 4 + 2] + kKeyTile - 1) / kKeyTile;
        packed_at[s + 1] = packed_at[s] + Hkv * num_tiles * 2 * kKeyTile * D;
        for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t t = 0; t < num_tiles; ++t) tiles.push_back({s, h, t});
    }
    float* packed = static_cast<float*>(aligned_alloc(64, sizeof(float) * static_cast<size_t>(packed_at[S] + 16)));
    if (packed == nullptr) return;
    const int64_t num_tiles_all = static_cast<int64_t>(tiles.size());

#pragma omp parallel num_threads(num_threads) if (num_items > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles_all; ++t) {
            const Tile& tile = tiles[static_cast<size_t>(t)];
            const int64_t kv = seqs[tile.seq * 4 + 2];
            const int64_t* seq_slots = slots + seqs[tile.seq * 4 + 3];
            const int64_t num_tiles = (kv + kKeyTile - 1) / kKeyTile;
            float* kt = packed + packed_at[tile.seq] + (tile.head * num_tiles + tile.tile) * 2 * kKeyTile * D;
            float* vt = kt + kKeyTile * D;
            const int64_t j0 = tile.tile * kKeyTile;
            const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, kv - j0));
            if (paired) {  // bfloat16 kept, in pairs (block_amx, block_dot); zeros past nk
                uint16_t* kp = reinterpret_cast<uint16_t*>(kt);
                uint16_t* vp = reinterpret_cast<uint16_t*>(vt);
                for (int j = 0; j < kKeyTile; ++j) {
                    const int64_t base = j < nk ? (seq_slots[j0 + j] * Hkv + tile.head) * D : 0;
                    const uint16_t* kr = reinterpret_cast<const uint16_t*>(k) + base;
                    const uint16_t* vr = reinterpret_cast<const uint16_t*>(v) + base;
                    for (int d = 0; d < D; ++d) {
                        kp[(d / 2) * 2 * kKeyTile + j * 2 + (d & 1)] = j < nk ? kr[d] : 0;
                        vp[(j / 2) * 2 * D + d * 2 + (j & 1)] = j < nk ? vr[d] : 0;
                    }
                }
                continue;
            }
            // V row by row; K transposed column by column, so that the stores run along a row of
            // kt (storing each key's D values kKeyTile floats apart: ~3% slower at 478 tokens)
            int64_t base[kKeyTile];
            for (int j = 0; j < nk; ++j) {
                base[j] = (seq_slots[j0 + j] * Hkv + tile.head) * D;
                for (int d = 0; d < D; ++d) vt[j * D + d] = load(v, base[j] + d);
            }
            for (int d = 0; d < D; ++d)
                for (int j = 0; j < nk; ++j) kt[d * kKeyTile + j] = load(k, base[j] + d);
            for (int j = nk; j < kKeyTile; ++j)
                for (int d = 0; d < D; ++d) kt[d * kKeyTile + j] = vt[j * D + d] = 0.0f;
        }
        // per thread: the item's queries (float32 pre-scaled, or bfloat16 for the tile unit) and
        // outputs, scores, their bfloat16 weights, one block's partial output
        float* buffer = static_cast<float*>(aligned_alloc(
            64, sizeof(float) * static_cast<size_t>(2 * max_rows * D + max_rows * kKeyTile + max_rows * D / 2 +
                                                    max_rows * kKeyTile / 2 + kAmxRows * D + 2 * max_rows + 64)));
        float* qf = buffer;
        float* of = qf + max_rows * D;
        float* scores = of + max_rows * D;
        uint16_t* qb = reinterpret_cast<uint16_t*>(scores + max_rows * kKeyTile);
        uint16_t* weights = qb + max_rows * D;
        float* partial = reinterpret_cast<float*>(weights + max_rows * kKeyTile);
        float* best = partial + kAmxRows * D;
        float* total = best + max_rows;
        if (amx) amx_configure();
        std::vector<int> limit(static_cast<size_t>(max_rows));
        std::vector<int> visible(static_cast<size_t>(max_rows));

#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; ++it) {
            const Item& item = items[static_cast<size_t>(it)];
            const int64_t row0 = seqs[item.seq * 4], n = seqs[item.seq * 4 + 1], kv = seqs[item.seq * 4 + 2];
            const int64_t h = item.head;
            const int64_t num_tiles = (kv + kKeyTile - 1) / kKeyTile;
            const float* seq_packed = packed + packed_at[item.seq] + h * num_tiles * 2 * kKeyTile * D;
            const int rows = static_cast<int>(item.count * G);
            const int padded_rows = static_cast<int>((rows + row_block - 1) / row_block * row_block);
            if (paired) {  // padding rows: zero queries that see no key
                memset(qb + rows * D, 0, sizeof(uint16_t) * (padded_rows - rows) * D);
                for (int r = rows; r < padded_rows; ++r) limit[r] = 0;
            }
            for (int64_t i = 0; i < item.count; ++i) {
                const int64_t pos = item.first + i;
                const int64_t keys = kv - n + pos + 1;  // causal: its own key and those before it
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t r = i * G + g;
                    const T* qr = q + (row0 + pos) * q_stride + (h * G + g) * D;
                    if (paired)
                        memcpy(qb + r * D, qr, sizeof(uint16_t) * D);  // scaled in the softmax
                    else
                        for (int d = 0; d < D; ++d) qf[r * D + d] = load(qr, d) * scale;
                    limit[r] = static_cast<int>(keys);
                }
            }
            for (int64_t r = 0; r < padded_rows; ++r) {
                best[r] = -INFINITY;
                total[r] = 0.0f;
            }
            memset(of, 0, sizeof(float) * padded_rows * D);
            const int64_t last_keys = limit[rows - 1];
            for (int64_t j0 = 0; j0 < last_keys; j0 += kKeyTile) {
                const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, last_keys - j0));
                const float* kt = seq_packed + (j0 / kKeyTile) * 2 * kKeyTile * D;
                const float* vt = kt + kKeyTile * D;
                for (int r0 = 0; r0 < rows; r0 += static_cast<int>(row_block)) {
                    const int block = std::min(static_cast<int>(row_block), padded_rows - r0);
                    bool any = false;
                    for (int r = 0; r < block; ++r) {
                        const int64_t seen = limit[r0 + r] - j0;
                        visible[r0 + r] = static_cast<int>(seen <= 0 ? 0 : (seen < nk ? seen : nk));
                        any |= visible[r0 + r] > 0;
                    }
                    if (!any) continue;
                    if (amx) {
                        block_amx<D>(qb + r0 * D, reinterpret_cast<const uint16_t*>(kt),
                                     reinterpret_cast<const uint16_t*>(vt), nk, visible.data() + r0, scale,
                                     scores + r0 * kKeyTile, weights + r0 * kKeyTile, partial, best + r0, total + r0,
                                     of + r0 * D);
                        continue;
                    }
                    if (dot) {
                        block_dot<D>(qb + r0 * D, reinterpret_cast<const uint16_t*>(kt),
                                     reinterpret_cast<const uint16_t*>(vt), nk, visible.data() + r0, scale,
                                     scores + r0 * kKeyTile, weights + r0 * kKeyTile, best + r0, total + r0,
                                     of + r0 * D);
                        continue;
                    }
                    block_dispatch<D>(block, qf + r0 * D, kt, vt, visible.data() + r0, scores + r0 * kKeyTile,
                                      best + r0, total + r0, of + r0 * D);
                }
            }
            for (int64_t i = 0; i < item.count; ++i) {
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t r = i * G + g;
                    const int64_t at = (row0 + item.first + i) * Hq + h * G + g;
                    const float inv = 1.0f / total[r];  // every row sees at least its own key
                    for (int d = 0; d < D; ++d) store(out, at * D + d, of[r * D + d] * inv);
                    if (lse != nullptr) lse[at] = best[r] + logf(total[r]);
                }
            }
        }
        if (amx) amx_release();
        free(buffer);
    }
    free(packed);
}

template <typename T>
int dispatch_head_dim(int64_t D, const void* q, int64_t q_stride, const void* k, const void* v, const int64_t* seqs,
                      const int64_t* slots, void* out, float* lse, int64_t S, int64_t Hkv, int64_t G, float scale,
                      int num_threads) {
    const T* qt = static_cast<const T*>(q);
    const T* kt = static_cast<const T*>(k);
    const T* vt = static_cast<const T*>(v);
    T* ot = static_cast<T*>(out);
    switch (D) {
        case 32: prefill<T, 32>(qt, q_stride, kt, vt, seqs, slots, ot, lse, S, Hkv, G, scale, num_threads); return 0;
        case 64: prefill<T, 64>(qt, q_stride, kt, vt, seqs, slots, ot, lse, S, Hkv, G, scale, num_threads); return 0;
        case 128: prefill<T, 128>(qt, q_stride, kt, vt, seqs, slots, ot, lse, S, Hkv, G, scale, num_threads); return 0;
        default: return 2;
    }
}

}  // namespace

// dtype 0: float32, 1: bfloat16. Returns 0, or non-zero for a shape it does not handle (the caller
// then takes the PyTorch path; nothing was written).
extern "C" int prefixkv_prefill_attention(int dtype, int64_t D, const void* q, int64_t q_stride, const void* k, const void* v,
                                          const int64_t* seqs, const int64_t* slots, void* out, float* lse, int64_t S,
                                          int64_t Hkv, int64_t G, float scale, int num_threads) {
    if (G < 1 || G > kMaxGroup || S < 0 || Hkv < 1 || num_threads < 1 || q_stride < Hkv * G * D) return 1;
    for (int64_t s = 0; s < S; ++s) {  // every query must see at least its own key
        const int64_t n = seqs[s * 4 + 1], kv = seqs[s * 4 + 2];
        if (n < 1 || kv < n || kv > (int64_t{1} << 30)) return 1;
    }
    if (dtype == 0) return dispatch_head_dim<float>(D, q, q_stride, k, v, seqs, slots, out, lse, S, Hkv, G, scale, num_threads);
    if (dtype == 1)
        return dispatch_head_dim<uint16_t>(D, q, q_stride, k, v, seqs, slots, out, lse, S, Hkv, G, scale, num_threads);
    return 3;
}

// 1 when bfloat16 prefill attention runs on the tile unit (AMX) here, 2 on the vector dot-product
// instruction (AVX512-BF16), else 0 (float32 vectors).
extern "C" int prefixkv_prefill_attention_unit() {
    if (kAmxBuilt && amx_permitted()) return 1;
    return kDotBuilt ? 2 : 0;
}
