"""The site's policy: parsed once with one-line errors, and each item refusing the request that
would break it, in process (``LocalGrid``) over the real ClientApp: the site refuses before
anything is computed, the server records a refusal by the site's policy (not a failure), and the
run completes with the other site (docs/sites.md#for-a-governance-office)."""

from __future__ import annotations

import hashlib
import html
import itertools
import json
from pathlib import Path

import pytest
import tomli_w
from in_process import TINY_RUN, run_grid, starfed
from site_folders import CLASSES, site_folder
from starlette.testclient import TestClient

from starfed.cli import main
from starfed.client import app as client_app
from starfed.client.ops import site_options
from starfed.client.ops.site_options import SiteError
from starfed.client.policy import PolicyError, PrivacyTerms, SitePolicy
from starfed.client.release_record import ReleaseRecord
from starfed.ops import pki
from starfed.server.messaging import note_error
from starfed.server.ops.dashboard import Dashboard
from starfed.server.ops.layout import ServerFolder
from starfed.server.records import Exchange
from starfed.shared.protocol import POLICY_REFUSED
from starfed.simulations.local_grid import LocalGrid

_run_ids = itertools.count(9500)


# --- the file ---------------------------------------------------------------------------------


def test_the_default_policy_refuses_nothing() -> None:
    policy = SitePolicy.from_toml({})
    assert policy == SitePolicy()
    assert not policy.filters_classes
    for releases in ((), ("counts",), ("prompt", "clip_mixture"), ("evaluation",)):
        for dtype in ("float32", "float16"):
            assert policy.refusal(releases, dtype, "any", "", None) is None
            terms = PrivacyTerms(1e9, 0.1, "patient")
            assert policy.refusal(releases, dtype, "any", "", terms) is None
    assert policy.oversized(2**40) is None


@pytest.mark.parametrize(
    ("toml", "names"),
    [
        ({"classes": {"allow": "x"}}, "classes.allow"),
        ({"classes": {"min-images": -1}}, "classes.min-images"),
        ({"privacy": {"max-epsilon": 0}}, "privacy.max-epsilon"),
        ({"privacy": {"unit": "pixel"}}, "privacy.unit"),
        ({"release": {"withhold": ["prompt", "weights"]}}, "release.withhold"),
        ({"release": {"wire-dtypes": ["float64"]}}, "release.wire-dtypes"),
        ({"server": {"certificate-sha256": "abc"}}, "server.certificate-sha256"),
        ({"server": {"federaton": "x"}}, "server.federaton: unknown key"),
        ({"classes": 3}, "classes"),
    ],
)
def test_a_bad_policy_is_one_line_naming_the_key(toml, names, tmp_path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(tomli_w.dumps(toml))
    with pytest.raises(PolicyError) as caught:
        SitePolicy.read(path)
    message = str(caught.value)
    assert "\n" not in message and names in message and str(path) in message


def test_each_item_refuses_with_one_reason() -> None:
    terms = PrivacyTerms(8.0, 1e-5, "image")
    cases = {
        "pinned to federation": (
            SitePolicy(federation="X"),
            ("counts",),
            "float32",
            "Y",
            "",
            terms,
        ),
        "pinned to server certificate": (
            SitePolicy(server_certificate="a" * 64),
            ("counts",),
            "float32",
            "X",
            "b" * 64,
            terms,
        ),
        "release.withhold forbids clip_mixture": (
            SitePolicy(withhold=("clip_mixture",)),
            ("prompt", "clip_mixture"),
            "float32",
            "X",
            "",
            terms,
        ),
        "not in release.wire-dtypes": (
            SitePolicy(wire_dtypes=("float32",)),
            ("prompt",),
            "float16",
            "X",
            "",
            terms,
        ),
        "privacy.required": (
            SitePolicy(privacy_required=True),
            ("counts",),
            "float32",
            "X",
            "",
            None,
        ),
        "privacy.max-epsilon": (
            SitePolicy(max_epsilon=4.0),
            ("counts",),
            "float32",
            "X",
            "",
            terms,
        ),
        "privacy.max-delta": (SitePolicy(max_delta=1e-6), ("counts",), "float32", "X", "", terms),
        "privacy.unit": (
            SitePolicy(privacy_unit="patient"),
            ("counts",),
            "float32",
            "X",
            "",
            terms,
        ),
    }
    for expected, (policy, *request) in cases.items():
        reason = policy.refusal(*request)
        assert reason is not None and expected in reason, (expected, reason)
        assert "\n" not in reason
    assert SitePolicy(max_reply_bytes=10).oversized(11) is not None
    assert SitePolicy(max_reply_bytes=10).oversized(10) is None
    assert not SitePolicy(deny=("tomato*",)).admits("Tomato_Late_blight")
    assert SitePolicy(allow=("apple*",)).admits("Apple_scab")
    assert not SitePolicy(allow=("apple*",)).admits("Grape_rot")


# --- the federation ---------------------------------------------------------------------------

A, B = CLASSES[0:2], CLASSES[2:4]


def federation(tmp: Path, policy: str = "", **config: object) -> tuple[dict, Path]:
    """One step over farm-a and farm-b, farm-b under ``policy`` (TOML); the run's metrics and
    farm-b's state folder."""
    config = {**TINY_RUN, "max-steps": 1, **config, "federation-dir": str(tmp / "federation")}
    nodes = {}
    for node, (name, classes) in enumerate((("farm-a", A), ("farm-b", B)), start=1):
        nodes[node] = {
            "data-dir": str(site_folder(tmp / name, {"t1": classes}, train=6, test=3)),
            "state-dir": str(tmp / f"{name}-state"),
            "site-name": name,
            "cache-dir": str(tmp.parent / "cache"),
        }
    if policy:
        (tmp / "farm-b-state").mkdir()
        (tmp / "farm-b-state" / "policy.toml").write_text(policy)
    grid = LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids))
    return run_grid(grid, config), tmp / "farm-b-state"


def node_exchanges(metrics: dict, node: int = 2) -> list[dict]:
    return [e for e in metrics["exchanges"] if e["node_id"] == node]


@pytest.mark.parametrize(
    ("policy", "config", "reason"),
    [
        ('[server]\nfederation = "another"\n', {}, "pinned to federation another"),
        ("[privacy]\nrequired = true\n", {}, "privacy.required"),
        ("[privacy]\nmax-epsilon = 8.0\n", {"privacy-epsilon": 20.0}, "privacy.max-epsilon 8"),
        ('[release]\nwire-dtypes = ["float32"]\n', {"wire-dtype": "float16"}, "wire-dtypes"),
        ('[release]\nwithhold = ["counts"]\n', {}, "release.withhold forbids counts"),
    ],
)
def test_a_request_that_breaks_the_policy_is_refused_and_the_run_goes_on(
    policy, config, reason, tmp_path
) -> None:
    metrics, state = federation(tmp_path, policy, **config)
    assert metrics["status"] == "completed"  # a refusal is an answer, not a failure
    assert set(metrics["classes"]) == set(A)  # farm-a's: farm-b announced nothing
    refused = [e["status"] for e in node_exchanges(metrics)]
    assert len(refused) == 1 and refused[0].startswith(f"refused: {POLICY_REFUSED}: ")
    assert reason in refused[0] and "\n" not in refused[0]
    lines = list(ReleaseRecord(state).releases())
    assert [(line.phase, reason in line.refused) for line in lines] == [("sync", True)]
    assert lines[0].sha256 == "" and lines[0].bytes == 0
    assert ReleaseRecord(state).verify() == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "phase", "reason"),
    [
        ('[release]\nwithhold = ["clip_mixture"]\n', "stage1", "forbids clip_mixture"),
        ('[release]\nwithhold = ["evaluation"]\n', "evaluate", "forbids evaluation"),
        ("[release]\nmax-reply-bytes = 2000\n", "stage1", "release.max-reply-bytes 2000"),
    ],
)
def test_a_phase_the_policy_forbids_is_refused_there(policy, phase, reason, tmp_path) -> None:
    metrics, state = federation(tmp_path, policy)
    exchanges = node_exchanges(metrics)
    refused = [e for e in exchanges if e["status"].startswith("refused")]
    assert refused and all(reason in e["status"] for e in refused)
    assert refused[0]["phase"] == phase
    assert not any(e["status"].startswith(("error", "rejected")) for e in exchanges)
    record = list(ReleaseRecord(state).releases())
    assert [r.phase for r in record if r.refused] == [e["phase"] for e in refused]


def test_a_withheld_evaluation_travelling_with_the_sync_is_refused_alone(tmp_path) -> None:
    """Until no site brings a class: the step's evaluation travels with the closing sync, and
    farm-b's policy refuses it alone — the sync is answered, the refusal recorded as its
    evaluate's, with the reason, on both sides."""
    policy = '[release]\nwithhold = ["evaluation"]\n'
    metrics, state = federation(tmp_path, policy, **{"max-steps": 0})
    exchanges = node_exchanges(metrics)
    statuses = {(e["step"], e["phase"]): e["status"] for e in exchanges}
    assert statuses[(0, "evaluate")] == (
        f"refused: {POLICY_REFUSED}: release.withhold forbids evaluation"
    )
    assert statuses[(1, "sync")] == "ok"  # the closing sync it travelled with
    record = list(ReleaseRecord(state).releases())
    assert [(r.step, r.phase) for r in record if r.refused] == [(1, "evaluate")]
    assert [r.phase for r in record if not r.refused][-1] == "sync"


@pytest.mark.parametrize(
    "policy",
    [f'[classes]\ndeny = ["{B[1].lower()}"]\n', f'[classes]\nallow = ["{B[0]}"]\n', ""],
)
def test_a_class_the_policy_does_not_admit_never_leaves(policy, tmp_path) -> None:
    metrics, state = federation(tmp_path, policy)
    expected = set(A) | {B[0]} if policy else set(A) | set(B)
    assert set(metrics["classes"]) == expected
    assert metrics["status"] == "completed"
    left = {name for r in ReleaseRecord(state).releases() for name in r.classes}
    assert left == expected - set(A)


def test_too_few_images_per_class_are_not_announced(tmp_path) -> None:
    metrics, state = federation(tmp_path, "[classes]\nmin-images = 7\n")  # farm-b has 6 each
    assert set(metrics["classes"]) == set(A)
    assert all(not r.classes for r in ReleaseRecord(state).releases())


# --- site start and site check ----------------------------------------------------------------


def start_options(tmp_path: Path, policy: str):
    """``site start``'s inputs checked (``site_options.prepare``) with ``policy`` as --policy."""
    data = site_folder(tmp_path / "farm", {"t1": B}, train=3, test=1)
    key, ca = tmp_path / "site.key", tmp_path / "ca.pem"
    pki.write_site_key(key, "t")
    ca.write_text("the federation's CA")
    (tmp_path / "policy.toml").write_text(policy)
    return site_options.prepare(
        "fed.example.org:9092",
        data,
        ca=ca,
        key=key,
        state=tmp_path / "state",
        policy=tmp_path / "policy.toml",
    )


def test_site_start_installs_the_policy_and_names_the_server(tmp_path) -> None:
    digest = hashlib.sha256(b"the federation's CA").hexdigest()
    policy = f'[server]\ncertificate-sha256 = "{digest}"\n'
    options = start_options(tmp_path, policy)
    assert options.server_certificate == digest
    options.state.mkdir()
    site_options.write_site_terms(options)
    assert (options.state / "policy.toml").read_text() == policy
    assert (options.state / "server-certificate").read_text() == digest


@pytest.mark.parametrize(
    ("policy", "error"),
    [
        (f'[server]\ncertificate-sha256 = "{"a" * 64}"\n', "answers only the server certificate"),
        ("[release]\nwithold = []\n", "release.withold: unknown key"),
    ],
)
def test_site_start_refuses_another_server_or_a_bad_policy(tmp_path, policy, error) -> None:
    with pytest.raises((SiteError, PolicyError)) as caught:
        start_options(tmp_path, policy)
    assert error in str(caught.value) and "\n" not in str(caught.value)


def test_site_check_prints_the_policy_and_the_classes_it_leaves_out(tmp_path, capsys) -> None:
    data = site_folder(tmp_path / "farm", {"t1": B}, train=3, test=1)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "policy.toml").write_text(f'[classes]\ndeny = ["{B[0]}"]\n')
    code = main(
        ["site", "check", "--data", str(data), "--state", str(tmp_path / "state"), "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["policy"]["classes.deny"] == [B[0]]
    lines = [f["message"] for f in report["findings"] if f["topic"] == "policy"]
    assert any("classes.deny" in line for line in lines)
    assert any(f"class {B[0]} is never announced" in line for line in lines)
    assert "under this run config it answers every message" not in " ".join(lines)


def test_site_check_says_what_the_policy_refuses_under_the_servers_run_config(
    tmp_path, capsys
) -> None:
    data = site_folder(tmp_path / "farm", {"t1": B}, train=3, test=1)
    (tmp_path / "state").mkdir()
    policy = '[privacy]\nmax-epsilon = 8.0\n\n[release]\nwithhold = ["vit_mixture"]\n'
    (tmp_path / "state" / "policy.toml").write_text(policy)
    check = ["site", "check", "--data", str(data), "--state", str(tmp_path / "state"), "--json"]
    main([*check, "--run-config", "privacy-epsilon=20"])
    lines = [f["message"] for f in json.loads(capsys.readouterr().out)["findings"]]
    refused = [line for line in lines if "under this run config it refuses" in line]
    assert len(refused) == 6  # every message; stage2_stats for its first reason, the field
    assert sum("privacy epsilon 20 > privacy.max-epsilon 8" in r for r in refused) == 5
    main([*check, "--run-config", "privacy-epsilon=4"])
    lines = [f["message"] for f in json.loads(capsys.readouterr().out)["findings"]]
    refused = [line for line in lines if "under this run config it refuses" in line]
    assert refused == [
        "under this run config it refuses stage2_stats: release.withhold forbids vit_mixture"
    ]


def test_server_status_shows_why_a_site_refused(tmp_path, capsys) -> None:
    federation(tmp_path, "[privacy]\nrequired = true\n")
    folder = ["--dir", tmp_path / "server", "--federation", tmp_path / "federation"]
    code, out, _ = starfed(capsys, "server", "status", *folder, "--json")
    status = json.loads(out)
    assert code == 0 and status["errors"] == []
    (refusal,) = status["refusals"]
    # a site refusing its sync never said its name: its node (a registered site: its name)
    assert refusal["site"] == "node-2" and refusal["phase"] == "sync"
    assert refusal["status"] == f"refused: {POLICY_REFUSED}: " + (
        "privacy.required: this run releases without privacy"
    )
    code, out, _ = starfed(capsys, "server", "status", *folder)
    assert "refused by sites in the last steps" in out and "privacy.required" in out
    dashboard = Dashboard(ServerFolder.at(tmp_path / "server"), tmp_path / "federation", 5.0)
    page = TestClient(dashboard.app()).get("/").text
    assert "refused by sites in the last steps" in page
    assert "privacy.required: this run releases without privacy" in html.unescape(page)


@pytest.mark.parametrize(
    "reason",
    [
        f"PolicyRefusal: {POLICY_REFUSED}: pinned to federation X, asked by Y",  # local runtime
        "<class 'starfed.client.worker.WorkerError'>:<'PolicyRefusal: "  # Flower's ClientApp
        f"{POLICY_REFUSED}: pinned to federation X, asked by Y'>",
    ],
)
def test_the_server_reads_a_refusal_in_each_runtimes_error_reply(reason) -> None:
    entry = Exchange(0, "sync", 0, 2, "farm-b", 0)
    note_error(entry, reason)
    assert str(entry.status) == f"refused: {POLICY_REFUSED}: pinned to federation X, asked by Y"
    assert not entry.failed
    note_error(entry, "RuntimeError: boom")
    assert entry.failed and str(entry.status) == "error: RuntimeError: boom"
