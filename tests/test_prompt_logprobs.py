"""Scoring a prompt (SamplingParams.prompt_logprobs) and prompts given as token ids, on SmolLM2:
each prompt token's logprob under the model's logits given the tokens before it, against
transformers' on the same weights, and the same bits however the prompt was cut into
chunks, beside other requests, after its blocks were cached, and in SD."""
import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
from ssd.errors import PromptError
from ssd.models.loader import transformers_kwargs

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the children played."


def _scored(out) -> list[tuple[int, float, list]]:
    return [(lp.token_id, lp.logprob, lp.top) for lp in out.prompt_logprobs[1:]]


@pytest.fixture(scope="module")
def ids(smollm) -> list[int]:
    return smollm.encode(TEXT)


def test_prompt_logprobs_are_the_models(smollm, smollm_dir, ids):
    out = smollm.generate(ids, SamplingParams.greedy(max_tokens=1, prompt_logprobs=3))[0]
    assert out.prompt_token_ids == ids and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32,
                                                           **transformers_kwargs(smollm_dir)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    scored = _scored(out)
    assert [t for t, _, _ in scored] == ids[1:]
    gaps = [abs(logprob - ref[i - 1, token].item()) for i, (token, logprob, _) in enumerate(scored, 1)]
    print(f"largest |logprob - transformers'|: {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f}")
    # The engine's products of the Q4_1 blocks with 8-bit activations (as llama.cpp's) against
    # transformers' dequantised weights and fp32 activations: 0.31 at most, 0.076 on average here.
    assert max(gaps) < 0.5 and sum(gaps) / len(gaps) < 0.12, gaps
    agree = [[t for t, _ in top] == ref[i - 1].topk(3).indices.tolist() for i, (_, _, top) in enumerate(scored, 1)]
    assert sum(agree) >= 0.8 * len(agree)
    # The last prompt position's logits give the first output token.
    assert out.token_ids == [int(ref[-1].argmax())]


def test_a_scored_token_has_the_bits_decoding_gave_it(smollm, ids):
    """The logprob of a prompt's token is the one the engine gave it when it decoded it."""
    out = smollm.generate(ids, SamplingParams.greedy(max_tokens=3, logprobs=2))[0]
    scored = smollm.generate(ids + out.token_ids, SamplingParams.greedy(max_tokens=1, prompt_logprobs=2))[0]
    assert scored.prompt_logprobs[len(ids):] == out.logprobs


def test_the_same_bits_however_the_prompt_runs(smollm_dir, ids):
    params = SamplingParams.greedy(max_tokens=4, prompt_logprobs=2)
    with LLM(smollm_dir) as llm:
        alone = llm.generate(ids, params)[0]
        again = llm.generate(ids, params)[0]  # its blocks are cached now: none is read
        beside = llm.generate([TEXT + " More.", ids, "Hello"], [SamplingParams.greedy(max_tokens=8), params,
                                                                  SamplingParams.greedy(max_tokens=8)])[1]
    with LLM(smollm_dir, max_num_batched_tokens=7) as llm:  # cut into chunks of at most 7 tokens
        chunked = llm.generate(ids, params)[0]
    assert again.metrics.cached_tokens == 0
    for out in (again, beside, chunked):
        assert _scored(out) == _scored(alone) and out.token_ids == alone.token_ids


def test_token_ids_are_read_as_they_are(smollm, ids):
    by_text = smollm.generate(TEXT, SamplingParams.greedy(max_tokens=12))[0]
    by_ids = smollm.generate(ids, SamplingParams.greedy(max_tokens=12))[0]
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt == smollm.tokenizer.decode(ids)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        smollm.generate([1, 2, 10**9], SamplingParams.greedy(max_tokens=1))
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_scoring_in_sd_equals_ar(smollm_dir, ids):
    params = SamplingParams.greedy(max_tokens=6, prompt_logprobs=1)
    with LLM(smollm_dir) as llm:
        ar = llm.generate(ids, params)[0]
    with LLM(smollm_dir, mode="sd", draft=smollm_dir, speculate_k=3) as llm:
        sd = llm.generate(ids, params)[0]
    assert _scored(sd) == _scored(ar) and sd.token_ids == ar.token_ids
