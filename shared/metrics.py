"""Continual-learning metrics: the accuracy matrix, FAA, forgetting, and their plot.

``matrix[i][j]`` is the accuracy (in %) on task j's test set after training task i (j ≤ i);
in a federation, tasks are the classes each step registered. Final average accuracy (FAA) is the
mean of the last row; forgetting averages, over all tasks but the last, the drop from a task's
best earlier accuracy to its final one. A NaN (no test images of a task anywhere) is left out.
"""

from __future__ import annotations

from pathlib import Path

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


def plot_accuracy_matrix(matrix: AccuracyMatrix, path: Path, title: str) -> None:
    """Heat map of the accuracy matrix with the values written in the cells."""
    n = len(matrix)
    grid = np.full((n, n), np.nan)
    for i, row in enumerate(matrix):
        grid[i, : len(row)] = row
    fig = Figure(figsize=(1.0 + 0.75 * n, 0.8 + 0.65 * n))
    ax = fig.subplots()
    image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis")
    for i in range(n):
        for j in range(len(matrix[i])):
            color = "black" if grid[i, j] > 60 else "white"
            ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color=color, fontsize=8)
    ax.set_xticks(range(n), [f"T{j + 1}" for j in range(n)])
    ax.set_yticks(range(n), [f"after T{i + 1}" for i in range(n)])
    ax.set_xlabel("evaluated task")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_accuracy_over_time(matrix: AccuracyMatrix, path: Path, title: str) -> None:
    """One line per task: its accuracy at every step after it was learned."""
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    n = len(matrix)
    for task in range(max(len(row) for row in matrix)):
        steps = [i for i in range(n) if len(matrix[i]) > task]
        ax.plot(
            [s + 1 for s in steps],
            [matrix[s][task] for s in steps],
            marker="o",
            label=f"T{task + 1}",
        )
    ax.plot(range(1, n + 1), [float(np.mean(row)) for row in matrix], "k--", lw=2, label="mean")
    ax.set_xlabel("after step")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_confusion_matrix(
    counts: np.ndarray, names: list[str], path: Path, title: str, max_labels: int = 40
) -> None:
    """Rows: true class, columns: predicted class; colour is the share of the row (so classes
    with few test images read like the others), counts are written in the cells when few."""
    counts = np.asarray(counts)
    n = len(names)
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)
    size = min(2.5 + 0.32 * n, 24.0)
    fig = Figure(figsize=(size + 1.5, size))
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
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="share of the true class's images (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
