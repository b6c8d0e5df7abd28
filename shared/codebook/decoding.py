"""Decoding is validating: the values of a received codebook, delta or update, checked.

Whatever comes from outside is checked here, once, into a typed value the rest of the code
trusts: schema version, fingerprint and dims (against the receiver's), tensor dtypes, byte
lengths and shapes (from ``schema.FIELDS``), finite values, counts, mixture weights and
variances, class names. ``wire`` parses the messages and checks what only a whole message says
(an update against the codebook its phase was sent with); any failure is ``CodebookError`` with
a one-line reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import schema
from starfed.shared.codebook.entry import ClassEntry, Value
from starfed.shared.codebook.framing import CodebookError
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.codebook.tensor_views import EntryViews

SCHEMA_VERSION = 1
MAX_NAME_LENGTH = 256
MAX_DIM = 65_536  # far above any CLIP/ViT width or depth; bounds what a message can allocate
WEIGHT_SUM_TOLERANCE = 1e-6

NUMPY_DTYPES: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
}


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


def check_names(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        problem = check_name(name)
        if problem:
            raise CodebookError(problem)
        if name in seen:
            raise CodebookError(f"{label(name)} appears twice")
        seen.add(name)


def check_count(count: int, minimum: int, what: str) -> None:
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
    check_count(mixture.count, 1, what)


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

    ``view`` is the tensor's ``data`` bytes inside the received message (``tensor_views``): when
    they are already ``to`` in this machine's byte order, the array is a read-only view of them,
    not a copy (it keeps the message's bytes alive; nothing writes to an update's values)."""
    if msg.dtype not in dtypes:
        allowed = ", ".join(pb.DType.Name(d) for d in dtypes)
        raise CodebookError(f"{what}: dtype {msg.dtype} is not one of {allowed}")
    if tuple(msg.shape) != shape:
        raise CodebookError(f"{what}: shape {tuple(msg.shape)}, expected {shape}")
    dtype = NUMPY_DTYPES[msg.dtype]
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
        return _decode_array(
            getattr(msg, name), part_shape, f"{what}: {name}", float64, f64, views.get(name)
        )

    mixture = GaussianMixture(
        weights=part("weights", (m,)),
        means=part("means", (m, dim)),
        variances=part("variances", (m, dim)),
        count=msg.count,
    )
    _check_mixture(mixture, what)
    return mixture


def present_fields(msg: pb.ClassEntry) -> set[str]:
    return {f.name for f in schema.FIELDS if msg.HasField(f.name)}


def decode_values(
    msg: pb.ClassEntry, dims: ModelDims, views: EntryViews | None = None
) -> dict[str, Value]:
    """The schema fields set in one entry message, decoded and checked; ``views`` are its
    tensors' data bytes in the received message, by field name (``tensor_views``)."""
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
            values[f.name] = _decode_array(tensor, f.shape(dims), what, NUMPY_DTYPES, f32, view)
        else:
            parts = views.get(f.name) if views else None
            parts = parts if isinstance(parts, dict) else None  # a mixture's: one per part
            values[f.name] = _decode_mixture(getattr(msg, f.name), f.shape(dims)[0], what, parts)
    return values


def decode_header(
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


def decode_entries(
    message: pb.Codebook, dims: ModelDims, full: bool, views: list[EntryViews] | None = None
) -> dict[str, ClassEntry]:
    """Entries of a codebook (every tensor field required) or a delta (any subset); ``views``:
    each entry's tensor bytes in the message's bytes (``tensor_views``)."""
    check_names([e.name for e in message.entries])
    if views is not None and len(views) != len(message.entries):
        raise CodebookError("the codebook's entries do not match its bytes")
    entries = {}
    for i, msg in enumerate(message.entries):
        values = decode_values(msg, dims, None if views is None else views[i])
        missing = [name for name in schema.TENSORS if name not in values]
        if full and missing:
            raise CodebookError(f"{label(msg.name)}: {missing[0]}: missing")
        trained = msg.frozen or any(name in values for name in schema.MIXTURES)
        check_count(msg.count, 1 if trained and full else 0, label(msg.name))
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
