import json
from dataclasses import dataclass, field
from pathlib import Path

from ssd.errors import ModelFileError, UnsupportedModelError

# What each supported architecture adds to the plain Llama block.
ARCH_FEATURES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}
ROPE_TYPES = ("default", "linear", "llama3")


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

    def end_ids(self, tokenizer) -> set[int]:
        """The token ids that end a sequence: the config's and its tokenizer's."""
        ids = set(self.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        arch = d.get("model_type", "")
        if arch not in ARCH_FEATURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; supported: {', '.join(ARCH_FEATURES)}")
        # transformers >= 5 keeps rope settings in `rope_parameters`; older configs use
        # `rope_theta` + `rope_scaling`.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}; supported: {ROPE_TYPES}")
        rope["rope_type"] = rope_type
        if arch == "qwen2" and d.get("use_sliding_window"):
            raise UnsupportedModelError("qwen2 with use_sliding_window=true is not supported")
        eos = d.get("eos_token_id")
        heads = d["num_attention_heads"]
        features = dict(ARCH_FEATURES[arch])
        if arch == "llama":
            features["qkv_bias"] = bool(d.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
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
