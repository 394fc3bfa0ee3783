"""Seeded sampled requests under shared noise (ssd/request/noise.py): one seed, one answer, the
same tokens as AR's in every mode, at any K, alone or in a batch; the noise itself draws from
the distribution it is given."""
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.exactness import pooled_p_value
from ssd.models.config import ModelConfig
from ssd.request import noise as noise_module
from ssd.request.noise import SharedNoise, request_noise
from ssd.request.sampler import sample
from ssd.speculative.draft import draft_engine
from ssd.speculative.sources.cross_vocab import CrossVocab
from ssd.speculative.sources.feature_head import FeatureHead
from chance import fits
from test_eagle import write_authors
from tiny_pair import drafter

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Once upon a time", "import numpy as np\n", "The best way to learn a language is", "Dear Sir,",
           "SELECT name FROM", "Q: What is 7 times 8?\nA:", "The mitochondria is", "for i in range(10):",
           "My favourite colour is", "In 1969, astronauts", "Here is a list of fruits:", "class Stack:",
           "The weather today", "To make a cake, first", "Rust and Go are", "Hello! How can I"]
SEEDS = (1, 2, 3)
REQUESTS = [(p, SamplingParams(temperature=0.8, max_tokens=24, seed=s, ignore_eos=True))
            for p in PROMPTS for s in SEEDS]


@pytest.fixture(scope="module")
def ar_seeded(smollm) -> list[list[int]]:
    outs = smollm.generate([p for p, _ in REQUESTS], [sp for _, sp in REQUESTS])
    return [o.token_ids for o in outs]


def _run(llm: LLM, requests=REQUESTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate([p for p, _ in requests], [sp for _, sp in requests])]


# ---- the noise ----------------------------------------------------------------------------
def test_the_tensor_hash_is_the_reference_hash_bit_for_bit():
    noise, width = SharedNoise(2**64 - 12345), 5000
    key = noise.key(77)
    x = noise_module._spread(width, torch.device("cpu")) + noise_module._int32(key)
    bits = noise_module._hash(x, torch.empty_like(x))
    want = [noise_module._int32(noise_module._mix(v * noise_module._GOLDEN + key)) for v in range(width)]
    assert bits.tolist() == want


def test_draws_over_a_whole_vocabulary_reach_its_tail():
    """151,936 tokens of a long-tailed distribution (logits ~ N(0, 2.5^2)) cut into ten bins of
    equal mass, likeliest first: 20,000 positions' draws fall into each a tenth of the time.
    The last bin holds 145,000 tokens, each far less likely than the likeliest ones: it wins
    only through the smallest E values, which a float32 -log(U) rounds away (its share fell to
    0.057 that way)."""
    V, bins, n = 151_936, 10, 20_000
    p = (torch.randn(V, generator=torch.Generator().manual_seed(0)) * 2.5).softmax(-1)
    sorted_p, order = p.sort(descending=True)
    bin_of = torch.empty(V, dtype=torch.long)
    bin_of[order] = (sorted_p.cumsum(0) * bins).clamp(max=bins - 0.5).long()
    mass = torch.zeros(bins).scatter_add_(0, bin_of, p)
    draws = torch.tensor(SharedNoise(77).choose(p.expand(n, -1), list(range(n))))
    counts = bin_of[draws].bincount(minlength=bins).double()
    assert fits(pooled_p_value(counts, mass)), (counts / n).tolist()


def test_a_rows_draw_follows_its_distribution_and_positions_are_independent():
    """Draws at 40,000 positions of one seed from a fixed p: each follows p, and the pairs of
    neighbouring positions follow p x p; a foil (p with 1 % moved between two tokens) is caught."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    noise, n = SharedNoise(2024), 40_000
    draws = torch.tensor(noise.choose(p.expand(n, -1), list(range(n))))
    assert fits(pooled_p_value(draws.bincount(minlength=7).double(), p))
    pairs = (draws[0::2] * 7 + draws[1::2]).bincount(minlength=49).double()
    assert fits(pooled_p_value(pairs, torch.outer(p, p).flatten()))
    foil = p.clone()
    foil[0], foil[3] = 0.39, 0.11
    assert pooled_p_value(draws.bincount(minlength=7).double(), foil) < 1e-6
    # Another seed: other draws (a key that ignored the seed would give the same).
    assert SharedNoise(2025).choose(p.expand(200, -1), list(range(200))) != draws[:200].tolist()


def test_a_rows_noise_does_not_depend_on_the_rows_beside_it():
    noise = SharedNoise(5)
    p = torch.softmax(torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)), -1)
    together = noise.choose(p, [10, 11, 12, 13, 14, 15])
    assert [noise.choose(p[i:i + 1], [10 + i])[0] for i in range(6)] == together


def test_only_seeded_sampled_requests_share_noise():
    seeded = SamplingParams(temperature=0.8, seed=3)
    assert request_noise(seeded, "shared-noise") == SharedNoise(3)
    assert request_noise(seeded, "rejection") is None
    assert request_noise(SamplingParams(temperature=0.8), "shared-noise") is None
    assert request_noise(SamplingParams.greedy(seed=3), "shared-noise") is None


def test_an_unknown_scheme_is_refused(smollm_dir):
    with pytest.raises(Exception, match="seeded_sampling must be one of shared-noise, rejection"):
        LLM(smollm_dir, seeded_sampling="gumbel")


# ---- one seed, one answer -----------------------------------------------------------------
def test_ar_gives_a_seeded_request_the_same_tokens_alone_and_in_a_batch(smollm_dir, ar_seeded):
    with LLM(smollm_dir, max_num_seqs=3) as llm:
        assert _run(llm, REQUESTS[:9]) == ar_seeded[:9]
        assert [_run(llm, [r])[0] for r in REQUESTS[9:12]] == ar_seeded[9:12]


@pytest.mark.parametrize("options", [
    dict(draft="ngram", speculate_k=3), dict(draft="suffix"), dict(draft="ngram", speculate_k="auto"),
], ids=["lookup-k3", "suffix-auto", "lookup-auto"])
def test_sd_without_a_model_gives_ars_seeded_tokens(smollm_dir, ar_seeded, options):
    with LLM(smollm_dir, mode="sd", max_num_seqs=8, **options) as llm:
        assert _run(llm) == ar_seeded


@pytest.mark.parametrize("k", [1, 4, 8, "auto"])
def test_sd_with_a_draft_model_gives_ars_seeded_tokens_at_any_k(smollm_dir, truncated_draft, ar_seeded, k):
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=k, max_num_seqs=8) as llm:
        outs = llm.generate([p for p, _ in REQUESTS], [sp for _, sp in REQUESTS])
        assert [o.token_ids for o in outs] == ar_seeded
        assert [_run(llm, [r])[0] for r in REQUESTS[:3]] == ar_seeded[:3]  # alone
    assert k == "auto" or sum(o.metrics.drafted for o in outs) > 0  # (auto-K may find drafting does not pay)


def test_a_draft_racing_the_same_noise_proposes_the_targets_draws(smollm_dir, monkeypatch):
    """The coupling at work: the model as its own draft on int8 weights (q close to p) races the
    target's noise, so it proposes the target's own draw far more often than the same draft
    racing other noise (a foil: independent draws, matched only by chance). Both are exact."""
    def acceptance() -> float:
        with LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k=4, max_num_seqs=8) as llm:
            outs = llm.generate([p for p, _ in REQUESTS[:24]], [sp for _, sp in REQUESTS[:24]])
        return sum(o.metrics.accepted for o in outs) / sum(o.metrics.drafted for o in outs)

    coupled = acceptance()
    monkeypatch.setattr(draft_engine, "request_noise", lambda params, _: SharedNoise(params.seed + 99))
    apart = acceptance()
    assert coupled > apart + 0.2, (coupled, apart)


@pytest.mark.parametrize("k", [3, "auto"])
def test_ssd_gives_ars_seeded_tokens(smollm_dir, truncated_draft, ar_seeded, k):
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=k, max_num_seqs=8) as llm:
        assert _run(llm) == ar_seeded


def test_a_head_gives_ars_seeded_tokens(smollm_dir, tmp_path, ar_seeded):
    write_authors(tmp_path / "head", ModelConfig.from_folder(smollm_dir))
    with LLM(smollm_dir, draft=str(tmp_path / "head"), mode="sd", speculate_k=3, max_num_seqs=8) as llm:
        assert isinstance(drafter(llm), FeatureHead)
        assert _run(llm) == ar_seeded


def test_a_draft_of_another_vocabulary_gives_ars_seeded_tokens(smollm_dir, other_vocab, ar_seeded):
    with LLM(smollm_dir, draft=other_vocab, mode="sd", speculate_k=3, max_num_seqs=8) as llm:
        assert isinstance(drafter(llm), CrossVocab)
        assert _run(llm) == ar_seeded


def test_a_small_random_draft_of_its_vocabulary_gives_ars_seeded_tokens(smollm_dir, tiny_models, ar_seeded):
    with LLM(smollm_dir, draft=tiny_models["llama"], mode="sd", speculate_k=2, max_num_seqs=8) as llm:
        assert _run(llm) == ar_seeded


def test_seeded_requests_keep_their_tokens_through_preemption(smollm_dir, truncated_draft, ar_seeded):
    """A KV cache that holds two requests: the others wait or are preempted and rerun."""
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=3, max_num_seqs=8,
             kv_cache_tokens=96, enable_prefix_caching=False) as llm:
        assert _run(llm, REQUESTS[:12]) == ar_seeded[:12]


def test_rejection_sampling_is_still_there_when_asked_for(smollm_dir, truncated_draft):
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=3, seeded_sampling="rejection") as llm:
        seq = llm.new_request(*REQUESTS[0])
        assert seq.noise is None and seq.generator is not None
        a, b = _run(llm, REQUESTS[:2]), _run(llm, REQUESTS[:2])  # at a fixed K: reproducible
    assert a == b


def test_first_argmax_is_argmax_ties_included():
    g = torch.Generator().manual_seed(3)
    for width in (5, 2047, 151_936, 4096):
        for _ in range(20):
            x = torch.randint(0, 50, (width,), generator=g).float()  # many ties
            assert noise_module.first_argmax(x) == int(x.argmax())


def test_sibling_leaves_give_ars_seeded_tokens(smollm_dir, truncated_draft, ar_seeded):
    """A seeded round's tree: the draft's runner-up in the same race beside its pick, verified by
    the target's draws at each node (a sibling at the first rejected depth can be taken)."""
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", draft_siblings=True, speculate_k="auto",
             max_num_seqs=8) as llm:
        outs = llm.generate([p for p, _ in REQUESTS], [sp for _, sp in REQUESTS])
    assert [o.token_ids for o in outs] == ar_seeded


def test_noise_made_first_under_inference_mode_serves_outside_it():
    """A row's buffers are first made wherever the first draw happens (a draft's pass runs under
    inference_mode); a draw outside it then still works, and gives the same token."""
    p = torch.softmax(torch.randn(1, 3333, generator=torch.Generator().manual_seed(1)), -1)
    with torch.inference_mode():
        inside = SharedNoise(8).choose(p, [4])
    assert SharedNoise(8).choose(p, [4]) == inside
    assert sample(p, torch.Generator().manual_seed(2)).shape == (1,)
