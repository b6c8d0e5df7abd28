"""`joint`: all of the scenario's classes as one task at one site (no continual learning: the
upper reference).

`starfed train-local` like `single-site` (``local_options``), with one task of every class.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.console import Console

from starfed.shared.data.cropdiseases import SplitCropDiseases
from starfed.shared.knob import Values
from starfed.simulations.methods.single_site import local_options
from starfed.simulations.train_local import run_local


def run(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    options = local_options(values, seed, out_dir)
    split = SplitCropDiseases.from_root(
        options.data_root, options.n_tasks, options.classes_per_task, seed
    )  # the same seed picks the same classes whatever the number of tasks
    run_local(replace(options, n_tasks=1, classes_per_task=split.n_classes), console)
