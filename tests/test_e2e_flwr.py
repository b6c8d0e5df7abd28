"""End to end: a real `flwr run` (SuperLink, SuperExec, Ray simulation) through `starfed simulate`.

The smallest scenario that still exercises every phase twice: 3 clients, 2 tasks of 2 classes,
1 epoch per stage and per replay. A sampler thread records every process carrying the run's
``FLWR_HOME`` in its environment, independently of the command's own bookkeeping, so the test
can check by PID that nothing it started outlives it. About a minute on 2 cores. The other
tests check the command's argument handling without starting anything.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from process_sampler import ProcessSampler, alive

from starfed.cli import build_parser
from starfed.cli.simulate import build_overrides
from starfed.shared.config import ConfigError
from starfed.simulations.simulate import (
    SimulationError,
    find_project_dir,
    load_app_config,
    toml_value,
)

TIMEOUT_S = 170


def _overrides(*argv: str) -> dict:
    args = build_parser().parse_args(["simulate", *argv])
    return build_overrides(args, load_app_config(find_project_dir()))


def test_overrides_keep_supernodes_and_clients_together(tmp_path: Path) -> None:
    overrides = _overrides()
    assert overrides["num-clients"] == 5  # the pyproject default, always sent explicitly
    assert Path(overrides["results-dir"]).is_absolute()
    assert overrides["run-name"].startswith("fed-")
    overrides = _overrides(
        "--run-config=num-clients=4",
        "--run-config=preset=tiny",
        "--run-config=generative-replay=false",
        f"--results-dir={tmp_path}",
        "--run-name=x",
    )
    assert overrides["num-clients"] == 4
    assert overrides["generative-replay"] is False
    assert overrides["preset"] == "tiny"
    assert _overrides("--clients=3", "--run-config=num-clients=4")["num-clients"] == 3
    # values are typed by the schema; paths become absolute (the apps run elsewhere)
    overrides = _overrides("--run-config=alpha=1", '--run-config=run-name="a b"', "--seed=7")
    assert overrides["alpha"] == 1.0 and isinstance(overrides["alpha"], float)
    assert overrides["run-name"] == "a b" and overrides["seed"] == 7
    assert _overrides("--run-config=data-root=.")["data-root"] == str(Path.cwd())


def test_bad_overrides_are_rejected_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="unknown run-config"):
        _overrides("--run-config=no-such-key=1")
    with pytest.raises(ConfigError, match="--clients 0"):
        _overrides("--clients=0")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        _overrides("--run-config=seed")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # typer's use of click, on import
def test_toml_values_round_trip_through_flower_parser() -> None:
    from flwr.common.config import parse_config_args

    values = {"a": True, "b": 3, "c": 0.5, "d": "/tmp/with space/x", "e": ""}
    lines = [f"{k}={toml_value(v)}" for k, v in values.items()]
    assert parse_config_args(lines) == values


def test_without_project_dir_the_error_says_why(tmp_path: Path) -> None:
    with pytest.raises(SimulationError, match="project directory"):
        find_project_dir(str(tmp_path))


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_flwr_run_end_to_end(tmp_path: Path) -> None:
    results = tmp_path / "results"
    flwr_home = results / "e2e" / ".flwr"
    command = [
        sys.executable,
        "-m",
        "starfed.cli",
        "simulate",
        "--clients=3",
        "--tasks=2",
        "--classes-per-task=2",
        "--epochs=1",
        "--run-config=replay1-epochs=1",
        "--run-config=replay2-epochs=1",
        "--run-config=replay2-epochs-per-task=0",
        "--run-config=timeout-s=120",
        f"--results-dir={results}",
        "--run-name=e2e",
        f"--timeout={TIMEOUT_S - 30}",
    ]
    env = dict(os.environ, STARFED_CACHE_DIR=str(tmp_path / "cache"))
    sampler = ProcessSampler(f"FLWR_HOME={flwr_home}")
    sampler.start()
    log = tmp_path / "simulate.log"
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=out)
            try:
                rc = proc.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(f"starfed simulate ran past {TIMEOUT_S}s:\n{log.read_text()}")
    finally:
        sampler.done.set()
        sampler.join()
        leftovers = {p: cmd for p, (t, cmd) in sampler.seen.items() if alive(p, t)}
        for pid in leftovers:  # never leak into the rest of the session, even on failure
            os.kill(pid, signal.SIGKILL)

    output = log.read_text()
    assert rc == 0, output
    assert "finished:completed" in output, output
    assert not leftovers, f"processes left running: {leftovers}"
    commands = " ".join(cmd for _, cmd in sampler.seen.values())
    assert "flower-superlink" in commands and "flwr-simulation" in commands, sampler.seen

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
    assert metrics["config"]["run_config"]["num-clients"] == 3
