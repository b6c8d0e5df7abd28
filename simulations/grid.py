"""An experiment grid file: scenarios × methods × seeds, read and checked in one place.

```toml
[experiment]
name = "default"                         # results/<name>/
seeds = [1993, 1996, 1997]               # optional; these by default (the paper's)
methods = ["starfed", "single-site"]     # names of starfed.simulations.methods.METHODS

[defaults]                               # optional: run-config keys of every scenario
num-tasks = 7

[[scenario]]                             # one table per scenario: a name and run-config keys
name = "sites-5"                         # optional; derived from the keys when left out
num-sites = 5
alpha = 0.5
```

Every run-config key is checked by the configuration schema (``starfed.shared.config.parse``),
so a bad grid is one ``ConfigError`` line before anything runs; a retired key (``retired_names``)
is read as its new one, with a note. ``seed``, ``results-dir``,
``run-name`` and ``federation-dir`` belong to a cell, not a scenario.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from starfed.shared.config import TABLES, parse
from starfed.shared.knob import ConfigError, Value, show
from starfed.shared.retired_names import current_keys
from starfed.simulations.methods import METHODS

PAPER_SEEDS = (1993, 1996, 1997)
CELL_KEYS = ("seed", "results-dir", "run-name", "federation-dir")  # set per cell
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SECTIONS = {"experiment", "defaults", "scenario"}
EXPERIMENT_KEYS = {"name", "seeds", "methods"}


@dataclass(frozen=True)
class Scenario:
    name: str
    run_config: dict[str, Value]  # the keys the grid sets (defaults, then its own), typed

    @property
    def values(self) -> dict[str, Value]:
        """Every run-config key: the grid's, then the schema's defaults."""
        return parse(self.run_config)


@dataclass(frozen=True)
class Cell:
    scenario: Scenario
    method: str
    seed: int

    @property
    def name(self) -> str:
        """The cell's folder under ``results/<experiment>/``."""
        return f"{self.scenario.name}__{self.method}__seed{self.seed}"


@dataclass(frozen=True)
class Experiment:
    name: str
    seeds: tuple[int, ...]
    methods: tuple[str, ...]
    scenarios: tuple[Scenario, ...]
    source: str  # the grid file

    def cells(self) -> list[Cell]:
        """Seed by seed, so that a first complete seed gives every row of the table early."""
        return [
            Cell(scenario, method, seed)
            for seed in self.seeds
            for scenario in self.scenarios
            for method in self.methods
        ]


def shipped_grids() -> dict[str, Path]:
    """The grids that come with starfed (``simulations/grids/``), by name."""
    folder = files("starfed.simulations") / "grids"
    found = sorted((p for p in folder.iterdir() if p.name.endswith(".toml")), key=lambda p: p.name)
    return {Path(p.name).stem: Path(str(p)) for p in found}


def resolve(grid: str) -> Path:
    """A grid file's path, or a shipped grid's name (``default``, ``sites``, ...)."""
    path = Path(grid).expanduser()
    if path.is_file():
        return path
    shipped = shipped_grids()
    if grid in shipped:
        return shipped[grid]
    raise ConfigError(f"grid {grid}: no such file, nor a shipped grid ({', '.join(shipped)})")


def load(grid: str) -> Experiment:
    """Read and check a grid file (or a shipped grid by name)."""
    path = resolve(grid)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"grid {path}: {err}") from None
    try:
        return _experiment(raw, str(path))
    except ConfigError as err:
        raise ConfigError(f"grid {path}: {err}") from None


def _experiment(raw: dict, source: str) -> Experiment:
    _known(raw, SECTIONS, "section")
    head = raw.get("experiment")
    if not isinstance(head, dict):
        raise ConfigError("needs an [experiment] table with name and methods")
    _known(head, EXPERIMENT_KEYS, "[experiment] key")
    name = _name(head.get("name"), "[experiment] name")
    raw_seeds = head.get("seeds", list(PAPER_SEEDS))
    if not isinstance(raw_seeds, list) or not raw_seeds:
        raise ConfigError("[experiment] seeds: expected a non-empty list of integers")
    seed = TABLES["run-config"]["seed"]
    seeds = tuple(int(seed.parse(s, "[experiment] seeds")) for s in raw_seeds)  # an int knob
    methods = head.get("methods")
    if not isinstance(methods, list) or not methods:
        raise ConfigError(f"[experiment] methods: expected a non-empty list of {_known_methods()}")
    for method in methods:
        if method not in METHODS:
            raise ConfigError(f"[experiment] methods: unknown {method!r} ({_known_methods()})")
    defaults = _run_config(raw.get("defaults", {}), "[defaults]")
    tables = raw.get("scenario")
    if not isinstance(tables, list) or not tables:
        raise ConfigError("needs at least one [[scenario]] table")
    scenarios = tuple(_scenario(table, i, defaults) for i, table in enumerate(tables))
    names = [s.name for s in scenarios]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise ConfigError(f"two scenarios are named {duplicate!r}")
    for what, items in (("seeds", seeds), ("methods", methods)):
        if len(set(items)) < len(items):
            raise ConfigError(f"[experiment] {what}: listed twice: {items}")
    return Experiment(name, seeds, tuple(methods), scenarios, source)


def _scenario(table: object, index: int, defaults: dict[str, Value]) -> Scenario:
    where = f"[[scenario]] {index + 1}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table")
    keys = {k: v for k, v in table.items() if k != "name"}
    own = _run_config(keys, where)
    run_config = {**defaults, **own}
    # from the keys as written: a grid that still says a retired key keeps its cells' folders
    typed = zip(keys, own.values(), strict=True)  # same order (current_keys keeps it)
    derived = "_".join(f"{k}-{show(v)}" for k, v in typed) or "defaults"
    name = _name(table.get("name", derived), f"{where} name")
    return Scenario(name, run_config)


def _run_config(table: object, where: str) -> dict[str, Value]:
    """The table's run-config keys, typed and checked; cell keys refused."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table of run-config keys")
    for key in CELL_KEYS:
        if key in table:
            raise ConfigError(f"{where}: {key} is set per cell, not per scenario")
    try:
        values = parse(table)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return {key: values[key] for key in current_keys(table, quiet=True)}  # noted by parse


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ConfigError(
            f"{where}: expected a folder name (letters, digits, . _ -), got {value!r}"
        )
    return value


def _known(table: dict, known: set[str], what: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"unknown {what} {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _known_methods() -> str:
    return f"known: {', '.join(METHODS)}"
