"""SD's draft source: the draft model in the target's process, drafting between the target's
passes (ssd/speculative/draft/draft_engine.py); SSD's worker drafts the same way in this
process when it fails over (ssd_worker.py)."""
from ssd.request.sequence import Sequence
from ssd.runner.kv_cache import CacheFullError
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import IN_PROCESS, Proposal
from ssd.speculative.sources.base import DraftSource


class DraftModel(DraftSource):
    """SD: the draft model runs in the target's process, between the target's passes."""

    capabilities = IN_PROCESS

    def __init__(self, engine: DraftEngine, context: int, weights: str):
        super().__init__(context)
        self.engine, self.weights = engine, weights

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        return propose_locally(self, self.engine, seqs, plans)

    def step_cost(self) -> float | None:
        try:
            return self.engine.runner.timed_pass(1, repeat=2)
        except CacheFullError:  # every block of the draft's cache held: no pass to time now
            return None

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.engine.release(seq_id)

    def held(self) -> dict[str, int]:
        return {**super().held(), **self.engine.held()}

    def kv_blocks_in_use(self) -> int | None:
        return self.engine.kv.blocks_in_use


def propose_locally(source: DraftSource, engine: DraftEngine, seqs: list[Sequence],
                    plans: list[SeqPlan]) -> list[Proposal]:
    """SD's proposals: tell the draft what the target kept, then draft each plan's K tokens. A
    request that changes its logits (penalties, a constraint) has the draft propose under
    the same changes, from a copy of its own."""
    drafts = []
    for seq, plan in zip(seqs, plans):
        num_valid, tokens, params = source.next_update(seq)
        fork = seq.processor.fork() if params is not None and seq.processor is not None else None
        drafts.append(engine.sync(seq.seq_id, num_valid, tokens, params, plan.k, fork))
    return engine.draft(drafts, [p.k for p in plans], any(p.alternatives for p in plans), [p.stop for p in plans])
