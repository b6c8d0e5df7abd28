"""``step-findings.json``: the screening's findings in the step in progress, written ahead of
each of its checkpoints, so that a resumed step keeps those of the phases it had done (the
step's record keeps them all once it ends)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from starfed.server.folder_files import STEP_FINDINGS_FILE, FederationError
from starfed.server.records import Finding
from starfed.shared.files import write_atomic


def read_step_findings(root: Path) -> tuple[int | None, list[Finding]]:
    """``step-findings.json`` of the federation folder ``root``: its step (None without the
    file) and findings. FederationError when it is damaged (``starfed server repair`` sets it
    aside)."""
    path = root / STEP_FINDINGS_FILE
    if not path.is_file():
        return None, []
    try:
        value = json.loads(path.read_text())
        return int(value["step"]), [Finding.from_json(f) for f in value["findings"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FederationError(
            f"{path} is damaged ({err}); `starfed server repair` sets it aside (the step then "
            "goes on without the findings so far)"
        ) from None


def write_step_findings(root: Path, step: int, findings: Sequence[Finding]) -> None:
    """``step-findings.json``: what ``read_step_findings`` reads back."""
    value = {"step": step, "findings": [f.to_json() for f in findings]}
    write_atomic(root / STEP_FINDINGS_FILE, json.dumps(value, indent=1).encode())
