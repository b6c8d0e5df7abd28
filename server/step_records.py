"""What a server run and its steps leave behind: the run's log, a step's history record, and the
words for why a phase failed.

The coordinator (``server.coordinator``) drives a step; here is what it writes of one: the
``StepRecord`` of ``history.jsonl`` (its exchanges, phase times, scores, the screening's
findings), the line of scores it prints, the reason of a failed phase — the class and site a
bad merge is blamed on (``blame``) or the screening's rejections (``no_update``) — and, for a
resumed step, which of the findings saved ahead of its checkpoints still hold
(``findings_kept``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from starfed.server.records import (
    Exchange,
    Finding,
    PhaseRound,
    PhaseTime,
    ReplayCost,
    StepRecord,
    StepScores,
    Taken,
)
from starfed.server.screening import Screen
from starfed.shared import progress
from starfed.shared.codebook.codebook import CodebookError
from starfed.shared.protocol import Phase
from starfed.shared.run_status import COMPLETED, DEGRADED, FAILED

#: The level of a run's last line, by how the run ended (completed: INFO).
RUN_END_LEVELS: dict[str, int] = {FAILED: logging.ERROR, DEGRADED: logging.WARNING}


class StepFailed(RuntimeError):
    """A phase in which no class in play got an update: the step cannot finish."""


@dataclass
class RunLog:
    """What one server run did."""

    steps: list[StepRecord] = field(default_factory=list)  # the records it wrote to the history
    exchanges: list[Exchange] = field(default_factory=list)
    status: str = COMPLETED
    reason: str = ""

    def settle(self) -> None:
        """The run's status from its steps': failed if one failed (with its reason), else
        degraded if one was."""
        statuses = {record.status for record in self.steps} | {self.status}
        if FAILED in statuses:
            self.status = FAILED
            failed = (r.reason for r in self.steps if r.status == FAILED)
            self.reason = next(failed, self.reason)
        elif DEGRADED in statuses:
            self.status = DEGRADED

    def end_without_step(self, exchanges: Sequence[Exchange]) -> str:
        """The sync found nothing in play: the run is over — unless sites failed to
        answer, which says nothing about what they hold (all failed: the run failed; some:
        degraded). The line to log (at the level ``status`` calls for)."""
        failed = [e for e in exchanges if e.failed]
        if failed and len(failed) == len(exchanges):
            self.status = FAILED
            self.reason = f"no site answered the sync ({failed[0].site}: {failed[0].status})"
            return self.reason
        if failed:
            self.status = DEGRADED
            return (
                f"{progress.counted(len(failed), 'site')} did not answer the sync; the "
                "others bring nothing new: the run is over"
            )
        return "no site brings a new class: the run is over"


@dataclass
class StepTally:
    """What a step did so far besides its codebook: what was exchanged with whom, how long each
    phase took, and what the sites' evaluation scored."""

    started: float = field(default_factory=time.time)
    exchanges: list[Exchange] = field(default_factory=list)
    seconds: list[PhaseTime] = field(default_factory=list)
    replays: list[ReplayCost] = field(default_factory=list)
    scores: StepScores | None = None
    taken: tuple[Taken, ...] = ()  # what the step's new classes took (``server.taken``)


def step_record(
    step: int,
    status: str,
    reason: str,
    attempt: int,
    tally: StepTally,
    *,
    classes: Sequence[str],
    sites: Iterable[str],
    version: int,
    screen: Screen,
    server_eval: StepScores | None,
) -> StepRecord:
    """The step's line of the history."""
    return StepRecord(
        step=step,
        status=status,
        started=tally.started,
        wall_s=time.time() - tally.started,
        attempt=attempt,
        reason=reason,
        classes=tuple(classes),
        sites=tuple(sorted(set(sites))),
        phase_seconds=tuple(tally.seconds),
        exchanges=tuple(tally.exchanges),
        codebook_version=version,
        scores=tally.scores,
        server_eval=server_eval,
        findings=tuple(screen.findings),
        quarantined=tuple(screen.quarantined),
        replays=tuple(tally.replays),
        taken=tally.taken,
    )


def scores_line(step: int, classes: int, scores: StepScores) -> str:
    """The line a step's evaluation prints: the federation's accuracy by arrival step."""
    row = " ".join("—" if math.isnan(a) else f"{a:.0f}" for a in scores.accuracy)
    untested = "  (—: no test images)" if "—" in row else ""
    return (
        f"step {step + 1}: {progress.counted(classes, 'class')} · "
        f"federation accuracy {scores.mean_accuracy:.1f}% by arrival step: {row}{untested}"
    )


def no_update(phase: Phase, screen: Screen, in_play: Iterable[str]) -> StepFailed:
    """The failure of a phase in which no class in play got an update: none arrived, or the
    screening rejected every one (then the first three are named)."""
    key, names = phase.key, set(in_play)
    rejected = [f for f in screen.findings if f.phase == key and f.name in names]
    if rejected:  # they arrived, and the screening rejected them all
        named = "; ".join(f"class {f.name!r}: {f.site} ({f.reason})" for f in rejected[:3])
        return StepFailed(
            f"the screening rejected every {key} update of the classes in play: {named}"
        )
    return StepFailed(f"no site's {key} update arrived for any class in play")


def blame(phase: Phase, err: CodebookError, screen: Screen) -> str:
    """Why a phase's result cannot be kept: the class and field, and the site whose kept
    update to that class went furthest this step (``Screen.furthest``: an update passes
    validation on its own; what overflows is what the merge or the replay made of it)."""
    name, field_name = getattr(err, "name", None), getattr(err, "field", None)
    where = f"class {name!r}, field {field_name}" if name else "its codebook"
    detail = str(err).removeprefix(f"{name}/{field_name}: ")
    furthest = screen.furthest.get(name) if name else None
    source = (
        ""
        if furthest is None
        else (f"; the furthest update to it came from site {furthest.site} ({furthest.what})")
    )
    return f"the {phase.key} result is invalid at {where}: {detail}{source}"


def findings_kept(findings: Iterable[Finding], not_repeated: set[PhaseRound]) -> list[Finding]:
    """Of the findings saved ahead of a resumed step's checkpoints, those of the phases it does
    not repeat (``not_repeated``: its position's marks)."""
    return [f for f in findings if PhaseRound(f.phase, f.round) in not_repeated]
