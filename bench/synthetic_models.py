"""Random-weight models of real shapes with a forced acceptance pattern, for speed runs on
machines the real weights cannot reach (a lent GPU machine takes only small files).

Speed does not depend on weight values, but speculation does depend on the draft agreeing
with the target. So both models get a planted next-token map on top of random layers: the
embedding of token v is a large random vector e_v, and the output head row of token f(v)
is e_v, so the greedy next token after v is f(v) (f a fixed random permutation); the
random transformer layers add a comparatively small perturbation. The draft follows the
same map except on a random fraction (1 - accept) of tokens v, where its head favours
another token g(v) and puts f(v) second. Greedy drafting then agrees with the target with
probability `accept` per token, and after a rejection the target's token is the draft's
second choice, so SSD's speculation cache can hit it with a fan-out of 1 or more.

    python bench/synthetic_models.py --target-like DIR --draft-like DIR --out DIR [--accept 0.8]
        [--target-shape llama3.1-8b --draft-shape llama3.2-1b] [--cpu-draft-shape qwen2.5-0.5b]

DIR: a model folder whose config.json and tokenizer files are copied (the weights are not
read), e.g. ~/.cache/ssd-engine/models/qwen2.5-coder-1.5b-instruct. A shape (bench/shapes.py)
replaces its layers' shapes and architecture; the vocabulary stays DIR's, for its tokenizer.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from shapes import SHAPES

EMBED_STD = 10.0  # the planted map must dominate the ~N(0, 4) noise of 28 random layers
INIT_STD = 0.02  # transformers' default initialiser range


def build(like: Path, out: Path, f: torch.Tensor, disagree: torch.Tensor | None, g: torch.Tensor | None,
          dtype: torch.dtype, device: str, seed: int, shape: str | None = None) -> None:
    cfg = json.loads((like / "config.json").read_text())
    if shape:
        for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "rope_scaling",
                    "rope_parameters", "architectures"):
            cfg.pop(key, None)
        cfg |= {k: v for k, v in SHAPES[shape].items() if k != "vocab_size"}
    out.mkdir(parents=True, exist_ok=True)
    for p in like.iterdir():
        if p.suffix != ".safetensors" and p.is_file():
            shutil.copy(p, out / p.name)
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    V, H, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // heads
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype).cpu()

    embed = torch.randn(V, H, generator=gen, device=device) * EMBED_STD
    head = torch.empty_like(embed)
    head[f] = embed  # row f(v) = e_v: after token v, f(v) wins
    if disagree is not None:
        head[f[disagree]] *= 0.9  # f(v) becomes the second choice ...
        head.index_add_(0, g[disagree], embed[disagree])  # ... after g(v)
    w = {"model.embed_tokens.weight": embed.to(dtype).cpu(), "lm_head.weight": head.to(dtype).cpu(),
         "model.norm.weight": torch.ones(H, dtype=dtype)}
    del embed, head
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": randn(heads * hd, H), p + "self_attn.k_proj.weight": randn(kv * hd, H),
              p + "self_attn.v_proj.weight": randn(kv * hd, H), p + "self_attn.o_proj.weight": randn(H, heads * hd),
              p + "mlp.gate_proj.weight": randn(inter, H), p + "mlp.up_proj.weight": randn(inter, H),
              p + "mlp.down_proj.weight": randn(H, inter),
              p + "input_layernorm.weight": torch.ones(H, dtype=dtype),
              p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype)}
        if cfg.get("model_type") == "qwen2":
            w |= {p + f"self_attn.{n}_proj.bias": torch.zeros(d, dtype=dtype)
                  for n, d in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd))}
    save_file(w, out / "model.safetensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-like", type=Path, required=True)
    ap.add_argument("--draft-like", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT/target and OUT/draft")
    ap.add_argument("--target-shape", choices=sorted(SHAPES), help="the target's layers (default: like's)")
    ap.add_argument("--draft-shape", choices=sorted(SHAPES), help="the draft's layers (default: like's)")
    ap.add_argument("--cpu-draft-shape", choices=sorted(SHAPES),
                    help="also OUT/draft-cpu: a draft of this shape with the same planted map, for a draft on the "
                         "host's CPU beside a GPU target")
    ap.add_argument("--accept", type=float, default=0.8, help="per-token greedy agreement (default: 0.8)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab = json.loads((args.target_like / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)
    f = torch.randperm(vocab, generator=gen)
    disagree = torch.nonzero(torch.rand(vocab, generator=gen) >= args.accept).squeeze(1)
    g = (f + 1 + torch.randint(vocab - 1, (vocab,), generator=gen)) % vocab  # != f(v)
    dtype = getattr(torch, args.dtype)
    build(args.target_like, args.out / "target", f.to(args.device), None, None, dtype, args.device, args.seed + 1,
          args.target_shape)
    build(args.draft_like, args.out / "draft", f.to(args.device), disagree.to(args.device), g.to(args.device),
          dtype, args.device, args.seed + 2, args.draft_shape)
    if args.cpu_draft_shape:
        build(args.draft_like, args.out / "draft-cpu", f.to(args.device), disagree.to(args.device),
              g.to(args.device), dtype, args.device, args.seed + 3, args.cpu_draft_shape)
    print(f"wrote {args.out}/target and {args.out}/draft: {len(disagree)} of {vocab} tokens "
          f"({len(disagree) / vocab:.1%}) where the draft's first choice differs")


if __name__ == "__main__":
    main()
