"""``starfed server start|stop``: the federation's SuperLink in the safe layout, as a daemon.

What ``start`` runs, each in its own session so it outlives the command:

- ``flower-superlink`` bound to **127.0.0.1** on an internal port: TLS, ``--enable-supernode-auth``
  (only registered site keys get in), state in ``superlink.db`` (registrations and runs survive
  restarts), a timestamped log file, no ``uv sync`` of app dependencies at run time, and
  ``--isolation process``: it starts no ServerApp itself.
- ``flower-superexec`` (ours, not the SuperLink's auto-started one) that runs the ServerApps,
  authenticated to the SuperLink with a random 0600 shared secret. In the default subprocess
  isolation Flower ignores that secret, and ``acquire-task`` (which hands out a pending
  ServerApp's token) answers anyone who reaches the port; with the secret it answers 401.
- the fleet-only gateway (``starfed.server.ops.gateway``) on the public address: the only thing
  sites reach. Flower 1.42 serves the unauthenticated Control API on the SuperLink's one port,
  so that port must never be public.

The SuperExec and the gateway end by themselves when the SuperLink ends (``--parent-pid``,
``--exit-with``). ``run.json`` records each process (PID, start time, boot id, command, log), and
``stop`` ends exactly those and everything below them, SIGTERM first, SIGKILL after a grace
period. There is no automatic restart: for that, run ``start --foreground`` under systemd.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from starfed.ops import flower_runs, processes
from starfed.ops.processes import ManagedProcess, ProcessId, ProcessRecord
from starfed.server.ops.certs import LOCAL_NAMES, certificate_sans
from starfed.server.ops.layout import ServerFolder
from starfed.shared.addresses import format_address, is_loopback, is_wildcard
from starfed.shared.files import write_atomic

DEFAULT_INTERNAL_PORT = 9093
STARTUP_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0
#: Stop order: sites lose their door first, the SuperLink (and its state) goes last.
STOP_ORDER = ("gateway", "superexec", "superlink")


class ServerError(RuntimeError):
    """Something the operator can fix; one line, exit code 1."""


@dataclass(frozen=True)
class ServerOptions:
    listen_host: str
    listen_port: int
    internal_port: int = DEFAULT_INTERNAL_PORT
    insecure: bool = False
    isolation: str = "process"  # or "subprocess": the SuperLink starts its own SuperExec
    max_body_mib: int = 65  # the gateway's MAX_BODY_BYTES
    max_per_address: int = 32  # the gateway's MAX_PER_ADDRESS

    @property
    def internal_address(self) -> str:
        return f"127.0.0.1:{self.internal_port}"

    @property
    def public_address(self) -> str:
        return format_address(self.listen_host, self.listen_port)


@dataclass(kw_only=True)
class RunRecord(ProcessRecord):
    """``run.json``: what ``start`` started and where it listens."""

    public_address: str
    internal_address: str
    insecure: bool
    isolation: str

    def superlink_alive(self) -> bool:
        return self.alive().get("superlink", False)


def gone(folder: ServerFolder, federation: Path, step_running: bool) -> str:
    """What to do once the SuperLink has died (docs/deployment.md#a-dead-superlink): start the
    server again, then continue the step it left running (or run the next)."""
    then = "resume" if step_running else "run"
    other = "" if federation == folder.federation else f" --federation {federation}"
    return (
        f"the SuperLink is gone: `starfed server start --dir {folder.root}`, then "
        f"`starfed server {then} --dir {folder.root}{other}`"
    )


# --- files ---------------------------------------------------------------------------------


def write_flower_config(folder: ServerFolder, options: ServerOptions) -> None:
    """``$FLWR_HOME/config.toml`` whose default connection is our SuperLink on 127.0.0.1, so the
    operator's ``flwr`` never falls back to Flower's auto-starting ``local`` connection."""
    ca = None if options.insecure else folder.ca_cert
    flower_runs.write_connection(folder.flwr_home, options.internal_address, ca)


def ensure_superexec_secret(folder: ServerFolder) -> Path:
    """A random 32-byte secret (hex), 0600, made once; Flower reads the file's exact bytes."""
    path = folder.superexec_secret
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        write_atomic(path, secrets.token_hex(32).encode())
        os.chmod(path, 0o600)
    return path


def flower_env(folder: ServerFolder) -> dict[str, str]:
    return processes.flower_env(folder.flwr_home)


# --- commands ------------------------------------------------------------------------------


def superlink_command(folder: ServerFolder, options: ServerOptions) -> list[str]:
    command = [processes.flower_executable("flower-superlink")]
    if options.insecure:
        command += ["--insecure"]  # Flower refuses --enable-supernode-auth without TLS
    else:
        command += [
            "--ssl-ca-certfile",
            str(folder.ca_cert),
            "--ssl-certfile",
            str(folder.server_cert),
            "--ssl-keyfile",
            str(folder.server_key),
            "--enable-supernode-auth",
        ]
    command += [
        "--host",
        "127.0.0.1",
        "--port",
        str(options.internal_port),
        "--database",
        str(folder.database),
        "--log-file",
        str(folder.superlink_log),
        "--disable-runtime-dependency-installation",
        "--isolation",
        options.isolation,
    ]
    if options.isolation == "process":
        command += ["--superexec-auth-secret-file", str(folder.superexec_secret)]
    return command


def superexec_command(
    folder: ServerFolder, options: ServerOptions, superlink_pid: int
) -> list[str]:
    command = [
        processes.flower_executable("flower-superexec"),
        "--runtime-api-address",
        options.internal_address,
        "--superexec-auth-secret-file",
        str(folder.superexec_secret),
        "--parent-pid",
        str(superlink_pid),
    ]
    if options.insecure:
        return [*command, "--insecure"]
    return [*command, "--root-certificates", str(folder.ca_cert)]


def gateway_command(folder: ServerFolder, options: ServerOptions, superlink_pid: int) -> list[str]:
    scheme = "http" if options.insecure else "https"
    command = processes.python_module(
        "starfed.server.ops.gateway",
        "--listen",
        options.public_address,
        "--upstream",
        f"{scheme}://{options.internal_address}",
        "--log-file",
        str(folder.gateway_log),
        "--max-body-mib",
        str(options.max_body_mib),
        "--max-per-address",
        str(options.max_per_address),
        "--exit-with",
        str(superlink_pid),
    )
    if options.insecure:
        return command
    return [
        *command,
        "--site-keys",
        str(folder.sites_file),
        "--ca",
        str(folder.ca_cert),
        "--cert",
        str(folder.server_cert),
        "--key",
        str(folder.server_key),
    ]


# --- start ---------------------------------------------------------------------------------


def _check_ready_to_start(folder: ServerFolder, options: ServerOptions) -> None:
    record = RunRecord.load(folder.run_file)
    if record is not None:
        if running := record.running():
            raise ServerError(
                f"already running in {folder.root} ({record.pids(running)}); "
                "`starfed server stop` first"
            )
        folder.run_file.unlink()  # a stale record: nothing of it runs any more
    if not options.insecure:
        missing = [
            p for p in (folder.ca_cert, folder.server_cert, folder.server_key) if not p.exists()
        ]
        if missing:
            raise ServerError(
                f"missing {', '.join(p.name for p in missing)} in {folder.certs}; "
                "run `starfed server certs --host <public name>` first"
            )
    if options.internal_port == options.listen_port:
        raise ServerError("--internal-port must differ from the --listen port")
    for host, port, what in (
        ("127.0.0.1", options.internal_port, "--internal-port"),
        (options.listen_host, options.listen_port, "--listen"),
    ):
        if not processes.port_is_free(host, port):
            raise ServerError(f"{format_address(host, port)} is in use; choose another {what}")


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def _ssl_context(
    folder: ServerFolder, options: ServerOptions, check_hostname: bool = True
) -> ssl.SSLContext | bool:
    """Our CA, for probing our own processes; the gateway's probe goes to the listen address,
    which need not be one of the certificate's names (sites dial those)."""
    if options.insecure:
        return False
    context = ssl.create_default_context(cafile=str(folder.ca_cert))
    context.check_hostname = check_hostname
    return context


def _answers(url: str, verify: ssl.SSLContext | bool, status: int) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return httpx.get(url, verify=verify, timeout=2.0, trust_env=False).status_code == status
        except httpx.HTTPError:
            return False

    return ready


def _accepts(host: str, port: int, context: ssl.SSLContext | bool) -> Callable[[], bool]:
    """Whether ``host:port`` completes a connection (and a TLS handshake with our CA): the
    gateway's readiness, asked without a request, which the gateway would log as refused."""

    def ready() -> bool:
        try:
            with socket.create_connection((host, port), timeout=2.0) as raw:
                if isinstance(context, ssl.SSLContext):
                    context.wrap_socket(raw, server_hostname=host).close()
            return True
        except OSError:  # ssl.SSLError too
            return False

    return ready


def _wait_until(managed: ManagedProcess, ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if not managed.id.alive():
            raise ServerError(
                f"{managed.name} exited during start-up: {_tail(Path(managed.output))} "
                f"(full output: {managed.output})"
            )
        if ready():
            return
        time.sleep(0.3)
    raise ServerError(f"{managed.name} did not answer {what} within {STARTUP_TIMEOUT_S:.0f}s")


def _launch(name: str, command: list[str], folder: ServerFolder) -> ManagedProcess:
    output = folder.output_log(name)
    if output.exists() and output.stat().st_size:  # keep one previous run's output
        output.replace(output.with_name(output.name + ".1"))
    popen = processes.spawn(command, env=flower_env(folder), cwd=folder.root, output=output)
    managed = ManagedProcess.of(name, popen, command, output)
    if managed is None:  # exited before we could look: its output says why
        raise ServerError(f"{name} exited at once: {_tail(output)}")
    return managed


def _local_url(options: ServerOptions, host: str, port: int, path: str) -> str:
    scheme = "http" if options.insecure else "https"
    return f"{scheme}://{format_address(host, port)}{path}"


def start(folder: ServerFolder, options: ServerOptions) -> RunRecord:
    """Start SuperLink, SuperExec and gateway; return the record once all three answer.

    On any failure everything started so far is stopped again, so a failed start leaves
    nothing behind.
    """
    _check_ready_to_start(folder, options)
    folder.create()
    folder.logs.mkdir(parents=True, exist_ok=True)
    write_flower_config(folder, options)
    if options.isolation == "process":
        ensure_superexec_secret(folder)
    record = RunRecord.begin(
        public_address=options.public_address,
        internal_address=options.internal_address,
        insecure=options.insecure,
        isolation=options.isolation,
    )
    try:
        superlink = _launch("superlink", superlink_command(folder, options), folder)
        record.processes.append(superlink)
        record.save(folder.run_file)  # from here on, `stop` can clean up even if we die
        health = _local_url(options, "127.0.0.1", options.internal_port, "/health")
        _wait_until(superlink, _answers(health, _ssl_context(folder, options), 200), health)
        if options.isolation == "process":
            superexec = _launch(
                "superexec", superexec_command(folder, options, superlink.pid), folder
            )
            record.processes.append(superexec)
            record.save(folder.run_file)
        gateway = _launch("gateway", gateway_command(folder, options, superlink.pid), folder)
        record.processes.append(gateway)
        record.save(folder.run_file)
        # a wildcard bind answers on loopback too, under a name we signed
        host = "127.0.0.1" if is_wildcard(options.listen_host) else options.listen_host
        accepts = _accepts(host, options.listen_port, _ssl_context(folder, options, False))
        _wait_until(gateway, accepts, format_address(host, options.listen_port))
        if options.isolation == "process":
            time.sleep(1.0)  # the SuperExec has no port to probe: it must at least stay up
            if not superexec.id.alive():
                raise ServerError(
                    f"superexec exited during start-up: {_tail(Path(superexec.output))}"
                )
    except BaseException:
        stop(folder)
        raise
    return record


# --- stop ----------------------------------------------------------------------------------


@dataclass
class StopReport:
    stopped: list[str] = field(default_factory=list)  # names that were running
    survivors: list[ProcessId] = field(default_factory=list)
    was_running: bool = True


def stop(folder: ServerFolder, grace: float = STOP_GRACE_S) -> StopReport:
    """End what ``start`` recorded, and their children, in :data:`STOP_ORDER`."""
    record = RunRecord.load(folder.run_file)
    if record is None:
        return StopReport(was_running=False)
    report = StopReport()
    if record.boot_id == processes.boot_id():
        by_name = {p.name: p for p in record.processes}
        for name in STOP_ORDER:
            if (managed := by_name.get(name)) is None or not managed.id.alive():
                continue
            report.stopped.append(name)
            report.survivors += sorted(
                processes.terminate([managed.id], grace), key=lambda p: p.pid
            )
    if not report.survivors:
        folder.run_file.unlink(missing_ok=True)
    return report


def wait_foreground(record: RunRecord) -> str:
    """Block until SIGTERM/SIGINT or until a managed process ends; return why."""
    reason = ""

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal reason
        reason = signal.Signals(signum).name

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not reason:
            dead = [name for name, up in record.alive().items() if not up]
            if dead:
                return f"{', '.join(dead)} ended"
            time.sleep(0.5)
        return reason
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def public_names(folder: ServerFolder, options: ServerOptions) -> Sequence[str]:
    """Addresses sites can dial, never a wildcard bind address (``0.0.0.0``): the server
    certificate's names (a site's TLS refuses any other) — the remote ones, or the local ones
    when it has no other or the gateway listens on loopback; without TLS the listen host."""
    host, port = options.listen_host, options.listen_port
    if options.insecure or not folder.server_cert.exists():
        return [format_address("127.0.0.1" if is_wildcard(host) else host, port)]
    names = certificate_sans(folder.server_cert)
    local = [n for n in names if n in LOCAL_NAMES]
    remote = [n for n in names if n not in LOCAL_NAMES]
    chosen = local if is_loopback(host) or not remote else remote
    return [format_address(n, port) for n in chosen]
