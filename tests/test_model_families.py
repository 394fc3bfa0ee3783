"""Speculation stays exact on the Mistral, Phi-3 and Gemma families: sliding-window layers
(windows shorter than the prompts), Gemma's soft-capping and its own RoPE bases, Phi-3's
partial LongRoPE, on the dequantised and
the GGUF-block paths. Random weights; the draft is the target's first two layers (it agrees
with the target often, not always)."""
import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
from conftest import WINDOW

FAMILIES = ["mistral", "phi3", "gemma2", "gemma3"]
PROMPTS = ["Once upon a time, in a land far away, there lived a king who had three daughters, and",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
GREEDY = SamplingParams.greedy(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def pairs(tiny_models, tmp_path_factory) -> dict[tuple[str, str], tuple]:
    """(arch, weights) -> (target folder, draft folder): HF folders (dequantised) and Q8_0 GGUF
    copies of them (blocks)."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    out = {}
    for arch in FAMILIES:
        target = tiny_models[arch]
        model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        model.model.layers = model.model.layers[:2]
        model.config.num_hidden_layers = 2
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:2]
        draft = tmp_path_factory.mktemp(f"{arch}-draft")
        model.save_pretrained(draft)
        transformers.AutoTokenizer.from_pretrained(target).save_pretrained(draft)
        out[arch, "dequantized"] = target, draft
        out[arch, "gguf"] = tuple(quantized_copy(f, tmp_path_factory.mktemp(f"{arch}-q8"), GGML.Q8_0)
                                  for f in (target, draft))
    return out


@pytest.mark.parametrize("weights", ["dequantized", "gguf"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_speculation_equals_ar(pairs, arch, weights):
    target, draft = pairs[arch, weights]
    with LLM(target, weights=weights) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert min(len(llm.tokenizer(p).input_ids) for p in PROMPTS) > WINDOW
    with LLM(target, weights=weights, draft=draft, mode="sd", speculate_k=3) as sd:
        outs = sd.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == expected
        alone = sd.generate(PROMPTS[0], GREEDY)[0]
        assert alone.token_ids == expected[0]
    accepted = sum(o.metrics.accepted for o in outs)
    assert 0 < accepted < sum(o.metrics.drafted for o in outs), "a shallow draft is right sometimes"
    with LLM(target, weights=weights, draft="ngram", mode="sd", speculate_k=4, ngram_min=1) as lookup:
        assert [o.token_ids for o in lookup.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize("arch", FAMILIES)
def test_ssd_greedy_equals_ar(pairs, arch):
    """SSD's draft worker builds trees on a sliding-window draft: tree rows keep a key at its
    position, so the window is cut the same way for every branch."""
    target, draft = pairs[arch, "gguf"]
    with LLM(target) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(target, draft=draft, mode="ssd", speculate_k=3) as ssd:
        outs = ssd.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert any(o.metrics.hits for o in outs)
