"""How many tokens to draft: a fixed K, or K chosen each round from measured costs (auto).

Auto-K applies the speed-up model of ssd-algorithm.md §7 round by round. For a sequence whose
draft token i is accepted with probability a_i once the tokens before it were (its acceptance
by position), drafting K tokens gains on average

    E(K) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_K     tokens (the target always adds one),

and a round costs D(K) = K x d (the wait for proposals: K draft steps in SD, mostly nothing on
an SSD cache hit) plus V(R), the target's pass over R rows (R = K + 1 per sequence). All three are
measured as the engine runs: V at start-up by timing the target on 1..K_max+1 rows and d by
timing one draft step, then both from every round (moving averages), and the a_i from each sequence's own rounds (decayed
counts) shrunk towards the engine-wide rates, which stand in for positions a sequence has not
reached. The round's K per sequence maximises the batch's tokens per second,
sum E_s(K_s) / (D(max K_s) + V(sum (K_s + 1))); K = 0 is plain decoding, chosen when drafting
does not pay. A sequence at K = 0 learns nothing about its acceptance, so after PROBE_EVERY
rounds at K = 0 it drafts PROBE_K tokens again; a probe that gains nothing doubles the wait
before the next (up to PROBE_BACKOFF times), as each one costs a draft step and the draft's
catch-up on the tokens it missed; a sequence that never drafted does not probe once the
engine-wide rates rest on enough rounds (its probe would pay the draft's prefill too).
"""
from collections.abc import Callable
from dataclasses import dataclass, field

from ssd.engine.sequence import Sequence

PRIOR_RATE = 0.6  # acceptance assumed before anything is measured
PRIOR_WEIGHT = 2.0  # ... worth this many rounds
SEQ_WEIGHT = 4.0  # a sequence's own rates are shrunk towards the engine-wide ones by this many rounds
SEQ_DECAY = 0.9  # per round: a sequence's recent text counts most (copying spans come and go)
ENGINE_DECAY = 0.995
TIME_EMA = 0.2
PROBE_EVERY = 16
PROBE_K = 2
ENGINE_EVIDENCE = 8  # decayed rounds at the first position
PROBE_BACKOFF = 16  # a probe that gains nothing doubles the wait before the next, up to this factor


@dataclass
class Acceptance:
    """Decayed counts, per draft position, of rounds that reached it and accepted it."""

    decay: float
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        n = len(self.reached)
        if drafted > n:
            self.reached += [0.0] * (drafted - n)
            self.accepted += [0.0] * (drafted - n)
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for i in range(min(accepted + 1, drafted)):  # positions 0..accepted were tried
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    def rates(self, k: int, prior: list[float], weight: float) -> list[float]:
        """a_1..a_k: the observed counts with `weight` rounds of a prior added. The prior at a
        position is `prior` there, scaled by how this one's rate compared with `prior` at the
        position before: positions not reached yet follow the ones that were."""
        out = []
        for i in range(k):
            r, a = (self.reached[i], self.accepted[i]) if i < len(self.reached) else (0.0, 0.0)
            p = prior[i] if i == 0 else min(1.0, prior[i] * out[-1] / max(prior[i - 1], 1e-6))
            out.append((a + weight * p) / (r + weight))
        return out


def expected_tokens(rates: list[float]) -> list[float]:
    """E(K) for K = 0..len(rates)."""
    out, run = [1.0], 1.0
    for a in rates:
        run *= a
        out.append(out[-1] + run)
    return out


class Timings:
    """Moving averages of the target's pass by rows, read with interpolation. The start-up
    timings are replaced by the first round measured at each size (a real round also pays for
    sampling and verification)."""

    def __init__(self, initial: dict[int, float]):
        self.values = dict(initial)
        self.measured: set[int] = set()

    def observe(self, size: int, seconds: float) -> None:
        old = self.values.get(size)
        self.values[size] = old + TIME_EMA * (seconds - old) if size in self.measured else seconds
        self.measured.add(size)

    def __call__(self, size: int) -> float:
        if size in self.values:
            return self.values[size]
        known = sorted(self.values)
        below = [s for s in known if s < size]
        above = [s for s in known if s > size]
        if below and above:
            lo, hi = below[-1], above[0]
        elif len(below) >= 2:
            lo, hi = below[-2], below[-1]
        elif len(above) >= 2:
            lo, hi = above[0], above[1]
        else:  # one point: proportional to size
            s = known[0]
            return self.values[s] * size / s
        v_lo, v_hi = self.values[lo], self.values[hi]
        return max(0.0, v_lo + (v_hi - v_lo) * (size - lo) / (hi - lo))


class FixedK:
    """Every sequence drafts K tokens every round."""

    def __init__(self, k: int):
        self.k_max = k

    def choose(self, seqs: list[Sequence]) -> list[int]:
        return [self.k_max] * len(seqs)

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int], draft_s: float,
                verify_s: float, step_s: float | None = None) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class AutoK(FixedK):
    """K per sequence and round, 0..k_max, from measured acceptance and costs (module doc)."""

    def __init__(self, k_max: int, verify_time: Callable[[int], float], draft_step_s: float,
                 steps_measured: bool = False):
        """verify_time(rows): the target's pass over that many rows of one sequence, timed now;
        draft_step_s: one draft step (0 for a draft that costs nothing, as prompt lookup);
        steps_measured: the draft times its steps itself (observe's step_s; SD), else a round's
        wait per draft token is the step's cost (SSD, prompt lookup)."""
        super().__init__(k_max)
        self.steps_measured = steps_measured
        self.verify = Timings({r: verify_time(r) for r in range(1, k_max + 2)})
        self.draft_step, self.draft_measured = draft_step_s, False  # D(K) = K x draft_step
        self.engine = Acceptance(ENGINE_DECAY)
        self.seqs: dict[int, Acceptance] = {}
        self.idle: dict[int, int] = {}  # seq_id -> rounds in a row at K = 0
        self.wait: dict[int, int] = {}  # seq_id -> rounds at K = 0 before its next probe

    def choose(self, seqs: list[Sequence]) -> list[int]:
        prior = self.engine.rates(self.k_max, [PRIOR_RATE] * self.k_max, PRIOR_WEIGHT)
        gains = [expected_tokens(self.seqs.setdefault(s.seq_id, Acceptance(SEQ_DECAY))
                                 .rates(self.k_max, prior, SEQ_WEIGHT)) for s in seqs]
        ks = self._best(gains)
        for b, s in enumerate(seqs):
            if ks[b] == 0 and self.idle.get(s.seq_id, 0) >= self.wait.get(s.seq_id, PROBE_EVERY) \
                    and (self.seqs[s.seq_id].reached or not self.engine_knows()):
                ks[b] = min(PROBE_K, self.k_max)
        return ks

    def engine_knows(self) -> bool:
        """Enough recent rounds engine-wide that a sequence with none of its own follows them
        without a probe (its first probe would also pay the draft's prefill of its prompt)."""
        return bool(self.engine.reached) and self.engine.reached[0] >= ENGINE_EVIDENCE

    def _best(self, gains: list[list[float]]) -> list[int]:
        """The K per sequence that maximise sum E_s(K_s) / (D(max K_s) + V(sum (K_s + 1))): the best
        K common to all, then each sequence's best K given the others' (coordinate ascent)."""
        n, kmax = len(gains), self.k_max
        speed = lambda gain, rows, deepest: gain / max(deepest * self.draft_step + self.verify(rows), 1e-9)  # noqa: E731
        common = max(range(kmax + 1), key=lambda k: speed(sum(g[k] for g in gains), n * (k + 1), k))
        ks = [common] * n
        at = [0] * (kmax + 1)  # sequences per K, for the deepest K of the others
        at[common] = n
        gain, rows = sum(g[common] for g in gains), n * (common + 1)
        for _ in range(2):
            for b in range(n):
                old = ks[b]
                at[old] -= 1
                others = max((k for k in range(kmax + 1) if at[k]), default=0)
                best = max(range(kmax + 1), key=lambda k: speed(gain - gains[b][old] + gains[b][k],
                                                                rows - old + k, max(others, k)))
                gain += gains[b][best] - gains[b][old]
                rows += best - old
                at[best] += 1
                ks[b] = best
        return ks

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int], draft_s: float,
                verify_s: float, step_s: float | None = None) -> None:
        """One round's outcome: tokens each sequence drafted and had accepted, the round's wait
        for proposals and verify pass (the whole batch's), and where the draft measured it, its
        time per draft token without catch-up (a prompt's prefill, tokens missed at K = 0:
        counting those would make drafting look dearer the longer it was off)."""
        for s, d, a in zip(seqs, drafted, accepted):
            if d and self.idle.get(s.seq_id, 0) >= self.wait.get(s.seq_id, PROBE_EVERY):  # a probe
                wait = self.wait.get(s.seq_id, PROBE_EVERY)
                self.wait[s.seq_id] = PROBE_EVERY if a else min(2 * wait, PROBE_BACKOFF * PROBE_EVERY)
            self.idle[s.seq_id] = 0 if d else self.idle.get(s.seq_id, 0) + 1
            if d:
                self.seqs.setdefault(s.seq_id, Acceptance(SEQ_DECAY)).observe(d, a)
                self.engine.observe(d, a)
        deepest = max(drafted, default=0)  # a round drafts as deep as its longest proposal
        step = step_s if self.steps_measured else draft_s / deepest if deepest else None
        if step is not None:  # None: no step without catch-up this round
            self.draft_step = self.draft_step + TIME_EMA * (step - self.draft_step) if self.draft_measured else step
            self.draft_measured = True
        self.verify.observe(sum(drafted) + len(seqs), verify_s)

    def release(self, seq: Sequence) -> None:
        for table in (self.seqs, self.idle, self.wait):
            table.pop(seq.seq_id, None)
