"""What ``starfed site start`` was asked for, checked once (:func:`prepare`), and what the
SuperNode gets from it: its node-config file, its SuperExec secret, its command line.
The process that runs them is ``supernode``'s (docs/deployment.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from starfed.client.ops import dialling
from starfed.client.policy import POLICY_FILE, SERVER_FILE, SitePolicy, read_policy
from starfed.ops import pki, processes
from starfed.shared import addresses
from starfed.shared.config import TABLES
from starfed.shared.files import write_atomic

#: `starfed site start --device` (the knob table defines it; the CLI checks it at start).
DEFAULT_DEVICE = str(TABLES["run-config"]["device"].default)


class SiteError(RuntimeError):
    """Something the site engineer can fix; one line, exit code 1."""


@dataclass(frozen=True)
class SiteOptions:
    server: str  # HOST:PORT of the operator's gateway
    data: Path
    state: Path
    name: str
    device: str = DEFAULT_DEVICE
    ca: Path | None = None  # None only with insecure
    key: Path | None = None
    insecure: bool = False
    fingerprint: str = ""
    worker: bool = True  # answer messages in a long-lived site worker (starfed.client.worker)
    privacy: tuple[float, float] = (0.0, 0.0)  # the site's own target (ε, δ); ε 0: none
    give_up_s: float = dialling.GIVE_UP_S  # not reached once in this long: stop (0: never)
    privacy_unit: str = "image"  # what the site's ε protects: an image or a patient
    policy: Path | None = None  # --policy (None: the state folder's policy.toml, if any)
    server_certificate: str = ""  # sha256 of --ca's certificate ("": insecure)

    @property
    def worker_socket(self) -> Path:
        return self.state / "worker.sock"

    @property
    def superexec_secret(self) -> Path:
        return self.state / "superexec.secret"

    @property
    def run_file(self) -> Path:
        """The processes ``site start`` started (PIDs, start times), while they run."""
        return self.state / "run.json"

    def node_config(self) -> dict[str, str]:
        config = {
            "data-dir": str(self.data),
            "state-dir": str(self.state),
            "site-name": self.name,
            "device": self.device,
        }
        if self.worker:
            config["worker-socket"] = str(self.worker_socket)
        if self.privacy[0]:
            config["privacy-epsilon"], config["privacy-delta"] = map(str, self.privacy)
            config["privacy-unit"] = self.privacy_unit
        return config


def default_state_dir(name: str) -> Path:
    """``$XDG_DATA_HOME/starfed/sites/<name>`` (``~/.local/share/...``): the site's own, writable
    even when the data folder is a read-only mount."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "starfed" / "sites" / name


def site_name_from(data: Path) -> str:
    """A site name from the data folder's name: ``My Data`` -> ``My-Data``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", data.name).strip(".-")[:64] or "site"


def prepare(
    server: str,
    data: Path,
    *,
    ca: Path | None,
    key: Path | None,
    state: Path | None = None,
    name: str | None = None,
    device: str = DEFAULT_DEVICE,
    privacy: tuple[float, float] = (0.0, 0.0),
    insecure: bool = False,
    worker: bool = True,
    give_up_s: float = dialling.GIVE_UP_S,
    privacy_unit: str = "image",
    policy: Path | None = None,
) -> SiteOptions:
    """Check every input once, here; what comes out is what the SuperNode gets."""
    addresses.parse_address(server)  # ValueError: bad input
    data = data.expanduser().resolve()
    if not data.is_dir():
        raise SiteError(f"--data {data} is not a folder: a site without its data must not join")
    name = pki.check_site_name(name or site_name_from(data))
    fingerprint = ""
    if insecure:
        if key is not None:
            raise SiteError(
                "--key needs TLS: Flower refuses SuperNode authentication with --insecure"
            )
    else:
        if ca is None or key is None:
            raise SiteError("--ca and --key are required (or --insecure for a local test server)")
        ca = ca.expanduser().resolve()
        if not ca.is_file():
            raise SiteError(f"--ca {ca} is not a file: get ca.pem from the operator")
        key = key.expanduser().resolve()
        fingerprint = pki.read_private_key(key).fingerprint
    state = (state.expanduser() if state else default_state_dir(name)).resolve()
    if state == data or data in state.parents:
        raise SiteError(f"--state {state} must not be inside --data {data}")
    if not device.strip() or any(c.isspace() for c in device):
        raise SiteError(f"--device must be one word, e.g. auto, cpu, cuda:0; got {device!r}")
    if not give_up_s >= 0:
        raise SiteError(f"--give-up-after must be 0 (never) or more seconds, got {give_up_s}")
    policy = policy.expanduser().resolve() if policy else None
    if policy is not None and not policy.is_file():
        raise SiteError(f"--policy {policy} is not a file")
    server_certificate = certificate_sha256(ca) if ca is not None else ""
    check_policy(read_policy(policy, state), server_certificate)
    return SiteOptions(
        server,
        data,
        state,
        name,
        device,
        ca,
        key,
        insecure,
        fingerprint,
        worker,
        privacy,
        give_up_s,
        privacy_unit,
        policy,
        server_certificate,
    )


def certificate_sha256(ca: Path) -> str:
    """The sha256 of the ``ca.pem`` file (``sha256sum ca.pem``), by which the site's policy
    and record name the server it answers."""
    try:
        return hashlib.sha256(ca.read_bytes()).hexdigest()
    except OSError as err:
        raise SiteError(f"--ca {ca}: {err.strerror}") from None


def check_policy(policy: SitePolicy, server_certificate: str) -> None:
    """Refuse to start against a server the site's policy does not answer."""
    pinned = policy.server_certificate
    if pinned and pinned != server_certificate:
        found = server_certificate or "none (--insecure)"
        raise SiteError(
            f"the site's policy answers only the server certificate {pinned}; --ca is {found}"
        )


def write_node_config(path: Path, options: SiteOptions) -> None:
    """The node config as a TOML file: Flower reads a ``.toml`` path whole, so paths with
    spaces, quotes or any other character arrive unchanged (its ``k=v`` string form splits on
    spaces)."""
    path.write_text(tomli_w.dumps(options.node_config()), encoding="utf-8")


def write_site_terms(options: SiteOptions) -> None:
    """What the site's ClientApp reads in its state folder (``starfed.client.policy``): the
    policy in force (``--policy``, copied) and the sha256 of the server's ``ca.pem``."""
    if options.policy is not None and options.policy != options.state / POLICY_FILE:
        write_atomic(options.state / POLICY_FILE, options.policy.read_bytes())
    write_atomic(options.state / SERVER_FILE, options.server_certificate.encode())


def write_superexec_secret(path: Path) -> None:
    """A new random SuperExec secret (0600) on every start: the SuperNode's Runtime API asks it
    of whoever acquires the site's tasks."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(32))


def supernode_command(options: SiteOptions, node_config: Path, runtime_port: int) -> list[str]:
    command = [
        processes.flower_executable("flower-supernode"),
        "--superlink",
        options.server,
        "--node-config",
        str(node_config),
        "--host",
        "127.0.0.1",
        "--port",
        str(runtime_port),
        "--isolation",
        "process",
        "--superexec-auth-secret-file",
        str(options.superexec_secret),
    ]
    if options.insecure:
        return [*command, "--insecure"]
    return [
        *command,
        "--root-certificates",
        str(options.ca),
        "--auth-supernode-private-key",
        str(options.key),
    ]
