"""One writer per federation folder: a lock file held by the server run that writes it.

Two ServerApps over one folder overwrite each other's checkpoints, so a run takes
``lock.json`` before it reads anything and gives it back however it ends. The lock is
``starfed.host.locks``'s: it names its holder (PID, start time, boot id, host, what it is and
since when), a stale one (its holder was killed) is taken over by the next run, one of another
host never is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from starfed.host import locks

LOCK_FILE = "lock.json"


class FolderLocked(RuntimeError):
    """Another live process holds the folder; the message names it, on one line."""


@dataclass(frozen=True)
class Holder:
    """Who holds a federation folder's lock."""

    pid: int
    started: int  # ticks since boot (``ProcessId``)
    boot: str
    host: str
    what: str  # e.g. "server run 7 (ServerApp)"
    since: str

    @classmethod
    def me(cls, what: str) -> Holder:
        me = locks.Owner.me()
        since = datetime.now(UTC).isoformat(timespec="seconds")
        return cls(me.pid, me.started, me.boot, me.host, what, since)

    def alive(self) -> bool:
        """Still running: always true for another host's holder (it cannot be seen from here)."""
        return locks.alive(self)

    def describe(self) -> str:
        return f"{self.what}, PID {self.pid} on {self.host}, since {self.since}"


def holder(root: Path) -> Holder | None:
    """The folder's lock holder, alive or stale; None when it is not locked. A lock file that
    cannot be read is a holder all the same (never taken over silently)."""
    try:
        return locks.read(Path(root) / LOCK_FILE, Holder)
    except locks.LockDamaged as err:
        raise _refused(root, err) from None


def _refused(root: Path, err: locks.LockError) -> FolderLocked:
    if isinstance(err, locks.LockDamaged):
        return FolderLocked(f"{err}: remove it once no server run uses {root}")
    assert isinstance(err, locks.LockBusy)
    if not isinstance(err.holder, Holder):
        return FolderLocked(f"could not take the lock of {root}: other runs keep taking it")
    return FolderLocked(
        f"the federation folder {root} is in use by {err.holder.describe()}: wait for it to "
        "end, or stop it"
    )


def acquire(root: Path, what: str) -> Holder:
    """Take the folder's lock for this process (taking over a stale one); ``FolderLocked``
    naming the live holder otherwise."""
    me = Holder.me(what)
    try:
        locks.acquire(Path(root) / LOCK_FILE, me)
    except locks.LockError as err:
        raise _refused(root, err) from None
    return me


def release(root: Path, me: Holder) -> None:
    """Give the lock back, if this process still holds it."""
    locks.release(Path(root) / LOCK_FILE, me)


@contextlib.contextmanager
def locked(root: Path, what: str) -> Iterator[Holder]:
    """Hold the folder's lock for the ``with`` block, released however it ends (an exception,
    SystemExit, KeyboardInterrupt; SIGKILL leaves a stale lock the next run takes over)."""
    refuse = functools.partial(_refused, root)
    with locks.hold(Path(root) / LOCK_FILE, Holder.me(what), refuse) as me:
        yield me
