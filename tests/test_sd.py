"""Synchronous speculative decoding: exactly AR's output, with real draft models."""
import pytest

from ssd import LLM, SamplingParams
from ssd.errors import SSDError, VocabularyMismatchError
from ssd.speculative.sources.cross_vocab import CrossVocab

from tiny_pair import drafter

PROMPTS = ["def fibonacci(n):", "The capital of France is",
           "Write a haiku about the sea.", "1, 2, 3, 4,"]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_sd_equals_ar(smollm_dir, truncated_draft, ar_outputs, k):
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=k) as sd:
        batch = sd.generate(PROMPTS, params)
        alone = [sd.generate(p, params)[0] for p in PROMPTS[:2]]
    expected = ar_outputs(PROMPTS, params)
    assert [o.token_ids for o in batch] == expected
    assert [o.token_ids for o in alone] == expected[:2]
    m = batch[0].metrics
    assert 0 < m.acceptance_rate < 1, "a truncated draft should be right sometimes, not always"
    assert m.drafted <= m.rounds * k and sum(batch[0].from_draft) == m.accepted
    assert sum(m.accepted_hist) == m.rounds and len(m.accepted_hist) <= k + 1


def test_model_as_its_own_draft_accepts_every_token(smollm_dir, ar_outputs):
    params = SamplingParams.greedy(max_tokens=30, ignore_eos=True)
    # The draft on the target's own blocks: the same numerics, so every proposal is the target's.
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k=4, draft_quantization="gguf") as sd:
        outs = sd.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:2], params)
    for o in outs:
        assert o.metrics.acceptance_rate == 1.0
        assert o.metrics.mean_accepted_length > 4


def test_sd_respects_stop_strings_eos_and_context(smollm_dir, truncated_draft):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(smollm_dir, max_model_len=64) as ar, \
            LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=5, max_model_len=64) as sd:
        to_the_end = 64 - len(ar.encode("Count: 1, 2, 3,"))  # the most max_tokens the context allows
        cases = [(chat, SamplingParams.greedy(max_tokens=20)),  # ends on eos
                 ("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=40, stop=[" 9"])),
                 ("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=to_the_end, ignore_eos=True)),  # context end
                 ("Count: 1, 2, 3,", SamplingParams.greedy(max_tokens=7, ignore_eos=True))]
        for prompt, params in cases:
            got, want = sd.generate(prompt, params)[0], ar.generate(prompt, params)[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_sd_stream_marks_tokens_from_draft(smollm_dir, truncated_draft):
    params = SamplingParams.greedy(max_tokens=30, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=4) as sd:
        chunks = list(sd.stream("def fibonacci(n):", params))
        full = sd.generate("def fibonacci(n):", params)[0]
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    flags = [f for c in chunks for f in c.from_draft]
    assert flags == full.from_draft and any(flags) and not all(flags)
    assert all(c.from_draft[-1] is False for c in chunks[:-1])  # each round ends on the target's token
    assert chunks[-1].metrics.rounds > 0
    assert full.sources == ["draft" if f else None for f in full.from_draft] == [s for c in chunks for s in c.sources]


@pytest.mark.parametrize("draft", ["model", "ngram", "suffix"])
def test_stream_pieces_spell_the_text_by_source(smollm_dir, truncated_draft, draft):
    """A chunk's pieces are its text cut by the tokens that wrote it, each with their source, a
    stop string and characters of several bytes included; its step says what the round was;
    a request with speculate=False gets the same text from plain steps."""
    prompt, stop = ("def fibonacci(n):", "# Output") if draft == "model" else \
        ("Repeat this line three times: héllo wörld ✓ 1 2 3 4 5 héllo wörld ✓ 1 2 3 4 5", "5 h")
    kind = {"model": "draft", "ngram": "lookup", "suffix": "suffix"}[draft]
    with LLM(smollm_dir, draft=truncated_draft if draft == "model" else draft, mode="sd", speculate_k=4) as sd:
        chunks = list(sd.stream(prompt, SamplingParams.greedy(max_tokens=48, stop=[stop])))
        plain = list(sd.stream(prompt, SamplingParams.greedy(max_tokens=48, stop=[stop], speculate=False)))
    text = "".join(c.text for c in chunks)
    assert text == "".join(c.text for c in plain)
    for c in chunks:
        assert "".join(t for t, _ in c.pieces) == c.text
        assert {s for _, s in c.pieces} <= {None, kind} and set(c.sources) <= {None, kind}
        assert c.step.tokens == len(c.token_ids) and c.step.accepted == sum(c.from_draft)
        assert c.step.source in (None, kind) and c.step.drafted <= c.step.k
    assert any(s == kind for c in chunks for _, s in c.pieces)
    assert [c.step.at_s for c in chunks] == sorted(c.step.at_s for c in chunks)
    assert sum(c.step.accepted for c in chunks) == chunks[-1].metrics.accepted
    assert all(c.step.k == 0 and not any(c.from_draft) for c in plain) and plain[-1].metrics.drafted == 0


def test_sampled_sd_is_reproducible_with_a_seed(smollm_dir, truncated_draft):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=3) as sd:
        a = sd.generate("Once upon a time", params)[0]
        b = sd.generate(["Once upon a time", "Hello"], [params, SamplingParams(max_tokens=5)])[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24


def test_a_draft_with_another_vocabulary_drafts_through_text_in_sd_only(smollm_dir, other_vocab, ar_outputs):
    """Another token table: SD drafts through text (sources/cross_vocab.py), exactly; SSD's
    worker cannot yet, and says so."""
    other = other_vocab
    params = SamplingParams.greedy(max_tokens=32, ignore_eos=True)
    prompts = ["def fibonacci(n):", "The capital of France is"]
    with LLM(smollm_dir, draft=other, mode="sd", speculate_k=3) as llm:
        assert isinstance(drafter(llm), CrossVocab)
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert sum(o.metrics.accepted for o in outs) > 10  # the same model: most of its text is taken
    with pytest.raises(VocabularyMismatchError, match="token tables differ.*mode 'sd' only"):
        LLM(smollm_dir, draft=other, mode="ssd")


def test_a_draft_with_another_vocabulary_proposes_k_tokens_a_round(smollm_dir, other_vocab, ar_outputs):
    """The crossing drops the last target token of the draft's text (it may merge with the
    next), so the draft drafts one more of its own: a K of 1 proposes a token (it proposed
    nothing, and auto-K, which chose it, never learnt why). Auto-K leaves the draft's stopping
    rule out: its confidences are in the draft's tokens."""
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    prompt = "def fibonacci(n):"
    with LLM(smollm_dir, draft=other_vocab, mode="sd", speculate_k=1) as llm:
        out = llm.generate(prompt, params)[0]
        assert out.metrics.accepted >= out.metrics.rounds // 2  # the same model: its token is mostly taken
        assert drafter(llm).ratio == pytest.approx(1.0)  # the same text cuts into as many tokens
    assert out.token_ids == ar_outputs([prompt], params)[0]
    with LLM(smollm_dir, draft=other_vocab, mode="sd", speculate_k="auto") as llm:
        assert llm.engine.k_policy.stop is None
        assert llm.generate(prompt, params)[0].token_ids == out.token_ids


def test_mode_and_draft_must_agree(smollm_dir):
    with pytest.raises(SSDError, match="needs a draft"):
        LLM(smollm_dir, mode="sd")
    with pytest.raises(SSDError, match="mode"):
        LLM(smollm_dir, draft=smollm_dir)
    with pytest.raises(SSDError, match="speculate_k"):
        LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k=0)


def test_plain_rounds_ride_in_the_pass_of_prompt_chunks(smollm_dir, truncated_draft, ar_outputs):
    """A round that drafts nothing is plain decoding: while another request's prompt fills in
    chunks, its rows join that pass, as AR's do, so every step is one pass of the target (a
    pass of their own read the weights once more); the output stays AR's and each such step
    counts as a round."""
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    prompts = ["1, 2, 3,", "Write a long story about a lighthouse keeper who finds a map in a bottle. " * 3]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=2, max_num_batched_tokens=16) as sd:
        sd.engine.set_speculate_k(0)
        runner, passes, steps = sd.engine.runner, [], []
        forward, step = runner.forward, sd.engine.step
        runner.forward = lambda *a, **kw: passes.append(1) or forward(*a, **kw)
        sd.engine.step = lambda: steps.append(len(passes)) or step()
        outs = sd.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert len(passes) == len(steps), "a step of prompt chunks and plain rounds ran more than one pass"
    m = outs[0].metrics
    assert m.rounds == len(outs[0].token_ids) - 1 and m.drafted == 0 and m.k_hist == [m.rounds]
