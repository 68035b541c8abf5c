// bfloat16 <-> float32 for the CPU kernels of this folder: loads widen to float32, stores round to
// nearest even (as torch), so a kernel computes in float32 and rounds where PyTorch rounds.
#pragma once

#include <stdint.h>
#include <string.h>

namespace prefixkv {

inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept a NaN (as torch)
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// bfloat16 travels as uint16_t: one overload per element type
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
// the value a tensor of that element type would hold
inline float round_to(const float*, float v) { return v; }
inline float round_to(const uint16_t*, float v) { return bf16_to_f32(f32_to_bf16(v)); }

}  // namespace prefixkv
