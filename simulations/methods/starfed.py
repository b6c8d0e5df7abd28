"""`starfed`: federated STAR-Prompt over the scenario's simulated sites, on the local runtime.

The same ServerApp and ClientApp code as `starfed simulate` (either runtime computes the same
numbers), without Flower's start-up cost per cell. Each federated baseline (``starfed-<x>``) is
this run with its strategy passed in.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from starfed.server.strategy import Strategy
from starfed.shared.knob import Values
from starfed.simulations.local_grid import run_locally
from starfed.simulations.methods import cell_run_config


def run(
    values: Values, seed: int, out_dir: Path, console: Console, strategy: Strategy | None = None
) -> None:
    run_locally(cell_run_config(values, seed, out_dir), console, strategy=strategy)
