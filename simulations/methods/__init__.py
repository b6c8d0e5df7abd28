"""The methods an experiment compares, by name: ``METHODS``, one module here per method.

A method runs one cell of an experiment grid and writes ``out_dir/metrics.json`` (the keys of
``starfed.simulations.tabulate.METRICS``; docs/results.md). Its module here defines either

- a subclass of ``starfed.server.strategy.MeanStrategy``: a federated baseline, named
  ``starfed-<what it changes>`` — `starfed` on the local runtime with that strategy passed in
  (``starfed.simulations.methods.starfed``); or
- ``run(values, seed, out_dir, console)``: any other method. ``values`` are the scenario's run
  config, parsed by the configuration schema, with ``seed`` set to ``seed``.

Adding a method is its module and its line in ``METHODS`` (tests/test_baselines.py checks that
every module here is listed and defines what its line says). The table names modules and
classes as text, so reading and checking a grid imports no torch; each cell runs in its own
process (``starfed.simulations.cell``), which imports its method's module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from rich.console import Console

from starfed.shared.knob import Value, Values

FEDERATED = "starfed"  # the method a strategy's name is prefixed with (and its runner module)
#: The methods a Flower run computes (``starfed experiment --runtime flower``): the simulation's
#: ServerApp runs starfed's own strategy; the baselines' strategies and the other methods run on
#: the local runtime only.
FLOWER_METHODS = (FEDERATED,)


class Method(Protocol):
    def __call__(self, values: Values, seed: int, out_dir: Path, console: Console) -> None: ...


@dataclass(frozen=True)
class MethodSpec:
    """A method: its module here (whose docstring says what it is) and its strategy class (a
    federated baseline)."""

    module: str  # module name under starfed.simulations.methods
    strategy: str | None  # the module's Strategy subclass; None: the module's ``run``

    def load(self) -> Method:
        module = importlib.import_module(f"{__name__}.{self.module}")
        if self.strategy is None:
            return module.run
        runner = importlib.import_module(f"{__name__}.{FEDERATED}")
        return partial(runner.run, strategy=getattr(module, self.strategy)())


#: Every method, by name: `starfed` first, then the federated baselines, then the others (the
#: order of the experiment's tables). What each is: its module's docstring.
METHODS: dict[str, MethodSpec] = {
    FEDERATED: MethodSpec("starfed", None),
    "starfed-keys": MethodSpec("keys", "ClassifyWithKeys"),
    "starfed-no-replay": MethodSpec("no_replay", "NoReplay"),
    "starfed-positional": MethodSpec("positional", "PositionalAveraging"),
    "starfed-unmerged": MethodSpec("unmerged", "Unmerged"),
    "fedavg": MethodSpec("fedavg", None),
    "joint": MethodSpec("joint", None),
    "single-site": MethodSpec("single_site", None),
}


def cell_run_config(values: Values, seed: int, out_dir: Path) -> dict[str, Value]:
    """The run config of one cell: the scenario's values, its seed, its folder as the run."""
    return {**values, "seed": seed, "results-dir": str(out_dir.parent), "run-name": out_dir.name}
