"""A codebook too large for one message, sent in parts: the sender's split, the receiver's staging.

A whole codebook grows with the federation's classes (≈ 86 kB per paper-dims class in float32,
docs/benchmarks.md), but a message a receiver decodes is limited (``DEFAULT_MAX_BYTES``). A
receiver that holds nothing the sender can make a small delta from — a site joining late, one
that lost its state — therefore receives the codebook in parts (the coordinator's catch-up,
``starfed.server.catch_up``): the broadcast split by classes, in codebook order, into parts of at
most ``part_bytes`` each (the run config's ``part-bytes``: at most the receiver's limit, by
default that limit; less where a proxy in front of the server carries less, or where each part
must arrive within its own timeout on a slow link). Every part is itself a whole codebook of
some classes, at the sender's version and with its lineage, so each is decoded (= validated)
as any broadcast is.

A part is named by its key (``part_key``: its lineage, the wire dtype and its classes) and has
a version (``Plan.changed``: the latest of its classes' versions). The first message of each
catch-up carries the manifest (every part's key and version, in codebook order); the receiver
answers each part with the version it has each part of the manifest staged at
(``Staging.versions``). A catch-up the sender stopped (a step's end) thus resumes with only
what the receiver lacks: the parts it has none of, whole, and for a part staged before its
classes changed the change (``Plan.patch``: one delta of the classes of as many such parts as
fit a part; a class's changed fields, a fraction of it when only its aligned head was
realigned), which the receiver applies to the parts staged (``Staging.add``).

The receiver stages the parts on disk (``Staging``: a deployed site answers every message in a
fresh process) and holds nothing new until every part of the manifest is staged and the
assembled codebook passed its checks — a staged codebook is never "held". A new manifest prunes
the staged parts it does not name (so the staging never holds more than one codebook's parts);
a part of another lineage or version than the manifest staged, one whose classes are not the
manifest's, a change of a part not staged at its base version or later, or bytes that do not
decode are refused with ``CodebookError`` and the staging is
dropped. Each part is held in memory alone, on both sides: the sender encodes one at a time,
and the receiver writes the whole codebook file from the staged parts' messages, one after the
other in the manifest's order, then decodes it as it decodes any held codebook. When a staging
is abandoned for good is the receiver's rule (``starfed.shared.codebook.held``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import Codebook, CodebookError, Delta
from starfed.shared.codebook.decoding import MAX_NAME_LENGTH
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES, frame, header, read_payload
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic
from starfed.shared.protocol import CATCH_UP, CATCH_UP_PARTS, CATCH_UP_PATCHED, CATCH_UP_VERSIONS

#: Bytes of a message besides the tensors' data, counted generously: a tensor's tags, dtype and
#: shape; a class's tags, count, versions and frozen flag; the message's fingerprint, dims and
#: versions. A bound, not an estimate: a part never passes what was planned for it.
TENSOR_SLACK, CLASS_SLACK, HEADER_SLACK = 32, 64, 4096
STAGED_FILE = "staged.json"
#: Hex characters of a part's key (``part_key``): 128 bits of a SHA-256.
KEY_CHARS = 32


@dataclass(frozen=True)
class Plan:
    """How a codebook (with its lineage in its metadata) is split: the classes of each part, in
    codebook order. The parts are encoded one at a time (``encoded``), in broadcast form."""

    codebook: Codebook
    parts: tuple[tuple[str, ...], ...]
    dtype: str
    part_bytes: int

    @cached_property
    def keys(self) -> tuple[str, ...]:
        """The manifest's keys: each part's (``part_key``), in order."""
        lineage = Lineage.of(self.codebook)
        return tuple(part_key(lineage, self.dtype, names) for names in self.parts)

    @cached_property
    def changed(self) -> tuple[int, ...]:
        """Each part's version: the codebook version at which one of its classes last changed
        (a part staged at it, or later, holds what this one would)."""
        return tuple(max(self.codebook[n].version for n in names) for names in self.parts)

    def encoded(self, index: int) -> bytes:
        """Part ``index``'s message (checked against the limit it was planned for)."""
        return self._checked(self._of(self.parts[index]).broadcast(), f"part {index}")

    def patch(self, indices: Sequence[int], since: int) -> bytes:
        """What changed in parts ``indices`` since version ``since`` (each staged by the
        receiver at it or later): one delta of their classes (checked against the limit)."""
        value = self._of(self._names(indices)).delta(since)
        return self._checked(value, f"the change of parts {list(indices)}")

    def patch_bytes(self, indices: Sequence[int], since: int) -> int:
        """An upper bound on ``patch``'s bytes (``broadcast_bytes``)."""
        return broadcast_bytes(self._of(self._names(indices)), since, self.dtype)

    def _names(self, indices: Sequence[int]) -> list[str]:
        return [name for index in indices for name in self.parts[index]]

    def _of(self, names: Iterable[str]) -> Codebook:
        return replace(self.codebook, entries={n: self.codebook[n] for n in names})

    def _checked(self, value: Codebook | Delta, what: str) -> bytes:
        data = wire.encode(value, self.dtype)
        if len(data) > self.part_bytes:  # the plan counts an upper bound: never reached
            raise ValueError(f"{what} is {len(data)} bytes, over {self.part_bytes}")
        return data


def plan(codebook: Codebook, part_bytes: int, dtype: str = "float32") -> Plan:
    """The split of ``codebook`` into parts of at most ``part_bytes``, each as many classes as
    their bounds (``class_bytes``) allow."""
    header = _header_bytes(codebook)
    split: list[tuple[str, ...]] = []
    names: list[str] = []
    size = header
    for name in codebook.names:
        more = class_bytes(codebook, name, dtype)
        if header + more > part_bytes:
            raise ValueError(f"class {name!r} takes up to {more} bytes, more than a part")
        if size + more > part_bytes:
            split.append(tuple(names))
            names, size = [], header
        names.append(name)
        size += more
    split.append(tuple(names))
    return Plan(codebook, tuple(split), dtype, part_bytes)


def part_key(lineage: Lineage, dtype: str, names: Iterable[str]) -> str:
    """A part's key: its lineage, wire dtype and classes, in order. What a staged part of the
    key holds is said by its version (``Plan.changed``): a class's version names its values
    within a lineage (a rollback starts another: docs/federation.md)."""
    named = [lineage.federation, lineage.epoch, dtype, list(names)]
    return hashlib.sha256(json.dumps(named).encode()).hexdigest()[:KEY_CHARS]


def least_part_bytes(codebook: Codebook, dtype: str) -> int:
    """The most one part of one class of ``codebook``'s dims may take, its lineage in its
    metadata (as the catch-up sends it): every field sites read, a name of the longest a
    decoder accepts (``MAX_NAME_LENGTH`` characters of up to 4 bytes). A ``part_bytes`` below
    it could meet a class no part holds."""
    header = _header_bytes(replace(codebook, metadata=Lineage.of(codebook).as_metadata()))
    fields = _fields_bytes(codebook.dims, schema.BROADCAST, dtype)
    return header + fields + 4 * MAX_NAME_LENGTH + CLASS_SLACK


def broadcast_bytes(codebook: Codebook, since: int, dtype: str) -> int:
    """An upper bound on the bytes of the broadcast to a receiver that holds version ``since``:
    the delta from it, or with ``since`` 0 the whole codebook (a delta lists every name)."""
    if since == 0:
        return _header_bytes(codebook) + sum(
            class_bytes(codebook, name, dtype) for name in codebook.names
        )
    names = sum(len(name.encode()) + 8 for name in codebook.names)
    changed = (n for n, entry in codebook.entries.items() if entry.version > since)
    return (
        _header_bytes(codebook)
        + names
        + sum(class_bytes(codebook, name, dtype, since) for name in changed)
    )


def class_bytes(codebook: Codebook, name: str, dtype: str, since: int = 0) -> int:
    """An upper bound on the bytes class ``name`` adds to a broadcast: its fields sites read
    (those changed after version ``since``, all with 0), its name, ``CLASS_SLACK``."""
    entry = codebook[name]
    fields = [
        f
        for f in entry.values
        if f in schema.BROADCAST and (not since or entry.field_versions.get(f, 0) > since)
    ]
    return _fields_bytes(codebook.dims, fields, dtype) + len(name.encode()) + CLASS_SLACK


def _fields_bytes(dims: ModelDims, fields: Iterable[str], dtype: str) -> int:
    """An upper bound on the bytes of these fields' tensors in a message."""
    itemsize = np.dtype(dtype).itemsize
    shapes = (schema.BY_NAME[f].shape(dims) for f in fields)
    return sum(math.prod(shape) * itemsize + TENSOR_SLACK for shape in shapes)


def _header_bytes(codebook: Codebook) -> int:
    metadata = sum(len(k.encode()) + len(v.encode()) + 8 for k, v in codebook.metadata.items())
    return HEADER_SLACK + len(codebook.fingerprint) + metadata


def current(keys: Sequence[str], changed: Sequence[int], staged: Mapping[str, int]) -> int:
    """How many of a manifest's parts (``keys``, ``changed``) are ``staged`` at their version
    or later: the receiver's count and the sender's reading of its word."""
    return sum(staged.get(key, 0) >= version for key, version in zip(keys, changed, strict=True))


@dataclass(frozen=True)
class Label:
    """What a catch-up message says of its part: part ``index`` of ``count`` of a codebook of
    ``classes`` classes, or with ``patched`` the change of those staged parts (a delta of
    their classes: ``Plan.patch``); the first message of a catch-up also carries the manifest:
    every part's key and version (``Plan.keys``, ``Plan.changed``), in order."""

    index: int
    count: int
    classes: int
    keys: tuple[str, ...] = ()
    changed: tuple[int, ...] = ()
    patched: tuple[int, ...] = ()  # the parts a delta changes (none: the part is whole)

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Label:
        """The label a catch-up message's config carries (``server.catch_up.send`` writes it)."""
        index, count, classes = (int(value) for value in config[CATCH_UP])
        return cls(
            index,
            count,
            classes,
            tuple(str(key) for key in config.get(CATCH_UP_PARTS, [])),
            tuple(int(version) for version in config.get(CATCH_UP_VERSIONS, [])),
            tuple(int(part) for part in config.get(CATCH_UP_PATCHED, [])),
        )


@dataclass(frozen=True)
class Staged:
    """What a staging holds (the staging folder's one record): the manifest of the codebook it
    assembles (its lineage, version, classes, wire dtype, and each part's key and version),
    how many of its parts are staged at their version or later, and the step of the last
    part staged (``held``'s rule for when a staging is abandoned)."""

    federation: str
    epoch: str
    version: int
    parts: int
    classes: int
    received: int
    dtype: str = "float32"
    keys: tuple[str, ...] = ()
    changed: tuple[int, ...] = ()
    step: int = 0

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Staged:
        keys = tuple(str(key) for key in raw.get("keys", ()))
        changed = tuple(int(version) for version in raw.get("changed", ()))
        return cls(**{**raw, "keys": keys, "changed": changed})


class Staging:
    """Parts received so far, in ``folder`` (beside the held codebook): ``staged.json`` and one
    checksummed file per part, named by its key and version (``part-<key>-<version>.bin``)."""

    def __init__(
        self, folder: Path, *, fingerprint: str | None = None, dims: ModelDims | None = None
    ) -> None:
        self.folder = folder
        self.fingerprint, self.dims = fingerprint, dims

    def add(self, data: bytes, label: Label, step: int, dtype: str, target: Path) -> bool:
        """Stage ``data``, the part ``label`` names, sent in ``step`` in ``dtype``: its classes
        whole, or a delta of them from the version of the part staged; once every part of the
        manifest is staged at its version or later, write the whole codebook file ``target``
        (True). A label with a manifest starts the codebook it names, keeping the staged
        parts it names.

        Raises CodebookError (and drops the staging) for a part that does not decode or is
        not the manifest's, a delta from a version not staged, or parts that do not make a
        whole codebook."""
        try:
            return self._add(data, label, step, dtype, target)
        except CodebookError:
            self.drop()
            raise

    def _add(self, data: bytes, label: Label, step: int, dtype: str, target: Path) -> bool:
        if not 0 <= label.index < label.count:
            raise CodebookError(f"part {label.index} of {label.count} does not exist")
        sent = wire.decode_broadcast(data, fingerprint=self.fingerprint, dims=self.dims)
        lineage = Lineage.of(sent)
        announced = Staged(
            lineage.federation, lineage.epoch, sent.version, label.count, label.classes, 0, dtype
        )
        staged = self._begin(announced, label, step) if label.keys else self.staged()
        if replace(staged, received=0, keys=(), changed=(), step=0) != announced:
            raise CodebookError(
                f"part {label.index} belongs to another codebook than the one staged"
            )
        if isinstance(sent, Delta):
            if not label.patched:
                raise CodebookError(f"part {label.index} is a delta of no staged part")
            for index in label.patched:
                if not 0 <= index < staged.parts:
                    raise CodebookError(f"part {index} of {staged.parts} does not exist")
                self._patch(staged.keys[index], sent, dtype, f"part {index}")
        else:
            key = staged.keys[label.index]
            if part_key(lineage, dtype, sent.names) != key:
                raise CodebookError(
                    f"part {label.index} holds other classes than the manifest names"
                )
            self._put(key, sent.version, data)
        staged = replace(
            staged, received=current(staged.keys, staged.changed, self._versions()), step=step
        )
        write_atomic(self.folder / STAGED_FILE, json.dumps(asdict(staged)).encode())
        if staged.received < staged.parts:
            return False
        header_only = Codebook(sent.fingerprint, sent.dims, {}, sent.version, sent.metadata)
        self._write(staged, wire.encode(header_only), target)
        return True

    def _begin(self, header: Staged, label: Label, step: int) -> Staged:
        """The codebook ``header`` of the manifest ``label`` carries staged from now on: the
        staged parts it does not name pruned."""
        keys, changed = label.keys, label.changed
        if not (len(keys) == len(changed) == header.parts) or not all(map(_is_key, keys)):
            raise CodebookError(f"the manifest is not {header.parts} part keys and versions")
        if len(set(keys)) != len(keys):
            raise CodebookError("the manifest names a part twice")
        self.folder.mkdir(parents=True, exist_ok=True)
        for path in self.folder.glob("part-*.bin"):
            if path.stem.split("-")[1] not in keys:
                path.unlink()
        return replace(header, keys=keys, changed=changed, step=step)

    def _patch(self, key: str, delta: Delta, dtype: str, what: str) -> None:
        """The staged part ``key`` changed by ``delta`` (whose entries hold their values at the
        delta's version: applied to the part staged at the delta's base version or later,
        each gets its value at the delta's version), staged at that version."""
        version = self._versions().get(key, 0)
        if not delta.base_version <= version <= delta.version:
            raise CodebookError(
                f"{what}: a change from version {delta.base_version}, staged at {version}"
            )
        old = read_payload(self._file(key, version), DEFAULT_MAX_BYTES)
        part = wire.decode_broadcast(old, fingerprint=self.fingerprint, dims=self.dims)
        if isinstance(part, Delta):  # never written: a part is staged whole
            raise CodebookError(f"the staged {what} is a delta")
        changes = {n: delta.entries[n] for n in part.names if n in delta.entries}
        names = tuple(part.names)
        mine = Delta(
            part.fingerprint, part.dims, delta.version, version, names, changes, delta.metadata
        )
        self._put(key, delta.version, wire.encode(part.apply(mine), dtype))

    def _put(self, key: str, version: int, data: bytes) -> None:
        """Part ``key`` staged at ``version`` (its earlier version gone)."""
        for old in self.folder.glob(f"part-{key}-*.bin"):
            old.unlink()
        write_atomic(self._file(key, version), frame(data))

    def staged(self) -> Staged:
        """What the staging holds; CodebookError when it holds nothing."""
        try:
            return Staged.from_json(json.loads((self.folder / STAGED_FILE).read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise CodebookError(f"no staged codebook to add a part to ({err})") from None

    def versions(self) -> bytes:
        """The version each part of the staged manifest is staged at (0: not staged), as
        little-endian 64-bit integers (nothing staged: no bytes). What the receiver tells the
        sender, which sends only what changed since (``starfed.server.catch_up``)."""
        try:
            staged = self.staged()
        except CodebookError:
            return b""
        versions = self._versions()
        return struct.pack(f"<{staged.parts}Q", *(versions.get(k, 0) for k in staged.keys))

    def _versions(self) -> dict[str, int]:
        """Each staged part's version, by key (from the files' names)."""
        versions = {}
        for path in self.folder.glob("part-*-*.bin"):
            _, key, version = path.stem.split("-")
            versions[key] = int(version)
        return versions

    def _file(self, key: str, version: int) -> Path:
        return self.folder / f"part-{key}-{version}.bin"

    def _write(self, staged: Staged, trailer: bytes, target: Path) -> None:
        """The staged parts as one codebook file at ``target``, one part in memory at a time:
        their messages one after the other in the manifest's order, then ``trailer`` (the
        codebook's header without classes: a part staged at an earlier version says that
        version, and protobuf keeps a field's last value), which protobuf reads as one message
        holding every part's classes in order (each part's other fields are the same: lineage
        checked as they arrived, fingerprint and dims the receiver's). The receiver then decodes
        the file whole (``HeldCodebook.stage``), which refuses a class sent twice; the parts are
        not parsed again here (each was decoded as it arrived)."""
        digest, length = hashlib.sha256(), 0
        for payload in self._payloads(staged, trailer):
            digest.update(payload)
            length += len(payload)
        pieces = itertools.chain([header(length, digest.digest())], self._payloads(staged, trailer))
        write_atomic(target, pieces)
        self.drop()

    def _payloads(self, staged: Staged, trailer: bytes) -> Iterator[bytes]:
        versions = self._versions()
        for key in staged.keys:
            yield read_payload(self._file(key, versions[key]), DEFAULT_MAX_BYTES)
        yield trailer

    def drop(self) -> None:
        """Forget every staged part."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _is_key(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == KEY_CHARS
        and all(c in "0123456789abcdef" for c in value)
    )
