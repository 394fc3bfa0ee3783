"""Paged attention for CUDA, in Triton: decode, verify and draft-tree rows over the paged cache.

The same contract as the CPU kernel (attention_cpu.py) and AttentionBatch: query t sees the
keys in cache slots ``rows[q_row[t], :q_len[t]]`` (a sliding-window layer: the last `window`
of them). One program serves one token and one kv head: it loads the token's query heads of
that group and walks the keys from the first (or the window's first) in tiles of BLOCK keys,
with an online softmax. Nothing in that walk depends on the other tokens of the call, their
number or their rows, so a query's output has the same bits in a decode step, a verify pass,
a tree step or a prefill chunk (batch-invariant, as exact speculation needs), and no split of
the keys among programs changes with the batch.

It reads q_len on the device and never syncs with the host, so a CUDA graph can capture it
(ssd/engine/cuda_graphs.py). On a CPU it runs only under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without triton: the callers keep SDPA
    triton = None

BLOCK = 64  # keys per tile


def available(q: torch.Tensor) -> bool:
    """Whether the layers use the kernel for q: on CUDA, with triton installed."""
    return triton is not None and q.is_cuda


if triton is not None:
    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, rows_ptr, q_row_ptr, q_len_ptr, row_stride, key_stride, scale, softcap,
                          window, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                          D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                          WINDOW: tl.constexpr, IEEE: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(q_row_ptr + t)
        n = tl.load(q_len_ptr + t)
        start = 0
        if WINDOW:
            start = tl.maximum(n - window, 0)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        gd_mask = (g < GROUP)[:, None] & (d < D)[None, :]
        heads = h * GROUP + g
        q = tl.load(q_ptr + (t * KV_HEADS * GROUP + heads)[:, None] * D + d[None, :], mask=gd_mask, other=0.0)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D_P], tl.float32)
        for s0 in range(start, n, BLOCK_N):
            s = s0 + tl.arange(0, BLOCK_N)
            live = s < n
            slot = tl.load(rows_ptr + row.to(tl.int64) * row_stride + s * key_stride, mask=live, other=0).to(tl.int64)
            kv_mask = live[:, None] & (d < D)[None, :]
            at = (slot * KV_HEADS + h)[:, None] * D + d[None, :]
            k = tl.load(k_ptr + at, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + at, mask=kv_mask, other=0.0)
            if IEEE:
                x = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                x = tl.dot(q, tl.trans(k))
            x = x * scale
            if SOFTCAP:  # cap * tanh(x / cap), tanh from exp (no tanh in tl)
                x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
            x = tl.where(live[None, :], x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(x - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / total[:, None]
        tl.store(o_ptr + (t * KV_HEADS * GROUP + heads)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gd_mask)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
              q_row: torch.Tensor, q_len: torch.Tensor, scale: float, softcap: float | None = None,
              window: int | None = None) -> torch.Tensor:
    """q [T, heads, D]; k_cache/v_cache [slots, kv_heads, D]; rows [R, S] slots (int32 or int64,
    any strides: the captured steps keep them key-major); q_row, q_len [T].
    Returns [T, heads, D] in q's dtype."""
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    if t == 0:
        return out
    _attention_kernel[(t, kv_heads)](
        q.contiguous(), k_cache, v_cache, out, rows, q_row, q_len, rows.stride(0), rows.stride(1), scale,
        softcap or 1.0, window or 0, KV_HEADS=kv_heads, GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)), D=dim, D_P=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=BLOCK, SOFTCAP=softcap is not None, WINDOW=window is not None, IEEE=q.dtype is torch.float32)
    return out
