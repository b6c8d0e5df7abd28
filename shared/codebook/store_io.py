"""A codebook saved to and loaded from a store (``store_layout``: where its bytes are): a save
writes what changed since the last save, and a manifest.

A save appends one record to the log of the state it follows: the entries that differ from that
state, each with only the fields that differ, found by identity (a new ``Codebook`` shares every
entry and tensor it does not change, ``Codebook.set_values``) — so its bytes follow what the
phase changed, not the codebook's size. The record is validated before it is written (decoded
as a reader will), and the manifest that commits it is returned for its owner to write
atomically. A new base (a whole codebook file) is written when there is no state to follow (a
new store, a codebook read from a file of the layout before), or when the records a manifest
applies have grown past twice its base: then a reader's work stays within three codebooks'
bytes, and the base's cost, spread over the saves that grew the log, stays below half of what
they wrote (docs/federation.md, the federation folder).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import schema, store_layout, wire
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.decoding import label
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.framing import frame, read_message
from starfed.shared.files import write_atomic

COMPACT_AT = 2  # a new base once the records applied pass this many times the base's bytes


@dataclass(frozen=True)
class Stored:
    """A codebook as a manifest names it: what the next save writes the changes from."""

    codebook: Codebook
    ref: store_layout.Ref
    base_bytes: int


def load(
    path: Path, *, fingerprint: str | None = None, dims: schema.ModelDims | None = None
) -> tuple[Codebook, Stored | None]:
    """The codebook of the file ``path`` (a manifest, or a whole codebook of the layout before
    the store: then no ``Stored``); the file is read once."""
    message = read_message(path)
    ref = store_layout.Ref.of(message.metadata)
    if ref is None:
        return wire.read_file(path, fingerprint=fingerprint, dims=dims), None
    codebook = wire.read_manifest(path, message, fingerprint=fingerprint, dims=dims)
    base_bytes = (store_layout.find_dir(path) / ref.base).stat().st_size
    return codebook, Stored(codebook, ref, base_bytes)


def save(folder: Path, codebook: Codebook, since: Stored | None) -> tuple[Stored, bytes]:
    """Write ``codebook`` into the store ``folder`` as the changes since ``since`` (a record
    appended to its log; none when nothing changed) or as a new base; the stored state and the
    manifest bytes that commit it. ``CodebookError`` (``wire.InvalidValue`` for a value) when it
    cannot be kept: nothing is written then."""
    folder.mkdir(parents=True, exist_ok=True)
    same_line = since is not None and (since.codebook.fingerprint, since.codebook.dims) == (
        codebook.fingerprint,
        codebook.dims,
    )
    if since is None or not same_line:
        return _new_base(folder, codebook)
    changes, replaced = _changes(since.codebook, codebook)
    if not changes:
        return Stored(codebook, since.ref, since.base_bytes), manifest(codebook, since.ref)
    data = frame(_record(codebook, changes, replaced))
    if since.ref.log_bytes + len(data) > COMPACT_AT * since.base_bytes:
        return _new_base(folder, codebook)
    offset = _append(folder / since.ref.log, data)
    ref = since.ref.appended(offset, len(data))
    return Stored(codebook, ref, since.base_bytes), manifest(codebook, ref)


def manifest(codebook: Codebook, ref: store_layout.Ref) -> bytes:
    """The framed manifest of ``codebook`` stored at ``ref``."""
    lines = {n: replace(e, values={}, field_versions={}) for n, e in codebook.entries.items()}
    message = store_layout.header(wire.to_proto(replace(codebook, entries=lines)))
    message.metadata.update(ref.as_metadata())
    return frame(message.SerializeToString(deterministic=True))


def manifest_of(whole: Path, base: str) -> bytes:
    """The manifest of the whole codebook file ``whole`` moved into a store as ``base``."""
    message = store_layout.header(read_message(whole))
    message.metadata.update(store_layout.Ref(base, base.replace("base-", "log-", 1)).as_metadata())
    return frame(message.SerializeToString(deterministic=True))


def link_base(whole: Path, folder: Path, name: str) -> None:
    """The whole codebook file ``whole`` named ``name`` in the store ``folder`` (a hard link:
    no bytes copied; a copy where the file system has none). ``whole`` is replaced by a
    manifest right after, so damage in place never reaches both."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.link(whole, folder / name)
    except OSError:
        write_atomic(folder / name, whole.read_bytes())


def new_name(version: int) -> str:
    """A fresh base's file name (its log's: ``log-`` instead of ``base-``)."""
    return f"base-{version:06d}-{uuid.uuid4().hex[:8]}.bin"


def _new_base(folder: Path, codebook: Codebook) -> tuple[Stored, bytes]:
    name = new_name(codebook.version)
    wire.write_file(folder / name, codebook)  # validated before it is written
    ref = store_layout.Ref(name, name.replace("base-", "log-", 1))
    stored = Stored(codebook, ref, (folder / name).stat().st_size)
    return stored, manifest(codebook, ref)


def _changes(before: Codebook, after: Codebook) -> tuple[dict[str, ClassEntry], list[str]]:
    """The entries of ``after`` that are not ``before``'s, each with the fields that are not
    (by identity), and the classes written whole (new, or with a field gone)."""
    changes, replaced = {}, []
    for name, entry in after.entries.items():
        old = before.entries.get(name)
        if old is entry:
            continue
        if old is None or set(old.values) - set(entry.values):
            absent = [f for f in schema.TENSORS if f not in entry.values]
            if absent:
                raise CodebookError(f"{label(name)}: {absent[0]}: missing")
            changes[name] = entry
            replaced.append(name)
            continue
        values = (
            {f: v for f, v in entry.values.items() if old.values[f] is not v}
            if all(f in old.values for f in entry.values)
            else dict(entry.values)
        )
        stamps = {f: entry.field_versions[f] for f in values if f in entry.field_versions}
        if values or (old.count, old.version, old.frozen) != (
            entry.count,
            entry.version,
            entry.frozen,
        ):
            changes[name] = replace(entry, values=values, field_versions=stamps)
    return changes, replaced


def _record(codebook: Codebook, changes: dict[str, ClassEntry], replaced: list[str]) -> bytes:
    """A record's payload, decoded (= validated) before it is returned."""
    record = Codebook(
        codebook.fingerprint,
        codebook.dims,
        changes,
        codebook.version,
        {store_layout.REPLACED_KEY: json.dumps(replaced)},
    )
    payload = wire.encode(record)
    wire.decode_changes(payload, fingerprint=codebook.fingerprint, dims=codebook.dims)
    return payload


def _append(path: Path, data: bytes) -> int:
    """``data`` appended to ``path`` and made durable; where it starts."""
    new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = 0
        while written < len(data):
            written += os.write(fd, memoryview(data)[written:])
        os.fsync(fd)
        end = os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)
    if new:  # the new file's name must survive a power cut too
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return end - len(data)


def verify(
    path: Path,
    ref: store_layout.Ref,
    names: list[str],
    *,
    fingerprint: str,
    dims: schema.ModelDims,
    seen: dict[tuple[str, int], frozenset[str]],
) -> None:
    """Read the store of the manifest at ``path`` as a reader would, each base and record
    decoded once across calls that share ``seen`` (the classes found in each): many manifests
    share a base (``starfed server check``). ``CodebookError`` for what a reader would refuse."""
    folder = store_layout.find_dir(path)
    if (ref.base, -1) not in seen:
        base = folder / ref.base
        if store_layout.Ref.of(read_message(base).metadata) is not None:
            raise CodebookError(f"{base}: a store's base is a manifest")
        codebook = wire.read_file(base, fingerprint=fingerprint, dims=dims)
        seen[ref.base, -1] = frozenset(codebook.names)
        del codebook
    found = set(seen[ref.base, -1])
    for (offset, _), payload in zip(ref.records, store_layout.records(folder, ref), strict=True):
        if (ref.log, offset) not in seen:
            changes, _ = wire.decode_changes(payload, fingerprint=fingerprint, dims=dims)
            seen[ref.log, offset] = frozenset(changes)
        found |= seen[ref.log, offset]
    lost = [name for name in names if name not in found]
    if lost:
        raise CodebookError(f"class {lost[0]!r} is in no record of its store")


def relabelled(message: pb.Codebook, metadata: dict[str, str]) -> bytes:
    """The framed manifest ``message`` with ``metadata`` instead of its own, naming the same
    store bytes (``starfed server repair``: a restored checkpoint on a new version line)."""
    ref = store_layout.Ref.of(message.metadata)
    if ref is None:
        raise CodebookError("a relabelled codebook must be a store's manifest")
    out = store_layout.header(message)
    out.metadata.clear()
    out.metadata.update({**metadata, **ref.as_metadata()})
    return frame(out.SerializeToString(deterministic=True))
