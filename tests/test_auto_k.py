"""Auto-K (ssd/speculative/policy/adaptive_k.py): K chosen per sequence and round from measured
acceptance and costs; plain decoding when drafting does not pay; exact in every case."""
import dataclasses
import random

import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.exactness import pooled_p_value
from ssd.speculative.options import AUTO_K, SSD_K, SpecOptions
from ssd.speculative.plan import Plan, SeqPlan
from ssd.speculative.policy.adaptive_k import AutoK
from ssd.speculative.policy.costs import CatchupCost, Timings, expected_tokens
from ssd.speculative.policy.tunables import PROBE_BUDGET, PROBE_K, SIZE_EVIDENCE, TIME_WINDOW
from ssd.speculative.records import Proposal, Round, RoundTimes
from ssd.speculative.sources.ngram import PromptLookup
from chance import fits
from test_ngram import REPEATING
from tiny_pair import NEW, PROMPT, V, exact_joint


class _Seq:
    """What AutoK reads of a sequence: its id, length, output so far and max_tokens (and the
    tokens, for prompt lookup: none here)."""

    def __init__(self, seq_id, num_tokens=100, max_tokens=10_000):
        self.seq_id, self.num_tokens, self.output_ids, self.token_ids = seq_id, num_tokens, [], []
        self.params = SamplingParams(max_tokens=max_tokens)


def _observe(policy, seqs, drafted, accepted, draft_s, verify_s, step_s=None, catchup=None):
    """One round of the batch `seqs`, as the engine records it (ssd/speculative/round.py)."""
    times = RoundTimes(draft_s, verify_s, step_s=step_s, catchup=catchup)
    policy.learn([Round(s, d, Proposal([0] * d), a, times=times) for s, d, a in zip(seqs, drafted, accepted)])


def _policy(k_max=8, draft_step=0.01):
    # A target pass of R rows: 50 ms + 4 ms per extra row (about the 1.5B target's shape here).
    return AutoK(k_max, lambda rows: 0.05 + 0.004 * (rows - 1), draft_step)


def _rounds(policy, seqs, accept, n):
    for _ in range(n):
        ks = policy.plan(seqs).ks
        _observe(policy, seqs, ks, [accept(k) for k in ks], 0.01 * max(ks), 0.05 + 0.004 * sum(ks))
    return policy.plan(seqs).ks


def test_expected_tokens_and_timings():
    assert expected_tokens([0.5, 0.5]) == [1.0, 1.5, 1.75]
    t = Timings({1: 1.0, 3: 3.0})
    assert t(2) == 2.0 and t(5) == 5.0 and t(3) == 3.0
    for _ in range(SIZE_EVIDENCE - 1):  # the start-up timing stands until the rounds have measured enough ...
        t.observe(1, 1.0)  # (the load stays 1)
        t.observe(3, 4.0)
        assert t(3) == 3.0
    t.observe(3, 4.0)  # ... then their low quantile prices the size
    assert t(3) == 4.0
    for _ in range(3):  # a few slow passes move it no further than the quiet ones measured
        t.observe(1, 1.0)
        t.observe(3, 30.0)
    assert t(3) == 4.0
    for _ in range(12):  # a slowdown that lasts does
        t.observe(1, 1.0)
        t.observe(3, 5.0)
    assert t(3) == 5.0


def test_a_size_measured_a_few_times_is_weighed_like_one_measured_often():
    # Noisy passes (up to 30 % over the quiet time): the size chosen every round reads its low
    # quantile, which falls the more passes it has; one pass of a deeper size, read alone, would
    # price it at a typical pass and the chosen size would look the cheaper for good.
    startup = {r: 0.035 + 0.003 * (r - 1) for r in range(1, 10)}
    t = Timings(startup)
    noise = [1.0, 1.3, 1.1, 1.25, 1.05, 1.2, 1.15, 1.3, 1.02, 1.28, 1.1, 1.22, 1.08, 1.3, 1.12, 1.18]
    for x in noise:
        t.observe(3, startup[3] * x)
    t.observe(9, startup[9] * 1.15)
    assert t(9) / t(3) == pytest.approx(startup[9] / startup[3], rel=0.02)


def test_a_pass_never_reads_dearer_than_a_larger_one():
    # A start-up timing caught in a load spike (1 row: 0.5 s) is capped by the larger sizes'.
    t = Timings({1: 0.5, 2: 0.05, 3: 0.06})
    assert t(1) == 0.05 and t(2) == 0.05 and t(3) == 0.06 and t(4) == pytest.approx(0.07)
    t.observe(2, 0.08)  # the machine is slower now than at start-up: the sizes not measured follow
    assert t(3) == pytest.approx(0.096) and t(1) == 0.08


def test_a_pass_past_every_measured_size_reads_along_the_curve():
    """Two sizes measured close together can slope down by noise; past them a pass reads no
    flatter than the curve's chord (here 5 ms a row), never below the largest size's."""
    t = Timings({r: 0.045 + 0.005 * (r - 1) for r in range(1, 10)})
    t.observe(28, 0.18)
    t.observe(30, 0.17)  # noise: two rows more, 10 ms less
    assert t(64) >= 0.17 + (0.17 - 0.045) / 29 * 34 - 1e-9
    assert t(32) >= t(30)


def test_a_batch_pass_costs_one_sequences_rows_plus_each_further_sequence():
    """V(R, n) = f(R) + c (n - 1): batch passes fit c where one sequence's passes give f, and a
    batch pass past every size one sequence measured goes to f, less c."""
    f = {r: 0.047 + 0.0025 * (r - 1) for r in range(1, 10)}
    t = Timings(f)
    for _ in range(5):
        t.observe(8, f[8] + 7 * 0.001, 8)
        t.observe(9, f[9] + 7 * 0.001, 8)
    assert t.per_seq() == pytest.approx(0.001)
    assert t(9) == f[9] and t(8, 8) == pytest.approx(f[8] + 0.007)
    assert t(9, 8) - t(8, 8) == pytest.approx(f[9] - f[8])  # a lookup's row in the batch: a row's cost
    t.observe(64, 0.2, 64)
    assert t(64) == pytest.approx(0.2 - 0.063) and t(64, 64) == pytest.approx(0.2)


def test_a_batch_measured_at_plain_decoding_does_not_make_a_row_look_free():
    """Rows alone: plain decoding of 8 sequences measured at 80 ms read as dear as one
    sequence's 9-row start-up timing (79 ms), so a row beside them looked free and a free draft
    of acceptance 0.5 drafted (8.5 tokens for 93 ms against 8 for 80). Each further sequence's
    cost kept apart, the row costs a row: plain decoding."""
    f = lambda rows: 0.066 + 0.013 * (rows - 8) if rows >= 8 else 0.047 + 0.0027 * (rows - 1)  # noqa: E731
    policy = AutoK(8, f, 0.0)
    seqs = [_Seq(i) for i in range(8)]
    for _ in range(12):  # acceptance 0.5 at the first position, engine-wide
        _observe(policy, seqs, [1] * 8, [1, 0] * 4, 0.0, f(16) + 0.014)
    for _ in range(3):
        _observe(policy, seqs, [0] * 8, [0] * 8, 0.0, f(8) + 0.014)
    assert policy.plan(seqs).ks == [0] * 8


def test_a_token_is_worth_the_steps_it_saves_later():
    """Rows cheap (R rows of n sequences: 50 ms, 2 ms a further row, 2 ms a further sequence), a
    free draft of acceptance 0.5, 8 sequences. In step (as many tokens left each) they all draft,
    as the batch's speed says. One with 200 tokens left where the others have 20 drafts alone: it
    will end alone, each of its last tokens a whole step, while a token the others gain saves only
    their part of the steps they all take. Where requests wait for places, all draft again."""
    pass_s = lambda rows, n: 0.05 + 0.002 * (rows - 1) + 0.002 * (n - 1)  # noqa: E731

    def trained(lefts):
        policy = AutoK(8, lambda rows: pass_s(rows, 1), 0.0)
        seqs = [_Seq(i, max_tokens=m) for i, m in enumerate(lefts)]
        for _ in range(3):  # plain rounds: each further sequence's cost
            _observe(policy, seqs, [0] * 8, [0] * 8, 0.0, pass_s(8, 8))
        for r in range(12):  # acceptance 0.5 at the first position, each sequence's and engine-wide
            _observe(policy, seqs, [1] * 8, [(r + i) % 2 for i in range(8)], 0.0, pass_s(16, 8))
        return policy, seqs

    policy, seqs = trained([20] * 8)
    assert all(policy.plan(seqs).ks)
    policy, seqs = trained([200] + [20] * 7)
    ks = policy.plan(seqs).ks
    assert ks[0] > 0 and ks[1:] == [0] * 7, ks
    policy, seqs = trained([200] + [20] * 7)
    assert all(policy.plan(seqs, waiting=True).ks)


def test_a_useless_draft_is_turned_off_despite_a_spiked_start_up_timing():
    # A draft step as dear as the target's pass, never accepted, and the plain step's start-up
    # timing 10x too high: drafting must not look free (K = 0 would never run to correct it).
    policy = AutoK(8, lambda rows: 0.5 if rows == 1 else 0.05 + 0.004 * (rows - 1), 0.05)
    seqs = [_Seq(0)]
    for _ in range(30):
        ks = policy.plan(seqs).ks
        _observe(policy, seqs, ks, [0] * len(ks), 0.05 * max(ks), 0.05 + 0.004 * sum(ks))
    assert policy.plan(seqs).ks == [0]


def test_a_spiked_start_up_timing_of_the_draft_step_is_timed_again():
    # The draft's step timed at start-up in a load spike (1 s against a 50 ms target pass):
    # at K = 0 no round would measure it again, so the next new sequence times it again.
    timings = iter([1.0, None, 0.01, 0.5])  # (None: no step could be timed, the draft's cache full)
    policy = AutoK(8, lambda rows: 0.05 + 0.004 * (rows - 1), lambda: next(timings))
    assert policy.draft_step == 1.0
    assert policy.plan([_Seq(0)]).ks == [0] and policy.draft_step == 1.0
    assert policy.plan([_Seq(0), _Seq(1)]).ks[1] > 0 and policy.draft_step == 0.01
    policy.plan([_Seq(1)])  # the same sequence: not timed again
    policy.plan([_Seq(1), _Seq(2)])  # a new one: timed again, the cheapest timing stands
    assert policy.draft_step == 0.01
    # A draft that really is that dear stays off.
    dear = AutoK(8, lambda rows: 0.05 + 0.004 * (rows - 1), lambda: 1.0)
    assert dear.plan([_Seq(0)]).ks == [0]


def test_a_draft_that_is_never_accepted_turns_speculation_off_then_probes():
    policy, seq = _policy(), _Seq(0)
    assert policy.plan([seq]).ks[0] > 0  # optimistic before any data
    _rounds(policy, [seq], lambda k: 0, 20)
    chosen = []
    for _ in range(3000):  # rounds at K = 0 teach nothing: a probe now and then
        (k,) = policy.plan([seq]).ks
        chosen.append(k)
        _observe(policy, [seq], [k], [0], 0.01 * k, 0.05 + 0.004 * k)
        seq.num_tokens += 1
    probes = [i for i, k in enumerate(chosen) if k]
    assert {chosen[i] for i in probes} == {PROBE_K} and len(probes) >= 3, probes
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]  # each fruitless probe waits longer, up to a cap
    assert all(g2 >= g1 for g1, g2 in zip(gaps, gaps[1:])) and gaps[2] > gaps[1] > gaps[0] and gaps[-1] >= 3 * gaps[0], gaps
    probe_s = len(probes) * (0.01 * PROBE_K + 0.05 + 0.004 * PROBE_K)
    assert probe_s <= PROBE_BUDGET * 0.05 * (len(chosen) - len(probes))  # probes cost little time


def test_a_long_prompt_with_a_short_answer_is_not_prefilled_for_the_draft():
    """Drafting starts only if what it saves over the tokens left pays the draft's catch-up."""
    policy = _policy()
    _rounds(policy, [_Seq(0)], lambda k: k, 30)  # a draft that is always right
    _observe(policy, [_Seq(9)], [2], [2], 0.05, 0.06, 0.01, catchup=(1.01, 1000, 500_500))  # a step + 1 ms per token
    short_prompt, long_prompt = _Seq(1, num_tokens=300, max_tokens=64), _Seq(2, num_tokens=3000, max_tokens=64)
    assert policy.plan([short_prompt]).ks[0] > 0  # 0.3 s of catch-up, ~2 s saved
    assert policy.plan([long_prompt]).ks == [0]  # 3 s of catch-up
    assert policy.plan([_Seq(3, num_tokens=3000, max_tokens=1000)]).ks[0] > 0  # a long answer pays for it


def test_in_a_batch_a_catch_up_must_pay_against_the_batchs_plain_step():
    """Alone, a 300-token prompt's catch-up (0.3 s) is repaid over 128 tokens; in a batch of 8,
    where a plain step serves all 8 and drafting for them gains ~17 % a round, the 8 catch-ups
    (2.5 s) would cost more than the batch saves (~1.5 s): the batch decodes plainly. A long
    answer repays them. Before the batch's view, all 8 drafted."""
    policy = _policy()
    rnd = random.Random(0)
    _rounds(policy, [_Seq(0)], lambda k: next((i for i in range(k) if rnd.random() > 0.8), k), 40)  # rates ~0.8
    _observe(policy, [_Seq(9)], [2], [2], 0.05, 0.06, 0.01, catchup=(0.31, 300, 45_150))  # a step + 1 ms a token
    short = [_Seq(i, num_tokens=300, max_tokens=128) for i in range(1, 9)]
    assert policy.plan(short[:1]).ks[0] > 0
    assert policy.plan(short).ks == [0] * 8
    assert all(policy.plan([_Seq(i, num_tokens=300, max_tokens=1000) for i in range(11, 19)]).ks)


def test_before_evidence_the_prior_decides_a_catch_up():
    """Before the engine-wide rates rest on a few rounds, a long prompt drafts, to learn, only
    if the prior's rates could repay its catch-up over the tokens left; a warm-up's one
    rejected round does not stop a short prompt from drafting."""
    policy = _policy()
    assert policy.plan([_Seq(0, num_tokens=3000, max_tokens=64)]).ks == [0]  # 1.5 s of catch-up, 0.5 s saved at best
    assert policy.plan([_Seq(1, num_tokens=3000, max_tokens=1000)]).ks[0] > 0  # a long answer would repay it
    _observe(policy, [_Seq(2)], [1], [0], 0.01, 0.054, 0.01)  # a warm-up's one round, rejected
    assert policy.plan([_Seq(3, num_tokens=300, max_tokens=128)]).ks[0] > 0


def test_before_a_catch_up_is_measured_its_tokens_cost_what_the_targets_rows_do():
    """A CPU's shape: a row adds a tenth of a target step to a pass, the draft's step is 0.3 of
    the target's, so reading a token costs the draft ~1.5 ms (0.1 of its step, not 5 %): a
    fresh engine does not read a 600-token prompt for 100 tokens (0.9 s against ~0.6 s saved
    at the prior's rates), and once a catch-up measured 0.2 ms a token, it does."""
    policy = AutoK(8, lambda rows: 0.05 + 0.005 * (rows - 1), 0.015)
    assert policy.plan([_Seq(0, num_tokens=600, max_tokens=100)]).ks == [0]
    _observe(policy, [_Seq(9)], [2], [2], 0.03, 0.06, 0.015, catchup=(0.075, 300, 45_150))
    assert policy.plan([_Seq(1, num_tokens=600, max_tokens=100)]).ks[0] > 0


def test_a_fresh_engine_does_not_prefill_a_long_prompt_for_a_short_answer(smollm_dir, truncated_draft):
    """The first request of a new SD engine (auto-K, nothing measured yet), ~1,600 prompt tokens
    and 8 to write: decoded plainly, the draft never reads the prompt (it used to probe at once
    and prefill the whole prompt for the draft: SD 35 % slower than AR end to end)."""
    prompt = "Rome was not built in a day, and neither was any other city of its size. " * 100
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k="auto") as llm:
        [out] = llm.generate([prompt], SamplingParams.greedy(max_tokens=8, ignore_eos=True))
    m = out.metrics
    assert m.prompt_tokens > 1500
    # Rounds that proposed anything took prompt lookup's tokens (the prompt repeats), not the
    # draft's; the draft's prefill of this prompt would take seconds.
    assert sum(m.k_hist[1:]) == m.lookup_rounds and m.draft_s < 0.01, m


def test_stale_engine_wide_rates_do_not_lock_drafting_out():
    """The draft was useless for a while, then becomes right every time (other requests): the
    engine's own probe budget and the sequences' probes bring drafting back, within a few short
    requests, though each request's catch-up of its prompt is refused on the stale rates."""
    policy = _policy()
    for _ in range(100):  # 100 rounds of a fixed K = 4 that was never accepted
        _observe(policy, [_Seq(0)], [4], [0], 0.04, 0.066, 0.01)
    assert policy.engine_knows()
    rounds = []  # per request: the rounds its 128 tokens took (128 when decoded plainly)
    for seq_id in range(1, 13):
        seq, n = _Seq(seq_id, num_tokens=300, max_tokens=128), 0
        while len(seq.output_ids) < 128:
            (k,) = policy.plan([seq]).ks
            _observe(policy, [seq], [k], [k], 0.01 * k, 0.05 + 0.004 * k, 0.01 if k else None)
            seq.num_tokens += k + 1
            seq.output_ids += [0] * (k + 1)
            n += 1
        policy.release(seq.seq_id)
        rounds.append(n)
    assert rounds[-1] < 40 and policy.plan([_Seq(99)]).ks[0] > 0, rounds


def test_a_sequence_climbs_past_stale_engine_wide_rates_at_deeper_positions():
    """Earlier requests never had a second draft token accepted, so the engine-wide rate says a
    second token does not pay; this sequence's draft is always right: trying one token deeper
    now and then shows it, and its K climbs."""
    policy = _policy()
    _rounds(policy, [_Seq(0)], lambda k: min(k, 1), 100)
    policy.release(0)
    seq = _Seq(1)
    assert policy.plan([seq]).ks == [1]
    ks = []
    for _ in range(60):
        ks += policy.plan([seq]).ks
        _observe(policy, [seq], ks[-1:], ks[-1:], 0.01 * ks[-1], 0.05 + 0.004 * ks[-1])
    assert min(ks[-10:]) >= 4, ks


def test_probes_on_the_engine_budget_cost_little_with_a_useless_draft():
    """Many short requests, none long enough to probe on its own budget: the engine probes now and
    then on its own, within its budget, each fruitless probe doubling the wait."""
    policy = _policy()
    _rounds(policy, [_Seq(0)], lambda k: 0, 100)
    plain_s = probe_s = 0.0
    for seq_id in range(1, 201):
        seq = _Seq(seq_id, num_tokens=300, max_tokens=64)
        for _ in range(64):
            (k,) = policy.plan([seq]).ks
            _observe(policy, [seq], [k], [0], 0.01 * k, 0.05 + 0.004 * k)
            seq.num_tokens += 1
            seq.output_ids.append(0)
            if k:
                probe_s += 0.01 * k + 0.004 * k + 0.01 + 300 * 0.0005  # + a catch-up of the prompt
            else:
                plain_s += 0.05
        policy.release(seq.seq_id)
    assert 0 < probe_s <= PROBE_BUDGET * plain_s, (probe_s, plain_s)


def test_a_plan_that_drafts_nothing_holds_where_planning_is_a_large_part_of_a_step(monkeypatch):
    """64 sequences and a useless draft on a GPU-like target (a step of 64 rows in ~16 ms): a
    plan that takes 4 ms and drafts nothing holds for the rounds that keep planning within 3 %
    of them; the held rounds' time reaches every sequence's idle time when planning resumes
    (probes come as before), and a sequence joining ends a hold."""
    from types import SimpleNamespace
    import ssd.speculative.policy.adaptive_k as adaptive_k
    clock = iter(range(10**6))
    monkeypatch.setattr(adaptive_k, "time", SimpleNamespace(perf_counter=lambda: next(clock) * 0.004))
    step = lambda rows: 0.01 + 0.0001 * rows  # noqa: E731
    policy, seqs = AutoK(8, step, 0.002), [_Seq(i) for i in range(64)]
    planned = []
    real = policy._plan
    monkeypatch.setattr(policy, "_plan", lambda batch, waiting: planned.append(len(batch)) or real(batch, waiting))
    for _ in range(200):  # until the draft is off for all and a plan holds
        ks = policy.plan(seqs).ks
        _observe(policy, seqs, ks, [0] * len(ks), 0.002 * max(ks), step(sum(ks) + len(ks)))
        if policy.hold.rounds:
            break
    hold = policy.hold.rounds
    assert hold == int(0.004 / (0.03 * step(64))) == 8 and not any(ks)
    idle, planned[:] = policy.probes.idle_s[0], []
    for _ in range(hold):
        assert policy.plan(seqs).ks == [0] * 64
        _observe(policy, seqs, [0] * 64, [0] * 64, 0.0, step(64))
    assert planned == [] and policy.probes.idle_s[0] == idle  # held: no planning, idle time kept aside
    policy.plan(seqs)
    assert planned == [64] and policy.probes.idle_s[0] == pytest.approx(idle + hold * step(64))
    policy.hold.rounds, planned[:] = 5, []
    policy.plan(seqs + [_Seq(64)])
    assert planned == [65]


def test_one_slow_plan_does_not_hold_but_slow_planning_that_lasts_does(monkeypatch):
    """Planning's time is read as a low quantile of the recent plans' (docs/cost-model.md,
    "Reading the clock"): a plan caught in a spike of load (10 ms among 0.1 ms ones) holds
    nothing; planning that stays slow (the machine's speed, or a batch that grew) does."""
    from types import SimpleNamespace
    import ssd.speculative.policy.adaptive_k as adaptive_k
    took = [1e-4]
    readings = iter(x for i in range(10**6) for x in (i, i + took[0]))  # (start, end) of each plan
    monkeypatch.setattr(adaptive_k, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    step = lambda rows: 0.01 + 0.0001 * rows  # noqa: E731
    policy, seqs = AutoK(8, step, 0.002), [_Seq(i) for i in range(64)]

    def run(rounds):
        for _ in range(rounds):
            ks = policy.plan(seqs).ks
            _observe(policy, seqs, ks, [0] * len(ks), 0.002 * max(ks), step(sum(ks) + len(ks)))
            if policy.hold.rounds:
                return True
        return False

    assert not run(200)  # the draft is off for all; quick plans never hold
    took[0] = 0.01
    assert not run(1)
    took[0] = 1e-4
    assert not run(20)
    took[0] = 0.01
    assert run(TIME_WINDOW)


def test_a_draft_that_is_always_accepted_drafts_deep():
    policy, seqs = _policy(), [_Seq(0)]
    assert _rounds(policy, seqs, lambda k: k, 30) == [policy.k_max]


def test_a_step_that_fills_prompts_decodes_plainly_and_drafting_resumes_after():
    """Beside prompt chunks the plain rows ride in their pass, while a drafting round would add a
    pass of its own: a draft that is always accepted still drafts nothing there, and its K is
    back once the prompts are in. Those rounds' pass (prompts included) is not read as V."""
    policy, seqs = _policy(), [_Seq(0)]
    deep = _rounds(policy, seqs, lambda k: k, 30)
    assert deep == [policy.k_max]
    v1 = policy.verify(1)
    for _ in range(5):
        assert policy.plan(seqs, filling=True).ks == [0]
        policy.learn([Round(seqs[0], 0, Proposal([]), times=RoundTimes(verify_s=9.0, timed=False))])
    assert policy.verify(1) == v1
    assert policy.plan(seqs).ks == deep


def test_each_sequence_gets_its_own_k():
    policy, good, bad = _policy(), _Seq(0), _Seq(1)
    for _ in range(30):
        ks = policy.plan([good, bad]).ks
        _observe(policy, [good, bad], ks, [ks[0], 0], 0.01 * max(ks), 0.05 + 0.004 * (sum(ks) + 1))
    k_good, k_bad = policy.plan([good, bad]).ks
    assert k_good >= 4 and k_bad == 0


def test_expensive_draft_is_not_worth_it():
    # A draft step as costly as the target's pass never pays, even if always accepted.
    policy, seqs = _policy(draft_step=0.06), [_Seq(0)]
    for _ in range(10):
        ks = policy.plan(seqs).ks
        _observe(policy, seqs, ks, ks, 0.06 * max(ks), 0.05 + 0.004 * sum(ks))
    assert policy.plan(seqs).ks == [0]


@pytest.fixture(scope="module")
def random_smollm(smollm_dir, tmp_path_factory):
    """SmolLM2's shapes and tokenizer with random weights: a draft that costs what the target
    costs and (almost) never agrees with it."""
    folder = tmp_path_factory.mktemp("random-smollm")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(smollm_dir))
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(smollm_dir).save_pretrained(folder)
    return folder


def test_auto_k_with_a_useless_draft_decodes_plainly_and_exactly(smollm_dir, random_smollm, ar_outputs):
    params = SamplingParams.greedy(max_tokens=48, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with LLM(smollm_dir, draft=random_smollm, mode="sd", speculate_k="auto") as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    for o in outs:
        m = o.metrics
        assert m.k_hist[0] > m.rounds / 2, m  # mostly plain decoding


def test_auto_k_with_prompt_lookup_drafts_deep_on_repeats(smollm_dir, ar_outputs):
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    with LLM(smollm_dir, draft="ngram", mode="sd", speculate_k="auto") as llm:
        # Costs fixed as a quiet machine measures them: SmolLM2's passes take ~10 ms, so on a
        # busy CI machine the measured V(rows) is noise and the 10 rounds too few to average it.
        llm.engine.k_policy = _FixedCosts(k_max=8)
        (out,) = llm.generate([REPEATING], params)
    assert out.token_ids == ar_outputs([REPEATING], params)[0]
    assert out.metrics.mean_k >= 3, out.metrics  # drafting is free and copies are accepted (k_max 8)


def test_auto_k_target_as_its_own_draft_accepts_everything_it_drafts(smollm_dir, ar_outputs):
    """A self-draft costs a target pass a token, so measured costs keep K at 0 (drafting could
    never pay); with the costs of a free draft, every token it drafts is accepted."""
    params = SamplingParams.greedy(max_tokens=32, ignore_eos=True)
    prompts = ["Once upon a time", "The three primary colours are"]
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k="auto", draft_quantization="gguf") as llm:
        llm.engine.k_policy = _FixedCosts(k_max=8)
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert all(o.metrics.accepted == o.metrics.drafted > 0 for o in outs)


class _FixedCosts(AutoK):
    """A free draft and a target pass growing slowly with its rows, whatever the machine's load."""

    def __init__(self, k_max=4):
        super().__init__(k_max, lambda rows: 1.0 + (rows - 1) / 3000, 0.0)

    def plan(self, seqs, filling=False, waiting=False):  # (drafting beside prompt chunks too: its rounds are tested)
        return super().plan(seqs, waiting=waiting)

    def learn(self, rounds):
        rows = sum(r.drafted + 1 for r in rounds)
        times = RoundTimes(verify_s=1.0 + (rows - 1) / 3000)
        super().learn([dataclasses.replace(r, times=times) for r in rounds])


def test_auto_k_sampling_follows_the_target(tiny_pair):
    """K varies with each sequence's own acceptance so far, never with the round's drafts."""
    target, draft = tiny_pair
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", speculate_k="auto", k_max=4, max_num_seqs=500, seed=5) as llm:
        # The tiny models cost next to nothing and about the same: fix the costs (a free draft, a
        # target pass growing slowly with its rows) so that K follows each sequence's acceptance.
        llm.engine.k_policy = _FixedCosts()
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    k_hist = [sum(o.metrics.k_hist[k] for o in outs if k < len(o.metrics.k_hist)) for k in range(5)]
    assert sum(o.metrics.accepted for o in outs) > 100 and len([k for k in k_hist if k]) > 1, k_hist
    joint = exact_joint(target, prompt_ids, temperature)
    for i in range(NEW):
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert fits(pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal)), i


def test_auto_k_is_sds_default_and_a_fixed_k_ssds():
    assert SpecOptions().resolved("sd").speculate_k == AUTO_K
    assert SpecOptions().resolved("ssd").speculate_k == SSD_K
    assert SpecOptions(speculate_k=3).resolved("sd").speculate_k == 3


# ---- prompt lookup beside the draft ---------------------------------------------------------

class _Text(_Seq):
    """A sequence with tokens, which prompt lookup reads: a span of `period` tokens repeated."""

    def __init__(self, seq_id, length=120, period=10, max_tokens=10_000, prompt=None):
        super().__init__(seq_id, max_tokens=max_tokens)
        self.token_ids = list(prompt) if prompt else [100 + i % period for i in range(length)]
        self.period = period

    @property
    def num_tokens(self):
        return len(self.token_ids)

    @num_tokens.setter
    def num_tokens(self, value):  # _Seq's constructor sets it
        pass

    def continuation(self, n):
        return [100 + (len(self.token_ids) + i) % self.period for i in range(n)]


def _lookup_round(policy, seq, draft_accepts, kept=None):
    """One round as the engine runs it: the policy's choice, then the kept tokens are the text's
    continuation (kept: other tokens, where the text stops repeating)."""
    plan = policy.plan([seq])
    (k,), lookup = plan.ks, plan.seqs[0].lookup is not None
    truth = kept if kept is not None else seq.continuation(k + 1)
    proposal = Proposal(plan.seqs[0].lookup, lookup=True) if lookup else Proposal([0] * k)
    accepted = next((i for i in range(k) if proposal.tokens[i] != truth[i]), k) if lookup else min(k, draft_accepts)
    tokens = truth[:accepted + 1]
    policy.learn([Round(seq, k, proposal, accepted, tokens, RoundTimes(0.0 if lookup else 0.01 * k, 0.05 + 0.004 * k,
                                                                      step_s=0.01 if k and not lookup else None))])
    seq.token_ids += tokens
    seq.output_ids += tokens
    return k, lookup


def _lookup_policy(k_max=8):
    return AutoK(k_max, lambda rows: 0.05 + 0.004 * (rows - 1), 0.01, steps_measured=True,
                 lookup=PromptLookup(1, 4))


def test_lookup_is_learnt_from_rounds_that_did_not_propose_it():
    """Earlier requests' long matches were all wrong, so this sequence drafts first; its round
    shows that the lookup's tokens were the kept ones, and the policy proposes them from then
    on, 8 at a time (no draft step), without a round spent trying them."""
    policy, seq = _lookup_policy(), _Text(0)
    for _ in range(10):
        policy.lookup_overall[3].observe(8, 0)
    assert _lookup_round(policy, seq, draft_accepts=2)[1] is False
    rounds = [_lookup_round(policy, seq, draft_accepts=2) for _ in range(10)]
    assert set(rounds) == {(8, True)}, rounds
    assert policy.overall.reached[0] == 1, policy.overall.reached  # lookup rounds do not count as the draft's


def test_a_lookup_that_is_never_right_is_not_proposed():
    policy, seq = _lookup_policy(), _Text(0)
    for _ in range(20):  # the text stops repeating: the lookup's proposals never match
        k, lookup = _lookup_round(policy, seq, draft_accepts=8, kept=[7] * 9)
    plan = policy.plan([seq])
    assert plan.ks == [8] and plan.seqs[0].lookup is None


def test_a_long_prompt_with_a_short_answer_takes_lookup_rounds_not_the_draft():
    """The draft's catch-up of a long prompt would not pay over 64 tokens; where the lookup
    finds the text, it proposes instead (a summary quoting its document), else plain decoding."""
    policy = _lookup_policy()
    _rounds(policy, [_Seq(1)], lambda k: k, 30)  # the draft is always right ...
    _observe(policy, [_Seq(9)], [2], [2], 0.05, 0.06, 0.01, catchup=(1.01, 1000, 500_500))  # ... and reads 1 ms a token
    for i in range(8):
        policy.lookup_overall[3].observe(8, 8)  # long matches were right before
    seq = _Text(2, length=3000, period=500, max_tokens=64)
    plan = policy.plan([seq])
    assert plan.ks == [8] and plan.seqs[0].lookup == seq.continuation(8)
    fresh = _Text(3, prompt=list(range(1000, 4000)), max_tokens=64)  # no repeat: no lookup, no draft
    plan = policy.plan([fresh])
    assert plan.ks == [0] and plan.seqs[0].lookup is None


def test_the_drafts_catch_up_must_pay_against_the_lookup_not_plain_decoding():
    """A 600-token document being summarised: against plain decoding the draft's catch-up
    (0.6 s) would pay over 128 tokens, against the lookup rounds this sequence has been taking
    it would not, so a round where the lookup finds nothing decodes plainly, and the draft
    never reads the document."""
    policy = _lookup_policy()
    _rounds(policy, [_Seq(1)], lambda k: k, 30)  # the draft is always right ...
    _observe(policy, [_Seq(9)], [2], [2], 0.05, 0.06, 0.01, catchup=(1.01, 1000, 500_500))  # ... and reads 1 ms a token
    for i in range(8):
        policy.lookup_overall[3].observe(8, 8)
    seq = _Text(2, length=600, period=300, max_tokens=128)
    for _ in range(3):
        plan = policy.plan([seq])
        assert plan.ks == [8] and plan.seqs[0].lookup is not None
    seq.token_ids += [5000, 5001, 5002, 5003]  # text never seen: no lookup this round
    plan = policy.plan([seq])
    assert plan.ks == [0] and plan.seqs[0].lookup is None
    plain = _Text(3, prompt=list(range(1000, 1600)), max_tokens=128)  # never a lookup: the draft pays
    assert policy.plan([plain]).ks[0] > 0


def test_prompt_lookup_beside_the_draft_is_exact_and_used(smollm_dir, truncated_draft, ar_outputs):
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    prompts = [REPEATING, "The capital of France is"]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd") as llm:
        assert llm.engine.k_policy.lookup is not None  # on by default in SD with auto-K
        llm.engine.k_policy = _EveryOtherLookup(k_max=4)
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    m = outs[0].metrics
    assert m.lookup_rounds > 0 and m.tokens_on_lookup > m.lookup_rounds and m.rounds > m.lookup_rounds, m


class _EveryOtherLookup(_FixedCosts):
    """Fixed costs, and prompt lookup's proposal wherever it finds one on every other round:
    lookup and draft rounds mixed in one batch, the draft catching up after lookup rounds."""

    def __init__(self, k_max=4):
        super().__init__(k_max)
        self.lookup, self.turn = PromptLookup(1, 4), 0

    def plan(self, seqs, filling=False, waiting=False):
        plan = super().plan(seqs, filling, waiting)
        self.turn += 1
        mixed = []
        for b, (s, p) in enumerate(zip(seqs, plan.seqs)):
            tokens = self.last.found.get(s.seq_id, ([], 0))[0]
            lookup = tokens if tokens and (self.turn + b) % 2 else None
            mixed.append(SeqPlan(len(tokens) if lookup else p.k, lookup))
        return Plan(mixed)


def test_prompt_lookup_beside_the_draft_sampling_follows_the_target(tiny_pair):
    target, draft = tiny_pair
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", k_max=4, max_num_seqs=500, seed=7) as llm:
        llm.engine.k_policy = _EveryOtherLookup()
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    lookup_rounds = sum(o.metrics.lookup_rounds for o in outs)
    assert lookup_rounds > 1000 and sum(o.metrics.accepted for o in outs) > 1000, lookup_rounds
    joint = exact_joint(target, prompt_ids, temperature)
    for i in range(NEW):
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert fits(pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal)), i


def test_prompt_lookup_option():
    assert SpecOptions(prompt_lookup=True).resolved("sd").prompt_lookup
    for mode, k in (("ssd", None), ("sd", 4)):
        with pytest.raises(SSDError, match="prompt_lookup applies to mode 'sd' with speculate_k='auto' only"):
            SpecOptions(prompt_lookup=True, speculate_k=k).resolved(mode)
    with pytest.raises(SSDError, match="True, False, None or 'suffix'"):
        SpecOptions(prompt_lookup="yes").resolved("sd")
    assert SpecOptions(prompt_lookup="suffix").resolved("sd").prompt_lookup == "suffix"
    with pytest.raises(SSDError, match="prompt_lookup applies to a draft model, not a draft source without one"):
        LLM("smollm2-135m-instruct", draft="ngram", mode="sd", prompt_lookup=True)


def test_the_catch_up_cost_grows_with_the_context_its_attention_reads():
    """Catch-ups measured on the Zen 5 host (a 148-token prompt, a 960-token one, 3 tokens at
    position 1000): the fit prices each size near what it cost, where one cost per token,
    learnt mostly from short prompts, would price the long prompt at about half of it."""
    cost = CatchupCost()
    assert cost(100, 5000.0) is None
    keys = lambda n, start=0: n * (start + (n + 1) / 2)  # noqa: E731

    def seen(seconds: float, n: int, k: float) -> None:  # expected: the fit's (before any, as measured)
        cost.observe(seconds, n, k, cost(n, k) or seconds)

    for _ in range(3):
        seen(0.111, 148, keys(148))
        seen(0.0022, 3, keys(3, 1000))
    seen(1.213, 960, keys(960))
    assert cost(960, keys(960)) == pytest.approx(1.213, rel=0.1)
    assert cost(148, keys(148)) == pytest.approx(0.111, rel=0.25)
    assert cost(300, keys(300)) < cost(960, keys(960)) * 300 / 960  # cheaper a token when shorter
    one = CatchupCost()
    one.observe(1.0, 1000, 0.0, 1.0)  # no keys counted: a cost per token
    assert one(500, 0.0) == pytest.approx(0.5, rel=0.02)  # (the ridge shrinks it by 1 per cent)


def test_a_dear_catch_up_waits_for_a_second():
    """A catch-up 1.5x dearer than expected is held back: a spike is dropped when the next one
    comes at the expected cost; one that the next confirms enters with it."""
    cost = CatchupCost()
    cost.observe(0.1, 100, 0.0, 0.1)
    cost.observe(1.0, 100, 0.0, cost(100, 0.0))  # 10x: held back
    assert cost(100, 0.0) == pytest.approx(0.1, rel=0.02)
    cost.observe(0.1, 100, 0.0, cost(100, 0.0))  # the expected cost: the spike is dropped
    assert cost(100, 0.0) == pytest.approx(0.1, rel=0.02)
    for _ in range(2):  # dear twice in a row: both enter
        cost.observe(1.0, 100, 0.0, cost(100, 0.0))
    assert cost(100, 0.0) > 0.5
