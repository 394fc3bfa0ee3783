"""Fan-out policies: how the draft tree's branch budget is spread over the depths."""
import pytest

from ssd.errors import SSDError
from ssd.speculative.draft.fanout import MAX_RANK, FanOut, check_fan_out


def test_uniform_and_short_speculations():
    f = FanOut(4, 3)
    assert f.sizes(5, after_hit=True) == [3] * 5 == f.sizes(5, after_hit=False)
    assert f.sizes(2, after_hit=True) == [3, 3]  # a speculation of 1 token: depth 0 and its bonus
    assert f.max_size == 3


def test_lists_after_hit_and_after_miss():
    f = FanOut(4, [4, 3, 2, 1, 2], miss=[6, 1, 0, 0, 1])
    assert f.sizes(5, after_hit=True) == [4, 3, 2, 1, 2]
    assert f.sizes(5, after_hit=False) == [6, 1, 0, 0, 1]
    assert f.sizes(3, after_hit=True) == [4, 3, 2]  # depths 0, 1, then the bonus size
    assert f.max_size == 6


@pytest.mark.parametrize("hit, miss, match", [
    ([1, 2, 3], None, "list of K\\+1"), ([0, 0, 0, 0, 0], None, "not all 0"), (0, None, ">= 1"),
    ("more", None, "fan_out must be"), (2, [1, -1, 0, 0, 0], "fan_out_miss"), ("auto", 2, "auto"),
])
def test_bad_fan_outs(hit, miss, match):
    with pytest.raises(SSDError, match=match):
        check_fan_out(4, hit, miss, None)


def test_auto_spends_the_budget_where_rounds_end():
    f = FanOut(4, "auto", budget=10)
    prior = f.sizes(5, after_hit=True)
    assert sum(prior) == 10 and prior[0] >= prior[2]  # the prior: geometric acceptance
    for _ in range(500):  # after misses every round ends at depth 0; after hits all accept
        f.observe(False, 0, 0)
        f.observe(False, 0, 1)
        f.observe(True, 4, 0)
    after_miss, after_hit = f.sizes(5, after_hit=False), f.sizes(5, after_hit=True)
    # Ranks 0 and 1 are all that ever occur: two forks where the rounds end, the rest of the
    # budget unspent but for the prior's small chance of other depths.
    assert after_miss[0] == 2 and sum(after_miss) < 10 and max(after_miss[1:4]) == 0, after_miss
    assert after_hit[4] == max(after_hit) == 2 and sum(after_hit) < 10, after_hit


def test_auto_stops_where_forks_would_never_hit():
    f = FanOut(3, "auto", budget=40)
    for _ in range(2000):
        for depth in range(4):
            f.observe(True, depth, 0)  # the target's token is always the draft's first choice
    sizes = f.sizes(4, after_hit=True)
    assert sizes == [1, 1, 1, 1], sizes


def test_auto_counts_tokens_beyond_the_candidates():
    f = FanOut(2, "auto", budget=6)
    for _ in range(1000):
        f.observe(True, 1, None)  # never among the candidates: no fork helps
    assert f.rank_counts[MAX_RANK] == 1000
    # The prior's guess that the draft's first choice is often right fades with the evidence:
    # one branch is left, where the rounds end (the prior alone would put all six there) ...
    assert f.sizes(3, after_hit=True) == [0, 1, 0]
    for _ in range(4000):
        f.observe(True, 1, None)
    # ... and none once no fork is worth MIN_GAIN: the budget goes unspent.
    assert f.sizes(3, after_hit=True) == [0, 0, 0] == f.sizes(3, after_hit=False)


def test_a_late_build_caps_the_tree_at_the_likeliest_forks():
    f = FanOut(2, 3)  # 3 forks at each of depths 0, 1 and 2: 9 branches
    f.fit(9, build_s=0.080, wait_s=0.0)  # the target's request waited for this build
    assert f.cap == 7
    sizes = f.sizes(3, after_hit=True)
    # The prior ends most rounds at depth 2 (all accepted) and ranks the draft's first choice
    # highest: the two forks dropped are the least likely outcomes, at most F per depth kept.
    assert sum(sizes) == 7 and sizes[2] == 3 and max(sizes) <= 3, sizes
    f.fit(7, build_s=0.060, wait_s=0.0007)  # what receiving a waiting request takes: late again
    assert f.cap == 6
    for _ in range(10):
        f.fit(1, build_s=0.040, wait_s=0.0)
    assert f.cap == 1 and sum(f.sizes(3, after_hit=False)) == 1


def test_the_cap_grows_while_the_draft_waits_longer_than_a_branch_costs():
    f = FanOut(2, 3)
    f.fit(9, build_s=0.080, wait_s=0.0)
    f.fit(7, build_s=0.060, wait_s=0.005)  # a branch cost at most 60/7 ms: 5 ms is not room for one
    assert f.cap == 7
    f.fit(7, build_s=0.060, wait_s=0.020)
    assert f.cap == 8
    f.fit(4, build_s=0.030, wait_s=0.050)  # a smaller tree than the cap (a short speculation): no news
    assert f.cap == 8


def test_a_draft_that_keeps_up_is_never_capped():
    f = FanOut(4, 3)
    for _ in range(100):
        f.fit(15, build_s=0.004, wait_s=0.010)  # a draft on its own GPU
    assert f.cap is None and f.sizes(5, after_hit=True) == [3] * 5


def test_trees_of_a_batch_share_the_cap():
    f = FanOut(3, "auto", budget=12)
    f.fit(8, build_s=0.050, wait_s=0.0)
    assert f.cap == 6
    assert sum(f.sizes(4, after_hit=True, trees=3)) == 2
    assert sum(f.sizes(4, after_hit=True, trees=8)) == 1  # every tree keeps one branch
