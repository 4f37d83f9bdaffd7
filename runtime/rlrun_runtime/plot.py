"""The PNG plot of a run: mean reward and mismatch KL over trainer steps (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

PLOTTED = (("reward_mean", "mean reward"), ("mismatch_kl", "mismatch KL (trainer vs inference)"))


def get_plot_series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` from metrics.jsonl rows, one point per step (pure).

    A step that appears twice (a resumed run re-logs a step it repeats) keeps its last value; rows
    without ``step`` or with a missing, non-numeric or NaN value are skipped. Sorted by step.
    """
    points: dict[int, float] = {}
    for row in rows:
        step, value = row.get("step"), row.get(key)
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            continue
        points[step] = float(value)
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def render_plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Write a PNG with one panel per series of ``PLOTTED`` to ``path`` (parents created); returns ``path``.

    Raises:
        ValueError: no row has a plottable ``reward_mean`` or ``mismatch_kl``.
    """
    series = [(label, *get_plot_series(rows, key)) for key, label in PLOTTED]
    if not any(steps for _, steps, _ in series):
        raise ValueError("no metrics rows with reward_mean or mismatch_kl to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.6 * len(series)), sharex=True)
    for ax, (label, steps, values) in zip(axes, series):
        ax.plot(steps, values, marker="o", markersize=3, linewidth=1.2)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("trainer step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
