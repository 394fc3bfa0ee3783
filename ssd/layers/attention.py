from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssd.layers.norm import RMSNorm
from ssd.layers.rotary import RotaryEmbedding


@dataclass
class AttentionBatch:
    """Where one forward pass's new tokens go in the paged KV cache, and what each may see.

    The T new tokens of all sequences are packed into one flat row for the projections;
    attention itself runs on a padded [B, Q] layout so one SDPA call serves sequences of
    different lengths.
    """

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    kv_slots: torch.Tensor  # [B, S] cache slots of each sequence's keys (padded)
    q_index: torch.Tensor | None  # [T] place of each new token in the flat [B*Q] layout; None if B == 1
    num_queries: int  # Q, the padded number of new tokens per sequence
    mask: torch.Tensor | None  # [B, 1, Q, S] bool, True where a query may attend; None: all


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
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
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv[0], kv[1]
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)

        b, nq = batch.kv_slots.shape[0], batch.num_queries
        if batch.q_index is None:
            qp = q.view(1, t, self.num_heads, self.head_dim)
        else:
            qp = q.new_zeros(b * nq, self.num_heads, self.head_dim)
            qp[batch.q_index] = q
            qp = qp.view(b, nq, self.num_heads, self.head_dim)
        keys = k_cache[batch.kv_slots].transpose(1, 2)
        values = v_cache[batch.kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values,
                                           attn_mask=batch.mask, enable_gqa=True)
        o = o.transpose(1, 2).reshape(b * nq, self.q_size)
        if batch.q_index is not None:
            o = o[batch.q_index]
        return self.o_proj(o)
