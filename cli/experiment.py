"""`starfed experiment GRID`: a grid of scenarios × methods × seeds, its table and plots.

The grid file is read and every run-config key in it checked (``starfed.simulations.grid``)
before anything runs: a bad grid is one line and exit code 2. Exit code 1 means some cell
failed (the others still ran; its ``log.txt`` says why); 0, every cell is complete; 130,
interrupted (Ctrl-C: the running cells are stopped, the complete ones stay).
"""

from __future__ import annotations

import argparse
import json
import sys

from starfed.cli._common import ray_options
from starfed.cli.flags import add_command, parsed, same_name, switch
from starfed.ops.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from starfed.shared.knob import ConfigError, as_float, as_int, as_str, writable_dir
from starfed.simulations.grid import load, shipped_grids
from starfed.simulations.methods import FLOWER_METHODS

COMMAND = "experiment"
FLAGS = (
    *same_name("results-dir", "runtime", "jobs", "timeout", "gpus-per-client", "ray-address"),
    switch("--json", "json", True),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, COMMAND, _main, FLAGS)
    parser.add_argument(
        "grid",
        metavar="GRID",
        help=f"a grid file (TOML), or a shipped grid: {', '.join(shipped_grids())}",
    )


def _main(args: argparse.Namespace) -> int:
    """run a grid of scenarios × methods × seeds; write a paper-style table and plots

    Run every cell (scenario × method × seed) of a grid file, --jobs at once (default one after
    another), each in its own process, into <results-dir>/<experiment>/<cell>/. A complete cell
    is skipped, so re-running continues an interrupted experiment. Writes table.md (FAA,
    forgetting, prompt selection, bytes per site per round, wall time: mean ± sd over seeds) and
    plots. docs/results.md describes grids and methods. With --runtime flower each starfed cell
    is a `starfed simulate` run; --ray-address (or RAY_ADDRESS) runs its clients on an existing
    Ray cluster's nodes (docs/simulation.md).
    """
    values, options, names = parsed(args, FLAGS, COMMAND)
    experiment = load(args.grid)
    gpus, ray_address = ray_options(options)
    local_only = [m for m in experiment.methods if m not in FLOWER_METHODS]
    if options["runtime"] == "flower" and local_only:
        raise ConfigError(
            f"--runtime flower: methods {', '.join(local_only)} run on the local runtime only "
            f"(Flower runs {', '.join(FLOWER_METHODS)}): give them a grid of their own"
        )
    results = writable_dir(as_str(values, "results-dir"), names.get("results-dir", "results-dir"))
    from starfed.simulations.cell import Runtime
    from starfed.simulations.experiment import run_experiment  # matplotlib: only now

    runtime = Runtime(as_str(options, "runtime"), as_float(options, "timeout"), gpus, ray_address)
    try:
        summary = run_experiment(experiment, results.resolve(), runtime, as_int(options, "jobs"))
    except KeyboardInterrupt:  # the running cells are stopped; complete ones stay
        print(
            f"starfed experiment: interrupted; the same command continues "
            f"({results / experiment.name})",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if options["json"]:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        with open(summary["table"]) as table:
            print(table.read())
        print(f"table: {summary['table']}\nplots: {', '.join(summary['plots'])}")
    return EXIT_FAILED if summary["failed"] else EXIT_OK
