"""One cell of an experiment: its definition file, whether it is done, and its run.

A cell runs in a process of its own (``python -m starfed.simulations.cell CELL_DIR``), as each
Flower run does: its memory is returned when it ends (the ClientApp keeps its sites per
process), a crash ends that cell only, and Ctrl-C stops it by PID. Its folder holds
``cell.json`` (what it is: method, seed, the scenario's run config; its runtime, wall and CPU
time), ``log.txt`` (everything it printed) and what its method writes, ``metrics.json`` first.

A cell of the ``starfed`` method runs on the local runtime (in its process), or on Flower's
(``Runtime``): then the cell's process is one ``starfed simulate`` run into the cell's folder,
its SuperLink and Ray its own, or the Ray cluster of ``--ray-address`` (``RAY_ADDRESS``).

A cell is **complete** when ``metrics.json`` holds a final average accuracy, its status is not
``failed`` and ``cell.json`` defines the same cell (a retired run-config key read as its new
name); anything else runs again from scratch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from starfed.ops import processes
from starfed.ops.exit_codes import EXIT_OK, FINISHED
from starfed.shared.files import write_atomic
from starfed.shared.retired_names import current_keys
from starfed.simulations.grid import Cell
from starfed.simulations.simulate import flower_env, simulate

CELL_FILE = "cell.json"
METRICS_FILE = "metrics.json"
LOG_FILE = "log.txt"
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class Runtime:
    """Where a cell's federation runs, with ``starfed simulate``'s options (the same knobs):
    it does not change what a cell computes, so a complete cell is complete on either."""

    name: str  # local, or flower: the cell is a `starfed simulate` run
    timeout: float
    gpus_per_client: float
    ray_address: str  # "": RAY_ADDRESS, else a Ray of the run's own (flower_env)


@dataclass
class Outcome:
    """What became of one cell in this invocation."""

    status: str  # done | skipped | failed
    seconds: float | None  # the cell's run time (for a skipped cell: when it ran)
    metrics: dict | None
    error: str = ""
    cpu_seconds: float | None = None  # CPU time of its process


def definition(cell: Cell) -> dict:
    """What makes a cell this cell; a folder whose ``cell.json`` differs is run again."""
    return {
        "scenario": cell.scenario.name,
        "method": cell.method,
        "seed": cell.seed,
        "run_config": cell.scenario.run_config,
    }


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def complete(folder: Path, cell: Cell) -> Outcome | None:
    """The finished cell in ``folder``, or None when it must run (again)."""
    record = read_json(folder / CELL_FILE)
    metrics = read_json(folder / METRICS_FILE)
    if record is None or metrics is None or _stored(record) != definition(cell):
        return None
    faa = metrics.get("final_average_accuracy")
    if not isinstance(faa, int | float) or math.isnan(faa) or metrics.get("status") == "failed":
        return None
    return Outcome("skipped", record.get("seconds"), metrics, cpu_seconds=record.get("cpu_seconds"))


def _stored(record: dict) -> object:
    """A ``cell.json``'s definition with its run-config keys under their current names: a cell
    run before a key was renamed (``starfed.shared.retired_names``) is still complete."""
    stored = record.get("definition")
    if isinstance(stored, dict) and isinstance(stored.get("run_config"), dict):
        return {**stored, "run_config": current_keys(stored["run_config"], quiet=True)}
    return stored


@dataclass
class Running:
    """A cell's process, started by ``start``: ``poll`` it until it has an outcome; ``stop``
    ends it (Ctrl-C, SIGTERM of the experiment)."""

    folder: Path
    cell: Cell
    runtime: Runtime
    child: subprocess.Popen
    started: float

    def poll(self) -> Outcome | None:
        """The cell's outcome once its process has ended (its record then written), else None."""
        ended = _reap(self.child)
        if ended is None:
            return None
        code, cpu = ended
        seconds = time.monotonic() - self.started
        _write_record(self.folder, self.cell, self.runtime, seconds, cpu)
        finished = complete(self.folder, self.cell)
        if code == 0 and finished is not None:
            return Outcome("done", seconds, finished.metrics, cpu_seconds=cpu)
        error = _last_line(self.folder / LOG_FILE) or f"exit code {code}"
        return Outcome("failed", seconds, None, error, cpu)

    def stop(self) -> None:
        """End the process by its PID: SIGTERM (a `simulate` run stops what it started), then
        SIGKILL after ``STOP_GRACE_S``."""
        processes.stop_child(self.child, STOP_GRACE_S)


def start(folder: Path, cell: Cell, runtime: Runtime, threads: int = 0) -> Running:
    """Start the cell in a child process, from an empty folder. The child's environment names
    the Ray cluster (``flower_env``), as a ``starfed simulate``'s does, and with ``threads``
    (cells side by side) its thread pools' size (``OMP_NUM_THREADS``, read by torch, numpy and
    scikit-learn when they load), unless the user set that: cells that each start a pool as
    large as the machine wait on each other's threads and take twice the CPU time."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    _write_record(folder, cell, runtime, None)
    command = processes.python_module("starfed.simulations.cell", str(folder))
    env = flower_env(folder / ".flwr", runtime.ray_address)
    if threads:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    with (folder / LOG_FILE).open("wb") as log:  # the child holds its own descriptor
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    return Running(folder, cell, runtime, child, time.monotonic())


def _reap(child: subprocess.Popen) -> tuple[int, float] | None:
    """The exit code and CPU seconds of an ended child (its own and its waited-for
    descendants'), or None while it runs. ``os.wait4`` gives one child's resource use, where
    ``getrusage(RUSAGE_CHILDREN)`` sums every child's: cells may run side by side (``--jobs``),
    and on a shared machine a cell's CPU time says more about its cost than its wall time."""
    pid, status, usage = os.wait4(child.pid, os.WNOHANG)
    if pid == 0:
        return None
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait
    return child.returncode, usage.ru_utime + usage.ru_stime


def _write_record(
    folder: Path,
    cell: Cell,
    runtime: Runtime,
    seconds: float | None,
    cpu_seconds: float | None = None,
) -> None:
    record = {
        "cell": cell.name,
        "definition": definition(cell),
        "runtime": asdict(runtime),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }
    write_atomic(folder / CELL_FILE, json.dumps(record, indent=2).encode())


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    return next((line for line in reversed(lines) if line), "")


def main(argv: list[str]) -> int:
    """The child: run the cell that ``CELL_DIR/cell.json`` defines, on its runtime."""
    from rich.console import Console

    from starfed.shared.config import parse
    from starfed.simulations.methods import METHODS, cell_run_config

    folder = Path(argv[0])
    record = json.loads((folder / CELL_FILE).read_text())
    spec, runtime = record["definition"], Runtime(**record["runtime"])
    values = parse({**spec["run_config"], "seed": spec["seed"]})
    if runtime.name == "flower":  # a FLOWER_METHODS cell; Ray's address is in RAY_ADDRESS
        code = simulate(
            cell_run_config(values, spec["seed"], folder), runtime.timeout, runtime.gpus_per_client
        )
        return EXIT_OK if code in FINISHED else code  # degraded: complete, as locally
    method = METHODS[spec["method"]].load()
    console = Console(file=sys.stdout, width=110, log_path=False)
    method(values, spec["seed"], folder, console)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
