"""``starfed site check`` on good and bad site folders: each problem is one line, and the exit
code says whether the site would work (0 ready, 1 a problem, 2 bad input)."""

from __future__ import annotations

import json
import shutil

import pytest
from site_folders import CLASSES, site_folder

from starfed.cli import main
from starfed.client.ops.check import PROBLEM, WARNING, check_site
from starfed.shared.codebook import wire
from starfed.shared.model.backbone_options import BackboneOptions

TINY = BackboneOptions()


@pytest.fixture(scope="module")
def fingerprint() -> str:
    return TINY.load().fingerprint


def findings(report, level: str) -> list[str]:
    return [f"{f.topic}: {f.message}" for f in report.findings if f.level == level]


def test_a_good_site_is_ready(tmp_path, fingerprint, capsys) -> None:
    data = site_folder(tmp_path / "farm", {"2026-03": CLASSES[0:2], "2026-05": CLASSES[2:3]})
    state = tmp_path / "state"
    code = main(
        [
            "site",
            "check",
            "--data",
            str(data),
            "--state",
            str(state),
            "--fingerprint",
            fingerprint[:12],
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ready"], report["findings"]
    assert report["tasks"] == [
        {"name": "2026-03", "classes": {CLASSES[0]: 10, CLASSES[1]: 10}},
        {"name": "2026-05", "classes": {CLASSES[2]: 10}},
    ]
    assert report["test_images"] == dict.fromkeys(CLASSES[0:3], 4) and not report["test_share"]
    assert report["fingerprint"] == fingerprint and report["unreadable"] == []
    assert {f["level"] for f in report["findings"]} == {"ok"}


def test_missing_and_mixed_folders_are_problems(tmp_path) -> None:
    report = check_site(tmp_path / "nowhere", tmp_path / "state", TINY)
    assert not report.ready
    assert any("does not exist" in line for line in findings(report, PROBLEM))

    data = site_folder(tmp_path / "mixed", {"2026-03": CLASSES[0:1]})
    site_folder(data, {".": CLASSES[1:2]})  # a class folder next to a task folder
    report = check_site(data, tmp_path / "state", TINY)
    assert any("mixes class folders with task folders" in x for x in findings(report, PROBLEM))


def test_class_names_that_collide(tmp_path) -> None:
    data = site_folder(tmp_path / "a", {"t1": [CLASSES[0], f"{CLASSES[1]}=apple apple-scab"]})
    report = check_site(data, tmp_path / "state", TINY)  # two spellings of one class, one task
    assert any("name the same class" in line for line in findings(report, PROBLEM))

    data = site_folder(
        tmp_path / "b", {"t1": CLASSES[0:1], "t2": [f"{CLASSES[0]}=apple apple scab"]}
    )
    shutil.rmtree(data / "test" / "apple apple scab")  # test/ holds one spelling per class
    report = check_site(data, tmp_path / "state", TINY)  # again in a later task: frozen there
    assert report.ready
    [warning] = [x for x in findings(report, WARNING) if x.startswith("class names")]
    assert "'apple apple scab' in t2" in warning and "not trained again" in warning


def test_corrupt_images_are_listed_and_a_class_without_any_is_a_problem(tmp_path) -> None:
    data = site_folder(tmp_path / "farm", {"t1": CLASSES[0:2]})
    broken = data / "t1" / CLASSES[0] / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    report = check_site(data, tmp_path / "state", TINY)
    assert report.ready and report.unreadable == [str(broken)]
    assert any("1 unreadable" in line for line in findings(report, WARNING))

    only_bad = data / "t1" / "Broken_class"
    only_bad.mkdir()
    (only_bad / "x.png").write_bytes(b"garbage")
    report = check_site(data, tmp_path / "state", TINY)
    assert not report.ready
    assert "images: class t1/Broken_class has no readable training image" in findings(
        report, PROBLEM
    )


def test_backbones_of_another_federation(tmp_path, fingerprint, capsys) -> None:
    data = site_folder(tmp_path / "farm", {"t1": CLASSES[0:1]})
    report = check_site(data, tmp_path / "state", TINY, "ab" * 32)
    assert not report.ready
    assert any("but the federation's are abababababab" in x for x in findings(report, PROBLEM))

    state = tmp_path / "state"  # the last codebook this site received says which backbones
    state.mkdir()
    (state / "site.json").write_text(json.dumps({"federation": "f" * 32, "completed": {"t0": 0}}))
    from starfed.shared.codebook.codebook import Codebook
    from starfed.shared.codebook.schema import ModelDims

    wire.write_file(state / "codebook.bin", Codebook("cd" * 32, ModelDims(4, 4, 4, 1), version=3))
    report = check_site(data, state, TINY)
    assert (
        report.remembered["federation"] == "f" * 32 and report.remembered["codebook_version"] == 3
    )
    assert any("completed tasks no longer" in x for x in findings(report, WARNING))
    assert any("federation's are cdcdcdcdcdcd" in x for x in findings(report, PROBLEM))

    other, held = tmp_path / "other", state / "codebook.bin"
    code = main(
        ["site", "check", "--data", str(data), "--state", str(other), "--codebook", str(held)]
    )
    out = capsys.readouterr().out
    assert code == 1 and "FAIL backbones" in out and "not ready: 1 problem" in out


def test_bad_input_is_exit_2(tmp_path, capsys) -> None:
    data = site_folder(tmp_path / "farm", {"t1": CLASSES[0:1]})
    (tmp_path / "junk.bin").write_bytes(b"junk")
    for extra, message in (
        (["--fingerprint", "xyz"], "expected 8 to 64 hex digits"),
        (["--codebook", str(tmp_path / "junk.bin")], "too short to be a starfed codebook"),
        (["--preset", "huge"], "--preset huge: expected one of tiny, paper, paper-random"),
    ):
        assert main(["site", "check", "--data", str(data), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_a_state_folder_inside_the_data_folder_is_a_problem(tmp_path) -> None:
    data = site_folder(tmp_path / "farm", {"t1": CLASSES[0:1]})
    report = check_site(data, data / "state", TINY)
    assert any("inside the data folder" in line for line in findings(report, PROBLEM))


def test_site_data_writes_a_ready_site_and_a_new_task_later(tmp_path, capsys) -> None:
    """`starfed site data`: the simulation's share of the bundled set for one site, task by
    task; `site check` finds it ready (issue 47)."""
    data = tmp_path / "farm-a"
    share = ["site", "data", str(data), "--site", "2", "--sites", "2", "--tasks", "7"]
    assert main([*share, "--arrived", "2"]) == 0
    assert sorted(p.name for p in data.iterdir()) == ["task-00", "task-01", "test"]
    assert f"next: starfed site check --data {data}" in capsys.readouterr().out
    report = check_site(data, tmp_path / "state", TINY)
    assert report.ready and [t.name for t in report.tasks] == ["task-00", "task-01"]
    assert main([*share, "--arrived", "3"]) == 0  # a new task arrives
    assert sorted(p.name for p in data.iterdir()) == ["task-00", "task-01", "task-02", "test"]
    capsys.readouterr()
    assert main(["site", "data", str(data), "--site", "3", "--sites", "2"]) == 2
    assert capsys.readouterr().err == (
        "starfed site data: error: --site 3: expected at most --sites 2\n"
    )


def test_a_class_without_test_images_is_named_plainly(tmp_path) -> None:
    data = site_folder(tmp_path / "farm", {"2026-03": CLASSES[0:2]})
    shutil.rmtree(data / "test" / CLASSES[1])
    report = check_site(data, tmp_path / "state", TINY)
    assert f"test images: none for {CLASSES[1]}: this site cannot score them" in findings(
        report, WARNING
    )
