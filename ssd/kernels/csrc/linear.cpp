// Built by ssd/kernels/build.py; the Python side and the why: ssd/kernels/linear_cpu.py.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include "library.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "v8.h"

namespace {

// Blocking. None of these changes the arithmetic, only the speed.
constexpr int64_t KC = 512;  // K chunk: an NR x KC tile of W stays in L1 across M tiles
constexpr int64_t MC = 48;   // M block (even): rows of x that pass over one W tile
constexpr int64_t NB = 48;   // rows of W per work unit handed to a thread (multiple of NR)
constexpr int64_t PF = 256;  // software prefetch distance along W rows (weights)

// W's element types: fp32, or fp16 / bf16 read as the fp32 values they hold (exactly), so a
// matrix kept in half the bytes gives the bits of its fp32 copy.
using Half = c10::Half;
using BF16 = c10::BFloat16;
static inline float wscalar(const float* p) { return *p; }
static inline float wscalar(const Half* p) { return float(*p); }
static inline float wscalar(const BF16* p) { return float(*p); }
#if SSD_AVX2
static inline V8 wload(const float* p) { return vload(p); }
static inline V8 wload(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline V8 wload(const BF16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
#elif SSD_NEON
static inline V8 wload(const float* p) { return vload(p); }
static inline V8 wload(const Half* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
static inline V8 wload(const BF16* p) {  // bf16 is the top half of its fp32
  const uint16x8_t u = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(u), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(u, 16))};
}
#else
template <typename WT>
static inline V8 wload(const WT* p) {
  V8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = wscalar(p + j);
  return r;
}
#endif

// One register tile: MT rows of x times NR rows of W over k in [k0, k1), (k1-k0) % 8 == 0.
// acc holds the [MT][NR] 8-lane vectors between K chunks.
template <typename WT, int MT, int NR>
static void micro(const float* __restrict x, int64_t ldx, const WT* __restrict w,
                  int64_t ldw, int64_t k0, int64_t k1, float* __restrict acc) {
  V8 a[MT][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) a[m][r] = vload(acc + (m * NR + r) * 8);
  for (int64_t k = k0; k < k1; k += 8) {
    if (((k - k0) & 15) == 0) {
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) prefetch(w + r * ldw + k + PF);
    }
    V8 wv[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) wv[r] = wload(w + r * ldw + k);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      V8 xv = vload(x + m * ldx + k);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) a[m][r] = vfma(xv, wv[r], a[m][r]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) vstore(acc + (m * NR + r) * 8, a[m][r]);
}

#if SSD_AVX512
// The same 8-lane arithmetic, two rows of x per zmm: the low half carries row 2p, the high
// half row 2p+1, and every 8-float piece of W is broadcast to both halves. xp holds the
// rows packed in pairs: pair p, k block kb at xp[p * ldp + kb * 16] (16 floats).
template <typename WT, int MP, int NR>
static void micro2(const float* __restrict xp, int64_t ldp, const WT* __restrict w,
                   int64_t ldw, int64_t k0, int64_t k1, float* __restrict acc) {
  __m512 a[MP][NR];
#pragma GCC unroll 16
  for (int p = 0; p < MP; ++p)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
      a[p][r] = _mm512_insertf32x8(
          _mm512_castps256_ps512(_mm256_loadu_ps(acc + (2 * p * NR + r) * 8)),
          _mm256_loadu_ps(acc + ((2 * p + 1) * NR + r) * 8), 1);
  for (int64_t k = k0; k < k1; k += 8) {
    if (((k - k0) & 15) == 0) {
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) prefetch(w + r * ldw + k + PF);
    }
    __m512 xv[MP];
#pragma GCC unroll 16
    for (int p = 0; p < MP; ++p) xv[p] = _mm512_loadu_ps(xp + p * ldp + 2 * k);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = _mm512_broadcast_f32x8(wload(w + r * ldw + k));
#pragma GCC unroll 16
      for (int p = 0; p < MP; ++p) a[p][r] = _mm512_fmadd_ps(xv[p], wv, a[p][r]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < MP; ++p)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(acc + (2 * p * NR + r) * 8, _mm512_castps512_ps256(a[p][r]));
      _mm256_storeu_ps(acc + ((2 * p + 1) * NR + r) * 8, _mm512_extractf32x8_ps(a[p][r], 1));
    }
}
#endif

template <typename WT>
using MicroFn = void (*)(const float*, int64_t, const WT*, int64_t, int64_t, int64_t, float*);

template <typename WT, int NR, bool PAIRED>
static MicroFn<WT> micro_for(int mt) {  // mt: rows of x per tile (even when PAIRED)
#if SSD_AVX512
  if (PAIRED) {
    switch (mt) {
      case 2: return &micro2<WT, 1, NR>;
      case 4: return &micro2<WT, 2, NR>;
      case 6: return &micro2<WT, 3, NR>;
      default: return &micro2<WT, 4, NR>;
    }
  }
#endif
  switch (mt) {
    case 1: return &micro<WT, 1, NR>;
    case 2: return &micro<WT, 2, NR>;
    case 3: return &micro<WT, 3, NR>;
    default: return &micro<WT, 4, NR>;
  }
}

struct Args {
  const float* x; int64_t ldx;
  const void* w; int64_t ldw;  // float, Half or BF16
  const float* b;
  float* y; int64_t ldy;
  int64_t M, N, K;
  const float* xp; int64_t ldp;  // x packed in pairs of rows (PAIRED path)
};

// Rows [mb0, mb0 + mb) of x times W rows n0 .. n0+NR-1, in register tiles of mt rows.
template <typename WT, int NR, bool PAIRED>
static void tile(const Args& A, int64_t mb0, int64_t mb, int64_t n0, int mt, float* acc) {
  const int64_t K8 = A.K & ~int64_t(7);
  const WT* w = static_cast<const WT*>(A.w) + n0 * A.ldw;
  const int64_t rows = PAIRED ? (mb + 1) & ~int64_t(1) : mb;  // + a zero pad row if odd
  const float* xs = PAIRED ? A.xp + (mb0 / 2) * A.ldp : A.x + mb0 * A.ldx;
  const int64_t ld = PAIRED ? A.ldp : A.ldx;
  std::fill(acc, acc + rows * NR * 8, 0.f);
  const MicroFn<WT> full = micro_for<WT, NR, PAIRED>(mt), last = micro_for<WT, NR, PAIRED>(int(rows % mt));
  for (int64_t k0 = 0; k0 < K8; k0 += KC) {
    const int64_t k1 = std::min(K8, k0 + KC);
    int64_t m0 = 0;
    for (; m0 + mt <= rows; m0 += mt)
      full(xs + (PAIRED ? m0 / 2 : m0) * ld, ld, w, A.ldw, k0, k1, acc + m0 * NR * 8);
    if (m0 < rows) last(xs + (PAIRED ? m0 / 2 : m0) * ld, ld, w, A.ldw, k0, k1, acc + m0 * NR * 8);
  }
  const int64_t rem = A.K - K8;
  for (int64_t m = 0; m < mb; ++m)
    for (int r = 0; r < NR; ++r) {
      float* l = acc + (m * NR + r) * 8;
      const float* xt = A.x + (mb0 + m) * A.ldx + K8;
      const WT* wt = w + r * A.ldw + K8;
      for (int64_t j = 0; j < rem; ++j) l[j] = std::fma(xt[j], wscalar(wt + j), l[j]);
      const float s0 = l[0] + l[4], s1 = l[1] + l[5], s2 = l[2] + l[6], s3 = l[3] + l[7];
      const float t0 = s0 + s2, t1 = s1 + s3;
      float s = t0 + t1;
      if (A.b) s = s + A.b[n0 + r];
      A.y[(mb0 + m) * A.ldy + n0 + r] = s;
    }
}

template <typename WT, int NR, bool PAIRED>
static void unit(const Args& A, int64_t nbeg, int64_t nend, int mt, float* acc) {
  for (int64_t mb0 = 0; mb0 < A.M; mb0 += MC) {
    const int64_t mb = std::min(MC, A.M - mb0);
    int64_t n0 = nbeg;
    for (; n0 + NR <= nend; n0 += NR) tile<WT, NR, PAIRED>(A, mb0, mb, n0, mt, acc);
    for (; n0 < nend; ++n0) tile<WT, 1, PAIRED>(A, mb0, mb, n0, mt, acc);
  }
}

template <typename WT, bool PAIRED>
static void unit_nr(const Args& A, int64_t nbeg, int64_t nend, int mt, int nr, float* acc) {
  switch (nr) {
    case 8: unit<WT, 8, PAIRED>(A, nbeg, nend, mt, acc); break;
    case 6: unit<WT, 6, PAIRED>(A, nbeg, nend, mt, acc); break;
    case 4: unit<WT, 4, PAIRED>(A, nbeg, nend, mt, acc); break;
    default: unit<WT, 3, PAIRED>(A, nbeg, nend, mt, acc); break;
  }
}

template <typename WT>
static void run(Args A) {
  // Register tile (rows of x mt, rows of W nr) by M; 16 ymm (AVX2) or 32 zmm (AVX-512).
  int mt, nr;
  bool paired = false;
  switch (A.M) {
    case 1: mt = 1; nr = 8; break;
    case 2: mt = 2; nr = 6; break;
    case 3: mt = 3; nr = 4; break;
    default: mt = 4; nr = 3; break;
  }
  at::Tensor xp;
#if SSD_AVX512
  if (A.M >= 2) {
    paired = true;
    switch (A.M) {
      case 2: mt = 2; nr = 8; break;
      case 3: case 4: mt = 4; nr = 8; break;
      case 5: case 6: mt = 6; nr = 8; break;
      default: mt = 8; nr = 6; break;
    }
    const int64_t K8 = A.K & ~int64_t(7), pairs = (A.M + 1) / 2;
    A.ldp = 2 * K8;
    xp = at::empty({pairs * A.ldp + 1}, at::kFloat);
    float* dst = xp.data_ptr<float>();
    at::parallel_for(0, pairs, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int h = 0; h < 2; ++h) {
          const int64_t m = 2 * p + h;
          float* d = dst + p * A.ldp + 8 * h;
          if (m < A.M) {
            const float* s = A.x + m * A.ldx;
            for (int64_t kb = 0; kb < K8; kb += 8) std::memcpy(d + 2 * kb, s + kb, 32);
          } else {
            for (int64_t kb = 0; kb < K8; kb += 8) std::memset(d + 2 * kb, 0, 32);
          }
        }
    });
    A.xp = dst;
  }
#endif
  const int64_t units = (A.N + NB - 1) / NB;
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t, int64_t) {
    alignas(64) float acc[MC * 8 * 8];
    for (;;) {  // dynamic schedule: a thread slowed by a busy core takes fewer units
      const int64_t u = next.fetch_add(1, std::memory_order_relaxed);
      if (u >= units) break;
      const int64_t nbeg = u * NB, nend = std::min(A.N, nbeg + NB);
      if (paired) unit_nr<WT, true>(A, nbeg, nend, mt, nr, acc);
      else unit_nr<WT, false>(A, nbeg, nend, mt, nr, acc);
    }
  };
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), units);
  if (nt <= 1) body(0, 1);
  else at::parallel_for(0, nt, 1, body);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "ssd linear: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "ssd linear: x must be fp32");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16,
              "ssd linear: w must be fp32, fp16 or bf16");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "ssd linear: CPU only");
  TORCH_CHECK(x.size(1) == w.size(1), "ssd linear: x.size(1) != w.size(1)");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "ssd linear: rows of x must be contiguous");
  TORCH_CHECK(w.stride(1) == 1 || w.size(1) <= 1, "ssd linear: rows of w must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* bp = nullptr;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->dim() == 1 && b->size(0) == N &&
                b->is_contiguous() && b->device().is_cpu(), "ssd linear: bad bias");
    bp = b->data_ptr<float>();
  }
  if (M == 0 || N == 0) return y;
  const Args args{x.data_ptr<float>(), x.stride(0), w.data_ptr(), w.stride(0), bp, y.data_ptr<float>(), N, M, N, K,
                  nullptr, 0};
  switch (w.scalar_type()) {
    case at::kHalf: run<Half>(args); break;
    case at::kBFloat16: run<BF16>(args); break;
    default: run<float>(args); break;
  }
  return y;
}

}  // namespace

SSD_LIBRARY(m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &linear);
}
