"""The run plots read well from 1 to 50 tasks: the title inside the figure and clear of the colour
bar, integer steps, a bounded size, cell values only while they fit. The confusion matrix of
``starfed evaluate --plot`` keeps its title and colour-bar label whole from 1 to 40 classes."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.transforms import Bbox

from starfed.shared.metrics import (
    LABEL_EVERY_TASK,
    MATRIX_PLOT,
    NAME_CHARS,
    OVER_TIME_PLOT,
    plot_accuracy_matrix,
    plot_accuracy_over_time,
    plot_confusion_matrix,
    random_backbones_note,
    results_line,
    short_class_name,
    untested_tasks,
)

TITLE = "STAR-Prompt, tiny backbones, seed 1993: FAA 17.3% (a title of a usual length)"


def matrix(n: int) -> list[list[float]]:
    rng = np.random.default_rng(n)
    return [list(rng.uniform(0, 100, i + 1)) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_accuracy_matrix_title_is_whole_and_clear_of_the_colour_bar(n: int, tmp_path: Path):
    fig = plot_accuracy_matrix(matrix(n), tmp_path / "m.png", TITLE)
    renderer = fig._get_renderer()  # the layout as saved (savefig drew it)
    ax, colorbar = fig.axes
    title = ax.title.get_window_extent(renderer)
    figure = fig.bbox
    assert figure.x0 <= title.x0 and title.x1 <= figure.x1 and title.y1 <= figure.y1
    assert not title.overlaps(colorbar.get_window_extent(renderer))
    width, height = fig.get_size_inches()
    assert width <= 10 and height <= 10
    assert (len(ax.texts) > 0) == (n <= LABEL_EVERY_TASK)
    assert len(ax.get_xticks()) <= max(n, 10)
    assert (tmp_path / "m.png").stat().st_size > 0


def test_a_step_without_scores_leaves_the_matrix_a_column_wider(tmp_path: Path) -> None:
    """A step whose evaluation gave no scores has no row: the next row is longer than the
    matrix is tall (bench/big_step.py's synthetic first step); every score is still drawn."""
    fig = plot_accuracy_matrix([[50.0, 60.0]], tmp_path / "m.png", TITLE)
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (1, 2)
    assert [t.get_text() for t in ax.texts] == ["50", "60"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["T1", "T2"]


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_accuracy_over_time_has_integer_steps(n: int, tmp_path: Path) -> None:
    fig = plot_accuracy_over_time(matrix(n), tmp_path / "t.png", TITLE)
    fig.canvas.draw()
    ax = fig.axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert min(ticks) >= 1 and max(ticks) <= n
    labels = ax.get_legend_handles_labels()[1]
    assert "mean" in labels and len(labels) == (n + 1 if n <= LABEL_EVERY_TASK else 1)


def _inside(box: Bbox, figure: Bbox) -> bool:
    return (
        figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 and box.y1 <= figure.y1
    )


@pytest.mark.parametrize("n", [1, 2, 8, 40])
def test_confusion_matrix_title_and_colour_bar_label_are_inside_the_figure(
    n: int, tmp_path: Path
) -> None:
    names = [f"Crop_{i}___Cercospora_leaf_spot Gray_leaf_spot" for i in range(n)]  # cut at 28
    counts = np.random.default_rng(n).integers(0, 9, (n, n))
    fig = plot_confusion_matrix(counts, names, tmp_path / "c.png", TITLE)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # the layout at the figure's own dpi, the one fig.bbox is in
    renderer = canvas.get_renderer()
    _, colorbar = fig.axes
    label = colorbar.yaxis.label.get_window_extent(renderer)
    title = fig._suptitle.get_window_extent(renderer)
    assert colorbar.get_ylabel() and _inside(label, fig.bbox), (label, fig.bbox)
    assert " ".join(fig.get_suptitle().split()) == TITLE  # wrapped, never cut
    assert _inside(title, fig.bbox), (title, fig.bbox)
    assert not label.overlaps(title)
    assert (tmp_path / "c.png").stat().st_size > 0


@pytest.mark.parametrize("n", [7, 28])
def test_per_task_lines_are_told_apart(n: int, tmp_path: Path) -> None:
    """A qualitative colour map, then line styles: no two task lines look alike."""
    fig = plot_accuracy_over_time(matrix(n), tmp_path / "t.png", TITLE)
    lines = fig.axes[0].get_lines()[:n]  # the tasks' lines; the mean comes last
    looks = {(to_hex(line.get_color()), line.get_linestyle()) for line in lines}
    assert len(looks) == n
    neighbours = [to_hex(a.get_color()) != to_hex(b.get_color()) for a, b in pairwise(lines)]
    assert all(neighbours)  # T4, T5, T6 are three colours, not three shades of one


def test_the_step_axis_has_one_name_and_random_backbones_say_so(tmp_path: Path) -> None:
    note = random_backbones_note("tiny", has_weights=False)
    assert note and "random weights" in note and random_backbones_note("paper", True) is None
    grid = plot_accuracy_matrix(matrix(7), tmp_path / "m.png", TITLE, note)
    lines = plot_accuracy_over_time(matrix(7), tmp_path / "t.png", TITLE, note)
    assert grid.axes[0].get_ylabel() == lines.axes[0].get_xlabel() == "after step"
    for fig in (grid, lines):
        shown = " ".join(fig._supxlabel.get_text().split())
        assert shown == note  # wrapped, never cut, under the plot
        renderer = fig._get_renderer()
        assert _inside(fig._supxlabel.get_window_extent(renderer), fig.bbox)


def test_confusion_cells_show_what_the_colour_bar_says(tmp_path: Path) -> None:
    counts = np.array([[3, 1], [0, 4]])
    names = ["Cherry_(including_sour)___Powdery_mildew", "Apple___healthy"]
    fig = plot_confusion_matrix(counts, names, tmp_path / "c.png", TITLE)
    ax, colorbar = fig.axes
    assert sorted(t.get_text() for t in ax.texts) == ["100", "25", "75"]  # % of the row
    assert "% of the true class's images" in colorbar.get_ylabel()
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["Cherry…Powdery_mildew (4)", "Apple___healthy (4)"]


def test_long_class_names_are_cut_in_the_middle_keeping_the_disease() -> None:
    assert short_class_name("Cherry_(including_sour)___Powdery_mildew") == "Cherry…Powdery_mildew"
    assert short_class_name("Tomato___Spider_mites Two-spotted_spider_mite") == (
        "Tomato…spotted_spider_mite"
    )
    assert short_class_name("Apple___healthy") == "Apple___healthy"
    cut = short_class_name("x" * 60)
    assert len(cut) == NAME_CHARS and "…" in cut[1:-1]
    for name in ("Corn_(maize)___Cercospora_leaf_spot Gray_leaf_spot", "a" * 29):
        assert len(short_class_name(name)) <= NAME_CHARS


def test_a_runs_last_line_lists_every_plot_it_wrote(tmp_path: Path) -> None:
    for name in ("metrics.json", MATRIX_PLOT, OVER_TIME_PLOT, "codebook.bin"):
        (tmp_path / name).write_bytes(b"")
    assert results_line(tmp_path) == (
        f"results: {tmp_path} (metrics.json, accuracy_matrix.png, accuracy_over_time.png, "
        "codebook.bin)"
    )


def test_a_task_without_test_images_is_said_not_drawn_as_nan(tmp_path: Path) -> None:
    """Issue 47: an empty column and a legend entry with no note, and `nan` in the step line."""
    from starfed.server.records import StepScores
    from starfed.server.step_records import scores_line

    nan = float("nan")
    scores = [[40.0], [30.0, nan], [20.0, nan, 50.0]]
    assert untested_tasks(scores) == [1]
    grid = plot_accuracy_matrix(scores, tmp_path / "m.png", TITLE, "random weights")
    lines = plot_accuracy_over_time(scores, tmp_path / "t.png", TITLE)
    assert "nan" not in {t.get_text() for t in grid.axes[0].texts}
    assert " ".join(grid._supxlabel.get_text().split()) == (
        "random weights; T2: no test images (drawn empty)"
    )
    assert "T2 (no test images)" in [t.get_text() for t in lines.axes[0].get_legend().texts]
    line = scores_line(2, 12, StepScores(scores[-1], scores[-1], 35.0))
    assert line == (
        "step 3: 12 classes · federation accuracy 35.0% by arrival step: 20 — 50"
        "  (—: no test images)"
    )
