"""A draft in this process with prompt lookup or suffix decoding beside it, as one draft source.

Text that repeats (code edits, quoted input, earlier answers) is proposed deeper and at no cost
by a lookup; elsewhere the draft model's or head's tokens are the better guess. Auto-K weighs
both per sequence and round (adaptive_k.py, reading `lookup`) and its plan says which: a
sequence whose plan carries the lookup's tokens is proposed those (the draft then holds nothing
new of it, and its next round there catches up), the others are the draft's to propose. Under a
fixed K the plan never carries lookup tokens, and this is the draft alone.
"""
import torch

from ssd.request.sequence import Sequence
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import Proposal, Round
from ssd.speculative.sources.base import DraftSource


class Beside(DraftSource):
    """`draft` (a source that drafts in this process) with `lookup` beside it (module doc)."""

    def __init__(self, draft: DraftSource, lookup: DraftSource):
        super().__init__(draft.context)
        self.draft, self.lookup = draft, lookup
        self.capabilities, self.weights, self.suffix_index = draft.capabilities, draft.weights, lookup.suffix_index
        self.kind = draft.kind

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        asked = [b for b, p in enumerate(plans) if p.lookup is None]
        drafted = iter(self.draft.propose([seqs[b] for b in asked], [plans[b] for b in asked]) if asked else [])
        return [Proposal(p.lookup, lookup=True, candidates=list(p.lookup_tree)) if p.lookup is not None
                else next(drafted) for p in plans]

    def learn(self, rounds: list[Round]) -> None:
        self.draft.learn(rounds)

    def states(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        self.draft.states(seq, start, rows)

    def wait_ready(self) -> None:
        self.draft.wait_ready()

    def step_cost(self) -> float | None:
        return self.draft.step_cost()

    def kv_blocks_in_use(self) -> int | None:
        return self.draft.kv_blocks_in_use()

    def release(self, seq_id: int) -> None:
        self.draft.release(seq_id)
        self.lookup.release(seq_id)

    def held(self) -> dict[str, int]:
        return {**self.draft.held(), **self.lookup.held()}

    def close(self) -> None:
        self.draft.close()
        self.lookup.close()
