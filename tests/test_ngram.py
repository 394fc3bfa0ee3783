"""Prompt-lookup (n-gram) drafting: no draft model, proposals verified as one-hot, exact."""
import torch

from ssd import LLM, SamplingParams
from ssd.exactness import pooled_p_value
from ssd.speculative.sources.ngram import PromptLookup
from tiny_pair import NEW, PROMPT, V, exact_joint

REPEATING = "def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n    return a + b + c\n\n\ndef add"


class _Seq:
    def __init__(self, seq_id, tokens):
        self.seq_id, self.token_ids = seq_id, tokens


def test_lookup_proposes_what_followed_the_latest_match():
    spec = PromptLookup(ngram_min=1, ngram_max=3)
    s = _Seq(0, [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3])
    assert spec.match(s, 2)[0] == [5, 6]  # "1 2 3" last seen before 5 6, not before 4
    s.token_ids += [5, 6]
    assert spec.match(s, 3)[0] == [1, 2, 3]  # "3 5 6" was followed by 1 2 3 (the index grows with the text)
    s.token_ids += [7]
    assert spec.match(s, 3)[0] == []  # "7" never appeared before: no proposal
    assert spec.match(_Seq(1, [8, 8, 8]), 4)[0] == [8]  # "8 8" ends at index 2 -> continuation [8]
    assert spec.match(_Seq(2, [4, 5]), 2)[0] == []


def test_ngram_greedy_equals_ar_and_accepts_repeats(smollm_dir, ar_outputs):
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    prompts = [REPEATING, "The capital of France is"]
    with LLM(smollm_dir, draft="ngram", mode="sd", speculate_k=4) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert outs[0].metrics.accepted > 5, outs[0].metrics


def test_ngram_sampling_follows_the_target(tiny_pair):
    target, _ = tiny_pair
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft="ngram", mode="sd", speculate_k=2, max_num_seqs=500, seed=3, ngram_min=1) as llm:
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    assert sum(o.metrics.accepted for o in outs) > 100  # the path is really taken
    joint = exact_joint(target, prompt_ids, temperature)
    for i in range(NEW):
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal) > 1e-3, i
