"""One holder at a time: a lock file that names its holder, taken over once that holder is gone.

Used for the federation folder (``server.folder_lock``: one server run writes it), a site's data
folder (``client.ops.data_lock``: one running site per data) and a site's state folder
(``client.ops.supernode``: one SuperNode per key). The file is made with ``O_CREAT | O_EXCL``
(atomic on a local file system), written and synced, and names its holder: a frozen dataclass
with the holder's PID, start time and boot id (``process_identity``) and host, and what its
caller adds. A holder killed with SIGKILL cannot give it back; its lock is *stale* — the process
with that PID and start time no longer runs on this host in this boot — and the next taker takes
it over, moving the stale file aside first, so two takers at once cannot both win. A lock of
another host is never taken over (this one cannot see whether its holder runs), nor is a file
that cannot be read: both are refused, with the holder or the damage named.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from starfed.host.process_identity import ProcessId, boot_id

TAKE_TRIES = 3  # a stale lock moved aside, then the race for the new one


class Holder(Protocol):
    """What a lock file records: a frozen dataclass with at least these fields."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def pid(self) -> int: ...
    @property
    def started(self) -> int: ...  # ticks since boot (``ProcessId``)
    @property
    def boot(self) -> str: ...
    @property
    def host(self) -> str: ...


H = TypeVar("H", bound=Holder)


@dataclass(frozen=True)
class Owner:
    """This process, as every holder names it."""

    pid: int
    started: int
    boot: str
    host: str

    @classmethod
    def me(cls) -> Owner:
        process = ProcessId.of(os.getpid())
        assert process is not None  # we are running
        return cls(process.pid, process.started, boot_id(), socket.gethostname())


def alive(holder: Holder) -> bool:
    """Still running: always true for another host's holder (it cannot be seen from here)."""
    if holder.host != socket.gethostname():
        return True
    return holder.boot == boot_id() and ProcessId(holder.pid, holder.started).alive()


class LockError(RuntimeError):
    """The lock cannot be taken."""


class LockBusy(LockError):
    """A live holder (or one on another host) has it; None: other takers kept taking it."""

    def __init__(self, holder: Holder | None) -> None:
        super().__init__(f"held by {holder}" if holder else "other takers keep taking it")
        self.holder = holder


class LockDamaged(LockError):
    """The lock file cannot be read: never taken over silently."""


def read(path: Path, kind: type[H]) -> H | None:
    """The holder that ``path`` names, alive or stale; None when there is no lock."""
    try:
        return kind(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        raise LockDamaged(f"{path} is damaged ({err})") from None


def acquire(path: Path, me: Holder) -> None:
    """Take the lock for ``me`` (taking over a stale one); ``LockBusy`` naming a live holder,
    ``LockDamaged`` for a file that cannot be read."""
    data = json.dumps(asdict(me), indent=2).encode()
    for _ in range(TAKE_TRIES):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            current = read(path, type(me))
            if current is None:
                continue
            if alive(current):
                raise LockBusy(current) from None
            _take_over(path, current)
            continue
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        return
    raise LockBusy(None)


def _take_over(path: Path, stale: Holder) -> None:
    """Move a stale lock aside; if what was moved is not that stale lock (another taker took it
    over first and holds it now), put it back and refuse."""
    aside = path.with_name(f".{path.name}.stale-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = read(aside, type(stale))
    except LockDamaged:
        moved = None
    if moved != stale:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        raise LockBusy(moved)
    aside.unlink(missing_ok=True)


def release(path: Path, me: Holder) -> None:
    """Give the lock back, if ``me`` still holds it."""
    with contextlib.suppress(LockDamaged):
        if read(path, type(me)) == me:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def hold(path: Path, me: H, refuse: Callable[[LockError], Exception]) -> Iterator[H]:
    """Hold the lock for the ``with`` block, released however it ends (an exception,
    SystemExit, KeyboardInterrupt; SIGKILL leaves a stale lock the next taker takes over).
    When it cannot be taken, ``refuse`` makes the caller's one-line error of why."""
    try:
        acquire(path, me)
    except LockError as err:
        raise refuse(err) from None
    try:
        yield me
    finally:
        release(path, me)
