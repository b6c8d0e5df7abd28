"""`starfed experiment`: every cell of a grid, one after another, then the table and plots.

Cells (``starfed.simulations.grid``) run in grid order, seed by seed, each in its own process
(``starfed.simulations.cell``) into ``<results-dir>/<experiment>/<cell>/``; a complete cell is
skipped, so an interrupted experiment continues where it stopped. One line per cell says how
far the grid is (done/total, the cell, its time, elapsed, ETA). ``table.md`` is rewritten after
every cell; the plots are drawn at the end (``starfed.simulations.tabulate``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from starfed.shared.files import write_atomic
from starfed.simulations import cell as cells
from starfed.simulations import tabulate
from starfed.simulations.grid import Cell, Experiment

SUMMARY_FILE = "summary.json"


@dataclass
class Progress:
    """Time per finished cell, by method, for the ETA (methods differ by minutes)."""

    total: int
    started: float = field(default_factory=time.monotonic)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def record(self, method: str, seconds: float | None) -> None:
        if seconds is not None:
            self.seconds.setdefault(method, []).append(seconds)

    def eta(self, remaining: list[Cell]) -> float | None:
        every = [s for times in self.seconds.values() for s in times]
        if not every:
            return None
        overall = statistics.fmean(every)
        return sum(statistics.fmean(self.seconds.get(c.method, [overall])) for c in remaining)

    def line(self, index: int, cell: Cell, outcome: cells.Outcome, remaining: list[Cell]) -> str:
        eta = self.eta(remaining)
        took = "" if outcome.seconds is None else f" {_duration(outcome.seconds)}"
        what = {
            "done": f"done{took}",
            "skipped": "complete, skipped",
            "failed": f"FAILED{took}: {outcome.error}",
        }[outcome.status]
        if outcome.metrics is not None:
            what += f" · FAA {outcome.metrics['final_average_accuracy']:.2f}"
        elapsed = _duration(time.monotonic() - self.started)
        left = "—" if eta is None else _duration(eta)
        width = len(str(self.total))
        return (
            f"[{index:{width}d}/{self.total}] {cell.name}: {what} · elapsed {elapsed} · ETA {left}"
        )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def run_experiment(
    experiment: Experiment, results_dir: Path, runtime: cells.Runtime, out: TextIO | None = None
) -> dict:
    """Run or skip every cell, each on ``runtime``; write the table and plots; return the
    summary (``--json``). Progress lines go to ``out`` (standard error by default)."""
    out = out or sys.stderr
    folder = results_dir / experiment.name
    folder.mkdir(parents=True, exist_ok=True)
    todo = experiment.cells()
    finished = {cell.name: cells.complete(folder / cell.name, cell) for cell in todo}
    progress = Progress(len(todo))
    for outcome, cell in zip(finished.values(), todo, strict=True):
        if outcome is not None:  # its time from when it ran: a better first ETA than none
            progress.record(cell.method, outcome.seconds)
    results: dict[str, tuple[dict, float | None]] = {}
    report: list[dict] = []
    for index, cell in enumerate(todo, 1):
        where = folder / cell.name
        outcome = finished[cell.name] or cells.run(where, cell, runtime)
        if outcome.status == "done":
            progress.record(cell.method, outcome.seconds)
        if outcome.metrics is not None:
            results[cell.name] = (outcome.metrics, outcome.seconds)
        remaining = [c for c in todo[index:] if finished[c.name] is None]
        print(progress.line(index, cell, outcome, remaining), file=out, flush=True)
        report.append(_cell_summary(cell, outcome, where))
        table_rows = tabulate.rows(experiment, results)
        write_atomic(folder / tabulate.TABLE_FILE, tabulate.table(experiment, table_rows).encode())
    plots = tabulate.plots(experiment, table_rows, folder)
    summary = {
        "experiment": experiment.name,
        "grid": experiment.source,
        "results": str(folder),
        "table": str(folder / tabulate.TABLE_FILE),
        "plots": [str(p) for p in plots],
        "wall_s": time.monotonic() - progress.started,
        "failed": sum(c["status"] == "failed" for c in report),
        "cells": report,
        "rows": [row.summary() for row in table_rows],
    }
    write_atomic(folder / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
    return summary


def _cell_summary(cell: Cell, outcome: cells.Outcome, where: Path) -> dict:
    metrics = outcome.metrics or {}
    return {
        "cell": cell.name,
        "scenario": cell.scenario.name,
        "method": cell.method,
        "seed": cell.seed,
        "status": outcome.status,
        "seconds": outcome.seconds,
        "cpu_seconds": outcome.cpu_seconds,
        "final_average_accuracy": metrics.get("final_average_accuracy"),
        "folder": str(where),
        "error": outcome.error,
    }
