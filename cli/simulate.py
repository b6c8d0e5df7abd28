"""`starfed simulate`: the command line of a federated simulation, on Flower or locally.

The run config to submit — the schema's defaults (the generated app's
``[tool.flwr.app.config]``), then ``--run-config`` pairs, then named options — is checked as a
whole against the configuration schema, and the results folder proven writable, before any
Flower process starts; the life cycle of the run itself is ``starfed.simulations.simulate``
(``--runtime flower``) or ``starfed.simulations.local_grid`` (``--runtime local``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from starfed.cli._common import ray_options
from starfed.cli.flags import (
    Flag,
    add_command,
    add_run_config,
    given,
    parsed,
    run_config,
    same_name,
)
from starfed.ops.exit_codes import EXIT_INTERRUPTED
from starfed.shared.knob import ConfigError, as_float, as_str, writable_dir
from starfed.simulations.simulate import INTERRUPTED_FILE, follow, simulate

COMMAND = "simulate"
FLAGS = (
    Flag("--sites", ("num-sites",), retired=("--clients",)),
    Flag("--tasks", ("num-tasks",)),
    *same_name("classes-per-task", "alpha", "seed", "arrival-offset"),
    *same_name("stage1-rounds", "stage2-rounds"),
    Flag("--epochs", ("stage1-epochs", "stage2-epochs"), help="local epochs of stages 1 and 2"),
    *same_name("fraction-train", "min-train-sites"),
    *same_name("results-dir", "run-name", "runtime", "timeout", "gpus-per-client", "ray-address"),
    *same_name("resume", "follow"),
)
#: The run config a simulation submitted, in its run folder: what ``--resume`` submits again.
SETTINGS_FILE = "simulation.json"
#: Where ``flwr run .`` starts its local SuperLink without ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``
#: (Flower 1.42, ``flwr/cli/constant.py``).
LOCAL_SUPERLINK_PORT = "39091"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, COMMAND, _main, FLAGS)
    add_run_config(parser)


def build_overrides(args: argparse.Namespace) -> dict:
    """The run config to submit: the keys set on the command line, typed and checked together
    with the defaults.

    ``num-sites`` is always sent (it is also the SuperNode count); paths become absolute
    (the apps run in the SuperLink's working directory) and ``run-name`` is fixed here, so
    this command knows where results land.
    """
    values, submitted = run_config(args, FLAGS, always=("num-sites", "results-dir"))
    submitted["run-name"] = values["run-name"] or datetime.now(UTC).strftime("fed-%Y%m%d-%H%M%S")
    return submitted


def resumed(args: argparse.Namespace, run_dir: Path) -> dict:
    """The run config an interrupted simulation submitted, for the same run folder: its
    ServerApp continues the federation from the last checkpoint (as ``server resume`` does),
    and the simulated sites keep their state folders there."""
    named, _, names = given(args, FLAGS)
    if named or args.run_config:
        typed = ", ".join(sorted({names[key] for key in named})) or "--run-config"
        raise ConfigError(f"--resume continues a run with its own settings: drop {typed}")
    try:
        saved = json.loads((run_dir / SETTINGS_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"--resume {run_dir}: no readable {SETTINGS_FILE} ({err.__class__.__name__}): not "
            "the folder of a `starfed simulate` run"
        ) from None
    (run_dir / INTERRUPTED_FILE).unlink(missing_ok=True)  # written again if stopped again
    return saved | {"results-dir": str(run_dir.parent), "run-name": run_dir.name}


def _main(args: argparse.Namespace) -> int:
    """federated simulation on this machine, start to finish (Flower and Ray, or local)

    Run the federated scenario. The flower runtime is a real Flower simulation: start a private
    localhost SuperLink, submit the app with `flwr run`, follow it until it finishes, stop every
    process it started; Ctrl-C or SIGTERM stops the run and marks its folder interrupted. The
    local runtime runs the same ServerApp and ClientApp code in this process, one site after
    another, without Flower's start-up cost. Unset options keep the schema's defaults
    (docs/simulation.md); the number of simulated SuperNodes always equals num-sites.
    """
    _, options, names = parsed(args, FLAGS, COMMAND)
    if options["follow"]:  # a run `flwr run .` submitted: Flower's local SuperLink has it
        port = os.environ.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", LOCAL_SUPERLINK_PORT)
        return follow(int(options["follow"]), f"127.0.0.1:{port}")
    gpus, ray_address = ray_options(options)
    if options["resume"]:
        overrides = resumed(args, Path(as_str(options, "resume")).expanduser().resolve())
    else:
        overrides = build_overrides(args)
        results = writable_dir(overrides["results-dir"], names.get("results-dir", "results-dir"))
        run_dir = results / str(overrides["run-name"])
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ConfigError(
                f"run folder {run_dir} already exists: choose another --run-name, or continue "
                f"an interrupted one with `starfed simulate --resume {run_dir}`"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SETTINGS_FILE).write_text(json.dumps(overrides, indent=2) + "\n")
    if options["runtime"] == "local":
        from starfed.simulations.local_grid import simulate_locally  # Flower, torch: only now

        try:
            return simulate_locally(overrides)
        except KeyboardInterrupt:  # its checkpoints are atomic: nothing finished is lost
            run_dir = Path(str(overrides["results-dir"])) / str(overrides["run-name"])
            print(
                f"interrupted; continue it: starfed simulate --resume {run_dir} --runtime local",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
    return simulate(overrides, as_float(options, "timeout"), gpus, ray_address)
