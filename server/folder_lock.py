"""One writer per federation folder: a lock file held by the server run that writes it.

Two ServerApps over one folder overwrite each other's checkpoints, so a run takes
``lock.json`` before it reads anything and gives it back however it ends. The file is made with
``O_CREAT | O_EXCL`` (atomic on a local file system) and names its holder: PID, start time and
boot id (``server.process_identity``), host, what it is and since when. A holder killed with
SIGKILL cannot give it back; its lock is *stale* — the process with that PID and start time no
longer runs on this host in this boot — and the next run takes it over (moving the stale file
aside first, so two runs taking over at once cannot both win). A lock of another host is never
taken over: this one cannot see whether its holder runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from starfed.server.process_identity import ProcessId, boot_id

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
        me = ProcessId.of(os.getpid())
        return cls(os.getpid(), me.started if me else 0, boot_id(), socket.gethostname(), what,
                   datetime.now(UTC).isoformat(timespec="seconds"))  # fmt: skip

    def alive(self) -> bool:
        """Still running: always true for another host's holder (it cannot be seen from here)."""
        if self.host != socket.gethostname():
            return True
        return self.boot == boot_id() and ProcessId(self.pid, self.started).alive()

    def describe(self) -> str:
        return f"{self.what}, PID {self.pid} on {self.host}, since {self.since}"


def holder(root: Path) -> Holder | None:
    """The folder's lock holder, alive or stale; None when it is not locked. A lock file that
    cannot be read is a holder all the same (never taken over silently)."""
    path = Path(root) / LOCK_FILE
    try:
        return Holder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as err:
        raise FolderLocked(f"{path} is damaged ({err}): remove it once no server run uses "
                           f"{root}") from None  # fmt: skip


def acquire(root: Path, what: str) -> Holder:
    """Take the folder's lock for this process (taking over a stale one); ``FolderLocked``
    naming the live holder otherwise."""
    path = Path(root) / LOCK_FILE
    me = Holder.me(what)
    data = json.dumps(asdict(me), indent=2).encode()
    for _ in range(3):  # a stale lock moved aside, then the race for the new one
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            current = holder(root)
            if current is None:
                continue
            if current.alive():
                raise FolderLocked(
                    f"the federation folder {root} is in use by {current.describe()}: wait for "
                    "it to end, or stop it"
                ) from None
            _take_over(path, current)
            continue
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        return me
    raise FolderLocked(f"could not take the lock of {root}: other runs keep taking it")


def _take_over(path: Path, stale: Holder) -> None:
    """Move a stale lock aside; if what was moved is not that stale lock (another run took it
    over first and holds it now), put it back and refuse."""
    aside = path.with_name(f".{LOCK_FILE}.stale-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = Holder(**json.loads(aside.read_text()))
    except (OSError, ValueError, TypeError):
        moved = None
    if moved != stale:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        who = moved.describe() if moved else "another run"
        raise FolderLocked(f"the federation folder {path.parent} is in use by {who}")
    aside.unlink(missing_ok=True)


def release(root: Path, me: Holder) -> None:
    """Give the lock back, if this process still holds it."""
    with contextlib.suppress(FolderLocked):
        if holder(root) == me:
            (Path(root) / LOCK_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def locked(root: Path, what: str) -> Iterator[Holder]:
    """Hold the folder's lock for the ``with`` block, released however it ends (an exception,
    SystemExit, KeyboardInterrupt; SIGKILL leaves a stale lock the next run takes over)."""
    me = acquire(root, what)
    try:
        yield me
    finally:
        release(root, me)
