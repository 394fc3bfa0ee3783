"""Model quality of the GGUF-block weights (8-bit activations) against the fp32 copy of the same
file, on held-out real text: perplexity, agreement of the most likely next token, and the mean
KL divergence of the next-token distributions; with llama.cpp's perplexity on the same text, and
(--llamacpp) the same three figures for llama.cpp's own logits on the same file and tokens.

The text: the conclusion sections of the ACLSum test split (scientific English; the benchmark's
ACLSum prompts use the introductions), tokenised once and cut into chunks of --ctx tokens.
Scoring follows llama-perplexity: each chunk is evaluated from its start (its first token replaced
by BOS for a model whose tokenizer adds one, as Gemma's does) and only the tokens of its second
half are scored, so every scored token has at least ctx/2 tokens of context.

    python bench/quality.py --model qwen2.5-coder-1.5b-instruct --tokens 4096 --llamacpp \
        --llama-perplexity "$(bash bench/llamacpp.sh)/llama-perplexity"
"""
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ssd import LLM
from ssd.bench.prompts import read_records
from ssd.bench.script_args import script_parser
from ssd.runner.model_runner import Chunk
from ssd.store import REGISTRY, gguf_path


def held_out_text(min_chars: int) -> str:
    records = read_records("aclsum")
    parts = []
    for r in records:
        parts.append(" ".join(r["sentences"]["conclusion"]))
        if sum(map(len, parts)) >= min_chars:
            break
    return "\n\n".join(parts)


@torch.inference_mode()
def chunk_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one chunk, evaluated from its start (a fresh sequence)."""
    owner = -12345
    llm.engine.cache.reserve(owner, len(ids))
    try:
        return llm.engine.runner.forward([Chunk(owner, ids, 0, len(ids))]).float()
    finally:
        llm.engine.cache.release(owner)


def score(model: str, weights: str, chunks: list[list[int]], threads: int | None) -> tuple[list[torch.Tensor], float]:
    """Per chunk, the log-probabilities of the scored positions [ctx/2, ctx-1) (log_softmax rows)."""
    llm = LLM(model, weights=weights, threads=threads, max_num_batched_tokens=4096)
    start = time.perf_counter()
    out = []
    for ids in chunks:
        logits = chunk_logits(llm, ids)
        out.append(torch.log_softmax(logits[len(ids) // 2:len(ids) - 1], dim=-1))
    seconds = time.perf_counter() - start
    llm.close()
    return out, seconds


def score_llamacpp(gguf: Path, chunks: list[list[int]], threads: int) -> tuple[list[torch.Tensor], float]:
    """As score(), from llama-cpp-python's logits on the same GGUF file and tokens (its own
    kernels: 4-bit weights, 8-bit activations, fp16 KV cache)."""
    from llama_cpp import Llama
    ctx = max(map(len, chunks))
    llm = Llama(model_path=str(gguf), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, n_gpu_layers=0,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    start = time.perf_counter()
    out = []
    for ids in chunks:
        llm.reset()
        llm.eval(ids)
        logits = torch.from_numpy(llm.scores[:len(ids)].copy()).float()
        out.append(torch.log_softmax(logits[len(ids) // 2:len(ids) - 1], dim=-1))
    seconds = time.perf_counter() - start
    llm.close()
    return out, seconds


def agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Share of scored positions where a and b have the same most likely next token."""
    return sum((x.argmax(-1) == y.argmax(-1)).sum().item() for x, y in zip(a, b)) / sum(len(x) for x in a)


def mean_kl(ref: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean KL(ref || other) over the scored positions."""
    return sum((r.exp() * (r - o)).sum().item() for r, o in zip(ref, other)) / sum(len(r) for r in ref)


def perplexity(logp: list[torch.Tensor], chunks: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for lp, ids in zip(logp, chunks):
        targets = torch.tensor(ids[len(ids) // 2 + 1:])
        nll -= lp.gather(1, targets[:, None]).sum().item()
        n += len(targets)
    return math.exp(nll / n)


def llama_perplexity(binary: str, gguf: Path, text: str, ctx: int, chunks: int, threads: int) -> float | None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [binary, "-m", str(gguf), "-f", f.name, "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
           "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        print(f"llama-perplexity failed ({out.returncode}): {(out.stdout + out.stderr)[-2000:]}", file=sys.stderr)
        return None
    return float(m[1])


def main() -> None:
    ap = script_parser(__doc__, whole_doc=True, threads=None, out=True)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text (half of them scored)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--llama-perplexity", metavar="BIN", help="llama.cpp's llama-perplexity, to run beside")
    ap.add_argument("--llamacpp", action="store_true", help="score llama-cpp-python's logits too (bench/llamacpp.sh)")
    args = ap.parse_args()

    probe = LLM(args.model, weights="gguf", threads=args.threads)
    text = held_out_text(args.tokens * 6)
    body = probe.tokenizer(text, add_special_tokens=False).input_ids
    bos = probe.tokenizer.bos_token_id
    adds_bos = int(bos is not None and probe.tokenizer("a").input_ids[:1] == [bos])
    ids = [bos] * adds_bos + body
    probe.close()
    n = len(ids) // args.ctx
    if n * args.ctx < args.tokens:
        raise SystemExit(f"only {len(ids)} tokens of text for {args.tokens}")
    n = args.tokens // args.ctx
    chunks = [ids[i * args.ctx:(i + 1) * args.ctx] for i in range(n)]
    if adds_bos:  # as llama-perplexity does for a model that reads a BOS (Gemma): every chunk starts at one
        chunks = [[bos] + c[1:] for c in chunks]
    text = probe.tokenizer.decode(body[:n * args.ctx - adds_bos])  # what llama.cpp reads: the same tokens

    q, q_s = score(args.model, "gguf", chunks, args.threads)
    f, f_s = score(args.model, "dequantized", chunks, args.threads)
    scored = sum(len(c) // 2 - 1 for c in chunks)
    result = {"model": args.model, "text_tokens": n * args.ctx, "scored_tokens": scored, "ctx": args.ctx,
              "threads": torch.get_num_threads(), "ppl_gguf": perplexity(q, chunks),
              "ppl_fp32": perplexity(f, chunks), "argmax_agreement": agreement(q, f), "mean_kl": mean_kl(f, q),
              "seconds_gguf": q_s, "seconds_fp32": f_s}
    result["ppl_ratio"] = result["ppl_gguf"] / result["ppl_fp32"]
    file = gguf_path(args.model) if args.model in REGISTRY else Path(args.model)
    if args.llamacpp:  # llama.cpp's logits against the same fp32 reference
        c, c_s = score_llamacpp(file, chunks, result["threads"])
        result.update(ppl_llamacpp_logits=perplexity(c, chunks), argmax_agreement_llamacpp=agreement(c, f),
                      mean_kl_llamacpp=mean_kl(f, c), argmax_agreement_gguf_llamacpp=agreement(q, c),
                      seconds_llamacpp=c_s)
    if args.llama_perplexity:
        result["ppl_llamacpp"] = llama_perplexity(args.llama_perplexity, file, text, args.ctx, n,
                                                  result["threads"])
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
