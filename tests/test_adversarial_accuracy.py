"""Honest sites keep their accuracy (issue 43): one site's attacks on the others' accuracy.

Three sites through the real ClientApp (``LocalGrid``, tiny backbones, the default merge), as in
tests/test_adversarial_alone.py, whose ``federate`` edits farm-m's (node 3's) replies as protobuf
bytes. Each test rebuilds one of the issue's attacks: the attack is refused or recorded (a
finding against farm-m), and the honest sites' accuracy stays within ``TOLERANCE`` of the same
federation with farm-m honest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from site_folders import CLASSES
from test_adversarial import STATISTICS, TOLERANCE, UPDATE_RECORDS, edit_update
from test_adversarial_alone import federate, findings

from starfed.proto import codebook_pb2 as pb
from starfed.server.change_scale import ChangeScale
from starfed.server.federation import Federation
from starfed.shared.codebook import wire

pytestmark = [pytest.mark.adversarial, pytest.mark.slow]

C0, A1, B1, M1, X, A2, B2, M2 = CLASSES[:8]

#: One step: all three hold C0, each a class of its own.
SHARED = {"farm-a": {"t1": [C0, A1]}, "farm-b": {"t1": [C0, B1]}, "farm-m": {"t1": [C0, M1]}}
#: Step 2 is busy: all three sites train X with a class of their own, so every field of the
#: phase has three senders and its median over sites is a bound; M2 is farm-m's alone.
BUSY = {
    "farm-a": {"t1": [C0, A1], "t2": [X, A2]},
    "farm-b": {"t1": [C0, B1], "t2": [X, B2]},
    "farm-m": {"t1": [C0, M1], "t2": [X, M2]},
}


def head_scaled(factor: float, names: set[str]) -> Callable[[pb.ClientUpdate], None]:
    """Multiply the head row (``head_weight``) of the entries of ``names`` by ``factor``."""

    def edit(message: pb.ClientUpdate) -> None:
        for entry in message.entries:
            if entry.name in names and entry.HasField("head_weight"):
                array = np.frombuffer(entry.head_weight.data, np.float32) * factor
                entry.head_weight.data = array.astype(np.float32).tobytes()

    return edit


def accuracy(tmp: Path) -> dict[str, float]:
    """Each site's accuracy after the federation's last step."""
    last = Federation.open(tmp / "federation").history()[-1]
    return {site: s["accuracy"] for site, s in last.scores.sites.items()}


def assert_honest_within_noise(got: dict[str, float], honest: dict[str, float]) -> None:
    for site in ("farm-a", "farm-b"):
        assert abs(got[site] - honest[site]) <= TOLERANCE, (site, got[site], honest[site])


@pytest.fixture(scope="module")
def busy_honest(tmp_path_factory) -> dict[str, float]:
    """The honest federation's site accuracies after step 2."""
    tmp = tmp_path_factory.mktemp("busy-honest")
    metrics = federate(BUSY, tmp, **{"max-steps": 2})
    assert metrics["status"] == "completed" and metrics["steps"] == 2, metrics["status"]
    assert not findings(tmp)
    return accuracy(tmp)


def test_a_lone_holder_in_a_busy_phase_is_held_to_its_classs_history(tmp_path, busy_honest) -> None:
    """Attack 1: farm-m alone holds M2, in a phase where three sites send; its M2 head row
    × 30 (about 29 × the class's size: under ``reference-bound``, 100, and under
    ``update-bound`` × the median over sites) was merged with no finding, and the honest
    sites' accuracy fell. Every row is held to the scale of earlier steps × its class's size
    whatever the number of senders: the row is rejected, the others' accuracy is the honest
    run's."""
    faults = {"train.stage2": edit_update(head_scaled(30.0, {M2}))}
    federate(BUSY, tmp_path, faults, **{"max-steps": 2})
    assert ChangeScale.read(tmp_path / "federation").reference("head_weight") is not None
    rejected = [f for f in findings(tmp_path) if f.action == "rejected"]
    assert rejected and {(f.site, f.name) for f in rejected} == {("farm-m", M2)}
    assert all("× the scale of honest changes in earlier steps" in f.reason for f in rejected)
    assert all("sent by 3 sites)" in f.reason for f in rejected)
    assert_honest_within_noise(accuracy(tmp_path), busy_honest)


@pytest.fixture(scope="module")
def shared_honest(tmp_path_factory) -> dict[str, float]:
    """The honest one-step federation's site accuracies."""
    tmp = tmp_path_factory.mktemp("shared-honest")
    metrics = federate(SHARED, tmp, **{"max-steps": 1})
    assert metrics["status"] == "completed", metrics["status"]
    return accuracy(tmp)


def deflate(message: pb.ClientUpdate) -> None:
    """Every mixture's means scaled to norm about 10⁻⁴, its variances at the fit's
    regularisation (10⁻⁶, above the floor): a summary of nothing, inside every upper bound."""
    for entry in message.entries:
        for _, value in entry.ListFields():
            if isinstance(value, pb.Mixture):
                means = np.frombuffer(value.means.data, np.float64)
                value.means.data = (means * 1e-4).tobytes()
                value.variances.data = np.full(len(value.variances.data) // 8, 1e-6).tobytes()


def test_deflated_mixtures_are_held_from_below(tmp_path, shared_honest) -> None:
    """Attack 3: farm-m's mixtures (of C0, shared, and M1, its own) deflated towards zero
    passed a screen that bounded them from above only, and the replay drew their classes'
    features onto the origin. They are now rejected as under 1/``mixture-bound`` of the
    reference; the others' accuracy is the honest run's."""
    faults = {t: edit_update(deflate, UPDATE_RECORDS) for t in STATISTICS}
    federate(SHARED, tmp_path, faults, **{"max-steps": 1})
    rejected = [f for f in findings(tmp_path) if f.action == "rejected"]
    assert rejected and {f.site for f in rejected} == {"farm-m"}
    assert {f.name for f in rejected} >= {C0, M1}
    assert all("under 1/1000" in f.reason for f in rejected)
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    for name in (C0, A1, B1):
        assert float(codebook[name].values["clip_mixture"].means.norm(dim=1).max()) > 1e-2
    assert_honest_within_noise(accuracy(tmp_path), shared_honest)


def moved(message: pb.ClientUpdate) -> None:
    """farm-m's mixtures of C0, which all three hold, moved by three times their norm (their
    means × 4): inside every bound (``mixture-bound`` is 1000 × from above and below)."""
    for entry in message.entries:
        for _, value in entry.ListFields():
            if entry.name == C0 and isinstance(value, pb.Mixture):
                value.means.data = (np.frombuffer(value.means.data, np.float64) * 4).tobytes()


def test_a_shared_classs_mixture_far_from_the_others_is_a_finding(tmp_path, shared_honest) -> None:
    """Attack 3's rest: farm-m's mixtures of C0 moved far (``moved``) pass every bound and were
    pooled by count. Its G_c's mean lies 55 × the spread of C0's features from farm-a's and
    farm-b's (on ``mixture_distances``' scale), so the screen rejects it — a finding against
    farm-m naming C0, where until then the merge left it out with only a log line: C0's G_c is
    theirs alone (their count), and the others' accuracy is the honest run's. (Its H_c lies 14 ×
    that spread away, under ``MIXTURE_OUTLIER``, and is pooled: this step runs no head replay.)"""
    faults = {t: edit_update(moved, UPDATE_RECORDS) for t in STATISTICS}
    federate(SHARED, tmp_path, faults, **{"max-steps": 1})
    (finding,) = findings(tmp_path)
    assert (finding.site, finding.name, finding.action) == ("farm-m", C0, "rejected")
    assert finding.reason.startswith("clip_mixture's mean") and "over 20" in finding.reason
    (record,) = Federation.open(tmp_path / "federation").history()
    assert record.status == "degraded"
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    assert codebook[C0].values["clip_mixture"].count == 2 * 12
    assert_honest_within_noise(accuracy(tmp_path), shared_honest)
