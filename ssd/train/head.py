"""An EAGLE-3 head to train: the arithmetic of ssd/speculative/draft/eagle.py's EagleHead in
plain torch (autograd), its tensors under the authors' names, and saved in the authors' layout
(config.json with draft_vocab_size, model.safetensors with fc, midlayer.*, norm, lm_head, d2t,
t2d), which the engine loads as any head people bring.

Training-time test (EAGLE-3): a head drafts from the target's states for its first token and
from its own output states after that, so it is trained on both. Step 0's row at position t
reads the token at t + 1 and the target's states at t; step s's row for the same base t sits at
position t + s, reads the token at t + s + 1 and step s - 1's output state, and attends to step
0's rows at positions <= t and to its own base's rows of steps 1..s (what the engine's KV cache
holds when it drafts s tokens past the target's last state). Each row predicts the target's
choice after its token.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ssd.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class HeadShape:
    """A head's shape; the target's width, vocabulary and RoPE come from the target."""

    hidden_size: int  # the target's width (the head reads the target's embedding)
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float

    def config(self) -> dict:
        """config.json in the EAGLE-3 authors' layout."""
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "num_hidden_layers": 1, "attention_bias": False, "hidden_act": "silu",
                "tie_word_embeddings": False}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TrainHead(nn.Module):
    def __init__(self, shape: HeadShape, draft_to_target: torch.Tensor, max_positions: int):
        super().__init__()
        h, q, kv, eps = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
            shape.rms_norm_eps
        self.shape = shape
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.hidden_norm, self.input_layernorm, self.post_attention_layernorm, self.norm = (
            RMSNorm(h, eps) for _ in range(4))
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(2 * h, n, bias=False) for n in (q, kv, kv))
        self.o_proj = nn.Linear(q, h, bias=False)
        self.gate_proj, self.up_proj = (nn.Linear(h, shape.intermediate_size, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(shape.intermediate_size, h, bias=False)
        self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(shape.head_dim, max_positions, shape.rope_theta, {})
        self.register_buffer("draft_to_target", draft_to_target.long(), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    @torch.no_grad()
    def start_from(self, target: nn.Module, chunk: int = 256) -> None:
        """The output side from the target's: its final norm, and its output layer's rows of the
        head's vocabulary, read through the target's own lm_head (any weight format) one block
        of unit vectors at a time. The head then starts in the space the target predicts in
        and learns the step ahead, instead of a vocabulary's worth of rows from noise."""
        self.norm.weight.copy_(target.norm.weight.float())
        h = self.shape.hidden_size
        for i in range(0, h, chunk):
            unit = torch.eye(h)[i:i + chunk].contiguous()
            self.lm_head.weight[:, i:i + chunk] = target.lm_head(unit).float()[:, self.draft_to_target].T

    def forward(self, embeds: torch.Tensor, states: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """One sequence: embeds [T, H] (the target's embedding of every token), states [T, 3H]
        (the target's, at each position). Returns each step's logits over the draft vocabulary:
        step s's [T - 1 - s] rows for bases t = 0 .. T - 2 - s (row t reads token t + s + 1)."""
        n = embeds.shape[0]
        h = self.fc(states[:n - 1])
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        for s in range(steps):
            rows = n - 1 - s
            if rows <= 0:
                break
            h = h[:rows]
            normed = self.hidden_norm(h)
            x = torch.cat([self.input_layernorm(embeds[s + 1:s + 1 + rows]), normed], dim=-1)
            attn, k, v = self._attention(x, s, keys, values)
            keys.append(k)
            values.append(v)
            h = h + attn
            y = self.post_attention_layernorm(h)
            h = h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
            out.append(self.lm_head(self.norm(h)))
        return out

    def _attention(self, x: torch.Tensor, step: int, keys: list[torch.Tensor], values: list[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step `step`'s attention (module doc): its rows for bases 0..R-1 against step 0's rows
        at bases <= t and the rows of steps 1..step at base t."""
        sh = self.shape
        rows = x.shape[0]
        pos = torch.arange(rows) + step
        q = self.q_proj(x).view(rows, sh.num_heads, sh.head_dim)
        k = self.k_proj(x).view(rows, sh.num_kv_heads, sh.head_dim)
        v = self.v_proj(x).view(rows, sh.num_kv_heads, sh.head_dim)
        q, k = self.rotary(pos, q, k)
        group = sh.num_heads // sh.num_kv_heads
        ks = [kk[:rows] for kk in keys] + [k]
        vs = [vv[:rows] for vv in values] + [v]
        # scores against step 0's keys: causal over bases; against later steps' keys: the same base only
        scale = sh.head_dim ** -0.5
        qh = q.transpose(0, 1)  # [heads, R, d]
        k0 = ks[0].repeat_interleave(group, 1).transpose(0, 1)  # [heads, R, d]
        v0 = vs[0].repeat_interleave(group, 1).transpose(0, 1)
        causal = torch.ones(rows, rows, dtype=torch.bool).tril()
        scores = [(qh @ k0.transpose(1, 2) * scale).masked_fill(~causal, float("-inf"))]
        for kk in ks[1:]:
            scores.append((qh * kk.repeat_interleave(group, 1).transpose(0, 1)).sum(-1, keepdim=True) * scale)
        p = torch.softmax(torch.cat(scores, -1), -1)
        o = p[..., :rows] @ v0
        for j, vv in enumerate(vs[1:]):
            o = o + p[..., rows + j:rows + j + 1] * vv.repeat_interleave(group, 1).transpose(0, 1)
        return self.o_proj(o.transpose(0, 1).reshape(rows, -1)), k, v

    def _named(self) -> dict[str, nn.Module]:
        """The modules holding its weights, by the EAGLE-3 authors' names."""
        names = {"fc": self.fc, "norm": self.norm, "lm_head": self.lm_head,
                 "midlayer.hidden_norm": self.hidden_norm, "midlayer.input_layernorm": self.input_layernorm,
                 "midlayer.post_attention_layernorm": self.post_attention_layernorm}
        names |= {f"midlayer.self_attn.{p}": getattr(self, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        return names | {f"midlayer.mlp.{p}": getattr(self, p) for p in ("gate_proj", "up_proj", "down_proj")}

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start from a head's weights under the authors' names (a head people bring, or one
        trained before: EagleWeights.tensors)."""
        for n, m in self._named().items():
            m.weight.copy_(tensors[f"{n}.weight"].float())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the EAGLE-3 authors' names, with d2t (offsets) and t2d."""
        out = {f"{n}.weight": m.weight.detach().contiguous().clone() for n, m in self._named().items()}
        ids = self.draft_to_target.cpu()
        t2d = torch.zeros(self.shape.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return out | {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors(), folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(self.shape.config(), indent=2) + "\n")
