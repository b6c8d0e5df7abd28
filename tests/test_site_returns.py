"""A site lost after sync, then back: its classes are registered by the step that trains them.

Classes no site sent statistics for are unregistered before replay (docs/design.md#the-protocol);
when their site returns, the next step registers them, and the federation's scores group them
under that step. In process (``LocalGrid``); tests/test_e2e_site_lost.py is the same with real
processes and a SIGKILL.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from flwr.app import Message
from in_process import TINY_RUN, run_grid
from site_folders import CLASSES, site_folder

from starfed.client import app as client_app
from starfed.server.federation import Federation
from starfed.simulations.local_grid import LocalGrid

CONFIG = {**TINY_RUN, "max-steps": 1}
_run_ids = itertools.count(9000)


def run(tmp: Path, silent_after_sync: bool) -> dict:
    config = {**CONFIG, "federation-dir": str(tmp / "federation")}
    nodes = {
        node: {
            "data-dir": str(site_folder(tmp / name, {"t1": classes}, train=6, test=3)),
            "state-dir": str(tmp / f"{name}-state"),
            "site-name": name,
            "cache-dir": str(tmp / "cache"),
        }
        for node, (name, classes) in enumerate(
            {"farm-a": CLASSES[0:2], "farm-b": CLASSES[2:4]}.items(), start=1
        )
    }
    grid = LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids))
    if silent_after_sync:
        for message_type in (
            "train.stage1",
            "query.stage1_stats",
            "train.stage2",
            "query.stage2_stats",
            "evaluate",
        ):

            def silent(reply: Message) -> None:
                return None

            grid.faults[(2, message_type)] = silent
    return run_grid(grid, config)


def test_classes_dropped_for_a_lost_site_are_registered_when_it_returns(tmp_path) -> None:
    first = run(tmp_path, silent_after_sync=True)
    assert first["status"] == "degraded"
    assert set(first["classes"]) == set(CLASSES[0:2])  # farm-b's: unregistered
    registry = Federation.open(tmp_path / "federation").registry
    assert set(registry) == set(CLASSES[0:2])

    second = run(tmp_path, silent_after_sync=False)
    assert second["status"] == "completed" and second["steps"] == 2
    assert {n: c["step"] for n, c in second["classes"].items()} == {
        **dict.fromkeys(CLASSES[0:2], 0),
        **dict.fromkeys(CLASSES[2:4], 1),
    }
    assert {n: c["sites"] for n, c in second["classes"].items()} == {
        **{name: ["farm-a"] for name in CLASSES[0:2]},
        **{name: ["farm-b"] for name in CLASSES[2:4]},
    }
    # row i: the accuracy after step i on the classes of each step up to i
    assert [len(row) for row in second["accuracy_matrix"]] == [1, 2]
    assert all(a is not None for row in second["accuracy_matrix"] for a in row)
