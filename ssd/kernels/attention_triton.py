"""Paged attention for CUDA, in Triton: decode, verify and draft-tree rows over the paged cache.

The same contract as the CPU kernel (attention_cpu.py) and AttentionBatch: query t sees the
keys in cache slots ``rows[q_row[t], :q_len[t]]`` (a sliding-window layer: the last `window`
of them). A program serves one token, one kv head and one split of its keys: it loads the
token's query heads of that group and walks the split's keys in tiles of BLOCK, with an online
softmax; a token with several splits has them merged in split order by a second kernel. A
token's n keys are cut into at most SPLITS splits of the smallest multiple of BLOCK that needs
no more (n <= 1,024: tiles of 64, one program each), so its splits depend on n alone, not on
the other tokens of the call, their number or their rows: a query's output has the same bits
in a decode step, a verify pass, a tree step or a prefill chunk (batch-invariant, as exact
speculation needs), and a decode step's few tokens are still read by many programs at once
(one program per token and kv head took a quarter of a small model's step: docs/kernels.md,
"GPU").

It reads q_len on the device and never syncs with the host, so a CUDA graph can capture it
(ssd/runner/cuda_graphs.py). On a CPU it runs only under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without triton: the callers keep SDPA
    triton = None

BLOCK = 64  # keys per tile, and the unit of a split's size
SPLITS = 16  # programs a token's keys are cut among at most (a kv head's), merged in a fixed order


def available(q: torch.Tensor) -> bool:
    """Whether the layers use the kernel for q: on CUDA, with triton installed."""
    return triton is not None and q.is_cuda


if triton is not None:
    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, rows_ptr, q_row_ptr, q_len_ptr,
                          row_stride, key_stride, scale, softcap, window, splits,
                          KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr,
                          D_P: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
                          WINDOW: tl.constexpr, IEEE: tl.constexpr):
        """Program (t, h, j): split j of token t's window, kv head h (split sizes: _split_size).
        A token with one split writes its output; with more, each writes its running max,
        sum and unnormalised output for _combine_kernel."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        j = tl.program_id(2)
        row = tl.load(q_row_ptr + t)
        n = tl.load(q_len_ptr + t)
        start = 0
        if WINDOW:
            start = tl.maximum(n - window, 0)
        size = _split_size(n - start, BLOCK_N, SPLITS)
        lo = start + j * size
        if lo < n:
            hi = tl.minimum(n, lo + size)
            g = tl.arange(0, GROUP_P)
            d = tl.arange(0, D_P)
            gd_mask = (g < GROUP)[:, None] & (d < D)[None, :]
            heads = h * GROUP + g
            q = tl.load(q_ptr + (t * KV_HEADS * GROUP + heads)[:, None] * D + d[None, :], mask=gd_mask, other=0.0)
            m = tl.full([GROUP_P], float("-inf"), tl.float32)
            total = tl.zeros([GROUP_P], tl.float32)
            acc = tl.zeros([GROUP_P, D_P], tl.float32)
            for s0 in range(lo, hi, BLOCK_N):
                s = s0 + tl.arange(0, BLOCK_N)
                live = s < hi
                slot = tl.load(rows_ptr + row.to(tl.int64) * row_stride + s * key_stride, mask=live,
                               other=0).to(tl.int64)
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
            if n - start <= size:
                out = acc / total[:, None]
                tl.store(o_ptr + (t * KV_HEADS * GROUP + heads)[:, None] * D + d[None, :],
                         out.to(o_ptr.dtype.element_ty), mask=gd_mask)
            else:
                part = ((t * KV_HEADS + h) * splits + j).to(tl.int64)
                tl.store(m_ptr + part * GROUP_P + g, m)
                tl.store(l_ptr + part * GROUP_P + g, total)
                tl.store(acc_ptr + (part * GROUP_P + g)[:, None] * D_P + d[None, :], acc)

    @triton.jit
    def _split_size(keys, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
        """Keys per split of a token with `keys` keys: the smallest multiple of BLOCK_N that cuts
        them into at most SPLITS splits (a function of `keys` alone: batch invariance)."""
        return BLOCK_N * tl.cdiv(keys, BLOCK_N * SPLITS)

    @triton.jit
    def _combine_kernel(o_ptr, m_ptr, l_ptr, acc_ptr, q_len_ptr, window, splits, KV_HEADS: tl.constexpr,
                        GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr):
        """Program (t, h): a token's splits merged in split order (a fixed order: the bits do
        not depend on the batch)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(q_len_ptr + t)
        start = 0
        if WINDOW:
            start = tl.maximum(n - window, 0)
        count = tl.cdiv(n - start, _split_size(n - start, BLOCK_N, SPLITS))
        if count > 1:
            g = tl.arange(0, GROUP_P)
            d = tl.arange(0, D_P)
            base = ((t * KV_HEADS + h) * splits).to(tl.int64)
            top = tl.full([GROUP_P], float("-inf"), tl.float32)
            for j in range(0, count):
                top = tl.maximum(top, tl.load(m_ptr + (base + j) * GROUP_P + g))
            total = tl.zeros([GROUP_P], tl.float32)
            acc = tl.zeros([GROUP_P, D_P], tl.float32)
            for j in range(0, count):
                w = tl.exp(tl.load(m_ptr + (base + j) * GROUP_P + g) - top)
                total += tl.load(l_ptr + (base + j) * GROUP_P + g) * w
                acc += tl.load(acc_ptr + ((base + j) * GROUP_P + g)[:, None] * D_P + d[None, :]) * w[:, None]
            out = acc / total[:, None]
            gd_mask = (g < GROUP)[:, None] & (d < D)[None, :]
            tl.store(o_ptr + (t * KV_HEADS * GROUP + h * GROUP + g)[:, None] * D + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=gd_mask)


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
    # The grid comes from the rows' width, which a captured step keeps fixed; programs past a
    # token's splits return at once.
    splits = min(SPLITS, triton.cdiv(min(rows.shape[1], window or rows.shape[1]), BLOCK))
    group_p, dim_p = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(dim))
    m = torch.empty(t, kv_heads, splits, group_p, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    acc = torch.empty(t, kv_heads, splits, group_p, dim_p, dtype=torch.float32, device=q.device)
    meta = dict(KV_HEADS=kv_heads, GROUP=group, GROUP_P=group_p, D=dim, D_P=dim_p, BLOCK_N=BLOCK, SPLITS=SPLITS,
                WINDOW=window is not None)
    _attention_kernel[(t, kv_heads, splits)](
        q.contiguous(), k_cache, v_cache, out, m, total, acc, rows, q_row, q_len, rows.stride(0), rows.stride(1),
        scale, softcap or 1.0, window or 0, splits, SOFTCAP=softcap is not None,
        IEEE=q.dtype is torch.float32, **meta)
    if splits > 1:
        _combine_kernel[(t, kv_heads)](out, m, total, acc, q_len, window or 0, splits, **meta)
    return out
