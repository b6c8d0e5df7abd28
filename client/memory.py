"""A site's memory across messages, restarts and runs: its state folder.

In deployment every message starts a fresh ClientApp process, and a site may restart or be
offline for steps, so what a site must remember lives on disk (docs/sites.md):

* ``codebook.bin``: the last codebook received, so the server can send only what changed (a
  ``Delta``) — a site that lost it simply receives the whole codebook again, in parts when it
  is too large for one message (staged in ``codebook-parts/`` until the last arrived, kept
  across steps while the catch-up goes on: ``HeldCodebook.drop_idle_staging``);
* ``site.json``: which federation that codebook belongs to, which of the site's tasks are
  completed (all their classes frozen) and at which federation step, and the task folders its
  last sync saw (what the step's evaluation covers, even when it travels with the next step's
  sync and a task folder appeared in between);
* ``privacy.json``, for a site with the privacy setting: what it has released of each class's
  images, and which class each protected unit is in (``PrivacyLedger``), so a restart never
  resets its privacy budget. It belongs to the images, not to a federation: joining another
  federation keeps it.

All are written atomically.
"""

from __future__ import annotations

import fcntl
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from starfed.shared.codebook import parts
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.held import HeldCodebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic
from starfed.shared.privacy.accountant import Release

logger = logging.getLogger(__name__)

STATE_FILE = "site.json"
CODEBOOK_FILE = "codebook.bin"
PRIVACY_FILE = "privacy.json"
PRIVACY_LOCK = "privacy.lock"


#: The ledger key of the releases that a site before issue 44 charged to all its classes at once
#: (the patient unit's site-wide budget, when patients spanned classes): every key took part in
#: them, so every key's history counts them.
SITE_WIDE = "*site*"
#: A class's count in the ledger when its noisy count was drawn and fell under the threshold
#: that hides a class of one unit: the class is not announced, and its images are not used.
NOT_ANNOUNCED = 0


@dataclass
class PrivacyLedger:
    """A private site's releases by ledger key: every release (its noise multiplier, and its
    sampling when DP-SGD's) that depended on the key's images, in order, and the noisy image
    count it drew (once; every later message reuses it; ``NOT_ANNOUNCED`` when it fell under
    the threshold).

    A key is the class key of a class folder. ``units`` says which key each protected unit (an
    image's content digest, or ``patient <name>``) belongs to: the first class it was seen in.
    A unit is used in that class only, so removing it changes one key's releases, and a folder
    renamed or copied under another name does not release its images again under a new key.
    ``aliases`` (class key -> ledger key) are read from ledgers written before units were kept,
    where a renamed class folder continued its old key.
    """

    releases: dict[str, list[Release]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)  # protected unit -> ledger key
    aliases: dict[str, str] = field(default_factory=dict)  # class key -> ledger key

    def record(self, keys: list[str], release: Release) -> None:
        for key in keys:
            self.releases.setdefault(key, []).append(release)

    def key(self, class_key: str) -> str:
        """The ledger key of a class (its own, unless an old ledger's alias continues another)."""
        return self.aliases.get(class_key, class_key)

    def past(self, key: str) -> list[Release]:
        """The releases a key's units took part in: its own, after the site-wide ones."""
        return [*self.releases.get(SITE_WIDE, []), *self.releases.get(key, [])]

    def class_keys(self) -> list[str]:
        """Every class key with a release."""
        return [key for key in self.releases if key != SITE_WIDE]

    @classmethod
    def from_json(cls, raw: dict) -> PrivacyLedger:
        """The ledger from ``privacy.json``; one written before units were kept gives each of
        its keys' image digests (``images``) to that key."""
        releases = {
            str(k): [Release.from_json(r) for r in v] for k, v in raw.get("releases", {}).items()
        }
        counts = {str(k): int(v) for k, v in raw.get("counts", {}).items()}
        units = {str(d): str(k) for k, v in raw.get("images", {}).items() for d in v}
        units |= {str(u): str(k) for u, k in raw.get("units", {}).items()}
        aliases = {str(k): str(v) for k, v in raw.get("aliases", {}).items()}
        return cls(releases, counts, units, aliases)

    def to_json(self) -> dict:
        return {
            "releases": {k: [r.to_json() for r in v] for k, v in self.releases.items()},
            "counts": self.counts,
            "units": self.units,
            "aliases": self.aliases,
        }


class SiteMemory:
    """The state folder of one site, for one backbone pair."""

    def __init__(self, state_dir: str | Path, fingerprint: str, dims: ModelDims) -> None:
        self.root = Path(state_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.dims = dims
        self.federation = ""  # id of the federation whose codebook is held
        self.completed: dict[str, int] = {}  # task folder name -> federation step
        self.synced: tuple[str, ...] | None = None  # task folders at the last sync (None: none)
        self.held = HeldCodebook(self.root / CODEBOOK_FILE, fingerprint=fingerprint, dims=dims)

    def _read_state(self) -> None:
        """site.json as it is now (another worker process of a simulation may have written)."""
        path = self.root / STATE_FILE
        if path.is_file():
            state = json.loads(path.read_text())
            self.federation = str(state.get("federation", ""))
            self.completed = {str(k): int(v) for k, v in state.get("completed", {}).items()}
            synced = state.get("synced")
            self.synced = None if synced is None else tuple(str(name) for name in synced)

    def join(self, federation: str) -> None:
        """Follow ``federation``; a site that moves to another one starts its memory afresh."""
        self._read_state()
        if federation != self.federation:
            if self.federation:
                logger.warning("state of federation %s replaced by %s", self.federation, federation)
            self.federation, self.completed, self.synced = federation, {}, None
            self.held.forget()
            self._save()

    def held_version(self, epoch: str) -> int:
        """The version of the held codebook if it is of this federation's version line
        ``epoch``, else 0 (``HeldCodebook``'s rule)."""
        return self.held.version_for(Lineage(self.federation, epoch))

    def receive(self, data: bytes) -> Codebook:
        """The codebook a message carries: as sent, or the held one with a delta applied
        (``CodebookError`` for a delta that does not apply: the server sends the whole
        codebook next)."""
        return self.held.receive(data)

    def catch_up(self, data: bytes, label: parts.Label, step: int, dtype: str) -> bytes:
        """Stage the part ``label`` names of a codebook too large for one message; once every
        part is, it is held (``HeldCodebook.stage``; ``CodebookError`` for a part it refuses).
        The version each part is staged at now (``Staging.versions``)."""
        self.held.stage(data, label, step, dtype)
        return self.held.staged_parts()

    def complete(self, task: str, step: int) -> None:
        self._read_state()
        if task not in self.completed:
            self.completed[task] = step
            self._save()

    def has_ledger(self) -> bool:
        return (self.root / PRIVACY_FILE).is_file()

    def ledger(self) -> PrivacyLedger:
        """The privacy ledger as it is on disk (empty when the site never released privately)."""
        path = self.root / PRIVACY_FILE
        if not path.is_file():
            return PrivacyLedger()
        return PrivacyLedger.from_json(json.loads(path.read_text()))

    @contextmanager
    def updating_ledger(self) -> Iterator[PrivacyLedger]:
        """The ledger to change, read and written back (when changed) under an exclusive lock
        on ``privacy.lock``: two processes of one site never lose each other's releases."""
        with open(self.root / PRIVACY_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            ledger = self.ledger()
            before = json.dumps(ledger.to_json(), indent=2)
            yield ledger
            after = json.dumps(ledger.to_json(), indent=2)
            if after != before:  # a scan that met no new unit writes nothing
                write_atomic(self.root / PRIVACY_FILE, after.encode())

    def saw(self, tasks: list[str]) -> None:
        """The task folders the site's sync saw (``synced``)."""
        self._read_state()
        if self.synced != tuple(tasks):
            self.synced = tuple(tasks)
            self._save()

    def _save(self) -> None:
        state: dict[str, object] = {"federation": self.federation, "completed": self.completed}
        if self.synced is not None:
            state["synced"] = list(self.synced)
        write_atomic(self.root / STATE_FILE, json.dumps(state, indent=2).encode())
