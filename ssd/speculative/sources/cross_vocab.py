"""A draft model with another tokenizer (any draft for any target), in SD: the draft works in
its own tokens, and text carries what passes between the two vocabularies at each round's
boundary, as Hugging Face's universal assisted generation does.

Each round, a sequence's text so far (the target's tokens decoded) is encoded with the draft's
tokenizer; the draft keeps the longest prefix of what it holds that agrees (its K/V stay) and
reads the rest. It drafts K of its tokens; their text, appended to the sequence's, is encoded
with the target's tokenizer, and the target tokens past the sequence's are the proposal: all
but the last (which the draft's next text might merge into a longer token), at most K. Where
encoding the text again does not give back the sequence's own tokens (a tokenizer that is not
stable across the boundary), the round proposes nothing. The proposals are one-hot (q = None:
not drawn from a distribution over the target's tokens), so verification keeps the output
exactly the target's, greedy or sampled (docs/exactness.md).
"""
from ssd.request.sequence import Sequence
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import Proposal
from ssd.speculative.sources.draft_model import DraftModel


class CrossVocab(DraftModel):
    """SD with a draft model of another tokenizer: a DraftModel whose proposals cross through text."""

    def __init__(self, engine: DraftEngine, target_tokenizer, draft_tokenizer, context: int, weights: str):
        super().__init__(engine, context, weights)
        self.target_tok, self.draft_tok = target_tokenizer, draft_tokenizer

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        texts, contexts, drafts = [], [], []
        for seq, plan in zip(seqs, plans):
            text = self.target_tok.decode(seq.token_ids)
            ids = self.draft_tok.encode(text, add_special_tokens=False)
            held = self.engine.seqs.get(seq.seq_id)  # its tokens from `offset` on (a draft window cuts the rest)
            keep = held.offset + _agree(held.tokens, ids[held.offset:]) if held else 0
            keep = min(keep, len(ids) - 1)  # it reads at least the newest token
            drafts.append(self.engine.sync(seq.seq_id, keep, ids[keep:], seq.params if held is None else None,
                                           plan.k))
            texts.append(text)
            contexts.append(ids)
        proposals = self.engine.draft(drafts, [p.k for p in plans], stops=[p.stop for p in plans])
        return [Proposal(self._to_target(seq, text, ids, prop.tokens, plan.k), step_s=prop.step_s,
                         catchup=prop.catchup)
                for seq, plan, text, ids, prop in zip(seqs, plans, texts, contexts, proposals)]

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
        return tokens[n:-1][:k]


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
