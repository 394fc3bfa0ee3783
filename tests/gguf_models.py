"""GGUF files for tests: a real model cut to its first layers, and quantised copies of small
random-weight Hugging Face folders, written with the gguf package as llama.cpp lays them out."""
import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from ssd.models.config import MODEL_TYPES
from ssd.models.gguf_file import (GEMMA, GEMMA_LAYER_NAMES, GGUF_LINK, GLOBAL_NAMES, LAYER_NAMES, PHI3_LAYER_NAMES,
                                  copy_metadata)
from ssd.store import resolve_model

def truncated_gguf(src: Path, dst: Path, layers: int) -> Path:
    """`src` with only its first `layers` decoder layers, as a GGUF at `dst`; returns the model
    folder the store prepares for it."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    copy_metadata(reader, writer, skip=(f"{arch}.block_count",))
    writer.add_block_count(layers)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        raw = np.array(t.data)
        writer.add_tensor(t.name, raw, raw_dtype=t.tensor_type if raw.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return resolve_model(dst)


def _gguf_name(hf: str, arch: str) -> str:
    name = hf.removeprefix("model.")
    stem, _, kind = name.rpartition(".")
    names = GEMMA_LAYER_NAMES if arch in GEMMA else PHI3_LAYER_NAMES if arch == "phi3" else LAYER_NAMES
    for ours, theirs in names.items():
        if stem.endswith("." + theirs) and stem.startswith("layers."):
            return f"blk.{stem.split('.')[1]}.{ours}.{kind}"
    for theirs, ours in ((v, k) for k, v in GLOBAL_NAMES.items()):
        if f"model.{stem}" == theirs or stem == theirs:
            return f"{ours}.{kind}"
    raise KeyError(hf)


EXPERT = re.compile(r"(.*\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
KINDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def stack_experts(state: dict) -> dict:
    """A mixture's per-expert tensors (the hub's layout) stacked [experts, rows, cols] under
    the names the GGUF's ffn_*_exps map to; Mixtral's router under Qwen's name."""
    out, experts = {}, {}
    for name, w in state.items():
        m = EXPERT.fullmatch(name)
        if m:
            prefix, e, kind = m.groups()
            experts.setdefault((prefix, KINDS.get(kind, kind)), {})[int(e)] = w
        else:
            out[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = w
    for (prefix, kind), mats in experts.items():
        out[f"{prefix}mlp.experts.{kind}.weight"] = torch.stack([mats[e] for e in sorted(mats)])
    return out


# Types the gguf package cannot quantise: random blocks, their fp16 scale (at this byte offset of
# a block) set so that the weights' spread is near the random models' 0.02.
RANDOM_SCALE = {gguf.GGMLQuantizationType.Q3_K: (108, 5e-4), gguf.GGMLQuantizationType.IQ4_NL: (0, 3e-4),
                gguf.GGMLQuantizationType.Q2_K: (80, 4e-3), gguf.GGMLQuantizationType.IQ4_XS: (0, 2e-5),
                gguf.GGMLQuantizationType.MXFP4: (0, None)}  # (an 8-bit exponent: random_blocks)


def random_blocks(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, rng) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(int(np.prod(shape)) // block, size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.MXFP4:  # an E8M0 scale byte: 2^-8, then 4-bit floats
        raw[:, 0] = 127 - 8
        return raw.reshape(*shape[:-1], -1)
    at, d = RANDOM_SCALE[qtype]
    raw[:, at:at + 2] = np.full(len(raw), d, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == gguf.GGMLQuantizationType.Q2_K:  # dmin too
        raw[:, at + 2:at + 4] = raw[:, at:at + 2]
    return raw.reshape(*shape[:-1], -1)


def write_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """The shape keys and SmolLM2's tokenizer (the tiny models' vocabulary)."""
    from ssd.store import gguf_path
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 1e4)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_local_experts"):
        writer.add_expert_count(cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    copy_metadata(gguf.GGUFReader(gguf_path("smollm2-135m-instruct")), writer, prefix="tokenizer.")


def quantized_copy(folder: Path, dst: Path, qtype: gguf.GGMLQuantizationType, metadata: bool = False) -> Path:
    """A model folder beside `folder` (a Hugging Face one, fp32 safetensors) whose weights are a
    GGUF: every matrix quantised to `qtype` by the gguf package (random blocks of `qtype` where
    the package cannot quantise to it: RANDOM_SCALE), vectors in F32, llama's q/k
    rows interleaved as llama.cpp's converter does (Mistral and Mixtral are written as `llama`,
    as llama.cpp does), Gemma's norms stored as 1 + w, a mixture's experts stacked. Config and tokenizer are copied as they are."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = MODEL_TYPES.get(cfg["model_type"], cfg["model_type"])
    arch = "llama" if arch in ("mistral", "mixtral") else arch
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dst.mkdir(parents=True, exist_ok=True)
    path = dst / "weights.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if metadata:  # what llama.cpp's converter writes, so that the store can prepare the file alone
        write_metadata(writer, cfg)
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    state = stack_experts(state)
    rng = np.random.default_rng(0)
    for name, w in state.items():
        w = w.float().numpy()
        gname = _gguf_name(name, arch)
        if arch in GEMMA and gname.endswith("norm.weight"):
            w = w + np.float32(1)
        n = heads if ".attn_q." in gname else kv_heads if ".attn_k." in gname else None
        if arch == "llama" and n is not None:  # llama.cpp's permute, which the loader undoes
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if w.ndim >= 2 and "ffn_gate_inp" not in gname:  # llama.cpp keeps routers in F32
            writer.add_tensor(gname, random_blocks(w.shape, qtype, rng) if qtype in RANDOM_SCALE
                              else gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    (dst / GGUF_LINK).symlink_to(path)
    return dst
