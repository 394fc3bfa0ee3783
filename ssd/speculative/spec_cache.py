"""The speculation cache of SSD: for each hypothesised outcome of the round the target is
verifying, the draft's next speculation, ready before the outcome is known.

An outcome is (k, t): k draft tokens accepted, then t, the target's recovery token (k < K)
or bonus token (k == K). The entry for (sequence, k, t) holds the K draft tokens that
continue `prefix + d_1..d_k + t`, and the K distributions q they were drawn from (None for
greedy requests, whose verification needs no q). Entries live for one round: a sequence's
entries are dropped as soon as its real outcome has been looked up.
"""
from dataclasses import dataclass

import torch

from ssd.speculative.draft_engine import DraftSeq


@dataclass
class Branch:
    tokens: list[int]  # d'_1..d'_K
    # Rows [V] of the processed draft distribution each token was drawn from: views into the
    # tree's per-depth tensors, stacked only for the branch that is used (q).
    q_rows: list[torch.Tensor] | None

    @property
    def q(self) -> torch.Tensor | None:  # [K, V]
        return None if self.q_rows is None else torch.stack(self.q_rows)


@dataclass
class Lookup:
    branch: Branch | None  # the entry for the real outcome; None: a miss
    same_depth: list[Branch]  # the entries forked at the outcome's depth, most likely first


def outcome(s: DraftSeq, num_valid: int, new_tokens: list[int]) -> tuple[int, int] | None:
    """The outcome (k, t) of the round of sequence s, as its next request tells it (before the
    draft engine applies it): the first num_valid tokens stand, then new_tokens. None: a first
    request, or one after the draft's context was cut short."""
    if not (s.spec and s.confirmed <= num_valid and len(new_tokens) == 1):
        return None
    return num_valid - s.confirmed, new_tokens[0]


class SpeculationCache:
    def __init__(self) -> None:
        self._entries: dict[int, dict[tuple[int, int], Branch]] = {}

    def put(self, seq_id: int, k: int, t: int, branch: Branch) -> None:
        self._entries.setdefault(seq_id, {})[(k, t)] = branch

    def lookup(self, seq_id: int, end: tuple[int, int] | None) -> Lookup:
        """The entry for the round's outcome `end` (k, t), and those forked at its depth. Takes
        the sequence's entries of the round: the cache keeps nothing of it after this."""
        entries = self._entries.pop(seq_id, {})
        if end is None:
            return Lookup(None, [])
        return Lookup(entries.get(end), [b for (j, _), b in entries.items() if j == end[0]])

    def entries(self, seq_id: int) -> dict[tuple[int, int], Branch]:
        """The sequence's entries of the round in flight, keyed (k, t), most likely fork first
        at each depth (a look, not a lookup)."""
        return dict(self._entries.get(seq_id, {}))

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)

    def __len__(self) -> int:
        return sum(map(len, self._entries.values()))
