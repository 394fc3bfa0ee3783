"""What the speculation policies measure, as the engine runs: a draft's acceptance by
position (decayed counts), the tokens a round of K drafts is expected to gain, the target's
pass by rows, and the draft's catch-up (docs/cost-model.md, "The speed-up model")."""
from ssd.speculative.policy.estimators import DecayedRatio, LowQuantile
from ssd.speculative.policy.tunables import CATCHUP_DECAY, CATCHUP_RIDGE, SIZE_EVIDENCE, SPIKE


class Acceptance:
    """Decayed counts, per draft position, of rounds that reached it and accepted it."""

    def __init__(self, decay: float):
        self.decay = decay
        self.positions: list[DecayedRatio] = []

    @property
    def reached(self) -> list[float]:
        return [p.trials for p in self.positions]

    def observe(self, drafted: int, accepted: int) -> None:
        self.positions += [DecayedRatio(self.decay) for _ in range(drafted - len(self.positions))]
        for i, p in enumerate(self.positions):  # positions 0..accepted were tried
            p.observe(i < accepted, 1.0) if i < min(accepted + 1, drafted) else p.age()

    def rates(self, k: int, prior: list[float], weight: float) -> list[float]:
        """a_1..a_k: the observed counts with `weight` rounds of a prior added. The prior at a
        position is `prior` there, scaled by how this one's rate compared with `prior` at the
        position before: positions not reached yet follow the ones that were."""
        out, positions = [], self.positions
        for i in range(k):
            p = prior[i] if i == 0 else min(1.0, prior[i] * out[-1] / max(prior[i - 1], 1e-6))
            # (a position not reached yet: no counts, the prior alone)
            out.append(positions[i].rate(p, weight) if i < len(positions) else (0.0 + weight * p) / (0.0 + weight))
        return out


def expected_tokens(rates: list[float]) -> list[float]:
    """E(K) for K = 0..len(rates)."""
    out, run = [1.0], 1.0
    for a in rates:
        run *= a
        out.append(out[-1] + run)
    return out


class CatchupCost:
    """The draft's catch-up beyond a step, fitted as a x tokens + b x keys (the keys their
    attention reads, each token's position + 1 summed) by decayed least squares over the
    catch-ups measured: a long prompt costs more a token than a short one, by attention's
    share, which grows with the context (docs/decision-log.md). Tokens count in thousands and
    keys in millions, so the two columns are of a size.

    A catch-up SPIKE times dearer than expected is held back until the next one confirms it:
    one caught in a spike (a fresh engine's first long prompt, work beside it) would price every
    later request's catch-up so dear that none drafted, and none would measure it again; one
    that costs more for good is learnt at the second."""

    def __init__(self) -> None:
        self.sums: list[float] | None = None  # decayed sums of n n, n k, k k, n y, k y
        self.dear: tuple[float, int, float] | None = None  # a catch-up held back (class doc)

    def observe(self, seconds: float, tokens: int, keys: float, expected: float) -> None:
        """A catch-up of `tokens` tokens (`keys` keys read) took `seconds`; `expected`: what was
        expected of it (the fit's, or before any a guess)."""
        held, self.dear = self.dear, None
        if seconds > SPIKE * expected and held is None:
            self.dear = (seconds, tokens, keys)
            return
        if held is not None and seconds > SPIKE * expected:  # confirmed: the held one enters too
            self._add(*held)
        self._add(seconds, tokens, keys)

    def _add(self, seconds: float, tokens: int, keys: float) -> None:
        n, k = tokens / 1e3, keys / 1e6
        new = [n * n, n * k, k * k, n * seconds, k * seconds]
        self.sums = new if self.sums is None else [CATCHUP_DECAY * a + b for a, b in zip(self.sums, new)]

    def __call__(self, tokens: int, keys: float) -> float | None:
        """Seconds for a catch-up of this size; None before any was measured."""
        if self.sums is None:
            return None
        nn, nk, kk, ny, ky = self.sums
        nn, kk = nn * (1 + CATCHUP_RIDGE), kk * (1 + CATCHUP_RIDGE)  # alike sizes alone: a stable fit
        det = nn * kk - nk * nk
        a, b = ((ny * kk - ky * nk) / det, (ky * nn - ny * nk) / det) if det > 0 else (-1.0, -1.0)
        if b < 0 or a < 0:  # noise, or one size alone: the better of the one-column fits
            a, b = (ny / nn, 0.0) if kk == 0 or ny * ny / nn >= ky * ky / kk else (0.0, ky / kk)
        return a * tokens / 1e3 + b * keys / 1e6


class Timings:
    """The target's pass: V(R, n) = f(R) + c (n - 1) for R rows of n sequences, times the
    machine's load now. f, one sequence's pass by rows, is read per size as a low quantile of
    its recent passes (estimators.py); c, what each further sequence adds (its own context's
    attention, its rows' bookkeeping), as a low quantile of what recent batch passes say of it,
    (V - f(R)) / (n - 1). A table keyed by rows alone would mix the two (docs/cost-model.md,
    "Costs"). A batch pass past every size one sequence measured (R rows of a large batch) goes
    to f, less c. Until rounds have measured a size SIZE_EVIDENCE times, f there is its start-up
    timing: a low quantile reads lower the more passes it has, so a size read from one or two
    would be weighed against sizes read from many, and the sizes chosen first would look
    cheapest for good (docs/cost-model.md, "Reading the clock").

    The load (`scale`) is a low quantile of the recent passes over the start-up timings of
    their sizes, and f and c are kept in start-up units (each pass divided by the load when it
    ran): a machine that got busier since a size last ran makes it dearer too, so a plain step
    measured under load is not weighed against drafting sizes last timed quiet (docs/cost-model.md,
    "Reading the clock"). A start-up timing that a round finds SPIKE times too dear was caught in
    a spike: its ratios say nothing of the load, and the sizes no round measured may have been
    caught too (`retake_due`: they are timed again).

    A pass over more rows costs at least what one over fewer does, so a reading is capped by
    every larger size's: a start-up timing caught in a spike would otherwise stand until that
    size ran again, and a plain decoding step that looks dearer than a verify pass makes
    drafting look free (then K = 0, the size that would correct it, never runs)."""

    def __init__(self, initial: dict[int, float]):
        self.startup = dict(initial)
        self.values = dict(initial)  # f in start-up units: the measured sizes', the others' start-up timings
        self.times: dict[int, LowQuantile] = {}  # f's measured sizes
        self.single = max(initial, default=0)  # the largest size f rests on one sequence's passes for
        self.seq_cost = LowQuantile()  # batch passes' (V - f(R)) / (n - 1), in start-up units
        self.c = 0.0  # ... read, at least 0 (read with every pass a plan weighs)
        self.ratios = LowQuantile()  # passes over their sizes' start-up timings (none caught in a spike)
        self.scale = 1.0  # the load: their low quantile
        self.spiked = False  # a round found a start-up timing caught in a spike since the last retake
        # Readings since the last observation: a batch's plan reads thousands (choose.py), which
        # at 64 sequences cost more than the GPU's decode step.
        self.read: dict[int, float] = {}

    def observe(self, size: int, seconds: float, seqs: int = 1) -> None:
        """A pass over `size` rows of `seqs` sequences took `seconds`."""
        if self.startup.get(size, 0) > 0 and (seqs == 1 or size > self.single):
            ratio = (seconds - self.per_seq() * (seqs - 1)) / self.startup[size]
            if ratio * SPIKE >= 1:
                self.scale = self.ratios.observe(ratio)
                self.read.clear()
            else:
                self.spiked = True
        if seqs > 1 and size <= self.single:
            self.c = max(0.0, self.seq_cost.observe((seconds - self(size)) / (seqs - 1) / self.scale))
            return
        if seqs == 1:
            self.single = max(self.single, size)
        quiet = (seconds - self.per_seq() * (seqs - 1)) / self.scale
        reading = self.times.setdefault(size, LowQuantile()).observe(quiet)
        if self.measured(size):
            self.values[size] = reading
            self.read.clear()

    def measured(self, size: int) -> bool:
        """Rounds read f at this size, not its start-up timing (class doc)."""
        times = self.times.get(size)
        return times is not None and (len(times.recent) >= SIZE_EVIDENCE or size not in self.startup)

    def retake_due(self) -> bool:
        """Rounds found a start-up timing caught in a spike: the sizes no round measured may be too."""
        return self.spiked and any(not self.measured(s) for s in self.startup)

    def retake(self, timed: dict[int, float]) -> None:
        """Start-up timings taken again (`timed`, by size, at the load now): the cheaper of the
        two stands (a load only makes a pass slower) for the sizes no round measured."""
        for s, v in timed.items():
            if s in self.startup and not self.measured(s):
                self.startup[s] = self.values[s] = min(self.startup[s], v / self.scale)
        self.spiked = False
        self.read.clear()

    def per_seq(self) -> float:
        """c: seconds a pass takes for each sequence beyond the first."""
        return self.c * self.scale

    def __call__(self, size: int, seqs: int = 1) -> float:
        """V(size, seqs)."""
        value = self.read.get(size)
        if value is None:
            value = self.read[size] = self.scale * min([self._read(size)] + [v for s, v in self.values.items()
                                                                             if s > size])
        return value + self.per_seq() * (seqs - 1) if seqs > 1 else value

    def _read(self, size: int) -> float:
        if size in self.values:
            return self.values[size]
        known = sorted(self.values)
        below = [s for s in known if s < size]
        above = [s for s in known if s > size]
        if below and above:
            lo, hi = below[-1], above[0]
        elif len(below) >= 2:
            # Past the largest size known: along its last segment, but no flatter than the whole
            # curve's chord. Two sizes that rounds measured close together (a batch's 28 rows,
            # then 30) can slope down by noise, and extrapolated that far a large batch's pass
            # read as a fraction of a smaller one's (docs/decision-log.md).
            lo, hi, first = below[-2], below[-1], known[0]
            slope = max((self.values[hi] - self.values[lo]) / (hi - lo),
                        (self.values[hi] - min(self.values.values())) / (hi - first), 0.0)
            return self.values[hi] + slope * (size - hi)
        elif len(above) >= 2:
            lo, hi = above[0], above[1]
        else:  # one point: proportional to size
            s = known[0]
            return self.values[s] * size / s
        v_lo, v_hi = self.values[lo], self.values[hi]
        return max(0.0, v_lo + (v_hi - v_lo) * (size - lo) / (hi - lo))
