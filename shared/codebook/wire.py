"""Codebooks and updates as protobuf bytes (``proto/codebook.proto``) and as files.

Decoding is validating: whatever comes from outside is checked, once, into a typed value the
rest of the code trusts — each value by ``decoding`` (header, entries, tensors, mixtures,
names), the message size here (before parsing), and an update against the codebook its phase
was sent with: the same version, the classes registered there, exactly the fields its phase
trains. A received message's tensors are views of its bytes (``tensor_views``). Any failure
raises ``CodebookError`` with a one-line reason; nothing is half-applied.

Files are frames (``framing``: magic, length, sha256, payload), written atomically. A file holds
a whole codebook and nothing else: a delta or an update is a message, meaningful only against
the codebook it was made from, so neither is ever written to a file (``write_file`` refuses
them).

float16 on the wire (``dtype="float16"``) halves the per-class tensors; mixtures stay float64
because their statistics are averaged across sites and tasks. Round-to-nearest keeps 11
significant bits: values in float16's normal range (6.1e-5 <= |x| <= 65504) come back with a
relative error of at most 2**-11, smaller ones with an absolute error of at most 2**-25; larger
ones do not fit and encoding raises ``CodebookError``. Decoding always yields float32.
Sizes at the paper's dims are in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict, TypeVar, Unpack, cast, overload

import numpy as np
from google.protobuf.message import Message

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import schema, store_layout
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError, Delta
from starfed.shared.codebook.decoding import (
    NUMPY_DTYPES,
    SCHEMA_VERSION,
    check_count,
    check_names,
    decode_entries,
    decode_header,
    decode_values,
    label,
    present_fields,
)
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES  # re-exported
from starfed.shared.codebook.framing import frame, payload_checked_alongside, read_message
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.codebook.tensor_views import (
    CODEBOOK_ENTRIES,
    EntryViews,
    quiet_read_only_views,
    tensor_views,
)
from starfed.shared.codebook.tensor_views import check_parts as check_parts  # re-exported
from starfed.shared.files import write_atomic
from starfed.shared.protocol import Phase

WIRE_DTYPES: dict[str, pb.DType] = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16}


class InvalidValue(CodebookError):
    """A value of one class's field that the codebook cannot hold (non-finite, beyond the wire
    dtype's range, a count that does not fit): where it is, for the step that must roll back."""

    def __init__(self, message: str, name: str, field: str) -> None:
        super().__init__(message)
        self.name, self.field = name, field


_Message = TypeVar("_Message", bound=Message)


def parse(message_type: type[_Message], data: bytes, max_bytes: int | None) -> _Message:
    """Parse with the size limit checked first (None: a file's payload, bounded by the file);
    every parser failure becomes CodebookError."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodebookError(f"expected bytes, got {type(data).__name__}")
    if max_bytes is not None and len(data) > max_bytes:
        raise CodebookError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    message = message_type()
    try:
        message.ParseFromString(bytes(data))
    except Exception as err:  # DecodeError, invalid UTF-8, recursion limits, ...
        raise CodebookError(f"not a valid {message_type.__name__} message ({err})") from None
    return message


class Expected(TypedDict, total=False):
    """What a receiver checks a codebook message against (``decode_broadcast``'s keywords, with
    their defaults there): its backbones' ``fingerprint`` and ``dims`` when it has them, and the
    message's ``max_bytes``."""

    fingerprint: str | None
    dims: ModelDims | None
    max_bytes: int | None


def decode_codebook(data: bytes, **expected: Unpack[Expected]) -> Codebook:
    """A validated codebook, never a delta; ``expected``: as for ``decode_broadcast``."""
    received = decode_broadcast(data, **expected)
    if isinstance(received, Delta):
        raise CodebookError("a delta, not a whole codebook")
    return received


def decode_broadcast(
    data: bytes,
    *,
    fingerprint: str | None = None,
    dims: ModelDims | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> Codebook | Delta:
    """A validated codebook, or a delta when the message has a base version."""
    message = parse(pb.Codebook, data, max_bytes)
    return broadcast_from_proto(message, fingerprint=fingerprint, dims=dims)


def broadcast_from_proto(
    message: pb.Codebook,
    *,
    fingerprint: str | None = None,
    dims: ModelDims | None = None,
    views: list[EntryViews] | None = None,
) -> Codebook | Delta:
    """``decode_broadcast`` of a message parsed elsewhere: a gRPC reply carries the codebook
    message itself, its size limited by the channel (``starfed.ops.follow``);
    ``views``: its entries' tensor bytes in the bytes it was parsed from (``tensor_views``)."""
    model_dims = decode_header(message, fingerprint, dims)
    check_count(message.version, 0, "codebook version")
    metadata = dict(message.metadata)
    if message.base_version == 0:
        if message.names:
            raise CodebookError("a whole codebook lists no names")
        entries = decode_entries(message, model_dims, full=True, views=views)
        return Codebook(
            message.backbone_fingerprint, model_dims, entries, message.version, metadata
        )
    if not 0 < message.base_version <= message.version:  # equal: nothing changed (a catch-up)
        raise CodebookError(
            f"a delta from version {message.base_version} to {message.version} goes backwards"
        )
    names = list(message.names)
    check_names(names)
    entries = decode_entries(message, model_dims, full=False)
    if not set(entries) <= set(names):
        raise CodebookError("a delta carries a class its name list leaves out")
    return Delta(
        message.backbone_fingerprint,
        model_dims,
        message.version,
        message.base_version,
        tuple(names),
        entries,
        metadata,
    )


def decode_update(
    data: bytes,
    *,
    against: Codebook,
    phase: Phase,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int | None = None,
) -> ClientUpdate:
    """A validated update answering ``phase`` of the codebook ``against`` (what was sent).

    Sync answers no codebook: its classes may be new, it carries names and counts only, and its
    base version is the version of the codebook the site holds. Every other phase must start
    from ``against``'s version, name registered classes only, and carry exactly the fields its
    phase trains for each of them. Its parts are counted before they are parsed
    (``check_parts``): at most ``max_entries`` entries (default: ``against``'s classes, or for a
    sync, whose classes may be new, only the byte limit).
    """
    if max_entries is None and phase is not Phase.SYNC:
        max_entries = len(against)
    if max_entries is not None and isinstance(data, bytes | bytearray | memoryview):
        if max_bytes is not None and len(data) > max_bytes:
            raise CodebookError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
        check_parts(data, max_entries)
    message = parse(pb.ClientUpdate, data, max_bytes)
    dims = decode_header(message, against.fingerprint, against.dims)
    if int(message.phase) != phase:
        found = pb.Phase.Name(message.phase) if message.phase in pb.Phase.values() else "?"
        raise CodebookError(f"update answers {found}, not PHASE_{phase.name}")
    check_names([e.name for e in message.entries])
    wanted = set(schema.trained_in(phase))
    tensors = isinstance(data, bytes) and bool(wanted)
    views = tensor_views(data) if tensors else [None] * len(message.entries)
    if len(views) != len(message.entries):
        raise CodebookError("the update's entries do not match its bytes")
    quiet_read_only_views()
    entries = []
    for msg, entry_views in zip(message.entries, views, strict=True):
        what = label(msg.name)
        if msg.version or msg.frozen:
            raise CodebookError(f"{what}: an update cannot set version/frozen")
        check_count(msg.count, 1, what)
        if present_fields(msg) != wanted:
            raise CodebookError(
                f"{what}: carries {sorted(present_fields(msg)) or 'no fields'}, "
                f"{phase.key} carries {sorted(wanted) or 'none'}"
            )
        values = decode_values(msg, dims, entry_views)
        if phase is not Phase.SYNC and msg.name not in against:
            raise CodebookError(f"{what} is not registered")
        entries.append(ClassEntry(msg.name, msg.count, values))
    if phase is not Phase.SYNC and message.base_version != against.version:
        raise CodebookError(
            f"update starts from codebook version {message.base_version}, "
            f"the codebook is at {against.version} (stale or foreign reply)"
        )
    check_count(message.base_version, 0, "base version")
    return ClientUpdate(
        message.backbone_fingerprint,
        dims,
        phase,
        message.base_version,
        tuple(entries),
        dict(message.metadata),
    )


# --- encoding -------------------------------------------------------------------------------------


def _fill_tensor(target: pb.Tensor, value: np.ndarray, dtype: pb.DType, what: str) -> None:
    with np.errstate(over="ignore"):  # overflow shows as inf, reported below
        wire = np.asarray(value, dtype=NUMPY_DTYPES[dtype])  # tobytes() is C order
    if not np.isfinite(wire).all():
        raise CodebookError(f"{what}: NaN, infinite or beyond the range of {pb.DType.Name(dtype)}")
    target.shape[:] = wire.shape
    target.dtype = dtype
    target.data = wire.tobytes()


def _fill_count(target: pb.ClassEntry | pb.Mixture, count: int, what: str) -> None:
    """``target.count``: an int64 of the message; a count that does not fit is refused."""
    if not 0 <= count < 2**63:
        raise CodebookError(f"{what}: count {count!r} does not fit an int64")
    target.count = count


def _fill_entry(target: pb.ClassEntry, entry: ClassEntry, dtype: pb.DType) -> None:
    target.name = entry.name
    _fill_count(target, entry.count, label(entry.name))
    for name, version in entry.field_versions.items():
        target.field_versions[name] = version
    for name, value in entry.values.items():
        what = f"{entry.name}/{name}"
        try:
            if isinstance(value, GaussianMixture):
                mixture = getattr(target, name)
                for part in ("weights", "means", "variances"):
                    array = getattr(value, part).detach().cpu().numpy()
                    _fill_tensor(getattr(mixture, part), array, pb.DTYPE_FLOAT64, what)
                _fill_count(mixture, value.count, what)
            else:
                _fill_tensor(getattr(target, name), value.detach().cpu().numpy(), dtype, what)
        except CodebookError as err:
            raise InvalidValue(str(err), entry.name, name) from None


def _dims_proto(dims: ModelDims) -> pb.ModelDims:
    return pb.ModelDims(
        d_txt=dims.d_txt, d_clip=dims.d_clip, d_vit=dims.d_vit, n_layers=dims.n_layers
    )


class _Header(TypedDict):
    schema_version: int
    backbone_fingerprint: str
    dims: pb.ModelDims
    metadata: Mapping[str, str]


@overload
def to_proto(value: Codebook | Delta, dtype: str = "float32") -> pb.Codebook: ...
@overload
def to_proto(value: ClientUpdate, dtype: str = "float32") -> pb.ClientUpdate: ...
def to_proto(
    value: Codebook | Delta | ClientUpdate, dtype: str = "float32"
) -> pb.Codebook | pb.ClientUpdate:
    """The protobuf message: per-class tensors in ``dtype`` (float32/float16), mixtures float64."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r}")
    wire = WIRE_DTYPES[dtype]
    header: _Header = {
        "schema_version": SCHEMA_VERSION,
        "backbone_fingerprint": value.fingerprint,
        "dims": _dims_proto(value.dims),
        "metadata": value.metadata,
    }
    if isinstance(value, Codebook | Delta):
        book = pb.Codebook(version=value.version, **header)
        if isinstance(value, Delta):
            book.base_version = value.base_version
            book.names[:] = value.names
        for entry in value.entries.values():
            target = book.entries.add(version=entry.version, frozen=entry.frozen)
            _fill_entry(target, entry, wire)
        return book
    phase = cast(pb.Phase, int(value.phase))  # Phase's values are the wire enum's numbers
    update = pb.ClientUpdate(base_version=value.base_version, phase=phase, **header)
    for entry in value.entries:
        _fill_entry(update.entries.add(), entry, wire)
    return update


def encode(value: Codebook | Delta | ClientUpdate, dtype: str = "float32") -> bytes:
    """Deterministic serialisation (same value, same bytes)."""
    return to_proto(value, dtype).SerializeToString(deterministic=True)


# --- files ----------------------------------------------------------------------------------------


def write_file(path: str | os.PathLike[str], codebook: Codebook, dtype: str = "float32") -> None:
    """Atomically replace ``path`` with header (magic, length, sha256) + the codebook's message,
    after decoding (= validating) that message: nothing a reader would refuse is ever written,
    so a file on disk is always one that loads.

    Only a whole codebook is written: a ``Delta`` or a ``ClientUpdate`` is a ``TypeError`` (see
    the module docstring)."""
    if not isinstance(codebook, Codebook):
        raise TypeError(f"a file holds a whole codebook, not a {type(codebook).__name__}")
    kept = _last_written.get(dtype)
    if kept is not None and kept[0] is codebook:
        framed = kept[1]
    else:
        payload = encode(codebook, dtype)
        decode_codebook(
            payload, fingerprint=codebook.fingerprint, dims=codebook.dims, max_bytes=None
        )
        framed = frame(payload)
        _last_written[dtype] = codebook, framed
    write_atomic(path, framed)


#: The last codebook ``write_file`` wrote in each dtype (kept with it: its id stays its own),
#: with its framed bytes: a simulation's process writes one received codebook into thousands of
#: sites' folders, and an immutable ``Codebook`` encodes to the same bytes every time.
_last_written: dict[str, tuple[Codebook, bytes]] = {}


def read_version(
    path: str | os.PathLike[str],
    *,
    fingerprint: str | None = None,
    dims: ModelDims | None = None,
) -> tuple[int, dict[str, str]]:
    """A codebook file's version and metadata, without decoding its classes
    (``framing.read_message``), its header checked (schema, backbones) as ``read_file`` does;
    the values were validated when the file was written (``write_file``), and the checksum says
    they are the same. What a receiver announces at every sync (``HeldCodebook.version_for``)."""
    message = read_message(path)
    decode_header(message, fingerprint, dims)
    return message.version, dict(message.metadata)


def read_file(
    path: str | os.PathLike[str],
    *,
    fingerprint: str | None = None,
    dims: ModelDims | None = None,
    max_bytes: int | None = None,
) -> Codebook:
    """Read, verify the checksum, decode and validate (``OSError`` if unreadable). A file has no
    size limit unless the caller sets one (``framing``).
    A manifest (``store_layout``) reads as the codebook it names: its base, then its records."""
    with payload_checked_alongside(path, max_bytes) as payload:
        message = parse(pb.Codebook, payload, max_bytes)
        if store_layout.MANIFEST_KEY not in message.metadata:
            return _whole(message, payload, fingerprint, dims)
    del payload
    return read_manifest(Path(path), message, fingerprint=fingerprint, dims=dims)


def _whole(
    message: pb.Codebook, payload: bytes, fingerprint: str | None, dims: ModelDims | None
) -> Codebook:
    """The whole codebook ``message`` parsed from a file's ``payload``: its tensors are views
    of the payload's bytes, not copies of them (a 10,000-class codebook is 0.9-2 GB: each copy
    costs seconds, ``starfed predict``'s load included; docs/benchmarks.md, issue 34). Nothing
    writes to a codebook's values (a ``Codebook`` is immutable; a bank copies them)."""
    quiet_read_only_views()
    views = tensor_views(payload, CODEBOOK_ENTRIES) if message.base_version == 0 else None
    received = broadcast_from_proto(message, fingerprint=fingerprint, dims=dims, views=views)
    if isinstance(received, Delta):
        raise CodebookError("a delta, not a whole codebook")
    return received


def decode_changes(
    data: bytes, *, fingerprint: str | None, dims: ModelDims | None
) -> tuple[dict[str, ClassEntry], set[str]]:
    """A store record (``store_layout``): the entries it carries, each with only the fields that
    changed (validated as a delta's), and the classes whose entries it replaces whole."""
    message = parse(pb.Codebook, data, None)
    model_dims = decode_header(message, fingerprint, dims)
    entries = decode_entries(message, model_dims, full=False)
    try:
        replaced = set(json.loads(message.metadata.get(store_layout.REPLACED_KEY, "[]")))
    except (ValueError, TypeError) as err:
        raise CodebookError(f"a store record's replaced classes are damaged ({err})") from None
    if not replaced <= set(entries):
        raise CodebookError("a store record replaces a class it does not carry")
    return entries, replaced


def read_manifest(
    path: Path, message: pb.Codebook, *, fingerprint: str | None, dims: ModelDims | None
) -> Codebook:
    """The codebook the manifest ``message`` (read from ``path``) names: its base with its
    records applied in order, in the manifest's class order, with its metadata."""
    ref = store_layout.Ref.of(message.metadata)
    if ref is None:
        raise CodebookError(f"{path}: not a store's manifest")
    folder = store_layout.find_dir(path)
    base_path = folder / ref.base
    with payload_checked_alongside(base_path) as base_payload:
        base_message = parse(pb.Codebook, base_payload, None)
        if store_layout.MANIFEST_KEY in base_message.metadata:
            raise CodebookError(f"{base_path}: a store's base is a manifest")
        base = _whole(base_message, base_payload, fingerprint, dims)
    del base_message, base_payload
    entries = dict(base.entries)
    for payload in store_layout.records(folder, ref):
        changes, replaced = decode_changes(payload, fingerprint=base.fingerprint, dims=base.dims)
        for name, new in changes.items():
            old = entries.get(name)
            entries[name] = (
                new
                if old is None or name in replaced
                else dataclasses.replace(
                    new,
                    values={**old.values, **new.values},
                    field_versions={**old.field_versions, **new.field_versions},
                )
            )
    return _assembled(path, message, entries, base)


def _assembled(
    path: Path, message: pb.Codebook, entries: dict[str, ClassEntry], base: Codebook
) -> Codebook:
    """The manifest's classes from ``entries``, each checked against the manifest's line."""
    kept = {}
    for line in message.entries:
        entry = entries.get(line.name)
        if entry is None:
            raise CodebookError(f"{path}: class {line.name!r} is in no record of its store")
        if (entry.count, entry.version, entry.frozen) != (line.count, line.version, line.frozen):
            raise CodebookError(f"{path}: class {line.name!r} differs from its store's record")
        absent = [f for f in schema.TENSORS if f not in entry.values]
        if absent:
            raise CodebookError(f"{label(line.name)}: {absent[0]}: missing")
        kept[line.name] = entry
    metadata = {k: v for k, v in message.metadata.items() if k != store_layout.MANIFEST_KEY}
    return Codebook(base.fingerprint, base.dims, kept, message.version, metadata)
