import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ssd.kernels import attention_cpu, attention_triton, fused_cpu, fused_triton
from ssd.layers.linear import Linear
from ssd.layers.norm import RMSNorm
from ssd.layers.rotary import RotaryEmbedding


@dataclass
class AttentionBatch:
    """Where one forward pass's new tokens go in the paged KV cache, and what each may see.

    The T new tokens of all sequences are packed into one flat row for the projections.
    Token t attends to the keys in cache slots rows[q_row[t], :q_len[t]]: the tokens of a
    causal chunk share their sequence's row with growing lengths; a draft-tree node may
    have a row of its own (prefix plus ancestors).
    """

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    rows: torch.Tensor  # [R, S] cache slots of keys, padded
    q_row: torch.Tensor  # [T] row of each token
    q_len: torch.Tensor  # [T] how many keys of its row each token sees
    _windows: dict = field(default_factory=dict, repr=False, compare=False)

    def windowed(self, window: int) -> "AttentionBatch":
        """The batch of a sliding-window layer: each token sees only the last `window` of its
        keys. A key sits in its row at its position (a chain's or a tree branch's), so token
        t's window is rows[q_row[t], q_len[t] - window:q_len[t]]: a token whose window starts
        past 0 gets a row of its own; its keys, their order and count are then the same
        whatever else is in the batch, so the attention kernel keeps its bits."""
        if window not in self._windows:
            late = (self.q_len > window).nonzero().squeeze(1)
            batch = self
            if late.numel():
                r, s = self.rows.shape  # s >= q_len > window
                starts = self.q_len[late] - window
                own = self.rows[self.q_row[late, None], starts[:, None] + torch.arange(window, device=late.device)]
                q_row, q_len = self.q_row.clone(), self.q_len.clone()
                q_row[late] = r + torch.arange(late.numel(), device=late.device)
                q_len[late] = window
                batch = AttentionBatch(self.slot_mapping, torch.cat([self.rows, F.pad(own, (0, s - window))]),
                                       q_row, q_len)
            self._windows[window] = batch
        return self._windows[window]

    @functools.cached_property
    def padded(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        """For SDPA: (index of each token in a flat [R*Q] query layout, Q, mask [R, 1, Q, S]).
        Padding queries see key 0 only, so their softmax stays finite."""
        r, s = self.rows.shape
        order = torch.argsort(self.q_row, stable=True)
        counts = torch.bincount(self.q_row, minlength=r)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(self.q_row)
        rank[order] = torch.arange(len(order), device=order.device) - starts[self.q_row[order]]
        nq = int(counts.max())
        lens = torch.ones(r * nq, dtype=torch.long, device=self.q_row.device)
        index = self.q_row * nq + rank
        lens[index] = self.q_len
        mask = torch.arange(s, device=lens.device)[None, :] < lens[:, None]
        return index, nq, mask.view(r, 1, nq, s)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool, eps: float, *,
                 scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 in_features: int | None = None):
        """scale: of the scores (None: head_dim ** -0.5); softcap: scores -> cap * tanh(scores /
        cap) before the softmax (Gemma 2); window: a sliding-window layer's keys per token;
        in_features: the width q, k and v are projected from (None: hidden; an EAGLE-3 head's
        layer reads an embedding and a hidden state side by side, 2 x hidden)."""
        super().__init__()
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap, self.window = softcap, window
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(in_features or hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.rotary = rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Contiguous first: the fused (batch-invariant) norm takes contiguous rows only, and a
            # view of the qkv output is contiguous only for one token, so a decode step and a
            # prefill or verify pass would round differently (SD != AR on near-ties).
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        k_cache, v_cache = kv[0], kv[1]
        fused = fused_triton if fused_triton.available(q) else fused_cpu
        rotated = fused.rope_cache(q, k, v, positions, self.rotary.cos, self.rotary.sin, k_cache, v_cache,
                                   batch.slot_mapping)
        if rotated is not None:
            q = rotated
        else:
            q, k = self.rotary(positions, q, k)
            k_cache.index_copy_(0, batch.slot_mapping, k)
            v_cache.index_copy_(0, batch.slot_mapping, v)
        if attention_triton.available(q):  # windows in the kernel: no host sync, so CUDA graphs can hold it
            o = attention_triton.attention(q, k_cache, v_cache, batch.rows, batch.q_row, batch.q_len, self.scale,
                                           softcap=self.softcap, window=self.window)
        else:
            if self.window is not None:
                batch = batch.windowed(self.window)
            o = attention_cpu.attention(q, k_cache, v_cache, batch.rows, batch.q_row, batch.q_len,
                                        self.scale, softcap=self.softcap)
            if o is None:
                o = self._sdpa(q, k_cache, v_cache, batch)
        return self.o_proj(o.reshape(t, self.q_size))

    def _sdpa(self, q, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        index, nq, mask = batch.padded
        r = batch.rows.shape[0]
        qp = q.new_zeros(r * nq, self.num_heads, self.head_dim)
        qp[index] = q
        qp = qp.view(r, nq, self.num_heads, self.head_dim).transpose(1, 2)
        keys = k_cache[batch.rows].transpose(1, 2)
        values = v_cache[batch.rows].transpose(1, 2)
        if self.softcap is None:
            o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, enable_gqa=True, scale=self.scale)
        else:  # SDPA has no soft-capping: the same steps in plain torch
            groups = self.num_heads // self.num_kv_heads
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            scores = torch.tanh((qp @ keys.transpose(-1, -2)) * self.scale / self.softcap) * self.softcap
            o = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values
        return o.transpose(1, 2).reshape(r * nq, self.num_heads, self.head_dim)[index]
