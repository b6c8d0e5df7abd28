"""The server folder: where an operator's deployment keeps its keys, state and logs.

One folder holds everything ``starfed server ...`` reads or writes, so a deployment can be
backed up, moved or inspected as a unit, and every command finds the same files. This class is
the one place that names them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from starfed.shared.config import environment, environment_variable
from starfed.shared.knob import as_str

#: ``--dir`` default when the environment does not name a folder.
DEFAULT_DIR = "starfed-server"
DIR_ENV = environment_variable("server-dir")


def default_dir() -> Path:
    return Path(as_str(environment(), "server-dir") or DEFAULT_DIR)


class _Place:
    """One path of the server folder, named once: ``folder.ca_cert`` is ``<root>/certs/ca.pem``
    (a descriptor; ``under``: the folder it is in, else the root)."""

    def __init__(self, name: str, under: _Place | None = None) -> None:
        self.name, self.under = name, under

    def __get__(self, folder: ServerFolder, owner: type | None = None) -> Path:
        return (folder.root if self.under is None else self.under.__get__(folder)) / self.name


@dataclass(frozen=True)
class ServerFolder:
    """Paths of one deployment; nothing is created until a command writes it."""

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> ServerFolder:
        return cls(Path(path).expanduser().resolve())

    def create(self) -> None:
        """Make the folder, private to the operator if it is new (keys, database, logs)."""
        if not self.root.exists():
            self.root.mkdir(mode=0o700, parents=True)

    # --- certificates and keys (``starfed server certs``) ---
    certs = _Place("certs")
    #: Goes to every site: the SuperNode checks the server's certificate against it.
    ca_cert = _Place("ca.pem", certs)
    #: Signs server certificates; never leaves this folder (better: an offline copy).
    ca_key = _Place("ca.key", certs)
    server_cert = _Place("server.pem", certs)
    server_key = _Place("server.key", certs)
    #: Key pairs made here for sites that do not make their own (``certs --site``).
    site_keys = _Place("site-keys")
    #: Shared secret of the SuperLink and its SuperExec (process isolation).
    superexec_secret = _Place("superexec.secret", _Place("secrets"))

    def site_key(self, name: str) -> Path:
        return self.site_keys / f"{name}.key"

    # --- state ---
    #: The SuperLink's state: registered sites, runs; survives restarts.
    database = _Place("superlink.db")
    #: FLWR_HOME of every Flower process here and of the operator's ``flwr`` CLI.
    flwr_home = _Place("flwr-home")
    flwr_config = _Place("config.toml", flwr_home)
    #: The federation folder ``server run`` continues by default (docs/federation.md).
    federation = _Place("federation")
    #: The Flower app ``server run`` submits, generated from the installed package.
    app = _Place("app")
    #: What ``start`` started (PIDs, start times, addresses), for ``stop`` and ``status``.
    run_file = _Place("run.json")
    #: Site names <-> SuperNode ids and keys: Flower's own list shows no names.
    sites_file = _Place("sites.json")

    # --- logs ---
    logs = _Place("logs")
    #: The SuperLink's log (timestamped, rotated): refused SuperNodes show up here.
    superlink_log = _Place("superlink.log", logs)
    gateway_log = _Place("gateway.log", logs)

    def run_log(self, run_id: int) -> Path:
        """What ``server run`` streamed of a run's log, with Flower's lines the terminal leaves
        out (``flwr log RUN --show`` has it too, while the SuperLink keeps the run)."""
        return self.logs / f"run-{run_id}.log"

    def output_log(self, process: str) -> Path:
        """A managed process's stdout and stderr (start-up errors before its own log opens)."""
        return self.logs / f"{process}.out"
