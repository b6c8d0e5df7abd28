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
    @property
    def certs(self) -> Path:
        return self.root / "certs"

    @property
    def ca_cert(self) -> Path:
        """Goes to every site: the SuperNode checks the server's certificate against it."""
        return self.certs / "ca.pem"

    @property
    def ca_key(self) -> Path:
        """Signs server certificates; never leaves this folder (better: an offline copy)."""
        return self.certs / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.certs / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.certs / "server.key"

    @property
    def site_keys(self) -> Path:
        """Key pairs made here for sites that do not make their own (``certs --site``)."""
        return self.root / "site-keys"

    def site_key(self, name: str) -> Path:
        return self.site_keys / f"{name}.key"

    @property
    def superexec_secret(self) -> Path:
        """Shared secret of the SuperLink and its SuperExec (process isolation)."""
        return self.root / "secrets" / "superexec.secret"

    # --- state ---
    @property
    def database(self) -> Path:
        """The SuperLink's state: registered sites, runs; survives restarts."""
        return self.root / "superlink.db"

    @property
    def flwr_home(self) -> Path:
        """FLWR_HOME of every Flower process here and of the operator's ``flwr`` CLI."""
        return self.root / "flwr-home"

    @property
    def flwr_config(self) -> Path:
        return self.flwr_home / "config.toml"

    @property
    def federation(self) -> Path:
        """The federation folder ``server round`` continues by default (docs/federation.md)."""
        return self.root / "federation"

    @property
    def app(self) -> Path:
        """The Flower app ``server round`` submits, generated from the installed package."""
        return self.root / "app"

    @property
    def run_file(self) -> Path:
        """What ``start`` started (PIDs, start times, addresses), for ``stop`` and ``status``."""
        return self.root / "run.json"

    @property
    def sites_file(self) -> Path:
        """Site names <-> SuperNode ids and keys: Flower's own list shows no names."""
        return self.root / "sites.json"

    # --- logs ---
    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def superlink_log(self) -> Path:
        """The SuperLink's log (timestamped, rotated): refused SuperNodes show up here."""
        return self.logs / "superlink.log"

    def output_log(self, process: str) -> Path:
        """A managed process's stdout and stderr (start-up errors before its own log opens)."""
        return self.logs / f"{process}.out"

    @property
    def gateway_log(self) -> Path:
        return self.logs / "gateway.log"
