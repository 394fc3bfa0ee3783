"""Auto-K's cost model (docs/cost-model.md, "Costs", "Reading the clock"): the target's pass
V(R, n), the draft's step d, the draft's catch-up over tokens it has not read, and a token's
worth in a batch, each measured as the engine runs and read at the machine's load now.
"""
from bisect import bisect_left, bisect_right
from collections.abc import Callable

from ssd.request.sequence import Sequence
from ssd.speculative.policy.costs import CatchupCost, Timings
from ssd.speculative.policy.estimators import LowQuantile
from ssd.speculative.policy.tunables import RETAKES, WORTH_FLOOR
from ssd.speculative.records import Round, RoundTimes


class CostModel:
    """V, d, the catch-up and a token's worth (module doc)."""

    def __init__(self, k_max: int, verify_time: Callable[[int], float | None], sizes: list[int],
                 draft_step_s: float | Callable[[], float | None], steps_measured: bool, window: int | None):
        """verify_time(rows): the target's pass over that many rows of one sequence, timed now
        (None: it cannot be now; at start-up it must be), at `sizes`; draft_step_s: one draft
        step, or what times one now (None where it cannot: then timed again for each new
        sequence until a round measures it); steps_measured: the draft times its steps itself
        and runs in this process (SD), else a round's wait per draft token is its step's cost;
        window: the most tokens a catch-up reads (draft_window)."""
        self.k_max, self.window, self.steps_measured = k_max, window, steps_measured
        self.verify = Timings({r: verify_time(r) for r in sorted(set(sizes))})
        self.time_verify, self.retakes = verify_time, RETAKES
        self.time_draft = draft_step_s if callable(draft_step_s) else None
        self.draft_quiet = 0.0  # d in start-up units (set through draft_step below)
        self.draft_step = (self.time_draft() or 0.0) if self.time_draft else draft_step_s
        self.draft_measured = False
        self.draft_times = LowQuantile()  # the rounds' draft steps (the start-up timings left out)
        self.catchup = CatchupCost()  # the draft's cost of reading tokens it has not seen

    @property
    def draft_step(self) -> float:
        """d: seconds a draft step takes now."""
        return self.draft_quiet * self._draft_load()

    @draft_step.setter
    def draft_step(self, seconds: float) -> None:
        self.draft_quiet = seconds / self._draft_load()

    def _draft_load(self) -> float:
        """The load the draft's costs share with the target's (Timings.scale) where it runs beside
        it (steps_measured: in this process), else none: they are kept in start-up units."""
        return self.verify.scale if self.steps_measured else 1.0

    def time_draft_again(self) -> None:
        """A draft step timed again, where no round has measured one: the cheapest timing stands
        (a start-up timing caught in a spike would keep the draft off for good: at K = 0 no round
        measures it)."""
        if self.time_draft and not self.draft_measured:
            timed = self.time_draft()
            self.draft_step = self.draft_step if timed is None else min(self.draft_step, timed)

    def round_s(self, k: int) -> float:
        """D(k) + V(k + 1): one sequence's round drafting k tokens."""
        return k * self.draft_step + self.verify(k + 1)

    def catchup_s(self, tokens: int, context: int) -> float:
        """The draft's pass over the last `tokens` of a context it has not seen: a step plus
        their measured cost (CatchupCost; before any, a guess from the measured passes). Past the
        window it reads only the context's last `window` tokens, from position 0."""
        start = context - tokens
        if self.window is not None and tokens > self.window:
            tokens, start = self.window, 0
        return self.draft_step + self._catchup_quiet(tokens, tokens * (start + (tokens + 1) / 2)) * self._draft_load()

    def _catchup_quiet(self, tokens: int, keys: float) -> float:
        """A catch-up's cost beyond a step, in start-up units (CatchupCost's fit). Before any was
        measured: what a row adds to the target's pass, scaled by the draft's step against the
        target's. A draft reads a prompt as the target verifies rows (a fixed share of a step
        priced them at a third: docs/decision-log.md)."""
        fitted = self.catchup(tokens, keys)
        if fitted is not None:
            return fitted
        top = self.k_max + 1
        return tokens * (self.verify(top) - self.verify(1)) / (top - 1) * self.draft_quiet / self.verify(1)

    def worth(self, seqs: list[Sequence], waiting: bool) -> list[float]:
        """Each sequence's token's worth, the seconds it saves later against the batch's plain
        step a token (docs/cost-model.md, "Choosing K for a batch"): decoded plainly from here, a
        sequence with the k-th most tokens left ends when k sequences remain, so one token fewer
        saves it V(k, k) - V(k - 1, k - 1), averaged over the sequences with about as many left
        (a round's gain more or less), at least WORTH_FLOOR. All 1 where requests wait for
        places (a sequence that ends makes room for one) or one sequence decodes."""
        n = len(seqs)
        if waiting or n == 1:
            return [1.0] * n
        left = [s.params.max_tokens - len(s.output_ids) for s in seqs]
        fewest = sorted(left)
        full = [0.0] + [self.verify(k, k) for k in range(1, n + 1)]  # plain steps of 0..n sequences
        mean = max(full[n] / n, 1e-12)
        out = []
        for m in left:
            # The ranks (1: the most left) of the sequences within a round's gain of this one's.
            lo, hi = n - bisect_right(fewest, m + self.k_max + 1), n - bisect_left(fewest, m - self.k_max - 1)
            out.append(max(WORTH_FLOOR, (full[hi] - full[lo]) / (hi - lo) / mean))
        return out

    def learn(self, rounds: list[Round], times: RoundTimes, drafted: list[int]) -> None:
        """A round's times: the target's pass by its rows (first: the load the draft's costs are
        read at), the draft's step (per drafted token, catch-up left out: counting it would make
        drafting look dearer the longer it was off; drafted: tokens per sequence by the draft
        model) and its catch-up."""
        if times.timed:
            self.verify.observe(sum(r.drafted + len(r.branches) for r in rounds) + len(rounds), times.verify_s,
                                len(rounds))
            if self.retakes and self.verify.retake_due():  # (a spiked start-up: Timings; the draft's too)
                self.retakes -= 1
                again = {s: self.time_verify(s) for s in self.verify.startup if not self.verify.measured(s)}
                self.verify.retake({s: t for s, t in again.items() if t is not None})
                self.time_draft_again()
        deepest = max(drafted, default=0)  # a round drafts as deep as its longest proposal
        step = times.step_s if self.steps_measured else times.draft_s / deepest if deepest else None
        if step is not None:  # None: no step without catch-up this round
            self.draft_quiet = self.draft_times.observe(step / self._draft_load())
            self.draft_measured = True
        if times.catchup is not None and times.catchup[1] > 0:  # a pass costs a step, plus what its tokens cost
            seconds, tokens, keys = times.catchup
            quiet = max(0.0, seconds - self.draft_step) / self._draft_load()
            self.catchup.observe(quiet, tokens, keys, self._catchup_quiet(tokens, keys))
