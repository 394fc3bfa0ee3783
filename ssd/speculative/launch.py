"""From LLM(...)'s speculation options to a running speculator: the draft loaded in this
process (SD) or a draft worker started on its own cores or GPU (SSD)."""
from pathlib import Path

import torch

from ssd.errors import SSDError
from ssd.models.config import ModelConfig
from ssd.models.loader import load_tokenizer
from ssd.speculative.draft_engine import DraftEngine
from ssd.speculative.fanout import FanOut
from ssd.speculative.ngram import NgramSpeculator
from ssd.speculative.options import NGRAM, DraftConfig, SpecOptions
from ssd.speculative.remote import RemoteSpeculator
from ssd.speculative.speculator import LocalSpeculator, Speculator
from ssd.speculative.vocab import check_same_vocabulary, head_tokens
from ssd.store import resolve_model


def start_speculator(opts: SpecOptions, mode: str, draft: str | Path, *, target_folder: Path, tokenizer,
                     config: ModelConfig, eos_ids: set[int], device: torch.device, dtype: torch.dtype,
                     cache_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                     seed: int | None) -> Speculator:
    """The speculator for a target (its tokenizer and config) on `device`. An SSD worker is
    only started here; RemoteSpeculator.wait_ready() waits for its draft to load, so the
    caller can load the target meanwhile."""
    if draft == NGRAM:
        if mode != "sd":
            raise SSDError(f"draft='{NGRAM}' (prompt lookup) runs in mode 'sd', not {mode!r}")
        return NgramSpeculator(opts.ngram_min, opts.ngram_max)
    folder = resolve_model(draft)
    draft_config = ModelConfig.from_folder(folder)
    check_same_vocabulary(tokenizer, load_tokenizer(folder), config, draft_config)
    head = head_tokens(target_folder, opts.draft_vocab, draft_config.vocab_size, eos_ids)
    vocab_ids = None if head is None else list(head)
    k = opts.k_max
    fan = FanOut(k, opts.fan_out, opts.fan_out_miss, opts.tree_budget)
    # The target's tokens, K proposals and a partial block per sequence, and in SSD each
    # sequence's tree of up to fan.max_size branches per depth, K deep.
    branches = (k + 1) * fan.max_size if mode == "ssd" else 0
    cfg = DraftConfig(model=str(folder) if opts.draft_address is None else str(draft),
                      dtype=str(dtype).removeprefix("torch."), weights=opts.draft_weights(folder, device), k_max=k,
                      cache_tokens=cache_tokens + max_num_seqs * (k + 2 * block_size + branches * k),
                      block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=seed,
                      fan_out=opts.fan_out, fan_out_miss=opts.fan_out_miss, tree_budget=opts.tree_budget,
                      fit_tree=opts.fit_tree, backup=opts.backup, saguaro_c=opts.saguaro_c, vocab_ids=vocab_ids)
    # SD, and SSD's fallback should its worker fail: the draft in this process.
    in_process = lambda: DraftEngine.from_config(cfg, device)  # noqa: E731
    if mode == "sd":
        speculator: Speculator = LocalSpeculator(in_process())
    else:
        speculator = RemoteSpeculator(cfg, opts.target_placement(device), opts.draft_placement(device),
                                      address=opts.draft_address, secret=opts.secret(), timeout=opts.draft_timeout,
                                      fallback=in_process)
    speculator.draft_weights, speculator.context = cfg.weights, draft_config.max_position_embeddings
    return speculator
