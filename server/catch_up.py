"""The catch-up: a codebook too large for one message, sent to the sites far behind in parts.

A phase's message carries each site the delta from the codebook version it holds, or the whole
codebook. Once the federation's codebook passes what one message may carry
(``starfed.shared.codebook.parts.PART_BYTES``), a site that holds nothing recent — one joining
late, one that lost its state — could not receive it at all. So before a codebook phase's
message the coordinator finds the nodes whose broadcast would pass a part (``behind``) and sends
them the codebook split by classes (``send``): one ``query.sync`` message per part, whose config
says which part it is (``CATCH_UP``), all behind nodes served part by part. A site stages the
parts and holds the codebook only after the last (``HeldCodebook.stage``); its last reply says
the version it now holds (``HELD``), and the phase's own message then carries the empty delta
from it. A node that fails a part (an error, no reply, a part refused) leaves the catch-up and
sits that phase out; the next phase starts its catch-up again from the first part, so a site
that went away mid-way costs only a restart. The server encodes one part at a time.

Costs: a catch-up sends the broadcast's bytes once per behind node, in ⌈bytes / PART_BYTES⌉
messages; deciding who is behind is one pass over the classes' versions per phase.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from starfed.server.messaging import SiteGrid, exchange, message_config, reject
from starfed.server.participants import Participants
from starfed.server.records import Exchange
from starfed.shared.codebook import parts
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.protocol import (
    CATCH_UP,
    CATCH_UP_KEY,
    HELD,
    RECORD_DATA,
    ROUND,
    SYNC,
)


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
) -> tuple[list[int], list[Exchange]]:
    """Catch up the ``nodes`` of a phase that are ``behind`` (``send``), and note what each
    holds after; the nodes to send the phase to — all but those that failed a part (they sit
    the phase out, and start their catch-up again at the next) — and the log of every part."""
    late = behind(codebook, participants.versions, nodes, dtype)
    if not late:
        return list(nodes), []
    caught, exchanges = send(grid, codebook, late, step, dtype, sites, timeout)
    for node in late:
        participants.set_version(node, codebook.version if node in caught else None)
    left = set(late) - caught
    return [node for node in nodes if node not in left], exchanges


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
            grid, SYNC, step, index, message, pending, sites, _constant(data), timeout
        )
        for entry in exchanges:
            entry.phase = CATCH_UP_KEY
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
