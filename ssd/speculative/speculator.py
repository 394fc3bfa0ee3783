"""The target's side of speculation, shared by SD and SSD: one Proposal per sequence and round.

What the draft already holds of each sequence is tracked here: after a round where the
target kept `num_valid` tokens, the draft's first `num_valid` tokens are still right, and
the next round tells it only what came after (the target's own token, or the whole prompt
the first time). LocalSpeculator (SD) drafts in this process; RemoteSpeculator (SSD,
remote.py) asks the draft worker.
"""
from contextlib import AbstractContextManager, nullcontext

from ssd.engine.sequence import Sequence
from ssd.sampling_params import SamplingParams
from ssd.speculative.draft_engine import DraftEngine
from ssd.speculative.draft_stop import DraftStop
from ssd.speculative.records import Proposal


class Speculator:
    def __init__(self) -> None:
        self.known: dict[int, int] = {}  # seq_id -> leading tokens the draft holds that are right
        self.failures = 0  # SSD: how often the draft worker failed and SD took over
        self.draft_weights: str | None = None  # how a draft model's weights are held, "auto" resolved
        self.context: int | None = None  # positions the draft model holds (None: no model, no limit)

    def wait_ready(self) -> None:
        """Return once the draft can answer (SSD: its worker has loaded the model)."""

    def step_cost(self) -> float:
        """Seconds the target waits per draft token, as first guessed before any round is
        timed (SSD: 0, its drafting is meant to be hidden; prompt lookup: 0)."""
        return 0.0

    # Whether last_step_s() times draft steps apart from catch-up (else adaptive_k.py takes a
    # round's wait per draft token).
    measures_steps = False

    def last_step_s(self) -> float | None:
        """Seconds per draft token in the last round, catch-up left out; None: no such step."""
        return None

    def last_catchup(self) -> tuple[float, int, float] | None:
        """The last round's catch-up where the draft timed it: (seconds, tokens it read that it
        had not seen: a prompt, tokens decoded while K was 0, and the keys their attention
        read); None: none, or not timed here."""
        return None

    def kv_blocks_in_use(self) -> int | None:
        """The draft's KV cache blocks held, where this process holds them (None: elsewhere or none)."""
        return None

    def placement(self, drafting: bool = True) -> AbstractContextManager:
        """The target's share of the hardware for a step (SSD: its cores, pinned; in a step
        without a speculative round, also the draft worker's idle cores)."""
        return nullcontext()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to ks[i] draft tokens for each sequence (fewer where the draft's context ends)."""
        raise NotImplementedError

    def next_update(self, seq: Sequence) -> tuple[int, list[int], SamplingParams | None]:
        """What the draft must be told of seq this round, from then on taken as known: how many
        of the tokens it holds are right, the target's tokens after those, and the sampling
        params the first time."""
        n = self.known.get(seq.seq_id)
        self.known[seq.seq_id] = seq.num_tokens
        return n or 0, seq.token_ids[n or 0:], seq.params if n is None else None

    def kept(self, seq: Sequence, num_valid: int) -> None:
        """After verification the target kept the sequence's first num_valid tokens: that much
        of what the draft holds is right."""
        self.known[seq.seq_id] = num_valid

    def release(self, seq_id: int) -> None:
        """Forget a sequence here and on the draft's side (registered with the engine's
        registry, ssd/engine/registry.py)."""
        self.known.pop(seq_id, None)

    def held(self) -> dict[str, int]:
        """Sequences known here, and what the draft side holds per sequence."""
        return {"sequences": len(self.known)}

    def close(self) -> None:
        pass


class LocalSpeculator(Speculator):
    """SD: the draft runs in the target's process, between the target's passes."""

    measures_steps = True

    def __init__(self, engine: DraftEngine):
        super().__init__()
        self.engine = engine
        self.alternatives = False  # also each drafted token's runner-up (sibling leaves, siblings.py)
        self.stop: DraftStop | None = None  # the K policy's stopping rule (draft_stop.py), if it has one

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return propose_locally(self, self.engine, seqs, ks, self.alternatives, self.stop)

    def step_cost(self) -> float:
        return self.engine.runner.timed_pass(1, repeat=2)

    def last_step_s(self) -> float | None:
        return self.engine.step_s

    def last_catchup(self) -> tuple[float, int, float] | None:
        return self.engine.catchup

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.engine.release(seq_id)

    def held(self) -> dict[str, int]:
        return {**super().held(), **self.engine.held()}

    def kv_blocks_in_use(self) -> int | None:
        return self.engine.kv.blocks_in_use


def propose_locally(speculator: Speculator, engine: DraftEngine, seqs: list[Sequence], ks: list[int],
                    alternatives: bool = False, stop: DraftStop | None = None) -> list[Proposal]:
    """SD's proposals: tell the draft what the target kept, then draft K tokens for each. A
    request that changes its logits (penalties, a constraint) has the draft propose under
    the same changes, from a copy of its own."""
    drafts = []
    for seq, k in zip(seqs, ks):
        num_valid, tokens, params = speculator.next_update(seq)
        fork = seq.processor.fork() if params is not None and seq.processor is not None else None
        drafts.append(engine.sync(seq.seq_id, num_valid, tokens, params, k, fork))
    return [Proposal(tokens, q, alternatives=alts, confidences=confs)
            for tokens, q, alts, confs in engine.draft(drafts, ks, alternatives, stop)]
