"""Processes that starfed starts and must end exactly: Flower's binaries, our gateway.

Flower processes start more processes (the SuperLink its SuperExec, the SuperExec one
``flwr-serverapp``/``flwr-clientapp`` per task), some of them in new sessions, so ending "what we
started" means walking the process tree, and ending it days later from another command (``starfed
server stop``) means recognising a PID again. A PID alone may have been reused; a PID with its
start time (clock ticks since boot, ``/proc/PID/stat`` field 22) and the boot id names one
process. A command that starts long-lived processes records them (:class:`ProcessRecord`, a JSON
file in its own folder: ``server start``'s ``run.json``, ``site start``'s) and prints their PIDs,
so they can be found and ended by PID later. Nothing here kills by name.

Linux only: processes are read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from starfed.host.process_identity import ProcessId, boot_id, proc_stat
from starfed.shared.files import write_atomic

#: Flower/Ray settings every Flower process starfed starts gets: no telemetry, no update
#: checks, no ``uv sync`` of an app's dependencies at run time.
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class ProcessError(RuntimeError):
    """A process could not be started or found; the message is one line for the user."""


@dataclass
class ManagedProcess:
    """A process a command started and recorded: its name, identity, command and output file."""

    name: str
    pid: int
    started: int
    command: list[str]
    output: str  # stdout/stderr file

    @property
    def id(self) -> ProcessId:
        return ProcessId(self.pid, self.started)

    @classmethod
    def of(
        cls, name: str, popen: subprocess.Popen, command: Sequence[str], output: Path
    ) -> ManagedProcess | None:
        """The process ``popen`` started, or None when it has already exited."""
        process = ProcessId.of(popen.pid)
        if process is None:
            return None
        return cls(name, process.pid, process.started, list(command), str(output))


@dataclass(kw_only=True)
class ProcessRecord:
    """What a command started, as a JSON file in its folder: read by the commands that stop or
    show them (``server stop``, ``server status``), and by a person with ``kill``."""

    boot_id: str
    started_at: str
    processes: list[ManagedProcess] = field(default_factory=list)

    @classmethod
    def begin(cls, **details: Any) -> Self:
        """A record made now, of no process yet (``details``: a subclass's fields)."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        return cls(boot_id=boot_id(), started_at=now, **details)

    def save(self, path: Path) -> None:
        write_atomic(path, (json.dumps(asdict(self), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> Self | None:
        """The record at ``path``; None when there is none. ProcessError when it is damaged."""
        try:
            data = json.loads(path.read_text())
            data["processes"] = [ManagedProcess(**p) for p in data["processes"]]
            return cls(**data)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError) as err:
            raise ProcessError(f"{path} is damaged ({err}); check `ps` and remove it") from None

    def alive(self) -> dict[str, bool]:
        """Process name -> still running (never true across a reboot: start times restart)."""
        same_boot = self.boot_id == boot_id()
        return {p.name: same_boot and p.id.alive() for p in self.processes}

    def running(self) -> list[ManagedProcess]:
        """The recorded processes that still run."""
        alive = self.alive()
        return [p for p in self.processes if alive[p.name]]

    def pids(self, processes: Sequence[ManagedProcess] | None = None) -> str:
        """``name PID, ...`` of ``processes`` (default: all): what the commands print."""
        return ", ".join(f"{p.name} {p.pid}" for p in processes or self.processes)


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every live process; zombies are left out."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) and stat[0] != "Z":
            table[int(entry.name)] = (stat[1], stat[2])
    return table


def descendants(roots: Iterable[ProcessId]) -> set[ProcessId]:
    """The live ``roots`` and every live process below them."""
    table = process_table()
    found = {r for r in roots if r.pid in table and table[r.pid][1] == r.started}
    frontier = [r.pid for r in found]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in table.items():
            if ppid == parent and (child := ProcessId(pid, started)) not in found:
                found.add(child)
                frontier.append(pid)
    return found


def alive(processes: Iterable[ProcessId]) -> set[ProcessId]:
    return {p for p in processes if p.alive()}


def wait_gone(processes: Iterable[ProcessId], timeout: float) -> set[ProcessId]:
    """Wait up to ``timeout`` seconds for ``processes`` to end; returns those still alive."""
    processes = set(processes)
    deadline = time.monotonic() + timeout
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def send_signal(processes: Iterable[ProcessId], sig: signal.Signals) -> None:
    """Signal each process that is still the one recorded (never a reused PID)."""
    for p in processes:
        if p.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, sig)


def stop_child(child: subprocess.Popen, grace: float) -> None:
    """SIGTERM one child of this process, wait ``grace`` seconds, SIGKILL it if it is still
    there; it is reaped either way."""
    child.terminate()
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def terminate(processes: Iterable[ProcessId], grace: float = 10.0) -> set[ProcessId]:
    """SIGTERM, wait ``grace`` seconds, SIGKILL what is left; returns what survived even that.

    Processes started meanwhile by the ones being stopped are collected and stopped too.
    """
    processes = descendants(processes)
    send_signal(processes, signal.SIGTERM)
    left = wait_gone(processes, grace)
    processes |= descendants(left)
    left = alive(processes)
    if left:
        send_signal(left, signal.SIGKILL)
        left = wait_gone(left, 5.0)
    return left


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the kernel's choice, so parallel callers differ)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def flower_env(flwr_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus a Flower home and :data:`FLOWER_ENV`.

    The interpreter's folder goes first on PATH: Flower starts ``flower-superexec``,
    ``flwr-serverapp`` and ``flwr-clientapp`` by name, and ``starfed`` may run without an
    activated virtual environment.
    """
    env = dict(os.environ)
    env.update(FLOWER_ENV)
    env["FLWR_HOME"] = str(flwr_home)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
    return env


def python_module(module: str, *args: str) -> list[str]:
    """``python -P -m MODULE ARGS`` with this interpreter: ``-P`` keeps the working folder off
    ``sys.path``, so a ``starfed/`` folder there (a checkout) is never mixed into the installed
    namespace package (docs/deployment.md#0-install)."""
    return [sys.executable, "-P", "-m", module, *args]


def flower_executable(name: str) -> str:
    """The Flower binary next to this interpreter (the same installation), else on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if not found:
        raise ProcessError(f"`{name}` not found: install flwr (one of starfed's dependencies)")
    return found


def spawn(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    output: Path | None = None,
) -> subprocess.Popen:
    """Start ``command`` in a new session (a Ctrl-C in our terminal does not reach it: we stop
    it ourselves, in order), stdin closed, stdout and stderr appended to ``output`` (or piped
    to us when ``output`` is None)."""
    if output is None:
        return subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("ab") as sink:
        return subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
