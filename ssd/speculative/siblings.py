"""Sibling leaves: SD's chain of draft tokens plus, at some depths, the draft's runner-up as a
one-token alternative that the target scores in the same verify pass (the simplest draft
tree; issue 33, lever 1).

At depth j the chain proposes d_j, the draft's top choice; its runner-up s_j is a sibling
leaf: one more verify row, at d_j's position, that sees the chain's tokens before depth j and
itself (the tree mask as attention rows: `Chunk.forks`, ssd/engine/model_runner.py). Greedy
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

from ssd.engine.kv_cache import PagedKVCache
from ssd.engine.sequence import Sequence
from ssd.speculative.records import Alternative, Sibling

MAX_PER_SEQUENCE = 4  # sibling rows a sequence's round may add
DECAY = 0.98  # per round with siblings: the calibration follows the recent text
PRIOR_WEIGHT = 2.0  # expected rescues' worth of the prior factor 1


def eligible(seq: Sequence) -> bool:
    """A request whose verification over a tree is written here: its logits unchanged (no
    penalties or constraint) and no logprobs asked for."""
    return seq.processor is None and seq.params.logprobs is None


class SiblingPolicy:
    """Chooses each round's sibling leaves and learns how often they rescue a round."""

    def __init__(self) -> None:
        self.rescued = 0.0  # decayed rescues seen
        self.expected = 0.0  # decayed rescues the draft's probabilities promised
        self.pending: dict[int, float] = {}  # seq_id -> this round's promise (uncalibrated)

    @property
    def calibration(self) -> float:
        return (self.rescued + PRIOR_WEIGHT) / (self.expected + PRIOR_WEIGHT)

    def choose(self, alternatives: list[list[Alternative]], rate: float, verify: Callable[[int], float],
               rows: int, seq_ids: list[int]) -> list[list[Sibling]]:
        """Per sequence, its siblings: alternatives[b] are sequence b's drafted tokens' runners-up
        (empty: none wanted); rate: tokens per second the round makes without siblings;
        verify(rows): the target's pass over that many rows; rows: the chain's."""
        pool = []
        for b, alts in enumerate(alternatives):
            reach = 1.0
            for j, a in enumerate(alts):
                pool.append((reach * a.p2, b, Sibling(j, a.token)))
                reach *= a.p1
        pool.sort(key=lambda c: -c[0])
        chosen: list[list[Sibling]] = [[] for _ in alternatives]
        scale = self.calibration
        for promise, b, sibling in pool:
            if len(chosen[b]) == MAX_PER_SEQUENCE:
                continue
            if scale * promise <= rate * (verify(rows + 1) - verify(rows)):
                break
            chosen[b].append(sibling)
            self.pending[seq_ids[b]] = self.pending.get(seq_ids[b], 0.0) + promise
            rows += 1
        return chosen

    def observe(self, seq_id: int, rescued: bool) -> None:
        promise = self.pending.pop(seq_id, None)
        if promise is not None:
            self.rescued = self.rescued * DECAY + rescued
            self.expected = self.expected * DECAY + promise

    def release(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)


def keep_sibling(cache: PagedKVCache, seq: Sequence, drafts: int, index: int, depth: int) -> None:
    """The target's K/V of sibling `index` (written after the chain's K + 1 tokens) into the slot
    of draft `depth`, whose place it takes."""
    cache.copy_position(seq.seq_id, seq.num_tokens + drafts + index, seq.num_tokens + depth)
