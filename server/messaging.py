"""Messages to sites: one phase sent to every participating node, and what came back.

Every send has a timeout; error replies and missing replies are recorded per node with the phase
(``Exchange``), and the phase goes on with the others. Replies are pulled after short, growing
waits rather than Flower's fixed 3 s (docs/benchmarks.md). What a reply says is read by the
next stage (``server.decode``).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from flwr.app import ConfigRecord, Message, RecordDict

from starfed.server.records import Exchange, ExchangeStatus, Outcome
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.protocol import (
    CODEBOOK_RECORD,
    CONFIG_RECORD,
    POLICY_REFUSED,
    RECORD_DATA,
    ROUND,
    STEP,
    WIRE_DTYPE,
    ConfigValue,
    reply_sha256,
)

logger = logging.getLogger(__name__)

PULL_WAITS_S = (0.05, 0.2)  # the first and the longest wait between two pulls of replies
#: Flower's own reasons begin so (e.g. "Error: Node Unavailable — ..." in Flower 1.42).
ERROR_PREFIX = re.compile(r"^error:\s*", re.IGNORECASE)


Reply = tuple[Exchange, Message]


class SiteGrid(Protocol):
    """What the coordinator asks of a grid: Flower's ``Grid``, or one that answers at once
    (``simulations/local_grid.py``, the tests' grids)."""

    def get_node_ids(self) -> Iterable[int]: ...

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]: ...


@runtime_checkable
class PushPullGrid(SiteGrid, Protocol):
    """A grid whose messages are pushed, and their replies pulled, apart (Flower's ``Grid``):
    its sites answer concurrently, so one exchange need not wait for another
    (``server.catch_up``'s streams)."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]: ...

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]: ...


def message_config(
    step: int, round_index: int, codebook: Codebook, wire_dtype: str
) -> dict[str, ConfigValue]:
    """The protocol's keys of every message's config: the step, the round, the wire dtype and
    the lineage of the codebook it answers to (a phase, the sync and the catch-up add theirs)."""
    return {
        STEP: step,
        ROUND: round_index,
        WIRE_DTYPE: wire_dtype,
        **Lineage.of(codebook).as_metadata(),
    }


def exchange(
    grid: SiteGrid,
    message_type: str,
    key: str,
    step: int,
    round_index: int,
    config: Mapping[str, ConfigValue] | Callable[[int], Mapping[str, ConfigValue]],
    nodes: Sequence[int],
    sites: Mapping[int, str],
    payload: Callable[[int], bytes] | None,
    timeout: float,
) -> tuple[list[Reply], list[Exchange]]:
    """Send one message, of Flower's ``message_type``, to ``nodes`` (with ``payload(node)``,
    the codebook or a part of it, when it carries one: none for a node it gives no bytes),
    logged under ``key`` (a phase's, or the catch-up's); ``config`` is the message's config,
    or each node's (``config(node)``: a sync some nodes get a travelling phase with). The good
    replies with their log entries, and every log entry."""
    record_of = _config_records(config)
    messages, exchanges = [], []
    for node in nodes:
        content = RecordDict({CONFIG_RECORD: record_of(node)})
        data = payload(node) if payload else b""
        if data:
            content[CODEBOOK_RECORD] = ConfigRecord({RECORD_DATA: data})
        group = f"{step}/{key}/{round_index}"
        messages.append(Message(content, node, message_type, group_id=group))
        site = sites.get(node, "")
        exchanges.append(Exchange(step, key, round_index, node, site, len(data)))
    replies = send_and_receive(grid, messages, timeout)
    # Grids fill in each message's id when they push it; replies point back to it.
    logs = {m.metadata.message_id: e for m, e in zip(messages, exchanges, strict=True)}
    good, answered = [], set()
    for reply in replies:
        entry = logs.get(reply.metadata.reply_to_message_id)
        if entry is None:
            logger.warning("reply to an unknown message from node %s", reply.metadata.src_node_id)
            continue
        answered.add(entry.node_id)
        if reply.has_error():
            note_error(entry, reply.error.reason)
            continue
        entry.bytes_up = content_bytes(reply.content)
        entry.reply_sha256 = reply_sha256(
            (name, value)
            for name, record in reply.content.items()
            for value in record.values()
            if isinstance(value, bytes)
        )
        good.append((entry, reply))
    for entry in exchanges:
        if entry.node_id not in answered:
            entry.status = ExchangeStatus(Outcome.NO_REPLY)
            logger.warning("%s sent no %s reply within %.0fs", who(entry), key, timeout)
    return good, exchanges


def _config_records(
    config: Mapping[str, ConfigValue] | Callable[[int], Mapping[str, ConfigValue]],
) -> Callable[[int], ConfigRecord]:
    """Each node's config record: one shared by all, or each node's own."""
    if callable(config):
        return lambda node: ConfigRecord(dict(config(node)))
    record = ConfigRecord(dict(config))
    return lambda node: record


def send_and_receive(grid: SiteGrid, messages: list[Message], timeout: float) -> list[Message]:
    """Push the messages, then pull replies after short, growing waits until all came or
    ``timeout`` passed. Flower's ``Grid.send_and_receive`` sleeps 3 s between pulls, which a
    deployed step would pay in every phase (docs/benchmarks.md). Grids without push/pull (test
    grids that answer at once) use their own ``send_and_receive``."""
    if not isinstance(grid, PushPullGrid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = set(grid.push_messages(messages))
    replies: list[Message] = []
    wait, deadline = PULL_WAITS_S[0], time.monotonic() + timeout
    while pending:
        pulled = list(grid.pull_messages(pending))
        replies.extend(pulled)
        pending -= {reply.metadata.reply_to_message_id for reply in pulled}
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(wait)
        wait = min(wait * 1.5, PULL_WAITS_S[1])
    return replies


def note_error(entry: Exchange, reason: str | None) -> None:
    """Record an error reply: a refusal by the site's policy (``POLICY_REFUSED``: an answer,
    with its reason), or a failure."""
    text = short_reason(reason)
    _, refused, why = text.partition(f"{POLICY_REFUSED}: ")
    if refused:
        why = why.removesuffix("'>").removesuffix('">')  # Flower's "<class ...>:<'text'>"
        entry.status = ExchangeStatus(Outcome.REFUSED, f"{POLICY_REFUSED}: {why}")
        logger.info("%s refused %s: %s", who(entry), entry.phase, why)
        return
    entry.status = ExchangeStatus(Outcome.ERROR, text)
    logger.warning("%s failed %s: %s", who(entry), entry.phase, reason)


def reject(entry: Exchange, reason: str) -> None:
    entry.status = ExchangeStatus(Outcome.REJECTED, reason)
    logger.warning("rejected %s reply of %s: %s", entry.phase, who(entry), reason)


def who(entry: Exchange) -> str:
    """A site by its name once it has told it (its sync), else by its node id: the
    spelling of the step's records and of ``starfed server status``."""
    return entry.site or f"node-{entry.node_id}"


def short_reason(reason: str | None, limit: int = 300) -> str:
    """The informative line of an error reason (runtimes wrap a traceback around it), without
    the "Error: " Flower starts its own reasons with: the status already says ``error:``."""
    lines = [line.strip() for line in (reason or "").splitlines() if line.strip()]
    fallback = lines[-1] if lines else ""
    line = next((line for line in reversed(lines) if "Message:" in line), fallback)
    return ERROR_PREFIX.sub("", line)[:limit]


def content_bytes(content: RecordDict) -> int:
    """Payload bytes of a reply: serialised updates count fully, other records by their values."""
    return sum(record_size(record) for record in content.values())


def record_size(record: Mapping[str, object]) -> int:
    """Payload bytes of one record of a reply (``content_bytes``)."""
    return sum(len(v) if isinstance(v, bytes) else len(str(v).encode()) for v in record.values())
