"""How many tokens to draft: a fixed K, or K chosen each round from measured costs (auto).

Auto-K applies the speed-up model of docs/cost-model.md, "The speed-up model", round by
round. For a sequence whose draft token i is accepted with probability a_i once the tokens
before it were (its acceptance by position), drafting K tokens gains on average

    E(K) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_K     tokens (the target always adds one),

and a round costs D(K) = K x d (the wait for proposals: K draft steps in SD, mostly nothing on
an SSD cache hit) plus V(R), the target's pass over R rows (R = K + 1 per sequence). All three
are measured as the engine runs: V at start-up by timing the target on 1..K_max+1 rows and d
by timing one draft step, then both from every round (d per drafted token: a pass drafts more
than one where the draft's guesses are right) (moving averages), and the a_i from each
sequence's own rounds (decayed counts) shrunk towards the engine-wide rates, which stand in
for positions a sequence has not reached. The round's K per sequence maximises the batch's
tokens per second, sum E_s(K_s) / (D(max K_s) + V(sum (K_s + 1))); K = 0 is plain decoding,
chosen when drafting does not pay.

The draft step's start-up timing is one pass, and a pass caught in a spike of the host's load
(seen on a fresh machine's first run: the draft never ran) would stand
for good: at K = 0 no round measures the draft again, and a step priced that high rules out
even the probes below. Until a round has measured it, each new sequence times one draft step
again and the cheapest timing stands (load only makes a pass slower).

A position beyond a sequence's K is never reached, so its rate would rest on the other
sequences' rounds for good (and a K chosen on a low one would stay low): every EXPLORE_GAP
drafting rounds a sequence drafts one token deeper than chosen while its own evidence at that
position is thin.

Drafting for a sequence also costs a catch-up: the draft must first read the tokens it has
not seen (the whole prompt the first time, the tokens decoded plainly while K was 0): a
draft step plus their measured cost, per token read and per key their attention reads
(CatchupCost: a long prompt costs more a token). Once the engine-wide rates rest on
ENGINE_EVIDENCE (decayed) rounds, a sequence starts (or resumes) drafting only if the time
the chosen K saves over its remaining tokens (max_tokens left) pays for that catch-up, so a
long prompt with a short answer is decoded plainly rather than prefilled twice. In a batch
the time saved is the batch's (_Batch): the rounds the sequence takes to write its tokens,
their tokens at the batch's speed without its drafting against their time with it, so its
drafting pays for the rows it adds beside the others' (and the draft's steps, where the others
draft none) against a plain step that serves the whole batch; at one sequence this is its own
saving. A probe's cost is likewise what it adds to the batch's round. Before
that, the same rule holds at the prior's rates (the best the draft could do as far as
anything is known), and a sequence whose K came out 0 probes (below) every round, to
learn: a K of 0 may rest on a round or two, such as a warm-up's.

A sequence at K = 0 learns nothing about its acceptance, so it probes now and then: it
drafts PROBE_K tokens once the time it has decoded plainly since its last drafting round
is 1 / PROBE_BUDGET times what a probe costs (catch-up, PROBE_K draft steps, the larger
verify pass), so probes take at most about PROBE_BUDGET of the time; a probe that gains
nothing doubles its cost in that rule but for the catch-up (up to PROBE_BACKOFF times). Once
learning is over, no sequence probes where drafting at the prior's rates could not repay the
catch-up over its remaining tokens. Requests too short to earn a probe on their own time
share the engine's budget: when nothing has drafted for 1 / PROBE_BUDGET times the cheapest
probe, that sequence probes, with a backoff of its own; without it, rates measured on a draft
that was useless for a while would keep every later short request from drafting.

Prompt lookup beside the draft (SD with a draft model, `prompt_lookup`): where a sequence's
newest n-gram occurred before, ssd/speculative/sources/ngram.py proposes what followed it, at no
draft cost. Its acceptance is counted apart from the draft's, per match length n (1, 2, 3,
4 or more: a longer match is likelier a copied span), per sequence and engine-wide as above,
and in every round where the lookup found something, used or not: its tokens are compared
with the tokens the round kept (agreeing ones count as accepted up to the first that
differs; past the round's tokens nothing is known), so it is learnt without rounds spent
trying it. The lookup's K tokens are one more option of the round, gaining E_lookup(K) for
V(K + 1) with no draft step: the batch's choice weighs them with the draft's K and plain
decoding. Lookup rounds leave the draft behind, so its next drafting round catches up on what they
added (a catch-up as above). On a summary of a long document the draft's prefill never pays
and lookup rounds carry the speed-up; on code, lookup takes the rounds that copy a span.

A token's worth: with nobody waiting for a place in the batch, a sequence that gets ahead of
the others does not save a plain step for each token it gains, only its own part of the steps
the others still take (its row, and what each sequence adds to a pass), while the sequence
with the most tokens left ends alone, each of its last tokens a whole step. So each
sequence's expected tokens are weighed by their worth (_worth): the seconds one token fewer
saves, decoded plainly from here, over the batch's plain step a token. A sequence with the
k-th most tokens left ends when k sequences remain: V(k, k) - V(k - 1, k - 1), averaged over
the sequences within a round's gain of it, and at least a quarter of the average (its
request's user waits for it, whatever it saves the batch). Sequences in step (a batch that
started together) are all worth the average, so that the batch's speed is as before (valued
at the average, lookup rounds of sequences that were ahead gained tokens that saved no step:
docs/decision-log.md). Where requests wait, a sequence that ends makes room for one, and every token is worth
the average.

While a step also fills prompts (chunked prefill beside decoding sequences), the plain rows
of the decoding sequences ride in the pass of the prompt chunks, as AR's do, for next to
nothing; a drafting round would add a pass of its own (the weights read once more) and the
draft's steps, and hold back every prompt being filled. So such a step decodes plainly, and
the last prompt's first token comes as AR's does (docs/decision-log.md).

Planning is host time (Python, about 0.1 ms a sequence), which at a large batch on a GPU is a
large part of a step (a GPU's step at a batch of 64 is some 16 ms: docs/decision-log.md). So where a plan drafts nothing (no K, no lookup,
no probe) and took more than HOLD_SHARE of the step it planned (V(n), at least HOLD_MIN_S),
it holds for as many rounds as keep planning within that share, unless a new sequence joins.
Those rounds learn only their time: V(n), and the idle time that every sequence (and the
engine) is credited with when planning resumes, so probes come as they would have.
"""
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from ssd.request.sequence import Sequence
from ssd.speculative.plan import Plan, SeqPlan
from ssd.speculative.policy.costs import Acceptance, CatchupCost, Timings, expected_tokens
from ssd.speculative.policy.draft_stop import DraftStop, StopRule
from ssd.speculative.policy.estimators import LowQuantile
from ssd.speculative.policy.siblings import MAX_PER_SEQUENCE, SiblingOffer, SiblingPolicy, cut, eligible
from ssd.speculative.records import Round, argmax_chain
from ssd.speculative.sources.ngram import PromptLookup

PRIOR_RATE = 0.6  # acceptance assumed before anything is measured
PRIOR_WEIGHT = 2.0  # ... worth this many rounds
SEQ_WEIGHT = 4.0  # a sequence's own rates are shrunk towards the engine-wide ones by this many rounds
SEQ_DECAY = 0.9  # per round: a sequence's recent text counts most (copying spans come and go)
ENGINE_DECAY = 0.995
PROBE_K = 2
PROBE_BUDGET = 0.05  # share of plain decoding time a sequence spends on probes, at most
ENGINE_EVIDENCE = 8  # decayed rounds at the first position
PROBE_BACKOFF = 16  # a probe that gains nothing doubles the wait before the next, up to this factor
EXPLORE_GAP = 4  # a drafting sequence tries one token deeper than chosen every this many rounds ...
EXPLORE_EVIDENCE = 1.0  # ... while its own (decayed) rounds that reached that position are fewer
# Prompt lookup's acceptance assumed before any is measured, by match length 1, 2, 3, 4+
# (replayed on the bench sets, bench/studies/lookup_headroom.py: a 1-token match is rarely a copy).
LOOKUP_PRIOR = (0.2, 0.4, 0.6, 0.75)
HOLD_SHARE = 0.03  # planning's share of the rounds where a plan that drafts nothing holds (module doc)
HOLD_MIN_S = 0.5e-3  # a plan quicker than this never holds
HOLD_MAX = 32  # rounds a plan holds for at most
# A token's worth is at least this share of the batch's average (_worth): its request's user waits
# for it, whatever it saves the batch (where a pass costs the same at any batch size, nothing).
WORTH_FLOOR = 0.25
RETAKES = 2  # times the start-up timings are taken again, at most, where rounds find them spiked
WITHOUT_EMA = 0.2  # a sequence's time a token without the draft, over plain decoding's: its rounds' weight


@dataclass
class SeqState:
    """What auto-K keeps of one sequence."""

    acceptance: Acceptance = field(default_factory=lambda: Acceptance(SEQ_DECAY))
    seen: int = 0  # its tokens when it last drafted (what the draft read)
    idle_s: float = 0.0  # seconds of plain decoding since it last drafted
    backoff: int = 1  # the wait's factor before its next probe
    explore_wait: int = 0  # drafting rounds since it last drafted deeper
    lookup: list[Acceptance] = field(default_factory=lambda: [Acceptance(SEQ_DECAY) for _ in LOOKUP_PRIOR])
    without: float | None = None  # its time a token without the draft (plain or its lookup) over plain's, averaged


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
                 steps_measured: bool = False, lookup: PromptLookup | None = None, window: int | None = None,
                 siblings: bool = False, stop: DraftStop | None = None, lookup_trees: bool = False):
        """verify_time(rows): the target's pass over that many rows of one sequence, timed now
        (None: it cannot be now; at start-up it must be);
        draft_step_s: one draft step (0 for a draft that costs nothing, as prompt lookup), or what
        times one now, None where it cannot (then timed again for each new sequence until a round
        measures it: module doc);
        steps_measured: the draft times its steps itself (the rounds' step_s; SD), else a round's
        wait per draft token is the step's cost (SSD, prompt lookup); lookup: prompt lookup
        beside the draft (module doc); window: the most tokens a catch-up reads (draft_window);
        siblings: ask the draft for branches off its chains (runners-up, a head's tree) and offer them
        (siblings.py); lookup_trees: offer a lookup's branches (suffix decoding's tree); stop: the draft's
        stopping rule (draft_stop.py), which drafting sequences it applies to get K = k_max for."""
        self.k_max = k_max
        self.stop = stop
        self.lookup, self.window = lookup, window
        self.siblings = siblings
        self.lookup_trees = lookup_trees and hasattr(lookup, "tree")
        self.branches, self.lookup_branches = SiblingPolicy(), SiblingPolicy()  # the draft's, the lookup's
        self.trees: dict[int, list] = {}  # seq_id -> this round's lookup tree (its candidate branches)
        self.lookup_overall = [Acceptance(ENGINE_DECAY) for _ in LOOKUP_PRIOR]
        self.found: dict[int, tuple[list[int], int]] = {}  # seq_id -> this round's lookup and its match class
        self.steps_measured = steps_measured
        # A pass over the chain's rows, and (timed at a few sizes, read between them) with branches.
        wider = [k_max + 1 + m for m in (1, 2, 4, 8, MAX_PER_SEQUENCE)] if siblings or self.lookup_trees else []
        sizes = list(range(1, k_max + 2)) + wider
        self.verify = Timings({r: verify_time(r) for r in sorted(set(sizes))})
        self.time_verify, self.retakes = verify_time, RETAKES
        self.time_draft = draft_step_s if callable(draft_step_s) else None
        self.draft_step = (self.time_draft() or 0.0) if self.time_draft else draft_step_s  # D(K) = K x draft_step
        self.draft_measured = False
        self.draft_times = LowQuantile()  # the rounds' draft steps (the start-up timings left out)
        self.catchup = CatchupCost()  # the draft's cost of reading tokens it has not seen
        self.overall = Acceptance(ENGINE_DECAY)  # engine-wide, over every sequence's rounds
        self.seqs: dict[int, SeqState] = {}
        self.probing: set[int] = set()  # the sequences probing on their own budget this round
        self.engine_idle_s = 0.0  # seconds since any sequence drafted
        self.engine_backoff = 1  # the engine's probes double their wait as the sequences' do
        self.engine_probe: int | None = None  # the sequence probing on the engine's budget this round
        self.hold = 0  # rounds the last plan (one that drafts nothing) still holds for (module doc)
        self.holding = False  # this round's plan is a held one
        self.held_s = 0.0  # those rounds' time, not yet credited as idle

    def plan(self, seqs: list[Sequence], filling: bool = False, waiting: bool = False) -> Plan:
        if filling:  # plain decoding, its rows in the prompt chunks' pass (module doc)
            self._new_round()
            return Plan([SeqPlan(0)] * len(seqs))
        if self.hold and all(s.seq_id in self.seqs for s in seqs):
            self.hold -= 1
            self.holding = True
            return Plan([SeqPlan(0)] * len(seqs))
        self.hold = 0
        for state in self.seqs.values():
            state.idle_s += self.held_s
        self.engine_idle_s += self.held_s
        self.held_s = 0.0
        t0 = time.perf_counter()
        plan = self._plan(seqs, waiting)
        took = time.perf_counter() - t0
        if took > HOLD_MIN_S and not any(plan.ks):
            self.hold = min(HOLD_MAX, int(took / max(HOLD_SHARE * self.verify(len(seqs), len(seqs)), 1e-9)))
        return plan

    def _plan(self, seqs: list[Sequence], waiting: bool) -> Plan:
        if self.time_draft and not self.draft_measured and any(s.seq_id not in self.seqs for s in seqs):
            timed = self.time_draft()  # (module doc: a spiked start-up timing)
            self.draft_step = self.draft_step if timed is None else min(self.draft_step, timed)
        prior = self.overall.rates(self.k_max, [PRIOR_RATE] * self.k_max, PRIOR_WEIGHT)
        rates = [self._state(s).acceptance.rates(self.k_max, prior, SEQ_WEIGHT) for s in seqs]
        gains = [expected_tokens(r) for r in rates]
        # Each sequence's options: draft K = 0..k_max tokens (K = 0: plain decoding), then its
        # lookup's first 1..n tokens; as (tokens expected, rows, draft steps), the tokens weighed
        # by their worth (_worth).
        self._new_round()
        found = [self._lookup(s) for s in seqs]
        worth = self._worth(seqs, waiting)
        options = [[(w * g[k], k + 1, k) for k in range(self.k_max + 1)] + [(w * lg[k], k + 1, 0)
                                                                           for k in range(1, len(lg))]
                   for w, g, (_, lg) in zip(worth, gains, found)]
        picks = self._best(options)
        ks = [min(p, self.k_max) for p in picks]
        lookups: dict[int, list[int]] = {}  # seq_id -> prompt lookup's tokens proposed instead of the draft's
        learning = not self.engine_knows()  # too little measured to refuse a catch-up
        # Once learning is over, a probe is worth its catch-up only if drafting, were it to work
        # as the prior assumes, would save more than that over the tokens left (no probe near a
        # request's end).
        hopeful = expected_tokens([PRIOR_RATE] * self.k_max)
        hopeful_k = max(range(1, self.k_max + 1), key=lambda k: hopeful[k] / self._round_s(k))
        hope = (hopeful[hopeful_k], hopeful_k + 1, hopeful_k)  # that option: (tokens expected, rows, draft steps)
        batch = _Batch(options, picks, self.draft_step, self.verify)
        costs: dict[int, float] = {}  # b -> what a probe would cost now, for the sequences at K = 0
        for b, s in enumerate(seqs):
            missed = s.num_tokens - self.seqs[s.seq_id].seen
            catchup = self._catchup_s(missed, s.num_tokens) if missed > 2 else 0.0
            # Saves against what the sequence would do without the draft: plain decoding, or its
            # lookup where that is faster (a summary copying its document), as the batch's time
            # a token (_Batch). The lookup's share of plain decoding's is averaged over its rounds
            # (matches come and go); plain decoding's is the batch's now.
            state = self.seqs[s.seq_id]
            plain = batch.per_token(b, options[b][0])
            now = batch.without(b) / plain
            state.without = now if state.without is None else state.without + WITHOUT_EMA * (now - state.without)
            # Its tokens left, weighed as the options' are; a sequence worth more than the average
            # is so only until it catches up with the others (module doc), so no more than that.
            left = min(worth[b], 1.0) * (s.params.max_tokens - len(s.output_ids))
            hoped = (worth[b] * hope[0], *hope[1:])
            best_case = batch.saving(b, hoped, plain, left)
            # What drafting saves over the tokens left must pay a long catch-up: by the measured
            # rates, or while too little is measured by the prior's (a long prompt with a short
            # answer is never prefilled for the draft, even by a fresh engine's first request).
            saving = batch.saving(b, hoped if learning else options[b][ks[b]], state.without * plain, left)
            if ks[b] and picks[b] <= self.k_max and catchup > max(self.verify(1), saving):
                # No draft for it this round: plain decoding, or its lookup where that is faster.
                ks[b], picks[b] = 0, batch.alternative(b)
            if picks[b] > self.k_max:  # a lookup round
                ks[b] = picks[b] - self.k_max
                lookups[s.seq_id] = found[b][0][:ks[b]]
                continue
            if ks[b] == 0 and catchup <= best_case:
                k = min(PROBE_K, self.k_max)
                # The catch-up grows with the wait whatever it is: the backoff stretches the rest.
                costs[b] = catchup + batch.extra(b, options[b][k]) * state.backoff
        # While learning, a K of 0 may rest on a round or two (a warm-up's): probe at once.
        probes = [b for b, c in costs.items() if learning or self.seqs[seqs[b].seq_id].idle_s * PROBE_BUDGET >= c]
        if costs and not probes:  # the engine's own budget: one probe when nothing drafted for long
            b = min(costs, key=costs.get)
            if self.engine_idle_s * PROBE_BUDGET >= costs[b] * self.engine_backoff:
                probes = [b]
                self.engine_probe = seqs[b].seq_id
        for b in probes:
            ks[b] = min(PROBE_K, self.k_max)
            if not learning:  # probes on a budget back off; learning ends by itself
                self.probing.add(seqs[b].seq_id)
        for b, s in enumerate(seqs):
            # A position beyond the chosen K is never reached, so its rate (the engine-wide one)
            # would never be corrected by this sequence: now and then it drafts one token deeper.
            k, state = ks[b], self.seqs[s.seq_id]
            if 0 < k < self.k_max and s.seq_id not in self.probing and s.seq_id not in lookups \
                    and state.explore_wait >= EXPLORE_GAP and self._evidence(s, k) < EXPLORE_EVIDENCE:
                ks[b] = k + 1
                state.explore_wait = 0
        rule = self._stop_rule(seqs, ks, gains, lookups) if self.stop is not None else None
        trees = {i: tuple(cut(self.trees.get(i, []), len(self.found[i][0]), len(t))) for i, t in lookups.items()}
        offer = SiblingOffer(rates, [eligible(s) for s in seqs], self.draft_step, partial(self.verify, seqs=len(seqs)),
                             self.branches.calibration, self.lookup_branches.calibration) \
            if self.siblings or any(trees.values()) else None
        return Plan([SeqPlan(k, lookups.get(s.seq_id), self.siblings, rule if rule is not None and argmax_chain(s)
                             else None, trees.get(s.seq_id, ())) for s, k in zip(seqs, ks)], offer)

    def _new_round(self) -> None:
        """Forget the last plan's per-round state: its lookups and trees, its probes."""
        self.found, self.trees = {}, {}
        self.probing, self.engine_probe = set(), None

    def _stop_rule(self, seqs: list[Sequence], ks: list[int], gains: list[list[float]],
                   lookups: dict[int, list[int]]) -> StopRule | None:
        """The draft's stopping rule (draft_stop.py) takes over the length of a drafting round
        where one sequence drafts alone (not a probe, not a lookup round): its K becomes k_max,
        a cap. The rule's rate before any round was measured: the one expected of the K chosen
        here. None: the rule does not apply this round."""
        drafting = [b for b, k in enumerate(ks) if k and seqs[b].seq_id not in lookups]
        s = seqs[drafting[0]] if len(drafting) == 1 else None
        if s is None or s.seq_id in self.probing or s.seq_id == self.engine_probe or not argmax_chain(s):
            return None
        k = ks[drafting[0]]
        ks[drafting[0]] = self.k_max
        return self.stop.rule(self.k_max, self.draft_step, self.verify,
                              gains[drafting[0]][k] / (k * self.draft_step + self.verify(k + 1)))

    def _evidence(self, seq: Sequence, position: int) -> float:
        """The sequence's own decayed rounds that reached draft position `position` (0-based)."""
        own = self.seqs[seq.seq_id].acceptance.reached
        return own[position] if position < len(own) else 0.0

    def engine_knows(self) -> bool:
        """Enough recent rounds engine-wide that a sequence may be refused drafting by them."""
        return bool(self.overall.reached) and self.overall.reached[0] >= ENGINE_EVIDENCE

    def _round_s(self, k: int) -> float:
        """D(k) + V(k + 1): one sequence's round drafting k tokens."""
        return k * self.draft_step + self.verify(k + 1)

    def _catchup_s(self, tokens: int, context: int) -> float:
        """The draft's pass over the last `tokens` of a context it has not seen: a step plus
        their measured cost (CatchupCost; before any, a guess from the measured passes). Past the window it
        reads only the context's last `window` tokens, from position 0."""
        start = context - tokens
        if self.window is not None and tokens > self.window:
            tokens, start = self.window, 0
        fitted = self.catchup(tokens, tokens * (start + (tokens + 1) / 2))
        if fitted is not None:
            fitted *= self._draft_load()
        else:
            # Before any catch-up is measured: what a row adds to the target's pass, scaled by the
            # draft's step against the target's. A draft reads a prompt as the target verifies
            # rows (a fixed share of a step priced them at a third: docs/decision-log.md).
            top = self.k_max + 1
            fitted = tokens * (self.verify(top) - self.verify(1)) / (top - 1) * self.draft_step / self.verify(1)
        return self.draft_step + fitted

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[float]]:
        """The sequence's prompt-lookup proposal (up to k_max tokens) and E(K) for its first K
        (empty: no lookup, or nothing found)."""
        if self.lookup is None:
            return [], []
        if self.lookup_trees and argmax_chain(seq):  # (sampled requests: sibling leaves of the draft's only)
            tokens, n, self.trees[seq.seq_id] = self.lookup.tree(seq, self.k_max)
        else:
            tokens, n = self.lookup.match(seq, self.k_max)
        if not tokens:
            return [], []
        c = min(n, len(LOOKUP_PRIOR)) - 1
        self.found[seq.seq_id] = tokens, c
        prior = self.lookup_overall[c].rates(len(tokens), [LOOKUP_PRIOR[c]] * len(tokens), PRIOR_WEIGHT)
        return tokens, expected_tokens(self._state(seq).lookup[c].rates(len(tokens), prior, SEQ_WEIGHT))

    def _worth(self, seqs: list[Sequence], waiting: bool) -> list[float]:
        """Each sequence's token's worth, the seconds it saves later against the batch's plain
        step a token (module doc, "a token's worth"): decoded plainly from here, a sequence
        with the k-th most tokens left ends when k sequences remain, so one token fewer saves
        it V(k, k) - V(k - 1, k - 1), averaged over the sequences with about as many left (a
        round's gain more or less), at least WORTH_FLOOR. All 1 where requests wait for places
        (a sequence that ends makes room for one) or one sequence decodes."""
        n = len(seqs)
        if waiting or n == 1:
            return [1.0] * n
        left = [s.params.max_tokens - len(s.output_ids) for s in seqs]
        fewest = sorted(left)
        full = [0.0] + [self.verify(k, k) for k in range(1, n + 1)]  # plain steps of 0..n sequences
        mean = max(full[n] / n, 1e-12)
        out = []
        for m in left:
            # The ranks (1: the most left) of the sequences within a round's gain of this one's.
            lo, hi = n - bisect_right(fewest, m + self.k_max + 1), n - bisect_left(fewest, m - self.k_max - 1)
            out.append(max(WORTH_FLOOR, (full[hi] - full[lo]) / (hi - lo) / mean))
        return out

    def _best(self, options: list[list[tuple[float, int, int]]]) -> list[int]:
        """Each sequence's option (tokens expected, rows, draft steps; the first k_max + 1 are
        draft K = 0..k_max) that together maximise sum E_s / (D(deepest draft) + V(sum rows)): the
        best draft K common to all, then each sequence's best option given the others'
        (coordinate ascent)."""
        n, kmax, step = len(options), self.k_max, self.draft_step
        # Plain loops and each pass size read once a plan: at 64 sequences this weighs ~1,200
        # options, and planning is host time beside a GPU's ~16 ms step (module doc).
        read: dict[int, float] = {}

        def verify(rows: int) -> float:
            v = read.get(rows)
            if v is None:
                v = read[rows] = self.verify(rows, n)
            return v

        common, top = 0, -1.0
        for k in range(kmax + 1):
            speed = sum(o[k][0] for o in options) / max(k * step + verify(n * (k + 1)), 1e-9)
            if speed > top:
                common, top = k, speed
        picks = [common] * n
        at = [0] * (kmax + 1)  # sequences per draft depth, for the deepest of the others
        at[common] = n
        gain, rows = sum(o[common][0] for o in options), n * (common + 1)
        for _ in range(2):
            for b, opts in enumerate(options):
                old_gain, old_rows, old_depth = opts[picks[b]]
                at[old_depth] -= 1
                others = max((k for k in range(kmax + 1) if at[k]), default=0)
                rest_gain, rest_rows = gain - old_gain, rows - old_rows
                best, top = 0, -1.0
                for i, (g, r, depth) in enumerate(opts):
                    speed = (rest_gain + g) / max(max(others, depth) * step + verify(rest_rows + r), 1e-9)
                    if speed > top:
                        best, top = i, speed
                gain += opts[best][0] - old_gain
                rows += opts[best][1] - old_rows
                at[opts[best][2]] += 1
                picks[b] = best
        return picks

    def learn(self, rounds: list[Round]) -> None:
        """One round of the batch (round.py): tokens each sequence drafted and had accepted, the
        round's wait for proposals and its pass, and where the draft measured them, its time
        per draft token without catch-up (a prompt's prefill, tokens missed at K = 0: counting
        those would make drafting look dearer the longer it was off) and its catch-up."""
        draft_s, verify_s, step_s, catchup = rounds[0].draft_s, rounds[0].verify_s, rounds[0].step_s, rounds[0].catchup
        if self.holding:  # a held plan's round (module doc)
            self.holding = False
            self.held_s += draft_s + verify_s
            if rounds[0].timed:
                self.verify.observe(len(rounds), verify_s, len(rounds))
            return
        drafted = [0 if r.proposal.lookup else r.drafted for r in rounds]  # by the draft model
        for r in rounds:
            s, d, a, state = r.seq, r.drafted, r.accepted, self._state(r.seq)
            if s.seq_id in self.found:  # the lookup's tokens against those the round kept
                tokens, c = self.found[s.seq_id]
                known = min(len(tokens), len(r.tokens))
                agree = next((i for i in range(known) if tokens[i] != r.tokens[i]), known)
                state.lookup[c].observe(min(agree + 1, known), agree)
                self.lookup_overall[c].observe(min(agree + 1, known), agree)
            if r.proposal.lookup:  # the draft neither ran nor read these: it stays idle
                state.idle_s += draft_s + verify_s
            elif d:
                if s.seq_id in self.probing:
                    state.backoff = 1 if a else min(2 * state.backoff, PROBE_BACKOFF)
                if s.seq_id == self.engine_probe:
                    self.engine_backoff = 1 if a else min(2 * self.engine_backoff, PROBE_BACKOFF)
                state.seen = s.num_tokens
                state.idle_s = 0.0
                state.explore_wait += 1
                state.acceptance.observe(d, a)
                self.overall.observe(d, a)
            else:
                state.idle_s += draft_s + verify_s
        self.engine_idle_s = 0.0 if any(drafted) else self.engine_idle_s + draft_s + verify_s
        if rounds[0].timed:  # first: the load that the draft's costs are read at
            self.verify.observe(sum(r.drafted + len(r.branches) for r in rounds) + len(rounds), verify_s, len(rounds))
            if self.retakes and self.verify.retake_due():  # (module doc: a spiked start-up)
                self.retakes -= 1
                again = {s: self.time_verify(s) for s in self.verify.startup if s not in self.verify.times}
                self.verify.retake({s: t for s, t in again.items() if t is not None})
        deepest = max(drafted, default=0)  # a round drafts as deep as its longest proposal
        step = step_s if self.steps_measured else draft_s / deepest if deepest else None
        if step is not None:  # None: no step without catch-up this round
            self.draft_quiet = self.draft_times.observe(step / self._draft_load())
            self.draft_measured = True
        if catchup is not None and catchup[1] > 0:  # a pass costs a step, plus what its tokens cost
            self.catchup.observe(max(0.0, catchup[0] - self.draft_step) / self._draft_load(), catchup[1], catchup[2])
        self.branches.learn([r for r in rounds if not r.proposal.lookup])
        self.lookup_branches.learn([r for r in rounds if r.proposal.lookup])
        if self.stop is not None and any(drafted):
            stopped = [r for r in rounds if r.proposal.confidences is not None]  # the rule's, where it applied
            for r in stopped:
                self.stop.observe(r.proposal.confidences, r.accepted)
            if catchup is None and stopped:  # (a catch-up's pass is no draft step)
                self.stop.observe_rate(sum(len(r.tokens) for r in rounds), draft_s + verify_s)

    @property
    def draft_step(self) -> float:
        """d: seconds a draft step takes now."""
        return self.draft_quiet * self._draft_load()

    @draft_step.setter
    def draft_step(self, seconds: float) -> None:
        self.draft_quiet = seconds / self._draft_load()

    def _draft_load(self) -> float:
        """The load the draft's costs share with the target's (Timings.scale) where it runs beside
        it (steps_measured: in this process), else none: they are kept in start-up units."""
        return self.verify.scale if self.steps_measured else 1.0

    def _state(self, seq: Sequence) -> SeqState:
        return self.seqs.setdefault(seq.seq_id, SeqState())

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.found.pop(seq_id, None)
        self.trees.pop(seq_id, None)
        if self.lookup is not None:
            self.lookup.release(seq_id)
        self.probing.discard(seq_id)
        if self.engine_probe == seq_id:
            self.engine_probe = None

    def held(self) -> dict[str, int]:
        return {"sequences": len(self.seqs), "probing": len(self.probing)}


class _Batch:
    """The round a plan's picks make (_best), to weigh one sequence's option in it: the batch's
    tokens and seconds with that sequence at another option and the others as picked. One
    sequence's saving is then the batch's, so drafting for it must pay for the rows it adds
    beside the others' (and for the draft's steps where the others draft none) against the
    batch's plain step, not against a plain step of its own (docs/decision-log.md). At one
    sequence it is the saving alone."""

    def __init__(self, options: list[list[tuple[float, int, int]]], picks: list[int], draft_step: float,
                 verify: Timings):
        self.options, self.picks = options, list(picks)
        self.draft_step, self.verify = draft_step, verify
        chosen = [opts[p] for opts, p in zip(options, picks)]
        self.gain, self.rows = sum(o[0] for o in chosen), sum(o[1] for o in chosen)
        depths = sorted((o[2] for o in chosen), reverse=True) + [0]
        self.deepest, self.second = depths[0], depths[1]  # the others' deepest: `second` where b's is deepest

    def round(self, b: int, option: tuple[float, int, int]) -> tuple[float, float]:
        """Tokens expected and seconds of the round with sequence b at `option`."""
        gain, rows, depth = self.options[b][self.picks[b]]
        others = self.second if depth == self.deepest else self.deepest
        total = self.rows - rows + option[1]
        seconds = max(others, option[2]) * self.draft_step + self.verify(total, len(self.options))
        return self.gain - gain + option[0], seconds

    def per_token(self, b: int, option: tuple[float, int, int]) -> float:
        """The batch's seconds a token with sequence b at `option`."""
        gain, seconds = self.round(b, option)
        return seconds / max(gain, 1e-9)

    def alternative(self, b: int) -> int:
        """Sequence b's best option without the draft (plain decoding, or its lookup's): the
        fewest seconds a token for the batch."""
        opts = self.options[b]
        return min((i for i, o in enumerate(opts) if o[2] == 0), key=lambda i: self.per_token(b, opts[i]))

    def without(self, b: int) -> float:
        """The batch's seconds a token with sequence b at its best option without the draft."""
        return self.per_token(b, self.options[b][self.alternative(b)])

    def saving(self, b: int, option: tuple[float, int, int], without: float, left: int) -> float:
        """Seconds that sequence b at a drafting `option` saves over its `left` tokens, against
        `without` seconds a token: over the rounds it takes to write them, the batch's tokens at
        that speed against the rounds' time. At one sequence, left x (without - its round's
        seconds a token)."""
        gain, seconds = self.round(b, option)
        return left / option[0] * (gain * without - seconds)

    def extra(self, b: int, option: tuple[float, int, int]) -> float:
        """Seconds that sequence b at `option` adds to the round against its plain decoding."""
        return self.round(b, option)[1] - self.round(b, self.options[b][0])[1]
