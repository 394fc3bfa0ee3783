"""The benchmark's summary table (text and markdown) and results.json: every per-prompt
record, the summary rows, the machine and the full configuration."""
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path

import torch

from ssd.bench.prompts import PROMPT_SETS
from ssd.bench.runner import ENGINE_MODES, BenchResult, PromptRecord, RunConfig
from ssd.errors import SSDError

SCHEMA = "ssd-bench/1"
OUT_FILES = ("results.json", "table.md", "*.png")  # what write_report and write_plots put in --out


@dataclass
class Row:
    """One (prompt set, configuration) line of the table; None where a figure does not apply."""

    set: str
    config: str  # RunConfig.label
    mode: str
    prompts: int = 0
    threads: int = 0  # CPU threads of this row's engine (the same for every row of a run)
    tok_s: float | None = None  # decode tok/s, mean over prompts
    tok_s_agg: float | None = None  # all decode tokens / all decode seconds
    e2e_tok_s: float | None = None  # all output tokens / wall time of the generate() calls, prefill included
    ttft_s: float | None = None  # mean time to first token
    acceptance: float | None = None  # accepted / drafted, over all prompts
    accepted_len: float | None = None  # 1 + accepted / rounds: tokens per target pass
    mean_k: float | None = None  # draft tokens asked for per round (auto-K's mean choice)
    k0_share: float | None = None  # rounds at K = 0 (plain decoding chosen by auto-K) / all rounds
    lookup_share: float | None = None  # SD with prompt lookup beside the draft: lookup rounds / all rounds
    hit_rate: float | None = None  # SSD: rounds whose speculation was in the cache / all rounds
    tokens_per_hit: float | None = None  # SSD: tokens gained per round on a hit
    tokens_per_miss: float | None = None  # SSD: tokens gained per round on a miss
    speedup: float | None = None  # tok_s_agg / AR's tok_s_agg, same set, same run
    same_as_ar: str = "n.a."  # "yes" | "no (d/n)": d of n prompts differ | "ref" | "n.a."
    valid: str = "-"  # finished answers that parse and follow their schema, "v/n (c cut)" ("-": no schema)
    skipped: str | None = None  # why the configuration did not run


def _identity(c: RunConfig, records: list[PromptRecord]) -> str:
    if c.mode == "ar":
        return "ref"
    checked = [r.same_as_ar for r in records if r.same_as_ar is not None]
    if not checked:
        return "n.a."
    differ = checked.count(False)
    return f"no ({differ}/{len(checked)})" if differ else "yes"


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _k_hist(metrics: list[dict]) -> list[int]:
    hists = [x.get("k_hist") or [] for x in metrics]
    return [sum(h[k] for h in hists if k < len(h)) for k in range(max(map(len, hists), default=0))]


def _row(name: str, c: RunConfig, records: list[PromptRecord], threads: int) -> Row:
    m = [r.metrics for r in records]

    def total(key: str) -> float:
        return sum(x.get(key) or 0 for x in m)

    walls = {r.batch: r.batch_wall_s for r in records}  # one wall time per generate() call
    rounds, accepted, hits, misses = total("rounds"), total("accepted"), total("hits"), total("misses")
    k_hist = _k_hist(m)
    return Row(
        name, c.label, c.mode, len(records), threads,
        tok_s=total("tokens_per_second") / len(m),
        tok_s_agg=_ratio(sum(max(0, x["output_tokens"] - 1) for x in m), total("decode_s")),
        e2e_tok_s=_ratio(total("output_tokens"), sum(walls.values())),
        ttft_s=total("ttft_s") / len(m),
        acceptance=_ratio(accepted, total("drafted")),
        accepted_len=1 + accepted / rounds if rounds else None,
        mean_k=_ratio(sum(k * n for k, n in enumerate(k_hist)), sum(k_hist)),
        k0_share=_ratio(k_hist[0], sum(k_hist)) if k_hist else None,
        lookup_share=_ratio(total("lookup_rounds"), rounds) if total("lookup_rounds") else None,
        hit_rate=_ratio(hits, hits + misses),
        tokens_per_hit=_ratio(total("tokens_on_hit"), hits),
        tokens_per_miss=_ratio(total("tokens_on_miss"), misses),
        same_as_ar=_identity(c, records), valid=_valid(records))


def _valid(records: list[PromptRecord]) -> str:
    """Answers under a schema that ended by themselves and validate / those that ended by
    themselves; answers cut by max_tokens are counted apart (a cut answer is unfinished JSON)."""
    schema = [r for r in records if r.valid is not None]
    ended = [r.valid for r in schema if r.finish_reason != "length"]
    cut = len(schema) - len(ended)
    return f"{sum(ended)}/{len(ended)}" + (f" ({cut} cut)" if cut else "") if schema else "-"


def summarise(result: BenchResult) -> list[Row]:
    """One row per prompt set and configuration, in the order of spec.configs."""
    rows = []
    for name in result.prompt_sets:
        set_rows = []
        for c in result.spec.configs:
            records = [r for r in result.records if r.set == name and r.config == c.label]
            skipped = result.skipped.get(c.label, result.skipped.get(f"{c.label} on {name}"))
            set_rows.append(Row(name, c.label, c.mode, skipped=skipped) if skipped is not None
                            else _row(name, c, records, result.threads))
        ar = next((r for r in set_rows if r.config == "ar" and r.tok_s_agg), None)
        for r in set_rows:
            if ar and r.tok_s_agg is not None:
                r.speedup = r.tok_s_agg / ar.tok_s_agg
        rows += set_rows
    return rows


COLUMNS = ("set", "config", "n", "thr", "tok/s", "tok/s all", "e2e tok/s", "TTFT s", "accept", "acc len", "K",
           "K=0", "lookup", "hit", "speedup", "=AR", "JSON ok")


def _cells(r: Row) -> list[str]:
    if r.skipped is not None:
        return [r.set, r.config, "0", "-", "skipped", *["-"] * (len(COLUMNS) - 5)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return [r.set, r.config, str(r.prompts), str(r.threads or "-"), fmt(r.tok_s, ".1f"), fmt(r.tok_s_agg, ".1f"),
            fmt(r.e2e_tok_s, ".1f"), fmt(r.ttft_s, ".3f"), fmt(r.acceptance, ".0%"), fmt(r.accepted_len, ".2f"),
            fmt(r.mean_k, ".1f"), fmt(r.k0_share, ".0%"), fmt(r.lookup_share, ".0%"), fmt(r.hit_rate, ".0%"),
            "-" if r.speedup is None else f"{r.speedup:.2f}x", r.same_as_ar, r.valid]


def _draft_weights(result: BenchResult) -> str:
    asked = result.spec.draft_quantization
    if result.draft_weights is None:  # no draft model ran (or an old result)
        return asked or "as the target"
    return result.draft_weights if asked in (None, result.draft_weights) else f"{result.draft_weights}, from {asked}"


def _notes(result: BenchResult, rows: Sequence[Row]) -> list[str]:
    spec, machine = result.spec, machine_info()
    gpu = f", {machine['gpu']}" if machine["gpu"] else ""
    commit = (machine["git_commit"] or "unknown")[:12] + " (modified)" * bool(machine["git_dirty"])
    notes = [f"{datetime.now():%Y-%m-%d %H:%M}; {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']} GiB"
             f"{gpu}; commit {commit}",
             f"model {spec.model}, draft {spec.draft or '-'} (weights: {_draft_weights(result)}); "
             f"{result.device} {result.dtype}; "
             f"temperature {spec.temperature:g}; max {spec.max_tokens} tokens{' (ignore eos)' * spec.ignore_eos}; "
             f"batch {spec.batch_size}; chat template {'on' if spec.chat_template else 'off'}"
             + (f"; {spec.busy_cores} busy cores beside each row (thr: the most threads)" if spec.busy_cores else ""),
             "tok/s: decode speed (tokens after the first / time after the first), mean over prompts; "
             "tok/s all: the same over all prompts together",
             "e2e tok/s: all tokens / generate() wall time, prefill included; TTFT: mean time to first token",
             "accept: accepted / drafted; acc len: tokens per target pass; hit: SSD cache hit rate",
             "speedup: tok/s all vs AR in the same run; =AR: token-identical to AR on every prompt"]
    if spec.temperature > 0 and spec.request_seed is None:
        notes.append("=AR is n.a. at temperature > 0 without --seed: sampled outputs differ by design")
    elif spec.temperature > 0:
        notes.append(f"every request carries seed {spec.request_seed}: seeded sampling draws by shared noise, so "
                     "=AR holds for sampled outputs too (peers: n.a.)")
    if any(c.is_peer for c in spec.configs) and spec.batch_size > 1:
        notes.append("peers run one prompt at a time")
    if any(r.mode.startswith("llamacpp") and not r.skipped for r in rows):
        notes.append("llamacpp decodes the GGUF with its own kernels, which round differently from the engine's "
                     "(and hf's fp32), so its tokens may differ from AR")
    notes += [f"skipped {label}: {reason}" for label, reason in result.skipped.items()]
    notes += [f"WARNING: {r.config} on {r.set} is not token-identical to AR at temperature 0"
              for r in rows if r.same_as_ar.startswith("no") and r.mode in ENGINE_MODES]
    return notes


def format_table(result: BenchResult, rows: Sequence[Row], markdown: bool = False) -> str:
    """The table with its notes below: aligned plain text, or markdown."""
    cells = [_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines + [""] + [f"- {n}" for n in _notes(result, rows)]) + "\n"
    widths = [max(len(x) for x in col) for col in zip(COLUMNS, *cells)]
    line = lambda xs: "  ".join(x.ljust(w) if i < 2 else x.rjust(w)  # noqa: E731
                                for i, (x, w) in enumerate(zip(xs, widths))).rstrip()
    lines = [line(COLUMNS), "  ".join("-" * w for w in widths)]
    for i, (r, c) in enumerate(zip(rows, cells)):
        if i and r.set != rows[i - 1].set:
            lines.append("")
        lines.append(line(c))
    return "\n".join(lines + [""] + _notes(result, rows)) + "\n"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(Path(__file__).parent), *args], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine_info() -> dict:
    commit = _git("rev-parse", "HEAD")
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("ssd-engine", "torch", "transformers", "llama-cpp-python")},
        "git_commit": commit,
        "git_dirty": bool(_git("status", "--porcelain")) if commit else None,
        "torch_threads": torch.get_num_threads(),
    }


def results_dict(result: BenchResult, rows: Sequence[Row], cli_args: dict | None = None) -> dict:
    return {
        "schema": SCHEMA,
        "created": datetime.now().astimezone().isoformat(timespec="seconds"),
        "cli_args": cli_args,  # the `ssd bench` options, defaults included, when run from the command line
        "machine": machine_info(),
        "config": {**asdict(result.spec), "device_resolved": result.device, "dtype_resolved": result.dtype,
                   "draft_weights_resolved": result.draft_weights,
                   "configs": [{"label": c.label, **asdict(c)} for c in result.spec.configs]},
        "prompt_sets": {name: {"selection": PROMPT_SETS[name].selection if name in PROMPT_SETS else "file order",
                               "prompt_ids": [p.id for p in ps]} for name, ps in result.prompt_sets.items()},
        "summary": [asdict(r) for r in rows],
        "skipped": result.skipped,
        "records": [asdict(r) for r in result.records],
    }


def write_report(out: Path, result: BenchResult, rows: Sequence[Row], cli_args: dict | None = None) -> list[Path]:
    """results.json and table.md in `out` (created if needed)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results_dict(result, rows, cli_args), indent=1) + "\n")
    (out / "table.md").write_text(format_table(result, rows, markdown=True))
    return [out / "results.json", out / "table.md"]


def earlier_results(out: Path) -> list[Path]:
    """The files of an earlier run in `out`."""
    return sorted(p for pattern in OUT_FILES for p in out.glob(pattern)) if out.is_dir() else []


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is a file, or that holds an earlier run's results (unless overwrite):
    old plots next to new results would be taken for this run's."""
    if out.exists() and not out.is_dir():
        raise SSDError(f"--out {out} is a file; give a folder")
    found = earlier_results(out)
    if found and not overwrite:
        raise SSDError(f"--out {out} already holds an earlier run's results ({', '.join(p.name for p in found)}); "
                       "choose another folder, or pass --overwrite to replace them")
