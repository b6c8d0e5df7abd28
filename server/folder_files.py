"""The federation folder's files: their names, the folder's identity, and each record file's
reader and writer, which need no ``Federation`` (``server.folder_check`` and ``folder_repair``
work on damaged folders): the registry, the history, the quarantine, the step's findings (the
change scale's are ``server.change_scale``'s). The folder holds::


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
    history.jsonl     one ``StepRecord`` per finished step: status, phases, participation,
                      screening findings, scores (written and read here only)
    step-end.json     the record of a step being closed, between its commit and its history
                      line (the next run finishes an interrupted close)
    lock.json         the run that writes the folder now (``server.folder_lock``)
    change-scale.json the scale of honest changes per field over completed steps, the
                      reference of a lone sender's bound (``server.change_scale``)
    quarantine.json   sites kept out of later steps (``quarantine-persists``; the operator
                      deletes an entry to let a site back in)
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from starfed.server.records import (
    Exchange,
    ExportRecord,
    Finding,
    Registration,
    StepRecord,
    Withdrawal,
)
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


def read_registry(root: Path) -> dict[str, Registration]:
    """``registry.json`` of the federation folder ``root`` (none yet: empty); ``DamagedFile``
    when it does not read. The one reader: a run, ``check`` and ``repair`` alike."""
    path = root / REGISTRY_FILE
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
        return {name: Registration(**entry) for name, entry in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise DamagedFile(path, err) from None


def registry_bytes(registry: Mapping[str, Registration]) -> bytes:
    """``registry.json`` as ``read_registry`` reads it back."""
    return json.dumps({name: asdict(entry) for name, entry in registry.items()}, indent=2).encode()


def write_registry(root: Path, registry: Mapping[str, Registration]) -> None:
    write_atomic(root / REGISTRY_FILE, registry_bytes(registry))


def read_quarantine(root: Path) -> dict[str, dict]:
    """``quarantine.json``: sites kept out of later steps, site -> the step and reason that put
    it there (none yet: empty); ``DamagedFile`` when it is not site -> entry."""
    path = root / QUARANTINE_FILE
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as err:
        raise DamagedFile(path, err) from None
    values = entries.values() if isinstance(entries, dict) else [None]
    if not all(isinstance(v, dict) and isinstance(v.get("step"), int) for v in values):
        raise DamagedFile(path, "not site -> entry")
    return entries


def write_quarantine(root: Path, entries: Mapping[str, dict]) -> None:
    write_atomic(root / QUARANTINE_FILE, json.dumps(entries, indent=2).encode())


def write_history(root: Path, records: Sequence[StepRecord]) -> None:
    """``history.jsonl`` written anew with ``records`` (atomically)."""
    write_atomic(root / HISTORY_FILE, "".join(r.to_json() + "\n" for r in records).encode())


def append_history(root: Path, record: StepRecord) -> None:
    """One line more in ``history.jsonl`` (the file written anew, atomically)."""
    path = root / HISTORY_FILE
    lines = path.read_text() if path.is_file() else ""
    write_atomic(path, (lines + record.to_json() + "\n").encode())


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
class HistoryLines:
    """``history.jsonl`` line by line, as written: the records that read, in file order, and
    each damaged line (its 1-based number, why). The one reader: a run refuses a damaged line,
    ``check`` reports each, ``repair`` drops them."""

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


def read_step_findings(root: Path) -> tuple[int | None, list[Finding]]:
    """``step-findings.json`` of the federation folder ``root``: its step (None without the
    file) and findings. FederationError when it is damaged (``starfed server repair`` sets it
    aside)."""
    path = root / STEP_FINDINGS_FILE
    if not path.is_file():
        return None, []
    try:
        value = json.loads(path.read_text())
        return int(value["step"]), [Finding(**f) for f in value["findings"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FederationError(
            f"{path} is damaged ({err}); `starfed server repair` sets it aside (the step then "
            "goes on without the findings so far)"
        ) from None


def write_step_findings(root: Path, step: int, findings: Sequence[Finding]) -> None:
    """``step-findings.json``: what ``read_step_findings`` reads back."""
    value = {"step": step, "findings": [asdict(f) for f in findings]}
    write_atomic(root / STEP_FINDINGS_FILE, json.dumps(value, indent=1).encode())


def append_step_failures(root: Path, exchanges: Sequence[Exchange]) -> None:
    """Lines more in ``step-failures.jsonl``, appended and flushed as the exchanges end: a
    journal for people, so an append (not an atomic rewrite) is enough; a line a crash tore is
    skipped by the reader."""
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
