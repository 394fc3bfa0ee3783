"""How the engine's draft source starts (docs/algorithm.md, "The engine's layers"): in two
phases, `start_source` before the target loads (a draft model loads in this process, an SSD
worker starts loading its own) and `Starting.attach` once it has (a feature head reads the
target's embedding), so that the engine holds no branch per kind of draft; a draft in this
process with prompt lookup beside it (sources/beside.py); with the draft side's configuration
(DraftConfig) derived from the engine's.
"""
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ssd.config import EngineConfig
from ssd.errors import VocabularyMismatchError
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM
from ssd.models.loader import load_tokenizer
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.draft.eagle import EagleHead, is_eagle_head, load_eagle
from ssd.speculative.draft.fanout import FanOut
from ssd.speculative.draft.vocab import check_same_vocabulary, head_tokens
from ssd.speculative.options import NGRAM, SUFFIX, DraftConfig, SpecOptions
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.beside import Beside
from ssd.speculative.sources.cross_vocab import CrossVocab, draft_steps
from ssd.speculative.sources.draft_model import DraftModel
from ssd.speculative.sources.feature_head import FeatureHead
from ssd.speculative.sources.named import NAMED
from ssd.speculative.sources.ssd_worker import SSDWorker
from ssd.store import resolve_model


@dataclass
class Starting:
    """A draft source on its way: `attach` gives it, once the target has loaded."""

    make: Callable[[DecoderLM], DraftSource]

    def attach(self, target: DecoderLM) -> DraftSource:
        return self.make(target)


def start_source(config: EngineConfig, tokenizer) -> Starting:
    """The draft source of `config`'s draft for its target (whose tokenizer is given): a
    feature head (an EAGLE-3 head's folder) once the target is there, any other now."""
    if config.draft in NAMED:
        source = NAMED[config.draft](config.speculation)
        return Starting(lambda target: source)
    if is_eagle_head(resolve_model(config.draft)):
        return Starting(lambda target: with_lookup(start_feature_head(config, target), config.speculation))
    source = with_lookup(_start_model_source(config, tokenizer), config.speculation)
    return Starting(lambda target: source)


def with_lookup(source: DraftSource, opts: SpecOptions) -> DraftSource:
    """A draft in this process with the lookup `prompt_lookup` asks for beside it (beside.py):
    by default suffix decoding (the request's own tokens and earlier requests' text), True:
    prompt lookup over the request alone, False: none."""
    if not source.capabilities.in_process or opts.prompt_lookup is False:
        return source
    return Beside(source, NAMED[SUFFIX if opts.prompt_lookup in (None, SUFFIX) else NGRAM](opts))


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


def _start_model_source(config: EngineConfig, tokenizer) -> DraftSource:
    """The draft source of a draft model for the target of `config` (whose tokenizer is given).
    An SSD worker is only started here; SSDWorker.wait_ready() waits for its draft to load, so
    the caller can load the target meanwhile."""
    opts = config.speculation
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
        seeded_sampling=config.seeded_sampling,
        fan_out=opts.fan_out, fan_out_miss=opts.fan_out_miss, tree_budget=opts.tree_budget, fit_tree=opts.fit_tree,
        backup=opts.backup, saguaro_c=opts.saguaro_c, vocab_ids=None if head is None else list(head),
        prefix_caching=config.enable_prefix_caching, window=opts.draft_window,
        guesses=opts.draft_guesses if opts.draft_guesses is not None else config.mode == "sd",
        threads=config.threads if config.follow_load else None)
