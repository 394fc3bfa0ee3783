"""The draft model's side of speculation, shared by SD (in the target's process) and SSD (in
the draft worker, ssd/speculative/draft/ssd_draft.py): each sequence's tokens as the draft knows
them, the draft's paged KV cache, and drafting K tokens one forward pass at a time.

After a round where the target accepted k of the draft's tokens and added its own token t,
the draft's first `confirmed + k` tokens are still right: `sync` keeps those, appends the
target's tokens, and rolls the draft's KV cache back to the part that is still valid.

On a GPU the steps of greedy chains after each one's first token run as one CUDA graph
(ssd/runner/chain_graphs.py), each token picked on the GPU: no host read between steps.
"""
import time
from dataclasses import dataclass, field

import torch

from ssd.errors import SSDError
from ssd.models.decoder import DecoderLM
from ssd.models.loader import shared_model
from ssd.request.logits_process import LogitsProcessor
from ssd.request.noise import SharedNoise, request_noise
from ssd.request.sampler import probs_from_logits, sample, saguaro
from ssd.runner.chain_graphs import CHAIN_ROWS, ChainSteps
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import WARM_UP_OWNER, Chunk, ModelRunner
from ssd.runner.threads import ThreadChooser
from ssd.sampling_params import SamplingParams
from ssd.speculative.draft.drafting import Drafting, PassTimes
from ssd.speculative.draft.spec_cache import SpeculationCache
from ssd.speculative.draft.vocab import DraftHead, ExtraTokens
from ssd.speculative.options import DraftConfig
from ssd.speculative.policy.costs import Acceptance, Timings, expected_tokens
from ssd.speculative.policy.draft_stop import StopRule
from ssd.speculative.policy.estimators import LowQuantile
from ssd.speculative.records import Alternative, Proposal, argmax_chain, round_k
from ssd.speculative.sources.ngram_index import NgramIndex


GUESS_NGRAM_MAX = 4  # the longest n-gram looked up for the draft's guesses
# The most guessed rows a pass feeds: each costs the pass a little, and with draft_stop a
# round's K is k_max, most of which it never drafts.
GUESS_ROWS = 3
# A guessed row's chance of being the draft's own pick (the rows before it right), before any
# was measured, worth this many passes; decayed per pass.
GUESS_PRIOR, GUESS_WEIGHT, GUESS_DECAY = 0.5, 4.0, 0.99
GUESS_PROBE = 16  # where no guess pays, every this many passes guess one row anyway (to learn)


def chain_buckets(device: torch.device) -> list[int] | None:
    """The sequences a chain graph holds, by bucket (None: no chain graphs; on a CPU, where the
    passes are the host's own work, there is nothing to save)."""
    return [1, 2, 4, CHAIN_ROWS] if device.type == "cuda" else None


def agreed(picked: list[int], guess: list[int]) -> int:
    """How many leading tokens of a guess the draft picked itself, row by row: a row's pick
    stands only where the tokens fed before it were the draft's own."""
    right = 0
    while right < len(guess) and picked[right] == guess[right]:
        right += 1
    return right


@dataclass
class DraftSeq:
    """Everything the draft side holds of one sequence, so that releasing it frees all of it
    (DraftEngine.release): its tokens as the draft knows them, its K/V in the draft's cache
    (under its seq_id, and SSD's tree branches under tree_owner), its own tokens outside a
    reduced head, and SSD's speculation cache for the round in flight."""

    seq_id: int
    params: SamplingParams
    generator: torch.Generator | None
    noise: SharedNoise | None = None  # a seeded request's shared noise: the target's (noise.py)
    processor: LogitsProcessor | None = None  # SD: the request's penalties and constraint, the draft's copy
    tokens: list[int] = field(default_factory=list)  # confirmed tokens, then the current speculation
    confirmed: int = 0
    fed: int = 0  # leading tokens the draft has fed: their K/V are in its KV cache
    # Leading context tokens the draft dropped (DraftEngine's window): tokens[i] is the
    # context's token offset + i, at draft position i.
    offset: int = 0
    extra: ExtraTokens = field(default_factory=ExtraTokens)
    speculations: SpeculationCache = field(default_factory=SpeculationCache)  # SSD's, for the round in flight
    # SSD: whether the current speculation came from `speculations`, and the fork candidates of
    # the tree built from it (per depth, most likely first).
    after_hit: bool = False
    candidates: list[list[int]] = field(default_factory=list)
    # Prompt lookup's index of its confirmed tokens, for the draft's guesses (DraftEngine._guess).
    ngrams: NgramIndex = field(default_factory=lambda: NgramIndex(GUESS_NGRAM_MAX))

    @property
    def spec(self) -> list[int]:
        return self.tokens[self.confirmed:]

    @property
    def tree_owner(self) -> int:
        """The KV cache owner of its tree's branch slots (its main slots are owned by seq_id)."""
        return -1 - self.seq_id

    def outcome(self, num_valid: int, new_tokens: list[int]) -> tuple[int, int] | None:
        """The outcome (k, t) of its round, as its next request tells it (before sync applies
        it): the first num_valid tokens stand, then new_tokens. None: a first request, or one
        after the draft's context was cut short."""
        valid = num_valid - self.offset
        if not (self.spec and self.confirmed <= valid and len(new_tokens) == 1):
            return None
        return valid - self.confirmed, new_tokens[0]


class DraftEngine:
    def __init__(self, model: DecoderLM, device: torch.device, *, k_max: int, cache_tokens: int,
                 block_size: int = 16, seed: int | None = None, saguaro: tuple[float, int] | None = None,
                 vocab_ids: tuple[int, ...] | None = None, prefix_salt: str | None = None,
                 window: int | None = None, guesses: bool = False, threads: int | None = None,
                 seeded_sampling: str = "shared-noise"):
        """saguaro: (C, n) to draft sampled requests from Saguaro's distribution (SSD).
        vocab_ids: the token ids of a reduced-vocabulary head (the model's logits are for those,
        in that order): the draft proposes only them and each sequence's own tokens (DraftHead),
        and its q is 0 on every other token. prefix_salt: the draft's own prefix cache
        (PagedKVCache), None for none. window: the most tokens of a context the draft reads
        when catching up; beyond that it starts over from the context's last `window` tokens
        (positions from 0: RoPE sees the same distances), None for all. guesses: prompt lookup's
        guesses of the draft's next tokens join its passes (_guess). threads: the most CPU
        threads a pass takes, their count following the machine's load (ssd/runner/threads.py);
        None: the process's count. seeded_sampling: the target's (EngineConfig): under
        "shared-noise" a seeded request drafts by the target's noise (ssd/request/noise.py)."""
        cfg = model.config
        self.seeded_sampling = seeded_sampling
        self.window, self.guesses = window, guesses
        self.guessed = Acceptance(GUESS_DECAY)  # how often a guessed row was right (_guess_rows)
        self.passes = 0
        self.k_max, self.device, self.saguaro = k_max, device, saguaro
        self.max_len = cfg.max_position_embeddings
        self.head = DraftHead(model, vocab_ids, device)
        self.kv = PagedKVCache(cfg, cache_tokens, block_size, device, next(model.parameters()).dtype, prefix_salt)
        # A draft's bits need not match anything: buckets of every size, each its own graph.
        buckets = [1 << i for i in range(7)] if device.type == "cuda" else None
        max_keys = min(self.max_len, cache_tokens) + k_max + 1
        self.runner = ModelRunner(model, self.kv, device, buckets, max_keys=max_keys,
                                  threads=None if threads is None else ThreadChooser(threads, LowQuantile))
        self.runner.warm_up(head=False)  # the draft's passes stop at hidden states (DraftHead)
        # The draft's pass by rows, timed now and then measured, to price its guesses (_guess_rows).
        self.pass_time = Timings({r: self.runner.timed_pass(r, repeat=2, head=False)
                                  for r in range(1, GUESS_ROWS + 2)}) if guesses else None
        chains = chain_buckets(device)
        self.chain = None if not chains or k_max < 2 else ChainSteps(
            self._step, self.head.ids, self.kv.kv, self.kv.scratch_slot(), max_keys, chains, k_max - 1)
        if self.chain is not None:
            self.kv.reserve(WARM_UP_OWNER, k_max)
            self.chain.warm_up(self.kv.slot_array(WARM_UP_OWNER, k_max))
            self.kv.release(WARM_UP_OWNER)
        self.seqs: dict[int, DraftSeq] = {}
        self._seeds = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator()
        if seed is None:
            self._seeds.seed()

    @classmethod
    def from_config(cls, cfg: DraftConfig, device: torch.device, saguaro: tuple[float, int] | None = None
                    ) -> "DraftEngine":
        from ssd.store import resolve_model
        ids = None if cfg.vocab_ids is None else tuple(cfg.vocab_ids)
        model = shared_model(resolve_model(cfg.model), device, getattr(torch, cfg.dtype), cfg.weights, ids)
        return cls(model, device, k_max=cfg.k_max, cache_tokens=cfg.cache_tokens, block_size=cfg.block_size,
                   seed=cfg.seed, saguaro=saguaro, vocab_ids=ids,
                   prefix_salt=f"{cfg.model}|{cfg.dtype}|{cfg.weights}" if cfg.prefix_caching else None,
                   window=cfg.window, guesses=cfg.guesses, threads=cfg.threads, seeded_sampling=cfg.seeded_sampling)

    def sync(self, seq_id: int, num_valid: int, new_tokens: list[int], params: SamplingParams | None,
             k: int, processor: LogitsProcessor | None = None) -> DraftSeq:
        """Apply the target's outcome: keep the first num_valid tokens the draft holds, append
        new_tokens (a prompt the first time, then the target's own token). k: the round's K,
        which the target decided (round_k) and the draft checks. processor: the first time,
        the draft's copy of what the request changes about the logits (SD)."""
        s = self.seqs.get(seq_id)
        if s is None:
            if params is None:
                raise SSDError(f"draft protocol: first request for sequence {seq_id} carries no params")
            s = self.seqs[seq_id] = DraftSeq(seq_id, params, self._generator(params),
                                             request_noise(params, self.seeded_sampling), processor=processor)
        if num_valid == 0:  # the whole context again
            s.offset = 0
            s.tokens.clear()
        if not 0 <= num_valid - s.offset <= len(s.tokens) or not (new_tokens or num_valid):
            raise SSDError(f"draft protocol: sequence {seq_id} keeps {num_valid} of {s.offset + len(s.tokens)} "
                           f"tokens and adds {len(new_tokens)}")
        num_valid -= s.offset
        del s.tokens[num_valid:]
        first = not s.tokens
        s.tokens += new_tokens
        if not 0 <= k <= round_k(self.k_max, len(s.tokens), self.max_len):
            raise SSDError(f"draft protocol: sequence {seq_id} of {len(s.tokens)} tokens asks for {k} draft tokens, "
                           f"beyond K {self.k_max} or the draft's context of {self.max_len}")
        self.head.extend(s.extra, new_tokens)
        s.confirmed = len(s.tokens)
        if first:  # a prompt, or the whole context again: start from the cached prefix
            s.ngrams = NgramIndex(GUESS_NGRAM_MAX)
            self.kv.release(seq_id)
            s.fed = self.kv.match(seq_id, s.tokens, s.params.cache_salt)
        else:
            s.fed = min(s.fed, num_valid)
        s.candidates = []
        self.kv.truncate(seq_id, s.fed)
        self.kv.commit(seq_id, s.tokens[:s.fed])
        return s

    def release(self, seq_id: int) -> None:
        """Forget a sequence: everything of it is in its DraftSeq and its two cache owners."""
        s = self.seqs.pop(seq_id, None)
        if s is not None:
            self.kv.commit(s.seq_id, s.tokens[:s.confirmed])
            self.kv.release(s.seq_id)
            self.kv.release(s.tree_owner)

    def held(self) -> dict[str, int]:
        return {"draft sequences": len(self.seqs), **{f"draft KV {k}": n for k, n in self.kv.held().items()}}

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy_decoding:
            return None
        gen = torch.Generator(self.device)
        if params.seed is not None:  # a seeded request drafts reproducibly too
            gen.manual_seed(params.seed ^ 0x5D5D)
        else:
            gen.manual_seed(int(torch.randint(2**62, (1,), generator=self._seeds)))
        return gen

    # ---- drafting -------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, seqs: list[DraftSeq], ks: list[int], alternatives: bool = False,
              stops: list[StopRule | None] | None = None) -> list[Proposal]:
        """ks[b] tokens for each sequence, appended to its speculation, one batched forward pass
        per token (fewer where the draft's guesses are right, _guess); the first pass feeds
        whatever the draft has not seen (a prompt, the target's token). With a rule in stops[b],
        a greedy request whose logits nothing changes drafts up to ks[b] tokens, as long as the
        rule (draft_stop.py) says one more is worth it. Each proposal has the q [k, V] its
        tokens were drawn from (None for greedy requests), with `alternatives` each drafted
        token's runner-up (requests whose logits nothing changes, ssd/speculative/policy/siblings.py),
        where a rule applied each token's top-1 probability, and the call's timings (step_s,
        catchup: Proposal)."""
        drafts = [Drafting(k, rule if rule is not None and argmax_chain(s) else None)
                  for s, k, rule in zip(seqs, ks, stops or [None] * len(seqs))]
        times = PassTimes()
        judged = any(d.rule is not None for d in drafts)
        while True:
            self._forced(seqs, drafts)
            live = [b for b, d in enumerate(drafts) if d.left > 0]
            if not live:
                break
            if self._chainable([seqs[b] for b in live], [drafts[b].left for b in live], alternatives):
                times.step(*self._draft_chains(seqs, live, drafts))
                break
            start = time.perf_counter()
            chunks, guesses = [], []
            for b in live:
                self._window(seqs[b])
                seqs[b].fed = min(seqs[b].fed, len(seqs[b].tokens) - 1)  # feed at least the newest token
            rows = self._guess_rows(sum(len(seqs[b].tokens) - seqs[b].fed for b in live), len(live))
            for b in live:
                s = seqs[b]
                guess = self._guess(s, min(rows, drafts[b].left - 1))
                self.kv.reserve(s.seq_id, len(s.tokens) + len(guess))
                chunks.append(Chunk(s.seq_id, s.tokens[s.fed:] + guess, s.fed, 1 + len(guess)))
                guesses.append(guess)
            picked, q, runner_up, conf = self.pick(self.runner.forward(chunks, head=False), [seqs[b] for b in live],
                                                   [1 + len(g) for g in guesses], alternatives, judged, guesses=guesses)
            row, advanced = 0, []
            for i, b in enumerate(live):
                s, guess, d = seqs[b], guesses[i], drafts[b]
                right = agreed(picked[row:row + len(guess)], guess)  # their K/V stay
                if guess:
                    self.guessed.observe(len(guess), right)
                s.fed = len(s.tokens) + right
                if right < len(guess):
                    self.kv.truncate(s.seq_id, s.fed)
                new = guess[:right] + [picked[row + right]]
                s.tokens += new
                if q[i] is not None:
                    d.qs += list(q[i][:len(new)])
                for token, alt in zip(new, runner_up[row:row + len(new)]):
                    if alt is not None and len(d.alternatives) == len(d.tokens):  # none after a forced token
                        d.alternatives.append(alt)
                    d.tokens.append(token)
                if d.rule is not None:  # (the tokens of one pass come together: it reads the last)
                    d.judge(conf[row:row + len(new)])
                advanced.append(len(new))
                row += len(guess) + 1
            # A first pass that feeds a prompt or many tokens missed while K was 0 is catch-up,
            # not what one more draft token costs (auto-K reads step_s); the batch is as far as
            # its slowest sequence.
            elapsed = time.perf_counter() - start
            reads = [(c.start, len(c.tokens) - len(g)) for c, g in zip(chunks, guesses)]
            if times.timed_pass(elapsed, reads, min(advanced)) and self.pass_time is not None:
                self.pass_time.observe(sum(len(c.tokens) for c in chunks), elapsed, len(chunks))
        return [d.proposal(times) for d in drafts]

    def _step(self, tokens: torch.Tensor, states: None, positions: torch.Tensor, batch) -> tuple[torch.Tensor, None]:
        """One draft step of a chain (ChainSteps): the logits of the head's columns (a chain
        runs only where no sequence has extra columns: _chainable)."""
        return self.head.model.logits(self.head.model(tokens, positions, batch, self.kv.kv, None, False)), None

    def _chainable(self, seqs: list[DraftSeq], left: list[int], alternatives: bool) -> bool:
        """Whether the sequences' next tokens come from one chain graph: each has drafted its
        first token this call (one token unread), is greedy with its logits unchanged and has
        no extra columns in a reduced head, no runner-ups are asked for, and it fits."""
        return self.chain is not None and not alternatives and all(
            len(s.tokens) - s.fed == 1 and s.tokens[s.confirmed:] and argmax_chain(s) and not s.extra.known
            for s in seqs) and self.chain.fits(len(seqs), max(left), max(len(s.tokens) for s in seqs) - 1 + max(left))

    def _draft_chains(self, seqs: list[DraftSeq], live: list[int], drafts: list[Drafting]) -> tuple[float, int]:
        """The rest of the live sequences' chains as one graph of as many steps as the longest
        asks; the stopping rule then cuts each where it would have stopped it. Returns the
        graph's seconds and steps."""
        n = max(drafts[b].left for b in live)
        starts = [len(seqs[b].tokens) - 1 for b in live]
        for b, start in zip(live, starts):
            self.kv.reserve(seqs[b].seq_id, start + n)
            self.kv.prepare_write(seqs[b].seq_id, start, start + n)
        keys = [self.kv.slot_array(seqs[b].seq_id, start + n) for b, start in zip(live, starts)]
        t0 = time.perf_counter()
        picked, conf = self.chain.run([seqs[b].tokens[-1] for b in live], None, starts, keys, n)
        took = time.perf_counter() - t0
        for i, (b, start) in enumerate(zip(live, starts)):
            s, d = seqs[b], drafts[b]
            before = len(d.tokens)
            self.kv.written(s.seq_id, start + n)
            d.take_chain(picked[i], conf[i])
            s.tokens += d.tokens[before:]
            s.fed = len(s.tokens) - 1  # as after the passes one at a time: the newest token unread
            self.kv.truncate(s.seq_id, s.fed)
        return took, n

    def _guess_rows(self, fed: int, live: int) -> int:
        """The guessed rows per sequence this pass takes (at most GUESS_ROWS): the g that makes
        the most tokens a second, live x E(g) / T(fed + live x g), E(g) = 1 + p_1 + p_1 p_2 +
        ... the tokens a sequence's pass expects with g guessed rows (p_i: how often a guessed
        row was the draft's own pick, the rows before it right), T the pass's measured time by
        rows and sequences (costs.py's Timings). Where rows are dear (AVX2 without VNNI:
        docs/decision-log.md), guesses that are often wrong cost more
        than the passes they save; unpriced, they made a drafted token dearer, and auto-K
        drafted less (docs/algorithm.md, "The draft's guesses")."""
        if self.pass_time is None:
            return 0
        if fed > 2 * live:  # a catch-up (a prompt, tokens missed): a few rows more cost nothing beside it
            return GUESS_ROWS
        self.passes += 1
        gain = expected_tokens(self.guessed.rates(GUESS_ROWS, [GUESS_PRIOR] * GUESS_ROWS, GUESS_WEIGHT))
        best = max(range(GUESS_ROWS + 1), key=lambda g: gain[g] / max(self.pass_time(fed + live * g, live), 1e-9))
        return best if best or self.passes % GUESS_PROBE else 1

    def _guess(self, s: DraftSeq, most: int) -> list[int]:
        """Prompt lookup's guess of the draft's next `most` tokens, this pass's pick the first
        (what followed the latest earlier occurrence of its newest n-gram): fed after the
        token the pass drafts from, each row checks the one before it, so every guessed token
        the draft would have picked itself saves a pass (a guessed row costs a few per cent of
        a step on a CPU, bench/pass_cost.py). Greedy requests only: a sampled row's pick is a
        draw, which a guess matches less often, and each guessed row would cost its distribution
        over the whole vocabulary (measured slower, docs/decision-log.md, "The draft's guesses").
        A greedy request whose logits the draft changes (penalties, a constraint) has row j
        processed after the guess's first j tokens, as a verify pass's rows are (logits_process.py)."""
        if not self.guesses or most <= 0 or not s.params.greedy_decoding:
            return []
        s.ngrams.extend(s.tokens, s.confirmed)
        return s.ngrams.match(s.tokens, most)[0]

    def _window(self, s: DraftSeq) -> None:
        """More than `window` tokens unread: drop all but the context's last `window` and
        start over from them (the target verifies every token, so the draft may see less)."""
        drop = len(s.tokens) - self.window if self.window is not None else 0
        if drop <= 0 or len(s.tokens) - s.fed <= self.window:
            return
        del s.tokens[:drop]
        s.offset += drop
        s.confirmed -= drop
        s.ngrams = NgramIndex(GUESS_NGRAM_MAX)
        self.kv.release(s.seq_id)
        s.fed = self.kv.match(s.seq_id, s.tokens, s.params.cache_salt)

    def _forced(self, seqs: list[DraftSeq], drafts: list[Drafting]) -> None:
        """Tokens a sequence's constraint forces (the only one it allows) join its draft without
        a forward pass (the target scores them in its verify pass anyway); q is one-hot there."""
        for s, d in zip(seqs, drafts):
            while s.processor is not None and d.left > 0:
                token = s.processor.forced(s.tokens)
                if token is None:
                    break
                s.tokens.append(token)
                d.tokens.append(token)
                if not s.params.greedy_decoding:
                    d.qs.append(torch.nn.functional.one_hot(torch.tensor(token), self.head.vocab).float())

    @torch.inference_mode()
    def score_speculations(self, seqs: list[DraftSeq]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward pass over each sequence's newest confirmed token and its speculation
        ("glue decode"): the draft's logits at every depth j = 0..K of the speculation, with
        their extra columns' token ids (DraftHead)."""
        chunks = []
        for s in seqs:
            self._window(s)
            s.fed = min(s.fed, s.confirmed - 1)  # re-feed from the target's newest token
            self.kv.truncate(s.seq_id, s.fed)
            self.kv.reserve(s.seq_id, len(s.tokens))
            chunks.append(Chunk(s.seq_id, s.tokens[s.fed:], s.fed, len(s.spec) + 1))
            s.fed = len(s.tokens)
        rows = [len(s.spec) + 1 for s in seqs]
        logits, extra_ids = self.head(self.runner.forward(chunks, head=False), [s.extra for s in seqs], rows)
        return list(zip(logits.split(rows), extra_ids.split(rows) if extra_ids is not None else [None] * len(seqs)))

    def pick(self, hidden: torch.Tensor, seqs: list[DraftSeq], rows: list[int], alternatives: bool = False,
             confidence: bool = False, positions: list[int] | None = None, guesses: list[list[int]] | None = None
             ) -> tuple[list[int], list[torch.Tensor | None], list[Alternative | None], list[float] | None]:
        """Draw one token per row of final hidden states; seqs[i] owns the next rows[i] rows,
        which draft the positions after its tokens (or per row `positions`: an SSD tree's), its
        row j after guesses[i][:j] where it was fed guessed tokens (_guess).
        Returns the tokens, per sequence the distributions drawn from over the whole
        vocabulary (None for greedy rows), per row with `alternatives`, for a request with
        unchanged logits, the runner-up: the likeliest token other than the one picked (else
        None), and with `confidence` each row's top-1 probability over the head (else None)."""
        logits, extra_ids = self.head(hidden, [s.extra for s in seqs], rows)
        # The greedy rows' distribution, once, for the confidences and the runners-up.
        probs = torch.softmax(logits, -1) if confidence or alternatives else None
        top = probs.amax(-1).tolist() if confidence else None
        out, qs, start = [], [], 0
        greedy_cols = logits.argmax(-1)
        greedy = self.head.token_ids(greedy_cols, extra_ids).tolist()
        runner_up: list[Alternative | None] = [None] * sum(rows)
        for i, (s, n) in enumerate(zip(seqs, rows)):
            if s.processor is not None:  # SD: the request's changes over the whole vocabulary
                ids = None if extra_ids is None else extra_ids[start:start + n]
                whole, drafts = self.head.whole(logits[start:start + n], ids), guesses[i] if guesses else ()
                if s.params.greedy_decoding:
                    out += s.processor.argmax(whole, s.tokens, drafts, raw=greedy[start:start + n])
                    qs.append(None)
                else:
                    row = s.processor.process(whole, s.tokens, drafts)
                    q = probs_from_logits(row, s.params)
                    out += self._draw(s, q, self._at(s, start, n, positions)) if s.noise is not None \
                        else sample(q, s.generator).tolist()
                    qs.append(q)
            elif s.params.greedy_decoding:
                out += greedy[start:start + n]
                qs.append(None)
                if alternatives:
                    ids = None if extra_ids is None else extra_ids[start:start + n]
                    runner_up[start:start + n] = self._runners_up(probs[start:start + n],
                                                                  greedy_cols[start:start + n], ids)
            else:
                ids = None if extra_ids is None else extra_ids[start:start + n]
                q = probs_from_logits(logits[start:start + n], s.params)
                if self.saguaro is not None:
                    q = saguaro(q, *self.saguaro)
                if s.noise is not None:  # the target's noise on q over the whole vocabulary (noise.py)
                    whole = self.head.over_vocabulary(q, ids)
                    seconds = [] if alternatives else None
                    out += self._draw(s, whole, self._at(s, start, n, positions), seconds)
                    qs.append(whole)
                    if alternatives:
                        runner_up[start:start + n] = seconds
                    start += n
                    continue
                picked = sample(q, s.generator)
                out += self.head.token_ids(picked, ids).tolist()
                qs.append(self.head.over_vocabulary(q, ids))
                if alternatives:
                    runner_up[start:start + n] = self._runners_up(q, picked, ids)
            start += n
        return out, qs, runner_up, top

    @staticmethod
    def _at(s: DraftSeq, start: int, n: int, positions: list[int] | None) -> list[int]:
        """The positions that rows start..start + n - 1, s's, draft."""
        return positions[start:start + n] if positions is not None else \
            [s.offset + len(s.tokens) + j for j in range(n)]

    @staticmethod
    def _draw(s: DraftSeq, q: torch.Tensor, at: list[int], seconds: list[Alternative] | None = None) -> list[int]:
        """A seeded request's picks from its rows of q [n, V] by the target's shared noise at
        the positions `at`; with `seconds`, each row's runner-up in the same race appended to
        it (the likeliest other winner: where the target's draw differs from the pick, most
        often that one)."""
        if seconds is None:
            return s.noise.choose(q, at)
        out = []
        for j, position in enumerate(at):
            top = s.noise.ranked(q[j], position, 2)
            out.append(top[0])
            seconds.append(Alternative(top[1], float(q[j, top[0]]), float(q[j, top[1]])))
        return out

    def _runners_up(self, q: torch.Tensor, picked: torch.Tensor, ids: torch.Tensor | None) -> list[Alternative]:
        """Per row of q (the head's columns), its likeliest column other than the one picked:
        a function of q and the pick alone, so a fair one-hot candidate (siblings.py)."""
        second = q.scatter(-1, picked.unsqueeze(-1), -1.0).argmax(-1)
        p1 = q.gather(-1, picked.unsqueeze(-1))[:, 0].tolist()
        p2 = q.gather(-1, second.unsqueeze(-1))[:, 0].tolist()
        return [Alternative(t, a, b) for t, a, b in zip(self.head.token_ids(second, ids).tolist(), p1, p2)]
