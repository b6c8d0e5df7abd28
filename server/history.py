"""``history.jsonl``: one ``StepRecord`` a line per finished step (and failed attempt), in the
order written. The one reader (``HistoryLines``): a run refuses a damaged line, ``check``
reports each, ``repair`` drops them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from starfed.server.folder_files import HISTORY_FILE
from starfed.server.records import StepRecord
from starfed.shared.files import write_atomic


@dataclass(frozen=True)
class HistoryLines:
    """``history.jsonl`` line by line, as written: the records that read, in file order, and
    each damaged line (its 1-based number, why)."""

    records: list[StepRecord]
    damaged: list[tuple[int, str]]

    @classmethod
    def read(cls, root: Path, errors: str = "strict") -> HistoryLines:
        """``OSError`` when the file cannot be read (``UnicodeDecodeError`` too, unless
        ``errors`` replaces what does not decode); no file: no lines."""
        path = root / HISTORY_FILE
        text = path.read_text(errors=errors) if path.is_file() else ""
        records, damaged = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append(StepRecord.from_json(line))
                except (ValueError, TypeError) as err:
                    damaged.append((number, str(err)))
        return cls(records, damaged)


def write_history(root: Path, records: Sequence[StepRecord]) -> None:
    """``history.jsonl`` written anew with ``records`` (atomically)."""
    write_atomic(root / HISTORY_FILE, "".join(r.to_json() + "\n" for r in records).encode())


def append_history(root: Path, record: StepRecord) -> None:
    """One line more in ``history.jsonl`` (the file written anew, atomically)."""
    path = root / HISTORY_FILE
    lines = path.read_text() if path.is_file() else ""
    write_atomic(path, (lines + record.to_json() + "\n").encode())
