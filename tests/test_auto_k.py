"""Auto-K (ssd/speculative/adaptive_k.py): K chosen per sequence and round from measured
acceptance and costs; plain decoding when drafting does not pay; exact in every case."""
import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
from ssd.speculative.adaptive_k import PROBE_EVERY, PROBE_K, AutoK, Timings, expected_tokens
from test_ngram import REPEATING
from tiny_pair import NEW, PROMPT, V, exact_joint, pooled_p_value


class _Seq:
    def __init__(self, seq_id):
        self.seq_id = seq_id


def _policy(k_max=8, draft_step=0.01):
    # A target pass of R rows: 50 ms + 4 ms per extra row (about the 1.5B target's shape here).
    return AutoK(k_max, lambda rows: 0.05 + 0.004 * (rows - 1), draft_step)


def _rounds(policy, seqs, accept, n):
    for _ in range(n):
        ks = policy.choose(seqs)
        policy.observe(seqs, ks, [accept(k) for k in ks], 0.01 * max(ks), 0.05 + 0.004 * sum(ks))
    return policy.choose(seqs)


def test_expected_tokens_and_timings():
    assert expected_tokens([0.5, 0.5]) == [1.0, 1.5, 1.75]
    t = Timings({1: 1.0, 3: 3.0})
    assert t(2) == 2.0 and t(5) == 5.0 and t(3) == 3.0
    t.observe(3, 4.0)  # the first measurement replaces the start-up timing, later ones average in
    assert t(3) == 4.0
    t.observe(3, 3.0)
    assert 3.0 < t(3) < 4.0


def test_a_draft_that_is_never_accepted_turns_speculation_off_then_probes():
    policy, seqs = _policy(), [_Seq(0)]
    assert policy.choose(seqs)[0] > 0  # optimistic before any data
    _rounds(policy, seqs, lambda k: 0, 20)
    chosen = []
    for _ in range(8 * PROBE_EVERY):  # rounds at K = 0 teach nothing: a probe now and then
        (k,) = policy.choose(seqs)
        chosen.append(k)
        policy.observe(seqs, [k], [0], 0.0, 0.05)
    probes = [i for i, k in enumerate(chosen) if k]
    assert {chosen[i] for i in probes} == {PROBE_K} and len(probes) >= 2
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]  # each fruitless probe doubles the wait
    assert all(g2 == 2 * g1 for g1, g2 in zip(gaps, gaps[1:])) and gaps[-1] >= 2 * PROBE_EVERY, gaps


def test_a_draft_that_is_always_accepted_drafts_deep():
    policy, seqs = _policy(), [_Seq(0)]
    assert _rounds(policy, seqs, lambda k: k, 30) == [policy.k_max]


def test_each_sequence_gets_its_own_k():
    policy, good, bad = _policy(), _Seq(0), _Seq(1)
    for _ in range(30):
        ks = policy.choose([good, bad])
        policy.observe([good, bad], ks, [ks[0], 0], 0.01 * max(ks), 0.05 + 0.004 * (sum(ks) + 1))
    k_good, k_bad = policy.choose([good, bad])
    assert k_good >= 4 and k_bad == 0


def test_expensive_draft_is_not_worth_it():
    # A draft step as costly as the target's pass never pays, even if always accepted.
    policy, seqs = _policy(draft_step=0.06), [_Seq(0)]
    for _ in range(10):
        ks = policy.choose(seqs)
        policy.observe(seqs, ks, ks, 0.06 * max(ks), 0.05 + 0.004 * sum(ks))
    assert policy.choose(seqs) == [0]


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
        (out,) = llm.generate([REPEATING], params)
    assert out.token_ids == ar_outputs([REPEATING], params)[0]
    assert out.metrics.mean_k >= 3, out.metrics  # drafting is free and copies are accepted (k_max 8)


def test_auto_k_target_as_its_own_draft_accepts_everything_it_drafts(smollm_dir, ar_outputs):
    params = SamplingParams.greedy(max_tokens=32, ignore_eos=True)
    prompts = ["Once upon a time", "The three primary colours are"]
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k="auto", draft_quantization="gguf") as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert all(o.metrics.accepted == o.metrics.drafted for o in outs)


class _FixedCosts(AutoK):
    def __init__(self):
        super().__init__(4, lambda rows: 1.0 + (rows - 1) / 3000, 0.0)

    def observe(self, seqs, drafted, accepted, draft_s, verify_s, step_s=None):
        super().observe(seqs, drafted, accepted, 0.0, 1.0 + (sum(drafted) + len(seqs) - 1) / 3000)


def test_auto_k_sampling_follows_the_target(tiny_pair):
    """K varies with each sequence's own acceptance so far, never with the round's drafts."""
    target, draft = tiny_pair
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", speculate_k="auto", k_max=4, max_num_seqs=500, seed=5) as llm:
        # The tiny models cost next to nothing and about the same: fix the costs (a free draft, a
        # target pass growing slowly with its rows) so that K follows each sequence's acceptance.
        llm.k_policy = _FixedCosts()
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    k_hist = [sum(o.metrics.k_hist[k] for o in outs if k < len(o.metrics.k_hist)) for k in range(5)]
    assert sum(o.metrics.accepted for o in outs) > 100 and len([k for k in k_hist if k]) > 1, k_hist
    joint = exact_joint(target, prompt_ids, temperature)
    for i in range(NEW):
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal) > 1e-3, i
