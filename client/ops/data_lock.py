"""One running site per data folder: a lock that names its holder.

Why: two ``starfed site start`` with different state folders (or names, or keys) on one data
folder are, to the server, two sites that hold the same images: every count they report is
doubled and the merge weighs those images twice, with nothing to show for it. The state folder
has its own lock (``supernode._state_lock``, the same kind of lock); this one is on the data.

The lock is ``starfed.host.locks``'s, naming the holder: its site name, state folder, host, and
the ``starfed site start`` process as PID, start time and boot id, so a lock left by a process
that died (or a PID reused since) is recognised as stale and taken over, while a second start on
a live lock is refused with one line that names the holder. It lives in the data folder
(``.starfed-site.lock``); a data folder that is a read-only mount gets it in a folder shared by
the machine's users (``$TMPDIR/starfed-data-locks``), named after the folder's device and inode,
so starts on this machine still see each other. A holder on another host (a shared network
folder) cannot be checked for life, so its lock is only ever reported, never replaced.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from starfed.host import locks

LOCK_NAME = ".starfed-site.lock"
SHARED_LOCKS = "starfed-data-locks"


class DataFolderInUse(RuntimeError):
    """Another running site holds the data folder; one line naming it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a site's data (or state) folder."""

    site: str
    state: str
    host: str
    pid: int
    started: int
    since: str
    boot: str = ""  # a lock written without one (before starfed recorded it) is stale

    @classmethod
    def me(cls, site: str, state: Path) -> Holder:
        me = locks.Owner.me()
        now = datetime.now(UTC).isoformat(timespec="seconds")
        return cls(site, str(state), me.host, me.pid, me.started, now, me.boot)

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


def _refused(data: Path, path: Path, err: locks.LockError) -> DataFolderInUse:
    if isinstance(err, locks.LockBusy) and isinstance(err.holder, Holder):
        return DataFolderInUse(
            f"--data {data} is in use by {err.holder.describe()}: one data folder serves one "
            f"site (if that site is not running, remove {path})"
        )
    if isinstance(err, locks.LockBusy):
        return DataFolderInUse(f"--data {data} was taken at the same moment by another start")
    return DataFolderInUse(f"--data {data}: {err}; if no site is running on it, remove it")


@contextlib.contextmanager
def hold(data: Path, site: str, state: Path) -> Iterator[Holder]:
    """Hold ``data`` for this process while the block runs; ``DataFolderInUse`` if a running
    site holds it."""
    path = lock_path(data)
    refuse = functools.partial(_refused, data, path)
    with locks.hold(path, Holder.me(site, state), refuse) as me:
        yield me
