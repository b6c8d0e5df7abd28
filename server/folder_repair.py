"""Roll a damaged federation folder back to a good state (``starfed server repair``).

What ``check`` (``server.folder_check``) finds damaged, ``repair`` plans to fix, and says so
line by line before it does anything (``--dry-run`` stops there): a damaged or missing codebook
restored from the kept checkpoint furthest along that decodes (``previous.bin`` or
``checkpoints/step-NNNN.bin``), or from the one the operator names (``--to STEP``: the codebook
after that many completed steps), on a new version line (sites then receive whole codebooks, as
after a failed step); the history rewritten to the records that agree with it (damaged lines,
duplicates and steps beyond it left out; an interrupted close's record added; a completed step
whose record is lost kept as a placeholder without scores); the registry aligned with the
codebook's classes. Every file it replaces is kept beside as ``<name>.before-repair-<UTC
time>``, so a repair loses nothing. It holds the folder's lock while it writes: never under a
running server.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from starfed.proto import codebook_pb2 as pb
from starfed.server import folder_lock
from starfed.server.federation import Federation
from starfed.server.folder_check import Depth, read_codebook_file
from starfed.server.folder_files import (
    CODEBOOK_FILE,
    CONTRIBUTIONS_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    PENDING_FILE,
    PREVIOUS_FILE,
    REGISTRY_FILE,
    STEP_FINDINGS_FILE,
    WITHDRAWING_FILE,
    DamagedFile,
    FederationError,
    Identity,
    temporaries,
)
from starfed.server.history import HistoryLines
from starfed.server.records import Position, StepRecord
from starfed.server.registry import Registration, read_registry, registry_bytes
from starfed.server.step_findings import read_step_findings
from starfed.shared.codebook import store_layout
from starfed.shared.codebook.framing import CodebookError, read_message
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.files import write_atomic
from starfed.shared.run_status import COMPLETED, DEGRADED, FAILED

FINISHED = (COMPLETED, DEGRADED)
LOST_RECORD = "its record was lost; restored by `starfed server repair` (scores unknown)"


@dataclass
class Action:
    """One change ``repair`` makes: what it says, and doing it."""

    what: str
    do: Callable[[], None]


@dataclass
class Plan:
    """The changes that make the folder whole, in order (none: nothing to repair)."""

    folder: Path
    actions: list[Action]
    position: Position  # where the federation stands after them


def plan(root: str | Path, to: int | None = None, *, depth: Depth = Depth.CHECKSUMS) -> Plan:
    """What ``repair`` would do to ``root``; ``to``: roll back to the codebook after that many
    completed steps (``checkpoints/step-NNNN.bin``); a codebook file is good when it reads to
    ``depth`` (``folder_check.Depth``: its checksums, or every tensor decoded).
    ``FederationError`` when no good state is left to go back to (the message says what was
    tried)."""
    root = Path(root).expanduser()
    identity = Identity.read(root)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    seen: dict = {}  # store pieces read so far (kept checkpoints share a base)

    def good(path: Path) -> pb.Codebook | None:
        """The file's message (a manifest: metadata and class lines) when it reads whole."""
        try:
            return read_codebook_file(identity, path, depth, seen)
        except (CodebookError, OSError):
            return None

    actions: list[Action] = []
    current = root / CODEBOOK_FILE
    kept = dict(identity.step_checkpoints())
    if to is not None:
        if to not in kept:
            have = ", ".join(map(str, sorted(kept))) or "none"
            raise FederationError(f"no kept codebook after step {to} (kept: {have})")
        sources = [kept[to]]
    elif (found := good(current)) is not None:
        sources = []
    else:
        sources = _by_progress(identity.kept_codebooks())
        found = None
    for source in sources:
        found = good(source)
        if found is not None:
            actions.append(_restore(root, source, found, stamp))
            break
    if found is None:
        if _finished_records(root):
            tried = ", ".join(str(s.relative_to(root)) for s in sources if s.exists())
            raise FederationError(
                f"{root}: no good codebook is left to go back to (tried {tried or 'none'})"
            )
        position, names = Position(), set()
        if current.exists():
            actions.append(
                _aside(root, CODEBOOK_FILE, stamp, "no step was completed: starts afresh")
            )
    else:
        position = Position.from_metadata(found.metadata)
        names = {entry.name for entry in found.entries}
    previous = root / PREVIOUS_FILE
    if previous.is_file() and good(previous) is None:  # it shared the damaged bytes
        actions.append(
            _aside(root, PREVIOUS_FILE, stamp, "damaged; the next checkpoint rewrites it")
        )
    actions += _history(root, position, stamp)
    actions += _registry(root, position, names, stamp)
    return Plan(root, actions + _side_files(root, stamp, good), position)


def _side_files(root: Path, stamp: str, good: Callable[[Path], pb.Codebook | None]) -> list[Action]:
    """The files beside the codebook and its records: a step's close written ahead (the
    history's repair handled it), damaged step findings, kept rows and metrics set aside, a
    withdrawal's close finished or dropped (``good``: a codebook file's message, None when it
    does not read whole)."""
    actions = []
    if (root / PENDING_FILE).exists():
        actions.append(
            Action(
                f"remove {PENDING_FILE} (handled above)",
                lambda: (root / PENDING_FILE).unlink(missing_ok=True),
            )
        )
    try:
        read_step_findings(root)
    except FederationError:
        actions.append(
            _aside(
                root,
                STEP_FINDINGS_FILE,
                stamp,
                "damaged; a resumed step goes on without the screening's findings so far",
            )
        )
    kept_rows = root / CONTRIBUTIONS_FILE
    if kept_rows.is_file() and good(kept_rows) is None:
        why = "damaged; an immediate withdrawal has no kept rows of earlier steps' classes"
        actions.append(_aside(root, CONTRIBUTIONS_FILE, stamp, why))
    if (root / WITHDRAWING_FILE).exists():

        def finish() -> None:
            Federation.open(root).recover_withdrawal()

        what = f"finish the interrupted withdrawal ({WITHDRAWING_FILE}) if committed, else drop it"
        actions.append(Action(what, finish))
    metrics = root / METRICS_FILE
    if metrics.is_file() and not _json_ok(metrics):
        actions.append(_aside(root, METRICS_FILE, stamp, "damaged; the next run rewrites it"))
    if found := Identity.read(root).temporary_files():
        actions.append(
            Action(
                f"remove {temporaries(found, root)} that killed writes left",
                lambda: _remove(found),
            )
        )
    return actions


def apply(repair: Plan) -> None:
    """Do the planned changes, holding the folder's lock (``FolderLocked`` under a run)."""
    with folder_lock.locked(repair.folder, "starfed server repair"):
        for action in repair.actions:
            action.do()


def _by_progress(paths: list[Path]) -> list[Path]:
    """The codebook files whose frame reads, furthest along the protocol first (a step's end
    before its phases; ``previous.bin`` may be mid-step, a kept step's codebook never is)."""
    found = []
    for path in paths:
        try:
            message = read_message(path)
            position = Position.from_metadata(message.metadata)
        except (CodebookError, OSError, ValueError, TypeError):
            continue
        found.append(
            ((position.step, not position.running, len(position.done), message.version), path)
        )
    return [path for _, path in sorted(found, reverse=True)]


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _json_ok(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _aside(root: Path, name: str, stamp: str, why: str) -> Action:
    """Move ``name`` aside (kept as ``<name>.before-repair-<stamp>``)."""
    path = root / name
    return Action(
        f"move {name} aside ({why}) as {path.name}.before-repair-{stamp}",
        lambda: os.replace(path, root / f"{name}.before-repair-{stamp}"),
    )


def _keep_copy(path: Path, stamp: str) -> None:
    if path.exists():
        write_atomic(path.with_name(f"{path.name}.before-repair-{stamp}"), path.read_bytes())


def _restore(root: Path, source: Path, message: pb.Codebook, stamp: str) -> Action:
    """``codebook.bin`` replaced by ``source``'s codebook on a new version line: a manifest
    naming the same store bytes (a whole file when ``source`` is one of the layout before)."""
    position = Position.from_metadata(message.metadata)
    where = (
        f"step {position.step + 1} running, {position.done_text() or 'no phase'} done"
        if position.running
        else f"{position.step} step(s) completed"
    )
    epoch = Lineage.in_metadata(message.metadata).new_epoch().as_metadata()
    metadata = {k: v for k, v in message.metadata.items() if k != store_layout.MANIFEST_KEY} | epoch

    def do() -> None:
        from starfed.shared.codebook import store_io, wire  # torch: writing codebooks

        _keep_copy(root / CODEBOOK_FILE, stamp)
        if store_layout.Ref.of(message.metadata) is None:
            codebook = wire.read_file(source)
            wire.write_file(root / CODEBOOK_FILE, replace(codebook, metadata=metadata))
        else:
            write_atomic(root / CODEBOOK_FILE, store_io.relabelled(message, metadata))

    name = source.relative_to(root)
    return Action(
        f"restore {CODEBOOK_FILE} from {name} (version {message.version}, {where}) "
        "on a new version line",
        do,
    )


def _finished_records(root: Path) -> bool:
    return any(r.status in FINISHED for r in HistoryLines.read(root, errors="replace").records)


def _pending(root: Path) -> StepRecord | None:
    try:
        return StepRecord.from_json((root / PENDING_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return None


def _history(root: Path, position: Position, stamp: str) -> list[Action]:
    """The records that agree with ``position``: each completed step once, failed attempts up
    to the current step; an interrupted close's record added when its commit happened."""
    lines = HistoryLines.read(root, errors="replace")
    records, damaged = lines.records, len(lines.damaged)
    pending = _pending(root)
    added = 0
    if pending is not None and not any(
        (r.step, r.attempt) == (pending.step, pending.attempt) for r in records
    ):
        committed = Position(pending.step if pending.status == FAILED else pending.step + 1)
        if position == committed:
            records.append(pending)
            added = 1
    kept: list[StepRecord] = []
    finished: set[int] = set()
    for record in records:
        if record.status in FINISHED:
            if record.step >= position.step or record.step in finished:
                continue
            finished.add(record.step)
        elif record.step > position.step:
            continue
        kept.append(record)
    dropped = len(records) - len(kept)
    lost = [step for step in range(position.step) if step not in finished]
    kept += [
        StepRecord(step, COMPLETED, time.time(), 0.0, reason=LOST_RECORD) for step in lost
    ]  # the codebook holds the step: it stays counted, its scores are gone
    kept.sort(key=lambda r: (r.step, r.attempt))
    if not damaged and not dropped and not added and not lost:
        return []
    parts = [
        f"{damaged} damaged line(s)" if damaged else "",
        f"{dropped} record(s) beyond or repeating step(s) of the codebook" if dropped else "",
        f"the interrupted close of step {pending.step + 1}" if added and pending else "",
        f"placeholders for the lost records of step(s) {', '.join(str(s + 1) for s in lost)}"
        if lost
        else "",
    ]
    text = "".join(r.to_json() + "\n" for r in kept).encode()

    def do() -> None:
        _keep_copy(root / HISTORY_FILE, stamp)
        write_atomic(root / HISTORY_FILE, text)

    what = ", ".join(p for p in parts if p)
    return [Action(f"rewrite {HISTORY_FILE} with {len(kept)} record(s) ({what})", do)]


def _registry(root: Path, position: Position, names: set[str], stamp: str) -> list[Action]:
    """Every codebook class registered (its readable entry kept; else from the history: the
    step whose record names it, sites unknown), nothing else."""
    path = root / REGISTRY_FILE
    try:
        current, damaged = read_registry(root), False
    except DamagedFile:
        current, damaged = {}, True
    records = HistoryLines.read(root, errors="replace").records
    brought = {name: r for r in records if r.status in FINISHED for name in r.classes}
    registry = {}
    for name in sorted(names, key=lambda n: brought[n].step if n in brought else position.step):
        if name in current:
            registry[name] = current[name]
        elif name in brought:
            ended = datetime.fromtimestamp(brought[name].ended, UTC).isoformat(timespec="seconds")
            registry[name] = Registration(brought[name].step, ended)
        else:
            registry[name] = Registration(position.step)
    if not damaged and registry == current:
        return []
    restored = len(set(registry) - set(current))
    dropped = len(set(current) - set(registry))
    text = registry_bytes(registry)

    def do() -> None:
        _keep_copy(path, stamp)
        write_atomic(path, text)

    why = (
        "damaged: rebuilt from the codebook and the history, sites unknown"
        if damaged
        else (f"{restored} class(es) added, {dropped} dropped")
    )
    return [Action(f"rewrite {REGISTRY_FILE} with {len(registry)} class(es) ({why})", do)]
