"""Codebook and ClientUpdate: exact round trips, float16, files, validation errors, the CLI."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from starfed.cli import main as cli_main
from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook.codebook import (
    MIXTURE_FIELDS,
    PHASE_FIELDS,
    ClientUpdate,
    Codebook,
    CodebookError,
    Phase,
)
from starfed.shared.codebook.entry import ClassBank, ModelDims
from starfed.shared.codebook.mixture import GaussianMixture


def assert_mixtures_equal(a: GaussianMixture | None, b: GaussianMixture | None) -> None:
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert a.count == b.count
        for name in ("weights", "means", "variances"):
            assert getattr(a, name).dtype == torch.float64
            assert torch.equal(getattr(a, name), getattr(b, name))


def assert_banks_equal(a: ClassBank, b: ClassBank) -> None:
    assert a.dims == b.dims
    assert a.names == b.names
    assert a.counts == b.counts
    assert a.versions == b.versions
    for name in ClassBank.TENSOR_FIELDS:
        assert getattr(a, name).dtype == getattr(b, name).dtype == torch.float32
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in MIXTURE_FIELDS:
        for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
            assert_mixtures_equal(x, y)


@pytest.fixture
def codebook(make_bank: Callable[..., ClassBank], fingerprint: str) -> Codebook:
    bank = make_bank(n_classes=4)
    bank.clip_mixtures[3] = None  # a class whose statistics are not fitted yet
    bank.vit_mixtures[3] = None
    return Codebook.from_bank(
        bank, fingerprint, version=5, frozen={"class_0"}, metadata={"seed": "1993", "task": "2"}
    )


# --- round trips ---------------------------------------------------------------------------------


def test_bank_bytes_bank_round_trip_is_exact(codebook: Codebook, fingerprint: str) -> None:
    decoded = Codebook.from_bytes(codebook.to_bytes())
    assert_banks_equal(decoded.to_bank(), codebook.bank)
    assert decoded.fingerprint == fingerprint
    assert decoded.version == 5
    assert decoded.frozen == {"class_0"}
    assert decoded.metadata == {"seed": "1993", "task": "2"}
    assert decoded.dims == codebook.dims


def test_proto_round_trip_is_exact(codebook: Codebook) -> None:
    assert_banks_equal(Codebook.from_proto(codebook.to_proto()).bank, codebook.bank)


def test_empty_codebook_round_trips(tiny_dims: ModelDims, fingerprint: str) -> None:
    decoded = Codebook.from_bytes(Codebook(fingerprint, ClassBank(tiny_dims)).to_bytes())
    assert decoded.bank.names == []
    assert decoded.bank.query_prompts.shape == (0, tiny_dims.n_layers, tiny_dims.d_vit)


def test_from_bank_and_to_bank_copy(
    codebook: Codebook, make_bank: Callable[..., ClassBank]
) -> None:
    bank = make_bank()
    snapshot = Codebook.from_bank(bank, "f" * 64)
    bank.prompts.add_(1.0)
    assert not torch.equal(snapshot.bank.prompts, bank.prompts)
    copy = codebook.to_bank()
    copy.prompts.zero_()
    assert codebook.bank.prompts.abs().sum() > 0


def test_serialisation_is_deterministic(codebook: Codebook) -> None:
    reordered = Codebook.from_bank(
        codebook.bank,
        codebook.fingerprint,
        version=codebook.version,
        frozen=codebook.frozen,
        metadata=dict(reversed(codebook.metadata.items())),
    )
    assert codebook.to_bytes() == reordered.to_bytes()


def test_float16_halves_tensors_within_documented_error(codebook: Codebook) -> None:
    bank = codebook.bank
    bank.prompts[1, :3] = torch.tensor([1e-6, -3e-7, 60000.0])  # subnormal and near the top
    full, half = codebook.to_bytes("float32"), codebook.to_bytes("float16")
    tensor_values = sum(getattr(bank, f).numel() for f in ClassBank.TENSOR_FIELDS)
    assert len(full) - len(half) == 2 * tensor_values
    decoded = Codebook.from_bytes(half)
    for name in ClassBank.TENSOR_FIELDS:
        original, restored = getattr(bank, name), getattr(decoded.bank, name)
        assert restored.dtype == torch.float32
        bound = torch.maximum(original.abs() * 2.0**-11, torch.full_like(original, 2.0**-25))
        assert ((restored - original).abs() <= bound).all(), name
    for name in MIXTURE_FIELDS:  # always float64, exact
        for x, y in zip(getattr(bank, name), getattr(decoded.bank, name), strict=True):
            assert_mixtures_equal(x, y)


def test_float16_overflow_is_refused(codebook: Codebook) -> None:
    codebook.bank.keys[2, 0] = 1e5
    codebook.to_bytes("float32")
    with pytest.raises(CodebookError, match=r"class_2/keys.*FLOAT16"):
        codebook.to_bytes("float16")


def test_unknown_wire_dtype_is_a_usage_error(codebook: Codebook) -> None:
    with pytest.raises(ValueError, match="wire dtype"):
        codebook.to_bytes("bfloat16")


def test_encoding_refuses_invalid_values(codebook: Codebook) -> None:
    codebook.bank.query_weights[1, 0, 0] = float("nan")
    with pytest.raises(CodebookError, match=r"class_1.*query_weights.*NaN"):
        codebook.to_bytes()


# --- files ---------------------------------------------------------------------------------------


def test_broadcast_copy_leaves_out_only_the_mixtures(codebook: Codebook) -> None:
    lean = codebook.without_mixtures()
    decoded = Codebook.from_bytes(lean.to_bytes())
    assert decoded.bank.names == codebook.bank.names and decoded.frozen == codebook.frozen
    for name in ClassBank.TENSOR_FIELDS:
        assert torch.equal(getattr(decoded.bank, name), getattr(codebook.bank, name))
    assert all(m is None for m in decoded.bank.clip_mixtures + decoded.bank.vit_mixtures)
    assert any(m is not None for m in codebook.bank.clip_mixtures)  # the original is untouched
    assert len(lean.to_bytes()) < len(codebook.to_bytes())


def test_file_round_trip(codebook: Codebook, tmp_path: Path) -> None:
    path = tmp_path / "model.codebook"
    codebook.save(path)
    codebook.save(path)  # replacing an existing file
    assert_banks_equal(Codebook.load(path).bank, codebook.bank)
    assert os.listdir(tmp_path) == ["model.codebook"]  # no temporary file left behind


def test_failed_save_keeps_the_old_file(
    codebook: Codebook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.codebook"
    codebook.save(path)
    before = path.read_bytes()
    codebook.version += 1

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        codebook.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.codebook"]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[:-1], "announces"),
        (lambda data: data + b"x", "announces"),
        (lambda data: data[:20], "too short"),
        (lambda data: data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "checksum"),
        (lambda data: b"SFUPDATE" + data[8:], "client update file"),
        (lambda data: b"GARBAGE!" + data[8:], "not a starfed file"),
    ],
)
def test_damaged_files_are_rejected(
    codebook: Codebook, tmp_path: Path, damage: Callable[[bytes], bytes], reason: str
) -> None:
    path = tmp_path / "model.codebook"
    codebook.save(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CodebookError, match=reason):
        Codebook.load(path)


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Codebook.load(tmp_path / "absent")


# --- validation ----------------------------------------------------------------------------------


def test_expected_fingerprint_and_dims(codebook: Codebook, tiny_dims: ModelDims) -> None:
    data = codebook.to_bytes()
    Codebook.from_bytes(data, fingerprint=codebook.fingerprint, dims=tiny_dims)
    with pytest.raises(CodebookError, match="fingerprint"):
        Codebook.from_bytes(data, fingerprint="cd" * 32)
    other = ModelDims(tiny_dims.d_txt, tiny_dims.d_clip, tiny_dims.d_vit, tiny_dims.n_layers + 1)
    with pytest.raises(CodebookError, match="dims"):
        Codebook.from_bytes(data, dims=other)


def test_size_limit_is_checked_before_parsing(codebook: Codebook) -> None:
    data = codebook.to_bytes()
    with pytest.raises(CodebookError, match="exceeds the limit"):
        Codebook.from_bytes(data, max_bytes=len(data) - 1)
    with pytest.raises(CodebookError, match="exceeds the limit"):
        Codebook.from_bytes(b"\xff" * 100, max_bytes=10)  # garbage never reaches the parser


def test_garbage_is_a_codebook_error() -> None:
    with pytest.raises(CodebookError, match="not a valid Codebook"):
        Codebook.from_bytes(b"\xff\xff\xff\xff")


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
    message = codebook.to_proto()
    mutate(message)
    with pytest.raises(CodebookError, match=reason):
        Codebook.from_bytes(message.SerializeToString())


def test_untrained_entry_may_have_count_zero(codebook: Codebook) -> None:
    codebook.bank.counts[3] = 0  # registered at sync, nothing fitted yet
    assert Codebook.from_bytes(codebook.to_bytes()).bank.counts[3] == 0


def test_frozen_names_must_exist(codebook: Codebook) -> None:
    codebook.frozen.add("ghost")
    with pytest.raises(CodebookError, match="ghost"):
        codebook.validate()


# --- client updates ------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", list(Phase))
def test_update_round_trip_per_phase(codebook: Codebook, phase: Phase, tmp_path: Path) -> None:
    classes = ["class_1", "class_2"]
    update = ClientUpdate.from_bank(
        codebook.bank,
        fingerprint=codebook.fingerprint,
        phase=phase,
        base_version=codebook.version,
        classes=classes,
        metadata={"node": "7"},
    )
    message = update.to_proto()
    proto_fields = {"prompt": "prompts", "key": "keys", "head_bias": "head_bias"}
    proto_fields |= {"query_prompt": "query_prompts", "vit_mixture": "vit_mixtures"}
    for entry in message.entries:  # parts the phase does not train stay unset
        for proto_field, bank_field in proto_fields.items():
            assert entry.HasField(proto_field) == (bank_field in PHASE_FIELDS[phase])
    path = tmp_path / "update.bin"
    update.save(path)
    for decoded in (ClientUpdate.from_bytes(update.to_bytes()), ClientUpdate.load(path)):
        assert decoded.phase == phase
        assert decoded.base_version == codebook.version
        assert decoded.metadata == {"node": "7"}
        assert [e.name for e in decoded.entries] == classes
        for entry, i in zip(decoded.entries, (1, 2), strict=True):
            assert entry.count == codebook.bank.counts[i]
            assert set(entry.tensors) | set(entry.mixtures) == set(PHASE_FIELDS[phase])
            for field_name, value in entry.tensors.items():
                assert torch.equal(value, getattr(codebook.bank, field_name)[i])
            for field_name, mixture in entry.mixtures.items():
                assert_mixtures_equal(mixture, getattr(codebook.bank, field_name)[i])


def test_update_file_is_not_a_codebook(codebook: Codebook, tmp_path: Path) -> None:
    update = ClientUpdate.from_bank(
        codebook.bank, fingerprint=codebook.fingerprint, phase=Phase.SYNC, base_version=5
    )
    update.save(tmp_path / "u")
    with pytest.raises(CodebookError, match="client update file"):
        Codebook.load(tmp_path / "u")


def test_update_without_statistics_to_send(codebook: Codebook) -> None:
    with pytest.raises(ValueError, match="'class_3' has no clip_mixtures"):
        ClientUpdate.from_bank(
            codebook.bank,
            fingerprint=codebook.fingerprint,
            phase=Phase.STAGE1_STATS,
            base_version=5,
        )


UPDATE_MUTATIONS: dict[str, tuple[Callable[[pb.ClientUpdate], None], str]] = {
    "unknown phase": (lambda m: setattr(m, "phase", 9), "phase"),
    "unspecified phase": (lambda m: setattr(m, "phase", 0), "phase"),
    "count zero": (lambda m: setattr(m.entries[0], "count", 0), "count"),
    "sets frozen": (lambda m: setattr(m.entries[0], "frozen", True), "frozen"),
    "sets version": (lambda m: setattr(m.entries[0], "version", 3), "version"),
    "negative base version": (lambda m: setattr(m, "base_version", -1), "base version"),
    "nan": (lambda m: _set_float(m.entries[1].query_prompt, 0, math.nan), "NaN"),
    "wrong shape": (lambda m: m.entries[1].head_weight.shape.append(1), "shape"),
}


@pytest.mark.parametrize("mutation", sorted(UPDATE_MUTATIONS))
def test_invalid_updates_are_rejected(codebook: Codebook, mutation: str) -> None:
    update = ClientUpdate.from_bank(
        codebook.bank,
        fingerprint=codebook.fingerprint,
        phase=Phase.STAGE2,
        base_version=5,
        classes=["class_1", "class_2"],
    )
    message = update.to_proto()
    mutate, reason = UPDATE_MUTATIONS[mutation]
    mutate(message)
    with pytest.raises(CodebookError, match=reason):
        ClientUpdate.from_bytes(message.SerializeToString())


# --- command line --------------------------------------------------------------------------------


@pytest.fixture
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


@pytest.mark.usefixtures("wide_terminal")
def test_cli_inspect(
    codebook: Codebook, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.codebook"
    codebook.save(path)
    assert cli_main(["codebook", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert codebook.fingerprint in out
    assert "d_txt=8 d_clip=6 d_vit=10 n_layers=2" in out
    assert "4 (1 frozen)" in out
    for name in codebook.bank.names:
        assert name in out
    for part in ("prompts (p)", "keys (w)", "query prompts (Q)", "query weights (A)", "heads"):
        assert part in out
    assert f"{path.stat().st_size - 48:,}" in out  # total = the payload after the file header


@pytest.mark.usefixtures("wide_terminal")
def test_cli_diff(
    codebook: Codebook,
    make_bank: Callable[..., ClassBank],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    codebook.save(tmp_path / "a")
    bank = codebook.to_bank()
    bank.keys[1, 0] += 0.5
    bank.names[2] = "renamed"
    newer = Codebook.from_bank(bank, codebook.fingerprint, version=7, frozen={"class_0"})
    newer.save(tmp_path / "b")
    assert cli_main(["codebook", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "5 → 7" in out
    assert "added        renamed" in out
    assert "removed      class_2" in out
    assert "w 5.00e-01" in out
    assert "unchanged" in out


@pytest.mark.parametrize("action", ["inspect", "diff"])
def test_cli_bad_files_exit_2_with_one_line(
    codebook: Codebook, tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    good = tmp_path / "good"
    codebook.save(good)
    corrupt = tmp_path / "corrupt"
    corrupt.write_bytes(good.read_bytes()[:-3])
    for bad in (corrupt, tmp_path / "missing"):
        files = [str(bad)] if action == "inspect" else [str(good), str(bad)]
        assert cli_main(["codebook", action, *files]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("starfed codebook: error: ")
        assert captured.err.count("\n") == 1
        assert "Traceback" not in captured.err
