// exp(x) for x <= 0, shared by the attention kernels of this folder.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace prefixkv {

// The range reduction and polynomial of exp(x) for x <= 0, shared by the scalar version below and
// the vector one (vec16.h): x = n ln2 + r, exp(x) = 2^n * poly(r), relative error ~2e-7.
constexpr float kExpMin = -87.0f;  // below it exp(x) would leave the normal floats
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;

// poly(x - n ln2) for a float or a vector of them (V{} + c broadcasts a constant)
template <typename V>
inline V exp_poly(V x, V n) {
    const V r = x - n * kLn2Hi - n * kLn2Lo;
    V p = V{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (a score minus its row's maximum), written out so that the compiler can
// inline it (libm's expf is not).
inline float exp_nonpositive(float x) {
    x = x < kExpMin ? kExpMin : x;
    const float n = floorf(x * kLog2e + 0.5f);
    const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return exp_poly(x, n) * scale;
}

}  // namespace prefixkv
