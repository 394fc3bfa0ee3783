"""Write a random-weight GGUF of Qwen3-30B-A3B's shapes (qwen3moe: 48 layers, hidden 2048, 32
query / 4 KV heads of 128, q/k norms, 128 experts of 768, 8 a token, renormalised) in Q4_K with
Q6_K for the output layer and for every other layer's attn_v and ffn_down_exps (llama.cpp's
Q4_K_M mix), the routers in F32, to time a mixture of experts against llama.cpp on the same
file. Decode speed does not depend on the weights' values: the blocks are random bytes with fp16
scales small enough to keep activations finite (bench/make_8b_gguf.py); the tokenizer is the
Qwen2.5 GGUF's (the same 151,936 entries).

    python bench/make_moe_gguf.py /tmp/qwen3-30b-a3b-shapes.gguf [--layers 48]
    ssd generate --model /tmp/qwen3-30b-a3b-shapes.gguf --prompt "Hello" --max-tokens 32 --ignore-eos
"""
import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML

from make_8b_gguf import add_tokenizer, random_blocks

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FFN, CONTEXT = 2048, 32, 4, 128, 128, 8, 768, 8192


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=48, help="decoder layers (Qwen3-30B-A3B has 48)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    writer = gguf.GGUFWriter(str(args.out), "qwen3moe")
    writer.add_name(f"random-qwen3-30b-a3b-shapes-{args.layers}-layers")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_block_count(args.layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(6144)
    writer.add_expert_feed_forward_length(EXPERT_FFN)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(USED)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    vocab = add_tokenizer(writer)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    matrices = [("token_embd.weight", (vocab,), HIDDEN, GGML.Q4_K), ("output.weight", (vocab,), HIDDEN, GGML.Q6_K)]
    vectors = [("output_norm.weight", HIDDEN)]
    routers = []
    for i in range(args.layers):
        six = GGML.Q6_K if i % 2 == 0 else GGML.Q4_K
        matrices += [(f"blk.{i}.attn_q.weight", (q,), HIDDEN, GGML.Q4_K),
                     (f"blk.{i}.attn_k.weight", (kv,), HIDDEN, GGML.Q4_K),
                     (f"blk.{i}.attn_v.weight", (kv,), HIDDEN, six),
                     (f"blk.{i}.attn_output.weight", (HIDDEN,), q, GGML.Q4_K),
                     (f"blk.{i}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN), HIDDEN, GGML.Q4_K),
                     (f"blk.{i}.ffn_up_exps.weight", (EXPERTS, EXPERT_FFN), HIDDEN, GGML.Q4_K),
                     (f"blk.{i}.ffn_down_exps.weight", (EXPERTS, HIDDEN), EXPERT_FFN, six)]
        vectors += [(f"blk.{i}.attn_norm.weight", HIDDEN), (f"blk.{i}.ffn_norm.weight", HIDDEN),
                    (f"blk.{i}.attn_q_norm.weight", HEAD_DIM), (f"blk.{i}.attn_k_norm.weight", HEAD_DIM)]
        routers.append(f"blk.{i}.ffn_gate_inp.weight")
    for name, rows, cols, qtype in matrices:
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(rows))
        writer.add_tensor_info(name, (*rows, cols * size // per), np.dtype(np.uint8), n * cols // per * size,
                               raw_dtype=qtype)
    for name, n in vectors:
        writer.add_tensor_info(name, (n,), np.dtype(np.float32), n * 4)
    for name in routers:
        writer.add_tensor_info(name, (EXPERTS, HIDDEN), np.dtype(np.float32), EXPERTS * HIDDEN * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, rows, cols, qtype in matrices:
        writer.write_tensor_data(random_blocks(qtype, int(np.prod(rows)), cols, rng).reshape(*rows, -1))
    for _ in vectors:
        writer.write_tensor_data(np.ones(_[1], dtype=np.float32))
    for _ in routers:  # scores of a few units: the top 8 of 128 differ from token to token
        writer.write_tensor_data(rng.normal(0, 0.05, (EXPERTS, HIDDEN)).astype(np.float32))
    writer.close()
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
