"""`starfed simulate --ray-address` and `starfed experiment --runtime flower --ray-address`:
the simulated clients run on an existing Ray cluster.

A one-node cluster on 127.0.0.1 (``ray start --head --block``, its own temp folder, so no other
``ray.init`` on this machine finds it) stands for several machines; the module's tests share
it. Every process of the cluster carries a marker in its environment, so the tests know them by
PID: they check that a run's ClientApp actors were the cluster's workers and that the run
started no Ray of its own; at the end the cluster's processes are stopped by PID (never ``ray
stop``, which ends every Ray on the machine by name). The numbers of a simulation equal those
of the same run on a Ray of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from in_process import SMALL_GRID_DEFAULTS
from process_sampler import ProcessSampler

from starfed.ops import processes
from starfed.ops.processes import ProcessId
from starfed.shared.codebook import wire

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]

TIMEOUT_S = 600
CLUSTER_CPUS = 2
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
    "--sites=2",
    "--tasks=2",
    f"--timeout={TIMEOUT_S - 60}",
]


def _ray() -> str:
    return str(Path(sys.executable).parent / "ray")


@dataclass(frozen=True)
class Cluster:
    """The running cluster: its head's address and a record of its processes."""

    address: str
    processes: ProcessSampler


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A one-node Ray cluster on 127.0.0.1 for the module's tests, then stopped by PID."""
    # A short temp folder: Ray's sockets live there, and socket paths are limited to 107 bytes.
    ray_temp = Path(tempfile.mkdtemp(prefix="sfray-", dir="/tmp"))
    port = processes.free_port()
    marker = f"STARFED_RAY_CLUSTER_TEST={ray_temp}"
    env = dict(os.environ, STARFED_RAY_CLUSTER_TEST=str(ray_temp), RAY_USAGE_STATS_ENABLED="0")
    sampler = ProcessSampler(marker)
    sampler.start()
    head = subprocess.Popen(
        [
            _ray(),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            f"--num-cpus={CLUSTER_CPUS}",
            "--num-gpus=0",
            "--include-dashboard=false",
            f"--dashboard-port={processes.free_port()}",
            f"--ray-client-server-port={processes.free_port()}",
            "--disable-usage-stats",
            f"--temp-dir={ray_temp}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not any("raylet" in command for command in sampler.seen.values()):
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        time.sleep(5)  # the head registers its node before clients connect
        yield Cluster(f"127.0.0.1:{port}", sampler)
    finally:
        head.terminate()
        survivors = processes.terminate(set(sampler.seen), 20)
        sampler.stop()
        shutil.rmtree(ray_temp, ignore_errors=True)
    assert not survivors, survivors


def _run(command: list[str], tmp_path: Path, flwr_home: Path, log: Path) -> ProcessSampler:
    """One command to its end, exit code 0; the processes it started (those of ``flwr_home``),
    none of them left running."""
    env = dict(os.environ, STARFED_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("RAY_ADDRESS", None)
    sampler = ProcessSampler(f"FLWR_HOME={flwr_home}")
    sampler.start()
    try:
        with log.open("wb") as out:
            rc = subprocess.run(
                command, env=env, stdout=out, stderr=out, timeout=TIMEOUT_S
            ).returncode
    finally:
        leftovers = sampler.stop()
    assert rc == 0, log.read_text()
    assert not leftovers, leftovers
    return sampler


def _simulate(tmp_path: Path, name: str, *extra: str) -> tuple[dict, ProcessSampler]:
    """One run to its end; its metrics and the processes it started."""
    results = tmp_path / "results"
    command = [*SMALL, f"--results-dir={results}", f"--run-name={name}", *extra]
    sampler = _run(command, tmp_path, results / name / ".flwr", tmp_path / f"{name}.log")
    return json.loads((results / name / "metrics.json").read_text()), sampler


def _actors(cluster: Cluster, before: set[ProcessId], flwr_home: Path) -> list[str]:
    """A run's ClientApp actors: the cluster's Ray workers started since ``before`` with the
    run's app folder on their path (Flower's runtime env) — seen while Ray's ``setup_worker``
    prepares them — or, once they have become the worker proper, with a job's runtime env (a
    runtime-env hash other than 0, the idle workers' own; the run is the cluster's only job).
    The sampler may see a short-lived ``setup_worker`` or not, so either counts."""
    app = str(flwr_home / "apps")
    return [
        command
        for process, command in cluster.processes.seen.items()
        if process not in before
        and (
            app in command
            or ("default_worker.py" in command and "--runtime-env-hash=0" not in command)
        )
    ]


def _own_ray(run: ProcessSampler) -> bool:
    return any("raylet" in command or "gcs_server" in command for command in run.seen.values())


def test_simulate_runs_its_clients_on_an_existing_ray_cluster(
    cluster: Cluster, tmp_path: Path
) -> None:
    before = set(cluster.processes.seen)
    on_cluster, run = _simulate(tmp_path, "cluster", f"--ray-address={cluster.address}")
    actors = _actors(cluster, before, tmp_path / "results" / "cluster" / ".flwr")
    assert actors, f"no worker of the run among the cluster's processes: {cluster.processes.seen}"
    assert not _own_ray(run), run.seen

    on_its_own, own = _simulate(tmp_path, "own")
    assert any("raylet" in command for command in own.seen.values())  # a Ray of the run's own
    assert on_cluster["accuracy_matrix"] == on_its_own["accuracy_matrix"]
    assert on_cluster["final_average_accuracy"] == on_its_own["final_average_accuracy"]
    cluster_codebook, own_codebook = (
        replace(wire.read_file(tmp_path / "results" / name / "codebook.bin"), metadata={})
        for name in ("cluster", "own")
    )  # the metadata names each run's federation
    assert wire.encode(cluster_codebook) == wire.encode(own_codebook)


GRID = f"""
[experiment]
name = "ray"
seeds = [1993]
methods = ["starfed"]
{SMALL_GRID_DEFAULTS}
[[scenario]]
name = "two-sites"
num-sites = 2
"""


def test_experiment_runs_its_flower_cells_on_an_existing_ray_cluster(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A one-cell grid, `--runtime flower --ray-address`: the cell's clients are the cluster's
    workers, and neither the experiment nor its cell starts a Ray of its own."""
    grid, results = tmp_path / "grid.toml", tmp_path / "results"
    grid.write_text(GRID)
    cell = results / "ray" / "two-sites__starfed__seed1993"
    command = [
        sys.executable,
        "-m",
        "starfed.cli",
        "experiment",
        str(grid),
        "--runtime=flower",
        f"--ray-address={cluster.address}",
        f"--results-dir={results}",
        f"--timeout={TIMEOUT_S - 60}",
    ]
    before = set(cluster.processes.seen)
    run = _run(command, tmp_path, cell / ".flwr", tmp_path / "experiment.log")
    summary = json.loads((results / "ray" / "summary.json").read_text())
    assert [(c["cell"], c["status"]) for c in summary["cells"]] == [(cell.name, "done")]
    assert isinstance(summary["cells"][0]["final_average_accuracy"], float)
    actors = _actors(cluster, before, cell / ".flwr")
    assert actors, f"no worker of the cell among the cluster's processes: {cluster.processes.seen}"
    assert run.seen and not _own_ray(run), run.seen
