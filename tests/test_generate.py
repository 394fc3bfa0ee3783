"""What the engine promises a user of LLM.generate / LLM.stream, on SmolLM2-135M-Instruct."""
import copy

import pytest

from ssd import LLM, SamplingParams
from ssd.request.detokenizer import TextStream

GREEDY = SamplingParams.greedy(max_tokens=16)


def test_chat_answers_capital_of_france(smollm_dir):
    """The fp32 values of SmolLM2's file answer "Paris"; its Q4_1 blocks with 8-bit activations
    (the CPU default) answer "L'Étoile, la ..." here, as llama.cpp does on the same file."""
    with LLM(smollm_dir, weights="dequantized") as llm:
        out = llm.generate([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams.greedy(max_tokens=32))[0]
    assert "Paris" in out.text
    assert out["text"] == out.text and out["token_ids"] == out.token_ids


def test_output_fields_and_metrics(smollm):
    out = smollm.generate("Once upon a time", SamplingParams.greedy(max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    m = out.metrics
    assert m.prompt_tokens > 0 and m.output_tokens == 5 and m.ttft_s > 0 and m.tokens_per_second > 0
    assert set(m.as_dict()) >= {"prompt_tokens", "output_tokens", "ttft_s", "tokens_per_second"}


def test_batch_of_different_lengths_equals_each_alone(smollm):
    prompts = ["Hi", "Write a Python function that reverses a string.",
               "List three facts about the moon, one per line, in short sentences please.", "2+2="]
    params = SamplingParams.greedy(max_tokens=12, ignore_eos=True)
    batch = smollm.generate(prompts, params)
    alone = [smollm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]


def test_batch_larger_than_slots_and_tiny_cache_preempts(smollm_dir, smollm):
    """More requests than max_num_seqs, and a KV cache so small that sequences are
    preempted and recomputed: the tokens must not change."""
    prompts = [f"Count from {i} to {i + 5}:" for i in range(5)]
    params = SamplingParams.greedy(max_tokens=20, ignore_eos=True)
    expected = [o.token_ids for o in smollm.generate(prompts, params)]
    with LLM(smollm_dir, max_num_seqs=3, kv_cache_tokens=96, block_size=16,
             max_num_batched_tokens=16) as small:
        assert [o.token_ids for o in small.generate(prompts, params)] == expected


def test_seed_makes_sampling_reproducible(smollm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    a = smollm.generate("Tell me a story", params)[0].token_ids
    b = smollm.generate("Tell me a story", params)[0].token_ids
    # The same seed inside a batch with other requests gives the same tokens too.
    c = smollm.generate(["Tell me a story", "Another prompt"], [params, SamplingParams(max_tokens=4)])[0].token_ids
    d = smollm.generate("Tell me a story", SamplingParams(temperature=1.0, max_tokens=16, seed=99,
                                                          ignore_eos=True))[0].token_ids
    assert a == b == c
    assert a != d


def test_stop_string_ends_generation(smollm):
    free = smollm.generate("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=20, ignore_eos=True))[0]
    stop = free.text.strip().split()[1]  # a piece of text the model will produce
    out = smollm.generate("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=20, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)


def test_stop_token_id_ends_generation(smollm):
    free = smollm.generate("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=10, ignore_eos=True))[0]
    stop_id = free.token_ids[3]
    out = smollm.generate("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=10, stop_token_ids=[stop_id]))[0]
    first = free.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]


def test_eos_ends_generation_with_stop(smollm):
    out = smollm.generate([{"role": "user", "content": "Say just the word yes."}],
                          SamplingParams.greedy(max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm.eos_ids


def test_stream_pieces_add_up_to_generate(smollm):
    prompt = [{"role": "user", "content": "Name two rivers in Europe."}]
    chunks = list(smollm.stream(prompt, SamplingParams.greedy(max_tokens=24)))
    full = smollm.generate(prompt, SamplingParams.greedy(max_tokens=24))[0]
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert all(not any(c.from_draft) for c in chunks)
    assert chunks[-1].finish_reason == full.finish_reason and chunks[-1].metrics.output_tokens == len(full.token_ids)
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_stream_stop_string_is_never_emitted(smollm):
    free = smollm.generate("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=20, ignore_eos=True))[0]
    stop = free.text.strip().split()[2]
    text = "".join(c.text for c in smollm.stream("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=20, stop=stop)))
    assert stop not in text and free.text.startswith(text)


@pytest.mark.parametrize("text", ["naïve café 日本語 🙂👍🏽 done", "∑ x² → ∞ ✓"])
def test_text_stream_handles_multibyte_characters(smollm, text):
    """Characters split over several byte-level tokens come out whole, never as U+FFFD."""
    tok = smollm.tokenizer
    ids = tok(text, add_special_tokens=False).input_ids
    stream, pieces = TextStream(tok, []), []
    for i in ids:
        stream.push([i])
        pieces.append(stream.take())
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("clean_up", [False, True])
def test_text_stream_decodes_as_the_tokenizer_does(smollm, clean_up):
    """The stream's decoder (the fast tokenizer's own where transformers would add nothing) gives
    the text `decode(..., skip_special_tokens=True)` gives, special tokens and spaces included."""
    tok = copy.copy(smollm.tokenizer)
    tok.clean_up_tokenization_spaces = clean_up
    ids = tok("Hello , world . It 's  done :\n\tx = [1 , 2]", add_special_tokens=False).input_ids
    ids = ids[:4] + [tok.eos_token_id] + ids[4:] + [tok.eos_token_id]
    stream = TextStream(tok, [])
    for i in ids:
        stream.push([i])
    assert stream.take(final=True) == tok.decode(ids, skip_special_tokens=True)


def test_one_sampling_params_per_prompt(smollm):
    outs = smollm.generate(["a", "b"], [SamplingParams.greedy(max_tokens=3, ignore_eos=True),
                                        SamplingParams.greedy(max_tokens=5, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 5]


def test_presets():
    assert SamplingParams.greedy().temperature == 0
    assert SamplingParams.creative().temperature > SamplingParams.conservative().temperature > 0
