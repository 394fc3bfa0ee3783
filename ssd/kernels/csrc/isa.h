// Which SIMD code a kernel compiles, from the ISA flags build.py passes for its variant:
// SSD_AVX2 (AVX2 + FMA: the avx2 and avx512 builds) and SSD_AVX512 (AVX-512 F/DQ besides);
// on aarch64, SSD_NEON (every aarch64 CPU: the neon and dotprod builds) and SSD_DOTPROD
// (the dot-product extension, SDOT: Apple M1 and later, Graviton 2 and later).
// A kernel that needs more (quant.cpp: VNNI, F16C) checks those on top of these.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SSD_AVX2 1
#else
#define SSD_AVX2 0
#endif
#if SSD_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__)
#define SSD_AVX512 1
#else
#define SSD_AVX512 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(SSD_PORTABLE)  // NEON is always on for aarch64
#include <arm_neon.h>
#define SSD_NEON 1
#else
#define SSD_NEON 0
#endif
#if SSD_NEON && defined(__ARM_FEATURE_DOTPROD)
#define SSD_DOTPROD 1
#else
#define SSD_DOTPROD 0
#endif
