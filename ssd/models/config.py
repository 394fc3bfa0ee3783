import json
from dataclasses import dataclass, field
from pathlib import Path

from ssd.errors import ModelFileError, UnsupportedModelError

# What each supported architecture adds to the plain Llama block (Gemma: see GEMMA below).
ARCH_FEATURES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "phi3": {"qkv_bias": False, "qk_norm": False},
    "qwen2moe": {"qkv_bias": True, "qk_norm": False},
    "qwen3moe": {"qkv_bias": False, "qk_norm": True},
    "mixtral": {"qkv_bias": False, "qk_norm": False},
    "gemma2": {"qkv_bias": False, "qk_norm": False},
    "gemma3": {"qkv_bias": False, "qk_norm": True},
}
# Hugging Face model_type -> our architecture name (the GGUF's general.architecture).
MODEL_TYPES = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# Gemma's block: the input embedding scaled by sqrt(hidden), RMSNorm by (1 + w), norms after
# attention and after the MLP as well as before them, GeGLU (tanh), query scaling by
# query_pre_attn_scalar, alternating sliding-window and global layers.
GEMMA = ("gemma2", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelConfig:
    """The shape of a decoder-only model, read from a Hugging Face config.json."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    gemma_norms: bool = False  # Gemma: RMSNorm by (1 + w), and norms after attention and the MLP too
    embed_scale: float | None = None  # the input embedding times this (Gemma: sqrt(hidden))
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_window: int | None = None  # keys a sliding layer's token sees, itself included
    layer_types: list[str] = field(default_factory=list)  # per layer SLIDING or FULL; [] all FULL
    local_rope_theta: float | None = None  # the RoPE base of sliding layers, if their own (Gemma 3)
    rotary_dim: int | None = None  # a head's first dimensions that RoPE turns; None: all (Phi's partial rotary)
    num_experts: int = 0  # mixture of experts (layers/moe.py); 0: dense
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = False  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    dense_layers: list[int] = field(default_factory=list)  # layers of a MoE model with a dense MLP

    def moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING and self.sliding_window is not None

    def end_ids(self, tokenizer) -> set[int]:
        """The token ids that end a sequence: the config's and its tokenizer's."""
        ids = set(self.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        arch = MODEL_TYPES.get(d.get("model_type", ""), d.get("model_type", ""))
        if arch not in ARCH_FEATURES:
            known = ", ".join(ARCH_FEATURES)
            if "text_config" in d:
                raise UnsupportedModelError(f"{arch!r} is a multimodal checkpoint; supported are text-only "
                                            f"checkpoints of: {known}")
            raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: {known}")
        # transformers >= 5 keeps rope settings in `rope_parameters` (Gemma 3: one dict per
        # layer type); older configs use `rope_theta` + `rope_scaling` (+ `rope_local_base_freq`).
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        local = rope.pop(SLIDING, None)
        rope = dict(rope.pop(FULL, rope))
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}; supported: {ROPE_TYPES}")
        rope["rope_type"] = rope_type
        if rope_type == "longrope":
            rope.setdefault("original_max_position_embeddings",
                            d.get("original_max_position_embeddings") or d.get("max_position_embeddings", 4096))
        partial = rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
        if local is not None and local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"unsupported rope scaling {local['rope_type']!r} on sliding layers")
        local_theta = (local or {}).get("rope_theta") or d.get("rope_local_base_freq")
        if arch == "qwen2" and d.get("use_sliding_window"):
            raise UnsupportedModelError("qwen2 with use_sliding_window=true is not supported")
        eos = d.get("eos_token_id")
        heads = d["num_attention_heads"]
        layers = d["num_hidden_layers"]
        features = dict(ARCH_FEATURES[arch])
        if arch in ("llama", "mistral"):
            features["qkv_bias"] = bool(d.get("attention_bias", False))
        window = d.get("sliding_window")
        types = list(d.get("layer_types") or [])
        if window and not types:  # configs older than transformers 5 leave the pattern implicit
            pattern = {"gemma2": 2, "gemma3": d.get("sliding_window_pattern", 6)}.get(arch, 1)
            types = [FULL if pattern > 1 and (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
        if len(types) not in (0, layers) or set(types) - {SLIDING, FULL}:
            raise UnsupportedModelError(f"layer_types {types} do not name {layers} layers of {SLIDING}/{FULL}")
        gemma = arch in GEMMA
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
        if act not in acts:
            raise UnsupportedModelError(f"unsupported activation {act!r}; supported: {', '.join(acts)}")
        experts = d.get("num_experts") or d.get("num_local_experts") or 0
        step = d.get("decoder_sparse_step") or 1
        dense = sorted({*d.get("mlp_only_layers", []), *(i for i in range(layers) if (i + 1) % step)}) if experts else []
        return cls(
            num_experts=experts,
            experts_per_token=d.get("num_experts_per_tok", 0) if experts else 0,
            expert_intermediate_size=(d.get("moe_intermediate_size") or d["intermediate_size"]) if experts else 0,
            normalize_expert_weights=bool(d.get("norm_topk_prob", arch == "mixtral")),
            shared_expert_intermediate_size=(d.get("shared_expert_intermediate_size") or 0) if experts else 0,
            dense_layers=dense,
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            hidden_act=acts[act],
            gemma_norms=gemma,
            embed_scale=d["hidden_size"] ** 0.5 if gemma else None,
            query_scale=d["query_pre_attn_scalar"] ** -0.5 if gemma and d.get("query_pre_attn_scalar") else None,
            attn_softcap=d.get("attn_logit_softcapping") or None,
            final_softcap=d.get("final_logit_softcapping") or None,
            sliding_window=int(window) if window and SLIDING in types else None,
            layer_types=types if window else [],
            local_rope_theta=float(local_theta) if local_theta else None,
            rotary_dim=None if partial == 1.0 else int((d.get("head_dim") or d["hidden_size"] // heads) * partial),
            **features,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelFileError(f"cannot read {path}: {e}") from e
        cfg = cls.from_dict(d)
        gen = Path(folder) / "generation_config.json"
        if gen.exists():  # generation_config may list more end-of-turn tokens
            eos = json.loads(gen.read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
            cfg.eos_token_ids += [e for e in extra if e not in cfg.eos_token_ids]
        return cfg
