"""`starfed simulate`: one `flwr run` of the federated scenario on this machine, start to finish.

Plain `flwr run .` reads and writes ``~/.flwr``, rewrites connection settings, runs ``uv sync``
per run, reports telemetry and leaves a detached SuperLink behind that later runs silently reuse
(DESIGN §6). This command owns the whole life cycle instead: a Flower home inside the run's
results folder, a SuperLink it starts itself on a free localhost port, the run submitted with
``flwr run``, progress from ``flwr log``, status from ``flwr ls --format json``, and at the end
every process it started stopped by PID and checked gone. The command line, which checks the
run config before anything starts, is ``starfed.cli.simulate``.

Linux only: processes are tracked through ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import starfed.simulations
from starfed.shared import processes
from starfed.shared.processes import ProcessId

CONNECTION = "starfed"  # the SuperLink connection's name in the run's own Flower config
FINISHED = "finished"
COMPLETED = "finished:completed"
EXIT_DEGRADED = 3  # the run finished, but some site failed, went silent or was rejected
POLL_S = 3.0
STARTUP_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0
#: CPUs per simulated client. Ray sets OMP_NUM_THREADS to it, so torch in a ClientApp runs that
#: many threads; the local runtime gives each ClientApp call as many (same float rounding).
CLIENT_CPUS = 1

#: Warnings the run's Flower processes drop (``PYTHONWARNINGS``): Ray's and Flower's
#: FutureWarnings, typer's DeprecationWarnings. Warnings only: errors and logs still show.
QUIET = "ignore::FutureWarning,ignore::DeprecationWarning"
#: Flower's log lines about the number of SuperNodes, which this command always sets itself
#: (they suggest a command the user need not run); every other line is shown.
NOISE = (
    "default simulated SuperNodes changed",
    "To change federation size, use the following command",
    "flwr federation simulation-config",
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class SimulationError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


# --- the project ---------------------------------------------------------------------------


def find_project_dir(explicit: str | None = None) -> Path:
    """The folder holding starfed's ``pyproject.toml``: `flwr run` builds the app from it.

    An editable install (or a source checkout) has it one level above ``simulations/``; a
    wheel install has no project folder, so the user must point at a checkout.
    """
    candidate = (
        Path(explicit).expanduser().resolve()
        if explicit
        else Path(starfed.simulations.__file__).resolve().parent.parent
    )
    pyproject = candidate / "pyproject.toml"
    if pyproject.is_file():
        with pyproject.open("rb") as f:
            config = tomllib.load(f)
        if config.get("project", {}).get("name") == "starfed" and _app_config(config):
            return candidate
    raise SimulationError(
        f"no starfed Flower app (pyproject.toml with [tool.flwr.app]) in {candidate}. "
        "`flwr run` builds the app from the project directory, which a wheel install does "
        "not have: clone the starfed repository and pass --project-dir /path/to/checkout "
        "(or install it with `pip install -e`)."
    )


def _app_config(config: Mapping) -> dict:
    return dict(config.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


def load_app_config(project_dir: Path) -> dict:
    """``[tool.flwr.app.config]``: the keys a run may override and their defaults."""
    with (project_dir / "pyproject.toml").open("rb") as f:
        return _app_config(tomllib.load(f))


# --- run config ----------------------------------------------------------------------------


def toml_value(value: object) -> str:
    """A value as `flwr run --run-config` parses it (TOML: quoted strings, true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if '"' in text:  # Flower's override parser ends a quoted value at the first quote
        raise SimulationError(f"run-config values cannot contain '\"': {text!r}")
    return json.dumps(text)


# --- processes ---------------------------------------------------------------------------


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Flower's settings (``shared.processes.flower_env``) and quiet warnings (``QUIET``)."""
    env = processes.flower_env(flwr_home)
    env["PYTHONWARNINGS"] = ",".join(filter(None, [QUIET, os.environ.get("PYTHONWARNINGS")]))
    return env


def flower_executable(name: str) -> str:
    try:
        return processes.flower_executable(name)
    except processes.ProcessError as err:
        raise SimulationError(str(err)) from None


class LocalSuperLink:
    """A simulation SuperLink this command owns: localhost only, its own port, state and logs.

    ``watch()`` records every process below it (SuperExec, the simulation runtime, Ray), so
    ``stop()`` can end them by PID even if one was orphaned, and report any that survived.
    """

    def __init__(self, flwr_home: Path, cwd: Path, env: Mapping[str, str]) -> None:
        self.flwr_home = flwr_home
        self.cwd = cwd
        self.env = dict(env)
        self.port = processes.free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_file = flwr_home / "superlink.log"
        self.process: subprocess.Popen | None = None
        self.seen: set[ProcessId] = set()

    def start(self) -> None:
        command = [
            flower_executable("flower-superlink"),
            "--insecure",  # plain HTTP, so bound to 127.0.0.1 only (docs/simulation.md)
            "--simulation",
            "--isolation",
            "subprocess",
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--database",
            str(self.flwr_home / "state.db"),
            "--log-file",
            str(self.log_file),
        ]
        output = (self.flwr_home / "superlink.out").open("wb")
        with output:
            self.process = subprocess.Popen(
                command,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches us, and we stop it in order
            )
        self.watch()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SimulationError(
                    f"flower-superlink exited with code {self.process.returncode}; "
                    f"see {self.flwr_home / 'superlink.out'}"
                )
            if self._healthy():
                return
            time.sleep(0.2)
        raise SimulationError(f"flower-superlink not ready after {STARTUP_TIMEOUT_S:.0f}s")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def watch(self) -> None:
        if self.process is not None and (root := ProcessId.of(self.process.pid)):
            self.seen |= processes.descendants([root])

    def stop(self) -> set[ProcessId]:
        """SIGTERM the SuperLink, then whatever it left; SIGKILL late ones. Returns survivors."""
        if self.process is None:
            return set()
        self.watch()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if processes.wait_gone(self.seen, STOP_GRACE_S / 2):
            processes.send_signal(self.seen, signal.SIGTERM)
            if processes.wait_gone(self.seen, STOP_GRACE_S / 2):
                processes.send_signal(self.seen, signal.SIGKILL)
        return processes.wait_gone(self.seen, 5.0)


# --- the run -------------------------------------------------------------------------------


def write_flower_config(flwr_home: Path, address: str) -> None:
    """A Flower config whose only connection is our SuperLink, so nothing else is reached."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{address}"\ninsecure = true\n'
    )


def _flwr(args: Sequence[str], env: Mapping[str, str], timeout: float = 120.0) -> str:
    try:
        result = subprocess.run(
            [flower_executable("flwr"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise SimulationError(f"`flwr {' '.join(args[:2])}` hung for {timeout:.0f}s") from None
    if result.returncode != 0:
        detail = (result.stdout + result.stderr).strip()
        raise SimulationError(f"`flwr {' '.join(args[:2])}` failed: {detail}")
    return result.stdout


def _json_tail(text: str) -> dict:
    """The JSON object ``flwr ... --format json`` prints (after any notice lines)."""
    return json.loads(text[text.index("{") :])


def submit(
    project_dir: Path, overrides: Mapping[str, object], n_supernodes: int, env: Mapping
) -> int:
    """`flwr run`; returns the run id. One --run-config per key keeps quoting simple."""
    command = ["run", str(project_dir), CONNECTION, "--format", "json"]
    for key, value in overrides.items():
        command += ["--run-config", f"{key}={toml_value(value)}"]
    command += [
        "--federation-config",
        f"num-supernodes={n_supernodes} client-resources-num-cpus={CLIENT_CPUS} "
        "client-resources-num-gpus=0.0",
    ]
    reply = _json_tail(_flwr(command, env))
    if not reply.get("success") or reply.get("run-id") is None:
        raise SimulationError(f"`flwr run` did not start a run: {reply}")
    return int(reply["run-id"])


def run_status(run_id: int, env: Mapping[str, str]) -> str:
    """``pending``, ``starting``, ``running`` or ``finished:<completed|failed|stopped>``."""
    reply = _json_tail(_flwr(["ls", CONNECTION, "--run-id", str(run_id), "--format", "json"], env))
    runs = reply.get("runs") or []
    if not runs:
        raise SimulationError(f"the SuperLink does not know run {run_id}: {reply}")
    return str(runs[0]["status"])


def stream_logs(run_id: int, env: Mapping[str, str]) -> subprocess.Popen:
    """`flwr log --stream` in the background, onto our stdout: the ServerApp's progress, less
    Flower's notices about settings this command makes itself (``NOISE``)."""
    stream = subprocess.Popen(
        [flower_executable("flwr"), "log", str(run_id), CONNECTION, "--stream"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    threading.Thread(target=_echo, args=(stream.stdout,), daemon=True).start()
    return stream


def _echo(lines: IO[bytes]) -> None:
    for line in lines:
        text = ANSI.sub("", line.decode(errors="replace")).strip()
        if text and text != "INFO :" and not any(noise in text for noise in NOISE):
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


def summarize(metrics: dict) -> str:
    faa = metrics.get("final_average_accuracy")
    parts = [f"{metrics.get('status', '?')} · {metrics.get('steps', 0)} steps"]
    parts.append(f"FAA {faa:.2f}%" if isinstance(faa, int | float) else "FAA n/a")
    forgetting = metrics.get("final_forgetting")
    if isinstance(forgetting, int | float):
        parts.append(f"forgetting {forgetting:.2f}")
    parts.append(f"server wall {metrics.get('wall_time_s', 0):.0f}s")
    return " · ".join(parts)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def simulate(project_dir: Path, overrides: dict, timeout: float) -> int:
    """Run one simulation to its end. Exit code: 0 when it finished:completed with a
    metrics.json and every step completed, 3 when it completed degraded (some site failed,
    went silent or was rejected), 1 otherwise.

    SIGTERM is handled like Ctrl-C (stop the run, then every process), so a CI or test
    timeout that terminates this command leaves nothing behind.
    """
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _simulate(project_dir, overrides, timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _simulate(project_dir: Path, overrides: dict, timeout: float) -> int:
    run_dir = Path(str(overrides["results-dir"])) / str(overrides["run-name"])
    run_dir.mkdir(parents=True, exist_ok=True)
    flwr_home = run_dir / ".flwr"
    env = flower_env(flwr_home)
    n_supernodes = int(overrides["num-clients"])  # ClientApps read num-partitions from it
    started = time.monotonic()
    superlink = LocalSuperLink(flwr_home, run_dir, env)
    write_flower_config(flwr_home, superlink.address)
    logs: subprocess.Popen | None = None
    run_id: int | None = None
    status = "not started"
    try:
        superlink.start()
        print(f"SuperLink on {superlink.address}, FLWR_HOME={flwr_home}")
        run_id = submit(project_dir, overrides, n_supernodes, env)
        print(f"run {run_id}: {n_supernodes} simulated clients, results in {run_dir}", flush=True)
        logs = stream_logs(run_id, env)
        while True:
            superlink.watch()
            status = run_status(run_id, env)
            if status.startswith(FINISHED):
                break
            if time.monotonic() - started > timeout:
                status = f"timed out (--timeout {timeout:.0f})"
                _flwr(["stop", str(run_id), CONNECTION], env)
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        status = "interrupted"
        if run_id is not None:
            with contextlib.suppress(SimulationError):  # best effort: the SuperLink goes next
                _flwr(["stop", str(run_id), CONNECTION], env)
    except SimulationError as err:
        status = f"failed: {err}"
    finally:
        if logs is not None:
            try:
                logs.wait(10)  # the stream ends by itself once the run has finished
            except subprocess.TimeoutExpired:
                logs.terminate()
                logs.wait()
        survivors = superlink.stop()
    wall = time.monotonic() - started
    if survivors:
        pids = sorted(p.pid for p in survivors)
        print(f"error: processes still running after stop: {pids}", file=sys.stderr)
    if status != COMPLETED or not (run_dir / "metrics.json").is_file():
        print(
            f"error: run {run_id} {status} after {wall:.0f}s; logs: `flwr log` output above, "
            f"{superlink.log_file}",
            file=sys.stderr,
        )
        return 1
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(f"{status} in {wall:.0f}s · {summarize(metrics)}")
    print(f"results: {run_dir} (metrics.json, accuracy_matrix.png, codebook.bin)")
    if survivors:
        return 1
    return EXIT_DEGRADED if metrics.get("status") == "degraded" else 0
