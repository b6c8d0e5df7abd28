"""Which processes a test started, found in /proc by a marker in their environment.

Tests that start real Flower processes give them a marker that every child inherits — the
test's own ``FLWR_HOME`` or ``STARFED_..._TEST=<folder>`` — and check by PID and start time,
independently of the code under test's bookkeeping, that nothing they started outlives them.
``marked`` looks once; a ``ProcessSampler`` looks every 0.3 s while a test runs, so it also
records processes that come and go (a ClientApp per message).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from starfed.ops.processes import ProcessId, send_signal


def marked(marker: str, also: str | None = None) -> dict[ProcessId, str]:
    """Live processes whose environment holds the entry ``marker`` (and, if given, an entry
    that starts with ``also``), with their command lines; this process is not read."""
    wanted, prefix = marker.encode(), (also or "").encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if wanted not in environ or (prefix and not any(e.startswith(prefix) for e in environ)):
            continue
        process = ProcessId.of(int(entry.name))
        if process is not None and process.alive():
            found[process] = cmdline.decode(errors="replace").strip()
    return found


class ProcessSampler(threading.Thread):
    """Records every marked process (see ``marked``) while it runs, until ``stop()``."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker = marker
        self.seen: dict[ProcessId, str] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.3):
            # every marked process is read again, not only new PIDs: a process caught between
            # its fork and its exec shows its parent's command line (a `flwr-simulation` seen as
            # the SuperLink that starts it), which the next look replaces with its own
            self.seen |= marked(self.marker)

    def stop(self) -> dict[ProcessId, str]:
        """Stop sampling; the recorded processes still alive, each then killed (SIGKILL) so a
        failing test never leaks them into the rest of the session."""
        self._done.set()
        self.join()
        left = {p: cmd for p, cmd in self.seen.items() if p.alive()}
        send_signal(left, signal.SIGKILL)
        return left

    def commands(self) -> str:
        return " ".join(self.seen.values())
