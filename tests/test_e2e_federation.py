"""End to end, deployed: a real SuperLink and two real SuperNodes on localhost, two server runs.

Two farms with different classes, each a `flower-supernode` whose node config names its own data
and state folders and its site worker (as `starfed site start` runs them). Server run 1 (`flwr
run`) learns what they hold; then a task folder appears at one farm, and server run 2 continues
the same federation folder and trains only the new classes. Plain HTTP on 127.0.0.1 (TLS and
node authentication are covered by the deployment tests). A sampler records every process
carrying the test's FLWR_HOME, so the test can check by PID that nothing it started outlives
it. A few minutes on 2 cores: each message still costs a ClientApp process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_sampler import ProcessSampler
from site_folders import CLASSES, site_folder

from starfed.ops.processes import FLOWER_ENV, free_port
from starfed.server.federation import Federation
from starfed.shared.codebook import wire
from starfed.shared.data.site_folder import class_key

RUN_TIMEOUT_S = 420
CONFIG = {
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "replay2-epochs-per-task": 0,
    "timeout-s": 120,
    "min-sites": 2,
    "wait-s": 90,
}


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _flwr(args: list[str], env: dict) -> dict:
    out = subprocess.run(
        [_bin("flwr"), *args, "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    reply = json.loads(out.stdout[out.stdout.index("{") :])
    assert reply.get("success"), (out.stdout, out.stderr)
    return reply


def _wait_for_port(port: int, timeout: float = 60) -> None:
    """Until the SuperLink listens: it takes seconds to start on a loaded machine, and `flwr
    run` gives up at once on a connection refused."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    raise AssertionError(f"the SuperLink did not listen on {port} within {timeout:.0f}s")


def _identity(federation: Path) -> tuple[str, object]:
    codebook = wire.read_file(federation / "codebook.bin")
    return codebook.fingerprint, codebook.dims


def _run(project: Path, federation: Path, env: dict) -> dict:
    """One server run through `flwr run`, followed to its end; its metrics.json."""
    args = ["run", str(project), "e2e"]
    for key, value in {**CONFIG, "federation-dir": str(federation)}.items():
        args += ["--run-config", f"{key}={json.dumps(value)}"]
    run_id = _flwr(args, env)["run-id"]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        status = _flwr(["ls", "e2e", "--run-id", str(run_id)], env)["runs"][0]["status"]
        if status.startswith("finished"):
            break
        time.sleep(2)
    assert status == "finished:completed", status
    return json.loads((federation / "metrics.json").read_text())


@pytest.mark.e2e
@pytest.mark.slow  # CI runs the same story through the CLI: tests/test_e2e_server_run.py
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_two_deployed_sites_and_a_federation_that_continues(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "e2e"\n\n[superlink.e2e]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n"
    )
    env = {
        **os.environ,
        **FLOWER_ENV,
        "FLWR_HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    farm_a = site_folder(tmp_path / "farm-a", {"2026-03": CLASSES[0:2]})
    site_folder(tmp_path / "farm-b", {"2026-04": CLASSES[2:4]})
    federation = tmp_path / "federation"
    sampler = ProcessSampler(f"FLWR_HOME={home}")
    sampler.start()
    processes: list[subprocess.Popen] = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, command: list[str]) -> None:
        with (logs / f"{name}.log").open("wb") as out:
            processes.append(
                subprocess.Popen(
                    command, env=env, stdout=out, stderr=out, cwd=tmp_path, start_new_session=True
                )
            )

    try:
        start(
            "superlink",
            [
                _bin("flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--database",
                str(tmp_path / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
        )
        _wait_for_port(port)
        for name in ("farm-a", "farm-b"):
            state = tmp_path / f"{name}-state"
            socket_path = state / "worker.sock"
            state.mkdir()
            start(
                f"{name}-worker",
                [sys.executable, "-m", "starfed.client.worker", "--socket", str(socket_path)],
            )
            node_config = (
                f"data-dir='{tmp_path / name}' state-dir='{state}' site-name='{name}' "
                f"cache-dir='{tmp_path / 'cache'}' worker-socket='{socket_path}'"
            )
            start(
                name,
                [
                    _bin("flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    node_config,
                ],
            )
        project = Path(__file__).resolve().parent.parent  # `flwr run .` from a checkout
        first = _run(project, federation, env)
        site_folder(farm_a, {"2026-06": CLASSES[4:6]})  # a new task appears at farm-a
        second = _run(project, federation, env)
    finally:  # SuperNodes first (they go offline), then the SuperLink; then whatever is left
        for process in [*processes[1:], processes[0]]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        time.sleep(1)
        leftovers = sampler.stop()

    assert not leftovers, f"processes left running: {leftovers}"
    for record in Federation(federation, *_identity(federation)).history():
        print(f"deployed step {record.step}: {record.wall_s:.1f}s", record.phase_seconds)
    assert first["status"] == "completed" and first["steps"] == 1
    assert {n: c["sites"] for n, c in first["classes"].items()} == {
        **{name: ["farm-a"] for name in CLASSES[0:2]},
        **{name: ["farm-b"] for name in CLASSES[2:4]},
    }
    assert second["status"] == "completed" and second["steps"] == 2
    codebook = wire.read_file(federation / "codebook.bin")
    expected = sorted(CLASSES[0:4], key=class_key) + sorted(CLASSES[4:6], key=class_key)
    assert codebook.names == expected and len(set(codebook.names)) == 6
    assert codebook.frozen == set(expected)
    stage1 = [e for e in second["exchanges"] if e["phase"] == "stage1"]
    # a reply without rows is its records' envelopes (the update and the stage-1 statistics
    # travelling with it: ~160 bytes); one class's rows are kilobytes
    trained = {e["site"] for e in stage1 if e["bytes_up"] > 1000}
    assert trained == {"farm-a"}  # run 2 trained the new classes, which only farm-a holds
    assert set(second["site_accuracy"]) == {"farm-a", "farm-b"}
    assert all(0 <= a <= 100 for a in second["site_accuracy"].values())
