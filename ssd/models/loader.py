import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from ssd.errors import ModelFileError, SSDError
from ssd.layers.linear import Linear
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM

QUANTIZATIONS = ("int8",)

# Our fused matrices and the Hugging Face tensors they are stacked from, in order.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def weight_files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"no .safetensors weights in {folder}")
    return files


def load_tokenizer(folder: Path):
    """The model's own tokenizer (a transformers fast tokenizer)."""
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise ModelFileError(f"cannot load the tokenizer in {folder}: {str(e).strip().splitlines()[0]}") from e


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = weight_files(folder)
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


def load_model(folder: Path, device: torch.device, dtype: torch.dtype,
               quantize: str | None = None) -> DecoderLM:
    """quantize="int8": every Linear (q/k/v/o, gate_up, down, lm_head) gets weight-only int8
    (for a draft model: its numerics change only the acceptance rate, never the output)."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise SSDError(f"unknown quantization {quantize!r}; known: {', '.join(QUANTIZATIONS)}")
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
    del weights  # the model holds the only references: quantizing frees each fp32 matrix
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if quantize == "int8":
        quantize_int8(model)
    return model.to(device).eval()


def quantize_int8(model: DecoderLM) -> None:
    """Weight-only int8 for every Linear; the input embedding keeps its fp32 table (a tied
    lm_head gets an int8 copy). The loaded tensors are views of one memory map of the
    safetensors file, unmapped only once none is left: the tensors that stay fp32 get their
    own memory first, then each Linear drops its fp32 weight as it is quantized."""
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if not (isinstance(module, Linear) and name == "weight"):
                    p.data = p.data.clone()
        for module in model.modules():
            if isinstance(module, Linear):
                module.quantize_int8()


_loaded: "weakref.WeakValueDictionary[tuple, DecoderLM]" = weakref.WeakValueDictionary()


def shared_model(folder: Path, device: torch.device, dtype: torch.dtype, quantize: str | None = None) -> DecoderLM:
    """Load a model, or hand back the copy another LLM already holds: weights are read-only
    at inference, so engines of the same model (an AR, an SD and an SSD engine side by side
    in a benchmark) share one copy."""
    key = (str(Path(folder).resolve()), str(device), dtype, quantize)
    model = _loaded.get(key)
    if model is None:
        model = _loaded[key] = load_model(folder, device, dtype, quantize=quantize)
    return model
