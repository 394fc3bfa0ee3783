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


class SpeculationCache:
    def __init__(self) -> None:
        self._entries: dict[int, dict[tuple[int, int], Branch]] = {}

    def put(self, seq_id: int, k: int, t: int, branch: Branch) -> None:
        self._entries.setdefault(seq_id, {})[(k, t)] = branch

    def pop_round(self, seq_id: int) -> dict[tuple[int, int], Branch]:
        """Take the sequence's entries of the round in flight, keyed (k, t), in the order they
        were put (most likely fork first at each depth). A lookup is `.get((k, t))`; the
        cache keeps nothing of the round after this."""
        return self._entries.pop(seq_id, {})

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)

    def __len__(self) -> int:
        return sum(map(len, self._entries.values()))
