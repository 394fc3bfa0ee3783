"""The engine under LLM (ssd/llm.py): the target model with its KV cache and scheduler, the
draft source and its K policy, and the step that runs them. The draft source (the draft loaded
in this process, SD; prompt lookup or suffix decoding, no draft model; a feature head; a draft
worker on its own cores or GPU, SSD) is started by draft_start.py.

A step is one forward pass of the target over what the scheduler picked: prompt chunks and
plain decoding steps (AR), and in SD and SSD one speculative round (ssd/speculative/round.py)
for the sequences that are decoding. It returns what each sequence got, finished sequences
included; LLM turns that into outputs and streams.
"""
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from ssd.checks import check_int
from ssd.config import EngineConfig
from ssd.distributed.tensor_parallel import RANK_SECRET_ENV, Ranks, Settings, fingerprint, local_config
from ssd.distributed.tensor_parallel import load as load_shard
from ssd.engine.draft_start import start_source
from ssd.engine.registry import Registry
from ssd.engine.scheduler import Scheduler, Work
from ssd.errors import SamplingParamsError, SSDError
from ssd.models.loader import shared_model
from ssd.outputs import StepInfo
from ssd.request.constraint import Grammars
from ssd.request.logits_process import LogitsProcessor
from ssd.request.sampler import next_token, token_logprobs
from ssd.request.sequence import Sequence
from ssd.runner.kv_cache import CacheFullError, PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.runner.threads import ThreadChooser
from ssd.sampling_params import SamplingParams
from ssd.speculative.options import AUTO_K
from ssd.speculative.plan import Plan
from ssd.speculative.policy.adaptive_k import AutoK, FixedK, KPolicy
from ssd.speculative.policy.draft_stop import DraftStop
from ssd.speculative.policy.estimators import LowQuantile
from ssd.speculative.records import Proposal, Round, RoundTimes
from ssd.speculative.round import speculative_round
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.suffix import SuffixIndex, index_file
from ssd.store import store_root

# What a step added to a sequence: its new tokens, the source of each that was an accepted draft
# (None: the target's), and what the step was (LLM.step makes each a StreamChunk).
Advance = tuple[Sequence, list[int], list[str | None], StepInfo]


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.eos_ids = config.model_config.end_ids(tokenizer)
        self.grammars = Grammars(tokenizer, config.model_config.vocab_size, self.eos_ids)
        # The draft source starts before the target loads (an SSD worker loads its draft meanwhile)
        # and is attached to it after (a feature head reads the target's embedding).
        starting = None if config.draft is None else start_source(config, tokenizer)
        # The target loads while an SSD worker loads the draft (and tensor-parallel ranks their shares).
        self.ranks = None
        if config.tensor_parallel_size > 1:
            settings = Settings(fingerprint(config.model), str(config.dtype).removeprefix("torch."), config.weights,
                                config.kv_cache_tokens, config.block_size)
            self.ranks = Ranks(config.tensor_parallel_size, config.model, settings, config.threads,
                               config.tensor_parallel_address, os.environ.get(RANK_SECRET_ENV),
                               config.tensor_parallel_timeout)
            model = load_shard(config.model, config.device, config.dtype, config.weights, self.ranks.group)
            self.ranks.ready()
        else:
            model = shared_model(config.model, config.device, config.dtype, config.weights)
        self.source: DraftSource | None = None if starting is None else starting.attach(model)
        if self.source:
            self.source.wait_ready()
        # A source that reads the target's states at every position (a feature head) would lack
        # them for a cached prefix, which the target does not run: no prefix caching then.
        salt = config.prefix_salt if self.source is None or not self.source.capabilities.taps else None
        self.cache = PagedKVCache(local_config(model), config.kv_cache_tokens, config.block_size, config.device,
                                  config.dtype, salt)
        self.registry = Registry()  # everything held per sequence: one release reaches it all
        self.registry.register("target KV cache", self.cache)
        if self.source:
            self.registry.register("draft source", self.source)
        self.k_max = config.speculation.k_max
        self.runner = ModelRunner(model, self.cache, config.device, target_buckets(config, self.k_max),
                                  max_keys=config.max_model_len + self.k_max + 1,
                                  threads=ThreadChooser(config.threads, LowQuantile) if config.follow_load else None)
        self.taps = self.source.capabilities.taps if self.source else ()  # what a feature head reads of every target pass
        self.runner.warm_up(taps=self.taps)
        self.speculate_k: int | str = 0  # set_speculate_k() changes it
        self.k_policy: KPolicy | None = None
        # Earlier requests' text for suffix decoding: draft="suffix"'s own, or the one beside a
        # draft (--lookup suffix); with suffix_keep, kept across restarts.
        own = self.source.suffix_index if self.source else None
        self.suffix_index = own if own is not None else SuffixIndex(config.speculation.suffix_tokens)
        self.suffix_file = index_file(store_root(), Path(config.model)) if config.speculation.suffix_keep else None
        if self.suffix_file is not None and self.suffix_file.exists():
            try:
                self.suffix_index.load(self.suffix_file)
            except (OSError, ValueError, KeyError, IndexError) as e:  # a damaged file: start empty, say so
                warnings.warn(f"suffix decoding's index in {self.suffix_file} not loaded ({e}); starting empty")
        if self.source:
            self.set_speculate_k(config.speculation.speculate_k)
        # Drafts sit before the target's own token, and inside the draft model's context.
        draft_len = self.source.context if self.source else None
        self.draft_context = min(config.max_model_len - 1, draft_len or config.max_model_len)
        self.scheduler = Scheduler(self.cache, self.registry, config.max_num_seqs, config.max_num_batched_tokens,
                                   lookahead=self.k_max if self.source else 0)

    def step(self) -> list[Advance]:
        """One scheduled step. Prompt chunks run through the target alone; in SD and SSD the
        sequences that are decoding run one speculative round by the K policy's plan. A plan
        that drafts nothing is plain decoding, whose rows join the prompt chunks' pass as AR's
        do (a pass of their own would read the weights once more while a batch's prompts fill)."""
        work = self.scheduler.schedule()
        decoding = [w.seq for w in work if self.source and w.num_new == 1 and w.samples]
        rounding = set(decoding)  # (Sequences compare by identity)
        filling = len(work) > len(decoding)  # prompt chunks too
        plan = self.k_policy.plan(decoding, filling, bool(self.scheduler.waiting)) if decoding else None
        plan = None if plan is None else plan.within(decoding, self.draft_context)  # what each can take
        speculating = plan is not None and any(plan.ks)
        plain = [w for w in work if w.seq not in rounding] if speculating else work
        with self.source.placement(drafting=speculating) if self.source else nullcontext():
            start = time.perf_counter()
            drawn = self._forward(plain) if plain else []
            pass_s = time.perf_counter() - start
            now = time.perf_counter()
            events, rounds = [], []
            times = RoundTimes(verify_s=pass_s, timed=not filling)  # a plain round's, where there is one
            for seq, token, lps in drawn:
                if speculating or seq not in rounding:
                    events.append(self._append(seq, [token], [None], StepInfo(), now, lps))
                else:  # a plain round
                    rounds.append(Round(seq, 0, Proposal([]), tokens=[token], times=times, logprobs=lps))
            events += self._learn(rounds) if rounds else []
            events += self._speculate(decoding, plan) if speculating else []
        for w in work:  # name the newly full blocks of confirmed tokens (prefix caching)
            if not w.seq.finished:
                self.cache.commit(w.seq.seq_id, w.seq.token_ids)
        return events

    def set_speculate_k(self, k: int | str) -> None:
        """K for the next rounds: 0 (plain decoding) up to k_max, or "auto"."""
        if self.source is None:
            raise SSDError("there is no draft model: speculation needs mode 'sd' or 'ssd'")
        if k != AUTO_K:
            check_int("K", k, 0, self.k_max, also=f"(the most this engine was started with) or '{AUTO_K}'")
            self.k_policy = FixedK(k)
        else:
            opts, can = self.config.speculation, self.source.capabilities
            # Branches off the chain (siblings.py): a draft's where asked for; suffix decoding's
            # tree, alone or beside a draft, unless turned off.
            trees = opts.draft_siblings is not False
            siblings = (bool(opts.draft_siblings) and can.in_process) or (trees and can.offers_trees)
            # The draft's stopping rule (draft_stop.py), where the draft can take it.
            stop = DraftStop() if opts.draft_stop is not False and can.stops_by_confidence else None
            self.k_policy = AutoK(self.k_max, self._time_verify, self.source.step_cost, can.measures_steps,
                                  self.source.lookup, opts.draft_window, siblings, stop, trees)
        self.registry.register("K policy", self.k_policy)
        self.speculate_k = k

    def _time_verify(self, rows: int) -> float | None:
        """The target's verify pass over `rows` rows of one sequence, timed now (None: every
        block of the KV cache is held, no pass to time)."""
        try:
            return self.runner.timed_pass(rows, repeat=2, taps=self.taps)
        except CacheFullError:
            return None

    def processor(self, params: SamplingParams, num_prompt_tokens: int) -> LogitsProcessor | None:
        """What the request changes about the logits (None: nothing), checked against this
        model: token ids in its vocabulary, a constraint that compiles (GrammarError)."""
        if not params.adjusts_logits:
            return None
        vocab = self.config.model_config.vocab_size
        outside = [t for t in params.logit_bias if t >= vocab]
        if outside:
            raise SamplingParamsError(f"logit_bias: token id {outside[0]} is outside the vocabulary of {vocab} tokens")
        return LogitsProcessor(params, num_prompt_tokens, self.eos_ids, self.grammars.compile(params))

    def finish(self, seq: Sequence) -> None:
        """End a sequence, finished or not, and free what it holds."""
        self.scheduler.finish(seq)

    def close(self) -> None:
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            self.finish(seq)
        if self.source is not None:
            self.source.close()
        if self.ranks is not None:
            self.ranks.close()
        if self.suffix_file is not None:
            try:
                self.suffix_index.save(self.suffix_file)
            except OSError as e:
                warnings.warn(f"suffix decoding's index not saved to {self.suffix_file}: {e}")
            self.suffix_file = None  # once (close is idempotent)

    def _forward(self, work: list[Work]) -> list[tuple[Sequence, int, list | None]]:
        """Prompt chunks and plain decoding steps in one pass; a token is drawn for each chunk
        that ends at its sequence's newest token, from the request's processed logits. Returns
        (sequence, token, its logprobs or None)."""
        taps = self.taps
        # Logits rows a chunk needs: its last (a token is drawn after it), or every row over the
        # prompt where the request scores it (prompt_logprobs).
        rows = [w.num_new if self._scores(w) else int(w.samples) for w in work]
        out = self.runner.forward([Chunk(w.seq.seq_id, w.seq.token_ids[w.start:w.start + w.num_new], w.start, n)
                                   for w, n in zip(work, rows)], taps=taps)
        logits = out[0] if taps else out
        if any(rows[i] > int(w.samples) for i, w in enumerate(work)):
            logits = self._score_prompts(work, rows, logits)
        if taps:  # the draft source reads the target's states of every position it ran
            states = out[1].permute(1, 0, 2).reshape(out[1].shape[1], -1)
            at = 0
            for w in work:
                self.source.states(w.seq, w.start, states[at:at + w.num_new])
                at += w.num_new
        out = []
        seqs = [w.seq for w in work if w.samples]
        # The greedy rows' choices read at once: one host read a batch (on a GPU each read
        # waits for the pass), the others row by row.
        plain = [s.params.greedy_decoding and s.processor is None for s in seqs]
        best = logits.argmax(-1).tolist() if any(plain) else None
        for row, seq in enumerate(seqs):
            rows = logits[row:row + 1]
            if seq.processor is not None:
                rows = seq.processor.process(rows, seq.token_ids)
            token = best[row] if plain[row] else next_token(rows, seq.params, seq.generator, seq.noise, seq.num_tokens)
            lps = None if seq.params.logprobs is None else token_logprobs(rows, [token], seq.params.logprobs)
            out.append((seq, token, lps))
        return out

    @staticmethod
    def _scores(w: Work) -> bool:
        """Whether this chunk's rows score its sequence's prompt."""
        return w.seq.params.prompt_logprobs is not None and w.start < w.seq.num_prompt_tokens

    def _score_prompts(self, work: list[Work], rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Each scored chunk's prompt tokens' logprobs from its rows (row i: the token at position
        start + i + 1, under the model's logits); returns the rows a token is drawn from, one a
        sampling chunk (its last)."""
        keep, at = [], 0
        for w, n in zip(work, rows):
            if n > int(w.samples):
                seq = w.seq
                scored = seq.prompt_logprobs
                if not scored:
                    scored.append(None)  # (the first token: nothing before it to score it by)
                count = min(n, seq.num_prompt_tokens - 1 - w.start)
                if count > 0:
                    tokens = seq.token_ids[w.start + 1:w.start + 1 + count]
                    for pos, lp in enumerate(token_logprobs(logits[at:at + count], tokens, seq.params.prompt_logprobs),
                                             w.start + 1):
                        if pos < len(scored):  # (prefilled again after a preemption: the same values)
                            scored[pos] = lp
                        else:
                            scored.append(lp)
            if w.samples:
                keep.append(at + n - 1)
            at += n
        return logits[keep]

    def _speculate(self, seqs: list[Sequence], plan: Plan) -> list[Advance]:
        """One speculative round (ssd/speculative/round.py) for the sequences that are decoding,
        by the K policy's plan (cut to what each can take, Plan.within; one that drafts for some
        sequence)."""
        return self._learn(speculative_round(plan, self.source, self.runner, self.cache, seqs))

    def _learn(self, rounds: list[Round]) -> list[Advance]:
        """A round's records to whoever learns from them: the K policy, the draft source and each
        request's metrics (a plain round too: the draft catches up when next asked)."""
        self.k_policy.learn(rounds)
        self.source.learn(rounds)
        now = time.perf_counter()
        events = []
        for r in rounds:
            r.seq.stats.record(r)
            kind = None if not r.k else self.source.lookup.kind if r.proposal.lookup else self.source.kind
            kept = r.accepted + r.rescued
            step = StepInfo(r.k, r.drafted, kept, source=kind)
            events.append(self._append(r.seq, r.tokens, [kind] * kept + [None], step, now, r.logprobs))
        return events

    def _append(self, seq: Sequence, tokens: list[int], sources: list[str | None], step: StepInfo, now: float,
                logprobs: list | None = None) -> Advance:
        """Add tokens up to the first that finishes the sequence; return what was added. A
        sequence stops at an end token, a stop token or string, or where its constraint is
        complete. step: the step's record, its tokens and time filled in here."""
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            seq.sources.append(sources[i])
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            seq.detokenizer.push([token])
            seq.text_ends.append(len(seq.detokenizer.text))
            if seq.detokenizer.stopped:  # the text was cut at a stop string: so were the tokens' ends
                seq.text_ends[:] = [min(e, seq.text_ends[-1]) for e in seq.text_ends]
            seq.first_token_at = seq.first_token_at or now
            seq.last_token_at = now
            p = seq.params
            if ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids or seq.detokenizer.stopped
                    or (seq.processor is not None and seq.processor.complete(seq.token_ids))):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
                seq.finish_reason = "length"
            if seq.finished:
                self.finish(seq)
                tokens, sources = tokens[:i + 1], sources[:i + 1]
                break
        return seq, tokens, sources, replace(step, tokens=len(tokens), at_s=now - seq.arrival)


def target_buckets(config: EngineConfig, k_max: int) -> list[int] | None:
    """The target's CUDA-graph buckets (engine/cuda_graphs.py): P = cuda_graph_rows rows for
    every pass of up to P tokens (one shape: SD and SSD == AR there), then 2P, 4P, ... up to a
    full batch's verify pass (at most 256 rows); None on a CPU or with cuda_graph_rows=0."""
    rows = config.cuda_graph_rows
    if config.device.type != "cuda" or rows == 0:
        return None
    buckets = [rows]
    while buckets[-1] < min(256, config.max_num_seqs * (k_max + 1)):
        buckets.append(buckets[-1] * 2)
    return buckets
