"""Loading a model's weights: from its GGUF file (the quantised blocks themselves, on a CPU,
or dequantised to fp32) or from Hugging Face safetensors."""
import contextlib
import hashlib
import json
import re
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ssd.errors import ModelFileError, SSDError, UnsupportedModelError
from ssd.kernels import quant_cpu
from ssd.kernels.prebuild import prebuild
from ssd.layers.linear import Linear, QuantEmbedding, QuantLinear
from ssd.layers.moe import DenseExperts, QuantExperts, SparseMoE
from ssd.layers.norm import RMSNorm
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM
from ssd.models.gguf_file import GGUFTensor, dequantize, open_gguf, tensors
from ssd.models.pack_cache import PackCache
from ssd.models.shard import Cut, plan
from ssd.models.names import GGUF_LINK, WEIGHTS


# The types "q4_0" requantises: those of more than 5 bits a weight (Q5_0, Q5_1, Q5_K, Q6_K,
# Q8_0, F16, F32). Q4_1 (5.0) is kept: 10 % fewer bytes are not worth a second rounding
# (SmolLM2's Q4_1 layers requantised: 9 % relative error a matrix, its top-1 next token
# changed at 31 % of positions).
Q4_0_SOURCES = {t for t in (*quant_cpu.SUPPORTED, GGML.F32, GGML.F16, GGML.BF16)
                if quant_cpu.bits_per_weight(t) > 5}

# Our fused matrices and the Hugging Face tensors they are stacked from, in order.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight"),
    "mlp.shared_expert.gate_up_proj.weight": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
}


@contextlib.contextmanager
def no_init():
    """Modules built to be loaded into skip their random initialisation (the weights are
    replaced): on the meta device it computes nothing, but its first call imports torch's
    decompositions, about 3 s of every process's first load."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda t, *args, **kwargs: t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def weight_files(folder: Path) -> list[Path]:
    """The files a model folder's weights are read from: its GGUF file, or safetensors."""
    gguf = Path(folder) / GGUF_LINK
    if gguf.is_symlink() or gguf.exists():
        if not gguf.is_file():
            raise ModelFileError(f"{folder}: its weights file {gguf} -> {gguf.resolve()} is missing")
        return [gguf]
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"no weights in {folder}: neither {GGUF_LINK} nor .safetensors files")
    return files


def transformers_kwargs(folder: Path) -> dict:
    """What `transformers.AutoModelForCausalLM.from_pretrained(folder, ...)` needs to load the
    same weights (for a GGUF-backed folder: the file, which transformers dequantises)."""
    return {"gguf_file": GGUF_LINK} if weight_files(folder)[0].name == GGUF_LINK else {}


def resolve_weights(folder: Path, device: torch.device, weights: str) -> str:
    """The concrete way a model's weights will be held ("auto" decided)."""
    if weights not in WEIGHTS:
        raise SSDError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if device.type == "cpu":  # every kernel a first pass needs, side by side on a fresh machine,
        prebuild()  # before the quant kernel below is asked for (alone, it built first, by itself)
    is_gguf = weight_files(folder)[0].name == GGUF_LINK
    if weights in ("gguf", "q4_0"):
        if not is_gguf:
            raise SSDError(f"weights={weights!r} needs a GGUF model; {folder} holds safetensors")
        if device.type != "cpu":
            raise SSDError(f"weights={weights!r} runs on the CPU only (a GPU gets the dequantised weights)")
        if not quant_cpu.available():
            why = ("is switched off by SSD_CPU_KERNELS" if quant_cpu.variant() is None
                   else "could not be built here (see the message above)")
            raise SSDError(f"weights={weights!r} needs the CPU quant kernel, which {why}; use weights='dequantized'")
    if weights == "auto":
        return "gguf" if is_gguf and device.type == "cpu" and quant_cpu.available() else "dequantized"
    return weights


def load_tokenizer(folder: Path):
    """The model's own tokenizer (a transformers fast tokenizer). One saved as the generic fast
    tokenizer (every prepared GGUF's) is built as that class directly: AutoTokenizer would
    first import the model's configuration class, ~2 s of transformers imports."""
    try:
        cls = json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    try:
        if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return PreTrainedTokenizerFast.from_pretrained(folder)
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise ModelFileError(f"cannot load the tokenizer in {folder}: {str(e).strip().splitlines()[0]}") from e


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name, fp32 from a GGUF file (dequantised exactly as
    transformers does) or as stored in safetensors."""
    files = weight_files(folder)
    if files[0].name == GGUF_LINK:
        return {t.name: dequantize(t) for t in tensors(open_gguf(files[0]), files[0])}
    found: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    found[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise ModelFileError(f"cannot read weights {f}: {e}") from e
    return found


# Mixtral's names for its mixture of experts, as Qwen-MoE's (w1: gate, w3: up, w2: down).
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                 (".w2.", ".down_proj."))
EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def to_engine_names(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to DecoderLM's and stack the fused projections (a mixture's
    experts: into [experts, rows, cols], SparseMoE's layout)."""
    out = {}
    for name, t in hf.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if cfg.arch == "mixtral":
            for a, b in MIXTRAL_NAMES:
                name = name.replace(a, b)
        out[name] = t
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name in [n for n in out if EXPERT.fullmatch(n)]:
        layer, e, kind = EXPERT.fullmatch(name).groups()
        experts.setdefault((layer, kind), {})[int(e)] = out.pop(name)
    for (layer, kind), mats in experts.items():  # one checkpoint tensor an expert (the hub's layout)
        if sorted(mats) != list(range(cfg.num_experts)):
            raise ModelFileError(f"layer {layer}: {kind} of experts {sorted(mats)[:8]}..., not 0..{cfg.num_experts - 1}")
        out[f"layers.{layer}.mlp.experts.{kind}.weight"] = torch.stack([mats[e] for e in range(cfg.num_experts)])
    for i in range(cfg.num_layers):
        for fused, parts in FUSED.items():
            names = [f"layers.{i}.{p}" for p in parts]
            if all(n in out for n in names):
                ts = [out.pop(n) for n in names]  # stacked along the rows (of each expert's matrix)
                out[f"layers.{i}.{fused}"] = torch.cat(ts, dim=-2 if ts[0].dim() > 1 else 0)
            elif any(n in out for n in names):
                raise ModelFileError(f"layer {i}: only some of {parts} are present")
        down = f"layers.{i}.mlp.experts.down_proj.weight"
        if down in out:
            out[f"layers.{i}.mlp.experts.down_proj"] = out.pop(down)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["embed_tokens.weight"]
    if cfg.gemma_norms:
        for name in out:
            if name.endswith("norm.weight"):
                out[name] = gemma_norm(out[name])
    return out


def gemma_norm(w: torch.Tensor) -> torch.Tensor:
    """The weight our RMSNorm multiplies by for a Gemma norm of weight w: 1 + w, in fp32 as
    transformers computes it."""
    return 1.0 + w.float()


def load_model(folder: Path, device: torch.device, dtype: torch.dtype, weights: str = "auto",
               head_rows: tuple[int, ...] | None = None) -> DecoderLM:
    """weights: see names.py ("int8": every Linear (q/k/v/o, gate_up, down, lm_head) gets
    weight-only int8, for a draft model, whose numerics change only the acceptance rate).
    head_rows: token ids the output layer keeps (its logits come in that order), for a
    reduced-vocabulary draft head; None keeps them all. A reduced head's model gets
    `full_head`: a module that looks up any of the whole output layer's rows in fp32 (the tied
    input embedding, or a GGUF file's output layer read from its pages), None where there is
    none to read (an untied safetensors head)."""
    weights = resolve_weights(folder, device, weights)
    cfg = ModelConfig.from_folder(folder)
    rows = None if head_rows is None else torch.tensor(head_rows, dtype=torch.long)
    if rows is not None and not (rows.numel() and 0 <= int(rows.min()) and int(rows.max()) < cfg.vocab_size):
        raise SSDError(f"head rows must be token ids in 0..{cfg.vocab_size - 1}")
    if weights in ("gguf", "q4_0"):
        return load_gguf_blocks(weight_files(folder)[0], cfg, rows, requantize=weights == "q4_0").eval()
    state = to_engine_names(read_weights(folder), cfg)
    if rows is not None:
        state["lm_head.weight"] = state["lm_head.weight"][rows]
    with torch.device("meta"), no_init():
        model = DecoderLM(cfg)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ModelFileError(f"weights in {folder} do not fit the {cfg.arch} config: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if rows is not None:
        model.lm_head = Linear(cfg.hidden_size, len(rows), bias=False, device="meta")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    if rows is not None and cfg.tie_word_embeddings:
        model.full_head = model.embed_tokens
    del state  # the model holds the only references: quantizing frees each fp32 matrix
    if cfg.tie_word_embeddings and rows is None:
        model.lm_head.weight = model.embed_tokens.weight
    if weights == "int8":
        quantize_int8(model)
    return model.to(device).eval()


def load_gguf_shard(folder: Path, rank: int, world: int) -> tuple[DecoderLM, Cut]:
    """A tensor-parallel rank's share of a GGUF model's blocks (engine/tensor_parallel.py): only
    its cut of each matrix is read and repacked. o_proj's and down_proj's columns are cut at
    their types' blocks."""
    path = weight_files(folder)[0]
    if path.name != GGUF_LINK:
        raise SSDError(f"weights='gguf' needs a GGUF model; {folder} holds safetensors")
    cfg = ModelConfig.from_folder(folder)
    found = {t.name: t for t in tensors(open_gguf(path), path)}

    def block(kind: str) -> int:  # the largest block of a kind of matrix along its columns
        return max(GGML_QUANT_SIZES[t.qtype][0] for n, t in found.items() if n.endswith(f"{kind}.weight"))
    cut = plan(cfg, rank, world, q_align=block("o_proj"), inter_align=block("down_proj"))
    return load_gguf_blocks(path, cfg, cut=cut), cut


def load_gguf_blocks(path: Path, cfg: ModelConfig, head_rows: torch.Tensor | None = None,
                     requantize: bool = False, cut: Cut | None = None) -> DecoderLM:
    """The model on its GGUF file's own blocks (CPU), read in one pass: each matrix is
    repacked for the kernel from the file's pages (no fp32 copy is ever made), the embedding
    keeps its blocks, norms and biases are fp32. A matrix stored as F32 stays a plain fp32
    Linear, one stored as F16 / BF16 a Linear holding that dtype (read as its fp32 values).
    requantize: each matrix of more than 5 bits a weight (Q4_0_SOURCES) is requantised to
    Q4_0 instead, one matrix at a time (the embedding, a lookup, is kept). cut: a
    tensor-parallel rank's part of each matrix only (load_gguf_shard)."""
    if cut is not None and head_rows is not None:
        raise SSDError("a reduced output layer (head_rows) is for a draft, not a tensor-parallel rank")
    blocks = _Blocks(path, cfg, head_rows, requantize, cut)
    with torch.device("meta"), no_init():
        model = DecoderLM(cfg)
    for i, layer in enumerate(model.layers):
        blocks.attention(layer.self_attn, f"model.layers.{i}.")
        blocks.mlp(layer.mlp, f"model.layers.{i}.mlp.")
    for name, module in model.named_modules():  # every norm (Qwen3's q/k norms, Gemma's four a layer)
        if isinstance(module, RMSNorm):
            module.weight = blocks.vector(f"model.{name}.weight")
    vocab_rows = None if cut is None else torch.arange(cut.vocab_lo, cut.vocab_hi)
    model.embed_tokens = blocks.embedding(vocab_rows)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    model.lm_head = blocks.linear([head], rows=vocab_rows if cut is not None else head_rows)
    if head_rows is not None:
        model.full_head = model.embed_tokens if cfg.tie_word_embeddings else full_rows(blocks.get(head), blocks.index)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ModelFileError(f"{path}: no weights for {leftover[:5]}")
    blocks.cache.save()
    return model


class _Blocks:
    """A GGUF file's tensors as load_gguf_blocks builds the model's modules from them."""

    def __init__(self, path: Path, cfg: ModelConfig, head_rows: torch.Tensor | None, requantize: bool,
                 cut: Cut | None):
        self.path, self.cfg, self.requantize, self.cut = path, cfg, requantize, cut
        self.index = open_gguf(path)
        self.found = {t.name: t for t in tensors(self.index, path)}
        rows_key = "" if head_rows is None else hashlib.blake2b(head_rows.numpy().tobytes(), digest_size=8).hexdigest()
        cut_key = "" if cut is None else f" rank={cut.rank}/{cut.world}"
        self.cache = PackCache(path, f"requantize={requantize} head={rows_key}{cut_key}")

    def get(self, name: str) -> GGUFTensor:
        if name not in self.found:
            raise ModelFileError(f"{self.path}: tensor {name} is missing")
        return self.found[name]

    def vector(self, name: str) -> nn.Parameter:
        v = dequantize(self.get(name))
        return nn.Parameter(gemma_norm(v) if self.cfg.gemma_norms and name.endswith("norm.weight") else v,
                            requires_grad=False)

    def kernel_holds(self, t: GGUFTensor) -> bool:
        """Whether the kernel runs this matrix (requantised to Q4_0 where asked)."""
        return t.qtype in quant_cpu.SUPPORTED or (
            self.requantize and t.qtype in Q4_0_SOURCES and t.shape[-1] % 32 == 0)

    @staticmethod
    def part(t: GGUFTensor, rows: torch.Tensor | None, cols: tuple[int, int] | None) -> GGUFTensor:
        """Whole quantised rows of t (their blocks are exact), and of those the blocks of columns
        [lo, hi) (a cut at a block's edge)."""
        raw, shape = t.raw, t.shape
        if rows is not None:
            raw, shape = raw[rows.numpy()], (len(rows), *shape[1:])
        if cols is not None:
            size, nbytes = GGML_QUANT_SIZES[t.qtype]
            lo, hi = cols
            raw = raw.reshape(shape[0], -1)[:, lo // size * nbytes:-(-hi // size) * nbytes]
            shape = (shape[0], hi - lo)
        return t if raw is t.raw else replace(t, raw=np.ascontiguousarray(raw), shape=shape)

    def packed(self, name: str, t: GGUFTensor, rows: torch.Tensor | None = None,
               cols: tuple[int, int] | None = None) -> quant_cpu.QuantMatrix:
        """A matrix in the kernel's layout: from the pack cache, else repacked from the file's
        pages (only `rows` and `cols` of it where given)."""
        def make() -> quant_cpu.QuantMatrix:
            src = self.part(t, rows, cols)
            k = to_q4_0(src, self.index) if self.requantize else src
            m = quant_cpu.repack(torch.from_numpy(np.ascontiguousarray(k.raw).reshape(-1)), k.qtype, *k.shape)
            self.index.unmap(t.raw)  # read once: its pages need not stay in this process
            return m
        return self.cache.matrix(name, make)

    def linear(self, names: list[str], bias: torch.Tensor | None = None, rows=None,
               cols: tuple[int, int] | None = None) -> nn.Module:
        """The parts `names` stacked; rows: one index tensor for every part, or a list of one per
        part; cols: a run of the columns."""
        parts = [self.get(n) for n in names]
        per_part = rows if isinstance(rows, list) else [rows] * len(parts)
        if all(self.kernel_holds(t) for t in parts):
            return QuantLinear([self.packed(n, t, r, cols) for n, t, r in zip(names, parts, per_part)], bias)
        plain = [t for t in parts if t.qtype.name not in ("F32", "F16", "BF16")]
        if plain:
            bad = sorted({t.qtype.name for t in plain})
            raise UnsupportedModelError(
                f"{self.path}: GGUF type {', '.join(bad)} (in {plain[0].name}) has no CPU kernel here; the kernels "
                f"cover {', '.join(sorted(q.name for q in quant_cpu.SUPPORTED))}, F32, F16 and BF16. "
                f"Load it with weights='dequantized'")
        parts = [self.part(t, r, cols) for t, r in zip(parts, per_part)]
        kinds = {t.qtype.name for t in parts}
        w = torch.cat([self.as_stored(t) if kinds in ({"F16"}, {"BF16"}) else dequantize(t) for t in parts])
        layer = Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        return layer

    def as_stored(self, t: GGUFTensor) -> torch.Tensor:
        """An F16 / BF16 matrix in its own dtype (a copy: the file's pages are dropped): the
        linear kernel reads it as its fp32 values, at half the bytes of an fp32 copy."""
        w = torch.from_numpy(np.array(t.raw)).view(t.shape[0], -1)
        self.index.unmap(t.raw)
        return w if t.qtype.name == "F16" else w.view(torch.bfloat16)

    def attention(self, attn: nn.Module, pre: str) -> None:
        cut = self.cut
        qkv = [f"{pre}self_attn.{p}_proj" for p in "qkv"]
        rows = None if cut is None else list(cut.qkv_rows())
        if f"{pre}self_attn.qkv_proj.weight" in self.found:  # Phi-3: stacked in the file
            qkv = [f"{pre}self_attn.qkv_proj"]
            rows = None if cut is None else [cut.stacked_qkv_rows()]
        bias = torch.cat([dequantize(self.get(f"{n}.bias")) for n in qkv]) if self.cfg.qkv_bias else None
        if bias is not None and cut is not None:
            bias = bias[cut.stacked_qkv_rows()]
        attn.qkv_proj = self.linear([f"{n}.weight" for n in qkv], bias, rows=rows)
        attn.o_proj = self.linear([f"{pre}self_attn.o_proj.weight"], cols=None if cut is None else cut.q)

    def mlp(self, mlp: nn.Module, pre: str) -> None:
        if isinstance(mlp, SparseMoE):
            mlp.gate = self.linear([f"{pre}gate.weight"])
            mlp.experts = self.experts(f"{pre}experts.")
            if mlp.shared_expert is not None:
                mlp.shared_expert_gate = self.linear([f"{pre}shared_expert_gate.weight"])
                self.gated_mlp(mlp.shared_expert, f"{pre}shared_expert.", None)
        else:
            self.gated_mlp(mlp, pre, self.cut)

    def gated_mlp(self, mlp: nn.Module, pre: str, cut: Cut | None) -> None:
        stacked = f"{pre}gate_up_proj.weight" in self.found  # Phi-3 stacks them in the file
        gate_up = [f"{pre}gate_up_proj.weight"] if stacked else [f"{pre}gate_proj.weight", f"{pre}up_proj.weight"]
        rows = None if cut is None else cut.gate_up_rows() if stacked else torch.arange(cut.inter_lo, cut.inter_hi)
        mlp.gate_up_proj = self.linear(gate_up, rows=rows)
        cols = None if cut is None else (cut.inter_lo, cut.inter_hi)
        mlp.down_proj = self.linear([f"{pre}down_proj.weight"], cols=cols)

    def experts(self, pre: str) -> nn.Module:
        """A mixture's experts: each one's slice of the file's stacked tensors, repacked alone
        (or, stored as F32/F16/BF16, one fp32 copy of them all)."""
        stacked = [self.get(f"{pre}{kind}_proj.weight") for kind in ("gate", "up", "down")]
        if all(t.qtype in quant_cpu.SUPPORTED for t in stacked):
            mats = []
            for t in stacked:
                n, rows, cols = t.shape
                raw = t.raw.reshape(n, rows, -1)
                mats.append([self.packed(f"{t.name}#{e}", replace(t, raw=raw[e], shape=(rows, cols)))
                             for e in range(n)])
                self.index.unmap(t.raw)
            return QuantExperts(*mats)
        n, inter, hidden = stacked[0].shape
        with torch.device("meta"):
            dense = DenseExperts(n, hidden, inter)
        w = [dequantize(t) for t in stacked]
        dense.gate_up_proj = nn.Parameter(torch.cat(w[:2], dim=1), requires_grad=False)
        dense.down_proj = nn.Parameter(w[2], requires_grad=False)
        return dense

    def embedding(self, vocab_rows: torch.Tensor | None) -> nn.Module:
        """The embedding on its blocks where the kernel reads them, else fp32."""
        whole = self.get("model.embed_tokens.weight")
        embed = self.part(whole, vocab_rows, None)
        if embed.qtype not in quant_cpu.SUPPORTED:
            return nn.Embedding.from_pretrained(dequantize(embed))

        def blocks() -> quant_cpu.QuantMatrix:  # a copy: the file's pages are unmapped once loading is done
            m = quant_cpu.QuantMatrix(embed.qtype, *embed.shape, torch.from_numpy(embed.raw.reshape(-1).copy()))
            self.index.unmap(whole.raw)
            return m
        m = self.cache.matrix("model.embed_tokens.weight (blocks)", blocks)
        return QuantEmbedding(m.packed, m.qtype, m.rows, m.cols)


def to_q4_0(t: GGUFTensor, index) -> GGUFTensor:
    """The matrix requantised to Q4_0 where its own type is one of Q4_0_SOURCES."""
    if t.shape[1] % 32 or t.qtype not in Q4_0_SOURCES:
        return t
    raw = quant_cpu.quantize_q4_0(dequantize(t)).numpy()
    index.unmap(t.raw)
    return replace(t, raw=raw, qtype=GGML.Q4_0)


def full_rows(t: GGUFTensor, index) -> nn.Module:
    """Any row of a GGUF matrix in fp32, read from the file's pages when asked: a reduced
    draft head's source for a request's own tokens (ssd/speculative/draft/vocab.py), which touches
    only those rows' pages."""
    if t.qtype not in quant_cpu.SUPPORTED:
        return nn.Embedding.from_pretrained(dequantize(t))
    index.unmap(t.raw)  # the kept rows were gathered from these pages; the rest were never read
    return QuantEmbedding(torch.from_numpy(t.raw.reshape(-1)), t.qtype, *t.shape)


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


def shared_model(folder: Path, device: torch.device, dtype: torch.dtype, weights: str = "auto",
                 head_rows: tuple[int, ...] | None = None) -> DecoderLM:
    """Load a model, or hand back the copy another LLM already holds: weights are read-only
    at inference, so engines of the same model (an AR, an SD and an SSD engine side by side
    in a benchmark) share one copy."""
    weights = resolve_weights(Path(folder), device, weights)
    key = (str(Path(folder).resolve()), str(device), dtype, weights, head_rows)
    model = _loaded.get(key)
    if model is None:
        model = _loaded[key] = load_model(folder, device, dtype, weights, head_rows)
    return model
