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
"""
from collections.abc import Callable
from dataclasses import dataclass

from ssd.request.sequence import Sequence
from ssd.runner.kv_cache import PagedKVCache
from ssd.speculative.policy.costs import expected_tokens
from ssd.speculative.records import Alternative, Proposal, Round, Sibling

MAX_PER_SEQUENCE = 4  # sibling rows a sequence's round may add
DECAY = 0.98  # per round with siblings: the calibration follows the recent text
PRIOR_WEIGHT = 2.0  # expected rescues' worth of the prior factor 1


def eligible(seq: Sequence) -> bool:
    """A request whose verification over a tree is written here: its logits unchanged (no
    penalties or constraint) and no logprobs asked for."""
    return seq.processor is None and seq.params.logprobs is None


def choose(alternatives: list[list[Alternative]], rate: float, verify: Callable[[int], float], rows: int,
           calibration: float) -> list[list[Sibling]]:
    """Per sequence, its siblings: alternatives[b] are sequence b's drafted tokens' runners-up
    (empty: none wanted); rate: tokens per second the round makes without siblings;
    verify(rows): the target's pass over that many rows; rows: the chain's; calibration:
    rescues seen per rescue the draft's probabilities promised. Each sibling carries its
    (uncalibrated) promise, which the policy learns from."""
    pool = []
    for b, alts in enumerate(alternatives):
        reach = 1.0
        for j, a in enumerate(alts):
            pool.append((reach * a.p2, b, j, a.token))
            reach *= a.p1
    pool.sort(key=lambda c: -c[0])
    chosen: list[list[Sibling]] = [[] for _ in alternatives]
    for promise, b, depth, token in pool:
        if len(chosen[b]) == MAX_PER_SEQUENCE:
            continue
        if calibration * promise <= rate * (verify(rows + 1) - verify(rows)):
            break
        chosen[b].append(Sibling(depth, token, promise))
        rows += 1
    return chosen


@dataclass(frozen=True)
class SiblingOffer:
    """A round's terms for sibling leaves, set when the K policy plans it: the round chooses
    them (`choose`) once the chains are drafted, at the rate the chains make."""

    rates: list[list[float]]  # per sequence, its acceptance by position a_1..a_k_max
    eligible: list[bool]  # per sequence: eligible()
    draft_step: float  # seconds per draft step
    verify: Callable[[int], float]  # the target's pass by rows
    calibration: float

    def choose(self, proposals: list[Proposal], room: list[bool]) -> list[list[Sibling]]:
        """The siblings of each sequence's chain: room[b], the KV cache has the slots for
        sequence b's (else none)."""
        gain = sum(expected_tokens(r[:len(p.tokens)])[-1] for r, p in zip(self.rates, proposals))
        rows = sum(len(p.tokens) + 1 for p in proposals)
        deepest = max((len(p.tokens) for p in proposals if not p.lookup), default=0)
        rate = gain / max(deepest * self.draft_step + self.verify(rows), 1e-9)
        wanted = [p.alternatives if ok and fits and not p.lookup else []
                  for p, ok, fits in zip(proposals, self.eligible, room)]
        return choose(wanted, rate, self.verify, rows, self.calibration)


class SiblingPolicy:
    """How often sibling leaves rescue a round, learnt from the rounds; offers each round's
    terms."""

    def __init__(self) -> None:
        self.rescued = 0.0  # decayed rescues seen
        self.expected = 0.0  # decayed rescues the draft's probabilities promised

    @property
    def calibration(self) -> float:
        return (self.rescued + PRIOR_WEIGHT) / (self.expected + PRIOR_WEIGHT)

    def offer(self, seqs: list[Sequence], rates: list[list[float]], draft_step: float,
              verify: Callable[[int], float]) -> SiblingOffer:
        return SiblingOffer(rates, [eligible(s) for s in seqs], draft_step, verify, self.calibration)

    def learn(self, rounds: list[Round]) -> None:
        for r in rounds:
            if r.siblings:
                self.rescued = self.rescued * DECAY + r.rescued
                self.expected = self.expected * DECAY + sum(s.promise for s in r.siblings)


def keep_sibling(cache: PagedKVCache, seq: Sequence, drafts: int, index: int, depth: int) -> None:
    """The target's K/V of sibling `index` (written after the chain's K + 1 tokens) into the slot
    of draft `depth`, whose place it takes."""
    cache.copy_position(seq.seq_id, seq.num_tokens + drafts + index, seq.num_tokens + depth)
