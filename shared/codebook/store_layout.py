"""Where a stored codebook's bytes are: a base, the records of its changes, and a manifest.

A federation's codebook grows to thousands of classes (about 2 GB at 10,000 paper-dims
classes), but a phase changes a few classes' fields (and a step every class's aligned head).
So a codebook is kept as a **base** (a whole codebook file) and an append-only **log** of
records, each holding the entries a save changed with only their changed fields; a small
**manifest** names the base and the records that apply to it, in order, and is the one commit
point (written atomically by its owner). A crash after a record is appended but before the
manifest is written leaves a record no manifest names: it is never read, and goes when its log
does. Several manifests may share a base and a prefix of its log (the last good checkpoint, a
step's start, kept steps): a rollback is a manifest naming an older prefix, no bytes copied.

A manifest is a framed ``pb.Codebook`` (``framing``) with the codebook's header and metadata and
one entry per class (name, count, version, frozen; no tensors), its store named under
``MANIFEST_KEY``: what ``starfed server status`` reads, without torch, in milliseconds. The store
folder (``STORE_DIR``) sits beside the manifest, or one folder up (``checkpoints/``)::

    codebook-store/base-<version>-<token>.bin   a whole codebook file (``wire.write_file``)
    codebook-store/log-<version>-<token>.bin    frames appended after it (``framing.frame``)

Reading and decoding are ``wire``'s (``wire.read_file`` reads a manifest as the codebook it
names), writing is ``store_io``'s; this module is the layout, without torch. ``verify`` is
``starfed server check``'s reading of a store: every byte checksummed and every class line
found by its field headers, no tensor decoded (``store_io.verify`` decodes them: ``--deep``).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook.framing import (
    HEADER_SIZE,
    CodebookError,
    read_message,
    unframe,
    verify_file,
)
from starfed.shared.codebook.protowalk import LENGTH_DELIMITED, VARINT, Data, fields

if TYPE_CHECKING:
    from starfed.shared.codebook.schema import ModelDims

STORE_DIR = "codebook-store"
MANIFEST_KEY = "starfed.store"  # a manifest's metadata key naming its base and records
REPLACED_KEY = "starfed.replaced"  # a record's metadata: classes whose entries it replaces whole
MANIFEST_MAX_BYTES = 64 * 2**20  # far above a 10,000-class manifest (< 1 MB): larger is a base


@dataclass(frozen=True)
class Ref:
    """A manifest's store: the base file, its log, and the (offset, length) of each record
    that applies to the base, in order."""

    base: str
    log: str
    records: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, metadata: Mapping[str, str]) -> Ref | None:
        """The store a manifest's metadata names; None for a whole codebook's metadata."""
        if MANIFEST_KEY not in metadata:
            return None
        try:
            raw = json.loads(metadata[MANIFEST_KEY])
            records = tuple((int(o), int(n)) for o, n in raw["records"])
            ref = cls(str(raw["base"]), str(raw["log"]), records)
        except (ValueError, KeyError, TypeError) as err:
            raise CodebookError(f"its store reference is damaged ({err!r})") from None
        if any(Path(name).name != name or not name for name in (ref.base, ref.log)):
            raise CodebookError("its store reference names a file outside its store")
        return ref

    def as_metadata(self) -> dict[str, str]:
        value = {"base": self.base, "log": self.log, "records": [list(r) for r in self.records]}
        return {MANIFEST_KEY: json.dumps(value, separators=(",", ":"))}

    def appended(self, offset: int, length: int) -> Ref:
        return replace(self, records=(*self.records, (offset, length)))

    @property
    def log_bytes(self) -> int:
        """The bytes of the records it applies (what a reader reads beyond the base)."""
        return sum(length for _, length in self.records)


def find_dir(manifest: Path) -> Path:
    """The store of the manifest at ``manifest``: beside it, or one folder up."""
    beside = manifest.parent / STORE_DIR
    return (
        beside
        if beside.is_dir() or not (manifest.parent.parent / STORE_DIR).is_dir()
        else (manifest.parent.parent / STORE_DIR)
    )


def records(folder: Path, ref: Ref) -> Iterator[bytes]:
    """The checksum-verified payload of each record ``ref`` applies, in order."""
    if not ref.records:
        return
    path = folder / ref.log
    try:
        file = open(path, "rb")  # noqa: SIM115 (read record by record below)
    except OSError as err:
        raise CodebookError(f"{path}: cannot be read ({err.strerror})") from None
    with file:
        size = os.fstat(file.fileno()).st_size
        for offset, length in ref.records:
            what = f"{STORE_DIR}/{ref.log} record at {offset}"
            if offset < 0 or length < 0 or offset + length > size:
                raise CodebookError(f"{what}: beyond the end of the log ({size} bytes)")
            file.seek(offset)
            yield unframe(file.read(length), what)


def missing(manifest: Path, ref: Ref) -> str | None:
    """What of ``ref``'s store is not there (a file, a record beyond its log's end), without
    reading it: the quick check of ``starfed server status``."""
    folder = find_dir(manifest)
    need = {ref.base: 0, ref.log: max((o + n for o, n in ref.records), default=0)}
    for name, size in need.items():
        path = folder / name
        if name == ref.base or size:
            if not path.is_file():
                return f"{STORE_DIR}/{name} is missing"
            if path.stat().st_size < size:
                return f"{STORE_DIR}/{name} is shorter than its manifest says (truncated)"
    return None


def header(message: pb.Codebook) -> pb.Codebook:
    """A manifest's message without its store: the codebook's header, metadata and entries
    (name, count, version, frozen), from a whole codebook's message or a manifest's."""
    out = pb.Codebook(
        schema_version=message.schema_version,
        backbone_fingerprint=message.backbone_fingerprint,
        version=message.version,
    )
    out.dims.CopyFrom(message.dims)
    out.metadata.update({k: v for k, v in message.metadata.items() if k != MANIFEST_KEY})
    for e in message.entries:
        out.entries.add(name=e.name, count=e.count, version=e.version, frozen=e.frozen)
    return out


def referenced(manifests: list[Path]) -> set[str] | None:
    """The store files the readable manifests among ``manifests`` name; None when one of them
    cannot be read (then nothing may be taken as unreferenced)."""
    names: set[str] = set()
    for path in manifests:
        try:
            if path.stat().st_size > MANIFEST_MAX_BYTES:
                continue  # a whole codebook file of the layout before the store
            ref = Ref.of(read_message(path).metadata)
        except (OSError, CodebookError):
            return None
        names |= {ref.base, ref.log} if ref else set()
    return names


def collect(folder: Path, manifests: list[Path]) -> list[str]:
    """Remove the store files in ``folder`` that no manifest names (a compacted log and its
    base, once no kept checkpoint needs them); the names removed."""
    keep = referenced(manifests)
    if keep is None or not folder.is_dir():
        return []
    gone = [p.name for p in folder.glob("*.bin") if p.name not in keep]
    for name in gone:
        (folder / name).unlink(missing_ok=True)
    return gone


_CODEBOOK = {f.name: f.number for f in pb.Codebook.DESCRIPTOR.fields}
_ENTRY = {f.name: f.number for f in pb.ClassEntry.DESCRIPTOR.fields}
_DIMS = tuple(f.number for f in pb.ModelDims.DESCRIPTOR.fields)  # d_txt, d_clip, d_vit, n_layers


@dataclass(frozen=True)
class Piece:
    """What a base or a record holds, read from its field headers (``scan``): its backbones,
    dims, whether it names a store (a manifest: never a base), and each class's line (count,
    version, frozen) by name."""

    fingerprint: str
    dims: tuple[int, ...]
    names_a_store: bool
    lines: dict[str, tuple[int, int, bool]]


def scan(data: Data, start: int, end: int, what: str) -> Piece:
    """The ``Piece`` of the ``pb.Codebook`` message in ``data[start:end]`` (bytes or a memory
    map), its tensors skipped: a walk over about 30 field headers per class."""
    fingerprint, names_a_store = "", False
    dims: tuple[int, ...] = (0, 0, 0, 0)
    lines: dict[str, tuple[int, int, bool]] = {}
    for number, kind, value, stop in fields(data, start, end, what):
        if kind != LENGTH_DELIMITED:
            continue
        if number == _CODEBOOK["entries"]:
            name, line = _line(data, value, stop, what)
            if name in lines:
                raise CodebookError(f"{what}: class {name!r} appears twice")
            lines[name] = line
        elif number == _CODEBOOK["backbone_fingerprint"]:
            fingerprint = _text(data, value, stop, what)
        elif number == _CODEBOOK["dims"]:
            found = {n: v for n, k, v, _ in fields(data, value, stop, what) if k == VARINT}
            dims = tuple(found.get(n, 0) for n in _DIMS)
        elif number == _CODEBOOK["metadata"]:
            keys = [
                _text(data, v, e, what)
                for n, k, v, e in fields(data, value, stop, what)
                if n == 1 and k == LENGTH_DELIMITED
            ]
            names_a_store |= MANIFEST_KEY in keys
    return Piece(fingerprint, dims, names_a_store, lines)


def _line(data: Data, start: int, end: int, what: str) -> tuple[str, tuple[int, int, bool]]:
    name, count, version, frozen = "", 0, 0, False
    for number, kind, value, stop in fields(data, start, end, what):
        if number == _ENTRY["name"] and kind == LENGTH_DELIMITED:
            name = _text(data, value, stop, what)
        elif kind == VARINT and number == _ENTRY["count"]:
            count = value
        elif kind == VARINT and number == _ENTRY["version"]:
            version = value
        elif kind == VARINT and number == _ENTRY["frozen"]:
            frozen = bool(value)
    return name, (count, version, frozen)


def _text(data: Data, start: int, end: int, what: str) -> str:
    try:
        return bytes(data[start:end]).decode()
    except UnicodeDecodeError:
        raise CodebookError(f"{what}: a string is not UTF-8") from None


def scan_file(path: Path) -> Piece:
    """A whole codebook file's ``Piece`` and its checksum (``verify_file``: streamed, about 1 s
    for a 2 GB base), the two at once: hashlib hashes in a thread without the GIL while the
    walk reads the pages that hold field headers. A damaged file is named by its checksum."""
    name = f"{STORE_DIR}/{path.name}"
    with ThreadPoolExecutor(max_workers=1) as pool:
        checked = pool.submit(verify_file, path, name)
        try:
            with (
                open(path, "rb") as file,
                mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data,
            ):
                piece = scan(data, HEADER_SIZE, len(data), name)
        except (CodebookError, ValueError):  # ValueError: an empty file cannot be mapped
            checked.result()  # the checksum's error, when there is one
            raise
        checked.result()
    return piece


def verify(
    manifest: Path,
    message: pb.Codebook,
    *,
    fingerprint: str,
    dims: ModelDims,
    seen: dict[tuple[str, int], Piece | Exception],
) -> None:
    """The store of the manifest ``message`` (read from ``manifest``) as a reader will find it,
    without decoding a tensor: the base's and each record's checksum, their backbones and dims,
    and every class line of the manifest (count, version, frozen) as the last piece carrying it
    says. The pieces were validated before they were written (``store_io``), and the checksums
    say they are those bytes. ``seen`` holds the pieces scanned so far, so several manifests
    sharing a base read it once. ``CodebookError`` for what a reader would refuse (``OSError``
    for a base that cannot be read)."""
    ref = Ref.of(message.metadata)
    if ref is None:
        raise CodebookError(f"{manifest}: not a store's manifest")
    folder = find_dir(manifest)
    if (ref.base, -1) not in seen:
        try:
            seen[ref.base, -1] = scan_file(folder / ref.base)
        except (CodebookError, OSError) as err:
            seen[ref.base, -1] = err  # a damaged base is read once too, however many share it
    base = seen[ref.base, -1]
    if isinstance(base, Exception):
        raise base
    todo = replace(ref, records=tuple(r for r in ref.records if (ref.log, r[0]) not in seen))
    for (offset, _), payload in zip(todo.records, records(folder, todo), strict=True):
        seen[ref.log, offset] = scan(
            payload, 0, len(payload), f"{STORE_DIR}/{ref.log} record at {offset}"
        )
    pieces = {ref.base: base}
    for offset, _ in ref.records:
        record = seen[ref.log, offset]
        assert isinstance(record, Piece)  # only a base is kept as its error
        pieces[f"{ref.log} record at {offset}"] = record
    if base.names_a_store:
        raise CodebookError(f"{STORE_DIR}/{ref.base}: a store's base is a manifest")
    want = (fingerprint, (dims.d_txt, dims.d_clip, dims.d_vit, dims.n_layers))
    lines: dict[str, tuple[int, int, bool]] = {}
    for name, piece in pieces.items():
        if (piece.fingerprint, piece.dims) != want:
            raise CodebookError(f"{STORE_DIR}/{name}: made for other backbones or dims")
        lines.update(piece.lines)
    for entry in message.entries:
        line = lines.get(entry.name)
        if line is None:
            raise CodebookError(f"class {entry.name!r} is in no record of its store")
        if line != (entry.count, entry.version, entry.frozen):
            raise CodebookError(f"class {entry.name!r} differs from its store's record")
