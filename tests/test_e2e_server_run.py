"""End to end on 127.0.0.1, as an operator and two sites would do it, every step a real command.

A started server and two ``starfed site start`` SuperNodes holding different classes
(``deployed.deployment``), ``starfed server run`` (exit 0), ``status --json`` (the classes and
who brought them), a new task folder at one site, ``run`` again (only the new classes train)
until no site brings a new class, the step's evaluation travelling with the closing sync;
leaving the deployment stops the sites with Ctrl-C on their terminals and the server, and
checks that nothing is left. Slow: a ``run`` Ctrl-C'd on the operator's terminal, then
``resume``. Several minutes on 2 cores: each message costs a ClientApp process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from deployed import RUN_TIMEOUT_S, Deployment, deployment, run_settings, starfed
from site_folders import CLASSES, site_folder
from terminal import Terminal

from starfed.client.release_record import ReleaseRecord
from starfed.host.process_identity import ProcessId
from starfed.ops.exit_codes import EXIT_INTERRUPTED
from starfed.ops.flower_runs import FLOWER_CHATTER
from starfed.ops.processes import descendants, wait_gone

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]


def test_two_sites_two_runs_on_a_started_server(tmp_path, monkeypatch) -> None:
    sites = {"farm-a": {"2026-03": CLASSES[0:2]}, "farm-b": {"2026-04": CLASSES[2:4]}}
    settings = run_settings("--json")
    with deployment(tmp_path, monkeypatch, sites) as deployed:
        log = deployed.log
        before = log.stat().st_size
        code, out = starfed("server", "run", *settings, log=log, timeout=RUN_TIMEOUT_S)
        first = json.loads(out)
        assert code == 0 and first["status"] == "completed", log.read_text()[-3000:]
        assert first["metrics"]["steps"] == 1
        # the streamed log (stderr with --json): starfed's lines, Flower's in the run's log file
        streamed = log.read_text()[before:]
        assert "step 1: 4 new classes from 2 sites" in streamed, streamed
        assert not any(FLOWER_CHATTER.match(line) for line in streamed.splitlines()), streamed
        kept = deployed.server.run_log(first["run_id"]).read_text()
        assert "INFO :      Start `flwr-serverapp` process" in kept and "step 1: " in kept

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


@pytest.mark.slow
def test_ctrl_c_on_the_operators_terminal_stops_the_run_and_resume_finishes_it(
    tmp_path, monkeypatch
) -> None:
    """Ctrl-C as a terminal sends it, to the whole foreground process group (issue 47's walk
    sent SIGINT to one process). Slow: a deployment of its own, and the Ctrl-C'd run costs
    about one run more than the test above (bench/results/test_suite.md)."""
    sites = {"farm-a": {"2026-03": CLASSES[0:2]}, "farm-b": {"2026-04": CLASSES[2:4]}}
    with deployment(tmp_path, monkeypatch, sites) as deployed:
        log = deployed.log
        interrupted_by_ctrl_c(deployed, tmp_path / "interrupted.log")
        code, out = starfed(
            "server", "resume", *run_settings("--json"), log=log, timeout=RUN_TIMEOUT_S
        )
        resumed = json.loads(out)
        assert code == 0 and resumed["status"] == "completed", log.read_text()[-3000:]
        assert "continuing step 1 after its completed phases (sync/0" in log.read_text()
        assert resumed["metrics"]["steps"] == 1
        # each site trained its own classes, in whichever run sent stage 1 (the Ctrl-C lands
        # after the sync, a phase or two later): said on each site's terminal
        for name, tasks in sites.items():
            trained = [
                line
                for line in deployed.sites[name].text().splitlines()
                if "step 1 · stage1/0: trained" in line
            ]
            classes = next(iter(tasks.values()))
            assert trained and all(c in line for line in trained for c in classes), trained


def interrupted_by_ctrl_c(deployed: Deployment, output: Path) -> None:
    """``server run`` on the operator's terminal, Ctrl-C once its first step has synced (the
    sites get Ctrl-C the same way when the deployment ends): exit 130, one line saying how to
    continue, and nothing it started left running, the ServerApp included."""
    command = [sys.executable, "-m", "starfed.cli", "server", "run", *run_settings()]
    run = Terminal(command, output)
    deployed.wait_for_checkpoint("sync/0", timeout=RUN_TIMEOUT_S)
    root = ProcessId.of(run.pid)
    assert root is not None, run.text()
    started = descendants([root]) | set(deployed.serverapps())
    run.ctrl_c()
    code, said = run.wait(120), run.text()
    assert code == EXIT_INTERRUPTED and "Traceback" not in said, said
    assert said.splitlines()[-1].removeprefix("^C").startswith("stopped run "), said  # ^C: echo
    assert f"continue it: starfed server resume --dir {deployed.server.root}" in said, said
    assert wait_gone(started, 60) == set(), said
