"""One process named robustly to PID reuse: its PID, its start time and the boot it ran in.

A PID alone may have been reused; a PID with its start time (clock ticks since boot,
``/proc/PID/stat`` field 22) and the boot id names one process. Every lock file
(``starfed.host.locks``) tells a stale holder this way, and the operations that start and end
Flower's processes (``ops.processes``) recognise them days later the same way. Linux
only: processes are read from ``/proc``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


def boot_id() -> str:
    """This boot's id: start times count from boot, so they only compare within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``, or None when it does not exist. A
    ``/proc`` this process cannot read for its own reasons (out of file handles: EMFILE,
    ENFILE; out of memory) raises ``OSError``: that says nothing of ``pid``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces and ')'
    return fields[0], int(fields[1]), int(fields[19])


@dataclass(frozen=True)
class ProcessId:
    """One process, robust to PID reuse: its PID and its start time in ticks since boot."""

    pid: int
    started: int

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        stat = proc_stat(pid)
        return None if stat is None else cls(pid, stat[2])

    def alive(self) -> bool:
        """The same process still runs (a zombie counts as gone: it only waits to be reaped);
        ``OSError`` when this process cannot tell (``proc_stat``)."""
        stat = proc_stat(self.pid)
        return stat is not None and stat[0] != "Z" and stat[2] == self.started

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "started": self.started}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ProcessId:
        pid, started = data["pid"], data["started"]
        if not isinstance(pid, int | str) or not isinstance(started, int | str):
            raise TypeError(f"a process id is two integers, not {pid!r} and {started!r}")
        return cls(int(pid), int(started))
