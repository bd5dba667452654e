"""Charts drawn with matplotlib: the benchmark's step time and memory per system, and the loss
curve of ``shardwise train``. matplotlib is an optional dependency (``pip install
"shardwise[tools]"``); ``available()`` says whether it is installed, and callers skip the
chart with a note when it is not. Only the object-oriented API is used (``Figure``, no
pyplot), so nothing global changes and no display is needed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

COLORS = {"shardwise": "#1f77b4", "fsdp2": "#ff7f0e", "ddp": "#2ca02c", "floor": "#7f7f7f"}
INSTALL = 'pip install "shardwise[tools]"'


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def bench_chart(summary: dict, path: Path) -> None:
    """Two panels of horizontal bars, one bar per system coloured by library: median step
    time with its p25-p75 range, and peak memory per rank."""
    from matplotlib.figure import Figure

    rows = summary["systems"]
    names = list(rows)[::-1]  # the first system on top
    colors = [COLORS[n.partition("/")[0]] for n in names]
    fig = Figure(figsize=(9, 1.2 + 0.45 * len(names)), layout="constrained")
    time_ax, mem_ax = fig.subplots(1, 2, sharey=True)
    med = [rows[n]["median_ms"] for n in names]
    spread = [[m - rows[n]["p25_ms"] for n, m in zip(names, med)],
              [rows[n]["p75_ms"] - m for n, m in zip(names, med)]]
    bars = time_ax.barh(names, med, xerr=spread, color=colors, capsize=3)
    time_ax.bar_label(bars, fmt="%.0f", padding=4)  # placed past the p75 whisker
    time_ax.set_xlabel("median step time (ms), p25-p75")
    mem = [rows[n]["peak_bytes"] / 2**20 for n in names]
    mem_ax.bar_label(mem_ax.barh(names, mem, color=colors), fmt="%.1f", padding=4)
    mem_ax.set_xlabel("peak memory per rank (MiB)")
    for ax in (time_ax, mem_ax):
        ax.margins(x=0.18)
        ax.spines[["top", "right"]].set_visible(False)
    c = summary["config"]
    fig.suptitle(
        f"{c['model']} model, {summary['world_size']} ranks, "
        f"{summary['machine'].split(',')[-1].strip()}, {summary['date']}"
    )
    fig.savefig(path, dpi=120)


def loss_curve(steps: list[int], losses: list[float], path: Path, title: str) -> None:
    """The training loss (mean over ranks) against the optimizer step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(steps, losses, marker=".", color=COLORS["shardwise"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
