"""What prompt lookup and the draft model could gain together over each alone,
estimated offline from real text and measured pass costs before building it.

For each prompt the target's greedy output is computed, then the draft reads prompt + output
in one teacher-forced pass (its top-1 at every output position given the true prefix). Greedy
rounds are replayed over each output:
- chain: the draft proposes K tokens (accepted while its top-1 is the target's token);
- lookup: prompt lookup's proposal of up to K tokens (ssd/speculative/sources/ngram.py);
- lookup first: a lookup round where the newest n-gram of at least n0 tokens occurred before,
  else a draft round.
Costs: the target's pass over M rows T(M), the draft's pass over m rows D(m) (a round drafting
K costs D(tokens it has not read) + (K - 1) D(1): after lookup rounds, and the first time, the
draft catches up on what it missed, the whole prompt included). Decode time only: the
target's prefill is the same for every policy and left out; the draft's is counted.

    python bench/studies/lookup_headroom.py --sets humaneval,gsm8k,mtbench,aclsum --num-prompts 4 --max-tokens 128
"""
import itertools
from types import SimpleNamespace

from tree_headroom import pass_seconds, replay_setup, runner_for

from ssd.runner.model_runner import Chunk
from ssd.speculative.sources.ngram import PromptLookup


class Costs:
    def __init__(self, target: dict[int, float], draft: dict[int, float]):
        self.target, self.draft = target, draft

    @staticmethod
    def _read(table: dict[int, float], m: int) -> float:
        if m in table:
            return table[m]
        sizes = sorted(table)
        lo = max([s for s in sizes if s < m], default=sizes[0])
        hi = min([s for s in sizes if s > m], default=sizes[-1])
        if hi == lo:  # past the largest size: linear in the rows
            return table[lo] * m / lo
        return table[lo] + (table[hi] - table[lo]) * (m - lo) / (hi - lo)

    def T(self, m: int) -> float:
        return self._read(self.target, m)

    def D(self, m: int) -> float:
        return self._read(self.draft, m)


def replay(prompt: list[int], truth: list[int], top1: list[int], costs: Costs, policy: str, k_draft: int,
           k_lookup: int, n0: int) -> tuple[int, float, int]:
    """One output replayed under a policy: (tokens, seconds, lookup rounds)."""
    lookup = PromptLookup(1, 4)
    seq = SimpleNamespace(seq_id=0, token_ids=list(prompt))
    pos, seconds, fed, lookups, n = 0, 0.0, 0, 0, len(truth)
    while pos < n:
        context = len(prompt) + pos
        seq.token_ids = list(prompt) + truth[:pos]
        proposal, match = lookup.match(seq, min(k_lookup, n - pos - 1)) if policy != "chain" else ([], 0)
        if policy == "lookup" or (policy == "lookup first" and proposal and match >= n0):
            j = next((i for i, t in enumerate(proposal) if t != truth[pos + i]), len(proposal))
            seconds += costs.T(len(proposal) + 1)
            lookups += 1
        else:
            k = min(k_draft, n - pos - 1)
            j = next((i for i in range(k) if top1[pos + i] != truth[pos + i]), k)
            seconds += (costs.D(context - fed) + (k - 1) * costs.D(1) if k else 0.0) + costs.T(k + 1)
            fed = context + min(k - 1, j) if k else fed
        pos += j + 1
    return n, seconds, lookups


def main() -> None:
    args, outputs = replay_setup(__doc__.split("\n\n")[0], "humaneval,gsm8k,mtbench,aclsum")
    longest = max(len(a) + len(b) for _, a, b in outputs)
    draft = runner_for(args.draft, args.draft_weights, max(longest, 1024) + 32)
    target = runner_for(args.model, "auto", 256)
    target.forward([Chunk(0, list(range(100, 300)), 0, 1)])
    draft.forward([Chunk(0, list(range(100, 300)), 0, 1)])
    costs = Costs({m: pass_seconds(target, m) for m in range(1, 10)},
                  {m: pass_seconds(draft, m) for m in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)}
                  | {512: pass_seconds(draft, 512, context=0, repeats=1)})
    print("measured ms: target T(M) " + ", ".join(f"{m}: {v * 1e3:.0f}" for m, v in costs.target.items())
          + "; draft D(m) " + ", ".join(f"{m}: {v * 1e3:.0f}" for m, v in costs.draft.items()))

    runs: dict[str, list] = {}
    for name, prompt, out in outputs:
        logits = draft.forward([Chunk(0, prompt + out[:-1], 0, len(out))])
        runs.setdefault(name, []).append((prompt, out, logits.argmax(-1).tolist()))

    grid = {"chain": [(k, 0, 0) for k in range(1, 7)],
            "lookup": [(0, k, 1) for k in range(1, 9)],
            "lookup first": list(itertools.product(range(1, 7), (2, 4, 6, 8), (1, 2, 3, 4)))}
    print("set        policy        (K draft, K lookup, n0)  est. tok/s  vs AR  vs chain  lookup rounds")
    for name, items in runs.items():
        ar = sum(len(out) for _, out, _ in items) / sum(len(out) * costs.T(1) for _, out, _ in items)
        chain = None
        for policy, settings in grid.items():
            best = None
            for kd, kl, n0 in settings:
                results = [replay(p, out, top1, costs, policy, kd, kl, n0) for p, out, top1 in items]
                tokens, seconds = sum(r[0] for r in results), sum(r[1] for r in results)
                share = sum(r[2] for r in results) / max(1, sum(r[0] for r in results))
                if best is None or tokens / seconds > best[0]:
                    best = (tokens / seconds, (kd, kl, n0), share)
            chain = chain or best[0]
            print(f"{name:10} {policy:13} {str(best[1]):26} {best[0]:9.1f} {best[0] / ar:5.2f}x "
                  f"{best[0] / chain:6.2f}x  {best[2]:.2f} per token")


if __name__ == "__main__":
    main()
