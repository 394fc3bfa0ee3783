"""Convert a GGUF file (llama, qwen2, qwen3) into a Hugging Face style folder of fp32
safetensors, config.json, generation_config.json and tokenizer files.

The tensors written are bit-identical to what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)` holds."""

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ssd.errors import ModelFileError, UnsupportedModelError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Precomputed rope frequencies (llama 3.1 GGUFs); Hugging Face derives them from the config.
SKIPPED = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str:
    """Hugging Face name of a llama.cpp tensor name, e.g. blk.3.attn_q.weight."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    raise UnsupportedModelError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row interleaving llama.cpp's converter applies to q/k of `llama` models
    (same as transformers' LlamaTensorProcessor._reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]],
                      desc: str) -> None:
    """Write fp32 tensors one at a time, so only one dequantised tensor is in memory."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f, tqdm(total=offset, desc=desc, unit="B", unit_scale=True) as bar:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, load in tensors:
            arr = np.ascontiguousarray(load(), dtype="<f4")
            if arr.shape != shape:
                raise ModelFileError(f"{name}: dequantised shape {arr.shape}, expected {shape}")
            f.write(arr.data)
            bar.update(arr.nbytes)


def _write_config(gguf_path: Path, out: Path, arch: str, reader, tied: bool) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    d = config.to_dict()
    # Drop the GGUF loading hints, the temporary source path and generic PretrainedConfig noise.
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "transformers_version",
                "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "return_dict",
                "output_attentions", "output_hidden_states", "is_encoder_decoder"):
        d.pop(key, None)
    rope = dict(d.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or _field(reader, f"{arch}.rope.freq_base", 10000.0)
    # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta/rope_scaling.
    d["rope_theta"] = float(theta)
    d["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        d["head_dim"] = int(head_dim)
    d.update(architectures=[ARCHITECTURES[arch]], tie_word_embeddings=tied, dtype="float32",
             torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")

    # eos from the GGUF plus its end-of-turn token, when it names a different one.
    eos = list(dict.fromkeys(
        i for i in (d.get("eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")) if i is not None))
    gen = GenerationConfig(bos_token_id=d.get("bos_token_id"), pad_token_id=d.get("pad_token_id"),
                           eos_token_id=eos[0] if len(eos) == 1 else eos or None)
    gen.save_pretrained(out)


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template:
        raise ModelFileError(f"{gguf_path} has no chat template (tokenizer.chat_template)")
    tok.save_pretrained(out)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert `gguf_path` into the folder `out_dir` (replaced if it exists) and return it.

    Works in a temporary sibling folder renamed at the end, so a folder at `out_dir`
    is always complete."""
    import gguf

    gguf_path, out = Path(gguf_path).resolve(), Path(out_dir)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read GGUF file {gguf_path}: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r} in {gguf_path}; supported: {', '.join(ARCHITECTURES)}")
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_kv_head = _field(reader, f"{arch}.attention.head_count_kv", n_head)

    def loader(t) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            if arch == "llama" and ".attn_q." in t.name:
                w = unpermute(w, n_head)
            elif arch == "llama" and ".attn_k." in t.name:
                w = unpermute(w, n_kv_head)
            return w
        return load

    tensors = [(hf_name(t.name), tuple(int(n) for n in reversed(t.shape)), loader(t))
               for t in reader.tensors if t.name not in SKIPPED]
    tied = all(t.name != "output.weight" for t in reader.tensors)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_safetensors(tmp / "model.safetensors", tensors, desc=f"convert {gguf_path.name}")
        _write_config(gguf_path, tmp, arch, reader, tied)
        _write_tokenizer(gguf_path, tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
