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
names), writing is ``stored``'s; this module is the layout, without torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook.framing import CodebookError, read_message, unframe

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
    return beside if beside.is_dir() or not (manifest.parent.parent / STORE_DIR).is_dir() else (
        manifest.parent.parent / STORE_DIR)  # fmt: skip


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
            what = f"{path} record at {offset}"
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
