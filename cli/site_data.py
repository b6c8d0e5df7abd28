"""``starfed site data``: a site's data folder from an ImageFolder root (default: the bundled
mini set), for a trial or a demo without images of one's own.

The site's share is the simulation's (``shared/data/scenario.py``: a Dirichlet partition over
``--sites`` sites, seeded), so ``site data --site 2 --sites 5`` writes what ``starfed simulate``
gives its second site: task folders of links, and ``test/`` (docs/sites.md). Writing it again
with more ``--arrived`` tasks adds their folders, as a new task arrives at a real site.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from starfed.cli._common import guard
from starfed.cli.flags import Flag, add_command, parsed, same_name
from starfed.ops.exit_codes import EXIT_OK
from starfed.shared.knob import ConfigError, as_int

COMMAND = "site data"
FLAGS = (
    *same_name("data-root"),
    Flag("--sites", ("num-sites",)),
    Flag("--tasks", ("num-tasks",)),
    *same_name("classes-per-task", "alpha", "seed", "site", "arrived"),
)


def add_action(actions: argparse._SubParsersAction) -> None:
    """Register ``data`` on the ``site`` group."""
    parser = add_command(actions, "data", guard()(run_data), FLAGS, table=COMMAND)
    parser.add_argument("folder", type=Path, metavar="DATA", help="the site's data folder to fill")


def run_data(args: argparse.Namespace) -> int:
    """write a site's data folder from the bundled images (or --data-root)

    Fill DATA with site --site's share of Split CropDiseases over --sites sites: one folder per
    task that has arrived (task-00, task-01, ...; class folders of links to the images) and
    test/. Run again with a larger --arrived to add the next task's folder. Then `starfed site
    check --data DATA` and `starfed site start --data DATA ...` (docs/deployment.md).
    """
    values, own, names = parsed(args, FLAGS, COMMAND)
    sites, site = as_int(values, "num-sites"), as_int(own, "site")
    if site > sites:
        raise ConfigError(f"{names.get('site', '--site')} {site}: expected at most --sites {sites}")
    from starfed.shared.data.scenario import Scenario, ScenarioConfig  # numpy, datasets: now

    scenario = Scenario(ScenarioConfig.from_config(values | {"arrival-offset": 0}))
    arrived = as_int(own, "arrived") or scenario.n_tasks
    if arrived > scenario.n_tasks:
        raise ConfigError(f"--arrived {arrived}: the split has {scenario.n_tasks} tasks (--tasks)")
    scenario.write_site(site - 1, args.folder, step=arrived - 1)
    tasks = sorted(p.name for p in args.folder.iterdir() if p.name.startswith("task-"))
    print(f"{args.folder}: site {site} of {sites}, tasks {', '.join(tasks)} and test/ (links)")
    print(f"next: starfed site check --data {args.folder}")
    return EXIT_OK
