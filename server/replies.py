"""A phase's replies decoded (= validated) and screened, one at a time, before a strategy sees them.

The coordinator (``server.coordinator``) hands each codebook phase's replies here: every update is
decoded against the codebook its message carried (a bad one is rejected, never half-applied),
stripped of rows of classes not in play, and screened (``server.screening``) in two passes over
the same decoded updates — the first measures every row, the second hands on what the screening
kept. An evaluation's reports are decoded and screened the same way. The cost is one decode per
reply and a few objects per tensor held between the passes (``screened``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Collection, Iterator

from starfed.server.messaging import Reply, malformed, note_privacy, refused_classes, reject
from starfed.server.records import Exchange
from starfed.server.screening import Screen
from starfed.server.strategy import PhaseState
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError
from starfed.shared.protocol import RECORD_DATA, REPORT_RECORD, UPDATE_RECORD, Phase, record_bytes
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)


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


def decoded(
    replies: list[Reply],
    phase: Phase,
    screen: Screen,
    against: Codebook,
    record: str = UPDATE_RECORD,
) -> Iterator[tuple[Exchange, ClientUpdate]]:
    """Decode (= validate) each update (the replies' ``record``) against the codebook the
    phase was sent with (``against``: the message it travelled with), one at a time; reject bad
    ones. A decoded update's tensors are views of its reply's bytes, so holding one costs a few
    objects per tensor, not a copy."""
    # Merge order changes float rounding and the k-means of pooled mixtures: merge in the
    # order of site names (unique in a step: the screening refuses a second sync under
    # one), the same from run to run and whatever message carried an update — not in node
    # id order (random per run) nor as they arrived.
    for entry, reply in sorted(replies, key=lambda r: (r[0].site, r[0].node_id)):
        try:
            data = record_bytes(reply.content[record][RECORD_DATA], record)
            bound = screen.max_entries(phase, against)
            update = wire.decode_update(data, against=against, phase=phase, max_entries=bound)
            note_privacy(entry, update)
        except (CodebookError, KeyError, TypeError, ValueError) as err:
            reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
            continue
        yield entry, update


def screened(
    replies: list[Reply],
    state: PhaseState,
    phase: Phase,
    screen: Screen,
    carried: set[str],
    *,
    against: Codebook,
    record: str = UPDATE_RECORD,
) -> Iterator[ClientUpdate]:
    """The phase's valid updates (``decoded``: the replies' ``record``, made from ``against``)
    without rows of classes not in play (``state.in_play``), screened (``server.screening``: a
    first pass measures every row, the second hands the screened updates on, in the same
    order); the classes they carry are added to ``carried`` as they go by. The decoded updates
    are held between the passes: their tensors are views of the replies' bytes, which the phase
    holds anyway, so that costs a few objects per update, not a copy — except with
    ``wire-dtype = "float16"``, whose rows are converted: then the phase holds their float32
    copies, twice the replies' bytes."""
    in_play: Collection[str] = set(state.in_play)
    phase_screen = screen.phase(phase, state.round, state.codebook)
    valid = []
    with without_cyclic_gc():
        for entry, update in decoded(replies, phase, screen, against, record):
            stray = [e.name for e in update.entries if e.name not in in_play]
            if stray:
                logger.info(
                    "node %s sent rows of classes not in play: %s", entry.node_id, stray[:10]
                )
                codebook = state.codebook  # one lookup per row: ``.frozen`` walks every class
                frozen = [n for n in stray if n in codebook and codebook[n].frozen]
                phase_screen.frozen_rows(entry.site, frozen)
            update = update.only(in_play)
            phase_screen.observe(entry.site, update)
            valid.append((entry, update))
    phase_screen.decide()
    for entry, update in valid:
        kept = phase_screen.apply(entry.site, update)
        if kept is None:
            continue
        carried.update(e.name for e in kept.entries)
        carried.update(refused_classes(update))  # answered: kept as they are
        yield kept


def reports(
    replies: list[Reply], codebook: Codebook, screen: Screen
) -> Iterator[tuple[str, EvaluationReport]]:
    """The valid evaluation reports, with their sites, one at a time."""
    for entry, reply in replies:
        try:
            data = record_bytes(reply.content[REPORT_RECORD][RECORD_DATA], REPORT_RECORD)
            report = EvaluationReport.from_bytes(data, against=codebook)
        except (CodebookError, KeyError, TypeError) as err:
            reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
            continue
        if screen.report(entry, report):
            yield entry.site, report
