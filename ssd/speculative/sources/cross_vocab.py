"""A draft model with another tokenizer (any draft for any target), in SD: the draft works in
its own tokens, and text carries what passes between the two vocabularies at each round's
boundary, as Hugging Face's universal assisted generation does.

Each round, a sequence's text so far (the target's tokens decoded) is encoded with the draft's
tokenizer; the draft keeps the longest prefix of what it holds that agrees (its K/V stay) and
reads the rest. It drafts K of its tokens; their text, appended to the sequence's, is encoded
with the target's tokenizer, and the target tokens past the sequence's are the proposal: all
but the last (which the draft's next text might merge into a longer token), at most K. So that
K of them come out, the draft drafts (K + 1) / r of its tokens, r the target's tokens per draft
token measured so far (about 0.9-0.97 for SmolLM2 -> Qwen2.5; drafting only K left a K of 1
with nothing to propose, and auto-K chose it), and the proposal's step_s is the draft's time
per proposed target token, the cost auto-K weighs. Where encoding the text again does not give
back the sequence's own tokens (a tokenizer that is not stable across the boundary), the round
proposes nothing. The proposals are one-hot (q = None:
not drawn from a distribution over the target's tokens), so verification keeps the output
exactly the target's, greedy or sampled (docs/exactness.md).
"""
import math
from dataclasses import replace

from ssd.request.sequence import Sequence
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import Proposal, round_k
from ssd.speculative.sources.draft_model import DraftModel


RATIO_EMA = 0.1  # the moving average of target tokens per draft token


def draft_steps(k: int) -> int:
    """The most draft tokens a round of K target tokens drafts: another tokenizer may cut the
    same text into about twice as many tokens, and the last is dropped (module doc)."""
    return 2 * k + 1


class CrossVocab(DraftModel):
    """SD with a draft model of another tokenizer: a DraftModel whose proposals cross through text."""

    # Its confidences are in its own tokens, which the crossing regroups, and a round it
    # stopped after one token would propose nothing: auto-K's K stands.
    capabilities = replace(DraftModel.capabilities, stops_by_confidence=False)

    def __init__(self, engine: DraftEngine, target_tokenizer, draft_tokenizer, context: int, weights: str):
        super().__init__(engine, context, weights)
        self.target_tok, self.draft_tok = target_tokenizer, draft_tokenizer
        self.ratio = 1.0  # target tokens per draft token, a moving average (module doc)

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        texts, contexts, drafts, steps = [], [], [], []
        for seq, plan in zip(seqs, plans):
            text = self.target_tok.decode(seq.token_ids)
            ids = self.draft_tok.encode(text, add_special_tokens=False)
            held = self.engine.seqs.get(seq.seq_id)  # its tokens from `offset` on (a draft window cuts the rest)
            keep = held.offset + _agree(held.tokens, ids[held.offset:]) if held else 0
            keep = min(keep, len(ids) - 1)  # it reads at least the newest token
            n = min(draft_steps(plan.k), math.ceil((plan.k + 1) / max(self.ratio, 0.5))) if plan.k else 0
            steps.append(round_k(n, len(ids), self.engine.max_len))
            drafts.append(self.engine.sync(seq.seq_id, keep, ids[keep:], seq.params if held is None else None,
                                           steps[-1]))
            texts.append(text)
            contexts.append(ids)
        drafted = self.engine.draft(drafts, steps, stops=[p.stop for p in plans])
        proposed = [self._to_target(seq, text, ids, d.tokens, plan.k)
                    for seq, plan, text, ids, d in zip(seqs, plans, texts, contexts, drafted)]
        # The draft's time per proposed target token (a round that proposes nothing counts as one).
        step_s = drafted[0].step_s if drafted else None
        if step_s is not None:
            step_s *= max(len(d.tokens) for d in drafted) / max(1, max(map(len, proposed)))
        return [Proposal(p, step_s=step_s, catchup=d.catchup) for p, d in zip(proposed, drafted)]

    def _to_target(self, seq: Sequence, text: str, ids: list[int], drafted: list[int], k: int) -> list[int]:
        """The draft's tokens as the target's (module doc)."""
        if not drafted:
            return []
        before = self.draft_tok.decode(ids)
        after = self.draft_tok.decode(ids + drafted)
        if not after.startswith(before):
            return []
        tokens = self.target_tok.encode(text + after[len(before):], add_special_tokens=False)
        n = len(seq.token_ids)
        if tokens[:n] != seq.token_ids:
            return []
        self.ratio += RATIO_EMA * ((len(tokens) - n) / len(drafted) - self.ratio)
        return tokens[n:-1][:k]


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
