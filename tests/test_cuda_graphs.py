"""The GPU step path's CPU-testable parts: the Triton paged-attention kernel (under Triton's
interpreter) against a float64 reference, and the captured steps' padded static inputs
(run eagerly on the CPU, where the kernels are batch-invariant, so padding must not move a bit)."""
import os
import subprocess
import sys

import pytest
import torch

from ssd.models.loader import load_model
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner

from tiny_pair import drafter

CPU = torch.device("cpu")


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_triton_kernel_under_the_interpreter():
    """Triton reads TRITON_INTERPRET when it first builds a kernel, in a process that has not
    imported it yet: the kernel's tests below run in a fresh pytest process with it set."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is that process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interpreted"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout, run.stdout + run.stderr


@pytest.fixture
def interpreted():
    """kernels/attention_triton.py, in the process the test above starts."""
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 (test_triton_kernel_under_the_interpreter)")
    from ssd.kernels import attention_triton
    return attention_triton


@pytest.fixture
def fused():
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 (test_triton_kernel_under_the_interpreter)")
    from ssd.kernels import fused_triton
    return fused_triton


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_interpreted_rms_norm_and_act_mul(fused):
    from ssd.layers.mlp import ACTIVATIONS
    from ssd.layers.norm import RMSNorm
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96, generator=g)
    x = torch.randn(5, 96, generator=g)
    assert rel_err(fused.rms_norm(x, norm.weight, 1e-6), norm._norm(x)) < 1e-6
    h = torch.randn(5, 96, generator=g)
    total, y = fused.add_rms_norm(x, h, norm.weight, 1e-6)
    assert torch.equal(total, x + h) and torch.equal(y, fused.rms_norm(x + h, norm.weight, 1e-6))
    # bf16: the norm reads the rounded sum (the interpreter rounds to bf16 its own way, so the
    # sum's bits against torch's add are checked on the GPU: bench/gpu/gpu_profile.py)
    xb, hb = x.bfloat16(), (h * 1e-2).bfloat16()
    total, y = fused.add_rms_norm(xb, hb, norm.weight, 1e-6)
    assert torch.equal(y, fused.rms_norm(total, norm.weight, 1e-6)) and rel_err(total, xb + hb) < 1e-2
    gate_up = torch.randn(3, 2 * 1100, generator=g)  # not a multiple of the block
    for name, gelu in (("silu", False), ("gelu_tanh", True)):
        gate, up = gate_up.chunk(2, dim=-1)
        assert rel_err(fused.act_mul(gate_up, gelu), ACTIVATIONS[name](gate) * up) < 1e-6


@pytest.mark.parametrize("rotary_dim", [64, 32])  # all of a head, and Phi's partial rotary
def test_interpreted_rope_cache(fused, rotary_dim):
    from ssd.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(rotary_dim, 256, 10000.0, {})
    q, k, v = torch.randn(4, 6, 64, generator=g), torch.randn(4, 2, 64, generator=g), torch.randn(4, 2, 64, generator=g)
    positions, slots = torch.tensor([0, 5, 100, 255]), torch.tensor([7, 3, 12, 0])
    k_cache, v_cache = torch.zeros(16, 2, 64), torch.zeros(16, 2, 64)
    out = fused.rope_cache(q, k, v, positions, rope.cos, rope.sin, k_cache, v_cache, slots)
    q_ref, k_ref = rope(positions, q, k)
    assert rel_err(out, q_ref) < 1e-6
    assert rel_err(k_cache[slots], k_ref) < 1e-6 and torch.equal(v_cache[slots], v)
    # q, k and v as views of one qkv projection's rows (the layers' case): read at its stride
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    views = [x.view(4, -1, 64) for x in qkv.split([6 * 64, 2 * 64, 2 * 64], 1)]
    k_cache2, v_cache2 = torch.zeros(16, 2, 64), torch.zeros(16, 2, 64)
    out2 = fused.rope_cache(*views, positions, rope.cos, rope.sin, k_cache2, v_cache2, slots)
    assert torch.equal(out2, out) and torch.equal(k_cache2, k_cache) and torch.equal(v_cache2, v_cache)
    written = torch.zeros(16, dtype=torch.bool)
    written[slots] = True
    assert not k_cache[~written].any() and not v_cache[~written].any()


def reference(q, k_cache, v_cache, rows, q_row, q_len, scale, softcap=None, window=None):
    group = q.shape[1] // k_cache.shape[1]
    out = []
    for t in range(q.shape[0]):
        n = int(q_len[t])
        slots = rows[q_row[t], max(0, n - window) if window else 0:n]
        k = k_cache[slots].double().repeat_interleave(group, 1)
        v = v_cache[slots].double().repeat_interleave(group, 1)
        x = torch.einsum("hd,nhd->hn", q[t].double(), k) * scale
        if softcap:
            x = softcap * torch.tanh(x / softcap)
        out.append(torch.einsum("hn,nhd->hd", x.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("kv_heads,group,dim,softcap,window", [
    (2, 3, 64, None, None),  # a group that is no power of two
    (1, 1, 32, None, None),
    (2, 4, 96, 5.0, None),  # a head size that is no power of two (Phi-3), Gemma 2's soft cap
    (3, 2, 64, None, 40),  # a sliding window shorter than most rows
    (1, 2, 32, None, 600),  # a window of two splits
])
def test_interpreted_attention_matches_float64(interpreted, kv_heads, group, dim, softcap, window):
    """Causal chunks sharing a row, tree nodes with rows of their own, lengths across tiles."""
    g = torch.Generator().manual_seed(kv_heads * 100 + dim)
    slots = 1400
    k_cache = torch.randn(slots, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g)
    rows = torch.stack([torch.randperm(slots, generator=g)[:1200] for _ in range(3)])
    q_row = torch.tensor([0, 0, 1, 2, 2])
    q_len = torch.tensor([1, 65, 1100, 7, 513])  # 65, 513: splits of 64 keys; 1100: 9 of 128, merged
    q = torch.randn(len(q_row), kv_heads * group, dim, generator=g)
    out = interpreted.attention(q, k_cache, v_cache, rows, q_row, q_len, dim ** -0.5, softcap=softcap, window=window)
    ref = reference(q, k_cache, v_cache, rows, q_row, q_len, dim ** -0.5, softcap, window)
    assert out.dtype is torch.float32 and out.shape == q.shape
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_interpreted_attention_is_batch_invariant(interpreted):
    """A query's output has the same bits alone and among others, and in a row tensor only as wide
    as its keys (fewer programs in the grid): its keys are cut and walked in one order."""
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = torch.randn(900, 2, 64, generator=g), torch.randn(900, 2, 64, generator=g)
    rows = torch.randperm(900, generator=g)[:800].view(1, 800)
    q = torch.randn(3, 8, 64, generator=g)
    lens = torch.tensor([800, 17, 65])
    together = interpreted.attention(q, k_cache, v_cache, rows, torch.zeros(3, dtype=torch.long), lens, 0.125)
    for t in range(3):
        for width in (800, int(lens[t])):
            alone = interpreted.attention(q[t:t + 1], k_cache, v_cache, rows[:, :width].contiguous(),
                                          torch.zeros(1, dtype=torch.long), lens[t:t + 1], 0.125)
            assert torch.equal(alone[0], together[t])


def passes(runner: ModelRunner, cache: PagedKVCache, ids: list[int], taps: tuple[int, ...] = ()) -> list:
    """A prompt chunk (longer than the buckets: eager), decode steps, a verify pass, two
    sequences in one pass, and a tree-like pass with a row of its own; with taps, each pass's
    logits and the states of those layers."""
    cache.reserve(0, 64)
    cache.reserve(1, 64)
    steps = [[Chunk(0, ids[:20], 0, 20)], [Chunk(0, ids[20:21], 20, 1)], [Chunk(0, ids[21:26], 21, 5)],
             [Chunk(1, ids[5:12], 0, 7)], [Chunk(1, ids[12:13], 7, 1), Chunk(0, ids[26:29], 26, 2)]]
    steps += [[Chunk(0, ids[29 + i:30 + i], 29 + i, 1), Chunk(1, ids[13 + i:14 + i], 13 + i, 1)]
              for i in range(3)]  # decode steps of both
    return [runner.forward(chunks, taps=taps) for chunks in steps]


@pytest.mark.parametrize("taps", [(), (2, 15, 30)], ids=["logits", "and-a-head's-states"])
def test_padded_static_steps_keep_the_bits(smollm_dir, taps):
    """The captured-step path (its pinned inputs, padding to a bucket, the scratch slot) gives
    the eager path's logits and KV cache bit for bit on the CPU; and where an EAGLE-3 head
    reads the target, the states of its layers at each of the pass's own tokens (a padded
    pass holds more rows)."""
    model = load_model(smollm_dir, CPU, torch.float32, "dequantized")
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    results = []
    for buckets in (None, [4, 8]):
        cache = PagedKVCache(model.config, 512, 16, CPU, torch.float32)
        cache.kv.zero_()
        runner = ModelRunner(model, cache, CPU, buckets, max_keys=80)
        out = passes(runner, cache, ids, taps)
        lengths = (32, 16)  # what each sequence has written
        if buckets:
            assert runner.steps is not None and runner.steps.failed is None and runner.steps.passes == 7
            assert all(cache.scratch_slot() not in cache.slots(o, 0, 64).tolist() for o in (0, 1))
            assert {key[2] for key in runner.steps.graphs} == {taps}
        results.append((out, [cache.kv[:, :, cache.slots(o, 0, n)] for o, n in enumerate(lengths)]))
    (eager, kv_eager), (captured, kv_captured) = results
    for a, b in zip(eager, captured):
        if taps:
            (a, a_states), (b, b_states) = a, b
            assert torch.equal(a_states, b_states)  # eagerly: [3, the pass's tokens, hidden]
        assert torch.equal(a, b)
    for a, b in zip(kv_eager, kv_captured):
        assert torch.equal(a, b)


def test_draft_tree_steps_through_padded_static_steps(truncated_draft, smollm_dir):
    """SSD's tree steps (explicit attention rows, one per branch) through the captured-step
    path build the tree the eager path builds, branch for branch."""
    import transformers
    from ssd import SamplingParams
    from ssd.speculative.draft.draft_engine import DraftEngine
    from ssd.speculative.draft.fanout import FanOut
    from ssd.speculative.link.protocol import SpecRequest
    from ssd.speculative.draft.ssd_draft import SSDDraft
    model = load_model(truncated_draft, CPU, torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    prompts = [tok(p).input_ids for p in ("def add(a, b):", "The capital of France is")]
    trees = []
    for buckets in (None, [1, 2, 4, 8, 16, 32]):
        engine = DraftEngine(model, CPU, k_max=3, cache_tokens=2048, seed=0)
        if buckets:
            engine.runner = ModelRunner(model, engine.kv, CPU, buckets, max_keys=64)
        draft = SSDDraft(engine, FanOut(3, [2, 1, 2, 3]))
        replies = draft.step([SpecRequest(i, 0, ids, 3, SamplingParams.greedy()) for i, ids in enumerate(prompts)])
        draft.build()
        if buckets:  # the draft steps and each depth of the tree (16 branches, 16 rows)
            assert engine.runner.steps.passes >= 3 + 3
        trees.append(([r.tokens for r in replies],
                      [{key: b.tokens for key, b in engine.seqs[i].speculations.entries.items()} for i in range(2)]))
    assert trees[0] == trees[1] and all(trees[0][1])


def test_warm_up_runs_every_bucket(smollm_dir):
    """Each bucket's graph is captured at start-up (for a draft: of hidden states), not in a
    request's first passes, whose time auto-K reads as what drafting costs. On the CPU the
    bucket's padded pass runs eagerly; the key records that it ran."""
    model = load_model(smollm_dir, CPU, torch.float32)
    cache = PagedKVCache(model.config, 256, 16, CPU, torch.float32)
    runner = ModelRunner(model, cache, CPU, [1, 2, 4], max_keys=64)
    before = cache.held()  # the padding tokens' scratch block
    runner.warm_up(head=False)
    assert set(runner.steps.graphs) == {(1, False, ()), (2, False, ()), (4, False, ())}
    assert cache.held() == before  # the warm-up's slots are free again


@pytest.mark.parametrize("stop", [False, True], ids=["chains", "cut-by-the-stopping-rule"])
def test_a_draft_models_chains_draft_what_its_passes_do(smollm_dir, truncated_draft, monkeypatch, stop):
    """On a GPU a greedy chain's steps after its first token run as one graph (ChainSteps), cut
    afterwards by the stopping rule; on the CPU the same padded static inputs run eagerly with
    the bits of the passes one at a time: the same proposals and confidences, round by round,
    and greedy output AR's."""
    import ssd.speculative.draft.draft_engine as draft_engine
    from ssd import LLM, SamplingParams
    from ssd.speculative.draft.draft_engine import DraftEngine
    from test_feature_head import VARIED
    real, proposed = DraftEngine.draft, []

    def ruled(self, seqs, ks, alternatives=False, stops=None):
        proposed.append(real(self, seqs, ks, alternatives, [VARIED if stop else None] * len(seqs)))
        return proposed[-1]
    monkeypatch.setattr(DraftEngine, "draft", ruled)
    params = SamplingParams.greedy(max_tokens=32, ignore_eos=True)
    prompts = ["def add(a, b):", "The capital of France is"]
    runs = []
    for buckets in (None, [1, 2, 4, 8]):
        monkeypatch.setattr(draft_engine, "chain_buckets", lambda device: buckets)
        proposed.clear()
        # Without the draft's guesses: how many rows they take is priced by timed passes, and a
        # pass that takes a guess hands the rule two tokens at once, so runs would differ by timing.
        with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=5, draft_guesses=False) as llm:
            outs = llm.generate(prompts, params)
            engine = drafter(llm).engine
            if buckets:  # (the start-up ran each graph once)
                assert engine.chain.passes > len(engine.chain.graphs) == len(buckets) * 4
            else:
                assert engine.chain is None
        runs.append(([[(p.tokens, p.confidences) for p in props] for props in proposed],
                     [(o.token_ids, o.metrics.drafted, o.metrics.accepted) for o in outs]))
    assert runs[0] == runs[1]
    lengths = {len(t) for props in runs[0][0] for t, _ in props}
    assert len(lengths) >= (3 if stop else 1), lengths
