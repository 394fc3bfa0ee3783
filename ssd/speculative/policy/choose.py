"""The batch's choice (docs/cost-model.md, "Choosing K for a batch"): each sequence's option
that together make the most expected tokens a second, and the round those picks make, to weigh
one sequence's option in it (`BatchRound`). Pure functions of the options and the costs.

An option is (tokens expected, rows, draft steps): drafting K tokens is (E(K), K + 1, K), a
lookup's K tokens (E_lookup(K), K + 1, 0); a sequence's first k_max + 1 options are the draft's
K = 0..k_max. The tokens are weighed by their worth (model.py, `CostModel.worth`).
"""
from collections.abc import Callable

Option = tuple[float, int, int]
Verify = Callable[..., float]  # V(rows, seqs)


def choose(options: list[list[Option]], k_max: int, draft_step: float, verify: Verify) -> list[int]:
    """Each sequence's option that together maximise sum E_s / (D(deepest draft) + V(sum rows)):
    the best draft K common to all, then each sequence's best option given the others'
    (coordinate ascent, two sweeps)."""
    n, step = len(options), draft_step
    # Plain loops and each pass size read once a plan: at 64 sequences this weighs ~1,200
    # options, and planning is host time beside a GPU's step.
    read: dict[int, float] = {}

    def v(rows: int) -> float:
        seconds = read.get(rows)
        if seconds is None:
            seconds = read[rows] = verify(rows, n)
        return seconds

    common, top = 0, -1.0
    for k in range(k_max + 1):
        speed = sum(o[k][0] for o in options) / max(k * step + v(n * (k + 1)), 1e-9)
        if speed > top:
            common, top = k, speed
    picks = [common] * n
    at = [0] * (k_max + 1)  # sequences per draft depth, for the deepest of the others
    at[common] = n
    gain, rows = sum(o[common][0] for o in options), n * (common + 1)
    for _ in range(2):
        for b, opts in enumerate(options):
            old_gain, old_rows, old_depth = opts[picks[b]]
            at[old_depth] -= 1
            others = max((k for k in range(k_max + 1) if at[k]), default=0)
            rest_gain, rest_rows = gain - old_gain, rows - old_rows
            best, top = 0, -1.0
            for i, (g, r, depth) in enumerate(opts):
                speed = (rest_gain + g) / max(max(others, depth) * step + v(rest_rows + r), 1e-9)
                if speed > top:
                    best, top = i, speed
            gain += opts[best][0] - old_gain
            rows += opts[best][1] - old_rows
            at[opts[best][2]] += 1
            picks[b] = best
    return picks


class BatchRound:
    """The round a plan's picks make, to weigh one sequence's option in it: the batch's tokens
    and seconds with that sequence at another option and the others as picked. One sequence's
    saving is then the batch's, so drafting for it must pay for the rows it adds beside the
    others' (and for the draft's steps where the others draft none) against the batch's plain
    step, not against a plain step of its own (docs/decision-log.md). At one sequence it is the
    saving alone."""

    def __init__(self, options: list[list[Option]], picks: list[int], draft_step: float, verify: Verify):
        self.options, self.picks = options, list(picks)
        self.draft_step, self.verify = draft_step, verify
        chosen = [opts[p] for opts, p in zip(options, picks)]
        self.gain, self.rows = sum(o[0] for o in chosen), sum(o[1] for o in chosen)
        depths = sorted((o[2] for o in chosen), reverse=True) + [0]
        self.deepest, self.second = depths[0], depths[1]  # the others' deepest: `second` where b's is deepest

    def round(self, b: int, option: Option) -> tuple[float, float]:
        """Tokens expected and seconds of the round with sequence b at `option`."""
        gain, rows, depth = self.options[b][self.picks[b]]
        others = self.second if depth == self.deepest else self.deepest
        total = self.rows - rows + option[1]
        seconds = max(others, option[2]) * self.draft_step + self.verify(total, len(self.options))
        return self.gain - gain + option[0], seconds

    def per_token(self, b: int, option: Option) -> float:
        """The batch's seconds a token with sequence b at `option`."""
        gain, seconds = self.round(b, option)
        return seconds / max(gain, 1e-9)

    def alternative(self, b: int) -> int:
        """Sequence b's best option without the draft (plain decoding, or its lookup's): the
        fewest seconds a token for the batch."""
        opts = self.options[b]
        return min((i for i, o in enumerate(opts) if o[2] == 0), key=lambda i: self.per_token(b, opts[i]))

    def without(self, b: int) -> float:
        """The batch's seconds a token with sequence b at its best option without the draft."""
        return self.per_token(b, self.options[b][self.alternative(b)])

    def saving(self, b: int, option: Option, without: float, left: float) -> float:
        """Seconds that sequence b at a drafting `option` saves over its `left` tokens, against
        `without` seconds a token: over the rounds it takes to write them, the batch's tokens at
        that speed against the rounds' time. At one sequence, left x (without - its round's
        seconds a token)."""
        gain, seconds = self.round(b, option)
        return left / option[0] * (gain * without - seconds)

    def extra(self, b: int, option: Option) -> float:
        """Seconds that sequence b at `option` adds to the round against its plain decoding."""
        return self.round(b, option)[1] - self.round(b, self.options[b][0])[1]
