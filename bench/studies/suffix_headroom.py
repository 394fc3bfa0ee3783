"""What an index over earlier answers could add to SD where problems come one after another
(HumanEval answered in a row), with the draft model beside it: the best any policy over these
proposals could do, and what per-round rules do.

The target answers --run HumanEval problems greedily, in order; the last --measure are
replayed. The draft reads each prompt + answer in one teacher-forced pass (its top-1 at every
position given the true prefix). At every answer position the engine's suffix decoding
(ssd/speculative/sources/suffix.py) proposes a chain twice: over the request's own tokens only
(what prompt lookup beside the draft sees: the SD baseline of bench/suffix_decoding.py) and
over the earlier prompts and answers too. Replayed policies, each at its best fixed K:
- chain: the draft's K tokens every round;
- own / index first: the lookup's chain where its match is 3+ tokens, else the draft's K;
- index first + extend: that, and after a draft chain the index's chain from its end
  (verify rows are cheap: no draft step for them);
- bound: every round takes, knowing the outcome, the best of plain decoding, the draft's K
  (1..8) and the index's chain cut to any length (a shortest-time path over the answer);
  "draft alone" without the index (what knowing each round's K would give);
- bound, best occurrence: the same with the index's chain replaced by the longest
  continuation any earlier occurrence of the newest two tokens had (no index proposes better).
Costs: the target's T(M) and the draft's D(m) measured here, the draft's catch-up after
lookup rounds counted (lookup_headroom.py's model); decode time only.

    python bench/studies/suffix_headroom.py [--run 40] [--measure 20] [--max-tokens 128]
"""
from types import SimpleNamespace

from lookup_headroom import Costs
from tree_headroom import pass_seconds, runner_for

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.script_args import script_parser
from ssd.runner.model_runner import Chunk
from ssd.speculative.sources.suffix import ANCHOR, SuffixIndex, SuffixLookup

MIN_MATCH = 3  # the match class from which a lookup round is taken (suffix.py's classes: 1..4)


def run_length(chain: list[int], truth: list[int], at: int) -> int:
    n = 0
    while n < len(chain) and at + n < len(truth) and chain[n] == truth[at + n]:
        n += 1
    return n


def best_occurrence(texts: list[list[int]], context: list[int], truth: list[int], at: int) -> int:
    """The longest stretch of truth[at:] that follows any earlier occurrence of the context's
    newest ANCHOR tokens (in earlier texts or the context itself)."""
    key, best = context[-ANCHOR:], 0
    for text in texts + [context]:
        for a in range(ANCHOR, len(text)):
            if text[a - ANCHOR:a] == key:
                best = max(best, run_length(text[a:], truth, at))
    return best


def replay(prompt, truth, top1, chains, costs: Costs, k: int, first: bool, extend: bool) -> float:
    """Seconds to produce `truth` under a per-round rule (module doc)."""
    pos, seconds, fed, n = 0, 0.0, 0, len(truth)
    while pos < n:
        context = len(prompt) + pos
        chain, match = chains[pos]
        if first and chain and match >= MIN_MATCH:
            chain = chain[:n - pos - 1]
            j = run_length(chain, truth, pos)
            seconds += costs.T(len(chain) + 1)
        else:
            kk = min(k, n - pos - 1)
            j = next((i for i in range(kk) if top1[pos + i] != truth[pos + i]), kk)
            rows = kk + 1
            if extend and 0 < kk and pos + kk < n and chains[pos + kk][0]:
                more = chains[pos + kk][0][:min(8, n - pos - kk - 1)]
                rows += len(more)
                j += run_length(more, truth, pos + kk) if j == kk else 0
            seconds += (costs.D(context - fed) + (kk - 1) * costs.D(1) if kk else 0.0) + costs.T(rows)
            fed = context + min(kk - 1, j) if kk else fed
        pos += j + 1
    return seconds


def bound(truth, top1, runs: list[tuple[int, int]], costs: Costs) -> float:
    """The shortest time over the answer when every round picks, knowing the outcome, plain
    decoding, the draft's K or the index's chain cut to any length (runs: per position, the
    chain's right tokens and its length)."""
    n = len(truth)
    best = [0.0] * (n + 1)
    for pos in range(n - 1, -1, -1):
        options = [(costs.T(1), 1)]
        for k in range(1, min(8, n - pos - 1) + 1):
            j = next((i for i in range(k) if top1[pos + i] != truth[pos + i]), k)
            options.append((k * costs.D(1) + costs.T(k + 1), j + 1))
        right, length = runs[pos]
        options += [(costs.T(m + 1), min(right, m) + 1) for m in range(1, length + 1)]
        best[pos] = min(c + best[min(n, pos + gain)] for c, gain in options)
    return best[0]


def main() -> None:
    ap = script_parser(__doc__, draft=True, max_tokens=128)
    ap.add_argument("--draft-weights", default="q4_0")
    ap.add_argument("--run", type=int, default=40)
    ap.add_argument("--measure", type=int, default=20)
    args = ap.parse_args()
    answers = []
    with LLM(args.model) as llm:
        for p in load_prompt_set("humaneval", args.run):
            chat = [{"role": "user", "content": p.text}]
            out = llm.generate(chat, SamplingParams.greedy(max_tokens=args.max_tokens))[0]
            answers.append((llm.encode(chat), list(out.token_ids)))
    longest = max(len(a) + len(b) for a, b in answers)
    draft = runner_for(args.draft, args.draft_weights, max(longest, 1024) + 32)
    target = runner_for(args.model, "auto", 256)
    target.forward([Chunk(0, list(range(100, 300)), 0, 1)])
    draft.forward([Chunk(0, list(range(100, 300)), 0, 1)])
    costs = Costs({m: pass_seconds(target, m) for m in range(1, 18)},
                  {m: pass_seconds(draft, m) for m in (1, 2, 4, 8, 16, 32, 64)}
                  | {512: pass_seconds(draft, 512, context=0, repeats=1)})
    print("measured ms: target T(M) " + ", ".join(f"{m}: {v * 1e3:.0f}" for m, v in costs.target.items())
          + "; draft D(m) " + ", ".join(f"{m}: {v * 1e3:.0f}" for m, v in costs.draft.items()))

    index, own = SuffixLookup(SuffixIndex()), SuffixLookup(SuffixIndex())
    texts: list[list[int]] = []
    totals: dict[str, list[float]] = {}
    tokens, ar = 0, 0.0
    for i, (prompt, truth) in enumerate(answers):
        if i >= args.run - args.measure:
            top1 = draft.forward([Chunk(0, prompt + truth[:-1], 0, len(truth))]).argmax(-1).tolist()
            chains = {"own": [], "index": []}
            best_runs, index_runs = [], []
            for pos in range(len(truth)):
                seq = SimpleNamespace(seq_id=i, token_ids=prompt + truth[:pos], params=SimpleNamespace(cache_salt=None))
                for name, lookup in (("own", own), ("index", index)):
                    chain, match, _ = lookup.tree(seq, 16, branches=False)
                    chains[name].append((chain, match))
                chain = chains["index"][-1][0]
                index_runs.append((run_length(chain, truth, pos), len(chain)))
                best_runs.append((best_occurrence(texts, seq.token_ids, truth, pos), 16))
            for k in range(1, 9):
                for label, name, first, extend in (("chain", "own", False, False), ("own first", "own", True, False),
                                                   ("index first", "index", True, False),
                                                   ("index first + extend", "index", True, True)):
                    totals.setdefault(label, [0.0] * 9)[k] += replay(prompt, truth, top1, chains[name], costs, k,
                                                                      first, extend)
            totals.setdefault("bound, draft alone", [0.0])[0] += bound(truth, top1, [(0, 0)] * len(truth), costs)
            totals.setdefault("bound", [0.0])[0] += bound(truth, top1, index_runs, costs)
            totals.setdefault("bound, best occurrence", [0.0])[0] += bound(truth, top1, best_runs, costs)
            tokens, ar = tokens + len(truth), ar + len(truth) * costs.T(1)
        for lookup in (index, own):
            lookup.own.pop(i, None)
        index.index.add(None, prompt + truth)
        texts.append(prompt + truth)
    baseline = min(s for s in totals["own first"] if s)
    print(f"{'policy':24} {'K':>2} {'est. tok/s':>10} {'x AR':>6} {'x own first':>11}")
    for label, seconds in totals.items():
        k, s = min(((k, s) for k, s in enumerate(seconds) if s), key=lambda ks: ks[1])
        print(f"{label:24} {k if len(seconds) > 1 else '-':>2} {tokens / s:10.1f} {ar / s:5.2f}x {baseline / s:10.2f}x")


if __name__ == "__main__":
    main()
