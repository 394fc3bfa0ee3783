"""The reduced-vocabulary draft head: the draft proposes only the V' tokens a target writes
most, with q 0 elsewhere; outputs stay exact (greedy equal to AR; sampling follows the target)."""
import json

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.speculative.vocab import counts_path, reduced_vocabulary
from tiny_pair import NEW, PROMPT, V, exact_joint, pooled_p_value

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]


@pytest.fixture
def counts_for(tmp_path, monkeypatch):
    """Writes a token-count file for a target into a store of its own."""
    monkeypatch.setenv("SSD_HOME", str(tmp_path))

    def write(target_folder, counts: dict[int, int]):
        path = counts_path(target_folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"counts": {str(t): n for t, n in counts.items()}}))
    return write


def test_kept_ids_are_the_most_frequent_then_by_id(counts_for, smollm_dir):
    counts_for(smollm_dir, {900: 50, 7: 40, 40000: 40, 3: 1})
    assert reduced_vocabulary(smollm_dir, 5, 49152, {2}) == (2, 3, 7, 900, 40000)  # 3 was seen once: before unseen 0
    with pytest.raises(SSDError, match="draft_vocab must be"):
        reduced_vocabulary(smollm_dir, 49153, 49152, set())


def test_missing_counts_say_how_to_make_them(tmp_path, monkeypatch, smollm_dir, truncated_draft):
    monkeypatch.setenv("SSD_HOME", str(tmp_path))
    with pytest.raises(SSDError, match="ssd vocab --model"):
        LLM(smollm_dir, draft=truncated_draft, mode="sd", draft_vocab=1000)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_reduced_head_greedy_equals_ar(counts_for, smollm_dir, truncated_draft, ar_outputs, mode):
    tok_counts = {}
    with LLM(smollm_dir) as ar:  # count the target's own tokens, as `ssd vocab` does
        for o in ar.generate(PROMPTS, SamplingParams.greedy(max_tokens=24)):
            for t in o.token_ids:
                tok_counts[t] = tok_counts.get(t, 0) + 1
    counts_for(smollm_dir, tok_counts)
    params = SamplingParams.greedy(max_tokens=32, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode=mode, speculate_k=3, draft_vocab=4096) as llm:
        engine = llm.speculator.engine if mode == "sd" else None
        outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ar_outputs(PROMPTS, params)
    assert sum(o.metrics.accepted for o in outs) > 0
    if engine is not None:
        assert engine.vocab_ids.numel() == 4096
        assert engine.runner.model.lm_head.out_features == 4096


def test_reduced_head_sampling_follows_the_target(counts_for, tiny_pair):
    target, draft = tiny_pair
    counts_for(target, {2: 9, 3: 8, 5: 7, 6: 6})  # the draft may propose 2, 3, 5, 6 and eos (1)
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", speculate_k=2, max_num_seqs=500, seed=4, draft_vocab=5) as llm:
        assert llm.speculator.engine.vocab_ids.tolist() == [1, 2, 3, 5, 6]
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    accepted, drafted = sum(o.metrics.accepted for o in outs), sum(o.metrics.drafted for o in outs)
    assert 0.05 < accepted / drafted < 0.95
    joint = exact_joint(target, prompt_ids, temperature)
    for i in range(NEW):
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal) > 1e-3, i
