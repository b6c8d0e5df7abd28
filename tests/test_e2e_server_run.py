"""End to end on 127.0.0.1, as an operator and two sites would do it, every step a real command.

A started server and two ``starfed site start`` SuperNodes holding different classes
(``deployed.deployment``), ``starfed server run`` (exit 0), ``status --json`` (the classes and
who brought them), a new task folder at one site, ``run`` again (only the new classes train)
until no site brings a new class, the step's evaluation travelling with the closing sync;
leaving the deployment stops the sites and the server and checks that nothing is left. Several
minutes on 2 cores: each message costs a ClientApp process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deployed import RUN_TIMEOUT_S, deployment, run_settings, starfed
from site_folders import CLASSES, site_folder

from starfed.client.release_record import ReleaseRecord

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]


def test_two_sites_two_runs_on_a_started_server(tmp_path, monkeypatch) -> None:
    sites = {"farm-a": {"2026-03": CLASSES[0:2]}, "farm-b": {"2026-04": CLASSES[2:4]}}
    settings = run_settings("--json")
    with deployment(tmp_path, monkeypatch, sites) as deployed:
        log = deployed.log
        code, out = starfed("server", "run", *settings, log=log, timeout=RUN_TIMEOUT_S)
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

        site_folder(tmp_path / "farm-a", {"2026-06": CLASSES[4:6]}, train=8, test=3)  # new task
        # until no site brings a class: the step's evaluation travels with the closing sync
        until_done = [arg for arg in settings if arg != "--steps=1"]
        record = ReleaseRecord(tmp_path / "farm-a-state")
        before = len(list(record.releases()))
        code, out = starfed("server", "run", *until_done, log=log, timeout=RUN_TIMEOUT_S)
        second = json.loads(out)
        assert code == 0 and second["status"] == "completed", log.read_text()[-3000:]
        answered = [line.phase for line in list(record.releases())[before:]]
        assert answered == ["sync", "stage1", "stage2", "stage2_stats", "sync"]
        metrics = second["metrics"]
        assert metrics["steps"] == 2 and len(metrics["steps_this_run"]) == 1
        evaluations = [e for e in metrics["exchanges"] if e["phase"] == "evaluate"]
        assert {e["site"]: e["status"] for e in evaluations} == {"farm-a": "ok", "farm-b": "ok"}
        # (a stage-1 reply without rows: two empty updates, stage 1's and its statistics')
        trained = {
            e["site"]
            for e in metrics["exchanges"]
            if e["phase"] == "stage1" and e["bytes_up"] > 200
        }
        assert trained == {"farm-a"}  # only the new classes, which only farm-a holds
        assert {n for n, c in metrics["classes"].items() if c["step"] == 1} == set(CLASSES[4:6])
        assert set(metrics["site_accuracy"]) == {"farm-a", "farm-b"}
