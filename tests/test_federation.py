"""A federation that lives: sites bring their own tasks from their own folders, in process.

Each site here is a deployed site (node config ``data-dir``/``state-dir``) whose folder the test
writes: task folders of links to a few bundled images per class, and a ``test/`` folder. The
server keeps its federation folder across runs. Sizes are the smallest that exercise the
protocol (tiny backbones, 10 training and 4 test images per class, one epoch everywhere).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import Message

from starfed.client import app as client_app
from starfed.server.app import RunFailed, run_server
from starfed.server.federation import Federation as FederationFolder
from starfed.server.folder_files import CODEBOOK_FILE, STEP_FINDINGS_FILE, FederationError
from starfed.server.records import Exchange, Finding, PhaseTime, StepRecord, StepScores
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.data.site_folder import class_key
from starfed.simulations.local_grid import LocalGrid

sys.path.insert(0, str(Path(__file__).parent))
from in_process import TINY_RUN
from site_folders import CLASSES, site_folder

_run_ids = itertools.count(5000)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Federation:
    """A federation folder, its sites' folders and runs over an in-process grid."""

    def __init__(self, tmp: Path, cache: Path) -> None:
        self.tmp, self.cache = tmp, cache
        self.folder = tmp / "federation"
        self.sites: dict[int, dict] = {}
        self.faults: dict = {}

    def site(self, node: int, name: str, tasks: dict[str, list[str]]) -> Path:
        data = site_folder(self.tmp / name / "data", tasks)
        self.sites[node] = {
            "data-dir": str(data),
            "state-dir": str(self.tmp / name / "state"),
            "site-name": name,
            "cache-dir": str(self.cache),
        }
        return data

    def run(
        self, nodes: list[int] | None = None, before_step=None, **overrides
    ) -> tuple[dict, LocalGrid]:
        config = {**TINY_RUN, "federation-dir": str(self.folder), **overrides}
        chosen = {n: self.sites[n] for n in (nodes if nodes is not None else self.sites)}
        grid = LocalGrid(client_app.app, config, chosen, run_id=next(_run_ids), record=True)
        grid.faults.update(self.faults)
        return run_server(grid, config, grid.run_id, before_step=before_step), grid

    def codebook(self) -> Codebook:
        return wire.read_file(self.folder / CODEBOOK_FILE)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fed(tmp_path, cache) -> Federation:
    return Federation(tmp_path, cache)


def statuses(metrics: dict, site: str, phase: str | None = None) -> list[str]:
    return [
        e["status"]
        for e in metrics["exchanges"]
        if e["site"] == site and (phase is None or e["phase"] == phase)
    ]


# --- sites with their own tasks ---------------------------------------------------------------


def test_disjoint_sites_then_a_new_task_in_a_second_run(fed):
    """Two sites with different classes; one site's class is held by it alone. A second run
    continues the same federation and trains only the new task's classes."""
    a = fed.site(1, "farm-a", {"2026-03-scab": CLASSES[0:2]})
    fed.site(2, "farm-b", {"2026-04-blight": CLASSES[2:4]})
    first, _ = fed.run()
    assert first["status"] == "completed" and first["steps"] == 1
    assert set(first["classes"]) == set(CLASSES[0:4])
    assert first["classes"][CLASSES[0]]["sites"] == ["farm-a"]
    assert first["classes"][CLASSES[2]]["sites"] == ["farm-b"]
    assert set(first["site_accuracy"]) == {"farm-a", "farm-b"}
    before = fed.codebook()

    site_folder(a, {"2026-06-rust": CLASSES[4:6]})  # a new task folder appears at farm-a
    second, grid = fed.run()
    assert second["status"] == "completed" and second["steps"] == 2
    after = fed.codebook()
    # every class exactly once, new ones in class-key order
    assert after.names == before.names + sorted(CLASSES[4:6], key=class_key)
    assert after.frozen == set(after.names)
    assert {name: c["step"] for name, c in second["classes"].items()} == {
        **dict.fromkeys(CLASSES[0:4], 0),
        **dict.fromkeys(CLASSES[4:6], 1),
    }
    # Only the new classes trained: the first step's classes kept every final value.
    for name in before.names:
        for field in ("prompt", "key", "query_prompt", "query_weight", "head_weight"):
            assert torch.equal(after[name].values[field], before[name].values[field])
    # The second run's stage-1 updates carried the new classes only, from farm-a only (a reply
    # without rows holds two empty updates, stage 1's and its statistics': 164 bytes).
    for entry in (e for e in second["exchanges"] if e["phase"] == "stage1"):
        assert (entry["bytes_up"] > 200) == (entry["site"] == "farm-a")
    assert len(second["accuracy_matrix"]) == 2 and len(second["accuracy_matrix"][1]) == 2
    # Both sites held the codebook of run 1: the new run sent them deltas, not the codebook.
    first_download = next(e for e in grid.sent if "codebook" in e.content)
    assert len(first_download.content["codebook"]["data"]) < len(wire.encode(after.broadcast()))


def test_late_joiner_offline_site_and_a_frozen_class_brought_again(fed):
    """farm-b joins in the second run and brings a frozen class again (left frozen) plus a
    new one; farm-a is offline during that run and catches up at the next."""
    fed.site(1, "farm-a", {"t1": CLASSES[0:2]})
    _first, _ = fed.run(nodes=[1])
    fed.site(2, "farm-b", {"t1": [CLASSES[1], CLASSES[6]]})
    frozen_before = fed.codebook()[CLASSES[1]]
    second, _ = fed.run(nodes=[2])  # farm-a offline
    codebook = fed.codebook()
    assert second["status"] == "completed"
    assert codebook.names == [*CLASSES[0:2], CLASSES[6]]
    entry = codebook[CLASSES[1]]
    assert entry.frozen and entry.count == frozen_before.count  # left frozen, not retrained
    assert torch.equal(entry.values["prompt"], frozen_before.values["prompt"])
    assert second["classes"][CLASSES[1]]["sites"] == ["farm-a", "farm-b"]
    # farm-a comes back with a new task: its held codebook is two runs old; it catches up.
    site_folder(Path(fed.sites[1]["data-dir"]), {"t2": CLASSES[7:8]})
    third, _ = fed.run()
    assert third["status"] == "completed"
    assert fed.codebook().names[-1] == CLASSES[7]
    assert set(third["site_accuracy"]) == {"farm-a", "farm-b"}


def test_empty_task_and_names_that_collide_after_normalisation(fed):
    """An empty task folder is skipped; 'Apple___healthy' and 'apple healthy' at two sites are
    one class, registered once."""
    name = CLASSES[0]
    respelled = name.lower().replace("_", " ")
    data = fed.site(1, "farm-a", {"t0-empty": [], "t1": [name]})
    (data / "t0-empty").mkdir(exist_ok=True)
    fed.site(2, "farm-b", {"t1": [f"{name}={respelled}", CLASSES[1]]})
    metrics, _ = fed.run()
    assert metrics["status"] == "completed"
    assert sorted(fed.codebook().names) == sorted([name, CLASSES[1]])
    assert metrics["classes"][name]["sites"] == ["farm-a", "farm-b"]


def test_a_site_folder_with_two_spellings_of_one_class_is_refused(fed):
    fed.site(1, "farm-a", {"t1": [CLASSES[0], f"{CLASSES[0]}={CLASSES[0].upper()}"]})
    fed.site(2, "farm-b", {"t1": [CLASSES[1]]})
    metrics, _ = fed.run()
    assert metrics["status"] == "degraded"
    assert statuses(metrics, "", "sync")[0].startswith("error: ")  # farm-a never named itself
    assert fed.codebook().names == [CLASSES[1]]


# --- failures -------------------------------------------------------------------------------


def test_before_step_runs_before_every_sync(fed):
    """A simulation writes its sites' folders in ``before_step``: the sync of the same step
    sees what it wrote, and it runs for the step that finds nothing new as well."""
    data = fed.site(1, "farm-a", {})
    data.mkdir(parents=True, exist_ok=True)
    seen: list[int] = []

    def before_step(step: int) -> None:
        seen.append(step)
        if step == 0:
            site_folder(data, {"t1": CLASSES[0:2]})

    metrics, _ = fed.run(before_step=before_step)
    assert metrics["status"] == "completed" and metrics["steps"] == 1
    assert seen == [0, 1]
    assert sorted(fed.codebook().names) == sorted(CLASSES[0:2])


def test_the_history_is_step_records(fed):
    """history.jsonl is written and read as ``StepRecord`` lines, lines written before the type
    (no ``attempt``) included; a record written again wins."""
    folder = FederationFolder(
        fed.tmp / "records", "f" * 64, ModelDims(d_txt=3, d_clip=4, d_vit=5, n_layers=2)
    )
    exchange = Exchange(0, "sync", 0, 1, "farm-a", 10, 20)
    scores = StepScores([50.0], [25.0], 50.0, {"farm-a": {"images": 2}})
    record = StepRecord(
        0,
        "completed",
        1.0,
        2.0,
        classes=("a",),
        sites=("farm-a",),
        phase_seconds=(PhaseTime("sync", 0, 0.5),),
        exchanges=(exchange,),
        codebook_version=3,
        scores=scores,
    )
    history = folder.root / "history.jsonl"
    old = {"step": 1, "status": "failed", "reason": "r", "started": 3.0, "wall_s": 1.0}
    history.write_text(record.to_json() + "\n" + json.dumps(old) + "\n")
    assert folder.history() == [record, StepRecord(1, "failed", 3.0, 1.0, reason="r")]
    assert folder.history()[0].ended == 3.0 and folder.attempts(1) == 1
    history.write_text("{not json\n")
    with pytest.raises(FederationError, match=r"history\.jsonl:1 is damaged"):
        folder.history()


def test_a_steps_findings_are_kept_for_that_step_only(tmp_path: Path):
    """step-findings.json: what the screening found in the step in progress; another step's
    is none, and a damaged file is one line that says how to go on (folder_check reports it,
    repair sets it aside: tests/test_folder_repair.py)."""
    folder = FederationFolder(tmp_path, "f" * 64, ModelDims(d_txt=3, d_clip=4, d_vit=5, n_layers=2))
    assert folder.step_findings(0) == []
    found = [
        Finding("farm-m", "stage1", 0, "rejected", "scaled", "a"),
        Finding("farm-m", "stage2", 0, "quarantined", "3 findings in step 1"),
    ]
    folder.save_findings(0, found)
    assert folder.step_findings(0) == found and folder.step_findings(1) == []
    (tmp_path / STEP_FINDINGS_FILE).write_text('{"step": 0, "findings": [{"who": 1}]}')
    with pytest.raises(FederationError, match="`starfed server repair` sets it aside"):
        folder.step_findings(0)
    (tmp_path / CODEBOOK_FILE).write_bytes(b"the last checkpoint")  # what begin_step keeps
    folder.begin_step(None)  # a new step (or attempt) starts without them
    assert not (tmp_path / STEP_FINDINGS_FILE).exists()


def test_no_site_connected_fails_the_run(fed):
    with pytest.raises(RunFailed, match="0 site"):
        fed.run()
    assert (fed.folder / "metrics.json").is_file()


def test_no_site_answering_the_sync_fails_the_run_instead_of_ending_it(fed):
    """Sites that cannot answer (a missing package, a broken disk) say nothing about what they
    hold: the run fails with their error rather than completing with "nothing new"."""
    fed.site(1, "farm-a", {"t1": CLASSES[0:2]})
    fed.site(2, "farm-b", {"t1": CLASSES[2:4]})
    for node in (1, 2):
        fed.faults[(node, "query.sync")] = lambda reply: None
    with pytest.raises(RunFailed, match="no site answered the sync"):
        fed.run()
    assert not (fed.folder / CODEBOOK_FILE).exists()  # no step began: nothing was written
    fed.faults[(1, "query.sync")] = lambda reply: reply  # one site back: a degraded step
    metrics, _ = fed.run()
    assert metrics["status"] == "degraded" and metrics["steps"] == 1
    assert sorted(fed.codebook().names) == sorted(CLASSES[0:2])


def test_every_site_failing_a_phase_fails_the_step_and_rolls_back(fed):
    fed.site(1, "farm-a", {"t1": CLASSES[0:2]})
    fed.site(2, "farm-b", {"t1": CLASSES[2:4]})

    for node in (1, 2):
        fed.faults[(node, "train.stage2")] = lambda reply: None  # silent in stage 2
    with pytest.raises(RunFailed, match="no site's stage2 update"):
        fed.run()
    codebook = fed.codebook()
    assert codebook.names == [] and codebook.version >= 0  # rolled back to the step's start
    fed.faults.clear()
    metrics, _ = fed.run()  # the step is tried again and completes
    assert metrics["status"] == "completed" and metrics["steps"] == 1
    assert sorted(fed.codebook().names) == sorted(CLASSES[0:4])


def test_a_run_stopped_mid_phase_records_no_failed_step(fed):
    """`flwr stop` silences the sites first; the ServerApp's next grid call then fails in
    Flower (its token is revoked). The run ends there: no failed step, no metrics.json."""

    class RunStopped(Exception):
        pass

    fed.site(1, "farm-a", {"t1": CLASSES[0:2]})
    fed.site(2, "farm-b", {"t1": CLASSES[2:4]})
    stopped = {"yes": False}

    def stop(reply: Message) -> None:
        stopped["yes"] = True

    for node in (1, 2):
        fed.faults[(node, "train.stage2")] = stop
    config = {**TINY_RUN, "federation-dir": str(fed.folder)}
    grid = LocalGrid(client_app.app, config, fed.sites, run_id=next(_run_ids))
    grid.faults.update(fed.faults)
    node_ids = grid.get_node_ids

    def revoked() -> list[int]:
        if stopped["yes"]:
            raise RunStopped
        return list(node_ids())

    grid.get_node_ids = revoked
    with pytest.raises(RunStopped):
        run_server(grid, config, grid.run_id)
    assert not (fed.folder / "metrics.json").exists()
    history = fed.folder / "history.jsonl"
    assert not history.exists() or '"failed"' not in history.read_text()


def test_a_site_lost_mid_run_makes_the_run_degraded(fed):
    fed.site(1, "farm-a", {"t1": CLASSES[0:2], "t2": CLASSES[4:5]})
    fed.site(2, "farm-b", {"t1": CLASSES[2:4], "t2": CLASSES[5:6]})
    lost = {"after": False}

    def gone(reply: Message) -> Message | None:
        lost["after"] = True
        return None

    fed.faults[(2, "train.stage2")] = gone
    for message_type in ("query.stage2_stats", "evaluate", "query.sync", "train.stage1"):
        fed.faults[(2, message_type)] = lambda reply: None if lost["after"] else reply
    metrics, _ = fed.run()
    assert metrics["status"] == "degraded"
    assert metrics["steps"] == 2
    assert "no reply" in statuses(metrics, "farm-b", "stage2")
    # farm-b's classes got no statistics in stage 2, so they were unregistered; farm-b never
    # reached its second task, farm-a did.
    names = fed.codebook().names
    assert set(names) == {*CLASSES[0:2], CLASSES[4]}


# --- partial participation ----------------------------------------------------------------------


def test_a_seeded_fraction_of_sites_trains_and_every_class_keeps_a_holder(fed):
    """fraction-train 0.5 of 4 sites: 2 per training or statistics round, the same draw in
    every run; a class whose holders were only partly drawn merges the drawn ones' counts."""
    for node, name in enumerate(("farm-a", "farm-b", "farm-c", "farm-d"), start=1):
        fed.site(node, name, {"t1": [CLASSES[node - 1], CLASSES[node]]})  # neighbours share
    metrics, _ = fed.run(**{"fraction-train": 0.5})
    assert metrics["status"] == "completed"
    rounds: dict[str, list[str]] = {}
    for e in metrics["exchanges"]:
        rounds.setdefault(f"{e['phase']}/{e['round']}", []).append(e["site"])
    assert len(rounds["sync/0"]) == 4 * 2 and len(rounds["evaluate/0"]) == 4  # everyone
    codebook = fed.codebook()
    assert "stage1_stats/0" not in rounds  # the statistics travel with stage 1's draw
    for phase in ("stage1/0", "stage2/0", "stage2_stats/0"):
        drawn = set(rounds[phase])
        assert 2 <= len(drawn) <= 4  # two drawn, plus holders of classes the draw missed
        holders = {
            name: {f"farm-{'abcd'[i]}" for i in range(4) if name in CLASSES[i : i + 2]}
            for name in codebook.names
        }
        assert all(holders[name] & drawn for name in codebook.names)
    last = set(rounds["stage2_stats/0"])
    for name in codebook.names:  # each holder has 10 training images of each of its classes
        drawn_holders = {f"farm-{'abcd'[i]}" for i in range(4) if name in CLASSES[i : i + 2]}
        assert codebook[name].count == 10 * len(drawn_holders & last)
    again = Federation(fed.tmp / "again", fed.cache)  # a second federation of the same sites
    again.sites = fed.sites
    again_metrics, _ = again.run(**{"fraction-train": 0.5})
    again_rounds = {}
    for e in again_metrics["exchanges"]:
        again_rounds.setdefault(f"{e['phase']}/{e['round']}", []).append(e["site"])
    assert {k: sorted(v) for k, v in again_rounds.items()} == {
        k: sorted(v) for k, v in rounds.items()
    }  # the same draw: seeded by the step and phase, over site names
