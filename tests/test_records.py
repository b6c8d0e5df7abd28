"""The federation's typed records read what folders written before them hold, and write it
back byte for byte: an exchange's status and a position's phase rounds keep their text form;
each record file (registry, quarantine, the step's findings) through its own reader and
writer."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
from conftest import FINGERPRINT, TINY_DIMS

from starfed.server.federation import Federation
from starfed.server.folder_files import DamagedFile, FederationError
from starfed.server.quarantine import Quarantined, read_quarantine, write_quarantine
from starfed.server.records import (
    Exchange,
    ExchangeStatus,
    Outcome,
    PhaseRound,
    Position,
    StepRecord,
)
from starfed.server.registry import Registration, read_registry, registry_bytes, write_registry
from starfed.server.step_findings import read_step_findings, write_step_findings

#: A history line as the federation wrote it when statuses and phase rounds were text.
OLD_LINE = json.dumps(
    {
        "step": 1,
        "status": "degraded",
        "started": 1000.0,
        "wall_s": 12.5,
        "attempt": 0,
        "reason": "",
        "classes": ["c1"],
        "sites": ["farm-a", "farm-b"],
        "phase_seconds": [{"phase": "sync", "round": 0, "seconds": 1.0}],
        "exchanges": [
            {
                "step": 1,
                "phase": "sync",
                "round": 0,
                "node_id": 7,
                "site": "farm-a",
                "bytes_down": 10,
                "bytes_up": 20,
                "status": "ok",
                "epsilon": None,
            },
            {
                "step": 1,
                "phase": "stage1",
                "round": 0,
                "node_id": 8,
                "site": "farm-b",
                "bytes_down": 10,
                "bytes_up": 0,
                "status": "no reply",
                "epsilon": None,
            },
            {
                "step": 1,
                "phase": "stage2",
                "round": 0,
                "node_id": 7,
                "site": "farm-a",
                "bytes_down": 10,
                "bytes_up": 0,
                "status": "error: Node Unavailable: gone",
                "epsilon": None,
            },
            {
                "step": 1,
                "phase": "stage1_stats",
                "round": 0,
                "node_id": 9,
                "site": "farm-c",
                "bytes_down": 10,
                "bytes_up": 5,
                "status": "rejected: malformed reply (x)",
                "epsilon": None,
            },
            {
                "step": 1,
                "phase": "stage2_stats",
                "round": 0,
                "node_id": 10,
                "site": "farm-d",
                "bytes_down": 10,
                "bytes_up": 5,
                "status": "refused: privacy budget exhausted for c1",
                "epsilon": 2.5,
            },
            {
                "step": 1,
                "phase": "evaluate",
                "round": 0,
                "node_id": 7,
                "site": "farm-a",
                "bytes_down": 10,
                "bytes_up": 0,
                "status": "error: ",
                "epsilon": None,
            },
        ],
        "codebook_version": 3,
        "findings": [],
        "quarantined": [],
    }
)


def test_an_old_history_line_reads_typed_and_writes_back_the_same() -> None:
    record = StepRecord.from_json(OLD_LINE)
    outcomes = [e.status.outcome for e in record.exchanges]
    assert outcomes == [
        Outcome.OK,
        Outcome.NO_REPLY,
        Outcome.ERROR,
        Outcome.REJECTED,
        Outcome.REFUSED,
        Outcome.ERROR,
    ]
    assert record.exchanges[2].status.reason == "Node Unavailable: gone"
    assert record.exchanges[5].status == ExchangeStatus(Outcome.ERROR, "")
    # one definition of failed: a private site's refusal is an answer
    assert [e.failed for e in record.exchanges] == [False, True, True, True, False, True]
    assert record.to_json() == OLD_LINE


def test_an_old_folder_reads_its_history_and_position(tmp_path: Path) -> None:
    fed = Federation(tmp_path, FINGERPRINT, TINY_DIMS)
    (tmp_path / "history.jsonl").write_text(OLD_LINE + "\n")
    [record] = fed.history()
    assert str(record.exchanges[4].status) == "refused: privacy budget exhausted for c1"
    old = {
        "position": json.dumps(
            {"step": 2, "running": True, "done": ["sync/0", "stage1/1"], "in_play": ["c1"]}
        )
    }
    position = Position.from_metadata(old)
    assert position.done == (PhaseRound("sync", 0), PhaseRound("stage1", 1))
    assert position.as_metadata() == old and position.done_text() == "sync/0, stage1/1"


def test_a_status_none_of_the_forms_is_a_damaged_history(tmp_path: Path) -> None:
    fed = Federation(tmp_path, FINGERPRINT, TINY_DIMS)
    (tmp_path / "history.jsonl").write_text(OLD_LINE.replace('"no reply"', '"maybe"') + "\n")
    with pytest.raises(FederationError, match=r"history.jsonl:1 is damaged: exchange status"):
        fed.history()


@pytest.mark.parametrize("text", ["ok", "no reply", "error: x: y", "rejected: r", "refused: w"])
def test_a_status_and_its_text_are_one(text: str) -> None:
    status = ExchangeStatus.from_json(text)
    assert str(status) == status.to_json() == text and ExchangeStatus.from_json(text) == status
    entry = Exchange(0, "sync", 0, 1, "a", 1, status=status)
    raw = json.loads(json.dumps(entry.to_json()))
    assert raw["status"] == text and Exchange.from_json(raw).status.outcome is status.outcome


@pytest.mark.parametrize("text", ["sync", "/0", "sync/x", "okay"])
def test_a_phase_round_is_phase_slash_round(text: str) -> None:
    with pytest.raises(ValueError):
        PhaseRound.from_json(text)
    assert PhaseRound.from_json("stage1_stats/2") == PhaseRound("stage1_stats", 2)
    assert PhaseRound("stage1_stats", 2).to_json() == "stage1_stats/2"


def test_a_position_copies_and_pickles_with_its_phase_rounds() -> None:
    """``copy`` and ``pickle`` rebuild a ``PhaseRound`` from its phase and round, and its JSON
    form is its text."""
    position = Position(1, running=True, done=(PhaseRound("sync"), PhaseRound("stage1", 2)))
    for again in (copy.deepcopy(position), pickle.loads(pickle.dumps(position))):
        assert again == position and all(type(d) is PhaseRound for d in again.done)
        assert again.done[1].round == 2
    assert position.to_json()["done"] == ["sync/0", "stage1/2"]


#: Record files as folders written before their typed readers hold them (``json.dumps`` of the
#: dicts the federation kept: ``indent=2`` for the registry and the quarantine, 1 for findings).
OLD_FILES = {
    "registry.json": json.dumps(
        {
            "c1": {"step": 0, "registered": "2026-01-01T00:00:00+00:00", "sites": {}},
            "c2": {
                "step": 1,
                "registered": "2026-01-02T00:00:00+00:00",
                "sites": {"farm-a": "2026-01-02T00:00:01+00:00"},
            },
        },
        indent=2,
    ),
    "quarantine.json": json.dumps(
        {"farm-m": {"step": 2, "since": "2026-01-03T00:00:00+00:00", "reason": "3 findings"}},
        indent=2,
    ),
    "step-findings.json": json.dumps(
        {
            "step": 2,
            "findings": [
                {
                    "site": "farm-m",
                    "phase": "stage1",
                    "round": 0,
                    "action": "rejected",
                    "reason": "far",
                    "name": "c2",
                }
            ],
        },
        indent=1,
    ),
}


def test_each_record_file_reads_typed_and_writes_back_the_same(tmp_path: Path) -> None:
    """The registry, the quarantine and the step's findings, each through its own module's
    reader and writer, as a folder written before them holds them."""
    for name, text in OLD_FILES.items():
        (tmp_path / name).write_text(text)
    registry = read_registry(tmp_path)
    assert registry["c2"].sites == {"farm-a": "2026-01-02T00:00:01+00:00"}
    assert registry_bytes(registry).decode() == OLD_FILES["registry.json"]
    quarantine = read_quarantine(tmp_path)
    assert quarantine == {"farm-m": Quarantined(2, "2026-01-03T00:00:00+00:00", "3 findings")}
    assert quarantine["farm-m"].line() == "quarantined since step 3: 3 findings"
    step, findings = read_step_findings(tmp_path)
    assert step == 2 and findings[0].name == "c2"
    for name in OLD_FILES:
        (tmp_path / name).unlink()
    write_registry(tmp_path, registry)
    write_quarantine(tmp_path, quarantine)
    write_step_findings(tmp_path, step, findings)
    assert {name: (tmp_path / name).read_text() for name in OLD_FILES} == OLD_FILES


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("registry.json", '{"c1": {"step": 0, "sites": {}, "steps": 2}}'),
        ("quarantine.json", '{"farm-m": {"since": "now"}}'),
        ("quarantine.json", '["farm-m"]'),
    ],
)
def test_a_record_file_that_is_not_its_record_is_damaged(
    tmp_path: Path, name: str, text: str
) -> None:
    (tmp_path / name).write_text(text)
    read = read_registry if name == "registry.json" else read_quarantine
    with pytest.raises(DamagedFile, match=rf"^{tmp_path / name} is damaged: "):
        read(tmp_path)


def test_a_registration_changes_into_a_new_one() -> None:
    """Frozen: a site that brought the class, or one withdrawn, makes a new entry; a site
    already named keeps its first time."""
    entry = Registration(1, "t0")
    brought = entry.brought_by("farm-a", "t1").brought_by("farm-a", "t2")
    assert entry.sites == {} and brought.sites == {"farm-a": "t1"}
    assert brought.without("farm-a") == entry
