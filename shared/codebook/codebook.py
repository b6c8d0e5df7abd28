"""The codebook: the per-class state every part of starfed exchanges (DESIGN.md §2).

A ``Codebook`` is a ``ClassBank`` plus what it is only valid with: the fingerprint of the frozen
backbones, a monotonic version, which classes are frozen (finished) and training metadata. A
``ClientUpdate`` is what one client sends back for one phase: the classes it touched, restricted
to the parts that phase trains. Both convert to and from the protobuf messages of
``proto/codebook.proto``, bytes (the wire) and files (checkpoints, exports).

Everything decoded from outside is validated before it is returned: schema version, fingerprint
and dims (against the expected ones when given), tensor dtypes, byte lengths and shapes, finite
values, counts, mixture weights and variances, class names, and the message size (checked before
parsing). Any failure raises ``CodebookError`` with a one-line reason; nothing is half-applied.
Encoding validates too, so a sender fails where a bug is rather than at every receiver.

Files are ``magic (8 bytes) | payload length (u64 LE) | sha256(payload) (32 bytes) | payload``
and are written atomically (temporary file in the same folder, fsync, rename, fsync folder), so
a crash leaves either the old file or the new one.

float16 on the wire (``to_bytes("float16")``) halves the per-class tensors (p, w, Q, A, heads);
mixtures stay float64 because their statistics are averaged across sites and tasks. For the paper
dims (768/768/768, 12 blocks, M=5) an entry drops from 209,176 to 166,164 bytes (-21%: the two
mixtures, about 123 kB, dominate) and a 35-class codebook from 7,321,381 to 5,815,961 bytes
(``bench/codebook_sizes.py``; full ViT-B/16 weights are 346 MB). Accuracy: round-to-nearest keeps
11 significant bits, so every value in float16's normal range (6.1e-5 <= |x| <= 65504) comes
back with a relative error of at most 2**-11 ≈ 4.9e-4; smaller values have an absolute error of
at most 2**-25 ≈ 3.0e-8; larger ones do not fit and ``to_bytes`` raises ``CodebookError``.
Decoding always yields float32.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Self, TypeVar

import numpy as np
import torch

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook.entry import ClassBank, ModelDims
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.files import write_atomic

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 64 * 2**20
MAX_NAME_LENGTH = 256
MAX_DIM = 65_536  # far above any CLIP/ViT width or depth; bounds what a message can allocate
WEIGHT_SUM_TOLERANCE = 1e-6

CODEBOOK_MAGIC = b"SFCODEBK"
UPDATE_MAGIC = b"SFUPDATE"
_FILE_KINDS = {CODEBOOK_MAGIC: "codebook", UPDATE_MAGIC: "client update"}
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload

MIXTURE_FIELDS = ("clip_mixtures", "vit_mixtures")
# ClassBank field -> ClassEntry field.
_ENTRY_FIELDS = {
    "prompts": "prompt",
    "keys": "key",
    "query_prompts": "query_prompt",
    "query_weights": "query_weight",
    "head_weight": "head_weight",
    "head_bias": "head_bias",
    "aligned_head_weight": "aligned_head_weight",
    "aligned_head_bias": "aligned_head_bias",
    "clip_mixtures": "clip_mixture",
    "vit_mixtures": "vit_mixture",
}
_NUMPY_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
}
_WIRE_DTYPES = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16}
_Message = TypeVar("_Message", pb.Codebook, pb.ClientUpdate)


class CodebookError(ValueError):
    """Invalid codebook data; the message says what and where, on one line."""


class Phase(enum.IntEnum):
    """Server-driven phase a client update answers (DESIGN.md §3); values are the proto's."""

    SYNC = pb.PHASE_SYNC
    STAGE1 = pb.PHASE_STAGE1
    STAGE1_STATS = pb.PHASE_STAGE1_STATS
    STAGE2 = pb.PHASE_STAGE2
    STAGE2_STATS = pb.PHASE_STAGE2_STATS
    EVALUATE = pb.PHASE_EVALUATE


# What each phase trains, as ClassBank field names (the default content of an update).
PHASE_FIELDS: dict[Phase, tuple[str, ...]] = {
    Phase.SYNC: (),
    Phase.STAGE1: ("prompts",),
    Phase.STAGE1_STATS: ("clip_mixtures",),
    Phase.STAGE2: ("query_prompts", "query_weights", "head_weight", "head_bias"),
    Phase.STAGE2_STATS: ("vit_mixtures",),
    Phase.EVALUATE: (),
}


def row_shape(field_name: str, dims: ModelDims) -> tuple[int, ...]:
    """Shape of one class's row of a ``ClassBank`` tensor field."""
    shapes = {
        "prompts": (dims.d_txt,),
        "keys": (dims.d_clip,),
        "query_prompts": (dims.n_layers, dims.d_vit),
        "query_weights": (dims.n_layers, dims.d_clip),
        "head_weight": (dims.d_vit,),
        "head_bias": (),
        "aligned_head_weight": (dims.d_vit,),
        "aligned_head_bias": (),
    }
    return shapes[field_name]


def mixture_dim(field_name: str, dims: ModelDims) -> int:
    """Feature dimension of a mixture field: CLIP image features (G) or ViT CLS features (H)."""
    return {"clip_mixtures": dims.d_clip, "vit_mixtures": dims.d_vit}[field_name]


# --- validation of in-memory values -------------------------------------------------------------


def _label(name: str) -> str:
    """A class name for an error message, cut short: a hostile name must not flood logs."""
    return f"class {name[:60]!r}" + ("…" if len(name) > 60 else "")


def _check_fingerprint(fingerprint: str, expected: str | None) -> None:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise CodebookError("backbone fingerprint is empty")
    if expected is not None and fingerprint != expected:
        raise CodebookError(
            f"backbone fingerprint {fingerprint[:16]!r}… does not match the expected "
            f"{expected[:16]!r}… (made for other backbones)"
        )


def _check_dims(dims: ModelDims, expected: ModelDims | None) -> None:
    values = (dims.d_txt, dims.d_clip, dims.d_vit, dims.n_layers)
    if not all(isinstance(v, int) and 1 <= v <= MAX_DIM for v in values):
        raise CodebookError(f"dims must be integers in [1, {MAX_DIM}], got {dims}")
    if expected is not None and dims != expected:
        raise CodebookError(f"dims {dims} do not match the expected {expected}")


def _check_names(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not name:
            raise CodebookError("a class name is empty")
        if len(name) > MAX_NAME_LENGTH:
            raise CodebookError(f"{_label(name)} has a name longer than {MAX_NAME_LENGTH}")
        if not name.isprintable():
            raise CodebookError(f"{_label(name)}: name contains control characters")
        if name in seen:
            raise CodebookError(f"{_label(name)} appears twice")
        seen.add(name)


def _check_tensor(
    value: torch.Tensor, shape: tuple[int, ...], what: str, row_names: list[str] | None = None
) -> None:
    """Type, shape and finiteness; with ``row_names`` an error names the class of the bad row."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise CodebookError(f"{what}: expected a floating-point tensor")
    if tuple(value.shape) != shape:
        raise CodebookError(f"{what}: shape {tuple(value.shape)}, expected {shape}")
    finite = torch.isfinite(value)
    if not finite.all():
        if row_names is not None:
            row = int((~finite).reshape(len(row_names), -1).any(dim=1).nonzero()[0])
            what = f"{_label(row_names[row])}: {what}"
        raise CodebookError(f"{what}: contains NaN or infinite values")


def _check_count(count: int, minimum: int, what: str) -> None:
    if not isinstance(count, int) or count < minimum:
        raise CodebookError(f"{what}: count {count!r} must be an integer >= {minimum}")


def _check_mixture(mixture: GaussianMixture, dim: int, what: str) -> None:
    if not isinstance(mixture, GaussianMixture):
        raise CodebookError(f"{what}: expected a GaussianMixture")
    m = int(mixture.weights.shape[0]) if mixture.weights.dim() == 1 else 0
    if m < 1:
        raise CodebookError(f"{what}: weights must be a non-empty vector")
    for name in ("weights", "means", "variances"):
        value = getattr(mixture, name)
        if value.dtype != torch.float64:
            raise CodebookError(f"{what}: {name} must be float64, got {value.dtype}")
        _check_tensor(value, (m,) if name == "weights" else (m, dim), f"{what}: {name}")
    if (mixture.weights < 0).any():
        raise CodebookError(f"{what}: negative mixture weight")
    total = float(mixture.weights.sum())
    if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise CodebookError(f"{what}: mixture weights sum to {total!r}, not 1")
    if not (mixture.variances > 0).all():
        raise CodebookError(f"{what}: variances must be positive")
    _check_count(mixture.count, 1, what)


def _check_metadata(metadata: Mapping[str, str]) -> None:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CodebookError("metadata keys and values must be strings")


# --- protobuf encoding and decoding --------------------------------------------------------------


def _wire_dtype(dtype: str) -> int:
    if dtype not in _WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {sorted(_WIRE_DTYPES)}, got {dtype!r}")
    return _WIRE_DTYPES[dtype]


def _fill_tensor(target: pb.Tensor, value: np.ndarray, dtype: int, what: str) -> None:
    with np.errstate(over="ignore"):  # overflow shows as inf, reported below
        wire = np.asarray(value, dtype=_NUMPY_DTYPES[dtype])  # tobytes() is C order
    if not np.isfinite(wire).all():
        raise CodebookError(f"{what}: values exceed the range of {pb.DType.Name(dtype)}")
    target.shape[:] = wire.shape
    target.dtype = dtype
    target.data = wire.tobytes()


def _fill_mixture(target: pb.Mixture, mixture: GaussianMixture) -> None:
    for name in ("weights", "means", "variances"):
        value = getattr(mixture, name).detach().cpu().numpy()
        _fill_tensor(getattr(target, name), value, pb.DTYPE_FLOAT64, name)
    target.count = mixture.count


def _fill_entry(
    target: pb.ClassEntry,
    name: str,
    count: int,
    rows: Mapping[str, torch.Tensor],
    mixtures: Mapping[str, GaussianMixture | None],
    dtype: int,
) -> None:
    """Write one class; ``rows`` and ``mixtures`` hold only the parts to send."""
    target.name = name
    target.count = count
    for field_name, row in rows.items():
        value = row.detach().cpu().numpy()
        _fill_tensor(
            getattr(target, _ENTRY_FIELDS[field_name]), value, dtype, f"{name}/{field_name}"
        )
    for field_name, mixture in mixtures.items():
        if mixture is not None:
            _fill_mixture(getattr(target, _ENTRY_FIELDS[field_name]), mixture)


def _decode_array(
    msg: pb.Tensor, shape: tuple[int, ...], what: str, dtypes: Iterable[int]
) -> np.ndarray:
    if msg.dtype not in dtypes:
        allowed = ", ".join(pb.DType.Name(d) for d in dtypes)
        raise CodebookError(f"{what}: dtype {msg.dtype} is not one of {allowed}")
    if tuple(msg.shape) != shape:
        raise CodebookError(f"{what}: shape {tuple(msg.shape)}, expected {shape}")
    dtype = _NUMPY_DTYPES[msg.dtype]
    expected = math.prod(shape) * dtype.itemsize
    if len(msg.data) != expected:
        raise CodebookError(f"{what}: {len(msg.data)} bytes of data, expected {expected}")
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape)


def _decode_mixture(msg: pb.Mixture, dim: int, what: str) -> GaussianMixture:
    float64 = (pb.DTYPE_FLOAT64,)
    shape = tuple(msg.weights.shape)
    if len(shape) != 1 or shape[0] < 1:
        raise CodebookError(f"{what}: weights shape {shape} is not [M] with M >= 1")
    m = shape[0]
    weights = _decode_array(msg.weights, (m,), f"{what}: weights", float64)
    means = _decode_array(msg.means, (m, dim), f"{what}: means", float64)
    variances = _decode_array(msg.variances, (m, dim), f"{what}: variances", float64)
    return GaussianMixture(
        weights=torch.from_numpy(weights.astype(np.float64)),
        means=torch.from_numpy(means.astype(np.float64)),
        variances=torch.from_numpy(variances.astype(np.float64)),
        count=msg.count,
    )


def _decode_entry(
    msg: pb.ClassEntry, dims: ModelDims, require_all: bool
) -> tuple[dict[str, torch.Tensor], dict[str, GaussianMixture]]:
    """One class's tensors (float32) and mixtures; with ``require_all`` every tensor must be set."""
    rows: dict[str, torch.Tensor] = {}
    for field_name in ClassBank.TENSOR_FIELDS:
        proto_field = _ENTRY_FIELDS[field_name]
        what = f"{_label(msg.name)}: {field_name}"
        if not msg.HasField(proto_field):
            if require_all:
                raise CodebookError(f"{what}: missing")
            continue
        shape = row_shape(field_name, dims)
        array = _decode_array(getattr(msg, proto_field), shape, what, _NUMPY_DTYPES)
        # float64 beyond float32's range becomes inf here, which validation then rejects.
        with np.errstate(over="ignore"):
            rows[field_name] = torch.from_numpy(array.astype(np.float32))
    mixtures: dict[str, GaussianMixture] = {}
    for field_name in MIXTURE_FIELDS:
        proto_field = _ENTRY_FIELDS[field_name]
        if msg.HasField(proto_field):
            what = f"{_label(msg.name)}: {field_name}"
            dim = mixture_dim(field_name, dims)
            mixtures[field_name] = _decode_mixture(getattr(msg, proto_field), dim, what)
    return rows, mixtures


def _decode_header(
    schema_version: int,
    fingerprint: str,
    msg_dims: pb.ModelDims,
    expected_fingerprint: str | None,
    expected_dims: ModelDims | None,
) -> ModelDims:
    if schema_version != SCHEMA_VERSION:
        raise CodebookError(f"schema version {schema_version}, this code reads {SCHEMA_VERSION}")
    _check_fingerprint(fingerprint, expected_fingerprint)
    dims = ModelDims(msg_dims.d_txt, msg_dims.d_clip, msg_dims.d_vit, msg_dims.n_layers)
    _check_dims(dims, expected_dims)
    return dims


def _dims_proto(dims: ModelDims) -> pb.ModelDims:
    return pb.ModelDims(
        d_txt=dims.d_txt, d_clip=dims.d_clip, d_vit=dims.d_vit, n_layers=dims.n_layers
    )


def _parse(message_type: type[_Message], data: bytes, max_bytes: int) -> _Message:
    """Parse with the size limit checked first; every parser failure becomes CodebookError."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodebookError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise CodebookError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    message = message_type()
    try:
        message.ParseFromString(bytes(data))
    except Exception as err:  # DecodeError, invalid UTF-8, recursion limits, ...
        raise CodebookError(f"not a valid {message_type.__name__} message: {err}") from err
    return message


# --- files ---------------------------------------------------------------------------------------


def _write_file(path: str | os.PathLike[str], magic: bytes, payload: bytes) -> None:
    """Atomically replace ``path`` with header (magic, length, sha256) + payload."""
    header = _HEADER.pack(magic, len(payload), hashlib.sha256(payload).digest())
    write_atomic(path, header + payload)


def read_payload(
    path: str | os.PathLike[str], magic: bytes = CODEBOOK_MAGIC, max_bytes: int = DEFAULT_MAX_BYTES
) -> bytes:
    """The checksum-verified message bytes of a codebook (or update) file.

    Raises ``CodebookError`` for a wrong kind of file, a truncated or corrupted one, or one over
    ``max_bytes``; ``OSError`` when it cannot be read at all.
    """
    kind = _FILE_KINDS[magic]
    with open(path, "rb") as file:
        header = file.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise CodebookError(f"{path}: too short to be a starfed {kind} file")
        found, length, digest = _HEADER.unpack(header)
        if found != magic:
            other = _FILE_KINDS.get(found)
            what = f"a starfed {other} file" if other else "not a starfed file"
            raise CodebookError(f"{path}: {what}, expected a {kind} file")
        if length > max_bytes:
            raise CodebookError(f"{path}: payload of {length} bytes exceeds the limit {max_bytes}")
        payload = file.read(length + 1)
    if len(payload) != length:
        raise CodebookError(f"{path}: header announces {length} bytes, file holds {len(payload)}")
    if hashlib.sha256(payload).digest() != digest:
        raise CodebookError(f"{path}: checksum mismatch (file corrupted)")
    return payload


# --- bytes and files, the same for both message kinds ---------------------------------------------


class _Serialised:
    """Bytes and file conversions for a class with ``to_proto``/``from_proto`` (one message)."""

    _PROTO: ClassVar[type]
    _MAGIC: ClassVar[bytes]

    def to_bytes(self, dtype: str = "float32") -> bytes:
        """Deterministic serialisation (same value, same bytes)."""
        return self.to_proto(dtype).SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        fingerprint: str | None = None,
        dims: ModelDims | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> Self:
        """Parse (size-checked first), decode and validate; ``CodebookError`` if anything is off."""
        message = _parse(cls._PROTO, data, max_bytes)
        return cls.from_proto(message, fingerprint=fingerprint, dims=dims)

    def save(self, path: str | os.PathLike[str], dtype: str = "float32") -> None:
        """Write atomically with a checksum (see the module docstring for the layout)."""
        _write_file(path, self._MAGIC, self.to_bytes(dtype))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        fingerprint: str | None = None,
        dims: ModelDims | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> Self:
        """Read, verify the checksum, decode and validate (``OSError`` if unreadable)."""
        payload = read_payload(path, cls._MAGIC, max_bytes)
        return cls.from_bytes(payload, fingerprint=fingerprint, dims=dims, max_bytes=max_bytes)


# --- the codebook ---------------------------------------------------------------------------------


@dataclass(eq=False)  # tensors have no single truth value: compare encodings, not objects
class Codebook(_Serialised):
    """A ClassBank with its backbone fingerprint, version, frozen classes and metadata."""

    _PROTO: ClassVar[type] = pb.Codebook
    _MAGIC: ClassVar[bytes] = CODEBOOK_MAGIC

    fingerprint: str
    bank: ClassBank
    version: int = 0
    frozen: set[str] = field(default_factory=set)  # names of finished classes
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def dims(self) -> ModelDims:
        return self.bank.dims

    @classmethod
    def from_bank(
        cls,
        bank: ClassBank,
        fingerprint: str,
        *,
        version: int = 0,
        frozen: Iterable[str] = (),
        metadata: Mapping[str, str] | None = None,
    ) -> Codebook:
        """Snapshot a model's bank (a copy: later training does not change the codebook)."""
        return cls(fingerprint, copy.deepcopy(bank), version, set(frozen), dict(metadata or {}))

    def to_bank(self) -> ClassBank:
        """A copy of the bank, exactly as stored, for a model to compute with."""
        return copy.deepcopy(self.bank)

    def without_mixtures(self) -> Codebook:
        """The same codebook minus the mixtures (shares the tensors; cheap).

        Mixtures are the server's replay memory; sites never read them, and they are most of a
        codebook's bytes (two float64 mixtures per class), so broadcasts leave them out.
        """
        bank = copy.copy(self.bank)
        bank.clip_mixtures = [None] * len(bank)
        bank.vit_mixtures = [None] * len(bank)
        return Codebook(self.fingerprint, bank, self.version, set(self.frozen), dict(self.metadata))

    def validate(self, *, fingerprint: str | None = None, dims: ModelDims | None = None) -> None:
        """Raise CodebookError unless every invariant of DESIGN.md §2 holds."""
        _check_fingerprint(self.fingerprint, fingerprint)
        _check_dims(self.dims, dims)
        _check_count(self.version, 0, "codebook version")
        bank = self.bank
        names = bank.names
        _check_names(names)
        for field_name in ClassBank.TENSOR_FIELDS:
            expected = (len(names), *row_shape(field_name, self.dims))
            _check_tensor(getattr(bank, field_name), expected, field_name, row_names=names)
        lists = (bank.clip_mixtures, bank.vit_mixtures, bank.counts, bank.versions)
        if any(len(values) != len(names) for values in lists):
            raise CodebookError("bank lists (mixtures, counts, versions) differ in length")
        for i, name in enumerate(names):
            what = _label(name)
            trained = name in self.frozen or any(
                getattr(bank, f)[i] is not None for f in MIXTURE_FIELDS
            )
            _check_count(bank.counts[i], 1 if trained else 0, what)
            version = bank.versions[i]
            if not isinstance(version, int) or not 0 <= version <= self.version:
                raise CodebookError(f"{what}: version {version!r} outside [0, {self.version}]")
            for field_name in MIXTURE_FIELDS:
                mixture = getattr(bank, field_name)[i]
                if mixture is not None:
                    dim = mixture_dim(field_name, self.dims)
                    _check_mixture(mixture, dim, f"{what}: {field_name}")
        unknown = self.frozen - set(names)
        if unknown:
            raise CodebookError(f"frozen classes not in the codebook: {sorted(unknown)}")
        _check_metadata(self.metadata)

    def to_proto(self, dtype: str = "float32") -> pb.Codebook:
        """The message, per-class tensors in ``dtype`` (float32 or float16), mixtures float64."""
        wire = _wire_dtype(dtype)
        self.validate()
        bank = self.bank
        message = pb.Codebook(
            schema_version=SCHEMA_VERSION,
            backbone_fingerprint=self.fingerprint,
            dims=_dims_proto(self.dims),
            version=self.version,
            metadata=self.metadata,
        )
        for i, name in enumerate(bank.names):
            entry = message.entries.add(version=bank.versions[i], frozen=name in self.frozen)
            rows = {f: getattr(bank, f)[i] for f in ClassBank.TENSOR_FIELDS}
            mixtures = {f: getattr(bank, f)[i] for f in MIXTURE_FIELDS}
            _fill_entry(entry, name, bank.counts[i], rows, mixtures, wire)
        return message

    @classmethod
    def from_proto(
        cls,
        message: pb.Codebook,
        *,
        fingerprint: str | None = None,
        dims: ModelDims | None = None,
    ) -> Codebook:
        """Decode and validate; ``fingerprint``/``dims`` are the receiver's, when it has them."""
        model_dims = _decode_header(
            message.schema_version, message.backbone_fingerprint, message.dims, fingerprint, dims
        )
        names = [entry.name for entry in message.entries]
        decoded = [_decode_entry(entry, model_dims, require_all=True) for entry in message.entries]
        stacked = {
            f: torch.stack([rows[f] for rows, _ in decoded]) if decoded else None
            for f in ClassBank.TENSOR_FIELDS
        }
        bank = ClassBank(
            model_dims,
            names,
            clip_mixtures=[mixtures.get("clip_mixtures") for _, mixtures in decoded],
            vit_mixtures=[mixtures.get("vit_mixtures") for _, mixtures in decoded],
            counts=[entry.count for entry in message.entries],
            versions=[entry.version for entry in message.entries],
            **stacked,
        )
        codebook = cls(
            message.backbone_fingerprint,
            bank,
            message.version,
            {entry.name for entry in message.entries if entry.frozen},
            dict(message.metadata),
        )
        codebook.validate()
        return codebook


# --- client updates ------------------------------------------------------------------------------


@dataclass(eq=False)
class ClassUpdate:
    """One class in a client update: the parts the client trained and how many examples it used."""

    name: str
    count: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # ClassBank field -> one row
    mixtures: dict[str, GaussianMixture] = field(default_factory=dict)  # "clip_/vit_mixtures"


@dataclass(eq=False)
class ClientUpdate(_Serialised):
    """What one client sends back for one phase, relative to codebook ``base_version``."""

    _PROTO: ClassVar[type] = pb.ClientUpdate
    _MAGIC: ClassVar[bytes] = UPDATE_MAGIC

    fingerprint: str
    dims: ModelDims
    phase: Phase
    base_version: int
    entries: list[ClassUpdate] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_bank(
        cls,
        bank: ClassBank,
        *,
        fingerprint: str,
        phase: Phase,
        base_version: int,
        classes: Iterable[str] | None = None,
        fields: Iterable[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> ClientUpdate:
        """The rows of ``classes`` (default all), restricted to ``fields`` (default: what
        ``phase`` trains, ``PHASE_FIELDS``), with the bank's counts. Rows are copied."""
        fields = tuple(PHASE_FIELDS[phase] if fields is None else fields)
        unknown = set(fields) - set(ClassBank.TENSOR_FIELDS) - set(MIXTURE_FIELDS)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        entries = []
        for name in bank.names if classes is None else classes:
            i = bank.index(name)
            tensors = {
                f: getattr(bank, f)[i].detach().clone()
                for f in fields
                if f in ClassBank.TENSOR_FIELDS
            }
            mixtures = {f: getattr(bank, f)[i] for f in fields if f in MIXTURE_FIELDS}
            missing = [f for f, mixture in mixtures.items() if mixture is None]
            if missing:
                raise ValueError(f"{_label(name)} has no {', '.join(missing)} to send")
            entries.append(ClassUpdate(name, bank.counts[i], tensors, mixtures))
        return cls(fingerprint, bank.dims, phase, base_version, entries, dict(metadata or {}))

    def validate(self, *, fingerprint: str | None = None, dims: ModelDims | None = None) -> None:
        """Raise CodebookError unless the update is well formed (counts >= 1, shapes, ...)."""
        _check_fingerprint(self.fingerprint, fingerprint)
        _check_dims(self.dims, dims)
        if not isinstance(self.phase, Phase):
            raise CodebookError(f"unknown phase {self.phase!r}")
        _check_count(self.base_version, 0, "base version")
        _check_names([entry.name for entry in self.entries])
        for entry in self.entries:
            what = _label(entry.name)
            _check_count(entry.count, 1, what)
            unknown = set(entry.tensors) - set(ClassBank.TENSOR_FIELDS)
            unknown |= set(entry.mixtures) - set(MIXTURE_FIELDS)
            if unknown:
                raise CodebookError(f"{what}: unknown fields {sorted(unknown)}")
            for field_name, value in entry.tensors.items():
                _check_tensor(value, row_shape(field_name, self.dims), f"{what}: {field_name}")
            for field_name, mixture in entry.mixtures.items():
                dim = mixture_dim(field_name, self.dims)
                _check_mixture(mixture, dim, f"{what}: {field_name}")
        _check_metadata(self.metadata)

    def to_proto(self, dtype: str = "float32") -> pb.ClientUpdate:
        wire = _wire_dtype(dtype)
        self.validate()
        message = pb.ClientUpdate(
            schema_version=SCHEMA_VERSION,
            base_version=self.base_version,
            phase=int(self.phase),
            backbone_fingerprint=self.fingerprint,
            dims=_dims_proto(self.dims),
            metadata=self.metadata,
        )
        for entry in self.entries:
            target = message.entries.add()
            _fill_entry(target, entry.name, entry.count, entry.tensors, entry.mixtures, wire)
        return message

    @classmethod
    def from_proto(
        cls,
        message: pb.ClientUpdate,
        *,
        fingerprint: str | None = None,
        dims: ModelDims | None = None,
    ) -> ClientUpdate:
        """Decode and validate. ``version`` and ``frozen`` are the server's: an update that sets
        them is rejected rather than having them silently dropped."""
        model_dims = _decode_header(
            message.schema_version, message.backbone_fingerprint, message.dims, fingerprint, dims
        )
        try:
            phase = Phase(message.phase)
        except ValueError:
            raise CodebookError(f"unknown phase {message.phase}") from None
        entries = []
        for entry in message.entries:
            if entry.version or entry.frozen:
                raise CodebookError(f"{_label(entry.name)}: an update cannot set version/frozen")
            tensors, mixtures = _decode_entry(entry, model_dims, require_all=False)
            entries.append(ClassUpdate(entry.name, entry.count, tensors, mixtures))
        update = cls(
            message.backbone_fingerprint,
            model_dims,
            phase,
            message.base_version,
            entries,
            dict(message.metadata),
        )
        update.validate()
        return update
