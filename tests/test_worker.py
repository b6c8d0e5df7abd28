"""The site worker answers what a ClientApp would, over its Unix socket; bad frames do no harm."""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from site_folders import CLASSES, site_folder

from starfed.client import answer
from starfed.client import worker as site_worker
from starfed.client.worker import WorkerError, read_frame, request, send_frame, serve
from starfed.server import replay
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.config import parse
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import Phase


@pytest.fixture
def worker(tmp_path: Path):
    path = tmp_path / "state" / "worker.sock"
    path.parent.mkdir()
    threading.Thread(target=serve, args=(path,), daemon=True).start()
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path


def sync_header(tmp_path: Path) -> dict:
    data = site_folder(tmp_path / "farm", {"t1": CLASSES[0:2]})
    return {
        "phase": "sync",
        "config": {"step": 0, "round": 0, "federation": "f", "epoch": "e", "frozen": []},
        "run-config": {"preset": "tiny"},
        "node-config": {
            "data-dir": str(data),
            "state-dir": str(tmp_path / "farm-state"),
            "site-name": "farm",
            "cache-dir": str(tmp_path / "cache"),
        },
        "run-id": 1,
        "node-id": 3,
    }


def test_the_worker_answers_as_the_clientapp_does(worker: Path, tmp_path: Path) -> None:
    header = sync_header(tmp_path)
    [(record, data)] = request(worker, header, b"")
    assert record == "update"
    own = BackboneOptions.from_config(parse({"preset": "tiny"})).load()
    update = wire.decode_update(data, against=Codebook(own.fingerprint, own.dims), phase=Phase.SYNC)
    assert sorted(e.name for e in update.entries) == CLASSES[0:2]
    assert update.metadata["site"] == "farm"
    # answered in this process too, by the same folders as another node's site: the same reply
    assert answer.answer({**header, "node-id": 4}, b"") == [(record, data)]


def test_updates_that_travel_with_a_message_come_back_in_the_same_reply(
    worker: Path, tmp_path: Path
) -> None:
    """The last stage-1 round asks for the statistics too: two records, back to back in one
    frame, each the update of its phase, as the ClientApp answers in process."""
    header = sync_header(tmp_path)
    values = parse({"preset": "tiny"})
    own = BackboneOptions.from_config(values).load()
    lineage = {"federation": "f", "epoch": "e"}
    empty = replace(Codebook(own.fingerprint, own.dims), metadata=lineage)
    codebook = replay.register(empty, CLASSES[0:2], own, TrainConfig.from_config(values))
    header["phase"] = "stage1"
    header["config"] = {
        "step": 0,
        "round": 0,
        "wire-dtype": "float32",
        **lineage,
        "also": ["stage1_stats"],  # TRAVELLING as the wire spells it, for servers of every release
    }
    header["run-config"] = {"preset": "tiny", "stage1-epochs": 1}
    payload = wire.encode(codebook.broadcast())
    records = request(worker, header, payload)
    assert [name for name, _ in records] == ["update", "stage1_stats"]
    for (_, data), phase in zip(records, (Phase.STAGE1, Phase.STAGE1_STATS), strict=True):
        update = wire.decode_update(data, against=codebook, phase=phase)
        assert sorted(e.name for e in update.entries) == CLASSES[0:2]
    # answered in this process too, by the same folders as another node's site: the same reply
    assert answer.answer({**header, "node-id": 4}, payload) == records


def test_errors_and_garbage(worker: Path, tmp_path: Path) -> None:
    header = {**sync_header(tmp_path), "node-config": {}}  # neither a site nor simulated
    with pytest.raises(WorkerError, match="no data folder"):
        request(worker, header, b"")
    with socket.socket(socket.AF_UNIX) as stream:  # a frame announcing a huge header
        stream.connect(str(worker))
        stream.sendall(struct.pack("<I", 2**31))
    [(record, _)] = request(worker, sync_header(tmp_path), b"")  # the worker still answers
    assert record == "update"
    with pytest.raises(WorkerError, match="no site worker"):
        request(tmp_path / "absent.sock", header, b"")
    assert oct(worker.stat().st_mode & 0o777) == "0o600"


class Preempted(socket.socket):
    """A ClientApp the scheduler pauses after every write, as on a loaded machine."""

    def sendall(self, data, *args) -> None:
        super().sendall(data, *args)
        time.sleep(0.3)


def test_a_frame_without_payload_survives_an_answer_that_comes_at_once(tmp_path: Path) -> None:
    # A peer that answers as soon as the frame is complete and closes, as the worker does
    # with a sync: the sender must not write to the closed connection afterwards (seen as a
    # BrokenPipeError that lost a site's sync in tests/test_e2e_resume.py).
    path = str(tmp_path / "peer.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()

        def answer_at_once() -> None:
            connection, _ = listener.accept()
            with connection:
                header, payload = read_frame(connection)
                send_frame(connection, {"ok": True, "echo": header}, payload)

        peer = threading.Thread(target=answer_at_once, daemon=True)
        peer.start()
        with Preempted(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
            stream.connect(path)
            send_frame(stream, {"phase": "sync"})
            assert read_frame(stream) == ({"ok": True, "echo": {"phase": "sync"}}, b"")
        peer.join(5)


def test_a_worker_that_cannot_import_the_site_code_stops_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No message could be answered: the worker ends (``site start`` then stops) with the
    reason, instead of listening and failing every message."""
    monkeypatch.setattr(site_worker, "PRELOAD", "starfed.client.no_such_module")
    path = tmp_path / "worker.sock"
    why = serve(path)
    assert why == "ModuleNotFoundError: No module named 'starfed.client.no_such_module'"
    assert not path.exists()
