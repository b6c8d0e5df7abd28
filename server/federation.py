"""The federation's home: everything the server remembers across runs, in one folder.

A federation lives longer than any server run: sites bring new tasks whenever they happen, and
each run performs aggregation steps over what they bring, continuing where the last one stopped
(docs/federation.md). Its files are named in ``starfed.server.folder_files``; its records
(``starfed.server.records``) are written and read here.

Closing a step has one commit point: ``codebook.bin`` written with the next position (its
records are appended to the store before it; no reader reads a record no manifest names). The
step's record is written ahead (``step-end.json``), then the codebook is committed, then the
record is appended to the history and the registry follows; a crash before the commit leaves
the step running (the next run resumes it and records it once), a crash after it leaves a
record that ``recover`` appends — never twice, never lost. A full disk (ENOSPC) at any write
of a step is one ``FederationError`` that says what was being written, where the commit point
stands and what the next run does. Nothing is written that does not decode (``wire.write_file``
and ``stored.save`` validate first), and a missing codebook is never replaced by an empty one
once the folder has done any work. The codebook's metadata carries its lineage
(``starfed.shared.codebook.lineage``) and the protocol position (``Position``).
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

from starfed.server.folder_files import (
    CHECKPOINTS_DIR,
    CODEBOOK_FILE,
    CONTRIBUTIONS_FILE,
    HISTORY_FILE,
    IDENTITY_FILE,
    METRICS_FILE,
    PENDING_FILE,
    PREVIOUS_FILE,
    STEP_FAILURES_FILE,
    STEP_FINDINGS_FILE,
    STEP_START_FILE,
    WITHDRAWING_FILE,
    FederationError,
    HistoryLines,
    Identity,
    append_history,
    append_step_failures,
    append_withdrawal,
    copy_atomic,
    is_manifest,
    read_quarantine,
    read_registry,
    read_step_findings,
    read_withdrawals,
    temporaries,
    write_history,
    write_quarantine,
    write_registry,
    write_step_findings,
)
from starfed.server.records import (
    Checkpoint,
    Exchange,
    Finding,
    Outcome,
    Position,
    Registration,
    StepRecord,
    Withdrawal,
    now,
)
from starfed.shared.codebook import store
from starfed.shared.codebook.framing import CodebookError, read_message
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic
from starfed.shared.run_status import FAILED

logger = logging.getLogger(__name__)

WITHDRAWAL_KEY = "starfed.withdrawal"  # metadata of the codebook a withdrawal committed: its id

if TYPE_CHECKING:  # decoding a codebook needs torch: imported where a codebook is decoded, so
    # the folder's records can be read without it (`starfed server status`)
    from starfed.server.contributions import Contributions
    from starfed.shared.codebook.codebook import Codebook
    from starfed.shared.codebook.stored import Stored


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
        self._stored: Stored | None = None  # codebook.bin's codebook as saved: saves follow it
        self._start: Stored | None = None  # step-start.bin's, when this run began the step
        self._kept: Stored | None = None  # the newest step checkpoint's: its own base and log
        self._migrated = False
        self._whole: Codebook | None = None  # codebook.bin's codebook, read from a whole file
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

    def _load(self, name: str) -> tuple[Codebook, Stored | None]:
        from starfed.shared.codebook import stored

        try:
            return stored.load(self.root / name, fingerprint=self.fingerprint, dims=self.dims)
        except (CodebookError, OSError) as err:  # OSError: a store file missing or unreadable
            why = (
                f"{err.filename} cannot be read ({err.strerror})"
                if isinstance(err, OSError)
                else err
            )
            raise FederationError(
                f"{self.root / name}: {why}; `starfed server repair` restores the last good "
                "checkpoint"
            ) from None

    def _save(self, name: str, codebook: Codebook, since: Stored | None) -> Stored:
        """``codebook`` written as what changed since ``since``; its manifest ``name`` (the
        commit) written last."""
        from starfed.shared.codebook import stored

        saved, manifest = stored.save(self.root / store.STORE_DIR, codebook, since)
        write_atomic(self.root / name, manifest)
        return saved

    def migrate(self) -> list[str]:
        """Move a folder written before the store into it, once: each whole codebook file
        becomes a base of the store (a hard link: no bytes copied) and a manifest takes its
        place. The names moved (none when there were none)."""
        from starfed.shared.codebook import stored

        if self._migrated:
            return []
        moved = []
        folder = self.root / store.STORE_DIR
        for path in Identity(self.root, self.fingerprint, self.dims).manifests():
            if path.stat().st_size <= store.MANIFEST_MAX_BYTES and is_manifest(path):
                continue
            base = stored.new_name(0)
            try:
                manifest = stored.manifest_of(path, base)
            except CodebookError:
                continue  # damaged: ``check`` names it, ``repair`` sets it right
            stored.link_base(path, folder, base)
            write_atomic(path, manifest)
            if path.name == CODEBOOK_FILE and self._whole is not None:  # saves follow it
                ref = store.Ref(base, base.replace("base-", "log-", 1))
                self._stored = stored.Stored(self._whole, ref, (folder / base).stat().st_size)
            moved.append(str(path.relative_to(self.root)))
        self._migrated = True
        return moved

    # --- the codebook and the position ----------------------------------------------------

    def codebook(self) -> Codebook:
        """The codebook after the last completed phase (empty for a new federation)."""
        from starfed.shared.codebook.codebook import Codebook

        if not self._has_codebook():
            metadata = Lineage(self.id).new_epoch().as_metadata()
            return Codebook(self.fingerprint, self.dims, metadata=metadata)
        codebook, self._stored = self._load(CODEBOOK_FILE)
        self._whole = codebook if self._stored is None else None  # a file of the layout before
        return codebook

    def _has_codebook(self) -> bool:
        """Whether ``codebook.bin`` exists; its absence where the folder has completed work is
        an error, raised before anything is written (the registry, the step's close)."""
        if (self.root / CODEBOOK_FILE).is_file():
            return True
        if traces := Identity(self.root, self.fingerprint, self.dims).traces():
            raise FederationError(
                f"{self.root / CODEBOOK_FILE} is missing, but the folder holds {traces}: "
                "`starfed server repair` restores the last good checkpoint"
            )
        return False

    @staticmethod
    def position(codebook: Codebook) -> Position:
        return Position.from_metadata(codebook.metadata)

    def last_checkpoint(self) -> Checkpoint | None:
        """The saved codebook's version, classes and position, None before the first one."""
        path = self.root / CODEBOOK_FILE
        if not path.is_file():
            return None
        try:
            message = read_message(path)
        except CodebookError as err:
            raise FederationError(str(err)) from None
        if message.backbone_fingerprint != self.fingerprint:
            raise FederationError(f"{path} holds a codebook of other backbones")
        names = tuple(entry.name for entry in message.entries)
        frozen = frozenset(entry.name for entry in message.entries if entry.frozen)
        return Checkpoint(message.version, names, frozen, Position.from_metadata(message.metadata))

    def checkpoint(self, codebook: Codebook, position: Position) -> Codebook:
        """Save ``codebook`` with ``position`` mid-step (``_commit``); a full disk is one
        ``FederationError`` (``_mid_step``)."""
        with self._mid_step(f"the checkpoint of {position.done[-1] if position.done else 'it'}"):
            return self._commit(codebook, position)

    def _commit(self, codebook: Codebook, position: Position) -> Codebook:
        """The commit point: ``codebook`` with ``position`` in its metadata, what changed since
        the last checkpoint appended to the store, then its manifest (one atomic write); the
        last good checkpoint stays beside it (``previous.bin``)."""
        self.migrate()
        lineage = replace(Lineage.of(codebook), federation=self.id)
        metadata = {**codebook.metadata, **lineage.as_metadata(), **position.as_metadata()}
        saved = replace(codebook, metadata=metadata)
        current = self.root / CODEBOOK_FILE
        if current.is_file():
            copy_atomic(current, self.root / PREVIOUS_FILE)
        self._stored = self._save(CODEBOOK_FILE, saved, self._stored)  # validated first
        return saved

    # --- each site's last rows per class (``server.contributions``) --------------------------

    def contributions(self) -> Contributions:
        """The rows ``contributions.bin`` keeps (none before the first phase merged)."""
        from starfed.server.contributions import Contributions

        if not (self.root / CONTRIBUTIONS_FILE).is_file():
            return Contributions()
        codebook, self._kept_rows = self._load(CONTRIBUTIONS_FILE)
        try:
            return Contributions.from_codebook(codebook)
        except CodebookError as err:
            raise FederationError(f"{self.root / CONTRIBUTIONS_FILE}: {err}") from None

    def save_contributions(self, contributions: Contributions, like: Codebook) -> Contributions:
        """``contributions`` kept (what changed since the last save), ahead of the checkpoint
        of the phase that merged them: a crash between leaves rows the repeated phase
        replaces (``Contributions.merged``)."""
        with self._mid_step("the contributions of the phase ahead of its checkpoint"):
            self.migrate()
            codebook = contributions.as_codebook(like)
            self._kept_rows = self._save(CONTRIBUTIONS_FILE, codebook, self._kept_rows)
        return replace(contributions, codebook=codebook)

    # --- a site leaves (``server.withdrawal``) ----------------------------------------------

    def withdraw(self, record: Withdrawal, codebook: Codebook) -> Codebook:
        """Commit ``codebook``, the federation without ``record.site``: one commit point, as a
        step's close (the module docstring): the record written ahead, the codebook committed
        naming it, then the registry, the quarantine, the kept rows and ``withdrawals.jsonl``
        follow (``recover`` finishes them after a crash, or drops a record never committed).
        ``codebook`` is made from this object's ``codebook()``: the save writes what changed."""
        write_atomic(self.root / WITHDRAWING_FILE, record.to_json().encode())
        metadata = {**codebook.metadata, WITHDRAWAL_KEY: record.id}
        steps = record.steps if record.rerun_from is None else record.rerun_from
        saved = self._commit(replace(codebook, metadata=metadata), Position(steps))
        self._finish_withdrawal(record)
        return saved

    def first_steps(self) -> dict[str, int]:
        """Site -> the step that registered the first class it brought (its first rows)."""
        first: dict[str, int] = {}
        for registration in self.registry.values():
            for site in registration.sites:
                first[site] = min(first.get(site, registration.step), registration.step)
        return first

    def kept_step(self, completed: int) -> Codebook:
        """The codebook kept after ``completed`` steps (``checkpoints/step-NNNN.bin``), on a new
        version line; the next commit writes only its manifest (no bytes copied)."""
        path = self.root / CHECKPOINTS_DIR / f"step-{completed:04d}.bin"
        if not path.is_file():
            raise FederationError(f"{path} is not kept")
        self.migrate()
        codebook, self._stored = self._load(path.relative_to(self.root).as_posix())
        metadata = {**codebook.metadata, **Lineage.of(codebook).new_epoch().as_metadata()}
        return replace(codebook, metadata=metadata)

    def _finish_withdrawal(self, record: Withdrawal) -> None:
        """After the commit (each part idempotent): its classes and the site out of the
        registry, the site quarantined for good, its rows and its classes' rows forgotten,
        the line in ``withdrawals.jsonl``; the record written ahead goes last. An exact
        withdrawal also forgets the steps to be run again: their history lines, and every
        kept codebook after its checkpoint (they hold the site's values)."""
        if record.rerun_from is not None:
            self._forget_steps(record.rerun_from)
        self.registry = {n: r for n, r in self.registry.items() if n not in record.removed}
        for registration in self.registry.values():
            registration.sites.pop(record.site, None)
        self._write_registry()
        quarantine = self.quarantine()
        quarantine[record.site] = {
            "step": record.steps,
            "since": record.when,
            "reason": "withdrawn: a new `starfed server sites add` lets it back",
        }
        write_quarantine(self.root, quarantine)
        kept = self.contributions().without(record.site, record.removed)
        self.save_contributions(kept, self.codebook())
        append_withdrawal(self.root, record)
        (self.root / WITHDRAWING_FILE).unlink(missing_ok=True)

    def rerunning(self) -> str | None:
        """A line while the federation runs again the steps an exact withdrawal undid (None
        when it does not): for the run's log and ``starfed server status``."""
        withdrawals = read_withdrawals(self.root)
        last = withdrawals[-1] if withdrawals else None
        if last is None or last.rerun_from is None:
            return None
        checkpoint = self.last_checkpoint()
        done = 0 if checkpoint is None else checkpoint.position.step
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
        identity = Identity(self.root, self.fingerprint, self.dims)
        for steps, path in identity.step_checkpoints():
            if steps > completed:
                path.unlink()
        copy_atomic(self.root / CODEBOOK_FILE, self.root / PREVIOUS_FILE)
        (self.root / STEP_START_FILE).unlink(missing_ok=True)
        store.collect(self.root / store.STORE_DIR, identity.manifests() + identity.kept_copies())

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
        codebook, _ = self._load(CODEBOOK_FILE)
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
            self.migrate()
            current = self.root / CODEBOOK_FILE
            if current.is_file():
                write_atomic(self.root / STEP_START_FILE, current.read_bytes())
                same = (
                    self._stored is not None and self._stored.codebook.entries is codebook.entries
                )
                self._start = self._stored if same else None
                self._part_from_kept()
            else:
                self._stored = self._start = self._save(STEP_START_FILE, codebook, self._stored)
            (self.root / STEP_FINDINGS_FILE).unlink(missing_ok=True)  # an earlier attempt's
            (self.root / STEP_FAILURES_FILE).unlink(missing_ok=True)

    def _part_from_kept(self) -> None:
        """At a step's start, the step checkpoints' store and ``codebook.bin``'s kept apart: a
        run that did not close the last step follows the newest checkpoint's store when it
        holds this codebook (its close then appends the step's changes, not a new base); a
        ``codebook.bin`` naming a checkpoint's store file (``repair`` restored it from there,
        or a folder written before) is saved to a new base by the step's first checkpoint."""
        identity = Identity(self.root, self.fingerprint, self.dims)
        kept = [path for _, path in identity.step_checkpoints()]
        if not kept or self._stored is None:
            return
        if self._kept is None:
            self._kept = self._follow(kept[-1], self._stored)
        shared = store.referenced(kept) or set()  # None: one does not read (``check`` says)
        if {self._stored.ref.base, self._stored.ref.log} & shared:
            self._stored = None

    def _follow(self, path: Path, current: Stored) -> Stored | None:
        """The step checkpoint ``path`` as stored, when it holds ``current``'s codebook (same
        version and class lines); None when it does not, or does not read (``check`` names it)."""
        try:
            message = read_message(path)
            lines = read_message(self.root / CODEBOOK_FILE)
            ref = store.Ref.of(message.metadata)
            if ref is None or (message.version, message.entries) != (lines.version, lines.entries):
                return None
            return replace(
                current, ref=ref, base_bytes=(store.find_dir(path) / ref.base).stat().st_size
            )
        except (CodebookError, OSError):
            return None

    def register(self, names: list[str], step: int, brought: dict[str, list[str]]) -> None:
        """Record newly registered classes and which sites brought which class."""
        for name in names:
            self.registry.setdefault(name, Registration(step))
        when = now()
        for name, sites in brought.items():
            for site in sites:
                self.registry[name].sites.setdefault(site, when)
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

    def quarantine(self) -> dict[str, dict]:
        """Sites kept out of later steps: site -> the step and reason that put it there."""
        return read_quarantine(self.root)

    def add_quarantine(self, sites: dict[str, str], step: int) -> None:
        """Keep ``sites`` (site -> why) out of later steps (``quarantine-persists``)."""
        quarantine = self.quarantine()
        for site, reason in sites.items():
            quarantine.setdefault(site, {"step": step, "since": now(), "reason": reason})
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
                self.migrate()
                start, self._stored = (
                    (self._start.codebook, self._start)
                    if self._start
                    else self._load(STEP_START_FILE)
                )  # the step's start as stored: going back to it appends no record
                metadata = {**start.metadata, **Lineage.of(start).new_epoch().as_metadata()}
                saved = self._commit(replace(start, metadata=metadata), Position(record.step))
            else:
                saved = self._commit(codebook, Position(record.step + 1))
            self._finish(record, keep_steps)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise FederationError(self._full_disk(record, err)) from None
        return saved

    def _committed(self, record: StepRecord) -> bool:
        """Whether ``codebook.bin`` holds the position the close of ``record`` commits."""
        checkpoint = self.last_checkpoint()
        done = Position(record.step if record.status == FAILED else record.step + 1)
        return checkpoint is not None and checkpoint.position == done

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
            checkpoint = self.last_checkpoint()
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
        self._has_codebook()
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
        checkpoint = self.last_checkpoint()
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
            self._keep_step(record.step + 1, keep_steps)
        (self.root / PENDING_FILE).unlink(missing_ok=True)

    def _keep_step(self, completed: int, keep_steps: int) -> None:
        """``checkpoints/step-NNNN.bin``: the codebook after ``completed`` steps, saved in a
        base and log of its own, which ``codebook.bin`` never names (one damaged store file
        never takes both: docs/federation.md, the codebook store): the step's changes appended
        to the last kept step's log, or a new base (the first close of a run that did not start
        the step, or one past ``stored.COMPACT_AT``); the oldest beyond ``keep_steps`` pruned."""
        (self.root / CHECKPOINTS_DIR).mkdir(exist_ok=True)
        codebook = self._stored.codebook if self._stored else self._load(CODEBOOK_FILE)[0]
        name = f"{CHECKPOINTS_DIR}/step-{completed:04d}.bin"
        self._kept = self._save(name, codebook, self._kept)
        identity = Identity(self.root, self.fingerprint, self.dims)
        pinned = self.first_steps().values()  # an exact withdrawal goes back to these
        kept = [(n, path) for n, path in identity.step_checkpoints() if n not in pinned]
        for _, path in kept[: max(0, len(kept) - keep_steps) if keep_steps else 0]:
            path.unlink(missing_ok=True)
        store.collect(self.root / store.STORE_DIR, identity.manifests() + identity.kept_copies())
