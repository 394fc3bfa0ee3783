"""A round's plan: what the K policy decides before a round, per sequence, and what the round
needs to finish its shape once the chains are drafted (docs/algorithm.md, "A speculative
round")."""
from dataclasses import dataclass, replace

from ssd.request.sequence import Sequence
from ssd.speculative.policy.draft_stop import StopRule
from ssd.speculative.policy.siblings import SiblingOffer, cut
from ssd.speculative.records import Branch, round_k


@dataclass(frozen=True)
class SeqPlan:
    """One sequence's part of a round."""

    k: int  # draft tokens asked for (0: plain decoding; with `stop`, a cap)
    lookup: list[int] | None = None  # prompt lookup's tokens, proposed instead of the draft's (their K)
    alternatives: bool = False  # the draft also gives each token's runner-up (sibling leaves)
    stop: StopRule | None = None  # the draft stops early by this rule (draft_stop.py)
    lookup_tree: tuple[Branch, ...] = ()  # the lookup's candidate branches off its tokens (siblings.py)


@dataclass(frozen=True)
class Plan:
    seqs: list[SeqPlan]
    siblings: SiblingOffer | None = None  # the terms for sibling leaves, None: none this round

    @property
    def ks(self) -> list[int]:
        return [p.k for p in self.seqs]

    def within(self, seqs: list[Sequence], context: int) -> "Plan":
        """Each K cut to what its sequence can take (round_k): before position `context`, and
        no more than its tokens left allow, and 0 for a request that asked not to speculate; a
        lookup's tokens with it (none left: the draft's sequence at K = 0)."""
        out = []
        for s, p in zip(seqs, self.seqs):
            k = round_k(p.k if s.params.speculate else 0, s.num_tokens, context,
                        s.params.max_tokens - len(s.output_ids))
            lookup = p.lookup[:k] if p.lookup and k else None
            tree = tuple(cut(list(p.lookup_tree), len(p.lookup), k)) if lookup else ()
            out.append(p if k == p.k else replace(p, k=k, lookup=lookup, lookup_tree=tree))
        return replace(self, seqs=out)
