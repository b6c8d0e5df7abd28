"""The codebook a receiver holds and keeps current by deltas: a site's, an inference device's.

A site (``starfed.client.memory``) and an inference device (``starfed.ops.follow``)
both keep the last codebook they received in a file, so that the sender can send only what
changed since (a ``Delta``). ``HeldCodebook`` is that file and the one rule for when a delta
applies. A whole codebook received is written as one file; the first delta after it moves
that file into a codebook store beside it as its base (``store_layout``, ``store_io``: linked, not
copied) and the file becomes the store's manifest, so a delta writes what it changed, not the
whole codebook. A codebook too large for one message arrives in parts (``stage``), staged
beside the file and held only once every part is staged; a catch-up stopped part-way resumes
with the parts staged, until a codebook arrives or ``STAGING_IDLE_STEPS`` steps pass without a
part. The file is replaced atomically and
read again whenever it changed on disk, as several worker processes of a simulation may answer
for the same site.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import TypeVar

from starfed.shared.codebook import parts, store_io, store_layout, wire
from starfed.shared.codebook.codebook import Codebook, CodebookError, Delta
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic

logger = logging.getLogger(__name__)

STAGING_DIR = "codebook-parts"  # beside the held file: the parts of a codebook being received
#: Steps a catch-up's staging is kept without a new part: past them it is dropped at the sync
#: (``HeldCodebook.drop_idle_staging``). A staging holds at most one codebook's parts.
STAGING_IDLE_STEPS = 2


def staging_idle(step: int, last: int) -> bool:
    """Whether a staging whose last part was staged at step ``last`` is abandoned at ``step``:
    the receiver's rule, and the sender's for what it may still take as staged."""
    return step - last > STAGING_IDLE_STEPS


#: How many payloads, and deltas applied, a process keeps decoded (``Shared``).
SHARED_KEPT = 4
#: How many held files a process remembers decoded (``Shared.loaded``): a few hundred bytes
#: each, the codebooks themselves shared.
LOADED_KEPT = 1 << 16


#: A payload and the backbones it is decoded against; a held file and the same.
DecodeKey = tuple[bytes, str | None, ModelDims | None]
FileKey = tuple[Path, str | None, ModelDims | None]
K = TypeVar("K")
V = TypeVar("V")


class Shared:
    """What every receiver in a process computes alike, computed once: a simulation's process
    answers for thousands of sites, and each message of a phase carries the same bytes to each
    of them (the delta from the version they all hold). Decoding those bytes, applying that
    delta to that codebook, and reading a held file unchanged since it was last read give the
    same immutable value (``Codebook``: nobody modifies one in place), so each is kept and
    shared — at 1000 simulated sites they were half of what the sites did (docs/benchmarks.md,
    many sites). A deployed site, one message per process, only ever misses."""

    def __init__(self) -> None:
        self.decoded: OrderedDict[DecodeKey, Codebook | Delta] = OrderedDict()
        self.applied: OrderedDict[tuple[int, int], tuple[Codebook, Delta, Codebook]] = OrderedDict()
        # (path, fingerprint, dims) -> (mtime and size when read, the codebook, its store state)
        self.loaded: OrderedDict[
            FileKey, tuple[tuple[int, int], Codebook, store_io.Stored | None]
        ] = OrderedDict()

    def decode(
        self, data: bytes, fingerprint: str | None, dims: ModelDims | None
    ) -> Codebook | Delta:
        """``wire.decode_broadcast`` of ``data``, decoded once per distinct bytes."""
        key: DecodeKey = (data, fingerprint, dims)
        value = self.decoded.get(key)
        if value is None:
            value = wire.decode_broadcast(data, fingerprint=fingerprint, dims=dims)
        _keep(self.decoded, key, value, SHARED_KEPT)
        return value

    def apply(self, held: Codebook, delta: Delta) -> Codebook:
        """``held.apply(delta)``, once per (codebook, delta) pair."""
        key = (id(held), id(delta))
        kept = self.applied.get(key)  # kept with both, so the ids stay theirs
        result = kept[2] if kept is not None else held.apply(delta)
        _keep(self.applied, key, (held, delta, result), SHARED_KEPT)
        return result

    def remember(self, file: HeldCodebook, held: Codebook, stored: store_io.Stored | None) -> None:
        """``file`` holds ``held`` (stored as ``stored``) while its stamp is what it is now."""
        _keep(self.loaded, file.identity, (file.stamp, held, stored), LOADED_KEPT)

    def recall(self, file: HeldCodebook) -> tuple[Codebook, store_io.Stored | None] | None:
        """What ``file`` held when it last had its present stamp, read by a receiver with the
        same backbones, if remembered."""
        kept = self.loaded.get(file.identity)
        return None if kept is None or kept[0] != file.stamp else (kept[1], kept[2])


def _keep(kept: OrderedDict[K, V], key: K, value: V, limit: int) -> None:
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > limit:
        kept.popitem(last=False)


#: This process's.
SHARED = Shared()


class HeldCodebook:
    """The last codebook received, kept in one file, and the one rule for deltas.

    The rule: a delta applies only to a held codebook of the same lineage (federation id and
    epoch, ``Lineage``) whose version is the delta's base version (``Codebook.apply`` checks
    the version and the backbones). A version number alone does not name a codebook: two
    federations both reach version 12, and a rollback starts a new version line that counts up
    again. Anything else — nothing held, another federation, another epoch, another version —
    is refused with ``CodebookError``, and the receiver needs the whole codebook. So the version
    to announce for a lineage (``version_for``) is the held version when the held codebook is
    of that lineage, else 0: nothing a delta can be made from. A whole codebook is taken as it
    comes. What is received is held from then on (written at once, so a process that restarts
    holds it too).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fingerprint: str | None = None,
        dims: ModelDims | None = None,
    ) -> None:
        self.path = Path(path)
        self.fingerprint, self.dims = fingerprint, dims  # the receiver's backbones, if known
        self._held: Codebook | None = None
        self._stored: store_io.Stored | None = None  # the held codebook as its store has it
        self._stamp: tuple[int, int] = (0, 0)  # the file's mtime and size when read

    @property
    def identity(self) -> FileKey:
        """The file and the backbones it is read against (``Shared``'s key)."""
        return self.path, self.fingerprint, self.dims

    @property
    def stamp(self) -> tuple[int, int]:
        return self._stamp

    def codebook(self) -> Codebook | None:
        """The held codebook, if there is one and it is intact (a damaged file is ignored: it
        costs one whole codebook)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._held = None
            return None
        if self._held is None or self._stamp != (stat.st_mtime_ns, stat.st_size):
            self._held, self._stored = None, None
            self._stamp = (stat.st_mtime_ns, stat.st_size)
            recalled = SHARED.recall(self)
            try:
                self._held, self._stored = recalled or store_io.load(
                    self.path, fingerprint=self.fingerprint, dims=self.dims
                )
            except (OSError, CodebookError) as err:
                logger.warning("ignoring the held codebook: %s", err)
            else:
                SHARED.remember(self, self._held, self._stored)
        return self._held

    def version_for(self, lineage: Lineage) -> int:
        """The version a sender of ``lineage`` can make a delta from: the held one, or 0. Read
        from the file's header when the held codebook is not in memory: a site answers every
        sync with it, and decoding every class for a version number cost a tenth of a
        1000-site simulation (docs/benchmarks.md)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return 0
        if self._held is not None and self._stamp == (stat.st_mtime_ns, stat.st_size):
            version, metadata = self._held.version, self._held.metadata
        else:
            try:
                version, metadata = wire.read_version(
                    self.path, fingerprint=self.fingerprint, dims=self.dims
                )
            except (OSError, CodebookError) as err:
                logger.warning("ignoring the held codebook: %s", err)
                return 0
        return version if Lineage.in_metadata(metadata) == lineage else 0

    def receive(self, received: bytes | Codebook | Delta) -> Codebook:
        """The codebook a message carries (bytes are decoded and validated here): as sent, or
        the held one with the delta applied; it is held from now on.

        Raises CodebookError for bad bytes or a delta the rule refuses. A whole codebook is
        written as one file; a delta as what it changed, appended to a store beside it (the
        whole file moved in as its base, once)."""
        if isinstance(received, bytes | bytearray | memoryview):
            received = SHARED.decode(bytes(received), self.fingerprint, self.dims)
        self.drop_staging()  # a codebook arrived: no catch-up to resume
        folder = self.path.parent / store_layout.STORE_DIR
        if isinstance(received, Delta):
            held = self.codebook()
            if held is None or Lineage.of(held) != Lineage.of(received):
                raise CodebookError(
                    f"a delta from version {received.base_version} arrived, but that codebook "
                    "is not held here"
                )
            received = SHARED.apply(held, received)
            since = self._stored or self._moved_in(held, folder)
            self._stored, manifest = store_io.save(folder, received, since)
            write_atomic(self.path, manifest)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            wire.write_file(self.path, received)
            self._stored = None
        if self._stored is None or since is None or self._stored.ref.base != since.ref.base:
            store_layout.collect(folder, [self.path])  # the bases no longer held
        stat = self.path.stat()
        self._held, self._stamp = received, (stat.st_mtime_ns, stat.st_size)
        SHARED.remember(self, received, self._stored)
        return received

    def stage(self, data: bytes, label: parts.Label, step: int, dtype: str) -> Codebook | None:
        """The part ``label`` names of a codebook sent in parts (``parts``), in ``step`` in
        ``dtype``: staged, and once every part is, the codebook they make, decoded (=
        validated) from the file they were written to and held from now on (None before).
        Until then nothing new is held: ``version_for`` says what it said before.

        Raises CodebookError (the staging dropped: the next catch-up starts again) for a part
        that does not decode or is not the manifest's, or parts that do not make a valid
        codebook of the classes announced."""
        assembled = self._assembled()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._staging().add(data, label, step, dtype, assembled):
            return None
        try:
            codebook = wire.read_file(assembled, fingerprint=self.fingerprint, dims=self.dims)
            if len(codebook) != label.classes:
                raise CodebookError(
                    f"the parts hold {len(codebook)} classes, {label.classes} announced"
                )
        except CodebookError:
            assembled.unlink(missing_ok=True)
            raise
        os.replace(assembled, self.path)
        self._stored = None
        store_layout.collect(
            self.path.parent / store_layout.STORE_DIR, [self.path]
        )  # the bases no longer held
        stat = self.path.stat()
        self._held, self._stamp = codebook, (stat.st_mtime_ns, stat.st_size)
        return codebook

    def staged_parts(self) -> bytes:
        """The version each part of the catch-up in progress is staged at
        (``Staging.versions``)."""
        return self._staging().versions()

    def drop_idle_staging(self, step: int) -> None:
        """At the sync of ``step``: forget a catch-up's parts when none was staged in the last
        ``STAGING_IDLE_STEPS`` steps (a sender that no longer catches this receiver up: it
        quarantined it, or went away). A catch-up stopped at a step's end resumes at the next
        step with the parts staged so far."""
        try:
            idle = staging_idle(step, self._staging().staged().step)
        except CodebookError:  # none, or one no catch-up can resume (an earlier release's)
            idle = True
        if idle:
            self.drop_staging()

    def drop_staging(self) -> None:
        """Forget a catch-up's parts and its assembled file (up to twice the codebook on disk):
        when a codebook arrives (nothing to catch up), or the staging is idle
        (``drop_idle_staging``)."""
        self._staging().drop()
        self._assembled().unlink(missing_ok=True)

    def _assembled(self) -> Path:
        return self.path.with_name(f".{self.path.name}.assembled")

    def _staging(self) -> parts.Staging:
        folder = self.path.parent / STAGING_DIR
        return parts.Staging(folder, fingerprint=self.fingerprint, dims=self.dims)

    def _moved_in(self, held: Codebook, folder: Path) -> store_io.Stored:
        """The held whole file as the base of a store (its bytes linked, not copied)."""
        base = store_io.new_name(held.version)
        store_io.link_base(self.path, folder, base)
        ref = store_layout.Ref(base, base.replace("base-", "log-", 1))
        return store_io.Stored(held, ref, (folder / base).stat().st_size)

    def forget(self) -> None:
        """Hold nothing (the next message must carry the whole codebook)."""
        self.path.unlink(missing_ok=True)
        self.drop_staging()
        store_layout.collect(self.path.parent / store_layout.STORE_DIR, [])
        self._held, self._stored = None, None
