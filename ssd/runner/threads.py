"""How many CPU threads a model's passes run with, following the machine's load
(docs/kernels.md, "A busy machine").

A kernel shares a pass among its threads and waits for the last of them, so a thread whose
core another program holds makes every pass wait for it: with one of two cores busy, two
threads ran slower than one. The engine cannot see the load, but it sees its passes: each
pass's time over the fastest this runner ever took at its size is a ratio that a busy core
raises. Now and then, and at once where passes run slow, the chooser tries a neighbouring
thread count: passes alternate between the two counts (a change of load hits both alike),
and the count whose passes ran faster stays. A trial whose first pass at the other count is
far slower than the current count runs ends there (under load, two threads' pass costs twice
one thread's: three such passes a trial were most of what following the load cost). A trial
that changes nothing waits longer before the next, so a quiet machine pays little for the
checks; a machine that calms is tried again.

A row's bits do not depend on the thread count (the kernels' invariance), so a count changed
between passes changes no output. Threads a user asks for are not changed.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Protocol

TRIAL_PASSES = 3  # passes at each of the two counts a trial compares
MARGIN = 0.05  # the other count must run this much faster to be taken
# A trial's first pass at the other count this much slower than the current count's passes
# run (their reading) ends the trial: the other count is not taken. Above a quiet machine's one
# thread against two (1.45x), so that no trial a quiet machine makes is cut short by it.
ABANDON = 1.6
FIRST_WAIT = 32  # passes before the next trial after a change ...
WAIT_GROWTH = 4  # ... times this after each trial that changed nothing ...
MAX_WAIT = 2048  # ... up to this many at every thread ...
CALM_WAIT = 256  # ... and this many at fewer: a machine that calms is not seen otherwise
# Passes this much slower than the fastest at their size (a low quantile of the recent ones)
# call a trial within SLOW_WAIT passes.
SLOW = 1.3
SLOW_WAIT = 16


def _size(rows: int) -> int:
    """Passes compared as of one size: the same rows up to 16, then within a power of two."""
    return rows if rows <= 16 else 16 + rows.bit_length()


@dataclass
class _Trial:
    counts: tuple[int, int]  # (the current count, the other)
    ratios: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    turn: int = 1  # which count the next pass runs with

    def done(self) -> bool:
        return all(len(r) >= TRIAL_PASSES for r in self.ratios)


class Reading(Protocol):
    """A time read robustly over its recent measurements (the speculation policy's LowQuantile,
    ssd/speculative/policy/estimators.py, given by the caller: this layer is below it)."""

    value: float | None

    def observe(self, x: float) -> float: ...


class ThreadChooser:
    """The thread count of one model's passes (module doc): `threads()` before a pass,
    `observe()` after it. `reading` makes the estimator of the current count's ratios."""

    def __init__(self, most: int, reading: Callable[[], Reading]):
        self.most, self.reading = most, reading
        self.count = most
        self.fastest: dict[int, float] = {}  # by size: the fastest pass seen
        self.recent, self.measured = reading(), 0  # the current count's ratios, and how many
        self.trial: _Trial | None = _Trial((most, max(1, most // 2))) if most > 1 else None
        self.wait = FIRST_WAIT
        self.backoff = FIRST_WAIT
        self.slow = False
        self.up = True  # the direction of the next trial, where both are open

    @property
    def trialling(self) -> bool:
        return self.trial is not None

    def threads(self) -> int:
        return self.count if self.trial is None else self.trial.counts[self.trial.turn]

    def observe(self, rows: int, seconds: float) -> None:
        """A pass over `rows` tokens took `seconds`, at `threads()` threads."""
        size = _size(rows)
        fastest = self.fastest.get(size)
        self.fastest[size] = seconds if fastest is None else min(fastest, seconds)
        if fastest is None or fastest <= 0:  # the first of its size: nothing to compare with
            return
        ratio = seconds / fastest
        if self.trial is not None:
            t = self.trial
            t.ratios[t.turn].append(ratio)
            if t.turn == 1 and len(t.ratios[1]) == 1 and self.measured and ratio > ABANDON * self.recent.value:
                self._keep()
                return
            t.turn = 1 - t.turn if len(t.ratios[1 - t.turn]) < TRIAL_PASSES else t.turn
            if t.done():
                self._decide(t)
            return
        self.recent.observe(ratio)
        self.measured += 1
        slow = self.count == self.most and self.measured >= 4 and self.recent.value > SLOW
        if slow and not self.slow:
            self.wait = min(self.wait, SLOW_WAIT)
        self.slow = slow
        self.wait -= 1
        if self.wait <= 0 and self.most > 1:
            self.trial = _Trial((self.count, self._other()))

    def _other(self) -> int:
        down = max(1, self.count // 2)
        up = min(self.most, self.count * 2)
        if self.count == self.most:
            return down
        if self.count == 1:
            return up
        self.up = not self.up
        return up if self.up else down

    def _decide(self, t: _Trial) -> None:
        if median(t.ratios[1]) < (1 - MARGIN) * median(t.ratios[0]):
            self.trial = None
            self.count = t.counts[1]
            self.recent, self.measured = self.reading(), 0
            self.backoff = self.wait = FIRST_WAIT
        else:
            self._keep()

    def _keep(self) -> None:
        """End the trial with the current count kept, and wait longer before the next."""
        self.trial = None
        self.backoff = min(MAX_WAIT if self.count == self.most else CALM_WAIT, self.backoff * WAIT_GROWTH)
        self.wait = self.backoff
