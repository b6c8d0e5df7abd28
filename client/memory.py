"""A site's memory across messages, restarts and runs: its state folder.

In deployment every message starts a fresh ClientApp process, and a site may restart or be
offline for steps, so what a site must remember lives on disk (docs/sites.md):

* ``codebook.bin``: the last codebook received, so the server can send only what changed (a
  ``Delta``) — a site that lost it simply receives the whole codebook again;
* ``site.json``: which federation that codebook belongs to, and which of the site's tasks are
  completed (all their classes finished) and at which federation step.

Both are written atomically.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from starfed.shared.codebook.codebook import Codebook, CodebookError, Delta
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.codebook.wire import decode_broadcast
from starfed.shared.files import write_atomic

logger = logging.getLogger(__name__)

STATE_FILE = "site.json"
CODEBOOK_FILE = "codebook.bin"
EPOCH = "epoch"  # codebook metadata: the server's version line (a rollback starts a new one)


class SiteMemory:
    """The state folder of one site, for one backbone pair."""

    def __init__(self, state_dir: str | Path, fingerprint: str, dims: ModelDims) -> None:
        self.root = Path(state_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.dims = dims
        self.federation = ""  # id of the federation whose codebook is held
        self.completed: dict[str, int] = {}  # task folder name -> federation step
        self._held: Codebook | None = None
        self._stamp: tuple[int, int] = (0, 0)  # the held file's mtime and size when read

    def _read_state(self) -> None:
        """site.json as it is now (another worker process of a simulation may have written)."""
        path = self.root / STATE_FILE
        if path.is_file():
            state = json.loads(path.read_text())
            self.federation = str(state.get("federation", ""))
            self.completed = {str(k): int(v) for k, v in state.get("completed", {}).items()}

    def join(self, federation: str) -> None:
        """Follow ``federation``; a site that moves to another one starts its memory afresh."""
        self._read_state()
        if federation != self.federation:
            if self.federation:
                logger.warning("state of federation %s replaced by %s", self.federation, federation)
            self.federation, self.completed, self._held = federation, {}, None
            (self.root / CODEBOOK_FILE).unlink(missing_ok=True)
            self._save()

    def held_version(self, epoch: str) -> int:
        """The version of the held codebook if it is of the version line ``epoch``, else 0."""
        held = self.held()
        return held.version if held and held.metadata.get(EPOCH) == epoch else 0

    def held(self) -> Codebook | None:
        """The last codebook received from this federation, if it is intact.

        Read again whenever the file changed: in a simulation several worker processes may
        answer for the same site.
        """
        path = self.root / CODEBOOK_FILE
        try:
            stat = path.stat()
        except FileNotFoundError:
            self._held = None
            return None
        if self._held is None or self._stamp != (stat.st_mtime_ns, stat.st_size):
            self._held, self._stamp = None, (stat.st_mtime_ns, stat.st_size)
            try:
                self._held = Codebook.load(path, fingerprint=self.fingerprint, dims=self.dims)
            except (OSError, CodebookError) as err:  # a damaged copy costs one full download
                logger.warning("ignoring the held codebook: %s", err)
        return self._held

    def receive(self, data: bytes) -> Codebook:
        """The codebook a message carries: as sent, or the held one with a delta applied."""
        received = decode_broadcast(data, fingerprint=self.fingerprint, dims=self.dims)
        if isinstance(received, Delta):
            held = self.held()
            if held is None or held.metadata.get(EPOCH) != received.metadata.get(EPOCH):
                raise CodebookError(
                    f"a delta from version {received.base_version} arrived, but that codebook "
                    "is not held (the server sends the whole codebook next)"
                )
            received = held.apply(received)
        if self._held is None or received.version != self._held.version:
            received.save(self.root / CODEBOOK_FILE)
            stat = (self.root / CODEBOOK_FILE).stat()
            self._held, self._stamp = received, (stat.st_mtime_ns, stat.st_size)
        return received

    def complete(self, task: str, step: int) -> None:
        self._read_state()
        if task not in self.completed:
            self.completed[task] = step
            self._save()

    def _save(self) -> None:
        state = {"federation": self.federation, "completed": self.completed}
        write_atomic(self.root / STATE_FILE, json.dumps(state, indent=2).encode())
