"""SD with an EAGLE-3 head (ssd/speculative/sources/feature_head.py): a random head, written in
the authors' layout, drafts from the target's own hidden states; greedy output is AR's token
for token, every row the head reads holds the target's states of its position, and sampled
output follows the target's distribution."""
from dataclasses import replace

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.models.config import ModelConfig
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.speculative.policy.draft_stop import StopRule
from ssd.speculative.sources.feature_head import TREE_WIDTH, FeatureHead
from chance import fits
from test_eagle import write_authors, write_speculators
from test_ngram import REPEATING
from tiny_pair import NEW, PROMPT, exact_joint, marginal_p_values, drafter


def test_sd_with_a_head_is_exact_and_reads_the_targets_states(smollm_dir, tmp_path, ar_outputs, monkeypatch):
    target = ModelConfig.from_folder(smollm_dir)
    write_authors(tmp_path / "head", target)
    fed = []  # the rows of target states of every head pass: (first position, rows)
    real = FeatureHead._pass

    def spy(self, rows):
        fed.extend((start, states) for _, start, _, states in rows if states.shape[-1] != target.hidden_size)
        return real(self, rows)
    monkeypatch.setattr(FeatureHead, "_pass", spy)
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    prompts = [REPEATING, "The capital of France is"]
    with LLM(smollm_dir, draft=str(tmp_path / "head"), mode="sd", speculate_k=3) as llm:
        assert isinstance(drafter(llm), FeatureHead) and llm.engine.cache.prefix is None
        model, taps = llm.engine.runner.model, llm.engine.source.capabilities.taps
        for prompt, want in zip(prompts, ar_outputs(prompts, params)):
            fed.clear()
            out = llm.generate(prompt, params)[0]
            assert out.token_ids == want and out.metrics.drafted > 0
            # One fresh pass over the whole sequence (batch-invariant kernels: the same bits).
            tokens = llm.encode(prompt) + out.token_ids
            cache = PagedKVCache(model.config, 512, 16, torch.device("cpu"), torch.float32)
            cache.reserve(0, len(tokens))
            _, states = ModelRunner(model, cache, torch.device("cpu")).forward([Chunk(0, tokens, 0, 1)], taps=taps)
            whole = states.permute(1, 0, 2).reshape(len(tokens), -1)
            assert fed and fed[0][0] == 0
            for (start, rows), (after, _) in zip(fed, fed[1:] + [(None, None)]):  # each position once, in order
                assert torch.equal(rows, whole[start:start + len(rows)]), start
                assert after is None or after == start + len(rows)


class _Varied(StopRule):
    """A stopping rule that ends a chain after about a third of its tokens, by their top-1
    probability's digits (a random head's are all near 1 / its vocabulary)."""

    def chance(self, confidence: float) -> float:
        return 0.0 if int(confidence * 1e6) % 3 == 0 else 1.0


VARIED = _Varied((1.0,) * 10, (0.5,) * 4)


@pytest.mark.parametrize("rule", [None, VARIED], ids=["chains", "cut-by-the-stopping-rule"])
def test_a_heads_captured_passes_draft_what_its_eager_ones_do(smollm_dir, tmp_path, monkeypatch, rule):
    """On a GPU the head's passes run as CUDA graphs of padded buckets (HeadPasses), and a
    greedy chain's steps after the first as one graph (HeadChain), cut afterwards by the
    stopping rule; on the CPU the same padded static inputs run eagerly, with the same bits
    (batch-invariant kernels): the same proposals, round by round, and greedy output AR's."""
    import ssd.engine.draft_start as engine
    write_authors(tmp_path / "head", ModelConfig.from_folder(smollm_dir))
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    prompts = [REPEATING, "The capital of France is"]
    real, proposed = FeatureHead.propose, []

    def ruled(self, seqs, plans):
        proposed.append(real(self, seqs, [replace(p, stop=rule) for p in plans]))
        return proposed[-1]
    monkeypatch.setattr(FeatureHead, "propose", ruled)
    runs = []
    for buckets in (None, [1, 2, 4, 8]):
        monkeypatch.setattr(engine, "head_buckets", lambda config: buckets)
        proposed.clear()
        with LLM(smollm_dir, draft=str(tmp_path / "head"), mode="sd", speculate_k=5, draft_stop=False) as llm:
            outs = llm.generate(prompts, params)
            source = drafter(llm)
            if buckets:  # the first passes went through the buckets' static inputs, the steps after as chains
                assert source.steps.passes >= 2 * len(prompts)
                assert set(source.steps.graphs) == {(b, f, ()) for b in buckets for f in (True, False)}
                assert set(source.chain.graphs) == {(b, s) for b in buckets for s in range(1, 5)}
                assert source.chain.passes > len(source.chain.graphs)  # (the start-up's: one each)
            else:
                assert source.steps is None and source.chain is None
            runs.append(([[(p.tokens, p.confidences) for p in props] for props in proposed],
                         [(o.token_ids, o.metrics.drafted, o.metrics.accepted) for o in outs]))
    assert runs[0][1] == runs[1][1] and all(drafted for _, drafted, _ in runs[0][1])
    assert runs[0][0] == runs[1][0]  # tokens and confidences
    lengths = {len(t) for props in runs[0][0] for t, _ in props}
    assert len(lengths) >= (3 if rule else 1), lengths


def test_sd_with_a_head_samples_the_target(tiny_pair, tmp_path):
    """A speculators-layout head over the tiny target's whole vocabulary, reading its layers
    0, 1 and the stream after the last: 4000 samples of the first tokens against the exact
    marginals."""
    target, _ = tiny_pair
    write_speculators(tmp_path / "head", ModelConfig.from_folder(target), layer_ids=[0, 1, 2], vd=8)
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=str(tmp_path / "head"), mode="sd", speculate_k=2, max_num_seqs=500, seed=11) as llm:
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    assert sum(o.metrics.accepted for o in outs) > 100  # the head's proposals are really verified
    assert all(map(fits, marginal_p_values(tokens, exact_joint(target, prompt_ids, temperature))))


def test_a_heads_matrices_are_int8_on_the_cpu_unless_asked_otherwise(smollm_dir, tmp_path):
    write_authors(tmp_path / "head", ModelConfig.from_folder(smollm_dir))
    head = str(tmp_path / "head")
    with LLM(smollm_dir, draft=head, mode="sd") as llm:
        assert all(m.quantized for m in (drafter(llm).head.fc, drafter(llm).head.lm_head))
    with LLM(smollm_dir, draft=head, mode="sd", draft_quantization=None) as llm:
        assert not drafter(llm).head.fc.quantized
    with pytest.raises(SSDError, match="an EAGLE-3 head's weights are int8"):
        LLM(smollm_dir, draft=head, mode="sd", draft_quantization="q4_0")


def test_a_head_times_its_steps_apart_from_its_catch_up(smollm_dir, tmp_path, monkeypatch):
    """As a draft model's do, a head's proposals carry its seconds per draft step and, for a
    first pass over many rows (the prompt), a catch-up of that many rows: auto-K then prices a
    drafted token by a step, not by a round's wait (docs/algorithm.md, "EAGLE-3 heads")."""
    write_authors(tmp_path / "head", ModelConfig.from_folder(smollm_dir))
    seen = []
    real = FeatureHead.propose
    monkeypatch.setattr(FeatureHead, "propose", lambda self, seqs, plans: seen.append(real(self, seqs, plans))
                        or seen[-1])
    with LLM(smollm_dir, draft=str(tmp_path / "head"), mode="sd", speculate_k=3) as llm:
        prompt = llm.encode(REPEATING)
        llm.generate(REPEATING, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
    drafted = [p[0] for p in seen if p[0].tokens]
    assert drafted[0].catchup is not None and drafted[0].catchup[1] == len(prompt)  # rows 0..N - 2, N = prompt + 1
    steps = [p.step_s for p in drafted if p.step_s is not None]
    assert steps and all(0 < s < 1 for s in steps)


def test_a_head_answers_sibling_leaves_and_the_stopping_rule(smollm_dir, tmp_path, monkeypatch, ar_outputs):
    """Asked for them by the plan, a head's proposals for a sampled request carry each token's
    runner-up (another token, with its and the pick's probabilities), for a greedy one a tree
    of candidates off the chain; each greedy token's top-1 probability, and its chain stops
    where the rule says; with auto-K (which offers all of these) greedy output stays AR's."""
    write_authors(tmp_path / "head", ModelConfig.from_folder(smollm_dir))
    seen = []
    real = FeatureHead.propose
    never = StopRule(tuple([0.5] * 10), (2.0,) * 4)  # no second token: S_1 <= 1 < 2

    def asking(self, seqs, plans):
        seen.append(real(self, seqs, [replace(p, alternatives=True, stop=never) for p in plans]))
        return seen[-1]
    params = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)
    with monkeypatch.context() as m:
        m.setattr(FeatureHead, "propose", asking)
        with LLM(smollm_dir, draft=str(tmp_path / "head"), mode="sd", speculate_k=3) as llm:
            assert llm.generate(REPEATING, params)[0].token_ids == ar_outputs([REPEATING], params)[0]
            greedy = [p for props in seen for p in props if p.tokens]
            seen.clear()
            llm.generate(REPEATING, sampled)
    assert greedy and all(len(p.tokens) == 1 == len(p.confidences) and not p.alternatives for p in greedy)
    for p in greedy:  # a chain of one: the newest token's other likeliest tokens, no deeper
        assert p.candidates and all(b.parent == 0 and b.token != p.tokens[0] for b in p.candidates)
        assert all(0 < b.promise <= 1 - p.confidences[0] + 1e-6 for b in p.candidates)
    drafted = [p for props in seen for p in props if p.tokens]
    assert drafted and all(len(p.tokens) == len(p.alternatives) and not p.candidates for p in drafted)
    for p in drafted:
        a = p.alternatives[0]
        assert a.token != p.tokens[0] and 0 <= a.p1 <= 1 and 0 <= a.p2 <= 1  # (p1: the drawn token's)
    prompts = [REPEATING, "The capital of France is"]
    params = SamplingParams.greedy(max_tokens=48, ignore_eos=True)
    for siblings in (False, True):
        with LLM(smollm_dir, draft=str(tmp_path / "head"), mode="sd", speculate_k="auto",
                 draft_siblings=siblings) as llm:
            assert [o.token_ids for o in llm.generate(prompts, params)] == ar_outputs(prompts, params)


def test_a_heads_tree_rows_are_its_chain_rows_for_those_tokens(smollm_dir, tmp_path, monkeypatch):
    """An expanded candidate's row in the head's tree (its parent's keys and output state, in a
    pass beside the chain's row) gives the logits the chain's row gives when the chain holds
    that token; and the tree's candidates hang off the nodes they were drawn from."""
    write_authors(tmp_path / "head", ModelConfig.from_folder(smollm_dir))
    grown, forced = [], []
    real_grow, real_pick, real = FeatureHead._grow, FeatureHead._pick, FeatureHead.propose

    def grow(self, tree, owner, step, chain, expand):
        grown.append((step, chain[0].clone(),
                      [(tree.candidates[i], logits.clone()) for i, *_, logits in tree.frontier]))
        return real_grow(self, tree, owner, step, chain, expand)

    def pick(self, seq, logits, draft, alternative):
        if forced and not draft.tokens:
            draft.tokens.append(forced[0])
            return forced[0]
        return real_pick(self, seq, logits, draft, alternative)
    monkeypatch.setattr(FeatureHead, "_grow", grow)
    monkeypatch.setattr(FeatureHead, "_pick", pick)
    monkeypatch.setattr(FeatureHead, "propose", lambda self, seqs, plans: real(
        self, seqs, [replace(p, alternatives=True) for p in plans]))
    params = SamplingParams.greedy(max_tokens=5, ignore_eos=True)  # a first round of K = 3
    with LLM(smollm_dir, draft=str(tmp_path / "head"), mode="sd", speculate_k=3) as llm:
        llm.generate(REPEATING, params)
        step1 = next(g for g in grown if g[0] == 1)
        assert len(step1[2]) == TREE_WIDTH - 1  # depth 1: the newest token's other likeliest, all expanded
        (parent, token, promise), logits = step1[2][0]
        assert parent == 0 and 0 < promise < 1  # under the newest token: depth 1
        grown.clear()
        forced.append(token)
        llm.generate(REPEATING, params)
    chain = next(g for g in grown if g[0] == 1)[1]
    torch.testing.assert_close(chain, logits, rtol=1e-5, atol=1e-5)
