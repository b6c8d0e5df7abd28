"""The run plots read well from 1 to 50 tasks: the title inside the figure and clear of the colour
bar, integer steps, a bounded size, cell values only while they fit. The confusion matrix of
``starfed evaluate --plot`` keeps its title and colour-bar label whole from 1 to 40 classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.transforms import Bbox

from starfed.shared.metrics import (
    LABEL_EVERY_TASK,
    plot_accuracy_matrix,
    plot_accuracy_over_time,
    plot_confusion_matrix,
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
