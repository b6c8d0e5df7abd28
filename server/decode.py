"""The decode stage of a phase: its replies read as typed updates (= validated), bad ones rejected.

Every update is decoded against the codebook its message carried (``wire.decode_update``); one
that does not decode is rejected (its ``Exchange`` says why), never half-applied. A decoded
update's tensors are views of its reply's bytes, so the phase holds a few objects per tensor, not
a copy (``without_cyclic_gc``). What the updates are worth is the screening's
(``server.field_bounds``, ``server.screening``), the next stage.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections.abc import Iterator

from starfed.server.messaging import Reply, reject, who
from starfed.server.records import Exchange, ExchangeStatus, Outcome
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError
from starfed.shared.protocol import (
    BUDGET_EXHAUSTED,
    PRIVACY_EPSILON,
    RECORD_DATA,
    REPORT_RECORD,
    UPDATE_RECORD,
    Phase,
    record_bytes,
)
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)

Decoded = tuple[Exchange, ClientUpdate]  # an update and the log entry of the reply it came in


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a phase's updates are decoded and held:
    each holds a few objects per tensor (140 for 35 classes at stage 2) and none is part of a
    cycle, but every collection walks all of them again — at 1000 sites that cost more than the
    decoding (docs/benchmarks.md#server-merge-at-scale-benchmerge_scalepy)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def updates(
    replies: list[Reply],
    phase: Phase,
    against: Codebook,
    max_entries: int,
    record: str = UPDATE_RECORD,
) -> list[Decoded]:
    """Each valid update (the replies' ``record``) decoded against the codebook the phase was
    sent with (``against``: the message it travelled with), with at most ``max_entries``
    entries (``Screen.max_entries``); bad ones rejected. In the order of site names: merge
    order changes float rounding and the k-means of pooled mixtures, so it is the same from run
    to run and whatever message carried an update — not node id order (random per run) nor
    arrival (site names are unique in a step: the screening refuses a second sync under one)."""
    decoded = []
    with without_cyclic_gc():
        for entry, reply in sorted(replies, key=lambda r: (r[0].site, r[0].node_id)):
            try:
                data = record_bytes(reply.content[record][RECORD_DATA], record)
                update = wire.decode_update(
                    data, against=against, phase=phase, max_entries=max_entries
                )
                note_privacy(entry, update)
            except (CodebookError, KeyError, TypeError, ValueError) as err:
                reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
                continue
            decoded.append((entry, update))
    return decoded


def reports(
    replies: list[Reply], codebook: Codebook, record: str = REPORT_RECORD
) -> list[tuple[Exchange, EvaluationReport]]:
    """The valid evaluation reports (the replies' ``record``: one that travelled with a sync is
    named after its phase), with their log entries, in the order they came."""
    decoded = []
    for entry, reply in replies:
        try:
            data = record_bytes(reply.content[record][RECORD_DATA], record)
            report = EvaluationReport.from_bytes(data, against=codebook)
        except (CodebookError, KeyError, TypeError) as err:
            reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
            continue
        decoded.append((entry, report))
    return decoded


def refused_classes(update: ClientUpdate) -> list[str]:
    """The classes a private site refused to share in ``update``: their budget is exhausted."""
    return [name for name in update.metadata.get(BUDGET_EXHAUSTED, "").split(",") if name]


def note_privacy(entry: Exchange, update: ClientUpdate) -> None:
    """Record a private site's ε and its refusals on its log entry (ValueError: a malformed
    ε, rejected as a malformed reply)."""
    if PRIVACY_EPSILON in update.metadata:
        epsilon = float(update.metadata[PRIVACY_EPSILON])
        if not math.isfinite(epsilon) or epsilon < 0:
            raise ValueError(f"privacy epsilon {epsilon!r}")
        entry.epsilon = epsilon
    refused = refused_classes(update)
    if refused:
        why = f"privacy budget exhausted for {', '.join(refused)}"
        entry.status = ExchangeStatus(Outcome.REFUSED, why)
        logger.info("%s refused %s: %s", who(entry), entry.phase, entry.status)


def malformed(err: Exception) -> str:
    return f"malformed reply ({err})"
