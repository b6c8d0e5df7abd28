"""`starfed simulate`: the command line of a federated simulation, on Flower or locally.

The run config to submit — the project's ``[tool.flwr.app.config]``, then ``--run-config``
pairs, then named options — is checked as a whole against the configuration schema, and the
results folder proven writable, before any Flower process starts; the life cycle of the run
itself is ``starfed.simulations.simulate`` (``--runtime flower``) or
``starfed.simulations.local_grid`` (``--runtime local``).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from starfed.cli.flags import Flag, add_command, given, same_name
from starfed.shared.config import TABLES, ConfigError, Value, optional, parse, writable_dir
from starfed.simulations.simulate import find_project_dir, load_app_config, simulate

COMMAND = "simulate"
FLAGS = (
    Flag("--clients", ("num-clients",)),
    Flag("--tasks", ("num-tasks",)),
    *same_name("classes-per-task", "alpha", "seed", "arrival-offset"),
    *same_name("stage1-rounds", "stage2-rounds"),
    Flag("--epochs", ("stage1-epochs", "stage2-epochs"), help="local epochs of stages 1 and 2"),
    *same_name("results-dir", "run-name", "runtime", "timeout", "project-dir"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        COMMAND,
        FLAGS,
        _main,
        help="federated simulation on this machine, start to finish (Flower and Ray, or local)",
        description=(
            "Run the federated scenario. The flower runtime is a real Flower simulation: "
            "start a private localhost SuperLink, submit the app with `flwr run`, follow it "
            "until it finishes, stop every process it started. The local runtime runs the "
            "same ServerApp and ClientApp code in this process, one site after another, "
            "without Flower's start-up cost. Unset options keep the defaults of "
            "[tool.flwr.app.config] in pyproject.toml; the number of simulated SuperNodes "
            "always equals num-clients."
        ),
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any run-config key (docs/simulation.md), repeatable; named options win",
    )


def parse_override(text: str) -> tuple[str, str]:
    """``KEY=VALUE``: the value as typed, or a quoted TOML string's content; the schema
    converts it to the key's type."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--run-config {text}: expected KEY=VALUE")
    value = raw.strip()
    if value[:1] in ("'", '"'):
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            raise ConfigError(f"--run-config {text}: not a TOML string") from None
    return key.strip(), value


def build_overrides(args: argparse.Namespace, app_config: Mapping[str, object]) -> dict:
    """The run config to submit: the keys set on the command line, typed and checked together
    with the project's defaults.

    ``num-clients`` is always sent (it is also the SuperNode count); paths become absolute
    (the apps run in the SuperLink's working directory) and ``run-name`` is fixed here, so
    this command knows where results land.
    """
    named, _, names = given(args, FLAGS)
    overrides: dict[str, object] = dict(parse_override(item) for item in args.run_config)
    overrides |= named
    values = parse({**app_config, **overrides}, "run-config", names)
    sent = [*overrides, "num-clients", "results-dir"]
    submitted: dict[str, Value] = {key: values[key] for key in sent}
    for key, knob in TABLES["run-config"].items():
        if knob.path and submitted.get(key):
            submitted[key] = str(Path(str(submitted[key])).expanduser().resolve())
    submitted["run-name"] = values["run-name"] or datetime.now(UTC).strftime("fed-%Y%m%d-%H%M%S")
    return submitted


def _main(args: argparse.Namespace) -> int:
    _, own, names = given(args, FLAGS)
    options = parse(own, COMMAND, names)
    local = options["runtime"] == "local"
    project_dir = None if local else find_project_dir(optional(options["project-dir"]))
    # The local runtime needs no project: the schema's defaults are pyproject's (a test says so).
    overrides = build_overrides(args, load_app_config(project_dir) if project_dir else {})
    results = writable_dir(overrides["results-dir"], names.get("results-dir", "results-dir"))
    run_dir = results / str(overrides["run-name"])
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"run folder {run_dir} already exists: choose another --run-name (a federation "
            "continues with `starfed server round`, not by simulating into its folder)"
        )
    if project_dir is None:
        from starfed.simulations.local_grid import simulate_locally  # Flower, torch: only now

        return simulate_locally(overrides)
    return simulate(project_dir, overrides, options["timeout"])
