// Included first by every kernel source, before any other header: what the whole file compiles for.
//
// On an ARM CPU with SVE (AWS Graviton 3 and 4, Arm Neoverse V1/V2/N2), -march=native turns SVE on
// without fixing its vector length, and GCC 12 then lowers the 16-float vectors of vec16.h to
// scalar code (decode_attention.cpp: 7,734 scalar multiply-adds and no NEON one at -O3 for
// -mcpu=neoverse-v1, against 1,794 NEON ones for armv8-a; seen with Debian's cross compiler and
// on an emulated aarch64, bench/emulated_aarch64.sh). The kernels are built with SVE off, so
// those vectors are NEON's, as on any other ARMv8 CPU. Clang takes no such pragma.
#pragma once

// (__ARM_FEATURE_SVE_BITS is 0 where the length is not fixed; fixed, with -msve-vector-bits, GCC
// lowers those vectors to SVE's own)
#if defined(__aarch64__) && defined(__ARM_FEATURE_SVE) && !__ARM_FEATURE_SVE_BITS && !defined(__clang__)
#pragma GCC target("+nosve")
#endif
