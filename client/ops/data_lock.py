"""One running site per data folder: a lock that names its holder.

Why: two ``starfed site start`` with different state folders (or names, or keys) on one data
folder are, to the server, two sites that hold the same images: every count they report is
doubled and the merge weighs those images twice, with nothing to show for it. The state folder
has its own lock (``supernode._state_lock``); this one is on the data.

The lock is a small JSON file naming the holder: its site name, state folder, host, and the
``starfed site start`` process as PID and start time (``processes.ProcessId``), so a lock left by
a process that died (or a PID reused since) is recognised as stale and replaced, while a second
start on a live lock is refused with one line that names the holder. It lives in the data
folder (``.starfed-site.lock``); a data folder that is a read-only mount gets it in a folder
shared by the machine's users (``$TMPDIR/starfed-data-locks``), named after the folder's device
and inode, so starts on this machine still see each other. Limits: a holder on another host
(a shared network folder) cannot be checked for life, so its lock is only ever reported, never
replaced; two starts that find the same stale lock in the same instant could both proceed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from starfed.server.ops.processes import ProcessId

LOCK_NAME = ".starfed-site.lock"
SHARED_LOCKS = "starfed-data-locks"


class DataFolderInUse(RuntimeError):
    """Another running site holds the data folder; one line naming it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a data folder."""

    site: str
    state: str
    host: str
    pid: int
    started: int
    since: str

    @classmethod
    def me(cls, site: str, state: Path) -> Holder:
        process = ProcessId.of(os.getpid())
        assert process is not None  # we are running
        now = datetime.now(UTC).isoformat(timespec="seconds")
        return cls(site, str(state), socket.gethostname(), process.pid, process.started, now)

    @classmethod
    def read(cls, path: Path) -> Holder | None:
        """The holder a lock file names, or None when it cannot be read (a lock being written,
        or a damaged one: treated as stale)."""
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def running(self) -> bool:
        """Still running — or on another host, where we cannot tell."""
        if self.host != socket.gethostname():
            return True
        return ProcessId(self.pid, self.started).alive()

    def describe(self) -> str:
        return (
            f"site {self.site} (pid {self.pid} on {self.host}, state {self.state}, "
            f"since {self.since})"
        )


def lock_path(data: Path) -> Path:
    """Where the lock of ``data`` lives: in it, or (read-only data) in the machine's shared
    lock folder under the folder's device and inode."""
    if os.access(data, os.W_OK):
        return data / LOCK_NAME
    shared = Path(tempfile.gettempdir()) / SHARED_LOCKS
    if not shared.is_dir():
        shared.mkdir(exist_ok=True)
        with contextlib.suppress(PermissionError):  # another user made it first
            shared.chmod(0o1777)  # every user may add a lock, only its owner removes it
    stat = data.stat()
    return shared / f"{stat.st_dev}-{stat.st_ino}.lock"


def _create(path: Path, holder: Holder) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        json.dump(asdict(holder), file)
    return True


@contextlib.contextmanager
def hold(data: Path, site: str, state: Path) -> Iterator[Holder]:
    """Hold ``data`` for this process while the block runs; ``DataFolderInUse`` if a running
    site holds it."""
    path = lock_path(data)
    me = Holder.me(site, state)
    if not _create(path, me):
        holder = Holder.read(path)
        if holder is not None and holder.running():
            raise DataFolderInUse(
                f"--data {data} is in use by {holder.describe()}: one data folder serves one "
                f"site (if that site is not running, remove {path})"
            )
        path.unlink(missing_ok=True)  # stale: its process is gone
        if not _create(path, me):
            other = Holder.read(path)
            raise DataFolderInUse(
                f"--data {data} was taken at the same moment by "
                f"{other.describe() if other else 'another start'}"
            )
    try:
        yield me
    finally:
        if Holder.read(path) == me:
            path.unlink(missing_ok=True)
