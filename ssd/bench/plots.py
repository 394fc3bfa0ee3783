"""The benchmark's plots, drawn with matplotlib's Figure API (no pyplot, so no display and
no global backend): tok/s per configuration and set, acceptance by draft position, and
speedup vs the swept value."""
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ssd.bench.report import Row
from ssd.bench.runner import SWEEPS, BenchResult, shown
from ssd.speculative.options import declared


def _title(result: BenchResult) -> str:
    s = result.spec
    return (f"{Path(s.model).name}, draft {Path(s.draft).name if s.draft else '-'}\n{result.device} "
            f"{result.dtype}, temperature {s.temperature:g}, batch {s.batch_size}, max {s.max_tokens} tokens")


def _save(fig: Figure, ax, result: BenchResult, path: Path) -> Path:
    """A one-axes plot's legend and title, written to `path`."""
    fig.legend(fontsize=8, loc="outside right upper")
    ax.set_title(_title(result), fontsize=9)
    fig.savefig(path, dpi=120)
    return path


def plot_tok_s(result: BenchResult, rows: Sequence[Row], path: Path) -> Path:
    """Grouped bars: decode tok/s over all prompts, one group per set, one bar per configuration."""
    sets = list(result.prompt_sets)
    configs = [c.label for c in result.spec.configs if c.label not in result.skipped]
    value = {(r.set, r.config): r for r in rows}
    width = 0.8 / max(1, len(configs))
    bars_total = len(sets) * len(configs)
    fig = Figure(figsize=(min(14.0, max(6.0, 2.0 + bars_total * 0.4)), 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(sets))
    for i, label in enumerate(configs):
        rs = [value[s, label] for s in sets]
        bars = ax.bar(x + (i - (len(configs) - 1) / 2) * width, [r.tok_s_agg or 0 for r in rs], width, label=label)
        ax.bar_label(bars, [f"{r.tok_s_agg:.1f}" + (f"\n{r.speedup:.2f}x" if r.speedup else "")
                            if r.tok_s_agg else "" for r in rs], fontsize=7 if bars_total <= 16 else 5)
    ax.set_xticks(x, sets)
    ax.set_ylabel("decode tok/s (all prompts)")
    ax.margins(y=0.15)
    return _save(fig, ax, result, path)


def _by_position(result: BenchResult, set_name: str, label: str) -> np.ndarray | None:
    """Per draft position i: rounds that accepted draft i / rounds that proposed it."""
    metrics = [r.metrics for r in result.records if r.set == set_name and r.config == label]
    n = max((len(m.get("drafted_by_position") or []) for m in metrics), default=0)
    if not n:
        return None

    def total(key: str) -> np.ndarray:
        return sum(np.pad(np.asarray(m.get(key) or [], float), (0, n - len(m.get(key) or []))) for m in metrics)

    return total("accepted_by_position") / total("drafted_by_position")


def plot_acceptance(result: BenchResult, path: Path) -> Path | None:
    """Acceptance by draft position, one panel per set, one line per speculative configuration."""
    sets = list(result.prompt_sets)
    lines = {(s, c.label): _by_position(result, s, c.label) for s in sets for c in result.spec.configs}
    if all(v is None for v in lines.values()):
        return None
    fig = Figure(figsize=(max(6.5, 3.6 * len(sets)), 3.8), layout="constrained")
    axes = fig.subplots(1, len(sets), sharey=True, squeeze=False)[0]
    for ax, s in zip(axes, sets):
        for c in result.spec.configs:
            if (y := lines[s, c.label]) is not None:
                ax.plot(np.arange(1, len(y) + 1), y, marker="o", label=c.label)
        ax.set_title(s, fontsize=10)
        ax.set_xlabel("draft position")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance at this position\n(rounds accepting / proposing it)")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="outside right center")
    fig.suptitle(_title(result), fontsize=9)
    fig.savefig(path, dpi=120)
    return path


def plot_sweep(result: BenchResult, rows: Sequence[Row], path: Path) -> Path:
    """Speedup vs AR against the swept value: a colour per set, solid for sd, dashed for ssd."""
    key = result.spec.sweep
    name = SWEEPS[key].name
    config = {c.label: c for c in result.spec.configs}
    values = list(dict.fromkeys(c.value(name) for c in result.spec.configs if c.mode in ("sd", "ssd")))
    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for mode, style in (("sd", "-o"), ("ssd", "--s")):
        for i, s in enumerate(result.prompt_sets):
            points = [(values.index(config[r.config].value(name)), r.speedup) for r in rows
                      if r.set == s and r.mode == mode and r.speedup is not None]
            if points:
                ax.plot(*zip(*points), style, color=f"C{i}", label=f"{mode}, {s}")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1, label="AR")
    ax.set_xticks(range(len(values)), [shown(name, v) for v in values])
    ax.set_xlabel(f"{declared(SWEEPS[key]).flag} ({name})")
    ax.set_ylabel("speedup vs AR (decode tok/s)")
    ax.grid(alpha=0.3)
    return _save(fig, ax, result, path)


def write_plots(out: Path, result: BenchResult, rows: Sequence[Row]) -> list[Path]:
    """tok_s.png always; acceptance_by_position.png when a speculative mode ran;
    speedup_vs_k.png / speedup_vs_f.png in a sweep."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_tok_s(result, rows, out / "tok_s.png"), plot_acceptance(result, out / "acceptance_by_position.png")]
    if result.spec.sweep:
        paths.append(plot_sweep(result, rows, out / f"speedup_vs_{result.spec.sweep}.png"))
    return [p for p in paths if p is not None]
