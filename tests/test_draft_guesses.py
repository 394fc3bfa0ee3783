"""draft_guesses: prompt lookup guesses the draft's own next tokens, fed in the same draft pass
(issue 33, lever 3). Every row's logits are what one pass at a time would give (batch-invariant
kernels), so the draft's tokens are the same in fewer passes; SD's output stays AR's, and
sampled output follows the target."""
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.models.loader import load_model
from ssd.speculative.draft_engine import DraftEngine
from test_draft_window import fed
from test_ngram import REPEATING
from test_siblings import _marginal_p_values
from tiny_pair import NEW, PROMPT, exact_joint

# Flatter than the tiny pair at temperature 1 (where most tokens are near-certain): the draws
# differ from the guesses more often.
TEMPERATURE = 2.0


def _rounds(engine: DraftEngine, prompt: list[int], rounds: int, k: int) -> list[list[int]]:
    """Draft `rounds` rounds of k tokens; the target keeps half of each round's tokens and adds
    a token of the prompt (a rejection that rolls the draft's cache back)."""
    params = SamplingParams.greedy(max_tokens=256)
    s = engine.sync(0, 0, prompt, params, k)
    drafted = []
    for r in range(rounds):
        tokens = engine.draft([s], [k])[0][0]
        drafted.append(tokens)
        keep = s.confirmed + len(tokens) // 2
        s = engine.sync(0, keep, [prompt[r % len(prompt)]], None, k)
    return drafted


@pytest.fixture(scope="module")
def smollm_model(smollm_dir):
    return load_model(smollm_dir, torch.device("cpu"), torch.float32, "auto")


def test_guesses_give_the_draft_its_own_tokens_in_fewer_passes(smollm_model, smollm):
    prompt = smollm.encode(REPEATING)
    passes = {}
    drafted = {}
    for guesses in (False, True):
        engine = DraftEngine(smollm_model, torch.device("cpu"), k_max=8, cache_tokens=512, guesses=guesses)
        sizes = fed(engine)
        drafted[guesses] = _rounds(engine, prompt, 8, 8)
        passes[guesses] = len(sizes)
        assert engine.step_s is not None and engine.step_s > 0
    assert drafted[True] == drafted[False]
    assert passes[True] < passes[False], passes


def test_wrong_guesses_cost_rows_not_tokens(smollm_model, smollm, monkeypatch):
    """Guesses that are always wrong: every pass picks the draft's own token, and the rejected
    rows' K/V are dropped (the next rounds draft the same tokens as without guesses)."""
    prompt = smollm.encode(REPEATING)
    plain = _rounds(DraftEngine(smollm_model, torch.device("cpu"), k_max=6, cache_tokens=512), prompt, 6, 6)
    engine = DraftEngine(smollm_model, torch.device("cpu"), k_max=6, cache_tokens=512, guesses=True)
    monkeypatch.setattr(engine, "_guess", lambda s, most: [7] * most)
    sizes = fed(engine)
    assert _rounds(engine, prompt, 6, 6) == plain
    assert max(sizes) > 2  # guessed rows were fed


def test_sd_with_guesses_is_exact(smollm_dir, truncated_draft, ar_outputs):
    params = SamplingParams.greedy(max_tokens=48, ignore_eos=True)
    prompts = [REPEATING, "List three prime numbers and say why they are prime."]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=6, draft_guesses=True) as llm:
        sizes = fed(llm.engine.speculator.engine)
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert max(sizes[1:]) > 2  # passes with guesses beside the prompts' first


def test_ssd_with_guesses_is_exact(smollm_dir, truncated_draft, ar_outputs):
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3, fan_out=2, draft_guesses=True) as llm:
        outs = llm.generate([REPEATING], params)
    assert [o.token_ids for o in outs] == ar_outputs([REPEATING], params)


def _sampled(tiny_pair, n: int, constant: int | None = None) -> tuple[torch.Tensor, list[int], int]:
    """n sampled answers of SD with guesses on the tiny pair (8 tokens: the n-gram guesses find
    something in most passes; constant: every guess is that token instead, mostly wrong), and
    how many guessed rows the draft was fed."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", speculate_k=4, draft_guesses=True, max_num_seqs=500, seed=3) as llm:
        engine = llm.engine.speculator.engine
        guess, rows = engine._guess, []

        def counted(s, most):
            g = guess(s, most) if constant is None else [constant] * most
            rows.append(len(g))
            return g
        engine._guess = counted
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    return torch.tensor([o.token_ids for o in outs]), prompt_ids, sum(rows)


@pytest.mark.parametrize("constant", [None, 3], ids=["n-gram guesses", "wrong guesses"])
def test_sampled_sd_with_guesses_follows_the_target(tiny_pair, constant):
    """A guessed row's token is drawn from its own q, and kept only where the draws before it
    were the guess: the drafts are distributed as one pass at a time, and every position's token
    follows the target's exact marginal, whether the guesses are good or mostly wrong."""
    tokens, prompt_ids, guessed = _sampled(tiny_pair, 3000, constant)
    assert guessed > 3000, guessed
    joint = exact_joint(tiny_pair[0], prompt_ids, TEMPERATURE)
    assert min(_marginal_p_values(tokens, joint)) > 1e-3


def test_guesses_taken_without_the_draft_drawing_them_are_caught(tiny_pair, monkeypatch):
    """The foil: a draft that keeps every guessed token whatever its row drew, with that row's
    q reported as if the token were drawn from it, skews the tokens, and the same test sees it."""
    monkeypatch.setattr("ssd.speculative.draft_engine.agreed", lambda picked, guess: len(guess))
    tokens, prompt_ids, _ = _sampled(tiny_pair, 3000)
    joint = exact_joint(tiny_pair[0], prompt_ids, TEMPERATURE)
    assert min(_marginal_p_values(tokens, joint)) < 1e-6


def test_draft_guesses_option(smollm_dir):
    with pytest.raises(SSDError, match="draft_guesses must be True, False or None"):
        LLM(smollm_dir, draft=smollm_dir, mode="sd", draft_guesses="yes")
