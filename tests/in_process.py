"""starfed in the test's own process: a command, and server runs over the real ClientApp.

The in-process counterparts of tests/deployed.py (which starts real processes): fast enough
to run a federation once per module and an operator's commands against it many times. The
modules that run federations share the tiny config, the crash and the run's clean-up here.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from starfed.cli import main
from starfed.client import app as client_app
from starfed.server.app import run_server
from starfed.simulations.local_grid import LocalGrid

#: The smallest run config that exercises the protocol: tiny backbones, one epoch everywhere.
TINY_RUN = {
    "preset": "tiny",
    "seed": 1993,
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "timeout-s": 5,
    "wait-s": 0.5,
}
#: A grid file's [defaults] for the smallest cells: two tasks of two classes, one epoch each.
SMALL_GRID_DEFAULTS = """
[defaults]
num-tasks = 2
classes-per-task = 2
stage1-epochs = 1
stage2-epochs = 1
replay1-epochs = 1
replay2-epochs = 1
replay2-epochs-per-task = 0
"""
_run_ids = itertools.count(9000)


class Crash(BaseException):
    """The server process dying: nothing in the server catches it."""


def starfed(capture: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """``starfed *argv`` in this process: (exit code, stdout, stderr) as ``capture`` caught
    them (capsys; capfd where the command's own child processes print too)."""
    code = main([str(arg) for arg in argv])
    out, err = capture.readouterr()
    return code, out, err


def run_two_sites(root: Path, faults: dict | None = None, **config: object) -> dict:
    """One server run over ``root/server/federation`` with the sites farm-a (node 1) and farm-b
    (node 2), whose folders are ``root/farm-a`` and ``root/farm-b``; ``faults`` as
    ``LocalGrid.faults`` takes them; ``config``: run-config keys beyond ``TINY_RUN``. The run's
    metrics."""
    config = {**TINY_RUN, **config, "federation-dir": str(root / "server" / "federation")}
    nodes = site_nodes(root, ("farm-a", "farm-b"))
    grid = LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids))
    grid.faults.update(faults or {})
    return run_grid(grid, config)


def site_nodes(root: Path, sites: tuple[str, ...], taking_part: tuple[str, ...] = ()) -> dict:
    """Node configs of ``sites`` (node ids 1, 2, … in that order) whose folders are
    ``root/<site>`` and ``root/<site>-state``; only those ``taking_part`` (default: all)."""
    return {
        i + 1: {
            "data-dir": str(root / site),
            "state-dir": str(root / f"{site}-state"),
            "site-name": site,
            "cache-dir": str(root / "cache"),
        }
        for i, site in enumerate(sites)
        if site in (taking_part or sites)
    }


def run_grid(grid: LocalGrid, config: dict) -> dict:
    """The server over ``grid``; the run's metrics."""
    return run_server(grid, config, grid.run_id)
