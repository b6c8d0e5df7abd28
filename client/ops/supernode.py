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
  known failure lines into one clear line each (:data:`FAILURES`); a SuperNode that stopped
  itself on Flower's 401 was refused either for its key or for this machine's clock, told apart
  by asking the server's time (``server.ops.clock``);
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
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import tomli_w

from starfed.client.ops import data_lock, dialling
from starfed.client.worker import CANNOT_START
from starfed.host import locks
from starfed.server.ops import clock, pki, processes
from starfed.server.ops.processes import ManagedProcess, ProcessId, ProcessRecord
from starfed.shared import addresses
from starfed.shared.config import TABLES

STOP_GRACE_S = 15.0
#: `starfed site start --device` (the knob table defines it; the CLI checks it at start).
DEFAULT_DEVICE = str(TABLES["run-config"]["device"].default)
WORKER_START_S = 30.0


#: Node-config keys the ClientApp reads (docs/deployment.md).
class SiteError(RuntimeError):
    """Something the site engineer can fix; one line, exit code 1."""


@dataclass(frozen=True)
class Failure:
    """A log line that means the SuperNode cannot work, and what to tell the user."""

    pattern: re.Pattern[str]
    explain: Callable[[SiteOptions], str]


def _wrong_ca(o: SiteOptions) -> str:
    return (
        f"TLS: the server's certificate is not signed by {o.ca}; get the federation's ca.pem "
        "from the operator (or check that --server is the server's address)"
    )


def _wrong_name(o: SiteOptions) -> str:
    return (
        f"TLS: {o.server} is not a name in the server's certificate; use the address the "
        "operator gave you, or ask them to add it (`starfed server certs --renew-server`)"
    )


def _not_registered(o: SiteOptions) -> str:
    return (
        f"refused: this site's key ({o.fingerprint}) is not registered; send "
        f"{pki.public_key_path(o.key) if o.key else 'the public key'} to the operator: "
        f"`starfed server sites add {o.name} <that file>`"
    )


def _auth_mismatch(o: SiteOptions) -> str:
    return (
        "refused: the server requires SuperNode authentication and this SuperNode did not "
        "authenticate (start with --key, over TLS)"
    )


def _key_revoked(o: SiteOptions) -> str:
    return (
        f"the server stopped accepting this site's key ({o.fingerprint}), most likely because "
        "the operator removed the site; a removed key never returns: make a new one with "
        "`starfed site keygen` and send its .pub to the operator"
    )


#: Known failure lines of Flower 1.42's SuperNode, first match wins (docs/deployment.md).
FAILURES: tuple[Failure, ...] = (
    Failure(re.compile(r"Hostname mismatch|IP address mismatch"), _wrong_name),
    Failure(re.compile(r"CERTIFICATE_VERIFY_FAILED"), _wrong_ca),
    Failure(re.compile(r"\[code: 2004\]"), _not_registered),
    Failure(re.compile(r"\[code: 2001\]"), _auth_mismatch),
)
#: Flower's SuperNode answers a 401 (its key was unregistered) by sending itself SIGINT, so it
#: ends "gracefully" with code 0; when nobody told it to stop, that line means revocation.
SELF_STOP = re.compile(r"SuperNode terminated gracefully")


@dataclass(frozen=True)
class SiteOptions:
    server: str  # HOST:PORT of the operator's gateway
    data: Path
    state: Path
    name: str
    device: str = DEFAULT_DEVICE
    ca: Path | None = None  # None only with insecure
    key: Path | None = None
    insecure: bool = False
    fingerprint: str = ""
    worker: bool = True  # answer messages in a long-lived site worker (starfed.client.worker)
    privacy: tuple[float, float] = (0.0, 0.0)  # the site's own target (ε, δ); ε 0: none
    give_up_s: float = dialling.GIVE_UP_S  # not reached once in this long: stop (0: never)
    privacy_unit: str = "image"  # what the site's ε protects: an image or a patient

    @property
    def worker_socket(self) -> Path:
        return self.state / "worker.sock"

    @property
    def superexec_secret(self) -> Path:
        return self.state / "superexec.secret"

    @property
    def run_file(self) -> Path:
        """The processes ``site start`` started (PIDs, start times), while they run."""
        return self.state / "run.json"

    def node_config(self) -> dict[str, str]:
        config = {
            "data-dir": str(self.data),
            "state-dir": str(self.state),
            "site-name": self.name,
            "device": self.device,
        }
        if self.worker:
            config["worker-socket"] = str(self.worker_socket)
        if self.privacy[0]:
            config["privacy-epsilon"], config["privacy-delta"] = map(str, self.privacy)
            config["privacy-unit"] = self.privacy_unit
        return config


def default_state_dir(name: str) -> Path:
    """``$XDG_DATA_HOME/starfed/sites/<name>`` (``~/.local/share/...``): the site's own, writable
    even when the data folder is a read-only mount."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "starfed" / "sites" / name


def site_name_from(data: Path) -> str:
    """A site name from the data folder's name: ``My Data`` -> ``My-Data``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", data.name).strip(".-")[:64] or "site"


def prepare(
    server: str,
    data: Path,
    *,
    ca: Path | None,
    key: Path | None,
    state: Path | None = None,
    name: str | None = None,
    device: str = DEFAULT_DEVICE,
    privacy: tuple[float, float] = (0.0, 0.0),
    insecure: bool = False,
    worker: bool = True,
    give_up_s: float = dialling.GIVE_UP_S,
    privacy_unit: str = "image",
) -> SiteOptions:
    """Check every input once, here; what comes out is what the SuperNode gets."""
    addresses.parse_address(server)  # ValueError: bad input
    data = data.expanduser().resolve()
    if not data.is_dir():
        raise SiteError(f"--data {data} is not a folder: a site without its data must not join")
    name = pki.check_site_name(name or site_name_from(data))
    fingerprint = ""
    if insecure:
        if key is not None:
            raise SiteError(
                "--key needs TLS: Flower refuses SuperNode authentication with --insecure"
            )
    else:
        if ca is None or key is None:
            raise SiteError("--ca and --key are required (or --insecure for a local test server)")
        ca = ca.expanduser().resolve()
        if not ca.is_file():
            raise SiteError(f"--ca {ca} is not a file: get ca.pem from the operator")
        key = key.expanduser().resolve()
        fingerprint = pki.read_private_key(key).fingerprint
    state = (state.expanduser() if state else default_state_dir(name)).resolve()
    if state == data or data in state.parents:
        raise SiteError(f"--state {state} must not be inside --data {data}")
    if not device.strip() or any(c.isspace() for c in device):
        raise SiteError(f"--device must be one word, e.g. auto, cpu, cuda:0; got {device!r}")
    if not give_up_s >= 0:
        raise SiteError(f"--give-up-after must be 0 (never) or more seconds, got {give_up_s}")
    return SiteOptions(
        server, data, state, name, device, ca, key, insecure, fingerprint, worker, privacy,
        give_up_s,
        privacy_unit,
    )  # fmt: skip


def write_node_config(path: Path, options: SiteOptions) -> None:
    """The node config as a TOML file: Flower reads a ``.toml`` path whole, so paths with
    spaces, quotes or any other character arrive unchanged (its ``k=v`` string form splits on
    spaces)."""
    path.write_text(tomli_w.dumps(options.node_config()), encoding="utf-8")


def write_superexec_secret(path: Path) -> None:
    """A new random SuperExec secret (0600) on every start: the SuperNode's Runtime API asks it
    of whoever acquires the site's tasks."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(32))


def supernode_command(options: SiteOptions, node_config: Path, runtime_port: int) -> list[str]:
    command = [
        processes.flower_executable("flower-supernode"),
        "--superlink",
        options.server,
        "--node-config",
        str(node_config),
        "--host",
        "127.0.0.1",
        "--port",
        str(runtime_port),
        "--isolation",
        "process",
        "--superexec-auth-secret-file",
        str(options.superexec_secret),
    ]
    if options.insecure:
        return [*command, "--insecure"]
    return [
        *command,
        "--root-certificates",
        str(options.ca),
        "--auth-supernode-private-key",
        str(options.key),
    ]


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


def _supervise(
    popen: subprocess.Popen,
    worker: _Worker | None,
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
    with locks.held(state / STATE_LOCK, me, functools.partial(_state_in_use, state)):
        yield


def _state_in_use(state: Path, err: locks.LockError) -> SiteError:
    if isinstance(err, locks.LockBusy) and isinstance(err.holder, data_lock.Holder):
        return SiteError(f"another `starfed site start` uses {state}: {err.holder.describe()}")
    if isinstance(err, locks.LockBusy):
        return SiteError(f"another `starfed site start` uses {state}")
    return SiteError(f"{err}; if no `starfed site start` uses {state}, remove it")


@dataclass
class _Worker:
    """The running site worker, and the reason it gave (``CANNOT_START``) if it stopped."""

    popen: subprocess.Popen
    log: Path
    said: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None  # copies its output to the log

    def listen(self, log: IO[str]) -> None:
        self.pump = threading.Thread(
            target=_pump, args=(self.popen.stdout, log, None, self.hear), daemon=True
        )
        self.pump.start()

    def hear(self, line: str) -> None:
        if line.startswith(CANNOT_START):
            self.said.append(line.removeprefix(CANNOT_START).strip())

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


def _start_worker(options: SiteOptions, env: dict[str, str], log: IO[str]) -> _Worker:
    """The site worker (``starfed.client.worker``): built once, it answers every message, so
    no message pays for importing torch, building the backbones and reading the caches."""
    socket_path = options.worker_socket
    socket_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "starfed.client.worker", "--socket", str(socket_path)]
    popen = processes.spawn(command, env=env, cwd=options.state)
    worker = _Worker(popen, Path(log.name))
    worker.listen(log)
    deadline = time.monotonic() + WORKER_START_S
    while not socket_path.exists():
        if (ended := worker.ended()) or time.monotonic() > deadline:
            popen.kill()
            raise SiteError(ended or f"the site worker did not start in {WORKER_START_S:.0f} s")
        time.sleep(0.1)
    return worker


def _start_superexec(
    options: SiteOptions, runtime_port: int, env: dict[str, str], log: IO[str], echo: IO[str] | None
) -> subprocess.Popen:
    """The site's SuperExec (``starfed.client.ops.superexec``); its tasks' output goes where the
    SuperNode's does."""
    address = f"127.0.0.1:{runtime_port}"
    command = [sys.executable, "-m", "starfed.client.ops.superexec",
               "--runtime-api-address", address,
               "--secret-file", str(options.superexec_secret)]  # fmt: skip
    popen = processes.spawn(command, env=env, cwd=options.state)
    threading.Thread(target=_pump, args=(popen.stdout, log, echo, lambda _: None),
                     kwargs={"local": dialling.LOCAL_RETRY}, daemon=True).start()  # fmt: skip
    return popen


def _pump(
    stream: IO[bytes],
    log: IO[str],
    echo: IO[str] | None,
    on_line: Callable[[str], str | None],
    local: re.Pattern[str] | None = None,
) -> None:
    """Copy the SuperNode's output line by line to the log (and terminal), classifying it;
    ``on_line`` may add a line of ours after it. Lines ``local`` matches are about a local
    connection (the SuperExec's to its SuperNode), not the server: to the log only, marked."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        note = on_line(line)
        lines = line + (f"starfed: {note}\n" if note else "")
        is_local = local is not None and local.search(line) is not None
        try:
            _write(log, f"(local SuperExec, not the server) {line}" if is_local else lines)
            if echo is not None and not is_local:
                _write(echo, lines)
        except (OSError, ValueError):  # closed after we gave up waiting: drop the rest
            return


def _write(out: IO[str], text: str) -> None:
    out.write(text)
    out.flush()


def _record(started: dict[str, subprocess.Popen | None], log: Path) -> ProcessRecord:
    """The record of the processes ``started`` that run (their output goes to ``log``)."""
    record = ProcessRecord.begin()
    for name, popen in started.items():
        if popen is not None and (
            managed := ManagedProcess.of(name, popen, cast(list[str], popen.args), log)
        ):
            record.processes.append(managed)
    return record


def run(
    options: SiteOptions,
    echo: IO[str] | None = sys.stdout,
    on_started: Callable[[ProcessRecord], None] = lambda record: None,
) -> SiteRun:
    """Run the SuperNode until it ends or we are told to stop (SIGINT/SIGTERM); ``on_started``
    gets the record of the processes once they all run."""
    with _state_lock(options.state, options.name), _data_lock(options):
        _check_none_left(options.run_file)
        return _run(options, echo, on_started)


@contextlib.contextmanager
def _data_lock(options: SiteOptions) -> Iterator[None]:
    try:
        with data_lock.hold(options.data, options.name, options.state):
            yield
    except data_lock.DataFolderInUse as err:
        raise SiteError(str(err)) from None


def _check_none_left(run_file: Path) -> None:
    """Refuse to start while a process an earlier start recorded still runs: a ``site start``
    that was killed may leave its SuperNode connected with this site's key."""
    record = ProcessRecord.load(run_file)
    if record is None:
        return
    if running := record.running():
        left = record.pids(running)
        raise SiteError(f"still running from an earlier `site start` ({left}): end them first")
    run_file.unlink()


def _run(
    options: SiteOptions, echo: IO[str] | None, on_started: Callable[[ProcessRecord], None]
) -> SiteRun:
    state = options.state
    node_config = state / "node-config.toml"
    write_node_config(node_config, options)
    log_file = state / "logs" / "supernode.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = processes.flower_env(state / "flwr-home")
    outcome = SiteRun(log_file=log_file)
    stop_reason: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        stop_reason.append(signal.Signals(signum).name)

    self_stopped: list[bool] = []

    dial = dialling.Dialling(options.server, options.give_up_s)

    def on_line(line: str) -> str | None:
        if SELF_STOP.search(line):
            self_stopped.append(True)
        if outcome.failure is None:
            for failure in FAILURES:
                if failure.pattern.search(line):
                    outcome.failure = failure.explain(options)
                    return None
        return dial.see(line, time.monotonic())

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    seen: set[ProcessId] = set()
    popen: subprocess.Popen | None = None
    worker: _Worker | None = None
    superexec: subprocess.Popen | None = None
    pump: threading.Thread | None = None
    try:
        with log_file.open("a") as log:
            _write(log, f"starfed: site {options.name} dials the server at {options.server}\n")
            try:
                if options.worker:
                    worker = _start_worker(options, env, log)
                    seen |= {root} if (root := ProcessId.of(worker.popen.pid)) else set()
                write_superexec_secret(options.superexec_secret)
                runtime_port = processes.free_port()
                command = supernode_command(options, node_config, runtime_port)
                popen = processes.spawn(command, env=env, cwd=state)
                seen |= {root} if (root := ProcessId.of(popen.pid)) else set()
                superexec = _start_superexec(options, runtime_port, env, log, echo)
                seen |= {root} if (root := ProcessId.of(superexec.pid)) else set()
                pump = threading.Thread(
                    target=_pump, args=(popen.stdout, log, echo, on_line), daemon=True
                )
                pump.start()
                started = {"worker": worker.popen if worker else None, "supernode": popen,
                           "superexec": superexec}  # fmt: skip
                record = _record(started, log_file)
                record.save(options.run_file)
                on_started(record)
                outcome.stopped_by = _supervise(popen, worker, seen, outcome, stop_reason, dial)
            finally:  # whatever happened: nothing of the SuperNode outlives us
                for helper in (worker.popen if worker else None, superexec):
                    if helper is not None and helper.poll() is None:
                        helper.terminate()
                if popen is not None:
                    if popen.poll() is None:
                        popen.kill()
                    popen.wait()  # reaped: its SuperExec sees the parent gone and ends too
                    outcome.returncode = popen.returncode
                    left = processes.wait_gone(seen, 5.0)
                    outcome.survivors = processes.terminate(left, grace=5.0)
                if pump is not None:
                    pump.join(5.0)  # the rest of the output, until the pipe closes
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not outcome.survivors:
        options.run_file.unlink(missing_ok=True)
    if outcome.stopped_by is None and stop_reason:
        outcome.stopped_by = stop_reason[0]
    if outcome.stopped_by is None and outcome.failure is None and self_stopped:
        outcome.failure = _self_stopped(options)
    return outcome


def _self_stopped(options: SiteOptions, offset_s: float | None = None) -> str:
    """Why the SuperNode stopped itself (Flower's 401): a clock outside Flower's window, told
    apart from a removed key by asking the server's time (``server.ops.clock``); else the key.
    ``offset_s``: the measured difference (tests)."""
    if offset_s is None:
        offset_s = clock.server_offset(options.server, options.ca, options.insecure)
    if offset_s is not None and clock.refused(offset_s):
        return (
            "refused for clock skew, not for the key: Flower answered 401 (Invalid SuperNode "
            f"authentication) and {clock.describe(offset_s)}; set this machine's clock right "
            "(NTP) and start again"
        )
    return _key_revoked(options)
