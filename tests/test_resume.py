"""Crash safety: a server run that dies inside a step is continued by the next run.

The crash is the grid raising in the middle of a phase, or the server's first-level replay
raising — after the last stage-1 round, whose replies carried the statistics, was checkpointed,
so the next run sends the statistics' own message (the real-process variant, SIGKILL of the
ServerApp, is in tests/test_e2e_resume.py). The next run over the same federation folder
resumes from the last completed phase, and the final codebook equals that of a run that never
crashed, tensor by tensor: nothing learned before the crash is lost or merged twice.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from flwr.app import Message
from in_process import TINY_RUN, Crash, run_grid
from site_folders import CLASSES, site_folder

from starfed.client import app as client_app
from starfed.server.federation import Federation
from starfed.server.folder_files import CODEBOOK_FILE
from starfed.server.strategy import MeanStrategy, PhaseState, Strategy
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.protocol import TRAVELLING, Phase
from starfed.simulations.local_grid import LocalGrid

CONFIG = {**TINY_RUN, "stage1-rounds": 2}
ALL_PHASES = {
    "sync/0",
    "stage1/0",
    "stage1/1",
    "stage1_stats/0",
    "stage2/0",
    "stage2_stats/0",
    "evaluate/0",
}
_run_ids = itertools.count(7000)


def run(
    tmp: Path, name: str, data: dict[str, Path], crash_at: str | None = None, **extra: object
) -> dict:
    config = {**CONFIG, "federation-dir": str(tmp / name), **extra}
    nodes = {
        i + 1: {
            "data-dir": str(path),
            "state-dir": str(tmp / f"{name}-{site}"),
            "site-name": site,
            "cache-dir": str(tmp / "cache"),
        }
        for i, (site, path) in enumerate(sorted(data.items()))
    }
    grid = LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids))
    if crash_at is not None:
        message_type, _, round_index = crash_at.partition("/")

        def crash(reply: Message) -> Message:
            sent = grid.sent[-1]
            config = sent.content["config"]
            # the evaluation: its own message, or the next step's sync it travels with
            evaluation = sent.metadata.message_type == "evaluate" or TRAVELLING in config
            if message_type == "evaluate" and not evaluation:
                return reply
            if int(config["round"]) == int(round_index or 0):
                raise Crash(crash_at)
            return reply

        grid.faults[(2, message_type)] = crash
        if message_type == "evaluate":
            grid.faults[(2, "query.sync")] = crash
    return run_grid(grid, config)


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sites")
    return {
        "farm-a": site_folder(root / "a", {"t1": CLASSES[0:2], "t2": CLASSES[4:5]}),
        "farm-b": site_folder(root / "b", {"t1": CLASSES[1:3]}),
    }


@pytest.fixture(scope="module")
def clean(sites, tmp_path_factory) -> Path:
    """The federation folder of a run that never crashed; its first step's evaluation
    travelled with the second step's sync."""
    tmp = tmp_path_factory.mktemp("clean")
    metrics = run(tmp, "federation", sites)
    assert metrics["status"] == "completed" and metrics["steps"] == 2
    return tmp / "federation"


@pytest.fixture(scope="module")
def uninterrupted(clean) -> Codebook:
    return wire.read_file(clean / CODEBOOK_FILE)


def test_an_evaluation_in_its_own_message_scores_as_one_that_travelled(
    sites, clean, uninterrupted, tmp_path
):
    """Two runs of one step each — a run's last step evaluates in a message of its own — end
    with the clean run's codebook and, step by step, its scores."""
    for _ in range(2):
        metrics = run(tmp_path, "federation", sites, **{"max-steps": 1})
        assert metrics["status"] == "completed" and len(metrics["steps_this_run"]) == 1
    folder = Federation.open(tmp_path / "federation")
    same_entries(wire.read_file(folder.root / CODEBOOK_FILE), uninterrupted)
    own = [record.scores for record in folder.history()]
    travelled = [record.scores for record in Federation.open(clean).history()]
    assert None not in own + travelled
    assert [json.dumps(asdict(s)) for s in own if s] == [
        json.dumps(asdict(s)) for s in travelled if s
    ]


def same_entries(a: Codebook, b: Codebook) -> None:
    assert a.names == b.names
    for name in a.names:
        x, y = a[name], b[name]
        assert (x.count, x.frozen) == (y.count, y.frozen), name
        assert set(x.values) == set(y.values)
        for field, value in x.values.items():
            if field.endswith("mixture"):
                for part in ("weights", "means", "variances"):
                    assert torch.equal(getattr(value, part), getattr(y.values[field], part))
            else:
                assert torch.equal(value, y.values[field]), (name, field)


def crash_in_replay1(phase: Phase, codebook: Codebook, state: PhaseState) -> Codebook:
    if phase is Phase.STAGE1_STATS:
        raise Crash("replay1")
    return MeanStrategy().replay(phase, codebook, state)


@pytest.mark.parametrize("crash_at", ["train.stage1/1", "replay1", "train.stage2", "evaluate"])
def test_a_crashed_step_resumes_to_the_same_codebook(
    sites, uninterrupted, tmp_path, monkeypatch, crash_at
):
    in_replay = crash_at == "replay1"
    with pytest.raises(Crash), monkeypatch.context() as patch:
        if in_replay:
            patch.setattr(Strategy, "replay", lambda self, *args: crash_in_replay1(*args))
        run(tmp_path, "federation", sites, None if in_replay else crash_at)
    folder = Federation(tmp_path / "federation", uninterrupted.fingerprint, uninterrupted.dims)
    position = folder.checkpoints.position
    assert position.running and position.step == 0
    done_before = position.to_json()["done"]
    assert "sync/0" in done_before

    metrics = run(tmp_path, "federation", sites)  # the next run resumes
    assert metrics["status"] == "completed" and metrics["steps"] == 2
    resumed = wire.read_file(tmp_path / "federation" / CODEBOOK_FILE)
    same_entries(resumed, uninterrupted)
    # the resumed step repeated none of the phases it had finished before the crash (only
    # the sync, which tells the server who is here); the statistics travel with the last
    # stage-1 round when it is sent, else on their own
    assert metrics["steps_this_run"][0]["step"] == 0
    record = folder.history()[0]
    left = ALL_PHASES - set(done_before)
    messages = left - {"stage1_stats/0"} if "stage1/1" in left else left
    assert {f"{e.phase}/{e.round}" for e in record.exchanges} == {"sync/0"} | messages
    assert {f"{p.phase}/{p.round}" for p in record.phase_seconds} == {"sync/0"} | left
    if in_replay:
        assert done_before == ["sync/0", "stage1/0", "stage1/1"]


def test_the_position_is_inside_the_checkpoint(sites, tmp_path):
    with pytest.raises(Crash):
        run(tmp_path, "federation", sites, "train.stage2")
    position = Federation.open(tmp_path / "federation").checkpoints.position
    assert position.to_json()["done"] == ["sync/0", "stage1/0", "stage1/1", "stage1_stats/0"]
    assert set(position.in_play) == {*CLASSES[0:3]}
    assert replace(position, done=()).step == 0
