"""How the speculation policies read a time they measure again and again (docs/cost-model.md,
"Reading the clock").

A pass measured on a machine that does other things is its quiet cost times a load that
comes and goes: a spike makes a few passes slow, never one fast. So a time is read as a low
quantile of its last TIME_WINDOW measurements (`LowQuantile`): a few slow passes do not move
it, a slowdown that lasts over most of the window does (it is then the machine's speed), and a
machine that calms is read again within a few passes. A moving average, which every slow pass
pulls up for good until faster ones pull it back, made auto-K's choices follow the clock.
"""
from collections import deque

TIME_WINDOW = 16  # measurements a time is read over
TIME_QUANTILE = 0.25  # ... as this quantile of them (a slowdown is taken once it holds 3/4 of the window)
# A measurement this many times its reading or more is a spike: it counts at that bound in a
# fit that weighs every measurement (CatchupCost), so that a few slow ones move it little.
SPIKE = 1.5


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
