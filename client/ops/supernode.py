"""``starfed site start``: this site's Flower SuperNode, in the foreground, stopped cleanly.

A bare ``flower-supernode`` with no node config trains on the bundled demo data as if it were a
site, shares one default Runtime API port with every other SuperNode on the host, polls for
tasks once a second and reports a wrong CA or an unregistered key as a Flower exit code in a
traceback-sized log. This wrapper:

- refuses to start without a data folder, and hands the ClientApp the site's folders through a
  node-config **file** (paths with spaces survive): ``data-dir``, ``state-dir``, ``site-name``,
  ``device``;
- checks the private key before Flower does (OpenSSH EC, mode 0600) and prints its fingerprint,
  the same one the operator sees in ``starfed server sites list`` and ``sites refused``;
- gives the SuperNode a free Runtime API port on 127.0.0.1 and its own ``FLWR_HOME`` in the
  state folder;
- runs the site worker (``starfed.client.worker``) next to it, so the per-message ClientApp
  processes only forward (no torch, no backbones, no cache reads per message); a worker that
  ends (its site code cannot be imported, or it died: every message would fail) stops the
  site at once, its reason as the error line;
- runs the SuperNode in Flower's ``process`` isolation with the site's own SuperExec
  (``starfed.client.ops.superexec``): each message's ClientApp process is forked from it instead of
  started from nothing (no Python start, no Flower import per message), and its Runtime API asks
  for a SuperExec secret only the site's processes can read;
- streams the SuperNode's log to the terminal and to ``<state>/logs/supernode.log``, and turns the
  known failure lines into one clear line each (``supernode_log``); a SuperNode that stopped
  itself on Flower's 401 was refused either for its key or for this machine's clock, told apart
  by asking the server's time (``ops.clock``);
- on Ctrl-C or SIGTERM sends SIGTERM to the SuperNode, which tells the SuperLink it goes offline
  (at once, instead of after the 60 s heartbeat patience), then ends whatever is left of its
  process tree by PID. One SuperNode per state folder (a lock file, ``starfed.host.locks``'s
  like the data folder's), so two cannot share a key,
  and one running site per data folder (``data_lock``: the second start is refused with one line
  naming the holder), so two sites cannot report the same images unnoticed;
- records the processes it starts (SuperNode, SuperExec, worker) in ``<state>/run.json`` and
  hands them to the caller to print, as ``starfed server start`` does
  (``processes.ProcessRecord``); the file goes when they have all ended, and a start refuses
  while one it lists still runs (a ``site start`` that was killed may leave its SuperNode).

The Runtime API stays plain HTTP on 127.0.0.1: the secret keeps another local user from
acquiring the site's tasks, but a ClientApp's own task token is not otherwise bound to the
process that holds it; run sites on machines (or containers) of their own (docs/deployment.md).

This module is the process, supervised and stopped; the inputs, checked once, and what the
SuperNode gets from them are ``site_options``'s, the worker and SuperExec beside it and their
record ``site_processes``', what its output says ``supernode_log``'s.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from starfed.client.ops import data_lock, dialling, site_processes, supernode_log
from starfed.client.ops.site_options import (
    SiteError,
    SiteOptions,
    supernode_command,
    write_node_config,
    write_site_terms,
    write_superexec_secret,
)
from starfed.host import locks
from starfed.ops import processes
from starfed.ops.processes import ProcessId, ProcessRecord

STOP_GRACE_S = 15.0


@dataclass
class SiteRun:
    """The outcome of one ``site start``: why it ended, and whether anything survived."""

    returncode: int | None = None
    failure: str | None = None
    stopped_by: str | None = None
    survivors: set[ProcessId] = field(default_factory=set)
    log_file: Path | None = None

    @property
    def exit_code(self) -> int:
        """0 only when we stopped it as told and nothing survived: a SuperNode that ends by
        itself has failed, whatever its own exit code."""
        return 0 if self.stopped_by and not (self.failure or self.survivors) else 1


@dataclass
class _Watch:
    """Reads each line of the SuperNode's output: the first known failure
    (``supernode_log.FAILURES``), whether it stopped itself, whether it reaches the server."""

    options: SiteOptions
    outcome: SiteRun
    dial: dialling.Dialling
    self_stopped: bool = False

    def __call__(self, line: str) -> str | None:
        if supernode_log.SELF_STOP.search(line):
            self.self_stopped = True
        if self.outcome.failure is None:
            for failure in supernode_log.FAILURES:
                if failure.pattern.search(line):
                    self.outcome.failure = failure.explain(self.options)
                    return None
        return self.dial.see(line, time.monotonic())


@dataclass
class _Started:
    """What ``site start`` has started so far; all of it is stopped, whatever happened."""

    seen: set[ProcessId] = field(default_factory=set)  # their process trees, as they grow
    supernode: subprocess.Popen | None = None
    worker: site_processes.Worker | None = None
    superexec: subprocess.Popen | None = None
    pump: threading.Thread | None = None  # copies the SuperNode's output

    def add(self, popen: subprocess.Popen) -> None:
        self.seen |= {root} if (root := ProcessId.of(popen.pid)) else set()

    def named(self) -> dict[str, subprocess.Popen | None]:
        return {
            "worker": self.worker.popen if self.worker else None,
            "supernode": self.supernode,
            "superexec": self.superexec,
        }


def _supervise(
    popen: subprocess.Popen,
    worker: site_processes.Worker | None,
    seen: set[ProcessId],
    outcome: SiteRun,
    stop_reason: list[str],
    dial: dialling.Dialling,
) -> str | None:
    """Wait until the SuperNode ends, a stop signal arrives, the site worker ends (no message
    could be answered: stop at once, with its reason), it gave up reaching the server, or a
    failure line was seen (then give Flower 10 s to exit by itself); SIGTERM it if it still
    runs. Records its process tree in ``seen`` as it grows; returns the signal that stopped
    it, if any."""
    fatal_since: float | None = None
    while popen.poll() is None and not stop_reason:
        seen |= processes.descendants(seen)
        if worker is not None and (ended := worker.ended()):
            outcome.failure = outcome.failure or ended
            break
        if outcome.failure is None and (why := dial.gave_up(time.monotonic())):
            outcome.failure = why
            break
        if outcome.failure and fatal_since is None:
            fatal_since = time.monotonic()
        if fatal_since and time.monotonic() - fatal_since > 10:
            break
        time.sleep(0.2)
    if popen.poll() is not None:
        return None
    popen.send_signal(signal.SIGTERM)  # the SuperNode tells the SuperLink it goes offline
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(STOP_GRACE_S)
    return stop_reason[0] if stop_reason else None


STATE_LOCK = ".starfed-state.lock"


@contextlib.contextmanager
def _state_lock(state: Path, name: str) -> Iterator[None]:
    """One SuperNode per state folder: two with one key would fight over one node id."""
    state.mkdir(parents=True, exist_ok=True)
    me = data_lock.Holder.me(name, state)
    with locks.hold(state / STATE_LOCK, me, functools.partial(_state_in_use, state)):
        yield


def _state_in_use(state: Path, err: locks.LockError) -> SiteError:
    if isinstance(err, locks.LockBusy) and isinstance(err.holder, data_lock.Holder):
        return SiteError(f"another `starfed site start` uses {state}: {err.holder.describe()}")
    if isinstance(err, locks.LockBusy):
        return SiteError(f"another `starfed site start` uses {state}")
    return SiteError(f"{err}; if no `starfed site start` uses {state}, remove it")


def run(
    options: SiteOptions,
    echo: IO[str] | None = sys.stdout,
    on_started: Callable[[ProcessRecord], None] = lambda record: None,
) -> SiteRun:
    """Run the SuperNode until it ends or we are told to stop (SIGINT/SIGTERM); ``on_started``
    gets the record of the processes once they all run."""
    with _state_lock(options.state, options.name), _data_lock(options):
        site_processes.check_none_left(options.run_file)
        return _run(options, echo, on_started)


@contextlib.contextmanager
def _data_lock(options: SiteOptions) -> Iterator[None]:
    try:
        with data_lock.hold(options.data, options.name, options.state):
            yield
    except data_lock.DataFolderInUse as err:
        raise SiteError(str(err)) from None


def _run(
    options: SiteOptions, echo: IO[str] | None, on_started: Callable[[ProcessRecord], None]
) -> SiteRun:
    node_config = options.state / "node-config.toml"
    write_node_config(node_config, options)
    write_site_terms(options)
    log_file = options.state / "logs" / "supernode.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    outcome = SiteRun(log_file=log_file)
    dial = dialling.Dialling(options.server, options.give_up_s, options.name)
    watch = _Watch(options, outcome, dial)
    stop_reason: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        stop_reason.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with log_file.open("a") as log:
            supernode_log.write(
                log, f"starfed: site {options.name} dials the server at {options.server}\n"
            )
            started = _Started()
            try:
                popen = _start(options, node_config, log, echo, watch, started)
                record = site_processes.record_of(started.named(), log_file)
                record.save(options.run_file)
                on_started(record)
                outcome.stopped_by = _supervise(
                    popen, started.worker, started.seen, outcome, stop_reason, watch.dial
                )
            finally:  # whatever happened: nothing of the SuperNode outlives us
                _stop(started, outcome)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not outcome.survivors:
        options.run_file.unlink(missing_ok=True)
    if outcome.stopped_by is None and stop_reason:
        outcome.stopped_by = stop_reason[0]
    if outcome.stopped_by is None and outcome.failure is None and watch.self_stopped:
        outcome.failure = supernode_log.self_stopped(options)
    return outcome


def _start(
    options: SiteOptions,
    node_config: Path,
    log: IO[str],
    echo: IO[str] | None,
    watch: _Watch,
    started: _Started,
) -> subprocess.Popen:
    """Start the site worker (if asked), the SuperNode and its SuperExec, recording each in
    ``started`` as it runs; returns the SuperNode."""
    env = processes.flower_env(options.state / "flwr-home")
    if options.worker:
        started.worker = site_processes.start_worker(options, env, log, echo)
        started.add(started.worker.popen)
    write_superexec_secret(options.superexec_secret)
    runtime_port = processes.free_port()
    command = supernode_command(options, node_config, runtime_port)
    popen = started.supernode = processes.spawn(command, env=env, cwd=options.state)
    started.add(popen)
    started.superexec = site_processes.start_superexec(options, runtime_port, env, log, echo)
    started.add(started.superexec)
    started.pump = threading.Thread(
        target=supernode_log.pump, args=(popen.stdout, log, echo, watch), daemon=True
    )
    started.pump.start()
    return popen


def _stop(started: _Started, outcome: SiteRun) -> None:
    """End the helpers and the SuperNode, then whatever is left of their process trees."""
    for helper in (started.worker.popen if started.worker else None, started.superexec):
        if helper is not None and helper.poll() is None:
            helper.terminate()
    if (popen := started.supernode) is not None:
        if popen.poll() is None:
            popen.kill()
        popen.wait()  # reaped: its SuperExec sees the parent gone and ends too
        outcome.returncode = popen.returncode
        left = processes.wait_gone(started.seen, 5.0)
        outcome.survivors = processes.terminate(left, grace=5.0)
    if started.pump is not None:
        started.pump.join(5.0)  # the rest of the output, until the pipe closes
