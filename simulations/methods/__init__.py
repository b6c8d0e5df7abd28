"""The methods an experiment compares, by name: one module per method, found by its name.

A method runs one cell of an experiment grid and writes ``out_dir/metrics.json`` (the keys of
``starfed.simulations.tabulate.METRICS``; docs/results.md). A module here is a method when it
defines, at its top level, either

- a subclass of ``starfed.server.strategy.Strategy``: a federated baseline, method
  ``starfed-<module>`` (underscores as dashes) — `starfed` on the local runtime with that
  strategy passed in (``starfed.simulations.methods.starfed``); or
- ``run(values, seed, out_dir, console)``: any other method, named ``<module>``. ``values`` are
  the scenario's run config, parsed by the configuration schema, with ``seed`` set to ``seed``.

The first paragraph of the module's docstring ("`name`: what it is") describes it. Adding a
method is one module here. Methods are found by reading the modules' source (``ast``), so
reading and checking a grid imports no torch; each cell runs in its own process
(``starfed.simulations.cell``), which imports its method's module.
"""

from __future__ import annotations

import ast
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
    """A method found here: its module, its strategy class (a federated baseline), what it is."""

    module: str  # module name under starfed.simulations.methods
    strategy: str | None  # the module's Strategy subclass; None: the module's ``run``
    description: str

    def load(self) -> Method:
        module = importlib.import_module(f"{__name__}.{self.module}")
        if self.strategy is None:
            return module.run
        runner = importlib.import_module(f"{__name__}.{FEDERATED}")
        return partial(runner.run, strategy=getattr(module, self.strategy)())


def _spec(path: Path) -> tuple[str, MethodSpec] | None:
    """The method a module defines, by reading its source; None for a module that is none."""
    tree = ast.parse(path.read_text(), str(path))
    first = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
    dashed = path.stem.replace("_", "-")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
            (base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")) == "Strategy"
            for base in node.bases
        ):
            name = f"{FEDERATED}-{dashed}"
            return name, MethodSpec(path.stem, node.name, first.removeprefix(f"`{name}`: "))
    if any(isinstance(node, ast.FunctionDef) and node.name == "run" for node in tree.body):
        return dashed, MethodSpec(path.stem, None, first.removeprefix(f"`{dashed}`: "))
    return None


def _discover() -> dict[str, MethodSpec]:
    """Every method here: `starfed` first, then the federated baselines, then the others."""
    found = dict(filter(None, map(_spec, sorted(Path(__file__).parent.glob("[!_]*.py")))))
    order = sorted(found, key=lambda name: (name != FEDERATED, not name.startswith(FEDERATED)))
    return {name: found[name] for name in order}


METHODS: dict[str, MethodSpec] = _discover()


def cell_run_config(values: Values, seed: int, out_dir: Path) -> dict[str, Value]:
    """The run config of one cell: the scenario's values, its seed, its folder as the run."""
    return {**values, "seed": seed, "results-dir": str(out_dir.parent), "run-name": out_dir.name}
