"""The one lock (``host/locks.py``) where the site's state folder uses it: ``site start``'s state
lock names its holder, is taken over once that holder was killed, and a damaged lock file is
refused rather than replaced — as the federation folder's (tests/test_faults.py) and the data
folder's (tests/test_adversarial_site_data.py) are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from starfed.client.ops import supernode
from starfed.client.ops.site_options import SiteError
from starfed.client.ops.supernode import STATE_LOCK
from starfed.host import locks

HOLD = """
import signal, sys, time
from pathlib import Path
from starfed.client.ops import supernode
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as `site start` ends on SIGTERM
with supernode._state_lock(Path(sys.argv[1]), "farm-a"):
    print("held", flush=True)
    time.sleep(60)
"""


def _holding(state: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_second_start_on_a_state_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder = _holding(state)
    try:
        with (
            pytest.raises(SiteError, match=rf"uses {state}: site farm-a \(pid {holder.pid} "),
            supernode._state_lock(state, "farm-b"),
        ):
            pass
    finally:
        holder.terminate()  # by its own PID: it gives the lock back as it ends
        holder.wait(15)
    assert not (state / STATE_LOCK).exists()


def test_the_lock_of_a_killed_start_is_taken_over(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder = _holding(state)
    holder.kill()  # SIGKILL: the lock file stays behind
    holder.wait(15)
    assert locks.read(state / STATE_LOCK, supernode.data_lock.Holder).pid == holder.pid
    with supernode._state_lock(state, "farm-b"):
        taken = locks.read(state / STATE_LOCK, supernode.data_lock.Holder)
        assert taken is not None and taken.site == "farm-b" and locks.alive(taken)
    assert not (state / STATE_LOCK).exists()


def test_a_damaged_lock_is_refused_not_replaced(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_LOCK).write_text("{half a lock")
    with (
        pytest.raises(SiteError, match=r"is damaged .*remove it"),
        supernode._state_lock(state, "farm-b"),
    ):
        pass
    assert (state / STATE_LOCK).read_text() == "{half a lock"
