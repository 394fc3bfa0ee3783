"""What tree-shaped SD proposals could gain over a chain, before building them:
the simplest tree, the draft's chain plus its second choice as a one-token sibling
leaf at chosen depths, estimated offline from real text and measured pass costs.

For each prompt the target's greedy output is computed, then the draft reads prompt + output
in one teacher-forced pass: at every output position its top-1 and top-2 tokens given the true
prefix. A greedy chain round of K from position p accepts the drafts while top-1 equals the
target's token; a sibling at the first rejected depth j rescues the round when top-2 equals it
(then the target's row at the sibling adds its own token: j + 2 tokens instead of j + 1). A
sibling costs one more verify row and no draft pass (its token comes from the same draft
step). With a draft step of d seconds and a verify pass of T(M) seconds over M rows (measured
here, as bench/pass_cost.py does), the estimate per policy is tokens / (rounds' K d + T(rows)).

    python bench/studies/tree_headroom.py --sets humaneval,gsm8k,mtbench --num-prompts 4 --max-tokens 128
"""
import argparse
import time

import torch

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.script_args import script_parser
from ssd.models.loader import load_model
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.store import resolve_model


def pass_seconds(runner: ModelRunner, rows: int, context: int = 200, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward([Chunk(0, list(range(500, 500 + rows)), context, rows)])
        best = min(best, time.perf_counter() - start)
    return best


def runner_for(name: str, weights: str, tokens: int) -> ModelRunner:
    model = load_model(resolve_model(name), torch.device("cpu"), torch.float32, weights)
    cache = PagedKVCache(model.config, tokens + 16, 16, torch.device("cpu"), torch.float32)
    cache.reserve(0, tokens)
    return ModelRunner(model, cache, torch.device("cpu"))


def simulate(top1, top2, p1, truth, k: int, tau: float | None) -> tuple[int, int, int]:
    """Greedy rounds of K over one output: (tokens, rounds, verify rows). tau None: a chain;
    else a sibling (top-2) at every depth whose top-1 probability is below tau."""
    pos, tokens, rounds, rows = 0, 0, 0, 0
    n = len(truth)
    while pos < n:
        kk = min(k, n - pos - 1)
        siblings = [j for j in range(kk) if tau is not None and p1[pos + j] < tau]
        j = next((j for j in range(kk) if top1[pos + j] != truth[pos + j]), kk)
        gained = j + 1
        if j < kk and j in siblings and top2[pos + j] == truth[pos + j]:
            gained = min(j + 2, n - pos)
        rounds += 1
        rows += kk + 1 + len(siblings)
        tokens += gained
        pos += gained
    return tokens, rounds, rows


def replay_setup(description: str, sets: str) -> tuple[argparse.Namespace, list[tuple[str, list[int], list[int]]]]:
    """The command line of a replay script, and the target's greedy outputs on its prompt sets:
    (set, prompt ids, output ids) per prompt."""
    ap = script_parser(description, draft=True, sets=sets, num_prompts=4, max_tokens=128)
    ap.add_argument("--draft-weights", default="q4_0")
    args = ap.parse_args()
    outputs = []
    with LLM(args.model) as llm:
        for name in args.sets.split(","):
            for p in load_prompt_set(name)[:args.num_prompts]:
                chat = [{"role": "user", "content": p.text}]
                out = llm.generate(chat, SamplingParams.greedy(max_tokens=args.max_tokens))[0]
                outputs.append((name, llm.encode(chat), out.token_ids))
    return args, outputs


def replay_costs(description: str, sets: str):
    """replay_setup, then the draft's runner and the measured costs: (args, outputs, draft
    runner, the target's T(M) for M = 1..17 rows, the draft's step), in seconds."""
    args, outputs = replay_setup(description, sets)
    longest = max(len(a) + len(b) for _, a, b in outputs)
    draft = runner_for(args.draft, args.draft_weights, longest + 32)
    target = runner_for(args.model, "auto", 256)
    target.forward([Chunk(0, list(range(100, 300)), 0, 1)])
    draft.forward([Chunk(0, list(range(100, 300)), 0, 1)])
    T = {m: pass_seconds(target, m) for m in range(1, 18)}
    d = pass_seconds(draft, 1)
    print(f"measured: draft step {d * 1e3:.1f} ms; target T(M) ms: "
          + ", ".join(f"{m}: {T[m] * 1e3:.0f}" for m in T))
    return args, outputs, draft, T, d


def main() -> None:
    _, outputs, draft, T, d = replay_costs(__doc__.split("\n\n")[0], "humaneval,gsm8k,mtbench")

    by_set: dict[str, list] = {}
    for name, prompt, out in outputs:
        logits = draft.forward([Chunk(0, prompt + out[:-1], 0, len(out))]).float()
        probs = logits.softmax(-1)
        top = probs.topk(2, dim=-1)
        by_set.setdefault(name, []).append((top.indices[:, 0].tolist(), top.indices[:, 1].tolist(),
                                            top.values[:, 0].tolist(), out))
    policies = [("chain", None)] + [(f"siblings below p1 {tau}", tau) for tau in (0.5, 0.8, 1.01)]
    print("set        policy                   best K  tokens/round  rows/round  est. tok/s (vs chain)")
    for name, runs in by_set.items():
        chain_best = None
        for label, tau in policies:
            best = None
            for k in range(1, 9):
                tokens = rounds = all_rows = seconds = 0.0
                for top1, top2, p1, truth in runs:
                    t, r, rows = simulate(top1, top2, p1, truth, k, tau)
                    tokens, rounds, all_rows = tokens + t, rounds + r, all_rows + rows
                    seconds += r * k * d + r * T[min(17, round(rows / r))]
                rate = tokens / seconds
                if best is None or rate > best[0]:
                    best = (rate, k, tokens / rounds, all_rows / rounds)
            chain_best = chain_best or best[0]
            print(f"{name:10} {label:24} {best[1]:6} {best[2]:13.2f} {best[3]:11.2f} {best[0]:7.1f} "
                  f"({best[0] / chain_best:.2f}x)")


if __name__ == "__main__":
    main()
