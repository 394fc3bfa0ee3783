"""Where an SD round's draft stops: at the depth where one more token is no longer worth its
cost, judged by the draft's own confidence in the tokens it drafted (`draft_stop`).

Auto-K (adaptive_k.py) chooses K before a round from acceptance by position, which knows
nothing of the text at hand: a round drafts K tokens whether the draft is sure of them or
not. Here the draft keeps going while it is sure and stops where it is not. After drafting
token j, with top-1 probabilities c_1..c_j (over its head), the chance that the target takes
all j is about S_j = f(c_1) ... f(c_j), f the draft's calibration: the measured acceptance
of a drafted token, once the tokens before it were accepted, by its probability (decayed
counts in BINS bins, from every round; the prior is f(c) = c). One more token would add
S_j x a tokens on average (a, the acceptance of a reached token, the counts' mean) and costs
a draft step d plus a verify row, V(j + 2) - V(j + 1); the time it takes would make r x (its
cost) tokens at the rate r of the rule's rounds so far (tokens per second: moving averages
of a round's tokens and of its seconds). So the draft goes on while

    S_j x a >= r x (d + V(j + 2) - V(j + 1)),

up to the round's K, which auto-K then sets to k_max for the sequences this applies to
(greedy requests whose logits nothing changes: their proposals are the draft's argmax, so
only the proposals' length depends on the rule, and verification stays exact). Only where
one sequence drafts alone: in a batch, one sequence's deeper draft holds up every other's
pass and adds rows to a larger verify pass, which this rule does not price (batches ran
slower with it on: docs/decision-log.md, "The draft's stopping rule"); auto-K's K, which
weighs the batch's costs, stands there. Replayed on the bench sets' greedy outputs
(bench/studies/draft_stop_headroom.py), the rule gained over the best fixed K.
"""
from collections.abc import Callable
from dataclasses import dataclass

from ssd.speculative.policy.estimators import DecayedRatio
from ssd.speculative.policy.tunables import STOP_BINS as BINS
from ssd.speculative.policy.tunables import STOP_DECAY, STOP_PRIOR_TOKENS, STOP_RATE_EMA


def _bin(confidence: float) -> int:
    return min(BINS - 1, max(0, int(confidence * BINS)))


@dataclass(frozen=True)
class StopRule:
    """One round's rule, as the policy planned it: the draft's calibration f by bin and the
    floors, fixed for the round (the counts change only once it is over)."""

    chances: tuple[float, ...]  # f(c) by bin
    floors: tuple[float, ...]  # floors[j - 1]: the least S_j at which token j + 1 is drafted

    def chance(self, confidence: float) -> float:
        return self.chances[_bin(confidence)]

    def keep_going(self, survival: float, depth: int) -> bool:
        """Draft token depth + 1, the chain so far taken whole with probability `survival`?"""
        return depth <= len(self.floors) and survival >= self.floors[depth - 1]


class DraftStop:
    """The draft's calibration and the rate of the rule's rounds, learnt from the rounds;
    auto-K owns one and plans each round's StopRule from it."""

    def __init__(self) -> None:
        # f by bin, starting from the prior f(c) = c at the bin's middle.
        self.bins = [DecayedRatio(STOP_DECAY, STOP_PRIOR_TOKENS * (i + 0.5) / BINS, STOP_PRIOR_TOKENS)
                     for i in range(BINS)]
        # A sequence's tokens and seconds per drafting round, moving averages: their ratio is
        # the rate (steadier than averaging the rounds' own rates, which go from 1 token to k_max + 1).
        self.tokens: float | None = None
        self.seconds = 0.0

    @property
    def reached(self) -> list[float]:
        return [b.trials for b in self.bins]

    @property
    def accepted(self) -> list[float]:
        return [b.hits for b in self.bins]

    def chance(self, confidence: float) -> float:
        """f(c): how often the target took a drafted token of this top-1 probability."""
        return self.bins[_bin(confidence)].rate()

    def rule(self, k_max: int, step_s: float, verify: Callable[[int], float], fallback_rate: float) -> StopRule:
        """This round's rule, from the draft step's and the verify pass's costs; the rate is
        the rounds' measured one, or `fallback_rate` before any round was measured."""
        rate = self.tokens / self.seconds if self.tokens is not None else fallback_rate
        mean = sum(self.accepted) / sum(self.reached)
        return StopRule(tuple(b.rate() for b in self.bins),
                        tuple(rate * (step_s + verify(j + 2) - verify(j + 1)) / max(mean, 1e-6)
                              for j in range(1, k_max)))

    def observe(self, confidences: list[float], accepted: int) -> None:
        """A round's drafted tokens' top-1 probabilities and how many the target took: each
        token up to the first rejected one was reached."""
        for b in self.bins:
            b.age()
        for j, c in enumerate(confidences[:accepted + 1]):
            self.bins[_bin(c)].add(j < accepted)

    def observe_rate(self, tokens: float, seconds: float) -> None:
        """A round of the rule's: its tokens, and its draft and verify time."""
        if seconds <= 0:
            return
        if self.tokens is None:
            self.tokens, self.seconds = tokens, seconds
        else:
            self.tokens += STOP_RATE_EMA * (tokens - self.tokens)
            self.seconds += STOP_RATE_EMA * (seconds - self.seconds)
