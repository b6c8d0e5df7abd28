"""``starfed server status|resume|run`` on a federation folder built in process.

Run 1: two sites, farm-b silent at evaluation (a degraded step). Run 2: a new task at farm-a,
and the server dies in stage 2 (a step left running). Between them, the commands are run as
an operator would, with no server started: status reads the folders, ``resume`` refuses when no
step is running and otherwise gets as far as "the server is not running", ``run`` checks its
input before anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import Message
from in_process import Crash, run_two_sites, starfed
from site_folders import CLASSES, site_folder

from starfed.proto import codebook_pb2 as pb
from starfed.server.app import RunFailed


@pytest.fixture(scope="module")
def root(tmp_path_factory, one_torch_thread) -> Path:
    root = tmp_path_factory.mktemp("status")
    site_folder(root / "farm-a", {"2026-03": CLASSES[0:2]})
    site_folder(root / "farm-b", {"2026-04": CLASSES[2:4]})
    silent = {(2, "evaluate"): lambda reply: None}  # a run's last step evaluates on its own
    metrics = run_two_sites(root, silent, **{"max-steps": 1})
    assert metrics["status"] == "degraded"
    return root


def test_status_of_a_finished_federation_without_a_server(root, capsys) -> None:
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server, "--json")
    assert code == 0
    status = json.loads(out)
    assert status["server"] == {"running": False, "processes": {}}
    assert {c["name"]: list(c["sites"]) for c in status["classes"]} == {
        **{name: ["farm-a"] for name in CLASSES[0:2]},
        **{name: ["farm-b"] for name in CLASSES[2:4]},
    }
    assert all(c["frozen"] and c["step"] == 0 for c in status["classes"])
    assert status["codebook_version"] > 0
    assert status["position"] == {"step": 1, "running": False, "done": [], "in_play": []}
    [step] = status["steps"]
    assert step["status"] == "degraded" and step["sites"] == ["farm-a", "farm-b"]
    assert 0 <= step["faa"] <= 100  # farm-a's test images only
    assert status["errors"] == [
        {"site": "farm-b", "step": 0, "phase": "evaluate", "round": 0, "status": "no reply"}
    ]
    assert [s["name"] for s in status["sites"]] == ["farm-a", "farm-b"]
    assert status["last_run"]["status"] == "degraded"

    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert code == 0
    assert "server     not running" in out and "degraded" in out and "no reply" in out
    assert CLASSES[0] in out
    federation = str(root / "server" / "federation")  # a simulation's folder: no server's
    code, out, _ = starfed(
        capsys, "server", "status", "--dir", str(root / "none"), "--federation", federation
    )
    assert code == 0 and "server     none (no server folder here)" in out

    code, out, err = starfed(capsys, "server", "resume", "--dir", server)
    assert code == 2 and out == ""
    assert "nothing to resume" in err and "1 step finished" in err


def test_status_and_resume_of_a_step_left_running(root, capsys) -> None:
    """Run 2 dies in stage 2, after farm-a claimed more images in stage 1 than its sync said
    and farm-b did not answer stage 1: the step is running, and the screening's finding and
    the failed exchange so far show before the step ends."""
    site_folder(root / "farm-a", {"2026-06": CLASSES[4:5]})

    def overclaim(reply: Message) -> Message:
        update = pb.ClientUpdate()
        update.ParseFromString(reply.content["update"]["data"])
        for entry in update.entries:
            entry.count = 10**6
        reply.content["update"]["data"] = update.SerializeToString()
        return reply

    def crash(reply: Message) -> Message:
        raise Crash

    with pytest.raises(Crash):
        run_two_sites(
            root,
            {
                (1, "train.stage1"): overclaim,
                (2, "train.stage1"): lambda reply: None,
                (1, "train.stage2"): crash,
            },
        )
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server, "--json")
    status = json.loads(out)
    position = status["position"]
    assert position["running"] and position["step"] == 1
    assert position["done"] == ["sync/0", "stage1/0", "stage1_stats/0"]
    assert position["in_play"] == [CLASSES[4]]
    [finding] = [f for f in status["findings"] if f["step"] == 1]
    assert (finding["site"], finding["phase"], finding["action"]) == ("farm-a", "stage1", "capped")
    assert finding["name"] == CLASSES[4]
    assert [e for e in status["errors"] if e["step"] == 1] == [
        {"site": "farm-b", "step": 1, "phase": "stage1", "round": 0, "status": "no reply"}
    ]
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert "step 2 RUNNING" in out and "capped" in out and "no reply" in out

    # resume gets past "nothing to resume" and stops at the missing server (exit 1)
    code, out, err = starfed(capsys, "server", "resume", "--dir", server, "--json")
    assert code == 1 and json.loads(out)["success"] is False
    assert "the server is not running" in err


def test_run_checks_its_input_before_anything(root, capsys) -> None:
    server = str(root / "server")
    for argv, message in (
        (["--run-config", "stage1-epochs=-1"], "stage1-epochs=-1: expected an integer >= 0"),
        (["--min-sites", "0"], "--min-sites 0: expected an integer >= 1"),
        (["--run-config", "federation-dir=/x"], "use --federation"),
        (["--run-config", "site-names=1:farm-a"], "set from `starfed server sites`"),
        (["--run-config", "nope=1"], "unknown run-config key 'nope'"),
    ):
        code, out, err = starfed(capsys, "server", "run", "--dir", server, *argv)
        assert code == 2 and out == "" and message in err and err.count("\n") == 1, err
    code, _, err = starfed(capsys, "server", "run", "--dir", server)
    assert code == 1 and "the server is not running" in err


def test_round_is_the_retired_name_of_run(tmp_path, capsys) -> None:
    """`server round` is `server run` (its checks, its exit codes) after a one-line note, and is
    not listed among the actions."""
    server = str(tmp_path / "server")
    note = "starfed: `starfed server round` is deprecated, use `starfed server run` (same meaning)"
    code, out, err = starfed(capsys, "server", "round", "--dir", server, "--min-sites", "0")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        note,
        "starfed server round: error: --min-sites 0: expected an integer >= 1",
    ]
    code, _, err = starfed(capsys, "server", "round", "--dir", server)
    assert code == 1 and err.splitlines()[0] == note and "the server is not running" in err
    with pytest.raises(SystemExit):
        starfed(capsys, "server", "--help")
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if line.startswith("    ") and line[4] != " "]
    assert "run" in listed and "round" not in listed


def test_status_without_a_federation(tmp_path, capsys) -> None:
    code, out, _ = starfed(capsys, "server", "status", "--dir", str(tmp_path), "--json")
    status = json.loads(out)
    assert code == 0 and status["federation"] is None and "no federation" in status["problem"]
    code, out, err = starfed(capsys, "server", "resume", "--dir", str(tmp_path))
    assert code == 2 and "nothing to resume" in err and "0 steps" in err


def test_flower_nodes_join_the_federation_sites_by_node_id() -> None:
    from starfed.server.ops.sites import SiteStatus
    from starfed.server.ops.status import SiteRow, Status, _flower_sites

    status = Status("s", "f", sites=[SiteRow("farm-a", 7, 0, "2026-11-23T00:00:00+00:00")])
    _flower_sites(
        status,
        [
            SiteStatus(None, 7, "online", "2026-11-23 01:00:00Z", None, None),  # self-registered
            SiteStatus("hospital-x", 9, "registered", None, None, "SHA256:x"),  # never connected
            SiteStatus("gone", 11, "unregistered", None, None, "SHA256:y", removed_at="then"),
        ],
    )
    assert [(r.name, r.node_id, r.status, r.last_step) for r in status.sites] == [
        ("farm-a", 7, "online", 0),
        ("hospital-x", 9, "registered", None),
    ]


def test_a_registered_site_whose_exchanges_fail_shows_failing(tmp_path, capsys) -> None:
    """farm-b (registered, as `server run` passes ``site-names``) cannot answer: its data
    folder is gone. Its failed sync is recorded under its registered name, and ``status``
    shows it failing with its error — also after a run whose sync failed everywhere,
    which records no step, only its metrics."""
    site_folder(tmp_path / "farm-a", {"2026-03": CLASSES[0:2]})
    registered = {"site-names": "1:farm-a 2:farm-b"}
    assert run_two_sites(tmp_path, **registered)["status"] == "degraded"
    (tmp_path / "farm-a").rename(tmp_path / "elsewhere")  # farm-a fails too now
    with pytest.raises(RunFailed, match="no site answered the sync"):
        run_two_sites(tmp_path, **registered)
    server = str(tmp_path / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server, "--json")
    status = json.loads(out)
    assert code == 0 and len(status["steps"]) == 1  # the second run recorded no step
    sites = {s["name"]: s for s in status["sites"]}
    assert sites.keys() == {"farm-a", "farm-b"}  # no node-2
    assert sites["farm-b"]["failed_in_a_row"] == 2 and sites["farm-a"]["failed_in_a_row"] == 1
    error = sites["farm-b"]["failing"]
    assert error.startswith("error: DatasetError: site data folder") and "farm-b" in error
    assert sites["farm-a"]["last_step"] == 0  # it answered in step 1, before it failed
    errors = [(e["site"], e["step"], e["phase"]) for e in status["errors"]]
    assert errors == [("farm-b", 0, "sync"), ("farm-a", 1, "sync"), ("farm-b", 1, "sync")]
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert code == 0 and "errors     none" not in out
    line = f"failing farm-b: its last 2 exchanges failed, the last with {error}"
    assert line in " ".join(out.split())
    assert "failing farm-a: its last exchange failed" in " ".join(out.split())
    assert "failing (—)" in out  # the sites table's "now": failing, Flower's word unknown
