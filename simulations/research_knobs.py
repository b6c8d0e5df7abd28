"""The research commands' own knobs: ``train-local``'s, ``simulate``'s and ``experiment``'s.

They live with ``simulations/``, the harness those commands drive, which reads them here
(``LocalRunOptions``); the command line builds their flags from the whole table
(``starfed.cli.command_knobs``: these, the other commands' and the model's). :data:`TABLES` is
the model's tables and these; :func:`parse` and :func:`knob` read from it.

Like ``starfed.shared.config``, this module imports nothing heavy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from starfed.shared import config
from starfed.shared.knob import Knob, Value
from starfed.shared.model.backbone_config import PAPER_VIT_TAGS

RUNTIMES = ("flower", "local")  # `starfed simulate --runtime` (docs/simulation.md)
#: The commands that run Flower simulations on Ray: they take its options (--ray-address, ...).
RAY_COMMANDS = ("simulate", "experiment")


def _ray_address(address: str) -> None:
    if any(c.isspace() for c in address) or address.startswith("ray://"):
        raise ValueError("expected host:port of a Ray cluster's head (not a Ray Client ray://)")


#: Group "command": each knob names its command(s); train-local's table also holds the model's
#: ``generative-replay`` (``starfed.shared.config``).
RESEARCH_KNOBS: tuple[Knob, ...] = (
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
        "follow",
        int,
        0,
        "follow a run that `flwr run .` submitted to the local SuperLink (its id; port "
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT, else 39091): its log without Flower's and Ray's "
        "warnings, to its end",
        "command",
        ge=0,
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
)

#: The model's tables and the research commands' (``TABLES["train-local"]``).
TABLES: dict[str, dict[str, Knob]] = config.tables(config.SCHEMA + RESEARCH_KNOBS)


def parse(
    raw: Mapping[str, object], table: str = "run-config", names: Mapping[str, str] | None = None
) -> dict[str, Value]:
    """:func:`starfed.shared.config.parse` over the model's and the research commands' tables."""
    return config.parse(raw, table, names, TABLES)


def knob(key: str, convert: Callable[[Any], Any] | None = None, table: str = "run-config") -> Any:
    """:func:`starfed.shared.config.knob` over the model's and the research commands' tables."""
    return config.knob(key, convert, table, TABLES)
