"""The catch-up: a codebook too large for one message, sent to the sites far behind in parts.

A phase's message carries each site the delta from the codebook version it holds, or the whole
codebook. Once the federation's codebook passes what one message may carry (the run config's
``part-bytes``: by default the site's own message limit), a site that holds nothing recent — one
joining late, one that lost its state — could not receive it at all. So before a codebook
phase's message the coordinator finds the nodes whose broadcast would pass a part (``behind``)
and sends each of them the codebook split by classes (``send``): one catch-up message per part
(``CATCH_UP_MESSAGE``, its own message type: a site answers it apart from the phases), whose
config says which part it is (``CATCH_UP``). A site stages the parts and holds the codebook only
after the last (``HeldCodebook.stage``); its last reply says the version it now holds
(``HELD``), and the phase's own message then carries the empty delta from it. A node that fails
a part (an error, no reply, a part refused) leaves the catch-up and sits that phase out. The
server encodes one part at a time.

A catch-up resumes (issue 43, attack 7: one longer than a step restarted every step, and never
ended): every reply says the version the site has each part staged at (``STAGED``), the server
keeps that word from step to step (``Ledger.staged``), and the next catch-up sends the parts
the site lacks whole and, for those it staged before their classes changed (every step's
replay realigns every class's head), the change, one delta of as many such parts as fit one
(``send``; the parts' keys and versions: ``starfed.shared.codebook.parts``). The word is
trusted for nothing but sending less: a site that claims what it lacks cannot assemble the
codebook, and fails.

Each node's parts are its own stream (``Stream``), so that a site reading its parts slowly
stalls no one (issue 43, attack 7: 1 s a part took every site's phase from 0.15 s to 6.25 s).
On a grid that pushes and pulls (Flower's) a stream runs in a thread of its own, each part with
its own timeout, while the phase is sent to the nodes that hold a recent codebook: a node whose
stream completes while the phase runs is sent the phase after the others answered
(``joined``), one whose stream is still going sits the phase out and joins a later phase; a
phase with no other node waits for the first stream that catches its node up (or for all to
end), the others going on beside it. A stream not done when its step ends is stopped
(``abandon``). A grid that answers at once (the local runtime, whose nodes run one after
another in one thread) runs each stream to its end before the phase, as before.

A catch-up costs up to the whole codebook, so the step counts them (``Ledger``): a failed one, a
site behind again after completing one, one refused past ``CATCH_UPS_PER_STEP``, and one the
step's end stopped before the site staged a part are screening findings
(``CaughtUp.findings``), which count toward ``quarantine-after``. One the step's end stopped
after the site staged parts is noted (``CaughtUp.noted``: recorded, not counted): it resumes at
the next step, and a slow link that makes progress is no fault. A site that never stages a
part still meets the rule.

Costs: a catch-up sends (and encodes, one part at a time) the broadcast's bytes once per behind
node, in ⌈bytes / part-bytes⌉ messages (a resumed one: what the site lacks, and the changes of
what it staged); the server keeps a key and a version per part a node has staged; deciding who
is behind is one pass over the classes' versions per phase; on a grid that pushes and pulls, a
thread per node in a catch-up.
"""

from __future__ import annotations

import struct
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from flwr.app import RecordDict

from starfed.server.messaging import (
    PushPullGrid,
    SiteGrid,
    exchange,
    message_config,
    reject,
)
from starfed.server.participants import Participants
from starfed.server.records import Exchange, Outcome
from starfed.shared.codebook import parts
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.held import staging_idle
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.protocol import (
    CATCH_UP,
    CATCH_UP_KEY,
    CATCH_UP_MESSAGE,
    CATCH_UP_PARTS,
    CATCH_UP_PATCHED,
    CATCH_UP_VERSIONS,
    HELD,
    RECORD_DATA,
    ROUND,
    STAGED,
)

#: Catch-ups one site may start in one step. An honest site needs one (it joined, or lost its
#: state); a second restarts one that a lost part cut short. A site behind before every phase
#: (issue 43, attack 7: one that claims again and again to hold an old codebook) would cost the
#: server the whole codebook each time: past this it sits the phase out, with a finding.
CATCH_UPS_PER_STEP = 2


@dataclass
class Stream:
    """One node's catch-up: the version it is sent, in how many parts, the version the node
    said each part is staged at, by key (``staged``: at the start, its last word in an
    earlier catch-up; then its reply to each part), the log entry of each part answered so far
    (appended as they go), whether it ended (``done``) and caught the node up (``caught``);
    ``stop`` ends it before its next part."""

    version: int
    staged: dict[str, int] = field(default_factory=dict)
    step: int = 0  # the step it runs in
    parts: int = 0  # how many the codebook is in, once planned
    exchanges: list[Exchange] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    caught: bool = False

    def holds(self, version: int) -> bool:
        """Whether it caught its node up to codebook ``version``."""
        return self.caught and self.version == version

    @property
    def progressed(self) -> bool:
        """Whether the node staged a part in it (a part answered without fault)."""
        return any(not entry.failed for entry in self.exchanges)


@dataclass
class Ledger:
    """One step's catch-ups: how many each node started, the nodes that completed one, the
    streams in progress or ended but not yet read (node -> its stream); and, kept from step to
    step (``next_step``), the version each node said each part is staged at when its last
    catch-up ended (what a resumed one sends only the changes of)."""

    started: Counter[int] = field(default_factory=Counter)
    completed: set[int] = field(default_factory=set)
    streams: dict[int, Stream] = field(default_factory=dict)
    ended: threading.Event = field(default_factory=threading.Event)  # set as each stream ends
    staged: dict[int, StagedWord] = field(default_factory=dict)

    def next_step(self) -> Ledger:
        """The next step's ledger: what the nodes have staged, nothing else."""
        return Ledger(staged=self.staged)

    def ending(self, node: int, stream: Stream) -> None:
        """``node``'s stream read out: what it has staged kept for its next catch-up."""
        del self.streams[node]
        if stream.staged:
            self.staged[node] = StagedWord(stream.step, stream.staged)
        else:
            self.staged.pop(node, None)

    def known(self, node: int, step: int) -> dict[str, int]:
        """What ``node`` has staged, as far as a catch-up in ``step`` can tell: nothing when
        its word is older than the site keeps an idle staging (``STAGING_IDLE_STEPS``)."""
        word = self.staged.get(node)
        if word is None or staging_idle(step, word.step):
            return {}
        return word.versions


@dataclass(frozen=True)
class StagedWord:
    """A node's last word on its staged parts: the step it said it in, and the version each
    part is staged at, by key."""

    step: int
    versions: dict[str, int]


@dataclass(frozen=True)
class CaughtUp:
    """What the catch-up before a phase did: the nodes to send the phase to, the log entry of
    every part, why each node that failed its catch-up, came back behind after completing
    one, or passed ``CATCH_UPS_PER_STEP`` is a screening finding (node -> reason), and, at the
    step's end, why each node whose catch-up was stopped after it staged parts is noted (a
    finding that does not count toward quarantine: it resumes at the next step)."""

    nodes: list[int]
    exchanges: list[Exchange]
    findings: dict[int, str]
    noted: dict[int, str] = field(default_factory=dict)


def behind(
    codebook: Codebook,
    versions: Mapping[int, int],
    nodes: Sequence[int],
    dtype: str,
    part_bytes: int,
) -> list[int]:
    """The nodes whose broadcast (the delta from the version ``versions`` says they hold, else the
    whole codebook) could pass one part of ``part_bytes`` (``parts.broadcast_bytes``: an upper
    bound)."""
    sizes: dict[int, int] = {}  # base version -> the bound of its broadcast
    late = []
    for node in nodes:
        since = versions.get(node, 0)
        since = since if 0 < since <= codebook.version else 0
        if since not in sizes:
            sizes[since] = parts.broadcast_bytes(codebook, since, dtype)
        if sizes[since] > part_bytes:
            late.append(node)
    return late


def before_phase(
    grid: SiteGrid,
    codebook: Codebook,
    participants: Participants,
    nodes: Sequence[int],
    step: int,
    dtype: str,
    part_bytes: int,
    sites: Mapping[int, str],
    timeout: float,
    ledger: Ledger,
) -> CaughtUp:
    """The streams that ended since the last phase read (``joined``), then a catch-up started
    (``start``) for each of the ``nodes`` of a phase that is ``behind`` (in parts of
    ``part_bytes``) and has none in
    progress, at most ``CATCH_UPS_PER_STEP`` times each in the step (``ledger``); the nodes to
    send the phase to — all but those behind that are not caught up (they sit the phase out,
    and may join a later one) — the log of every part of the streams that ended, and the
    findings. A phase whose every node is behind waits for the first catch-up that succeeds (or
    for every one to end): the others go on beside it, so even then a slow one stalls no one."""
    ended = joined(ledger, participants, codebook.version)
    findings, exchanges = dict(ended.findings), list(ended.exchanges)
    late = behind(codebook, participants.versions, nodes, dtype, part_bytes)
    for node in late:
        if node in ledger.streams:
            continue  # its catch-up is still going
        if node in ledger.completed:
            findings[node] = f"behind again after completing a catch-up in step {step + 1}"
        if ledger.started[node] >= CATCH_UPS_PER_STEP:
            findings[node] = f"refused a catch-up: {CATCH_UPS_PER_STEP} already in step {step + 1}"
            continue
        sent = partial(send, grid, codebook, node, step, dtype, part_bytes, sites, timeout)
        start(grid, ledger, node, codebook.version, step, sent)
    if set(nodes) <= set(late):  # no node to send the phase to until a catch-up succeeds
        going = [ledger.streams[n] for n in set(nodes) & set(ledger.streams)]
        _first_caught(ledger, going, codebook.version)
    now = joined(ledger, participants, codebook.version)
    exchanges += now.exchanges
    for node, why in now.findings.items():
        findings.setdefault(node, why)
    left = set(late) - set(now.nodes)
    return CaughtUp([node for node in nodes if node not in left], exchanges, findings)


def start(
    grid: SiteGrid,
    ledger: Ledger,
    node: int,
    version: int,
    step: int,
    sent: Callable[[Stream], bool],
) -> None:
    """``node``'s catch-up to codebook ``version`` in ``step`` (counted in ``ledger``, from what
    the node last said it has staged), whose parts ``sent`` sends (``send``, whether it caught
    the node up): in a thread of its own on a grid that pushes and pulls, to its end before
    returning on one that answers at once."""
    stream = Stream(version, ledger.known(node, step), step)
    ledger.streams[node] = stream
    ledger.started[node] += 1

    def run() -> None:
        try:
            stream.caught = sent(stream)
        finally:
            stream.done.set()
            ledger.ended.set()

    if isinstance(grid, PushPullGrid):
        threading.Thread(target=run, name=f"catch-up node {node}", daemon=True).start()
    else:
        run()


def _first_caught(ledger: Ledger, streams: Sequence[Stream], version: int) -> None:
    """Wait until one of ``streams`` caught its node up to codebook ``version`` (the phase's: a
    stream an earlier phase started may send an older one), or every one ended."""
    while not all(s.done.is_set() for s in streams) and not any(
        s.done.is_set() and s.holds(version) for s in streams
    ):
        ledger.ended.wait()  # set after a stream's done: a stream that ends now is seen next
        ledger.ended.clear()


def joined(ledger: Ledger, participants: Participants, version: int) -> CaughtUp:
    """The streams that ended, read out of ``ledger``: what each node holds now, the nodes that
    hold ``version`` (the phase's codebook: they may be sent the phase), the log of their parts
    and a finding for each that failed."""
    nodes: list[int] = []
    exchanges: list[Exchange] = []
    findings: dict[int, str] = {}
    for node, stream in list(ledger.streams.items()):
        if not stream.done.is_set():
            continue
        ledger.ending(node, stream)
        exchanges += stream.exchanges
        participants.set_version(node, stream.version if stream.caught else None)
        if stream.holds(version):
            ledger.completed.add(node)
            nodes.append(node)
        for entry in stream.exchanges:
            if entry.failed:
                findings.setdefault(node, f"failed its catch-up at part {entry.round + 1}")
    return CaughtUp(nodes, exchanges, findings)


def abandon(ledger: Ledger, participants: Participants, step: int) -> CaughtUp:
    """At the step's end, the streams that ended read (``joined``: none joins a phase now) and
    those still going stopped before their next part, their parts answered so far logged; a
    stopped stream's part in flight is answered, or times out, in its thread (not logged).
    One stopped after the node staged a part is noted (it resumes at the next step with the
    parts staged: a slow link makes progress), one that staged none a finding."""
    ended = joined(ledger, participants, version=-1)
    for node, stream in list(ledger.streams.items()):
        stream.stop.set()
        answered = list(stream.exchanges)
        ended.exchanges.extend(answered)
        why = (
            f"its catch-up was not done at the end of step {step + 1} "
            f"({len(answered)} of {stream.parts} parts answered)"
        )
        if stream.progressed:
            ended.noted[node] = f"{why}; it resumes with the parts staged"
        else:
            ended.findings[node] = why
        ledger.ending(node, stream)
        participants.set_version(node, None)
    return ended


def send(
    grid: SiteGrid,
    codebook: Codebook,
    node: int,
    step: int,
    dtype: str,
    part_bytes: int,
    sites: Mapping[int, str],
    timeout: float,
    stream: Stream,
) -> bool:
    """Send ``node`` the parts of ``codebook`` (of at most ``part_bytes``) it has not staged,
    in order, its lineage in its metadata and in each part's message config
    (``message_config``, round = part), the first message with the manifest
    (``CATCH_UP_PARTS``), each part with its own ``timeout``, until ``stream.stop``; whether
    the node now holds it (a reply says so, once every part is staged). Each reply says which
    parts the node has staged (``STAGED``): the next part sent is the first it lacks (at the
    start, by ``stream.staged``: its word in an earlier catch-up), and ``stream.staged`` is
    kept for a catch-up that resumes. Each part is sent at most once (at least one is: the
    node assembles the codebook on a part's arrival): a reply that lacks a part sent, or
    lacks none and does not hold the codebook, fails the catch-up. The log entry of every
    part sent (phase ``catch_up``) goes to ``stream.exchanges`` as it is answered."""
    config = message_config(step, 0, codebook, dtype)
    lineage = Lineage.of(codebook).as_metadata()
    plan = parts.plan(replace(codebook, metadata=lineage), part_bytes, dtype)
    keys, changed = plan.keys, plan.changed
    count = stream.parts = len(plan.parts)
    manifest: dict[str, list[str] | list[int]]
    manifest = {CATCH_UP_PARTS: list(keys), CATCH_UP_VERSIONS: list(changed)}
    sent: set[int] = set()
    index = _next(plan, stream.staged)
    while not stream.stop.is_set():
        message = {**config, ROUND: index, CATCH_UP: [index, count, len(codebook)]}
        if not sent:
            message.update(manifest)
        patched = _stale(plan, stream.staged, index, sent)
        if patched:
            since = min(stream.staged[keys[i]] for i in patched)
            data = plan.patch(patched, since)
            message[CATCH_UP_PATCHED] = patched
        else:
            data = plan.encoded(index)
        sent.update(patched or [index])
        good, [entry] = exchange(
            grid,
            CATCH_UP_MESSAGE,
            CATCH_UP_KEY,
            step,
            index,
            message,
            [node],
            sites,
            _constant(data),
            timeout,
        )
        caught = False
        if good:
            [(_, reply)] = good
            stream.staged = _staged(reply.content, plan, sent)
            said = _record(reply.content, HELD)
            caught = said == str(codebook.version).encode()
            index = _next(plan, stream.staged)
            if not caught and (
                index in sent or parts.current(plan.keys, plan.changed, stream.staged) == count
            ):
                why = f"holds {said[:20]!r} after its parts, not version {codebook.version}"
                reject(entry, why)  # each part once: a site that loses what it staged fails
        if caught or entry.status.outcome is Outcome.ERROR:
            stream.staged = {}  # held: nothing staged; refused: the staging dropped
        stream.exchanges.append(entry)
        if entry.failed or caught:
            return not entry.failed
    return False


def _stale(plan: parts.Plan, staged: Mapping[str, int], index: int, sent: set[int]) -> list[int]:
    """When part ``index`` is ``staged`` at an earlier version: it and the next parts staged
    at an earlier version and not ``sent``, as many as one delta of their classes fits a part
    (``Plan.patch_bytes``); else none (the part is sent whole)."""
    keys, changed = plan.keys, plan.changed
    group: list[int] = []
    for i in range(index, len(keys)):
        since = staged.get(keys[i], 0)
        if i in sent or not 0 < since < changed[i]:
            if i == index:
                return []
            continue
        oldest = min([since, *(staged[keys[k]] for k in group)])
        if plan.patch_bytes([*group, i], oldest) > plan.part_bytes:
            break
        group.append(i)
    return group


def _next(plan: parts.Plan, staged: Mapping[str, int]) -> int:
    """The first part not ``staged`` at its version (all are: the last, on whose arrival the
    node assembles them)."""
    pairs = enumerate(zip(plan.keys, plan.changed, strict=True))
    return next((i for i, (k, v) in pairs if staged.get(k, 0) < v), len(plan.keys) - 1)


def _record(content: RecordDict, name: str) -> bytes:
    """A reply's record ``name`` (anything but bytes, or none: no bytes)."""
    raw = content[name][RECORD_DATA] if name in content else b""
    return raw if isinstance(raw, bytes) else b""


def _staged(content: RecordDict, plan: parts.Plan, sent: set[int]) -> dict[str, int]:
    """The version each part is staged at by a reply (``STAGED``: a little-endian 64-bit
    integer a part, none past the codebook's version; anything else: none staged). A reply
    without the record (a site of an earlier release, which stages whole parts in order) has
    staged those ``sent``. Trusted only to send less: a site that says it holds a part it
    lacks cannot assemble the codebook, and one that says it lacks a part it was sent fails
    its catch-up (``send``)."""
    keys, version = plan.keys, plan.codebook.version
    if STAGED not in content:
        return {keys[i]: version for i in sent}
    raw = _record(content, STAGED)
    if len(raw) != 8 * len(keys):
        return {}
    versions = struct.unpack(f"<{len(keys)}Q", raw)
    if max(versions) > version:
        return {}
    return {key: v for key, v in zip(keys, versions, strict=True) if v}


def _constant(data: bytes) -> Callable[[int], bytes]:
    """The same part for every node."""
    return lambda node: data
