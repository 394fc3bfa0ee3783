"""One speculative round, the same in SD and SSD: propose -> verify -> accept.

  1. propose: the draft side gives K tokens per sequence (SD: drafted now; SSD: usually
     ready in the speculation cache);
  2. the target scores [last, d_1..d_K] in one forward pass (K+1 rows of logits);
  3. verify (verifier.py): an exact prefix of the drafts is accepted, plus one token of the
     target's own (a recovery token, or the bonus token after all K);
  4. accept: the target's KV cache keeps the valid prefix (rolling back is a truncation),
     and the draft side is told what the target kept.
"""
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssd.engine.kv_cache import PagedKVCache
from ssd.engine.model_runner import Chunk, ModelRunner
from ssd.engine.sampler import probs_from_logits
from ssd.engine.sequence import Sequence
from ssd.speculative.speculator import Proposal, Speculator
from ssd.speculative.verifier import verify, verify_greedy


@dataclass
class RoundResult:
    proposal: Proposal
    accepted: int  # draft tokens the target accepted
    tokens: list[int]  # those tokens, then the target's own
    draft_s: float  # the target's wait for the proposals (the whole batch's)
    verify_s: float  # the target's verify pass (the whole batch's)


def speculative_round(speculator: Speculator, target: ModelRunner, cache: PagedKVCache, seqs: list[Sequence],
                      ks: list[int]) -> list[RoundResult]:
    """One round for the decoding sequences, ks[i] draft tokens asked for seqs[i]; `cache` is
    the target's KV cache, which `target` writes."""
    t0 = time.perf_counter()
    proposals = speculator.propose(seqs, ks)
    t1 = time.perf_counter()
    logits = target.forward([Chunk(s.seq_id, [s.token_ids[-1]] + p.tokens, s.num_tokens - 1, len(p.tokens) + 1)
                             for s, p in zip(seqs, proposals)])
    t2 = time.perf_counter()
    results, row = [], 0
    for seq, prop in zip(seqs, proposals):
        k = len(prop.tokens)
        rows, row = logits[row:row + k + 1], row + k + 1
        if seq.params.greedy_decoding:
            verdict = verify_greedy(rows, prop.tokens)
        else:
            p = probs_from_logits(rows, seq.params)
            # The target's head may be padded past the draft's vocabulary: q is 0 there.
            q = None if prop.q is None else F.pad(prop.q.to(p.device), (0, p.shape[-1] - prop.q.shape[-1]))
            verdict = verify(p, torch.tensor(prop.tokens, dtype=torch.long), q, seq.generator)
        valid = seq.num_tokens + verdict.accepted  # the tokens before the round and the accepted drafts
        cache.truncate(seq.seq_id, valid)
        speculator.accepted(seq, valid)
        results.append(RoundResult(prop, verdict.accepted, prop.tokens[:verdict.accepted] + [verdict.token],
                                   t1 - t0, t2 - t1))
    return results
