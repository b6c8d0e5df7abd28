"""The site's release record: hash-chained lines whose every edit, cut and swap ``verify`` names,
and whose hashes equal the server's for every reply it accepted (after a 3-step federation in
process, over the real ClientApp; docs/security.md#the-release-record)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from in_process import TINY_RUN, run_grid, starfed
from site_folders import CLASSES, site_folder

from starfed.client import app as client_app
from starfed.client.release_record import RecordBroken, Release, ReleaseRecord, now
from starfed.simulations.local_grid import LocalGrid

_run_ids = itertools.count(9700)


def written(state: Path, lines: int) -> ReleaseRecord:
    record = ReleaseRecord(state)
    for i in range(lines):
        record.append(
            Release(now(), "", "fed", 1, i, "stage1", 0, i, ("a", "b"), ("prompt",), 10, "f" * 64)
        )
    return record


def test_an_untouched_record_verifies(tmp_path) -> None:
    assert written(tmp_path, 4).verify() == 4
    assert ReleaseRecord(tmp_path / "none").verify() == 0


@pytest.mark.parametrize("line", [1, 2, 3, 4])
def test_an_edited_line_is_named(tmp_path, line) -> None:
    record = written(tmp_path, 4)
    lines = record.path.read_text().splitlines(keepends=True)
    lines[line - 1] = lines[line - 1].replace('"bytes":10', '"bytes":11')
    record.path.write_text("".join(lines))
    with pytest.raises(RecordBroken) as caught:
        record.verify()
    assert caught.value.line == line and "changed" in str(caught.value)


@pytest.mark.parametrize("line", [1, 2, 3, 4])
def test_a_removed_line_is_named(tmp_path, line) -> None:
    record = written(tmp_path, 4)
    lines = record.path.read_text().splitlines(keepends=True)
    del lines[line - 1]
    record.path.write_text("".join(lines))
    with pytest.raises(RecordBroken) as caught:
        record.verify()
    assert caught.value.line == min(line, 3)  # the line after the gap, or the end


@pytest.mark.parametrize("line", [1, 2, 3])
def test_two_swapped_lines_are_named(tmp_path, line) -> None:
    record = written(tmp_path, 4)
    lines = record.path.read_text().splitlines(keepends=True)
    lines[line - 1], lines[line] = lines[line], lines[line - 1]
    record.path.write_text("".join(lines))
    with pytest.raises(RecordBroken) as caught:
        record.verify()
    assert caught.value.line == line


def test_a_line_read_back_is_the_line_written(tmp_path) -> None:
    release = Release(
        now(),
        "c" * 64,
        "fed",
        3,
        1,
        "stage2",
        1,
        7,
        ("x",),
        ("head_bias",),
        5,
        "d" * 64,
        {"x": (1.5, 1e-5)},
    )
    record = ReleaseRecord(tmp_path)
    record.append(release)
    assert list(record.releases()) == [release]


# --- against the server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory) -> Path:
    """A 3-step federation of farm-a and farm-b, a task of two classes per step each."""
    tmp = tmp_path_factory.mktemp("three-steps")
    config = {**TINY_RUN, "max-steps": 3, "federation-dir": str(tmp / "federation")}
    nodes = {}
    for node, name in enumerate(("farm-a", "farm-b"), start=1):
        first = 6 * (node - 1)
        tasks = {f"t{t + 1}": CLASSES[first + 2 * t : first + 2 * t + 2] for t in range(3)}
        nodes[node] = {
            "data-dir": str(site_folder(tmp / name, tasks, train=5, test=2)),
            "state-dir": str(tmp / f"{name}-state"),
            "site-name": name,
            "cache-dir": str(tmp / "cache"),
        }
    metrics = run_grid(LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids)), config)
    assert metrics["status"] == "completed"
    assert len(metrics["classes"]) == 12
    return tmp


def test_after_three_steps_site_audit_verifies(three_steps, capsys) -> None:
    state = three_steps / "farm-a-state"
    code, out, _ = starfed(capsys, "site", "audit", "--state", state, "--verify")
    assert code == 0, out
    assert "chain verified" in out and "class " in out
    code, out, _ = starfed(capsys, "site", "audit", "--state", state, "--json")
    audit = json.loads(out)
    assert len(audit["by_class"]) == 6 and audit["refusals"] == []
    assert {r["step"] for r in audit["lines"]} == {0, 1, 2}


def test_a_changed_record_fails_site_audit_naming_the_line(three_steps, capsys, tmp_path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    for name in ("release-record.jsonl", "release-record.head"):
        (state / name).write_bytes((three_steps / "farm-b-state" / name).read_bytes())
    path = state / "release-record.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[2], lines[3] = lines[3], lines[2]
    path.write_text("".join(lines))
    code, _, err = starfed(capsys, "site", "audit", "--state", state, "--verify")
    assert code == 1 and "line 3: does not follow line 2" in err


@pytest.mark.parametrize("site", ["farm-a", "farm-b"])
def test_the_records_hashes_are_the_servers(three_steps, capsys, site) -> None:
    federation = three_steps / "federation"
    code, out, _ = starfed(
        capsys, "server", "audit", "--federation", federation, "--site", site, "--json"
    )
    assert code == 0
    server = json.loads(out)["replies"]
    accepted = {r["sha256"] for r in server if r["status"] == "ok"}
    # 4 messages a step (an evaluation travels with the next sync), the last step's evaluation
    # its own message; all accepted
    assert len(accepted) == len(server) == 3 * 4 + 1
    record = ReleaseRecord(three_steps / f"{site}-state")
    assert record.verify() == len(server)
    assert accepted == {r.sha256 for r in record.releases()}
