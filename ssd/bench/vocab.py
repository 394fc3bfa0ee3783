"""`ssd vocab`: count the tokens a target model writes, for a reduced-vocabulary draft head
(SpecOptions.draft_vocab, ssd/speculative/draft/vocab.py).

The target answers held-out prompts of the benchmark's prompt sets greedily, in its chat
template: records from --skip on (the benchmarks take their prompts from the start of each
set, so by default none of those is counted). Counted: the answers' tokens, which are what a
draft must propose, and the prompts' own tokens, for the words answers copy from their input
(a name, a quantity, a term of the paper): on the benchmark's prompts a 32,768-token head
then misses 2.0-4.3 % of the target's tokens where the answers' counts alone miss 2.0-5.1 %
(docs/decision-log.md, "Reduced-vocabulary draft head"; each request's own tokens, which the
head adds, bring it to 0-1.4 %).
The counts go to $SSD_HOME/vocab/<target>.json.
"""
import argparse
import json
import sys
from collections import Counter

from ssd.bench.prompts import PROMPT_SETS, load_prompt_set
from ssd.errors import SSDError
from ssd.store import DEFAULT_TARGET


def count_outputs(model: str, sets: list[str], per_set: int, skip: int, max_tokens: int, batch: int) -> dict:
    from ssd import LLM, SamplingParams
    from ssd.speculative.draft.vocab import counts_path

    counts: Counter = Counter()
    prompts_used, prompt_tokens = 0, 0
    with LLM(model, max_num_seqs=batch) as llm:
        params = SamplingParams.greedy(max_tokens=max_tokens)
        for name in sets:
            prompts = load_prompt_set(name)[skip:skip + per_set]
            print(f"ssd vocab: {name}: {len(prompts)} prompts", file=sys.stderr)
            for i in range(0, len(prompts), batch):
                chats = [[{"role": "user", "content": p.text}] for p in prompts[i:i + batch]]
                for out in llm.generate(chats, params):
                    counts.update(out.token_ids)
            for p in prompts:
                ids = llm.encode(p.text)
                counts.update(ids)
                prompt_tokens += len(ids)
            prompts_used += len(prompts)
        path = counts_path(llm.config.model)
    result = {"model": model, "sets": sets, "skip": skip, "prompts": prompts_used, "max_tokens": max_tokens,
              "tokens": sum(counts.values()), "prompt_tokens": prompt_tokens, "distinct": len(counts),
              "counts": {str(t): n for t, n in counts.most_common()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return {**result, "path": str(path)}


def add_vocab_arguments(v: argparse.ArgumentParser) -> None:
    """`ssd vocab`'s arguments, on its subparser (ssd/cli.py, COMMANDS)."""
    v.description = __doc__
    v.add_argument("--model", default=DEFAULT_TARGET, help=f"the target (default: {DEFAULT_TARGET})")
    v.add_argument("--sets", default=",".join(PROMPT_SETS), help="prompt sets (default: all four)")
    v.add_argument("--prompts-per-set", type=int, default=32, metavar="N", help="prompts per set (default: 32)")
    v.add_argument("--skip", type=int, default=32, help="records skipped at the start of each set (default: 32)")
    v.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most (default: 256)")
    v.add_argument("--batch", type=int, default=16, help="prompts per generate() call (default: 16)")
    v.set_defaults(func=cmd_vocab)


def cmd_vocab(args: argparse.Namespace) -> None:
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in PROMPT_SETS]
    if unknown or not sets:
        raise SSDError(f"unknown prompt sets {unknown}; known: {', '.join(PROMPT_SETS)}")
    if min(args.prompts_per_set, args.max_tokens, args.batch) < 1 or args.skip < 0:
        raise SSDError("--prompts-per-set, --max-tokens and --batch must be >= 1, --skip >= 0")
    r = count_outputs(args.model, sets, args.prompts_per_set, args.skip, args.max_tokens, args.batch)
    print(f"{r['tokens'] - r['prompt_tokens']} output and {r['prompt_tokens']} prompt tokens ({r['distinct']} distinct) "
          f"from {r['prompts']} prompts -> {r['path']}")
