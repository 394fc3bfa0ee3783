"""How much a table of n-grams from other answers could add to the draft's guesses,
before building one: the draft's guesses now come from the sequence's own tokens
(ssd/speculative/draft/draft_engine.py, `_guess`); where those have no earlier occurrence of the
newest n-gram, or only a 1-token one, a table built from the target's answers to other prompts
might still guess the next token.

The target answers the first --held-out + --num-prompts prompts of each set greedily; the
table (n = 1..4 -> the most frequent next token, kept where n >= 2 or seen twice) is built from
the answers to prompts --num-prompts onwards, and both guesses are scored at every position of
the answers to the first --num-prompts prompts (the bench's) against the target's own next
token (the draft agrees with it most of the time; this is an estimate, not the draft's picks).
The last column is a table filled as the engine runs instead: from the answers before each one
in a `ssd bench` of these sets (the earlier sets' bench prompts, then this set's earlier ones).

    python bench/studies/shared_ngram_headroom.py humaneval gsm8k mtbench --num-prompts 4 --held-out 40 --threads 2
"""
import collections

import torch

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.script_args import script_parser
from ssd.speculative.sources.ngram_index import NgramIndex

N_MAX = 4


def table_guess(table: dict, context: list[int]) -> int | None:
    for n in range(min(N_MAX, len(context)), 0, -1):
        counts = table.get(tuple(context[-n:]))
        if counts:
            token, seen = counts.most_common(1)[0]
            if n >= 2 or seen >= 2:
                return token
    return None


def add(table: dict, out: list[int]) -> None:
    for end in range(1, len(out)):
        for n in range(1, min(N_MAX, end) + 1):
            table[tuple(out[end - n:end])][out[end]] += 1


def main() -> None:
    ap = script_parser(__doc__, num_prompts=4, max_tokens=128, threads=2)
    ap.add_argument("sets", nargs="+")
    ap.add_argument("--held-out", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| set | positions | own guess right | own, 1-token match | table where own has none | table where own is "
          "1-token | table of the run so far, where own has none |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    run: dict = collections.defaultdict(collections.Counter)  # the answers so far, as the engine would see them
    with LLM(args.model) as llm:
        for name in args.sets:
            prompts = load_prompt_set(name, args.num_prompts + args.held_out)
            outs = llm.generate([[{"role": "user", "content": p.text}] for p in prompts],
                                SamplingParams.greedy(max_tokens=args.max_tokens))
            answers = [(llm.encode(o.prompt), o.token_ids) for o in outs]
            table: dict = collections.defaultdict(collections.Counter)
            for _, out in answers[args.num_prompts:]:
                add(table, out)
            c = collections.Counter()
            for prompt, out in answers[:args.num_prompts]:
                for p in range(1, len(out)):
                    context = prompt + out[:p]
                    index = NgramIndex(N_MAX)
                    index.extend(context, len(context))
                    own, n = index.match(context, 1)
                    shared = table_guess(table, context)
                    c["positions"] += 1
                    key = "own" if own else "none"
                    c[key] += 1
                    c[key + " right"] += bool(own) and own[0] == out[p]
                    if own and n == 1:
                        c["own1"] += 1
                        c["own1 right"] += own[0] == out[p]
                        c["table/own1"] += shared is not None
                        c["table/own1 right"] += shared == out[p]
                    if not own:
                        c["table/none"] += shared is not None
                        c["table/none right"] += shared == out[p]
                        c["run/none right"] += table_guess(run, context) == out[p]
                add(run, out)
            share = lambda k, of: f"{c[k + ' right']} of {c[of]} ({c[k + ' right'] / max(1, c[of]):.0%})"  # noqa: E731
            print(f"| {name} | {c['positions']} | {share('own', 'own')} | {share('own1', 'own1')} "
                  f"| {share('table/none', 'none')} | {share('table/own1', 'own1')} | {share('run/none', 'none')} |",
                  flush=True)


if __name__ == "__main__":
    main()
