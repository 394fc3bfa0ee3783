// Built by ssd/kernels/build.py; the Python side and the why: ssd/kernels/fused_cpu.py.
//
// The small per-layer steps of a decoder, each one op instead of several torch calls:
//   rms_norm(x, w, eps)   y = w * (x / sqrt(mean(x^2) + eps)), per row
//   rope_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slots) -> q rotated
//                         RoPE (rotate-half layout) on q and k over cos's width (a head's first
//                         dimensions), k and v written to their cache slots
// fp32, CPU, rows independent: a row's result never depends on the other rows or the thread
// count. rms_norm sums x^2 in 16 lanes (lane j: i = j, j+16, ...; tail into lane i % 16), then
// ((l0+l8) + (l4+l12)) + ((l2+l10) + (l6+l14)) + ... as a fixed tree; rope_cache computes
// x*cos + (-x')*sin exactly as the torch expression it replaces (two products, one sum).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include "library.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace {

static float sum_squares(const float* x, int64_t n) {
  float l[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) l[j] = l[j] + x[i + j] * x[i + j];
  for (int j = 0; i + j < n; ++j) l[j] = l[j] + x[i + j] * x[i + j];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) l[j] = l[j] + l[j + w];
  return l[0];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
                  w.is_contiguous() && x.device().is_cpu() && x.size(-1) == w.numel(),
              "ssd rms_norm: fp32 contiguous CPU tensors, w of the last dimension's size");
  const int64_t h = w.numel(), rows = h ? x.numel() / h : 0;
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = float(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = xp + r * h;
      float* b = yp + r * h;
      const float inv = 1.f / std::sqrt(sum_squares(a, h) / float(h) + e);
      for (int64_t i = 0; i < h; ++i) b[i] = wp[i] * (a[i] * inv);
    }
  });
  return y;
}

// Rotate-half RoPE of the first r elements of one head vector of length d into out (the first
// half of them pairs with the second); elements r..d-1 are copied (Phi's partial rotary).
static inline void rotate(const float* x, const float* c, const float* s, int64_t r, int64_t d, float* out) {
  const int64_t half = r / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
  for (int64_t i = half; i < r; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
  for (int64_t i = r; i < d; ++i) out[i] = x[i];
}

at::Tensor rope_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                      const at::Tensor& slots) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "ssd rope_cache: fp32 CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2) && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) <= q.size(2) &&
                  cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes(),
              "ssd rope_cache: bad shapes");
  const int64_t T = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2), P = cos.size(0), S = k_cache.size(0);
  const int64_t r = cos.size(1);
  auto pos = positions.to(at::kLong).contiguous(), slot = slots.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T && slot.numel() == T, "ssd rope_cache: one position and one slot per token");
  const int64_t *pp = pos.data_ptr<int64_t>(), *sp = slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= pp[t] && pp[t] < P && 0 <= sp[t] && sp[t] < S, "ssd rope_cache: position or slot out of range");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty_like(qc);
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *op = out.data_ptr<float>(), *kcp = k_cache.data_ptr<float>(), *vcp = v_cache.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = cp + pp[t] * r, *s = snp + pp[t] * r;
      for (int64_t h = 0; h < hq; ++h) rotate(qp + (t * hq + h) * d, c, s, r, d, op + (t * hq + h) * d);
      for (int64_t h = 0; h < hk; ++h) {
        rotate(kp + (t * hk + h) * d, c, s, r, d, kcp + (sp[t] * hk + h) * d);
        for (int64_t i = 0; i < d; ++i) vcp[(sp[t] * hk + h) * d + i] = vp[(t * hk + h) * d + i];
      }
    }
  });
  return out;
}

}  // namespace

SSD_LIBRARY(m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_cache(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("rope_cache", c10::DispatchKey::CPU, &rope_cache);
}
