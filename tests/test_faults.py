"""Faults of the federation folder (issue 21): each ends in a clear message, and after the
documented recovery in a folder that ``starfed server check`` accepts, with no completed step
lost.

One federation is built in process (two sites, one completed step) and copied for each fault;
the faults are injected as they happen in the field — a file damaged on disk, a site's replies
scaled by 10³⁰, a write that fails with a full disk, a second run over the same folder, a site
clock 30 s fast (its refusal as the gateway sees it, and the site's own measurement) — and
the recovery is what docs/federation.md tells an operator to do (`repair`, or just the next
`run`). ``pytest -m faults`` runs them as a group.
"""

from __future__ import annotations

import datetime
import email.utils
import errno
import http.server
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from base64 import b64encode
from pathlib import Path

import numpy as np
import pytest
import torch
from codebooks import full_entry
from cryptography.hazmat.primitives import serialization
from flwr.app import Message
from in_process import run_two_sites, starfed
from site_folders import CLASSES, site_folder

from starfed.client.ops import site_options, supernode_log
from starfed.host.process_identity import ProcessId
from starfed.ops import clock, pki
from starfed.proto import codebook_pb2 as pb
from starfed.server import (
    checkpoints,
    folder_check,
    folder_files,
    folder_lock,
    history,
    step_findings,
)
from starfed.server import federation as federation_module
from starfed.server import registry as registry_module
from starfed.server.app import RunFailed
from starfed.server.federation import Federation
from starfed.server.folder_files import (
    CODEBOOK_FILE,
    HISTORY_FILE,
    PENDING_FILE,
    REGISTRY_FILE,
    STEP_FINDINGS_FILE,
    FederationError,
)
from starfed.server.ops import fleet_proxy
from starfed.server.ops.fleet_signatures import PUBLIC_KEY_HEADER, TIMESTAMP_HEADER
from starfed.server.ops.layout import ServerFolder
from starfed.server.records import Position
from starfed.shared.codebook import store_layout, wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES, read_message
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.codebook.store_layout import STORE_DIR
from starfed.shared.run_status import COMPLETED

pytestmark = pytest.mark.faults

PAPER_DIMS = ModelDims(d_txt=768, d_clip=768, d_vit=768, n_layers=12)


@pytest.fixture(scope="module")
def built(tmp_path_factory, one_torch_thread) -> Path:
    """A federation after one completed step (farm-a: two classes, farm-b: two)."""
    root = tmp_path_factory.mktemp("faults")
    site_folder(root / "farm-a", {"2026-03": CLASSES[0:2]})
    site_folder(root / "farm-b", {"2026-04": CLASSES[2:4]})
    assert run_two_sites(root)["status"] == COMPLETED
    return root


@pytest.fixture
def root(built: Path, tmp_path: Path) -> Path:
    """A copy of the built federation (and its sites' folders) to damage."""
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    return copy


def folder(root: Path) -> Path:
    return root / "server" / "federation"


def checked(root: Path) -> folder_check.Report:
    return folder_check.check(folder(root))


def finished_steps(root: Path) -> list[int]:
    """The steps the history records as finished, one entry per record."""
    return [r.step for r in Federation.open(folder(root)).history() if r.status != "failed"]


def next_task(root: Path) -> None:
    """farm-a brings a new task: the next round has a step to run."""
    site_folder(root / "farm-a", {"2026-06": CLASSES[4:5]})


def repaired(root: Path, capsys) -> str:
    """`starfed server repair` (after its dry run), which ends in a whole folder."""
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "repair", "--dir", server, "--dry-run")
    assert code == 0 and out.startswith("would: "), out
    code, out, _ = starfed(capsys, "server", "repair", "--dir", server)
    assert code == 0 and "still:" not in out, out
    assert checked(root).ok, checked(root).problems
    return out


def test_the_built_federation_is_whole(built: Path, capsys) -> None:
    code, out, _ = starfed(capsys, "server", "check", "--dir", str(built / "server"))
    assert code == 0 and "whole" in out, out
    code, out, _ = starfed(capsys, "server", "check", "--dir", str(built / "server"), "--json")
    assert code == 0 and json.loads(out)["success"] is True


# --- a federation past ~320 classes at paper dims ----------------------------------------------


def paper_entry(name: str, generator: torch.Generator) -> ClassEntry:
    """One class with every field at the paper's dims (5 components per mixture)."""
    return full_entry(name, PAPER_DIMS, generator)


def test_a_thousand_classes_at_paper_dims_round_trip_through_the_folder(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(21)
    fingerprint = "ab" * 32
    federation = Federation(tmp_path / "federation", fingerprint, PAPER_DIMS)
    entries = [paper_entry(f"class {i:04d}", generator) for i in range(1000)]
    codebook = Codebook(fingerprint, PAPER_DIMS).register(entries)
    federation.register(codebook.names, 0, {})
    federation.checkpoint(codebook, Position(0))
    stored = (tmp_path / "federation" / STORE_DIR).glob("*.bin")  # codebook.bin: its manifest
    size = sum(path.stat().st_size for path in stored)
    assert size > 3 * DEFAULT_MAX_BYTES  # well past the old 64 MiB wall
    back = Federation(tmp_path / "federation", fingerprint, PAPER_DIMS).checkpoints.codebook()
    assert back.names == codebook.names
    for name in (codebook.names[0], codebook.names[-1]):
        for field, value in codebook[name].values.items():
            got = back[name].values[field]
            if isinstance(value, GaussianMixture):
                assert torch.equal(got.means, value.means)
            else:
                assert torch.equal(got, value)
    report = folder_check.check(tmp_path / "federation")
    assert report.ok and report.codebook_version == 1, report.problems


# --- a merge whose values overflow in replay ------------------------------------------------


def times_1e30(reply: Message) -> Message:
    """A site's stage-1 update scaled by 10³⁰: finite, so it passes validation on its own."""
    message = pb.ClientUpdate.FromString(reply.content["update"]["data"])
    for entry in message.entries:
        values = np.frombuffer(entry.prompt.data, dtype="<f4") * np.float32(1e30)
        entry.prompt.data = values.astype("<f4").tobytes()
    reply.content["update"]["data"] = message.SerializeToString()
    return reply


def test_an_overflowing_merge_is_never_checkpointed(root: Path) -> None:
    next_task(root)
    before = Federation.open(folder(root)).checkpoints.last_checkpoint()
    with pytest.raises(RunFailed) as failed:
        run_two_sites(root, {(1, "train.stage1"): times_1e30})
    message = str(failed.value)
    assert f"class {CLASSES[4]!r}" in message and "farm-a" in message, message
    assert "farm-a (prompt changed by" in message  # the site and the field its values came in
    after = Federation.open(folder(root)).checkpoints.last_checkpoint()
    assert after.position == Position(1) and after.classes == before.classes  # rolled back
    assert checked(root).ok, checked(root).problems
    metrics = run_two_sites(root)  # the next run, without that site's poison, completes the step
    assert metrics["status"] == COMPLETED and finished_steps(root) == [0, 1]
    assert checked(root).ok


# --- codebook.bin missing, truncated, bit-flipped or empty -----------------------------------


def test_a_missing_codebook_is_never_replaced_by_an_empty_one(root: Path, capsys) -> None:
    (folder(root) / CODEBOOK_FILE).unlink()
    before = {path.name: path.read_bytes() for path in folder(root).iterdir() if path.is_file()}
    with pytest.raises(RunFailed, match=r"codebook\.bin is missing.*repair"):
        run_two_sites(root)
    after = {path.name: path.read_bytes() for path in folder(root).iterdir() if path.is_file()}
    assert after == before  # refused before anything is written: who brought each class kept
    assert json.loads(before[REGISTRY_FILE])  # (it held the classes)
    assert not (folder(root) / CODEBOOK_FILE).exists() and finished_steps(root) == [0]
    code, out, _ = starfed(capsys, "server", "status", "--dir", str(root / "server"))
    assert code == 1 and "DAMAGED    codebook.bin: missing" in out, out
    code, _, err = starfed(capsys, "server", "run", "--dir", str(root / "server"))
    assert code == 1 and err.count("\n") == 1, err  # refused before anything is submitted
    assert "the federation folder is damaged: codebook.bin: missing" in err
    out = repaired(root, capsys)
    assert "restore codebook.bin from checkpoints/step-0001.bin" in out, out
    next_task(root)
    assert run_two_sites(root)["steps"] == 2 and finished_steps(root) == [0, 1]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[: len(data) // 2], "header announces"),
        (lambda data: data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "checksum mismatch"),
        (lambda data: b"", "too short"),
    ],
    ids=["truncated", "bit-flipped", "empty"],
)
def test_a_damaged_codebook_makes_status_fail_and_repair_restores_it(
    root: Path, capsys, damage, reason
) -> None:
    path = folder(root) / CODEBOOK_FILE
    path.write_bytes(damage(path.read_bytes()))
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server, "--json")
    status = json.loads(out)
    assert code == 1 and status["success"] is False
    assert any(p.startswith("codebook.bin: ") and reason in p for p in status["problems"])
    code, out, _ = starfed(capsys, "server", "check", "--dir", server)
    assert code == 1 and out.splitlines() == [
        f"codebook.bin: {reason}" + out.split(reason)[1].splitlines()[0]
    ]
    with pytest.raises(RunFailed, match=reason):
        run_two_sites(root)
    repaired(root, capsys)
    assert finished_steps(root) == [0]
    next_task(root)
    assert run_two_sites(root)["steps"] == 2


# --- a store file damaged, missing, or left half written ------------------------------------


def store_files(path: Path) -> set[str]:
    """The base and log the manifest at ``path`` names."""
    ref = store_layout.Ref.of(read_message(path).metadata)
    assert ref is not None
    return {ref.base, ref.log}


def kept_store_files(root: Path) -> set[str]:
    return set().union(*(store_files(path) for path in (folder(root) / "checkpoints").iterdir()))


def final_accuracy(metrics: dict) -> list[float]:
    """Each site's accuracy after the run's last step, in site order (percent)."""
    return [metrics["site_accuracy"][site] for site in sorted(metrics["site_accuracy"])]


def test_one_flipped_byte_in_the_current_base_keeps_the_last_completed_step(
    root: Path, tmp_path: Path, capsys
) -> None:
    """Issue 43, attack 8: ``codebook.bin``'s base shares no byte with the kept step checkpoint,
    so a flipped byte in it is DAMAGED in ``status`` and ``repair`` keeps step 1; the next
    step's accuracy is the undamaged federation's."""
    clean = tmp_path / "clean"
    shutil.copytree(root, clean)
    current = folder(root) / CODEBOOK_FILE
    assert not store_files(current) & kept_store_files(root)
    base = folder(root) / STORE_DIR / min(store_files(current))  # base-… sorts before log-…
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 1
    base.write_bytes(bytes(data))
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert code == 1 and "DAMAGED    codebook.bin: " in out and "checksum mismatch" in out, out
    code, out, _ = starfed(capsys, "server", "check", "--dir", server)
    assert code == 1 and "codebook.bin: " in out and "checkpoints/" not in out, out
    with pytest.raises(RunFailed, match=r"checksum mismatch.*`starfed server repair`"):
        run_two_sites(root)
    out = repaired(root, capsys)
    assert "restore codebook.bin from checkpoints/step-0001.bin" in out, out
    assert finished_steps(root) == [0]
    for copy in (root, clean):
        next_task(copy)
    after, undamaged = run_two_sites(root), run_two_sites(clean)
    assert after["steps"] == 2 and finished_steps(root) == [0, 1]
    assert final_accuracy(after) == pytest.approx(final_accuracy(undamaged), abs=1.0)
    assert not store_files(current) & kept_store_files(root)  # parted again after the repair


def test_a_step_checkpoint_sharing_the_current_base_is_parted_by_the_next_step(
    root: Path, capsys
) -> None:
    """A folder of the layout before the kept step checkpoints had a store of their own (their
    manifest a copy of ``codebook.bin``'s, naming its base and log) opens and checks whole;
    its next step parts them, after which a flipped byte in the current base loses no
    completed step."""
    current = folder(root) / CODEBOOK_FILE
    shutil.copyfile(current, folder(root) / "checkpoints" / "step-0001.bin")
    assert store_files(current) == kept_store_files(root)
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "check", "--dir", server)
    assert code == 0, out
    next_task(root)
    run_two_sites(root)
    assert finished_steps(root) == [0, 1]
    assert not store_files(current) & kept_store_files(root)
    base = folder(root) / STORE_DIR / min(store_files(current))
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 1
    base.write_bytes(bytes(data))
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert code == 1 and "DAMAGED    codebook.bin: " in out, out
    assert "restore codebook.bin from checkpoints/step-0002.bin" in repaired(root, capsys)
    assert finished_steps(root) == [0, 1]


def test_a_missing_base_is_one_line_naming_it_and_the_repair(root: Path, capsys) -> None:
    base = min(store_files(folder(root) / CODEBOOK_FILE))
    (folder(root) / STORE_DIR / base).unlink()
    with pytest.raises(RunFailed) as failed:
        run_two_sites(root)
    line = str(failed.value)
    assert "\n" not in line and base in line and "`starfed server repair`" in line, line
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert code == 1 and f"DAMAGED    codebook.bin: {STORE_DIR}/{base} is missing" in out, out
    code, out, _ = starfed(capsys, "server", "check", "--dir", server)
    assert code == 1 and f"codebook.bin: {STORE_DIR}/{base} is missing" in out, out
    code, _, err = starfed(capsys, "server", "run", "--dir", server)
    assert code == 1 and err.count("\n") == 1 and base in err and "repair" in err, err
    assert "restore codebook.bin from checkpoints/step-0001.bin" in repaired(root, capsys)
    assert finished_steps(root) == [0]


def test_stale_temporary_files_are_listed_and_removed_under_the_lock(root: Path, capsys) -> None:
    """A write killed between its temporary file and the rename (three SIGKILLs while a new
    base was written) leaves whole temporary files: ``check`` and ``status`` list them,
    ``repair`` and the next run remove them."""
    codebook = (folder(root) / CODEBOOK_FILE).read_bytes()
    for token in ("0a", "0b", "0c"):
        name = f".base-000009-{token}.bin.x{token}.tmp"
        (folder(root) / STORE_DIR / name).write_bytes(codebook)
    (folder(root) / f".{CODEBOOK_FILE}.x0d.tmp").write_bytes(codebook)
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "check", "--dir", server)
    assert code == 0 and "note: 4 temporary files (" in out and ".base-000009-0a" in out, out
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert "note       4 temporary files" in out, out
    code, out, _ = starfed(capsys, "server", "repair", "--dir", server, "--dry-run")
    assert code == 0 and "remove 4 temporary files" in out, out
    next_task(root)
    assert run_two_sites(root)["steps"] == 2
    assert not list(folder(root).rglob("*.tmp"))


# --- history.jsonl and registry.json damaged -------------------------------------------------


def test_a_damaged_history_line_is_named_and_repaired(root: Path, capsys) -> None:
    path = folder(root) / HISTORY_FILE
    path.write_text(path.read_text() + '{"step": 1, "status": "compl\n')  # a torn append
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert code == 1 and "DAMAGED    history.jsonl:2: damaged" in out, out
    assert "JSONDecodeError" not in out
    with pytest.raises(RunFailed, match=r"history\.jsonl:2 is damaged"):
        run_two_sites(root)
    repaired(root, capsys)
    assert finished_steps(root) == [0]


def test_damaged_step_findings_are_named_and_set_aside(root: Path, capsys) -> None:
    """step-findings.json (the screening's findings of a running step, docs/federation.md):
    damaged, it is a problem `run` refuses to run over, and `repair` sets it aside."""
    (folder(root) / STEP_FINDINGS_FILE).write_text('{"step": 1, "findings": [{"sit')
    code, out, _ = starfed(capsys, "server", "status", "--dir", str(root / "server"))
    assert code == 1 and "DAMAGED    step-findings.json: damaged" in out, out
    out = repaired(root, capsys)
    assert "move step-findings.json aside" in out, out
    assert not (folder(root) / STEP_FINDINGS_FILE).exists()
    next_task(root)
    assert run_two_sites(root)["steps"] == 2


def test_a_lost_history_record_stays_counted(root: Path, capsys) -> None:
    path = folder(root) / HISTORY_FILE
    path.write_text("garbage\n")  # the only record, damaged
    assert any("no record of completed step(s) 1" in p for p in checked(root).problems)
    out = repaired(root, capsys)
    assert "placeholders for the lost records of step(s) 1" in out
    assert finished_steps(root) == [0]


#: A registry that is not JSON, and JSON that is not a registry (a list; an entry without its
#: step): each fails a run with one line and is rebuilt by ``repair``, as every reader of the
#: file reads it one way (``registry.read_registry``).
DAMAGED_REGISTRIES = ["{ not json", "[1, 2]", '{"Apple___healthy": {"sites": []}}']


@pytest.mark.parametrize("damaged", DAMAGED_REGISTRIES)
def test_a_damaged_registry_is_rebuilt(root: Path, capsys, damaged: str) -> None:
    (folder(root) / REGISTRY_FILE).write_text(damaged)
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "status", "--dir", server)
    assert code == 1 and "DAMAGED    registry.json: damaged" in out
    assert "creates it" not in out  # it is not a new federation
    with pytest.raises(RunFailed, match=r"registry\.json is damaged"):
        run_two_sites(root)
    repaired(root, capsys)
    registry = json.loads((folder(root) / REGISTRY_FILE).read_text())
    assert sorted(registry) == sorted(CLASSES[0:4])
    assert all(entry["step"] == 0 for entry in registry.values())
    next_task(root)
    assert run_two_sites(root)["steps"] == 2


# --- the disk fills while a step is closed ---------------------------------------------------


@pytest.mark.parametrize("fails", [HISTORY_FILE, CODEBOOK_FILE])
def test_a_full_disk_while_closing_a_step_never_duplicates_it(
    root: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """The history write after the commit, or the commit itself, fails with ENOSPC: one line
    says the disk is full and whether the commit point moved; the next run finishes the close
    (or the step) and records it once."""
    next_task(root)
    modules = (federation_module, checkpoints, folder_files, history, wire)
    real = {module: module.write_atomic for module in modules}

    def full(module):
        def write(path, data):
            if Path(path).name == fails and (folder(root) / PENDING_FILE).exists():
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real[module](path, data)

        return write

    for module in real:
        monkeypatch.setattr(module, "write_atomic", full(module))
    with pytest.raises(RunFailed, match=r"^the disk is full \(writing ") as failed:
        run_two_sites(root)
    said = str(failed.value)
    assert "\n" not in said and f"writing {fails} of " in said and "nothing was lost" in said
    committed = fails == HISTORY_FILE
    assert ("step 2 was committed" in said) is committed, said
    assert ("step 2 was not committed (codebook.bin is unchanged)" in said) is not committed
    for module, write in real.items():
        monkeypatch.setattr(module, "write_atomic", write)
    assert finished_steps(root) == [0]  # nothing recorded before the close finished
    metrics = run_two_sites(root)
    assert finished_steps(root) == [0, 1]
    assert metrics["steps"] == 2 and len(metrics["accuracy_matrix"]) == 2
    assert checked(root).ok, checked(root).problems


@pytest.mark.parametrize(
    ("fails", "nth", "writing", "then"),
    [
        (CODEBOOK_FILE, 2, "the checkpoint of stage1/0", "resumes step 2 after its sync/0"),
        (REGISTRY_FILE, 1, "the registry of its new classes", "starts step 2"),
        (STEP_FINDINGS_FILE, 2, "the screening's findings", "resumes step 2 after its sync/0"),
    ],
)
def test_a_full_disk_mid_step_is_one_line_and_the_step_resumes(
    root: Path, monkeypatch: pytest.MonkeyPatch, fails: str, nth: int, writing: str, then: str
) -> None:
    """ENOSPC at the ``nth`` write of ``fails`` in a step — the commit of its first training
    phase's checkpoint, the registry of its new classes at the sync, the findings written
    ahead of a checkpoint: one line says what was being written, that the commit point did not
    move and nothing was lost, and what the next run does; the run fails (exit 1) and the next
    run completes the step, recorded once, in a folder ``check`` accepts."""
    next_task(root)
    writers = (federation_module, checkpoints, folder_files, registry_module, step_findings)
    real = {module: module.write_atomic for module in writers}
    seen: list[bytes] = []

    def full(module):
        def write(path, data):
            if Path(path).name == fails:
                seen.append((folder(root) / CODEBOOK_FILE).read_bytes())
                if len(seen) == nth:
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real[module](path, data)

        return write

    for module in real:
        monkeypatch.setattr(module, "write_atomic", full(module))
    with pytest.raises(RunFailed, match=r"^the disk is full \(writing ") as failed:
        run_two_sites(root)
    said = str(failed.value)
    assert "\n" not in said and f"writing {fails} of " in said and f"{writing}" in said, said
    assert "the commit point did not move (codebook.bin is unchanged)" in said, said
    assert "nothing was lost" in said and f"the next run {then}, once space is freed" in said
    assert (folder(root) / CODEBOOK_FILE).read_bytes() == seen[-1]  # the commit point
    for module, write in real.items():
        monkeypatch.setattr(module, "write_atomic", write)
    assert finished_steps(root) == [0]
    metrics = run_two_sites(root)
    assert finished_steps(root) == [0, 1]
    assert metrics["steps"] == 2 and len(metrics["accuracy_matrix"]) == 2
    assert checked(root).ok, checked(root).problems


# --- two runs at once ------------------------------------------------------------------------


def test_a_second_run_is_refused_naming_the_holder(root: Path, capsys) -> None:
    holder = folder_lock.acquire(folder(root), "server run 77")
    try:
        with pytest.raises(RunFailed, match=r"in use by server run 77, PID \d+"):
            run_two_sites(root)
        code, _, err = starfed(capsys, "server", "run", "--dir", str(root / "server"))
        assert code == 1 and "in use by server run 77" in err and err.count("\n") == 1, err
        assert checked(root).notes == [f"in use by {holder.describe()}"]
    finally:
        folder_lock.release(folder(root), holder)
    assert not (folder(root) / folder_lock.LOCK_FILE).exists()
    next_task(root)
    assert run_two_sites(root)["steps"] == 2  # released: the next run goes ahead


def test_a_stale_lock_is_taken_over(root: Path) -> None:
    """A holder killed with SIGKILL leaves its lock; its PID and start time no longer name a
    running process, so the next run takes the lock over."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = ProcessId.of(child.pid)
    child.kill()
    child.wait()
    stale = folder_lock.Holder.me("server run 5")
    stale = folder_lock.Holder(
        dead.pid, dead.started, stale.boot, stale.host, stale.what, stale.since
    )
    (folder(root) / folder_lock.LOCK_FILE).write_text(json.dumps(vars(stale)))
    assert "stale lock of server run 5" in checked(root).notes[0]
    next_task(root)
    assert run_two_sites(root)["steps"] == 2
    assert not (folder(root) / folder_lock.LOCK_FILE).exists()


def test_a_half_closed_step_is_finished_by_the_next_run(root: Path) -> None:
    """A crash between the commit and the history line (the record written ahead): the next
    run appends the record once; a record of a step never committed is dropped."""
    fed = Federation.open(folder(root))
    [record] = fed.history()
    (folder(root) / HISTORY_FILE).write_text("")
    (folder(root) / PENDING_FILE).write_text(record.to_json())
    assert any(PENDING_FILE in p for p in checked(root).problems)
    assert "finished closing step 1" in fed.recover()
    assert finished_steps(root) == [0] and checked(root).ok
    uncommitted = type(record)(**{**vars(record), "step": 1})
    (folder(root) / PENDING_FILE).write_text(uncommitted.to_json())
    assert "step 2 was not committed" in Federation.open(folder(root)).recover()
    assert finished_steps(root) == [0] and checked(root).ok


def test_a_missing_codebook_without_any_good_checkpoint_cannot_be_repaired(
    root: Path, capsys
) -> None:
    for path in [
        folder(root) / CODEBOOK_FILE,
        folder(root) / "previous.bin",
        *(folder(root) / "checkpoints").iterdir(),
    ]:
        path.unlink()
    code, _, err = starfed(capsys, "server", "repair", "--dir", str(root / "server"))
    assert code == 1 and "no good codebook is left" in err
    with pytest.raises(FederationError, match="missing"):
        Federation.open(folder(root)).checkpoints.codebook()


# --- a site whose clock runs 30 s fast -------------------------------------------------------


class _DateAhead(http.server.BaseHTTPRequestHandler):
    """The gateway's answer to a GET (403), with a Date 30 s behind this machine's clock: as
    seen from a site whose clock runs 30 s fast."""

    def date_time_string(self, timestamp: float | None = None) -> str:
        return email.utils.formatdate(time.time() - 30, usegmt=True)

    def do_GET(self) -> None:
        self.send_response(403)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_site_refused_for_its_clock_is_told_so_not_that_its_key_was_removed(
    tmp_path: Path,
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DateAhead)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        offset = clock.server_offset(address, None, insecure=True)
    finally:
        server.shutdown()
        server.server_close()
    assert offset is not None and 29 <= offset <= 31.5, offset  # Date has whole seconds
    (tmp_path / "data").mkdir()
    options = site_options.prepare(address, tmp_path / "data", ca=None, key=None, insecure=True)
    told = supernode_log.self_stopped(options, offset)
    assert "refused for clock skew, not for the key" in told and "Flower answered 401" in told
    assert f"{offset:.0f} s ahead of the server's" in told
    assert "keygen" not in told
    assert "keygen" in supernode_log.self_stopped(options, 0.4)  # in time: the key it is


def test_the_operator_sees_a_clock_skew_refusal(tmp_path: Path, caplog, capsys) -> None:
    """The gateway logs a 401 to a call signed 30 s in the future as clock skew, with the key;
    `starfed server sites refused` shows it."""
    key = pki.write_site_key(tmp_path / "farm-c.key", "c")
    pem = serialization.load_ssh_public_key(key.openssh.encode()).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )  # what a SuperNode sends
    signed = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)).isoformat()
    headers = {TIMESTAMP_HEADER: signed, PUBLIC_KEY_HEADER: b64encode(pem).decode()}
    with caplog.at_level(logging.WARNING, logger="starfed.gateway"):
        fleet_proxy._log_clock_skew(headers, "/v1/fleet/pull-messages", "10.0.0.7")
        in_time = {**headers, TIMESTAMP_HEADER: datetime.datetime.now(datetime.UTC).isoformat()}
        fleet_proxy._log_clock_skew(in_time, "/v1/fleet/pull-messages", "10.0.0.7")  # a key issue
    [record] = caplog.records
    folder = ServerFolder.at(tmp_path / "server")
    folder.gateway_log.parent.mkdir(parents=True, exist_ok=True)
    line = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record)
    folder.gateway_log.write_text(line + "\n")
    code, out, _ = starfed(
        capsys, "server", "sites", "refused", "--dir", str(folder.root), "--json"
    )
    [refusal] = json.loads(out)["refused"]
    assert code == 0 and refusal["fingerprint"] == key.fingerprint
    assert refusal["code"] == "clock" and 29 <= refusal["offset_s"] <= 30.5
    assert "clock skew" in refusal["reason"] and "ahead of the server's" in refusal["reason"]


def test_repair_rolls_back_to_a_chosen_step(root: Path, capsys) -> None:
    next_task(root)
    assert run_two_sites(root)["steps"] == 2
    server = str(root / "server")
    code, out, _ = starfed(capsys, "server", "repair", "--dir", server, "--to", "1", "--dry-run")
    assert code == 0 and "would: restore codebook.bin from checkpoints/step-0002.bin" not in out
    assert "would: restore codebook.bin from checkpoints/step-0001.bin" in out, out
    assert finished_steps(root) == [0, 1]  # a dry run changes nothing
    code, out, _ = starfed(capsys, "server", "repair", "--dir", server, "--to", "1")
    assert code == 0 and checked(root).ok, out
    assert finished_steps(root) == [0]
    assert CLASSES[4] not in json.loads((folder(root) / REGISTRY_FILE).read_text())
    kept = sorted(p.name for p in folder(root).glob("*.before-repair-*"))
    assert [name.split(".before")[0] for name in kept] == [
        CODEBOOK_FILE,
        HISTORY_FILE,
        REGISTRY_FILE,
    ]  # nothing is lost: every replaced file is kept beside
    assert run_two_sites(root)["steps"] == 2 and finished_steps(root) == [0, 1]  # step 2 again
