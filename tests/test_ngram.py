"""Prompt-lookup (n-gram) drafting: no draft model, proposals verified as one-hot, exact."""
import torch

from ssd import LLM, SamplingParams
from ssd.speculative.sources.ngram import PromptLookup
from chance import fits
from tiny_pair import NEW, PROMPT, V, exact_joint, marginal_p_values, drafter

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
    assert sum(o.metrics.accepted for o in outs) > 100  # the path is really taken
    p_values = marginal_p_values(torch.tensor([o.token_ids for o in outs]), exact_joint(target, prompt_ids, temperature))
    assert all(map(fits, p_values)), p_values


def test_a_draft_with_another_tokenizer_samples_the_target(tiny_pair, tmp_path):
    """The tiny draft with its token ids shuffled (its tokenizer and its weights alike): the
    same text, another vocabulary, so SD drafts through text (sources/cross_vocab.py) and
    verifies the re-encoded proposals one-hot. 4000 samples against the exact marginals."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from ssd.speculative.sources.cross_vocab import CrossVocab
    target, draft = tiny_pair
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(4))  # word i has id perm[i] in the draft
    other = tmp_path / "shuffled"
    other.mkdir()
    for f in draft.iterdir():
        if f.name == "config.json":
            (other / f.name).write_text(f.read_text().replace('"eos_token_id": 1', f'"eos_token_id": {int(perm[1])}'))
    weights = load_file(draft / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        shuffled = torch.empty_like(weights[name])
        shuffled[perm] = weights[name]
        weights[name] = shuffled
    save_file(weights, other / "model.safetensors")
    tok = Tokenizer(models.WordLevel({f"w{i}": int(perm[i]) for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(other)
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=other, mode="sd", speculate_k=3, max_num_seqs=500, seed=3) as llm:
        assert isinstance(drafter(llm), CrossVocab)
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    assert sum(o.metrics.accepted for o in outs) > 100  # the path is really taken
    p_values = marginal_p_values(torch.tensor([o.token_ids for o in outs]), exact_joint(target, prompt_ids, temperature))
    assert all(map(fits, p_values)), p_values
