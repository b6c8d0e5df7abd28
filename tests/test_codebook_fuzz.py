"""Damaged messages either decode to something sound or raise CodebookError, nothing else.

"Sound" is checked here independently of the validator: the invariants of the codebook
(docs/design.md#the-codebook) are recomputed on the decoded objects, so a validator that
forgot a rule would fail these tests.
Structured damage (NaN, wrong shapes, unknown dtypes) must always be rejected.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.protocol import Phase

FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TENSOR_ENTRY_FIELDS = schema.TENSORS
MIXTURE_PARTS = [(m, p) for m in schema.MIXTURES for p in ("weights", "means")]


def assert_sound_mixture(mixture: GaussianMixture, dim: int) -> None:
    m = mixture.weights.shape[0]
    assert m >= 1 and mixture.count >= 1
    assert mixture.means.shape == mixture.variances.shape == (m, dim)
    for value in (mixture.weights, mixture.means, mixture.variances):
        assert value.dtype == torch.float64 and torch.isfinite(value).all()
    assert (mixture.weights >= 0).all() and abs(float(mixture.weights.sum()) - 1) <= 1e-6
    assert (mixture.variances > 0).all()


def assert_sound_name(name: str) -> None:
    assert 0 < len(name) <= 256 and name.isprintable()


def assert_sound_values(values: dict, dims: ModelDims) -> None:
    for name, value in values.items():
        f = schema.BY_NAME[name]
        if f.kind is schema.Kind.MIXTURE:
            assert_sound_mixture(value, f.shape(dims)[0])
        else:
            assert value.shape == f.shape(dims)
            assert value.dtype == torch.float32 and torch.isfinite(value).all()


def assert_sound_codebook(codebook: Codebook, fingerprint: str, dims: ModelDims) -> None:
    assert codebook.fingerprint == fingerprint and codebook.dims == dims
    for name, entry in codebook.entries.items():
        assert_sound_name(name) and entry.name == name
        assert set(schema.TENSORS) <= set(entry.values) <= set(schema.BY_NAME)
        assert_sound_values(entry.values, dims)
        trained = entry.frozen or any(m in entry.values for m in schema.MIXTURES)
        assert entry.count >= (1 if trained else 0)
        assert 0 <= entry.version <= codebook.version


def assert_sound_update(update: ClientUpdate, against: Codebook, phase: Phase) -> None:
    assert update.fingerprint == against.fingerprint and update.dims == against.dims
    assert update.phase is phase and update.base_version == against.version
    assert len({e.name for e in update.entries}) == len(update.entries)
    for entry in update.entries:
        assert_sound_name(entry.name) and entry.name in against
        assert entry.count >= 1
        assert set(entry.values) == set(schema.trained_in(phase))
        assert_sound_values(entry.values, update.dims)


@pytest.fixture(scope="module")
def valid(make_codebook: Callable[..., Codebook]) -> tuple[pb.Codebook, bytes, bytes, Codebook]:
    """A valid codebook message, its bytes, the bytes of a valid stage-2-statistics update and
    the codebook it answers."""
    codebook = make_codebook(n_classes=3, version=3, metadata={"k": "v"})
    entries = codebook.bank().entries(fields=schema.trained_in(Phase.STAGE2_STATS))
    update = ClientUpdate(
        codebook.fingerprint, codebook.dims, Phase.STAGE2_STATS, codebook.version, entries
    )
    return wire.to_proto(codebook), wire.encode(codebook), wire.encode(update), codebook


def decode_codebook(data: bytes, fingerprint: str, dims: ModelDims) -> None:
    """Decode with and without the expected fingerprint/dims; either sound or CodebookError."""
    for expected in ({"fingerprint": fingerprint, "dims": dims}, {}):
        try:
            codebook = wire.decode_codebook(data, **expected)
        except CodebookError:
            continue
        assert_sound_codebook(codebook, codebook.fingerprint, codebook.dims)
        if expected:
            assert_sound_codebook(codebook, fingerprint, dims)


def decode_update(data: bytes, against: Codebook) -> None:
    try:
        update = wire.decode_update(data, against=against, phase=Phase.STAGE2_STATS)
    except CodebookError:
        return
    assert_sound_update(update, against, Phase.STAGE2_STATS)


def pick_tensor(message: pb.Codebook, entry: int, field: str | tuple[str, str]) -> pb.Tensor:
    """A tensor of an entry: a ClassEntry field, or (mixture field, part) of a mixture."""
    if isinstance(field, tuple):
        return getattr(getattr(message.entries[entry], field[0]), field[1])
    return getattr(message.entries[entry], field)


def flip_bits(data: bytes, positions: list[int]) -> bytes:
    damaged = bytearray(data)
    for position in positions:
        damaged[(position // 8) % len(damaged)] ^= 1 << (position % 8)
    return bytes(damaged)


@FUZZ
@given(cut=st.integers(min_value=0, max_value=10**6))
def test_truncated_codebooks(valid, fingerprint: str, tiny_dims: ModelDims, cut: int) -> None:
    _, data, _, _ = valid
    decode_codebook(data[: cut % len(data)], fingerprint, tiny_dims)


@FUZZ
@given(positions=st.lists(st.integers(min_value=0, max_value=10**7), min_size=1, max_size=8))
def test_bit_flipped_codebooks(valid, fingerprint: str, tiny_dims: ModelDims, positions) -> None:
    _, data, _, _ = valid
    decode_codebook(flip_bits(data, positions), fingerprint, tiny_dims)


@FUZZ
@given(
    start=st.integers(min_value=0, max_value=10**6),
    junk=st.binary(min_size=1, max_size=64),
)
def test_spliced_codebooks(valid, fingerprint: str, tiny_dims: ModelDims, start, junk) -> None:
    _, data, _, _ = valid
    start %= len(data)
    decode_codebook(data[:start] + junk + data[start + len(junk) :], fingerprint, tiny_dims)


@FUZZ
@given(
    cut=st.integers(min_value=0, max_value=10**6),
    positions=st.lists(st.integers(min_value=0, max_value=10**7), max_size=4),
)
def test_damaged_updates(valid, fingerprint: str, tiny_dims: ModelDims, cut, positions) -> None:
    _, _, data, codebook = valid
    decode_update(flip_bits(data[: cut % len(data) or len(data)], positions), codebook)


@FUZZ
@given(
    entry=st.integers(min_value=0, max_value=2),
    field=st.sampled_from(TENSOR_ENTRY_FIELDS + tuple(MIXTURE_PARTS)),
    index=st.integers(min_value=0, max_value=10**6),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_injected_non_finite_values_are_rejected(valid, entry, field, index, value) -> None:
    message = pb.Codebook()
    message.CopyFrom(valid[0])
    tensor = pick_tensor(message, entry, field)
    dtype = "<f8" if tensor.dtype == pb.DTYPE_FLOAT64 else "<f4"
    array = np.frombuffer(tensor.data, dtype=dtype).copy()
    array[index % array.size] = value
    tensor.data = array.tobytes()
    with pytest.raises(CodebookError):
        wire.decode_codebook(message.SerializeToString())


@FUZZ
@given(
    entry=st.integers(min_value=0, max_value=2),
    field=st.sampled_from(TENSOR_ENTRY_FIELDS + tuple(MIXTURE_PARTS)),
    shape=st.lists(st.integers(min_value=-2, max_value=24), max_size=3),
    dtype=st.integers(min_value=0, max_value=5),
)
def test_wrong_shapes_and_dtypes_are_rejected(valid, entry, field, shape, dtype) -> None:
    message = pb.Codebook()
    message.CopyFrom(valid[0])
    tensor = pick_tensor(message, entry, field)
    # Any other dtype changes the byte length, so only the untouched tensor is valid.
    assume(list(tensor.shape) != shape or tensor.dtype != dtype)
    tensor.ClearField("shape")
    tensor.shape.extend(shape)
    tensor.dtype = dtype
    with pytest.raises(CodebookError):
        wire.decode_codebook(message.SerializeToString())


@FUZZ
@given(
    dims=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=4, max_size=4),
    keep_entries=st.booleans(),
)
def test_arbitrary_dims(valid, fingerprint: str, dims: list[int], keep_entries: bool) -> None:
    message = pb.Codebook()
    message.CopyFrom(valid[0])
    if not keep_entries:
        message.ClearField("entries")
        message.ClearField("version")
    message.dims.CopyFrom(
        pb.ModelDims(d_txt=dims[0], d_clip=dims[1], d_vit=dims[2], n_layers=dims[3])
    )
    try:
        codebook = wire.decode_codebook(message.SerializeToString())
    except CodebookError:
        return
    assert_sound_codebook(codebook, fingerprint, ModelDims(*dims))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=256))
def test_random_bytes(valid, data: bytes) -> None:
    """Whatever bytes arrive: CodebookError, or a codebook/update that keeps every invariant
    (the bytes alone, and the bytes after a valid message, where a parser could be fooled into
    merging them into the valid fields)."""
    against = valid[3]
    for message in (data, valid[1] + data):
        decode_codebook(message, against.fingerprint, against.dims)
    for message in (data, valid[2] + data):
        for phase in (Phase.STAGE2, Phase.STAGE2_STATS):
            try:
                update = wire.decode_update(message, against=against, phase=phase)
            except CodebookError:
                continue
            assert_sound_update(update, against, phase)
