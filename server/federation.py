"""The federation's home: everything the server remembers across runs, in one folder.

A federation lives longer than any server run: sites bring new tasks whenever they happen, and
each run performs aggregation steps over what they bring, continuing where the last one stopped
(docs/federation.md). The folder holds::

    federation.json   its identity: id, creation time, backbone fingerprint and dims
    codebook.bin      the codebook with mixtures after the last completed phase, and in its
                      metadata the protocol position (the step, its completed phases, the
                      classes in play): one atomic file, so a checkpoint is never half written
    step-start.bin    the codebook when the step in progress started (a failed step rolls back)
    registry.json     every class: the step that registered it, the sites that brought it, when
    history.jsonl     one record per finished step: status, phases, participation, scores
    metrics.json      the federation's scores after the last server run (``server.app``)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from starfed.shared.codebook.framing import CodebookError, read_message
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic

if TYPE_CHECKING:  # decoding a codebook needs torch: imported where a codebook is decoded, so
    # the folder's records can be read without it (`starfed server status`)
    from starfed.shared.codebook.codebook import Codebook

IDENTITY_FILE = "federation.json"
CODEBOOK_FILE = "codebook.bin"
STEP_START_FILE = "step-start.bin"
REGISTRY_FILE = "registry.json"
HISTORY_FILE = "history.jsonl"
METRICS_FILE = "metrics.json"
POSITION_KEY = "position"  # codebook metadata key of the protocol position
# Codebook metadata key of the version line: a rollback starts a new one, so a version a site
# holds from a rolled-back step is never mistaken for the same version of the new line.
EPOCH_KEY = "epoch"


class FederationError(ValueError):
    """A federation folder that cannot be used (other backbones, damaged files)."""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Registration:
    """What the federation knows of one class besides its codebook entry."""

    step: int  # the step that registered it
    registered: str = field(default_factory=now)
    sites: dict[str, str] = field(default_factory=dict)  # site -> when it first brought it


@dataclass(frozen=True)
class Position:
    """Where the protocol stands: ``step`` is in progress (``running``) with the phases
    ``done`` ("<phase>/<round>") and ``in_play`` classes, or it is the next step to run."""

    step: int = 0
    running: bool = False
    done: tuple[str, ...] = ()
    in_play: tuple[str, ...] = ()

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> Position:
        raw = json.loads(metadata.get(POSITION_KEY, "{}"))
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


@dataclass(frozen=True)
class Checkpoint:
    """What ``codebook.bin`` says without decoding its tensors (no torch): for views of the
    folder (``starfed server status``, an interrupted run's marker)."""

    version: int
    classes: tuple[str, ...]
    frozen: frozenset[str]
    position: Position


class Federation:
    """One federation folder (created on first use)."""

    def __init__(self, root: str | Path, fingerprint: str, dims: ModelDims) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        identity_path = self.root / IDENTITY_FILE
        if identity_path.is_file():
            identity = self._read(IDENTITY_FILE, {})
            if identity.get("fingerprint") != fingerprint:
                raise FederationError(
                    f"{self.root} is a federation of other backbones "
                    f"({str(identity.get('fingerprint'))[:12]}…, these are {fingerprint[:12]}…)"
                )
        else:
            identity = {"id": uuid.uuid4().hex, "created": now(), "fingerprint": fingerprint,
                        "dims": asdict(dims)}  # fmt: skip
            write_atomic(identity_path, json.dumps(identity, indent=2).encode())
        self.id: str = identity["id"]
        self.fingerprint = fingerprint
        self.dims = dims
        self.registry: dict[str, Registration] = {
            name: Registration(**entry) for name, entry in self._read(REGISTRY_FILE, {}).items()
        }

    @classmethod
    def open(cls, root: str | Path) -> Federation:
        """An existing federation folder, with the backbones its identity names: for readers
        that load no backbones (``starfed server export``, the codebook service)."""
        path = Path(root).expanduser()
        if not (path / IDENTITY_FILE).is_file():
            raise FederationError(f"{path} is not a federation folder (no {IDENTITY_FILE})")
        try:
            identity = json.loads((path / IDENTITY_FILE).read_text())
            return cls(path, identity["fingerprint"], ModelDims(**identity["dims"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise FederationError(f"{path / IDENTITY_FILE} is damaged: {err!r}") from None

    def metrics(self) -> dict:
        """``metrics.json`` of the last server run ({} before the first)."""
        return self._read(METRICS_FILE, {})

    def _read(self, name: str, default):
        path = self.root / name
        try:
            return json.loads(path.read_text()) if path.is_file() else default
        except json.JSONDecodeError as err:
            raise FederationError(f"{path} is damaged: {err}") from None

    def _load(self, name: str) -> Codebook:
        from starfed.shared.codebook.codebook import Codebook

        try:
            return Codebook.load(self.root / name, fingerprint=self.fingerprint, dims=self.dims)
        except CodebookError as err:
            raise FederationError(f"{self.root / name}: {err}") from None

    # --- the codebook and the position ----------------------------------------------------

    def codebook(self) -> Codebook:
        """The codebook after the last completed phase (empty for a new federation)."""
        from starfed.shared.codebook.codebook import Codebook

        if not (self.root / CODEBOOK_FILE).is_file():
            metadata = {"federation": self.id, EPOCH_KEY: uuid.uuid4().hex}
            return Codebook(self.fingerprint, self.dims, metadata=metadata)
        return self._load(CODEBOOK_FILE)

    @staticmethod
    def position(codebook: Codebook) -> Position:
        return Position.from_metadata(codebook.metadata)

    def last_checkpoint(self) -> Checkpoint | None:
        """The saved codebook's version, classes and position, None before the first one."""
        path = self.root / CODEBOOK_FILE
        if not path.is_file():
            return None
        try:
            message = read_message(path)
        except CodebookError as err:
            raise FederationError(str(err)) from None
        if message.backbone_fingerprint != self.fingerprint:
            raise FederationError(f"{path} holds a codebook of other backbones")
        names = tuple(entry.name for entry in message.entries)
        frozen = frozenset(entry.name for entry in message.entries if entry.frozen)
        return Checkpoint(message.version, names, frozen, Position.from_metadata(message.metadata))

    def checkpoint(self, codebook: Codebook, position: Position) -> Codebook:
        """Save ``codebook`` with ``position`` in its metadata (one atomic write)."""
        metadata = {**codebook.metadata, "federation": self.id,
                    POSITION_KEY: json.dumps(asdict(position))}  # fmt: skip
        saved = replace(codebook, metadata=metadata)
        saved.save(self.root / CODEBOOK_FILE)
        return saved

    # --- steps ----------------------------------------------------------------------------

    def begin_step(self, codebook: Codebook, step: int) -> Codebook:
        codebook.save(self.root / STEP_START_FILE)
        return self.checkpoint(codebook, Position(step, running=True))

    def register(self, names: list[str], step: int, brought: dict[str, list[str]]) -> None:
        """Record newly registered classes and which sites brought which class."""
        for name in names:
            self.registry.setdefault(name, Registration(step))
        when = now()
        for name, sites in brought.items():
            for site in sites:
                self.registry[name].sites.setdefault(site, when)
        self._write_registry()

    def unregister(self, names: list[str]) -> None:
        """Forget classes that left the step in progress (no site sent their statistics), so
        the step that brings them again registers them, and scores group them under it."""
        for name in names:
            self.registry.pop(name, None)
        self._write_registry()

    def _write_registry(self) -> None:
        registry = {name: asdict(entry) for name, entry in self.registry.items()}
        write_atomic(self.root / REGISTRY_FILE, json.dumps(registry, indent=2).encode())

    def history(self) -> list[dict]:
        """One record per finished step, in step order (a record written again wins)."""
        path = self.root / HISTORY_FILE
        if not path.is_file():
            return []
        records = {}
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[(record["step"], record.get("attempt", 0))] = record
        return [records[key] for key in sorted(records)]

    def end_step(self, record: dict, codebook: Codebook | None) -> Codebook:
        """Close the step in progress with its ``record``; returns the codebook to go on
        with. A failed step (``codebook`` None) goes back to the codebook it started from, and
        the next step keeps its index."""
        history = self.root / HISTORY_FILE
        lines = history.read_text() if history.is_file() else ""
        write_atomic(history, (lines + json.dumps(record) + "\n").encode())
        step = record["step"]
        if codebook is None:
            start = self._load(STEP_START_FILE)
            metadata = {**start.metadata, EPOCH_KEY: uuid.uuid4().hex}
            self.registry = {n: r for n, r in self.registry.items() if r.step != step}
            self._write_registry()
            return self.checkpoint(replace(start, metadata=metadata), Position(step))
        return self.checkpoint(codebook, Position(step + 1))
