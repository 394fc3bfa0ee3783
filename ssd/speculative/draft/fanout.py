"""Fan-out: how many fork tokens F_j the draft tries at each depth j = 0..K of a speculation.

Depth j < K stands for "d_1..d_j accepted, d_{j+1} rejected" (the fork tokens are the draft's
most likely recovery tokens, d_{j+1} excluded); depth K for "all accepted" (the most likely
bonus tokens). The speculation cache holds one branch per fork, so sum F_j = B, the branch
budget, sets the size of the draft tree.

Three policies:
- uniform: F_j = F at every depth (the reference engine's default, F = 3);
- explicit lists of K+1 sizes, one used after a cache hit and another after a miss (after a
  fast-backup miss nearly every outcome is "0 accepted", so the budget belongs at depth 0);
- "auto": the budget is spent where it buys the most hits, from what the engine measures as
  it runs: how often a round ends at each depth (separately after hits and misses), and how
  often the target's token is the draft's n-th choice. The n-th fork at depth j is worth
  P(end at j) * P(rank n); the B forks go greedily to the largest values, and none goes to a
  fork worth less than MIN_GAIN (every branch costs draft compute). Until enough rounds are
  seen, a prior (acceptance 0.8 per token, rank probabilities falling like 1/(n+1)^2) stands
  in for the measurements.

Whatever the policy, the tree must be built while the target verifies, or the target waits
for it every round. Where the draft computes its branches one by one (a CPU core), a tree
of 3 forks at each of K+1 depths takes longer than that, so the worker tells `fit` how each
build went against the target's next request, and a cap on the branches follows: it drops
by a quarter (at least one) after a build that the request had to wait for, and rises by one
while the draft waits longer than a branch costs. Over the cap, the forks kept are the most
likely outcomes, by the same estimates as "auto". Where the draft is fast (its own GPU) the
cap never binds.
"""
from collections.abc import Sequence

from ssd.checks import check_int, is_int
from ssd.errors import SSDError

MAX_RANK = 16  # ranks beyond this are counted as "not among the candidates"
PRIOR_WEIGHT = 8.0  # pseudo-rounds of the prior in the auto estimates
PRIOR_ACCEPT = 0.8
MIN_GAIN = 1e-3  # auto: a fork must be the outcome at least this often to get a branch
# The draft's wait below which a build counts as late: above what receiving a request that was
# already there takes (docs/decision-log.md).
LATE_S = 2e-3


def check_fan_out(k_max: int, hit: int | Sequence[int] | str, miss: int | Sequence[int] | None,
                  budget: int | None) -> None:
    """Raise SSDError for a fan-out that FanOut cannot take (the speculation options' check,
    and a worker's check of the configuration it is sent)."""
    if hit == "auto":
        if miss is not None:
            raise SSDError("fan_out='auto' chooses the sizes after a miss too; drop fan_out_miss")
        if budget is not None:
            check_int("the tree budget", budget, 1)
        return
    if isinstance(hit, str):
        raise SSDError(f"fan_out must be an int, a list of K+1 ints or 'auto', got {hit!r}")
    for spec, what in ((hit, "fan_out"), (miss, "fan_out_miss")):
        if is_int(spec) and spec < 1:
            raise SSDError(f"{what} must be >= 1, got {spec}")
        if spec is None or is_int(spec):
            continue
        if not (isinstance(spec, (list, tuple)) and len(spec) == k_max + 1 and all(is_int(f) and f >= 0 for f in spec)
                and any(spec)):
            raise SSDError(f"{what} must be one int or a list of K+1 = {k_max + 1} ints >= 0 (one per depth "
                           f"0..K), not all 0; got {spec!r}")


def _sizes(spec: int | Sequence[int], k_max: int) -> list[int]:
    return [spec] * (k_max + 1) if is_int(spec) else list(spec)


class FanOut:
    def __init__(self, k_max: int, hit: int | Sequence[int] | str = 3, miss: int | Sequence[int] | None = None,
                 budget: int | None = None):
        self.k_max = k_max
        """hit, miss, budget: as checked by check_fan_out."""
        self.auto = hit == "auto"
        if self.auto:
            self.budget = budget if budget is not None else 3 * (k_max + 1)
        else:
            self.hit = _sizes(hit, k_max)
            self.miss = _sizes(miss, k_max) if miss is not None else self.hit
        # Measured: rounds ending at each depth, after a hit [1] or a miss [0]; target-token ranks.
        self.depth_counts = [[0] * (k_max + 1), [0] * (k_max + 1)]
        self.rank_counts = [0] * (MAX_RANK + 1)  # [MAX_RANK]: beyond the candidates
        self.cap: int | None = None  # most branches per build that the target's verification hides (fit)

    @property
    def max_size(self) -> int:
        return self.budget if self.auto else max(max(self.hit), max(self.miss))

    def sizes(self, depths: int, after_hit: bool, trees: int = 1) -> list[int]:
        """F_0..F_{depths-1} for a speculation of depths-1 tokens (the last depth is the bonus),
        one of `trees` sequences' trees that share the cap."""
        cap = None if self.cap is None else max(1, self.cap // trees)
        if self.auto:
            return self._allocate(depths, after_hit, self.budget if cap is None else min(cap, self.budget))
        full = self.hit if after_hit else self.miss
        sizes = full[:depths - 1] + [full[-1]]
        return sizes if cap is None or sum(sizes) <= cap else self._allocate(depths, after_hit, cap, sizes)

    def fit(self, branches: int, build_s: float, wait_s: float) -> None:
        """A build of `branches` forks took build_s, then the draft waited wait_s for the
        target's next request (about 0: the request came before the build ended)."""
        if branches < 1:
            return
        if wait_s < LATE_S:
            self.cap = max(1, branches - max(1, branches // 4))
        elif self.cap is not None and branches >= self.cap and wait_s > 1.5 * build_s / branches:
            self.cap += 1  # room for another branch, at what one costs at most

    def observe(self, after_hit: bool, depth: int, rank: int | None) -> None:
        """A round ended at `depth`; the target's token was the draft's candidate number
        `rank` there (0 = most likely), or not among the first MAX_RANK (None)."""
        self.depth_counts[after_hit][min(depth, self.k_max)] += 1
        self.rank_counts[MAX_RANK if rank is None or rank >= MAX_RANK else rank] += 1

    def _depth_probs(self, depths: int, after_hit: bool) -> list[float]:
        prior = [PRIOR_ACCEPT ** j * (1 - PRIOR_ACCEPT) for j in range(depths - 1)] + [PRIOR_ACCEPT ** (depths - 1)]
        counts = self.depth_counts[after_hit][:depths - 1] + [sum(self.depth_counts[after_hit][depths - 1:])]
        total = sum(counts)
        return [(c + PRIOR_WEIGHT * p) / (total + PRIOR_WEIGHT) for c, p in zip(counts, prior)]

    def _rank_probs(self) -> list[float]:
        prior = [1 / (n + 1) ** 2 for n in range(MAX_RANK)]
        norm = sum(prior) * 1.25  # a fifth of the prior mass is "beyond the candidates"
        total = sum(self.rank_counts)
        return [(c + PRIOR_WEIGHT * p / norm) / (total + PRIOR_WEIGHT)
                for c, p in zip(self.rank_counts, prior)]

    def _allocate(self, depths: int, after_hit: bool, budget: int, limits: list[int] | None = None) -> list[int]:
        """The `budget` forks worth most, at most limits[j] at depth j."""
        p_depth, p_rank = self._depth_probs(depths, after_hit), self._rank_probs()
        limits = [min(f, MAX_RANK) for f in limits] if limits else [MAX_RANK] * depths
        sizes = [0] * depths
        for _ in range(budget):
            gains = [p_depth[j] * p_rank[sizes[j]] if sizes[j] < limits[j] else 0.0 for j in range(depths)]
            best = max(range(depths), key=gains.__getitem__)
            if gains[best] < MIN_GAIN:
                break
            sizes[best] += 1
        return sizes
