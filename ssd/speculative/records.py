"""What a speculative round is made of, as plain data shared by the target's side, the draft
sources and the policies (docs/algorithm.md, "A speculative round"): the rule for a round's
K, a draft source's `Proposal` for one sequence, and the round's records: `Round` per
sequence, `RoundTimes` for the batch.

Nothing here imports another module of ssd/speculative/, so that every side can import it.
"""
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ssd.request.sequence import Sequence
from ssd.sampling_params import SamplingParams


def round_k(k: int, num_tokens: int, context: int, left: int | None = None) -> int:
    """The K of a round, the one rule on both sides: k draft tokens (a policy's choice, or the
    deepest a tree goes), as many as fit before position `context` of a sequence of num_tokens
    tokens, and, for a request with `left` tokens to go, no more than it can use beside the
    target's own token."""
    k = min(k, context - num_tokens)
    return max(0, k if left is None else min(k, left - 1))


class _Request(Protocol):  # a Sequence (the target's side) or a DraftSeq (the draft's)
    processor: object | None
    params: SamplingParams


def argmax_chain(request: _Request) -> bool:
    """Whether the draft's proposals for a request are its argmax chain: greedy, its logits
    unchanged. Then only their length is a choice (the draft's stopping rule), and a guess of
    the draft's next tokens can be checked row by row (the draft's guesses)."""
    return request.processor is None and request.params.greedy_decoding


@dataclass(frozen=True)
class Capabilities:
    """What a draft source can do, the one thing of it the engine, the round and the K policy
    read (DraftSource.capabilities)."""

    # Its proposals carry step_s, its seconds per draft token without catch-up (else auto-K
    # takes a round's wait per draft token).
    measures_steps: bool = False
    # It drafts in this process between the target's passes (SD's draft model, a feature head):
    # prompt lookup may propose beside it (sources/beside.py), and auto-K offers sibling leaves
    # off its chains (siblings.py).
    in_process: bool = False
    # In this process, its rounds may end where the draft's confidence in its own tokens says
    # (draft_stop.py): a draft whose tokens are the target's.
    stops_by_confidence: bool = False
    # It proposes a tree of branches off its tokens (`tree`, suffix decoding's): auto-K then
    # offers them where it proposes (siblings.py).
    offers_trees: bool = False
    # The target layers whose entering hidden states it reads (a feature head): the target's
    # passes then give them, to DraftSource.states and in each round's record.
    taps: tuple[int, ...] = ()


# A draft that runs in this process and times its own steps (SD's draft model, a feature head).
IN_PROCESS = Capabilities(measures_steps=True, in_process=True, stops_by_confidence=True)


@dataclass
class Alternative:
    """What the draft's step had besides the token it drafted (sibling leaves, siblings.py)."""

    token: int  # its runner-up
    p1: float  # its probability of the drafted token
    p2: float  # ... of the runner-up


@dataclass
class Branch:
    """A draft token off the chain, verified in the same pass as the chain (a draft tree,
    siblings.py). Its parent is a node of the round's tree: 0 the sequence's newest token, 1..n
    the chain's drafts, n + 1 + i the round's i-th branch (a branch comes after its parent)."""

    parent: int
    token: int
    promise: float = 0.0  # the draft's probability that the target's path goes through it (siblings.choose)


@dataclass
class Proposal:
    """A draft source's answer for one sequence in a round, in SD as in SSD (protocol.py
    carries it over the worker link)."""

    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), V] distributions they were drawn from; None: verify one-hot
    hit: bool | None = None  # SSD: from the speculation cache (None: no tokens asked for, or not SSD)
    # SSD: the draft worker's time spent on this sequence (its share of batched work).
    tree_s: float = 0.0  # building the cache that this round's speculation came from
    backup_s: float = 0.0  # drafting it on the spot after a miss
    idle_s: float = 0.0  # waiting for this request
    failed_over: bool = False  # SSD: the worker failed during this round and SD took over
    lookup: bool = False  # prompt lookup's tokens, chosen by the K policy instead of the draft's
    # SD: each drafted token's runner-up, where sibling leaves were asked for (siblings.py).
    alternatives: list[Alternative] = field(default_factory=list)
    # A feature head's tree beyond the chain, where branches were asked for of a greedy
    # request (siblings.py), each with its promise: the candidates the round chooses from.
    candidates: list[Branch] = field(default_factory=list)
    # SD with draft_stop: each drafted token's top-1 probability, the draft's stopping rule's
    # input (draft_stop.py); None where the rule did not apply.
    confidences: list[float] | None = None
    # Where the draft times its own steps (SD), the batch's: seconds per draft token, catch-up
    # left out (None: no such step), and its catch-up (seconds, tokens it read that it had not
    # seen, and the keys their attention read: each token's position + 1, summed).
    step_s: float | None = None
    catchup: tuple[float, int, float] | None = None


@dataclass(frozen=True)
class RoundTimes:
    """A round's times, the whole batch's (one record, which each sequence's Round holds): the
    target's wait for the proposals, its pass (timed: a pass of the round's rows alone; False:
    a plain round whose rows rode in the pass of the step's prompt chunks, as AR's do, so its
    time is not what the rows cost), and the draft source's timings of its drafting
    (Proposal.step_s, .catchup)."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    timed: bool = True
    step_s: float | None = None
    catchup: tuple[float, int, float] | None = None


@dataclass
class Round:
    """One sequence's round, from the K asked for to the tokens kept (k = 0: a plain
    decoding step), and its batch's times."""

    seq: Sequence
    k: int  # draft tokens asked for
    proposal: Proposal
    accepted: int = 0  # draft tokens the target accepted
    tokens: list[int] = field(default_factory=list)  # those tokens, then the target's own
    times: RoundTimes = RoundTimes()
    logprobs: list | None = None  # per token, where the request asked for them (TokenLogprob)
    branches: list[Branch] = field(default_factory=list)  # verified beside the drafts (siblings.py)
    rescued: int = 0  # branch tokens taken: `tokens` are the accepted drafts, those, the target's own
    # The tokens before the round and the accepted drafts: what the draft source holds of the
    # sequence that is right (None: the source was not asked this round).
    kept: int | None = None
    # Where the source reads the target's hidden states (Capabilities.taps): those of the rows
    # that stand, the sequence's newest token before the round, the accepted drafts (and the
    # branches taken), [rows, taps x hidden]; else None.
    states: torch.Tensor | None = None

    @property
    def drafted(self) -> int:
        return len(self.proposal.tokens)

