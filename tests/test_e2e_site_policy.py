"""A site's policy on real processes (issue 45): a started server, two ``starfed site start``
SuperNodes on 127.0.0.1, farm-b with a policy in its state folder that denies one of its classes
and withholds its evaluation counts; farm-c's policy requires privacy and farm-d's allows float16
updates only, and the run asks for neither. One ``starfed server run``: farm-b never announces
the denied class, refuses the evaluation with its reason (through its site worker and the
ClientApp's error reply); farm-c and farm-d refuse the sync, each with its reason; the run
completes with farm-a and farm-b; farm-b's release record verifies and its hashes are the
server's for every accepted reply. Several minutes on 2 cores. (Each policy item is also
tested in process, tests/test_site_policy.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deployed import RUN_TIMEOUT_S, deployment, run_settings, starfed
from site_folders import CLASSES

from starfed.client.release_record import ReleaseRecord
from starfed.shared.protocol import POLICY_REFUSED

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]
A, B = CLASSES[0:2], CLASSES[2:4]
POLICIES = {
    "farm-b": f'[classes]\ndeny = ["{B[1]}"]\n\n[release]\nwithhold = ["evaluation"]\n',
    "farm-c": "[privacy]\nrequired = true\n",
    "farm-d": '[release]\nwire-dtypes = ["float16"]\n',
}


def test_a_site_policy_on_a_started_server(tmp_path, monkeypatch) -> None:
    for name, policy in POLICIES.items():
        (tmp_path / f"{name}-state").mkdir()
        (tmp_path / f"{name}-state" / "policy.toml").write_text(policy)
    state = tmp_path / "farm-b-state"
    sites = {"farm-a": {"2026-03": A}, "farm-b": {"2026-04": B}, "farm-c": {"2026-04": B}}
    sites["farm-d"] = {"2026-04": B}
    with deployment(tmp_path, monkeypatch, sites) as deployed:
        log = deployed.log
        code, out = starfed(
            "server", "run", *run_settings("--json"), log=log, timeout=RUN_TIMEOUT_S
        )
        result = json.loads(out)
        assert code == 0 and result["status"] == "completed", log.read_text()[-3000:]
        metrics = result["metrics"]
        assert set(metrics["classes"]) == {*A, B[0]}
        refused = [e for e in metrics["exchanges"] if e["status"].startswith("refused")]
        by_b = [e for e in refused if e["site"] == "farm-b"]
        assert [e["phase"] for e in by_b] == ["evaluate"]
        assert by_b[0]["status"] == (
            f"refused: {POLICY_REFUSED}: release.withhold forbids evaluation"
        )
        syncs = {e["status"] for e in refused if e["phase"] == "sync"}
        assert syncs == {
            f"refused: {POLICY_REFUSED}: privacy.required: this run releases without privacy",
            f"refused: {POLICY_REFUSED}: wire dtype float32 not in release.wire-dtypes ['float16']",
        }
        failed = [e for e in metrics["exchanges"] if e["status"].startswith(("error", "rej"))]
        assert failed == []
        code, out = starfed("server", "audit", "--site", "farm-b", "--json", log=log)
        server = {r["sha256"] for r in json.loads(out)["replies"] if r["status"] == "ok"}
        code, out = starfed("site", "audit", "--state", str(state), "--verify", "--json", log=log)
        audit = json.loads(out)
        assert code == 0 and audit["verified"] == len(audit["lines"])
    record = list(ReleaseRecord(state).releases())
    assert {r.sha256 for r in record if not r.refused} == server
    assert [r.phase for r in record if r.refused] == ["evaluate"]
    assert B[1] not in {name for r in record for name in r.classes}
