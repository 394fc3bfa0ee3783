"""AR decode speed: ssd-engine vs transformers on the same weights and dtype, and the
memory-bandwidth ceiling (bytes of weights read per token / measured read bandwidth),
all measured in one run, interleaved.

    python bench/ar_speed.py --model smollm2-135m-instruct --tokens 128 --repeats 2
"""
import time

import torch
import transformers

from ssd import LLM, SamplingParams
from ssd.bench.script_args import script_parser

PROMPT = "def quicksort(arr):\n"


def read_bandwidth_gbs(gb: float = 1.0, repeats: int = 5) -> float:
    x = torch.ones(int(gb * 2**30 / 4))
    x.sum()
    best = min(timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of every matrix a decode step reads in full (the embedding only gives one row,
    unless it is also the output head)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or (name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def main() -> None:
    ap = script_parser(None, model="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    llm = LLM(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32).eval()
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    params = SamplingParams.greedy(max_tokens=args.tokens, ignore_eos=True)

    def ours() -> float:
        return llm.generate(PROMPT, params)[0].metrics.tokens_per_second

    def theirs() -> float:
        # Time to the first token (prefill) is subtracted, as in our decode tok/s.
        with torch.no_grad():
            t0 = timed(lambda: hf.generate(ids, max_new_tokens=1, do_sample=False))
            t = timed(lambda: hf.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                          do_sample=False))
        return (args.tokens - 1) / (t - t0)

    ours(), theirs()  # warm-up
    ours_tps, hf_tps = [], []
    for _ in range(args.repeats):
        ours_tps.append(ours())
        hf_tps.append(theirs())
    bw = read_bandwidth_gbs()
    wb = weight_bytes_per_token(llm.engine.runner.model)
    print(f"model {args.model}  fp32  threads {torch.get_num_threads()}  {args.tokens} new tokens")
    print(f"ssd-engine AR    {max(ours_tps):6.2f} tok/s  (runs: {', '.join(f'{x:.2f}' for x in ours_tps)})")
    print(f"transformers     {max(hf_tps):6.2f} tok/s  (runs: {', '.join(f'{x:.2f}' for x in hf_tps)})")
    print(f"ceiling          {bw / (wb / 1e9):6.2f} tok/s  ({wb / 1e9:.2f} GB of weights per token, "
          f"read bandwidth {bw:.1f} GB/s)")


if __name__ == "__main__":
    main()
