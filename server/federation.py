"""The federation's home: everything the server remembers across runs, in one folder.

A federation lives longer than any server run: sites bring new tasks whenever they happen, and
each run performs aggregation steps over what they bring, continuing where the last one stopped
(docs/federation.md). The folder is two things: its checkpoints — the current codebook and
position, committed and recovered by ``starfed.server.checkpoints`` (``self.checkpoints``), their
one owner — and its records (the types in ``starfed.server.records``), each file read and
written by its own module (``server.registry``, ``server.history``, ``server.quarantine``,
``server.step_findings``, ``server.step_failures``; the withdrawals' log in
``server.folder_files``, which names every file). ``Federation`` composes them: it decides
when each is written in a step's close, not how.

Closing a step has one commit point: ``codebook.bin`` written with the next position (its
records are appended to the store before it; no reader reads a record no manifest names). The
step's record is written ahead (``step-end.json``), then the codebook is committed, then the
record is appended to the history and the registry follows; a crash before the commit leaves
the step running (the next run resumes it and records it once), a crash after it leaves a
record that ``recover`` appends — never twice, never lost. A full disk (ENOSPC) at any write
of a step is one ``FederationError`` that says what was being written, where the commit point
stands and what the next run does. Nothing is written that does not decode (``wire.write_file``
and ``store_io.save`` validate first), and a missing codebook is never replaced by an empty one
once the folder has done any work. The codebook's metadata carries its lineage
(``starfed.shared.codebook.lineage``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from starfed.server.checkpoints import CheckpointStore
from starfed.server.folder_files import (
    CODEBOOK_FILE,
    CONTRIBUTIONS_FILE,
    HISTORY_FILE,
    IDENTITY_FILE,
    METRICS_FILE,
    PENDING_FILE,
    STEP_FAILURES_FILE,
    STEP_FINDINGS_FILE,
    WITHDRAWING_FILE,
    FederationError,
    Identity,
    append_withdrawal,
    read_withdrawals,
    temporaries,
)
from starfed.server.history import HistoryLines, append_history, write_history
from starfed.server.quarantine import Quarantined, read_quarantine, write_quarantine
from starfed.server.records import (
    Exchange,
    Finding,
    Outcome,
    Position,
    StepRecord,
    Withdrawal,
    now,
)
from starfed.server.registry import Registration, read_registry, write_registry
from starfed.server.step_failures import append_step_failures
from starfed.server.step_findings import read_step_findings, write_step_findings
from starfed.shared.codebook.framing import CodebookError
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic
from starfed.shared.run_status import FAILED

logger = logging.getLogger(__name__)

WITHDRAWAL_KEY = "starfed.withdrawal"  # metadata of the codebook a withdrawal committed: its id

if TYPE_CHECKING:  # decoding a codebook needs torch: imported where a codebook is decoded, so
    # the folder's records can be read without it (`starfed server status`)
    from starfed.server.contributions import Contributions
    from starfed.shared.codebook.codebook import Codebook
    from starfed.shared.codebook.store_io import Stored


class Federation:
    """One federation folder (created on first use)."""

    def __init__(self, root: str | Path, fingerprint: str, dims: ModelDims) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        identity_path = self.root / IDENTITY_FILE
        if identity_path.is_file():
            identity = self._read(IDENTITY_FILE, {})
            if identity.get("fingerprint") != fingerprint:
                raise FederationError(
                    f"{self.root} is a federation of other backbones "
                    f"({str(identity.get('fingerprint'))[:12]}…, these are {fingerprint[:12]}…)"
                )
        else:
            identity = {
                "id": uuid.uuid4().hex,
                "created": now(),
                "fingerprint": fingerprint,
                "dims": asdict(dims),
            }
            write_atomic(identity_path, json.dumps(identity, indent=2).encode())
        self.id: str = identity["id"]
        self.fingerprint = fingerprint
        self.dims = dims
        self.registry: dict[str, Registration] = read_registry(self.root)
        #: the current codebook and position, and the codebooks kept: the store's alone
        self.checkpoints = CheckpointStore(Identity(self.root, fingerprint, dims), self.id)
        self._kept_rows: Stored | None = None  # contributions.bin's codebook as saved

    @classmethod
    def open(cls, root: str | Path) -> Federation:
        """An existing federation folder, with the backbones its identity names: for readers
        that load no backbones (``starfed server export``, the codebook service)."""
        identity = Identity.read(root)
        return cls(identity.root, identity.fingerprint, identity.dims)

    def metrics(self) -> dict:
        """``metrics.json`` of the last server run ({} before the first)."""
        return self._read(METRICS_FILE, {})

    def _read(self, name: str, default):
        path = self.root / name
        try:
            return json.loads(path.read_text()) if path.is_file() else default
        except json.JSONDecodeError as err:
            raise FederationError(f"{path} is damaged: {err}") from None

    # --- the checkpoints (``server.checkpoints``) -------------------------------------------

    def checkpoint(self, codebook: Codebook, position: Position) -> Codebook:
        """Commit ``codebook`` at ``position`` mid-step (``CheckpointStore.commit``); a full
        disk is one ``FederationError`` (``_mid_step``)."""
        with self._mid_step(f"the checkpoint of {position.done[-1] if position.done else 'it'}"):
            return self.checkpoints.commit(codebook, position)

    # --- each site's last rows per class (``server.contributions``) --------------------------

    def contributions(self) -> Contributions:
        """The rows ``contributions.bin`` keeps (none before the first phase merged)."""
        from starfed.server.contributions import Contributions

        if not (self.root / CONTRIBUTIONS_FILE).is_file():
            return Contributions()
        codebook, self._kept_rows = self.checkpoints.load(CONTRIBUTIONS_FILE)
        try:
            return Contributions.from_codebook(codebook)
        except CodebookError as err:
            raise FederationError(f"{self.root / CONTRIBUTIONS_FILE}: {err}") from None

    def save_contributions(self, contributions: Contributions, like: Codebook) -> Contributions:
        """``contributions`` kept (what changed since the last save), ahead of the checkpoint
        of the phase that merged them: a crash between leaves rows the repeated phase
        replaces (``Contributions.merged``)."""
        with self._mid_step("the contributions of the phase ahead of its checkpoint"):
            codebook = contributions.as_codebook(like)
            self._kept_rows = self.checkpoints.save(CONTRIBUTIONS_FILE, codebook, self._kept_rows)
        return replace(contributions, codebook=codebook)

    # --- a site leaves (``server.withdrawal``) ----------------------------------------------

    def withdraw(self, record: Withdrawal, codebook: Codebook) -> Codebook:
        """Commit ``codebook``, the federation without ``record.site``: one commit point, as a
        step's close (the module docstring): the record written ahead, the codebook committed
        naming it, then the registry, the quarantine, the kept rows and ``withdrawals.jsonl``
        follow (``recover`` finishes them after a crash, or drops a record never committed).
        ``codebook`` is made from ``checkpoints.codebook()``: the save writes what changed."""
        write_atomic(self.root / WITHDRAWING_FILE, record.to_json().encode())
        metadata = {**codebook.metadata, WITHDRAWAL_KEY: record.id}
        steps = record.steps if record.rerun_from is None else record.rerun_from
        saved = self.checkpoints.commit(replace(codebook, metadata=metadata), Position(steps))
        self._finish_withdrawal(record)
        return saved

    def first_steps(self) -> dict[str, int]:
        """Site -> the step that registered the first class it brought (its first rows)."""
        first: dict[str, int] = {}
        for registration in self.registry.values():
            for site in registration.sites:
                first[site] = min(first.get(site, registration.step), registration.step)
        return first

    def _finish_withdrawal(self, record: Withdrawal) -> None:
        """After the commit (each part idempotent): its classes and the site out of the
        registry, the site quarantined for good, its rows and its classes' rows forgotten,
        the line in ``withdrawals.jsonl``; the record written ahead goes last. An exact
        withdrawal also forgets the steps to be run again: their history lines, and every
        kept codebook after its checkpoint (they hold the site's values)."""
        if record.rerun_from is not None:
            self._forget_steps(record.rerun_from)
        self.registry = {
            n: r.without(record.site) for n, r in self.registry.items() if n not in record.removed
        }
        self._write_registry()
        quarantine = self.quarantine()
        quarantine[record.site] = Quarantined(
            record.steps, record.when, "withdrawn: a new `starfed server sites add` lets it back"
        )
        write_quarantine(self.root, quarantine)
        kept = self.contributions().without(record.site, record.removed)
        self.save_contributions(kept, self.checkpoints.codebook())
        append_withdrawal(self.root, record)
        (self.root / WITHDRAWING_FILE).unlink(missing_ok=True)

    def rerunning(self) -> str | None:
        """A line while the federation runs again the steps an exact withdrawal undid (None
        when it does not): for the run's log and ``starfed server status``."""
        withdrawals = read_withdrawals(self.root)
        last = withdrawals[-1] if withdrawals else None
        if last is None or last.rerun_from is None:
            return None
        done = self.checkpoints.position.step
        if done >= last.steps:
            return None
        return (
            f"re-running for the withdrawal of {last.site}: {done} of {last.steps} steps done "
            f"(steps {last.rerun_from + 1}-{last.steps} run again without it)"
        )

    def _forget_steps(self, completed: int) -> None:
        """The folder as it was after ``completed`` steps: later history lines and kept
        codebooks gone, the codebook before the last checkpoint the checkpoint itself."""
        write_history(self.root, [r for r in self.history() if r.step < completed])
        self.checkpoints.forget_after(completed)

    def recover_withdrawal(self) -> str | None:
        """Finish a withdrawal a crash interrupted after its commit (``withdrawal.json``), or
        drop it before; what was done, None when nothing was."""
        path = self.root / WITHDRAWING_FILE
        if not path.is_file():
            return None
        try:
            record = Withdrawal.from_json(path.read_text())
        except (ValueError, KeyError, TypeError) as err:
            path.unlink()
            return f"dropped a damaged {WITHDRAWING_FILE} ({err}); the withdrawal was not made"
        codebook, _ = self.checkpoints.load(CODEBOOK_FILE)
        if codebook.metadata.get(WITHDRAWAL_KEY) != record.id:
            path.unlink()
            return f"the withdrawal of {record.site} was not committed: run it again"
        self._finish_withdrawal(record)
        return f"finished the withdrawal of {record.site}"

    # --- steps ----------------------------------------------------------------------------

    def begin_step(self, codebook: Codebook) -> None:
        """Keep the codebook a step starts from, the last checkpoint, for a rollback: its
        manifest copied (``codebook`` saved for a new federation, which has none yet)."""
        with self._mid_step("the codebook it starts from"):
            self.checkpoints.begin(codebook)
            (self.root / STEP_FINDINGS_FILE).unlink(missing_ok=True)  # an earlier attempt's
            (self.root / STEP_FAILURES_FILE).unlink(missing_ok=True)

    def register(self, names: list[str], step: int, brought: dict[str, list[str]]) -> None:
        """Record newly registered classes and which sites brought which class."""
        for name in names:
            self.registry.setdefault(name, Registration(step))
        when = now()
        for name, sites in brought.items():
            for site in sites:
                self.registry[name] = self.registry[name].brought_by(site, when)
        with self._mid_step("the registry of its new classes"):
            self._write_registry()

    def unregister(self, names: list[str]) -> None:
        """Forget classes that left the step in progress (no site sent their statistics), so
        the step that brings them again registers them, and scores group them under it."""
        for name in names:
            self.registry.pop(name, None)
        with self._mid_step("the registry without the classes that left it"):
            self._write_registry()

    def _write_registry(self) -> None:
        write_registry(self.root, self.registry)

    def quarantine(self) -> dict[str, Quarantined]:
        """Sites kept out of later steps: site -> the step and reason that put it there."""
        return read_quarantine(self.root)

    def add_quarantine(self, sites: dict[str, str], step: int) -> None:
        """Keep ``sites`` (site -> why) out of later steps (``quarantine-persists``)."""
        quarantine = self.quarantine()
        for site, reason in sites.items():
            quarantine.setdefault(site, Quarantined(step, now(), reason))
        with self._mid_step("the sites it quarantined"):
            write_quarantine(self.root, quarantine)

    def save_findings(self, step: int, findings: Sequence[Finding]) -> None:
        """The screening's findings so far in ``step``, written ahead of each of its
        checkpoints, so that a crash loses none of a committed phase's (``step_findings``)."""
        with self._mid_step("the screening's findings ahead of its next checkpoint"):
            write_step_findings(self.root, step, findings)

    def journal_failures(self, exchanges: Sequence[Exchange]) -> None:
        """The step's failed and refused exchanges, journaled as they end so that `server
        status` shows them while the step runs (``step-failures.jsonl``). For people only: a
        write that fails is a warning, never the step's failure."""
        told = [e for e in exchanges if e.failed or e.status.outcome is Outcome.REFUSED]
        try:
            append_step_failures(self.root, told)
        except OSError as err:
            logger.warning("could not journal the step's failures for `server status`: %s", err)

    def step_findings(self, step: int) -> list[Finding]:
        """What ``save_findings`` last kept for ``step``, none for another step. Written ahead
        of a checkpoint, it may hold a phase that was not committed: the caller keeps those of
        the phases its position has done."""
        kept_for, findings = read_step_findings(self.root)
        return findings if kept_for == step else []

    def history(self) -> list[StepRecord]:
        """One record per finished step, in step order (a record written again wins)."""
        lines = HistoryLines.read(self.root)
        if lines.damaged:
            number, why = lines.damaged[0]
            raise FederationError(f"{self.root / HISTORY_FILE}:{number} is damaged: {why}")
        records = {(record.step, record.attempt): record for record in lines.records}
        return [records[key] for key in sorted(records)]

    def attempts(self, step: int) -> int:
        """How many records of ``step`` the history holds (its failed attempts)."""
        return sum(record.step == step for record in self.history())

    def end_step(
        self, record: StepRecord, codebook: Codebook | None, keep_steps: int = 0
    ) -> Codebook:
        """Close the step in progress with its ``record``; returns the codebook to go on
        with. A failed step (``codebook`` None) goes back to the codebook it started from, on
        a new version line, and the next step keeps its index. One commit point (the module
        docstring): the record is written ahead, the codebook committed, then the history
        and the registry follow; ``keep_steps`` completed steps' codebooks are kept (0: all).
        A full disk is one ``FederationError`` that says what the next run will do."""
        try:
            write_atomic(self.root / PENDING_FILE, record.to_json().encode())
            if codebook is None:
                saved = self.checkpoints.roll_back(record.step)
            else:
                saved = self.checkpoints.commit(codebook, Position(record.step + 1))
            self._finish(record, keep_steps)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise FederationError(self._full_disk(record, err)) from None
        return saved

    def _committed(self, record: StepRecord) -> bool:
        """Whether ``codebook.bin`` holds the position the close of ``record`` commits."""
        done = Position(record.step if record.status == FAILED else record.step + 1)
        return self.checkpoints.committed(done)

    def _full_disk(self, record: StepRecord, err: OSError) -> str:
        where = Path(err.filename).name if err.filename else "a file"
        step = f"step {record.step + 1}"
        if self._committed(record):
            then = f"{step} was committed and nothing was lost; the next run finishes recording it"
        else:
            then = (
                f"{step} was not committed ({CODEBOOK_FILE} is unchanged) and nothing was "
                "lost; the next run resumes the step"
            )
        return f"the disk is full (writing {where} of {self.root}): {then}, once space is freed"

    @contextlib.contextmanager
    def _mid_step(self, writing: str) -> Iterator[None]:
        """A full disk while ``writing`` (one of a step's writes before its close): one
        ``FederationError``. Each such write ends before the commit point or is the commit
        itself (atomic), so ``codebook.bin`` still holds the last checkpoint: nothing done
        before it is lost, and the next run resumes from it."""
        try:
            yield
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            where = Path(err.filename).name if err.filename else "a file"
            checkpoint = self.checkpoints.last_checkpoint()
            position = Position() if checkpoint is None else checkpoint.position
            step = f"step {position.step + 1}"
            then = (
                f"the next run resumes {step} after its {position.done[-1]}"
                if position.running and position.done
                else f"the next run starts {step}"
            )
            raise FederationError(
                f"the disk is full (writing {where} of {self.root}, {writing}, in {step}): the "
                f"commit point did not move ({CODEBOOK_FILE} is unchanged) and nothing was lost; "
                f"{then}, once space is freed"
            ) from None

    def recover(self, keep_steps: int = 0) -> str | None:
        """Finish a step close that a crash interrupted (``step-end.json``): after the commit,
        its record is appended (once); before it, the record is dropped (the step is still
        running and the next run records it). What was done, None when nothing was. A folder
        whose codebook is missing is refused first (``codebook``), with nothing written."""
        self.checkpoints.has_codebook()
        closes = (self._recover_close(keep_steps), self.recover_withdrawal())
        notes = [note for note in (*closes, self._align_registry(), self._sweep()) if note]
        return "; ".join(notes) or None

    def _sweep(self) -> str | None:
        """Remove the temporary files of writes a crash cut short (the caller holds the
        folder's lock: no write of another run is under way)."""
        found = Identity(self.root, self.fingerprint, self.dims).temporary_files()
        if not found:
            return None
        removed = temporaries(found, self.root)
        for path in found:
            path.unlink(missing_ok=True)
        return f"removed {removed} that killed writes left"

    def _recover_close(self, keep_steps: int) -> str | None:
        path = self.root / PENDING_FILE
        if not path.is_file():
            return None
        try:
            record = StepRecord.from_json(path.read_text())
        except (json.JSONDecodeError, TypeError) as err:
            path.unlink()
            return f"dropped a damaged {PENDING_FILE} ({err}); the step resumes"
        if not self._committed(record):
            path.unlink()
            return f"step {record.step + 1} was not committed: it resumes"
        self._finish(record, keep_steps)
        return f"finished closing step {record.step + 1} ({record.status})"

    def _align_registry(self) -> str | None:
        """The registry changes beside the codebook, not with it: a crash between the two
        leaves classes registered for a step that never checkpointed them (dropped), or
        classes in play that were unregistered before the checkpoint that removes them
        (registered again for the step in progress)."""
        checkpoint = self.checkpoints.last_checkpoint()
        position = Position() if checkpoint is None else checkpoint.position
        names = set() if checkpoint is None else set(checkpoint.classes)
        stray = [n for n, r in self.registry.items() if n not in names and r.step >= position.step]
        lost = [n for n in position.in_play if n in names and n not in self.registry]
        if not stray and not lost:
            return None
        for name in stray:
            del self.registry[name]
        for name in lost:
            self.registry[name] = Registration(position.step)
        self._write_registry()
        return f"registry aligned with the codebook ({len(stray)} dropped, {len(lost)} restored)"

    def _finish(self, record: StepRecord, keep_steps: int) -> None:
        """After the commit: the history line (unless already there), the registry of a failed
        step rolled back, the completed step's codebook kept; then the record written ahead goes."""
        if not any(r.step == record.step and r.attempt == record.attempt for r in self.history()):
            append_history(self.root, record)
        if record.status == FAILED:
            self.registry = {n: r for n, r in self.registry.items() if r.step != record.step}
            self._write_registry()
        else:
            pinned = self.first_steps().values()  # an exact withdrawal goes back to these
            self.checkpoints.keep_step(record.step + 1, keep_steps, pinned)
        (self.root / PENDING_FILE).unlink(missing_ok=True)
