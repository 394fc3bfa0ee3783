"""Drafts side by side on one target: AR and SD with each draft (a model, an EAGLE-3 head's
folder, "ngram", "suffix"), one engine each, taking turns prompt by prompt in one run (the
host's speed drifts), greedy, every output checked token-identical to AR. Prints decode tok/s
over each set's prompts, the speed-up over AR and over the first draft, acceptance, tokens
per target pass, drafted tokens per round (K), the share of rounds that took prompt lookup's
tokens, and a drafted token's cost in plain decoding steps (the round's wait for
proposals per drafted token, against AR's seconds a token). `--ks auto,3,5` runs each draft at
each K (auto-K against fixed ones); `--siblings off,on` each draft without and with branches off
its chain (sibling leaves; a head's tree), with their rows and tokens taken a round; `--prompt
TEXT` (repeatable) adds a set of one's own, `--prompts FILE` one from a JSONL of {"prompt": ...} (as
`ssd bench --prompts` reads); `--chat-template off` sends every prompt as plain text (random-weight
models on a GPU run so, with `--ignore-eos`: bench/gpu/gpu_run.sh).

    python bench/draft_compare.py --drafts qwen2.5-coder-0.5b-instruct,HEAD_DIR [--sets humaneval,gsm8k,mtbench]
        [--num-prompts 4] [--max-tokens 128] [--model qwen2.5-coder-1.5b-instruct] [--out FILE.json]
    python bench/draft_compare.py --drafts qwen2.5-coder-0.5b-instruct --ks auto,5 --sets none \
        --prompt "Write a Python class LRUCache with get and put in O(1), with comments."
"""
import json
import sys
from pathlib import Path

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.script_args import script_parser


def main() -> None:
    ap = script_parser(__doc__, num_prompts=4, max_tokens=128, out=True)
    ap.add_argument("--drafts", required=True, help="comma-separated drafts, the first the reference")
    ap.add_argument("--sets", default="humaneval,gsm8k,mtbench", help="prompt sets, comma-separated; none: only "
                    "--prompt's")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt of one's own (repeatable): the set 'own'")
    ap.add_argument("--prompts", type=Path, help="a JSONL file of {\"prompt\": ...}: these too, in the set 'own'")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens")
    ap.add_argument("--chat-template", choices=("on", "off"), default="on",
                    help="each prompt as a user message in the chat template, or as plain text (default: on)")
    ap.add_argument("--ks", default="auto", help="K per draft, comma-separated: auto (auto-K) or a number")
    ap.add_argument("--siblings", default="default", help="branches off the chain per draft, comma-separated: "
                    "default, on, off")
    args = ap.parse_args()
    drafts, ks, sibs = args.drafts.split(","), args.ks.split(","), args.siblings.split(",")
    configs = {d + (f" K={k}" if len(ks) > 1 else "") + (f" siblings={b}" if len(sibs) > 1 else ""):
               (d, k if k == "auto" else int(k), {"default": None, "on": True, "off": False}[b])
               for d in drafts for k in ks for b in sibs}
    engines = {"ar": LLM(args.model)} | {label: LLM(args.model, draft=d, mode="sd", speculate_k=k, draft_siblings=b)
                                         for label, (d, k, b) in configs.items()}
    texts = args.prompt + ([json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()
                            if line.strip()] if args.prompts else [])
    chat = (lambda text: [{"role": "user", "content": text}]) if args.chat_template == "on" else (lambda text: text)
    own = [chat(text) for text in texts]
    sets = [("own", own)] * bool(own) + [(name, [chat(p.text) for p in load_prompt_set(name, args.num_prompts)])
                                         for name in args.sets.split(",") if name != "none"]
    params = SamplingParams.greedy(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for llm in engines.values():  # warm-up: first calls' allocations out of the timings
        llm.generate(["Hello"], SamplingParams.greedy(max_tokens=8))
    rows, wrong = [], []
    for name, prompts in sets:
        # tokens, s, drafted, accepted, rounds, draft s, lookup rounds, branch rows, branch tokens taken
        totals = {label: [0, 0.0, 0, 0, 0, 0.0, 0, 0, 0] for label in engines}
        for i, prompt in enumerate(prompts):
            labels = list(engines)
            outputs = {}
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:
                out = outputs[label] = engines[label].generate([prompt], params)[0]
                m, t = out.metrics, totals[label]
                t[0] += max(0, m.output_tokens - 1)
                t[1] += m.decode_s
                t[2] += m.drafted
                t[3] += m.accepted
                t[4] += m.rounds
                t[5] += m.draft_s
                t[6] += m.lookup_rounds
                t[7] += m.sibling_rows
                t[8] += m.rescues
            wrong += [f"{label} on {name} prompt {i}" for label, out in outputs.items()
                      if out.token_ids != outputs["ar"].token_ids]
        ar = totals["ar"][0] / totals["ar"][1]
        first = next(iter(configs))
        ref = totals[first][0] / totals[first][1]
        for label, (tokens, seconds, drafted, accepted, rounds, draft_s, lookups, branches, taken) in totals.items():
            speed = tokens / seconds
            rows.append({"set": name, "config": label, "tok_s": round(speed, 1), "vs_ar": round(speed / ar, 2),
                         "vs_first_draft": round(speed / ref, 2),
                         "acceptance": round(accepted / drafted, 3) if drafted else None,
                         "tokens_per_pass": round((tokens + len(prompts)) / rounds, 2) if rounds else None,
                         # a drafted token's cost against a plain decoding step (AR's seconds a token)
                         "draft_cost": round(draft_s / drafted * ar, 3) if drafted else None,
                         "drafted_per_round": round(drafted / rounds, 2) if rounds else None,
                         "lookup_rounds": round(lookups / rounds, 2) if rounds else None,
                         "branch_rows": round(branches / rounds, 2) if rounds else None,
                         "branch_tokens": round(taken / rounds, 2) if rounds else None})
    print(f"{'set':10} {'config':60} {'tok/s':>6} {'x AR':>6} {'x first':>7} {'accept':>7} {'tok/pass':>8} "
          f"{'draft/step':>10} {'K':>5} {'lookup':>6} {'branch':>6} {'taken':>6}")
    for r in rows:
        print(f"{r['set']:10} {r['config'][-60:]:60} {r['tok_s']:6} {r['vs_ar']:6} {r['vs_first_draft']:7} "
              f"{r['acceptance'] if r['acceptance'] is not None else '-':>7} "
              f"{r['tokens_per_pass'] if r['tokens_per_pass'] is not None else '-':>8} "
              f"{r['draft_cost'] if r['draft_cost'] is not None else '-':>10} "
              f"{r['drafted_per_round'] if r['drafted_per_round'] is not None else '-':>5} "
              f"{r['lookup_rounds'] if r['lookup_rounds'] is not None else '-':>6} "
              f"{r['branch_rows'] if r['branch_rows'] is not None else '-':>6} "
              f"{r['branch_tokens'] if r['branch_tokens'] is not None else '-':>6}")
    if args.out:
        out = {"model": args.model, "drafts": drafts, "ks": ks, "siblings": sibs, "rows": rows}
        args.out.write_text(json.dumps(out, indent=2))
    if wrong:
        sys.exit(f"differ from AR: {'; '.join(wrong)}")
    print("every output token-identical to AR")


if __name__ == "__main__":
    main()
