"""The processes ``site start`` runs beside its SuperNode — the site worker
(``starfed.client.worker``) and the site's SuperExec (``starfed.client.ops.superexec``) — and the
record of them all in ``<state>/run.json`` (``processes.ProcessRecord``).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

from starfed.client.ops import dialling, supernode_log
from starfed.client.ops.site_options import SiteError, SiteOptions
from starfed.client.worker import CANNOT_START
from starfed.ops import processes
from starfed.ops.processes import ManagedProcess, ProcessRecord

WORKER_START_S = 30.0


@dataclass
class Worker:
    """The running site worker, and the reason it gave (``CANNOT_START``) if it stopped."""

    popen: subprocess.Popen
    log: Path
    said: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None  # copies its output to the log

    def listen(self, log: IO[str], echo: IO[str] | None = None) -> None:
        self.pump = threading.Thread(
            target=supernode_log.pump,
            args=(self.popen.stdout, log, echo, self.hear),
            kwargs={"shown": told},
            daemon=True,
        )
        self.pump.start()

    def hear(self, line: str) -> None:
        """Keep the reason of a worker's ``CANNOT_START`` log line (after its time and level)."""
        _, marker, reason = line.partition(CANNOT_START)
        if marker:
            self.said.append(reason.strip())

    def ended(self) -> str | None:
        """Why the worker is gone, once it is or once it said it cannot work (its exit may
        take a while): its own reason, or its exit code."""
        if not self.said:
            if self.popen.poll() is None:
                return None
            if self.pump is not None:
                self.pump.join(5.0)  # its last lines
        if self.said:
            return f"{CANNOT_START}{self.said[-1]} (the traceback is in {self.log})"
        return (
            f"the site worker ended (exit code {self.popen.returncode}) and no message can be "
            f"answered without it; its output is in {self.log}"
        )


#: A line of the worker's log (``starfed.client.worker.LOG_FORMAT``): time, level, logger.
WORKER_LINE = re.compile(r"^\S+ (\d\d:\d\d:\d\d)\S* (INFO|WARNING|ERROR|CRITICAL) (\S+) (.*)$")
#: Loggers whose lines the site engineer reads on the terminal: the site's protocol steps
#: (``client/site.py``), its privacy ledger, and warnings (an unreadable image).
TOLD = ("starfed.client.site", "starfed.client.privacy", "py.warnings")


def told(line: str) -> str | None:
    """What the terminal shows of a worker's log line: ``12:03:41 step 2: …``, warnings as
    ``warning: …``; None for the rest (the log keeps it)."""
    match = WORKER_LINE.match(line.rstrip("\n"))
    if match is None:
        return None
    time_of_day, level, name, message = match.groups()
    if name not in TOLD and level == "INFO":
        return None
    if name == "py.warnings":  # "FILE:LINE: RuntimeWarning: what"
        message = message.partition("Warning: ")[2] or message
    return f"{time_of_day} {'' if level == 'INFO' else level.lower() + ': '}{message}"


def start_worker(
    options: SiteOptions, env: dict[str, str], log: IO[str], echo: IO[str] | None = None
) -> Worker:
    """The site worker (``starfed.client.worker``): built once, it answers every message, so
    no message pays for importing torch, building the backbones and reading the caches."""
    socket_path = options.worker_socket
    socket_path.unlink(missing_ok=True)
    command = processes.python_module("starfed.client.worker", "--socket", str(socket_path))
    popen = processes.spawn(command, env=env, cwd=options.state)
    worker = Worker(popen, Path(log.name))
    worker.listen(log, echo)
    deadline = time.monotonic() + WORKER_START_S
    while not socket_path.exists():
        if (ended := worker.ended()) or time.monotonic() > deadline:
            popen.kill()
            raise SiteError(ended or f"the site worker did not start in {WORKER_START_S:.0f} s")
        time.sleep(0.1)
    return worker


def start_superexec(
    options: SiteOptions, runtime_port: int, env: dict[str, str], log: IO[str], echo: IO[str] | None
) -> subprocess.Popen:
    """The site's SuperExec (``starfed.client.ops.superexec``); its tasks' output goes where the
    SuperNode's does."""
    address = f"127.0.0.1:{runtime_port}"
    command = processes.python_module(
        "starfed.client.ops.superexec",
        "--runtime-api-address",
        address,
        "--secret-file",
        str(options.superexec_secret),
    )
    popen = processes.spawn(command, env=env, cwd=options.state)
    threading.Thread(
        target=supernode_log.pump,
        args=(popen.stdout, log, echo, lambda _: None),
        kwargs={"local": dialling.LOCAL_RETRY},
        daemon=True,
    ).start()
    return popen


def record_of(started: dict[str, subprocess.Popen | None], log: Path) -> ProcessRecord:
    """The record of the processes ``started`` that run (their output goes to ``log``)."""
    record = ProcessRecord.begin()
    for name, popen in started.items():
        if popen is not None and (
            managed := ManagedProcess.of(name, popen, cast(list[str], popen.args), log)
        ):
            record.processes.append(managed)
    return record


def check_none_left(run_file: Path) -> None:
    """Refuse to start while a process an earlier start recorded still runs: a ``site start``
    that was killed may leave its SuperNode connected with this site's key."""
    record = ProcessRecord.load(run_file)
    if record is None:
        return
    if running := record.running():
        left, pids = record.pids(running), " ".join(str(p.pid) for p in running)
        raise SiteError(
            f"still running from an earlier `site start` ({left}): end them first "
            f"(`kill {pids}`), then start the site again"
        )
    run_file.unlink()
