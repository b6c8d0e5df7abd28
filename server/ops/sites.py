"""``starfed server sites``: which site keys the SuperLink lets in, by site name.

Flower registers SuperNode public keys (``flwr supernode register|list|unregister``) and gives
each a random node id, but its list shows neither names nor keys, and with ``--format json`` it
exits 0 on errors (the answer says ``"success": false``). This module wraps those commands
against the local SuperLink connection that ``starfed server start`` wrote, checks ``success``,
and keeps the name <-> node id <-> key mapping in ``sites.json`` (one record per registration;
a removed record stays, because a removed key can never be registered again: Flower answers
"[code: 23] Public key already in use").

It also reads the SuperLink's log for SuperNodes that were turned away (``ApiError:2004``: key
not registered, ``ApiError:2001``: tried to register itself) and the gateway's for calls refused
for their clock (``ops.clock``), and prints each rejected key's SHA256 fingerprint, the
same fingerprint the site prints for its key.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from starfed.ops import clock, flower_runs, pki
from starfed.server.ops.layout import ServerFolder
from starfed.shared.files import write_atomic
from starfed.shared.privacy.unit import PrivacyUnit

FLWR_TIMEOUT_S = 60.0
SITES_LOCK = "sites.lock"  # in the server folder: one `sites add|remove` at a time
#: Fleet API errors of a refused SuperNode (flwr/supercore/error/base.py in Flower 1.42).
REFUSAL_CODES = {
    "2001": "tried to register itself (no registered key)",
    "2004": "key not registered",
}


#: Flower's node statuses of a key it no longer lets in (``flwr supernode list --verbose``).
UNREGISTERED = ("unregistered", "deleted")


class SitesError(RuntimeError):
    """Flower refused or could not be reached; one line, exit code 1."""


@dataclass(frozen=True)
class DeclaredPrivacy:
    """The privacy setting a site declared at its registration (``sites add
    --privacy-epsilon``): the server holds its rows to its release's bound, and a reply that
    says otherwise is a finding (``server.screening``: ``site-privacy``)."""

    epsilon: float  # its target ε per unit, over the federation's life
    unit: PrivacyUnit = PrivacyUnit.IMAGE

    def to_json(self) -> dict:
        return {"epsilon": self.epsilon, "unit": self.unit.value}

    @classmethod
    def from_json(cls, raw: dict) -> DeclaredPrivacy:
        epsilon = float(raw["epsilon"])
        if not epsilon > 0 or epsilon == float("inf"):
            raise ValueError(f"privacy epsilon {epsilon!r}")
        return cls(epsilon, PrivacyUnit(raw["unit"]))


@dataclass
class SiteRecord:
    """One registration of one site key, with the privacy it declared (None: not private)."""

    name: str
    node_id: int
    public_key: str  # the OpenSSH line (no comment)
    fingerprint: str
    added_at: str
    removed_at: str | None = None
    privacy: DeclaredPrivacy | None = None

    def to_json(self) -> dict:
        return with_privacy(self)

    @classmethod
    def from_json(cls, raw: dict) -> SiteRecord:
        privacy = raw.get("privacy")  # absent in a record written before issue 43
        declared = None if privacy is None else DeclaredPrivacy.from_json(privacy)
        return cls(**{**raw, "privacy": declared})


def with_privacy(row: SiteRecord | SiteStatus) -> dict:
    """A registration's row as JSON: its declared privacy written by its own ``to_json``."""
    privacy = None if row.privacy is None else row.privacy.to_json()
    return {**asdict(row), "privacy": privacy}


@dataclass
class Registry:
    """``sites.json``: every registration starfed made, removed ones included."""

    sites: list[SiteRecord] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> Registry:
        try:
            data = json.loads(path.read_text())
            return cls([SiteRecord.from_json(s) for s in data["sites"]])
        except FileNotFoundError:
            return cls()
        except (ValueError, TypeError, KeyError) as err:
            raise SitesError(f"{path} is damaged: {err}") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"sites": [s.to_json() for s in self.sites]}
        write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())

    def active(self, name: str) -> SiteRecord | None:
        return next((s for s in self.sites if s.name == name and not s.removed_at), None)

    def by_fingerprint(self, fingerprint: str) -> SiteRecord | None:
        """The latest registration of a key (a key is registered at most once)."""
        return next((s for s in reversed(self.sites) if s.fingerprint == fingerprint), None)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# --- Flower's CLI --------------------------------------------------------------------------


def flwr_json(folder: ServerFolder, *args: str) -> dict:
    """``flwr ARGS starfed --format json`` against this server; the answer if it succeeded.

    Without our config, ``flwr`` would create a default one and start a local SuperLink of its
    own: refuse instead.
    """
    if not folder.flwr_config.is_file():
        raise SitesError(f"no server set up in {folder.root}: run `starfed server start` first")
    try:
        return flower_runs.FlowerCli(folder.flwr_home).ask(*args, timeout=FLWR_TIMEOUT_S)
    except flower_runs.FlowerRunError as err:
        raise SitesError(_flower_message(str(err))) from None


def _flower_message(message: str) -> str:
    """Flower's error on one line, with what to do about the errors we know."""
    text = flower_runs.flower_message(message)
    if "SuperLink running?" in text:
        text += " (`starfed server start`)"
    elif "[code: 23]" in text:
        text += (
            " (registered before, perhaps with bare `flwr`: `starfed server sites add "
            "--adopt NAME KEY` records it under NAME)"
        )
    return text


# --- add, remove, list ---------------------------------------------------------------------


@contextlib.contextmanager
def _registering(folder: ServerFolder) -> Iterator[Registry]:
    """``sites.json`` read and written under the server folder's sites lock: what Flower is
    told and what sites.json keeps change as one, so two `sites add` at once both land (an
    advisory ``flock``: the kernel releases it when its holder dies)."""
    folder.root.mkdir(parents=True, exist_ok=True)
    with (folder.root / SITES_LOCK).open("a") as lock:
        deadline = time.monotonic() + FLWR_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SitesError(
                        f"another `starfed server sites` holds {lock.name} for "
                        f"over {FLWR_TIMEOUT_S:.0f} s"
                    ) from None
                time.sleep(0.1)
        try:
            yield Registry.load(folder.sites_file)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def add(
    folder: ServerFolder,
    name: str,
    public_key: Path,
    adopt: bool = False,
    privacy: DeclaredPrivacy | None = None,
) -> SiteRecord:
    """Register ``public_key`` for site ``name``, with the ``privacy`` it declares; refuse
    what Flower would refuse, but clearly. With ``adopt``, a key Flower has registered (bare
    ``flwr supernode register``, or a `sites add` that died between the two) is recorded under
    ``name`` with its node id instead."""
    pki.check_site_name(name)
    public_key = Path.cwd() / public_key.expanduser()  # flwr runs in the Flower home
    if not public_key.is_file():
        raise pki.SiteKeyError(f"Public key file {str(public_key)!r} does not exist")
    key = pki.read_public_key(public_key)
    with _registering(folder) as registry:
        if (current := registry.active(name)) is not None:
            raise SitesError(
                f"site {name} is registered (node {current.node_id}, key {current.fingerprint}); "
                "remove it first to give it a new key"
            )
        if (previous := registry.by_fingerprint(key.fingerprint)) is not None:
            if previous.removed_at:
                raise SitesError(
                    f"key {key.fingerprint} was removed from site {previous.name} on "
                    f"{previous.removed_at}; Flower never accepts a removed key again: the site "
                    "needs a new key (`starfed site keygen`)"
                )
            raise SitesError(f"key {key.fingerprint} already belongs to site {previous.name}")
        if adopt:
            node_id = flower_node_of(folder, key)
        else:
            answer = flwr_json(folder, "supernode", "register", str(public_key), "--name", name)
            node_id = int(answer["node-id"])
        record = SiteRecord(name, node_id, key.openssh, key.fingerprint, _now(), privacy=privacy)
        registry.sites.append(record)
        registry.save(folder.sites_file)
    return record


def flower_node_of(folder: ServerFolder, key: pki.SiteKey) -> int:
    """The node id Flower registered ``key`` under, from the SuperLink's database (its ``node``
    table: ops.flower_internals); ``SitesError`` when Flower does not hold the key."""
    pem = pki.flower_public_key_bytes(key.openssh)  # as Flower stores it
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{folder.database}?mode=ro", uri=True, timeout=10)
        ) as db:
            rows = db.execute(
                "SELECT node_id, status FROM node WHERE public_key = ?", (pem,)
            ).fetchall()
    except sqlite3.Error as err:
        raise SitesError(f"cannot read Flower's registry {folder.database}: {err}") from None
    live = [node_id for node_id, status in rows if status not in UNREGISTERED]
    if not live:
        raise SitesError(
            f"Flower holds no registration of key {key.fingerprint}: register it "
            "with `starfed server sites add` (without --adopt)"
        )
    return int(live[0])


def remove(folder: ServerFolder, name: str) -> SiteRecord:
    """Unregister site ``name``'s key: a running SuperNode with it stops within seconds."""
    with _registering(folder) as registry:
        record = registry.active(name)
        if record is None:
            raise SitesError(f"no registered site named {name} (see `starfed server sites list`)")
        try:
            flwr_json(folder, "supernode", "unregister", str(record.node_id))
        except SitesError as err:
            if "[code: 24]" not in str(err):  # "Node ID not found": already gone in Flower
                raise
        record.removed_at = _now()
        registry.save(folder.sites_file)
    return record


@dataclass
class SiteStatus:
    """A row of ``sites list``: our record joined with Flower's view of the node."""

    name: str | None
    node_id: int
    status: str  # registered (never connected) | online | offline | unregistered
    online_at: str | None
    offline_at: str | None
    fingerprint: str | None
    added_at: str | None = None
    removed_at: str | None = None
    privacy: DeclaredPrivacy | None = None

    def to_json(self) -> dict:
        return with_privacy(self)


def _flower_time(value: object) -> str | None:
    """Flower's ``2026-11-23 04:36:31Z`` as starfed writes times (``2026-11-23T04:36:31+00:00``),
    so one table does not mix two formats; text Flower may write otherwise is kept."""
    if value in (None, "", "N/A"):
        return None
    try:
        when = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return str(value)
    return when.isoformat(timespec="seconds")


def status(folder: ServerFolder) -> list[SiteStatus]:
    """Every site we registered and every node Flower knows, joined on the node id."""
    registry = Registry.load(folder.sites_file)
    nodes = {int(n["node-id"]): n for n in flwr_json(folder, "supernode", "list")["nodes"]}
    rows = []
    for record in registry.sites:
        node = nodes.pop(record.node_id, {})
        rows.append(
            SiteStatus(
                record.name,
                record.node_id,
                str(node.get("status") or ("unregistered" if record.removed_at else "unknown")),
                *_session(node),
                record.fingerprint,
                record.added_at,
                record.removed_at,
                record.privacy,
            )
        )
    for node_id, node in nodes.items():  # registered with bare `flwr`, not through starfed
        rows.append(SiteStatus(None, node_id, str(node.get("status")), *_session(node), None))
    return rows


def _session(node: dict) -> tuple[str | None, str | None]:
    """(online at, offline at) of a node's last session: Flower keeps the offline time of an
    earlier one while the node is online again (after a restart), which read as if it had
    gone offline after it came back."""
    online, offline = _flower_time(node.get("online-at")), _flower_time(node.get("offline-at"))
    if node.get("status") == "online" and online and offline and offline < online:
        offline = None
    return online, offline


# --- refused SuperNodes --------------------------------------------------------------------

_REFUSAL = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[,.]\d+ .*?"
    r"\[(?P<path>/v1/fleet/[a-z-]+)\]\[ApiError:(?P<code>\d+)\](?P<rest>.*)"
)
_PEM = re.compile(r"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", re.DOTALL)


@dataclass
class Refusal:
    """SuperNodes turned away with one key (or none), summed over the log."""

    fingerprint: str | None
    code: str
    reason: str
    count: int
    first: str
    last: str
    site: str | None = None  # the site this key was registered for, if any
    removed: bool = False
    offset_s: float | None = None  # clock skew: the site's clock minus the server's, last seen


_SKEW = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[,.]\d+ .*?refused (?P<path>/v1/fleet/[a-z-]+) "
    rf"from \S+: {clock.SKEW_LINE} (?P<offset>[-+]\d+(?:\.\d+)?) s key (?P<key>\S+)"
)


def parse_skews(lines: Iterable[str]) -> list[Refusal]:
    """The gateway's clock-skew lines grouped by key: Flower answers them as it answers a
    removed key, so only the gateway's log tells them apart (``ops.clock``)."""
    found: dict[str, Refusal] = {}
    for line in lines:
        if clock.SKEW_LINE not in line or (m := _SKEW.search(line)) is None:
            continue
        key, offset = m["key"], float(m["offset"])
        if (refusal := found.get(key)) is None:
            found[key] = refusal = Refusal(
                None if key.startswith("(") else key, "clock", "", 0, m["time"], m["time"]
            )
        refusal.count += 1
        refusal.last, refusal.offset_s = m["time"], offset
        refusal.reason = f"clock skew: {clock.describe(offset)}"
    return list(found.values())


def _log_files(folder: ServerFolder, log: Path | None = None) -> list[Path]:
    """A log (default: the SuperLink's) and its rotated predecessors, oldest first."""
    log = log or folder.superlink_log
    rotated = sorted(log.parent.glob(log.name + ".*"), key=lambda p: p.stat().st_mtime)
    return [*rotated, log] if log.exists() else rotated


def _refused_key(rest: str) -> str | None:
    match = _PEM.search(rest.replace("\\n", "\n"))
    if match is None:
        return None
    try:
        return pki.fingerprint(match.group(0))
    except pki.SiteKeyError:
        return None


def parse_refusals(lines: Iterable[str]) -> list[Refusal]:
    """Group the log's refusal lines by (key, code), in order of first appearance."""
    found: dict[tuple[str | None, str], Refusal] = {}
    for line in lines:
        if "ApiError:20" not in line or (m := _REFUSAL.search(line)) is None:
            continue
        code = m["code"]
        if code not in REFUSAL_CODES:
            continue
        key = (_refused_key(m["rest"]), code)
        if (refusal := found.get(key)) is None:
            found[key] = Refusal(key[0], code, REFUSAL_CODES[code], 1, m["time"], m["time"])
        else:
            refusal.count += 1
            refusal.last = m["time"]
    return list(found.values())


def refused(folder: ServerFolder) -> list[Refusal]:
    """Refused SuperNodes from the SuperLink log, and those refused for their clock from the
    gateway's, with the site name where the key is known."""
    registry = Registry.load(folder.sites_file)
    refusals = parse_refusals(_read_lines(_log_files(folder)))
    refusals += parse_skews(_read_lines(_log_files(folder, folder.gateway_log)))
    for refusal in refusals:
        if refusal.fingerprint and (record := registry.by_fingerprint(refusal.fingerprint)):
            refusal.site = record.name
            refusal.removed = bool(record.removed_at)
    return refusals


def _read_lines(paths: Sequence[Path]) -> Iterable[str]:
    for path in paths:
        with path.open(errors="replace") as f:
            yield from f
