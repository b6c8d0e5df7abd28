"""The site's SuperExec (``starfed.client.ops.superexec``): its fork executor runs ClientApp tasks
only, each in a child of its own that gets the task's token, and reaps them. The whole loop
against a real SuperNode runs in the deployed end-to-end tests (tests/test_e2e_server_run.py)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResultStatus

from starfed.client.ops import site_options, superexec


def _spec(task_type: TaskType, token: str = "tok-1") -> ExecutionSpec:
    return ExecutionSpec(
        task_type=task_type,
        runtime_api_address="127.0.0.1:1",
        token=token,
        insecure=True,
        root_certificates_path=None,
        runtime_dependency_install=False,
        parent_pid=os.getpid(),
        suppress_output=False,
        task_id=7,
    )


def _reap(executor: superexec.ForkExecutor, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while executor.children and time.monotonic() < deadline:
        executor.reconcile()
        time.sleep(0.05)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_clientapp_task_runs_in_a_forked_child_that_is_reaped(tmp_path: Path, monkeypatch):
    seen = tmp_path / "seen"

    def fake_run_clientapp(*, runtime_api_address: str, token: str, **_: object) -> None:
        seen.write_text(f"{runtime_api_address} {token} {os.getpid()}")
        raise SystemExit(0)  # as Flower's run_clientapp ends, through flwr_exit

    monkeypatch.setattr(superexec, "run_clientapp", fake_run_clientapp)
    monkeypatch.setattr(superexec, "OBJECTS_GRACE_S", 0.0)
    executor = superexec.ForkExecutor()
    result = executor.launch(_spec(TaskType.CLIENT_APP, token="secret-token"))
    assert result.status is LaunchResultStatus.ACCEPTED
    assert len(executor.children) == 1
    _reap(executor)
    assert not executor.children
    address, token, pid = seen.read_text().split()
    assert (address, token) == ("127.0.0.1:1", "secret-token")
    assert int(pid) != os.getpid()


def test_only_clientapp_tasks_are_acquired_or_launched() -> None:
    executor = superexec.ForkExecutor()
    types, fab_hashes = executor.get_eligible_capacity(set(TaskType))
    assert types == {TaskType.CLIENT_APP} and fab_hashes == set()
    result = executor.launch(_spec(TaskType.SERVER_APP))
    assert result.status is LaunchResultStatus.FAILED and "ClientApps only" in result.message
    assert not executor.children


def test_the_superexec_secret_is_new_and_private_on_every_start(tmp_path: Path) -> None:
    path = tmp_path / "superexec.secret"
    site_options.write_superexec_secret(path)
    first = path.read_bytes()
    site_options.write_superexec_secret(path)
    assert len(first) == 32 and path.read_bytes() != first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
