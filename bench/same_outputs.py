"""Outputs before and after a change that must not change them: every mode's tokens and
logprob bits on the bench sets, written to a JSON file, and two such files compared.

    python bench/same_outputs.py --out before.json          # on the old commit
    python bench/same_outputs.py --out after.json           # on the new one
    python bench/same_outputs.py --compare before.json after.json

Each configuration runs all prompts in one batch, greedy and seeded-sampled (T = 0.8, one seed
per prompt), with the top-2 logprobs of every token. Greedy outputs must also equal AR's. A
sampled output depends on how many tokens each round drafted, so where K or the SSD tree's
size comes from measured times (auto-K, the fitted tree) two runs of the same code can differ:
the sampled configurations here use a fixed K and SSD's tree without the fit, and the
comparison says which entries differed in a repeat of the same commit (--compare A A2 B).
"""
import argparse
import json
import struct
import sys
import time

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.script_args import script_parser

SETS = ("humaneval", "gsm8k", "mtbench", "aclsum")
# name -> (LLM options, sampled too?)
CONFIGS = {
    "ar": (dict(), True),
    "sd": (dict(draft="qwen2.5-coder-0.5b-instruct", mode="sd"), False),  # defaults: auto-K, timed
    "sd-k4": (dict(draft="qwen2.5-coder-0.5b-instruct", mode="sd", speculate_k=4), True),
    "ngram": (dict(draft="ngram", mode="sd"), False),
    "ngram-k4": (dict(draft="ngram", mode="sd", speculate_k=4), True),
    "ssd": (dict(draft="qwen2.5-coder-0.5b-instruct", mode="ssd", fit_tree=False), True),
}


def bits(x: float) -> str:
    return struct.pack(">f", x).hex()


def run(args: argparse.Namespace) -> dict:
    prompts = [p for s in SETS for p in load_prompt_set(s, args.num_prompts)]
    chats = [[{"role": "user", "content": p.text}] for p in prompts]
    out: dict = {}
    for name, (options, sampled) in CONFIGS.items():
        start = time.perf_counter()
        with LLM(args.model, max_num_seqs=16, threads=args.threads, seed=0, **options) as llm:
            kinds = {"greedy": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2)] * len(chats)}
            if sampled:
                kinds["sampled"] = [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=args.max_tokens,
                                                   logprobs=2) for i in range(len(chats))]
            for kind, params in kinds.items():
                for p, o in zip(prompts, llm.generate(chats, params)):
                    lps = [[lp.token_id, bits(lp.logprob), [[t, bits(v)] for t, v in lp.top]] for lp in o.logprobs]
                    out[f"{name}|{kind}|{p.id}"] = {"tokens": o.token_ids, "logprobs": lps}
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def compare(paths: list[str]) -> int:
    """paths: A [A2] B. Entries of B that differ from A; with A2 (a repeat of A's commit),
    those that differed between A and A2 are reported apart (timing-dependent)."""
    runs = [json.load(open(p)) for p in paths]
    a, b = runs[0], runs[-1]
    noisy = {k for k in a if len(runs) == 3 and runs[1].get(k) != a[k]}
    bad = 0
    for key in sorted(a):
        name, kind, pid = key.split("|")
        ar = a.get(f"ar|greedy|{pid}")
        if kind == "greedy" and b.get(key, {}).get("tokens") != ar["tokens"]:
            print(f"NOT AR: {key}")
            bad += 1
        if b.get(key) != a[key]:
            print(f"{'differs (also between repeats)' if key in noisy else 'DIFFERS'}: {key}")
            bad += key not in noisy
    print(f"{len(a)} entries, {bad} differ" + (f", {len(noisy)} timing-dependent" if len(runs) == 3 else ""))
    return 1 if bad else 0


def main() -> int:
    ap = script_parser(__doc__, num_prompts=2, max_tokens=48, threads=None, out=True)
    ap.add_argument("--compare", nargs="+", metavar="FILE", help="A [A2] B: compare B with A")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    with open(args.out, "w") as f:
        json.dump(run(args), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
