"""Batch-invariant fp32 CPU attention over the paged KV cache.

Why: exact speculative decoding needs the attention output of a query to have the same bits
whether it is scored alone (decode), among the K+1 queries of a verification, in a prefill
chunk of any length, next to other sequences, or as a node of a draft tree. SDPA's CPU
kernels block queries and keys differently for each shape, so they do not. Here every
query head's output is a fixed sequence of fp32 operations on its own q, its own keys and
values, and its own length L, whatever T, the other queries, their rows or the thread count:

    x_s = fma(q[D-1], k_s[D-1], ... fma(q[1], k_s[1], fma(q[0], k_s[0], 0)))   (s < L;
          one fma chain per key, d ascending)
    m   = max_s x_s: 16 lanes, lane j = max over s = j (mod 16) ascending, then lanes
          folded as a halving tree (j with j+8, then +4, +2, +1); max(a, b) = a > b ? a : b
    t_s = (x_s - m) * c,  c = fp32(scale * log2(e))
    p_s = exp2(t_s): n = (t + 1.5*2^23) - 1.5*2^23 (round to nearest), f = t - n,
          P(f) = fma chain (Horner) of the degree-6 Cephes exp2f polynomial in f,
          p = P(f) * 2^n (exponent add), and p = 0 where t < -125
    l   = sum_s p_s: 16 lanes, lane j = sum over s = j (mod 16) ascending from 0, then
          the halving tree (j + (j+8), then +4, +2, +1)
    out[d] = a_d / l,  a_d = fma chain over s ascending of p_s * v_s[d] from 0

Query t sees the keys in cache slots ``rows[q_row[t], :q_len[t]]``: a causal chunk shares
one row with growing lengths; a draft-tree node can have a row of its own (prefix plus its
ancestors). Slots past a query's length are never read for it (nor past the longest length
of a row at all).

Speed comes from the schedule, which never changes the arithmetic above. The queries of a
row are sorted by length and tiled, up to 48 query heads that share a kv head (16 queries
of SmolLM2, 8 of Qwen2.5-1.5B), so every key and value loaded serves all rows of the tile.
Keys are transposed 32 at a time into a [D, 32] block, and the scores are register tiles of
FMAs with the keys across the vector lanes (no horizontal sums); the exp is a vector
polynomial; P.V is register tiles with d across the lanes, over chunks of 64 keys that stay
in L1 while every row block of the tile passes over them (the running sums wait in memory
between chunks, exactly). (tile, kv head) work items go to the threads dynamically, largest
first. Padding lanes (keys past L in the last vector) add exact zeros to the sums.

The C++ source (ssd/kernels/csrc/attention.cpp) is built on first use by
ssd/kernels/build.py for the best ISA the CPU has: ``avx512`` (16 lanes), ``avx2`` (8
lanes, AVX2 + FMA) or ``portable`` (plain C++, std::fma). Lanes only ever hold independent
chains (keys for the scores, d for P.V, the 16 sum/max lanes as two 8-lane halves with
AVX2), so all three give the same bits. If no build is possible, :func:`attention` computes
in plain torch, one query at a time (ssd/kernels/fallback.py: batch-invariant too, slower, not
these bits); it returns None only for tensors it does not take (CUDA, not fp32), and the
caller then uses SDPA.
"""
from __future__ import annotations

import torch

from ssd.kernels.build import CppKernel


_KERNEL = CppKernel("attention")


def available(variant: str | None = None) -> bool:
    """Whether the kernel can run here (builds it on first call)."""
    return _KERNEL.op("attention", variant) is not None


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.dtype is torch.float32 and k_cache.dtype is torch.float32 and q.is_cpu and k_cache.is_cpu


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
              q_row: torch.Tensor, q_len: torch.Tensor, scale: float, softcap: float | None = None,
              variant: str | None = None) -> torch.Tensor | None:
    """out[t] = softmax(scale * q[t] K^T) V over the keys in slots rows[q_row[t], :q_len[t]];
    with softcap, softmax(softcap * tanh(scale * q[t] K^T / softcap)) V (Gemma 2).

    q: [T, H, D]; caches: [slots, G, D]. Returns None for tensors that are not fp32 on the CPU
    (the caller then uses SDPA)."""
    if not supported(q, k_cache):
        return None
    op = _KERNEL.op("attention", variant)
    if op is None:
        return _by_query(q, k_cache, v_cache, rows, q_row, q_len, scale, softcap)
    return op(q.contiguous(), k_cache, v_cache, rows, q_row, q_len, scale, softcap or 0.0)


def _by_query(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
              q_row: torch.Tensor, q_len: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """The same attention in plain torch where the kernel cannot run: each query alone, through
    calls whose shapes depend only on its own number of keys, so it is batch-invariant."""
    h, d = q.shape[1:]
    g = k_cache.shape[1]
    out = torch.empty_like(q)
    for t, (r, n) in enumerate(zip(q_row.tolist(), q_len.tolist())):
        slots = rows[r, :n]
        keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # [G, L, D]
        heads = q[t].reshape(g, h // g, d).clone()  # grouped by kv head; a fresh copy (alignment)
        scores = (heads @ keys.transpose(1, 2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores, dim=-1)
        out[t] = (weights @ values).view(h, d)
    return out
