"""A draft source, the target's side of drafting: one Proposal per sequence and round.

A draft source is told only what a round's plan asks of it (plan.py) and learns the round's
outcome from its records. What the draft already holds of each sequence is tracked here:
after a round where the target kept `kept` tokens, the draft's first `kept` tokens are still
right, and the next round tells it only what came after (the target's own token, or the whole
prompt the first time). DraftModel (SD, draft_model.py) drafts in this process; SSDWorker
(SSD, ssd_worker.py) asks the draft worker; prompt lookup (ngram.py) needs no model.
"""
from contextlib import AbstractContextManager, nullcontext

import torch

from ssd.request.sequence import Sequence
from ssd.sampling_params import SamplingParams
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import Capabilities, Proposal, Round


class DraftSource:
    """The interface every draft source has; a new source implements `propose` (and `release`
    where it keeps anything per sequence)."""

    capabilities = Capabilities()  # what it can do (records.py), all that the engine and the policy read of it
    # What its accepted tokens are marked as in outputs and streams (RequestOutput.sources): "draft"
    # (a draft model, in this process or a worker's), "head", "lookup" or "suffix".
    kind = "draft"
    # Prompt lookup or suffix decoding beside it (a composite's, beside.py): auto-K weighs its
    # tokens against the draft's per sequence and round, and a plan says which are proposed.
    lookup: "DraftSource | None" = None
    # The index of earlier requests' text it proposes from (suffix decoding's, suffix.py): the
    # engine keeps it and saves it (suffix_keep).
    suffix_index = None
    weights: str | None = None  # how a draft model's weights are held, "auto" resolved (None: no model)

    def __init__(self, context: int | None = None):
        """context: the positions a draft model holds (None: no model, no limit)."""
        self.context = context
        self.known: dict[int, int] = {}  # seq_id -> leading tokens the draft holds that are right
        self.failures = 0  # SSD: how often the draft worker failed and SD took over

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        """Up to plans[i].k draft tokens for each sequence (fewer where the draft's context ends)."""
        raise NotImplementedError

    def learn(self, rounds: list[Round]) -> None:
        """The rounds' outcomes: of each sequence this source proposed for, the target kept its
        first `kept` tokens, so that much of what the draft holds is right."""
        for r in rounds:
            if r.kept is not None:
                self.known[r.seq.seq_id] = r.kept

    def states(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """The target's hidden states (its capabilities' `taps` layers joined, [n, taps x hidden]) at the
        sequence's positions start..start + n - 1, from a pass outside a round (prompt chunks,
        plain steps); a round's come in its record (Round.states)."""

    def wait_ready(self) -> None:
        """Return once the draft can answer (SSD: its worker has loaded the model)."""

    def step_cost(self) -> float | None:
        """Seconds the target waits per draft token, as first guessed before any round is
        timed (SSD: 0, its drafting is meant to be hidden; prompt lookup: 0); None where no
        step can be timed now."""
        return 0.0

    def kv_blocks_in_use(self) -> int | None:
        """The draft's KV cache blocks held, where this process holds them (None: elsewhere or none)."""
        return None

    def placement(self, drafting: bool = True) -> AbstractContextManager:
        """The target's share of the hardware for a step (SSD: its cores, pinned; in a step
        without a speculative round, also the draft worker's idle cores)."""
        return nullcontext()

    def next_update(self, seq: Sequence) -> tuple[int, list[int], SamplingParams | None]:
        """What the draft must be told of seq this round, from then on taken as known: how many
        of the tokens it holds are right, the target's tokens after those, and the sampling
        params the first time."""
        n = self.known.get(seq.seq_id)
        self.known[seq.seq_id] = seq.num_tokens
        return n or 0, seq.token_ids[n or 0:], seq.params if n is None else None

    def release(self, seq_id: int) -> None:
        """Forget a sequence here and on the draft's side (registered with the engine's
        registry, ssd/engine/registry.py)."""
        self.known.pop(seq_id, None)

    def held(self) -> dict[str, int]:
        """Sequences known here, and what the draft side holds per sequence."""
        return {"sequences": len(self.known)}

    def close(self) -> None:
        pass
