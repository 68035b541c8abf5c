// The pieces of the kernels of this folder that decode_layers.cpp strings together into a whole
// decode step. Each piece is one unit of its kernel's work (a row, a task) and is the very function
// the kernel's own entry point runs for that unit - compiled once, in its own file, never inlined
// into a caller - so a decode step through decode_layers.cpp and one through the separate kernels
// compute every value with the same instructions: the same bits.
//
// dtype: 0 float32, 1 bfloat16 (uint16_t storage), as every entry point of this folder.
#pragma once

#include <stdint.h>

#include <vector>

#include "vec16.h"

namespace prefixkv {

// add_rms_norm.cpp: h += delta (delta may be null) and out = rms_norm(h) * weight, one row of dim.
void add_rms_norm_row(int dtype, void* h, const void* delta, const void* weight, void* out, int64_t dim, float eps);

// silu_and_mul.cpp: out[0:I] = silu(gu[0:I]) * gu[I:2I], one row.
void silu_and_mul_row(int dtype, const void* gu, void* out, int64_t I);

// rotary.cpp: rotate one token's H heads of D (contiguous) in place by its cos / signed-sin rows.
void rotate_token(int dtype, void* x, int64_t H, int64_t D, const void* cos, const void* sin);

// small_linear.cpp: y = x @ W^T (+ bias) is split into tasks of whole column slabs; task t writes
// its columns of every row. False where this build has no kernel for the dtype.
bool small_linear_built(int dtype);
int64_t small_linear_tasks(int64_t N);
void small_linear_task(int dtype, int64_t task, const void* x, int64_t ldx, const void* wp, const float* bias, void* y,
                       int64_t M, int64_t K, int64_t N);

// decode_attention.cpp: one query token per sequence against its paged context, as tasks (one
// sequence, one KV head, one part of its keys) and, where the keys were split into parts, a merge
// of each query row's parts. The sizes and the split are fixed per call; K and V are passed per
// task, so one plan serves every layer of a step.
struct DecodeScratch {
    std::vector<float> scores;
    std::vector<uint16_t> weights;
    std::vector<vec16> acc;
};

class DecodeAttention {
   public:
    // q: the rows of sequence b start at q + b * q_stride ([Hkv, G, D] contiguous within a row)
    DecodeAttention(int dtype, int64_t D, const void* q, int64_t q_stride, const int64_t* slots, const int64_t* lens,
                    void* out, float* lse, int64_t B, int64_t L, int64_t Hkv, int64_t G, float scale);
    bool supported() const { return supported_; }
    int64_t tasks() const { return B_ * Hkv_ * parts_; }
    int64_t merge_rows() const { return parts_ > 1 ? B_ * Hkv_ * G_ : 0; }
    void make_scratch(DecodeScratch& scratch) const;
    void run_task(int64_t task, const void* k, const void* v, DecodeScratch& scratch);
    void merge_row(int64_t row);

   private:
    int dtype_;
    int64_t D_;
    const void* q_;
    int64_t q_stride_;
    const int64_t* slots_;
    const int64_t* lens_;
    void* out_;
    float* lse_;
    int64_t B_, L_, Hkv_, G_;
    float scale_;
    bool supported_;
    int64_t parts_ = 1, span_ = 0, stride_ = 0;
    std::vector<float> part_best_, part_total_, part_acc_;  // each part's maximum, sum and output
};

}  // namespace prefixkv
