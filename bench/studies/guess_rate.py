"""How far the draft's guesses (`draft_guesses`, prompt lookup's guess of the draft's own next
tokens, fed in the same draft pass) take each draft pass: SD's defaults on the bench sets,
greedy, counting the draft's passes (catch-up passes over a prompt included), the tokens
they drafted (prompt lookup's rounds beside the draft draw none), and the guessed rows fed.

    python bench/studies/guess_rate.py humaneval gsm8k mtbench --num-prompts 4 --max-tokens 128 --threads 2

Draft tokens per pass is 1.0 without guesses; each right guess adds to it, each guessed row
costs a few per cent of a pass (bench/pass_cost.py --model qwen2.5-coder-0.5b-instruct).
"""

import torch

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.script_args import script_parser


def main() -> None:
    ap = script_parser(__doc__, draft=True, num_prompts=4, max_tokens=128, threads=2)
    ap.add_argument("sets", nargs="+")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counts = {"passes": 0, "drafted": 0, "guesses": 0, "guessed rows": 0}
    with LLM(args.model, draft=args.draft, mode="sd", draft_guesses=True) as llm:
        engine = llm.engine.source.draft.engine
        forward, guess, draft = engine.runner.forward, engine._guess, engine.draft

        def counted_forward(chunks, head=True):
            counts["passes"] += 1
            return forward(chunks, head)

        def counted_guess(s, most):
            g = guess(s, most)
            counts["guesses"] += bool(g)
            counts["guessed rows"] += len(g)
            return g
        def counted_draft(seqs, ks, alternatives=False):
            out = draft(seqs, ks, alternatives)
            counts["drafted"] += sum(len(tokens) for tokens, _, _ in out)
            return out
        engine.runner.forward, engine._guess, engine.draft = counted_forward, counted_guess, counted_draft
        print("| set | draft passes | drafted tokens | tokens per pass | passes with a guess | guessed rows "
              "| right guessed tokens per guessed row |\n|---|---:|---:|---:|---:|---:|---:|")
        for name in args.sets:
            counts.update(dict.fromkeys(counts, 0))
            for p in load_prompt_set(name, args.num_prompts):
                llm.generate([[{"role": "user", "content": p.text}]], SamplingParams.greedy(max_tokens=args.max_tokens))
            passes, rows, drafted = counts["passes"], counts["guessed rows"], counts["drafted"]
            print(f"| {name} | {passes} | {drafted} | {drafted / passes:.2f} | {counts['guesses']} | {rows} "
                  f"| {(drafted - passes) / rows if rows else 0:.2f} |", flush=True)


if __name__ == "__main__":
    main()
