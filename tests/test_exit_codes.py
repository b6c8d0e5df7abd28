"""One status → exit code table (``ops/exit_codes.py``) behind every command that runs a
federation: the Flower runtime's follower and the local runtime end with the same code for the
same final status; an experiment's cell counts a degraded run as complete (tests/test_experiment.py
runs that path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from starfed.ops import flower_runs
from starfed.ops.exit_codes import (
    EXIT_DEGRADED,
    EXIT_FAILED,
    EXIT_OK,
    FINISHED,
    RUN_EXIT_CODES,
    run_exit_code,
)
from starfed.ops.flower_runs import RunOutcome
from starfed.shared.run_status import COMPLETED, DEGRADED, FAILED
from starfed.simulations import local_grid

STATUSES = [COMPLETED, DEGRADED, FAILED, "running", None]  # the last two: no final status


def test_the_table_names_each_final_status_once():
    assert RUN_EXIT_CODES == {COMPLETED: EXIT_OK, DEGRADED: EXIT_DEGRADED, FAILED: EXIT_FAILED}
    assert [run_exit_code(s) for s in STATUSES] == [0, 3, 1, 1, 1]
    assert {code for status, code in RUN_EXIT_CODES.items() if status != FAILED} == FINISHED


@pytest.mark.parametrize("status", STATUSES)
def test_both_runtimes_end_with_the_tables_code(
    status: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = {} if status is None else {"status": status}
    finished = RunOutcome(run_id=1, status=flower_runs.COMPLETED)
    assert flower_runs.exit_code(finished, metrics) == run_exit_code(status)

    monkeypatch.setattr(local_grid, "run_locally", lambda overrides: metrics)
    overrides = {"results-dir": str(tmp_path), "run-name": "run", "num-sites": 2}
    assert local_grid.simulate_locally(overrides) == run_exit_code(status)


def test_the_local_runtime_fails_when_the_run_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failed(overrides: object) -> dict:
        raise local_grid.RunFailed("no site answered")

    monkeypatch.setattr(local_grid, "run_locally", failed)
    overrides = {"results-dir": str(tmp_path), "run-name": "run", "num-sites": 2}
    assert local_grid.simulate_locally(overrides) == EXIT_FAILED
