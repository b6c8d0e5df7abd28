"""A site lost mid-step, with real processes: the step finishes degraded, the site comes back.

A started server and two sites (``deployed.deployment``); ``starfed server run`` runs until
the federation folder's checkpoint shows the sync done, then every process of farm-b (its
``site start``, SuperNode, SuperExec, worker: the site's machine dying) is killed with
SIGKILL in the middle of stage 1. The run goes on with farm-a and ends degraded (exit 3);
farm-b's classes got no statistics, so they are unregistered before replay
(docs/design.md#the-protocol): the codebook holds farm-a's classes only. farm-b starts again
with the same folders, and the next ``run`` registers and trains its classes as a new step.
Slow: the server waits for the dead node's replies until Flower marks it offline (about a
minute) on top of two runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deployed import RUN_TIMEOUT_S, deployment, run_settings, starfed
from site_folders import CLASSES

from starfed.ops.processes import send_signal, wait_gone
from starfed.server.federation import Federation
from starfed.server.folder_files import CODEBOOK_FILE
from starfed.shared.codebook import wire
from starfed.shared.data.site_folder import class_key

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]

SITES = {"farm-a": {"2026-03": CLASSES[0:2]}, "farm-b": {"2026-04": CLASSES[2:4]}}
SETTINGS = run_settings("--json", timeout_s=90)  # a dead node's phase costs at most this


def test_a_site_killed_mid_step_is_left_out_then_catches_up(tmp_path, monkeypatch) -> None:
    started = time.monotonic()
    with deployment(tmp_path, monkeypatch, SITES) as deployed:
        with deployed.log.open("ab") as err:
            first_round = subprocess.Popen(
                [sys.executable, "-m", "starfed.cli", "server", "run", *SETTINGS],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        deployed.wait_for_checkpoint("sync/0", timeout=RUN_TIMEOUT_S)
        farm_b = deployed.site_processes("farm-b")
        assert any("flower-supernode" in command for command in farm_b.values()), farm_b
        send_signal(farm_b, signal.SIGKILL)
        assert not wait_gone(farm_b, 10)
        assert deployed.sites["farm-b"].wait(10) == -signal.SIGKILL  # its `site start` too
        killed_at = deployed.checkpoint()
        assert (
            killed_at is not None and "stage1_stats/0" not in killed_at.position.to_json()["done"]
        )
        out, _ = first_round.communicate(timeout=RUN_TIMEOUT_S)
        first = json.loads(out)
        degraded_s = time.monotonic() - started
        assert first_round.returncode == 3 and first["status"] == "degraded", out
        exchanges = first["metrics"]["exchanges"]
        lost = {(e["site"], e["phase"]) for e in exchanges if e["status"] != "ok"}
        assert lost and {site for site, _ in lost} == {"farm-b"}, lost
        assert ("farm-b", "sync") not in lost and ("farm-b", "evaluate") in lost
        assert set(first["metrics"]["classes"]) == set(CLASSES[0:2])  # farm-b's unregistered
        codebook = wire.read_file(deployed.federation / CODEBOOK_FILE)
        assert codebook.names == sorted(CLASSES[0:2], key=class_key)
        assert codebook.frozen == set(CLASSES[0:2])

        deployed.start_site("farm-b")  # the machine is back: same key, data and state
        code, out = starfed("server", "run", *SETTINGS, log=deployed.log, timeout=RUN_TIMEOUT_S)
        second = json.loads(out)
        assert code == 0 and second["status"] == "completed", deployed.log.read_text()[-3000:]
        metrics = second["metrics"]
        assert metrics["steps"] == 2 and len(metrics["steps_this_run"]) == 1
        assert {n: c["step"] for n, c in metrics["classes"].items()} == {
            **dict.fromkeys(CLASSES[0:2], 0),
            **dict.fromkeys(CLASSES[2:4], 1),
        }
        # (a stage-1 reply without rows: two empty updates, stage 1's and its statistics')
        trained = {
            e["site"]
            for e in metrics["exchanges"]
            if e["phase"] == "stage1" and e["bytes_up"] > 200
        }
        assert trained == {"farm-b"}
        assert [len(row) for row in metrics["accuracy_matrix"]] == [1, 2]

    codebook = wire.read_file(deployed.federation / CODEBOOK_FILE)
    expected = sorted(CLASSES[0:2], key=class_key) + sorted(CLASSES[2:4], key=class_key)
    assert codebook.names == expected and codebook.frozen == set(expected)
    (first_step, second_step) = Federation.open(deployed.federation).history()
    assert (first_step.status, second_step.status) == ("degraded", "completed")
    print(f"site-lost e2e: degraded run {degraded_s:.0f}s, total {time.monotonic() - started:.0f}s")
