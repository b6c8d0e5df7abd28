"""One misbehaving site: the server screens it, records it, and the others' classes hold.

Three sites through the real ClientApp on the local runtime (``LocalGrid``, tiny backbones):
farm-a and farm-b are honest, farm-m tampers with its replies the way each row of the table of
the "Trust no site" issue did (its replies are edited as protobuf bytes, as an attacker's
client would send them). All three hold class C0; each also holds a class of its own. For
every attack: the server survives, the run ends ``degraded``, the bad contribution is in the
step's record (``StepRecord.findings``), and the honest sites' accuracy is within
``TOLERANCE`` of the same federation with farm-m honest. The gateway's rows and a second site
on one data folder are tests/test_deploy_gateway.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message
from in_process import TINY_RUN, Crash, run_grid
from site_folders import CLASSES, site_folder

from starfed.client import app as client_app
from starfed.proto import codebook_pb2 as pb
from starfed.server.federation import Federation
from starfed.server.ops import dashboard_page, dashboard_state, status
from starfed.server.ops.layout import ServerFolder
from starfed.shared.codebook import wire
from starfed.shared.config import parse
from starfed.shared.protocol import PHASES
from starfed.simulations.local_grid import LocalGrid

pytestmark = pytest.mark.adversarial

C0, A1, B1, M1 = CLASSES[0], CLASSES[1], CLASSES[2], CLASSES[3]
SITES = {"farm-a": [C0, A1], "farm-b": [C0, B1], "farm-m": [C0, M1]}
M = 3  # farm-m's node id
#: The screening's tests run with the mean merge, which their honest reference and TOLERANCE were
#: measured with: at this size the merge itself moves farm-b by two of its ten test images (the
#: honest federation's 50 % with the mean, 30 % with the default median); the tests of the merge
#: name theirs.
CONFIG = {**TINY_RUN, "max-steps": 1, "merge": "mean"}
DEFAULT_MERGE = parse({})["merge"]
#: Percentage points the honest sites' accuracy may differ from the honest federation's: one of
#: each honest site's ten test images (a site left out changes the classes the others are
#: scored against). Without the defences, ×10^6 tensors take farm-b from 50 % to 0 %.
TOLERANCE = 10.0
TRAINING = ("train.stage1", "train.stage2")
UPDATE_RECORDS = {"update", *(spec.phase.key for spec in PHASES)}
# the stage-1 statistics travel with the last stage-1 round's message (shared/protocol.py)
STATISTICS = ("train.stage1", "query.stage2_stats")
_run_ids = itertools.count(7000)

Edit = Callable[[pb.ClientUpdate], None]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sites")
    for name, classes in SITES.items():
        site_folder(root / name, {"t1": classes}, train=12, test=5)
    return root


def federate(
    folders: Path,
    tmp: Path,
    faults: dict[str, Callable[[Message], Message]] | None = None,
    others: dict[tuple[int, str], Callable[[Message], Message]] | None = None,
    **config: object,
) -> dict:
    """One server run over the three sites; farm-m's replies of each message type in
    ``faults`` pass through it, and any node's of ``others`` (node, message type). The run's
    metrics."""
    run_config = {**CONFIG, **config, "federation-dir": str(tmp / "federation")}
    nodes = {
        node: {
            "data-dir": str(folders / name),
            "state-dir": str(tmp / f"{name}-state"),
            "site-name": name,
            "cache-dir": str(folders / "cache"),
        }
        for node, name in enumerate(SITES, start=1)
    }
    grid = LocalGrid(client_app.app, run_config, nodes, run_id=next(_run_ids))
    for message_type, fault in (faults or {}).items():
        grid.faults[(M, message_type)] = fault
    grid.faults.update(others or {})
    return run_grid(grid, run_config)


def edit_update(edit: Edit, records: Collection[str] = ("update",)) -> Callable[[Message], Message]:
    """A fault that edits farm-m's update messages in place, as bytes on the wire: the reply's
    own, and with ``records`` those of the phases that travel with it."""

    def fault(reply: Message) -> Message:
        assert not reply.has_error(), reply.error.reason
        for record in [key for key in reply.content if key in records]:
            message = pb.ClientUpdate()
            message.ParseFromString(reply.content[record]["data"])
            edit(message)
            reply.content[record]["data"] = message.SerializeToString()
        return reply

    return fault


def scale_tensors(factor: float) -> Edit:
    def edit(message: pb.ClientUpdate) -> None:
        for entry in message.entries:
            for _, value in entry.ListFields():
                if isinstance(value, pb.Tensor):
                    dtype = np.float16 if value.dtype == pb.DTYPE_FLOAT16 else np.float32
                    value.data = (np.frombuffer(value.data, dtype) * factor).astype(dtype).tobytes()

    return edit


def set_count(count: int, name: str = C0) -> Edit:
    def edit(message: pb.ClientUpdate) -> None:
        for entry in message.entries:
            if entry.name == name:
                entry.count = count

    return edit


def findings(tmp: Path, action: str | None = None) -> list:
    (record,) = Federation.open(tmp / "federation").history()
    return [f for f in record.findings if action is None or f.action == action]


@pytest.fixture(scope="module")
def honest(folders, tmp_path_factory) -> dict:
    """The federation with farm-m honest: the reference of every attack."""
    metrics = federate(folders, tmp_path_factory.mktemp("honest"))
    assert metrics["status"] == "completed"
    return metrics


def assert_contained(metrics: dict, honest: dict) -> None:
    """Degraded, and farm-a's and farm-b's accuracy within TOLERANCE of the honest run."""
    assert metrics["status"] == "degraded"
    for site in ("farm-a", "farm-b"):
        got, want = metrics["site_accuracy"][site], honest["site_accuracy"][site]
        assert abs(got - want) <= TOLERANCE, (site, got, want)


def test_the_honest_federation_is_not_screened(honest, tmp_path_factory) -> None:
    assert honest["status"] == "completed"
    assert set(honest["site_accuracy"]) == set(SITES)


@pytest.mark.parametrize("count", [10**6, 2**31 - 1, 2**63 - 1])
def test_claimed_examples_are_capped_by_the_sync(folders, tmp_path, honest, count) -> None:
    faults = {t: edit_update(set_count(count)) for t in TRAINING}
    metrics = federate(folders, tmp_path, faults)
    assert_contained(metrics, honest)
    capped = findings(tmp_path, "capped")
    assert {(f.site, f.phase, f.name) for f in capped} == {
        ("farm-m", "stage1", C0),
        ("farm-m", "stage2", C0),
    }
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    assert codebook[C0].count == 3 * 12  # the three sites' images, as reported at the sync


def test_a_claim_made_already_at_the_sync_is_bounded_by_max_class_share(
    folders, tmp_path, honest
) -> None:
    """farm-m claims 10^6 images of C0 at the sync and in training: consistent, so only the
    operator's share bound holds it (docs/security.md): a third, as much as each of the others."""
    faults = {t: edit_update(set_count(10**6)) for t in ("query.sync", *TRAINING)}
    metrics = federate(folders, tmp_path, faults, **{"max-class-share": 1 / 3})
    assert_contained(metrics, honest)
    capped = findings(tmp_path, "capped")
    assert [(f.site, f.phase, f.name) for f in capped] == [
        ("farm-m", "stage1", C0),
        ("farm-m", "stage2", C0),
    ]
    assert all("capped at 12 (max-class-share)" in f.reason for f in capped)


def _swap_in_own_class(message: pb.ClientUpdate) -> None:
    """farm-m's own class's rows sent as C0's, claiming 10^6 examples of C0."""
    rows = {entry.name: entry for entry in message.entries}
    for field, value in rows[M1].ListFields():
        if isinstance(value, pb.Tensor):
            getattr(rows[C0], field.name).CopyFrom(value)
    rows[C0].count = 10**6


def test_a_class_overwritten_with_another_is_outvoted_by_the_median(
    folders, tmp_path, honest
) -> None:
    """farm-m sends its own class's rows as C0's, claiming 10^6 examples: capped, and the
    median of three holders — the default merge — ignores it."""
    faults = {t: edit_update(_swap_in_own_class) for t in TRAINING}
    metrics = federate(folders, tmp_path, faults, merge=DEFAULT_MERGE)
    assert DEFAULT_MERGE == "median"
    assert_contained(metrics, honest)
    assert {f.name for f in findings(tmp_path, "capped")} == {C0}
    assert metrics["classes"][C0]["sites"] == sorted(SITES)


def test_the_mean_merges_a_class_overwritten_with_another(folders, tmp_path, honest) -> None:
    """What the default defends: with ``merge = mean`` the same lie, capped to a third of C0's
    examples, moves C0 as far as that share allows, and an honest site's accuracy falls by
    more than TOLERANCE (here farm-a's, 20 → 0 %; issue 35 saw 10/20 → 2/20)."""
    faults = {t: edit_update(_swap_in_own_class) for t in TRAINING}
    metrics = federate(folders, tmp_path, faults, merge="mean")
    assert metrics["status"] == "degraded"  # capped, so recorded; not outvoted
    assert any(
        honest["site_accuracy"][site] - metrics["site_accuracy"][site] > TOLERANCE
        for site in ("farm-a", "farm-b")
    )


@pytest.mark.parametrize("factor", [1e6, 1e30])
def test_scaled_tensors_are_rejected_and_the_site_quarantined(
    folders, tmp_path, honest, factor
) -> None:
    faults = {t: edit_update(scale_tensors(factor)) for t in TRAINING}
    metrics = federate(folders, tmp_path, faults)
    assert_contained(metrics, honest)
    rejected = findings(tmp_path, "rejected")
    assert {(f.site, f.phase) for f in rejected} >= {("farm-m", "stage1")}
    (record,) = Federation.open(tmp_path / "federation").history()
    assert record.quarantined == ("farm-m",)
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")  # finite: it decodes
    assert max(float(e.values["prompt"].abs().max()) for e in codebook.entries.values()) < 1e3


def test_a_resumed_step_keeps_the_screenings_findings_and_quarantine(
    folders, tmp_path, honest
) -> None:
    """The server dies after farm-m's scaled rows were rejected and farm-m quarantined (stage 1
    and 2), before the step ends; the next run resumes the step with farm-m sending honest
    replies. The step's record is the one of the same attack without the crash: the same
    findings, once each, farm-m quarantined and sent nothing after the sync."""
    faults = {t: edit_update(scale_tensors(1e6)) for t in TRAINING}
    uninterrupted = federate(folders, tmp_path / "uninterrupted", faults)

    def die(reply: Message) -> Message:
        raise Crash("the server process dies")

    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        federate(folders, crashed, faults, others={(1, "query.stage2_stats"): die})
    assert Federation.open(crashed / "federation").history() == []  # the step is not closed
    resumed = federate(folders, crashed)  # farm-m honest now: it is still held to the step's
    assert_contained(resumed, honest)
    assert findings(crashed) == findings(tmp_path / "uninterrupted")
    assert {(f.site, f.action) for f in findings(crashed)} == {
        ("farm-m", "rejected"),
        ("farm-m", "quarantined"),
    }
    (record,) = Federation.open(crashed / "federation").history()
    assert record.quarantined == ("farm-m",)
    assert {e.phase for e in record.exchanges if e.site == "farm-m"} == {"sync"}
    assert resumed["site_accuracy"].keys() == uninterrupted["site_accuracy"].keys()


def test_rows_for_classes_not_reported_at_the_sync_are_rejected(folders, tmp_path, honest) -> None:
    def add_a_class(message: pb.ClientUpdate) -> None:
        stolen = message.entries.add()
        stolen.CopyFrom(next(e for e in message.entries if e.name == M1))
        stolen.name, stolen.count = A1, 10**6

    faults = {t: edit_update(add_a_class) for t in TRAINING}
    metrics = federate(folders, tmp_path, faults)
    assert_contained(metrics, honest)
    assert {(f.phase, f.name) for f in findings(tmp_path, "rejected")} == {
        ("stage1", A1),
        ("stage2", A1),
    }
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    assert codebook[A1].count == 12
    assert metrics["classes"][A1]["sites"] == ["farm-a"]


@pytest.mark.parametrize("part", ["variances", "means"])
def test_implausible_mixtures_are_rejected(folders, tmp_path, honest, part) -> None:
    def inflate(message: pb.ClientUpdate) -> None:
        for entry in message.entries:
            for _, value in entry.ListFields():
                if isinstance(value, pb.Mixture) and entry.name == C0:
                    tensor = getattr(value, part)
                    tensor.data = np.full(len(tensor.data) // 8, 1e30).tobytes()

    faults = {t: edit_update(inflate, UPDATE_RECORDS) for t in STATISTICS}
    metrics = federate(folders, tmp_path, faults)
    assert_contained(metrics, honest)
    rejected = findings(tmp_path, "rejected")
    assert {(f.phase, f.name) for f in rejected} == {("stage1_stats", C0), ("stage2_stats", C0)}
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    mixture = codebook[C0].values["clip_mixture"]
    assert float(mixture.variances.max()) < 1e3 and float(mixture.means.abs().max()) < 1e3


def test_an_evaluation_report_beyond_the_sites_test_images_is_rejected(
    folders, tmp_path, honest
) -> None:
    def inflate(reply: Message) -> Message:
        message = pb.EvaluationReport()
        message.ParseFromString(reply.content["report"]["data"])
        for score in message.classes:
            score.images = score.correct = 10**9
            score.selection_hits = 0
            del score.taken_by[:]  # all right: none taken (a report whose counts add up)
        reply.content["report"]["data"] = message.SerializeToString()
        return reply

    # one step, the run's last: its evaluation has a message of its own, whose reply is edited
    metrics = federate(folders, tmp_path, {"evaluate": inflate}, **{"max-steps": 1})
    assert_contained(metrics, honest)
    assert [(f.site, f.phase) for f in findings(tmp_path, "rejected")] == [("farm-m", "evaluate")]
    assert "farm-m" not in metrics["site_accuracy"]
    assert metrics["final_average_accuracy"] < 99


def test_test_images_claimed_at_the_sync_do_not_set_the_federations_accuracy(
    folders, tmp_path, honest
) -> None:
    """Issue 43, attack 6: farm-m says 10^9 test images at the sync and reports them all
    right. Counted image by image that set the FAA to 99.99999 %; as the mean of the sites' own
    accuracies farm-m weighs one site's third, and its claim is in the record."""
    claimed = 10**9

    def declare(message: pb.ClientUpdate) -> None:
        message.metadata["test-images"] = str(claimed)

    def all_right(reply: Message) -> Message:
        message = pb.EvaluationReport()
        message.ParseFromString(reply.content["report"]["data"])
        for score in message.classes:
            score.images = score.correct = claimed // len(message.classes)
            del score.taken_by[:]
        reply.content["report"]["data"] = message.SerializeToString()
        return reply

    faults = {"query.sync": edit_update(declare), "evaluate": all_right}
    metrics = federate(folders, tmp_path, faults, **{"max-steps": 1})  # evaluated on its own
    assert metrics["status"] == "completed"  # a claim consistent with its sync is no finding
    for site in ("farm-a", "farm-b"):
        got, want = metrics["site_accuracy"][site], honest["site_accuracy"][site]
        assert abs(got - want) <= TOLERANCE, (site, got, want)
    (record,) = Federation.open(tmp_path / "federation").history()
    assert record.scores.sites["farm-m"]["images"] == claimed  # recorded as it was said
    accuracies = [metrics["site_accuracy"][site] for site in SITES]
    assert metrics["final_average_accuracy"] == pytest.approx(sum(accuracies) / len(SITES))
    bound = honest["final_average_accuracy"] + 100 / len(SITES) + TOLERANCE
    assert metrics["final_average_accuracy"] <= bound


def claim_classes(n: int) -> Callable[[Message], Message]:
    def edit(message: pb.ClientUpdate) -> None:
        for i in range(n):
            message.entries.add(name=f"claimed class {i:05d}", count=1)

    return edit_update(edit)


@pytest.mark.parametrize(
    ("n", "config", "why"),
    [
        (10_000, {}, "max-new-classes"),
        # issue 43, attack 5: 998 invented classes, within max-new-classes and max-classes,
        # made the server's replay of the step run for hours (past 834 s at 477d87e)
        (998, {}, "(max-step-classes"),
        # past max-classes, the one bound in all: a codebook past one message is no bound any
        # more (it reaches a site in parts, tests/test_catch_up.py)
        (
            18_000,
            {"max-new-classes": 20_000, "max-step-classes": 20_000, "max-classes": 12_000},
            "(max-classes)",
        ),
    ],
)
def test_a_site_registering_thousands_of_classes_sits_the_step_out(
    folders, tmp_path, honest, n, config, why
) -> None:
    metrics = federate(folders, tmp_path, {"query.sync": claim_classes(n)}, **config)
    assert metrics["status"] == "degraded"
    (finding,) = findings(tmp_path)
    assert (finding.site, finding.phase, finding.action) == ("farm-m", "sync", "rejected")
    assert why in finding.reason
    assert set(metrics["classes"]) == {C0, A1, B1}  # farm-m's step: none of its classes
    assert set(metrics["site_accuracy"]) == {"farm-a", "farm-b"}
    # the step's record keeps what its replays cost: the honest step's classes, not farm-m's
    (record,) = Federation.open(tmp_path / "federation").history()
    assert [(r.phase, r.classes, r.new_classes) for r in record.replays] == [
        ("stage1_stats", 3, 3),
        ("stage2_stats", 3, 3),
    ]
    assert all(0 < r.seconds < record.wall_s for r in record.replays)


def test_two_sites_with_one_name_are_not_merged_into_one(folders, tmp_path, honest) -> None:
    def impersonate(message: pb.ClientUpdate) -> None:
        message.metadata["site"] = "farm-a"

    metrics = federate(folders, tmp_path, {"query.sync": edit_update(impersonate)})
    assert metrics["status"] == "degraded"
    (finding,) = findings(tmp_path)
    assert (finding.site, finding.phase, finding.action) == ("node-3", "sync", "rejected")
    assert "'farm-a' is taken in this step by node 1" in finding.reason
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    assert codebook[C0].count == 2 * 12  # farm-a once and farm-b, not farm-a twice
    assert M1 not in codebook


def test_a_registered_site_is_known_by_its_registered_name(folders, tmp_path, honest) -> None:
    """With the operator's registered sites (``site-names``, as `starfed server run` sets it
    from sites.json), farm-m calling itself farm-a is still farm-m: nothing of it is recorded
    or merged under farm-a's name, and farm-a takes part as itself."""

    def impersonate(message: pb.ClientUpdate) -> None:
        message.metadata["site"] = "farm-a"

    registered = {"site-names": "1:farm-a 2:farm-b 3:farm-m"}
    metrics = federate(folders, tmp_path, {"query.sync": edit_update(impersonate)}, **registered)
    assert metrics["status"] == "completed" and not findings(tmp_path)
    assert metrics["site_accuracy"].keys() == honest["site_accuracy"].keys()
    (record,) = Federation.open(tmp_path / "federation").history()
    assert {e.site for e in record.exchanges if e.node_id == M} == {"farm-m"}
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    assert codebook[C0].count == 3 * 12 and M1 in codebook


def test_an_unregistered_node_cannot_use_a_registered_name(folders, tmp_path, honest) -> None:
    """farm-m's key was not registered through `starfed server sites` (so site-names leaves it
    out) and it calls itself farm-z, the registered name of a site that is not connected: it
    sits the step out, recorded by its node id, not under farm-z's name."""

    def impersonate(message: pb.ClientUpdate) -> None:
        message.metadata["site"] = "farm-z"

    registered = {"site-names": "1:farm-a 2:farm-b 9:farm-z"}
    metrics = federate(folders, tmp_path, {"query.sync": edit_update(impersonate)}, **registered)
    assert metrics["status"] == "degraded"
    (finding,) = findings(tmp_path)
    assert (finding.site, finding.phase, finding.action) == ("node-3", "sync", "rejected")
    assert "'farm-z' is registered to another node" in finding.reason
    codebook = wire.read_file(tmp_path / "federation" / "codebook.bin")
    assert codebook[C0].count == 2 * 12 and M1 not in codebook


def test_a_quarantine_that_persists_keeps_the_site_out_of_later_runs(tmp_path) -> None:
    sites = tmp_path / "sites"
    for name, classes in SITES.items():
        site_folder(sites / name, {"t1": classes}, train=12, test=5)
    faults = {t: edit_update(scale_tensors(1e6)) for t in TRAINING}
    federate(sites, tmp_path, faults, **{"quarantine-persists": True})
    assert set(Federation.open(tmp_path / "federation").quarantine()) == {"farm-m"}
    shown = status.read(ServerFolder(tmp_path), tmp_path / "federation").status  # as the operator
    # its two classes rejected in stage 1 and in stage 2, quarantined at the third
    assert shown.steps[0].quarantined == ["farm-m"] and shown.steps[0].findings == 4
    assert {(f.site, f.action) for f in shown.findings} == {
        ("farm-m", "rejected"),
        ("farm-m", "quarantined"),
    }
    assert set(shown.to_json()["quarantine"]) == {"farm-m"}
    state = dashboard_state.build_state(status.Reading(shown), ServerFolder(tmp_path), [], [])
    html = dashboard_page.page(state, 5)
    assert "quarantined sites" in html and "screened contributions" in html
    site_folder(sites / "farm-m", {"t2": [CLASSES[4]]}, train=12, test=5)
    again = federate(sites, tmp_path)
    assert again["status"] == "degraded" and again["steps"] == 1  # no step: nothing else new
    assert CLASSES[4] not in again["classes"]
    rejected = [e for e in again["exchanges"] if e["status"].startswith("rejected")]
    assert [(e["site"], e["phase"]) for e in rejected] == [("farm-m", "sync")]
    assert "quarantined since step 1" in rejected[0]["status"]
