"""Draft-free speculation by prompt lookup (n-gram drafting): the last n tokens of a sequence
are looked up in its own earlier tokens (prompt and output), and the K tokens that followed
their most recent earlier occurrence are proposed. Summaries, code edits and answers that
quote their input repeat long spans of it, which this proposes at no cost.

The proposals are not drawn from any distribution, so they are verified as one-hot proposals
(q = None, ssd/speculative/verifier.py): exact for greedy and sampled requests alike.
"""
from ssd.request.sequence import Sequence
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import Proposal
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.ngram_index import NgramIndex


class PromptLookup(DraftSource):
    kind = "lookup"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        """ngram_min, ngram_max: as checked by the speculation options (check_ngram_sizes)."""
        super().__init__()
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        return [Proposal(self.match(seq, p.k)[0]) for seq, p in zip(seqs, plans)]

    def release(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)

    def held(self) -> dict[str, int]:
        return {"n-gram indexes": len(self.indexes)}

    def match(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier occurrence of the sequence's newest
        n-gram, longest n first, and that n (0: none found, or k = 0)."""
        tokens = seq.token_ids
        index = self.indexes.setdefault(seq.seq_id, NgramIndex(self.ngram_max))
        index.extend(tokens, len(tokens))  # the n-grams that end before the newest token (the query's)
        return index.match(tokens, k, self.ngram_min)
