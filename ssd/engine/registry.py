"""Everything the target's side keeps per sequence, released in one call.

Each component that holds state for a sequence (the target's KV cache, the draft source and
the draft it drives, the K policy) registers here under a name; when a sequence ends
(finished, cancelled) or is preempted, the scheduler releases it here and every holder
forgets it. `held()` reports what each still holds, so that a test (and a reader) can see
that nothing is left once no request is in flight.
"""
from typing import Protocol


class Holder(Protocol):
    def release(self, seq_id: int) -> None:
        """Forget sequence seq_id (nothing happens for one it does not hold)."""

    def held(self) -> dict[str, int]:
        """What it still holds, by structure: sequences in it, or cache blocks."""


class Registry:
    def __init__(self) -> None:
        self._holders: dict[str, Holder] = {}

    def register(self, name: str, holder: Holder) -> None:
        """Add a holder; one registered under the same name before is replaced (a new K policy)."""
        self._holders[name] = holder

    def release(self, seq_id: int) -> None:
        for holder in self._holders.values():
            holder.release(seq_id)

    def held(self) -> dict[str, int]:
        return {f"{name}: {what}": n for name, holder in self._holders.items() for what, n in holder.held().items()}
