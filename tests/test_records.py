"""The federation's typed records read what folders written before them hold, and write it
back byte for byte: an exchange's status and a position's phase rounds keep their text form."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
from conftest import FINGERPRINT, TINY_DIMS

from starfed.server.federation import Federation
from starfed.server.folder_files import FederationError
from starfed.server.records import (
    Exchange,
    ExchangeStatus,
    Outcome,
    PhaseRound,
    Position,
    StepRecord,
)

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
