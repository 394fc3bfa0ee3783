"""Goodness-of-fit helpers for the distribution tests (no scipy needed)."""
import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of counts [V] against probs [V]. Tokens with
    zero probability must have zero count (never emitted); they add no degrees of freedom."""
    probs = probs.double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"emitted a token of zero target probability: {counts} vs {probs}"
    expected = counts.sum() * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    return float(stat), int(support.sum()) - 1


def p_value(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (what scipy.stats.chi2.sf gives)."""
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
