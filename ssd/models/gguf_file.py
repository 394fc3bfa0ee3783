"""GGUF model files (llama, qwen2, qwen3, gemma2, gemma3): reading them safely, the Hugging Face style folder
the engine keeps beside one (config.json, generation_config.json, tokenizer files and a
`model.gguf` link to the file itself), and the file's tensors, either as their raw quantised
blocks (what the CPU kernels compute on) or dequantised to fp32, bit-identical to what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)` holds."""

import json
import mmap
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ssd.errors import ModelFileError, UnsupportedModelError
from ssd.models.names import GGUF_LINK

# (llama.cpp writes Mistral models as `llama`.)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
GEMMA = ("gemma2", "gemma3")

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one matrix
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, every expert's matrices stacked [experts, rows, cols],
    # Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Phi-3's ffn_up holds the gate and up projections stacked, as Hugging Face's gate_up_proj.
PHI3_LAYER_NAMES = {**LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
# Gemma's four norms a layer (models/decoder.py, DecoderLayer).
GEMMA_LAYER_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Precomputed rope frequencies (llama 3.1 GGUFs); Hugging Face derives them from the config.
SKIPPED = {"rope_freqs.weight"}
# Phi-3's LongRoPE factors: read into config.json's rope_scaling (_write_config).
ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """Hugging Face name of a llama.cpp tensor name, e.g. blk.3.attn_q.weight."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    names = GEMMA_LAYER_NAMES if arch in GEMMA else PHI3_LAYER_NAMES if arch == "phi3" else LAYER_NAMES
    if len(parts) == 1 and stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    raise UnsupportedModelError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row interleaving llama.cpp's converter applies to q/k of `llama` models
    (same as transformers' LlamaTensorProcessor._reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader, key: str, default=None):
    """A metadata value from a GGUFIndex or from the gguf package's GGUFReader."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents() if hasattr(field, "contents") else field


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
    experts = _field(reader, f"{arch}.expert_count")
    if arch == "llama" and experts:  # Mixtral: llama.cpp writes it as `llama` with experts
        d.update(model_type="mixtral", num_local_experts=int(experts),
                 num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count")))
        arch_class = "MixtralForCausalLM"
    else:
        arch_class = ARCHITECTURES[arch]
    factors = {ROPE_FACTORS[t.name]: np.asarray(t.data, dtype=np.float32).tolist()
               for t in reader.tensors if t.name in ROPE_FACTORS}
    if factors:  # Phi-3 LongRoPE: the factors are tensors of the file, the rest metadata
        original = _field(reader, f"{arch}.rope.scaling.original_context_length") or d["max_position_embeddings"]
        d["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(original),
                             "long_factor": factors.get("long_factor", factors.get("short_factor")),
                             "short_factor": factors.get("short_factor", factors.get("long_factor"))}
        attn = _field(reader, f"{arch}.rope.scaling.attn_factor")
        if attn is not None:
            d["rope_scaling"]["attention_factor"] = float(attn)
        d.pop("rope_parameters", None)
    d.update(architectures=[arch_class], tie_word_embeddings=tied, dtype="float32",
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
    tok.save_pretrained(out)  # without a chat template (a base model) chat requests get a clear error


def open_gguf(path: str | os.PathLike) -> "GGUFIndex":
    """The file's tensor index and the few metadata values the engine needs, read without the
    gguf package's reader (which builds a Python object per vocabulary entry: seconds per
    load). Every count and size is checked against the file before it is used, so a file
    that is not a GGUF, is cut short, or announces absurd sizes is a ModelFileError and
    nothing is allocated from what it claims. The tensors are views of one memory map."""
    try:
        return GGUFIndex(Path(path))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelFileError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass
class IndexedTensor:
    name: str
    tensor_type: "gguf.GGMLQuantizationType"  # noqa: F821
    shape: tuple[int, ...]  # GGUF order: innermost (row length) first
    data: np.ndarray  # uint8 view of its bytes (F32/F16/BF16: of its values)


class GGUFIndex:
    def __init__(self, path: Path):
        import gguf

        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(min(size, 64 << 20))  # metadata and tensor infos come first
        pos = 0

        def take(fmt: str):
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > len(head):
                raise ValueError(f"the header ends early (byte {pos} of {len(head)})")
            out = struct.unpack_from("<" + fmt, head, pos)
            pos += n
            return out[0] if len(out) == 1 else out

        def string() -> str:
            nonlocal pos
            n = take("Q")
            if pos + n > len(head):
                raise ValueError(f"a string of {n} bytes runs past the header")
            pos += n
            return head[pos - n:pos].decode()

        def value(kind: int):
            nonlocal pos
            if kind in _SCALARS:
                return take(_SCALARS[kind])
            if kind == _STRING:
                return string()
            if kind != _ARRAY:
                raise ValueError(f"unknown metadata type {kind}")
            inner, count = take("I"), take("Q")
            if count > len(head):
                raise ValueError(f"an array of {count} entries is larger than the file")
            if inner in _SCALARS:  # skipped without reading: the engine needs no numeric arrays
                pos += count * struct.calcsize(_SCALARS[inner])
                return None
            if inner == _STRING:  # the vocabulary, merges: walked by their lengths, none kept
                for _ in range(count):
                    pos += 8 + _U64.unpack_from(head, pos)[0]
                if pos > len(head):
                    raise ValueError(f"an array of {count} strings runs past the header")
                return None
            for _ in range(count):  # arrays of arrays: walk, keep none
                value(inner)
            return None

        if take("4s") != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        if version not in (2, 3) or n_tensors > size or n_kv > size:
            raise ValueError(f"version {version} with {n_tensors} tensors and {n_kv} keys")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = string()
            self.fields[key] = value(take("I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = string(), take("I")
            if n_dims > 4:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = [take("Q") for _ in range(n_dims)]
            kind, offset = take("I"), take("Q")
            infos.append((name, tuple(dims), gguf.GGMLQuantizationType(kind), offset))
        align = int(self.fields.get("general.alignment") or 32)
        start = -(-pos // align) * align
        self.map = np.memmap(path, dtype=np.uint8, mode="c")
        flat = self.map.view(np.ndarray)  # (a memmap's own slices cost ~1 ms each)
        self.tensors: list[IndexedTensor] = []
        for name, dims, kind, offset in infos:
            block, nbytes = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims, dtype=object))
            if count % block:
                raise ValueError(f"tensor {name}: {count} values are not whole blocks of {block}")
            n = count // block * nbytes
            if start + offset + n > size:
                raise ValueError(f"tensor {name} ({n} bytes at {start + offset}) runs past the end of the file "
                                 f"({size} bytes): the file is truncated or corrupt")
            data = flat[start + offset:start + offset + n]
            if kind.name in ("F32", "F16"):
                data = data.view(np.float32 if kind.name == "F32" else np.float16)
            self.tensors.append(IndexedTensor(name, kind, dims, data))

    def unmap(self, data: np.ndarray) -> None:
        """Drop the pages under `data` (a view of this file) from this process's memory: loading
        reads each tensor once, so its pages need not stay resident (they stay in the page
        cache; a later read maps them again)."""
        mm = getattr(self.map, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or data.size == 0:
            return
        base = self.map.__array_interface__["data"][0]
        start = data.__array_interface__["data"][0] - base
        if not 0 <= start < len(mm):
            return  # a copy (a reordered tensor), not a view of the map
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(len(mm), -(-(start + data.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def architecture(reader, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r} in {path}; supported: {', '.join(ARCHITECTURES)}")
    return arch


def prepare_folder(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Make `out_dir` (replaced if it exists) the model folder of a GGUF file: its config,
    generation config and tokenizer as transformers reads them from the GGUF, and a link to
    the file. No weights are written. Works in a temporary sibling folder renamed at the end,
    so a folder at `out_dir` is always complete."""
    gguf_path, out = Path(gguf_path).resolve(), Path(out_dir)
    reader = open_gguf(gguf_path)
    arch = architecture(reader, gguf_path)
    for t in reader.tensors:
        if t.name not in SKIPPED and t.name not in ROPE_FACTORS:
            hf_name(t.name, arch)  # an unknown tensor fails here, not at load
    tied = all(t.name != "output.weight" for t in reader.tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_config(gguf_path, tmp, arch, reader, tied)
        _write_tokenizer(gguf_path, tmp)
        (tmp / GGUF_LINK).symlink_to(gguf_path)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass
class GGUFTensor:
    name: str  # the Hugging Face name, e.g. model.layers.3.self_attn.q_proj.weight
    qtype: "gguf.GGMLQuantizationType"  # noqa: F821
    shape: tuple[int, ...]  # torch order: [rows, cols] for a matrix
    raw: np.ndarray  # the file's bytes of it (uint8) [rows, bytes per row], or its values for F32/F16


def tensors(reader, path: Path) -> Iterator[GGUFTensor]:
    """The file's tensors under Hugging Face names, llama's q/k rows put back in the order
    transformers uses (llama.cpp's converter interleaves them): whole quantised rows move, so
    the raw blocks stay exact. Gemma's norm weights come back as transformers holds them:
    the converter stored 1 + w, transformers subtracts the 1 (in fp32, as here)."""
    arch = architecture(reader, path)
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_kv_head = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    for t in reader.tensors:
        if t.name in SKIPPED or t.name in ROPE_FACTORS:
            continue
        shape = tuple(int(n) for n in reversed(t.shape))
        raw = t.data.reshape(shape[0], -1) if len(shape) == 2 else t.data
        heads = n_head if ".attn_q." in t.name else n_kv_head if ".attn_k." in t.name else None
        if arch == "llama" and heads is not None:
            rows = np.arange(shape[0]).reshape(-1, 1)
            order = unpermute(rows, heads).reshape(-1)
            raw = raw.reshape(shape[0], -1)[order]
        if t.name.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 1:  # a [1, hidden] matrix
            shape = (1, shape[0])
        if arch in GEMMA and t.name.endswith("norm.weight"):
            raw = np.asarray(raw, dtype=np.float32) - np.float32(1)
        yield GGUFTensor(hf_name(t.name, arch), t.tensor_type, shape, raw)


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """fp32 values of a tensor, as the gguf package (and transformers) dequantise them: by the
    CPU kernel where it covers the type (bit-identical, tested, ~20x faster), else by gguf."""
    import gguf

    from ssd.kernels import quant_cpu

    if t.qtype in quant_cpu.SUPPORTED and len(t.shape) == 2 and quant_cpu.available():
        raw = torch.from_numpy(np.ascontiguousarray(t.raw).reshape(-1))
        return quant_cpu.dequant_rows(raw, t.qtype, torch.arange(t.shape[0]), t.shape[1])
    try:
        values = gguf.quants.dequantize(t.raw, t.qtype)
    except NotImplementedError:
        raise UnsupportedModelError(f"{t.name}: GGUF type {t.qtype.name} cannot be dequantised") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(t.shape))


def copy_metadata(reader, writer, *, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """Copy the metadata keys of a GGUF (the gguf package's reader) that start with `prefix`
    into a GGUFWriter, with their types (for files made from another: a truncated model, a
    random model with a real tokenizer)."""
    import gguf

    for key, field in reader.fields.items():
        if not key.startswith(prefix) or key in skip or key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), kind)

