"""Charts for the benchmark scripts (`--plot-dir DIR`; `make bench` writes them to docs/figures/).

Each chart carries a footnote with the command that produced it, so a committed PNG always says
where its numbers come from. Engines that were not run (a peer whose venv is absent) are simply
not in the chart. matplotlib comes with the test extra (`make install`); without it the scripts
print their tables and skip the charts.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: the load when the benchmark started (this module is imported at the top of the scripts)
START_LOAD = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
#: one colour per engine, the same in every chart
COLORS = {"prefixkv": "#1f77b4", "vLLM-CPU": "#ff7f0e", "llama.cpp": "#2ca02c"}


@dataclass
class Panel:
    """One bar chart: a group of bars per category, one bar per series (engine)."""

    ylabel: str
    categories: list[str]
    series: dict[str, list[float | None]] = field(default_factory=dict)
    fmt: str = "{:.3g}"


def command_line() -> str:
    """The command that is running, as a user would type it from the repo root."""
    args = [os.path.relpath(sys.argv[0])] + sys.argv[1:]
    return ".venv/bin/python " + shlex.join(args)


def footnote(extra: str = "") -> str:
    now = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = (
        f"{command_line()}  ({os.cpu_count()} CPUs; 1-minute load average {START_LOAD:.1f} at the start, "
        f"{now:.1f} at the end)"
    )
    return f"{text}\n{extra}" if extra else text


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed: no chart; it comes with `pip install -e '.[test]'`)")
        return None
    return plt


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  chart: {path}")
    return path


def bar_chart(path: str | Path, title: str, panels: list[Panel], note: str = "") -> Path | None:
    """Grouped bars, one panel per Panel side by side, each bar labelled with its value."""
    plt = _pyplot()
    if plt is None:
        return None
    widths = [max(1.5, len(p.categories)) for p in panels]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(2.6 * sum(widths) + 1, 4.2), squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for ax, panel in zip(axes[0], panels):
        names = [n for n, vals in panel.series.items() if any(v is not None for v in vals)]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            for j, value in enumerate(panel.series[name]):
                if value is None:
                    continue
                x = j - 0.4 + width * (i + 0.5)
                bar = ax.bar(x, value, width, color=COLORS.get(name), label=name if j == 0 else None)
                ax.bar_label(bar, [panel.fmt.format(value)], fontsize=8)
        ax.set_xticks(range(len(panel.categories)), panel.categories, fontsize=9)
        ax.set_ylabel(panel.ylabel)
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.text(0.01, 0.01, footnote(note), fontsize=7, color="#555555", va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, plt, Path(path))


def line_chart(
    path: str | Path,
    title: str,
    x: list[float],
    series: dict[str, list[float]],
    xlabel: str,
    ylabel: str,
    note: str = "",
    percent: bool = False,
) -> Path | None:
    """One line per series over x (e.g. hit rate per policy over cache sizes), log-scaled x."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for name, ys in series.items():
        style = {
            "optimum": {"linestyle": "--", "color": "black", "marker": "o"},
            "infinite cache": {"linestyle": ":", "color": "gray"},
        }.get(name, {"marker": "o"})
        ax.plot(x, [y * 100 if percent else y for y in ys], label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v:,}" for v in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.text(0.01, 0.01, footnote(note), fontsize=7, color="#555555", va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, plt, Path(path))
