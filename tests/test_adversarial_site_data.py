"""Two sites on one data folder: the second `starfed site start` is refused with one line naming
the first; a lock left by a dead process (or a reused PID) is stale and replaced."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from starfed.client.ops import data_lock
from starfed.client.ops.data_lock import DataFolderInUse, Holder
from starfed.host import locks
from starfed.ops.processes import ProcessId

pytestmark = pytest.mark.adversarial

HOLD = """
import signal, sys, time
from pathlib import Path
from starfed.client.ops import data_lock
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as `site start` ends on SIGTERM
with data_lock.hold(Path(sys.argv[1]), "farm-a", Path(sys.argv[2])):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def data(tmp_path: Path) -> Path:
    folder = tmp_path / "farm-data"
    (folder / "task-1").mkdir(parents=True)
    return folder


def _holding(data: Path, state: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(data), str(state)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_second_site_start_on_a_held_data_folder_is_refused(data: Path, tmp_path: Path) -> None:
    holder = _holding(data, tmp_path / "state-a")
    try:
        started = subprocess.run(
            [
                sys.executable,
                "-m",
                "starfed.cli",
                "site",
                "start",
                "--server",
                "127.0.0.1:9",
                "--insecure",
                "--quiet",
                "--data",
                str(data),
                "--state",
                str(tmp_path / "state-b"),
                "--name",
                "farm-b",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.terminate()  # by its own PID
        holder.wait(15)
    assert started.returncode == 1
    lines = started.stderr.strip().splitlines()
    assert len(lines) == 1, started.stderr
    assert f"in use by site farm-a (pid {holder.pid} on " in lines[0]
    assert str(tmp_path / "state-a") in lines[0]
    assert not (tmp_path / "state-b" / "run.json").exists()  # nothing was started
    assert not (data / data_lock.LOCK_NAME).exists()  # the holder let go when it ended


def test_a_lock_of_a_dead_process_is_stale(data: Path, tmp_path: Path) -> None:
    holder = _holding(data, tmp_path / "state-a")
    holder.kill()  # no clean-up: the lock file stays behind
    holder.wait(15)
    assert locks.read(data / data_lock.LOCK_NAME, Holder).pid == holder.pid
    with data_lock.hold(data, "farm-b", tmp_path / "state-b") as me:
        assert locks.read(data / data_lock.LOCK_NAME, Holder) == me
    assert not (data / data_lock.LOCK_NAME).exists()


def test_a_reused_pid_does_not_keep_a_lock(data: Path, tmp_path: Path) -> None:
    me = ProcessId.of(os.getpid())
    stale = Holder("farm-a", "s", socket.gethostname(), me.pid, me.started - 1, "t")
    (data / data_lock.LOCK_NAME).write_text(json.dumps(stale.__dict__))
    with data_lock.hold(data, "farm-b", tmp_path / "state-b") as holder:
        assert holder.site == "farm-b"


def test_in_one_process_a_second_hold_is_refused(data: Path, tmp_path: Path) -> None:
    with data_lock.hold(data, "farm-a", tmp_path / "a"):
        with (
            pytest.raises(DataFolderInUse, match="in use by site farm-a"),
            data_lock.hold(data, "farm-b", tmp_path / "b"),
        ):
            pass
        assert locks.read(data / data_lock.LOCK_NAME, Holder).site == "farm-a"


def test_a_holder_on_another_host_is_never_replaced(data: Path, tmp_path: Path) -> None:
    other = Holder("farm-a", "/srv/a", "elsewhere.example", 1, 1, "t")
    (data / data_lock.LOCK_NAME).write_text(json.dumps(other.__dict__))
    with (
        pytest.raises(DataFolderInUse, match=r"pid 1 on elsewhere\.example.*remove"),
        data_lock.hold(data, "farm-b", tmp_path / "b"),
    ):
        pass


def test_a_read_only_data_folder_is_locked_in_the_shared_folder(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_lock.os, "access", lambda path, mode: False)  # as a read-only mount
    monkeypatch.setattr(data_lock.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with data_lock.hold(data, "farm-a", tmp_path / "a"):
        (lock,) = (tmp_path / "tmp" / data_lock.SHARED_LOCKS).iterdir()
        assert lock.name == f"{data.stat().st_dev}-{data.stat().st_ino}.lock"
        assert not (data / data_lock.LOCK_NAME).exists()
        with (
            pytest.raises(DataFolderInUse, match="farm-a"),
            data_lock.hold(data, "farm-b", tmp_path / "b"),
        ):
            pass
    assert not lock.exists()
