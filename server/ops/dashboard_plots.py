"""The dashboard's images: what a person would rather look at than read.

Each :class:`Plot` takes its data from the page's :class:`~.dashboard_state.State` and draws it
as a PNG with matplotlib (``Figure`` without pyplot renders with Agg; nothing here imports
torch); the accuracy plots are the very ones ``train-local`` and the simulations write
(``starfed.shared.metrics``). An image's address carries :func:`digest` of its data, so it is
drawn again, and fetched again by the browser, only when what it shows changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, BinaryIO

from matplotlib import dates
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from starfed.server.ops import status
from starfed.server.ops.dashboard_state import RUNNING, State
from starfed.shared.metrics import (
    TASK_COLOURS,
    AccuracyMatrix,
    nan_to_none,
    plot_accuracy_matrix,
    plot_accuracy_over_time,
    task_ticks,
)
from starfed.shared.run_status import COMPLETED, DEGRADED, FAILED

#: A status word -> its colour (badges and the timeline); anything else is drawn grey.
COLOURS = {
    COMPLETED: "#2e7d32",
    DEGRADED: "#ef6c00",
    FAILED: "#c62828",
    RUNNING: "#1565c0",
    "online": "#2e7d32",
    "offline": "#c62828",
    status.FAILING: "#c62828",  # its last exchanges failed (server/ops/status.py)
    "registered": "#6d6d6d",
    "unregistered": "#6d6d6d",
    "capped": "#ef6c00",  # screening findings (server/screening.py)
    "rejected": "#c62828",
    "quarantined": "#c62828",
}
GREY = "#9e9e9e"


@dataclass(frozen=True)
class Plot:
    """One image: the data it draws (JSON; its digest names the image) and how it draws it."""

    title: str
    data: Callable[[State], Any]  # falsy: nothing to draw yet
    draw: Callable[[Any, BinaryIO], object]


def step_label(step: int, attempt: int) -> str:
    """Step ``step`` (0-based) as a person counts it, with its attempt after a retry: ``6``,
    then ``6 (try 2)``."""
    return f"{step + 1}" + (f" (try {attempt + 1})" if attempt else "")


def _timeline_data(state: State) -> list[tuple[str, str, float, float]]:
    bars = [(step_label(d.step, d.attempt), d.status, d.started_s, d.wall_s) for d in state.steps]
    run = state.running
    if run is not None and run.started_s is not None and run.wall_s is not None:
        bars.append((step_label(run.step, 0), RUNNING, run.started_s, run.wall_s))
    return bars


def _clock_axis(ax: Axes, first: float, last: float) -> None:
    """UTC clock times from ``first`` to ``last`` (seconds) on the x axis, the date in its
    label; a span under a minute is widened to one, so no tick reads as a fraction."""
    pad = max(60.0 - (last - first), 0.0) / 2 + 0.02 * (last - first)
    ends = [dates.date2num(datetime.fromtimestamp(t, UTC)) for t in (first - pad, last + pad)]
    ax.set_xlim(*ends)
    ax.xaxis.set_major_locator(dates.AutoDateLocator(minticks=3, maxticks=6, tz=UTC))
    days = sorted({datetime.fromtimestamp(t, UTC).date() for t in (first, last)})
    clock = "%H:%M:%S" if len(days) == 1 else "%d %b %H:%M"
    ax.xaxis.set_major_formatter(dates.DateFormatter(clock, tz=UTC))
    ax.set_xlabel("UTC, " + " to ".join(f"{day:%Y-%m-%d}" for day in days))


def _draw_timeline(bars: list[tuple[str, str, float, float]], out: BinaryIO) -> None:
    """Clock times on the axis (the date in its label), never fractions of a second: a span
    shorter than a minute is widened to one."""
    fig = Figure(figsize=(6.5, 1.6 + 0.3 * len(bars)), layout="constrained")
    ax = fig.subplots()
    for row, (_, state, start, wall) in enumerate(bars):
        left = dates.date2num(datetime.fromtimestamp(start, UTC))
        ax.barh(row, max(wall, 1.0) / 86400, left=left, color=COLOURS.get(state, GREY))
    ax.set_yticks(range(len(bars)), [label for label, *_ in bars])
    ax.invert_yaxis()
    ax.set_ylabel("step")
    first = min(start for *_, start, _ in bars)
    _clock_axis(ax, first, max(start + max(wall, 1.0) for *_, start, wall in bars))
    shown = dict.fromkeys(state for _, state, *_ in bars)
    ax.legend(
        handles=[Patch(color=COLOURS.get(s, GREY), label=s) for s in shown],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        frameon=False,
    )
    fig.savefig(out, format="png", dpi=110)


def _bytes_data(state: State) -> list[tuple[str, int, int]]:
    return [(step_label(d.step, d.attempt), d.bytes_down, d.bytes_up) for d in state.steps]


def _draw_bytes(rows: list[tuple[str, int, int]], out: BinaryIO) -> None:
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] / 2**20 for r in rows], 0.4, label="to the sites")
    ax.bar([i + 0.2 for i in x], [r[2] / 2**20 for r in rows], 0.4, label="from the sites")
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("MiB on the wire")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # no bar hid
    fig.savefig(out, format="png", dpi=110)


def _sites_data(state: State) -> dict[str, dict[int, float]]:
    return state.site_accuracy


def _draw_sites(series: dict[str, dict[int, float]], out: BinaryIO) -> None:
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    for i, (site, by_step) in enumerate(series.items()):
        steps = sorted(by_step, key=int)
        ax.plot(
            [int(s) + 1 for s in steps],
            [by_step[s] for s in steps],
            marker="o",
            color=TASK_COLOURS[i % len(TASK_COLOURS)],
            label=site,
        )
    ax.set_xlabel("after step")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    shown = sorted({int(s) + 1 for by_step in series.values() for s in by_step})
    ax.set_xlim(shown[0] - 0.5, shown[-1] + 0.5)
    ax.set_xticks([t + 1 for t in task_ticks(shown[-1])])
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # no point hid
    fig.savefig(out, format="png", dpi=110)


def _matrix_data(state: State) -> AccuracyMatrix:
    return state.accuracy_matrix


#: Under the accuracy plots: the dashboard cannot tell random backbones from trained ones (the
#: folder keeps only their fingerprint), so it says how to read a low score either way.
ACCURACY_NOTE = (
    "the sites' own test images; with random backbones (the tiny preset without weight files, "
    "docs/results.md#what-tiny-backbones-can-and-cannot-show) low accuracy is expected"
)

PLOTS: dict[str, Plot] = {
    "steps": Plot("the steps over time (UTC), by status", _timeline_data, _draw_timeline),
    "accuracy": Plot(
        "the federation's accuracy by arrival step, and their mean (FAA)",
        _matrix_data,
        lambda m, out: plot_accuracy_over_time(
            m, out, "accuracy by arrival step (sites' tests)", ACCURACY_NOTE
        ),
    ),
    "sites": Plot("each site's accuracy on its own test images", _sites_data, _draw_sites),
    "matrix": Plot(
        "the accuracy matrix: row i after step i, column j the classes of step j",
        _matrix_data,
        lambda m, out: plot_accuracy_matrix(
            m, out, "accuracy matrix (sites' test images)", ACCURACY_NOTE
        ),
    ),
    "bytes": Plot("bytes per step, to the sites and from them", _bytes_data, _draw_bytes),
}


def digest(data: Any) -> str:
    """A short digest of a plot's data: its image's version in the page's address."""
    text = json.dumps(nan_to_none(data), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
