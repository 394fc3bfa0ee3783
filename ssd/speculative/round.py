"""One speculative round, the same in SD and SSD: plan -> propose -> score -> verify -> accept,
and its record.

  0. plan (plan.py): the K policy's word per sequence: K, prompt lookup's tokens or the
     draft's, sibling leaves, whether the draft may stop early;
  1. propose: the draft source gives up to K tokens per sequence (SD: drafted now; SSD:
     usually ready in the speculation cache), a lookup round its tokens;
  2. score: the target scores [last, d_1..d_K] in one forward pass (K+1 rows of logits), with
     branches off the chain where the plan's terms take some (siblings.py: the draft's
     runner-up beside d_j, or a feature head's tree; one more row each);
  3. verify (verifier.py): an exact prefix of the drafts is accepted, plus one token of the
     target's own (a recovery token, or the bonus token after all K); greedy verification
     walks on into a branch that holds the target's token (verifier.greedy_tree), and a
     sampled round takes a sibling drawn in the recovery token's place (the multi-candidate
     rule); a taken branch's row gives the target's next token;
  4. accept: the target's KV cache keeps the valid prefix (rolling back is a truncation).

Each sequence's round leaves one record, `Round` (records.py): what was asked for, the draft
source's `Proposal` (its tokens, where they came from, what they cost), the verdict, what the
target kept and what the round cost. Whoever learns from rounds reads the records after the
round: the K policy (adaptive_k.py), the draft source (what the draft holds that is right),
the request's metrics (RequestMetrics.record); an SSD worker learns the outcome from the next
request, where the speculation cache and the fan-out read it (ssd_draft.py).
"""
import time
from collections import abc

import torch
import torch.nn.functional as F

from ssd.request.sampler import probs_from_logits, sample, token_logprobs
from ssd.request.sequence import Sequence
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.speculative.plan import Plan
from ssd.speculative.policy.siblings import MAX_PER_SEQUENCE, keep_path, offered
from ssd.speculative.records import Branch, Proposal, Round, RoundTimes
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.verifier import greedy_tree, verify, verify_with_siblings


def speculative_round(plan: Plan, source: DraftSource, target: ModelRunner, cache: PagedKVCache,
                      seqs: list[Sequence]) -> list[Round]:
    """One round for the decoding sequences by `plan` (its K already within each sequence's
    room, Plan.within); `cache` is the target's KV cache, which `target` writes."""
    t0 = time.perf_counter()
    # 1. propose (where the plan carries a lookup's tokens, those: sources/beside.py).
    proposals = source.propose(seqs, plan.seqs)
    trees = _branches(plan, seqs, proposals, cache)
    t1 = time.perf_counter()
    # 2. score every proposal, and its branches, in one pass of the target.
    out = target.forward([Chunk(s.seq_id, [s.token_ids[-1]] + p.tokens + [b.token for b in br], s.num_tokens - 1,
                                len(p.tokens) + 1 + len(br), [b.parent for b in br])
                          for s, p, br in zip(seqs, proposals, trees)], taps=source.capabilities.taps)
    logits, states = out if source.capabilities.taps else (out, None)
    if states is not None:  # [taps, rows, hidden] -> [rows, taps x hidden]
        states = states.permute(1, 0, 2).reshape(states.shape[1], -1)
    # Every row's argmax read at once (greedy verdicts need nothing else: one read for the
    # batch, not one per sequence). The read waits for the pass, so t2 - t1 is the pass's time
    # on a GPU too, where the launch returns at once: auto-K's V (timing the launch alone, auto-K
    # never drafted: docs/decision-log.md).
    best = logits.argmax(-1).tolist() if any(_greedy(s) for s in seqs) else None
    if best is None and logits.is_cuda:
        torch.cuda.current_stream(logits.device).synchronize()
    t2 = time.perf_counter()
    # The batch's times, one record; the source's timings of its drafting are on each of its proposals.
    timed = next((p for p in proposals if not p.lookup), Proposal([]))
    times = RoundTimes(t1 - t0, t2 - t1, True, timed.step_s, timed.catchup)
    rounds, row = [], 0
    for seq, k, prop, br in zip(seqs, plan.ks, proposals, trees):
        n, first = len(prop.tokens), row
        tree = logits[row:row + n + 1 + len(br)]
        row += n + 1 + len(br)
        rows = tree[:n + 1]
        greedy = best[first:row] if _greedy(seq) else None
        if seq.processor is not None and seq.params.greedy_decoding and seq.params.logprobs is None:
            # Row i after the draft tokens before it, as AR would have it: only its argmax counts.
            greedy = seq.processor.argmax(rows, seq.token_ids, prop.tokens) + tree[n + 1:].argmax(-1).tolist()
        elif seq.processor is not None:
            rows = seq.processor.process(rows, seq.token_ids, prop.tokens)
        # 3. verify, then 4. accept: the target's cache keeps the path that stands.
        accepted, taken, token = _verify(seq, prop, br, rows, tree, greedy)
        path = list(range(1, accepted + 1)) + [n + 1 + i for i in taken]  # the tree's nodes kept, by depth
        keep_path(cache, seq, path, n)
        cache.truncate(seq.seq_id, seq.num_tokens + len(path))
        tokens = prop.tokens[:accepted] + [br[i].token for i in taken] + [token]
        lps = None if seq.params.logprobs is None else token_logprobs(rows, tokens, seq.params.logprobs)
        stand = None if states is None else states[[first + i for i in [0] + path]]
        # Where the draft stopped by its own rule, K was only a cap: the round asked for what it drafted.
        asked_k = k if prop.confidences is None else n
        kept = None if prop.lookup else seq.num_tokens + accepted  # the draft holds the chain, not branches
        rounds.append(Round(seq, asked_k, prop, accepted, tokens, times, lps, br, len(taken), kept, stand))
    return rounds


def _branches(plan: Plan, seqs: list[Sequence], proposals: list[Proposal], cache: PagedKVCache
              ) -> list[list[Branch]]:
    """The branches the plan's terms take beside the drafted chains, where the target's KV
    cache has slots for them past the chain's (reserved here)."""
    if plan.siblings is None:
        return [[] for _ in seqs]
    room = []
    for s, p in zip(seqs, proposals):
        need = s.num_tokens + len(p.tokens) + min(MAX_PER_SEQUENCE, len(offered(p)))
        fits = bool(p.alternatives or p.candidates) and cache.can_reserve(s.seq_id, need)
        if fits:
            cache.reserve(s.seq_id, need)
        room.append(fits)
    return plan.siblings.choose(proposals, room)


def _greedy(seq: Sequence) -> bool:
    """Verified from the target's argmax alone: greedy, the logits as the model gives them."""
    return seq.params.greedy_decoding and seq.processor is None


def _verify(seq: Sequence, prop: Proposal, br: list[Branch], rows: torch.Tensor, tree: torch.Tensor,
            best: list[int] | None) -> tuple[int, list[int], int]:
    """The verdict on one sequence's proposal (verifier.py) from its chain's K + 1 rows as the
    request changes them and the whole tree's logits (the branches' rows after the chain's),
    or for a request verified from the argmax alone (_greedy) the tree's argmax `best`: the
    chain's drafts accepted, the branches taken after them, and the target's token after."""
    n = len(prop.tokens)
    if seq.params.greedy_decoding:
        if best is None:
            best = rows.argmax(-1).tolist() + tree[n + 1:].argmax(-1).tolist()
        return greedy_tree(best, prop.tokens, br)
    if seq.noise is not None:  # the target's own draws decide: drafter-invariant (noise.py)
        return greedy_tree(_Draws(seq, rows, tree[n + 1:], br), prop.tokens, br)
    p = probs_from_logits(rows, seq.params)
    # The target's head may be padded past the draft's vocabulary: q is 0 there.
    q = None if prop.q is None else F.pad(prop.q.to(p.device), (0, p.shape[-1] - prop.q.shape[-1]))
    drafts = torch.tensor(prop.tokens, dtype=torch.long)
    if not br:
        verdict = verify(p, drafts, q, seq.generator)
        return verdict.accepted, [], verdict.token
    # Sampled rounds get sibling leaves only (branches off the chain; siblings.py).
    verdict, took = verify_with_siblings(p, drafts, q, {b.parent: b.token for b in br}, seq.generator)
    if not took:
        return verdict.accepted, [], verdict.token
    i = next(i for i, b in enumerate(br) if b.parent == verdict.accepted)
    return verdict.accepted, [i], int(sample(probs_from_logits(tree[n + 1 + i:n + 2 + i], seq.params),
                                             seq.generator)[0])


class _Draws(abc.Sequence):
    """A seeded request's draws under shared noise at the nodes of a round's tree, each
    computed when greedy_tree first reads it (the rows past the first rejection cost nothing):
    node i's row gives the token at the sequence's position num_tokens + depth(i)."""

    def __init__(self, seq: Sequence, chain: torch.Tensor, branches: torch.Tensor, tree: list[Branch]):
        """chain: the chain's rows as the request changes them (the newest token's and one per
        draft); branches: a row per branch of the tree, after them."""
        self.seq, self.chain, self.branches, self.drawn = seq, chain, branches, {}
        self.depth = list(range(len(chain)))
        for b in tree:
            self.depth.append(self.depth[b.parent] + 1)

    def __getitem__(self, node: int) -> int:
        if node not in self.drawn:
            seq, n = self.seq, len(self.chain)
            row = self.chain[node:node + 1] if node < n else self.branches[node - n:node - n + 1]
            p = probs_from_logits(row, seq.params)
            self.drawn[node] = seq.noise.choose(p, [seq.num_tokens + self.depth[node]])[0]
        return self.drawn[node]

    def __len__(self) -> int:
        return len(self.depth)
