"""The federation folder's files: their names, the folder's identity, and the withdrawals' and
exports' logs. Each other record file has its own reader and writer, which need no
``Federation`` (``server.folder_check`` and ``folder_repair`` work on damaged folders):
``server.registry``, ``server.history``, ``server.quarantine``, ``server.step_findings``,
``server.step_failures``, ``server.change_scale``. The folder holds::


    federation.json   its identity: id, creation time, backbone fingerprint and dims
    codebook.bin      the manifest of the codebook with mixtures after the last completed phase
                      (``shared.codebook.store_layout``), and in its metadata the protocol position
                      (the step, its completed phases, the classes in play): one small atomic
                      file, so a checkpoint is never half written
    codebook-store/   the codebooks' bytes: bases and the records of what each save changed,
                      shared by the manifests (a save writes what changed, ``store_io``)
    previous.bin      the checkpoint before the current one (the last good one beside it)
    step-start.bin    the codebook when the step in progress started (a failed step rolls back)
    checkpoints/      the codebook after each completed step, ``step-NNNN.bin`` (1-based), the
                      newest ``checkpoints-kept`` of them (0: all): what ``repair`` rolls back to
                      (every ``.bin`` here is a manifest; a folder written before the store had
                      whole codebooks there, moved into the store once, ``Federation.migrate``)
    registry.json     every class: the step that registered it, the sites that brought it, when
                      (``server.registry``)
    history.jsonl     one ``StepRecord`` per finished step: status, phases, participation,
                      screening findings, scores (``server.history``)
    step-end.json     the record of a step being closed, between its commit and its history
                      line (the next run finishes an interrupted close)
    lock.json         the run that writes the folder now (``server.folder_lock``)
    change-scale.json the scale of honest changes per field over completed steps, the
                      reference of a lone sender's bound (``server.change_scale``)
    quarantine.json   sites kept out of later steps (``quarantine-persists``; the operator
                      deletes an entry to let a site back in; ``server.quarantine``)
    step-findings.json  the screening's findings in the step in progress, written ahead of each
                      of its checkpoints: a resumed step keeps those of the phases it had done
    step-failures.jsonl the step in progress's failed and refused exchanges, a line each as they
                      happen, for `server status` while the step runs (the step's record keeps
                      them all when it ends; nothing is resumed from this file)
    metrics.json      the federation's scores after the last server run (``server.app``)
    contributions.bin the manifest of each site's last rows per class (``server.contributions``),
                      written ahead of each phase's checkpoint: what a withdrawal re-merges from
    withdrawals.jsonl one ``Withdrawal`` per site that left (``server.withdrawal``)
    exports.jsonl     one ``ExportRecord`` per ``starfed server export``: where, when, which classes
    withdrawal.json   the record of a withdrawal being made, between its commit and its line
                      in withdrawals.jsonl (``Federation.recover`` finishes or drops it)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from starfed.server.records import ExportRecord, Withdrawal
from starfed.shared.codebook import store_layout
from starfed.shared.codebook.framing import CodebookError, read_message
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic
from starfed.shared.progress import counted

IDENTITY_FILE = "federation.json"
CODEBOOK_FILE = "codebook.bin"
STEP_START_FILE = "step-start.bin"
PREVIOUS_FILE = "previous.bin"
CHECKPOINTS_DIR = "checkpoints"
PENDING_FILE = "step-end.json"
STEP_FINDINGS_FILE = "step-findings.json"
STEP_FAILURES_FILE = "step-failures.jsonl"
REGISTRY_FILE = "registry.json"
HISTORY_FILE = "history.jsonl"
METRICS_FILE = "metrics.json"
QUARANTINE_FILE = "quarantine.json"
CONTRIBUTIONS_FILE = "contributions.bin"
WITHDRAWALS_FILE = "withdrawals.jsonl"
WITHDRAWING_FILE = "withdrawal.json"
EXPORTS_FILE = "exports.jsonl"


class FederationError(ValueError):
    """A federation folder that cannot be used (other backbones, damaged files)."""


class DamagedFile(FederationError):
    """A file of the folder that does not read: its path and why (``why``, for a line that
    names the file itself)."""

    def __init__(self, path: Path, why: Exception | str) -> None:
        super().__init__(f"{path} is damaged: {why}")
        self.why = str(why)


def read_withdrawals(root: Path) -> list[Withdrawal]:
    """``withdrawals.jsonl``: the sites that left, oldest first; ``DamagedFile`` when a line
    does not read."""
    path = root / WITHDRAWALS_FILE
    try:
        text = path.read_text() if path.is_file() else ""
        return [Withdrawal.from_json(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DamagedFile(path, err) from None


def append_withdrawal(root: Path, record: Withdrawal) -> None:
    """One line more in ``withdrawals.jsonl`` (the file written anew, atomically), unless the
    withdrawal is there already."""
    kept = read_withdrawals(root)
    if any(w.id == record.id for w in kept):
        return
    lines = "".join(w.to_json() + "\n" for w in [*kept, record])
    write_atomic(root / WITHDRAWALS_FILE, lines.encode())


def read_exports(root: Path) -> list[ExportRecord]:
    """``exports.jsonl``: the codebooks exported, oldest first (lines that do not read are
    left out: a lost line only hides an export from a withdrawal's list)."""
    path = root / EXPORTS_FILE
    text = path.read_text(errors="replace") if path.is_file() else ""
    found = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            found.append(ExportRecord.from_json(line))
    return found


def append_export(root: Path, record: ExportRecord) -> None:
    """One line more in ``exports.jsonl``, appended (an export does not lock the folder)."""
    with open(root / EXPORTS_FILE, "a") as file:
        file.write(record.to_json() + "\n")


@dataclass(frozen=True)
class Identity:
    """What ``federation.json`` says of a folder: enough to read and check its codebook files
    without the rest (``server.folder_check`` and ``folder_repair`` work on damaged folders)."""

    root: Path
    fingerprint: str
    dims: ModelDims

    @classmethod
    def read(cls, root: str | Path) -> Identity:
        path = Path(root).expanduser()
        if not (path / IDENTITY_FILE).is_file():
            raise FederationError(f"{path} is not a federation folder (no {IDENTITY_FILE})")
        try:
            identity = json.loads((path / IDENTITY_FILE).read_text())
            return cls(path, identity["fingerprint"], ModelDims(**identity["dims"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise FederationError(f"{path / IDENTITY_FILE} is damaged: {err!r}") from None

    def traces(self) -> str:
        """What shows that the folder has completed work ("" for a new federation, or one that
        crashed before its first checkpoint): a codebook must exist then."""
        history = self.root / HISTORY_FILE
        found = [HISTORY_FILE] if history.is_file() and history.read_text().strip() else []
        found += [PREVIOUS_FILE] if (self.root / PREVIOUS_FILE).is_file() else []
        found += [f"{CHECKPOINTS_DIR}/"] if self.step_checkpoints() else []
        return ", ".join(found)

    def step_checkpoints(self) -> list[tuple[int, Path]]:
        """(steps completed, file) of the codebooks kept after completed steps, oldest first."""
        folder = self.root / CHECKPOINTS_DIR
        found = []
        for path in folder.glob("step-*.bin") if folder.is_dir() else ():
            with contextlib.suppress(ValueError):
                found.append((int(path.stem.removeprefix("step-")), path))
        return sorted(found)

    def kept_codebooks(self) -> list[Path]:
        """The codebooks kept to go back to: ``previous.bin`` (the one before the last
        checkpoint) where there is one, then those after completed steps, oldest first."""
        previous = [self.root / PREVIOUS_FILE] if (self.root / PREVIOUS_FILE).exists() else []
        return previous + [path for _, path in self.step_checkpoints()]

    def manifests(self) -> list[Path]:
        """The codebook files a run writes (each a manifest once the folder is migrated)."""
        names = (CODEBOOK_FILE, PREVIOUS_FILE, STEP_START_FILE, CONTRIBUTIONS_FILE)
        return [self.root / n for n in names if (self.root / n).is_file()] + [
            path for _, path in self.step_checkpoints()
        ]

    def temporary_files(self) -> list[Path]:
        """What a write killed before its rename left (``write_atomic``'s ``.<name>.*.tmp``:
        a whole codebook, for a new base): in the folder, its store and ``checkpoints/``. No
        reader reads them; a run removes them under the lock (``Federation.recover``), ``check``
        lists them."""
        folders = (self.root, self.root / store_layout.STORE_DIR, self.root / CHECKPOINTS_DIR)
        return sorted(path for folder in folders for path in folder.glob(".*.tmp"))

    def kept_copies(self) -> list[Path]:
        """The manifests ``repair`` kept beside (``<name>.before-repair-<time>``)."""
        return sorted(self.root.glob("*.bin.before-repair-*"))


def is_manifest(path: Path) -> bool:
    """Whether ``path`` reads as a manifest (a damaged file is left to ``check``/``repair``)."""
    try:
        return store_layout.Ref.of(read_message(path).metadata) is not None
    except (CodebookError, OSError):
        return True


def temporaries(paths: Sequence[Path], root: Path) -> str:
    """``2 temporary files (41.9 MB: codebook-store/.base-….tmp, …)``: what
    ``Identity.temporary_files`` found, for a line of ``check``, ``repair`` or a run."""
    size = 0
    for path in paths:
        with contextlib.suppress(OSError):  # gone meanwhile: nothing to count
            size += path.stat().st_size
    shown = [str(path.relative_to(root)) for path in paths[:2]]
    names = ", ".join(shown + ["…"] * (len(paths) > 2))
    return f"{counted(len(paths), 'temporary file')} ({size / 1e6:.1f} MB: {names})"


def copy_atomic(source: Path, target: Path) -> None:
    """``target`` becomes a copy of ``source`` (a copy, not a hard link: damage to one file's
    bytes in place must not reach the other)."""
    write_atomic(target, source.read_bytes())
