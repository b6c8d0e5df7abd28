"""End to end: a real `flwr run` (SuperLink, SuperExec, Ray simulation) through `starfed simulate`.

The smallest scenario that still exercises every phase twice: 3 clients, 2 tasks of 2 classes,
1 epoch per stage and per replay. A sampler thread records every process carrying the run's
``FLWR_HOME`` in its environment, independently of the command's own bookkeeping, so the test
can check by PID that nothing it started outlives it. About a minute on 2 cores. A second run
is stopped with Ctrl-C after its first step: the run stops, its folder is marked interrupted,
nothing is left. The other tests check the command's argument handling without starting
anything.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from process_sampler import ProcessSampler

from starfed.cli import build_parser
from starfed.cli.simulate import build_overrides
from starfed.ops.processes import ProcessId
from starfed.shared.knob import ConfigError

TIMEOUT_S = 170
#: `starfed simulate` of the smallest scenario (add --sites, --tasks, the folders).
SMALL = [
    sys.executable,
    "-m",
    "starfed.cli",
    "simulate",
    "--classes-per-task=2",
    "--epochs=1",
    "--run-config=replay1-epochs=1",
    "--run-config=replay2-epochs=1",
    "--run-config=replay2-epochs-per-task=0",
    "--run-config=timeout-s=120",
    f"--timeout={TIMEOUT_S - 30}",
]


@dataclass
class Watched:
    """A started command, the log of its output, and the sampler that watched it
    (``leftovers``: what the sampler found still alive when the command's block was left)."""

    proc: subprocess.Popen
    log: Path
    sampler: ProcessSampler
    leftovers: dict[ProcessId, str] = field(default_factory=dict)


@contextmanager
def watched(
    command: list[str], env: dict[str, str], log: Path, flwr_home: Path
) -> Iterator[Watched]:
    """``command`` started in ``log``'s folder, its output in ``log``, while a sampler records
    every process carrying ``flwr_home``; on leaving the block (even by a failure) the command
    is killed by its PID if it still runs, and the sampler stops and kills what it found alive,
    which ``leftovers`` then holds."""
    sampler = ProcessSampler(f"FLWR_HOME={flwr_home}")
    sampler.start()
    run = None
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=log.parent, env=env, stdout=out, stderr=out)
            run = Watched(proc, log, sampler)
            yield run
    finally:
        if run is not None and run.proc.poll() is None:  # the block failed before it ended
            run.proc.kill()
            run.proc.wait()
        leftovers = sampler.stop()
        if run is not None:
            run.leftovers = leftovers


def _overrides(*argv: str) -> dict:
    args = build_parser().parse_args(["simulate", *argv])
    return build_overrides(args)


def test_overrides_keep_supernodes_and_clients_together(tmp_path: Path) -> None:
    overrides = _overrides()
    assert overrides["num-sites"] == 5  # the pyproject default, always sent explicitly
    assert Path(overrides["results-dir"]).is_absolute()
    assert overrides["run-name"].startswith("fed-")
    overrides = _overrides(
        "--run-config=num-sites=4",
        "--run-config=preset=tiny",
        "--run-config=confidence-modulation=false",
        f"--results-dir={tmp_path}",
        "--run-name=x",
    )
    assert overrides["num-sites"] == 4
    assert overrides["confidence-modulation"] is False
    assert overrides["preset"] == "tiny"
    assert _overrides("--sites=3", "--run-config=num-sites=4")["num-sites"] == 3
    # values are typed by the schema; paths become absolute (the apps run elsewhere)
    overrides = _overrides("--run-config=alpha=1", '--run-config=run-name="a b"', "--seed=7")
    assert overrides["alpha"] == 1.0 and isinstance(overrides["alpha"], float)
    assert overrides["run-name"] == "a b" and overrides["seed"] == 7
    assert _overrides("--run-config=data-root=.")["data-root"] == str(Path.cwd())


def test_bad_overrides_are_rejected_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="unknown run-config"):
        _overrides("--run-config=no-such-key=1")
    with pytest.raises(ConfigError, match="--sites 0"):
        _overrides("--sites=0")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        _overrides("--run-config=seed")


def test_a_failing_block_leaves_no_command_running(tmp_path: Path) -> None:
    """``watched`` stops its command by PID when the block fails before the command ends (a
    failed wait, a timeout): no test leaves it running."""
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    with (
        pytest.raises(subprocess.TimeoutExpired),
        watched(command, dict(os.environ), tmp_path / "sleep.log", tmp_path / ".flwr") as run,
    ):
        run.proc.wait(0.1)
    assert run.proc.returncode is not None  # ended, and reaped


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_flwr_run_end_to_end(tmp_path: Path) -> None:
    results = tmp_path / "results"
    flwr_home = results / "e2e" / ".flwr"
    command = [*SMALL, "--sites=3", "--tasks=2", f"--results-dir={results}", "--run-name=e2e"]
    env = dict(os.environ, STARFED_CACHE_DIR=str(tmp_path / "cache"))
    with watched(command, env, tmp_path / "simulate.log", flwr_home) as run:
        try:
            rc = run.proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"starfed simulate ran past {TIMEOUT_S}s:\n{run.log.read_text()}")

    output = run.log.read_text()
    assert rc == 0, output
    assert "finished:completed" in output, output
    # the ServerApp's own lines, streamed through `flwr log`: the run's progress is seen live
    assert re.search(r"^step 2: \d+ new class(es)? from", output, re.M), output
    assert "the run is over" in output, output
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    commands = run.sampler.commands()
    assert "flower-superlink" in commands and "flwr-simulation" in commands, run.sampler.seen

    metrics = json.loads((results / "e2e" / "metrics.json").read_text())
    matrix = metrics["accuracy_matrix"]
    assert [len(row) for row in matrix] == [1, 2]
    faa = metrics["final_average_accuracy"]
    assert isinstance(faa, int | float) and math.isfinite(faa)
    exchanges = metrics["exchanges"]
    assert {e["status"] for e in exchanges} == {"ok"}
    assert len({e["node_id"] for e in exchanges}) == 3
    assert sum(e["bytes_down"] for e in exchanges) > 0
    assert sum(e["bytes_up"] for e in exchanges) > 0
    assert metrics["config"]["run_config"]["num-sites"] == 3


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_ctrl_c_stops_the_run_and_marks_its_folder(tmp_path: Path) -> None:
    results = tmp_path / "results"
    run_dir = results / "stopped"
    # Ten steps: on an idle machine the ServerApp must not finish them all before `flwr stop`.
    command = [*SMALL, "--sites=2", "--tasks=10", f"--results-dir={results}", "--run-name=stopped"]
    env = dict(os.environ, STARFED_CACHE_DIR=str(tmp_path / "cache"))
    with watched(command, env, tmp_path / "simulate.log", run_dir / ".flwr") as run:
        deadline = time.monotonic() + TIMEOUT_S
        history = run_dir / "history.jsonl"
        while not (history.is_file() and history.read_text().strip()):  # step 1 is done
            if run.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no first step:\n{run.log.read_text()}")
            time.sleep(0.5)
        run.proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        rc = run.proc.wait(90)
        stop_s = time.monotonic() - started

    output = run.log.read_text()
    assert rc == 130, output
    assert stop_s < 60, output
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    marker = json.loads((run_dir / "interrupted.json").read_text())
    assert marker["run_id"] is not None and marker["position"]["step"] >= 1, marker
    assert marker["codebook_version"] > 0
    assert f"starfed server status --federation {run_dir}" in output
    assert not (run_dir / "metrics.json").exists()  # the ServerApp stopped, not only we
