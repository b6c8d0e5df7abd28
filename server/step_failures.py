"""``step-failures.jsonl``: the step in progress's failed and refused exchanges, a line each as
they end, for ``starfed server status`` while the step runs. A journal for people: appended,
not rewritten atomically, and nothing is resumed from it (the step's record keeps every
exchange when it ends)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path

from starfed.server.folder_files import STEP_FAILURES_FILE
from starfed.server.records import Exchange


def append_step_failures(root: Path, exchanges: Sequence[Exchange]) -> None:
    """Lines more in ``step-failures.jsonl``, appended and flushed as the exchanges end; a line
    a crash tore is skipped by the reader."""
    if exchanges:
        with (root / STEP_FAILURES_FILE).open("a") as out:
            out.writelines(json.dumps(e.to_json()) + "\n" for e in exchanges)


def read_step_failures(root: Path, step: int) -> list[Exchange]:
    """The exchanges of ``step`` that ``append_step_failures`` journaled; lines that do not
    read (torn by a crash, damaged) are skipped: the step's record is the account that counts."""
    path = root / STEP_FAILURES_FILE
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = Exchange.from_json(json.loads(line))
            except (ValueError, TypeError, KeyError):
                continue
            if entry.step == step:
                found.append(entry)
    return found
