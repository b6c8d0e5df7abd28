"""`starfed experiment`: every cell of a grid, one or several at once, then the table and plots.

Cells (``starfed.simulations.grid``) start in grid order, seed by seed, each in its own process
(``starfed.simulations.cell``) into ``<results-dir>/<experiment>/<cell>/``, at most ``jobs`` at
a time; a complete cell is skipped, so an interrupted experiment continues where it stopped.
One line per cell, as it ends, says how far the grid is (done/total, the cell, its time,
elapsed, ETA). ``table.md`` is rewritten after every cell; the plots are drawn at the end
(``starfed.simulations.tabulate``). Side by side, each cell's thread pools get its share of the
cores (``cells.start``); a cell is seeded and its clients' thread counts are fixed
(``local_grid``, Ray's CPUs per client), so only the float rounding of work that uses the
process's threads (the server's replays) can differ from a cell run alone (docs/results.md).
"""

from __future__ import annotations

import json
import os
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
POLL_S = 0.5  # how often running cells are looked at: cells take minutes


@dataclass
class Progress:
    """Time per finished cell, by method, for the ETA (methods differ by minutes)."""

    total: int
    jobs: int = 1  # cells at once: the ETA divides the remaining cells' time by it
    started: float = field(default_factory=time.monotonic)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def record(self, method: str, seconds: float | None) -> None:
        if seconds is not None:
            self.seconds.setdefault(method, []).append(seconds)

    def eta(self, remaining: list[tuple[Cell, float]]) -> float | None:
        """Seconds until the last cell ends: what each remaining cell is expected to take (its
        method's mean), less the seconds it has run, shared among the jobs."""
        every = [s for times in self.seconds.values() for s in times]
        if not every:
            return None
        overall = statistics.fmean(every)
        left = sum(
            max(0.0, statistics.fmean(self.seconds.get(cell.method, [overall])) - ran)
            for cell, ran in remaining
        )
        return left / min(self.jobs, max(len(remaining), 1))

    def line(
        self, index: int, cell: Cell, outcome: cells.Outcome, remaining: list[tuple[Cell, float]]
    ) -> str:
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
    experiment: Experiment,
    results_dir: Path,
    runtime: cells.Runtime,
    jobs: int = 1,
    out: TextIO | None = None,
) -> dict:
    """Run or skip every cell, at most ``jobs`` at once, each on ``runtime``; write the table
    and plots; return the summary (``--json``). Progress lines go to ``out`` (standard error by
    default), one per cell as it ends; the summary lists the cells in grid order. An exception
    (Ctrl-C, SIGTERM) stops every running cell by its PID before it goes on."""
    folder = results_dir / experiment.name
    folder.mkdir(parents=True, exist_ok=True)
    todo = experiment.cells()
    finished = {cell.name: cells.complete(folder / cell.name, cell) for cell in todo}
    progress = Progress(len(todo), jobs)
    for outcome, cell in zip(finished.values(), todo, strict=True):
        if outcome is not None:  # its time from when it ran: a better first ETA than none
            progress.record(cell.method, outcome.seconds)
    tracker = _Tracker(experiment, folder, todo, progress, out or sys.stderr)
    waiting = []
    for cell in todo:  # complete cells first, in grid order
        if (outcome := finished[cell.name]) is None:
            waiting.append(cell)
        else:
            tracker.ended(cell, outcome)
    tracker.run(waiting, runtime, jobs)
    plots = tabulate.plots(experiment, tracker.table_rows, folder)
    report = [tracker.reports[cell.name] for cell in todo]
    summary = {
        "experiment": experiment.name,
        "grid": experiment.source,
        "results": str(folder),
        "table": str(folder / tabulate.TABLE_FILE),
        "plots": [str(p) for p in plots],
        "wall_s": time.monotonic() - progress.started,
        "jobs": jobs,
        "failed": sum(c["status"] == "failed" for c in report),
        "cells": report,
        "rows": [row.summary() for row in tracker.table_rows],
    }
    write_atomic(folder / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
    return summary


@dataclass
class _Tracker:
    """An experiment's cells as they end: their results and reports, the table rewritten."""

    experiment: Experiment
    folder: Path
    todo: list[Cell]
    progress: Progress
    out: TextIO
    results: dict[str, tuple[dict, float | None]] = field(default_factory=dict)
    reports: dict[str, dict] = field(default_factory=dict)
    running: list[cells.Running] = field(default_factory=list)
    table_rows: list[tabulate.Row] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.table_rows = tabulate.rows(self.experiment, self.results)

    def ended(self, cell: Cell, outcome: cells.Outcome) -> None:
        """One progress line, and the table with the cell's result."""
        if outcome.status == "done":
            self.progress.record(cell.method, outcome.seconds)
        if outcome.metrics is not None:
            self.results[cell.name] = (outcome.metrics, outcome.seconds)
        self.reports[cell.name] = _cell_summary(cell, outcome, self.folder / cell.name)
        ran = {r.cell.name: time.monotonic() - r.started for r in self.running}
        remaining = [(c, ran.get(c.name, 0.0)) for c in self.todo if c.name not in self.reports]
        line = self.progress.line(len(self.reports), cell, outcome, remaining)
        print(line, file=self.out, flush=True)
        self.table_rows = tabulate.rows(self.experiment, self.results)
        table = tabulate.table(self.experiment, self.table_rows)
        write_atomic(self.folder / tabulate.TABLE_FILE, table.encode())

    def run(self, waiting: list[Cell], runtime: cells.Runtime, jobs: int) -> None:
        """Start cells while fewer than ``jobs`` run, until all ended; on any exception, stop
        the running ones by their PIDs first."""
        # side by side, each cell's thread pools get its share of this machine's cores
        threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0
        running = self.running
        try:
            while waiting or running:
                while waiting and len(running) < jobs:
                    cell = waiting.pop(0)
                    running.append(cells.start(self.folder / cell.name, cell, runtime, threads))
                still = []
                for cell_run in running:
                    outcome = cell_run.poll()
                    if outcome is None:
                        still.append(cell_run)
                    else:
                        self.ended(cell_run.cell, outcome)
                if len(still) == len(running):
                    time.sleep(POLL_S)
                running[:] = still
        except BaseException:
            for cell_run in running:
                cell_run.stop()
            raise


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
