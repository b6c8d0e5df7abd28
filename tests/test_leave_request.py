"""A site's signed request to leave (``ops/leave_request.py``): signed with its key, refused
when it is not the site's own, not signed by its registered key, altered, or older than the
site's registration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from starfed.ops import leave_request, pki
from starfed.ops.leave_request import LeaveRequestError, Mode

REGISTERED = "2026-01-01T00:00:00+00:00"


@pytest.fixture
def key(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "farm-c.key"
    return path, pki.write_site_key(path, "farm-c").openssh


def test_a_signed_request_verifies_with_the_sites_key_and_reads_back(key, tmp_path) -> None:
    path, public = key
    signed = leave_request.sign(path, "farm-c", Mode.EXACT, "patients\nwithdrew   consent")
    leave_request.write(tmp_path / "r.json", signed)
    again = leave_request.read(tmp_path / "r.json")
    assert again == signed and again.request.mode is Mode.EXACT
    assert again.request.reason == "patients withdrew consent"  # one line
    assert again.fingerprint == pki.fingerprint(public)
    leave_request.verify(again, "farm-c", public, REGISTERED)


def test_a_request_not_the_sites_own_is_refused(key, tmp_path) -> None:
    path, public = key
    signed = leave_request.sign(path, "farm-c", Mode.IMMEDIATE)
    other = pki.write_site_key(tmp_path / "other.key", "other").openssh
    refusals = {
        "not farm-a's": lambda: leave_request.verify(signed, "farm-a", public, REGISTERED),
        "registered key is": lambda: leave_request.verify(signed, "farm-c", other, REGISTERED),
        "before farm-c's current registration": lambda: leave_request.verify(
            signed, "farm-c", public, "2999-01-01T00:00:00+00:00"
        ),
    }
    for said, check in refusals.items():
        with pytest.raises(LeaveRequestError, match=said):
            check()
    # signed by another key that claims the registered key's fingerprint: the signature fails
    forged = leave_request.sign(tmp_path / "other.key", "farm-c", Mode.IMMEDIATE)
    forged = dataclasses.replace(forged, fingerprint=pki.fingerprint(public))
    with pytest.raises(LeaveRequestError, match="does not verify"):
        leave_request.verify(forged, "farm-c", public, REGISTERED)
    # the request altered after signing (the mode): the signature fails
    altered = dataclasses.replace(
        signed, request=dataclasses.replace(signed.request, mode=Mode.EXACT)
    )
    with pytest.raises(LeaveRequestError, match="does not verify"):
        leave_request.verify(altered, "farm-c", public, REGISTERED)


def test_a_file_that_is_not_a_request_is_one_line(key, tmp_path) -> None:
    path, _ = key
    bad = tmp_path / "bad.json"
    for text, said in (
        ("{", "not a leave request"),
        (json.dumps({"request": {"site": "x"}}), "not a leave request"),
        ("x" * (leave_request.MAX_BYTES + 1), "over"),
    ):
        bad.write_text(text)
        with pytest.raises(LeaveRequestError, match=said) as raised:
            leave_request.read(bad)
        assert "\n" not in str(raised.value)
    with pytest.raises(LeaveRequestError, match="cannot read"):
        leave_request.read(tmp_path / "missing.json")
    with pytest.raises(pki.SiteKeyError, match="public key"):
        leave_request.sign(pki.public_key_path(path), "farm-c", Mode.IMMEDIATE)
