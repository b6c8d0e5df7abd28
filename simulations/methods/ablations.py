"""The federated ablations of the paper's Table 4: `starfed-no-replay` and `starfed-keys`.

Federated STAR-Prompt exactly as `starfed` runs it, with one switch of the run config:

- ``generative-replay=false``: the server registers, merges and freezes as usual but never
  calibrates keys or head on features drawn from the merged class mixtures, so what the
  mixtures buy a federation is the difference between the two rows;
- ``classify-with-keys=true``: training is unchanged; every evaluation (the sites' and the
  server's test set) predicts with the first-level keys alone, so what the second level buys
  is the difference.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from starfed.shared.config import Values
from starfed.simulations.local_grid import run_locally
from starfed.simulations.methods import cell_run_config


def no_generative_replay(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    run_locally({**cell_run_config(values, seed, out_dir), "generative-replay": False}, console)


def classify_with_keys(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    run_locally({**cell_run_config(values, seed, out_dir), "classify-with-keys": True}, console)
