"""The commands' own knobs: options of one command that never travel in a Flower config.

The knob machinery (:class:`~starfed.shared.config.Knob`, ``parse``, ``Options``) and the
model's knobs (the run config's, a node's, the environment's) live in ``starfed.shared.config``;
the research commands' (``train-local``, ``simulate``, ``experiment``) live with the harness
they drive, ``starfed.simulations.research_knobs``; the options of the other commands —
``server start``'s gateway limits, ``predict``'s output format, ... — live here, with the layer
that uses them (docs/design.md#the-layout). :data:`SCHEMA` and :data:`TABLES` are the whole
table: the model's knobs, the research commands' and these; :func:`parse` reads from it.

Like ``starfed.shared.config``, this module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping

from starfed.shared import config
from starfed.shared.addresses import parse_address
from starfed.shared.knob import Knob, Value
from starfed.simulations.research_knobs import RESEARCH_KNOBS

ISOLATIONS = ("process", "subprocess")  # `starfed server start --isolation`
OUTPUT_FORMATS = ("csv", "json")  # `starfed predict --format`


#: Group "command": each knob names its command.
COMMAND_KNOBS: tuple[Knob, ...] = (
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

#: Every knob: the model's, the research commands' and the other commands'.
SCHEMA: tuple[Knob, ...] = config.SCHEMA + RESEARCH_KNOBS + COMMAND_KNOBS
#: Knob tables by where their values come from: Flower's configs, the environment, or one
#: command's options (``TABLES["server start"]``).
TABLES: dict[str, dict[str, Knob]] = config.tables(SCHEMA)


def parse(
    raw: Mapping[str, object], table: str = "run-config", names: Mapping[str, str] | None = None
) -> dict[str, Value]:
    """:func:`starfed.shared.config.parse` over every table, the commands' included."""
    return config.parse(raw, table, names, TABLES)
