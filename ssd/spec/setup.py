"""From LLM(...)'s speculation options to a running speculator: the draft loaded in this
process (SD) or a draft worker started on its own cores or GPU (SSD)."""
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ssd.engine.placement import default_pair, parse_placement
from ssd.errors import SSDError
from ssd.models.config import ModelConfig
from ssd.models.loader import QUANTIZATIONS, load_tokenizer, shared_model
from ssd.spec.draft_engine import DraftEngine, check_options
from ssd.spec.fanout import FanOut
from ssd.spec.remote import RemoteSpeculator
from ssd.spec.speculator import LocalSpeculator, Speculator
from ssd.spec.vocab import check_same_vocabulary
from ssd.store import resolve_model

SSD_ONLY = ("fan_out", "fan_out_miss", "tree_budget", "backup", "saguaro_c", "target_device",
            "draft_device", "draft_address")


@dataclass(frozen=True)
class SpecOptions:
    """The speculation options of LLM(...) (README.md explains each); checked when made, so a
    bad one fails before any model loads or worker starts."""
    mode: str = "ar"
    k: int = 4
    draft_quantization: str | None = "auto"
    fan_out: int | list[int] | str = 3
    fan_out_miss: int | list[int] | None = None
    tree_budget: int | None = None
    backup: str = "jit"
    saguaro_c: float | None = None
    target_device: str | None = None
    draft_device: str | None = None
    draft_address: str | None = None
    draft_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.mode == "ar":
            return
        if not 1 <= self.k <= 32:
            raise SSDError(f"speculate_k must be in 1..32, got {self.k}")
        defaults = {f.name: f.default for f in fields(self)}
        changed = [name for name in SSD_ONLY if getattr(self, name) != defaults[name]]
        if self.mode != "ssd" and changed:
            raise SSDError(f"{', '.join(changed)} only apply to mode 'ssd'")
        if self.draft_quantization not in ("auto", None, *QUANTIZATIONS):
            raise SSDError(f"draft_quantization must be 'auto', None or one of {', '.join(QUANTIZATIONS)}, "
                           f"got {self.draft_quantization!r}")
        if self.draft_timeout <= 0:
            raise SSDError(f"draft_timeout must be > 0 seconds, got {self.draft_timeout}")
        self.fan()
        check_options(self.backup, self.saguaro_c)

    def fan(self) -> FanOut:
        return FanOut(self.k, self.fan_out, self.fan_out_miss, self.tree_budget)

    def quantization(self, target_device: torch.device) -> str | None:
        if self.draft_quantization != "auto":
            return self.draft_quantization
        # The draft's numerics change only how often its tokens are accepted, never the output;
        # on a CPU its speed is memory-bound, and int8 weights read 4x fewer bytes.
        device = parse_placement(self.draft_device).device if self.draft_device else target_device
        return "int8" if device.type == "cpu" else None

    def target_placement(self, device: torch.device):
        return parse_placement(self.target_device) if self.target_device else default_pair(device)[0]

    def draft_placement(self, device: torch.device):
        return parse_placement(self.draft_device) if self.draft_device else default_pair(device)[1]


def start_speculator(opts: SpecOptions, draft: str | Path, *, tokenizer, config: ModelConfig,
                     device: torch.device, dtype: torch.dtype, cache_tokens: int, max_num_seqs: int,
                     block_size: int, seed: int | None) -> Speculator:
    """The speculator for a target (its tokenizer and config) on `device`. An SSD worker is
    only started here; RemoteSpeculator.wait_ready() waits for its draft to load, so the
    caller can load the target meanwhile."""
    draft_folder = resolve_model(draft)
    check_same_vocabulary(tokenizer, load_tokenizer(draft_folder), config, ModelConfig.from_folder(draft_folder))
    quantization = opts.quantization(device)
    fan = opts.fan()
    # The target's tokens, K proposals and a partial block per sequence, and in SSD each
    # sequence's tree of up to fan.max_size branches per depth, K deep.
    branches = (opts.k + 1) * fan.max_size if opts.mode == "ssd" else 0
    draft_tokens = cache_tokens + max_num_seqs * (opts.k + 2 * block_size + branches * opts.k)

    def in_process(fan_out: FanOut) -> DraftEngine:
        return DraftEngine(shared_model(draft_folder, device, dtype, quantization), device, k=opts.k,
                           cache_tokens=draft_tokens, block_size=block_size, fan_out=fan_out,
                           backup="jit", seed=seed)

    if opts.mode == "sd":
        return LocalSpeculator(in_process(fan))
    hello = {"type": "hello", "model": str(draft_folder) if opts.draft_address is None else str(draft),
             "dtype": str(dtype).removeprefix("torch."), "quantization": quantization,
             "k": opts.k, "fan_out": opts.fan_out, "fan_out_miss": opts.fan_out_miss,
             "tree_budget": opts.tree_budget, "backup": opts.backup, "saguaro_c": opts.saguaro_c,
             "cache_tokens": draft_tokens, "block_size": block_size, "seed": seed}
    # If the worker fails, SD in this process takes over (then AR; see RemoteSpeculator).
    return RemoteSpeculator(hello, opts.target_placement(device), opts.draft_placement(device),
                            address=opts.draft_address, timeout=opts.draft_timeout,
                            fallback=lambda: in_process(FanOut(opts.k)))
