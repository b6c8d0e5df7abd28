"""The commands' own knobs: options of one command that never travel in a Flower config.

The knob machinery (:class:`~starfed.shared.config.Knob`, ``parse``, ``Options``) and the
model's knobs (the run config's, a node's, the environment's) live in ``starfed.shared.config``;
the options that belong to a command — ``server start``'s gateway limits, ``predict``'s output
format, the Ray options of ``simulate`` and ``experiment``, ... — live here, with the layer that
uses them (docs/design.md#the-layout). :data:`SCHEMA` and :data:`TABLES` are the whole table:
the model's knobs and these; :func:`parse` and :func:`knob` read from it.

Like ``starfed.shared.config``, this module imports nothing heavy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from starfed.shared import config
from starfed.shared.addresses import parse_address
from starfed.shared.knob import Knob, Value
from starfed.shared.model.backbone_config import PAPER_VIT_TAGS

RUNTIMES = ("flower", "local")  # `starfed simulate --runtime` (docs/simulation.md)
#: The commands that run Flower simulations on Ray: they take its options (--ray-address, ...).
RAY_COMMANDS = ("simulate", "experiment")
ISOLATIONS = ("process", "subprocess")  # `starfed server start --isolation`
OUTPUT_FORMATS = ("csv", "json")  # `starfed predict --format`


def _ray_address(address: str) -> None:
    if any(c.isspace() for c in address) or address.startswith("ray://"):
        raise ValueError("expected host:port of a Ray cluster's head (not a Ray Client ray://)")


#: Group "command": each knob names its command(s); a command's table holds its own knobs
#: (train-local's also the model's ``generative-replay``, in ``starfed.shared.config``).
COMMAND_KNOBS: tuple[Knob, ...] = (
    Knob(
        "cache-dir",
        str,
        "",
        'reuse decoded images across runs; "": no cache',
        "command",
        path=True,
        command="train-local",
    ),
    Knob(
        "download",
        bool,
        False,
        "fetch the paper preset's weights from the hub",
        "command",
        command="train-local",
    ),
    Knob(
        "vit-tag",
        str,
        "augreg_in21k",
        "which ViT weights --download fetches",
        "command",
        choices=PAPER_VIT_TAGS,
        command="train-local",
    ),
    Knob(
        "classify-with-keys",
        bool,
        False,
        "ablation: predict with the first-level keys alone "
        "(evaluation only; a federation's: the starfed-keys baseline)",
        "command",
        command="train-local",
    ),
    Knob(
        "threads",
        int,
        os.cpu_count() or 1,
        "torch CPU threads",
        "command",
        ge=1,
        command="train-local",
    ),
    Knob(
        "runtime",
        str,
        "flower",
        "where the apps run: flower (a SuperLink and Ray, as "
        "deployed) or local (in this process, sites one after another: no start-up cost)",
        "command",
        choices=RUNTIMES,
        command="simulate",
    ),
    Knob(
        "runtime",
        str,
        "local",
        "where the starfed cells' federations run: local (in each "
        "cell's process: no start-up cost) or flower (a `starfed simulate` run per cell: a "
        "SuperLink and Ray, --ray-address)",
        "command",
        choices=RUNTIMES,
        command="experiment",
    ),
    Knob(
        "resume",
        str,
        "",
        "continue an interrupted simulation: its run folder (its own settings, saved there)",
        "command",
        path=True,
        command="simulate",
    ),
    Knob(
        "timeout",
        float,
        3600.0,
        "seconds for the whole run (flower runtime; experiment: per cell)",
        "command",
        gt=0,
        command=RAY_COMMANDS,
    ),
    Knob(
        "gpus-per-client",
        float,
        0.0,
        "GPU share of each simulated client (Flower's "
        "client-resources-num-gpus; 0.25: four clients share a GPU; 0: clients see no GPU)",
        "command",
        ge=0,
        command=RAY_COMMANDS,
    ),
    Knob(
        "ray-address",
        str,
        "",
        "an existing Ray cluster to run the simulated clients on "
        "(the head's address, e.g. 10.0.0.1:6379; docs/simulation.md); empty: RAY_ADDRESS "
        "when set, else a Ray instance of the run's own",
        "command",
        check=_ray_address,
        command=RAY_COMMANDS,
    ),
    Knob(
        "jobs",
        int,
        1,
        "cells run at once, each in its own process (1: one after another), "
        "each with its share of this machine's cores (OMP_NUM_THREADS, unless set)",
        "command",
        ge=1,
        command="experiment",
    ),
    Knob(
        "json",
        bool,
        False,
        "print a JSON summary on stdout (the progress lines stay on stderr)",
        "command",
        command="experiment",
    ),
    Knob("batch-size", int, 64, "images per forward pass", "command", ge=1, command="predict"),
    Knob("format", str, "csv", "output", "command", choices=OUTPUT_FORMATS, command="predict"),
    Knob(
        "cache",
        str,
        "",
        'where --from keeps its copy; "": $XDG_CACHE_HOME (or ~/.cache)/starfed/codebook',
        "command",
        path=True,
        command="predict",
    ),
    Knob(
        "plot",
        str,
        "confusion_matrix.png",
        "PNG to write",
        "command",
        path=True,
        command="evaluate",
    ),
    Knob(
        "listen",
        str,
        "0.0.0.0:9092",
        "public HOST:PORT of the gateway",
        "command",
        check=parse_address,
        command="server start",
    ),
    Knob(
        "internal-port",
        int,
        9093,
        "the SuperLink's port on 127.0.0.1, serving Fleet, Control and Runtime APIs",
        "command",
        ge=1,
        le=65535,
        command="server start",
    ),
    Knob(
        "isolation",
        str,
        "process",
        "process: our SuperExec, authenticated with a shared "
        "secret; subprocess: Flower's own (its task API is then open to local users)",
        "command",
        choices=ISOLATIONS,
        command="server start",
    ),
    Knob(
        "max-body-mib",
        int,
        65,
        "gateway: largest body of a call signed by a registered site "
        "(the codebook wire limit, 64 MiB, plus an envelope)",
        "command",
        ge=1,
        command="server start",
    ),
    Knob(
        "max-per-address",
        int,
        32,
        "gateway: connections at once from one address (sites behind one NAT address share it)",
        "command",
        ge=1,
        command="server start",
    ),
    Knob(
        "listen",
        str,
        "0.0.0.0:9095",
        "HOST:PORT",
        "command",
        check=parse_address,
        command="server serve",
    ),
    Knob("max-mib", int, 64, "largest reply", "command", ge=1, command="server serve"),
    Knob(
        "listen",
        str,
        "127.0.0.1:9097",
        "HOST:PORT of the page (no authentication: keep it on 127.0.0.1 and use an SSH tunnel)",
        "command",
        check=parse_address,
        command="server dashboard",
    ),
    Knob(
        "refresh-s",
        float,
        5.0,
        "seconds between the page's updates",
        "command",
        ge=1,
        command="server dashboard",
    ),
    Knob("out", str, "site.key", "private key file", "command", path=True, command="site keygen"),
    Knob(
        "site",
        int,
        1,
        "whose share of the images to write: site 1 to --sites",
        "command",
        ge=1,
        command="site data",
    ),
    Knob(
        "arrived",
        int,
        0,
        "the tasks that have arrived: the first N get their folders (0: every task)",
        "command",
        ge=0,
        command="site data",
    ),
)

#: Every knob: the model's and the commands'.
SCHEMA: tuple[Knob, ...] = config.SCHEMA + COMMAND_KNOBS
#: Knob tables by where their values come from: Flower's configs, the environment, or one
#: command's options (``TABLES["server start"]``).
TABLES: dict[str, dict[str, Knob]] = config.tables(SCHEMA)


def parse(
    raw: Mapping[str, object], table: str = "run-config", names: Mapping[str, str] | None = None
) -> dict[str, Value]:
    """:func:`starfed.shared.config.parse` over every table, the commands' included."""
    return config.parse(raw, table, names, TABLES)


def knob(key: str, convert: Callable[[Any], Any] | None = None, table: str = "run-config") -> Any:
    """:func:`starfed.shared.config.knob` over every table, the commands' included."""
    return config.knob(key, convert, table, TABLES)
