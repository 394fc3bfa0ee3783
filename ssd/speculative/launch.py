"""From the engine's configuration to a running speculator: the draft loaded in this process
(SD), prompt lookup (no draft model), or a draft worker started on its own cores or GPU
(SSD). The draft side's configuration (DraftConfig) is derived here."""
from pathlib import Path

from ssd.config import EngineConfig
from ssd.errors import SSDError
from ssd.models.config import ModelConfig
from ssd.models.loader import load_tokenizer
from ssd.speculative.draft_engine import DraftEngine
from ssd.speculative.fanout import FanOut
from ssd.speculative.ngram import NgramSpeculator
from ssd.speculative.options import NGRAM, DraftConfig
from ssd.speculative.remote import RemoteSpeculator
from ssd.speculative.speculator import LocalSpeculator, Speculator
from ssd.speculative.vocab import check_same_vocabulary, head_tokens
from ssd.store import resolve_model


def start_speculator(config: EngineConfig, tokenizer) -> Speculator:
    """The speculator for the target of `config` (whose tokenizer is given). An SSD worker is
    only started here; RemoteSpeculator.wait_ready() waits for its draft to load, so the
    caller can load the target meanwhile."""
    opts = config.speculation
    if config.draft == NGRAM:
        if config.mode != "sd":
            raise SSDError(f"draft='{NGRAM}' (prompt lookup) runs in mode 'sd', not {config.mode!r}")
        return NgramSpeculator(opts.ngram_min, opts.ngram_max)
    folder = resolve_model(config.draft)
    draft_model = ModelConfig.from_folder(folder)
    check_same_vocabulary(tokenizer, load_tokenizer(folder), config.model_config, draft_model)
    cfg = draft_config(config, folder, draft_model, config.model_config.end_ids(tokenizer))
    # SD, and SSD's fallback should its worker fail: the draft in this process.
    in_process = lambda: DraftEngine.from_config(cfg, config.device)  # noqa: E731
    if config.mode == "sd":
        speculator: Speculator = LocalSpeculator(in_process())
    else:
        speculator = RemoteSpeculator(cfg, opts.target_placement(config.device), opts.draft_placement(config.device),
                                      address=opts.draft_address, secret=opts.secret(), timeout=opts.draft_timeout,
                                      fallback=in_process)
    speculator.draft_weights, speculator.context = cfg.weights, draft_model.max_position_embeddings
    return speculator


def draft_config(config: EngineConfig, folder: Path, draft_model: ModelConfig, eos_ids: set[int]) -> DraftConfig:
    """What the draft side builds for the engine of `config`, its draft model in `folder`."""
    opts, k = config.speculation, config.speculation.k_max
    head = head_tokens(config.model, opts.draft_vocab, draft_model.vocab_size, eos_ids)
    fan = FanOut(k, opts.fan_out, opts.fan_out_miss, opts.tree_budget)
    # The target's tokens, K proposals and a partial block per sequence, and in SSD each
    # sequence's tree of up to fan.max_size branches per depth, K deep.
    branches = (k + 1) * fan.max_size if config.mode == "ssd" else 0
    per_seq = k + 2 * config.block_size + branches * k
    return DraftConfig(
        model=str(folder) if opts.draft_address is None else str(config.draft),
        dtype=str(config.dtype).removeprefix("torch."), weights=opts.draft_weights(folder, config.device), k_max=k,
        cache_tokens=config.kv_cache_tokens + config.max_num_seqs * per_seq, block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len, seed=config.seed,
        fan_out=opts.fan_out, fan_out_miss=opts.fan_out_miss, tree_budget=opts.tree_budget, fit_tree=opts.fit_tree,
        backup=opts.backup, saguaro_c=opts.saguaro_c, vocab_ids=None if head is None else list(head))
