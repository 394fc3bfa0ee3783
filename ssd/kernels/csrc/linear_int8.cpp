// Built by ssd/kernels/build.py; the Python side and the why: ssd/kernels/linear_int8_cpu.py.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include "library.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "v8.h"

namespace {

// Loads of int8 weights, converted exactly to fp32: 8 lanes (V8), or 16 (AVX-512).
#if SSD_AVX2
static inline V8 vload(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
#elif SSD_NEON
static inline V8 vload(const int8_t* p) {
  const int16x8_t h = vmovl_s8(vld1_s8(p));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)))};
}
#else
static inline V8 vload(const int8_t* p) {
  V8 r; for (int j = 0; j < 8; ++j) r.v[j] = float(p[j]); return r;
}
#endif
#if SSD_AVX512
static inline __m512 zload(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 zload(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
#endif

// Blocking. None of these changes the arithmetic, only the speed.
constexpr int64_t KC = 512;  // K chunk (multiple of 16) of the fp32 copy of a tile of Wq
constexpr int64_t MC = 48;   // M block: rows of x that pass over one tile of Wq
constexpr int NR_MAX = 8;
// Register tile (rows of x, rows of Wq) when M needs several tiles (see run()).
#if SSD_AVX512
constexpr int BUF_MT = 6, BUF_NR = 4;
#else
constexpr int BUF_MT = 4, BUF_NR = 3;
#endif

// micro() flags: start from zero (first K chunk) rather than from acc; prefetch the next
// tiles of Wq (into L1 and, one further, into L2: the hardware prefetcher alone leaves
// DRAM idle while a core converts and FMAs; measured +10% at M = 1).
constexpr int ZERO = 1, PREFETCH = 2;

// One register tile: MT rows of x times NR rows of W (int8 Wq, or an fp32 copy of a chunk
// of it) over k in [0, kn), kn % 16 == 0, into the [MT][NR] 16-lane accumulators at acc.
#if SSD_AVX512
template <int MT, int NR, typename W>
static void micro(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw,
                  int64_t kn, float* __restrict acc, int flags) {
  __m512 a[MT][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
      a[m][r] = (flags & ZERO) ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (m * NR + r) * 16);
  for (int64_t k = 0; k < kn; k += 16) {
    if ((flags & PREFETCH) && (k * sizeof(W)) % 64 == 0) {
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        prefetch(w + (NR + r) * ldw + k);
        prefetch_l2(w + (2 * NR + r) * ldw + k);
      }
    }
    __m512 wv[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) wv[r] = zload(w + r * ldw + k);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      // keep xv in a register: GCC would fold the load into each of the NR FMAs, and
      // the load ports, not the FMAs, would set the pace (measured +10% at M = 8)
      if constexpr (NR > 1) asm("" : "+v"(xv));
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) a[m][r] = _mm512_fmadd_ps(xv, wv[r], a[m][r]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(acc + (m * NR + r) * 16, a[m][r]);
}
#else
// Lanes h .. h+7 (h = 0 or 8) of each 16. The second pass reads the tile of W from L1.
template <int MT, int NR, typename W>
static void micro_half(const float* __restrict x, int64_t ldx, const W* __restrict w,
                       int64_t ldw, int64_t kn, float* __restrict acc, int flags, int h) {
  V8 a[MT][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
      a[m][r] = (flags & ZERO) ? vzero() : vload(acc + (m * NR + r) * 16 + h);
  for (int64_t k = h; k < kn; k += 16) {
    if ((flags & PREFETCH) && ((k - h) * sizeof(W)) % 64 == 0) {
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        prefetch(w + (NR + r) * ldw + k);
        prefetch_l2(w + (2 * NR + r) * ldw + k);
      }
    }
    V8 wv[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) wv[r] = vload(w + r * ldw + k);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const V8 xv = vload(x + m * ldx + k);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) a[m][r] = vfma(xv, wv[r], a[m][r]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) vstore(acc + (m * NR + r) * 16 + h, a[m][r]);
}

template <int MT, int NR, typename W>
static void micro(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw,
                  int64_t kn, float* __restrict acc, int flags) {
  micro_half<MT, NR, W>(x, ldx, w, ldw, kn, acc, flags, 0);
  micro_half<MT, NR, W>(x, ldx, w, ldw, kn, acc, flags & ZERO, 8);
}
#endif

template <typename W>
using MicroFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int);

// The micro kernel for a tile of mt rows (1 .. 12), instantiated only where mt * nr <= 24.
template <int NR, typename W, int MT = 1>
static MicroFn<W> micro_for(int mt) {
  if constexpr (MT > 12 || MT * NR > 24) {
    return nullptr;
  } else {
    return mt == MT ? &micro<MT, NR, W> : micro_for<NR, W, MT + 1>(mt);
  }
}

// wbuf[r * KC + k] = float(w[r * ldw + k]) for k < kn (exact), prefetching the next tile.
template <int NR>
static void convert(const int8_t* __restrict w, int64_t ldw, int64_t kn, float* __restrict wbuf) {
  for (int r = 0; r < NR; ++r)
    for (int64_t k = 0; k < kn; k += 16) {
      if (k % 64 == 0) prefetch(w + (NR + r) * ldw + k);
#if SSD_AVX512
      _mm512_storeu_ps(wbuf + r * KC + k, zload(w + r * ldw + k));
#else
      vstore(wbuf + r * KC + k, vload(w + r * ldw + k));
      vstore(wbuf + r * KC + k + 8, vload(w + r * ldw + k + 8));
#endif
    }
}

// sums[i] = the fixed tree over the 16 lanes of accumulator i (i < n; acc holds n rounded
// up to 16 accumulators): s_j = l_j + l_{j+8}, u_j = s_j + s_{j+4}, t_j = u_j + u_{j+2},
// t_0 + t_1. The SIMD versions add the same pairs, 16 (8) accumulators at a time
// transposed into one vector of sums: a few instructions per sum instead of a dozen.
#if SSD_AVX512
static void reduce_all(const float* acc, int64_t n, float* sums) {
  for (int64_t g = 0; g < n; g += 16) {
    // slot j holds accumulator 4 (j % 4) + j / 4, so the sums come out in order
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_loadu_ps(acc + (g + 4 * (j % 4) + j / 4) * 16);
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)  // 128-bit quarters q0 q1 | q2 q3 of each: s = l_j + l_{j+8}
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // u = s_j + s_{j+4}
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // t = u_j + u_{j+2}
      d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    _mm512_storeu_ps(sums + g, _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                                             _mm512_shuffle_ps(d[0], d[1], 0xDD)));
  }
}
#elif SSD_AVX2
static void reduce_all(const float* acc, int64_t n, float* sums) {
  for (int64_t g = 0; g < n; g += 8) {
    __m256 s[8], c[4], d[2];
    for (int j = 0; j < 8; ++j) {  // slot j holds accumulator 4 (j % 2) + j / 2
      const float* l = acc + (g + 4 * (j % 2) + j / 2) * 16;
      s[j] = _mm256_add_ps(_mm256_loadu_ps(l), _mm256_loadu_ps(l + 8));
    }
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                           _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)
      d[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                           _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    _mm256_storeu_ps(sums + g, _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], 0x88),
                                             _mm256_shuffle_ps(d[0], d[1], 0xDD)));
  }
}
#else
static void reduce_all(const float* acc, int64_t n, float* sums) {
  for (int64_t i = 0; i < n; ++i) {
    const float* l = acc + i * 16;
    float u[4];
    for (int j = 0; j < 4; ++j) u[j] = (l[j] + l[j + 8]) + (l[j + 4] + l[j + 12]);
    sums[i] = (u[0] + u[2]) + (u[1] + u[3]);
  }
}
#endif

struct Args {
  const float* x; int64_t ldx;
  const int8_t* w; int64_t ldw;
  const float* scale;
  const float* b;
  float* y; int64_t ldy;
  int64_t M, N, K;
};

// Rows [mb0, mb0 + mb) of x times Wq rows n0 .. n0+NR-1, in register tiles of mt rows.
// One tile: straight from int8 (each weight vector converted once). Several: each K chunk
// of Wq is converted once into wbuf (fp32, L1) that all the tiles then read.
template <int NR>
static void tile(const Args& A, int64_t mb0, int64_t mb, int64_t n0, int mt, float* acc,
                 float* sums, float* wbuf) {
  const int64_t K16 = A.K & ~int64_t(15), n = mb * NR;  // n accumulators, m-major
  const int8_t* w = A.w + n0 * A.ldw;
  const float* xs = A.x + mb0 * A.ldx;
  // zero the padding reduce_all reads (all of acc if no micro() call starts from zero)
  std::fill(acc + (K16 ? n : 0) * 16, acc + ((n + 15) & ~int64_t(15)) * 16, 0.f);
  if (mb <= mt) {
    if (K16) micro_for<NR, int8_t>(int(mb))(xs, A.ldx, w, A.ldw, K16, acc, ZERO | PREFETCH);
  } else if constexpr (NR == BUF_NR || NR == 1) {  // the only nr with several tiles
    const MicroFn<float> full = micro_for<NR, float>(mt), last = micro_for<NR, float>(int(mb % mt));
    for (int64_t k0 = 0; k0 < K16; k0 += KC) {
      const int64_t kn = std::min(KC, K16 - k0);
      convert<NR>(w + k0, A.ldw, kn, wbuf);
      const int flags = k0 == 0 ? ZERO : 0;
      int64_t m0 = 0;
      for (; m0 + mt <= mb; m0 += mt)
        full(xs + m0 * A.ldx + k0, A.ldx, wbuf, KC, kn, acc + m0 * NR * 16, flags);
      if (m0 < mb) last(xs + m0 * A.ldx + k0, A.ldx, wbuf, KC, kn, acc + m0 * NR * 16, flags);
    }
  }
  const int64_t rem = A.K - K16;
  for (int64_t i = 0; rem && i < n; ++i) {
    float* l = acc + i * 16;
    const float* xt = xs + (i / NR) * A.ldx + K16;
    const int8_t* wt = w + (i % NR) * A.ldw + K16;
    for (int64_t j = 0; j < rem; ++j) l[j] = std::fma(xt[j], float(wt[j]), l[j]);
  }
  reduce_all(acc, n, sums);
  for (int64_t m = 0; m < mb; ++m) {
    float* y = A.y + (mb0 + m) * A.ldy + n0;
    for (int r = 0; r < NR; ++r) {
      const float v = sums[m * NR + r] * A.scale[n0 + r];
      y[r] = A.b ? v + A.b[n0 + r] : v;
    }
  }
}

template <int NR>
static void unit(const Args& A, int64_t nbeg, int64_t nend, int mt, float* acc, float* sums,
                 float* wbuf) {
  for (int64_t mb0 = 0; mb0 < A.M; mb0 += MC) {
    const int64_t mb = std::min(MC, A.M - mb0);
    int64_t n0 = nbeg;
    for (; n0 + NR <= nend; n0 += NR) tile<NR>(A, mb0, mb, n0, mt, acc, sums, wbuf);
    for (; n0 < nend; ++n0) tile<1>(A, mb0, mb, n0, mt, acc, sums, wbuf);
  }
}

static void run(const Args& A) {
  // Register tile (rows of x mt, rows of Wq nr) by M, the fastest measured: mt * nr
  // accumulators plus nr weight vectors fit 32 zmm (AVX-512) or, per 8-lane half, 16 ymm
  // (AVX2). Larger M: several tiles over an fp32 copy of each chunk of Wq (tile()).
  int mt = BUF_MT, nr = BUF_NR;
#if SSD_AVX512
  if (A.M <= 2) { mt = int(A.M); nr = 8; }
  else if (A.M <= 3) { mt = 3; nr = 6; }
  else if (A.M <= 6) { mt = int(A.M); nr = 4; }
  else if (A.M <= 8) { mt = int(A.M); nr = 3; }
  else if (A.M <= 12) { mt = int(A.M); nr = 2; }
#else
  if (A.M == 1) { mt = 1; nr = 8; }
  else if (A.M == 2) { mt = 2; nr = 4; }
  else if (A.M <= 4) { mt = int(A.M); nr = 3; }
  else if (A.M <= 6) { mt = int(A.M); nr = 2; }
#endif
  if (A.M > mt) {  // even tiles
    const int64_t mb = std::min(A.M, MC), tiles = (mb + mt - 1) / mt;
    mt = int((mb + tiles - 1) / tiles);
  }
  // Work units of whole multiples of 120 rows (every nr divides 120), about 8 per thread:
  // long runs for the prefetchers, still several to rebalance when a core is busy.
  const int64_t nb = std::max<int64_t>(1, A.N / (120 * 8 * at::get_num_threads())) * 120;
  const int64_t units = (A.N + nb - 1) / nb;
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t, int64_t) {
    alignas(64) float acc[(MC * NR_MAX + 16) * 16], sums[MC * NR_MAX + 16], wbuf[NR_MAX * KC];
    for (;;) {  // dynamic schedule: a thread slowed by a busy core takes fewer units
      const int64_t u = next.fetch_add(1, std::memory_order_relaxed);
      if (u >= units) break;
      const int64_t nbeg = u * nb, nend = std::min(A.N, nbeg + nb);
      switch (nr) {
        case 8: unit<8>(A, nbeg, nend, mt, acc, sums, wbuf); break;
        case 6: unit<6>(A, nbeg, nend, mt, acc, sums, wbuf); break;
        case 4: unit<4>(A, nbeg, nend, mt, acc, sums, wbuf); break;
        case 3: unit<3>(A, nbeg, nend, mt, acc, sums, wbuf); break;
        case 2: unit<2>(A, nbeg, nend, mt, acc, sums, wbuf); break;
        default: unit<1>(A, nbeg, nend, mt, acc, sums, wbuf); break;
      }
    }
  };
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), units);
  if (nt <= 1) body(0, 1);
  else at::parallel_for(0, nt, 1, body);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "ssd linear_int8: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
              scale.scalar_type() == at::kFloat, "ssd linear_int8: fp32 x, int8 w, fp32 scale");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu(),
              "ssd linear_int8: CPU only");
  TORCH_CHECK(x.size(1) == w.size(1), "ssd linear_int8: x.size(1) != w.size(1)");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "ssd linear_int8: rows of x must be contiguous");
  TORCH_CHECK(w.stride(1) == 1 || w.size(1) <= 1, "ssd linear_int8: rows of w must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.is_contiguous(),
              "ssd linear_int8: bad scale");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* bp = nullptr;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->dim() == 1 && b->size(0) == N &&
                b->is_contiguous() && b->device().is_cpu(), "ssd linear_int8: bad bias");
    bp = b->data_ptr<float>();
  }
  if (M == 0 || N == 0) return y;
  run(Args{x.data_ptr<float>(), x.stride(0), w.data_ptr<int8_t>(), w.stride(0),
           scale.data_ptr<float>(), bp, y.data_ptr<float>(), N, M, N, K});
  return y;
}

}  // namespace

SSD_LIBRARY(m) {
  m.def("linear_int8(Tensor x, Tensor w, Tensor scale, Tensor? b) -> Tensor");
  m.impl("linear_int8", c10::DispatchKey::CPU, &linear_int8);
}
