"""The run plots read well from 1 to 50 tasks: the title inside the figure and clear of the colour
bar, integer steps, a bounded size, cell values only while they fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from starfed.shared.metrics import (
    LABEL_EVERY_TASK,
    plot_accuracy_matrix,
    plot_accuracy_over_time,
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
