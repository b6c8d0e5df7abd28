"""The federation folder's codebook store (issue 34): a checkpoint writes what changed.

A codebook of 40 classes at small dims, with mixtures, is checkpointed, then changed the way a
step changes it (a few classes' prompts, every class's aligned head, new classes): each
checkpoint's bytes are measured against the encoded size of what changed, and the folder is read
back, checked and rolled back as a run would. A folder of the layout before the store moves in
once, keeping its bytes.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from codebooks import changed_fields, full_entry

from starfed.cli import main as cli_main
from starfed.server import folder_check, folder_repair
from starfed.server.federation import Federation
from starfed.server.folder_files import (
    CHECKPOINTS_DIR,
    CODEBOOK_FILE,
    HISTORY_FILE,
    PREVIOUS_FILE,
    STEP_START_FILE,
)
from starfed.server.records import POSITION_KEY, Position, StepRecord
from starfed.server.serving import export
from starfed.shared.codebook import framing, schema, store_io, store_layout, wire
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.held import HeldCodebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.run_status import COMPLETED, FAILED

DIMS = ModelDims(d_txt=48, d_clip=32, d_vit=40, n_layers=3)
FINGERPRINT = "cd" * 32


def entry(name: str, generator: torch.Generator) -> ClassEntry:
    return full_entry(name, DIMS, generator, components=3)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(34)


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / store_layout.STORE_DIR).glob("*.bin"))


def equal(a: Codebook, b: Codebook) -> bool:
    """Same classes, order, counts, flags and values (bit for bit)."""
    if a.names != b.names or a.version != b.version:
        return False
    for name in a.names:
        x, y = a[name], b[name]
        if (x.count, x.frozen, set(x.values)) != (y.count, y.frozen, set(y.values)):
            return False
        for f, v in x.values.items():
            w = y.values[f]
            same = (
                torch.equal(v.means, w.means)
                if isinstance(v, GaussianMixture)
                else (torch.equal(v, w))
            )
            if not same:
                return False
    return True


def checked(federation: Federation, codebook: Codebook) -> list[str]:
    """``starfed server check``'s problems, the registry made to name ``codebook``'s classes
    (these tests write codebooks without steps)."""
    federation.unregister(list(federation.registry))
    federation.register(codebook.names, 0, {})
    return folder_check.check(federation.root).problems


def heads(codebook: Codebook, generator: torch.Generator) -> dict:
    """A new aligned head for every class, as the second-level replay gives."""
    return {
        n: {"aligned_head_weight": torch.randn(DIMS.d_vit, generator=generator)}
        for n in codebook.names
    }


def test_a_checkpoint_writes_what_changed_not_the_codebook(tmp_path: Path, generator) -> None:
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(40)])
    codebook = federation.checkpoint(codebook, Position(0))
    whole = len(wire.encode(codebook))
    steps = [
        lambda c: c.set_values(
            {n: {"prompt": torch.randn(DIMS.d_txt, generator=generator)} for n in c.names[:3]}
        ),
        lambda c: c.set_values(heads(c, generator)),
        lambda c: c.register([entry(f"new{i}", generator) for i in range(2)]),
        lambda c: c.without(["c5"]),
    ]
    for change in steps:
        before_bytes, before = store_bytes(root), codebook
        codebook = federation.checkpoint(change(codebook), Position(0))
        changed = len(wire.encode(changed_fields(before, codebook)))
        written = store_bytes(root) - before_bytes + (root / CODEBOOK_FILE).stat().st_size
        assert written <= 2 * changed + 4096, (written, changed)
        assert written < whole / 4, (written, whole)
        back = Federation.open(root).checkpoints.codebook()
        assert equal(back, codebook)
    assert checked(federation, codebook) == []


def test_the_position_is_committed_with_the_codebook_and_handed_out_by_the_store_alone(
    tmp_path: Path, generator
) -> None:
    """The position is written in codebook.bin's manifest, beside its codebook (the one atomic
    write, bytes as before), but a codebook the store hands out carries none: the store's
    ``position`` is it, after a commit and in a run that reads the folder again."""
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(3)])
    running = Position(0, running=True, done=("sync/0",), in_play=("c2",))
    committed = federation.checkpoint(codebook, running)
    assert POSITION_KEY not in committed.metadata and federation.checkpoints.position == running
    on_disk = framing.read_message(root / CODEBOOK_FILE).metadata
    assert Position.from_metadata(on_disk) == running
    again = Federation.open(root).checkpoints
    assert POSITION_KEY not in again.codebook().metadata and again.position == running
    assert Federation.open(root).checkpoints.position == running  # without reading the codebook


def test_a_record_no_manifest_names_is_never_read(tmp_path: Path, generator) -> None:
    """A crash after a record is appended and before its manifest is written: the folder
    reads as the last commit, and the next checkpoint goes on from it."""
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    first = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(5)])
    first = federation.checkpoint(first, Position(0))
    lost = first.set_values(heads(first, generator))
    since = federation.checkpoints._stored
    store_io.save(
        root / store_layout.STORE_DIR, lost, since
    )  # appended; its manifest never written
    assert equal(Federation.open(root).checkpoints.codebook(), first)
    again = Federation.open(root)
    resumed = again.checkpoints.codebook()
    later = again.checkpoint(resumed.set_values(heads(resumed, generator)), Position(0))
    assert equal(Federation.open(root).checkpoints.codebook(), later)
    assert checked(again, later) == []


def test_a_failed_step_rolls_back_without_writing_a_record(tmp_path: Path, generator) -> None:
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    start = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(5)])
    start = federation.checkpoint(start, Position(0))
    federation.begin_step(start)
    running = start.register([entry("new", generator)])
    federation.checkpoint(running, Position(0, running=True, done=("sync/0",), in_play=("new",)))
    log_bytes = store_bytes(root)
    record = StepRecord(0, FAILED, 0.0, 1.0, reason="a test")
    back = federation.end_step(record, None)
    assert store_bytes(root) == log_bytes  # a manifest naming the start's bytes, nothing more
    assert back.names == start.names and equal(Federation.open(root).checkpoints.codebook(), back)
    resumed = Federation.open(root)  # a new run rolls back from step-start.bin's manifest
    resumed.begin_step(resumed.checkpoints.codebook())
    assert resumed.end_step(record, None).names == start.names


def test_a_long_log_is_compacted_into_a_new_base(tmp_path: Path, generator) -> None:
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(8)])
    codebook = federation.checkpoint(codebook, Position(0))
    first_base = federation.checkpoints._stored.ref.base
    for _ in range(60):
        codebook = federation.checkpoint(
            codebook.set_values(heads(codebook, generator)), Position(0)
        )
    ref = federation.checkpoints._stored.ref
    assert ref.base != first_base  # compacted
    assert ref.log_bytes <= store_io.COMPACT_AT * federation.checkpoints._stored.base_bytes
    assert equal(Federation.open(root).checkpoints.codebook(), codebook)


def test_a_folder_of_the_layout_before_moves_in_once(tmp_path: Path, generator) -> None:
    """Whole codebook files become bases of the store (their bytes kept, not copied) and
    manifests take their places; the folder reads, checks and rolls back as before."""
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)  # writes federation.json
    old = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(6)])
    old = replace(old, metadata=Position(1).as_metadata())
    (root / CHECKPOINTS_DIR).mkdir()
    for path in (
        root / CODEBOOK_FILE,
        root / PREVIOUS_FILE,
        root / CHECKPOINTS_DIR / "step-0001.bin",
    ):
        wire.write_file(path, old)
    whole = (root / CODEBOOK_FILE).read_bytes()
    federation.register(old.names, 0, {})
    (root / HISTORY_FILE).write_text(StepRecord(0, COMPLETED, 0.0, 1.0).to_json() + "\n")
    assert equal(wire.read_file(root / CODEBOOK_FILE), old)  # the old layout reads as before
    federation = Federation.open(root)
    moved = federation.checkpoints.migrate()
    assert sorted(moved) == sorted([CODEBOOK_FILE, PREVIOUS_FILE, "checkpoints/step-0001.bin"])
    assert Federation.open(root).checkpoints.migrate() == []  # once
    bases = list((root / store_layout.STORE_DIR).glob("base-*.bin"))
    assert len(bases) == 3 and all(b.read_bytes() == whole for b in bases)
    assert (root / CODEBOOK_FILE).stat().st_size < len(whole) / 10
    codebook = Federation.open(root).checkpoints.codebook()
    assert equal(codebook, old)
    assert Federation.open(root).checkpoints.position == Position(1)  # the old file's
    assert folder_check.check(root).ok, folder_check.check(root).problems
    federation = Federation.open(root)
    (root / CODEBOOK_FILE).write_bytes(whole)  # a folder not moved in yet, read by a run
    codebook = federation.checkpoints.codebook()
    before = store_bytes(root) + len(whole)  # + the whole file linked in as a base
    later = federation.checkpoint(codebook.set_values(heads(codebook, generator)), Position(1))
    assert store_bytes(root) - before < len(whole) / 4  # the moved file is followed, not copied
    assert equal(Federation.open(root).checkpoints.codebook(), later)
    os.unlink(root / CODEBOOK_FILE)
    repair = folder_repair.plan(root)
    assert any("restore codebook.bin from" in a.what for a in repair.actions)
    folder_repair.apply(repair)
    assert folder_check.check(root).ok, folder_check.check(root).problems


def test_a_damaged_store_is_named_by_check(tmp_path: Path, generator) -> None:
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(4)])
    codebook = federation.checkpoint(codebook, Position(0))
    federation.checkpoint(codebook.set_values(heads(codebook, generator)), Position(0))
    federation.register(codebook.names, 0, {})
    log = root / store_layout.STORE_DIR / federation.checkpoints._stored.ref.log
    data = bytearray(log.read_bytes())
    data[-3] ^= 1
    log.write_bytes(bytes(data))
    problems = folder_check.check(root).problems
    assert any(p.startswith("codebook.bin: ") and "checksum mismatch" in p for p in problems)
    quick = folder_check.check(root, depth=folder_check.Depth.HEADERS, kept=False)
    assert quick.ok  # status reads no store bytes: a log's bytes are check's to verify
    log.write_bytes(bytes(data[:-10]))
    quick = folder_check.check(root, depth=folder_check.Depth.HEADERS, kept=False)
    assert any("truncated" in p for p in quick.problems), quick.problems
    with pytest.raises(CodebookError, match="beyond the end of the log"):
        wire.read_file(root / CODEBOOK_FILE)
    assert (root / STEP_START_FILE).exists() is False


def test_a_held_codebook_writes_what_a_delta_changed(tmp_path: Path, generator) -> None:
    """A site's held copy (``HeldCodebook``): a delta received appends what it changed; the
    copy reads back whole, in this process and another."""
    line = Lineage("fed-1", "epoch-a").as_metadata()
    path = tmp_path / "state" / "codebook.bin"
    held = HeldCodebook(path, fingerprint=FINGERPRINT, dims=DIMS)
    server = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(40)])
    held.receive(wire.encode(replace(server.broadcast(), metadata=line)))
    for _ in range(3):
        newer = server.set_values(
            {n: {"key": torch.randn(DIMS.d_clip, generator=generator)} for n in server.names[:2]}
        )
        delta = wire.encode(replace(newer.delta(since=server.version), metadata=line))
        before = sum(p.stat().st_size for p in path.parent.rglob("*.bin"))
        held.receive(delta)
        written = sum(p.stat().st_size for p in path.parent.rglob("*.bin")) - before
        assert written <= 2 * len(delta) + path.stat().st_size, (written, len(delta))
        server = newer
    assert equal(HeldCodebook(path).codebook(), replace(server.broadcast(), metadata=line))
    held.forget()
    assert not list(path.parent.rglob("*.bin"))


def test_inspect_reads_a_manifest_as_its_codebook(tmp_path: Path, generator, capsys) -> None:
    federation = Federation(tmp_path / "federation", FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(3)])
    federation.checkpoint(codebook, Position(0))
    assert cli_main(["codebook", "inspect", str(tmp_path / "federation" / CODEBOOK_FILE)]) == 0
    out = capsys.readouterr().out
    assert "3 (3 frozen)" in out and "M=3, n=40" in out, out


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["base", "record", "base header", "record header"])
def test_check_finds_a_flipped_byte_without_decoding(tmp_path: Path, generator, where) -> None:
    """``check`` reads every byte of the store through its checksums (no tensor decoded, as
    ``status`` does not): a byte flipped anywhere in the base or a record is named."""
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(4)])
    codebook = federation.checkpoint(codebook, Position(0))
    codebook = federation.checkpoint(codebook.set_values(heads(codebook, generator)), Position(0))
    assert checked(federation, codebook) == []
    ref = federation.checkpoints._stored.ref
    ((offset, length),) = ref.records
    folder = root / store_layout.STORE_DIR
    path, at = {
        "base": (folder / ref.base, (folder / ref.base).stat().st_size // 2),
        "record": (folder / ref.log, offset + length - 7),
        "base header": (folder / ref.base, 20),  # the checksum itself
        "record header": (folder / ref.log, offset + 2),  # the magic
    }[where]
    _flip(path, at)
    problems = folder_check.check(root).problems
    assert problems and all(p.startswith(("codebook.bin: ", "previous.bin: ")) for p in problems)
    assert all(f" {store_layout.STORE_DIR}/{path.name}" in p for p in problems), problems
    assert any(
        (
            "checksum mismatch"
            if "header" not in where or where == "base header"
            else "not a starfed codebook file"
        )
        in p
        for p in problems
    ), problems
    assert folder_check.check(root, depth=folder_check.Depth.HEADERS, kept=False).ok
    assert folder_check.check(root, depth=folder_check.Depth.DECODE).problems


def test_check_finds_a_manifest_that_disagrees_with_its_store(tmp_path: Path, generator) -> None:
    """Each class's line in the manifest is the line its store's last piece holds."""
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(3)])
    codebook = federation.checkpoint(codebook, Position(0))
    federation.register(codebook.names, 0, {})
    message = store_layout.header(framing.read_message(root / CODEBOOK_FILE))
    message.metadata.update(federation.checkpoints._stored.ref.as_metadata())
    message.entries[1].count += 1
    (root / CODEBOOK_FILE).write_bytes(framing.frame(message.SerializeToString()))
    assert folder_check.check(root).problems == [
        "codebook.bin: class 'c1' differs from its store's record"
    ]
    message.entries[1].name = "c9"
    (root / CODEBOOK_FILE).write_bytes(framing.frame(message.SerializeToString()))
    assert any("'c9' is in no record of its store" in p for p in folder_check.check(root).problems)


def test_check_deep_and_repair_dry_run_on_the_command_line(tmp_path: Path, generator, capsys):
    server = tmp_path / "server"
    federation = Federation(server / "federation", FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(3)])
    federation.checkpoint(codebook, Position(0))
    federation.register(codebook.names, 0, {})
    for deep in ([], ["--deep"]):
        assert cli_main(["server", "check", "--dir", str(server), *deep]) == 0
        assert "whole (codebook version" in capsys.readouterr().out
        assert cli_main(["server", "repair", "--dir", str(server), "--dry-run", *deep]) == 0
        assert "nothing to repair" in capsys.readouterr().out


def test_an_exported_codebook_loads_back_as_predict_reads_it(tmp_path: Path, generator) -> None:
    """``starfed server export`` then ``wire.read_file`` (``starfed predict``'s loader): the
    same classes and values bit for bit, its bank the stacked values; a flipped byte refused."""
    root = tmp_path / "federation"
    federation = Federation(root, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS).register([entry(f"c{i}", generator) for i in range(5)])
    federation.register(codebook.names, 0, {})
    federation.checkpoint(codebook, Position(1))
    deployable = export.deployable(Federation.open(root))
    out = tmp_path / "export.bin"
    export.write(Federation.open(root), deployable, out)
    loaded = wire.read_file(out)
    assert equal(loaded, deployable.codebook.broadcast())
    assert loaded.metadata == deployable.codebook.metadata
    bank = loaded.bank()
    for field in schema.TENSORS:
        want = torch.stack([deployable.codebook[n].values[field] for n in loaded.names])
        assert torch.equal(bank[field], want), field
    export.write(Federation.open(root), deployable, out, "float16")
    half = wire.read_file(out)
    assert half.names == loaded.names and all(
        torch.allclose(half[n].values[f], v, rtol=2**-10, atol=1e-6)
        for n in loaded.names
        for f, v in loaded[n].values.items()
    )
    _flip(out, out.stat().st_size - 100)
    with pytest.raises(CodebookError, match="checksum mismatch"):
        wire.read_file(out)
