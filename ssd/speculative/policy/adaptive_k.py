"""How many tokens to draft: a fixed K, or K chosen each round from measured costs (auto).

Auto-K applies the speed-up model of docs/cost-model.md round by round. For a sequence whose
draft token i is accepted with probability a_i once the tokens before it were, drafting K
tokens gains on average

    E(K) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_K     tokens (the target always adds one),

and a round costs D(K) = K x d plus V(R), the target's pass over R rows (R = K + 1 per
sequence). The round's K per sequence maximises the batch's tokens per second,
sum E_s(K_s) / (D(max K_s) + V(sum (K_s + 1))); K = 0 is plain decoding.

AutoK is four parts, each in a module of its own:
- the acceptance estimates (here): each sequence's decayed counts by position, shrunk towards
  the engine-wide ones, and prompt lookup's by match length, learnt from every round where the
  lookup found something, used or not (its tokens against the ones the round kept);
- the cost model (model.py): V(R, n), d, the catch-up, a token's worth, read at the load now;
- the batch's choice (choose.py): each sequence's option, the draft's K or its lookup's;
- the rules (rules.py), in the order of AutoK.rules: what the choice does not weigh by itself.
A step that also fills prompts decodes plainly: its plain rows ride in the prompt chunks'
pass, and a drafting round would add a pass and hold back every prompt being filled.
"""
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ssd.request.sequence import Sequence
from ssd.speculative.plan import Plan, SeqPlan
from ssd.speculative.policy.choose import BatchRound, choose
from ssd.speculative.policy.costs import Acceptance, Timings, expected_tokens
from ssd.speculative.policy.draft_stop import DraftStop
from ssd.speculative.policy.model import CostModel
from ssd.speculative.policy.rules import (Branches, CatchupGate, Explore, Hold, Planning, Probes, Rule,
                                          StopAtConfidence, best_cases, hope)
from ssd.speculative.policy.tunables import (ENGINE_DECAY, ENGINE_EVIDENCE, LOOKUP_PRIOR, MAX_PER_SEQUENCE,
                                             PRIOR_RATE, PRIOR_ROUNDS, SEQ_DECAY, SEQ_ROUNDS)
from ssd.speculative.records import Branch, Capabilities, Round, argmax_chain


class Lookup(Protocol):
    """Prompt lookup or suffix decoding beside the draft (sources/beside.py)."""

    capabilities: Capabilities  # offers_trees: it has `tree`

    def match(self, seq: Sequence, k: int) -> tuple[list[int], int]: ...

    def tree(self, seq: Sequence, k: int) -> tuple[list[int], int, list[Branch]]: ...


@dataclass
class SeqRates:
    """What auto-K counts of one sequence's rounds."""

    acceptance: Acceptance = field(default_factory=lambda: Acceptance(SEQ_DECAY))
    lookup: list[Acceptance] = field(default_factory=lambda: [Acceptance(SEQ_DECAY) for _ in LOOKUP_PRIOR])
    seen: int = 0  # its tokens when it last drafted (what the draft read)


class KPolicy:
    """What every K policy does: plan each round (plan.py), learn from its records, and forget
    a sequence (registered with the engine's registry)."""

    def plan(self, seqs: list[Sequence], filling: bool = False, waiting: bool = False) -> Plan:
        """filling: the step also fills prompts, in a pass that plain rows ride in; waiting:
        requests wait for a place in the batch."""
        raise NotImplementedError

    def learn(self, rounds: list[Round]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass

    def held(self) -> dict[str, int]:
        return {}


class FixedK(KPolicy):
    """Every sequence drafts K tokens every round."""

    def __init__(self, k: int):
        self.k = k

    def plan(self, seqs: list[Sequence], filling: bool = False, waiting: bool = False) -> Plan:
        return Plan([SeqPlan(self.k)] * len(seqs))


class AutoK(KPolicy):
    """K per sequence and round, 0..k_max, from measured acceptance and costs (module doc)."""

    def __init__(self, k_max: int, verify_time: Callable[[int], float | None],
                 draft_step_s: float | Callable[[], float | None],
                 steps_measured: bool = False, lookup: Lookup | None = None, window: int | None = None,
                 siblings: bool = False, stop: DraftStop | None = None, lookup_trees: bool = False):
        """verify_time, draft_step_s, steps_measured, window: the cost model's (model.py);
        lookup: prompt lookup or suffix decoding beside the draft (its `match`, and `tree` where
        it offers trees); siblings: ask the draft for branches off its chains (runners-up, a
        head's tree) and offer them (siblings.py); lookup_trees: offer a lookup's branches;
        stop: the draft's stopping rule (draft_stop.py)."""
        self.k_max, self.lookup, self.stop = k_max, lookup, stop
        self.siblings = siblings
        self.lookup_trees = lookup_trees and lookup is not None and lookup.capabilities.offers_trees
        # A pass over the chain's rows, and (timed at a few sizes, read between them) with branches.
        wider = [k_max + 1 + m for m in (1, 2, 4, 8, MAX_PER_SEQUENCE)] if siblings or self.lookup_trees else []
        self.model = CostModel(k_max, verify_time, list(range(1, k_max + 2)) + wider, draft_step_s, steps_measured,
                               window)
        self.overall = Acceptance(ENGINE_DECAY)  # engine-wide, over every sequence's rounds
        self.lookup_overall = [Acceptance(ENGINE_DECAY) for _ in LOOKUP_PRIOR]
        self.seqs: dict[int, SeqRates] = {}
        self.hold, self.probes = Hold(), Probes()
        # The rules, in the order they adjust a plan (rules.py).
        self.rules: list[Rule] = [CatchupGate(), self.probes, Explore()] + \
            ([StopAtConfidence(stop)] if stop is not None else []) + [Branches(siblings)]
        self.last = Planning([], k_max)  # the last plan, which its round's learning reads

    @property
    def verify(self) -> Timings:
        """V: the target's pass (the cost model's)."""
        return self.model.verify

    @verify.setter
    def verify(self, timings: Timings) -> None:
        self.model.verify = timings

    @property
    def draft_step(self) -> float:
        return self.model.draft_step

    @draft_step.setter
    def draft_step(self, seconds: float) -> None:
        self.model.draft_step = seconds

    def plan(self, seqs: list[Sequence], filling: bool = False, waiting: bool = False) -> Plan:
        if filling:  # plain decoding, its rows in the prompt chunks' pass (module doc)
            self.last = Planning(seqs, self.k_max)
            return Plan([SeqPlan(0)] * len(seqs))
        if self.hold.holds(all(s.seq_id in self.seqs for s in seqs)):
            return Plan([SeqPlan(0)] * len(seqs))
        self.probes.credit(self.hold.take_held(), list(self.seqs))
        t0 = time.perf_counter()
        p = self.last = self._plan(seqs, waiting)
        self.hold.after(time.perf_counter() - t0, p, self.model)
        return Plan([SeqPlan(k, p.lookups.get(s.seq_id), self.siblings,
                             p.stop if p.stop is not None and argmax_chain(s) else None,
                             tuple(p.trees.get(s.seq_id, ()))) for s, k in zip(seqs, p.ks)], p.offer)

    def _plan(self, seqs: list[Sequence], waiting: bool) -> Planning:
        if any(s.seq_id not in self.seqs for s in seqs):
            self.model.time_draft_again()
        prior = self.overall.rates(self.k_max, [PRIOR_RATE] * self.k_max, PRIOR_ROUNDS)
        p = Planning(seqs, self.k_max, own=[self._rates(s).acceptance for s in seqs])
        p.rates = [own.rates(self.k_max, prior, SEQ_ROUNDS) for own in p.own]
        p.gains = [expected_tokens(r) for r in p.rates]
        # Each sequence's options: draft K = 0..k_max tokens (K = 0: plain decoding), then its
        # lookup's first 1..n tokens; as (tokens expected, rows, draft steps), the tokens weighed
        # by their worth.
        found = [self._lookup(s, p) for s in seqs]
        p.worth = self.model.worth(seqs, waiting)
        p.options = [[(w * g[k], k + 1, k) for k in range(self.k_max + 1)] + [(w * lg[k], k + 1, 0)
                                                                             for k in range(1, len(lg))]
                     for w, g, lg in zip(p.worth, p.gains, found)]
        p.picks = choose(p.options, self.k_max, self.model.draft_step, self.model.verify)
        for b, i in enumerate(p.picks):
            p.pick(b, i)
        p.batch = BatchRound(p.options, p.picks, self.model.draft_step, self.model.verify)
        p.learning = not self.engine_knows()
        missed = [s.num_tokens - self.seqs[s.seq_id].seen for s in seqs]
        p.catchup = [self.model.catchup_s(m, s.num_tokens) if m > 2 else 0.0 for m, s in zip(missed, seqs)]
        p.plain = [p.batch.per_token(b, opts[0]) for b, opts in enumerate(p.options)]
        p.hope = hope(self.model)
        p.best_case = best_cases(p)
        for rule in self.rules:
            rule.adjust(p, self.model)
        return p

    def _rates(self, seq: Sequence) -> SeqRates:
        state = self.seqs.get(seq.seq_id)
        if state is None:
            state = self.seqs[seq.seq_id] = SeqRates()
        return state

    def engine_knows(self) -> bool:
        """Enough recent rounds engine-wide that a sequence may be refused drafting by them."""
        first = self.overall.positions[:1]
        return bool(first) and first[0].trials >= ENGINE_EVIDENCE

    def _lookup(self, seq: Sequence, p: Planning) -> list[float]:
        """E(K) for the first K tokens of the sequence's prompt-lookup proposal (up to k_max
        tokens, kept in p.found; empty: no lookup, or nothing found)."""
        if self.lookup is None:
            return []
        if self.lookup_trees and argmax_chain(seq):  # (sampled requests: sibling leaves of the draft's only)
            tokens, n, p.trees[seq.seq_id] = self.lookup.tree(seq, self.k_max)
        else:
            tokens, n = self.lookup.match(seq, self.k_max)
        if not tokens:
            return []
        c = min(n, len(LOOKUP_PRIOR)) - 1
        p.found[seq.seq_id] = tokens, c
        prior = self.lookup_overall[c].rates(len(tokens), [LOOKUP_PRIOR[c]] * len(tokens), PRIOR_ROUNDS)
        return expected_tokens(self._rates(seq).lookup[c].rates(len(tokens), prior, SEQ_ROUNDS))

    def learn(self, rounds: list[Round]) -> None:
        """One round of the batch (round.py): tokens each sequence drafted and had accepted (and
        what its lookup would have had), the round's times for the cost model, and each rule's."""
        times = rounds[0].times  # (the batch's, one record)
        if self.hold.learn_held(rounds, times, self.model):
            return
        p = self.last
        for r in rounds:
            s, state = r.seq, self._rates(r.seq)
            if s.seq_id in p.found:  # the lookup's tokens against those the round kept
                tokens, c = p.found[s.seq_id]
                known = min(len(tokens), len(r.tokens))
                agree = next((i for i in range(known) if tokens[i] != r.tokens[i]), known)
                state.lookup[c].observe(min(agree + 1, known), agree)
                self.lookup_overall[c].observe(min(agree + 1, known), agree)
            if r.drafted and not r.proposal.lookup:
                state.seen = s.num_tokens
                state.acceptance.observe(r.drafted, r.accepted)
                self.overall.observe(r.drafted, r.accepted)
        self.model.learn(rounds, times, [0 if r.proposal.lookup else r.drafted for r in rounds])
        for rule in self.rules:
            rule.learn(rounds, p, times)

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.last.found.pop(seq_id, None)
        self.last.trees.pop(seq_id, None)
        self.last.probing.discard(seq_id)
        if self.last.engine_probe == seq_id:
            self.last.engine_probe = None
        for rule in self.rules:
            rule.release(seq_id)

    def held(self) -> dict[str, int]:
        return {"sequences": len(self.seqs), "probing": len(self.last.probing)}
