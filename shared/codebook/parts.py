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

The receiver stages the parts on disk (``Staging``: a deployed site answers every message in a
fresh process) and holds nothing new until the last part arrived and the assembled codebook
passed its checks — a staged codebook is never "held". A part of another lineage or version,
one out of order, or bytes that do not decode are refused with ``CodebookError`` and the
staging is dropped: the next catch-up starts again from the first part. Each part is held in
memory alone, on both sides: the sender encodes one at a time, and the receiver writes the
whole codebook file from the staged parts' messages, one after the other, then decodes it as
it decodes any held codebook.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import Codebook, CodebookError, Delta
from starfed.shared.codebook.decoding import MAX_NAME_LENGTH
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES, frame, header, read_payload
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic

#: Bytes of a message besides the tensors' data, counted generously: a tensor's tags, dtype and
#: shape; a class's tags, count, versions and frozen flag; the message's fingerprint, dims and
#: versions. A bound, not an estimate: a part never passes what was planned for it.
TENSOR_SLACK, CLASS_SLACK, HEADER_SLACK = 32, 64, 4096
STAGED_FILE = "staged.json"


@dataclass(frozen=True)
class Plan:
    """How a codebook (with its lineage in its metadata) is split: the classes of each part, in
    codebook order. The parts are encoded one at a time (``encoded``), in broadcast form."""

    codebook: Codebook
    parts: tuple[tuple[str, ...], ...]
    dtype: str
    part_bytes: int

    def encoded(self, index: int) -> bytes:
        """Part ``index``'s message (checked against the limit it was planned for)."""
        entries = {name: self.codebook[name] for name in self.parts[index]}
        data = wire.encode(replace(self.codebook, entries=entries).broadcast(), self.dtype)
        if len(data) > self.part_bytes:  # the plan counts an upper bound: never reached
            raise ValueError(f"part {index} is {len(data)} bytes, over {self.part_bytes}")
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


@dataclass(frozen=True)
class Staged:
    """What a staging holds: the codebook it assembles, the parts received so far and the
    classes they carry (the staging folder's one record)."""

    federation: str
    epoch: str
    version: int
    parts: int
    classes: int
    received: int
    carried: int = 0


class Staging:
    """Parts received so far, in ``folder`` (beside the held codebook): ``staged.json`` and one
    checksummed file per part."""

    def __init__(
        self, folder: Path, *, fingerprint: str | None = None, dims: ModelDims | None = None
    ) -> None:
        self.folder = folder
        self.fingerprint, self.dims = fingerprint, dims

    def add(self, data: bytes, index: int, parts: int, classes: int, target: Path) -> bool:
        """Stage part ``index`` of ``parts`` (of a codebook of ``classes`` classes); after the
        last, write the whole codebook file ``target`` (True). Part 0 starts a new staging.

        Raises CodebookError (and drops the staging) for a part that does not decode or
        is not the next of the codebook staged, or an assembled codebook that is not whole."""
        try:
            return self._add(data, index, parts, classes, target)
        except CodebookError:
            self.drop()
            raise

    def _add(self, data: bytes, index: int, parts: int, classes: int, target: Path) -> bool:
        if not 0 <= index < parts:
            raise CodebookError(f"part {index} of {parts} does not exist")
        part = self._decoded(data, f"part {index}")
        lineage = Lineage.of(part)
        if index == 0:
            self.drop()
            self.folder.mkdir(parents=True)
            staged = Staged(lineage.federation, lineage.epoch, part.version, parts, classes, 0)
        else:
            staged = self.staged()
            expected = (
                staged.federation,
                staged.epoch,
                staged.version,
                staged.parts,
                staged.classes,
            )
            if (lineage.federation, lineage.epoch, part.version, parts, classes) != expected:
                raise CodebookError(f"part {index} belongs to another codebook than the one staged")
            if index != staged.received:
                raise CodebookError(f"part {index} arrived, part {staged.received} was next")
        write_atomic(self.folder / f"part-{index:06d}.bin", frame(data))
        staged = replace(staged, received=index + 1, carried=staged.carried + len(part))
        write_atomic(self.folder / STAGED_FILE, json.dumps(asdict(staged)).encode())
        if staged.received < parts:
            return False
        if staged.carried != staged.classes:
            raise CodebookError(f"the parts hold {staged.carried} classes, {classes} announced")
        self._write(staged, target)
        return True

    def _decoded(self, data: bytes, what: str) -> Codebook:
        part = wire.decode_broadcast(data, fingerprint=self.fingerprint, dims=self.dims)
        if isinstance(part, Delta):
            raise CodebookError(f"{what} is a delta, not a codebook's classes")
        return part

    def staged(self) -> Staged:
        """What the staging holds; CodebookError when it holds nothing."""
        try:
            raw = json.loads((self.folder / STAGED_FILE).read_text())
            return Staged(**raw)
        except (OSError, ValueError, TypeError) as err:
            raise CodebookError(f"no staged codebook to add a part to ({err})") from None

    def _write(self, staged: Staged, target: Path) -> None:
        """The staged parts as one codebook file at ``target``, one part in memory at a time:
        their messages one after the other, which protobuf reads as one message holding every
        part's classes in order (each part's other fields are the same: lineage and version
        checked as they arrived, fingerprint and dims the receiver's). The receiver then
        decodes the file whole (``HeldCodebook.stage``), which refuses a class sent twice; the
        parts are not parsed again here (each was decoded as it arrived)."""
        digest, length = hashlib.sha256(), 0
        for payload in self._payloads(staged):
            digest.update(payload)
            length += len(payload)
        pieces = itertools.chain([header(length, digest.digest())], self._payloads(staged))
        write_atomic(target, pieces)
        self.drop()

    def _payloads(self, staged: Staged) -> Iterator[bytes]:
        for index in range(staged.parts):
            yield read_payload(self.folder / f"part-{index:06d}.bin", DEFAULT_MAX_BYTES)

    def drop(self) -> None:
        """Forget every staged part."""
        shutil.rmtree(self.folder, ignore_errors=True)
