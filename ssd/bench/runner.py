"""Run benchmark configurations (AR, SD, SSD and peer engines) over prompt sets.

Every engine configuration keeps its own LLM alive for the whole run and they take turns
on each batch of prompts, the first of them rotating from batch to batch, so the slow and
fast moments of a shared host fall on all of them alike: speed ratios come from paired,
interleaved runs. Peers (transformers, llama.cpp) load their own copies of the weights, so
they run afterwards, once the engine's models are freed, on the same tokenised prompts."""
import gc
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import jsonschema
import torch
from tqdm import tqdm

from ssd import LLM, SamplingParams
from ssd.bench.busy import busy
from ssd.bench.peers import PeerResult, PeerSkip, isolated, run_hf, run_llamacpp
from ssd.bench.prompts import BenchPrompt
from ssd.errors import SSDError
from ssd.speculative.options import NGRAM, SSD_K, SpecOptions, declared
from ssd.store import REGISTRY, gguf_path, resolve_model

ENGINE_MODES = ("ar", "sd", "ssd", "ngram")  # ngram: SD drafted by prompt lookup (draft="ngram"), no draft model
PEERS = {"hf": ("hf", "hf-assisted"), "llamacpp": ("llamacpp", "llamacpp-spec")}  # --peers name -> rows
SWEEPS = {declared(f).sweep: f for f in fields(SpecOptions) if declared(f).sweep}  # --sweep key -> its option
OPTIONS = {f.name: f for f in fields(SpecOptions)}
WARMUP_PROMPT = "Count from one to ten."
WARMUP_TOKENS = 8

FanOut = int | str | tuple[int, ...]  # per depth, or "auto"


def shown(name: str, value) -> str:
    """An option's value as the command line writes it."""
    if value is None:
        return declared(OPTIONS[name]).none
    if isinstance(value, bool):
        return "on" if value else "off"
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def sweep_modes(key: str) -> set[str]:
    """The engine modes a --sweep key's option applies to, as the bench runs them (the others
    run once, at the default): an option of auto-K's only in sd, whose default K is auto, and
    ngram (SD without a draft model) only where the option needs no draft model."""
    o = declared(SWEEPS[key])
    modes = {m for m in o.modes if not (o.auto_only and m == "ssd")}
    return modes | ({"ngram"} if "sd" in modes and not o.model_only else set())


@dataclass(frozen=True)
class RunConfig:
    """One configuration the benchmark runs: an engine mode or a peer, with its settings."""

    mode: str  # "ar" | "sd" | "ssd" | "ngram", or a peer: "hf" | "hf-assisted" | "llamacpp" | "llamacpp-spec"
    k: int | str | None = None  # draft tokens per round, or "auto"
    # The speculation options this run sets (SpecOptions field, value), in the order given.
    options: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        parts = [self.mode] + ([f"k={self.k}"] if self.k is not None else [])
        return " ".join(parts + [f"{declared(OPTIONS[name]).sweep or name}={shown(name, value)}"
                                 for name, value in self.options])

    def value(self, name: str):
        """The value this configuration gives option `name` (None: the engine's default)."""
        return self.k if name == "speculate_k" else dict(self.options).get(name)

    @property
    def is_peer(self) -> bool:
        return self.mode not in ENGINE_MODES

    def setting(self, name: str, value) -> "RunConfig":
        """This configuration with option `name` set to `value` (in place, where it was set; K is
        the configuration's own)."""
        if name == "speculate_k":
            return replace(self, k=value)
        names = [n for n, _ in self.options]
        options = list(self.options)
        if name in names:
            options[names.index(name)] = (name, value)
        else:
            options.append((name, value))
        return replace(self, options=tuple(options))


def expand_configs(modes: Sequence[str], k: int, fan_out: FanOut | None = None, backup: str | None = None,
                   sweep: tuple[str, Sequence] | None = None, peers: Sequence[str] = ()) -> list[RunConfig]:
    """The configurations of a run, in table order: each mode, a sweep's values for the
    speculative modes it applies to (sweep_modes), then the peers' rows."""
    configs = []
    for mode in modes:
        ssd = (("fan_out", fan_out), ("backup", backup)) if mode == "ssd" else ()
        base = RunConfig(mode) if mode == "ar" else RunConfig(mode, k, tuple((n, v) for n, v in ssd if v is not None))
        applies = sweep is not None and mode in sweep_modes(sweep[0])
        configs += [base.setting(SWEEPS[sweep[0]].name, v) for v in sweep[1]] if applies else [base]
    for peer in peers:
        plain, spec = PEERS[peer]
        configs += [RunConfig(plain), RunConfig(spec, k)]
    return configs


@dataclass
class BenchSpec:
    model: str  # store name, folder or .gguf
    draft: str | None
    configs: list[RunConfig]
    temperature: float = 0.0
    max_tokens: int = 128
    ignore_eos: bool = False
    batch_size: int = 1  # prompts per generate() call (peers always run one at a time)
    chat_template: bool = True  # prompts as a user message in the model's chat template
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    draft_quantization: str | None = "auto"  # the engine's option (SpecOptions.draft_quantization)
    seed: int = 0  # of every LLM's sampling generator
    sweep: str | None = None  # the --sweep key (SWEEPS) when the configurations sweep one
    busy_cores: int = 0  # busy loops beside each configuration's turns and each peer (busy.py)
    request_seed: int | None = None  # every request's seed: seeded sampling gives AR's tokens in every mode

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens or self.max_tokens,
                              ignore_eos=self.ignore_eos, seed=self.request_seed)

    @property
    def pins_tokens(self) -> bool:
        """Whether the engine's modes must give AR's tokens: greedy, or seeded sampling."""
        return self.temperature == 0 or self.request_seed is not None

    def engine_kwargs(self, c: RunConfig) -> dict:
        kwargs = dict(device=self.device, dtype=self.dtype, threads=self.threads,
                      max_num_seqs=max(16, self.batch_size), seed=self.seed)
        if c.mode == "ngram":
            kwargs.update(draft=NGRAM, mode="sd", speculate_k=c.k)
        elif c.mode != "ar":
            kwargs.update(draft=self.draft, mode=c.mode, speculate_k=c.k, draft_quantization=self.draft_quantization)
        kwargs.update({name: list(v) if isinstance(v, tuple) else v for name, v in c.options})
        return kwargs


@dataclass
class PromptRecord:
    set: str
    prompt_id: str
    config: str  # RunConfig.label
    batch: int  # index of the generate() call within this set and configuration
    batch_wall_s: float  # wall time of that call, all its prompts together
    token_ids: list[int]
    metrics: dict  # RequestMetrics.as_dict(), or the subset of its keys a peer measures
    same_as_ar: bool | None = None  # token-identical to AR; None for AR itself, at T > 0, or without AR
    valid: bool | None = None  # the answer parses and follows the prompt's schema; None: no schema
    finish_reason: str | None = None  # the engine's ("stop", "length"); None for peers


@dataclass
class BenchResult:
    spec: BenchSpec
    prompt_sets: dict[str, list[BenchPrompt]]
    records: list[PromptRecord] = field(default_factory=list)
    # why a configuration did not run: by its label, or "LABEL on SET" where it ran on other sets
    skipped: dict[str, str] = field(default_factory=dict)
    device: str = ""  # where the engine ran and in what dtype, as resolved
    dtype: str = ""
    threads: int = 0  # CPU threads of the engine's rows and of every peer's
    draft_weights: str | None = None  # how the draft model's weights were held (auto resolved)


def run_bench(spec: BenchSpec, prompt_sets: dict[str, list[BenchPrompt]], progress: bool = True) -> BenchResult:
    """Run every configuration of `spec` on every prompt, then mark token identity with AR."""
    if not any(prompt_sets.values()):
        raise SSDError("no prompts to run")
    result = BenchResult(spec, prompt_sets)
    prompt_ids = _run_engines(result, progress)
    gc.collect()  # the engine's models are unreferenced now: free them before the peers load theirs
    for c in (c for c in spec.configs if c.is_peer):
        with busy(spec.busy_cores):
            _run_peer(result, c, prompt_ids)
    if spec.pins_tokens:  # (a peer's sampled tokens are its own draws)
        ar = {(r.set, r.prompt_id): r.token_ids for r in result.records if r.config == "ar"}
        engine = {c.label for c in spec.configs if not c.is_peer or spec.temperature == 0}
        for r in result.records:
            if r.config != "ar" and r.config in engine and (r.set, r.prompt_id) in ar:
                r.same_as_ar = r.token_ids == ar[r.set, r.prompt_id]
    return result


def _skip(result: BenchResult, label: str, reason: str) -> None:
    result.skipped[label] = reason
    print(f"ssd bench: {label} skipped: {reason}", file=sys.stderr)


def _batches(items: Sequence, size: int) -> Iterator[Sequence]:
    return (items[i:i + size] for i in range(0, len(items), size))


def _run_engines(result: BenchResult, progress: bool) -> dict[str, list[list[int]]]:
    """Load each engine configuration, warm it up, and run them in turn on every batch.
    Returns every set's prompts as token ids, for the peers."""
    spec = result.spec
    llms: dict[str, LLM] = {}
    for c in (c for c in spec.configs if not c.is_peer):
        try:
            llms[c.label] = LLM(spec.model, **spec.engine_kwargs(c))
        except SSDError as e:  # e.g. a mode this engine does not have (yet); AR must load
            if c.mode == "ar":
                raise
            _skip(result, c.label, str(e))
    if not llms:
        raise SSDError("no configuration could run: " + "; ".join(f"{k}: {v}" for k, v in result.skipped.items()))
    wrap = (lambda text: [{"role": "user", "content": text}]) if spec.chat_template else (lambda text: text)
    first = next(iter(llms.values()))
    result.device, result.dtype = str(first.config.device), str(first.config.dtype).removeprefix("torch.")
    result.threads = first.config.threads
    result.draft_weights = next((llm.engine.source.weights for llm in llms.values()
                                 if llm.engine.source and llm.engine.source.weights), None)
    inputs = {name: [wrap(p.text) for p in ps] for name, ps in result.prompt_sets.items()}
    token_ids = {name: [first.encode(x) for x in xs] for name, xs in inputs.items()}
    schema = next((p.schema for ps in result.prompt_sets.values() for p in ps if p.schema), None)
    for llm in llms.values():  # warm-up: first-call allocations and kernel builds out of the timings
        llm.generate([wrap(WARMUP_PROMPT)] * spec.batch_size, spec.params(WARMUP_TOKENS))
        if schema:  # and the constraint library's one-off view of the vocabulary
            llm.generate(wrap(WARMUP_PROMPT), replace(spec.params(WARMUP_TOKENS), json_schema=schema))

    params, labels = spec.params(), list(llms)
    totals = {label: [0, 0.0] for label in labels}  # decode tokens, decode seconds: the running tok/s
    with tqdm(total=sum(map(len, inputs.values())) * len(labels), unit="prompt", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        for name, prompts in result.prompt_sets.items():
            bar.set_description(name)
            for b, (batch, xs) in enumerate(zip(_batches(prompts, spec.batch_size),
                                                _batches(inputs[name], spec.batch_size))):
                for label in labels[b % len(labels):] + labels[:b % len(labels)]:
                    with busy(spec.busy_cores):
                        start = time.perf_counter()
                        outs = llms[label].generate(list(xs), [replace(params, json_schema=p.schema)
                                                               if p.schema else params for p in batch])
                        wall = time.perf_counter() - start
                    for p, o in zip(batch, outs):
                        result.records.append(PromptRecord(name, p.id, label, b, wall, o.token_ids,
                                                           o.metrics.as_dict(), valid=follows(o.text, p.schema),
                                                           finish_reason=o.finish_reason))
                        totals[label][0] += max(0, o.metrics.output_tokens - 1)
                        totals[label][1] += o.metrics.decode_s
                    bar.update(len(outs))
                    bar.set_postfix_str(" | ".join(f"{k} {n / s:.1f}" for k, (n, s) in totals.items() if s)
                                        + " tok/s")
    for llm in llms.values():
        llm.close()
    return token_ids


def follows(text: str, schema: dict | None) -> bool | None:
    """Whether an answer parses as JSON and follows the schema (None: no schema)."""
    if schema is None:
        return None
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _gguf(model: str) -> Path | None:
    """The GGUF file llama.cpp can load for a model: the file itself, or the store's copy."""
    path = gguf_path(model) if model in REGISTRY else Path(model)
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def _run_peer(result: BenchResult, c: RunConfig, prompt_ids: dict[str, list[list[int]]]) -> None:
    spec = result.spec
    if spec.temperature > 0:
        return _skip(result, c.label, "peers decode greedily only; run with --temperature 0")
    # Sets with a JSON schema are left out (the peer would decode them unconstrained; its grammar
    # support is not wired into this bench yet); the peer runs on the others.
    structured = [name for name, ps in result.prompt_sets.items() if any(p.schema for p in ps)]
    reason = "prompts with a JSON schema: the peer would decode them unconstrained (its grammar support is not " \
             "wired into this bench yet)"
    if len(structured) == len(result.prompt_sets):
        return _skip(result, c.label, reason)
    for name in structured:
        _skip(result, f"{c.label} on {name}", reason)
    flat = [(name, p.id, ids) for name, ps in result.prompt_sets.items() if name not in structured
            for p, ids in zip(ps, prompt_ids[name])]
    ids, pids = [x[2] for x in flat], [x[1] for x in flat]
    # The engine's own thread count, exactly: a peer left to its default (llama-cpp-python: half
    # the cores) would be handicapped.
    # k: spec peers only; they have no auto-K, so "auto" gives them SSD's fixed default K.
    common = dict(ignore_eos=spec.ignore_eos, threads=result.threads, num_draft=c.k if isinstance(c.k, int) else SSD_K)
    speculative = c.mode in ("hf-assisted", "llamacpp-spec")
    if c.mode.startswith("hf"):
        draft = resolve_model(spec.draft) if speculative else None
        out = run_hf(resolve_model(spec.model), ids, pids, spec.max_tokens, draft_folder=draft,
                     dtype=getattr(torch, result.dtype), device=result.device, **common)
    elif result.device != "cpu":
        out = PeerSkip(c.mode, f"the llama.cpp peer runs on the CPU only, the engine here on {result.device}")
    elif (gguf := _gguf(spec.model)) is None or (speculative and _gguf(spec.draft) is None):
        missing = spec.model if gguf is None else spec.draft
        out = PeerSkip(c.mode, f"no GGUF file for {missing}: llama.cpp needs a .gguf path or a store name"
                       + (f" whose GGUF is in the store (`ssd pull --force {missing}` fetches it again)"
                          if missing in REGISTRY else ""))
    else:
        out = isolated(c.mode, run_llamacpp, gguf, ids, pids, spec.max_tokens,
                       draft_gguf=_gguf(spec.draft) if speculative else None, **common)
    if isinstance(out, PeerSkip):
        return _skip(result, c.label, out.reason)
    for i, ((name, pid, _), r) in enumerate(zip(flat, out)):
        result.records.append(PromptRecord(name, pid, c.label, i, _e2e(r), r.token_ids, _peer_metrics(r)))


def _e2e(r: PeerResult) -> float:
    return (r.ttft_s or 0.0) + r.decode_s


def _peer_metrics(r: PeerResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "ttft_s": r.ttft_s,
            "decode_s": r.decode_s, "e2e_s": _e2e(r), "tokens_per_second": r.tokens_per_second}
