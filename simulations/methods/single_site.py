"""`single-site`: STAR-Prompt with all the data at one site, the same tasks in order — the
reference a federation is measured against.

`starfed train-local` (``run_local``) on the scenario's classes, seed and training budget,
sharing the sites' cache of decoded images.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from starfed.client.answer import default_cache_dir
from starfed.shared.knob import Values
from starfed.simulations.methods import cell_run_config
from starfed.simulations.research_knobs import parse
from starfed.simulations.train_local import LocalRunOptions, run_local


def local_options(values: Values, seed: int, out_dir: Path) -> LocalRunOptions:
    """The single-site run of one cell: the scenario's values, the sites' image cache."""
    own = parse({"cache-dir": str(default_cache_dir() / "images")}, "train-local")
    return LocalRunOptions.from_config(parse(cell_run_config(values, seed, out_dir)), own)


def run(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    run_local(local_options(values, seed, out_dir), console)
