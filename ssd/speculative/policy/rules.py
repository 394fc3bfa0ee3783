"""Auto-K's rules (docs/cost-model.md, "Auto-K"): what the batch's choice (choose.py) does not
weigh by itself. Each rule is an object with its own state, its `adjust` of a plan in the
making (`Planning`) and its `learn` from the round that plan made; AutoK.RULES names them in
the order they apply. A new rule is one class here and one entry there.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from ssd.request.sequence import Sequence
from ssd.speculative.policy.choose import BatchRound, Option
from ssd.speculative.policy.costs import Acceptance, expected_tokens
from ssd.speculative.policy.draft_stop import DraftStop, StopRule
from ssd.speculative.policy.estimators import LowQuantile
from ssd.speculative.policy.model import CostModel
from ssd.speculative.policy.siblings import SiblingOffer, SiblingPolicy, cut, eligible
from ssd.speculative.policy.tunables import (EXPLORE_EVIDENCE, EXPLORE_GAP, HOLD_MAX, HOLD_MIN_S, HOLD_SHARE,
                                             PRIOR_RATE, PROBE_BACKOFF, PROBE_BUDGET, PROBE_K, SPIKE, WITHOUT_EMA)
from ssd.speculative.records import Branch, Round, RoundTimes, argmax_chain


@dataclass
class Planning:
    """One plan in the making: what the batch's choice made of each sequence's options, what
    the rules read and adjust, and what learning from its round reads of it."""

    seqs: list[Sequence]
    k_max: int
    rates: list[list[float]] = field(default_factory=list)  # per sequence, a_1..a_k_max
    gains: list[list[float]] = field(default_factory=list)  # ... and E(0..k_max)
    own: list[Acceptance] = field(default_factory=list)  # ... its own acceptance counts
    found: dict[int, tuple[list[int], int]] = field(default_factory=dict)  # seq_id -> its lookup, match class
    trees: dict[int, list[Branch]] = field(default_factory=dict)  # seq_id -> its lookup's candidate branches
    options: list[list[Option]] = field(default_factory=list)
    worth: list[float] = field(default_factory=list)
    picks: list[int] = field(default_factory=list)  # per sequence, its option
    ks: list[int] = field(default_factory=list)  # ... and the K it drafts (or its lookup proposes)
    lookups: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> the lookup's tokens it proposes
    batch: BatchRound | None = None  # the round the batch's choice made
    learning: bool = False  # too little measured to refuse a catch-up
    catchup: list[float] = field(default_factory=list)  # per sequence, its draft's catch-up now
    plain: list[float] = field(default_factory=list)  # ... the batch's seconds a token with it decoding plainly
    hope: Option = (1.0, 1, 0)  # drafting at the prior's rates, at its best K (hope())
    best_case: list[float] = field(default_factory=list)  # ... what drafting would save at the prior's rates
    probing: set[int] = field(default_factory=set)  # seq_ids probing on their own budget
    engine_probe: int | None = None  # the seq_id probing on the engine's budget
    stop: StopRule | None = None  # the draft's stopping rule this round
    offer: SiblingOffer | None = None  # the terms for branches this round

    def __post_init__(self) -> None:
        if not self.ks:
            self.ks = [0] * len(self.seqs)

    def pick(self, b: int, i: int) -> None:
        """Sequence b takes its option i: the draft's K = i, or its lookup's first i - k_max tokens."""
        self.picks[b] = i
        seq_id = self.seqs[b].seq_id
        if i > self.k_max:
            self.ks[b] = i - self.k_max
            self.lookups[seq_id] = self.found[seq_id][0][:self.ks[b]]
        else:
            self.ks[b] = i
            self.lookups.pop(seq_id, None)


class Rule:
    """A rule of auto-K (module doc)."""

    def adjust(self, p: Planning, model: CostModel) -> None:
        pass

    def learn(self, rounds: list[Round], p: Planning, times: RoundTimes) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass


class CatchupGate(Rule):
    """A sequence starts (or resumes) drafting only if what the chosen K saves over its tokens
    left pays the draft's catch-up (the tokens it has not read), against what the sequence does
    without the draft (plain decoding, or its lookup where faster: its share of plain decoding's
    averaged over its rounds, as matches come and go), all at the batch's time a token. While
    learning, at the prior's rates (a long prompt with a short answer is never prefilled for the
    draft, even by a fresh engine's first request)."""

    def __init__(self) -> None:
        self.without: dict[int, float] = {}  # seq_id -> its time a token without the draft, over plain's

    def adjust(self, p: Planning, model: CostModel) -> None:
        for b, s in enumerate(p.seqs):
            plain = p.plain[b]
            now = p.batch.without(b) / plain
            old = self.without.get(s.seq_id)
            self.without[s.seq_id] = w = now if old is None else old + WITHOUT_EMA * (now - old)
            hoped = (p.worth[b] * p.hope[0], *p.hope[1:])
            option = hoped if p.learning else p.options[b][min(p.picks[b], p.k_max)]
            saving = p.batch.saving(b, option, w * plain, _left(s, p.worth[b]))
            if 0 < p.picks[b] <= p.k_max and p.catchup[b] > max(model.verify(1), saving):
                p.pick(b, p.batch.alternative(b))  # plain decoding, or its lookup where that is faster

    def release(self, seq_id: int) -> None:
        self.without.pop(seq_id, None)


class Probes(Rule):
    """A sequence at K = 0 learns nothing of its acceptance, so now and then it drafts PROBE_K
    tokens: once the time it decoded plainly since it last drafted is 1 / PROBE_BUDGET times
    what a probe costs (its catch-up, and what it adds to the round, stretched by its backoff:
    a probe that gains nothing doubles it, up to PROBE_BACKOFF). Not where drafting at the
    prior's rates could not repay the catch-up; at once while learning (a K of 0 may rest on a
    warm-up's round). Requests too short to earn one share the engine's budget: one probe when
    nothing drafted for 1 / PROBE_BUDGET times the cheapest."""

    def __init__(self) -> None:
        self.idle_s: dict[int, float] = {}  # seq_id -> seconds of plain decoding since it last drafted
        self.backoff: dict[int, int] = {}  # seq_id -> the wait's factor before its next probe
        self.engine_idle_s = 0.0  # seconds since any sequence drafted
        self.engine_backoff = 1

    def adjust(self, p: Planning, model: CostModel) -> None:
        k = min(PROBE_K, p.k_max)
        costs = {b: p.catchup[b] + p.batch.extra(b, p.options[b][k]) * self.backoff.get(s.seq_id, 1)
                 for b, s in enumerate(p.seqs) if p.ks[b] == 0 and p.catchup[b] <= p.best_case[b]}
        probes = [b for b, c in costs.items()
                  if p.learning or self.idle_s.get(p.seqs[b].seq_id, 0.0) * PROBE_BUDGET >= c]
        if costs and not probes:  # the engine's own budget
            b = min(costs, key=costs.get)
            if self.engine_idle_s * PROBE_BUDGET >= costs[b] * self.engine_backoff:
                probes = [b]
                p.engine_probe = p.seqs[b].seq_id
        for b in probes:
            p.ks[b] = k
            if not p.learning:  # probes on a budget back off; learning ends by itself
                p.probing.add(p.seqs[b].seq_id)

    def credit(self, seconds: float, seq_ids) -> None:
        """Rounds not planned (held: Hold) count as plain decoding."""
        for i in seq_ids:
            self.idle_s[i] = self.idle_s.get(i, 0.0) + seconds
        self.engine_idle_s += seconds

    def learn(self, rounds: list[Round], p: Planning, times: RoundTimes) -> None:
        spent = times.draft_s + times.verify_s
        drafting = False
        for r in rounds:
            i = r.seq.seq_id
            if r.drafted and not r.proposal.lookup:
                drafting = True
                if i in p.probing:
                    self.backoff[i] = 1 if r.accepted else min(2 * self.backoff.get(i, 1), PROBE_BACKOFF)
                if i == p.engine_probe:
                    self.engine_backoff = 1 if r.accepted else min(2 * self.engine_backoff, PROBE_BACKOFF)
                self.idle_s[i] = 0.0
            else:  # plain decoding, or a lookup's round: the draft neither ran nor read these
                self.idle_s[i] = self.idle_s.get(i, 0.0) + spent
        self.engine_idle_s = 0.0 if drafting else self.engine_idle_s + spent

    def release(self, seq_id: int) -> None:
        self.idle_s.pop(seq_id, None)
        self.backoff.pop(seq_id, None)


class Explore(Rule):
    """A position beyond a sequence's K is never reached, so its rate would rest on the other
    sequences' rounds for good (and a K chosen on a low one would stay low): every EXPLORE_GAP
    drafting rounds a sequence drafts one token deeper than chosen while its own evidence at
    that position is under EXPLORE_EVIDENCE."""

    def __init__(self) -> None:
        self.wait: dict[int, int] = {}  # seq_id -> drafting rounds since it last drafted deeper

    def adjust(self, p: Planning, model: CostModel) -> None:
        for b, s in enumerate(p.seqs):
            k, own = p.ks[b], p.own[b].positions
            evidence = own[k].trials if k < len(own) else 0.0  # its own rounds that reached position k + 1
            if 0 < k < p.k_max and s.seq_id not in p.probing and s.seq_id not in p.lookups \
                    and self.wait.get(s.seq_id, 0) >= EXPLORE_GAP and evidence < EXPLORE_EVIDENCE:
                p.ks[b] = k + 1
                self.wait[s.seq_id] = 0

    def learn(self, rounds: list[Round], p: Planning, times: RoundTimes) -> None:
        for r in rounds:
            if r.drafted and not r.proposal.lookup:
                self.wait[r.seq.seq_id] = self.wait.get(r.seq.seq_id, 0) + 1

    def release(self, seq_id: int) -> None:
        self.wait.pop(seq_id, None)


class StopAtConfidence(Rule):
    """The draft's stopping rule (draft_stop.py) takes over the length of a drafting round where
    one sequence drafts alone (not a probe, not a lookup round, its proposals the draft's argmax
    chain): its K becomes k_max, a cap. The rule's rate before any round was measured: the one
    expected of the K chosen. A round's time enters the rate at most SPIKE times what the cost
    model expects of it, so a spike of load cannot make the draft run deep for long."""

    def __init__(self, stop: DraftStop):
        self.stop = stop
        self.priced: tuple[float, Callable[[int], float]] | None = None  # d and V(m) of the round planned

    def adjust(self, p: Planning, model: CostModel) -> None:
        drafting = [b for b, k in enumerate(p.ks) if k and p.seqs[b].seq_id not in p.lookups]
        s = p.seqs[drafting[0]] if len(drafting) == 1 else None
        if s is None or s.seq_id in p.probing or s.seq_id == p.engine_probe or not argmax_chain(s):
            return
        b, k = drafting[0], p.ks[drafting[0]]
        p.ks[b] = p.k_max
        self.priced = (model.draft_step, model.verify)
        p.stop = self.stop.rule(p.k_max, model.draft_step, model.verify,
                                p.gains[b][k] / (k * model.draft_step + model.verify(k + 1)))

    def learn(self, rounds: list[Round], p: Planning, times: RoundTimes) -> None:
        if not any(r.drafted and not r.proposal.lookup for r in rounds):
            return
        stopped = [r for r in rounds if r.proposal.confidences is not None]  # the rule's, where it applied
        for r in stopped:
            self.stop.observe(r.proposal.confidences, r.accepted)
        if times.catchup is None and stopped:  # (a catch-up's pass is no draft step)
            seconds = times.draft_s + times.verify_s
            if self.priced is not None:
                d, verify = self.priced
                drafted = max(r.drafted for r in stopped)
                seconds = min(seconds, SPIKE * (drafted * d + verify(drafted + 1)))
            self.stop.observe_rate(sum(len(r.tokens) for r in rounds), seconds)


class Branches(Rule):
    """Branches off the chains (siblings.py): the draft's runners-up or a head's tree where asked
    for, a lookup's tree (suffix decoding's) where it proposes; offered on the round's terms,
    each kind's calibration learnt from its rounds."""

    def __init__(self, siblings: bool):
        self.siblings = siblings
        self.draft, self.lookup = SiblingPolicy(), SiblingPolicy()

    def adjust(self, p: Planning, model: CostModel) -> None:
        p.trees = {i: cut(p.trees.get(i, []), len(p.found[i][0]), len(t)) for i, t in p.lookups.items()}
        if self.siblings or any(p.trees.values()):
            p.offer = SiblingOffer(p.rates, [eligible(s) for s in p.seqs], model.draft_step,
                                   partial(model.verify, seqs=len(p.seqs)), self.draft.calibration,
                                   self.lookup.calibration)

    def learn(self, rounds: list[Round], p: Planning, times: RoundTimes) -> None:
        self.draft.learn([r for r in rounds if not r.proposal.lookup])
        self.lookup.learn([r for r in rounds if r.proposal.lookup])


class Hold(Rule):
    """Planning is host time, a large part of a step at a large batch on a GPU: where a plan
    drafts nothing (no K, no lookup, no probe) and took more than HOLD_SHARE of the step it
    planned (V(n), at least HOLD_MIN_S), it holds for as many rounds as keep planning within
    that share, unless a new sequence joins. Those rounds learn only V(n), and their time counts
    as plain decoding once planning resumes (Probes.credit)."""

    def __init__(self) -> None:
        self.rounds = 0  # rounds the last plan still holds for
        self.planning = LowQuantile()  # a plan's host time (one slow plan is no reason to hold)
        self.holding = False  # this round's plan is a held one
        self.held_s = 0.0  # those rounds' time, not yet credited

    def holds(self, all_known: bool) -> bool:
        if self.rounds and all_known:
            self.rounds -= 1
            self.holding = True
            return True
        self.rounds = 0
        return False

    def after(self, took: float, p: Planning, model: CostModel) -> None:
        """A plan made in `took` seconds."""
        took = self.planning.observe(took)
        if took > HOLD_MIN_S and not any(p.ks):
            n = len(p.seqs)
            self.rounds = min(HOLD_MAX, int(took / max(HOLD_SHARE * model.verify(n, n), 1e-9)))

    def learn_held(self, rounds: list[Round], times: RoundTimes, model: CostModel) -> bool:
        """A held plan's round (then True): its time, and the plain step's."""
        if not self.holding:
            return False
        self.holding = False
        self.held_s += times.draft_s + times.verify_s
        if times.timed:
            model.verify.observe(len(rounds), times.verify_s, len(rounds))
        return True

    def take_held(self) -> float:
        seconds, self.held_s = self.held_s, 0.0
        return seconds


def hope(model: CostModel) -> Option:
    """The option drafting would be at the prior's rates, at its best K: the most a draft could
    do as far as anything is known (CatchupGate while learning, and Probes' best case)."""
    hopeful = expected_tokens([PRIOR_RATE] * model.k_max)
    k = max(range(1, model.k_max + 1), key=lambda k: hopeful[k] / model.round_s(k))
    return hopeful[k], k + 1, k


def _left(s: Sequence, worth: float) -> float:
    """Its tokens left, weighed as the options' are; a sequence worth more than the average is
    so only until it catches up with the others, so no more than that."""
    return min(worth, 1.0) * (s.params.max_tokens - len(s.output_ids))


def best_cases(p: Planning) -> list[float]:
    """Per sequence, what drafting would save over its tokens left at the prior's rates, against
    plain decoding (no probe, nor a catch-up while learning, where it could not pay)."""
    return [p.batch.saving(b, (p.worth[b] * p.hope[0], *p.hope[1:]), p.plain[b], _left(s, p.worth[b]))
            for b, s in enumerate(p.seqs)]
