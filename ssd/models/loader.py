from pathlib import Path

import torch
from safetensors import safe_open

from ssd.errors import ModelFileError
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM

# Our fused matrices and the Hugging Face tensors they are stacked from, in order.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"no .safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise ModelFileError(f"cannot read weights {f}: {e}") from e
    return tensors


def to_engine_names(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to DecoderLM's and stack the fused projections."""
    out = {}
    for name, t in hf.items():
        if name.startswith("model."):
            name = name[len("model."):]
        out[name] = t
    for i in range(cfg.num_layers):
        for fused, parts in FUSED.items():
            names = [f"layers.{i}.{p}" for p in parts]
            if all(n in out for n in names):
                out[f"layers.{i}.{fused}"] = torch.cat([out.pop(n) for n in names])
            elif any(n in out for n in names):
                raise ModelFileError(f"layer {i}: only some of {parts} are present")
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def load_model(folder: Path, device: torch.device, dtype: torch.dtype) -> DecoderLM:
    cfg = ModelConfig.from_folder(folder)
    weights = to_engine_names(read_safetensors(folder), cfg)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ModelFileError(f"weights in {folder} do not fit the {cfg.arch} config: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device).eval()
