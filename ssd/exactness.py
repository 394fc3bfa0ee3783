"""Exactness a user can check on their own machine (`ssd check`), and the statistics the test
suite's distribution tests use: one implementation for both.

A speculative configuration (SD or SSD, with every option the user runs) is compared with plain
decoding of the same target:

  greedy   each prompt's greedy continuation, token for token;
  seeded   (given a seed) each prompt's sampled continuation with that seed, token for token:
           seeded requests draw by shared noise (ssd/request/noise.py), which pins their tokens
           in every mode;
  sampled  many short unseeded samples per prompt from each engine, and a chi-square test of
           homogeneity on the joint distribution of their first tokens (cells expected below
           5 times pooled). Under exactness both samples come from one distribution.

A test that cannot fail proves nothing, so each sampled check also states its power against a
foil: the draft model's own distribution, which a speculative rule that accepts draft tokens
too easily drifts towards. The foil is sampled for real, tested the same way against plain
decoding, and the power is estimated by resampling both empirical distributions.
"""
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from ssd.sampling_params import SamplingParams


# ---- statistics ---------------------------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of counts [V] against probs [V]. Tokens with
    zero probability must have zero count (never emitted); they add no degrees of freedom."""
    probs = probs.double()
    support = probs > 0
    if counts[~support].sum() != 0:
        raise AssertionError(f"emitted a token of zero target probability: {counts} vs {probs}")
    expected = counts.sum() * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    return float(stat), int(support.sum()) - 1


def p_value(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (what scipy.stats.chi2.sf gives)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def pooled_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit of counts [V] to probs [V], the cells expected below min_expected pooled."""
    expected = counts.sum() * probs
    small = expected < min_expected
    c = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    p = torch.cat([probs[~small], probs[small].sum(0, keepdim=True)])
    return p_value(*chi_square(c, p))


def homogeneity(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Chi-square test that two samples (counts by outcome) come from one distribution: the
    2 x C contingency table, outcomes expected below min_expected in either sample pooled into
    one cell. Returns (statistic, degrees of freedom, p-value)."""
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        raise ValueError("homogeneity needs two non-empty samples")
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    share = min(na, nb) / (na + nb)
    big = [k for k in keys if (a[k] + b[k]) * share >= min_expected]
    rest = [k for k in keys if (a[k] + b[k]) * share < min_expected]
    table = [[a[k], b[k]] for k in big]
    if rest:
        table.append([sum(a[k] for k in rest), sum(b[k] for k in rest)])
    t = torch.tensor(table, dtype=torch.float64)
    if t.shape[0] < 2:
        return 0.0, 0, 1.0
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = float(((t - expected) ** 2 / expected).sum())
    df = t.shape[0] - 1
    return stat, df, p_value(stat, df)


def power(a: Counter, b: Counter, n: int, alpha: float, trials: int = 200, seed: int = 0) -> float:
    """Estimated chance that homogeneity() on n draws from each of the empirical distributions
    a and b gives p < alpha (a parametric bootstrap)."""
    keys = sorted(set(a) | set(b))
    pa = torch.tensor([a[k] for k in keys], dtype=torch.float64)
    pb = torch.tensor([b[k] for k in keys], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    rejected = 0
    for _ in range(trials):
        da = torch.multinomial(pa, n, replacement=True, generator=gen).bincount(minlength=len(keys)).tolist()
        db = torch.multinomial(pb, n, replacement=True, generator=gen).bincount(minlength=len(keys)).tolist()
        _, _, p = homogeneity(Counter(dict(zip(keys, da))), Counter(dict(zip(keys, db))))
        rejected += p < alpha
    return rejected / trials


# ---- the check ----------------------------------------------------------------------------
@dataclass
class GreedyResult:
    prompt: int
    tokens: int  # plain decoding's tokens
    first_difference: int | None  # the first index where the speculative tokens differ; None: equal


@dataclass
class SampledResult:
    prompt: int
    samples: int  # per engine
    outcomes: int  # distinct first-token tuples seen
    p: float  # homogeneity of speculative vs plain
    foil_p: float | None = None  # homogeneity of the foil (the draft alone) vs plain
    foil_power: float | None = None  # chance of rejecting the foil with this many samples


@dataclass
class Report:
    alpha: float  # the family-wise level: each of the n sampled tests is held to alpha / n
    greedy: list[GreedyResult] = field(default_factory=list)
    seeded: list[GreedyResult] = field(default_factory=list)  # the seeded sampled continuations
    sampled: list[SampledResult] = field(default_factory=list)

    @property
    def threshold(self) -> float:
        return self.alpha / max(1, len(self.sampled))

    @property
    def passed(self) -> bool:
        return (all(g.first_difference is None for g in self.greedy + self.seeded)
                and all(s.p >= self.threshold for s in self.sampled))

    def lines(self) -> list[str]:
        out = []
        for kind, results in (("greedy", self.greedy), ("seeded", self.seeded)):
            for g in results:
                verdict = "equal" if g.first_difference is None else f"DIFFERENT from token {g.first_difference}"
                out.append(f"{kind:8s} prompt {g.prompt}: {g.tokens} tokens, {verdict}")
        for s in self.sampled:
            line = (f"sampled  prompt {s.prompt}: {s.samples} samples each, {s.outcomes} outcomes, p = {s.p:.3g}"
                    f" ({'ok' if s.p >= self.threshold else 'REJECTED'})")
            if s.foil_p is not None:
                line += f"; foil (draft alone) p = {s.foil_p:.3g}, power against it {s.foil_power:.0%}"
            out.append(line)
        if self.sampled:
            out.append(f"sampled tests at level {self.alpha:g} over {len(self.sampled)} prompts "
                       f"(each p >= {self.threshold:.3g} passes)")
        out.append("verdict: " + ("PASS: the speculative outputs match plain decoding" if self.passed
                                  else "FAIL: the speculative outputs differ from plain decoding"))
        return out


def greedy_runs(llm, prompts: list, params: SamplingParams) -> list[list[int]]:
    """Each prompt's token ids (params with temperature 0, or seeded)."""
    return [o.token_ids for o in llm.generate(prompts, params)]


def sample_runs(llm, prompt, params: SamplingParams, n: int) -> Counter:
    """Counts of the token-id tuples of n samples without a seed of their own: drawn from the
    engine's generator and verified by rejection sampling (a seeded request's draws are its
    seed's: the seeded check compares those token for token)."""
    outs = llm.generate([prompt] * n, replace(params, seed=None))
    return Counter(tuple(o.token_ids) for o in outs)


def check(model, draft, prompts: list, *, mode: str = "sd", engine: dict | None = None,
          spec: dict | None = None, params: SamplingParams | None = None, greedy_tokens: int = 64,
          samples: int = 400, sample_tokens: int = 4, alpha: float = 0.01, foil: bool = True,
          seed: int | None = None, log=lambda line: None) -> Report:
    """Run the check. engine: LLM options shared by every engine (device, threads, weights ...);
    spec: the speculative engine's own options (speculate_k, fan_out ...). params: the sampling
    params checked (temperature 0: the greedy check only); their max_tokens is replaced by
    greedy_tokens and sample_tokens. seed: where sampled, each prompt's continuation of
    greedy_tokens with this seed is compared token for token (under seeded_sampling
    "shared-noise", the default); the engines' generators are seeded from it. One engine is
    loaded at a time."""
    from ssd import LLM

    engine, spec = engine or {}, spec or {}
    params = params or SamplingParams(temperature=1.0)
    greedy = replace(params, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, max_tokens=greedy_tokens)
    sampled = None if params.temperature == 0 else replace(params, max_tokens=sample_tokens)
    noise = engine.get("seeded_sampling", "shared-noise") == "shared-noise"
    seeded = replace(params, max_tokens=greedy_tokens, seed=seed) if noise and seed is not None and sampled else None
    seed = seed or 0
    batch = max(16, min(samples, 64))
    runs: dict[str, tuple[list, list]] = {}
    # Plain decoding, the speculative engine, then the draft alone (the foil); their generators
    # seeded apart.
    engines = [("plain", model, engine, 0), (mode, model, dict(engine, draft=draft, mode=mode, **spec), 1)]
    if foil and sampled is not None:
        engines.append(("foil", draft, engine, 2))
    for name, path, options, k in engines:
        log(f"{name}: loading {path}")
        with LLM(path, max_num_seqs=batch, seed=seed + k * 1_000_003, **options) as llm:
            g = greedy_runs(llm, prompts, greedy) if name != "foil" else []
            if seeded is not None and name != "foil":
                g.extend(greedy_runs(llm, prompts, seeded))
            s = []
            if sampled is not None:
                for i, prompt in enumerate(prompts):
                    log(f"{name}: {samples} samples of prompt {i}")
                    s.append(sample_runs(llm, prompt, sampled, samples))
            runs[name] = (g, s)
    report = Report(alpha)
    plain_g, plain_s = runs["plain"]
    spec_g, spec_s = runs[mode]
    for i, (a, b) in enumerate(zip(plain_g, spec_g)):
        diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        (report.greedy if i < len(prompts) else report.seeded).append(GreedyResult(i % len(prompts), len(a), diff))
    for i, (a, b) in enumerate(zip(plain_s, spec_s)):
        result = SampledResult(i, samples, len(set(a) | set(b)), homogeneity(a, b)[2])
        if "foil" in runs:
            f = runs["foil"][1][i]
            result.foil_p = homogeneity(a, f)[2]
            result.foil_power = power(a, f, samples, alpha / len(plain_s))  # each test's level, as Report.threshold
        report.sampled.append(result)
    return report
