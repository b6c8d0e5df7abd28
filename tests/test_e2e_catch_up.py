"""A slow site times out alone, with real processes (issue 43, attack 7, against Flower's Grid).

A started server and farm-a (``deployed.deployment``); a first ``starfed server run`` founds the
federation. The next step is then run twice from there: once with farm-a alone (on a copy of the
federation folder, farm-a's state folder given back after: the measured run), once with farm-b
joining, the run's ``part-bytes`` small enough that farm-b's catch-up is four parts and farm-a's
deltas one message. Once farm-b has answered its first part (its staging shows a second one),
every process of farm-b (its ``site start``, SuperNode, SuperExec, the ClientApp answering) is
stopped with SIGSTOP: a site that stops reading. The step goes on with farm-a: farm-a's first
phase is answered while farm-b's catch-up is still going (its parts are logged only once it
ended), farm-b's unfinished catch-up is in the step's findings (phase ``catch_up``; noted, since
it staged a part: it resumes) and farm-a's accuracy is
that of the step without farm-b. After SIGCONT a third run catches farm-b up: it ends holding
the server's codebook. Slow: five steps in four server runs and two site restarts, minutes on 2
cores.

Why no ratio of seconds: the two steps run at different times, so at different loads (a ratio
``with farm-b < 2 × without`` failed once in four runs beside other tests). That farm-a did not
wait is read from the order of the run's log instead, which no load changes; and a step that
waited for a site that never answers would end only when the part timed out (``timeout-s``, set
far above the step) or when Flower found farm-b's SuperNode gone (no heartbeat for 2 × 30 s:
33-60 s after the stop) — the step's wall is held under the first, its log order rules out both.
The third run races farm-b's two parts against farm-a's four phases before the evaluation:
each is a ClientApp process of its own, so load slows both alike.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deployed import (
    RUN_TIMEOUT_S,
    TEST_IMAGES,
    TRAIN_IMAGES,
    Deployment,
    deployment,
    run_settings,
    starfed,
)
from site_folders import CLASSES, site_folder
from test_catch_up import one_class_parts, same_codebook

from starfed.client.memory import CODEBOOK_FILE
from starfed.ops.processes import ProcessId, send_signal
from starfed.server.federation import Federation
from starfed.server.records import StepRecord
from starfed.shared.codebook import parts
from starfed.shared.codebook.codebook import CodebookError
from starfed.shared.codebook.held import STAGING_DIR, HeldCodebook
from starfed.shared.protocol import CATCH_UP_KEY, Phase

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.adversarial,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]

FARM_A = {"2026-03": CLASSES[0:6], "2026-04": CLASSES[6:7]}
# farm-b's class is farm-a's new one: a class of its own would be in farm-a's bank from the
# sync until the statistics phase unregistered it, and change farm-a's step (the step without
# farm-b is then another step: tests/test_catch_up.py's slow site shares its class too)
FARM_B = {"2026-04": CLASSES[6:7]}
FARM_A_LATER = {"2026-05": CLASSES[7:8]}  # the third run's step
ALONE = run_settings("--json", "--min-sites=1")  # farm-a alone
BOTH = ["--min-sites=2"]
SOCKETS = shutil.ignore_patterns("*.sock")  # a state folder's copy: its worker makes its own


def _run(deployed: Deployment, *settings: str) -> tuple[int, dict]:
    code, out = starfed("server", "run", *settings, log=deployed.log, timeout=RUN_TIMEOUT_S)
    assert out, deployed.log.read_text()[-3000:]
    return code, json.loads(out)


def _step(federation: Path, step: int) -> StepRecord:
    [record] = [r for r in Federation.open(federation).history() if r.step == step]
    return record


def _restart(deployed: Deployment, name: str, state: Path) -> None:
    """Stop a site, give it back the state folder ``state`` (a copy made while it was stopped),
    start it again."""
    assert deployed.stop_site(name) == 0
    shutil.rmtree(deployed.root / f"{name}-state")
    shutil.copytree(state, deployed.root / f"{name}-state", symlinks=True)
    deployed.start_site(name)


def _staged_parts(state: Path) -> int:
    """The catch-up parts a site has staged so far (0: none, or none any more)."""
    try:
        return parts.Staging(state / STAGING_DIR).staged().received
    except CodebookError:
        return 0


def _stop_every_process(deployed: Deployment, name: str) -> dict[ProcessId, str]:
    """SIGSTOP to every process of a site, again until no new one appears (one started while
    its parent was being stopped); the stopped ones."""
    stopped: dict[ProcessId, str] = {}
    while found := {p: c for p, c in deployed.site_processes(name).items() if p not in stopped}:
        send_signal(found, signal.SIGSTOP)
        stopped.update(found)
    return stopped


def test_a_site_that_stops_reading_its_parts_times_out_alone(tmp_path, monkeypatch) -> None:
    started = time.monotonic()
    with deployment(tmp_path, monkeypatch, {"farm-a": FARM_A}) as deployed:
        code, founding = _run(deployed, *ALONE)
        assert code == 0 and founding["status"] == "completed", founding
        founded = Federation.open(deployed.federation).checkpoints.codebook()
        # parts of two classes: farm-a's deltas fit one, the whole codebook (seven classes) not
        longest = max(founded.names, key=lambda name: len(name.encode()))
        slack = 2 * max(len(name.encode()) for name in CLASSES[0:9])  # for a longer new name
        one = parts.class_bytes(founded, longest, "float32")
        part_bytes = one_class_parts(founded, slack) + one

        # the measured run: the same step without farm-b, on a copy; farm-a's state given back
        alone = tmp_path / "alone-federation"
        shutil.copytree(deployed.federation, alone)
        saved = tmp_path / "farm-a-state-saved"
        assert deployed.stop_site("farm-a") == 0
        shutil.copytree(tmp_path / "farm-a-state", saved, symlinks=True, ignore=SOCKETS)
        deployed.start_site("farm-a")
        code, baseline = _run(deployed, *ALONE, f"--federation={alone}")
        assert code == 0 and baseline["status"] == "completed", baseline
        without_b = _step(alone, 1)
        _restart(deployed, "farm-a", saved)

        # farm-b joins, its catch-up in parts; it stops once it answered the first
        deployed.join("farm-b", FARM_B)
        timeout_s = max(180, round(4 * without_b.wall_s))  # a part's: far above the step
        settings = run_settings("--json", *BOTH, timeout_s=timeout_s)
        small = f"--run-config=part-bytes={part_bytes}"
        with deployed.log.open("ab") as err:
            attacked_run = subprocess.Popen(
                [sys.executable, "-m", "starfed.cli", "server", "run", *settings, small],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        state_b = tmp_path / "farm-b-state"
        stopped: dict[ProcessId, str] = {}
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while _staged_parts(state_b) < 2:  # part 0 answered: part 1 was sent
                assert attacked_run.poll() is None, deployed.log.read_text()[-3000:]
                assert time.monotonic() < deadline, "farm-b never staged a second part"
                time.sleep(0.05)
            stopped = _stop_every_process(deployed, "farm-b")
            assert any("flower-supernode" in command for command in stopped.values()), stopped
            out, _ = attacked_run.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            send_signal(stopped, signal.SIGCONT)
        attacked = json.loads(out)
        assert attacked_run.returncode == 3 and attacked["status"] == "degraded", out
        with_b = _step(deployed.federation, 1)

        # farm-a went on alone, with its results: its first phase (sent beside farm-b's first
        # part) was answered while farm-b's catch-up was still going — a catch-up's parts are
        # logged once it ended, by the step's end or by a part failing (Flower's heartbeat) —
        # and the step ended before a part's timeout
        logged = [(e["site"], e["phase"]) for e in attacked["metrics"]["exchanges"]]
        parts_logged = logged.index(("farm-b", CATCH_UP_KEY))
        assert ("farm-a", Phase.STAGE1.key) in logged[:parts_logged], logged
        assert with_b.wall_s < timeout_s, (with_b.wall_s, timeout_s)
        findings = [f for f in with_b.findings if f.site == "farm-b"]
        assert findings and {f.phase for f in findings} == {CATCH_UP_KEY}, findings
        assert re.search(
            r"not done at the end of step 2 \([0-3] of 4 parts answered\)|failed its catch-up",
            findings[0].reason,
        ), findings
        caught_up = {
            e["site"] for e in attacked["metrics"]["exchanges"] if e["phase"] == CATCH_UP_KEY
        }
        assert caught_up == {"farm-b"}  # farm-a, one step behind, got deltas
        theirs = [e for e in attacked["metrics"]["exchanges"] if e["site"] == "farm-b"]
        assert {e["phase"] for e in theirs} <= {"sync", CATCH_UP_KEY}, theirs  # sat it out
        assert attacked["metrics"]["site_accuracy"]["farm-a"] == pytest.approx(
            baseline["metrics"]["site_accuracy"]["farm-a"], abs=1.0
        )

        # continued, farm-b is caught up by the next run and holds the server's codebook
        site_folder(tmp_path / "farm-a", FARM_A_LATER, train=TRAIN_IMAGES, test=TEST_IMAGES)
        # in two parts: each part is a ClientApp process of its own (seconds), and a catch-up not
        # done by the end of this short step is stopped (five parts of two classes were not: 4
        # of 5 answered when the step ended, 18 s, at load 3)
        now = Federation.open(deployed.federation).checkpoints.codebook()
        halves = f"--run-config=part-bytes={one_class_parts(now, slack) + 3 * one}"
        code, later = _run(deployed, *run_settings("--json", *BOTH), halves)
        assert code == 0 and later["status"] == "completed", later
        caught = [
            e
            for e in later["metrics"]["exchanges"]
            if e["phase"] == CATCH_UP_KEY and e["site"] == "farm-b"
        ]
        assert [(e["round"], e["status"]) for e in caught] == [(0, "ok"), (1, "ok")], caught
        answered = {
            e["phase"]
            for e in later["metrics"]["exchanges"]
            if e["site"] == "farm-b" and e["status"] == "ok"
        }
        assert "evaluate" in answered, answered
        server = Federation.open(deployed.federation).checkpoints.codebook()
        assert set(CLASSES[0:8]) == set(server.names)
        same_codebook(HeldCodebook(state_b / CODEBOOK_FILE).codebook(), server)
    print("stopped:", *sorted(stopped.values()), sep="\n  ")
    print(
        f"catch-up e2e: step without farm-b {without_b.wall_s:.1f}s, with farm-b stopped "
        f"{with_b.wall_s:.1f}s (part timeout {timeout_s}s, {part_bytes} bytes a part: "
        f"{findings[0].reason}), total {time.monotonic() - started:.0f}s"
    )
