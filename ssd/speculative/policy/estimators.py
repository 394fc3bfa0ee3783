"""How the speculation policies read a time they measure again and again (docs/cost-model.md,
"Reading the clock").

A pass measured on a machine that does other things is its quiet cost times a load that
comes and goes: a spike makes a few passes slow, never one fast. So a time is read as a low
quantile of its last TIME_WINDOW measurements (`LowQuantile`): a few slow passes do not move
it, a slowdown that lasts over most of the window does (it is then the machine's speed), and a
machine that calms is read again within a few passes. A moving average, which every slow pass
pulls up for good until faster ones pull it back, made auto-K's choices follow the clock.

What is counted rather than timed (a draft's acceptance by position, its calibration by
confidence, how often branches are taken) is a `DecayedRatio`: hits among trials, each count
decayed by a factor a round so that the recent rounds weigh most.
"""
from collections import deque

from ssd.speculative.policy.tunables import TIME_QUANTILE, TIME_WINDOW


class LowQuantile:
    """A time measured again and again, read as TIME_QUANTILE of its last TIME_WINDOW
    measurements (module doc)."""

    def __init__(self, first: float | None = None, window: int = TIME_WINDOW, quantile: float = TIME_QUANTILE):
        self.recent: deque[float] = deque(maxlen=window)
        self.quantile = quantile
        self.value: float | None = None
        if first is not None:
            self.observe(first)

    def observe(self, x: float) -> float:
        """Take a measurement; the reading after it."""
        self.recent.append(x)
        ordered = sorted(self.recent)
        self.value = ordered[int(self.quantile * (len(ordered) - 1))]
        return self.value

    def __bool__(self) -> bool:
        return self.value is not None


class DecayedRatio:
    """Decayed counts of hits among trials (module doc), read with a prior worth `weight` trials."""

    def __init__(self, decay: float, hits: float = 0.0, trials: float = 0.0):
        self.decay, self.hits, self.trials = decay, hits, trials

    def age(self) -> None:
        """One round older: every count decays."""
        self.hits *= self.decay
        self.trials *= self.decay

    def add(self, hit: float, trials: float = 1.0) -> None:
        self.hits += hit
        self.trials += trials

    def observe(self, hit: float, trials: float = 1.0) -> None:
        self.age()
        self.add(hit, trials)

    def rate(self, prior: float = 0.0, weight: float = 0.0) -> float:
        return (self.hits + weight * prior) / (self.trials + weight)
