// Eight fp32 lanes, for the kernels whose sums run in 8-lane chains (linear.cpp, linear_int8.cpp).
// The portable V8 does per lane exactly what the AVX2 one does: every build gives the same bits.
#pragma once

#include <cmath>

#include "isa.h"

namespace {

#if SSD_AVX2
using V8 = __m256;
static inline V8 vload(const float* p) { return _mm256_loadu_ps(p); }
static inline V8 vzero() { return _mm256_setzero_ps(); }
static inline void vstore(float* p, V8 a) { _mm256_storeu_ps(p, a); }
static inline V8 vfma(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
static inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
#elif SSD_NEON
// Two 4-lane halves; vfmaq_f32 is the fused multiply-add of std::fma, lane by lane.
struct V8 { float32x4_t lo, hi; };
static inline V8 vload(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
static inline V8 vzero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
static inline void vstore(float* p, V8 a) { vst1q_f32(p, a.lo); vst1q_f32(p + 4, a.hi); }
static inline V8 vfma(V8 a, V8 b, V8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
static inline void prefetch(const void* p) { __builtin_prefetch(p); }
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
#else
struct V8 { float v[8]; };
static inline V8 vload(const float* p) {
  V8 r; for (int j = 0; j < 8; ++j) r.v[j] = p[j]; return r;
}
static inline V8 vzero() { return V8{}; }
static inline void vstore(float* p, V8 a) { for (int j = 0; j < 8; ++j) p[j] = a.v[j]; }
static inline V8 vfma(V8 a, V8 b, V8 c) {
  V8 r; for (int j = 0; j < 8; ++j) r.v[j] = std::fma(a.v[j], b.v[j], c.v[j]); return r;
}
static inline void prefetch(const void* p) { __builtin_prefetch(p); }
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
#endif

}  // namespace
