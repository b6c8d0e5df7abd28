"""How a federation step, and a run of steps, ended: one word each, read by the server that
writes it (``history.jsonl``, ``metrics.json``) and by the operations that turn it into an exit
code (``starfed.ops.exit_codes``), so it lives below both."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """A step's or a run's status, written as its value."""

    COMPLETED = "completed"
    DEGRADED = "degraded"  # finished while some site failed or was rejected
    FAILED = "failed"


COMPLETED, DEGRADED, FAILED = RunStatus.COMPLETED, RunStatus.DEGRADED, RunStatus.FAILED
