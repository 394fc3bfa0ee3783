"""draft_guesses: prompt lookup guesses the draft's own next tokens, fed in the same draft pass
Every row's logits are what one pass at a time would give (batch-invariant
kernels), so the draft's tokens are the same in fewer passes, and SD's output stays AR's.
Greedy requests only: sampled ones take none; a constrained or penalised one has each guessed
row processed after the guessed tokens before it, as a verify pass's rows are. A pass takes as
many guessed rows as pay by the draft's measured pass cost and the guesses' measured precision
(_guess_rows); the tests of the mechanics fix that count at GUESS_ROWS (`every_row`)."""
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.models.loader import load_model
from ssd.speculative.draft.draft_engine import GUESS_PROBE, GUESS_ROWS, DraftEngine
from ssd.speculative.policy.costs import Timings
from test_draft_window import fed
from test_ngram import REPEATING
from tiny_pair import NEW, PROMPT, drafter


def _rounds(engine: DraftEngine, prompt: list[int], rounds: int, k: int, steps: list | None = None
            ) -> list[list[int]]:
    """Draft `rounds` rounds of k tokens; the target keeps half of each round's tokens and adds
    a token of the prompt (a rejection that rolls the draft's cache back). steps: gets each
    round's step_s."""
    params = SamplingParams.greedy(max_tokens=256)
    s = engine.sync(0, 0, prompt, params, k)
    drafted = []
    for r in range(rounds):
        (proposal,) = engine.draft([s], [k])
        tokens = proposal.tokens
        if steps is not None:
            steps.append(proposal.step_s)
        drafted.append(tokens)
        keep = s.confirmed + len(tokens) // 2
        s = engine.sync(0, keep, [prompt[r % len(prompt)]], None, k)
    return drafted


@pytest.fixture
def every_row(monkeypatch):
    """Every pass guesses GUESS_ROWS rows, whatever they cost on this machine."""
    monkeypatch.setattr(DraftEngine, "_guess_rows", lambda self, fed, live: GUESS_ROWS if self.guesses else 0)


@pytest.fixture(scope="module")
def smollm_model(smollm_dir):
    return load_model(smollm_dir, torch.device("cpu"), torch.float32, "auto")


def test_guesses_give_the_draft_its_own_tokens_in_fewer_passes(smollm_model, smollm, every_row):
    prompt = smollm.encode(REPEATING)
    passes = {}
    drafted = {}
    for guesses in (False, True):
        engine = DraftEngine(smollm_model, torch.device("cpu"), k_max=8, cache_tokens=512, guesses=guesses)
        sizes = fed(engine)
        steps = []
        drafted[guesses] = _rounds(engine, prompt, 8, 8, steps)
        passes[guesses] = len(sizes)
        assert steps[-1] is not None and steps[-1] > 0
    assert drafted[True] == drafted[False]
    assert passes[True] < passes[False], passes


def test_wrong_guesses_cost_rows_not_tokens(smollm_model, smollm, monkeypatch, every_row):
    """Guesses that are always wrong: every pass picks the draft's own token, and the rejected
    rows' K/V are dropped (the next rounds draft the same tokens as without guesses)."""
    prompt = smollm.encode(REPEATING)
    plain_engine = DraftEngine(smollm_model, torch.device("cpu"), k_max=6, cache_tokens=512)
    plain_sizes = fed(plain_engine)
    plain = _rounds(plain_engine, prompt, 6, 6)
    engine = DraftEngine(smollm_model, torch.device("cpu"), k_max=6, cache_tokens=512, guesses=True)
    monkeypatch.setattr(engine, "_guess", lambda s, most: [7] * most)
    sizes = fed(engine)
    assert _rounds(engine, prompt, 6, 6) == plain
    assert len(sizes) == len(plain_sizes) and sum(sizes) > sum(plain_sizes)  # as many passes, more rows


def test_sd_with_guesses_is_exact(smollm_dir, truncated_draft, ar_outputs, every_row):
    params = SamplingParams.greedy(max_tokens=48, ignore_eos=True)
    prompts = [REPEATING, "List three prime numbers and say why they are prime."]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=6, draft_guesses=True) as llm:
        engine = drafter(llm).engine
        guess, guessed = engine._guess, []

        def counted(s, most):
            g = guess(s, most)
            guessed.append(len(g))
            return g
        engine._guess = counted
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert sum(guessed) > 0


def test_ssd_with_guesses_is_exact(smollm_dir, truncated_draft, ar_outputs):
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3, fan_out=2, draft_guesses=True) as llm:
        outs = llm.generate([REPEATING], params)
    assert [o.token_ids for o in outs] == ar_outputs([REPEATING], params)


def test_constrained_requests_take_guesses_and_stay_exact(smollm_dir, truncated_draft, ar_outputs, every_row):
    """A JSON schema (its keys and punctuation repeat, which guesses find), one with penalties
    too, and a regex: the draft picks under each row's own constraint state, so the guesses
    it takes are its own picks and SD's output is AR's."""
    schema = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "count"],
        "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}}}}
    chat = [{"role": "user", "content": "List four fruits with how many of each are in a basket, as JSON."}]
    params = [SamplingParams.greedy(max_tokens=90, json_schema=schema),
              SamplingParams.greedy(max_tokens=90, json_schema=schema, frequency_penalty=0.5, repetition_penalty=1.2),
              SamplingParams.greedy(max_tokens=40, regex=r"(ab|abc|b)+ (cd )+end")]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=6, draft_guesses=True) as llm:
        engine = drafter(llm).engine
        guess, right = engine._guess, []
        observe = engine.guessed.observe

        def counted(s, most):
            g = guess(s, most)
            assert s.processor is not None
            return g
        engine._guess = counted
        engine.guessed.observe = lambda n, r: right.append(r) or observe(n, r)
        outs = llm.generate([chat] * 3, params)
    for out, p in zip(outs, params):
        assert out.token_ids == ar_outputs([chat], p)[0], out.text
    assert sum(right) > 0, right  # guessed rows the draft picked itself: passes saved


def test_sampled_requests_take_no_guesses(tiny_pair, every_row):
    """A sampled row's pick is a draw: guesses are for greedy requests (measured slower for
    sampled ones). With the option on, a batch of sampled and greedy requests feeds guessed rows
    for the greedy ones only."""
    target, draft = tiny_pair
    sampled = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    greedy = SamplingParams.greedy(max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", speculate_k=4, draft_guesses=True, seed=3) as llm:
        engine = drafter(llm).engine
        guess, given = engine._guess, {True: 0, False: 0}

        def counted(s, most):
            g = guess(s, most)
            given[s.params.greedy_decoding] += len(g)
            return g
        engine._guess = counted
        outs = llm.generate([PROMPT] * 8, [sampled] * 4 + [greedy] * 4)
    assert given[False] == 0 and given[True] > 0, given
    assert all(len(o.token_ids) == NEW for o in outs)


def test_guesses_are_taken_where_they_pay(smollm_model):
    """Rows that cost what a pass costs: no guess (but a probe now and then, to learn); rows
    nearly free: every row; guesses measured mostly wrong: none where a row costs a tenth of a
    pass."""
    engine = DraftEngine(smollm_model, torch.device("cpu"), k_max=8, cache_tokens=512, guesses=True)
    engine.pass_time = Timings({r: 0.01 * r for r in range(1, GUESS_ROWS + 2)})
    taken = [engine._guess_rows(1, 1) for _ in range(2 * GUESS_PROBE)]
    assert taken.count(1) == 2 and set(taken) == {0, 1}  # the probes
    engine.pass_time = Timings({r: 0.01 + 0.0001 * r for r in range(1, GUESS_ROWS + 2)})
    assert engine._guess_rows(1, 1) == GUESS_ROWS
    assert engine._guess_rows(2, 4) == GUESS_ROWS  # a batch's rows, read past the timed sizes
    engine.pass_time = Timings({r: 0.01 + 0.001 * r for r in range(1, GUESS_ROWS + 2)})  # a row: 10 % of a pass
    assert engine._guess_rows(1, 1) == 2  # at the prior's precision (a third row: 1.875 / 1.4 < 1.75 / 1.3)
    for _ in range(200):
        engine.guessed.observe(GUESS_ROWS, 0)  # the first guessed row wrong, every pass
    assert sum(engine._guess_rows(1, 1) for _ in range(GUESS_PROBE)) == 1  # the probe
    assert DraftEngine(smollm_model, torch.device("cpu"), k_max=8, cache_tokens=512)._guess_rows(1, 1) == 0


def test_draft_guesses_option(smollm_dir):
    with pytest.raises(SSDError, match="draft_guesses must be True, False or None"):
        LLM(smollm_dir, draft=smollm_dir, mode="sd", draft_guesses="yes")
