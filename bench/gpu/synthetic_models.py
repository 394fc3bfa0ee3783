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

With --head, also an EAGLE-3 head for the target (vLLM's speculators layout: one layer of the
target's shape, a draft vocabulary of --head-vocab tokens) that follows the same planted map
at the same rate. Its vocabulary is a random subset S of the target's, and f then maps every
token into S (a permutation of S; a token outside S, a prompt's, to some token of S), so what
the target generates stays where the head can draft. The head's layer drafts from the token
alone: its attention looks at the token's own row (q = k, large) and carries the token's
normed embedding to the output, whose lm_head row f(v) is that embedding; its hidden norm's
weight is 0, so the features it reads through fc (random) and its own states add nothing.
Its cost per step is a real head's (every matrix of the shape, read at the target's dtype).

With --subset N the planted map keeps to N tokens in the same way without a head, and the
target's token counts (`ssd vocab`'s file, in the store under the target folder's name) rank
exactly those first, so a draft run with `--draft-vocab N` (a reduced output layer) keeps them.

With --target-layers-at-load the target's file holds only its embedding, output layer and final
norm; bench/gpu/synthetic_load.py makes its random layers when the engine loads it, on the GPU (the
64 GB of Qwen2.5-32B's shapes do not fit a lent machine's 64 GiB disk as a file).

    python bench/gpu/synthetic_models.py --target-like DIR --draft-like DIR --out DIR [--accept 0.8]
        [--target-shape llama3.1-8b --draft-shape llama3.2-1b] [--cpu-draft-shape qwen2.5-0.5b] [--head]
        [--subset N] [--target-layers-at-load]

DIR: a model folder whose config.json and tokenizer files are copied (the weights are not
read), e.g. ~/.cache/ssd-engine/models/qwen2.5-coder-1.5b-instruct. A shape (bench/gpu/shapes.py)
replaces its layers' shapes and architecture; the vocabulary stays DIR's, for its tokenizer.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from shapes import SHAPES
from ssd.speculative.draft.vocab import counts_path

EMBED_STD = 10.0  # the planted map must dominate the ~N(0, 4) noise of 28 random layers
INIT_STD = 0.02  # transformers' default initialiser range
HEAD_QK = 2.0  # the head's q = k scale: a row's score on itself ~45 (head_dim 128), ~N(0, 4) on others
HEAD_OUT = 10.0  # the head's attention output against its random MLP's ~N(0, 6) per coordinate
AT_LOAD = "synthetic_layers.json"  # in a model folder whose layers bench/gpu/synthetic_load.py makes


def build(like: Path, out: Path, f: torch.Tensor, disagree: torch.Tensor | None, g: torch.Tensor | None,
          dtype: torch.dtype, device: str, seed: int, shape: str | None = None,
          layers_at_load: bool = False) -> tuple[dict, torch.Tensor]:
    """Writes the model (its layers only if not `layers_at_load`: then AT_LOAD says how to
    make them); returns its config and its embedding as written (float, on `device`)."""
    cfg = json.loads((like / "config.json").read_text())
    if shape:
        for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "rope_scaling",
                    "rope_parameters", "architectures"):
            cfg.pop(key, None)
        cfg |= {k: v for k, v in SHAPES[shape].items() if k != "vocab_size"}
    out.mkdir(parents=True, exist_ok=True)
    for p in like.iterdir():
        if p.suffix not in (".safetensors", ".gguf", ".bin") and p.is_file():  # configs and tokenizer files
            shutil.copy(p, out / p.name)
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    gen = torch.Generator(device).manual_seed(seed)
    embed = (torch.randn(V, H, generator=gen, device=device) * EMBED_STD).to(dtype).float()
    head = planted_rows(embed, f, disagree, g, V)
    w = {"model.embed_tokens.weight": embed.to(dtype).cpu(), "lm_head.weight": head.to(dtype).cpu(),
         "model.norm.weight": torch.ones(H, dtype=dtype)}
    del head
    if layers_at_load:
        (out / AT_LOAD).write_text(json.dumps({"seed": seed, "dtype": str(dtype).removeprefix("torch.")}))
    else:
        w |= layers(cfg, gen, dtype, device, "cpu")
    save_file(w, out / "model.safetensors")
    return cfg, embed


def layers(cfg: dict, gen: torch.Generator, dtype: torch.dtype, device: str, to: str) -> dict[str, torch.Tensor]:
    """Every decoder layer's tensors under their Hugging Face names: random matrices (drawn on
    `device` from `gen`), unit norms, zero biases; held on `to`."""
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // heads

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * INIT_STD).to(dtype).to(to)

    def const(value: float, n: int) -> torch.Tensor:
        return torch.full((n,), value, dtype=dtype, device=to)

    w = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": randn(heads * hd, H), p + "self_attn.k_proj.weight": randn(kv * hd, H),
              p + "self_attn.v_proj.weight": randn(kv * hd, H), p + "self_attn.o_proj.weight": randn(H, heads * hd),
              p + "mlp.gate_proj.weight": randn(inter, H), p + "mlp.up_proj.weight": randn(inter, H),
              p + "mlp.down_proj.weight": randn(H, inter),
              p + "input_layernorm.weight": const(1.0, H), p + "post_attention_layernorm.weight": const(1.0, H)}
        if cfg.get("model_type") == "qwen2":
            w |= {p + f"self_attn.{n}_proj.bias": const(0.0, d) for n, d in (("q", heads * hd), ("k", kv * hd),
                                                                           ("v", kv * hd))}
    return w


def planted_rows(vectors: torch.Tensor, f: torch.Tensor, disagree: torch.Tensor | None, g: torch.Tensor | None,
                 rows: int) -> torch.Tensor:
    """Output rows over which the vector of token v scores f(v) first (row f(v) holds it; rows
    sum where f maps several tokens to one), except on `disagree`, where it scores g(v) first
    and f(v) second."""
    weight = torch.ones(len(vectors), 1, device=vectors.device)
    if disagree is not None:
        weight[disagree] = 0.9
    head = torch.zeros(rows, vectors.shape[1], device=vectors.device)
    head.index_add_(0, f, vectors * weight)
    if disagree is not None:
        head.index_add_(0, g[disagree], vectors[disagree])
    return head


def build_head(cfg: dict, embed: torch.Tensor, used: torch.Tensor, f: torch.Tensor, disagree: torch.Tensor,
               g: torch.Tensor, out: Path, dtype: torch.dtype, device: str, seed: int) -> None:
    """An EAGLE-3 head of the target's layer shape over the draft vocabulary `used` (sorted
    target ids), planted as the module doc says, in vLLM's speculators layout."""
    H, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // heads
    group, width = heads // kv, kv * hd  # the embedding's first `width` coordinates carry the token
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * INIT_STD).to(dtype).cpu()

    pick = torch.zeros(width, 2 * H, device=device)  # kv head j reads coordinates j*hd..(j+1)*hd of the embedding
    pick[:, :width] = torch.eye(width, device=device)
    q = (HEAD_QK * pick).view(kv, 1, hd, 2 * H).expand(kv, group, hd, 2 * H).reshape(heads * hd, 2 * H)
    o = torch.zeros(H, heads * hd, device=device)  # the first head of each group to the output's first coordinates
    for j in range(kv):
        o[j * hd:(j + 1) * hd, j * group * hd:(j * group + 1) * hd] = HEAD_OUT * torch.eye(hd, device=device)
    normed = embed[:, :width] / embed.pow(2).mean(-1, keepdim=True).sqrt()  # the input norm's output, kept part
    slot = torch.full((V,), -1, dtype=torch.long, device=device)
    slot[used] = torch.arange(len(used), device=device)
    inside = torch.zeros(V, dtype=torch.bool, device=device)
    inside[used] = True  # the head drafts after tokens of its vocabulary only (what the target generates)
    lm = torch.zeros(len(used), H, device=device)
    lm[:, :width] = planted_rows(normed[used], slot[f[used]], None, None, len(used))
    off = disagree[inside[disagree]]
    lm[slot[f[off]], :width] -= 0.1 * normed[off]
    lm.index_add_(0, slot[g[off]], torch.nn.functional.pad(normed[off], (0, H - width)))
    layer = {"self_attn.q_proj": q, "self_attn.k_proj": HEAD_QK * pick, "self_attn.v_proj": pick, "self_attn.o_proj": o,
             "mlp.gate_proj": randn(inter, H), "mlp.up_proj": randn(inter, H), "mlp.down_proj": randn(H, inter),
             "hidden_norm": torch.zeros(H), "input_layernorm": torch.ones(H), "post_attention_layernorm": torch.ones(H)}
    w = {f"layers.0.{n}.weight": t.to(dtype).cpu() for n, t in layer.items()}
    w |= {"fc.weight": randn(H, 3 * H), "norm.weight": torch.ones(H, dtype=dtype), "lm_head.weight": lm.to(dtype).cpu(),
          "d2t": (used - torch.arange(len(used), device=device)).cpu(), "t2d": inside.cpu()}
    layer = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")}
    layer |= {"model_type": "llama", "head_dim": hd, "rope_scaling": cfg.get("rope_scaling")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": len(used), "norm_before_residual": True, "target_hidden_size": None}, indent=2))
    save_file(w, out / "model.safetensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-like", type=Path, required=True)
    ap.add_argument("--draft-like", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT/target (--target-name) and OUT/draft")
    ap.add_argument("--target-shape", choices=sorted(SHAPES), help="the target's layers (default: like's)")
    ap.add_argument("--draft-shape", choices=sorted(SHAPES), help="the draft's layers (default: like's)")
    ap.add_argument("--cpu-draft-shape", choices=sorted(SHAPES),
                    help="also OUT/draft-cpu: a draft of this shape with the same planted map, for a draft on the "
                         "host's CPU beside a GPU target")
    ap.add_argument("--head", action="store_true", help="also OUT/head: an EAGLE-3 head for the target (module doc)")
    ap.add_argument("--subset", type=int, help="the tokens the planted map keeps to (module doc; default: 32000, "
                    "EAGLE-3's Llama-3.1-8B head's vocabulary, with --head, else the whole vocabulary)")
    ap.add_argument("--target-name", default="target", help="the target's folder under OUT (the store keeps "
                    "its token counts by that name; default: target)")
    ap.add_argument("--target-layers-at-load", action="store_true",
                    help="the target's layers are made at load (bench/gpu/synthetic_load.py), not written")
    ap.add_argument("--accept", type=float, default=0.8, help="per-token greedy agreement (default: 0.8)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab = json.loads((args.target_like / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)
    subset = args.subset or (32000 if args.head else vocab)
    used = torch.randperm(vocab, generator=gen)[:subset].sort().values if subset < vocab else torch.arange(vocab)
    n = len(used)
    where = torch.randint(n, (vocab,), generator=gen)  # f(v) = used[where[v]]: a permutation of `used` ...
    where[used] = torch.randperm(n, generator=gen)  # ... and any token of it for a token outside
    f = used[where]
    disagree = torch.nonzero(torch.rand(vocab, generator=gen) >= args.accept).squeeze(1)
    g = used[(where + 1 + torch.randint(n - 1, (vocab,), generator=gen)) % n]  # != f(v)
    dtype = getattr(torch, args.dtype)
    target_cfg, embed = build(args.target_like, args.out / args.target_name, f.to(args.device), None, None, dtype,
                              args.device, args.seed + 1, args.target_shape, args.target_layers_at_load)
    # The store keeps counts by the target folder's name, and a draft's default head (draft_vocab
    # "auto") is reduced wherever a target has counts: a set without --subset must have none.
    counts = counts_path(args.out / args.target_name)
    counts.unlink(missing_ok=True)
    if args.subset:  # the target's "writing": the subset first, as `ssd vocab` would count it
        counts.parent.mkdir(parents=True, exist_ok=True)
        counts.write_text(json.dumps({"counts": {int(t): 1 for t in used}}))
    if args.head:
        build_head(target_cfg, embed, used.to(args.device), f.to(args.device), disagree.to(args.device),
                   g.to(args.device), args.out / "head", dtype, args.device, args.seed + 4)
    del embed
    build(args.draft_like, args.out / "draft", f.to(args.device), disagree.to(args.device), g.to(args.device),
          dtype, args.device, args.seed + 2, args.draft_shape)
    if args.cpu_draft_shape:
        build(args.draft_like, args.out / "draft-cpu", f.to(args.device), disagree.to(args.device),
              g.to(args.device), dtype, args.device, args.seed + 3, args.cpu_draft_shape)
    print(f"wrote {args.out}/{args.target_name} and {args.out}/draft: {len(disagree)} of {vocab} tokens "
          f"({len(disagree) / vocab:.1%}) where the draft's first choice differs")


if __name__ == "__main__":
    main()
