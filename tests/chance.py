"""The bar of the suite's distribution tests. Each p-value a test checks must exceed PASS, and a
run checks at most CHECKS of them (conftest.py fails a run that checks more), so a correct engine
fails some distribution test of a run by chance less than once in 1 / FAMILY runs (Bonferroni:
CHECKS x PASS = FAMILY). Foils are held below PASS: a biased rule's p-values are far smaller."""

FAMILY = 1e-3
CHECKS = 400
PASS = FAMILY / CHECKS

checked = 0  # p-values checked in this run


def fits(p: float) -> bool:
    """Whether a p-value passes (and count it)."""
    global checked
    checked += 1
    return p > PASS
