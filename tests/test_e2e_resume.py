"""Crash safety with real processes: SIGKILL of the ServerApp mid-step, then `server resume`.

A started server and two sites (``deployed.deployment``); ``starfed server run`` runs until
the federation folder's checkpoint shows a phase done — sync (the kill lands in stage 1, whose
replies carry the statistics), stage 1 (in the server's reduction of those statistics and its
first-level replay; the case CI runs: the resumed step sends the statistics' own message) or
stage 1's statistics (in stage 2) — then the
ServerApp process (below the server's SuperExec) is killed with SIGKILL and its run stopped on
the SuperLink (``flwr stop``), as an operator finds it after a crash. ``starfed server resume``
says where it continues, finishes the step without running again any phase checkpointed before
the kill, and ends with the codebook of a run that never crashed, tensor by tensor: the
guarantee of tests/test_resume.py (one random stream per phase, merges in content order, a
checkpoint per phase) now across processes. The uninterrupted run is the same step on the local
runtime, which computes what the deployed apps compute at the same thread count
(docs/simulation.md).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from deployed import RUN_CONFIG, RUN_TIMEOUT_S, deployment, run_settings, starfed
from site_folders import CLASSES

from starfed.client import app as client_app
from starfed.ops.flower_runs import FlowerCli, FlowerRunError
from starfed.ops.processes import send_signal, wait_gone
from starfed.server.app import run_server
from starfed.server.federation import Federation
from starfed.server.folder_files import CODEBOOK_FILE
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.data.site_folder import class_key
from starfed.simulations.local_grid import LocalGrid

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]

SITES = {"farm-a": {"2026-03": CLASSES[0:2]}, "farm-b": {"2026-04": CLASSES[2:4]}}
PHASES = ["sync/0", "stage1/0", "stage1_stats/0", "stage2/0", "stage2_stats/0", "evaluate/0"]


def uninterrupted(data: Path, root: Path) -> Codebook:
    """The same step, never interrupted, on the local runtime (sites' data folders in
    ``data``, everything else in ``root``), with each site's ClientApp at the thread count of
    a site worker (this machine's default), as the deployment runs it."""
    config = {
        "preset": "tiny",
        **RUN_CONFIG,
        "max-steps": 1,
        "min-sites": 2,
        "federation-dir": str(root / "federation"),
    }
    nodes = {
        node: {
            "data-dir": str(data / name),
            "state-dir": str(root / f"{name}-state"),
            "site-name": name,
            "device": "cpu",
        }
        for node, name in enumerate(SITES, start=1)
    }
    grid = LocalGrid(client_app.app, config, nodes, client_threads=torch.get_num_threads())
    metrics = run_server(grid, config, grid.run_id)
    assert metrics["status"] == "completed"
    return wire.read_file(root / "federation" / CODEBOOK_FILE)


def assert_same_tensors(a: Codebook, b: Codebook) -> None:
    assert a.names == b.names and a.frozen == b.frozen
    for name in a.names:
        assert a[name].count == b[name].count, name
        for f in schema.FIELDS:
            x, y = a[name].values.get(f.name), b[name].values.get(f.name)
            if f.kind is schema.Kind.TENSOR:
                assert torch.equal(x, y), (name, f.name)
            else:
                assert (x is None) == (y is None), (name, f.name)
                if x is not None:
                    for part in ("weights", "means", "variances"):
                        assert torch.equal(getattr(x, part), getattr(y, part)), (name, f.name)


@pytest.mark.parametrize(
    "after",  # the checkpoint the kill waits for: the ServerApp dies in the phase after it
    [
        pytest.param("sync/0", marks=pytest.mark.slow, id="killed-in-stage1"),
        pytest.param("stage1/0", id="killed-in-statistics"),
        pytest.param("stage1_stats/0", marks=pytest.mark.slow, id="killed-in-stage2"),
    ],
)
def test_a_killed_serverapp_is_resumed_where_it_stopped(tmp_path, monkeypatch, after) -> None:
    times = {"start": time.monotonic()}
    with deployment(tmp_path / "deployed", monkeypatch, SITES) as deployed:
        reference = uninterrupted(deployed.root, tmp_path / "reference")
        times["reference"] = time.monotonic()
        with deployed.log.open("ab") as err:
            interrupted = subprocess.Popen(
                [sys.executable, "-m", "starfed.cli", "server", "run", *run_settings(), "--json"],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        deployed.wait_for_checkpoint(after, timeout=RUN_TIMEOUT_S)
        serverapps = deployed.serverapps()
        assert len(serverapps) == 1, serverapps
        send_signal(serverapps, signal.SIGKILL)
        assert not wait_gone(serverapps, 10)
        times["killed"] = time.monotonic()
        before = deployed.checkpoint()
        assert before is not None and before.position.running and before.position.step == 0
        done_before = before.position.to_json()["done"]
        reached = PHASES.index(after) + 1
        assert done_before[:reached] == PHASES[:reached] and "evaluate/0" not in done_before
        cli = FlowerCli(deployed.server.flwr_home)
        (run,) = cli.unfinished_runs()  # the killed ServerApp's run is still "running"
        refused = deployed.root / "refused.log"
        code, _ = starfed("server", "resume", *run_settings(), log=refused)
        assert code == 1, refused.read_text()
        assert f"run {run['run-id']} is still running" in refused.read_text()
        assert f"flwr stop {run['run-id']}" in refused.read_text()
        try:
            cli.stop(int(run["run-id"]))
            ended = "finished:stopped"
        except FlowerRunError as error:
            # the SuperLink fails a run whose ServerApp sent no heartbeat for two of Flower's
            # 30 s intervals: on a busy machine that can come before the operator's stop
            assert "already finished" in str(error), error
            ended = "finished:failed"
        out, _ = interrupted.communicate(timeout=120)
        killed_run = json.loads(out)
        assert interrupted.returncode == 1 and killed_run["metrics"] is None, out
        assert killed_run["flower_status"] == ended, out

        code, out = starfed(
            "server", "resume", *run_settings(), log=deployed.log, timeout=RUN_TIMEOUT_S
        )
        times["resumed"] = time.monotonic()
        (deployed.root / "resume.out").write_text(out)
        print(out)
        assert code == 0, out + deployed.log.read_text()[-3000:]
        assert (
            f"continuing step 1 after its completed phases ({', '.join(done_before)}); "
            f"classes in play: {', '.join(before.position.in_play)}"
        ) in out
        assert "new class" not in out  # the sync again says who is here, registers nothing
        assert f"run {killed_run['run_id']}" not in out  # a new run

    federation = Federation.open(deployed.federation)
    metrics = federation.metrics()
    assert metrics["status"] == "completed" and metrics["steps"] == 1
    (record,) = federation.history()
    assert record.status == "completed" and record.attempt == 0
    # the resumed run repeated no phase checkpointed before the kill, only the sync that
    # tells it who is here
    ran = [f"{p.phase}/{p.round}" for p in record.phase_seconds]
    assert ran == [p for p in PHASES if p == "sync/0" or p not in done_before]
    exchanged = {f"{e.phase}/{e.round}" for e in record.exchanges}
    left = set(PHASES) - set(done_before)  # the statistics travel with stage 1 when it is sent
    messages = left - {"stage1_stats/0"} if "stage1/0" in left else left
    assert exchanged == {"sync/0"} | messages
    assert {str(e.status) for e in record.exchanges} == {"ok"}
    final = wire.read_file(deployed.federation / CODEBOOK_FILE)
    assert final.names == sorted(CLASSES[0:4], key=class_key) and final.frozen == set(CLASSES[0:4])
    assert not Federation.open(deployed.federation).checkpoints.position.running
    assert_same_tensors(final, reference)
    print(
        "resume e2e: reference {:.0f}s, run until the kill {:.0f}s, resume {:.0f}s".format(
            times["reference"] - times["start"],
            times["killed"] - times["reference"],
            times["resumed"] - times["killed"],
        )
    )
