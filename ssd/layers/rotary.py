import math

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict, max_positions: int) -> torch.Tensor:
    """head_dim: the rotated dimensions (Phi's partial rotary: fewer than a head's)."""
    kind = scaling.get("rope_type", "default")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if kind == "longrope":  # Phi-3: per-frequency factors, the long ones where the context passes the original
        long = max_positions > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def attention_factor(scaling: dict, max_positions: int) -> float:
    """LongRoPE's scale of cos and sin (1 for every other kind)."""
    if scaling.get("rope_type") != "longrope":
        return 1.0
    original = scaling["original_max_position_embeddings"]
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout, with cos/sin tables precomputed for every position, over
    the first `rotary_dim` dimensions of a head (all of them but for Phi's partial rotary)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        # Real tables even when the model is built on the meta device for loading.
        with torch.device("cpu"):
            inv_freq = inverse_frequencies(rotary_dim, theta, scaling, max_positions)
            freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = attention_factor(scaling, max_positions)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x of shape [tokens, heads, head_dim] by its token's position."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        rd = cos.shape[-1]
        out = []
        for x in xs:
            x, rest = x[..., :rd], x[..., rd:]
            half = rd // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            y = (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))
            out.append(torch.cat((y, rest), dim=-1) if rest.shape[-1] else y)
        return tuple(out)
