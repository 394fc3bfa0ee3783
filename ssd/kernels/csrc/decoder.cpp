// Built by ssd/kernels/build.py; the Python side and the why: ssd/kernels/decoder_cpu.py.
//
// layers(x, ...): the decoder layers of a dense model on GGUF-block weights (Llama, Mistral, Qwen2,
// Qwen3, Phi-3, Gemma 2 and 3), one op for the whole stack. Each layer makes the calls
// DecoderLayer.forward makes, in the same order and on the same ops (the quant, fused and
// attention kernels through the dispatcher; silu / gelu, mul and add from ATen), so the result
// has the bits of the Python loop:
//   h = rms_norm(x, w_attn);  q, k, v = split(qlinear(h, Wqkv) + b)
//   [Qwen3, Gemma 3: q, k = rms_norm(q, w_q), rms_norm(k, w_k) per head]
//   q = rope_cache(q, k, v -> cache)  (a sliding layer: its own cos/sin where the model has them)
//   o = qlinear(attention(q, cache), Wo)  (a sliding layer: the windowed rows, AttentionBatch.windowed)
//   x = x + o                                        [Gemma: x + rms_norm(o, w_post_attn)]
//   g, u = chunk(qlinear(rms_norm(x, w_mlp), Wgate_up));  m = qlinear(act(g) * u, Wdown)
//   x = x + m                                        [Gemma: x + rms_norm(m, w_post_ffw)]
// taps: the layers (ascending, 0..L) whose entering stream x is returned too (L: the stream after
// the last layer), the features an EAGLE-3 head reads.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include "library.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

namespace {

using QLinear = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, int64_t,
                           const std::optional<at::Tensor>&, bool);
using QLinearEach = std::vector<at::Tensor>(at::TensorList, at::TensorList, at::IntArrayRef, at::IntArrayRef, int64_t);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using RopeCache = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, double);

template <typename Sig>
static c10::TypedOperatorHandle<Sig> find(const std::string& ns, const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), "").typed<Sig>();
}

// experts(x, weights, chosen, ...): a mixture's experts on GGUF-block weights (ssd/layers/moe.py,
// SparseMoE.forward), the loop over the experts hit in C++: for each expert e, the rows routed
// to it (row-major order of chosen == e) go through qlinear(Wgate_up[e]), act(g) * u and
// qlinear(Wdown[e]), are scaled by their router weight and index_add-ed into the output in
// ascending expert order; the quant kernel computes each part's rows alone, so this has the bits
// of the Python loop (one call an expert), with fewer calls.
// gate_up: 2 parts an expert (gate, up); down: 1 an expert; act: 0 silu, 1 gelu tanh.
// The quant kernel's two matmuls, looked up once per op call (a lookup by name costs more than
// a small expert's product).
struct QuantOps {
  c10::TypedOperatorHandle<QLinear> qlinear;
  c10::TypedOperatorHandle<QLinearEach> qlinear_each;
  explicit QuantOps(const std::string& ns)
      : qlinear(find<QLinear>(ns, "qlinear")), qlinear_each(find<QLinearEach>(ns, "qlinear_each")) {}
};

static at::Tensor run_experts(const QuantOps& ops, const at::Tensor& x, const at::Tensor& weights,
                              const at::Tensor& chosen, at::TensorList gate_up, at::IntArrayRef gate_up_types,
                              at::TensorList down, at::IntArrayRef down_types, int64_t inter, int64_t act) {
  const int64_t E = int64_t(down.size()), T = x.size(0), k = chosen.size(1), hidden = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && chosen.dim() == 2 && chosen.size(0) == T &&
                  chosen.scalar_type() == at::kLong && weights.sizes() == chosen.sizes() &&
                  int64_t(gate_up.size()) == 2 * E && int64_t(gate_up_types.size()) == 2 * E &&
                  int64_t(down_types.size()) == E,
              "ssd experts: bad shapes");
  const auto& qlinear = ops.qlinear;
  const auto& qlinear_each = ops.qlinear_each;
  const at::Tensor ch = chosen.contiguous();
  const int64_t* c = ch.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> tokens(E), ranks(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < k; ++r) {
      const int64_t e = c[t * k + r];
      TORCH_CHECK(0 <= e && e < E, "ssd experts: expert ", e, " out of range");
      tokens[e].push_back(t);
      ranks[e].push_back(r);
    }
  const std::optional<at::Tensor> none;
  // Experts routed the same rows (every expert of a decode step) share one gate_up call: the
  // kernel computes each part's rows alone, so their bits are those of separate calls, and the
  // call's fixed costs are paid once.
  std::vector<std::vector<int64_t>> groups;
  for (int64_t e = 0; e < E; ++e) {
    if (tokens[e].empty()) continue;
    auto same = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return tokens[g[0]] == tokens[e]; });
    if (same == groups.end()) groups.push_back({e});
    else same->push_back(e);
  }
  std::vector<at::Tensor> acts(E), toks(E);
  for (const auto& group : groups) {
    const at::Tensor tok = at::tensor(tokens[group[0]], at::kLong);
    std::vector<at::Tensor> parts;
    std::vector<int64_t> types, rows;
    for (int64_t e : group) {
      parts.insert(parts.end(), {gate_up[2 * e], gate_up[2 * e + 1]});
      types.insert(types.end(), {gate_up_types[2 * e], gate_up_types[2 * e + 1]});
      rows.insert(rows.end(), {inter, inter});
    }
    at::Tensor gu = qlinear.call(x.index({tok}), parts, types, rows, hidden, none, false);
    for (size_t j = 0; j < group.size(); ++j) {
      const int64_t e = group[j];
      at::Tensor g = gu.narrow(1, 2 * inter * j, inter);
      acts[e] = (act == 1 ? at::gelu(g, "tanh") : at::silu(g)) * gu.narrow(1, 2 * inter * j + inter, inter);
      toks[e] = tok;
    }
  }
  // Every expert's down projection in one pass over the threads, each on its own rows.
  std::vector<at::Tensor> xs, downs;
  std::vector<int64_t> types, rows, hit;
  for (int64_t e = 0; e < E; ++e)
    if (acts[e].defined()) {
      xs.push_back(acts[e]);
      downs.push_back(down[e]);
      types.push_back(down_types[e]);
      rows.push_back(hidden);
      hit.push_back(e);
    }
  const std::vector<at::Tensor> ys = qlinear_each.call(xs, downs, types, rows, inter);
  at::Tensor out = at::zeros_like(x);
  for (size_t i = 0; i < hit.size(); ++i) {  // in ascending expert order, as the Python loop adds them
    const int64_t e = hit[i];
    out.index_add_(0, toks[e], ys[i] * weights.index({toks[e], at::tensor(ranks[e], at::kLong)}).unsqueeze(1));
  }
  return out;
}

at::Tensor experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& chosen, at::TensorList gate_up,
                   at::IntArrayRef gate_up_types, at::TensorList down, at::IntArrayRef down_types, int64_t inter,
                   int64_t act, std::string quant_ns) {
  return run_experts(QuantOps(quant_ns), x, weights, chosen, gate_up, gate_up_types, down, down_types, inter, act);
}

// parts: every linear's packed parts, layer by layer, linears in the order qkv, o, gate_up, down;
// nparts[4 * l + j]: how many parts linear j of layer l has (types, part_rows: one per part).
// dims: num_heads, num_kv_heads, head_dim, intermediate_size, norms a layer (2, or Gemma's 4:
// input, post-attention, pre-MLP, post-MLP), activation (0 silu, 1 gelu tanh), and for a mixture
// of experts: top-k, renormalise (0/1), an expert's intermediate size. moe: per layer 1 where
// the MLP is a mixture (its router in routers, fp32; its experts' parts in expert_gate_up, 2 an
// expert, and expert_down, MoE layer after MoE layer; nparts 0 for its gate_up and down). qkv_bias: one per
// layer, or none; qk_norms: per layer the q and the k norm's weights (Qwen3), or none. sliding:
// per layer 1 for a sliding-window layer, which reads rows_w / q_row_w / q_len_w (the windowed
// batch) and cos_w / sin_w (its RoPE).
std::tuple<at::Tensor, std::vector<at::Tensor>> layers(at::Tensor x, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& rows,
                  const at::Tensor& q_row, const at::Tensor& q_len, const at::Tensor& kv, const at::Tensor& cos,
                  const at::Tensor& sin, at::TensorList norms, at::TensorList parts, at::IntArrayRef types,
                  at::IntArrayRef part_rows, at::IntArrayRef nparts, at::TensorList qkv_bias,
                  at::TensorList qk_norms, at::IntArrayRef dims, at::IntArrayRef sliding, const at::Tensor& rows_w,
                  const at::Tensor& q_row_w, const at::Tensor& q_len_w, const at::Tensor& cos_w,
                  const at::Tensor& sin_w, at::IntArrayRef moe, at::TensorList routers, at::TensorList expert_gate_up,
                  at::IntArrayRef expert_gate_up_types, at::TensorList expert_down, at::IntArrayRef expert_down_types,
                  double eps, double scale, double softcap, at::IntArrayRef taps, std::string quant_ns,
                  std::string fused_ns, std::string attention_ns, std::string linear_ns) {
  const int64_t L = kv.size(0), hq = dims[0], hk = dims[1], d = dims[2], inter = dims[3], nn = dims[4];
  const bool gelu = dims[5] == 1, gemma = nn == 4;
  const int64_t top_k = dims[6], normalize = dims[7], expert_inter = dims[8];
  const int64_t E = routers.empty() ? 0 : routers[0].size(0);
  TORCH_CHECK(int64_t(moe.size()) == L, "ssd layers: moe needs one flag a layer");
  const int64_t hidden = x.size(1), qs = hq * d, ks = hk * d;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && kv.dim() == 5 && kv.size(1) == 2,
              "ssd layers: x [T, hidden] fp32, kv [layers, 2, slots, kv_heads, head_dim]");
  TORCH_CHECK((nn == 2 || nn == 4) && int64_t(sliding.size()) == L, "ssd layers: bad dims or sliding");
  TORCH_CHECK(int64_t(norms.size()) == nn * L && int64_t(nparts.size()) == 4 * L &&
                  (qkv_bias.empty() || int64_t(qkv_bias.size()) == L) &&
                  (qk_norms.empty() || int64_t(qk_norms.size()) == 2 * L) && types.size() == parts.size() &&
                  part_rows.size() == parts.size(),
              "ssd layers: the weights do not match ", L, " layers");
  const QuantOps quant(quant_ns);
  const auto& qlinear = quant.qlinear;
  const auto rms_norm = find<RmsNorm>(fused_ns, "rms_norm");
  const auto rope_cache = find<RopeCache>(fused_ns, "rope_cache");
  const auto attention = find<Attention>(attention_ns, "attention");
  using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
  const auto router_linear = find<Linear>(linear_ns, "linear");
  size_t r = 0;  // the next MoE layer's router
  const std::optional<at::Tensor> none;
  size_t p = 0;  // the next linear's first part
  auto linear = [&](int64_t l, int j, const at::Tensor& in, int64_t K, const std::optional<at::Tensor>& bias) {
    const size_t n = size_t(nparts[4 * l + j]);
    TORCH_CHECK(p + n <= parts.size(), "ssd layers: too few weight parts");
    at::Tensor y = qlinear.call(in, parts.slice(p, n), types.slice(p, n), part_rows.slice(p, n), K, bias, false);
    p += n;
    return y;
  };
  const int64_t T = x.size(0);
  std::vector<at::Tensor> tapped;
  size_t next_tap = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (next_tap < taps.size() && taps[next_tap] == l) {
      tapped.push_back(x);  // x is never written in place: a later layer makes a new tensor
      ++next_tap;
    }
    at::Tensor k_cache = kv[l][0], v_cache = kv[l][1];
    const std::optional<at::Tensor> bias = qkv_bias.empty() ? none : std::optional<at::Tensor>(qkv_bias[l]);
    at::Tensor qkv = linear(l, 0, rms_norm.call(x, norms[nn * l], eps), hidden, bias);
    at::Tensor q = qkv.narrow(1, 0, qs).view({T, hq, d});
    at::Tensor k = qkv.narrow(1, qs, ks).view({T, hk, d});
    at::Tensor v = qkv.narrow(1, qs + ks, ks).view({T, hk, d});
    if (!qk_norms.empty()) {
      q = rms_norm.call(q.contiguous(), qk_norms[2 * l], eps);
      k = rms_norm.call(k.contiguous(), qk_norms[2 * l + 1], eps);
    }
    const bool w = sliding[l] != 0;
    q = rope_cache.call(q, k, v, positions, w ? cos_w : cos, w ? sin_w : sin, k_cache, v_cache, slots);
    at::Tensor o = attention.call(q.contiguous(), k_cache, v_cache, w ? rows_w : rows, w ? q_row_w : q_row,
                                  w ? q_len_w : q_len, scale, softcap);
    o = linear(l, 1, o.reshape({T, qs}), qs, none);
    x = x + (gemma ? rms_norm.call(o, norms[nn * l + 1], eps) : o);
    at::Tensor h = rms_norm.call(x, norms[nn * l + (gemma ? 2 : 1)], eps), m;
    if (moe[l]) {  // SparseMoE.route, then its experts (a mixture without a shared expert)
      TORCH_CHECK(r < routers.size(), "ssd layers: too few routers");
      at::Tensor probs = at::softmax(router_linear.call(h, routers[r], none), -1);
      auto [weights, chosen] = at::topk(probs, top_k, -1);
      if (normalize) {
        at::Tensor total = weights.select(1, 0);
        for (int64_t j = 1; j < top_k; ++j) total = total + weights.select(1, j);
        weights = weights / total.unsqueeze(1);
      }
      m = run_experts(quant, h, weights, chosen, expert_gate_up.slice(2 * E * r, 2 * E),
                      expert_gate_up_types.slice(2 * E * r, 2 * E), expert_down.slice(E * r, E),
                      expert_down_types.slice(E * r, E), expert_inter, gelu ? 1 : 0);
      ++r;
    } else {
      at::Tensor gu = linear(l, 2, h, hidden, none);
      at::Tensor g = gu.narrow(1, 0, inter);
      at::Tensor act = (gelu ? at::gelu(g, "tanh") : at::silu(g)) * gu.narrow(1, inter, inter);
      m = linear(l, 3, act, inter, none);
    }
    x = x + (gemma ? rms_norm.call(m, norms[nn * l + 3], eps) : m);
  }
  TORCH_CHECK(p == parts.size(), "ssd layers: weight parts left over");
  if (next_tap < taps.size() && taps[next_tap] == L) {
    tapped.push_back(x);
    ++next_tap;
  }
  TORCH_CHECK(next_tap == taps.size(), "ssd layers: taps must be ascending layer ids in 0..", L);
  return {x, tapped};
}

}  // namespace

SSD_LIBRARY(m) {
  m.def("layers(Tensor x, Tensor positions, Tensor slots, Tensor rows, Tensor q_row, Tensor q_len, Tensor(a!) kv, "
        "Tensor cos, Tensor sin, Tensor[] norms, Tensor[] parts, int[] types, int[] part_rows, int[] nparts, "
        "Tensor[] qkv_bias, Tensor[] qk_norms, int[] dims, int[] sliding, Tensor rows_w, Tensor q_row_w, Tensor q_len_w, "
        "Tensor cos_w, Tensor sin_w, int[] moe, Tensor[] routers, Tensor[] expert_gate_up, int[] expert_gate_up_types, "
        "Tensor[] expert_down, int[] expert_down_types, float eps, float scale, float softcap, int[] taps, "
        "str quant_ns, str fused_ns, str attention_ns, str linear_ns) -> (Tensor, Tensor[])");
  m.impl("layers", c10::DispatchKey::CPU, &layers);
  m.def("experts(Tensor x, Tensor weights, Tensor chosen, Tensor[] gate_up, int[] gate_up_types, Tensor[] down, "
        "int[] down_types, int inter, int act, str quant_ns) -> Tensor");
  m.impl("experts", c10::DispatchKey::CPU, &experts);
}
