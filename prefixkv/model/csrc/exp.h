// exp(x) for x <= 0, shared by the attention kernels of this folder.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace prefixkv {

// exp(x) for x <= 0 (a score minus its row's maximum): 2^n * poly(r), relative error ~2e-7 -
// written out so that the compiler vectorizes the softmax loop (libm's expf is not inlined).
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

}  // namespace prefixkv
