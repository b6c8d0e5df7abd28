"""Continual-learning metrics: the accuracy matrix, FAA, forgetting, and their plot.

``matrix[i][j]`` is the accuracy (in %) on task j's test set after training task i (j ≤ i);
in a federation, tasks are the classes each step registered. Final average accuracy (FAA) is the
mean of the last row; forgetting averages, over all tasks but the last, the drop from a task's
best earlier accuracy to its final one. A NaN (no test images of a task anywhere) is left out.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure  # no pyplot: files only, no display or global state

AccuracyMatrix = list[list[float]]  # row i has i + 1 entries


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not np.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


def nan_to_none(value):
    """Scores, in (nested) lists and dicts, for strict JSON: NaN (no test images) -> None."""
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [nan_to_none(v) for v in value]
    return None if isinstance(value, float) and np.isnan(value) else value


def final_average_accuracy(matrix: AccuracyMatrix) -> float:
    return _nanmean(matrix[-1]) if matrix else float("nan")


def final_forgetting(matrix: AccuracyMatrix) -> float:
    """Mean over tasks j < T−1 of max_{i<T−1} acc[i][j] − acc[T−1][j]; 0 for one task."""
    if len(matrix) < 2:
        return 0.0
    last = matrix[-1]
    drops = []
    for j in range(len(matrix) - 1):
        earlier = [row[j] for row in matrix[j:-1] if not np.isnan(row[j])]
        if earlier and not np.isnan(last[j]):
            drops.append(max(earlier) - last[j])
    return _nanmean(drops)


#: Where the scores are defined, for the lines that print them.
SCORES_DOC = "docs/results.md#the-scores"


def forgetting_text(forgetting: float) -> str:
    """``forgetting 3.21`` for a summary line. A reader takes forgetting for a loss, so a
    negative value says what it means and where it is defined."""
    if forgetting < 0:
        return (
            f"forgetting {forgetting:.2f} (negative: the earlier tasks score better now than "
            f"they did before; {SCORES_DOC})"
        )
    return f"forgetting {forgetting:.2f}"


#: Up to this many tasks the plots label every cell and every task; beyond, a sparser axis.
LABEL_EVERY_TASK = 12
TITLE_CHARS_PER_INCH = 11  # at fontsize 10: a longer title wraps instead of being clipped


def task_ticks(n: int) -> list[int]:
    """Task positions (0-based) to label: all of them for few tasks, about ten otherwise."""
    stride = 1 if n <= LABEL_EVERY_TASK else math.ceil(n / 10)
    return list(range(0, n, stride))


def _title(ax, title: str, width: float) -> None:
    ax.set_title(textwrap.fill(title, int(TITLE_CHARS_PER_INCH * width)), fontsize=10)


def plot_accuracy_matrix(matrix: AccuracyMatrix, path: Path, title: str) -> Figure:
    """Heat map of the accuracy matrix, values written in the cells while they fit.

    The figure grows with the tasks up to a cap, so it reads from 1 to 50 tasks; the
    constrained layout keeps the (wrapped) title clear of the colour bar.
    """
    n = len(matrix)
    grid = np.full((n, n), np.nan)
    for i, row in enumerate(matrix):
        grid[i, : len(row)] = row
    side = min(2.6 + 0.45 * n, 8.0)
    width = side + 1.6
    fig = Figure(figsize=(width, side + 0.9), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis")
    if n <= LABEL_EVERY_TASK:
        for i in range(n):
            for j in range(len(matrix[i])):
                color = "black" if grid[i, j] > 60 else "white"
                ax.text(
                    j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color=color, fontsize=8
                )
    ticks = task_ticks(n)
    ax.set_xticks(ticks, [f"T{j + 1}" for j in ticks])
    ax.set_yticks(ticks, [f"T{i + 1}" for i in ticks])
    ax.set_xlabel("evaluated task")
    ax.set_ylabel("after learning task")
    _title(ax, title, width)
    fig.colorbar(image, ax=ax, label="accuracy (%)", shrink=0.9)
    fig.savefig(path, dpi=120)
    return fig


def plot_accuracy_over_time(matrix: AccuracyMatrix, path: Path, title: str) -> Figure:
    """One line per task (its accuracy at every step after it was learned) and their mean;
    integer steps. Beyond ``LABEL_EVERY_TASK`` tasks only the mean is in the legend."""
    width = 6.5
    fig = Figure(figsize=(width, 4), layout="constrained")
    ax = fig.subplots()
    n = len(matrix)
    n_tasks = max(len(row) for row in matrix)
    few = n_tasks <= LABEL_EVERY_TASK
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, n_tasks))
    for task in range(n_tasks):
        steps = [i for i in range(n) if len(matrix[i]) > task]
        ax.plot(
            [s + 1 for s in steps],
            [matrix[s][task] for s in steps],
            marker="o" if few else None,
            markersize=4,
            lw=1.2 if few else 0.7,
            color=colors[task],
            label=f"T{task + 1}" if few else None,
        )
    ax.plot(range(1, n + 1), [_nanmean(row) for row in matrix], "k--", lw=2, label="mean")
    ax.set_xlabel("after step")
    ax.set_ylabel("accuracy (%)")
    ax.set_xlim(0.5, n + 0.5)
    ax.set_ylim(0, 100)
    ax.set_xticks([t + 1 for t in task_ticks(n)])
    _title(ax, title, width)
    ax.legend(fontsize=7, ncol=2 if few else 1, loc="upper right")
    fig.savefig(path, dpi=120)
    return fig


def plot_confusion_matrix(
    counts: np.ndarray, names: list[str], path: Path, title: str, max_labels: int = 40
) -> Figure:
    """Rows: true class, columns: predicted class; colour is the share of the row (so classes
    with few test images read like the others), counts are written in the cells when few.

    The figure grows with the classes from a floor that leaves the matrix, and so the colour
    bar beside it, taller than the bar's label even under the rotated class names; the
    constrained layout keeps the (wrapped) title and the label inside the figure.
    """
    counts = np.asarray(counts)
    n = len(names)
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)
    size = min(max(5.0, 2.5 + 0.32 * n), 24.0)
    width = size + 1.5
    fig = Figure(figsize=(width, size), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(100 * share, vmin=0, vmax=100, cmap="viridis")
    if n <= 25:
        for i, j in zip(*np.nonzero(counts), strict=True):
            color = "black" if share[i, j] > 0.6 else "white"
            ax.text(j, i, str(counts[i, j]), ha="center", va="center", color=color, fontsize=7)
    if n <= max_labels:
        short = [name if len(name) <= 28 else name[:27] + "…" for name in names]
        ax.set_xticks(range(n), short, rotation=90, fontsize=7)
        ax.set_yticks(range(n), short, fontsize=7)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    # Over the figure, not the matrix: the class names push the matrix off its centre.
    fig.suptitle(textwrap.fill(title, int(TITLE_CHARS_PER_INCH * width)), fontsize=10)
    fig.colorbar(image, ax=ax, label="% of the true class's images")
    fig.savefig(path, dpi=120)
    return fig
