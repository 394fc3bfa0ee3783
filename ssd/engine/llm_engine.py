"""The engine under LLM (ssd/llm.py): the target model with its KV cache and scheduler, the
draft source and its K policy, and the step that runs them. The draft source is started here from
the engine's configuration: the draft loaded in this process (SD), prompt lookup (no draft
model), or a draft worker on its own cores or GPU (SSD), with the draft side's configuration
(DraftConfig) derived from the engine's.

A step is one forward pass of the target over what the scheduler picked: prompt chunks and
plain decoding steps (AR), and in SD and SSD one speculative round (ssd/speculative/round.py)
for the sequences that are decoding. It returns what each sequence got, finished sequences
included; LLM turns that into outputs and streams.
"""
import os
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from ssd.checks import check_int
from ssd.config import EngineConfig
from ssd.distributed.tensor_parallel import RANK_SECRET_ENV, Ranks, Settings, fingerprint, local_config
from ssd.distributed.tensor_parallel import load as load_shard
from ssd.engine.registry import Registry
from ssd.engine.scheduler import Scheduler, Work
from ssd.errors import SamplingParamsError, SSDError, VocabularyMismatchError
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM
from ssd.models.loader import load_tokenizer, shared_model
from ssd.request.constraint import Grammars
from ssd.request.logits_process import LogitsProcessor
from ssd.request.sampler import next_tokens, token_logprobs
from ssd.request.sequence import Sequence
from ssd.runner.kv_cache import CacheFullError, PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.sampling_params import SamplingParams
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.draft.eagle import EagleHead, load_eagle
from ssd.speculative.draft.fanout import FanOut
from ssd.speculative.draft.vocab import check_same_vocabulary, head_tokens
from ssd.speculative.options import AUTO_K, SUFFIX, DraftConfig
from ssd.speculative.plan import Plan
from ssd.speculative.policy.adaptive_k import AutoK, FixedK, KPolicy
from ssd.speculative.policy.draft_stop import DraftStop
from ssd.speculative.records import Proposal, Round
from ssd.speculative.round import speculative_round
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.cross_vocab import CrossVocab, draft_steps
from ssd.speculative.sources.draft_model import DraftModel
from ssd.speculative.sources.feature_head import FeatureHead
from ssd.speculative.sources.named import NAMED
from ssd.speculative.sources.ngram import PromptLookup
from ssd.speculative.sources.ssd_worker import SSDWorker
from ssd.speculative.sources.suffix import SuffixIndex, SuffixLookup, index_file
from ssd.store import resolve_model, store_root

# What a step added to a sequence: its new tokens, and whether each was a draft's (LLM.step makes
# each a StreamChunk).
Advance = tuple[Sequence, list[int], list[bool]]


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.eos_ids = config.model_config.end_ids(tokenizer)
        self.grammars = Grammars(tokenizer, config.model_config.vocab_size, self.eos_ids)
        # A feature head needs the target's embedding: it starts once the target has loaded.
        self.source: DraftSource | None = None if config.draft is None or config.feature_head \
            else start_source(config, tokenizer)
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
        if config.feature_head:
            self.source = start_feature_head(config, model)
        if self.source:
            self.source.wait_ready()
        self.cache = PagedKVCache(local_config(model), config.kv_cache_tokens, config.block_size, config.device,
                                  config.dtype, config.prefix_salt)
        self.registry = Registry()  # everything held per sequence: one release reaches it all
        self.registry.register("target KV cache", self.cache)
        if self.source:
            self.registry.register("draft source", self.source)
        self.k_max = config.speculation.k_max
        self.runner = ModelRunner(model, self.cache, config.device, target_buckets(config, self.k_max),
                                  max_keys=config.max_model_len + self.k_max + 1)
        self.taps = self.source.taps if self.source else ()  # what a feature head reads of every target pass
        self.runner.warm_up(taps=self.taps)
        self.speculate_k: int | str = 0  # set_speculate_k() changes it
        self.k_policy: KPolicy | None = None
        # Earlier requests' text for suffix decoding, kept across K policies: draft="suffix"'s
        # own, else the one beside a draft (--lookup suffix); with suffix_keep, across restarts.
        self.suffix_index = self.source.index if isinstance(self.source, SuffixLookup) else \
            SuffixIndex(config.speculation.suffix_tokens)
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
        speculating = plan is not None and any(plan.ks)
        plain = [w for w in work if w.seq not in rounding] if speculating else work
        with self.source.placement(drafting=speculating) if self.source else nullcontext():
            start = time.perf_counter()
            drawn = self._forward(plain) if plain else []
            pass_s = time.perf_counter() - start
            now = time.perf_counter()
            events, rounds = [], []
            for seq, token, lps in drawn:
                if speculating or seq not in rounding:
                    events.append(self._append(seq, [token], [False], now, lps))
                else:  # a plain round
                    rounds.append(Round(seq, 0, Proposal([]), tokens=[token], verify_s=pass_s, logprobs=lps,
                                        timed=not filling))
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
            opts = self.config.speculation
            local = self.source.in_process  # a draft model or a head in this process (SD)
            # Prompt lookup beside it (module doc of adaptive_k.py), and sibling leaves (siblings.py).
            lookup = None
            # By default suffix decoding (the request's own tokens and earlier requests' text), whose
            # index outlives this policy: the engine's. True: prompt lookup over the request alone.
            if local and opts.prompt_lookup in (None, SUFFIX):
                lookup = SuffixLookup(self.suffix_index)
            elif local and opts.prompt_lookup:
                lookup = PromptLookup(opts.ngram_min, opts.ngram_max)
            # Branches off the chain (siblings.py): a draft's where asked for; suffix decoding's
            # tree, alone or beside a draft, unless turned off.
            trees = opts.draft_siblings is not False
            siblings = (bool(opts.draft_siblings) and local) or (trees and self.source.offers_trees)
            # The draft's stopping rule (draft_stop.py), where the draft can take it.
            stop = DraftStop() if opts.draft_stop is not False and self.source.stops_by_confidence else None
            self.k_policy = AutoK(self.k_max, self._time_verify,
                                  self.source.step_cost, self.source.measures_steps, lookup,
                                  opts.draft_window, siblings, stop, trees)
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
        out = self.runner.forward([Chunk(w.seq.seq_id, w.seq.token_ids[w.start:w.start + w.num_new], w.start,
                                         int(w.samples)) for w in work], taps=taps)
        logits = out[0] if taps else out
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
            token = best[row] if plain[row] else int(next_tokens(rows, seq.params, seq.generator)[0])
            lps = None if seq.params.logprobs is None else token_logprobs(rows, [token], seq.params.logprobs)
            out.append((seq, token, lps))
        return out

    def _speculate(self, seqs: list[Sequence], plan: Plan) -> list[Advance]:
        """One speculative round (ssd/speculative/round.py) for the sequences that are decoding,
        by the K policy's plan (one that drafts for some sequence)."""
        return self._learn(speculative_round(plan.within(seqs, self.draft_context), self.source, self.runner,
                                             self.cache, seqs))

    def _learn(self, rounds: list[Round]) -> list[Advance]:
        """A round's records to whoever learns from them: the K policy, the draft source and each
        request's metrics (a plain round too: the draft catches up when next asked)."""
        self.k_policy.learn(rounds)
        self.source.learn(rounds)
        now = time.perf_counter()
        events = []
        for r in rounds:
            r.seq.stats.record(r)
            events.append(self._append(r.seq, r.tokens, r.from_draft, now, r.logprobs))
        return events

    def _append(self, seq: Sequence, tokens: list[int], from_draft: list[bool], now: float,
                logprobs: list | None = None) -> Advance:
        """Add tokens up to the first that finishes the sequence; return what was added. A
        sequence stops at an end token, a stop token or string, or where its constraint is
        complete."""
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            seq.from_draft.append(from_draft[i])
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            seq.detokenizer.push([token])
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
                return seq, tokens[:i + 1], from_draft[:i + 1]
        return seq, tokens, from_draft


def start_feature_head(config: EngineConfig, target: DecoderLM) -> FeatureHead:
    """SD with an EAGLE-3 head (the draft folder holds one), checked against the target, its
    embedding the target's unless the head brings its own."""
    weights = load_eagle(resolve_model(config.draft), config.model_config)
    own = weights.embedding
    embed = target.embed_tokens if own is None else nn.Embedding.from_pretrained(own.float())
    k = config.speculation.k_max
    head = EagleHead(weights, embed, config.max_model_len + k + 2)
    if config.device.type == "cpu":
        dtype = torch.float32
        if config.speculation.draft_quantization in ("auto", "int8"):  # a quarter of the bytes a step reads
            head.quantize_int8()
    else:  # on a GPU the head's weights are in the target's dtype, as the states it reads; its RoPE tables fp32
        dtype = config.dtype
        head.to(config.device)
        for p in head.parameters():
            p.data = p.data.to(dtype)
    # Its rows' keys: positions up to the context and K drafts, and a tree candidate's own.
    return FeatureHead(head, config.model_config.num_layers,
                       config.kv_cache_tokens + config.max_num_seqs * (k + 2 * config.block_size), config.block_size,
                       config.device, config.max_model_len, config.seed, dtype, head_buckets(config),
                       config.max_model_len + k + 3, k - 1)


def head_buckets(config: EngineConfig) -> list[int] | None:
    """A head's CUDA-graph buckets (rows 1, 2, 4, ... up to a batch's first pass, K + 1 rows a
    sequence, at most 256); None on a CPU."""
    rows = config.max_num_seqs * (config.speculation.k_max + 1)
    return [1 << i for i in range(9) if 1 << i < 2 * rows] if config.device.type == "cuda" else None


def start_source(config: EngineConfig, tokenizer) -> DraftSource:
    """The draft source for the target of `config` (whose tokenizer is given). An SSD worker is
    only started here; SSDWorker.wait_ready() waits for its draft to load, so the caller can
    load the target meanwhile."""
    opts = config.speculation
    if config.draft in NAMED:
        return NAMED[config.draft](opts)
    folder = resolve_model(config.draft)
    draft_model = ModelConfig.from_folder(folder)
    draft_tokenizer = load_tokenizer(folder)
    context = draft_model.max_position_embeddings
    try:
        check_same_vocabulary(tokenizer, draft_tokenizer, config.model_config, draft_model)
    except VocabularyMismatchError as e:
        if config.mode != "sd":
            raise VocabularyMismatchError(f"{e}. A draft with another tokenizer drafts in mode 'sd' only, so far") \
                from None
        # Any draft for any target: text carries the proposals across (sources/cross_vocab.py).
        cfg = draft_config(config, folder, draft_model, draft_model.end_ids(draft_tokenizer), same_vocabulary=False)
        return CrossVocab(DraftEngine.from_config(cfg, config.device), tokenizer, draft_tokenizer, context,
                          cfg.weights)
    cfg = draft_config(config, folder, draft_model, config.model_config.end_ids(tokenizer))
    # SD, and SSD's fallback should its worker fail: the draft in this process.
    in_process = lambda: DraftEngine.from_config(cfg, config.device)  # noqa: E731
    if config.mode == "sd":
        return DraftModel(in_process(), context, cfg.weights)
    return SSDWorker(cfg, opts.target_placement(config.device), opts.draft_placement(config.device), context,
                     address=opts.draft_address, secret=opts.secret(), timeout=opts.draft_timeout,
                     fallback=in_process, in_thread=opts.worker_in_thread(config.device))


def draft_config(config: EngineConfig, folder: Path, draft_model: ModelConfig, eos_ids: set[int],
                 same_vocabulary: bool = True) -> DraftConfig:
    """What the draft side builds for the engine of `config`, its draft model in `folder`
    (same_vocabulary False: a draft of another tokenizer, whose head the target's token
    counts cannot reduce)."""
    opts = config.speculation
    k = opts.k_max if same_vocabulary else draft_steps(opts.k_max)  # (another tokenizer's tokens: cross_vocab.py)
    head = head_tokens(config.model, opts.draft_vocab, draft_model.vocab_size, eos_ids) if same_vocabulary else None
    fan = FanOut(k, opts.fan_out, opts.fan_out_miss, opts.tree_budget)
    # The target's tokens, K proposals and a partial block per sequence, and in SSD each
    # sequence's tree of up to fan.max_size branches per depth, K deep.
    branches = (k + 1) * fan.max_size if config.mode == "ssd" else 0
    per_seq = k + 2 * config.block_size + branches * k
    return DraftConfig(
        model=str(folder) if opts.draft_address is None else str(config.draft),
        dtype=str(opts.draft_dtype(config.device, config.dtype)).removeprefix("torch."),
        weights=opts.draft_weights(folder, config.device), k_max=k,
        # Another tokenizer may cut the same text into more tokens: room for twice as many.
        cache_tokens=(1 if same_vocabulary else 2) * config.kv_cache_tokens + config.max_num_seqs * per_seq,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len, seed=config.seed,
        fan_out=opts.fan_out, fan_out_miss=opts.fan_out_miss, tree_budget=opts.tree_budget, fit_tree=opts.fit_tree,
        backup=opts.backup, saguaro_c=opts.saguaro_c, vocab_ids=None if head is None else list(head),
        prefix_caching=config.enable_prefix_caching, window=opts.draft_window,
        guesses=opts.draft_guesses if opts.draft_guesses is not None else config.mode == "sd")


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
