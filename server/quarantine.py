"""``quarantine.json``: the sites kept out of later steps (``quarantine-persists``, a
withdrawal), each with the step and reason that put it there. The operator deletes an entry to
let a site back in, so the reader asks of an entry only its step."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starfed.server.folder_files import QUARANTINE_FILE, DamagedFile
from starfed.shared.files import write_atomic


@dataclass(frozen=True)
class Quarantined:
    """Why one site is kept out: the step that quarantined it (0-based), when, and why."""

    step: int
    since: str = ""
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "since": self.since, "reason": self.reason}

    @classmethod
    def from_json(cls, raw: object) -> Quarantined:
        """The entry ``raw`` writes (ValueError: not an object with an integer step)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("step"), int):
            raise ValueError("not site -> entry")
        return cls(raw["step"], str(raw.get("since", "")), str(raw.get("reason", "")))

    def line(self) -> str:
        """``quarantined since step 3: <reason>`` (the step 1-based, as pages say it)."""
        return f"quarantined since step {self.step + 1}: {self.reason}"


def read_quarantine(root: Path) -> dict[str, Quarantined]:
    """``quarantine.json`` of the federation folder ``root``: site -> entry (none yet: empty);
    ``DamagedFile`` when it is not site -> entry."""
    path = root / QUARANTINE_FILE
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as err:
        raise DamagedFile(path, err) from None
    try:
        if not isinstance(entries, dict):
            raise ValueError("not site -> entry")
        return {str(site): Quarantined.from_json(entry) for site, entry in entries.items()}
    except ValueError as err:
        raise DamagedFile(path, err) from None


def write_quarantine(root: Path, entries: Mapping[str, Quarantined]) -> None:
    value = {site: entry.to_json() for site, entry in entries.items()}
    write_atomic(root / QUARANTINE_FILE, json.dumps(value, indent=2).encode())
