// Which SIMD code a kernel compiles, from the ISA flags build.py passes for its variant:
// SSD_AVX2 (AVX2 + FMA: the avx2 and avx512 builds) and SSD_AVX512 (AVX-512 F/DQ besides).
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
