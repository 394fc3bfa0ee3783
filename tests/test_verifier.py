"""The verifier keeps the target's distribution exactly, and greedy verification is exact.

Distribution tests: the rows p_0..p_K and q_0..q_{K-1} are fixed (they do not depend on the
prefix), so the target itself would emit output position j from p_j whatever came before.
Within one round, output position j exists iff k >= j; that event depends only on the
randomness of positions < j (d_0..d_{j-1} and their uniforms), and the token at j depends only
on the randomness of position j onwards. So among rounds with k >= j, and within each emitted
prefix out_0..out_{j-1}, out_j must be distributed as p_j. (A next round starts afresh at
position k+1 with the same rule, so this per-round check covers a whole generation.)
"""
import pytest
import torch

from ssd.exactness import chi_square, p_value
from ssd.request.sampler import probs_from_logits, sample
from ssd.sampling_params import SamplingParams
from ssd.speculative.verifier import Verdict, greedy_tree, verify, verify_many

from chance import fits

V = 6
ROUNDS = 200_000


def emitted(drafts: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """[N, K+1] tokens each round emits: the k accepted drafts, t, then -1 (not emitted)."""
    N, K = drafts.shape
    pos = torch.arange(K + 1).expand(N, K + 1)
    out = torch.cat([drafts, torch.full((N, 1), -1)], dim=1)
    out = torch.where(pos == k[:, None], t[:, None], out)
    return torch.where(pos > k[:, None], -1, out)


def output_p_value(p: torch.Tensor, out: torch.Tensor) -> float:
    """One p-value for 'out_j ~ p_j given the emitted prefix', pooled over every position j
    and every prefix seen often enough for the chi-square approximation (5 expected per cell)."""
    stat, df = 0.0, 0
    for j in range(p.shape[0]):
        reached = out[out[:, j] >= 0, : j + 1]
        code = (reached * V ** torch.arange(j, -1, -1)).sum(1)  # prefix digits, then out_j
        for counts in code.bincount(minlength=V ** (j + 1)).view(-1, V).double():
            if counts.sum() * p[j][p[j] > 0].min() < 5:
                chi_square(counts, p[j])  # still checks that no zero-probability token came out
                continue
            s, d = chi_square(counts, p[j])
            stat, df = stat + s, df + d
    assert df > 0
    return p_value(stat, df)


def rows(seed: int, K: int, target: SamplingParams, draft: SamplingParams,
         related: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """p [K+1, V] and q [K, V] from random logits; a related draft's logits are the target's
    plus noise (as with a real draft model, so that deep positions get reached)."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(K + 1, V, generator=g)
    draft_logits = torch.randn(K, V, generator=g) + (target_logits[:K] if related else 0)
    return probs_from_logits(target_logits, target), probs_from_logits(draft_logits, draft)


def draw_drafts(q: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[ROUNDS, K] proposals, d_i ~ q_i (torch.multinomial, independent of the engine's sampler)."""
    cols = [torch.multinomial(q[i], ROUNDS, replacement=True, generator=generator) for i in range(q.shape[0])]
    return torch.stack(cols, dim=1) if cols else torch.zeros(ROUNDS, 0, dtype=torch.long)


def run_rounds(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, seed: int) -> torch.Tensor:
    N, K = drafts.shape
    g = torch.Generator().manual_seed(seed)
    k, t = verify_many(p.expand(N, K + 1, V), drafts, None if q is None else q.expand(N, K, V), g)
    return emitted(drafts, k, t)


T07, T13 = SamplingParams(temperature=0.7), SamplingParams(temperature=1.3)
TOPK = SamplingParams(temperature=1.0, top_k=3)
TOPP = SamplingParams(temperature=1.0, top_p=0.8)
COMBO = SamplingParams(temperature=1.3, top_k=4, top_p=0.8)
COMBO2 = SamplingParams(temperature=0.7, top_k=3, top_p=0.8)

SAME_PROCESSING = {"t0.7": T07, "t1.3": T13, "top_k3": TOPK, "top_p0.8": TOPP,
                   "t1.3_k4_p0.8": COMBO, "t0.7_k3_p0.8": COMBO2}


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("name", SAME_PROCESSING)
def test_output_follows_target(name: str, K: int) -> None:
    params = SAME_PROCESSING[name]
    p, q = rows(K, K, params, params)
    g = torch.Generator().manual_seed(100 + K)
    out = run_rounds(p, q, draw_drafts(q, g), seed=200 + K)
    assert fits(output_p_value(p, out))


@pytest.mark.parametrize("K", [1, 3])
def test_draft_without_mass_on_target_favourites(K: int) -> None:
    """Draft cut to top-2 at low temperature, target broad: q is zero on the target's argmax,
    which can then only come out as a recovery token."""
    g = torch.Generator().manual_seed(7)
    target_logits = torch.randn(K + 1, V, generator=g)
    p = probs_from_logits(target_logits, T13)
    q = probs_from_logits(-target_logits[:K] + 0.3 * torch.randn(K, V, generator=g),
                          SamplingParams(temperature=0.7, top_k=2))
    assert (q.gather(1, p[:K].argmax(1, keepdim=True)) == 0).all()
    out = run_rounds(p, q, draw_drafts(q, g), seed=8)
    assert fits(output_p_value(p, out))


@pytest.mark.parametrize("K", [1, 3])
def test_target_cut_draft_broad(K: int) -> None:
    """Target top-k/top-p, draft untruncated: drafts the target gives zero mass are never kept."""
    p, q = rows(13, K, COMBO2, T13, related=False)
    assert ((p > 0).sum(-1) >= 2).all() and (p[:K] == 0).any() and (q > 0).all()
    out = run_rounds(p, q, draw_drafts(q, torch.Generator().manual_seed(12)), seed=13)
    assert fits(output_p_value(p, out))


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("proposer", ["wrong_distribution", "draft_argmax", "constant"])
def test_unsampled_proposals_verified_as_one_hot(proposer: str, K: int) -> None:
    """q=None: proposals that were not sampled from any q (placeholders, a greedy draft for a
    sampled target) still give exactly p."""
    p, q = rows(21, K, TOPP, T07)
    g = torch.Generator().manual_seed(22)
    if proposer == "wrong_distribution":  # mostly the target's least likely tokens
        wrong = (-4 * p[:K]).softmax(-1)
        drafts = draw_drafts(wrong, g)
    elif proposer == "draft_argmax":
        drafts = q.argmax(-1).expand(ROUNDS, K)
    else:
        drafts = torch.zeros(ROUNDS, K, dtype=torch.long)
    out = run_rounds(p, None, drafts, seed=23)
    assert fits(output_p_value(p, out))


def test_unsampled_proposals_verified_against_a_q_are_biased() -> None:
    """Why q=None exists: proposals not drawn from q (a fast-backup placeholder) but tested
    with the ratio p/q against the draft's q come out biased, and the harness sees it."""
    K = 3
    p, q = rows(21, K, TOPP, T07)
    drafts = draw_drafts((-4 * p[:K]).softmax(-1), torch.Generator().manual_seed(22))
    assert output_p_value(p, run_rounds(p, q, drafts, seed=23)) < 1e-9
    assert fits(output_p_value(p, run_rounds(p, None, drafts, seed=23)))


def test_biased_rule_fails_the_same_test() -> None:
    """Foil: 'accept d only if it is the target's argmax, else sample from p' is biased towards
    the argmax. The harness must reject it while the real rule passes on the same rows."""
    K = 3
    p, q = rows(31, K, T13, T13)
    drafts = draw_drafts(q, torch.Generator().manual_seed(32))
    g = torch.Generator().manual_seed(33)
    mismatch = drafts != p[:K].argmax(-1)
    k = torch.cat([mismatch, torch.ones(ROUNDS, 1, dtype=torch.bool)], 1).byte().argmax(1)
    t = sample(p[k], g)
    assert output_p_value(p, emitted(drafts, k, t)) < 1e-9
    assert fits(output_p_value(p, run_rounds(p, q, drafts, seed=33)))


def test_harness_detects_one_percent_bias() -> None:
    """ROUNDS is enough: moving 1% of mass between two tokens fails the chi-square test."""
    p, _ = rows(41, 0, T13, T13)
    biased = p[0].clone()
    top, low = p[0].argmax(), p[0].argmin()
    biased[top] -= 0.01
    biased[low] += 0.01
    g = torch.Generator().manual_seed(42)
    fair = torch.multinomial(p[0], ROUNDS, replacement=True, generator=g)
    off = torch.multinomial(biased, ROUNDS, replacement=True, generator=g)
    assert fits(output_p_value(p, fair[:, None]))
    assert output_p_value(p, off[:, None]) < 1e-6


def test_identical_rows_always_accept() -> None:
    """p(d) / q(d) == 1 exactly must always accept, at every probability level."""
    K = 4
    p, _ = rows(51, K, COMBO, COMBO)
    drafts = draw_drafts(p[:K], torch.Generator().manual_seed(52))
    k, _ = verify_many(p.expand(ROUNDS, K + 1, V), drafts, p[:K].expand(ROUNDS, K, V),
                       torch.Generator().manual_seed(53))
    assert (k == K).all()


def test_zero_target_probability_never_accepted() -> None:
    p, _ = rows(61, 1, SamplingParams(top_k=2), T13)
    d = int(p[0].argmin())
    assert p[0, d] == 0
    for q in (None, torch.full((1, V), 1 / V)):
        for seed in range(50):
            v = verify(p, torch.tensor([d]), q, torch.Generator().manual_seed(seed))
            assert v.accepted == 0 and p[0, v.token] > 0


def test_residual_rounding_guard() -> None:
    """If the residual rounds to all zeros, the draw falls back to p_k instead of failing."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.75, 0.5, 0.0]])  # p <= q everywhere: max(0, p - q) == 0
    seen = set()
    for seed in range(200):
        v = verify(p, torch.tensor([0]), q, torch.Generator().manual_seed(seed))
        if v.accepted == 0:
            seen.add(v.token)
    assert seen == {0, 1}


GREEDY = SamplingParams.greedy()


@pytest.mark.parametrize("K", [0, 1, 4])
@pytest.mark.parametrize("draft_rows", ["one_hot", "soft", "none"])
def test_greedy_accepts_exactly_the_matching_prefix(K: int, draft_rows: str) -> None:
    gen = torch.Generator().manual_seed(K)
    for trial in range(40):
        target_logits = torch.randn(K + 1, V, generator=gen)
        p = probs_from_logits(target_logits, GREEDY)
        best = target_logits.argmax(-1)
        match = int(torch.randint(0, K + 1, (), generator=gen))  # drafts agree up to here
        draft_logits = torch.randn(K, V, generator=gen)
        for i in range(K):  # plant the draft's argmax: the target's before `match`, another at it
            token = best[i] if i < match else (best[i] + 1 + trial % (V - 1)) % V
            draft_logits[i, token] = 10.0
        if draft_rows == "one_hot":
            q = probs_from_logits(draft_logits, GREEDY)
            drafts = q.argmax(-1)
        elif draft_rows == "soft":
            q = probs_from_logits(draft_logits / 5, SamplingParams(temperature=1.0))
            drafts = draft_logits.argmax(-1)  # may be any token q gives mass
        else:
            q, drafts = None, draft_logits.argmax(-1)
        expected = Verdict(accepted=match, token=int(best[match]))
        for generator in (None, torch.Generator().manual_seed(trial)):
            assert verify(p, drafts, q, generator) == expected
        # the round's greedy path
        assert greedy_tree(target_logits.argmax(-1).tolist(), drafts.tolist(), []) == (match, [], int(best[match]))


def test_greedy_path_breaks_ties_as_the_one_hot_rule() -> None:
    """Tied maxima: the one-hot p of probs_from_logits and torch's argmax (greedy_tree's input) pick
    the same token."""
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    p = probs_from_logits(logits, GREEDY)
    for drafts in ([1, 0], [2, 0], [1, 1], [3, 3]):
        k, _, token = greedy_tree(logits.argmax(-1).tolist(), drafts, [])
        assert Verdict(k, token) == verify(p, torch.tensor(drafts), None, None)


def test_greedy_bonus_with_k0() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9, 0.0, 0.0]])
    p = probs_from_logits(logits, GREEDY)
    for seed in range(20):
        assert verify(p, torch.zeros(0, dtype=torch.long), None, torch.Generator().manual_seed(seed)) \
            == Verdict(accepted=0, token=1)
        assert verify(p, torch.zeros(0, dtype=torch.long), torch.zeros(0, V), None) == Verdict(0, 1)


def test_seeded_generator_reproduces_verdicts() -> None:
    K = 3
    p, q = rows(71, K, COMBO, T13)
    drafts = draw_drafts(q, torch.Generator().manual_seed(72))[:300]

    def run(seed: int) -> list[Verdict]:
        g = torch.Generator().manual_seed(seed)
        return [verify(p, d, q, g) for d in drafts] + [verify(p, d, None, g) for d in drafts]

    first = run(5)
    assert first == run(5)
    assert first != run(6)
    assert len({(v.accepted, v.token) for v in first}) > 5  # the rounds really are random


def test_verify_is_verify_many_of_one() -> None:
    K = 2
    p, q = rows(81, K, T07, T07)
    drafts = draw_drafts(q, torch.Generator().manual_seed(82))[:50]
    for seed, d in enumerate(drafts):
        k, t = verify_many(p[None], d[None], q[None], torch.Generator().manual_seed(seed))
        assert verify(p, d, q, torch.Generator().manual_seed(seed)) == Verdict(int(k), int(t))
