"""A codebook too large for one message reaches a site in parts (issue 34, part 1).

The split and the staging on small codebooks with the part size made small (the run config's
``part-bytes``); then a site joining a federation through the real apps on the local
runtime: it catches up in several parts, a garbled part is refused and its catch-up starts again
at the next phase, and it ends the step holding the server's codebook.
"""

from __future__ import annotations

import itertools
import re
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, RecordDict
from in_process import TINY_RUN, run_grid
from site_folders import CLASSES, site_folder

from starfed.client import app as client_app
from starfed.client.answer import Incoming
from starfed.client.memory import CODEBOOK_FILE
from starfed.ops.flower_internals import SUPERLINK_NODE_ID, TaskIdentity
from starfed.server import catch_up
from starfed.server.app import RunFailed
from starfed.server.federation import Federation
from starfed.server.participants import Participants
from starfed.server.records import NOTED, REJECTED
from starfed.server.screening import Screen, ScreeningOptions
from starfed.shared.codebook import parts, schema, wire
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.decoding import MAX_NAME_LENGTH
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES
from starfed.shared.codebook.held import STAGING_DIR, STAGING_IDLE_STEPS, HeldCodebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.config import parse
from starfed.shared.knob import ConfigError
from starfed.shared.protocol import (
    CATCH_UP,
    CATCH_UP_KEY,
    CATCH_UP_MESSAGE,
    CATCH_UP_PARTS,
    CATCH_UP_VERSIONS,
    HELD,
    RECORD_DATA,
    STAGED,
    Phase,
)
from starfed.simulations.local_grid import LocalGrid

LINE = Lineage("fed-1", "epoch-a")
_run_ids = itertools.count(9500)


def same_codebook(held: Codebook, sent: Codebook) -> None:
    """``held`` is ``sent``'s broadcast: its classes in order, version, lineage, counts, frozen
    flags and every value."""
    sent = sent.broadcast()
    assert held.names == sent.names and held.version == sent.version
    assert Lineage.of(held) == Lineage.of(sent)
    for name in sent.names:
        mine, theirs = held[name], sent[name]
        assert (mine.count, mine.frozen) == (theirs.count, theirs.frozen)
        assert mine.values.keys() == theirs.values.keys()
        for field, value in theirs.values.items():
            assert torch.equal(mine.values[field], value), (name, field)


def one_class_parts(codebook: Codebook, slack: int = 0) -> int:
    """A part size that holds one class of ``codebook`` (its longest-named), not two."""
    name = max(codebook.names, key=lambda n: len(n.encode()))
    one = parts.broadcast_bytes(replace(codebook, entries={name: codebook[name]}), 0, "float32")
    return one + parts.class_bytes(codebook, name, "float32") // 2 + slack


@pytest.fixture
def codebook(make_entries, tiny_dims, fingerprint) -> Codebook:
    """Five classes, the first frozen, registered at version 5 of lineage ``LINE``."""
    entries = make_entries(n_classes=5)
    entries[0] = replace(entries[0], frozen=True)
    return Codebook(fingerprint, tiny_dims, {}, 4, LINE.as_metadata()).register(entries)


@pytest.fixture
def small_parts(codebook: Codebook) -> int:
    return one_class_parts(codebook)


def label(plan: parts.Plan, index: int, first: bool = False, classes: int | None = None):  # type: ignore[no-untyped-def]
    """Part ``index``'s label, with the manifest when it is the ``first`` of its catch-up."""
    count, announced = len(plan.parts), len(plan.codebook) if classes is None else classes
    if not first:
        return parts.Label(index, count, announced)
    return parts.Label(index, count, announced, plan.keys, plan.changed)


def stage(held: HeldCodebook, plan: parts.Plan, index: int, first: bool = False, step: int = 0):  # type: ignore[no-untyped-def]
    """Part ``index`` of ``plan`` staged as a site stages it."""
    return held.stage(plan.encoded(index), label(plan, index, first), step, plan.dtype)


def test_the_bounds_hold_for_a_whole_codebook_and_a_delta(
    codebook: Codebook, make_entries, fingerprint
) -> None:
    """``broadcast_bytes`` bounds what is sent; at the paper's dims within 5 % (4 kB of slack)."""
    paper = ModelDims(d_txt=768, d_clip=768, d_vit=768, n_layers=12)
    big = Codebook(fingerprint, paper, {}, 1, LINE.as_metadata())
    big = big.register(make_entries(paper, n_classes=3, mixtures=False))
    for start in (codebook, big):
        newer = start.set_values({start.names[1]: {"prompt": torch.zeros(start.dims.d_txt)}})
        for dtype in ("float32", "float16"):
            whole = len(wire.encode(newer.broadcast(), dtype))
            assert whole <= parts.broadcast_bytes(newer, 0, dtype)
            delta = len(wire.encode(newer.delta(start.version), dtype))
            assert delta <= parts.broadcast_bytes(newer, start.version, dtype)
    assert parts.broadcast_bytes(newer, 0, "float16") < 1.05 * whole


def test_a_part_of_the_least_size_holds_any_class(codebook: Codebook) -> None:
    """``least_part_bytes`` (what ``part-bytes`` must reach) holds a class with every field and
    the longest name a decoder accepts, in 4-byte characters: each in a part of its own."""
    longest = replace(codebook[codebook.names[1]], name="\U0001d538" * MAX_NAME_LENGTH)
    big = replace(codebook, entries={**codebook.entries, longest.name: longest})
    assert set(schema.BROADCAST) <= set(longest.values)
    for dtype in ("float32", "float16"):
        least = parts.least_part_bytes(big, dtype)
        plan = parts.plan(big, least, dtype)
        assert (longest.name,) in plan.parts
        assert all(len(plan.encoded(i)) <= least for i in range(len(plan.parts)))


def test_part_bytes_out_of_range_or_below_one_class_is_one_line(
    tmp_path: Path, codebook: Codebook, one_torch_thread
) -> None:
    """The knob's range is checked with the run config; what one class needs, once the run
    knows its backbones' dims: the run fails before its first step, saying the least."""
    for bad in ("0", str(DEFAULT_MAX_BYTES + 1)):
        with pytest.raises(ConfigError, match=rf"^part-bytes={bad}: expected an integer"):
            parse({"part-bytes": bad})
    with pytest.raises(RunFailed, match=r"^part-bytes = 4096: one class .* set at least \d+$"):
        _run(tmp_path, {"farm-a": {"t1": CLASSES[0:1]}}, LocalGrid, part_bytes=4096)
    assert not (tmp_path / "federation" / "history.jsonl").exists()


def test_a_codebook_in_parts_is_held_only_after_the_last_part(
    tmp_path: Path, codebook: Codebook, small_parts: int
) -> None:
    plan = parts.plan(codebook, small_parts)
    assert len(plan.parts) == len(codebook) >= 3
    held = HeldCodebook(
        tmp_path / "codebook.bin", fingerprint=codebook.fingerprint, dims=codebook.dims
    )
    for index in range(len(plan.parts)):
        assert len(plan.encoded(index)) <= small_parts
        assert held.version_for(LINE) == 0 and held.codebook() is None  # staged, not held
        got = stage(held, plan, index, first=index == 0)
        assert (got is None) == (index < len(plan.parts) - 1)
    assert held.version_for(LINE) == codebook.version
    same_codebook(HeldCodebook(held.path, fingerprint=codebook.fingerprint).codebook(), codebook)
    assert not (tmp_path / STAGING_DIR).exists()
    # the phase's message that follows: the empty delta from the version now held
    assert held.receive(codebook.delta(codebook.version)).version == codebook.version


def test_an_abandoned_catch_up_leaves_nothing_on_the_site_disk(
    tmp_path: Path, codebook: Codebook, small_parts: int
) -> None:
    """Parts staged for a catch-up the server gave up on, and an assembled file a killed site
    left: kept by the syncs of the next ``STAGING_IDLE_STEPS`` steps (the catch-up resumes),
    dropped by the one after (``drop_idle_staging``), or when a codebook arrives."""
    plan = parts.plan(codebook, small_parts)
    held = HeldCodebook(
        tmp_path / "codebook.bin", fingerprint=codebook.fingerprint, dims=codebook.dims
    )
    for index in range(2):
        stage(held, plan, index, first=index == 0, step=3)
    assembled = tmp_path / ".codebook.bin.assembled"
    assembled.write_bytes(b"half")
    assert len(list((tmp_path / STAGING_DIR).iterdir())) == 3  # staged.json and two parts
    for step in range(3, 4 + STAGING_IDLE_STEPS):
        held.drop_idle_staging(step)
        assert held.staged_parts() == struct.pack("<5Q", 5, 5, 0, 0, 0) and assembled.exists()
    held.drop_idle_staging(4 + STAGING_IDLE_STEPS)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    stage(held, plan, 0, first=True)
    held.receive(codebook)  # a codebook arrived: nothing to resume
    assert sorted(p.name for p in tmp_path.iterdir()) == ["codebook.bin"]


def _not_the_manifests(plan: parts.Plan, other: parts.Plan) -> list[tuple[bytes, int]]:
    return [(plan.encoded(0), 0), (plan.encoded(2), 1)]


def _another_version(plan: parts.Plan, other: parts.Plan) -> list[tuple[bytes, int]]:
    return [(plan.encoded(0), 0), (other.encoded(1), 1)]


def _another_lineage(plan: parts.Plan, other: parts.Plan) -> list[tuple[bytes, int]]:
    rolled_back = Lineage(LINE.federation, "epoch-b").as_metadata()
    elsewhere = replace(plan, codebook=replace(plan.codebook, metadata=rolled_back))
    return [(plan.encoded(0), 0), (elsewhere.encoded(1), 1)]


def _garbled(plan: parts.Plan, other: parts.Plan) -> list[tuple[bytes, int]]:
    data = plan.encoded(1)
    return [(plan.encoded(0), 0), (data[: len(data) // 2], 1)]


def _no_first_part(plan: parts.Plan, other: parts.Plan) -> list[tuple[bytes, int]]:
    return [(plan.encoded(1), 1)]


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        (_not_the_manifests, "part 1 holds other classes than the manifest names"),
        (_another_version, "another codebook than the one staged"),
        (_another_lineage, "another codebook than the one staged"),
        (_garbled, None),  # whatever the cut leaves undecodable
        (_no_first_part, "no staged codebook"),
    ],
)
def test_a_part_not_the_manifests_of_another_codebook_or_garbled_drops_the_staging(
    tmp_path: Path, codebook: Codebook, small_parts: int, sent, why: str | None
) -> None:
    newer = codebook.set_values({}, counts={codebook.names[0]: 99})
    plan, other = parts.plan(codebook, small_parts), parts.plan(newer, small_parts)
    held = HeldCodebook(
        tmp_path / "codebook.bin", fingerprint=codebook.fingerprint, dims=codebook.dims
    )
    *good, (bad, index) = sent(plan, other)
    for data, i in good:
        assert held.stage(data, label(plan, i, first=i == 0), 0, "float32") is None
    with pytest.raises(CodebookError, match=why):
        held.stage(bad, label(plan, index, first=index == 0), 0, "float32")
    assert not (tmp_path / STAGING_DIR).exists() and held.version_for(LINE) == 0
    for i in range(len(plan.parts)):  # the next catch-up starts again, from the first part
        stage(held, plan, i, first=i == 0)
    assert held.version_for(LINE) == codebook.version


def test_parts_that_do_not_make_the_announced_codebook_are_not_held(
    tmp_path: Path, codebook: Codebook, small_parts: int
) -> None:
    """Every part good, but one more class announced than they hold: nothing is held, nothing
    is left behind, and a catch-up that announces the codebook as it is then succeeds."""
    plan = parts.plan(codebook, small_parts)
    held = HeldCodebook(
        tmp_path / "codebook.bin", fingerprint=codebook.fingerprint, dims=codebook.dims
    )
    with pytest.raises(CodebookError, match="the parts hold 5 classes, 6 announced"):
        for i in range(len(plan.parts)):
            held.stage(plan.encoded(i), label(plan, i, i == 0, len(codebook) + 1), 0, "float32")
    assert held.version_for(LINE) == 0 and sorted(p.name for p in tmp_path.iterdir()) == []
    for i in range(len(plan.parts)):
        stage(held, plan, i, first=i == 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["codebook.bin"]
    same_codebook(held.codebook(), codebook)


def test_a_class_sent_in_two_parts_is_refused_and_not_held(
    tmp_path: Path, codebook: Codebook, small_parts: int
) -> None:
    """Two parts carrying the same class, as many classes as announced: a manifest naming one
    part twice is refused, and so is an assembled codebook whose decoding finds a class twice
    (two parts of one class, at two versions); nothing is held or left behind."""
    plan = parts.plan(codebook, small_parts)
    held = HeldCodebook(
        tmp_path / "codebook.bin", fingerprint=codebook.fingerprint, dims=codebook.dims
    )
    twice = parts.Label(0, 2, 2, (plan.keys[0], plan.keys[0]), (5, 5))
    with pytest.raises(CodebookError, match="names a part twice"):
        held.stage(plan.encoded(0), twice, 0, "float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    name = codebook.names[0]
    one = parts.plan(replace(codebook, entries={name: codebook[name]}), small_parts)
    renamed = {"other": replace(codebook[name], name="other")}
    other = parts.plan(replace(codebook, entries=renamed), small_parts)
    both = parts.Label(0, 2, 2, (one.keys[0], other.keys[0]), (5, 5))
    assert held.stage(one.encoded(0), both, 0, "float32") is None
    with pytest.raises(CodebookError, match="other classes than the manifest names"):
        held.stage(one.encoded(0), replace(both, index=1, keys=(), changed=()), 0, "float32")
    assert held.version_for(LINE) == 0 and sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_nodes_behind_are_those_whose_broadcast_passes_a_part(
    codebook: Codebook, small_parts: int
) -> None:
    newer = codebook.set_values({codebook.names[1]: {"prompt": torch.zeros(codebook.dims.d_txt)}})
    held = {1: codebook.version, 2: 0, 3: codebook.version - 1, 4: newer.version}
    # 1: the delta of one class fits; 2: nothing held; 3: every class changed since; 4: current
    assert catch_up.behind(newer, held, [1, 2, 3, 4], "float32", small_parts) == [2, 3]


class HeldGrid:
    """A site that answers every catch-up part and, after the last, holds the codebook sent."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.types: list[str] = []  # the Flower message type of each message sent

    def get_node_ids(self) -> list[int]:
        return [1]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as a grid's push does
            self.types.append(message.metadata.message_type)
            index, count, _ = message.content["config"][CATCH_UP]
            held = str(self.version if index == count - 1 else 0).encode()
            content = RecordDict({HELD: ConfigRecord({RECORD_DATA: held})})
            replies.append(Message(content, reply_to=message))
        return replies


def test_catch_ups_past_the_first_completed_one_are_findings_and_capped(
    codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site caught up, then claiming again to hold nothing: its second catch-up is a finding,
    and a third in the step is refused (it sits the phase out, nothing sent)."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)  # what a ServerApp's process has
    participants, ledger = Participants(node_ids=[1], sites={1: "farm-b"}), catch_up.Ledger()

    def before_phase() -> catch_up.CaughtUp:
        participants.set_version(1, None)  # it claims to hold nothing
        grid = HeldGrid(codebook.version)
        return catch_up.before_phase(
            grid, codebook, participants, [1], 0, "float32", small_parts, {1: "farm-b"}, 1.0, ledger
        )

    first = before_phase()
    assert first.nodes == [1] and not first.findings and len(first.exchanges) == len(codebook)
    assert participants.versions[1] == codebook.version
    again = before_phase()
    assert again.nodes == [1] and "behind again" in again.findings[1]
    third = before_phase()
    assert third.nodes == [] and not third.exchanges
    assert third.findings[1] == "refused a catch-up: 2 already in step 1"


def test_a_catch_up_part_is_its_own_message_which_a_site_reads_apart_from_the_sync(
    codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each part travels as a catch-up message (``query.catch_up``), not a sync, and is recorded
    under ``catch_up``; the site reads the message once into what it asks: a part to stage for
    a catch-up message, the sync's work for a sync message, whatever its config holds."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)  # what a ServerApp's process has
    grid = HeldGrid(codebook.version)
    stream = catch_up.Stream(codebook.version)
    sites = {1: "farm-b"}
    assert catch_up.send(grid, codebook, 1, 0, "float32", small_parts, sites, 1.0, stream)
    exchanges = stream.exchanges
    assert len(exchanges) == len(codebook)
    assert set(grid.types) == {CATCH_UP_MESSAGE} and len(grid.types) == len(codebook)
    assert {e.phase for e in exchanges} == {CATCH_UP_KEY}

    config = {"step": 0, "round": 1, **LINE.as_metadata(), CATCH_UP: [1, 5, 5]}
    part = Incoming.of(CATCH_UP_KEY, config)
    assert part.asks == parts.Label(1, 5, 5) and part.key == CATCH_UP_KEY
    first = Incoming.of(CATCH_UP_KEY, {**config, CATCH_UP_PARTS: ["k0"], CATCH_UP_VERSIONS: [3]})
    assert first.asks == parts.Label(1, 5, 5, ("k0",), (3,))
    assert part.epoch == LINE.epoch and part.federation == LINE.federation
    sync = Incoming.of(Phase.SYNC.key, config)
    assert sync.asks is Phase.SYNC and sync.key == "sync"


# --- a catch-up longer than a step resumes (issue 43, attack 7) -------------------------------


class StagingSite:
    """Node 1 stages its catch-up parts as a site does (``HeldCodebook.stage``; its reply as
    ``client.answer``'s: ``HELD`` and ``STAGED``, which ``staged`` may rewrite: a site that
    lies), reading at most ``budget`` parts a step: the step's others it never answers (a slow
    link: the step ends first). Node 2 holds the codebook. Pushes and pulls, as Flower's grid."""

    def __init__(self, folder: Path, codebook: Codebook, budget: int) -> None:
        self.held = HeldCodebook(
            folder / CODEBOOK_FILE, fingerprint=codebook.fingerprint, dims=codebook.dims
        )
        self.budget = budget
        self.staged: Callable[[bytes], bytes] = lambda versions: versions
        self.read: list[tuple[int, int, int]] = []  # (step, part, bytes) of each part read
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return [1, 2]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            ids.append(uuid.uuid4().hex)
            message.metadata.__dict__["_message_id"] = ids[-1]  # as a grid's push does
            step = message.content["config"]["step"]
            if sum(read[0] == step for read in self.read) < self.budget:
                self.replies[ids[-1]] = self._answer(message)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def _answer(self, message: Message) -> Message:
        config, data = message.content["config"], message.content["codebook"]["data"]
        part = parts.Label.of(config)
        index = part.index
        try:
            self.held.stage(data, part, config["step"], config["wire-dtype"])
        except CodebookError as err:  # the app's error reply
            return Message(error=Error(0, str(err)), reply_to=message)
        self.read.append((config["step"], index, len(data)))
        held = str(self.held.version_for(LINE)).encode()
        staged = self.staged(self.held.staged_parts())
        records = {HELD: held, STAGED: staged}
        content = RecordDict({k: ConfigRecord({RECORD_DATA: v}) for k, v in records.items()})
        return Message(content, reply_to=message)


def _step(
    site: StagingSite, codebook: Codebook, ledger: catch_up.Ledger, step: int, size: int
) -> tuple[catch_up.CaughtUp, catch_up.CaughtUp]:
    """One step of a federation whose node 2 holds ``codebook``: node 1's catch-up started
    before a phase (``before_phase``), run until it ends or has read ``budget`` parts, read
    (``joined``: what a phase then does), then the step's end (``abandon``)."""
    participants = Participants(node_ids=[1, 2], versions={2: codebook.version})
    sites = {1: "farm-b", 2: "farm-a"}
    catch_up.before_phase(
        site, codebook, participants, [1, 2], step, "float32", size, sites, 2.0, ledger
    )
    stream = ledger.streams[1]
    deadline = time.monotonic() + 30
    while not stream.done.is_set() and len(stream.exchanges) < site.budget:
        assert time.monotonic() < deadline, stream.exchanges
        time.sleep(0.01)
    stream.done.wait(0.2)  # a stream whose parts were all read ends at once
    ended = catch_up.joined(ledger, participants, codebook.version)
    return ended, catch_up.abandon(ledger, participants, step)


def test_a_catch_up_longer_than_a_step_resumes_with_the_parts_the_site_lacks(
    tmp_path: Path, codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site that reads three parts a step joins a codebook of five, then six, parts: in the
    first step it stages three (its catch-up stopped at the step's end: noted, no finding);
    in the second the codebook changed one of the classes it staged and gained one, and it is
    sent that part's change (a delta of its class) and the two parts it lacks; in the third
    the one part left, and it holds the codebook. No part is sent whole twice, the bytes it
    received are what it lacked, and the staging is gone."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)  # what a ServerApp's process has
    site, ledger = StagingSite(tmp_path, codebook, budget=3), catch_up.Ledger()
    _, first = _step(site, codebook, ledger, 0, small_parts)
    assert [i for _, i, _ in site.read] == [0, 1, 2]
    assert not first.findings and "(3 of 5 parts answered)" in first.noted[1]

    stale = codebook.names[1]
    newer = codebook.set_values({stale: {"prompt": torch.ones(codebook.dims.d_txt)}})
    newer = newer.register([replace(newer[stale], name="a new class", frozen=False)])
    plan = parts.plan(newer, small_parts)
    ledger = ledger.next_step()
    _, second = _step(site, newer, ledger, 1, small_parts)
    assert [i for s, i, _ in site.read if s == 1] == [1, 3, 4]  # 0 and 2 kept: unchanged
    assert not second.findings and 1 in second.noted

    ledger = ledger.next_step()
    joined, third = _step(site, newer, ledger, 2, small_parts)
    assert [i for s, i, _ in site.read if s == 2] == [5]
    assert joined.nodes == [1] and not joined.findings and not third.noted
    same_codebook(site.held.codebook(), newer)
    assert not (tmp_path / STAGING_DIR).exists() and 1 not in ledger.staged
    change = len(plan.patch([1], codebook.version))  # its prompt: a fifth of the class
    assert change < len(plan.encoded(1)) // 2
    received = sum(size for s, _, size in site.read if s > 0)
    assert received == change + sum(len(plan.encoded(i)) for i in (3, 4, 5))


def test_the_changes_of_the_parts_staged_travel_in_one_message(
    tmp_path: Path, codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's replay changes every class's aligned head, so a catch-up resumed a step
    later finds each part it staged changed a little: their changes go in one delta of their
    classes (as many as fit a part), then the parts it lacks whole."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    site, ledger = StagingSite(tmp_path, codebook, budget=3), catch_up.Ledger()
    _step(site, codebook, ledger, 0, small_parts)
    aligned = {n: {"aligned_head_bias": torch.tensor(1.0)} for n in codebook.names}
    newer = codebook.set_values(aligned)
    plan = parts.plan(newer, small_parts)
    site.budget = 99
    joined, _ = _step(site, newer, ledger.next_step(), 1, small_parts)
    assert joined.nodes == [1] and not joined.findings
    change = len(plan.patch([0, 1, 2], codebook.version))
    assert [(i, size) for s, i, size in site.read if s == 1] == [
        (0, change),  # parts 0, 1 and 2: a bias each
        (3, len(plan.encoded(3))),
        (4, len(plan.encoded(4))),
    ]
    assert change < len(plan.encoded(0)) // 2
    same_codebook(site.held.codebook(), newer)


def test_a_catch_up_ends_on_the_change_of_its_last_parts(
    tmp_path: Path, codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site holding the last two parts, staged before their classes changed, and a server
    that does not know it (a new run): it is sent the first part, learns what the site holds
    from the reply, sends the two parts it lacks, then the two staged parts' change, on which
    the site assembles the codebook."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    site = StagingSite(tmp_path, codebook, budget=99)
    plan = parts.plan(codebook, small_parts)
    for index in (3, 4):
        stage(site.held, plan, index, first=index == 3)
    newer = codebook.set_values({n: {"head_bias": torch.tensor(2.0)} for n in codebook.names})
    joined, _ = _step(site, newer, catch_up.Ledger(), 1, small_parts)
    assert joined.nodes == [1] and not joined.findings
    later = parts.plan(newer, small_parts)
    assert [(i, size) for _, i, size in site.read] == [
        (0, len(later.encoded(0))),
        (1, len(later.encoded(1))),
        (2, len(later.encoded(2))),
        (3, len(later.patch([3, 4], codebook.version))),
    ]
    same_codebook(site.held.codebook(), newer)


def test_a_staging_abandoned_for_good_is_dropped_and_a_new_catch_up_starts_again(
    tmp_path: Path, codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The site's staging past ``STAGING_IDLE_STEPS`` steps without a part is dropped at its
    sync, and the server forgets its word then too. A site that dropped its staging sooner:
    the server still remembers the parts it had, sends the first it lacks with the manifest,
    learns from the reply that the site holds nothing, and goes back to part 0: the catch-up
    completes in the step, each part sent once."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    site, ledger = StagingSite(tmp_path, codebook, budget=2), catch_up.Ledger()
    _step(site, codebook, ledger, 0, small_parts)
    site.held.drop_idle_staging(1 + STAGING_IDLE_STEPS)  # the sync of a step much later
    assert not (tmp_path / STAGING_DIR).exists() and len(ledger.staged[1].versions) == 2
    assert ledger.known(1, 1 + STAGING_IDLE_STEPS) == {}  # the server forgets it then too
    # ... but here a step sooner: the site dropped its staging, the server still knows it
    site.budget = len(codebook)
    later, _ = _step(site, codebook, ledger.next_step(), 1, small_parts)
    assert [i for s, i, _ in site.read if s == 1] == [2, 0, 1, 3, 4]
    assert later.nodes == [1] and not later.findings
    same_codebook(site.held.codebook(), codebook)


@pytest.mark.adversarial
def test_a_site_that_lies_about_its_staged_parts_gains_nothing(
    tmp_path: Path, codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site that says it staged every part at the codebook's version, after its first part
    (it holds none of the others), is sent that part and fails (a finding: it holds no
    codebook); its next catch-up is the last part alone (on whose arrival a site assembles
    the parts), and fails the same; a third is refused (``CATCH_UPS_PER_STEP``). One whose
    word is no version a part (10 kB) is taken to hold none, so it lacks a part just sent
    and fails. Honest again, it is sent the parts it lacks. The server goes on throughout,
    and the site never holds a codebook it was not sent whole."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    count = len(parts.plan(codebook, small_parts).parts)
    site, ledger = StagingSite(tmp_path, codebook, budget=99), catch_up.Ledger()
    site.staged = lambda versions: struct.pack(f"<{count}Q", *[codebook.version] * count)
    participants = Participants(node_ids=[1, 2], versions={2: codebook.version})
    sites = {1: "farm-b", 2: "farm-a"}
    found, rounds = [], []
    for _ in range(catch_up.CATCH_UPS_PER_STEP + 1):
        participants.set_version(1, None)
        before = catch_up.before_phase(
            site, codebook, participants, [1, 2], 0, "float32", small_parts, sites, 2.0, ledger
        )
        if 1 in ledger.streams:
            ledger.streams[1].done.wait(10)
        after = catch_up.joined(ledger, participants, codebook.version)
        assert 1 not in before.nodes + after.nodes  # never sent a phase
        found.append(before.findings.get(1) or after.findings.get(1))
        rounds.append([e.round for e in before.exchanges + after.exchanges])
    assert rounds == [[0], [count - 1], []] and [i for _, i, _ in site.read] == [0, count - 1]
    assert [why.split(" at ")[0] for why in found[:2]] == ["failed its catch-up"] * 2
    assert found[2] == "refused a catch-up: 2 already in step 1"
    assert site.held.version_for(LINE) == 0

    site.read.clear()
    site.staged = lambda versions: b"\xff" * 10_000  # no version a part: it has staged none
    garbled, _ = _step(site, codebook, ledger.next_step(), 1, small_parts)
    # the last (by its earlier word), then the first it lacks by this one, which it lacks again
    assert [i for _, i, _ in site.read] == [count - 1, 0] and "failed" in garbled.findings[1]
    site.read.clear()
    site.staged = lambda versions: versions  # honest again: it has the first and the last
    honest, _ = _step(site, codebook, ledger.next_step(), 2, small_parts)
    assert [i for _, i, _ in site.read] == list(range(count - 1)) and not honest.findings
    same_codebook(site.held.codebook(), codebook)


def test_a_noted_finding_does_not_count_toward_quarantine() -> None:
    """Two noted catch-ups and one rejected with ``quarantine-after`` 2: recorded, and the site
    not quarantined until a second finding that counts."""
    screen = Screen(ScreeningOptions(quarantine_after=2), step=0)
    for action in (NOTED, NOTED, REJECTED):
        screen.note("farm-b", CATCH_UP_KEY, 0, action, "its catch-up was not done")
    assert len(screen.findings) == 3 and not screen.quarantined
    screen.note("farm-b", CATCH_UP_KEY, 0, REJECTED, "failed its catch-up at part 1")
    assert screen.quarantined["farm-b"] == "2 findings in step 1"


def test_a_catch_up_stopped_without_a_part_staged_is_a_finding(
    tmp_path: Path, codebook: Codebook, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site that reads no part in the step: its stopped catch-up is a finding (it counts
    toward quarantine), not noted."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    site, ledger = StagingSite(tmp_path, codebook, budget=0), catch_up.Ledger()
    _, ended = _step(site, codebook, ledger, 0, small_parts)
    assert not ended.noted and "(0 of 5 parts answered)" in ended.findings[1]


# --- through the real apps ------------------------------------------------------------------


class GarblingGrid(LocalGrid):
    """The local runtime, with the first catch-up part 1 to node 2 cut in half on the way."""

    garbled: int = 0

    def _deliver(self, message):  # type: ignore[no-untyped-def]
        config = message.content["config"]
        if (
            message.metadata.dst_node_id == 2
            and CATCH_UP in config
            and config[CATCH_UP][0] == 1
            and not self.garbled
        ):
            data = message.content["codebook"]["data"]
            message.content["codebook"]["data"] = data[: len(data) // 2]
            self.garbled += 1
        return super()._deliver(message)


def _run(
    tmp: Path,
    sites: dict[str, dict[str, list[str]]],
    grid: Callable[..., LocalGrid] = GarblingGrid,
    part_bytes: int | None = None,  # None: the default (a tiny codebook is then never in parts)
    **run: object,  # other run config (``max-steps`` is 1 unless given)
) -> dict:
    config = {**TINY_RUN, "max-steps": 1, "federation-dir": str(tmp / "federation"), **run}
    if part_bytes is not None:
        config["part-bytes"] = part_bytes
    nodes = {
        node: {
            "data-dir": str(site_folder(tmp / name, tasks, train=4, test=2)),
            "state-dir": str(tmp / f"{name}-state"),
            "site-name": name,
            "cache-dir": str(tmp / "cache"),
        }
        for node, (name, tasks) in enumerate(sites.items(), start=1)
    }
    return run_grid(grid(client_app.app, config, nodes, run_id=next(_run_ids)), config)


def test_a_site_joining_late_catches_up_in_parts_and_recovers_from_a_garbled_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread
) -> None:
    """farm-a founds the federation with three classes; in a second run farm-b joins holding
    nothing, with parts of one class: a garbled part ends its first catch-up (it sits that
    phase out), the next phase catches it up in one part per class, and it ends the step with
    the server's codebook. farm-a, one step behind, gets deltas only."""
    farm_a = {"t1": CLASSES[0:3], "t2": CLASSES[3:4]}
    first = _run(tmp_path, {"farm-a": farm_a})
    assert first["status"] == "completed"
    assert not any(e["phase"] == CATCH_UP_KEY for e in first["exchanges"])

    founded = Federation.open(tmp_path / "federation").checkpoints.codebook()
    size = one_class_parts(founded, slack=2 * len(CLASSES[3]))  # for the fourth class's name
    second = _run(tmp_path, {"farm-a": farm_a, "farm-b": {"t1": CLASSES[3:4]}}, part_bytes=size)
    assert second["status"] == "degraded"  # farm-b failed a part
    server = Federation.open(tmp_path / "federation").checkpoints.codebook()
    assert len(server) == 4

    caught = [e for e in second["exchanges"] if e["phase"] == CATCH_UP_KEY]
    assert {e["site"] for e in caught} == {"farm-b"}
    statuses = [(e["round"], e["status"].split(":")[0]) for e in caught]
    assert statuses[:2] == [(0, "ok"), (1, "error")]  # the garbled part, refused
    assert statuses[2:] == [(i, "ok") for i in range(4)]  # the next phase: 4 parts, 1 class each
    phases = [e["phase"] for e in second["exchanges"] if e["site"] == "farm-b"]
    assert "stage1" not in phases and phases.count(CATCH_UP_KEY) == 6

    held = HeldCodebook(tmp_path / "farm-b-state" / CODEBOOK_FILE).codebook()
    same_codebook(held, server)
    assert not (tmp_path / "farm-b-state" / STAGING_DIR).exists()


# --- a site that claims an old codebook before every phase (issue 43, attack 7) ------------


class StaleClaimGrid(LocalGrid):
    """The local runtime, where node 2 receives every catch-up part and claims to hold an old
    version (its replies rewritten): it is behind again before every phase."""

    def _deliver(self, message):  # type: ignore[no-untyped-def]
        reply = super()._deliver(message)
        part = CATCH_UP in message.content["config"]
        if reply is not None and message.metadata.dst_node_id == 2 and part:
            reply.content[HELD] = ConfigRecord({RECORD_DATA: b"1"})
        return reply


@pytest.mark.adversarial
def test_a_site_behind_before_every_phase_is_capped_found_and_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread
) -> None:
    """farm-b joins a federation of four classes and claims an old codebook after each
    catch-up: it is caught up at most ``CATCH_UPS_PER_STEP`` times, each failed or refused
    catch-up is a finding, and at ``quarantine-after`` (3) it is quarantined; farm-a's results
    are those of the same step without farm-b."""
    farm_a = {"t1": CLASSES[0:3], "t2": CLASSES[3:4]}
    assert _run(tmp_path, {"farm-a": farm_a}, LocalGrid)["status"] == "completed"
    founded = Federation.open(tmp_path / "federation").checkpoints.codebook()
    size = one_class_parts(founded, slack=64)
    alone = tmp_path / "alone"
    shutil.copytree(tmp_path, alone)

    sites = {"farm-a": farm_a, "farm-b": {"t1": CLASSES[3:4]}}
    attacked = _run(tmp_path, sites, StaleClaimGrid, size)
    baseline = _run(alone, {"farm-a": farm_a}, LocalGrid, size)
    [step] = [s for s in Federation.open(tmp_path / "federation").history() if s.step == 1]
    mine = [f for f in step.findings if f.site == "farm-b"]
    assert [f.action for f in mine] == ["rejected"] * 3 + ["quarantined"], mine
    assert {f.phase for f in mine[:3]} == {CATCH_UP_KEY}
    assert "refused a catch-up" in mine[2].reason
    caught = [e for e in attacked["exchanges"] if e["phase"] == CATCH_UP_KEY]
    assert len({e["round"] for e in caught}) == 4  # four parts of one class each
    assert len(caught) == catch_up.CATCH_UPS_PER_STEP * 4  # then no more
    assert attacked["site_accuracy"]["farm-a"] == pytest.approx(
        baseline["site_accuracy"]["farm-a"], abs=1.0
    )


# --- a site that reads its parts slowly (issue 43, attack 7) ---------------------------------

SLOW_PART_S = 20.0  # far above a tiny phase, however loaded the machine


class SlowReaderGrid(LocalGrid):
    """The local runtime with Flower's pushes and pulls: each node answers its messages in
    order in a thread of its own, as a SuperNode does, and node 2 takes ``part_s`` to read
    each catch-up part, however it is sent (``close`` wakes it)."""

    part_s: float = SLOW_PART_S

    def __post_init__(self) -> None:
        super().__post_init__()
        self.workers = {node: ThreadPoolExecutor(1) for node in self.node_configs}
        self.replies: dict[str, Future[Message | None]] = {}
        self.closed = threading.Event()
        self.parts_read: list[float] = []  # when node 2 finished reading each part

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            ids.append(uuid.uuid4().hex)
            message.metadata.__dict__["_message_id"] = ids[-1]  # as a grid's push does
            node = message.metadata.dst_node_id
            self.replies[ids[-1]] = self.workers[node].submit(self._answer, message, ids[-1])
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        done = [self.replies.pop(i) for i in list(message_ids) if self.replies[i].done()]
        return [f.result() for f in done if not f.cancelled() and f.result() is not None]

    def _answer(self, message: Message, message_id: str) -> Message | None:
        reply = self._deliver(message)  # which gives the message an id of its own: put back
        message.metadata.__dict__["_message_id"] = message_id
        if reply is not None:
            reply.metadata.__dict__["_reply_to_message_id"] = message_id
        return reply

    def _deliver(self, message):  # type: ignore[no-untyped-def]
        if message.metadata.dst_node_id == 2 and message.metadata.message_type == CATCH_UP_MESSAGE:
            self.closed.wait(self.part_s)
            self.parts_read.append(time.monotonic())
        return super()._deliver(message)

    def close(self) -> None:
        self.closed.set()
        for worker in self.workers.values():
            worker.shutdown(wait=True, cancel_futures=True)


@pytest.mark.adversarial
@pytest.mark.parametrize(
    "farm_a_behind", [False, pytest.param(True, marks=pytest.mark.slow, id="farm-a-behind-too")]
)
def test_a_site_reading_its_parts_slowly_stalls_no_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread, farm_a_behind: bool
) -> None:
    """farm-b joins a federation of four classes (four parts) and reads each part in 20 s: on
    a grid whose sites answer concurrently, farm-a's phases go on without it (each phase of the
    step ends before farm-b has read a second part), farm-b sits them out and its unfinished
    catch-up is a finding at the step's end; farm-a's results are those of the same step
    without farm-b. Before the parts went in a stream per site, every phase waited 80 s. With
    ``farm_a_behind`` farm-a lost its codebook too: it is caught up itself before the step's first
    phase, which then goes on with it alone (it waited for farm-b's catch-up before)."""
    farm_a = {"t1": CLASSES[0:3], "t2": CLASSES[3:4]}
    assert _run(tmp_path, {"farm-a": farm_a}, LocalGrid)["status"] == "completed"
    if farm_a_behind:  # it holds nothing now, and remembers its first task done
        (tmp_path / "farm-a-state" / CODEBOOK_FILE).unlink()
    founded = Federation.open(tmp_path / "federation").checkpoints.codebook()
    size = one_class_parts(founded, slack=64)
    alone = tmp_path / "alone"
    shutil.copytree(tmp_path, alone)

    grids: list[SlowReaderGrid] = []

    def grid(*args, **kwargs) -> SlowReaderGrid:  # type: ignore[no-untyped-def]
        grids.append(SlowReaderGrid(*args, **kwargs))
        return grids[-1]

    t0 = time.monotonic()
    try:
        sites = {"farm-a": farm_a, "farm-b": {"t1": CLASSES[3:4]}}
        attacked = _run(tmp_path, sites, grid, size)
        step_s = time.monotonic() - t0
    finally:
        grids[0].close()
    assert len([t for t in grids[0].parts_read if t < t0 + step_s]) <= 1  # farm-b still reading
    [step] = [s for s in Federation.open(tmp_path / "federation").history() if s.step == 1]
    assert {p.phase for p in step.phase_seconds} >= {"stage1", "stage2", "evaluate"}
    mine = [f for f in step.findings if f.site == "farm-b"]
    answered = re.search(
        r"not done at the end of step 2 \(([01]) of 4 parts answered\)", mine[0].reason
    )
    assert answered, mine
    action = "noted" if answered.group(1) == "1" else "rejected"  # progress: it resumes
    assert [(f.phase, f.action) for f in mine] == [(CATCH_UP_KEY, action)], mine
    phases = {e["phase"] for e in attacked["exchanges"] if e["site"] == "farm-b"}
    assert phases <= {"sync", CATCH_UP_KEY}  # it sat every phase out
    baseline = _run(alone, {"farm-a": farm_a}, LocalGrid, size)
    assert attacked["site_accuracy"]["farm-a"] == pytest.approx(
        baseline["site_accuracy"]["farm-a"], abs=1.0
    )


def test_a_site_reading_its_parts_at_once_joins_the_step_on_a_grid_that_pushes_and_pulls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread
) -> None:
    """The same join with parts read at once: farm-b's stream ends within the step, it joins
    the phases after (the one it was found behind in, when its stream ends before farm-a
    answered), with no finding, and ends the step with the server's codebook."""
    farm_a = {"t1": CLASSES[0:3], "t2": CLASSES[3:4]}
    assert _run(tmp_path, {"farm-a": farm_a}, LocalGrid)["status"] == "completed"
    founded = Federation.open(tmp_path / "federation").checkpoints.codebook()
    size = one_class_parts(founded, slack=64)
    monkeypatch.setattr(SlowReaderGrid, "part_s", 0.0)
    grids: list[SlowReaderGrid] = []

    def grid(*args, **kwargs) -> SlowReaderGrid:  # type: ignore[no-untyped-def]
        grids.append(SlowReaderGrid(*args, **kwargs))
        return grids[-1]

    try:
        sites = {"farm-a": farm_a, "farm-b": {"t1": CLASSES[3:4]}}
        joined = _run(tmp_path, sites, grid, size)
    finally:
        grids[0].close()
    assert joined["status"] == "completed"
    theirs = [e for e in joined["exchanges"] if e["site"] == "farm-b"]
    assert [e["round"] for e in theirs if e["phase"] == CATCH_UP_KEY] == [0, 1, 2, 3]
    answered = {e["phase"] for e in theirs if e["status"] == "ok"} - {"sync", CATCH_UP_KEY}
    assert "evaluate" in answered, answered
    server = Federation.open(tmp_path / "federation").checkpoints.codebook()
    same_codebook(HeldCodebook(tmp_path / "farm-b-state" / CODEBOOK_FILE).codebook(), server)


PART_TIMEOUT_S = 60  # a part's (and a phase's): far above a tiny step


class BudgetGrid(SlowReaderGrid):
    """The pushing and pulling grid where node 2 reads at most ``budget`` catch-up messages a
    step (by the message's step) and never answers the step's others: a link too slow for
    its catch-up to end within a step."""

    budget: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        self.read_in: dict[int, list[int]] = {}  # step -> the parts node 2 read in it
        self.part_s = 0.0

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            config = message.content["config"]
            if message.metadata.dst_node_id == 2 and CATCH_UP in config:
                read = self.read_in.setdefault(config["step"], [])
                if len(read) >= self.budget:
                    ids.append(uuid.uuid4().hex)
                    message.metadata.__dict__["_message_id"] = ids[-1]
                    self.replies[ids[-1]] = Future()  # never answered
                    continue
                read.append(config[CATCH_UP][0])
            ids += super().push_messages([message])
        return ids


@pytest.mark.adversarial
def test_a_site_whose_catch_up_takes_steps_joins_after_them_holding_no_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread
) -> None:
    """farm-b joins a federation of three classes as farm-a brings one a step, reading three
    catch-up messages a step (parts of one class; the step's others never answered): every
    step completes for farm-a without waiting for farm-b, farm-b's catch-up stopped at the
    first step's end is noted (no finding toward quarantine), the next resumes with the
    changes of the three parts it staged (one message) and the two it lacks, farm-b joins
    the phases of that step after it (at least the evaluation) and the next step whole, and
    ends holding the server's codebook. Before, its catch-up restarted from the first part
    every step, and never ended."""
    farm_a = {"t1": CLASSES[0:3], "t2": CLASSES[3:4], "t3": CLASSES[4:5], "t4": CLASSES[5:6]}
    assert _run(tmp_path, {"farm-a": {"t1": farm_a["t1"]}}, LocalGrid)["status"] == "completed"
    founded = Federation.open(tmp_path / "federation").checkpoints.codebook()
    size = one_class_parts(founded, slack=64)
    grids: list[BudgetGrid] = []

    def grid(*args, **kwargs) -> BudgetGrid:  # type: ignore[no-untyped-def]
        grids.append(BudgetGrid(*args, **kwargs))
        return grids[-1]

    sites = {"farm-a": farm_a, "farm-b": {"t1": CLASSES[3:4]}}
    try:
        settings = {"max-steps": 3, "timeout-s": PART_TIMEOUT_S}
        joined = _run(tmp_path, sites, grid, size, **settings)
    finally:
        grids[0].close()
    history = [s for s in Federation.open(tmp_path / "federation").history() if s.step >= 1]
    assert [s.wall_s < PART_TIMEOUT_S for s in history] == [True] * 3  # none waited for it
    assert [s.status for s in history] == ["degraded", "completed", "completed"]
    [noted] = history[0].findings
    assert (noted.site, noted.phase, noted.action) == ("farm-b", CATCH_UP_KEY, "noted")
    assert "(3 of 4 parts answered)" in noted.reason
    done = {"stage1", "stage2", "evaluate"}
    for step in (1, 2, 3):
        for name in ("farm-a", "farm-b") if step == 3 else ("farm-a",):
            answered = {
                e["phase"]
                for e in joined["exchanges"]
                if e["site"] == name and e["step"] == step and e["status"] == "ok"
            }
            assert done <= answered, (step, name, answered)
    caught = [e for e in joined["exchanges"] if e["phase"] == CATCH_UP_KEY]
    assert [(e["step"], e["round"]) for e in caught] == [
        (1, 0),
        (1, 1),
        (1, 2),
        (2, 0),
        (2, 3),
        (2, 4),
    ]
    # step 3's first message: the changes of the three parts staged in step 2 (their aligned
    # heads: the replay's), not the parts again
    assert caught[3]["bytes_down"] < caught[0]["bytes_down"] / 2
    theirs = {e["phase"] for e in joined["exchanges"] if e["site"] == "farm-b" and e["step"] == 2}
    assert "evaluate" in theirs  # it joined the step its catch-up ended in (its later phases)
    server = Federation.open(tmp_path / "federation").checkpoints.codebook()
    same_codebook(HeldCodebook(tmp_path / "farm-b-state" / CODEBOOK_FILE).codebook(), server)
    assert not (tmp_path / "farm-b-state" / STAGING_DIR).exists()
