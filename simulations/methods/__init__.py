"""The methods an experiment compares, by name: one table, one module per method.

A method is a function ``run(values, seed, out_dir, console)`` that trains and evaluates one
cell of an experiment grid and writes ``out_dir/metrics.json`` (the keys of
``starfed.simulations.tabulate.METRICS``; docs/results.md). ``values`` are the scenario's run
config, parsed by the configuration schema, with ``seed`` set to ``seed``. Adding a method is
one module under ``simulations/methods/`` and one line in ``METHODS``.

The table names functions by import path (as Flower names its apps), so reading and checking a
grid imports no torch; each cell runs in its own process (``starfed.simulations.cell``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rich.console import Console

from starfed.shared.config import Value, Values


class Method(Protocol):
    def __call__(self, values: Values, seed: int, out_dir: Path, console: Console) -> None: ...


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: where its function lives and what it is, in one line."""

    target: str  # "module:function"
    description: str

    def load(self) -> Method:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)


METHODS: dict[str, MethodSpec] = {
    "starfed": MethodSpec(
        "starfed.simulations.methods.federated:run",
        "federated STAR-Prompt: the scenario's sites, the local runtime",
    ),
    "starfed-positional": MethodSpec(
        "starfed.simulations.methods.positional:run",
        "federated STAR-Prompt, trained tensors averaged by position (plain FedAvg)",
    ),
    "starfed-unmerged": MethodSpec(
        "starfed.simulations.methods.unmerged:run",
        "federated STAR-Prompt, the sites' Gaussians replayed unmerged (CCVR-style)",
    ),
    "starfed-no-replay": MethodSpec(
        "starfed.simulations.methods.ablations:no_generative_replay",
        "federated STAR-Prompt without generative replay (generative-replay=false)",
    ),
    "starfed-keys": MethodSpec(
        "starfed.simulations.methods.ablations:classify_with_keys",
        "federated STAR-Prompt evaluated with the first-level keys alone (classify-with-keys)",
    ),
    "fedavg": MethodSpec(
        "starfed.simulations.methods.fedavg:run",
        "FedAvg fine-tuning of a linear head, no continual mechanism (lower bound)",
    ),
    "single-site": MethodSpec(
        "starfed.simulations.methods.references:single_site",
        "STAR-Prompt with all the data at one site, the same tasks in order",
    ),
    "joint": MethodSpec(
        "starfed.simulations.methods.references:joint",
        "all the scenario's classes as one task at one site (upper reference)",
    ),
}


def cell_run_config(values: Values, seed: int, out_dir: Path) -> dict[str, Value]:
    """The run config of one cell: the scenario's values, its seed, its folder as the run."""
    return {**values, "seed": seed, "results-dir": str(out_dir.parent), "run-name": out_dir.name}
