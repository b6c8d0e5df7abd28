"""`starfed simulate`: one `flwr run` of the federated scenario on this machine, start to finish.

Plain `flwr run .` reads and writes ``~/.flwr``, rewrites connection settings, runs ``uv sync``
per run, reports telemetry and leaves a detached SuperLink behind that later runs silently reuse
(DESIGN §6). This command owns the whole life cycle instead: a Flower home inside the run's
results folder, a SuperLink it starts itself on a free localhost port, the app generated from
this installation and submitted, followed and stopped through ``starfed.ops.flower_runs``,
and at the end every process it started stopped by PID and checked gone. A run stopped by
Ctrl-C or SIGTERM is marked in its folder (``interrupted.json``). The command line, which checks
the run config before anything starts, is ``starfed.cli.simulate``.

Linux only: processes are tracked through ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from starfed.ops import exit_codes, flower_runs, processes
from starfed.ops.flower_runs import COMPLETED, FlowerCli, FlowerRunError, RunOutcome
from starfed.ops.processes import ProcessId
from starfed.server.federation import Federation
from starfed.server.folder_files import FederationError
from starfed.shared.metrics import results_line
from starfed.shared.progress import counted

STARTUP_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0
#: CPUs per simulated client. Ray sets OMP_NUM_THREADS to it, so torch in a ClientApp runs that
#: many threads; the local runtime gives each ClientApp call as many (same float rounding).
CLIENT_CPUS = 1
#: Warnings the run's Flower processes drop (``PYTHONWARNINGS``): Ray's and Flower's
#: FutureWarnings, typer's DeprecationWarnings. Warnings only: errors and logs still show.
QUIET = "ignore::FutureWarning,ignore::DeprecationWarning"
INTERRUPTED_FILE = "interrupted.json"
#: ``RAY_ADDRESS`` that makes ``ray.init`` start a Ray instance of its own: without one it joins
#: the cluster whose address a ``ray start`` left in /tmp/ray, whoever started it.
OWN_RAY = "local"
#: Lines of the run's log (``flwr log``) not shown: Flower 1.42's simulation runtime warns on
#: every run that its default number of simulated SuperNodes changed from 10 to 2, and says how
#: to resize the federation (``flwr/simulation/app.py``), whatever the run asked for; this
#: command sets the number for each run (``num-supernodes`` = ``num-sites``), and Flower's
#: next line, "Federation ... (N simulated SuperNodes)", says what it got.
FLOWER_NOISE = (
    "default simulated SuperNodes changed from 10 to 2",
    "To change federation size, use the following command",
    "flwr federation simulation-config",
    "Manually terminating ClientAppActor",  # a WARNING of every run's end, Ray's actors stopped
)
#: Python's report of a warning raised in Ray's or Flower's code ("…/ray/_private/worker.py:2051:
#: FutureWarning: Tip: …"); the next line, indented, is its source line.
LIBRARY_WARNING = re.compile(r"/(ray|flwr)/[\w/]+\.py:\d+: \w*Warning: ")
#: How long the run's log may take to drain after ``flwr log`` has ended.
DRAIN_S = 10.0
#: The simulation's apps (pyproject.toml's ``[tool.flwr.app.components]`` too): the ServerApp
#: that writes the simulated sites' folders, and the ClientApp every site runs.
APP_COMPONENTS = {
    **flower_runs.APP_COMPONENTS,
    "serverapp": "starfed.simulations.server_app:app",
}


class SimulationError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


def flower_env(flwr_home: Path, ray_address: str = "") -> dict[str, str]:
    """Flower's settings (``ops.processes.flower_env``), quiet warnings (``QUIET``) and the
    Ray cluster to run on: ``ray_address``, else ``RAY_ADDRESS``, else none — a Ray of the
    run's own, even where a ``ray start`` on this machine left its address for ``ray.init``."""
    warnings = ",".join(filter(None, [QUIET, os.environ.get("PYTHONWARNINGS")]))
    extra = {"PYTHONWARNINGS": warnings}
    address = ray_address or os.environ.get("RAY_ADDRESS", "")
    extra["RAY_ADDRESS"] = address or OWN_RAY
    return processes.flower_env(flwr_home, extra)


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
            processes.flower_executable("flower-superlink"),
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
        output = self.flwr_home / "superlink.out"
        self.process = processes.spawn(command, env=self.env, cwd=self.cwd, output=output)
        self.watch()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SimulationError(
                    f"flower-superlink exited with code {self.process.returncode}; see {output}"
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
            self.seen |= processes.descendants({root, *self.seen})

    def stop(self, at_once: bool = False) -> set[ProcessId]:
        """SIGTERM the SuperLink and wait for it, then end whatever it left (SIGKILL late
        ones). ``at_once`` (a run stopped by Ctrl-C) signals every process together: a
        ServerApp left running while the SuperLink goes would meet dead sites and record a
        failure (its checkpoints are atomic, so ending it mid-phase loses nothing). Returns
        the survivors."""
        if self.process is None:
            return set()
        self.watch()
        if at_once:
            survivors = processes.terminate(self.seen, STOP_GRACE_S / 2)
            self.process.wait()
            return survivors
        if self.process.poll() is None:
            processes.stop_child(self.process, STOP_GRACE_S)
        if processes.wait_gone(self.seen, STOP_GRACE_S / 2):
            return processes.terminate(self.seen, STOP_GRACE_S / 2)
        return set()


# --- the run -------------------------------------------------------------------------------


def without_noise(lines: Iterable[str]) -> Iterator[str]:
    """``lines`` of a run's log less Flower's notes (:data:`FLOWER_NOISE`) and the warnings that
    Ray's and Flower's code raise, each with the source line Python prints under it: what
    :data:`QUIET` keeps out of a run this command starts, kept out of a run ``flwr run .``
    started from a shell without it (``--follow``)."""
    source_line = False  # the line after a dropped warning: its indented source line
    for line in lines:
        if source_line and line.startswith(" "):
            source_line = False
            continue
        source_line = bool(LIBRARY_WARNING.search(line))
        if not source_line and not any(text in line for text in FLOWER_NOISE):
            yield line


@contextlib.contextmanager
def filtered_stdout() -> Iterator[IO[str]]:
    """A pipe to give a child process as its output: its lines reach our stdout as they come,
    less :func:`without_noise`'s."""
    read_end, write_end = os.pipe()

    def copy() -> None:
        with open(read_end, encoding="utf-8", errors="replace") as lines:
            for line in without_noise(lines):
                sys.stdout.write(line)
                sys.stdout.flush()

    thread = threading.Thread(target=copy, name="flower-log", daemon=True)
    thread.start()
    # Text, as the run's log stream writes it (a child process given it writes to its fd).
    sink = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 -- closed below
    try:
        yield sink
    finally:
        sink.close()  # the copy ends when the child's end closes too
        thread.join(DRAIN_S)


def simulate(
    overrides: dict, timeout: float, gpus_per_client: float = 0.0, ray_address: str = ""
) -> int:
    """Run one simulation to its end; the exit code of ``flower_runs.exit_code`` (0 completed,
    3 degraded, 1 failed, 130 interrupted), 1 as well when a process survived the stop.

    ``gpus_per_client`` is each simulated client's GPU share: Ray gives a client's worker
    process only its GPU (``CUDA_VISIBLE_DEVICES``), and none at 0, so ``device=auto`` follows it.
    SIGTERM is handled like Ctrl-C (stop the run, mark the folder, stop every process), so a CI
    or test timeout that terminates this command leaves nothing behind.

    ``ray_address`` (else ``RAY_ADDRESS``) is an existing Ray cluster's: Flower's simulation
    runtime calls ``ray.init`` with none, which connects to ``RAY_ADDRESS``, so the clients'
    actors run on the cluster's nodes and nothing of the cluster is this command's to stop
    (docs/simulation.md#on-a-ray-cluster). Without either, Ray would also join the cluster a
    plain ``ray start`` on this machine last recorded; the run gets a Ray of its own instead.
    """
    run_dir = Path(str(overrides["results-dir"])) / str(overrides["run-name"])
    run_dir.mkdir(parents=True, exist_ok=True)
    flwr_home = run_dir / ".flwr"
    cli = FlowerCli(flwr_home)
    n_supernodes = int(overrides["num-sites"])  # ClientApps read num-partitions from it
    started = time.monotonic()
    submitted_at = time.time()
    superlink = LocalSuperLink(flwr_home, run_dir, flower_env(flwr_home, ray_address))
    flower_runs.write_connection(flwr_home, superlink.address)
    app = flower_runs.write_app(flwr_home / "app", APP_COMPONENTS)
    outcome = RunOutcome(None, "not started")
    federation = {
        "num-supernodes": n_supernodes,
        "client-resources-num-cpus": CLIENT_CPUS,
        "client-resources-num-gpus": gpus_per_client,
    }
    with flower_runs.sigterm_as_interrupt():
        try:
            superlink.start()
            print(f"SuperLink on {superlink.address}, FLWR_HOME={flwr_home}")
            with filtered_stdout() as log_sink:
                outcome = flower_runs.run_to_end(
                    cli,
                    app,
                    overrides,
                    federation_config=federation,
                    log_sink=log_sink,
                    timeout_s=timeout,
                    on_submitted=lambda run_id: print(
                        f"run {run_id}: {counted(n_supernodes, 'simulated site')}, results in "
                        f"{run_dir}",
                        flush=True,
                    ),
                    on_poll=superlink.watch,
                )
        except KeyboardInterrupt:  # before the run was submitted
            outcome = RunOutcome(None, flower_runs.INTERRUPTED)
        except (SimulationError, FlowerRunError, processes.ProcessError) as err:
            outcome = RunOutcome(outcome.run_id, f"failed: {err}")
        finally:
            survivors = superlink.stop(at_once=outcome.interrupted)
    return _ended(run_dir, outcome, superlink.log_file, survivors, started, submitted_at)


def _ended(
    run_dir: Path,
    outcome: RunOutcome,
    superlink_log: Path,
    survivors: set[ProcessId],
    started: float,
    submitted_at: float,
) -> int:
    """Say how the run ended (``started``: monotonic; ``submitted_at``: wall clock, the
    oldest metrics.json that counts) and give its exit code."""
    wall = time.monotonic() - started
    if survivors:
        pids = sorted(p.pid for p in survivors)
        print(f"error: processes still running after stop: {pids}", file=sys.stderr)
    if outcome.interrupted:
        report_interrupted(run_dir, outcome, superlink_log)
        return exit_codes.EXIT_INTERRUPTED
    metrics = flower_runs.read_metrics(run_dir, since=submitted_at)
    if outcome.status != COMPLETED or metrics is None:
        print(
            f"error: run {outcome.run_id} {outcome.status} after {wall:.0f}s; logs: `flwr log` "
            f"output above, {superlink_log}",
            file=sys.stderr,
        )
        return exit_codes.EXIT_FAILED
    print(f"{outcome.status} in {wall:.0f}s · {flower_runs.summarize(metrics)}")
    print(results_line(run_dir))
    return exit_codes.EXIT_FAILED if survivors else flower_runs.exit_code(outcome, metrics)


def report_interrupted(run_dir: Path, outcome: RunOutcome, superlink_log: Path) -> None:
    """Mark the run folder interrupted (``interrupted.json``: when, which run, where the
    protocol stood) and say how to look at it: the folder holds a federation stopped mid-way,
    next to whatever an earlier phase wrote."""
    try:
        checkpoint = Federation.open(run_dir).checkpoints.last_checkpoint()
    except FederationError:  # stopped before the ServerApp made its folder
        checkpoint = None
    position = None if checkpoint is None else checkpoint.position
    marker = {
        "interrupted_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "run_id": outcome.run_id,
        "position": None if position is None else position.to_json(),
        "codebook_version": None if checkpoint is None else checkpoint.version,
    }
    (run_dir / INTERRUPTED_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    if position is None or not position.running:
        where = (
            "before any step started"
            if position is None
            else f"after {counted(position.step, 'step')}"
        )
    else:
        where = f"during step {position.step + 1} ({position.done_text() or 'no phase'} done)"
    print(
        f"interrupted: run {outcome.run_id} stopped {where}; marked in "
        f"{run_dir / INTERRUPTED_FILE}",
        file=sys.stderr,
    )
    print(
        f"continue it: starfed simulate --resume {run_dir}; look at it: starfed server status "
        f"--federation {run_dir}  (logs: {superlink_log})",
        file=sys.stderr,
    )


def follow(run_id: int, address: str) -> int:
    """Follow run ``run_id`` of the SuperLink at ``address`` (Flower's local one, which ``flwr
    run .`` starts and leaves) to its end: its log as :func:`filtered_stdout` shows a run of
    ``simulate``, then its final status. 0 completed, 1 otherwise; Ctrl-C stops following,
    not the run (130)."""
    with tempfile.TemporaryDirectory(prefix="starfed-follow-") as home:
        cli = FlowerCli(Path(home))
        flower_runs.write_connection(cli.flwr_home, address)
        try:
            status = cli.status(run_id)
            with filtered_stdout() as log_sink:
                logs = cli.stream_logs(run_id, log_sink)
                while not status.startswith(flower_runs.FINISHED):
                    time.sleep(flower_runs.POLL_S)
                    status = cli.status(run_id)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    logs.wait(DRAIN_S)
                logs.terminate()
        except FlowerRunError as err:
            raise SimulationError(f"--follow {run_id} on {address}: {err}") from None
        except KeyboardInterrupt:
            print(
                f"stopped following run {run_id}; it goes on (`flwr log {run_id} --stream`; "
                f"`flwr stop {run_id}` ends it)",
                file=sys.stderr,
            )
            return exit_codes.EXIT_INTERRUPTED
    print(f"run {run_id} {status}")
    return exit_codes.EXIT_OK if status == COMPLETED else exit_codes.EXIT_FAILED
