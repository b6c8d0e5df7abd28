"""The catch-up: a codebook too large for one message, sent to the sites far behind in parts.

A phase's message carries each site the delta from the codebook version it holds, or the whole
codebook. Once the federation's codebook passes what one message may carry
(``starfed.shared.codebook.parts.PART_BYTES``), a site that holds nothing recent — one joining
late, one that lost its state — could not receive it at all. So before a codebook phase's
message the coordinator finds the nodes whose broadcast would pass a part (``behind``) and sends
them the codebook split by classes (``send``): one catch-up message per part
(``CATCH_UP_MESSAGE``, its own message type: a site answers it apart from the phases), whose
config says which part it is (``CATCH_UP``), all behind nodes served part by part. A site stages the
parts and holds the codebook only after the last (``HeldCodebook.stage``); its last reply says
the version it now holds (``HELD``), and the phase's own message then carries the empty delta
from it. A node that fails a part (an error, no reply, a part refused) leaves the catch-up and
sits that phase out; the next phase starts its catch-up again from the first part, so a site
that went away mid-way costs only a restart. The server encodes one part at a time. A catch-up
costs the whole codebook, so the step counts them (``Ledger``): a failed one, a site behind
again after completing one, and one refused past ``CATCH_UPS_PER_STEP`` are screening findings
(``CaughtUp.findings``), which count toward ``quarantine-after``.

Costs: a catch-up sends the broadcast's bytes once per behind node, in ⌈bytes / PART_BYTES⌉
messages; deciding who is behind is one pass over the classes' versions per phase.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from starfed.server.messaging import SiteGrid, exchange, message_config, reject
from starfed.server.participants import Participants
from starfed.server.records import Exchange
from starfed.shared.codebook import parts
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.protocol import (
    CATCH_UP,
    CATCH_UP_KEY,
    CATCH_UP_MESSAGE,
    HELD,
    RECORD_DATA,
    ROUND,
)

#: Catch-ups one site may start in one step. An honest site needs one (it joined, or lost its
#: state); a second restarts one that a lost part cut short. A site behind before every phase
#: (issue 43, attack 7: one that claims again and again to hold an old codebook) would cost the
#: server the whole codebook each time: past this it sits the phase out, with a finding.
CATCH_UPS_PER_STEP = 2


@dataclass
class Ledger:
    """One step's catch-ups: how many each node started, and the nodes that completed one."""

    started: Counter[int] = field(default_factory=Counter)
    completed: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class CaughtUp:
    """What the catch-up before a phase did: the nodes to send the phase to, the log entry of
    every part, and why each node that failed its catch-up, came back behind after completing
    one, or passed ``CATCH_UPS_PER_STEP`` is a screening finding (node -> reason)."""

    nodes: list[int]
    exchanges: list[Exchange]
    findings: dict[int, str]


def behind(
    codebook: Codebook, versions: Mapping[int, int], nodes: Sequence[int], dtype: str
) -> list[int]:
    """The nodes whose broadcast (the delta from the version ``versions`` says they hold, else the
    whole codebook) could pass one part (``parts.broadcast_bytes``: an upper bound)."""
    sizes: dict[int, int] = {}  # base version -> the bound of its broadcast
    late = []
    for node in nodes:
        since = versions.get(node, 0)
        since = since if 0 < since <= codebook.version else 0
        if since not in sizes:
            sizes[since] = parts.broadcast_bytes(codebook, since, dtype)
        if sizes[since] > parts.PART_BYTES:
            late.append(node)
    return late


def before_phase(
    grid: SiteGrid,
    codebook: Codebook,
    participants: Participants,
    nodes: Sequence[int],
    step: int,
    dtype: str,
    sites: Mapping[int, str],
    timeout: float,
    ledger: Ledger,
) -> CaughtUp:
    """Catch up the ``nodes`` of a phase that are ``behind`` (``send``), at most
    ``CATCH_UPS_PER_STEP`` times each in the step (``ledger``), and note what each holds after;
    the nodes to send the phase to — all but those behind that were not caught up (they sit
    the phase out, and may start again at the next) — the log of every part, and the
    findings."""
    late = behind(codebook, participants.versions, nodes, dtype)
    findings = {
        node: f"behind again after completing a catch-up in step {step + 1}"
        for node in late
        if node in ledger.completed
    }
    sending = [node for node in late if ledger.started[node] < CATCH_UPS_PER_STEP]
    for node in set(late) - set(sending):
        findings[node] = f"refused a catch-up: {CATCH_UPS_PER_STEP} already in step {step + 1}"
    ledger.started.update(sending)
    caught, exchanges = (
        send(grid, codebook, sending, step, dtype, sites, timeout) if sending else (set(), [])
    )
    for node in sending:
        participants.set_version(node, codebook.version if node in caught else None)
    ledger.completed |= caught
    for entry in exchanges:
        if entry.failed:
            findings.setdefault(entry.node_id, f"failed its catch-up at part {entry.round + 1}")
    left = set(late) - caught
    return CaughtUp([node for node in nodes if node not in left], exchanges, findings)


def send(
    grid: SiteGrid,
    codebook: Codebook,
    nodes: Sequence[int],
    step: int,
    dtype: str,
    sites: Mapping[int, str],
    timeout: float,
) -> tuple[set[int], list[Exchange]]:
    """Send ``codebook`` in parts to ``nodes``, its lineage in its metadata and in each part's
    message config (``message_config``, round = part); the nodes that now hold it, and the log
    entry of every part sent (phase ``catch_up``)."""
    config = message_config(step, 0, codebook, dtype)
    lineage = Lineage.of(codebook).as_metadata()
    plan = parts.plan(replace(codebook, metadata=lineage), dtype)
    count = len(plan.parts)
    pending, logs = list(nodes), []
    for index in range(count):
        if not pending:
            break
        data = plan.encoded(index)
        message = {**config, ROUND: index, CATCH_UP: [index, count, len(codebook)]}
        good, exchanges = exchange(
            grid,
            CATCH_UP_MESSAGE,
            CATCH_UP_KEY,
            step,
            index,
            message,
            pending,
            sites,
            _constant(data),
            timeout,
        )
        if index == count - 1:
            for entry, reply in good:
                raw = reply.content[HELD][RECORD_DATA] if HELD in reply.content else b""
                said = raw if isinstance(raw, bytes) else b""  # anything else: rejected
                if said != str(codebook.version).encode():
                    reject(
                        entry,
                        f"holds {said[:20]!r} after the last part, not version {codebook.version}",
                    )
        logs += exchanges
        pending = [entry.node_id for entry in exchanges if not entry.failed]
    return set(pending), logs


def _constant(data: bytes) -> Callable[[int], bytes]:
    """The same part for every node."""
    return lambda node: data
