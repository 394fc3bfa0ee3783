"""One speculative round, the same in SD and SSD: propose -> verify -> accept, and its record.

  1. propose: the draft side gives K tokens per sequence (SD: drafted now; SSD: usually
     ready in the speculation cache);
  2. the target scores [last, d_1..d_K] in one forward pass (K+1 rows of logits), with SD's
     sibling leaves where the K policy chose some (siblings.py: the draft's runner-up beside
     d_j, one more row each);
  3. verify (verifier.py): an exact prefix of the drafts is accepted, plus one token of the
     target's own (a recovery token, or the bonus token after all K); where a sibling is that
     recovery token (greedy), or is drawn in its place (sampled: the multi-candidate rule), it
     is taken and its row gives the target's next token too;
  4. accept: the target's KV cache keeps the valid prefix (rolling back is a truncation),
     and the draft side is told what the target kept.

Each sequence's round leaves one record, `Round`: what was asked for, the draft side's
`Proposal` (its tokens, where they came from, what they cost the draft side), the verdict,
and what the round cost. The request's metrics (RequestMetrics.record) and the K policy
(adaptive_k.py) read it; an SSD worker learns the outcome from the next request, where the
speculation cache and the fan-out read it (ssd_draft.py).
"""
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ssd.engine.kv_cache import PagedKVCache
from ssd.engine.model_runner import Chunk, ModelRunner
from ssd.engine.sampler import probs_from_logits, sample, token_logprobs
from ssd.engine.sequence import Sequence
from ssd.speculative.records import Proposal, Round, Sibling
from ssd.speculative.siblings import MAX_PER_SEQUENCE, keep_sibling
from ssd.speculative.speculator import Speculator
from ssd.speculative.verifier import rescue, verify, verify_greedy, verify_with_siblings


def speculative_round(speculator: Speculator, target: ModelRunner, cache: PagedKVCache, seqs: list[Sequence],
                      ks: list[int], lookups: dict[int, list[int]] | None = None,
                      siblings: Callable[[list[Sequence], list[Proposal]], list[list[Sibling]]] | None = None
                      ) -> list[Round]:
    """One round for the decoding sequences, ks[i] draft tokens asked for seqs[i]; `cache` is
    the target's KV cache, which `target` writes. lookups: prompt lookup's tokens by seq_id,
    proposed for those sequences instead of asking the draft (which then holds nothing new of
    them: its next round there catches up). siblings: the K policy's choice of sibling leaves
    for the proposals (siblings.py), verified in the same pass."""
    lookups = lookups or {}
    t0 = time.perf_counter()
    asked = [(s, k) for s, k in zip(seqs, ks) if s.seq_id not in lookups]
    drafted = iter(speculator.propose([s for s, _ in asked], [k for _, k in asked]) if asked else [])
    proposals = [Proposal(lookups[s.seq_id], lookup=True) if s.seq_id in lookups else next(drafted) for s in seqs]
    if siblings is not None:
        for s, p in zip(seqs, proposals):  # sibling leaves need slots past the chain's, where there are some
            if p.alternatives:
                need = s.num_tokens + len(p.tokens) + MAX_PER_SEQUENCE
                if cache.can_reserve(s.seq_id, need):
                    cache.reserve(s.seq_id, need)
                else:
                    p.alternatives = []
    leaves = siblings(seqs, proposals) if siblings is not None else [[] for _ in seqs]
    t1 = time.perf_counter()
    logits = target.forward([Chunk(s.seq_id, [s.token_ids[-1]] + p.tokens + [b.token for b in sib], s.num_tokens - 1,
                                   len(p.tokens) + 1 + len(sib), [1 + b.depth for b in sib])
                             for s, p, sib in zip(seqs, proposals, leaves)])
    t2 = time.perf_counter()
    step_s, catchup = (speculator.last_step_s(), speculator.last_catchup()) if asked else (None, None)
    rounds, row = [], 0
    for seq, k, prop, sib in zip(seqs, ks, proposals, leaves):
        n = len(prop.tokens)
        tree, row = logits[row:row + n + 1 + len(sib)], row + n + 1 + len(sib)
        rows = tree[:n + 1]
        if seq.processor is not None:  # row i after the draft tokens before it, as AR would have it
            rows = seq.processor.process(rows, seq.token_ids, prop.tokens)
        taken = None  # (sibling index, the token its row gives) where a sibling was taken
        if seq.params.greedy_decoding:
            verdict = verify_greedy(rows, prop.tokens)
            taken = rescue(tree, prop.tokens, sib, verdict.accepted, verdict.token) if sib else None
        else:
            p = probs_from_logits(rows, seq.params)
            # The target's head may be padded past the draft's vocabulary: q is 0 there.
            q = None if prop.q is None else F.pad(prop.q.to(p.device), (0, p.shape[-1] - prop.q.shape[-1]))
            drafts = torch.tensor(prop.tokens, dtype=torch.long)
            if sib:
                verdict, took = verify_with_siblings(p, drafts, q, {b.depth: b.token for b in sib}, seq.generator)
                if took:
                    i = next(i for i, b in enumerate(sib) if b.depth == verdict.accepted)
                    taken = i, int(sample(probs_from_logits(tree[n + 1 + i:n + 2 + i], seq.params), seq.generator)[0])
            else:
                verdict = verify(p, drafts, q, seq.generator)
        valid = seq.num_tokens + verdict.accepted  # the tokens before the round and the accepted drafts
        if not prop.lookup:
            speculator.kept(seq, valid)
        tokens = prop.tokens[:verdict.accepted] + [verdict.token]
        if taken is not None:  # the sibling at the rejected depth, then its row's token
            keep_sibling(cache, seq, n, taken[0], verdict.accepted)
            valid += 1
            tokens.append(taken[1])
        cache.truncate(seq.seq_id, valid)
        lps = None if seq.params.logprobs is None else token_logprobs(rows, tokens, seq.params.logprobs)
        # Where the draft stopped by its own rule, K was only a cap: the round asked for what it drafted.
        asked = k if prop.confidences is None else len(prop.tokens)
        rounds.append(Round(seq, asked, prop, verdict.accepted, tokens, t1 - t0, t2 - t1, step_s, catchup, lps,
                            len(sib), taken is not None))
    return rounds
