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


class SpeculationCache:
    """One sequence's entries for the round in flight (its DraftSeq holds it), keyed (k, t),
    the most likely fork first at each depth."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, int], Branch] = {}

    def put(self, k: int, t: int, branch: Branch) -> None:
        self.entries[(k, t)] = branch

    def lookup(self, end: tuple[int, int] | None) -> Lookup:
        """The entry for the round's outcome `end` (k, t; None: no outcome to look up), and
        those forked at its depth. Takes the round's entries: none is kept after this."""
        entries, self.entries = self.entries, {}
        if end is None:
            return Lookup(None, [])
        return Lookup(entries.get(end), [b for (j, _), b in entries.items() if j == end[0]])

    def __len__(self) -> int:
        return len(self.entries)
