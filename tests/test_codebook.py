"""Codebook, Delta and ClientUpdate: immutable values, exact round trips, float16, files,
validation errors, the held codebook's one rule for deltas, the CLI."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from starfed.cli import main as cli_main
from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import held as held_module
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError, Delta
from starfed.shared.codebook.entry import ClassBank, ClassEntry
from starfed.shared.codebook.held import HeldCodebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.protocol import Phase


def assert_mixtures_equal(a: GaussianMixture | None, b: GaussianMixture | None) -> None:
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert a.count == b.count
        for name in ("weights", "means", "variances"):
            assert getattr(a, name).dtype == torch.float64
            assert torch.equal(getattr(a, name), getattr(b, name))


def assert_entries_equal(a: Codebook, b: Codebook) -> None:
    assert a.dims == b.dims
    assert a.names == b.names
    for x, y in zip(a.entries.values(), b.entries.values(), strict=True):
        assert (x.count, x.version, x.frozen) == (y.count, y.version, y.frozen)
        assert set(x.values) == set(y.values), x.name
        for name, value in x.values.items():
            if isinstance(value, GaussianMixture):
                assert_mixtures_equal(value, y.values[name])
            else:
                assert y.values[name].dtype == torch.float32
                assert torch.equal(value, y.values[name]), name


@pytest.fixture
def codebook(make_codebook: Callable[..., Codebook]) -> Codebook:
    """4 classes, version 5, class_0 frozen, class_3 without statistics yet."""
    codebook = make_codebook(version=5, metadata={"seed": "1993", "task": "2"})
    last = codebook["class_3"]
    unfitted = {f: v for f, v in last.values.items() if f not in schema.MIXTURES}
    entries = {
        **codebook.entries,
        "class_0": replace(codebook["class_0"], frozen=True),
        "class_3": replace(last, values=unfitted),
    }
    return replace(codebook, entries=entries)


# --- round trips ---------------------------------------------------------------------------------


def test_bytes_round_trip_is_exact(codebook: Codebook, fingerprint: str) -> None:
    decoded = wire.decode_codebook(wire.encode(codebook))
    assert_entries_equal(decoded, codebook)
    assert decoded.fingerprint == fingerprint
    assert decoded.version == 5
    assert decoded.frozen == {"class_0"}
    assert decoded.metadata == {"seed": "1993", "task": "2"}


def test_empty_codebook_round_trips(tiny_dims: ModelDims, fingerprint: str) -> None:
    decoded = wire.decode_codebook(wire.encode(Codebook(fingerprint, tiny_dims)))
    assert decoded.names == [] and decoded.dims == tiny_dims
    assert decoded.bank()["query_prompt"].shape == (0, tiny_dims.n_layers, tiny_dims.d_vit)


def test_bank_and_entries_convert_both_ways_with_copies(codebook: Codebook) -> None:
    bank = codebook.bank()
    assert bank.names == codebook.names
    assert bank["clip_mixture"][3] is None
    bank["prompt"].add_(1.0)  # training a bank never changes the codebook
    assert not torch.equal(codebook["class_1"].values["prompt"], bank["prompt"][1])
    entries = bank.entries(["class_2"], fields=("key", "vit_mixture"))
    assert set(entries[0].values) == {"key", "vit_mixture"}
    entries[0].values["key"].zero_()
    assert bank["key"][2].abs().sum() > 0
    again = ClassBank.from_entries(codebook.dims, bank.entries())
    for name in schema.TENSORS:
        assert torch.equal(again[name], bank[name])


def test_serialisation_is_deterministic(codebook: Codebook) -> None:
    reordered = replace(codebook, metadata=dict(reversed(codebook.metadata.items())))
    assert wire.encode(codebook) == wire.encode(reordered)


def test_evolving_returns_new_values(codebook: Codebook) -> None:
    key = torch.ones(codebook.dims.d_clip)
    newer = codebook.set_values({"class_1": {"key": key}}, {"class_1": 99}, freeze=["class_2"])
    assert newer.version == 6 and codebook.version == 5
    assert torch.equal(newer["class_1"].values["key"], key)
    assert not torch.equal(codebook["class_1"].values["key"], key)
    assert (newer["class_1"].count, newer["class_1"].version) == (99, 6)
    assert newer.frozen == {"class_0", "class_2"} and codebook.frozen == {"class_0"}
    assert newer["class_0"] is codebook["class_0"]  # untouched entries are shared
    smaller = newer.without(["class_1"])
    assert smaller.names == ["class_0", "class_2", "class_3"] and smaller.version == 7
    assert newer["class_1"].field_versions["key"] == 6
    assert "prompt" not in newer["class_1"].field_versions  # unchanged: no new stamp


def test_a_delta_carries_what_changed_and_rebuilds_the_codebook(codebook: Codebook) -> None:
    held = codebook.broadcast()  # what a site keeps
    key = torch.ones(codebook.dims.d_clip)
    newer = codebook.set_values({"class_1": {"key": key}}, freeze=["class_2"])
    newer = newer.register([replace(codebook["class_0"], name="class_9", frozen=False)])
    newer = newer.without(["class_3"])
    delta = newer.delta(since=codebook.version)
    assert delta.names == ("class_0", "class_1", "class_2", "class_9")
    assert set(delta.entries) == {"class_1", "class_2", "class_9"}
    assert set(delta.entries["class_1"].values) == {"key"}  # only the changed field
    assert delta.entries["class_2"].values == {}  # frozen, nothing else changed
    assert set(delta.entries["class_9"].values) == set(schema.BROADCAST)
    decoded = wire.decode_broadcast(wire.encode(delta))
    assert isinstance(decoded, Delta)
    rebuilt = held.apply(decoded)
    assert_entries_equal(rebuilt, replace(newer.broadcast(), metadata=rebuilt.metadata))
    assert len(wire.encode(delta)) < len(wire.encode(newer.broadcast())) / 2


def test_a_delta_applies_only_to_its_base(codebook: Codebook) -> None:
    newer = codebook.set_values({"class_1": {"key": torch.ones(codebook.dims.d_clip)}})
    newest = newer.set_values({"class_2": {"key": torch.ones(codebook.dims.d_clip)}})
    with pytest.raises(CodebookError, match="cannot apply to version"):
        codebook.broadcast().apply(newest.delta(since=newer.version))
    with pytest.raises(CodebookError, match="a delta, not a whole codebook"):
        wire.decode_codebook(wire.encode(newest.delta(since=newer.version)))
    lost = newest.delta(since=codebook.version)
    lost = replace(lost, names=(*lost.names, "ghost"))  # a class nobody has and no values
    with pytest.raises(CodebookError, match="ghost"):
        codebook.broadcast().apply(lost)


def test_float16_halves_tensors_within_documented_error(codebook: Codebook) -> None:
    prompt = codebook["class_1"].values["prompt"]
    prompt[:3] = torch.tensor([1e-6, -3e-7, 60000.0])  # subnormal and near the top
    full, half = wire.encode(codebook, "float32"), wire.encode(codebook, "float16")
    tensor_values = sum(codebook.bank()[name].numel() for name in schema.TENSORS)
    assert len(full) - len(half) == 2 * tensor_values
    decoded = wire.decode_codebook(half)
    for x, y in zip(codebook.entries.values(), decoded.entries.values(), strict=True):
        for name, original in x.values.items():
            restored = y.values[name]
            if isinstance(original, GaussianMixture):  # always float64, exact
                assert_mixtures_equal(original, restored)
                continue
            assert restored.dtype == torch.float32
            bound = torch.maximum(original.abs() * 2.0**-11, torch.full_like(original, 2.0**-25))
            assert ((restored - original).abs() <= bound).all(), name


def test_float16_overflow_is_refused(codebook: Codebook) -> None:
    codebook["class_2"].values["key"][0] = 1e5
    wire.encode(codebook, "float32")
    with pytest.raises(CodebookError, match=r"class_2/key.*FLOAT16"):
        wire.encode(codebook, "float16")


def test_unknown_wire_dtype_is_a_usage_error(codebook: Codebook) -> None:
    with pytest.raises(ValueError, match="wire dtype"):
        wire.encode(codebook, "bfloat16")


def test_encoding_refuses_non_finite_values(codebook: Codebook) -> None:
    codebook["class_1"].values["query_weight"][0, 0] = float("nan")
    with pytest.raises(CodebookError, match=r"class_1/query_weight: NaN"):
        wire.encode(codebook)


# --- files ---------------------------------------------------------------------------------------


def test_broadcast_copy_leaves_out_only_the_mixtures(codebook: Codebook) -> None:
    lean = codebook.broadcast()
    decoded = wire.decode_codebook(wire.encode(lean))
    assert decoded.names == codebook.names and decoded.frozen == codebook.frozen
    for x, y in zip(codebook.entries.values(), decoded.entries.values(), strict=True):
        assert set(y.values) == set(schema.BROADCAST) == set(schema.TENSORS)
        for name in schema.BROADCAST:
            assert torch.equal(x.values[name], y.values[name])
    assert "clip_mixture" in codebook["class_0"].values  # the original is untouched
    assert len(wire.encode(lean)) < len(wire.encode(codebook))


def test_file_round_trip(codebook: Codebook, tmp_path: Path) -> None:
    path = tmp_path / "model.codebook"
    wire.write_file(path, codebook)
    wire.write_file(path, codebook)  # replacing an existing file
    assert_entries_equal(wire.read_file(path), codebook)
    assert os.listdir(tmp_path) == ["model.codebook"]  # no temporary file left behind


def test_failed_save_keeps_the_old_file(
    codebook: Codebook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.codebook"
    wire.write_file(path, codebook)
    before = path.read_bytes()
    codebook = replace(codebook, version=codebook.version + 1)

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        wire.write_file(path, codebook)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.codebook"]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[:-1], "announces"),
        (lambda data: data + b"x", "announces"),
        (lambda data: data[:20], "too short"),
        (lambda data: data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "checksum"),
        (lambda data: b"GARBAGE!" + data[8:], "not a starfed codebook file"),
    ],
)
def test_damaged_files_are_rejected(
    codebook: Codebook, tmp_path: Path, damage: Callable[[bytes], bytes], reason: str
) -> None:
    path = tmp_path / "model.codebook"
    wire.write_file(path, codebook)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CodebookError, match=reason):
        wire.read_file(path)


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        wire.read_file(tmp_path / "absent")


def test_only_a_whole_codebook_is_written_to_a_file(codebook: Codebook, tmp_path: Path) -> None:
    """A delta or an update means something only against the codebook it was made from, so it
    is a message, never a file (cc93ac0 wrote a delta with the update header: unreadable)."""
    newer = codebook.set_values({"class_1": {"key": torch.ones(codebook.dims.d_clip)}})
    for message in (newer.delta(since=codebook.version), site_update(codebook, Phase.STAGE1)):
        with pytest.raises(TypeError, match="whole codebook"):
            wire.write_file(tmp_path / "message.bin", message)
    assert not (tmp_path / "message.bin").exists()


# --- validation ----------------------------------------------------------------------------------


def test_expected_fingerprint_and_dims(codebook: Codebook, tiny_dims: ModelDims) -> None:
    data = wire.encode(codebook)
    wire.decode_codebook(data, fingerprint=codebook.fingerprint, dims=tiny_dims)
    with pytest.raises(CodebookError, match="fingerprint"):
        wire.decode_codebook(data, fingerprint="cd" * 32)
    other = ModelDims(tiny_dims.d_txt, tiny_dims.d_clip, tiny_dims.d_vit, tiny_dims.n_layers + 1)
    with pytest.raises(CodebookError, match="dims"):
        wire.decode_codebook(data, dims=other)


def test_size_limit_is_checked_before_parsing(codebook: Codebook) -> None:
    data = wire.encode(codebook)
    with pytest.raises(CodebookError, match="exceeds the limit"):
        wire.decode_codebook(data, max_bytes=len(data) - 1)
    with pytest.raises(CodebookError, match="exceeds the limit"):
        wire.decode_codebook(b"\xff" * 100, max_bytes=10)  # garbage never reaches the parser


def test_garbage_is_a_codebook_error() -> None:
    with pytest.raises(CodebookError, match="not a valid Codebook"):
        wire.decode_codebook(b"\xff\xff\xff\xff")


def _set_float(tensor: pb.Tensor, index: int, value: float) -> None:
    dtype = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT64: "<f8"}[tensor.dtype]
    array = np.frombuffer(tensor.data, dtype=dtype).copy()
    array[index] = value
    tensor.data = array.tobytes()


MUTATIONS: dict[str, tuple[Callable[[pb.Codebook], None], str]] = {
    "schema version": (lambda m: setattr(m, "schema_version", 2), "schema version"),
    "empty fingerprint": (lambda m: setattr(m, "backbone_fingerprint", ""), "fingerprint"),
    "zero dim": (lambda m: setattr(m.dims, "d_vit", 0), "dims must be"),
    "unknown dtype": (lambda m: setattr(m.entries[0].prompt, "dtype", 7), "dtype 7"),
    "unspecified dtype": (lambda m: setattr(m.entries[0].key, "dtype", 0), "dtype 0"),
    "short data": (
        lambda m: setattr(m.entries[1].key, "data", m.entries[1].key.data[:-4]),
        "bytes of data",
    ),
    "wrong shape": (lambda m: m.entries[1].query_prompt.shape.append(1), "shape"),
    "swapped shape": (lambda m: m.entries[1].query_prompt.shape.reverse(), "shape"),
    "missing tensor": (lambda m: m.entries[2].ClearField("aligned_head_bias"), "missing"),
    "nan": (lambda m: _set_float(m.entries[2].query_weight, 3, math.nan), "NaN"),
    "inf bias": (lambda m: _set_float(m.entries[2].head_bias, 0, math.inf), "infinite"),
    "float64 beyond float32": (
        lambda m: m.entries[0].head_bias.CopyFrom(
            pb.Tensor(dtype=pb.DTYPE_FLOAT64, data=np.array(1e300, "<f8").tobytes())
        ),
        "infinite",
    ),
    "count zero with mixtures": (lambda m: setattr(m.entries[1], "count", 0), "count"),
    "negative count": (lambda m: setattr(m.entries[3], "count", -1), "count"),
    "frozen untrained": (
        lambda m: (setattr(m.entries[3], "count", 0), setattr(m.entries[3], "frozen", True)),
        "count",
    ),
    "weights not summing to one": (
        lambda m: _set_float(m.entries[0].clip_mixture.weights, 0, 0.9),
        "sum to",
    ),
    "negative variance": (
        lambda m: _set_float(m.entries[0].vit_mixture.variances, 5, -1.0),
        "positive",
    ),
    "zero variance": (lambda m: _set_float(m.entries[0].vit_mixture.variances, 0, 0.0), "positive"),
    "nan mean": (lambda m: _set_float(m.entries[0].vit_mixture.means, 0, math.nan), "NaN"),
    "mixture count zero": (lambda m: setattr(m.entries[0].clip_mixture, "count", 0), "count"),
    "float32 mixture": (
        lambda m: m.entries[0].clip_mixture.weights.CopyFrom(
            pb.Tensor(shape=[3], dtype=pb.DTYPE_FLOAT32, data=np.full(3, 1 / 3, "<f4").tobytes())
        ),
        "dtype",
    ),
    "mixture of wrong dim": (
        lambda m: m.entries[0].clip_mixture.CopyFrom(m.entries[0].vit_mixture),
        "shape",
    ),
    "empty mixture": (lambda m: m.entries[0].clip_mixture.ClearField("weights"), "weights"),
    "empty name": (lambda m: setattr(m.entries[0], "name", ""), "empty"),
    "long name": (lambda m: setattr(m.entries[0], "name", "x" * 257), "x{60}'… has a name longer"),
    "huge dim": (lambda m: setattr(m.dims, "n_layers", 2**40), "dims must be"),
    "control character": (lambda m: setattr(m.entries[0], "name", "a\nb"), "control"),
    "duplicate name": (lambda m: setattr(m.entries[1], "name", "class_0"), "twice"),
    "entry from the future": (lambda m: setattr(m.entries[0], "version", 6), "version"),
    "negative version": (lambda m: setattr(m, "version", -1), "version"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_invalid_messages_are_rejected(codebook: Codebook, mutation: str) -> None:
    mutate, reason = MUTATIONS[mutation]
    message = wire.to_proto(codebook)
    mutate(message)
    with pytest.raises(CodebookError, match=reason):
        wire.decode_codebook(message.SerializeToString())


def test_untrained_entry_may_have_count_zero(codebook: Codebook) -> None:
    untrained = replace(codebook["class_3"], count=0)  # registered at sync, nothing fitted yet
    codebook = replace(codebook, entries={**codebook.entries, "class_3": untrained})
    assert wire.decode_codebook(wire.encode(codebook))["class_3"].count == 0


def test_values_cannot_be_changed_after_they_are_made(codebook: Codebook) -> None:
    newer = codebook.set_values({"class_1": {"key": torch.ones(codebook.dims.d_clip)}})
    delta, update = newer.delta(since=codebook.version), site_update(codebook, Phase.STAGE2)
    for value, name in ((codebook, "metadata"), (delta, "names"), (update, "entries")):
        with pytest.raises(FrozenInstanceError):
            setattr(value, name, getattr(value, name))
    with pytest.raises(FrozenInstanceError):
        codebook["class_1"].count = 0
    for mapping in (codebook.metadata, codebook.entries, delta.entries, codebook["class_1"].values):
        with pytest.raises(TypeError):
            mapping["extra"] = None
    metadata = {"seed": "1"}
    made = Codebook(codebook.fingerprint, codebook.dims, metadata=metadata)
    metadata["seed"] = "2"  # the codebook holds its own copy
    assert made.metadata == {"seed": "1"}
    assert [e.name for e in update.only({"class_2", "ghost"}).entries] == ["class_2"]
    assert len(update.entries) == 2


# --- site updates ------------------------------------------------------------------------------


def site_update(codebook: Codebook, phase: Phase, names=("class_1", "class_2")) -> ClientUpdate:
    """What a site holding ``names`` returns for ``phase``: the phase's fields, its counts."""
    entries = codebook.bank().entries(names, fields=schema.trained_in(phase))
    return ClientUpdate(
        codebook.fingerprint, codebook.dims, phase, codebook.version, entries, {"node": "7"}
    )


@pytest.mark.parametrize("phase", [p for p in Phase if p is not Phase.EVALUATE])
def test_update_round_trip_per_phase(codebook: Codebook, phase: Phase) -> None:
    update = site_update(codebook, phase)
    message = wire.to_proto(update)
    for entry in message.entries:  # fields the phase does not train stay unset
        for f in schema.FIELDS:
            assert entry.HasField(f.name) == (f.trained_in is phase)
    decoded = wire.decode_update(wire.encode(update), against=codebook, phase=phase)
    assert decoded.phase == phase and decoded.base_version == codebook.version
    assert decoded.metadata == {"node": "7"}
    assert [e.name for e in decoded.entries] == ["class_1", "class_2"]
    for entry in decoded.entries:
        assert entry.count == codebook[entry.name].count
        assert set(entry.values) == set(schema.trained_in(phase))
        for name, value in entry.values.items():
            if isinstance(value, GaussianMixture):
                assert_mixtures_equal(value, codebook[entry.name].values[name])
            else:
                assert torch.equal(value, codebook[entry.name].values[name])


def test_sync_may_name_new_classes(codebook: Codebook) -> None:
    sync = ClientUpdate(
        codebook.fingerprint,
        codebook.dims,
        Phase.SYNC,
        3,
        [ClassEntry("brand new", 3), ClassEntry("class_1", 4)],
    )
    decoded = wire.decode_update(wire.encode(sync), against=codebook, phase=Phase.SYNC)
    assert [(e.name, e.count) for e in decoded.entries] == [("brand new", 3), ("class_1", 4)]
    assert decoded.base_version == 3  # the version the site holds


UPDATE_MUTATIONS: dict[str, tuple[Callable[[pb.ClientUpdate], None], str]] = {
    "other phase": (lambda m: setattr(m, "phase", pb.PHASE_STAGE1), "answers PHASE_STAGE1"),
    "unknown phase": (lambda m: setattr(m, "phase", 9), "answers"),
    "count zero": (lambda m: setattr(m.entries[0], "count", 0), "count"),
    "sets frozen": (lambda m: setattr(m.entries[0], "frozen", True), "frozen"),
    "sets version": (lambda m: setattr(m.entries[0], "version", 3), "version"),
    "stale base version": (lambda m: setattr(m, "base_version", 4), "version 4"),
    "nan": (lambda m: _set_float(m.entries[1].query_prompt, 0, math.nan), "NaN"),
    "wrong shape": (lambda m: m.entries[1].head_weight.shape.append(1), "shape"),
    "missing field": (lambda m: m.entries[1].ClearField("head_bias"), "stage2 carries"),
    "extra field": (lambda m: m.entries[0].key.CopyFrom(m.entries[0].head_weight), "carries"),
    "unregistered class": (lambda m: setattr(m.entries[0], "name", "ghost"), "not registered"),
    "other backbones": (lambda m: setattr(m, "backbone_fingerprint", "cd" * 32), "fingerprint"),
    "duplicate class": (lambda m: setattr(m.entries[1], "name", "class_1"), "twice"),
}


@pytest.mark.parametrize("mutation", sorted(UPDATE_MUTATIONS))
def test_invalid_updates_are_rejected(codebook: Codebook, mutation: str) -> None:
    message = wire.to_proto(site_update(codebook, Phase.STAGE2))
    mutate, reason = UPDATE_MUTATIONS[mutation]
    mutate(message)
    with pytest.raises(CodebookError, match=reason):
        wire.decode_update(message.SerializeToString(), against=codebook, phase=Phase.STAGE2)


def test_update_tensors_are_views_of_the_reply_bytes(codebook: Codebook) -> None:
    """float32 rows are not copied out of the message: they are read where they lie in it."""
    data = wire.encode(site_update(codebook, Phase.STAGE2))
    start = np.frombuffer(data, np.uint8).ctypes.data
    decoded = wire.decode_update(data, against=codebook, phase=Phase.STAGE2)
    for entry in decoded.entries:
        for name, value in entry.values.items():
            assert start <= value.data_ptr() < start + len(data), name
            assert torch.equal(value, codebook[entry.name].values[name])
    halved = wire.encode(site_update(codebook, Phase.STAGE2), dtype="float16")
    decoded = wire.decode_update(halved, against=codebook, phase=Phase.STAGE2)
    assert decoded.entries[0].values["head_weight"].dtype == torch.float32  # converted: a copy


def test_update_mixtures_are_views_of_the_reply_bytes(codebook: Codebook) -> None:
    """A statistics update's float64 mixtures are read where they lie too: the server holds a
    phase's decoded updates between the screening's passes, and that must not copy them."""
    update = site_update(codebook, Phase.STAGE2_STATS)
    data = wire.encode(update)
    start = np.frombuffer(data, np.uint8).ctypes.data
    decoded = wire.decode_update(data, against=codebook, phase=Phase.STAGE2_STATS)
    for entry, sent in zip(decoded.entries, update.entries, strict=True):
        mixture, expected = entry.values["vit_mixture"], sent.values["vit_mixture"]
        for part in ("weights", "means", "variances"):
            value = getattr(mixture, part)
            assert start <= value.data_ptr() < start + len(data), part
            assert torch.equal(value, getattr(expected, part).double()), part


def test_an_update_with_a_mixture_part_twice_is_rejected(codebook: Codebook) -> None:
    """A mixture's means sent twice: protobuf merges them, the views would see one."""
    message = wire.to_proto(site_update(codebook, Phase.STAGE2_STATS))
    mixture = message.entries[0].vit_mixture
    means = mixture.means.SerializeToString(deterministic=True)
    number = pb.Mixture.DESCRIPTOR.fields_by_name["means"].number
    mixture_bytes = mixture.SerializeToString(deterministic=True) + _length_delimited(number, means)
    message.entries[0].ClearField("vit_mixture")
    field = pb.ClassEntry.DESCRIPTOR.fields_by_name["vit_mixture"].number
    entry = message.entries[0].SerializeToString(deterministic=True)
    entry += _length_delimited(field, mixture_bytes)
    del message.entries[0]
    entries = pb.ClientUpdate.DESCRIPTOR.fields_by_name["entries"].number
    data = message.SerializeToString(deterministic=True) + _length_delimited(entries, entry)
    pb.ClientUpdate().ParseFromString(data)  # protobuf itself takes it
    with pytest.raises(CodebookError, match="twice"):
        wire.decode_update(data, against=codebook, phase=Phase.STAGE2_STATS)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return bytes([field << 3 | 2]) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


@pytest.mark.parametrize("twice", ["tensor", "data"])
def test_an_update_with_a_field_twice_is_rejected(codebook: Codebook, twice: str) -> None:
    """protobuf merges a field that appears twice; the views would see only one of them."""
    message = wire.to_proto(site_update(codebook, Phase.STAGE2))
    entry = message.entries[1]
    head = entry.head_weight.SerializeToString(deterministic=True)
    if twice == "data":
        data = pb.Tensor(data=entry.head_weight.data).SerializeToString()
        entry.ClearField("head_weight")
        body = entry.SerializeToString(deterministic=True) + _length_delimited(7, head + data)
    else:
        body = entry.SerializeToString(deterministic=True) + _length_delimited(7, head)
    del message.entries[1]
    data = message.SerializeToString(deterministic=True) + _length_delimited(6, body)
    pb.ClientUpdate().ParseFromString(data)  # protobuf itself takes it
    with pytest.raises(CodebookError, match="twice"):
        wire.decode_update(data, against=codebook, phase=Phase.STAGE2)


# --- the held codebook ---------------------------------------------------------------------------


def test_a_held_version_is_read_from_the_file_header_and_a_bad_file_announces_none(
    codebook: Codebook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site announces its held version at every sync: read from the checksummed header, not by
    decoding every class; a damaged file or one of other backbones announces 0 (the site then
    gets the whole codebook), as when the whole file was decoded."""
    line = Lineage("fed-1", "epoch-a")
    path = tmp_path / "codebook.bin"
    wire.write_file(path, replace(codebook, metadata=line.as_metadata()))
    monkeypatch.setattr(wire, "decode_codebook", None)  # any full decode would fail the test
    assert HeldCodebook(path, fingerprint=codebook.fingerprint).version_for(line) == 5
    assert HeldCodebook(path, fingerprint="cd" * 32).version_for(line) == 0
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert HeldCodebook(path, fingerprint=codebook.fingerprint).version_for(line) == 0


def test_a_held_codebook_takes_a_delta_only_of_its_lineage_and_version(
    codebook: Codebook, tmp_path: Path
) -> None:
    line, rolled_back = Lineage("fed-1", "epoch-a"), Lineage("fed-1", "epoch-b")
    path = tmp_path / "codebook.bin"
    held = HeldCodebook(path, fingerprint=codebook.fingerprint, dims=codebook.dims)
    assert held.codebook() is None and held.version_for(line) == 0
    first = replace(codebook.broadcast(), metadata=line.as_metadata())
    held.receive(wire.encode(first))
    assert held.version_for(line) == 5
    assert held.version_for(rolled_back) == 0 and held.version_for(Lineage("fed-2", "epoch-a")) == 0

    newer = codebook.set_values({"class_1": {"key": torch.ones(codebook.dims.d_clip)}})
    delta = replace(newer.delta(since=5), metadata=line.as_metadata())
    assert_entries_equal(held.receive(delta), newer.broadcast())
    again = HeldCodebook(path)  # persisted: another process holds it too
    assert again.version_for(line) == 6 and again.codebook().metadata == line.as_metadata()

    newest = newer.set_values({"class_2": {"key": torch.ones(codebook.dims.d_clip)}})
    other_line = replace(newest.delta(since=6), metadata=rolled_back.as_metadata())
    with pytest.raises(CodebookError, match="not held"):
        held.receive(wire.encode(other_line))
    other_base = replace(newest.delta(since=5), metadata=line.as_metadata())
    with pytest.raises(CodebookError, match="cannot apply to version 6"):
        held.receive(other_base)
    assert held.version_for(line) == 6  # a refused delta changes nothing
    held.forget()
    assert held.codebook() is None and not path.exists()
    with pytest.raises(CodebookError, match="not held"):
        held.receive(replace(newest.delta(since=6), metadata=line.as_metadata()))


def test_receivers_of_one_process_share_what_they_decode_and_each_writes_its_own_file(
    codebook: Codebook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulation's process answers for many sites, each sent the same bytes: they are
    decoded once, a delta is applied once, and a held file unchanged since this process read
    or wrote it is not decoded again (``held.Shared``) — yet every site's file is written and
    reads back, in another process, as the codebook it was sent."""
    line = Lineage("fed-1", "epoch-a").as_metadata()
    first = replace(codebook.broadcast(), metadata=line)
    newer = codebook.set_values({"class_1": {"key": torch.ones(codebook.dims.d_clip)}})
    delta = wire.encode(replace(newer.delta(since=5), metadata=line))
    whole = wire.encode(first)
    sites = [
        HeldCodebook(tmp_path / f"site-{i}" / "codebook.bin", fingerprint=codebook.fingerprint)
        for i in range(3)
    ]
    decoded = [site.receive(whole) for site in sites]
    assert decoded[0] is decoded[1] is decoded[2]
    rebuilt = [HeldCodebook(site.path, fingerprint=codebook.fingerprint) for site in sites]
    decodes = []
    monkeypatch.setattr(held_module.store_io, "load", lambda *a, **k: decodes.append(a))
    assert all(site.codebook() is decoded[0] for site in rebuilt)  # remembered, not decoded
    monkeypatch.undo()
    applied = [site.receive(delta) for site in rebuilt]
    assert applied[0] is applied[1] is applied[2] and decodes == []
    for site in sites:  # as another process reads them: from the disk
        assert_entries_equal(HeldCodebook(site.path).codebook(), newer.broadcast())
    changed = sites[0].path
    os.utime(changed, ns=(0, 0))  # the file changed since: read again
    reread = HeldCodebook(changed, fingerprint=codebook.fingerprint).codebook()
    assert reread is not applied[0]
    assert_entries_equal(reread, newer.broadcast())


# --- command line --------------------------------------------------------------------------------


def test_cli_inspect(
    codebook: Codebook, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.codebook"
    wire.write_file(path, codebook)
    assert cli_main(["codebook", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert codebook.fingerprint in out
    assert "d_txt=8 d_clip=6 d_vit=10 n_layers=2" in out
    assert "4 (1 frozen)" in out
    for name in codebook.names:
        assert name in out
    for f in schema.FIELDS:
        assert f"{f.symbol} ({f.name})" in out
    assert f"{path.stat().st_size - 48:,}" in out  # total = the payload after the file header


def test_cli_diff(codebook: Codebook, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wire.write_file(tmp_path / "a", codebook)
    key = codebook["class_1"].values["key"].clone()
    key[0] += 0.5
    newer = codebook.set_values({"class_1": {"key": key}})
    renamed = replace(newer["class_2"], name="renamed")
    newer = newer.without(["class_2"]).register([renamed])
    wire.write_file(tmp_path / "b", newer)
    assert cli_main(["codebook", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "5 → 8" in out
    assert "added        renamed" in out
    assert "removed      class_2" in out
    assert "w_c 5.00e-01" in out
    assert "unchanged" in out


def test_cli_output_piped_keeps_every_class_name_whole_on_one_line(
    codebook: Codebook,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Piped (``inspect > file``), no terminal width applies: the bundled data set's longest
    class names, one with a space, stay whole on one line in every table, as does the path."""
    monkeypatch.delenv("COLUMNS", raising=False)
    names = sorted(p.name for p in (bundled_dataset_root() / "train").iterdir())
    names = sorted(names, key=len)[-len(codebook) :]
    renamed = [replace(e, name=n) for e, n in zip(codebook.entries.values(), names, strict=True)]
    long = codebook.without(codebook.names).register(renamed)
    folder = tmp_path / ("a folder with a long name, " * 4).strip()
    folder.mkdir()
    wire.write_file(folder / "model.codebook", long)
    wire.write_file(folder / "other.codebook", codebook)
    assert cli_main(["codebook", "inspect", str(folder / "model.codebook")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(folder / "model.codebook")
    for name in names:
        assert any(name in line for line in lines), name
    files = [str(folder / "other.codebook"), str(folder / "model.codebook")]
    assert cli_main(["codebook", "diff", *files]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == " → ".join(files)
    assert next(line for line in lines if line.startswith("added")).endswith(", ".join(names))


@pytest.mark.parametrize("action", ["inspect", "diff"])
def test_cli_bad_files_exit_2_with_one_line(
    codebook: Codebook, tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    good = tmp_path / "good"
    wire.write_file(good, codebook)
    corrupt = tmp_path / "corrupt"
    corrupt.write_bytes(good.read_bytes()[:-3])
    for bad in (corrupt, tmp_path / "missing"):
        files = [str(bad)] if action == "inspect" else [str(good), str(bad)]
        assert cli_main(["codebook", action, *files]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"starfed codebook {action}: error: ")
        assert captured.err.count("\n") == 1
        assert "Traceback" not in captured.err
