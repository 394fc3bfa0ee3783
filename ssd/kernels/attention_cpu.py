"""Batch-invariant fp32 CPU attention over the paged KV cache.

Why: exact speculative decoding needs the attention output of a query to have the same bits
whether it is scored alone (decode), among the K+1 queries of a verification, next to other
sequences padded to a common length, or as a node of a draft tree. SDPA's CPU kernels block
queries and keys differently for each shape, so they do not. Here each (query, kv head)
is computed on its own, in an order fixed by its own keys only:

    score_s = scale * dot(q, k_s)   (8 lanes over d, lane j takes d = j, j+8, ...; the
                                     D % 8 tail into lanes 0..; lanes summed as a tree)
    p_s = exp(score_s - max_s score) ; l = sum_s p_s (ascending s)
    out = (sum_s p_s * v_s (ascending s, fma per d)) / l

Query t attends to the keys in cache slots ``rows[q_row[t], :q_len[t]]``: a causal
chunk shares one row with growing lengths; a draft-tree node can have a row of its own
(the prefix plus its ancestors). Reading the cache through slots also avoids the
gather copy of the keys that SDPA needs.
"""
from __future__ import annotations

import torch

from ssd.kernels.build import CppKernel

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Fixed-order dot product: 8 lanes, tail into the first lanes, tree sum of the lanes.
static inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t D8 = D - D % 8;
  for (int64_t d = 0; d < D8; d += 8)
    for (int j = 0; j < 8; ++j) l[j] = std::fma(a[d + j], b[d + j], l[j]);
  for (int64_t d = D8; d < D; ++d) l[d - D8] = std::fma(a[d], b[d], l[d - D8]);
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                     const at::Tensor& rows, const at::Tensor& q_row, const at::Tensor& q_len,
                     double scale) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 3 && vc.dim() == 3, "ssd attention: q [T,H,D], caches [N,G,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat &&
              vc.scalar_type() == at::kFloat, "ssd attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(),
              "ssd attention: q and caches must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && q_row.scalar_type() == at::kLong &&
              q_len.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 2,
              "ssd attention: rows/q_row/q_len must be int64, rows [R,S] contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), G = kc.size(1), S = rows.size(1);
  TORCH_CHECK(kc.size(2) == D && vc.sizes() == kc.sizes() && H % G == 0,
              "ssd attention: shape mismatch");
  TORCH_CHECK(q_row.numel() == T && q_len.numel() == T, "ssd attention: q_row/q_len need T entries");
  const int64_t HG = H / G, N = kc.size(0), R = rows.size(0);
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* qr = q_row.contiguous().data_ptr<int64_t>();
  const int64_t* ql = q_len.contiguous().data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(qr[t] >= 0 && qr[t] < R && ql[t] >= 1 && ql[t] <= S, "ssd attention: bad q_row/q_len");
  at::Tensor out = at::empty({T, H, D}, q.options());
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // One work item per (query, kv head): its HG query heads share every key/value load.
  at::parallel_for(0, T * G, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(HG * S), acc(HG * D), lsum(HG);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / G, g = i % G, L = ql[t];
      const int64_t* slots = rp + qr[t] * S;
      const float* qh = qp + (t * H + g * HG) * D;
      for (int64_t s = 0; s < L; ++s) {
        TORCH_CHECK(slots[s] >= 0 && slots[s] < N, "ssd attention: slot out of range");
        const float* k = kp + (slots[s] * G + g) * D;
        for (int64_t h = 0; h < HG; ++h) p[h * S + s] = fscale * dot(qh + h * D, k, D);
      }
      for (int64_t h = 0; h < HG; ++h) {
        float* ph = p.data() + h * S;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < L; ++s) m = ph[s] > m ? ph[s] : m;
        float l = 0.f;
        for (int64_t s = 0; s < L; ++s) { ph[s] = std::exp(ph[s] - m); l += ph[s]; }
        lsum[h] = l;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < L; ++s) {
        const float* v = vp + (slots[s] * G + g) * D;
        for (int64_t h = 0; h < HG; ++h) {
          const float w = p[h * S + s];
          float* a = acc.data() + h * D;
          for (int64_t d = 0; d < D; ++d) a[d] = std::fma(w, v[d], a[d]);
        }
      }
      for (int64_t h = 0; h < HG; ++h) {
        float* o = op + (t * H + g * HG + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] / lsum[h];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(SSD_NS, m) {
  m.def("attention(Tensor q, Tensor kc, Tensor vc, Tensor rows, Tensor q_row, Tensor q_len, float scale) -> Tensor");
  m.impl("attention", c10::DispatchKey::CPU, &attention);
}
"""

_KERNEL = CppKernel("attention", _SOURCE)


def available(variant: str | None = None) -> bool:
    """Whether the kernel can run here (builds it on first call)."""
    return _KERNEL.op("attention", variant) is not None


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.dtype is torch.float32 and k_cache.dtype is torch.float32 and q.is_cpu and k_cache.is_cpu


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
              q_row: torch.Tensor, q_len: torch.Tensor, scale: float,
              variant: str | None = None) -> torch.Tensor | None:
    """out[t] = softmax(scale * q[t] K^T) V over the keys in slots rows[q_row[t], :q_len[t]].

    q: [T, H, D]; caches: [slots, G, D]. Returns None when the kernel cannot run here (the
    caller then uses SDPA)."""
    op = _KERNEL.op("attention", variant) if supported(q, k_cache) else None
    if op is None:
        return None
    return op(q.contiguous(), k_cache, v_cache, rows, q_row, q_len, scale)
