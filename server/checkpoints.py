"""The federation folder's checkpoint store: the one owner of the current codebook and position.

A federation step moves through checkpoints: the codebook after each phase, with the protocol
position (``Position``: the step, its phase rounds done, its classes in play) that says where
an interrupted step resumes. This module commits them and hands them back — nothing else in
the server writes ``codebook.bin`` or hands out the position (the coordinator, the withdrawal
and the folder's records ask this store). Its files are named in ``server.folder_files``;
their bytes are the codebook store's (``shared.codebook.store_layout``, ``store_io``).

The position is written in ``codebook.bin``'s manifest, beside the codebook it belongs to:
the manifest is the commit point, one atomic write, so a codebook never exists on disk without
its position, nor a position without its codebook, and folders of earlier releases open
unchanged. In memory the two are apart: a ``Codebook`` this store hands out carries no
position, and the position is this store's ``position`` (parsed once, where a file is read).

Besides the current checkpoint the store keeps the one before it (``previous.bin``), the codebook
the step in progress started from (``step-start.bin``, what a failed step goes back to) and one
per completed step (``checkpoints/step-NNNN.bin``, what an exact withdrawal goes back to).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from starfed.server.folder_files import (
    CHECKPOINTS_DIR,
    CODEBOOK_FILE,
    PREVIOUS_FILE,
    STEP_START_FILE,
    FederationError,
    Identity,
    copy_atomic,
    is_manifest,
)
from starfed.server.records import POSITION_KEY, Checkpoint, Position
from starfed.shared.codebook import store_layout
from starfed.shared.codebook.framing import CodebookError, read_message
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.files import write_atomic

if TYPE_CHECKING:  # decoding a codebook needs torch: imported where a codebook is decoded, so
    # the folder's checkpoint can be read without it (`starfed server status`)
    from starfed.shared.codebook.codebook import Codebook
    from starfed.shared.codebook.store_io import Stored


class CheckpointStore:
    """The checkpoints of one federation folder: commit, the current codebook and position,
    the codebooks kept per step, and going back to one."""

    def __init__(self, identity: Identity, federation_id: str) -> None:
        self.identity = identity
        self.root = identity.root
        self.federation_id = federation_id
        self._position: Position | None = None  # codebook.bin's, once read or committed
        self._stored: Stored | None = None  # codebook.bin's codebook as saved: saves follow it
        self._start: Stored | None = None  # step-start.bin's, when this run began the step
        self._kept: Stored | None = None  # the newest step checkpoint's: its own base and log
        self._migrated = False
        self._whole: Codebook | None = None  # codebook.bin's codebook, read from a whole file

    # --- the files of the store ---------------------------------------------------------------

    def load(self, name: str) -> tuple[Codebook, Stored | None]:
        """The codebook of the folder's file ``name``, as stored (None: a whole file of the
        layout before the store); one ``FederationError`` when it does not read."""
        from starfed.shared.codebook import store_io

        identity = self.identity
        try:
            return store_io.load(
                self.root / name, fingerprint=identity.fingerprint, dims=identity.dims
            )
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

    def save(self, name: str, codebook: Codebook, since: Stored | None) -> Stored:
        """``codebook`` written as what changed since ``since``; its manifest ``name`` (the
        commit) written last."""
        from starfed.shared.codebook import store_io

        self.migrate()
        saved, manifest = store_io.save(self.root / store_layout.STORE_DIR, codebook, since)
        write_atomic(self.root / name, manifest)
        return saved

    def migrate(self) -> list[str]:
        """Move a folder written before the store into it, once: each whole codebook file
        becomes a base of the store (a hard link: no bytes copied) and a manifest takes its
        place. The names moved (none when there were none)."""
        from starfed.shared.codebook import store_io

        if self._migrated:
            return []
        moved = []
        folder = self.root / store_layout.STORE_DIR
        for path in self.identity.manifests():
            if path.stat().st_size <= store_layout.MANIFEST_MAX_BYTES and is_manifest(path):
                continue
            base = store_io.new_name(0)
            try:
                manifest = store_io.manifest_of(path, base)
            except CodebookError:
                continue  # damaged: ``check`` names it, ``repair`` sets it right
            store_io.link_base(path, folder, base)
            write_atomic(path, manifest)
            if path.name == CODEBOOK_FILE and self._whole is not None:  # saves follow it
                ref = store_layout.Ref(base, base.replace("base-", "log-", 1))
                self._stored = store_io.Stored(self._whole, ref, (folder / base).stat().st_size)
            moved.append(str(path.relative_to(self.root)))
        self._migrated = True
        return moved

    def collect(self) -> None:
        """The store's files no manifest names any more removed."""
        identity = self.identity
        store_layout.collect(
            self.root / store_layout.STORE_DIR, identity.manifests() + identity.kept_copies()
        )

    # --- the current codebook and position --------------------------------------------------

    def codebook(self) -> Codebook:
        """The codebook of the last checkpoint (empty for a new federation); ``position``
        then is its position."""
        from starfed.shared.codebook.codebook import Codebook

        if not self.has_codebook():
            self._position = Position()
            metadata = Lineage(self.federation_id).new_epoch().as_metadata()
            return Codebook(self.identity.fingerprint, self.identity.dims, metadata=metadata)
        codebook, self._stored = self.load(CODEBOOK_FILE)
        self._whole = codebook if self._stored is None else None  # a file of the layout before
        codebook, self._position = _apart(codebook)
        return codebook

    @property
    def position(self) -> Position:
        """Where the protocol stands: the last checkpoint's position (the first step's start
        before any)."""
        if self._position is None:
            checkpoint = self.last_checkpoint()
            self._position = Position() if checkpoint is None else checkpoint.position
        return self._position

    def has_codebook(self) -> bool:
        """Whether ``codebook.bin`` exists; its absence where the folder has completed work is
        an error, raised before anything is written (the registry, the step's close)."""
        if (self.root / CODEBOOK_FILE).is_file():
            return True
        if traces := self.identity.traces():
            raise FederationError(
                f"{self.root / CODEBOOK_FILE} is missing, but the folder holds {traces}: "
                "`starfed server repair` restores the last good checkpoint"
            )
        return False

    def last_checkpoint(self) -> Checkpoint | None:
        """The saved codebook's version, classes and position, None before the first one; read
        without decoding a tensor (no torch)."""
        path = self.root / CODEBOOK_FILE
        if not path.is_file():
            return None
        try:
            message = read_message(path)
        except CodebookError as err:
            raise FederationError(str(err)) from None
        if message.backbone_fingerprint != self.identity.fingerprint:
            raise FederationError(f"{path} holds a codebook of other backbones")
        names = tuple(entry.name for entry in message.entries)
        frozen = frozenset(entry.name for entry in message.entries if entry.frozen)
        return Checkpoint(message.version, names, frozen, Position.from_metadata(message.metadata))

    def committed(self, position: Position) -> bool:
        """Whether ``codebook.bin`` holds ``position`` (a close a crash interrupted)."""
        checkpoint = self.last_checkpoint()
        return checkpoint is not None and checkpoint.position == position

    def commit(self, codebook: Codebook, position: Position) -> Codebook:
        """The commit point: ``codebook`` at ``position``, what changed since the last
        checkpoint appended to the store, then its manifest, which names the position too (one
        atomic write); the last good checkpoint stays beside it (``previous.bin``). The
        codebook as committed (its lineage this federation's)."""
        lineage = replace(Lineage.of(codebook), federation=self.federation_id)
        committed, _ = _apart(
            replace(codebook, metadata={**codebook.metadata, **lineage.as_metadata()})
        )
        on_disk = {**committed.metadata, **position.as_metadata()}
        self.migrate()
        current = self.root / CODEBOOK_FILE
        if current.is_file():
            copy_atomic(current, self.root / PREVIOUS_FILE)
        self._stored = self.save(CODEBOOK_FILE, replace(committed, metadata=on_disk), self._stored)
        self._position = position
        return committed

    # --- a step's start, and going back to it --------------------------------------------------

    def begin(self, codebook: Codebook) -> None:
        """Keep the codebook a step starts from, the last checkpoint, for a rollback: its
        manifest copied (``codebook`` saved for a new federation, which has none yet)."""
        self.migrate()
        current = self.root / CODEBOOK_FILE
        if current.is_file():
            write_atomic(self.root / STEP_START_FILE, current.read_bytes())
            same = self._stored is not None and self._stored.codebook.entries is codebook.entries
            self._start = self._stored if same else None
            self._part_from_kept()
        else:
            self._stored = self._start = self.save(STEP_START_FILE, codebook, self._stored)

    def roll_back(self, step: int) -> Codebook:
        """Commit the codebook the failed ``step`` started from, on a new version line, at the
        start of ``step`` again; going back appends no record to the store."""
        start, self._stored = (
            (self._start.codebook, self._start) if self._start else self.load(STEP_START_FILE)
        )
        metadata = {**start.metadata, **Lineage.of(start).new_epoch().as_metadata()}
        return self.commit(replace(start, metadata=metadata), Position(step))

    def _part_from_kept(self) -> None:
        """At a step's start, the step checkpoints' store and ``codebook.bin``'s kept apart: a
        run that did not close the last step follows the newest checkpoint's store when it
        holds this codebook (its close then appends the step's changes, not a new base); a
        ``codebook.bin`` naming a checkpoint's store file (``repair`` restored it from there,
        or a folder written before) is saved to a new base by the step's first checkpoint."""
        kept = [path for _, path in self.identity.step_checkpoints()]
        if not kept or self._stored is None:
            return
        if self._kept is None:
            self._kept = self._follow(kept[-1], self._stored)
        shared = store_layout.referenced(kept) or set()  # None: one does not read (``check`` says)
        if {self._stored.ref.base, self._stored.ref.log} & shared:
            self._stored = None

    def _follow(self, path: Path, current: Stored) -> Stored | None:
        """The step checkpoint ``path`` as stored, when it holds ``current``'s codebook (same
        version and class lines); None when it does not, or does not read (``check`` names it)."""
        try:
            message = read_message(path)
            lines = read_message(self.root / CODEBOOK_FILE)
            ref = store_layout.Ref.of(message.metadata)
            if ref is None or (message.version, message.entries) != (lines.version, lines.entries):
                return None
            return replace(
                current, ref=ref, base_bytes=(store_layout.find_dir(path) / ref.base).stat().st_size
            )
        except (CodebookError, OSError):
            return None

    # --- the codebooks kept per completed step ------------------------------------------------

    def keep_step(self, completed: int, keep_steps: int, pinned: Iterable[int]) -> None:
        """``checkpoints/step-NNNN.bin``: the codebook after ``completed`` steps, saved in a
        base and log of its own, which ``codebook.bin`` never names (one damaged store file
        never takes both: docs/federation.md, the codebook store): the step's changes appended
        to the last kept step's log, or a new base (the first close of a run that did not start
        the step, or one past ``store_io.COMPACT_AT``); the oldest beyond ``keep_steps`` pruned
        (0: all kept), except those ``pinned`` (an exact withdrawal goes back to these)."""
        (self.root / CHECKPOINTS_DIR).mkdir(exist_ok=True)
        codebook = self._stored.codebook if self._stored else self.load(CODEBOOK_FILE)[0]
        name = f"{CHECKPOINTS_DIR}/step-{completed:04d}.bin"
        self._kept = self.save(name, codebook, self._kept)
        pinned = set(pinned)
        kept = [(n, path) for n, path in self.identity.step_checkpoints() if n not in pinned]
        for _, path in kept[: max(0, len(kept) - keep_steps) if keep_steps else 0]:
            path.unlink(missing_ok=True)
        self.collect()

    def kept_step(self, completed: int) -> Codebook:
        """The codebook kept after ``completed`` steps (``checkpoints/step-NNNN.bin``), on a new
        version line; the next commit writes only its manifest (no bytes copied)."""
        path = self.root / CHECKPOINTS_DIR / f"step-{completed:04d}.bin"
        if not path.is_file():
            raise FederationError(f"{path} is not kept")
        self.migrate()
        codebook, self._stored = self.load(path.relative_to(self.root).as_posix())
        codebook, _ = _apart(codebook)
        metadata = {**codebook.metadata, **Lineage.of(codebook).new_epoch().as_metadata()}
        return replace(codebook, metadata=metadata)

    def forget_after(self, completed: int) -> None:
        """The store as it was after ``completed`` steps: later kept codebooks gone, the
        codebook before the last checkpoint the checkpoint itself, no step started."""
        for steps, path in self.identity.step_checkpoints():
            if steps > completed:
                path.unlink()
        copy_atomic(self.root / CODEBOOK_FILE, self.root / PREVIOUS_FILE)
        (self.root / STEP_START_FILE).unlink(missing_ok=True)
        self.collect()


def _apart(codebook: Codebook) -> tuple[Codebook, Position]:
    """A codebook read from a file, and the position its manifest names, apart: the one place
    the position is read from a codebook's metadata."""
    metadata = dict(codebook.metadata)
    position = Position.from_metadata(metadata)
    metadata.pop(POSITION_KEY, None)
    return replace(codebook, metadata=metadata), position
