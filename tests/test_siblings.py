"""Sibling leaves (ssd/speculative/policy/siblings.py): the draft's runner-up beside
its top choice in the verify pass. The tree's rows, the rescue rule, the choice by cost, and
SD with siblings == AR."""
import dataclasses

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.models.loader import load_model
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.speculative.policy.adaptive_k import AutoK
from ssd.speculative.policy.siblings import MAX_PER_SEQUENCE, SiblingPolicy, choose
from ssd.speculative.records import Alternative, Proposal, Round, Sibling
from ssd.speculative.verifier import rescue
import ssd.speculative.verifier as verifier
from tiny_pair import NEW, PROMPT, exact_joint, marginal_p_values

PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France? Explain.",
           "List three prime numbers and say why they are prime.", "def fibonacci(n):"]


class Flat:
    """A target pass that costs the same over any number of rows (what a bandwidth-bound
    verify pass nearly does), so that every likely sibling is worth its row."""

    def __call__(self, rows: int) -> float:
        return 0.05

    def observe(self, size: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def runner(smollm_dir):
    model = load_model(smollm_dir, torch.device("cpu"), torch.float32, "auto")
    cache = PagedKVCache(model.config, 256, 16, torch.device("cpu"), torch.float32)
    return ModelRunner(model, cache, torch.device("cpu"))


def test_a_fork_row_is_the_pass_where_it_replaces_its_chain_token(runner):
    """A tree pass [last, d0, d1, d2] + forks beside d1 and d2: each fork's logits and K/V are
    bit for bit those of a causal pass that has it in the chain token's place, and the chain's
    rows are those of the chain alone."""
    cache, context = runner.cache, list(range(300, 340))
    chain, forks = [500, 501, 502, 503], [(2, 700), (3, 701)]
    cache.reserve(0, len(context) + len(chain) + len(forks))
    runner.forward([Chunk(0, context[:-1], 0, 1)])
    start = len(context) - 1
    tree = runner.forward([Chunk(0, chain + [t for _, t in forks], start, len(chain) + len(forks),
                                 [j for j, _ in forks])])
    kv_tree = cache.kv[:, :, cache.slots(0, start, start + len(chain) + len(forks))].clone()
    cache.truncate(0, start)
    alone = runner.forward([Chunk(0, chain, start, len(chain))])
    assert torch.equal(tree[:len(chain)], alone)
    assert torch.equal(kv_tree[:, :, :len(chain)], cache.kv[:, :, cache.slots(0, start, start + len(chain))])
    for i, (j, token) in enumerate(forks):
        cache.truncate(0, start)
        replaced = chain[:j] + [token]
        causal = runner.forward([Chunk(0, replaced, start, len(replaced))])
        assert torch.equal(tree[len(chain) + i], causal[-1])
        assert torch.equal(kv_tree[:, :, len(chain) + i], cache.kv[:, :, cache.slots(0, start + j, start + j + 1)][:, :, 0])
    cache.release(0)


def test_copy_position_moves_every_layers_kv(runner):
    cache = runner.cache
    cache.reserve(1, 40)
    runner.forward([Chunk(1, list(range(100, 140)), 0, 1)])
    cache.copy_position(1, 35, 20)
    slots = cache.slots(1, 0, 40)
    assert torch.equal(cache.kv[:, :, slots[20]], cache.kv[:, :, slots[35]])
    cache.release(1)


def test_rescue_takes_a_sibling_only_at_the_first_rejected_depth_and_only_if_right():
    logits = torch.zeros(4 + 2, 10)  # K = 3 chain rows + the bonus row, then 2 siblings
    logits[4, 7] = logits[5, 8] = 1.0  # the siblings' own rows' argmax
    logits = logits.argmax(-1).tolist()  # what the round reads of them
    drafts, siblings = [1, 2, 3], [Sibling(1, 5), Sibling(2, 6)]
    assert rescue(logits, drafts, siblings, accepted=1, token=5) == (0, 7)
    assert rescue(logits, drafts, siblings, accepted=2, token=6) == (1, 8)
    assert rescue(logits, drafts, siblings, accepted=1, token=4) is None  # the target wanted another token
    assert rescue(logits, drafts, siblings, accepted=0, token=5) is None  # no sibling at depth 0
    assert rescue(logits, drafts, siblings, accepted=3, token=5) is None  # the chain was all accepted


def test_the_policy_takes_likely_siblings_while_a_row_is_worth_it_and_learns_their_rate():
    policy = SiblingPolicy()
    alts = [Alternative(10 + j, p1, p2) for j, (p1, p2) in enumerate([(0.9, 0.05), (0.5, 0.4), (0.6, 0.3),
                                                                     (0.95, 0.01), (0.4, 0.35), (0.5, 0.3)])]
    flat = choose([alts, []], rate=20.0, verify=Flat(), rows=8, calibration=policy.calibration)
    # Every sibling with a promise is free on a flat pass: the likeliest MAX_PER_SEQUENCE.
    promise = [0.05, 0.9 * 0.4, 0.45 * 0.3, 0.27 * 0.01, 0.2565 * 0.35, 0.1026 * 0.3]
    best = sorted(range(6), key=lambda j: -promise[j])[:MAX_PER_SEQUENCE]
    assert [s.depth for s in flat[0]] == best and flat[1] == []
    assert [s.token for s in flat[0]] == [10 + j for j in best]
    # A row that costs 10 ms at 20 tokens/s is worth 0.2 tokens: only the 0.36 promise pays.
    steep = choose([alts], rate=20.0, verify=lambda r: 0.05 + 0.01 * r, rows=8, calibration=1.0)
    assert [s.depth for s in steep[0]] == [1]
    assert choose([alts], rate=20.0, verify=lambda r: 0.05 + 0.1 * r, rows=8, calibration=1.0) == [[]]
    # Rescues seen below the promise lower the calibration (and so the next choice's reach).
    before = policy.calibration
    policy.learn([Round(None, 6, Proposal([0] * 6), siblings=flat[0], rescued=False)])
    assert policy.calibration < before and policy.expected == pytest.approx(sum(promise[j] for j in best))
    policy.learn([Round(None, 6, Proposal([0] * 6), rescued=True)])  # nothing promised for it: nothing learnt
    assert policy.rescued == 0


def test_sd_with_siblings_is_exact_and_rescues_rounds(smollm_dir, ar_outputs):
    """The model as its own q4_0 draft: where the two disagree, the target's token is often the
    draft's runner-up, so rounds are rescued (with a flat pass, the draft drafts and every
    likely sibling is worth its row)."""
    params = SamplingParams.greedy(max_tokens=48, ignore_eos=True)
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", draft_siblings=True, draft_quantization="q4_0") as llm:
        llm.engine.k_policy.verify = Flat()
        llm.engine.k_policy.lookup = None
        outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ar_outputs(PROMPTS, params)
    rows, rescues = sum(o.metrics.sibling_rows for o in outs), sum(o.metrics.rescues for o in outs)
    assert rows > 0 and rescues > 0, (rows, rescues)
    for o in outs:  # a rescued round's sibling is a draft token, the token after it the target's
        assert sum(o.from_draft) == o.metrics.accepted + o.metrics.rescues


def test_siblings_option(smollm_dir):
    with pytest.raises(SSDError, match="draft_siblings applies to mode 'sd' with speculate_k='auto'"):
        LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k=3, draft_siblings=True)
    with pytest.raises(SSDError, match="draft_siblings applies"):
        LLM(smollm_dir, draft=smollm_dir, mode="ssd", draft_siblings=True)


def test_siblings_give_way_where_the_cache_has_no_room_for_them(smollm_dir, ar_outputs):
    """A KV cache that holds the chain's rows but not the siblings' near the end of the answer:
    those rounds verify the chain alone (no failed reservation), and the output is AR's."""
    prompt, params = ["def fibonacci(n):"], SamplingParams.greedy(max_tokens=54, ignore_eos=True)
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", draft_siblings=True, draft_quantization="q4_0",
             kv_cache_tokens=80, block_size=16, max_model_len=80) as llm:
        llm.engine.k_policy.verify = Flat()
        llm.engine.k_policy.lookup = None
        outs = llm.generate(prompt, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompt, params)


class _FlatSiblings(AutoK):
    """Auto-K with siblings on the tiny pair, at costs fixed whatever the machine's load: a free
    draft and a flat pass, so that rounds draft and every likely sibling is worth its row."""

    def __init__(self):
        super().__init__(4, lambda rows: 1.0, 0.0, siblings=True)
        self.verify = Flat()

    def learn(self, rounds):
        super().learn([dataclasses.replace(r, draft_s=0.0, verify_s=1.0, step_s=None, catchup=None)
                       for r in rounds])


def _sampled_with_siblings(tiny_pair, n: int) -> tuple[torch.Tensor, list, list[int]]:
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", draft_siblings=True, k_max=4, max_num_seqs=500, seed=7) as llm:
        llm.engine.k_policy = _FlatSiblings()
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    return torch.tensor([o.token_ids for o in outs]), outs, prompt_ids


def test_sampled_sd_with_siblings_follows_the_target(tiny_pair):
    """The multi-candidate rule: every position's token follows the target's exact marginal,
    with many rounds rescued by a sibling."""
    tokens, outs, prompt_ids = _sampled_with_siblings(tiny_pair, 4000)
    assert sum(o.metrics.rescues for o in outs) > 200, sum(o.metrics.rescues for o in outs)
    joint = exact_joint(tiny_pair[0], prompt_ids, 1.0)
    assert min(marginal_p_values(tokens, joint)) > 1e-3


def test_a_sibling_taken_whenever_the_chain_is_rejected_is_caught(tiny_pair, monkeypatch):
    """The foil: a rule that takes the sibling at every rejected depth (its probability under
    the residual ignored) skews the tokens, and the same test sees it."""
    rule = verifier.verify_with_siblings

    def always(p, draft, q, siblings, generator):
        verdict, _ = rule(p, draft, q, {}, generator)
        s = siblings.get(verdict.accepted)
        return (verifier.Verdict(verdict.accepted, s), True) if s is not None else (verdict, False)
    monkeypatch.setattr("ssd.speculative.round.verify_with_siblings", always)
    tokens, _, prompt_ids = _sampled_with_siblings(tiny_pair, 4000)
    joint = exact_joint(tiny_pair[0], prompt_ids, 1.0)
    assert min(marginal_p_values(tokens, joint)) < 1e-6
