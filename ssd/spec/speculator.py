"""The target's side of speculation, shared by SD and SSD: what the draft already holds of
each sequence, turned into one request per sequence and round.

After a round where the target accepted k of the draft's tokens and added its own token t,
the draft's first `num_tokens_before + k` tokens are still right; the next request says so
(num_valid) and carries the tokens after them ([t], or a whole prompt the first time). The
draft side (ssd/spec/draft_engine.py) answers with the next K tokens. LocalSpeculator runs
it in this process (SD); ssd/spec/remote.py talks to it in the draft worker (SSD).
"""
from contextlib import AbstractContextManager, nullcontext

from ssd.engine.sequence import Sequence
from ssd.spec.draft_engine import DraftEngine, SpecReply, SpecRequest


class Speculator:
    def __init__(self) -> None:
        self.known: dict[int, int] = {}  # seq_id -> leading tokens the draft holds that are right
        self.released: list[int] = []  # sequences the draft may forget, sent with the next request
        self.timings: dict = {}  # the draft worker's timings of the last exchange (SSD)
        self.failures = 0  # SSD: how often the draft worker failed and SD took over

    def wait_ready(self) -> None:
        """Return once the draft can answer (SSD: its worker has loaded the model)."""

    def placement(self) -> AbstractContextManager:
        """The target's share of the hardware while it runs (SSD: its cores, pinned)."""
        return nullcontext()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[SpecReply]:
        """K_b draft tokens for each sequence (fewer where the draft's context ends)."""
        requests = []
        for seq, k in zip(seqs, ks):
            n = self.known.get(seq.seq_id)
            requests.append(SpecRequest(seq.seq_id, n or 0, seq.token_ids[n or 0:], k,
                                        seq.params if n is None else None))
            self.known[seq.seq_id] = seq.num_tokens
        release, self.released = self.released, []
        return self._exchange(requests, release)

    def accepted(self, seq: Sequence, num_valid: int) -> None:
        """After verification: the sequence's first num_valid tokens are what the draft holds."""
        self.known[seq.seq_id] = num_valid

    def release(self, seq: Sequence) -> None:
        if self.known.pop(seq.seq_id, None) is not None:
            self.released.append(seq.seq_id)

    def close(self) -> None:
        pass

    def _exchange(self, requests: list[SpecRequest], release: list[int]) -> list[SpecReply]:
        raise NotImplementedError


def exchange_locally(engine: DraftEngine, requests: list[SpecRequest], release: list[int]) -> list[SpecReply]:
    engine.release(release)
    return engine.step(requests)


class LocalSpeculator(Speculator):
    """SD: the draft runs in the target's process, between the target's passes."""

    def __init__(self, engine: DraftEngine):
        super().__init__()
        self.engine = engine

    def _exchange(self, requests: list[SpecRequest], release: list[int]) -> list[SpecReply]:
        return exchange_locally(self.engine, requests, release)
