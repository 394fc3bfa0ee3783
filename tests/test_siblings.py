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
from ssd.speculative.plan import Plan, SeqPlan
from ssd.speculative.policy.adaptive_k import AutoK, KPolicy
from ssd.speculative.policy.costs import Timings
from ssd.speculative.policy.siblings import MAX_PER_SEQUENCE, SiblingOffer, SiblingPolicy, choose, sibling_candidates
from ssd.speculative.records import Alternative, Branch, Proposal, Round, RoundTimes
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.named import NAMED
from ssd.speculative.verifier import greedy_tree
import ssd.speculative.verifier as verifier
from chance import fits
from tiny_pair import NEW, PROMPT, exact_joint, marginal_p_values

PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France? Explain.",
           "List three prime numbers and say why they are prime.", "def fibonacci(n):"]


class Flat(Timings):
    """A target pass that costs the same over any number of rows (what a bandwidth-bound
    verify pass nearly does), so that every likely sibling is worth its row."""

    def __init__(self):
        super().__init__({1: 0.05})

    def __call__(self, rows: int, seqs: int = 1) -> float:
        return 0.05

    def observe(self, size: int, seconds: float, seqs: int = 1) -> None:
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
    chain, forks = [500, 501, 502, 503], [(2, 700), (3, 701)]  # (the chain token each replaces, token)
    cache.reserve(0, len(context) + len(chain) + len(forks))
    runner.forward([Chunk(0, context[:-1], 0, 1)])
    start = len(context) - 1
    tree = runner.forward([Chunk(0, chain + [t for _, t in forks], start, len(chain) + len(forks),
                                 [j - 1 for j, _ in forks])])
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


def test_greedy_verification_walks_into_a_branch_only_where_the_chain_is_rejected_and_it_is_right():
    """The tree [newest, d1, d2, d3] with siblings 5 (beside d2: parent d1) and 6 (beside d3),
    and 9 under the sibling 5; `best` is the argmax of each of its rows, in that order."""
    drafts, branches = [1, 2, 3], [Branch(1, 5), Branch(2, 6), Branch(4, 9)]
    assert greedy_tree([1, 5, 0, 0, 7, 8, 0], drafts, branches) == (1, [0], 7)  # the sibling, then its row's
    assert greedy_tree([1, 2, 6, 0, 7, 8, 0], drafts, branches) == (2, [1], 8)
    assert greedy_tree([1, 5, 0, 0, 9, 8, 11], drafts, branches) == (1, [0, 2], 11)  # two deep
    assert greedy_tree([1, 4, 0, 0, 7, 8, 0], drafts, branches) == (1, [], 4)  # the target wanted another token
    assert greedy_tree([5, 0, 0, 0, 7, 8, 0], drafts, branches) == (0, [], 5)  # no branch under the newest token
    assert greedy_tree([1, 2, 3, 5, 7, 8, 0], drafts, branches) == (3, [], 5)  # the chain was all accepted
    assert greedy_tree([1, 2, 3, 5], drafts, []) == (3, [], 5)


def test_a_branch_is_chosen_after_its_parent_and_indexed_in_the_chosen_tree():
    """Candidates of a chain of 3: a (under the newest token), b under a, c under b, d under the
    chain's first draft, e under c (deeper than the chain: never); where a is not worth its row,
    b and c are not taken either."""
    cands = [Branch(0, 10, 0.5), Branch(4, 11, 0.4), Branch(5, 12, 0.3), Branch(1, 13, 0.35), Branch(6, 14, 0.3)]
    tree = choose([cands], [3], rate=1.0, verify=lambda r: 0.1 * r, rows=4, calibrations=[1.0])[0]
    assert [(b.parent, b.token) for b in tree] == [(0, 10), (4, 11), (1, 13), (5, 12)]
    cands[0] = Branch(0, 10, 0.01)
    tree = choose([cands], [3], rate=1.0, verify=lambda r: 0.1 * r, rows=4, calibrations=[1.0])[0]
    assert [(b.parent, b.token) for b in tree] == [(1, 13)]


def test_the_policy_takes_likely_siblings_while_a_row_is_worth_it_and_learns_their_rate():
    policy = SiblingPolicy()
    alts = [Alternative(10 + j, p1, p2) for j, (p1, p2) in enumerate([(0.9, 0.05), (0.5, 0.4), (0.6, 0.3),
                                                                     (0.95, 0.01), (0.4, 0.35), (0.5, 0.3)])]
    flat = choose([sibling_candidates(alts), []], [6, 0], rate=20.0, verify=Flat(), rows=8,
                  calibrations=[policy.calibration] * 2)
    # Every sibling with a promise is free on a flat pass: the likeliest MAX_PER_SEQUENCE.
    promise = [0.05, 0.9 * 0.4, 0.45 * 0.3, 0.27 * 0.01, 0.2565 * 0.35, 0.1026 * 0.3]
    best = sorted(range(6), key=lambda j: -promise[j])[:MAX_PER_SEQUENCE]
    assert [s.parent for s in flat[0]] == best and flat[1] == []
    assert [s.token for s in flat[0]] == [10 + j for j in best]
    # A row that costs 10 ms at 20 tokens/s is worth 0.2 tokens: only the 0.36 promise pays.
    steep = choose([sibling_candidates(alts)], [6], rate=20.0, verify=lambda r: 0.05 + 0.01 * r, rows=8,
                   calibrations=[1.0])
    assert [s.parent for s in steep[0]] == [1]
    assert choose([sibling_candidates(alts)], [6], rate=20.0, verify=lambda r: 0.05 + 0.1 * r, rows=8,
                  calibrations=[1.0]) == [[]]
    # Rescues seen below the promise lower the calibration (and so the next choice's reach).
    before = policy.calibration
    policy.learn([Round(None, 6, Proposal([0] * 6), branches=flat[0], rescued=0)])
    assert policy.calibration < before and policy.taken.trials == pytest.approx(sum(promise[j] for j in best))
    policy.learn([Round(None, 6, Proposal([0] * 6), rescued=1)])  # nothing promised for it: nothing learnt
    assert policy.taken.hits == 0


def test_sd_with_siblings_is_exact_and_rescues_rounds(smollm_dir, ar_outputs):
    """The model as its own q4_0 draft: where the two disagree, the target's token is often the
    draft's runner-up, so rounds are rescued (with a flat pass, the draft drafts and every
    likely sibling is worth its row)."""
    params = SamplingParams.greedy(max_tokens=48, ignore_eos=True)
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", draft_siblings=True, draft_quantization="q4_0") as llm:
        llm.engine.k_policy = _FlatSiblings()  # fixed costs: a busy host's slow draft steps would turn K to 0
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

    def plan(self, seqs, filling=False, waiting=False):  # (drafting beside prompt chunks too: its rounds are tested)
        return super().plan(seqs, waiting=waiting)

    def learn(self, rounds):
        times = RoundTimes(verify_s=1.0)
        super().learn([dataclasses.replace(r, times=times) for r in rounds])


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
    assert all(map(fits, marginal_p_values(tokens, joint)))


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


class PlantedTree(DraftSource):
    """For a greedy request whose AR answer it knows: a chain of 3 right at its first draft only,
    and a tree whose path off that draft holds the next two right tokens, among wrong ones."""

    def __init__(self, truth: list[int]):
        super().__init__()
        self.truth = truth

    def propose(self, seqs, plans):
        out = []
        for s, p in zip(seqs, plans):
            right = self.truth[s.num_tokens:s.num_tokens + 3]
            if p.k < 3 or len(right) < 3:
                out.append(Proposal(right[:p.k]))
                continue
            wrong = [t + 1 for t in right]
            out.append(Proposal([right[0], wrong[1], wrong[2]], candidates=[
                Branch(0, wrong[0], 0.3), Branch(1, right[1], 0.5), Branch(5, right[2], 0.4), Branch(5, wrong[2], 0.2),
                Branch(6, right[0], 0.1)]))  # under right[2]: as deep as the chain (4 > 3), not offered
        return out


class PlantedPolicy(KPolicy):
    """K = 3 every round, and every branch worth its row (a flat pass)."""

    def plan(self, seqs, filling=False, waiting=False):
        return Plan([SeqPlan(3, alternatives=True)] * len(seqs),
                    SiblingOffer([[0.9] * 3] * len(seqs), [True] * len(seqs), 0.0, Flat(), 1.0, 1.0))


def test_greedy_verification_walks_a_deep_tree_and_keeps_its_kv(smollm_dir, ar_outputs, monkeypatch):
    """Each round takes the chain's first draft, then two branches deep, then the target's own
    token from the deepest one's row: 4 tokens a round from a chain whose second draft is
    wrong; the taken branches' K/V moved into the chain's slots (every later token AR's)."""
    prompt, params = "def fibonacci(n):", SamplingParams.greedy(max_tokens=41, ignore_eos=True)
    want = ar_outputs([prompt], params)[0]
    with LLM(smollm_dir) as ar:
        truth = ar.encode(prompt) + want
    monkeypatch.setitem(NAMED, "planted", lambda opts: PlantedTree(truth))
    with LLM(smollm_dir, draft="planted", mode="sd", speculate_k=3) as llm:
        llm.engine.k_policy = PlantedPolicy()
        out = llm.generate(prompt, params)[0]
    assert out.token_ids == want
    m = out.metrics
    assert (m.rounds, m.accepted, m.rescues, m.sibling_rows) == (10, 10, 20, 40), m  # 40 tokens after the first
