"""Sibling leaves: SD's chain of draft tokens plus, at some depths, the draft's runner-up as a
one-token alternative that the target scores in the same verify pass (the simplest draft
tree).

At depth j the chain proposes d_j, the draft's top choice; its runner-up s_j is a sibling
leaf: one more verify row, at d_j's position, that sees the chain's tokens before depth j and
itself (the tree mask as attention rows: `Chunk.forks`, ssd/runner/model_runner.py). Greedy
verification follows the target's argmax down the tree: where the chain's first rejected
depth j has a sibling equal to the target's token there, the sibling is taken and its own row
gives one more token, so the round gains one token over the chain (`verifier.rescue`); its K/V move to
d_j's slot. No draft pass is added: the runner-up comes from the step that drafted d_j.

Which depths get one: the likeliest rescues first, while a rescue's expected token is worth
more than one more verify row costs at the round's rate (tokens per second). A rescue at depth
j needs the chain to reach j, the draft's top choice there to be wrong and its runner-up
right: by the draft's own probabilities prod_{i<j} p1_i x p2_j, scaled by a factor learnt
from the rounds (rescues seen / rescues expected, decayed), since a small draft's
probabilities are not the target's. Where a wider pass costs more than it gains, no sibling
is chosen and the round is today's chain.

Sampled requests: the chain's d_j is drawn from the draft's q_j and the sibling is the
likeliest other token of q_j, a function of q_j and d_j alone, so it is a fair one-hot
candidate. Verification is the multi-candidate rule (recursive rejection sampling,
verifier.verify_with_siblings): at the first rejected depth the token is due from the residual
r = norm(max(0, p - q)); the sibling there is taken with probability r(s), else the token is
drawn from r without s, which is again exactly r; a taken sibling's row then gives the next
token, drawn from p there. Requests whose logits something changes (penalties, a
constraint) or that ask for logprobs keep the chain.

A feature head's tree (EAGLE-2's dynamic tree, feature_head.py): for a greedy request the head
also expands its likeliest candidates off the chain a few depths down and offers them all
(`Proposal.candidates`), each promising its path's product of the head's probabilities. The
same rule chooses among them, the likeliest first and a branch only after its parent, and
greedy verification walks the tree (verifier.greedy_tree): each taken branch is one more token.
"""
from collections.abc import Callable
from dataclasses import dataclass

from ssd.request.sequence import Sequence
from ssd.runner.kv_cache import PagedKVCache
from ssd.speculative.policy.costs import expected_tokens
from ssd.speculative.policy.estimators import DecayedRatio
from ssd.speculative.policy.tunables import BRANCH_DECAY, BRANCH_PRIOR_RESCUES, MAX_PER_SEQUENCE
from ssd.speculative.records import Alternative, Branch, Proposal, Round


def eligible(seq: Sequence) -> bool:
    """A request whose verification over a tree is written here: its logits unchanged (no
    penalties or constraint) and no logprobs asked for."""
    return seq.processor is None and seq.params.logprobs is None


def sibling_candidates(alternatives: list[Alternative]) -> list[Branch]:
    """The chain's runners-up as candidate branches: the one at depth j (0-based) hangs off
    chain node j and promises that the chain reaches it and the target takes it there."""
    out, reach = [], 1.0
    for j, a in enumerate(alternatives):
        out.append(Branch(j, a.token, reach * a.p2))
        reach *= a.p1
    return out


def choose(candidates: list[list[Branch]], chains: list[int], rate: float, verify: Callable[[int], float], rows: int,
           calibrations: list[float]) -> list[list[Branch]]:
    """Per sequence, its branches: candidates[b] are sequence b's candidates off its chain of
    chains[b] drafts (a parent past the chain is the candidate n + 1 + i); rate: tokens per
    second the round makes without branches; verify(rows): the target's pass over that many
    rows; rows: the chains'; calibrations[b]: branch tokens taken per token their promises
    promised, for sequence b's kind of proposal. The likeliest first, a branch only after its
    parent (re-indexed into the chosen tree) and no deeper than the chain, while a row's
    expected token is worth more than the row costs."""
    pool = sorted(((calibrations[b] * c.promise, b, i) for b, cs in enumerate(candidates) for i, c in enumerate(cs)),
                  key=lambda c: -c[0])  # stable: a parent (never less likely) before its children
    chosen: list[list[Branch]] = [[] for _ in candidates]
    at: list[dict[int, int]] = [{} for _ in candidates]  # candidate index -> its index among the chosen
    depth: list[dict[int, int]] = [{} for _ in candidates]  # chosen candidate index -> its depth
    for worth, b, i in pool:
        c, n = candidates[b][i], chains[b]
        if len(chosen[b]) == MAX_PER_SEQUENCE or (c.parent > n and c.parent - n - 1 not in at[b]):
            continue
        # No deeper than the chain: the round's K (round_k) bounds the tokens it may add.
        depth[b][i] = c.parent + 1 if c.parent <= n else depth[b][c.parent - n - 1] + 1
        if depth[b][i] > n:
            continue
        if worth <= rate * (verify(rows + 1) - verify(rows)):
            break
        at[b][i] = len(chosen[b])
        chosen[b].append(Branch(c.parent if c.parent <= n else n + 1 + at[b][c.parent - n - 1], c.token, c.promise))
        rows += 1
    return chosen


@dataclass(frozen=True)
class SiblingOffer:
    """A round's terms for branches, set when the K policy plans it: the round chooses them
    (`choose`) once the chains are drafted, at the rate the chains make."""

    rates: list[list[float]]  # per sequence, its acceptance by position a_1..a_k_max
    eligible: list[bool]  # per sequence: eligible()
    draft_step: float  # seconds per draft step
    verify: Callable[[int], float]  # the target's pass by rows
    calibration: float  # the draft's branches' (SiblingPolicy.calibration)
    lookup_calibration: float  # a lookup's (suffix decoding's tree)

    def choose(self, proposals: list[Proposal], room: list[bool]) -> list[list[Branch]]:
        """The branches of each sequence's chain: room[b], the KV cache has the slots for
        sequence b's (else none)."""
        gain = sum(expected_tokens(r[:len(p.tokens)])[-1] for r, p in zip(self.rates, proposals))
        rows = sum(len(p.tokens) + 1 for p in proposals)
        deepest = max((len(p.tokens) for p in proposals if not p.lookup), default=0)
        rate = gain / max(deepest * self.draft_step + self.verify(rows), 1e-9)
        wanted = [offered(p) if ok and fits and (not p.lookup or p.candidates) else []
                  for p, ok, fits in zip(proposals, self.eligible, room)]
        return choose(wanted, [len(p.tokens) for p in proposals], rate, self.verify, rows,
                      [self.lookup_calibration if p.lookup else self.calibration for p in proposals])


def offered(p: Proposal) -> list[Branch]:
    """A proposal's candidate branches: a tree (a head's, a suffix match's), else the draft's runners-up."""
    return p.candidates or sibling_candidates(p.alternatives)


def cut(branches: list[Branch], n: int, k: int) -> list[Branch]:
    """A tree's branches once its chain of n drafts is cut to its first k: those that hang off
    what is left and go no deeper than k, re-indexed."""
    out: list[Branch] = []
    at: dict[int, int] = {}  # index -> index in out
    depth: dict[int, int] = {}
    for i, b in enumerate(branches):
        if b.parent <= n:
            if b.parent > k:
                continue
            parent, d = b.parent, b.parent + 1
        elif b.parent - n - 1 in at:
            parent, d = k + 1 + at[b.parent - n - 1], depth[b.parent - n - 1] + 1
        else:
            continue
        if d <= k:
            at[i], depth[i] = len(out), d
            out.append(Branch(parent, b.token, b.promise))
    return out


class SiblingPolicy:
    """How often one kind of proposal's branches are taken, learnt from its rounds."""

    def __init__(self) -> None:
        # Branch tokens taken among those the draft's probabilities promised, decayed.
        self.taken = DecayedRatio(BRANCH_DECAY)

    @property
    def calibration(self) -> float:
        return self.taken.rate(1.0, BRANCH_PRIOR_RESCUES)

    def learn(self, rounds: list[Round]) -> None:
        """Rounds of this policy's kind (the draft's, or a lookup's)."""
        for r in rounds:
            if r.branches:
                self.taken.observe(r.rescued, sum(b.promise for b in r.branches))


def keep_path(cache: PagedKVCache, seq: Sequence, path: list[int], chain: int) -> None:
    """The target's K/V of the taken branches (written after the chain's `chain` + 1 rows) into
    the slots of the depths they take: path[d - 1] is the tree node kept at depth d."""
    start = seq.num_tokens - 1  # the newest token's position: tree node 0
    for depth, node in enumerate(path, 1):
        if node > chain:
            cache.copy_position(seq.seq_id, start + node, start + depth)
