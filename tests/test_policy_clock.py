"""Auto-K against a noisy clock (docs/cost-model.md, "Reading the clock"): the policy driven by
synthetic timings, a machine whose load comes and goes, and its choices checked against the
same policy on a quiet machine. Nothing here reads this machine's clock."""
import random

import pytest

from ssd.sampling_params import SamplingParams
from ssd.speculative.policy.adaptive_k import AutoK
from ssd.speculative.policy.costs import Timings
from ssd.speculative.records import Proposal, Round, RoundTimes

K_MAX = 8
DRAFT_S = 0.008  # the draft's step on a quiet machine
ACCEPT = 0.8  # the draft's acceptance at every position


def verify_s(rows: int) -> float:
    """The target's pass over `rows` rows on a quiet machine (about the 1.5B target on two cores)."""
    return 0.05 + 0.004 * (rows - 1)


class _Seq:
    def __init__(self, seq_id: int = 0):
        self.seq_id, self.num_tokens, self.output_ids, self.token_ids = seq_id, 100, [], []
        self.params = SamplingParams(max_tokens=100_000)


def _run(rounds: int, load=lambda i: 1.0, start_up=lambda rows: 1.0, draft_start_up: float = 1.0,
         seed: int = 0, target_load=lambda i: 1.0, draft_load=lambda i: 1.0) -> list[int]:
    """K per round of one sequence's `rounds` rounds. load(i): how much slower than quiet the
    machine runs round i, the draft and the target alike, and target_load(i) and draft_load(i)
    each alone beside it; start_up(rows): the same at start-up, per size timed, and draft_start_up the
    draft's step's (timings taken again are quiet)."""
    started = []

    def timed(rows: int) -> float:
        factor = start_up(rows) if not started else 1.0
        return verify_s(rows) * factor

    def draft_timed() -> float:
        return DRAFT_S * (draft_start_up if not started else 1.0)

    policy = AutoK(K_MAX, timed, draft_timed, steps_measured=True)
    started.append(True)
    # Round i's draft is right for its first lengths[i] tokens, whatever K drafted them: runs
    # that choose alike see the same text.
    rnd = random.Random(seed)
    lengths = [next(j for j in range(K_MAX + 1) if j == K_MAX or rnd.random() > ACCEPT) for _ in range(rounds)]
    seq, ks = _Seq(), []
    for i in range(rounds):
        (k,) = policy.plan([seq]).ks
        accepted = min(k, lengths[i])
        x = load(i)
        xd, xt = x * draft_load(i), x * target_load(i)
        times = RoundTimes(xd * DRAFT_S * k, xt * verify_s(k + 1), step_s=xd * DRAFT_S if k else None)
        policy.learn([Round(seq, k, Proposal([0] * k), accepted, times=times)])
        seq.num_tokens += accepted + 1
        seq.output_ids += [0] * (accepted + 1)
        ks.append(k)
    return ks


@pytest.fixture(scope="module")
def quiet() -> list[int]:
    return _run(200)


def _mean(ks: list[int]) -> float:
    return sum(ks[20:]) / len(ks[20:])


def test_the_quiet_machine_drafts_deep(quiet):
    assert _mean(quiet) >= 3, quiet  # (the premise: drafting pays here, and K follows the text)


def test_a_few_slow_passes_change_no_choice(quiet):
    """Three rounds at 10x, draft and target alike. Read through moving averages, the slow
    passes priced the sizes they ran dearer than the ones they did not for rounds after, K fell,
    and the sizes that would correct it no longer ran: plain decoding for the rest of the run."""
    assert _run(200, lambda i: 10.0 if 60 <= i < 63 else 1.0) == quiet


def test_a_slow_stretch_that_hits_draft_and_target_alike_changes_no_choice(quiet):
    """Ten rounds at 3x, then quiet again."""
    assert _run(200, lambda i: 3.0 if 60 <= i < 70 else 1.0) == quiet


def test_a_lasting_slowdown_that_hits_draft_and_target_alike_is_read_as_such(quiet):
    """From round 60 on the machine runs 3x slower, draft and target alike: the sizes that ran
    lately follow, and so do the ones that did not (kept in start-up units, read at the load
    now), and the draft's step with them: every choice is the quiet machine's."""
    assert _run(200, lambda i: 3.0 if i >= 60 else 1.0) == quiet


def test_passes_that_vary_pass_by_pass_steer_no_engine_away_from_the_others(quiet):
    """The target's every pass up to 30 % over its quiet time, drawn anew for each engine (a
    shared machine's jitter). Each size is read from enough of its passes before it is weighed
    against the others: read from a pass or two, the deeper sizes exploration tried looked dearer
    than the one the first rounds chose, read from many, and engines settled apart."""
    means = []
    for jitter in range(6):
        rnd = random.Random(100 + jitter)
        noise = [1.0 + 0.3 * rnd.random() for _ in range(200)]
        means.append(_mean(_run(200, target_load=lambda i: noise[i])))
    assert max(means) - min(means) <= 0.1 * _mean(quiet), means


def test_a_thread_trial_changes_no_choice(quiet):
    """The runners try another thread count now and then (docs/kernels.md, "A busy machine"):
    three passes at one thread of two, 1.7x as slow, the target's after 32 rounds and every 128
    after it, the draft's (a runner of its own) after 40."""
    trial = lambda i, at: 1.7 if (i - at) % 128 < 3 and i >= at else 1.0  # noqa: E731
    assert _run(200, target_load=lambda i: trial(i, 32), draft_load=lambda i: trial(i, 40)) == quiet


def test_a_drift_is_followed(quiet):
    """The costs grow by half over the run (a context that lengthens): K stays where it was."""
    assert _mean(_run(200, lambda i: 1.0 + 0.5 * i / 200)) == pytest.approx(_mean(quiet), rel=0.1)


def test_a_start_up_caught_in_a_spike_is_retaken(quiet):
    """The deep sizes' start-up timings taken in a spike (4x): drafting deep looked dear until
    each of them ran. A round that finds its size's start-up timing too dear has the others
    taken again."""
    spiked = _run(200, start_up=lambda rows: 4.0 if rows >= 4 else 1.0)
    assert sum(a == b for a, b in zip(spiked, quiet)) >= 0.95 * len(quiet), spiked


def test_a_whole_start_up_in_a_spike_is_taken_again(quiet):
    """Every start-up timing, the target's and the draft's, 4x: the first rounds find them too
    dear, and they are timed again."""
    spiked = _run(200, start_up=lambda rows: 4.0, draft_start_up=4.0)
    assert sum(a == b for a, b in zip(spiked, quiet)) >= 0.95 * len(quiet), spiked


def test_the_retaken_timings_stand_where_cheaper():
    t = Timings({1: 0.05, 2: 0.2, 3: 0.2})
    t.observe(2, 0.054)  # under a third of its start-up timing: that one was caught in a spike
    assert t.retake_due() and t.scale == 1.0  # (its ratio says nothing of the load)
    t.observe(1, 0.05)  # a calm one: the load is read from the calm ones
    assert t.scale == 1.0 and t.retake_due()
    t.retake({1: 0.06, 3: 0.058})
    assert t(1) == 0.05 and t(3) == 0.058 and not t.retake_due()


PROMPT, NEW = 300, 128


def _requests(n: int, token_s: float, first_catchup: float = 1.0) -> list[float]:
    """n requests one after another, each a PROMPT-token prompt and NEW tokens, whose draft
    catches up its prompt (and what it missed at K = 0) at token_s a token; the first request's
    first catch-up caught in a spike (first_catchup times as dear). Returns each request's share
    of rounds at K = 0."""
    policy = AutoK(K_MAX, verify_s, lambda: DRAFT_S, steps_measured=True)
    rnd, shares, caught = random.Random(0), [], False
    for r in range(n):
        seq, seen, ks = _Seq(r), 0, []
        seq.num_tokens, seq.params = PROMPT, SamplingParams(max_tokens=NEW)
        while len(seq.output_ids) < NEW:
            (k,) = policy.plan([seq]).ks
            accepted = min(k, next(j for j in range(K_MAX + 1) if j == K_MAX or rnd.random() > ACCEPT))
            catchup, missed = None, seq.num_tokens - seen
            if k and missed > 2:
                factor = 1.0 if caught else first_catchup
                caught = True
                catchup = (factor * (DRAFT_S + token_s * missed), missed, missed * (seen + (missed + 1) / 2))
            if k:
                seen = seq.num_tokens + accepted
            times = RoundTimes(DRAFT_S * k + (catchup[0] if catchup else 0.0), verify_s(k + 1),
                               step_s=DRAFT_S if k else None, catchup=catchup)
            policy.learn([Round(seq, k, Proposal([0] * k), accepted, times=times)])
            seq.num_tokens += accepted + 1
            seq.output_ids += [0] * (accepted + 1)
            ks.append(k)
        policy.release(seq.seq_id)
        shares.append(sum(k == 0 for k in ks) / len(ks))
    return shares


def test_a_catch_up_caught_in_a_spike_does_not_stop_later_requests_drafting():
    """A fresh engine's first catch-up 30x as dear as the draft's reading of a prompt costs: read
    as it came, it priced every later request's catch-up above what drafting saves, none drafted
    again, and none measured a catch-up to correct it (K = 0 in every round after)."""
    assert max(_requests(6, 0.0004, first_catchup=30.0)) < 0.05


def test_a_catch_up_dear_for_good_is_learnt_at_the_second():
    """A draft whose catch-up of a prompt costs more than drafting saves: from the third request
    on the prompt is not read for it (the first dear catch-up is held back until one confirms it)."""
    assert _requests(5, 0.03)[2:] == [1.0] * 3
