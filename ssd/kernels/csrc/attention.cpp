// Built by ssd/kernels/build.py; the Python side and the why: ssd/kernels/attention_cpu.py.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include "library.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "isa.h"

namespace {

// exp2 on [-0.5, 0.5]: Cephes exp2f, 2^f = 1 + f * P(f).
constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr float kE0 = 1.535336188319500e-4f, kE1 = 1.339887440266574e-3f,
                kE2 = 9.618437357674640e-3f, kE3 = 5.550332471162809e-2f,
                kE4 = 2.402264791363012e-1f, kE5 = 6.931472028550421e-1f;
constexpr float kUnder = -125.f;  // exp2 below this is 0
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t KB = 32;        // keys per transposed block
constexpr int64_t SCH = 64;       // keys per P.V chunk (when a tile has several row blocks)

// ---------------------------------------------------------------------------------------
// W-lane vectors. Every lane op is the IEEE fp32 op of the portable code, lane by lane.
#if SSD_AVX512
constexpr int W = 16;
using V = __m512;
static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vset1(float x) { return _mm512_set1_ps(x); }
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
static inline __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
static inline V vload_part(const float* p, int n, float fill) {  // lanes >= n: fill
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p);
}
static inline V vkeep(V a, int n) { return _mm512_maskz_mov_ps(first(n), a); }  // lanes >= n: 0
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
static inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }  // a > b ? a : b
static inline V vexp2(V t) {
  const V r = _mm512_add_ps(t, vset1(kMagic));
  const V n = _mm512_sub_ps(r, vset1(kMagic));
  const V f = _mm512_sub_ps(t, n);
  V p = vset1(kE0);
  p = vfma(p, f, vset1(kE1)); p = vfma(p, f, vset1(kE2)); p = vfma(p, f, vset1(kE3));
  p = vfma(p, f, vset1(kE4)); p = vfma(p, f, vset1(kE5)); p = vfma(p, f, vset1(1.f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_sub_epi32(_mm512_castps_si512(r), _mm512_castps_si512(vset1(kMagic))), 23);
  const V y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(t, vset1(kUnder), _CMP_LT_OQ), vzero());
}
// In place, W x W: r[j] = key j at d0..d0+W-1 becomes r[i] = element d0+i of keys 0..W-1.
static inline void transpose(V* r) {
  V t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}
constexpr int SC_RR = 12, SC_NV = 2;  // score register tile: rows x key vectors
constexpr int PV_RR = 6, PV_NV = 4;   // P.V register tile: rows x d vectors

#elif SSD_AVX2
constexpr int W = 8;
using V = __m256;
static inline V vzero() { return _mm256_setzero_ps(); }
static inline V vset1(float x) { return _mm256_set1_ps(x); }
static inline V vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
static inline __m256i first(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline V vload_part(const float* p, int n, float fill) {
  const __m256i m = first(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
static inline V vkeep(V a, int n) { return _mm256_and_ps(a, _mm256_castsi256_ps(first(n))); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
static inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }  // a > b ? a : b
static inline V vexp2(V t) {
  const V r = _mm256_add_ps(t, vset1(kMagic));
  const V n = _mm256_sub_ps(r, vset1(kMagic));
  const V f = _mm256_sub_ps(t, n);
  V p = vset1(kE0);
  p = vfma(p, f, vset1(kE1)); p = vfma(p, f, vset1(kE2)); p = vfma(p, f, vset1(kE3));
  p = vfma(p, f, vset1(kE4)); p = vfma(p, f, vset1(kE5)); p = vfma(p, f, vset1(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_sub_epi32(_mm256_castps_si256(r), _mm256_castps_si256(vset1(kMagic))), 23);
  const V y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_andnot_ps(_mm256_cmp_ps(t, vset1(kUnder), _CMP_LT_OQ), y);
}
static inline void transpose(V* r) {
  V t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
constexpr int SC_RR = 6, SC_NV = 2;
constexpr int PV_RR = 6, PV_NV = 2;

#elif SSD_NEON
// Eight lanes as two 4-lane halves, each op the portable lane op: vfmaq_f32 is std::fma, and
// vmax is a select on a > b (FMAX differs on signed zeros and NaN).
constexpr int W = 8;
struct V { float32x4_t lo, hi; };
static inline V vzero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
static inline V vset1(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
static inline V vload(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
static inline void vstore(float* p, V a) { vst1q_f32(p, a.lo); vst1q_f32(p + 4, a.hi); }
static inline uint32x4_t below(int n, int from) {  // lanes from..from+3 < n
  static const uint32_t idx[4] = {0, 1, 2, 3};
  return vcltq_u32(vaddq_u32(vld1q_u32(idx), vdupq_n_u32(uint32_t(from))), vdupq_n_u32(uint32_t(n)));
}
static inline V vload_part(const float* p, int n, float fill) {  // lanes >= n: fill
  float buf[W];
  for (int j = 0; j < W; ++j) buf[j] = j < n ? p[j] : fill;
  return vload(buf);
}
static inline V vkeep(V a, int n) {  // lanes >= n: 0
  return {vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a.lo), below(n, 0))),
          vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a.hi), below(n, 4)))};
}
static inline V vfma(V a, V b, V c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
static inline V vadd(V a, V b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
static inline V vsub(V a, V b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
static inline V vmul(V a, V b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
static inline V vdiv(V a, V b) { return {vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
static inline V vmax(V a, V b) {  // a > b ? a : b
  return {vbslq_f32(vcgtq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcgtq_f32(a.hi, b.hi), a.hi, b.hi)};
}
static inline float32x4_t exp2_half(float32x4_t t) {
  const float32x4_t magic = vdupq_n_f32(kMagic);
  const float32x4_t r = vaddq_f32(t, magic);
  const float32x4_t n = vsubq_f32(r, magic);
  const float32x4_t f = vsubq_f32(t, n);
  float32x4_t p = vdupq_n_f32(kE0);
  p = vfmaq_f32(vdupq_n_f32(kE1), p, f); p = vfmaq_f32(vdupq_n_f32(kE2), p, f);
  p = vfmaq_f32(vdupq_n_f32(kE3), p, f); p = vfmaq_f32(vdupq_n_f32(kE4), p, f);
  p = vfmaq_f32(vdupq_n_f32(kE5), p, f); p = vfmaq_f32(vdupq_n_f32(1.f), p, f);
  const uint32x4_t e = vshlq_n_u32(vsubq_u32(vreinterpretq_u32_f32(r), vreinterpretq_u32_f32(magic)), 23);
  const float32x4_t y = vreinterpretq_f32_u32(vaddq_u32(vreinterpretq_u32_f32(p), e));
  return vbslq_f32(vcltq_f32(t, vdupq_n_f32(kUnder)), vdupq_n_f32(0.f), y);
}
static inline V vexp2(V t) { return {exp2_half(t.lo), exp2_half(t.hi)}; }
static inline void transpose4(float32x4_t& a, float32x4_t& b, float32x4_t& c, float32x4_t& d) {
  const float32x4x2_t ab = vtrnq_f32(a, b), cd = vtrnq_f32(c, d);
  a = vcombine_f32(vget_low_f32(ab.val[0]), vget_low_f32(cd.val[0]));
  b = vcombine_f32(vget_low_f32(ab.val[1]), vget_low_f32(cd.val[1]));
  c = vcombine_f32(vget_high_f32(ab.val[0]), vget_high_f32(cd.val[0]));
  d = vcombine_f32(vget_high_f32(ab.val[1]), vget_high_f32(cd.val[1]));
}
static inline void transpose(V* r) {  // four 4 x 4 blocks: the off-diagonal two swap places
  transpose4(r[0].lo, r[1].lo, r[2].lo, r[3].lo);
  transpose4(r[4].lo, r[5].lo, r[6].lo, r[7].lo);
  transpose4(r[0].hi, r[1].hi, r[2].hi, r[3].hi);
  transpose4(r[4].hi, r[5].hi, r[6].hi, r[7].hi);
  for (int i = 0; i < 4; ++i) std::swap(r[i].hi, r[i + 4].lo);
}
constexpr int SC_RR = 6, SC_NV = 2;
constexpr int PV_RR = 6, PV_NV = 2;

#else
constexpr int W = 8;
struct V { float v[W]; };
static inline V vzero() { V r; for (int j = 0; j < W; ++j) r.v[j] = 0.f; return r; }
static inline V vset1(float x) { V r; for (int j = 0; j < W; ++j) r.v[j] = x; return r; }
static inline V vload(const float* p) { V r; for (int j = 0; j < W; ++j) r.v[j] = p[j]; return r; }
static inline void vstore(float* p, V a) { for (int j = 0; j < W; ++j) p[j] = a.v[j]; }
static inline V vload_part(const float* p, int n, float fill) {
  V r; for (int j = 0; j < W; ++j) r.v[j] = j < n ? p[j] : fill; return r;
}
static inline V vkeep(V a, int n) { for (int j = n; j < W; ++j) a.v[j] = 0.f; return a; }
static inline V vfma(V a, V b, V c) {
  V r; for (int j = 0; j < W; ++j) r.v[j] = std::fma(a.v[j], b.v[j], c.v[j]); return r;
}
#define SSD_LANEWISE(name, expr)                           \
  static inline V name(V a, V b) {                         \
    V r;                                                   \
    for (int j = 0; j < W; ++j) {                          \
      const float x = a.v[j], y = b.v[j];                  \
      r.v[j] = (expr);                                     \
    }                                                      \
    return r;                                              \
  }
SSD_LANEWISE(vadd, x + y)
SSD_LANEWISE(vsub, x - y)
SSD_LANEWISE(vmul, x * y)
SSD_LANEWISE(vdiv, x / y)
SSD_LANEWISE(vmax, x > y ? x : y)
#undef SSD_LANEWISE
static inline V vexp2(V t) {
  V y;
  for (int j = 0; j < W; ++j) {
    const float x = t.v[j];
    const float r = x + kMagic, n = r - kMagic, f = x - n;
    float p = kE0;
    p = std::fma(p, f, kE1); p = std::fma(p, f, kE2); p = std::fma(p, f, kE3);
    p = std::fma(p, f, kE4); p = std::fma(p, f, kE5); p = std::fma(p, f, 1.f);
    int32_t ri, mi, pi;
    std::memcpy(&ri, &r, 4); std::memcpy(&mi, &kMagic, 4); std::memcpy(&pi, &p, 4);
    const int32_t yi = static_cast<int32_t>(static_cast<uint32_t>(pi) +
                                            (static_cast<uint32_t>(ri - mi) << 23));
    float v; std::memcpy(&v, &yi, 4);
    y.v[j] = x < kUnder ? 0.f : v;
  }
  return y;
}
static inline void transpose(V* r) {
  for (int i = 0; i < W; ++i)
    for (int j = i + 1; j < W; ++j) std::swap(r[i].v[j], r[j].v[i]);
}
constexpr int SC_RR = 4, SC_NV = 2;
constexpr int PV_RR = 4, PV_NV = 2;
#endif

constexpr int LANES = 16;       // sum / max lanes
constexpr int LV = LANES / W;   // vectors per 16 lanes

// ---------------------------------------------------------------------------------------
// Transposed key block: kt[d * KB + j] = key j's element d, for j < nvk * W (zero past nk).
static void pack_keys(const float* const* key, int64_t nk, int64_t nvk, int64_t D, float* kt) {
  V r[W];
  for (int64_t j0 = 0; j0 < nvk * W; j0 += W) {
    const float* const* kj = key + j0;
    const int64_t nj = std::min<int64_t>(W, nk - j0);
    int64_t d0 = 0;
    if (nj == W) {
      for (; d0 + W <= D; d0 += W) {
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) r[j] = vload(kj[j] + d0);
        transpose(r);
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) vstore(kt + (d0 + i) * KB + j0, r[i]);
      }
    }
    for (; d0 < D; d0 += W) {
      const int nd = static_cast<int>(std::min<int64_t>(W, D - d0));
      for (int j = 0; j < W; ++j) {
        if (j >= nj) r[j] = vzero();
        else if (nd == W) r[j] = vload(kj[j] + d0);
        else r[j] = vload_part(kj[j] + d0, nd, 0.f);
      }
      transpose(r);
      for (int i = 0; i < nd; ++i) vstore(kt + (d0 + i) * KB + j0, r[i]);
    }
  }
}

// Scores of RR rows x NV*W keys: out[r][j] = fma chain over d of q_r[d] * kt[d][j].
template <int RR, int NV>
static void score_tile(const float* const* q, const float* kt, int64_t D, float* const* out) {
  V acc[RR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    V k[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) k[c] = vload(kt + d * KB + c * W);
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) {
      const V qb = vset1(q[r][d]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(qb, k[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vstore(out[r] + c * W, acc[r][c]);
}

// P.V of RR rows for d in [d0, d0 + NV*W), keys s in [s0, s1): continues the chains
// a_r[d] = fma(p_r[s], v_s[d], a_r[d]) (from 0 when s0 == 0, else from acc_r) up to
// min(s1, len[r]); a row that ends here gets out_r[d] = a / l_r, the others go back to acc_r.
// Rows are sorted by length, len[0] the shortest, and all are longer than s0.
template <int RR, int NV>
static void pv_tile(const float* const* p, const int64_t* len, const float* const* val,
                    int64_t d0, int64_t s0, int64_t s1, float* const* accr, const float* l,
                    float* const* out) {
  V acc[RR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = s0 == 0 ? vzero() : vload(accr[r] + d0 + c * W);
  const int64_t common = std::min(len[0], s1);
  for (int64_t s = s0; s < common; ++s) {
    V v[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) v[c] = vload(val[s] + d0 + c * W);
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) {
      const V pb = vset1(p[r][s]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(pb, v[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 1; r < RR; ++r) {
    const int64_t end = std::min(len[r], s1);
    for (int64_t s = common; s < end; ++s) {
      const V pb = vset1(p[r][s]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(pb, vload(val[s] + d0 + c * W), acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r) {
    if (len[r] <= s1) {
      const V lb = vset1(l[r]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) vstore(out[r] + d0 + c * W, vdiv(acc[r][c], lb));
    } else {
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) vstore(accr[r] + d0 + c * W, acc[r][c]);
    }
  }
}

using ScoreFn = void (*)(const float* const*, const float*, int64_t, float* const*);
using PvFn = void (*)(const float* const*, const int64_t*, const float* const*, int64_t,
                      int64_t, int64_t, float* const*, const float*, float* const*);

template <int NV, int... R>
static std::array<ScoreFn, sizeof...(R)> score_table(std::integer_sequence<int, R...>) {
  return {&score_tile<R + 1, NV>...};
}
template <int NV, int... R>
static std::array<PvFn, sizeof...(R)> pv_table(std::integer_sequence<int, R...>) {
  return {&pv_tile<R + 1, NV>...};
}
template <int... N>
static std::array<std::array<ScoreFn, SC_RR>, SC_NV> score_tables(std::integer_sequence<int, N...>) {
  return {score_table<N + 1>(std::make_integer_sequence<int, SC_RR>())...};
}
template <int... N>
static std::array<std::array<PvFn, PV_RR>, PV_NV> pv_tables(std::integer_sequence<int, N...>) {
  return {pv_table<N + 1>(std::make_integer_sequence<int, PV_RR>())...};
}
static const auto kScore = score_tables(std::make_integer_sequence<int, SC_NV>());  // [nv-1][rr-1]
static const auto kPv = pv_tables(std::make_integer_sequence<int, PV_NV>());

// In place over x[0, L): x_s -> p_s; returns l. x has room up to a multiple of 16 past L.
// cap > 0 (soft-capping): x_s -> tanh((x_s * scale) / cap) * cap first, one scalar at a time.
static float softmax_row(float* x, int64_t L, float c, float scale, float cap) {
  if (cap > 0.f)
    for (int64_t s = 0; s < L; ++s) x[s] = std::tanh(x[s] * scale / cap) * cap;
  V mx[LV], sum[LV];
  for (int i = 0; i < LV; ++i) { mx[i] = vset1(-kInf); sum[i] = vzero(); }
  for (int64_t s0 = 0; s0 < L; s0 += LANES)
    for (int i = 0; i < LV; ++i) {
      const int64_t s = s0 + i * W;
      if (s >= L) break;
      const int n = static_cast<int>(std::min<int64_t>(W, L - s));
      mx[i] = vmax(mx[i], n == W ? vload(x + s) : vload_part(x + s, n, -kInf));
    }
  float lanes[LANES];
  for (int i = 0; i < LV; ++i) vstore(lanes + i * W, mx[i]);
  for (int h = LANES / 2; h >= 1; h /= 2)
    for (int j = 0; j < h; ++j) lanes[j] = lanes[j] > lanes[j + h] ? lanes[j] : lanes[j + h];
  const V m = vset1(lanes[0]), cv = vset1(c);
  for (int64_t s0 = 0; s0 < L; s0 += LANES)
    for (int i = 0; i < LV; ++i) {
      const int64_t s = s0 + i * W;
      if (s >= L) break;
      const int n = static_cast<int>(std::min<int64_t>(W, L - s));
      V p = vexp2(vmul(vsub(n == W ? vload(x + s) : vload_part(x + s, n, 0.f), m), cv));
      if (n < W) p = vkeep(p, n);
      vstore(x + s, p);
      sum[i] = vadd(sum[i], p);
    }
  for (int i = 0; i < LV; ++i) vstore(lanes + i * W, sum[i]);
  for (int h = LANES / 2; h >= 1; h /= 2)
    for (int j = 0; j < h; ++j) lanes[j] = lanes[j] + lanes[j + h];
  return lanes[0];
}

struct Tile { int64_t row, begin, end, g, cost; };  // queries order[begin:end) of one row

at::Tensor attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                     const at::Tensor& rows, const at::Tensor& q_row_in, const at::Tensor& q_len_in,
                     double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 3 && vc.dim() == 3, "ssd attention: q [T,H,D], caches [N,G,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat &&
              vc.scalar_type() == at::kFloat, "ssd attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(),
              "ssd attention: q and caches must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && q_row_in.scalar_type() == at::kLong &&
              q_len_in.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 2,
              "ssd attention: rows/q_row/q_len must be int64, rows [R,S] contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), G = kc.size(1), S = rows.size(1);
  TORCH_CHECK(G > 0 && kc.size(2) == D && vc.sizes() == kc.sizes() && H % G == 0,
              "ssd attention: shape mismatch");
  TORCH_CHECK(q_row_in.numel() == T && q_len_in.numel() == T, "ssd attention: q_row/q_len need T entries");
  TORCH_CHECK(scale >= 0 && std::isfinite(scale), "ssd attention: scale must be finite and >= 0");
  const at::Tensor q_row = q_row_in.contiguous(), q_len = q_len_in.contiguous();
  const int64_t HG = H / G, N = kc.size(0), R = rows.size(0);
  at::Tensor out = at::empty({T, H, D}, q.options());
  if (T == 0 || H == 0 || D == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* qr = q_row.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();

  std::vector<int64_t> row_len(R, 0);  // longest length among each row's queries
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(qr[t] >= 0 && qr[t] < R && ql[t] >= 1 && ql[t] <= S, "ssd attention: bad q_row/q_len");
    row_len[qr[t]] = std::max(row_len[qr[t]], ql[t]);
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < row_len[r]; ++s)
      TORCH_CHECK(rp[r * S + s] >= 0 && rp[r * S + s] < N, "ssd attention: slot out of range");

  // Queries by (row, length); tiles of up to MQ of them in one row, times kv heads.
  std::vector<int64_t> order(T);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return qr[a] != qr[b] ? qr[a] < qr[b] : ql[a] < ql[b];
  });
  const int64_t MQ = std::max<int64_t>(1, 48 / HG);
  std::vector<Tile> tiles;
  int64_t max_len = 0;
  for (int64_t b = 0; b < T;) {
    int64_t e = b;
    while (e < T && qr[order[e]] == qr[order[b]]) ++e;
    const int64_t n = e - b, ntiles = (n + MQ - 1) / MQ;
    for (int64_t i = 0; i < ntiles; ++i) {  // near-equal tiles
      const int64_t tb = b + n * i / ntiles, te = b + n * (i + 1) / ntiles;
      int64_t cost = 0;
      for (int64_t k = tb; k < te; ++k) cost += ql[order[k]];
      for (int64_t g = 0; g < G; ++g) tiles.push_back({qr[order[b]], tb, te, g, cost});
    }
    max_len = std::max(max_len, row_len[qr[order[b]]]);
    b = e;
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });

  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "ssd attention: softcap must be finite and >= 0");
  const float cap = static_cast<float>(softcap), fscale = static_cast<float>(scale);
  const float c = static_cast<float>((cap > 0.f ? 1.0 : scale) * 1.4426950408889634);
  // Score rows are lpad + 16 floats apart: a multiple of 4 KiB would put them all in the
  // same L1 sets.
  const int64_t lpad = (max_len + KB - 1) / KB * KB, ldsc = lpad + 16, DW = D / W * W;
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  int64_t rmax = 0;  // rows of the largest tile
  for (const Tile& tl : tiles) rmax = std::max(rmax, (tl.end - tl.begin) * HG);
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t, int64_t) {
    // Scratch kept by each thread across calls (pages already mapped).
    thread_local std::vector<float> sc, kt, ac;
    thread_local std::vector<const float*> key, val;
    if (sc.size() < static_cast<size_t>(rmax * ldsc)) sc.resize(rmax * ldsc);
    if (ac.size() < static_cast<size_t>(rmax * D)) ac.resize(rmax * D);
    if (kt.size() < static_cast<size_t>(D * KB)) kt.resize(D * KB);
    if (key.size() < static_cast<size_t>(max_len)) key.resize(max_len), val.resize(max_len);
    std::vector<float> lsum(rmax);
    std::vector<const float*> qrow(rmax), prow(rmax);
    std::vector<float*> orow(rmax), srow(rmax), arow(rmax);
    std::vector<int64_t> len(rmax);
    for (;;) {
      const int64_t it = next.fetch_add(1, std::memory_order_relaxed);
      if (it >= ntiles) break;
      const Tile& tl = tiles[it];
      const int64_t g = tl.g, nr = (tl.end - tl.begin) * HG;
      const int64_t* slots = rp + tl.row * S;
      int64_t lmax = 0;
      for (int64_t i = 0; i < tl.end - tl.begin; ++i) {
        const int64_t t = order[tl.begin + i];
        lmax = std::max(lmax, ql[t]);
        for (int64_t h = 0; h < HG; ++h) {
          const int64_t r = i * HG + h;
          qrow[r] = qp + (t * H + g * HG + h) * D;
          orow[r] = op + (t * H + g * HG + h) * D;
          srow[r] = sc.data() + r * ldsc;
          arow[r] = ac.data() + r * D;
          len[r] = ql[t];
        }
      }
      for (int64_t s = 0; s < lmax; ++s) {
        key[s] = kp + (slots[s] * G + g) * D;
        val[s] = vp + (slots[s] * G + g) * D;
      }
      // Scores, one transposed block of KB keys at a time; rows are sorted by length.
      int64_t r0 = 0;
      for (int64_t s0 = 0; s0 < lmax; s0 += KB) {
        while (len[r0] <= s0) ++r0;
        const int64_t nk = std::min(KB, lmax - s0), nvk = (nk + W - 1) / W;
        pack_keys(key.data() + s0, nk, nvk, D, kt.data());
        float* outp[SC_RR];
        for (int64_t rb = r0; rb < nr; rb += SC_RR) {
          const int64_t rr = std::min<int64_t>(SC_RR, nr - rb);
          // key vectors these rows need: up to the longest of them (the last)
          const int64_t need = (std::min(len[rb + rr - 1] - s0, nk) + W - 1) / W;
          for (int64_t c0 = 0; c0 < need; c0 += SC_NV) {
            const int64_t nv = std::min<int64_t>(SC_NV, need - c0);
            for (int64_t i = 0; i < rr; ++i) outp[i] = srow[rb + i] + s0 + c0 * W;
            kScore[nv - 1][rr - 1](qrow.data() + rb, kt.data() + c0 * W, D, outp);
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        lsum[r] = softmax_row(srow[r], len[r], c, fscale, cap);
        prow[r] = srow[r];
      }
      // P.V, register tiles of rows x d vectors, in chunks of keys that stay in L1 while
      // every row block passes over them; d % W tail one lane at a time.
      const int64_t chunk = nr > PV_RR ? SCH : lmax;
      r0 = 0;
      for (int64_t s0 = 0; s0 < lmax; s0 += chunk) {
        const int64_t s1 = std::min(lmax, s0 + chunk);
        while (len[r0] <= s0) ++r0;
        for (int64_t rb = r0; rb < nr; rb += PV_RR) {
          const int64_t rr = std::min<int64_t>(PV_RR, nr - rb);
          for (int64_t d0 = 0; d0 < DW; d0 += PV_NV * W) {
            const int64_t nv = std::min<int64_t>(PV_NV, (DW - d0) / W);
            kPv[nv - 1][rr - 1](prow.data() + rb, len.data() + rb, val.data(), d0, s0, s1,
                                arow.data() + rb, lsum.data() + rb, orow.data() + rb);
          }
        }
      }
      for (int64_t d = DW; d < D; ++d)
        for (int64_t r = 0; r < nr; ++r) {
          float a = 0.f;
          for (int64_t s = 0; s < len[r]; ++s) a = std::fma(prow[r][s], val[s][d], a);
          orow[r][d] = a / lsum[r];
        }
    }
  };
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), ntiles);
  if (nt <= 1) body(0, 1);
  else at::parallel_for(0, nt, 1, body);
  return out;
}

}  // namespace

SSD_LIBRARY(m) {
  m.def("attention(Tensor q, Tensor kc, Tensor vc, Tensor rows, Tensor q_row, Tensor q_len, float scale, "
        "float softcap=0.) -> Tensor");
  m.impl("attention", c10::DispatchKey::CPU, &attention);
}
