"""EAGLE-3 draft heads as people bring them: one decoder layer that reads the target's hidden
states from three of its layers, with a draft vocabulary of its own (docs/algorithm.md, "EAGLE-3 heads").

Two layouts load as they are:
- the EAGLE-3 authors' (SafeAILab/EAGLE): a config.json with `draft_vocab_size`, weights
  `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d` in pytorch_model.bin or
  model.safetensors, no embedding (the target's is used), the target's layers 2, L // 2 and
  L - 3 (the states entering them);
- vLLM's speculators (speculators_model_type "eagle3"): the same tensors with `layers.0.` for
  `midlayer.`, the layer's shape in `transformer_layer_config`, the target layers in
  `eagle_aux_hidden_state_layer_ids` where given, optionally an embedding of its own.

d2t[i] is an offset: the head's token i is the target's token i + d2t[i]; t2d marks those
target tokens. A head is checked against the target it is meant for (hidden size,
vocabulary, layer ids) when it loads, and a mismatch names what differs.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ssd.errors import ModelFileError, UnsupportedModelError
from ssd.layers.attention import Attention, AttentionBatch
from ssd.layers.linear import Linear
from ssd.layers.mlp import MLP
from ssd.layers.norm import RMSNorm
from ssd.layers.rotary import RotaryEmbedding
from ssd.models.config import ModelConfig

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the authors' loader tries the .bin first; either is read
# speculators options that change the head's arithmetic beyond the authors' layer, not implemented here.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class EagleConfig:
    """A head's shape and what it reads of its target."""

    layout: str  # "eagle3" (the authors') or "speculators"
    hidden_size: int  # H, the head's own width
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    vocab_size: int  # the target's vocabulary, Vt
    draft_vocab_size: int  # the head's, Vd
    target_hidden_size: int  # the width of each target state it reads (the authors' config: H unless given)
    layer_ids: tuple[int, ...] | None  # the target layers whose entering states it reads; None: 2, L // 2, L - 3
    attention_bias: bool
    qk_norm: bool  # a Qwen3-style draft layer (speculators' qwen3): RMSNorm on each head's q and k
    norm_before_residual: bool  # the residual is the normed hidden state (speculators' option)

    @classmethod
    def from_folder(cls, folder: Path) -> "EagleConfig":
        path = Path(folder) / "config.json"
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{path}: cannot read the head's configuration: {e}") from None
        if d.get("speculators_model_type") == "eagle3":
            return cls._speculators(d, path)
        if "draft_vocab_size" in d:
            return cls._layer(d, d, "eagle3", d.get("target_hidden_size"), None, False, path)
        raise ModelFileError(f"{path}: not an EAGLE-3 head (no draft_vocab_size, and no speculators_model_type "
                             "'eagle3')")

    @classmethod
    def _speculators(cls, d: dict, path: Path) -> "EagleConfig":
        on = [flag for flag in UNSUPPORTED_FLAGS if d.get(flag)]
        if on:
            raise UnsupportedModelError(f"{path}: {', '.join(on)} set: this engine reads EAGLE-3 heads without them")
        layer = d.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ModelFileError(f"{path}: a speculators config without transformer_layer_config")
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        return cls._layer(layer, d, "speculators", d.get("target_hidden_size"), None if ids is None else tuple(ids),
                          bool(d.get("norm_before_residual", False)), path)

    @classmethod
    def _layer(cls, layer: dict, top: dict, layout: str, target_hidden: int | None, ids: tuple[int, ...] | None,
               norm_before_residual: bool, path: Path) -> "EagleConfig":
        try:
            hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
            return cls(layout, hidden, int(layer["intermediate_size"]), heads,
                       int(layer.get("num_key_value_heads") or heads), int(layer.get("head_dim") or hidden // heads),
                       float(layer.get("rms_norm_eps", 1e-6)), float(layer.get("rope_theta", 10000.0)),
                       dict(layer.get("rope_scaling") or {}), int(layer["vocab_size"]), int(top["draft_vocab_size"]),
                       int(target_hidden or hidden), ids, bool(layer.get("attention_bias", False)),
                       layer.get("model_type") == "qwen3", norm_before_residual)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFileError(f"{path}: the head's configuration lacks or mangles {e}") from None

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose entering hidden states the head reads, low to high."""
        return self.layer_ids if self.layer_ids is not None else (2, num_layers // 2, num_layers - 3)

    def check_target(self, target: ModelConfig, has_embedding: bool) -> None:
        """Refuse a target this head was not made for, naming the mismatch."""
        wrong = []
        if self.target_hidden_size != target.hidden_size:
            wrong.append(f"it reads hidden states of width {self.target_hidden_size}, the target's are "
                         f"{target.hidden_size} wide")
        if self.vocab_size != target.vocab_size:
            wrong.append(f"its tokens map into a vocabulary of {self.vocab_size}, the target's has {target.vocab_size}")
        layers = self.target_layers(target.num_layers)
        rising = list(layers) == sorted(set(layers))
        if len(layers) != 3 or not rising or not 0 <= layers[0] <= layers[-1] <= target.num_layers:
            wrong.append(f"it reads target layers {list(layers)}, the target has {target.num_layers} (three rising "
                         f"ids wanted, {target.num_layers} the stream after the last layer)")
        if not has_embedding and self.hidden_size != target.hidden_size:
            wrong.append(f"it has no embedding of its own and its width {self.hidden_size} is not the target's "
                         f"{target.hidden_size}")
        if wrong:
            raise UnsupportedModelError(f"this EAGLE-3 head does not fit the target: {'; '.join(wrong)}")


def is_eagle_head(folder: Path) -> bool:
    """Whether a model folder holds an EAGLE-3 head (either layout) rather than a model."""
    try:
        d = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and ("draft_vocab_size" in d or d.get("speculators_model_type") == "eagle3")


def expected_shapes(cfg: EagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a head in the authors' names, and its shape."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"fc.weight": (h, 3 * cfg.target_hidden_size),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
              "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
              "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
              "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
              "lm_head.weight": (cfg.draft_vocab_size, h)}
    if cfg.attention_bias:
        shapes.update({f"midlayer.self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
    if cfg.qk_norm:
        shapes.update({"midlayer.self_attn.q_norm.weight": (cfg.head_dim,),
                       "midlayer.self_attn.k_norm.weight": (cfg.head_dim,)})
    return shapes


@dataclass
class EagleWeights:
    """A head's tensors under the authors' names, its map to the target's tokens, and its own
    embedding where the file has one (else the target's is used)."""

    config: EagleConfig
    tensors: dict[str, torch.Tensor]
    draft_to_target: torch.Tensor  # [Vd] the target's token id of each of the head's tokens
    embedding: torch.Tensor | None


def load_eagle(folder: Path, target: ModelConfig) -> EagleWeights:
    """The head in `folder`, checked against its config and against `target`."""
    folder = Path(folder)
    cfg = EagleConfig.from_folder(folder)
    raw = _read_weights(folder)
    tensors = {("midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n): t
               for n, t in raw.items()}
    embedding = tensors.pop("embed_tokens.weight", None)
    cfg.check_target(target, embedding is not None)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(tensors))
    unknown = sorted(set(tensors) - set(shapes))
    wrong = [f"{n} is {tuple(tensors[n].shape)}, its config says {shapes[n]}" for n in shapes
             if n in tensors and tuple(tensors[n].shape) != shapes[n]]
    if missing or unknown or wrong:
        raise ModelFileError(f"{folder}: the head's tensors do not match its config: "
                             + "; ".join([f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
                                         + wrong))
    if embedding is not None and tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ModelFileError(f"{folder}: embed_tokens is {tuple(embedding.shape)}, not "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
    return EagleWeights(cfg, tensors, _token_map(cfg, d2t, t2d, folder), embedding)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            try:
                return load_file(path) if name.endswith(".safetensors") else torch.load(path, map_location="cpu",
                                                                                          weights_only=True)
            except Exception as e:  # a corrupt file: safetensors and torch raise their own kinds
                raise ModelFileError(f"{path}: cannot read the head's weights: {type(e).__name__}: {e}") from None
    raise ModelFileError(f"{folder}: no weights ({' or '.join(WEIGHT_FILES)})")


def _token_map(cfg: EagleConfig, d2t: torch.Tensor | None, t2d: torch.Tensor | None, folder: Path) -> torch.Tensor:
    """Each of the head's tokens as the target's token id (d2t's offsets added), checked: ids
    rising inside the target's vocabulary, and where t2d is given, exactly the tokens it marks."""
    vd, vt = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is None:
        if vd != vt:
            raise ModelFileError(f"{folder}: a draft vocabulary of {vd} tokens of {vt} needs d2t")
        return torch.arange(vt)
    if tuple(d2t.shape) != (vd,):
        raise ModelFileError(f"{folder}: d2t is {tuple(d2t.shape)}, not ({vd},)")
    ids = torch.arange(vd) + d2t.long()
    if not (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < vt):
        raise ModelFileError(f"{folder}: d2t does not map the head's tokens to rising ids inside the target's "
                             f"vocabulary of {vt}")
    if t2d is not None:
        marked = torch.zeros(vt, dtype=torch.bool)
        marked[ids] = True
        if tuple(t2d.shape) != (vt,) or not torch.equal(t2d.bool(), marked):
            raise ModelFileError(f"{folder}: t2d does not mark exactly the target tokens d2t maps to")
    return ids


class EagleHead(nn.Module):
    """An EAGLE-3 head of the engine's layers (batch-invariant on the CPU), its attention over a
    paged KV cache of its own ([2, slots, kv_heads, head_dim]). One step reads, per row, a
    token's embedding and the hidden state before it: the target's three states joined (width
    3 x Ht, brought to H by fc) or the head's own last output (width H), and gives the draft
    vocabulary's logits and its output state, which the next step reads."""

    def __init__(self, weights: EagleWeights, embed: nn.Module, max_positions: int):
        """embed: the head's embedding where the file has one, else the target's (the caller's)."""
        super().__init__()
        cfg, w = weights.config, weights.tensors
        h = cfg.hidden_size
        self.config, self.embed = cfg, embed
        self.fc = _linear(w["fc.weight"])
        self.hidden_norm, self.input_layernorm, self.post_attention_layernorm, self.norm = (
            _norm(w[f"{n}.weight"], cfg.rms_norm_eps) for n in ("midlayer.hidden_norm", "midlayer.input_layernorm",
                                                                 "midlayer.post_attention_layernorm", "norm"))
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        with torch.device("meta"):
            self.self_attn = Attention(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, cfg.attention_bias,
                                       cfg.qk_norm, cfg.rms_norm_eps, in_features=2 * h)
            self.mlp = MLP(h, cfg.intermediate_size)
        self.self_attn.rotary = rotary  # its tables are real (built on the CPU whatever the device)
        attn = "midlayer.self_attn."
        self.self_attn.qkv_proj = _linear(torch.cat([w[f"{attn}{p}_proj.weight"] for p in "qkv"]),
                                          torch.cat([w[f"{attn}{p}_proj.bias"] for p in "qkv"])
                                          if cfg.attention_bias else None)
        self.self_attn.o_proj = _linear(w[f"{attn}o_proj.weight"])
        if cfg.qk_norm:
            self.self_attn.q_norm = _norm(w[f"{attn}q_norm.weight"], cfg.rms_norm_eps)
            self.self_attn.k_norm = _norm(w[f"{attn}k_norm.weight"], cfg.rms_norm_eps)
        mlp = "midlayer.mlp."
        self.mlp.gate_up_proj = _linear(torch.cat([w[f"{mlp}gate_proj.weight"], w[f"{mlp}up_proj.weight"]]))
        self.mlp.down_proj = _linear(w[f"{mlp}down_proj.weight"])
        self.lm_head = _linear(w["lm_head.weight"])
        self.register_buffer("draft_to_target", weights.draft_to_target)

    def quantize_int8(self) -> None:
        """Weight-only int8 for every matrix (the embedding, the target's or its own, stays):
        a draft's numerics change only how often its tokens are accepted."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8()

    def forward(self, tokens: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T]; states [T, 3 x Ht] (the target's, joined low to high) or [T, H] (the
        head's own); returns logits [T, Vd] over the draft vocabulary and the output states
        [T, H] (before the final norm: what the next step reads)."""
        h = self.fc(states) if states.shape[-1] != self.config.hidden_size else states
        normed = self.hidden_norm(h)
        residual = normed if self.config.norm_before_residual else h
        x = torch.cat([self.input_layernorm(self.embed(tokens)), normed], dim=-1)
        h = residual + self.self_attn(x, positions, batch, kv)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)), h


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.float(), requires_grad=False)
    return layer


def _norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = nn.Parameter(weight.float(), requires_grad=False)
    return norm
