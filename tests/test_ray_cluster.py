"""`starfed simulate --ray-address`: the simulated clients run on an existing Ray cluster.

A one-node cluster on 127.0.0.1 (``ray start --head --block``, its own temp folder, so no other
``ray.init`` on this machine finds it) stands for several machines. Every process of the
cluster carries a marker in its environment, so the test knows them by PID: it checks that the
run's ClientApp actors were the cluster's workers, that the run started no Ray of its own, and
at the end stops the cluster's processes by PID (never ``ray stop``, which ends every Ray on
the machine by name). The numbers equal those of the same run on a Ray of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
from process_sampler import ProcessSampler

from starfed.server.ops import processes
from starfed.shared.codebook import wire

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]

TIMEOUT_S = 600
CLUSTER_CPUS = 2
SMALL = [
    sys.executable, "-m", "starfed.cli", "simulate", "--classes-per-task=2", "--epochs=1",
    "--run-config=replay1-epochs=1", "--run-config=replay2-epochs=1",
    "--run-config=replay2-epochs-per-task=0", "--clients=2", "--tasks=2",
    f"--timeout={TIMEOUT_S - 60}",
]  # fmt: skip


def _ray() -> str:
    return str(Path(sys.executable).parent / "ray")


def _simulate(tmp_path: Path, name: str, *extra: str) -> tuple[dict, ProcessSampler]:
    """One run to its end; its metrics and the processes it started."""
    results = tmp_path / "results"
    command = [*SMALL, f"--results-dir={results}", f"--run-name={name}", *extra]
    env = dict(os.environ, STARFED_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("RAY_ADDRESS", None)
    sampler = ProcessSampler(f"FLWR_HOME={results / name / '.flwr'}")
    sampler.start()
    log = tmp_path / f"{name}.log"
    try:
        with log.open("wb") as out:
            rc = subprocess.run(
                command, env=env, stdout=out, stderr=out, timeout=TIMEOUT_S
            ).returncode
    finally:
        leftovers = sampler.stop()
    assert rc == 0, log.read_text()
    assert not leftovers, leftovers
    return json.loads((results / name / "metrics.json").read_text()), sampler


def test_simulate_runs_its_clients_on_an_existing_ray_cluster(tmp_path: Path) -> None:
    # A short temp folder: Ray's sockets live there, and socket paths are limited to 107 bytes.
    ray_temp = Path(tempfile.mkdtemp(prefix="sfray-", dir="/tmp"))
    port = processes.free_port()
    marker = f"STARFED_RAY_CLUSTER_TEST={ray_temp}"
    env = dict(os.environ, STARFED_RAY_CLUSTER_TEST=str(ray_temp), RAY_USAGE_STATS_ENABLED="0")
    cluster = ProcessSampler(marker)
    cluster.start()
    head = subprocess.Popen(
        [_ray(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         f"--num-cpus={CLUSTER_CPUS}", "--num-gpus=0", "--include-dashboard=false",
         f"--dashboard-port={processes.free_port()}",
         f"--ray-client-server-port={processes.free_port()}",
         "--disable-usage-stats", f"--temp-dir={ray_temp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any("raylet" in command for command in cluster.seen.values()):
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        time.sleep(5)  # the head registers its node before clients connect
        before = set(cluster.seen)
        on_cluster, run = _simulate(tmp_path, "cluster", f"--ray-address=127.0.0.1:{port}")
        # The run's ClientApp actors: the cluster's Ray workers started with the run's app
        # folder on their path (Flower's runtime env), none of the run's own processes.
        app = str(tmp_path / "results" / "cluster" / ".flwr" / "apps")
        actors = [c for p, c in cluster.seen.items() if p not in before and app in c]
    finally:
        head.terminate()
        survivors = processes.terminate(set(cluster.seen), 20)
        cluster.stop()
        shutil.rmtree(ray_temp, ignore_errors=True)
    assert not survivors, survivors
    assert actors, f"no worker of the run among the cluster's processes: {cluster.seen}"
    assert not any("raylet" in command or "gcs_server" in command
                   for command in run.seen.values()), run.seen  # fmt: skip

    on_its_own, own = _simulate(tmp_path, "own")
    assert any("raylet" in command for command in own.seen.values())  # a Ray of the run's own
    assert on_cluster["accuracy_matrix"] == on_its_own["accuracy_matrix"]
    assert on_cluster["final_average_accuracy"] == on_its_own["final_average_accuracy"]
    cluster_codebook, own_codebook = (
        replace(wire.read_file(tmp_path / "results" / name / "codebook.bin"), metadata={})
        for name in ("cluster", "own")
    )  # the metadata names each run's federation
    assert wire.encode(cluster_codebook) == wire.encode(own_codebook)
