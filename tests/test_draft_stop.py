"""draft_stop: an SD round's draft goes on while its confidence makes one more token worth its
cost (ssd/speculative/policy/draft_stop.py). Only the proposals' length depends on it: greedy output
stays AR's, sampled and constrained requests draft the K they are given."""
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.models.loader import load_model
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.options import SpecOptions
from ssd.speculative.policy.adaptive_k import AutoK
from ssd.speculative.policy.draft_stop import BINS, DraftStop, StopRule
from ssd.speculative.policy.tunables import SPIKE, STOP_PRIOR_TOKENS
from test_ngram import REPEATING


@pytest.fixture(scope="module")
def smollm_model(smollm_dir):
    return load_model(smollm_dir, torch.device("cpu"), torch.float32, "auto")


def test_calibration_starts_at_the_confidence_and_learns_from_reached_tokens():
    stop = DraftStop()
    assert stop.chance(0.95) == pytest.approx(0.95)
    assert stop.chance(0.05) == pytest.approx(0.05)
    # Tokens 0 and 1 were reached (0 taken, 1 rejected); token 2 never was.
    stop.observe([0.93, 0.91, 0.15], accepted=1)
    top, low = BINS - 1, int(0.15 * BINS)
    assert stop.reached[top] == pytest.approx(STOP_PRIOR_TOKENS * 0.998 + 2)
    assert stop.accepted[top] == pytest.approx(STOP_PRIOR_TOKENS * 0.95 * 0.998 + 1)
    assert stop.reached[low] == pytest.approx(STOP_PRIOR_TOKENS * 0.998)
    for _ in range(200):  # a draft sure of itself and always wrong
        stop.observe([0.95], accepted=0)
    assert stop.chance(0.95) < 0.1


def test_floors_weigh_a_token_against_its_cost_at_the_rounds_rate():
    stop = DraftStop()
    verify = lambda rows: 0.02 + 0.001 * rows  # noqa: E731
    rule = stop.rule(4, 0.005, verify, fallback_rate=50.0)
    mean = sum(stop.accepted) / sum(stop.reached)
    assert rule.floors == pytest.approx([50.0 * 0.006 / mean] * 3)
    assert rule.keep_going(1.0, 1) and not rule.keep_going(0.5, 1)
    assert not rule.keep_going(1.0, 4)  # k_max drafted: no floor past it
    assert rule.chance(0.95) == stop.chance(0.95)
    stop.observe_rate(10, 0.5)  # a measured rate replaces the fallback
    assert stop.rule(4, 0.005, verify, fallback_rate=50.0).floors[0] == pytest.approx(20.0 * 0.006 / mean)
    stop.observe_rate(2, 0.5)  # moving averages of tokens and seconds: (10 - 1.6) / 0.5
    assert stop.rule(4, 0.005, verify, fallback_rate=50.0).floors[0] == pytest.approx(16.8 * 0.006 / mean)


def test_a_round_caught_in_a_spike_moves_the_rate_no_more_than_spike_allows():
    """The rule's rate takes a round's time at most SPIKE times what the cost model expects of
    it: a round a load spike made 20x slower does not make the draft run deep for long."""
    from ssd.speculative.policy.rules import StopAtConfidence
    from ssd.speculative.records import Proposal, Round, RoundTimes
    verify = lambda rows: 0.02 + 0.001 * rows  # noqa: E731
    policy = AutoK(4, verify, 0.005, stop=DraftStop())
    plan = policy.plan([_Seq(0)])
    assert plan.seqs[0].stop is not None
    (rule,) = [r for r in policy.rules if isinstance(r, StopAtConfidence)]
    expected = 3 * 0.005 + verify(4)
    for seconds, bound in ((expected, expected), (20 * expected, SPIKE * expected)):
        stop = rule.stop
        stop.tokens = None
        times = RoundTimes(3 * 0.005, seconds - 3 * 0.005)
        policy.learn([Round(_Seq(0), 3, Proposal([0] * 3, confidences=[0.9] * 3), 2, times=times)])
        assert stop.seconds == pytest.approx(bound)


def _draft(model, floors: list[float], params: list[SamplingParams], k: int = 6):
    engine = DraftEngine(model, torch.device("cpu"), k_max=k, cache_tokens=1024)
    rule = StopRule(tuple(DraftStop().chance((b + 0.5) / BINS) for b in range(BINS)), tuple(floors))
    prompt = list(range(400, 440))
    seqs = [engine.sync(i, 0, prompt, p, k) for i, p in enumerate(params)]
    return engine.draft(seqs, [k] * len(seqs), stops=[rule] * len(seqs))


def test_the_draft_stops_where_the_rule_says(smollm_model):
    greedy = SamplingParams.greedy(max_tokens=64)
    (always,) = _draft(smollm_model, [0.0] * 5, [greedy])
    (never,) = _draft(smollm_model, [2.0] * 5, [greedy])
    assert len(always.tokens) == 6 and len(never.tokens) == 1
    assert never.tokens == always.tokens[:1]
    assert len(always.confidences) == 6 and all(0.0 < c <= 1.0 for c in always.confidences)
    assert never.confidences == always.confidences[:1]


def test_sampled_requests_draft_the_k_they_are_given(smollm_model):
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=64)
    drawn, greedy = _draft(smollm_model, [2.0] * 5, [sampled, SamplingParams.greedy(max_tokens=64)])
    assert len(drawn.tokens) == 6 and drawn.q is not None and drawn.confidences is None
    assert len(greedy.tokens) == 1 and greedy.confidences is not None


class _Seq:
    def __init__(self, seq_id: int, greedy: bool = True):
        self.seq_id, self.num_tokens, self.output_ids, self.token_ids = seq_id, 100, [], []
        self.processor = None
        self.params = SamplingParams(temperature=0.0 if greedy else 0.8, max_tokens=10_000)


def test_the_rule_takes_a_round_where_one_greedy_sequence_drafts_alone():
    """Alone, its K becomes k_max and the draft stops by the rule; in a batch (its deeper
    draft would hold up the others' passes: 0.84-0.88x measured at batch 4) and for a
    sampled request, auto-K's K stands and the rule is off for the round."""
    policy = AutoK(8, lambda rows: 0.05 + 0.002 * rows, 0.01, stop=DraftStop())
    plan = policy.plan([_Seq(0)])
    (rule,) = [p.stop for p in plan.seqs]
    assert plan.ks == [8] and rule is not None
    assert len(rule.floors) == 7 and all(f > 0 for f in rule.floors)
    plan = policy.plan([_Seq(1), _Seq(2)])
    assert all(p.stop is None for p in plan.seqs) and 0 < max(plan.ks) < 8
    assert policy.plan([_Seq(3, greedy=False)]).seqs[0].stop is None


def test_sd_with_the_stop_is_exact_and_drafts_rounds_of_many_lengths(smollm_dir, truncated_draft, ar_outputs):
    params = SamplingParams.greedy(max_tokens=64, ignore_eos=True)
    prompts = [REPEATING, "List three prime numbers and say why they are prime."]
    # The rule is offered in the rounds a draft model drafts for a sequence alone. Lookup off
    # (on the repeating prompt it takes the rounds), and the draft's step priced at a tenth of
    # the target's whatever the timings say: on a loaded machine auto-K once left the rule no
    # round, and without lookup this draft is priced out of most rounds on some CPUs.
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", draft_stop=True, prompt_lookup=False) as llm:
        policy = llm.engine.k_policy
        stop, learn = policy.stop, policy.learn
        assert stop is not None

        def priced(rounds):
            learn(rounds)
            policy.draft_step = policy.verify(1) / 10
        policy.learn = priced
        policy.draft_step = policy.verify(1) / 10
        outs = [llm.generate(p, params)[0] for p in prompts]  # one at a time: the rule's rounds
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    lengths = [k for o in outs for k, n in enumerate(o.metrics.k_hist) if n and k]
    assert len(lengths) >= 3, [o.metrics.k_hist for o in outs]
    assert sum(stop.reached) > BINS * STOP_PRIOR_TOKENS  # calibrated from the rounds


def test_sd_without_the_stop_has_none(smollm_dir):
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", draft_stop=False) as llm:
        assert llm.engine.k_policy.stop is None


@pytest.mark.parametrize("mode, k", [("sd", 4), ("ssd", 4)])
def test_draft_stop_needs_sd_with_auto_k(mode, k):
    with pytest.raises(SSDError, match="draft_stop applies to mode 'sd' with speculate_k='auto'"):
        SpecOptions(speculate_k=k, draft_stop=True).check(mode)
    with pytest.raises(SSDError, match="draft_stop must be True, False or None"):
        SpecOptions(draft_stop="yes").resolved("sd")
