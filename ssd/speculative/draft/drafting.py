"""What an in-process drafter (the draft model, draft_engine.py; a feature head,
sources/feature_head.py) keeps while it drafts a round: per sequence one `Drafting` (its
tokens, the distributions they were drawn from, runners-up, confidences, and where the
draft's stopping rule ends it), and for the round its passes' `PassTimes`. Each drafter
keeps only its own passes (and a head its tree).
"""
from dataclasses import dataclass, field

import torch

from ssd.speculative.policy.draft_stop import StopRule
from ssd.speculative.records import Alternative, Branch, Proposal


@dataclass
class Drafting:
    """One sequence's draft in a round: up to k tokens, fewer where its rule (draft_stop.py)
    says one more is not worth it."""

    k: int
    rule: StopRule | None = None
    tokens: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)  # (sampled requests) each token's distribution
    alternatives: list[Alternative] = field(default_factory=list)  # each token's runner-up, where asked for
    confidences: list[float] = field(default_factory=list)  # (with a rule) each token's top-1 probability
    survival: float = 1.0  # the rule's chance that the target takes the whole chain so far

    @property
    def left(self) -> int:
        return self.k - len(self.tokens)

    def judge(self, confidences: list[float]) -> bool:
        """The rule reads the top-1 probabilities of the tokens just taken (a pass's come
        together: it judges after the last); False where it ends the draft here."""
        if self.rule is None:
            return True
        for c in confidences:
            self.confidences.append(c)
            self.survival *= self.rule.chance(c)
        if not self.rule.keep_going(self.survival, len(self.tokens)):
            self.k = len(self.tokens)
            return False
        return True

    def take_chain(self, picked: list[int], confidences: list[float]) -> None:
        """A chain drafted ahead of the rule (ssd/runner/chain_graphs.py): its tokens join up to
        where the rule stops, as it would have stopped the steps one at a time."""
        for token, c in zip(picked[:self.left], confidences):
            self.tokens.append(token)
            if not self.judge([c]):
                return

    def proposal(self, times: "PassTimes", candidates: list[Branch] | None = None) -> Proposal:
        return Proposal(self.tokens, torch.stack(self.qs) if self.qs else None, alternatives=self.alternatives,
                        candidates=candidates or [], confidences=self.confidences if self.rule is not None else None,
                        step_s=times.per_step, catchup=times.catchup)


@dataclass
class PassTimes:
    """A round's draft passes, as auto-K reads them (Proposal.step_s, .catchup): a pass that
    feeds at most two tokens a sequence is a draft step; one that feeds more (a prompt, tokens
    missed while K was 0) is catch-up, counted by the tokens it read and the keys their
    attention read (each token's position + 1, summed)."""

    step_s: float = 0.0
    steps: int = 0  # tokens drafted in the step passes (the batch's: as far as its slowest got)
    catchup_s: float = 0.0
    catchup_tokens: int = 0
    catchup_keys: float = 0.0

    def step(self, seconds: float, tokens: int) -> None:
        """A step pass (or a chain of them) that drafted `tokens` tokens in every sequence."""
        self.step_s += seconds
        self.steps += tokens

    def timed_pass(self, seconds: float, reads: list[tuple[int, int]], tokens: int) -> bool:
        """A pass that fed, per sequence, (the first position it read, tokens read) and drafted
        `tokens` tokens in every sequence: a step, or catch-up (class doc). Returns whether a step."""
        if max((n for _, n in reads), default=0) <= 2:
            self.step(seconds, tokens)
            return True
        self.catchup_s += seconds
        for start, n in reads:
            self.catchup_tokens += n
            self.catchup_keys += n * (start + (n + 1) / 2)  # each token attends to those before it and itself
        return False

    @property
    def per_step(self) -> float | None:
        return self.step_s / self.steps if self.steps else None

    @property
    def catchup(self) -> tuple[float, int, float] | None:
        return (self.catchup_s, self.catchup_tokens, self.catchup_keys) if self.catchup_tokens else None
