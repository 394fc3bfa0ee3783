"""The speculation options, and the draft side's configuration, each spelled once.

`SpecOptions` is what a user sets: keyword arguments of `LLM(...)`, flags of `ssd generate`
(generated from the fields below, see ssd/cli.py) and the bench's configurations.
`DraftConfig` is what the draft side needs to build its engine: in this process (SD) or in
the SSD worker, where it travels as a dict in the hello message (ssd/speculative/link/protocol.py).
"""
import os
from pathlib import Path
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

import torch

from ssd.checks import check_int, is_int
from ssd.distributed.link import parse_address
from ssd.distributed.placement import Placement, default_pair, parse_placement
from ssd.errors import SSDError
from ssd.models.loader import QUANTIZATIONS, resolve_weights
from ssd.speculative.draft.fanout import check_fan_out

MODES = ("ar", "sd", "ssd")
NGRAM = "ngram"  # draft=NGRAM: prompt lookup, no draft model (ssd/speculative/sources/ngram.py)
BACKUPS = ("jit", "fast")
SECRET_ENV = "SSD_DRAFT_SECRET"  # shared secret of a target and a draft worker started by hand
MAX_K = 32
AUTO_K = "auto"  # speculate_k=AUTO_K: K chosen each round (ssd/speculative/policy/adaptive_k.py)
# SD's default K is AUTO_K (it measured at least as fast as the best fixed K on every prompt set,
# bench/README.md); SSD's speculation cache is built for one depth, so it keeps a fixed default.
SSD_K = 4
# draft_vocab="auto": the reduced head's size where the target's token counts are known. With
# the default pair it kept acceptance within a point of the full head on all four prompt sets
# and made SD 1.10-1.15x faster; 16384 lost 5 points on MT-Bench (bench/README.md).
AUTO_DRAFT_VOCAB = 32768


def check_ngram_sizes(ngram_min: int, ngram_max: int) -> None:
    if not (is_int(ngram_min) and is_int(ngram_max) and 1 <= ngram_min <= ngram_max <= 16):
        raise SSDError(f"n-gram sizes must satisfy 1 <= ngram_min <= ngram_max <= 16, got {ngram_min}, {ngram_max}")


def _int_or(text: str, words: tuple[str, ...], what: str) -> int | str:
    """A command-line value that is an integer or one of `words`."""
    text = text.strip()
    if text in words:
        return text
    try:
        return int(text)
    except ValueError:
        options = ["an integer", *(f"'{w}'" for w in words)]
        raise SSDError(f"bad {what} {text!r}: expected {', '.join(options[:-1])} or {options[-1]}") from None


def parse_k(text: str) -> int | str:
    """A K as written on the command line: an integer or "auto"."""
    return _int_or(text, (AUTO_K,), "K")


def parse_on_off(text: str) -> bool:
    """A switch as written on the command line: on or off."""
    if text.strip() not in ("on", "off"):
        raise SSDError(f"expected on or off, got {text!r}")
    return text.strip() == "on"


def parse_draft_vocab(text: str) -> int | str:
    """A reduced draft head's size as written on the command line: an integer, "auto" or "full"."""
    return _int_or(text, ("auto", "full"), "draft vocabulary")


def parse_fan_out(text: str) -> int | str | list[int]:
    """A fan-out as written on the command line: "3", "auto" or one count per depth "4,2,1"."""
    text = text.strip()
    if text == "auto":
        return text
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SSDError(f"bad fan-out {text!r}: expected an integer, 'auto' or comma-separated integers") from None
    return values[0] if len(values) == 1 else values


def _option(default, help: str, *, flag: str | None = None, ssd_only: bool = False, parse=None,
            metavar: str | None = None, choices: tuple | None = None, repr: bool = True):
    """A field of SpecOptions with what the command line needs to offer it (flag None: no flag)."""
    return field(default=default, repr=repr, metadata=dict(flag=flag, help=help, ssd_only=ssd_only, parse=parse,
                                                          metavar=metavar, choices=choices))


@dataclass(frozen=True)
class SpecOptions:
    """How SD and SSD speculate (README.md, "Speculative decoding"). Checked, once, by
    `resolved(mode)` (ssd/config.py) before any model loads or worker starts."""

    speculate_k: int | str | None = _option(
        None, "draft tokens per round (1..32), or auto: chosen per sequence and round from the measured acceptance "
        f"and costs, 0 (plain decoding) when drafting does not pay. Default: auto in sd, {SSD_K} in ssd",
        flag="--k", parse=parse_k, metavar="K|auto")
    k_max: int = _option(8, "with --k auto: the most draft tokens a round may ask for", flag="--k-max", parse=int,
                         metavar="K")
    draft_quantization: str | None = _option(
        "auto", "the draft's weights: gguf (its GGUF file's own blocks), q4_0 (those blocks, each matrix of "
        "more than 5 bits a weight requantised to Q4_0 at load), int8 (weight-only int8 from its values), none "
        "(dequantised to the target's dtype); the output stays exact whatever they are, only acceptance may "
        "change. auto: q4_0 for a GGUF draft on a CPU (a cheaper draft step), int8 for another CPU draft, none "
        "on a GPU",
        flag="--draft-quantization", choices=("auto", "none", *QUANTIZATIONS))
    draft_vocab: int | str | None = _option(
        "auto", "reduced-vocabulary draft head: the V tokens the target writes most (counted by `ssd vocab`), "
        "plus each request's own tokens; the draft proposes only those, the output stays exact. auto: "
        f"{AUTO_DRAFT_VOCAB} where the target's counts are known (the default target's ship with ssd-engine), "
        "else the full head; full (or None): the draft's whole output layer", flag="--draft-vocab",
        parse=parse_draft_vocab, metavar="V|auto|full")
    prompt_lookup: bool | None = _option(
        None, "SD with a draft model and K auto: prompt lookup beside the draft. Where a sequence's newest n-gram "
        "occurred before, a round may propose what followed it (no draft step) instead of the draft's tokens, "
        "chosen by their measured acceptance and costs; the output stays exact. Default: on there",
        flag="--lookup", parse=parse_on_off, metavar="on|off")
    draft_siblings: bool | None = _option(
        None, "SD with a draft model and K auto: sibling leaves. Where the draft was unsure, its runner-up joins the "
        "verify pass as one more row beside its top choice; where the target takes it, the round gains a token. "
        "Chosen by their measured rescue rate against the cost of a row; sampled requests are verified by the "
        "multi-candidate rule; the output stays exact. Default: off",
        flag="--siblings", parse=parse_on_off, metavar="on|off")
    draft_stop: bool | None = _option(
        None, "SD with a draft model and K auto: the draft's own stopping rule. A greedy round drafts while "
        "the draft's confidence in its tokens (their top-1 probabilities, calibrated by measured acceptance) "
        "makes one more token worth a draft step and a verify row, up to --k-max; the output stays exact. "
        "Default: on there",
        flag="--draft-stop", parse=parse_on_off, metavar="on|off")
    draft_guesses: bool | None = _option(
        None, "with a draft model: prompt lookup guesses the draft's next tokens (what followed the latest earlier "
        "occurrence of its newest n-gram), fed in the same draft pass; each guessed token the draft would have "
        "picked itself saves a draft pass; greedy requests only. The draft's tokens are the same, the output stays "
        "exact. Default: on in SD (3-6 per cent faster on the bench sets), off in SSD (only its backups after a "
        "miss would take them: no gain measured)",
        flag="--draft-guesses", parse=parse_on_off, metavar="on|off")
    draft_window: int | None = _option(
        None, "the most tokens of a context the draft reads when it catches up (a prompt, or what it missed "
        "while not drafting): beyond that it starts over from the context's last W tokens, as if they were "
        "its whole context; the target still reads all, the output stays exact. Default: all of it",
        flag="--draft-window", parse=int, metavar="W")
    ngram_min: int = _option(1, "prompt lookup (draft='ngram', or beside a draft): the shortest n-gram looked up",
                             flag="--ngram-min", parse=int, metavar="N")
    ngram_max: int = _option(4, "prompt lookup: the longest n-gram looked up (tried first)", flag="--ngram-max",
                             parse=int, metavar="N")
    fan_out: int | list[int] | str = _option(
        3, "fork tokens per depth of the speculation tree: F, one count per depth F0,..,FK, or auto "
        "(sized from the measured acceptance)", flag="--f", ssd_only=True, parse=parse_fan_out, metavar="F|auto|F0,..,FK")
    fan_out_miss: int | list[int] | None = _option(
        None, "fork counts per depth after a cache miss (default: as --f)", flag="--fan-out-miss", ssd_only=True,
        parse=parse_fan_out, metavar="F0,..,FK")
    tree_budget: int | None = _option(None, "with --f auto: branches per tree (default: 3*(K+1))",
                                      flag="--tree-budget", ssd_only=True, parse=int, metavar="B")
    fit_tree: bool = _option(True, "fit the tree to the target's verify pass: a build the target had to wait for "
                             "caps the next trees' branches at the likeliest outcomes; off: the whole fan-out every "
                             "round", flag="--fit-tree", ssd_only=True, parse=parse_on_off, metavar="on|off")
    backup: str = _option("jit", "on a cache miss draft on the spot (jit) or send placeholders verified as one-hot "
                          "proposals (fast)", flag="--backup", ssd_only=True, choices=BACKUPS)
    saguaro_c: float | None = _option(None, "temperature > 0: Saguaro sampling, scale the draft's top tokens by C in "
                                      "(0, 1)", flag="--saguaro-c", ssd_only=True, parse=float, metavar="C")
    target_device: str | None = _option(None, "the target's device, e.g. cpu:0 or cuda:0 (default: the first half of "
                                        "the CPU cores / cuda:0)", flag="--target-device", ssd_only=True, metavar="DEV")
    draft_device: str | None = _option(None, "the draft worker's device, e.g. cpu:1 or cuda:1 (default: the other "
                                       "CPU cores / cuda:1)", flag="--draft-device", ssd_only=True, metavar="DEV")
    draft_address: str | None = _option(
        None, "wait at HOST:PORT for a worker started by hand (`ssd worker --connect HOST:PORT`, with the same "
        f"{SECRET_ENV} in both environments) instead of starting one", flag="--draft-address", ssd_only=True,
        metavar="HOST:PORT")
    draft_thread: bool | None = _option(
        None, "run the draft worker as a thread of this process (on a CUDA stream of its own) instead of a process: "
        "two processes on one GPU take turns, two streams of one process can overlap. Default: on where the target and "
        "the draft share one CUDA device", flag="--draft-thread", ssd_only=True, parse=parse_on_off, metavar="on|off")
    draft_timeout: float = _option(60.0, "seconds without an answer before the draft worker counts as hung",
                                   flag="--draft-timeout", ssd_only=True, parse=float, metavar="S")
    # A remote worker's shared secret (default: $SSD_DRAFT_SECRET); never shown in a repr.
    draft_secret: str | None = _option(None, "", ssd_only=True, repr=False)

    def resolved(self, mode: str) -> "SpecOptions":
        """These options checked for `mode`, its default K filled in, and k_max the most draft
        tokens a round asks for (a fixed K's own value)."""
        spec = self if self.speculate_k is not None else replace(self, speculate_k=SSD_K if mode == "ssd" else AUTO_K)
        spec.check(mode)
        return spec if spec.speculate_k == AUTO_K else replace(spec, k_max=spec.speculate_k)

    def check(self, mode: str) -> None:
        if mode not in MODES:
            raise SSDError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
        if mode == "ar":
            return
        if self.speculate_k != AUTO_K:
            check_int("speculate_k", self.speculate_k, 1, MAX_K, also=f"or '{AUTO_K}'")
        check_int("k_max", self.k_max, 1, MAX_K)
        if self.k_max != SpecOptions.k_max and self.speculate_k != AUTO_K:
            raise SSDError(f"k_max applies to speculate_k='{AUTO_K}' only")
        if self.draft_vocab not in (None, "auto", "full") and not is_int(self.draft_vocab):
            raise SSDError(f"draft_vocab must be an integer, 'auto', 'full' or None, got {self.draft_vocab!r}")
        changed = [f.name for f in fields(self) if f.metadata["ssd_only"] and getattr(self, f.name) != f.default]
        if mode != "ssd" and changed:
            raise SSDError(f"{', '.join(changed)} only apply to mode 'ssd'")
        if self.draft_window is not None:
            check_int("draft_window", self.draft_window, 16)
        if self.draft_thread not in (None, True, False):
            raise SSDError(f"draft_thread must be True, False or None, got {self.draft_thread!r}")
        if self.draft_thread and self.draft_address is not None:
            raise SSDError("draft_thread runs the worker in this process; draft_address waits for one elsewhere")
        check_ngram_sizes(self.ngram_min, self.ngram_max)
        for name in ("prompt_lookup", "draft_siblings", "draft_stop", "draft_guesses"):  # on, off, or the mode's default
            if getattr(self, name) not in (None, True, False):
                raise SSDError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.prompt_lookup and (mode != "sd" or self.speculate_k != AUTO_K):
            raise SSDError("prompt_lookup beside a draft model applies to mode 'sd' with speculate_k='auto' "
                           "(for prompt lookup alone, use draft='ngram')")
        if self.draft_siblings and (mode != "sd" or self.speculate_k != AUTO_K):
            raise SSDError("draft_siblings applies to mode 'sd' with speculate_k='auto' (their choice rests on "
                           "auto-K's measured costs)")
        if self.draft_stop and (mode != "sd" or self.speculate_k != AUTO_K):
            raise SSDError("draft_stop applies to mode 'sd' with speculate_k='auto' (a fixed K is what a round "
                           "drafts)")
        if self.draft_quantization not in ("auto", None, *QUANTIZATIONS):
            raise SSDError(f"draft_quantization must be 'auto', None or one of {', '.join(QUANTIZATIONS)}, "
                           f"got {self.draft_quantization!r}")
        if not self.draft_timeout > 0:
            raise SSDError(f"draft_timeout must be > 0 seconds, got {self.draft_timeout}")
        if not isinstance(self.fit_tree, bool):
            raise SSDError(f"fit_tree must be True or False, got {self.fit_tree!r}")
        if self.backup not in BACKUPS:
            raise SSDError(f"backup must be one of {', '.join(BACKUPS)}, got {self.backup!r}")
        if self.saguaro_c is not None and not 0 < self.saguaro_c < 1:
            raise SSDError(f"saguaro_c must be in (0, 1), got {self.saguaro_c}")
        if self.draft_address is not None:
            parse_address(self.draft_address)
        if self.draft_address is not None and not self.secret():
            raise SSDError(f"a draft worker started by hand needs a shared secret: set {SECRET_ENV} to the same value "
                           "where the target and the worker run (or pass draft_secret=...)")
        check_fan_out(self.k_max if self.speculate_k == AUTO_K else self.speculate_k, self.fan_out,
                      self.fan_out_miss, self.tree_budget)
        if mode == "ssd":
            for device in (self.target_device, self.draft_device):
                if device is not None:
                    parse_placement(device)

    def secret(self) -> str | None:
        return self.draft_secret or os.environ.get(SECRET_ENV) or None

    def draft_weights(self, folder: Path, target_device: torch.device) -> str:
        """How the draft's weights are held (ssd/models/loader.py WEIGHTS), "auto" decided."""
        device = self.draft_placement(target_device).device if self.draft_device else target_device
        if self.draft_quantization in QUANTIZATIONS and device.type == "cuda":
            raise SSDError(f"draft_quantization={self.draft_quantization!r} is for a draft on a CPU; on CUDA it "
                           "would dequantise every weight on every forward pass: use 'auto' or None")
        if self.draft_quantization is None:
            return "dequantized"
        if self.draft_quantization != "auto":
            return self.draft_quantization
        if device.type != "cpu":
            return "dequantized"
        # q4_0: the default draft's file is mostly Q5_0/Q8_0 (its 896-wide rows rule out the K
        # types); at 4.5 bits a weight its step costs ~0.75x and SD ran 3-7 % faster on every
        # set (bench/README.md, "Draft weights").
        return "q4_0" if resolve_weights(folder, device, "auto") == "gguf" else "int8"

    def target_placement(self, device: torch.device) -> Placement:
        return parse_placement(self.target_device) if self.target_device else default_pair(device)[0]

    def draft_placement(self, device: torch.device) -> Placement:
        return parse_placement(self.draft_device) if self.draft_device else default_pair(device)[1]

    def worker_in_thread(self, device: torch.device) -> bool:
        """draft_thread resolved: by default a thread where target and draft share a CUDA device."""
        if self.draft_thread is not None or self.draft_address is not None:
            return bool(self.draft_thread)
        target, draft = self.target_placement(device).device, self.draft_placement(device).device
        return target.type == "cuda" and target == draft

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "SpecOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise SSDError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the speculation "
                           f"options are {', '.join(sorted(known))}")
        return cls(**kwargs)


@dataclass(frozen=True)
class DraftConfig:
    """Everything the draft side needs to build its engine (DraftEngine.from_config)."""

    model: str  # a model folder, or for a worker on another host the name or path it resolves there
    dtype: str  # "float32", "bfloat16", ... as the target names it
    weights: str  # how the draft's weights are held (ssd/models/loader.py WEIGHTS)
    k_max: int  # the most draft tokens a round asks for
    cache_tokens: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    seed: int | None = None
    # SSD's speculation tree (the worker); SD drafts without one.
    fan_out: int | list[int] | str = 3
    fan_out_miss: int | list[int] | None = None
    tree_budget: int | None = None
    fit_tree: bool = True
    backup: str = "jit"
    saguaro_c: float | None = None
    vocab_ids: list[int] | None = None  # a reduced-vocabulary head's token ids (see SpecOptions.draft_vocab)
    prefix_caching: bool = True  # the draft's own prefix cache (EngineConfig.enable_prefix_caching)
    window: int | None = None  # SpecOptions.draft_window
    guesses: bool = False  # SpecOptions.draft_guesses

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        """From a hello message: a malformed one is the peer's error, not a crash."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not isinstance(d, dict) or not required <= set(d) <= names:
            keys = set(d) if isinstance(d, dict) else set()
            raise SSDError(f"bad draft configuration: missing {sorted(required - keys)}, unknown {sorted(keys - names)}")
        cfg = cls(**d)
        check_fan_out(cfg.k_max, cfg.fan_out, cfg.fan_out_miss, cfg.tree_budget)
        return cfg
