"""Continual-learning metrics: the accuracy matrix, FAA, forgetting, and their plot.

``matrix[i][j]`` is the accuracy (in %) on task j's test set after training task i (j ≤ i);
in a federation, tasks are the classes each step registered. Final average accuracy (FAA) is the
mean of the last row; forgetting averages, over all tasks but the last, the drop from a task's
best earlier accuracy to its final one. A NaN (no test images of a task anywhere) is left out.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any, BinaryIO, overload

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # no pyplot: files only, no display or global state

AccuracyMatrix = list[list[float]]  # row i has i + 1 entries


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not np.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


@overload
def nan_to_none(value: dict[str, Any]) -> dict[str, object]: ...
@overload
def nan_to_none(value: object) -> object: ...
def nan_to_none(value: object) -> object:
    """Scores, in (nested) lists and dicts, for strict JSON: NaN (no test images) -> None."""
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [nan_to_none(v) for v in value]
    return None if isinstance(value, float) and np.isnan(value) else value


def percentage(part: int, whole: int) -> float:
    """``part`` as a percentage of ``whole``: an accuracy from counts; NaN when there is nothing
    to count (no test image), like every score here."""
    return 100.0 * part / whole if whole else math.nan


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


def faa_text(faa: object) -> str:
    """``FAA 41.67%`` for a summary line; ``FAA n/a`` before any score (no step, no test
    image: NaN or None)."""
    if isinstance(faa, int | float) and not math.isnan(faa):
        return f"FAA {faa:.2f}%"
    return "FAA n/a"


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
#: The plots every federation run writes into its folder (``server/app.py``).
MATRIX_PLOT, OVER_TIME_PLOT = "accuracy_matrix.png", "accuracy_over_time.png"
#: Per-task lines: a qualitative map (neighbours differ in hue), then line styles, so 30 tasks
#: stay told apart; a sequential map makes T4-T6 one shade.
TASK_COLOURS = [matplotlib.colormaps["tab10"](i) for i in range(10)]
TASK_STYLES = ("-", "--", ":")
NAME_CHARS = 28  # a class name on an axis or in a table cell, at most


def results_line(run_dir: Path) -> str:
    """A run's last line: its folder and every result file it wrote there, plots included."""
    names = ("metrics.json", MATRIX_PLOT, OVER_TIME_PLOT, "codebook.bin")
    return f"results: {run_dir} ({', '.join(n for n in names if (run_dir / n).exists())})"


def short_class_name(name: str, limit: int = NAME_CHARS) -> str:
    """``name`` in at most ``limit`` characters, cut in the middle so the end stays: in
    PlantVillage's ``Plant___Disease`` the disease is what tells classes apart, so
    ``Cherry_(including_sour)___Powdery_mildew`` becomes ``Cherry…Powdery_mildew``."""
    if len(name) <= limit:
        return name
    plant, sep, disease = name.partition("___")
    if sep:  # the plant's first word, then as much of the disease's end as fits
        head = plant.replace("(", "_").replace(",", "_").split("_")[0][: limit // 3]
        room = limit - 1 - len(head)
        tail = disease[-room:]
        if len(disease) > room and (cut := re.search(r"[_ -]", tail)):  # from a word's start
            tail = tail[cut.end() :] or tail
        return f"{head}…{tail}"
    kept = (limit - 1) * 2 // 3
    return f"{name[: limit - 1 - kept]}…{name[-kept:]}"


def random_backbones_note(backbones: str, has_weights: bool) -> str | None:
    """What a plot of a run on random backbones must say, so a low accuracy reads as expected
    (None with weight files)."""
    if has_weights:
        return None
    return (
        f"backbones {backbones} with random weights (no --clip-weights/--vit-weights): a check "
        "that the pipeline runs, not a score of the model; low accuracy is expected "
        "(docs/results.md#what-tiny-backbones-can-and-cannot-show)"
    )


def _note(fig: Figure, note: str | None, width: float) -> None:
    """A line under the plot that says how to read it (e.g. random backbones)."""
    if note:
        chars = int(TITLE_CHARS_PER_INCH * 1.2 * width)
        wrapped = textwrap.fill(note, chars, break_on_hyphens=False)
        fig.supxlabel(wrapped, fontsize=8, color="#8a2b06")


def task_ticks(n: int) -> list[int]:
    """Task positions (0-based) to label: all of them for few tasks, about ten otherwise."""
    stride = 1 if n <= LABEL_EVERY_TASK else math.ceil(n / 10)
    return list(range(0, n, stride))


def _title(ax: Axes, title: str, width: float) -> None:
    ax.set_title(textwrap.fill(title, int(TITLE_CHARS_PER_INCH * width)), fontsize=10)


def untested_tasks(matrix: AccuracyMatrix) -> list[int]:
    """Tasks (0-based) no step could score: no site had a test image of their classes."""
    n_tasks = max((len(row) for row in matrix), default=0)
    return [
        task
        for task in range(n_tasks)
        if all(np.isnan(row[task]) for row in matrix if len(row) > task)
    ]


def _with_untested(note: str | None, matrix: AccuracyMatrix) -> str | None:
    """The plot's note, with the tasks drawn empty named: an empty column explained."""
    untested = untested_tasks(matrix)
    if not untested:
        return note
    names = ", ".join(f"T{task + 1}" for task in untested)
    said = f"{names}: no test images (drawn empty)"
    return f"{note}; {said}" if note else said


def plot_accuracy_matrix(
    matrix: AccuracyMatrix, path: Path | BinaryIO, title: str, note: str | None = None
) -> Figure:
    """Heat map of the accuracy matrix, values written in the cells while they fit; ``note``
    under it.

    The figure grows with the tasks up to a cap, so it reads from 1 to 50 tasks; the
    constrained layout keeps the (wrapped) title clear of the colour bar.
    """
    n = len(matrix)
    # a step without scores (its evaluation failed) leaves a row out: rows may outrun n
    columns = max([n, *(len(row) for row in matrix)])
    grid = np.full((n, columns), np.nan)
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
                text = "—" if np.isnan(grid[i, j]) else f"{grid[i, j]:.0f}"
                ax.text(j, i, text, ha="center", va="center", color=color, fontsize=8)
    ticks = task_ticks(n)
    ax.set_xticks(task_ticks(columns), [f"T{j + 1}" for j in task_ticks(columns)])
    ax.set_yticks(ticks, [str(i + 1) for i in ticks])
    ax.set_xlabel("evaluated task (the classes that step brought)")
    ax.set_ylabel("after step")  # the accuracy-over-time plot's x axis: one name
    _title(ax, title, width)
    _note(fig, _with_untested(note, matrix), width)
    fig.colorbar(image, ax=ax, label="accuracy (%)", shrink=0.9)
    fig.savefig(path, dpi=120)
    return fig


def plot_accuracy_over_time(
    matrix: AccuracyMatrix, path: Path | BinaryIO, title: str, note: str | None = None
) -> Figure:
    """One line per task (its accuracy at every step after it was learned) and their mean;
    integer steps; ``note`` under it. Beyond ``LABEL_EVERY_TASK`` tasks only the mean is in
    the legend."""
    width = 6.5
    fig = Figure(figsize=(width, 4), layout="constrained")
    ax = fig.subplots()
    n = len(matrix)
    n_tasks = max(len(row) for row in matrix)
    few = n_tasks <= LABEL_EVERY_TASK
    untested = untested_tasks(matrix)
    for task in range(n_tasks):
        steps = [i for i in range(n) if len(matrix[i]) > task]
        ax.plot(
            [s + 1 for s in steps],
            [matrix[s][task] for s in steps],
            marker="o" if few else None,
            markersize=4,
            lw=1.2 if few else 0.9,
            color=TASK_COLOURS[task % len(TASK_COLOURS)],
            linestyle=TASK_STYLES[task // len(TASK_COLOURS) % len(TASK_STYLES)],
            label=(f"T{task + 1}" + (" (no test images)" if task in untested else ""))
            if few
            else None,
        )
    ax.plot(range(1, n + 1), [_nanmean(row) for row in matrix], "k--", lw=2, label="mean")
    ax.set_xlabel("after step")
    ax.set_ylabel("accuracy (%)")
    ax.set_xlim(0.5, n + 0.5)
    ax.set_ylim(-3, 103)  # a point at 0 % or 100 % drawn whole
    ax.set_yticks(range(0, 101, 20))
    ax.set_xticks([t + 1 for t in task_ticks(n)])
    _title(ax, title, width)
    _note(fig, _with_untested(note, matrix), width)
    # beside the axes, where it hides no line
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path, dpi=120)
    return fig


def plot_confusion_matrix(
    counts: np.ndarray, names: list[str], path: Path, title: str, max_labels: int = 40
) -> Figure:
    """Rows: true class (with its image count), columns: predicted class; colour and the
    number in a cell are both the share of the row in % (so classes with few test images read
    like the others), written in the cells when few; long names cut in the middle
    (:func:`short_class_name`).

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
            text = f"{100 * share[i, j]:.0f}"
            ax.text(j, i, text, ha="center", va="center", color=color, fontsize=7)
    if n <= max_labels:
        short = [short_class_name(name) for name in names]
        ax.set_xticks(range(n), short, rotation=90, fontsize=7)
        rows = [f"{name} ({int(total)})" for name, total in zip(short, totals[:, 0], strict=True)]
        ax.set_yticks(range(n), rows, fontsize=7)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class (its images)")
    # Over the figure, not the matrix: the class names push the matrix off its centre.
    fig.suptitle(textwrap.fill(title, int(TITLE_CHARS_PER_INCH * width)), fontsize=10)
    fig.colorbar(image, ax=ax, label="% of the true class's images (the numbers in the cells)")
    fig.savefig(path, dpi=120)
    return fig
