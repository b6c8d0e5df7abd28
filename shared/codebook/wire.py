"""Codebooks and updates as protobuf bytes (``proto/codebook.proto``) and as files.

Decoding is validating: whatever comes from outside is checked here, once, into a typed value
the rest of the code trusts — schema version, fingerprint and dims (against the receiver's),
tensor dtypes, byte lengths and shapes (from ``schema.FIELDS``), finite values, counts, mixture
weights and variances, class names, and the message size (checked before parsing). An update
is also checked against the codebook its phase was sent with: the same version, the classes
registered there, exactly the fields its phase trains. Any failure raises ``CodebookError``
with a one-line reason; nothing is half-applied.

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
import functools
import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypedDict, TypeVar, cast, overload

import numpy as np
import torch
from google.protobuf.message import Message

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import schema, store
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError, Delta
from starfed.shared.codebook.entry import ClassEntry, Value
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES  # re-exported
from starfed.shared.codebook.framing import frame, payload_checked_alongside, read_message
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.files import write_atomic
from starfed.shared.protocol import Phase

SCHEMA_VERSION = 1
MAX_NAME_LENGTH = 256
MAX_DIM = 65_536  # far above any CLIP/ViT width or depth; bounds what a message can allocate
WEIGHT_SUM_TOLERANCE = 1e-6

_NUMPY_DTYPES: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
}
WIRE_DTYPES: dict[str, pb.DType] = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16}


class InvalidValue(CodebookError):
    """A value of one class's field that the codebook cannot hold (non-finite, beyond the wire
    dtype's range, a count that does not fit): where it is, for the step that must roll back."""

    def __init__(self, message: str, name: str, field: str) -> None:
        super().__init__(message)
        self.name, self.field = name, field


# --- checks of decoded values ---------------------------------------------------------------------


def label(name: str) -> str:
    """A class name for an error message, cut short: a hostile name must not flood logs."""
    return f"class {name[:60]!r}" + ("…" if len(name) > 60 else "")


def check_name(name: object) -> str | None:
    """Why ``name`` is not a valid class name, or None."""
    if not isinstance(name, str) or not name:
        return "a class name is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"{label(name)} has a name longer than {MAX_NAME_LENGTH}"
    if not name.isprintable():
        return f"{label(name)}: name contains control characters"
    return None


def _check_names(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        problem = check_name(name)
        if problem:
            raise CodebookError(problem)
        if name in seen:
            raise CodebookError(f"{label(name)} appears twice")
        seen.add(name)


def _check_count(count: int, minimum: int, what: str) -> None:
    if count < minimum:
        raise CodebookError(f"{what}: count {count!r} must be an integer >= {minimum}")


def _check_mixture(mixture: GaussianMixture, what: str) -> None:
    if (mixture.weights < 0).any():
        raise CodebookError(f"{what}: negative mixture weight")
    total = float(mixture.weights.sum())
    if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise CodebookError(f"{what}: mixture weights sum to {total!r}, not 1")
    if not (mixture.variances > 0).all():
        raise CodebookError(f"{what}: variances must be positive")
    _check_count(mixture.count, 1, what)


# --- decoding -------------------------------------------------------------------------------------


def _decode_array(
    msg: pb.Tensor,
    shape: tuple[int, ...],
    what: str,
    dtypes: Iterable[int],
    to: np.dtype,
    view: memoryview | None = None,
) -> torch.Tensor:
    """The array as ``to`` (float32 tensors, float64 mixtures), checked finite after that.

    ``view`` is the tensor's ``data`` bytes inside the received message (``_tensor_views``): when
    they are already ``to`` in this machine's byte order, the array is a read-only view of them,
    not a copy (it keeps the message's bytes alive; nothing writes to an update's values)."""
    if msg.dtype not in dtypes:
        allowed = ", ".join(pb.DType.Name(d) for d in dtypes)
        raise CodebookError(f"{what}: dtype {msg.dtype} is not one of {allowed}")
    if tuple(msg.shape) != shape:
        raise CodebookError(f"{what}: shape {tuple(msg.shape)}, expected {shape}")
    dtype = _NUMPY_DTYPES[msg.dtype]
    expected = math.prod(shape) * dtype.itemsize
    data = msg.data if view is None or dtype != to else view  # '<f4' == to only little-endian
    if len(data) != expected:
        raise CodebookError(f"{what}: {len(data)} bytes of data, expected {expected}")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if data is view:
        out = array
    else:
        with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: rejected
            out = array.astype(to)
    if not np.isfinite(out).all():
        raise CodebookError(f"{what}: contains NaN or infinite values")
    return torch.from_numpy(out)


def _decode_mixture(
    msg: pb.Mixture, dim: int, what: str, views: Mapping[str, memoryview] | None = None
) -> GaussianMixture:
    """``views``: its parts' data bytes in the received message, by part name."""
    float64 = (pb.DTYPE_FLOAT64,)
    shape = tuple(msg.weights.shape)
    if len(shape) != 1 or shape[0] < 1:
        raise CodebookError(f"{what}: weights shape {shape} is not [M] with M >= 1")
    m = shape[0]
    f64 = np.dtype(np.float64)
    views = views or {}

    def part(name: str, part_shape: tuple[int, ...]) -> torch.Tensor:
        return _decode_array(getattr(msg, name), part_shape, f"{what}: {name}", float64, f64,
                             views.get(name))  # fmt: skip

    mixture = GaussianMixture(
        weights=part("weights", (m,)),
        means=part("means", (m, dim)),
        variances=part("variances", (m, dim)),
        count=msg.count,
    )
    _check_mixture(mixture, what)
    return mixture


def _present(msg: pb.ClassEntry) -> set[str]:
    return {f.name for f in schema.FIELDS if msg.HasField(f.name)}


def _decode_values(
    msg: pb.ClassEntry, dims: ModelDims, views: EntryViews | None = None
) -> dict[str, Value]:
    """The schema fields set in one entry message, decoded and checked; ``views`` are its
    tensors' data bytes in the received message, by field name (``_tensor_views``)."""
    values: dict[str, Value] = {}
    f32 = np.dtype(np.float32)
    for f in schema.FIELDS:
        if not msg.HasField(f.name):
            continue
        what = f"{label(msg.name)}: {f.name}"
        if f.kind is schema.Kind.TENSOR:
            tensor = getattr(msg, f.name)
            view = views.get(f.name) if views else None
            view = view if isinstance(view, memoryview) else None  # a tensor's view is one
            values[f.name] = _decode_array(tensor, f.shape(dims), what, _NUMPY_DTYPES, f32, view)
        else:
            parts = views.get(f.name) if views else None
            parts = parts if isinstance(parts, dict) else None  # a mixture's: one per part
            values[f.name] = _decode_mixture(getattr(msg, f.name), f.shape(dims)[0], what, parts)
    return values


def _decode_header(
    message: pb.Codebook | pb.ClientUpdate, fingerprint: str | None, dims: ModelDims | None
) -> ModelDims:
    if message.schema_version != SCHEMA_VERSION:
        raise CodebookError(
            f"schema version {message.schema_version}, this code reads {SCHEMA_VERSION}"
        )
    found = message.backbone_fingerprint
    if not found:
        raise CodebookError("backbone fingerprint is empty")
    if fingerprint is not None and found != fingerprint:
        raise CodebookError(
            f"backbone fingerprint {found[:16]!r}… does not match the expected "
            f"{fingerprint[:16]!r}… (made for other backbones)"
        )
    d = message.dims
    decoded = ModelDims(d.d_txt, d.d_clip, d.d_vit, d.n_layers)
    if not all(1 <= v <= MAX_DIM for v in (d.d_txt, d.d_clip, d.d_vit, d.n_layers)):
        raise CodebookError(f"dims must be integers in [1, {MAX_DIM}], got {decoded}")
    if dims is not None and decoded != dims:
        raise CodebookError(f"dims {decoded} do not match the expected {dims}")
    return decoded


# --- where a message's tensor bytes are ---------------------------------------------------------
# protobuf's Python API hands out a copy of every bytes field it is asked for; an update's
# tensors are most of its bytes, and the server only reads them once (to validate and add them).
# These few lines find each tensor's ``data`` inside the received bytes instead, following the
# wire format (varint tags, length-delimited fields), so the arrays can be views of them. They
# run only on a message protobuf has already parsed, and agree with it or reject it.

_LENGTH_DELIMITED = 2
_SKIP = {1: 8, 5: 4}  # fixed64, fixed32
_UPDATE_ENTRIES = pb.ClientUpdate.DESCRIPTOR.fields_by_name["entries"].number
_CODEBOOK_ENTRIES = pb.Codebook.DESCRIPTOR.fields_by_name["entries"].number
_UPDATE_METADATA = pb.ClientUpdate.DESCRIPTOR.fields_by_name["metadata"].number
_TENSOR_SHAPE = pb.Tensor.DESCRIPTOR.fields_by_name["shape"].number
#: What one update may hold besides its entries, before protobuf makes an object of each part:
#: metadata pairs, fields of an entry (its tensors, mixtures and field versions, one each per
#: schema field), fields of a tensor or mixture, and the bytes of a tensor's packed shape (a
#: handful of dimensions of up to 10 bytes each).
MAX_METADATA = 256
MAX_ENTRY_FIELDS = 4 * len(schema.FIELDS) + 8
MAX_PART_FIELDS = 16
MAX_SHAPE_BYTES = 80
_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_TENSOR_FIELDS = {
    pb.ClassEntry.DESCRIPTOR.fields_by_name[name].number: name for name in schema.TENSORS
}
_MIXTURE_FIELDS = {
    pb.ClassEntry.DESCRIPTOR.fields_by_name[name].number: name for name in schema.MIXTURES
}
_MIXTURE_PARTS = {
    field.number: field.name for field in pb.Mixture.DESCRIPTOR.fields if field.name != "count"
}
#: One entry's tensor bytes in a received message: a tensor field's view, or a mixture field's
#: views by part.
EntryViews = dict[str, "memoryview | dict[str, memoryview]"]


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(
    data: bytes, start: int, end: int, limit: int | None = None, what: str = "one message"
) -> list[tuple[int, int, int]]:
    """(field number, start, end) of every length-delimited field in ``data[start:end]``; with
    ``limit``, ``CodebookError`` as soon as there are more fields than that (of any type)."""
    fields = []
    i = start
    count = 0
    while i < end:
        count += 1
        if limit is not None and count > limit:
            raise CodebookError(f"more than {limit} fields in {what}")
        tag, i = (data[i], i + 1) if data[i] < 0x80 else _varint(data, i)
        kind = tag & 7
        if kind == _LENGTH_DELIMITED:
            length, i = (data[i], i + 1) if data[i] < 0x80 else _varint(data, i)
            fields.append((tag >> 3, i, i + length))
            i += length
        elif kind == 0:
            i = i + 1 if data[i] < 0x80 else _varint(data, i)[1]
        elif kind in _SKIP:
            i += _SKIP[kind]
        else:
            raise CodebookError(f"not a valid ClientUpdate message (unexpected wire type {kind})")
    if i != end:
        raise CodebookError("not a valid ClientUpdate message (a field runs past its end)")
    return fields


def _data_view(data: bytes, whole: memoryview, start: int, end: int, what: str) -> memoryview:
    """The ``data`` bytes of the Tensor message in ``data[start:end]``, as a view."""
    spans = [(s, e) for n, s, e in _fields(data, start, end) if n == _TENSOR_DATA]
    if len(spans) > 1:
        raise CodebookError(f"{what} appears twice in an entry")
    return whole[spans[0][0] : spans[0][1]] if spans else whole[0:0]


def check_parts(data: bytes, max_entries: int) -> None:
    """Count an update's parts in its bytes before protobuf materialises any: at most
    ``max_entries`` entries (what its site can have: e.g. the classes it reported at the sync)
    and the bounds above on everything inside them, so that decoding a reply costs memory in
    proportion to its tensors' bytes, not to the number of (empty) parts it packs."""
    try:
        what = f"the update (at most {max_entries} entries: the classes its site can send)"
        top = _fields(data, 0, len(data), limit=max_entries + MAX_METADATA + 16, what=what)
        entries = [(s, e) for n, s, e in top if n == _UPDATE_ENTRIES]
        if len(entries) > max_entries:
            raise CodebookError(f"the update carries {len(entries)} entries, at most "
                                f"{max_entries} (the classes its site can send)")  # fmt: skip
        if sum(n == _UPDATE_METADATA for n, _, _ in top) > MAX_METADATA:
            raise CodebookError(f"the update carries over {MAX_METADATA} metadata pairs")
        for start, end in entries:
            for field, f_start, f_end in _fields(data, start, end, limit=MAX_ENTRY_FIELDS):
                if field in _TENSOR_FIELDS:
                    _check_tensor(data, f_start, f_end)
                elif field in _MIXTURE_FIELDS:
                    for n, s, e in _fields(data, f_start, f_end, limit=MAX_PART_FIELDS):
                        if n in _MIXTURE_PARTS:
                            _check_tensor(data, s, e)
    except IndexError:
        raise CodebookError("not a valid ClientUpdate message (truncated)") from None


def _check_tensor(data: bytes, start: int, end: int) -> None:
    for number, s, e in _fields(data, start, end, limit=MAX_PART_FIELDS):
        if number == _TENSOR_SHAPE and e - s > MAX_SHAPE_BYTES:
            raise CodebookError(f"a tensor shape of {e - s} bytes (at most {MAX_SHAPE_BYTES})")


def _tensor_views(data: bytes, entries_field: int = _UPDATE_ENTRIES) -> list[EntryViews]:
    """Per entry of a parsed ``ClientUpdate`` (or ``Codebook``: its ``entries_field``), the
    ``data`` bytes of its tensors as views of ``data``: by field name, a tensor's view, or a
    mixture's views by part (``means``, ...). A field or part that appears twice (protobuf
    would merge the two) is rejected: no encoder of this schema writes one."""
    whole = memoryview(data)
    entries = []
    for number, start, end in _fields(data, 0, len(data)):
        if number != entries_field:
            continue
        views: EntryViews = {}
        for field, f_start, f_end in _fields(data, start, end):
            if field in _TENSOR_FIELDS:
                name = _TENSOR_FIELDS[field]
                view: memoryview | dict[str, memoryview] = _data_view(
                    data, whole, f_start, f_end, name
                )
            elif field in _MIXTURE_FIELDS:
                name, view = _MIXTURE_FIELDS[field], {}
                for n, s, e in _fields(data, f_start, f_end):
                    if n in _MIXTURE_PARTS:
                        part = _MIXTURE_PARTS[n]
                        if part in view:
                            raise CodebookError(f"{name}.{part} appears twice in an entry")
                        view[part] = _data_view(data, whole, s, e, f"{name}.{part}")
            else:
                continue
            if name in views:
                raise CodebookError(f"{name} appears twice in an entry")
            views[name] = view
        entries.append(views)
    return entries


@functools.cache
def _quiet_read_only_views() -> None:
    """An update's tensors are views of the received bytes, which are read-only; torch warns
    once per process when it wraps one (it cannot mark a tensor read-only). Nothing writes to
    an update's values, so that one warning is spent here, silenced, rather than in a log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(np.frombuffer(b"\0\0\0\0", dtype=np.float32))


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


def _decode_entries(
    message: pb.Codebook, dims: ModelDims, full: bool, views: list[EntryViews] | None = None
) -> dict[str, ClassEntry]:
    """Entries of a codebook (every tensor field required) or a delta (any subset); ``views``:
    each entry's tensor bytes in the message's bytes (``_tensor_views``)."""
    _check_names([e.name for e in message.entries])
    if views is not None and len(views) != len(message.entries):
        raise CodebookError("the codebook's entries do not match its bytes")
    entries = {}
    for i, msg in enumerate(message.entries):
        values = _decode_values(msg, dims, None if views is None else views[i])
        missing = [name for name in schema.TENSORS if name not in values]
        if full and missing:
            raise CodebookError(f"{label(msg.name)}: {missing[0]}: missing")
        trained = msg.frozen or any(name in values for name in schema.MIXTURES)
        _check_count(msg.count, 1 if trained and full else 0, label(msg.name))
        if not 0 <= msg.version <= message.version:
            raise CodebookError(
                f"{label(msg.name)}: version {msg.version!r} outside [0, {message.version}]"
            )
        stamps = dict(msg.field_versions)
        if not set(stamps) <= set(values) or not all(
            0 <= v <= msg.version for v in stamps.values()
        ):
            raise CodebookError(f"{label(msg.name)}: field versions do not match its fields")
        entries[msg.name] = ClassEntry(msg.name, msg.count, values, msg.version, msg.frozen, stamps)
    return entries


def decode_codebook(
    data: bytes,
    *,
    fingerprint: str | None = None,
    dims: ModelDims | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> Codebook:
    """A validated codebook; ``fingerprint``/``dims`` are the receiver's, when it has them."""
    received = decode_broadcast(data, fingerprint=fingerprint, dims=dims, max_bytes=max_bytes)
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
    message itself, its size limited by the channel (``starfed.shared.inference.follow``);
    ``views``: its entries' tensor bytes in the bytes it was parsed from (``_tensor_views``)."""
    model_dims = _decode_header(message, fingerprint, dims)
    _check_count(message.version, 0, "codebook version")
    metadata = dict(message.metadata)
    if message.base_version == 0:
        if message.names:
            raise CodebookError("a whole codebook lists no names")
        entries = _decode_entries(message, model_dims, full=True, views=views)
        return Codebook(
            message.backbone_fingerprint, model_dims, entries, message.version, metadata
        )
    if not 0 < message.base_version <= message.version:  # equal: nothing changed (a catch-up)
        raise CodebookError(
            f"a delta from version {message.base_version} to {message.version} goes backwards"
        )
    names = list(message.names)
    _check_names(names)
    entries = _decode_entries(message, model_dims, full=False)
    if not set(entries) <= set(names):
        raise CodebookError("a delta carries a class its name list leaves out")
    return Delta(
        message.backbone_fingerprint, model_dims, message.version, message.base_version,
        tuple(names), entries, metadata,
    )  # fmt: skip


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
    dims = _decode_header(message, against.fingerprint, against.dims)
    if int(message.phase) != phase:
        found = pb.Phase.Name(message.phase) if message.phase in pb.Phase.values() else "?"
        raise CodebookError(f"update answers {found}, not PHASE_{phase.name}")
    _check_names([e.name for e in message.entries])
    wanted = set(schema.trained_in(phase))
    tensors = isinstance(data, bytes) and bool(wanted)
    views = _tensor_views(data) if tensors else [None] * len(message.entries)
    if len(views) != len(message.entries):
        raise CodebookError("the update's entries do not match its bytes")
    _quiet_read_only_views()
    entries = []
    for msg, entry_views in zip(message.entries, views, strict=True):
        what = label(msg.name)
        if msg.version or msg.frozen:
            raise CodebookError(f"{what}: an update cannot set version/frozen")
        _check_count(msg.count, 1, what)
        if _present(msg) != wanted:
            raise CodebookError(
                f"{what}: carries {sorted(_present(msg)) or 'no fields'}, "
                f"{phase.key} carries {sorted(wanted) or 'none'}"
            )
        values = _decode_values(msg, dims, entry_views)
        if phase is not Phase.SYNC and msg.name not in against:
            raise CodebookError(f"{what} is not registered")
        entries.append(ClassEntry(msg.name, msg.count, values))
    if phase is not Phase.SYNC and message.base_version != against.version:
        raise CodebookError(
            f"update starts from codebook version {message.base_version}, "
            f"the codebook is at {against.version} (stale or foreign reply)"
        )
    _check_count(message.base_version, 0, "base version")
    return ClientUpdate(
        message.backbone_fingerprint, dims, phase, message.base_version, tuple(entries),
        dict(message.metadata),
    )  # fmt: skip


# --- encoding -------------------------------------------------------------------------------------


def _fill_tensor(target: pb.Tensor, value: np.ndarray, dtype: pb.DType, what: str) -> None:
    with np.errstate(over="ignore"):  # overflow shows as inf, reported below
        wire = np.asarray(value, dtype=_NUMPY_DTYPES[dtype])  # tobytes() is C order
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
    payload = encode(codebook, dtype)
    decode_codebook(payload, fingerprint=codebook.fingerprint, dims=codebook.dims, max_bytes=None)
    write_atomic(path, frame(payload))


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
    _decode_header(message, fingerprint, dims)
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
    A manifest (``store``) reads as the codebook it names: its base, then its records."""
    with payload_checked_alongside(path, max_bytes) as payload:
        message = parse(pb.Codebook, payload, max_bytes)
        if store.MANIFEST_KEY not in message.metadata:
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
    _quiet_read_only_views()
    views = _tensor_views(payload, _CODEBOOK_ENTRIES) if message.base_version == 0 else None
    received = broadcast_from_proto(message, fingerprint=fingerprint, dims=dims, views=views)
    if isinstance(received, Delta):
        raise CodebookError("a delta, not a whole codebook")
    return received


def decode_changes(
    data: bytes, *, fingerprint: str | None, dims: ModelDims | None
) -> tuple[dict[str, ClassEntry], set[str]]:
    """A store record (``store``): the entries it carries, each with only the fields that
    changed (validated as a delta's), and the classes whose entries it replaces whole."""
    message = parse(pb.Codebook, data, None)
    model_dims = _decode_header(message, fingerprint, dims)
    entries = _decode_entries(message, model_dims, full=False)
    try:
        replaced = set(json.loads(message.metadata.get(store.REPLACED_KEY, "[]")))
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
    ref = store.Ref.of(message.metadata)
    if ref is None:
        raise CodebookError(f"{path}: not a store's manifest")
    folder = store.find_dir(path)
    base_path = folder / ref.base
    with payload_checked_alongside(base_path) as base_payload:
        base_message = parse(pb.Codebook, base_payload, None)
        if store.MANIFEST_KEY in base_message.metadata:
            raise CodebookError(f"{base_path}: a store's base is a manifest")
        base = _whole(base_message, base_payload, fingerprint, dims)
    del base_message, base_payload
    entries = dict(base.entries)
    for payload in store.records(folder, ref):
        changes, replaced = decode_changes(payload, fingerprint=base.fingerprint, dims=base.dims)
        for name, new in changes.items():
            old = entries.get(name)
            entries[name] = new if old is None or name in replaced else dataclasses.replace(
                new, values={**old.values, **new.values},
                field_versions={**old.field_versions, **new.field_versions},
            )  # fmt: skip
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
    metadata = {k: v for k, v in message.metadata.items() if k != store.MANIFEST_KEY}
    return Codebook(base.fingerprint, base.dims, kept, message.version, metadata)
