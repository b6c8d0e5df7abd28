"""Which processes a test started: sampled from /proc by a marker in their environment.

Tests that start real Flower processes record every process whose environment carries the
test's own ``FLWR_HOME``, independently of the code under test's bookkeeping, so they can check
by PID (and start time) that nothing outlives them.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def _state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[19])


def alive(pid: int, started: int) -> bool:
    state = _state(pid)
    return state is not None and state[0] != "Z" and state[1] == started


class ProcessSampler(threading.Thread):
    """Collects pid -> (start time, command line) of processes whose env holds ``marker``."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker = marker.encode()
        self.seen: dict[int, tuple[int, str]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.3):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit() or int(entry.name) in self.seen:
                    continue
                try:
                    environ = Path(entry.path, "environ").read_bytes().split(b"\0")
                    cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                state = _state(int(entry.name))
                if self.marker in environ and state is not None:
                    self.seen[int(entry.name)] = (state[1], cmdline.decode(errors="replace"))
