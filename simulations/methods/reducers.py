"""A federated method that differs from `starfed` only in how the server reduces the replies
of some phases: the coordinator's reducer table swapped for the duration of its run.

``REDUCERS`` (``starfed.server.coordinator``) is the server side of the protocol table, one
function per phase; the federation's ServerApp and ClientApp code is otherwise `starfed`'s, on
the same local runtime. Each cell runs in its own process (``starfed.simulations.cell``), so
nothing else sees the swap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from starfed.server.coordinator import REDUCERS, Coordinator
from starfed.server.messaging import Reply
from starfed.shared.config import Values
from starfed.shared.protocol import Phase
from starfed.simulations.local_grid import run_locally
from starfed.simulations.methods import cell_run_config

Reducer = Callable[[Coordinator, Phase, int, list[Reply]], None]


@contextmanager
def swapped(reducers: dict[Phase, Reducer]) -> Iterator[None]:
    """The coordinator's reducers of some phases replaced, for the duration."""
    saved = {phase: REDUCERS[phase] for phase in reducers}
    REDUCERS.update(reducers)
    try:
        yield
    finally:
        REDUCERS.update(saved)


def run_with(
    reducers: dict[Phase, Reducer], values: Values, seed: int, out_dir: Path, console: Console
) -> None:
    """One `starfed` cell with ``reducers`` in place of the coordinator's own."""
    with swapped(reducers):
        run_locally(cell_run_config(values, seed, out_dir), console)
