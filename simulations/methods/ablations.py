"""`starfed-no-replay`: the federated ablation of generative replay (the paper's Table 4).

Federated STAR-Prompt exactly as `starfed` runs it, with ``generative-replay=false``: the
server registers, merges and freezes as usual but never calibrates keys or head on features
drawn from the merged class mixtures, so what the mixtures buy a federation is the difference
between the two rows. The paper's other ablation, keys as classifier (``classify-with-keys``),
is an option of `starfed train-local` only (``shared/config.py``: group "command"): a
federation's sites always classify with the second level, so it has no federated row.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from starfed.shared.config import Values
from starfed.simulations.local_grid import run_locally
from starfed.simulations.methods import cell_run_config


def no_generative_replay(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    run_locally({**cell_run_config(values, seed, out_dir), "generative-replay": False}, console)
