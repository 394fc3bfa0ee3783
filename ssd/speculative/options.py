"""The speculation options, and the draft side's configuration, each declared once.

`SpecOptions` is what a user sets. Each field declares (Option) its help, flag, parser,
check, the modes it applies to and its `ssd bench --sweep` key; the keyword arguments of
`LLM(...)`, the flags of `ssd generate` and the other commands (ssd/cli.py), the bench's
configurations and sweeps (ssd/bench/runner.py) and docs/options.md are made from them.
`DraftConfig` is what the draft side needs to build its engine: in this process (SD) or in
the SSD worker, where it travels as a dict in the hello message
(ssd/speculative/link/protocol.py).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ssd.checks import check_int, is_int
from ssd.errors import SSDError
from ssd.models.names import QUANTIZATIONS
from ssd.speculative.draft.fanout import check_fan_out

if TYPE_CHECKING:  # torch, and what imports it, load where a value is checked or used: not for `--help`
    import torch

    from ssd.distributed.placement import Placement

MODES = ("ar", "sd", "ssd")
NGRAM = "ngram"  # draft=NGRAM: prompt lookup, no draft model (ssd/speculative/sources/ngram.py)
SUFFIX = "suffix"  # draft=SUFFIX: suffix decoding over earlier requests too (ssd/speculative/sources/suffix.py)
BACKUPS = ("jit", "fast")
SECRET_ENV = "SSD_DRAFT_SECRET"  # shared secret of a target and a draft worker started by hand
MAX_K = 32
AUTO_K = "auto"  # speculate_k=AUTO_K: K chosen each round (ssd/speculative/policy/adaptive_k.py)
# SD's default K is AUTO_K (it measured at least as fast as the best fixed K on every prompt set,
# docs/decision-log.md, "Auto-K against fixed K"); SSD's speculation cache is built for one
# depth, so it keeps a fixed default.
SSD_K = 4
# draft_vocab="auto": the reduced head's size where the target's token counts are known: as
# accepted as the full head with a cheaper step, where a smaller one lost acceptance on open
# chat (docs/decision-log.md, "Reduced-vocabulary draft head").
AUTO_DRAFT_VOCAB = 32768


def _placement(spec: str) -> Placement:
    from ssd.distributed.placement import parse_placement
    return parse_placement(spec)


def _address(spec: str) -> tuple[str, int]:
    from ssd.distributed.link import parse_address
    return parse_address(spec)


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


def parse_lookup(text: str) -> bool | str:
    """--lookup: on, off or suffix."""
    return SUFFIX if text.strip() == SUFFIX else parse_on_off(text)


def _lookup(name: str, value) -> None:
    if value not in (None, True, False, SUFFIX):
        raise SSDError(f"{name} must be True, False, None or '{SUFFIX}', got {value!r}")


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


@dataclass(frozen=True)
class Option:
    """What a field of SpecOptions declares besides its name, type and default: its help, the
    command-line flag (None: none), how a flag's or a sweep's text is read, the check of a
    value, where it applies (the modes; with `auto_only` only under speculate_k="auto"; with
    `model_only` only with a draft model, not a named draft source), the bench's --sweep key,
    and the word that stands for None on the command line."""

    help: str
    flag: str | None = None
    parse: Callable[[str], object] | None = None
    metavar: str | None = None
    choices: tuple | None = None
    check: Callable[[str, object], None] | None = None  # (name, value): raises SSDError
    modes: tuple[str, ...] = ("sd", "ssd")
    auto_only: bool = False
    model_only: bool = False
    sweep: str | None = None
    none: str = "none"

    @property
    def requires(self) -> str:
        """Where it applies, as an error message says it."""
        where = [] if set(self.modes) == {"sd", "ssd"} else ["mode " + " or ".join(f"'{m}'" for m in self.modes)]
        return " with ".join(where + ([f"speculate_k='{AUTO_K}'"] if self.auto_only else []))


def _option(default, help: str, *, repr: bool = True, **declared) -> object:
    """A field of SpecOptions and its declaration (Option)."""
    return field(default=default, repr=repr, metadata={"option": Option(help, **declared)})


def declared(f) -> Option:
    """The declaration of a field of SpecOptions."""
    return f.metadata["option"]


def _fail(message: str) -> None:
    raise SSDError(message)


def _switch(name: str, value) -> None:
    if value not in (None, True, False):
        raise SSDError(f"{name} must be True, False or None, got {value!r}")


def _k(name: str, value) -> None:
    if value != AUTO_K:
        check_int(name, value, 1, MAX_K, also=f"or '{AUTO_K}'")


def _quantization(name: str, value) -> None:
    if value not in ("auto", None, *QUANTIZATIONS):
        raise SSDError(f"{name} must be 'auto', None or one of {', '.join(QUANTIZATIONS)}, got {value!r}")


def _draft_vocab(name: str, value) -> None:
    if value not in (None, "auto", "full") and not is_int(value):
        raise SSDError(f"{name} must be an integer, 'auto', 'full' or None, got {value!r}")


def parse_window(text: str) -> int | None:
    """The draft's window as written on the command line: an integer, or "all" (None)."""
    window = _int_or(text, ("all",), "draft window")
    return None if window == "all" else window


def parse_quantization(text: str) -> str | None:
    return None if text.strip() == "none" else text.strip()


@dataclass(frozen=True)
class SpecOptions:
    """How SD and SSD speculate (docs/usage.md, "Speculative decoding (SD and SSD)"; every option's declaration:
    docs/options.md, made from these fields). Checked, once, by `resolved(mode)` (ssd/config.py)
    before any model loads or worker starts."""

    speculate_k: int | str | None = _option(
        None, "draft tokens per round (1..32), or auto: chosen per sequence and round from the measured acceptance "
        f"and costs, 0 (plain decoding) when drafting does not pay. Default: auto in sd, {SSD_K} in ssd",
        flag="--k", parse=parse_k, metavar="K|auto", check=_k, sweep="k")
    k_max: int = _option(8, "with --k auto: the most draft tokens a round may ask for", flag="--k-max", parse=int,
                         metavar="K", check=lambda name, v: check_int(name, v, 1, MAX_K), auto_only=True,
                         sweep="kmax")
    draft_quantization: str | None = _option(
        "auto", "the draft's weights: gguf (its GGUF file's own blocks), q4_0 (those blocks, each matrix of "
        "more than 5 bits a weight requantised to Q4_0 at load), int8 (weight-only int8 from its values), none "
        "(dequantised to the target's dtype); the output stays exact whatever they are, only acceptance may "
        "change. auto: q4_0 for a GGUF draft on a CPU (a cheaper draft step), int8 for another CPU draft, none "
        "on a GPU",
        flag="--draft-quantization", parse=parse_quantization, choices=("auto", None, *QUANTIZATIONS),
        check=_quantization, model_only=True)
    draft_vocab: int | str | None = _option(
        "auto", "reduced-vocabulary draft head: the V tokens the target writes most (counted by `ssd vocab`), "
        "plus each request's own tokens; the draft proposes only those, the output stays exact. auto: "
        f"{AUTO_DRAFT_VOCAB} where the target's counts are known (the default target's ship with ssd-engine), "
        "else the full head; full (or None): the draft's whole output layer", flag="--draft-vocab",
        parse=parse_draft_vocab, metavar="V|auto|full", check=_draft_vocab, model_only=True, sweep="v")
    prompt_lookup: bool | str | None = _option(
        None, "SD with a draft model and K auto: prompt lookup beside the draft. Where a sequence's newest n-gram "
        "occurred before, a round may propose what followed it (no draft step) instead of the draft's tokens, "
        "chosen by their measured acceptance and costs; the output stays exact (for prompt lookup alone: "
        "--draft ngram). suffix: suffix decoding, over earlier requests' text too (--draft suffix alone); on: "
        "over the request's own tokens only. Default: suffix there",
        flag="--lookup", parse=parse_lookup, metavar="on|off|suffix", check=_lookup, modes=("sd",), auto_only=True,
        model_only=True, sweep="lookup")
    draft_siblings: bool | None = _option(
        None, "SD with a draft model or an EAGLE-3 head and K auto: branches off the chain. Where the draft was "
        "unsure, its runner-up joins the verify pass as one more row beside its top choice (sibling leaves); a head "
        "grows a tree of its likeliest tokens a few depths down for greedy requests (EAGLE-2's dynamic tree). Each "
        "branch the target takes gains a token. Chosen by their measured take rate against the cost of a row "
        "(auto-K's costs); sampled requests get sibling leaves, verified by the multi-candidate rule; the output "
        "stays exact. Suffix decoding's tree (other continuations of the matched text, by their share) is offered "
        "the same way. Default: suffix decoding's trees only; off: none",
        flag="--siblings", parse=parse_on_off, metavar="on|off", check=_switch, modes=("sd",), auto_only=True,
        model_only=True, sweep="siblings")
    draft_stop: bool | None = _option(
        None, "SD with a draft model and K auto: the draft's own stopping rule. A greedy round drafts while "
        "the draft's confidence in its tokens (their top-1 probabilities, calibrated by measured acceptance) "
        "makes one more token worth a draft step and a verify row, up to --k-max; the output stays exact. "
        "Default: on there",
        flag="--draft-stop", parse=parse_on_off, metavar="on|off", check=_switch, modes=("sd",), auto_only=True,
        model_only=True, sweep="stop")
    draft_guesses: bool | None = _option(
        None, "with a draft model: prompt lookup guesses the draft's next tokens (what followed the latest earlier "
        "occurrence of its newest n-gram), fed in the same draft pass; each guessed token the draft would have "
        "picked itself saves a draft pass; greedy requests only. The draft's tokens are the same, the output stays "
        "exact. Default: on in SD (3-6 per cent faster on the bench sets), off in SSD (only its backups after a "
        "miss would take them: no gain measured)",
        flag="--draft-guesses", parse=parse_on_off, metavar="on|off", check=_switch, model_only=True,
        sweep="guesses")
    draft_window: int | None = _option(
        None, "the most tokens of a context the draft reads when it catches up (a prompt, or what it missed "
        "while not drafting): beyond that it starts over from the context's last W tokens, as if they were "
        "its whole context; the target still reads all, the output stays exact. all: all of it. Default: all",
        flag="--draft-window", parse=parse_window, metavar="W|all",
        check=lambda name, v: v is None or check_int(name, v, 16), model_only=True, sweep="w", none="all")
    suffix_tokens: int = _option(
        500_000, "suffix decoding (--draft suffix, or beside a draft model: --lookup suffix, the default): the most "
        "tokens of earlier requests its index keeps, over all tenants (cache_salt), the oldest request's out first",
        flag="--suffix-tokens", parse=int,
        metavar="N", modes=("sd",), check=lambda name, v: check_int(name, v, 0))
    suffix_keep: bool = _option(
        False, "suffix decoding: keep its index across restarts, in the store (one file per target tokenizer, "
        "tenants apart as in memory): saved when the engine closes, loaded when it starts",
        flag="--suffix-keep", parse=parse_on_off, metavar="on|off", check=_switch, modes=("sd",))
    ngram_min: int = _option(1, "prompt lookup (draft='ngram', or beside a draft with --lookup on): the shortest "
                             "n-gram looked up", flag="--ngram-min", parse=int, metavar="N")
    ngram_max: int = _option(4, "prompt lookup: the longest n-gram looked up (tried first)", flag="--ngram-max",
                             parse=int, metavar="N")
    fan_out: int | list[int] | str = _option(
        3, "fork tokens per depth of the speculation tree: F, one count per depth F0,..,FK, or auto "
        "(sized from the measured acceptance)", flag="--f", parse=parse_fan_out, metavar="F|auto|F0,..,FK",
        modes=("ssd",), model_only=True, sweep="f")
    fan_out_miss: int | list[int] | None = _option(
        None, "fork counts per depth after a cache miss (default: as --f)", flag="--fan-out-miss",
        parse=parse_fan_out, metavar="F0,..,FK", modes=("ssd",), model_only=True)
    tree_budget: int | None = _option(None, "with --f auto: branches per tree (default: 3*(K+1))",
                                      flag="--tree-budget", parse=int, metavar="B", modes=("ssd",), model_only=True)
    fit_tree: bool = _option(
        True, "fit the tree to the target's verify pass: a build the target had to wait for caps the next trees' "
        "branches at the likeliest outcomes; off: the whole fan-out every round", flag="--fit-tree",
        parse=parse_on_off, metavar="on|off", modes=("ssd",), model_only=True,
        check=lambda name, v: None if isinstance(v, bool) else _fail(f"{name} must be True or False, got {v!r}"))
    backup: str = _option("jit", "on a cache miss draft on the spot (jit) or send placeholders verified as one-hot "
                          "proposals (fast)", flag="--backup", choices=BACKUPS, modes=("ssd",), model_only=True,
                          check=lambda name, v: None if v in BACKUPS else
                          _fail(f"{name} must be one of {', '.join(BACKUPS)}, got {v!r}"))
    saguaro_c: float | None = _option(
        None, "temperature > 0: Saguaro sampling, scale the draft's top tokens by C in (0, 1)", flag="--saguaro-c",
        parse=float, metavar="C", modes=("ssd",), model_only=True,
        check=lambda name, v: None if v is None or 0 < v < 1 else _fail(f"{name} must be in (0, 1), got {v}"))
    target_device: str | None = _option(
        None, "the target's device, e.g. cpu:0 or cuda:0 (default: the first half of the CPU cores / cuda:0)",
        flag="--target-device", metavar="DEV", modes=("ssd",), model_only=True,
        check=lambda name, v: v is None or _placement(v))
    draft_device: str | None = _option(
        None, "the draft worker's device, e.g. cpu:1 or cuda:1 (default: the other CPU cores / cuda:1); cpu beside "
        "a GPU target: every host core but the first", flag="--draft-device", metavar="DEV", modes=("ssd",),
        model_only=True, sweep="ddev",
        check=lambda name, v: v is None or _placement(v))
    draft_address: str | None = _option(
        None, "wait at HOST:PORT for a worker started by hand (`ssd worker --connect HOST:PORT`, with the same "
        f"{SECRET_ENV} in both environments) instead of starting one", flag="--draft-address", metavar="HOST:PORT",
        modes=("ssd",), model_only=True, check=lambda name, v: v is None or _address(v))
    draft_thread: bool | None = _option(
        None, "run the draft worker as a thread of this process (on a CUDA stream of its own) instead of a process: "
        "two processes on one GPU take turns, two streams of one process can overlap. Default: on where the target and "
        "the draft share one CUDA device", flag="--draft-thread", parse=parse_on_off, metavar="on|off",
        check=_switch, modes=("ssd",), model_only=True, sweep="thread")
    draft_timeout: float = _option(
        60.0, "seconds without an answer before the draft worker counts as hung", flag="--draft-timeout",
        parse=float, metavar="S", modes=("ssd",), model_only=True,
        check=lambda name, v: None if v > 0 else _fail(f"{name} must be > 0 seconds, got {v}"))
    # A remote worker's shared secret (default: $SSD_DRAFT_SECRET); never shown in a repr.
    draft_secret: str | None = _option(None, "", modes=("ssd",), model_only=True, repr=False)

    def resolved(self, mode: str, named_source: bool = False) -> "SpecOptions":
        """These options checked for `mode` (named_source: the draft is a draft source without a
        model, sources/named.py), its default K filled in, and k_max the most draft tokens a
        round asks for (a fixed K's own value)."""
        spec = self if self.speculate_k is not None else replace(self, speculate_k=SSD_K if mode == "ssd" else AUTO_K)
        spec.check(mode, named_source)
        return spec if spec.speculate_k == AUTO_K else replace(spec, k_max=spec.speculate_k)

    def check(self, mode: str, named_source: bool = False) -> None:
        """Each option's own check (Option.check) and where it applies, then the rules that tie
        options together."""
        if mode not in MODES:
            raise SSDError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
        if mode == "ar":
            return
        for f in fields(self):
            o, value = declared(f), getattr(self, f.name)
            if o.check is not None:
                o.check(f.name, value)
            # None is the mode's default, and a switch turned off where it defaults to None is off
            # wherever it does not apply: neither is set here.
            set_here = value != f.default and not (f.default is None and value in (None, False))
            if set_here and (mode not in o.modes or (o.auto_only and self.speculate_k != AUTO_K)):
                raise SSDError(f"{f.name} applies to {o.requires} only")
            if set_here and o.model_only and named_source:
                raise SSDError(f"{f.name} applies to a draft model, not a draft source without one")
        if self.draft_thread and self.draft_address is not None:
            raise SSDError("draft_thread runs the worker in this process; draft_address waits for one elsewhere")
        check_ngram_sizes(self.ngram_min, self.ngram_max)
        if self.draft_address is not None and not self.secret():
            raise SSDError(f"a draft worker started by hand needs a shared secret: set {SECRET_ENV} to the same value "
                           "where the target and the worker run (or pass draft_secret=...)")
        check_fan_out(self.k_max if self.speculate_k == AUTO_K else self.speculate_k, self.fan_out,
                      self.fan_out_miss, self.tree_budget)

    def secret(self) -> str | None:
        return self.draft_secret or os.environ.get(SECRET_ENV) or None

    def draft_weights(self, folder: Path, target_device: torch.device) -> str:
        """How the draft's weights are held (ssd/models/loader.py WEIGHTS), "auto" decided."""
        device = self.draft_on(target_device)
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
        # types); at 4.5 bits a weight its step reads fewer bytes, which SD gains more from than
        # it loses in acceptance (docs/decision-log.md, "Draft weights").
        from ssd.models.loader import resolve_weights
        return "q4_0" if resolve_weights(folder, device, "auto") == "gguf" else "int8"

    def target_placement(self, device: torch.device) -> Placement:
        from ssd.distributed.placement import default_pair
        return _placement(self.target_device) if self.target_device else default_pair(device)[0]

    def draft_placement(self, device: torch.device) -> Placement:
        from ssd.distributed.placement import beside_gpu, default_pair
        if not self.draft_device:
            return default_pair(device)[1]
        return beside_gpu(_placement(self.draft_device), self.target_placement(device).device)

    def draft_on(self, target_device: torch.device) -> torch.device:
        """The device the draft computes on: its worker's where draft_device names one, else
        the target's (SD's draft runs in the target's process)."""
        return self.draft_placement(target_device).device if self.draft_device else target_device

    def draft_dtype(self, target_device: torch.device, target_dtype: torch.dtype) -> torch.dtype:
        """The draft's activations: the target's dtype on the target's kind of device; a draft
        on the CPU beside a GPU target computes as the CPU does best (its numerics change only
        the acceptance rate, never the output)."""
        device = self.draft_on(target_device)
        from ssd.distributed.placement import default_dtype
        return target_dtype if device.type == target_device.type else default_dtype(device)

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
    seeded_sampling: str = "shared-noise"  # EngineConfig.seeded_sampling: seeded requests draft by the target's noise
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
    threads: int | None = None  # the most threads a pass takes, by the load (EngineConfig.follow_load); None: fixed

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        """From a hello message: a malformed one is the peer's error, not a crash."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not isinstance(d, dict) or not required <= set(d) <= names:
            keys = set(d) if isinstance(d, dict) else set()
            raise SSDError(f"bad draft configuration: missing {sorted(required - keys)}, "
                           f"unknown {sorted(keys - names)}")
        cfg = cls(**d)
        check_fan_out(cfg.k_max, cfg.fan_out, cfg.fan_out_miss, cfg.tree_budget)
        return cfg


def reference() -> str:
    """docs/options.md: every speculation option as declared above (tests/test_cli.py checks that
    the file is this text, and says how to write it again)."""
    lines = ["# Speculation options", "",
             "Made from the declarations in `ssd/speculative/options.py` (`SpecOptions`): the keyword of",
             "`LLM(...)`, the flag of `ssd generate`, `ssd chat`, `ssd serve` and `ssd check`, the key of",
             "`ssd bench --sweep`, the default and where the option applies. The engine's own options",
             "(device, threads, KV cache, ...) are in the README.", "",
             "| keyword | flag | sweep | default | applies to | what it does |", "|---|---|---|---|---|---|"]
    for f in fields(SpecOptions):
        o = declared(f)
        if not o.help:
            continue
        where = o.requires or "sd, ssd"
        where += ", with a draft model" if o.model_only else ""
        default = "(the mode's)" if f.default is None else f"`{f.default!r}`"
        lines.append(f"| `{f.name}` | `{o.flag}` | {f'`{o.sweep}`' if o.sweep else ''} | {default} | {where} | "
                     f"{o.help} |")
    return "\n".join(lines) + "\n"
