"""What a request changes about the logits (penalties, logit_bias, min_tokens, a JSON schema,
regex or grammar) and logprobs: exact in every mode, against plain decoding and against the
target's distribution computed independently."""
import json

import jsonschema
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import GrammarError, SamplingParamsError
from ssd.exactness import pooled_p_value
from ssd.request.logits_process import LogitsProcessor
from chance import fits
from tiny_pair import CHARS_PROMPT, NEW, V, exact_joint, drafter

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string"}, "languages": {"type": "array", "items": {"type": "string"},
                                                                   "maxItems": 3}}}
CHAT = [{"role": "user", "content": "Describe a person named Bob, 42, from Paris, who speaks two languages, as JSON."}]
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
OPTIONS = {
    "schema": dict(json_schema=PERSON, max_tokens=80),
    "regex": dict(regex=r"(\d{3}-){2}\d{4}", max_tokens=24),
    "lark": dict(grammar=LARK, max_tokens=16),
    "penalties": dict(presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.3,
                      logit_bias={28: 4.0, 30: -100.0}, min_tokens=24, max_tokens=40),
    "schema+penalties": dict(json_schema=PERSON, frequency_penalty=0.4, max_tokens=80),
    "cut": dict(json_schema=PERSON, max_tokens=9),  # ends mid-structure
}


def run_all(llm: LLM) -> dict:
    """Every option's request, all in one batch (a row's logits do not depend on its batch)."""
    outs = llm.generate([CHAT] * len(OPTIONS), [SamplingParams.greedy(logprobs=3, **o) for o in OPTIONS.values()])
    return dict(zip(OPTIONS, outs))


@pytest.fixture(scope="module")
def ar_runs(smollm):
    return {name: smollm.generate(CHAT, SamplingParams.greedy(logprobs=3, **o))[0] for name, o in OPTIONS.items()}


def test_constrained_ar_follows_the_constraint(ar_runs):
    out = ar_runs["schema"]
    jsonschema.validate(json.loads(out.text), PERSON)
    assert out.finish_reason == "stop"
    assert ar_runs["lark"].text in ("The answer is yes.", "The answer is no.", "The answer is maybe.")
    assert ar_runs["cut"].finish_reason == "length" and len(ar_runs["cut"].token_ids) == 9
    import re
    assert re.fullmatch(r"(\d{3}-){2}\d{4}", ar_runs["regex"].text)
    pen = ar_runs["penalties"]
    assert 30 not in pen.token_ids and len(pen.token_ids) >= 24


@pytest.mark.parametrize("mode", ["sd", "ngram", "ssd", "self"])
def test_greedy_modes_equal_ar(mode, smollm_dir, truncated_draft, ar_runs):
    """Same tokens and, since a verify pass's rows have the bits of AR's, the same logprobs."""
    draft = {"sd": truncated_draft, "ngram": "ngram", "ssd": truncated_draft, "self": smollm_dir}[mode]
    same = dict(draft_quantization="gguf") if mode == "self" else {}  # the draft's weights as the target's
    with LLM(smollm_dir, draft=draft, mode="ssd" if mode == "ssd" else "sd", speculate_k=4, **same) as llm:
        for name, out in run_all(llm).items():
            want = ar_runs[name]
            assert out.token_ids == want.token_ids, (mode, name, out.text, want.text)
            assert out.finish_reason == want.finish_reason
            assert out.logprobs == want.logprobs, (mode, name)
            if mode == "self":  # the draft proposes under the same changes: it is never wrong
                assert out.metrics.accepted == out.metrics.drafted > 0, (name, out.metrics)


def test_forced_tokens_cost_the_draft_no_pass(smollm_dir):
    """Where the grammar allows one token, the SD draft emits it without a forward pass."""
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k=8, draft_quantization="gguf") as llm:
        draft = drafter(llm).engine
        passes = []
        forward = draft.runner.forward
        draft.runner.forward = lambda *a, **kw: passes.append(1) or forward(*a, **kw)
        out = llm.generate(CHAT, SamplingParams.greedy(regex="The person is called [A-Z][a-z]+, and that is all\\.",
                                                       max_tokens=30))[0]
    assert out.text.startswith("The person is called ") and out.text.endswith(", and that is all.")
    m = out.metrics
    assert m.accepted == m.drafted and m.drafted > 2 * len(passes), (m.drafted, len(passes))


def test_a_grammar_spelling_a_special_token_ends_its_request(smollm):
    """llguidance's mask allows <|im_start|> where the grammar's text spells it, then refuses
    to consume it: the token is dropped from the mask and the request ends, alone."""
    outs = smollm.generate(["Hi", "Hello"], [SamplingParams.greedy(regex=r"<\|im_start\|>x", max_tokens=8),
                                             SamplingParams.greedy(max_tokens=8, ignore_eos=True)])
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] in smollm.eos_ids
    assert len(outs[1].token_ids) == 8


@pytest.mark.parametrize("name", ["schema", "regex", "lark", "penalties", "min_tokens"])
def test_argmax_is_the_processed_rows_argmax(smollm, name):
    """LogitsProcessor.argmax (greedy drafting and verification) equals the argmax of process()'s
    rows, drafts the constraint allows and forbids included: the rows whose own argmax a ban
    leaves standing are not processed, the others are, and a request that changes logits
    otherwise (penalties, bias) is processed whole."""
    options = dict(OPTIONS, min_tokens=dict(min_tokens=6, max_tokens=20))[name]
    params = SamplingParams.greedy(**options)
    prompt = smollm.encode(CHAT)
    ar = smollm.generate(CHAT, params)[0].token_ids  # a path the request allows
    gen = torch.Generator().manual_seed(0)
    for cut in range(0, len(ar) - 3, 3):
        proc = smollm.engine.processor(params, len(prompt))
        tokens = prompt + ar[:cut]
        for drafts in (ar[cut:cut + 3], [ar[cut], 0, ar[cut + 2]]):  # (token 0 is forbidden by most states)
            logits = torch.randn(4, 49152, generator=gen) * 3
            logits[torch.arange(3), torch.tensor(drafts)] += 20 * (cut % 2)  # half the time the drafts lead
            want = proc.process(logits, tokens, drafts).argmax(-1).tolist()
            assert proc.argmax(logits, tokens, drafts) == want
            assert proc.argmax(logits, tokens, drafts, raw=logits.argmax(-1).tolist()) == want
    assert proc.bans_only == (name != "penalties")


def test_rows_see_the_draft_tokens_before_them():
    """process() over K+1 rows gives, row by row, what one row after tokens + drafts[:i] gives."""
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.5,
                            logit_bias={3: 2.0}, min_tokens=4)
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    tokens, drafts = [1, 2, 5, 2], [5, 5, 9]
    proc = LogitsProcessor(params, num_prompt_tokens=2, end_ids={0}, constraint=None)
    together = proc.process(logits, tokens, drafts)
    for i in range(4):
        assert torch.equal(together[i], proc.process(logits[i:i + 1], tokens + drafts[:i])[0])
    # by hand, row 3: output so far 5 2 5 5 9; prompt tokens 1 2 are only "seen"
    row = logits[3].clone()
    seen = {1, 2, 5, 9}
    for t in seen:
        row[t] = row[t] / 1.5 if row[t] > 0 else row[t] * 1.5
    counts = {5: 3, 2: 1, 9: 1}
    for t, c in counts.items():
        row[t] -= 0.3 * c + 0.7
    row[3] += 2.0
    assert torch.allclose(together[3], row)
    # min_tokens 4: rows 0 and 1 would draw the 3rd and 4th output tokens (no end token 0 yet)
    assert together[:2, 0].eq(float("-inf")).all() and together[2:, 0].isfinite().all()


# ---- sampled: the target's distribution with the request's changes ----------------------
REGEX = "[c-f]c[c-f]d[c-f]{2}"  # letters c..f (ids 2..5), positions 2 and 4 forced
CHANGES = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4, logit_bias={4: 1.5, 2: -0.7})


def _reference(prompt_len: int):
    """The request's changes, written independently of the engine, for tiny_pair.exact_joint."""
    def adjust(logits, ids):
        logits = logits.clone()
        n, new, _ = logits.shape
        for j in range(new):
            history, output = ids[:, :prompt_len + j], ids[:, prompt_len:prompt_len + j]
            seen = torch.zeros(n, V, dtype=torch.bool).scatter_(1, history, True)
            counts = torch.zeros(n, V, dtype=logits.dtype).scatter_add_(1, output, torch.ones_like(output, dtype=logits.dtype))
            x = logits[:, j]
            r = CHANGES["repetition_penalty"]
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            x = x - CHANGES["frequency_penalty"] * counts - CHANGES["presence_penalty"] * (counts > 0)
            for t, b in CHANGES["logit_bias"].items():
                x[:, t] += b
            allowed = {1: [2], 3: [3]}.get(j, [2, 3, 4, 5])  # REGEX: c is 2, d is 3
            mask = torch.full((V,), float("-inf"), dtype=x.dtype)
            mask[allowed] = 0
            logits[:, j] = x + mask
        return logits
    return adjust


@pytest.mark.parametrize("mode", ["ar", "sd", "ngram", pytest.param("ssd", marks=pytest.mark.long)])
def test_sampling_follows_the_changed_distribution(tiny_chars_pair, mode):
    target, draft = tiny_chars_pair
    n, temperature = 2000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, regex=REGEX, **CHANGES)
    # Fixed K everywhere: auto-K's choices follow the host's timings, so the draws would change
    # from run to run and a bound of 1e-3 at each position would fail by chance now and then.
    options = {"ar": {}, "sd": dict(draft=draft, mode="sd", speculate_k=3),
               "ngram": dict(draft="ngram", mode="sd", speculate_k=3),
               "ssd": dict(draft=draft, mode="ssd", speculate_k=2, fit_tree=False)}[mode]
    with LLM(target, max_num_seqs=500, seed=3, **options) as llm:
        outs = llm.generate([CHARS_PROMPT] * n, params)
        prompt_ids = llm.encode(CHARS_PROMPT)
    assert all(len(o.token_ids) == NEW and o.finish_reason == "stop" for o in outs)
    tokens = torch.tensor([o.token_ids for o in outs])
    if mode in ("sd", "ssd"):
        m = [o.metrics for o in outs]
        assert 0.05 < sum(x.accepted for x in m) / sum(x.drafted for x in m) < 1
    joint = exact_joint(target, prompt_ids, temperature, _reference(len(prompt_ids)))
    for i in range(NEW):
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert fits(pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal)), i
    last_two = joint.sum(dim=list(range(NEW - 2))).flatten()
    counts = (tokens[:, -2] * V + tokens[:, -1]).bincount(minlength=V * V).double()
    assert fits(pooled_p_value(counts, last_two))


# ---- bad input -----------------------------------------------------------------------
@pytest.mark.parametrize("kw, says", [
    (dict(json_schema={"type": "objekt"}), "json_schema: Invalid type"),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "json_schema: Unsatisfiable"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema must be a dict"),
    (dict(regex="(("), "regex"),
    (dict(grammar='start: "a" b'), "grammar: "),
    (dict(grammar="root ::= (("), "grammar"),
    (dict(regex="a", json_schema={}), "at most one of json_schema, regex and grammar"),
    (dict(logit_bias={5: 1e9}), "logit_bias values must be in [-100, 100]"),
    (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={10**7: 1.0}), "outside the vocabulary"),
    (dict(logprobs=21), "logprobs must be an integer in 0..20"),
    (dict(min_tokens=300, max_tokens=10), "min_tokens must be an integer in 0..10"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(presence_penalty=3), "presence_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
])
def test_bad_request_changes_are_refused_before_decoding(smollm, kw, says):
    with pytest.raises(SamplingParamsError) as e:
        smollm.new_request("Hello", SamplingParams(**kw))
    assert says in str(e.value), str(e.value)
    if "json_schema:" in says or says in ("regex", "grammar: ", "grammar"):
        assert isinstance(e.value, GrammarError)
    assert not smollm.unfinished()
