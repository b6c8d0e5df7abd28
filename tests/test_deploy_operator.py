"""The operator's ``starfed server`` commands against a fake ``flwr`` (``tests/fake_flwr.py``):
the same results from any working folder, one line saying what to do after the SuperLink died
mid-run, and what ``status`` says of it and of a site that was killed.

The server folder is set up as ``server start`` leaves it (the Flower config, ``run.json``),
with processes of this test standing in for the SuperLink and the gateway.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import fake_flwr as fake
import pytest
from conftest import FINGERPRINT, TINY_DIMS
from in_process import starfed

from starfed.ops import pki, processes
from starfed.ops.processes import ManagedProcess, ProcessId
from starfed.server.federation import Federation
from starfed.server.ops import status, superlink
from starfed.server.ops.layout import ServerFolder
from starfed.server.records import Exchange, PhaseTime, Position, StepRecord

METRICS = {"status": "completed", "steps": 1, "final_average_accuracy": 90.0, "wall_time_s": 3}
#: Online again after an earlier session: Flower keeps that session's offline time.
NODES = [
    {
        "node-id": 42,
        "status": "online",
        "online-at": "2026-11-23 01:00:00Z",
        "offline-at": "2026-11-22 23:00:00Z",
    }
]


def _server(root: Path, superlink_process: ProcessId) -> ServerFolder:
    """A server folder as ``server start`` leaves it; the gateway is this test's process."""
    folder = ServerFolder.at(root)
    folder.create()
    options = superlink.ServerOptions("127.0.0.1", 9092, 9093, insecure=True)
    superlink.write_flower_config(folder, options)
    me = ProcessId.of(os.getpid())
    assert me is not None
    record = superlink.RunRecord.begin(
        public_address=options.public_address,
        internal_address=options.internal_address,
        insecure=True,
        isolation="process",
        processes=[
            ManagedProcess("superlink", superlink_process.pid, superlink_process.started, [], ""),
            ManagedProcess("gateway", me.pid, me.started, [], ""),
        ],
    )
    record.save(folder.run_file)
    return folder


def _step_running(federation: Path) -> None:
    """A federation whose first step is running: its sync done."""
    fed = Federation(federation, FINGERPRINT, TINY_DIMS)
    # what a step rolls back to (`server check` wants it)
    fed.begin_step(fed.checkpoints.codebook())
    fed.checkpoint(fed.checkpoints.codebook(), Position(0, running=True, done=("sync/0",)))


# --- the working folder ----------------------------------------------------------------------


def test_every_action_that_runs_flwr_gives_the_same_result_from_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """``sites add|list|remove``, ``status`` and ``run`` (``resume`` is a ``run``) from a
    plain folder and from one that holds a ``starfed/`` checkout: the same answers. The
    ``site`` actions run no ``flwr`` (``site start`` runs ``flower-supernode``)."""
    me = ProcessId.of(os.getpid())
    assert me is not None
    key = pki.write_site_key(tmp_path / "farm-a.key", "a")
    public = pki.public_key_path(tmp_path / "farm-a.key")
    results: dict[str, list[tuple[int, str]]] = {}
    for where in ("plain", "checkout"):
        folder = _server(tmp_path / where / "server", me)
        work = tmp_path / where / "work"
        work.mkdir()
        monkeypatch.chdir(fake.checkout(work) if where == "checkout" else work)
        statuses = ["finished:stopped", "finished:stopped", "finished:completed"]
        bin_dir = fake.install(
            tmp_path / where / "bin", monkeypatch, statuses=statuses, nodes=NODES, metrics=METRICS
        )
        answers = []
        for action in (
            ("sites", "add", "farm-a", str(public), "--privacy-epsilon", "4"),
            ("sites", "list"),
            ("status",),
            ("run", "--steps", "1"),
            ("sites", "remove", "farm-a", "--yes"),
        ):
            code, out, err = starfed(capfd, "server", *action, "--dir", str(folder.root), "--json")
            assert code == 0, (action, out, err)
            out = out.replace(str(folder.root), "SERVER")
            answers.append((code, re.sub(r"\d{4}-\d\d-\d\dT[\d:]{8}\+00:00", "WHEN", out)))
        results[where] = answers
        calls = fake.calls(bin_dir)
        assert {call["cwd"] for call in calls} == {str(folder.flwr_home)}
        assert {tuple(call["argv"][:2]) for call in calls} >= {
            ("supernode", "register"),
            ("supernode", "list"),
            ("supernode", "unregister"),
            ("run", str(folder.app)),
            ("ls", "starfed"),
        }
        (submitted,) = [call["argv"] for call in calls if call["argv"][0] == "run"]
        assert "--run-config" in submitted and 'site-names="42:farm-a"' in submitted, submitted
        assert 'site-privacy="42:4.0"' in submitted, submitted  # its registration's, issue 43
    assert results["checkout"] == results["plain"]
    listed = json.loads(results["checkout"][1][1])["sites"]
    assert [(s["name"], s["node_id"], s["status"]) for s in listed] == [("farm-a", 42, "online")]
    assert listed[0]["fingerprint"] == key.fingerprint
    assert listed[0]["privacy"] == {"epsilon": 4.0, "unit": "image"}
    assert listed[0]["online_at"] == "WHEN"  # Flower's time written as starfed's (issue 47)
    assert listed[0]["offline_at"] is None  # the earlier session's, not this one's
    assert json.loads(results["checkout"][3][1])["metrics"] == METRICS


# --- a dead SuperLink ------------------------------------------------------------------------


@pytest.fixture
def superlink_process() -> ProcessId:
    """A process standing in for the SuperLink (the fake ``flwr`` may kill it)."""
    popen = subprocess.Popen(["sleep", "120"])
    process = ProcessId.of(popen.pid)
    assert process is not None
    yield process
    popen.kill()
    popen.wait()


def test_a_superlink_that_dies_mid_run_gets_one_line_saying_what_to_do(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    superlink_process: ProcessId,
) -> None:
    folder = _server(tmp_path / "server", superlink_process)
    _step_running(folder.federation)
    fake.install(
        tmp_path / "bin",
        monkeypatch,
        statuses=["finished:stopped", "running", "gone"],
        superlink=superlink_process.pid,
    )
    root = folder.root
    hint = (
        f"the SuperLink is gone: `starfed server start --dir {root}`, then "
        f"`starfed server resume --dir {root}`"
    )
    code, out, err = starfed(capfd, "server", "resume", "--dir", str(root))
    assert code == 1 and "continuing step 1" in out
    assert err.splitlines()[-1] == f"starfed server resume: error: {hint}", err
    assert fake.UNAVAILABLE not in out + err  # Flower's box, and its message, once is enough
    assert not superlink_process.alive()

    code, out, _ = starfed(capfd, "server", "status", "--dir", str(root))
    assert code == 0 and "step 1 RUNNING" in out
    assert f"next {hint}" in " ".join(out.split())  # however wide the terminal
    code, out, _ = starfed(capfd, "server", "status", "--dir", str(root), "--json")
    assert json.loads(out)["hint"] == hint


def test_status_hints_only_while_a_step_runs_without_its_superlink(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    superlink_process: ProcessId,
) -> None:
    fake.install(tmp_path / "bin", monkeypatch, statuses=["running"], nodes=NODES)
    folder = _server(tmp_path / "server", superlink_process)
    assert status.gather(folder, folder.federation).hint is None  # no federation yet
    _step_running(folder.federation)
    assert status.gather(folder, folder.federation).hint is None  # the SuperLink runs
    # the running step's failures are recorded when it ends: status says where they are now
    code, out, _ = starfed(capfd, "server", "status", "--dir", str(folder.root))
    said = " ".join(out.split())
    assert code == 0 and "the step running: its failures so far are in its log" in said
    assert f"`FLWR_HOME={folder.flwr_home} flwr log " in said and " --show`" in said
    other = tmp_path / "other federation"
    _step_running(other)
    processes.send_signal([superlink_process], processes.signal.SIGKILL)
    assert processes.wait_gone([superlink_process], 10) == set()
    assert status.gather(folder, other).hint == (
        f"the SuperLink is gone: `starfed server start --dir {folder.root}`, then "
        f"`starfed server resume --dir {folder.root} --federation {other}`"
    )
    folder.run_file.unlink()  # `server stop`, with the step still running
    assert "`starfed server resume" in str(status.gather(folder, other).hint)


# --- a killed site ---------------------------------------------------------------------------


def test_last_seen_is_when_a_site_last_answered_not_when_its_step_ended(tmp_path: Path) -> None:
    """farm-b answered the sync and was killed in stage 1; the step went on for minutes
    (its statistics phase waited for farm-b, replay) and ended long after it went offline."""
    fed = Federation(tmp_path / "federation", FINGERPRINT, TINY_DIMS)
    phases = (("sync", 10.0), ("stage1", 40.0), ("stage1_stats", 300.0), ("evaluate", 5.0))
    exchanges = [Exchange(0, phase, 0, 7, "farm-a", 1) for phase, _ in phases]
    exchanges += [Exchange(0, "sync", 0, 8, "farm-b", 1)]
    exchanges += [
        Exchange(0, phase, 0, 8, "farm-b", 1, status="no reply") for phase, _ in phases[1:]
    ]
    record = StepRecord(
        step=0,
        status="degraded",
        started=1000.0,
        wall_s=400.0,
        phase_seconds=tuple(PhaseTime(phase, 0, s) for phase, s in phases),
        exchanges=tuple(exchanges),
    )
    fed.end_step(record, fed.checkpoints.codebook())
    seen = {
        row.name: row.last_seen for row in status.gather(ServerFolder.at(tmp_path), fed.root).sites
    }
    assert seen == {"farm-a": status._when(1000 + 355), "farm-b": status._when(1000 + 10)}
