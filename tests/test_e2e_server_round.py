"""End to end on 127.0.0.1, as an operator and two sites would do it, every step a real command.

``starfed server start --insecure`` (loopback only: TLS and node authentication are covered by
tests/test_deploy_e2e.py), two ``starfed site start`` SuperNodes holding different classes,
``starfed server round`` (exit 0), ``status --json`` (the classes and who brought them), a new
task folder at one site, ``round`` again (only the new classes train), then ``site`` Ctrl-C
and ``server stop``: nothing left, checked by PID through an environment marker every process
started here inherits. Tiny backbones, one epoch everywhere, a few images per class. Several
minutes on 2 cores: each message costs a ClientApp process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_sampler import marked
from site_folders import CLASSES, site_folder

from starfed.shared.processes import free_port, send_signal

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]

MARKER = "STARFED_ROUND_TEST"
ROUND_TIMEOUT_S = 480
RUN_CONFIG = {
    "stage1-epochs": 1, "stage2-epochs": 1, "replay1-epochs": 1, "replay2-epochs": 1,
    "replay2-epochs-per-task": 0,
}  # fmt: skip


def starfed(*argv: str, log: Path, timeout: float = 120) -> tuple[int, str]:
    """A ``starfed`` command in its own process; (exit code, stdout); stderr to ``log``."""
    with log.open("ab") as err:
        result = subprocess.run(
            [sys.executable, "-m", "starfed.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    return result.returncode, result.stdout.decode()


def test_two_sites_two_rounds_on_a_started_server(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(MARKER, str(tmp_path))  # every process started here inherits it
    monkeypatch.setenv("STARFED_SERVER_DIR", str(tmp_path / "server"))
    log = tmp_path / "commands.log"
    farm_a = site_folder(tmp_path / "farm-a", {"2026-03": CLASSES[0:2]}, train=8, test=3)
    site_folder(tmp_path / "farm-b", {"2026-04": CLASSES[2:4]}, train=8, test=3)
    public = f"127.0.0.1:{free_port()}"
    settings = [f"--run-config={k}={v}" for k, v in RUN_CONFIG.items()]
    settings += ["--steps=1", "--min-sites=2", "--wait-s=120", "--timeout-s=180", "--json"]
    sites: list[subprocess.Popen] = []
    try:
        code, out = starfed("server", "start", "--insecure", "--listen", public,
                            "--internal-port", str(free_port()), log=log)  # fmt: skip
        assert code == 0, log.read_text()
        for name in ("farm-a", "farm-b"):
            with (tmp_path / f"{name}.log").open("wb") as output:
                sites.append(subprocess.Popen(
                    [sys.executable, "-m", "starfed.cli", "site", "start", "--insecure",
                     "--server", public, "--data", str(tmp_path / name), "--state",
                     str(tmp_path / f"{name}-state"), "--name", name, "--device", "cpu"],
                    stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                ))  # fmt: skip

        code, out = starfed("server", "round", *settings, log=log, timeout=ROUND_TIMEOUT_S)
        first = json.loads(out)
        assert code == 0 and first["status"] == "completed", log.read_text()[-3000:]
        assert first["metrics"]["steps"] == 1

        code, out = starfed("server", "status", "--json", log=log)
        status = json.loads(out)
        assert code == 0 and status["server"]["running"]
        assert {c["name"]: list(c["sites"]) for c in status["classes"]} == {
            **{name: ["farm-a"] for name in CLASSES[0:2]},
            **{name: ["farm-b"] for name in CLASSES[2:4]},
        }
        assert {s["name"]: s["status"] for s in status["sites"]} == {
            "farm-a": "online",
            "farm-b": "online",
        }

        site_folder(farm_a, {"2026-06": CLASSES[4:6]}, train=8, test=3)  # a new task appears
        code, out = starfed("server", "round", *settings, log=log, timeout=ROUND_TIMEOUT_S)
        second = json.loads(out)
        assert code == 0 and second["status"] == "completed", log.read_text()[-3000:]
        metrics = second["metrics"]
        assert metrics["steps"] == 2 and len(metrics["steps_this_run"]) == 1
        trained = {e["site"] for e in metrics["exchanges"]
                   if e["phase"] == "stage1" and e["bytes_up"] > 100}  # fmt: skip
        assert trained == {"farm-a"}  # only the new classes, which only farm-a holds
        assert {n for n, c in metrics["classes"].items() if c["step"] == 1} == set(CLASSES[4:6])
        assert set(metrics["site_accuracy"]) == {"farm-a", "farm-b"}
    finally:
        for site in sites:
            site.send_signal(signal.SIGINT)  # Ctrl-C: the site's SuperNode goes offline
        for site in sites:
            try:
                site.wait(60)
            except subprocess.TimeoutExpired:
                site.kill()
        code, out = starfed("server", "stop", "--json", log=log)
        time.sleep(1)
        left = marked(f"{MARKER}={tmp_path}")
        send_signal(left, signal.SIGKILL)  # never leak into the rest of the session
    assert code == 0 and json.loads(out)["survivors"] == [], out
    assert [site.returncode for site in sites] == [0, 0]
    assert left == {}, f"processes left running: {left}"
