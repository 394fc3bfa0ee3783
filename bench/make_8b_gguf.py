"""Write a random-weight GGUF of Llama-3-8B's shapes (32 layers, hidden 4096, 32 query / 8 KV
heads, MLP 14336) quantised as llama.cpp's Q4_K_M mixes them (Q4_K, with Q6_K for attn_v,
ffn_down of every other layer and the output layer), to show that an 8B-class model loads
and decodes on a 24 GB machine, and to time it against llama.cpp on the same file. `--type q2_k` / `q3_k` / `iq4_xs` writes every layer
matrix in that type instead (the output layer stays Q6_K, as llama.cpp's mixes keep it).

No such model ships on PyPI; decode speed does not depend on the weights' values. The blocks
are random bytes with fp16 scales small enough to keep activations finite; the tokenizer
(metadata) is copied from the Qwen2.5 GGUF of the store, so the vocabulary has its 151,936
entries instead of Llama-3's 128,256 (an 8.3B-parameter model).

    python bench/make_8b_gguf.py /tmp/llama3-8b-shapes-q4km.gguf
    python bench/make_8b_gguf.py /tmp/llama3-8b-shapes-q2k.gguf --type q2_k
    ssd generate --model /tmp/llama3-8b-shapes-q4km.gguf --prompt "Hello" --max-tokens 32 --ignore-eos
"""
import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML

from ssd.models.gguf_file import copy_metadata
from ssd.store import gguf_path

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, CONTEXT = 32, 4096, 32, 8, 14336, 8192
TOKENIZER_SOURCE = "qwen2.5-coder-1.5b-instruct"
# fp16 d (and dmin) inside a block, and the range drawn for it (IQ4_XS multiplies d by a 6-bit
# scale and its table's values up to 127: a smaller d keeps the activations finite).
SCALE_OFFSETS = {GGML.Q4_K: (0, 2), GGML.Q6_K: (208,), GGML.Q2_K: (80, 82), GGML.Q3_K: (108,), GGML.IQ4_XS: (0,)}
SCALE_RANGE = {GGML.IQ4_XS: (1e-6, 1e-5)}
TYPES = {"q4_k_m": None, "q2_k": GGML.Q2_K, "q3_k": GGML.Q3_K, "iq4_xs": GGML.IQ4_XS}


def random_blocks(qtype: GGML, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        half = rng.uniform(*SCALE_RANGE.get(qtype, (1e-4, 1e-3)), raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def add_tokenizer(writer: gguf.GGUFWriter) -> int:
    """The Qwen2.5 GGUF's tokenizer metadata into `writer`; returns its vocabulary size."""
    source = gguf.GGUFReader(gguf_path(TOKENIZER_SOURCE))
    copy_metadata(source, writer, prefix="tokenizer.")
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_vocab_size(vocab)
    return vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--type", choices=TYPES, default="q4_k_m", help="the layers' matrices' type")
    args = ap.parse_args()
    every = TYPES[args.type]
    rng = np.random.default_rng(args.seed)
    writer = gguf.GGUFWriter(str(args.out), "llama")
    writer.add_name("random-llama3-8b-shapes")
    writer.add_file_type({None: gguf.LlamaFileType.MOSTLY_Q4_K_M, GGML.Q2_K: gguf.LlamaFileType.MOSTLY_Q2_K,
                          GGML.Q3_K: gguf.LlamaFileType.MOSTLY_Q3_K_S, GGML.IQ4_XS: gguf.LlamaFileType.MOSTLY_IQ4_XS}[every])
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = add_tokenizer(writer)

    head = HIDDEN // HEADS
    matrices = [("token_embd.weight", vocab, HIDDEN, every or GGML.Q4_K), ("output.weight", vocab, HIDDEN, GGML.Q6_K)]
    norms = ["output_norm.weight"]
    for i in range(LAYERS):
        four = every or GGML.Q4_K
        six = every or (GGML.Q6_K if i % 2 == 0 else GGML.Q4_K)  # Q4_K_M: half of attn_v and ffn_down in Q6_K
        matrices += [(f"blk.{i}.attn_q.weight", HEADS * head, HIDDEN, four),
                     (f"blk.{i}.attn_k.weight", KV_HEADS * head, HIDDEN, four),
                     (f"blk.{i}.attn_v.weight", KV_HEADS * head, HIDDEN, six),
                     (f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head, four),
                     (f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, four),
                     (f"blk.{i}.ffn_up.weight", FFN, HIDDEN, four),
                     (f"blk.{i}.ffn_down.weight", HIDDEN, FFN, six)]
        norms += [f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight"]
    for name, rows, cols, qtype in matrices:
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor_info(name, (rows, cols * size // per), np.dtype(np.uint8), rows * cols // per * size,
                               raw_dtype=qtype)
    for name in norms:
        writer.add_tensor_info(name, (HIDDEN,), np.dtype(np.float32), HIDDEN * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, rows, cols, qtype in matrices:
        writer.write_tensor_data(random_blocks(qtype, rows, cols, rng))
    for _ in norms:
        writer.write_tensor_data(np.ones(HIDDEN, dtype=np.float32))
    writer.close()
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
