"""A command on a terminal of its own, as a person runs it, for end-to-end tests of Ctrl-C.

``Popen.send_signal(SIGINT)`` reaches one process; a terminal's Ctrl-C reaches its whole
foreground process group: the command and every child it did not start in a session of its own
(``flwr log --stream``, a ``flwr ls`` in flight). Here the command runs in a new session whose
controlling terminal is a pty, so writing the interrupt character to the pty's other end is the
Ctrl-C a terminal sends. Everything the command prints is copied to a file as it comes: a pty
whose reader stops blocks the writer.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import termios
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

CTRL_C = b"\x03"  # the pty's VINTR: the line discipline sends SIGINT to the foreground group


def _take_the_terminal() -> None:
    """In the child, after ``setsid`` (``start_new_session``): stdin's pty becomes the session's
    controlling terminal, its process group the foreground one."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """``command`` on a pty of its own; what it prints is appended to ``output``."""

    def __init__(
        self, command: Sequence[str], output: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.output = output
        self._master, slave = os.openpty()
        try:
            self.popen = subprocess.Popen(
                list(command),
                stdin=slave,
                stdout=slave,
                stderr=slave,
                env=None if env is None else dict(env),
                start_new_session=True,
                preexec_fn=_take_the_terminal,
            )
        finally:
            os.close(slave)
        self._pump = threading.Thread(target=self._copy, daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        with self.output.open("ab") as out:
            while True:
                try:
                    chunk = os.read(self._master, 4096)
                except OSError:  # EIO: every process holding the pty has ended
                    break
                if not chunk:
                    break
                out.write(chunk)
                out.flush()
        os.close(self._master)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def ctrl_c(self) -> None:
        os.write(self._master, CTRL_C)

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int:
        """The exit code, once the command ended and all it printed is in ``output``."""
        code = self.popen.wait(timeout)
        self._pump.join(10)
        return code

    def kill(self) -> None:
        self.popen.kill()

    def text(self) -> str:
        """What it printed so far, as a terminal shows it: lines end in CRLF on a pty."""
        return self.output.read_text(errors="replace").replace("\r\n", "\n")
