"""An experiment's table and plots, computed from its cells' ``metrics.json`` only.

What a method's ``metrics.json`` must hold (``METRICS``): ``accuracy_matrix``,
``final_average_accuracy``, ``final_forgetting``, ``prompt_selection_accuracy_matrix`` (may be
empty for a method without prompt selection) and, for a federated method, ``exchanges`` (one
entry per message to one site: ``bytes_down``, ``bytes_up``). The table is in the paper's style:
one section per scenario, one row per method, mean ± sample standard deviation over seeds, the
best FAA in bold. Plots are matplotlib ``Figure`` objects written to files (no pyplot).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from starfed.shared.knob import show
from starfed.shared.metrics import final_average_accuracy, task_ticks
from starfed.simulations.grid import Experiment, Scenario

METRICS = (
    "accuracy_matrix",
    "final_average_accuracy",
    "final_forgetting",
    "prompt_selection_accuracy_matrix",
)
TABLE_FILE = "table.md"
#: Scenario keys a grid may sweep: the plot of FAA against each (when the grid varies it).
SWEEPS = {
    "num-sites": ("number of sites", "log"),
    "alpha": ("Dirichlet α (smaller: more skew)", "log"),
    "arrival-offset": ("arrival offset (steps between sites)", "linear"),
}


@dataclass
class Row:
    """One method in one scenario: a value per finished seed."""

    scenario: Scenario
    method: str
    planned: int
    faa: list[float] = field(default_factory=list)
    forgetting: list[float] = field(default_factory=list)
    selection: list[float] = field(default_factory=list)
    up: list[float] = field(default_factory=list)  # bytes per site per round
    down: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    curves: list[list[float]] = field(default_factory=list)  # mean accuracy after each step

    def add(self, metrics: dict, seconds: float | None) -> None:
        self.faa.append(float(metrics["final_average_accuracy"]))
        self.forgetting.append(float(metrics["final_forgetting"]))
        selection = metrics.get("prompt_selection_accuracy_matrix") or []
        if selection:
            self.selection.append(final_average_accuracy(selection))
        exchanges = metrics.get("exchanges") or []
        if exchanges:  # each entry: one site's message in one round, and its reply
            self.up.append(sum(e["bytes_up"] for e in exchanges) / len(exchanges))
            self.down.append(sum(e["bytes_down"] for e in exchanges) / len(exchanges))
        if seconds is not None:
            self.seconds.append(seconds)
        self.curves.append([_mean(row) for row in metrics["accuracy_matrix"]])

    def summary(self) -> dict:
        """The row's numbers (``--json``)."""
        return {
            "scenario": self.scenario.name,
            "method": self.method,
            "seeds": len(self.faa),
            "planned": self.planned,
            "faa": _stats(self.faa),
            "forgetting": _stats(self.forgetting),
            "prompt_selection": _stats(self.selection),
            "bytes_up_per_site_round": _stats(self.up),
            "bytes_down_per_site_round": _stats(self.down),
            "seconds": _stats(self.seconds),
        }


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else math.nan


def _stats(values: list[float]) -> dict:
    sd = statistics.stdev(values) if len(values) > 1 else None
    return {"mean": _mean(values) if values else None, "sd": sd}


def rows(experiment: Experiment, results: dict[str, tuple[dict, float | None]]) -> list[Row]:
    """Rows in grid order from ``results``: cell name -> (metrics, seconds) of finished cells."""
    out = []
    for scenario in experiment.scenarios:
        for method in experiment.methods:
            row = Row(scenario, method, len(experiment.seeds))
            for cell in experiment.cells():
                if (cell.scenario, cell.method) == (scenario, method) and cell.name in results:
                    row.add(*results[cell.name])
            out.append(row)
    return out


# --- the table -------------------------------------------------------------------------------


def _pm(values: list[float], digits: int = 2) -> str:
    if not values:
        return "—"
    text = f"{_mean(values):.{digits}f}"
    return f"{text} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else text


def _kb(values: list[float]) -> str:
    return f"{_mean(values) / 1000:.1f} kB" if values else "—"


def scenario_title(scenario: Scenario) -> str:
    keys = " · ".join(f"{k} {show(v)}" for k, v in scenario.run_config.items())
    return f"{scenario.name}" + (f" — {keys}" if keys else " — the defaults")


def table(experiment: Experiment, all_rows: list[Row]) -> str:
    """``table.md``: one section per scenario, one row per method."""
    lines = [
        f"# Experiment `{experiment.name}`",
        "",
        f"Grid `{Path(experiment.source).name}` · seeds "
        f"{', '.join(map(str, experiment.seeds))} · methods {', '.join(experiment.methods)}",
        "",
    ]
    header = (
        "| method | FAA ↑ | forgetting ↓ | prompt selection | up / site / round "
        "| down / site / round | wall / run | seeds |"
    )
    for scenario in experiment.scenarios:
        lines += [f"## {scenario_title(scenario)}", "", header, "|---" * 8 + "|"]
        section = [r for r in all_rows if r.scenario == scenario]
        best = max((_mean(r.faa) for r in section if r.faa), default=None)
        for r in section:
            faa = _pm(r.faa)
            if r.faa and _mean(r.faa) == best:
                faa = f"**{faa}**"
            wall = f"{_mean(r.seconds):.0f} s" if r.seconds else "—"
            lines.append(
                f"| {r.method} | {faa} | {_pm(r.forgetting)} | {_pm(r.selection, 1)} | "
                f"{_kb(r.up)} | {_kb(r.down)} | {wall} | {len(r.faa)}/{r.planned} |"
            )
        lines.append("")
    lines += [
        "FAA: final average accuracy (%, the mean of the accuracy matrix's last row); "
        "forgetting: mean drop from each task's best earlier accuracy; prompt selection: "
        "how often (%) the selected first-level key belongs to the image's own task, "
        "averaged over the last row. Mean ± sample standard deviation over the seeds done. "
        "Bytes: one site's message in one round (a phase round: sync, a stage-1 or stage-2 "
        "round, statistics, evaluation) and its reply, from `metrics.json` → `exchanges`. "
        "Wall: seconds per run (one cell, its own process) on the machine it ran on.",
        "",
    ]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------


def plots(experiment: Experiment, all_rows: list[Row], folder: Path) -> list[Path]:
    """Accuracy over time per scenario, and FAA against every swept key; the files written."""
    written = []
    for scenario in experiment.scenarios:
        path = folder / f"accuracy_over_time__{scenario.name}.png"
        _over_time([r for r in all_rows if r.scenario == scenario], scenario, path)
        written.append(path)
    for key, (label, scale) in SWEEPS.items():
        swept = {s.values[key] for s in experiment.scenarios}
        if len(swept) > 1:
            path = folder / f"faa_vs_{key}.png"
            _faa_against(key, label, scale, all_rows, experiment, path)
            written.append(path)
    return written


def _over_time(section: list[Row], scenario: Scenario, path: Path) -> None:
    """Mean accuracy after each step, mean ± sd over seeds, one line per method; a method
    that learns everything in one step (joint) is a dashed reference line."""
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    n_steps = max((len(c) for r in section for c in r.curves), default=1)
    for r in section:
        if not r.curves:
            continue
        length = min(len(c) for c in r.curves)
        curves = np.array([c[:length] for c in r.curves])
        mean, sd = np.nanmean(curves, axis=0), np.nanstd(curves, axis=0)
        if length == 1 and n_steps > 1:
            ax.axhline(mean[0], ls="--", lw=1.2, color="grey", label=f"{r.method} (one task)")
            continue
        steps = np.arange(1, length + 1)
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=r.method)
        ax.fill_between(steps, mean - sd, mean + sd, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("after step")
    ax.set_ylabel("mean accuracy on seen tasks (%)")
    ax.set_xlim(0.5, n_steps + 0.5)
    ax.set_ylim(0, 100)
    ax.set_xticks([t + 1 for t in task_ticks(n_steps)])
    ax.set_title(f"accuracy over time · {scenario.name} (mean ± sd over seeds)", fontsize=10)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def _faa_against(
    key: str, label: str, scale: str, all_rows: list[Row], experiment: Experiment, path: Path
) -> None:
    """FAA (mean ± sd over seeds) against ``key``, one line per method (and per setting of the
    scenarios' other keys, when those differ too)."""
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for r in all_rows:
        if not r.faa:
            continue
        others = {k: v for k, v in r.scenario.run_config.items() if k != key}
        varying = {
            k: v for k, v in others.items() if len({s.values[k] for s in experiment.scenarios}) > 1
        }
        name = r.method + "".join(f", {k} {show(v)}" for k, v in varying.items())
        sd = statistics.stdev(r.faa) if len(r.faa) > 1 else 0.0
        lines.setdefault(name, []).append((float(r.scenario.values[key]), _mean(r.faa), sd))
    for name, points in lines.items():
        x, y, err = zip(*sorted(points), strict=True)
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale(scale)
    xs = sorted({float(s.values[key]) for s in experiment.scenarios})
    ax.set_xticks(xs, [show(int(v) if v.is_integer() else v) for v in xs])
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.set_ylabel("FAA (%)")
    ax.set_title(f"{experiment.name}: final average accuracy against {key}", fontsize=10)
    if lines:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
