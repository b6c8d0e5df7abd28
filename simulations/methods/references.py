"""`single-site` and `joint`: the references a federation is measured against.

Both are `starfed train-local` (``run_local``) on the scenario's classes, seed and training
budget. `single-site` learns the scenario's tasks in order with all the data at one site;
`joint` learns all of the scenario's classes at once, as one task (no continual learning: the
upper reference). Both share the sites' cache of decoded images.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.console import Console

from starfed.client.app import default_cache_dir
from starfed.shared.config import Values, parse
from starfed.shared.data.cropdiseases import SplitCropDiseases
from starfed.simulations.methods import cell_run_config
from starfed.simulations.train_local import LocalRunOptions, run_local


def _options(values: Values, seed: int, out_dir: Path) -> LocalRunOptions:
    own = parse({"cache-dir": str(default_cache_dir() / "images")}, "train-local")
    return LocalRunOptions.from_config(parse(cell_run_config(values, seed, out_dir)), own)


def single_site(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    run_local(_options(values, seed, out_dir), console)


def joint(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    options = _options(values, seed, out_dir)
    split = SplitCropDiseases.from_root(
        options.data_root, options.n_tasks, options.classes_per_task, seed
    )  # the same seed picks the same classes whatever the number of tasks
    run_local(replace(options, n_tasks=1, classes_per_task=split.n_classes), console)
