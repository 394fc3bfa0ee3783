"""SD with auto-K at a batch against AR: the batch's wall time and when its last request got
its first token (the prompts filled), and SD's rounds by kind (plain
rows riding in a prompt-fill pass, plain, lookup, drafting), their tokens and time and the
draft's catch-ups: where SD gains or loses when requests decode together (docs/cost-model.md,
"Catch-up").

    python bench/studies/batch_rounds.py [--set humaneval] [--batch 8] [--max-tokens 96] [--runs 2]

Each engine runs in a process of its own (one loaded model set at a time, as a user runs
one), AR and SD taking turns run by run, each warmed up as `ssd bench` warms up (its warm-up
prompt at the batch). To compare two commits, run it from a worktree of each in turn.

Found (Intel Xeon, 2026-11-29, 8 requests, 96 tokens, 2 runs): with every drafting round
priced for one sequence, SD's batch took 0.81-0.84x AR's speed on HumanEval, GSM8K and
MT-Bench, its rounds reading the first requests' prompts into the draft (catch-ups of up to
2 s); with the catch-up weighed against the batch's saving, 0.93-1.03x
(../../docs/decision-log.md, "Auto-K at a batch").
"""
import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.runner import WARMUP_PROMPT, WARMUP_TOKENS
from ssd.bench.script_args import script_parser
from ssd.speculative.records import Round

KINDS = ("fill", "plain", "lookup", "draft")


def kind(rounds: list[Round]) -> str:
    if not rounds[0].times.timed:
        return "fill"
    if any(r.drafted and not r.proposal.lookup for r in rounds):
        return "draft"
    return "lookup" if any(r.proposal.lookup for r in rounds) else "plain"


def one(args: argparse.Namespace) -> dict:
    """One engine's run: its wall time and, for SD, its rounds by kind."""
    sd = args.one == "sd"
    llm = LLM(args.model, max_num_seqs=max(16, args.batch),
              **({"mode": "sd", "draft": args.draft, "speculate_k": "auto"} if sd else {}))
    wrap = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    llm.generate([wrap(WARMUP_PROMPT)] * args.batch, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS))
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])  # rounds, tokens, seconds, catch-up s
    if sd:
        policy = llm.engine.k_policy
        learn = policy.learn

        def counted(rounds: list[Round]) -> None:
            k, r0 = kinds[kind(rounds)], rounds[0].times
            k[0] += 1
            k[1] += sum(len(r.tokens) for r in rounds)
            k[2] += r0.draft_s + r0.verify_s
            k[3] += r0.catchup[0] if r0.catchup else 0.0
            learn(rounds)

        policy.learn = counted
    prompts = [wrap(p.text) for p in load_prompt_set(args.set, args.batch)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    wall = time.perf_counter() - t
    llm.close()
    return {"wall": wall, "fill": max(o.metrics.ttft_s for o in outs), "tokens": [o.token_ids for o in outs],
            "kinds": dict(kinds)}


def main() -> None:
    ap = script_parser(__doc__, draft=True, max_tokens=96)
    ap.add_argument("--set", default="humaneval")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--one", choices=["ar", "sd"], help=argparse.SUPPRESS)  # a run in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    for run in range(args.runs):
        res = {}
        for mode in ("ar", "sd") if run % 2 == 0 else ("sd", "ar"):
            cmd = [sys.executable, __file__, "--one", mode] + sys.argv[1:]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            res[mode] = json.loads(out.strip().splitlines()[-1])
        ar, sd = res["ar"], res["sd"]
        same = "yes" if sd["tokens"] == ar["tokens"] else "NO"
        print(f"run {run + 1}: {args.set}, batch {args.batch}: wall AR {ar['wall']:.2f} s, SD {sd['wall']:.2f} s: "
              f"SD {ar['wall'] / sd['wall']:.2f}x AR; last first token AR {ar['fill']:.2f} s, SD {sd['fill']:.2f} s; "
              f"=AR {same}")
        for name in KINDS:
            if name in sd["kinds"]:
                n, tok, s, catchup = sd["kinds"][name]
                print(f"  {name:6s} {n:4d} rounds {tok:5d} tokens {s:6.2f} s {tok / s:6.1f} tok/s"
                      + (f", catch-ups {catchup:.2f} s" if catchup else ""))


if __name__ == "__main__":
    main()
