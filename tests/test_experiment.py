"""`starfed experiment`: grids checked before anything runs, cells run and resumed, the table
computed from the cells' metrics.json.

The end-to-end test runs a two-cell grid on the smallest sizes (tiny backbones, 2 sites, 2 tasks
x 2 classes, one epoch everywhere, one seed): federated and single-site, each cell in its own
process, both at once (``--jobs 2``); then runs it again, which skips both cells. How cells are
scheduled (at most ``--jobs`` at once, stopped on Ctrl-C) is tested with stand-in cell processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from in_process import SMALL_GRID_DEFAULTS

from starfed.cli import main
from starfed.ops.exit_codes import EXIT_DEGRADED
from starfed.shared.metrics import final_average_accuracy
from starfed.simulations import cell as cells
from starfed.simulations import experiment as experiment_module
from starfed.simulations import grid as grids
from starfed.simulations import tabulate
from starfed.simulations.methods import METHODS

TWO_CELLS = f"""
[experiment]
name = "tiny"
seeds = [1993]
methods = ["starfed", "single-site"]
{SMALL_GRID_DEFAULTS}
[[scenario]]
name = "two-sites"
num-sites = 2
"""
FAST_S = 2.0


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["experiment", *argv])
    return code, out.getvalue(), err.getvalue()


# --- grid files ---------------------------------------------------------------------------


def test_shipped_grids_are_valid() -> None:
    shipped = grids.shipped_grids()
    assert set(shipped) == {
        "default",
        "sites",
        "alpha",
        "arrival",
        "gap",
        "privacy",
        "privacy-patients",
    }
    default = grids.load("default")
    assert default.seeds == (1993, 1996, 1997)
    assert default.methods == (
        "starfed",
        "starfed-positional",
        "starfed-unmerged",
        "starfed-no-replay",
        "starfed-keys",
        "fedavg",
        "single-site",
        "joint",
    )
    (scenario,) = default.scenarios
    values = scenario.values
    assert (values["num-sites"], values["alpha"], values["num-tasks"]) == (5, 0.5, 7)
    assert values["data-root"] == ""  # the bundled mini set
    sites = grids.load("sites")
    assert [s.values["num-sites"] for s in sites.scenarios] == [1, 5, 10, 20, 50]
    assert [s.values["alpha"] for s in grids.load("alpha").scenarios] == [0.5, 0.1, 0.05]
    arrival = grids.load("arrival").scenarios
    assert [s.values["arrival-offset"] for s in arrival] == [0, 1]
    gap = {s.name: s.values for s in grids.load("gap").scenarios}
    budgets = [
        (v["stage1-rounds"], v["stage1-epochs"], v["stage2-rounds"], v["stage2-epochs"])
        for v in gap.values()
    ]
    assert budgets == [(1, 5, 1, 5), (2, 5, 2, 5), (5, 1, 5, 1), (1, 10, 1, 10)]
    assert len(default.cells()) == 24 and len({c.name for c in default.cells()}) == 24


def test_every_registered_method_loads() -> None:
    for spec in METHODS.values():
        assert callable(spec.load())


BAD_GRIDS = {
    "no experiment": ("[[scenario]]\nnum-sites = 2\n", "needs an [experiment] table"),
    "not toml": ("[experiment\n", "Expected ']'"),
    "unknown method": (
        '[experiment]\nname = "x"\nmethods = ["fedprox"]\n[[scenario]]\n',
        "[experiment] methods: unknown 'fedprox' (known: starfed, starfed-keys, "
        "starfed-no-replay, starfed-positional, starfed-unmerged, fedavg, joint, single-site)",
    ),
    "unknown key": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[[scenario]]\nsites = 5\n',
        "[[scenario]] 1: unknown run-config key 'sites' (known: data-root,",
    ),
    "bad value": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[[scenario]]\nalpha = -1\n',
        "[[scenario]] 1: alpha=-1: expected a number > 0",
    ),
    "seed in a scenario": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[[scenario]]\nseed = 3\n',
        "[[scenario]] 1: seed is set per cell, not per scenario",
    ),
    "bad seed": (
        '[experiment]\nname = "x"\nseeds = [-1]\nmethods = ["starfed"]\n[[scenario]]\n',
        "[experiment] seeds=-1: expected an integer in [0, 4294967295]",
    ),
    "bad name": (
        '[experiment]\nname = "../x"\nmethods = ["starfed"]\n[[scenario]]\n',
        "[experiment] name: expected a folder name",
    ),
    "no scenario": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n',
        "needs at least one [[scenario]] table",
    ),
    "same name twice": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[[scenario]]\nname = "a"\n'
        '[[scenario]]\nname = "a"\n',
        "two scenarios are named 'a'",
    ),
    "unknown section": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[[scenario]]\n[grid]\n',
        "unknown section 'grid'",
    ),
    "both site counts": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[[scenario]]\nnum-clients = 2\n'
        "num-sites = 2\n",
        "[[scenario]] 1: num-clients and num-sites both set: num-clients is the retired name",
    ),
    "bad default": (
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[defaults]\nnum-tasks = 0\n'
        "[[scenario]]\n",
        "[defaults]: num-tasks=0: expected an integer >= 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_GRIDS))
def test_a_bad_grid_is_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    text, message = BAD_GRIDS[case]
    path = tmp_path / "grid.toml"
    path.write_text(text)
    started = time.perf_counter()
    code, out, err = run_cli(str(path), f"--results-dir={tmp_path / 'results'}")
    assert time.perf_counter() - started < FAST_S
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"starfed experiment: error: grid {path}: "), err
    assert message in err, err
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_a_missing_grid_names_the_shipped_ones() -> None:
    code, _, err = run_cli("no-such-grid")
    assert code == 2
    assert err == (
        "starfed experiment: error: grid no-such-grid: no such file, nor a shipped grid "
        "(alpha, arrival, default, gap, privacy-patients, privacy, sites)\n"
    )


def test_a_bad_grid_loads_neither_torch_nor_flower(tmp_path: Path) -> None:
    path = tmp_path / "grid.toml"
    path.write_text(BAD_GRIDS["unknown key"][0])
    code = (
        "import sys; from starfed.cli import main; rc = main(sys.argv[1:]); "
        "print(rc, *sorted(m for m in ('torch', 'flwr', 'ray', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "experiment", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.stdout.split() == ["2"], result.stdout + result.stderr


def test_scenario_names_are_derived_from_their_keys(tmp_path: Path) -> None:
    path = tmp_path / "grid.toml"
    path.write_text(
        '[experiment]\nname = "x"\nmethods = ["starfed"]\n[[scenario]]\n'
        "num-sites = 3\nalpha = 0.1\n[[scenario]]\n"
    )
    experiment = grids.load(str(path))
    assert [s.name for s in experiment.scenarios] == ["num-sites-3_alpha-0.1", "defaults"]
    assert experiment.cells()[0].name == "num-sites-3_alpha-0.1__starfed__seed1993"


def test_a_grid_of_the_retired_site_key_loads_and_its_old_cells_are_complete(
    tmp_path: Path, capsys
) -> None:
    """A grid that says ``num-clients`` loads with a note, as ``num-sites``, under the folder
    names it had; a cell it ran before the rename is complete (read without a note), one of
    another site count is not."""
    path = tmp_path / "grid.toml"
    path.write_text(
        '[experiment]\nname = "x"\nmethods = ["starfed"]\nseeds = [1]\n[[scenario]]\n'
        "num-clients = 3\n"
    )
    experiment = grids.load(str(path))
    assert capsys.readouterr().err == (
        "starfed: num-clients is deprecated, use num-sites (same meaning)\n"
    )
    (scenario,) = experiment.scenarios
    assert (scenario.name, scenario.run_config) == ("num-clients-3", {"num-sites": 3})
    (cell,) = experiment.cells()
    folder = tmp_path / cell.name
    folder.mkdir()
    (folder / cells.METRICS_FILE).write_text(json.dumps({"final_average_accuracy": 50.0}))
    for count, complete in ((3, True), (4, False)):
        before = {
            "scenario": "num-clients-3",
            "method": "starfed",
            "seed": 1,
            "run_config": {"num-clients": count},
        }
        (folder / cells.CELL_FILE).write_text(json.dumps({"definition": before, "seconds": 9.0}))
        outcome = cells.complete(folder, cell)
        assert (outcome is not None and outcome.status == "skipped") is complete, count
    assert capsys.readouterr().err == ""


# --- end to end ---------------------------------------------------------------------------


def _table_rows(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[0] in METHODS:
            rows[cells[0]] = cells
    return rows


def _expected(metrics: dict) -> dict[str, str]:
    exchanges = metrics.get("exchanges") or []
    per_round = {
        key: f"{sum(e[key] for e in exchanges) / len(exchanges) / 1000:.1f} kB"
        if exchanges
        else "—"
        for key in ("bytes_up", "bytes_down")
    }
    return {
        "faa": f"{metrics['final_average_accuracy']:.2f}",
        "forgetting": f"{metrics['final_forgetting']:.2f}",
        "selection": f"{final_average_accuracy(metrics['prompt_selection_accuracy_matrix']):.1f}",
        **per_round,
    }


@pytest.fixture(scope="module")
def two_cells(tmp_path_factory) -> tuple[Path, Path, tuple]:
    out = tmp_path_factory.mktemp("experiment")
    path = out / "tiny.toml"
    path.write_text(TWO_CELLS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STARFED_CACHE_DIR", str(out / "cache"))
        first = run_cli(str(path), f"--results-dir={out / 'results'}", "--json", "--jobs=2")
    return out, path, first


def test_two_cells_end_to_end(two_cells) -> None:
    out, _, (code, printed, progress) = two_cells
    assert code == 0, progress
    summary = json.loads(printed)
    folder = out / "results" / "tiny"
    assert summary["results"] == str(folder) and summary["failed"] == 0
    assert [c["status"] for c in summary["cells"]] == ["done", "done"]
    assert all(c["cpu_seconds"] > 0 and c["seconds"] > 0 for c in summary["cells"])
    assert summary["jobs"] == 2
    assert [c["cell"] for c in summary["cells"]] == [  # grid order, whichever ended first
        "two-sites__starfed__seed1993",
        "two-sites__single-site__seed1993",
    ]
    lines = progress.strip().splitlines()
    assert len(lines) == 2, progress
    first, second = (re.match(r"\[(\d)/2\] (\S+): done", line) for line in lines)
    assert (first[1], second[1]) == ("1", "2"), progress
    assert {first[2], second[2]} == {c["cell"] for c in summary["cells"]}, progress
    assert re.match(
        r"\[1/2\] two-sites__\S+__seed1993: done \d+m\d\ds · FAA [\d.]+ · "
        r"elapsed \d+m\d\ds · ETA \d+m\d\ds$",
        lines[0],
    ), lines[0]

    table = (folder / "table.md").read_text()
    rows = _table_rows(table)
    assert set(rows) == {"starfed", "single-site"}
    for method, row in rows.items():
        metrics = json.loads(
            (folder / f"two-sites__{method}__seed1993" / "metrics.json").read_text()
        )
        want = _expected(metrics)
        assert row[1].strip("*") == want["faa"], (method, row)
        assert row[2] == want["forgetting"] and row[3] == want["selection"], (method, row)
        assert (row[4], row[5]) == (want["bytes_up"], want["bytes_down"]), (method, row)
        assert row[7] == "1/1"
        assert math.isclose(
            next(c for c in summary["cells"] if c["method"] == method)["final_average_accuracy"],
            metrics["final_average_accuracy"],
        )
    assert rows["starfed"][4] != "—" and rows["single-site"][4] == "—"
    best = max(rows.values(), key=lambda r: float(r[1].strip("*")))
    assert best[1].startswith("**")
    assert [Path(p).name for p in summary["plots"]] == ["accuracy_over_time__two-sites.png"]
    assert all(Path(p).stat().st_size > 0 for p in summary["plots"])


def test_running_again_skips_finished_cells(two_cells) -> None:
    out, path, (code, _, _) = two_cells
    assert code == 0
    folder = out / "results" / "tiny"
    logs = {p: p.stat().st_mtime_ns for p in folder.glob("*/log.txt")}
    table = (folder / "table.md").read_text()
    started = time.perf_counter()
    again, printed, progress = run_cli(str(path), f"--results-dir={out / 'results'}")
    assert again == 0
    assert time.perf_counter() - started < 30  # no cell ran
    assert progress.count("complete, skipped") == 2, progress
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*/log.txt")} == logs
    assert (folder / "table.md").read_text() == table
    assert printed.startswith(table)


def test_a_failed_cell_is_exit_1_and_the_rest_still_runs(tmp_path: Path) -> None:
    """A folder without images passes the grid's checks (it exists) and fails its cell."""
    path = tmp_path / "grid.toml"
    (tmp_path / "empty").mkdir()
    path.write_text(
        '[experiment]\nname = "broken"\nseeds = [1993]\nmethods = ["joint"]\n'
        f'[[scenario]]\nname = "no-data"\ndata-root = "{tmp_path / "empty"}"\n'
    )
    code, printed, progress = run_cli(str(path), f"--results-dir={tmp_path}", "--json")
    assert code == 1, progress
    summary = json.loads(printed)
    (cell,) = summary["cells"]
    assert cell["status"] == "failed" and cell["error"], cell
    assert "FAILED" in progress and cell["error"] in progress
    assert "| joint | — |" in (tmp_path / "broken" / "table.md").read_text()


def test_a_grid_naming_a_missing_data_root_is_bad_input(tmp_path: Path) -> None:
    """Checked when the grid is read, before any cell runs: one line, exit 2."""
    path = tmp_path / "grid.toml"
    path.write_text(
        '[experiment]\nname = "broken"\nseeds = [1993]\nmethods = ["joint"]\n'
        f'[[scenario]]\nname = "no-data"\ndata-root = "{tmp_path / "missing"}"\n'
    )
    code, _, progress = run_cli(str(path), f"--results-dir={tmp_path}")
    assert code == 2
    assert f"data-root={tmp_path / 'missing'}: no such folder" in progress
    assert not (tmp_path / "broken").exists()


def test_table_and_plots_of_a_sweep_over_seeds(tmp_path: Path) -> None:
    """Mean ± sample sd over seeds, the best FAA in bold, FAA against the swept key — from
    metrics alone (no training)."""
    path = tmp_path / "grid.toml"
    path.write_text(
        '[experiment]\nname = "sweep"\nseeds = [1, 2]\nmethods = ["starfed", "single-site"]\n'
        "[[scenario]]\nnum-sites = 1\n[[scenario]]\nnum-sites = 5\n"
    )
    experiment = grids.load(str(path))
    results = {}
    for i, cell in enumerate(experiment.cells()):
        faa = 10.0 + i
        metrics = {
            "accuracy_matrix": [[50.0], [faa, faa]],
            "final_average_accuracy": faa,
            "final_forgetting": 1.0,
            "prompt_selection_accuracy_matrix": [[20.0], [30.0, 40.0]],
            "exchanges": [{"bytes_up": 1000, "bytes_down": 3000}]
            if cell.method == "starfed"
            else [],
        }
        results[cell.name] = (metrics, 60.0)
    rows = tabulate.rows(experiment, results)
    table = tabulate.table(experiment, rows)
    # cells run seed by seed: seed 1 gives FAA 10..13, seed 2 gives 14..17
    assert (
        "| starfed | 12.00 ± 2.83 | 1.00 ± 0.00 | 35.0 ± 0.0 | 1.0 kB | 3.0 kB | 60 s | 2/2 |"
        in table
    )
    assert "| single-site | **15.00 ± 2.83** |" in table
    plots = tabulate.plots(experiment, rows, tmp_path)
    assert [p.name for p in plots] == [
        "accuracy_over_time__num-sites-1.png",
        "accuracy_over_time__num-sites-5.png",
        "faa_vs_num-sites.png",
    ]


# --- on Flower's runtime, on a Ray cluster -------------------------------------------------


@pytest.mark.parametrize("given", ["--ray-address", "RAY_ADDRESS"])
def test_flower_cells_are_simulate_runs_on_the_ray_cluster(
    given: str, tmp_path: Path, monkeypatch
) -> None:
    """--runtime flower with --ray-address (or RAY_ADDRESS): each cell's process gets the
    cluster in RAY_ADDRESS (as simulate's SuperLink does) and is one `simulate` run into the
    cell's folder with the command's options. The cells' processes run here, `simulate` a
    stand-in writing metrics; tests/test_ray_cluster.py runs the real thing."""
    address = "10.0.0.1:6379"
    if given == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    runs: list[tuple[dict, float, float, str]] = []

    def fake_simulate(overrides: dict, timeout: float, gpus_per_client: float = 0.0) -> int:
        runs.append((overrides, timeout, gpus_per_client, os.environ["RAY_ADDRESS"]))
        folder = Path(overrides["results-dir"]) / overrides["run-name"]
        metrics = {
            "status": "degraded",
            "accuracy_matrix": [[50.0], [40.0, 60.0]],
            "final_average_accuracy": 50.0,
            "final_forgetting": 10.0,
        }
        (folder / cells.METRICS_FILE).write_text(json.dumps(metrics))
        return EXIT_DEGRADED  # a complete cell, as on the local runtime

    class CellProcess:
        """The cell's child process, run in this one with the environment it was given."""

        def __init__(self, command: list[str], *, env: dict[str, str], **_: object) -> None:
            assert command[1:4] == ["-P", "-m", "starfed.simulations.cell"], command
            with monkeypatch.context() as child:
                child.setattr(os, "environ", env)
                self.code = cells.main(command[4:])

    monkeypatch.setattr(cells, "simulate", fake_simulate)
    monkeypatch.setattr(cells.subprocess, "Popen", CellProcess)
    monkeypatch.setattr(cells, "_reap", lambda child: (child.code, 0.0))  # it ran in here
    path = tmp_path / "grid.toml"
    path.write_text(
        '[experiment]\nname = "ray"\nseeds = [1, 2]\nmethods = ["starfed"]\n'
        "[[scenario]]\nnum-sites = 2\n"
    )
    argv = ["--runtime=flower", "--timeout=99"]
    argv += [f"--ray-address={address}"] if given == "--ray-address" else []
    code, printed, progress = run_cli(str(path), f"--results-dir={tmp_path}", "--json", *argv)
    assert code == 0, progress
    assert [c["status"] for c in json.loads(printed)["cells"]] == ["done", "done"]
    folders = [tmp_path / "ray" / f"num-sites-2__starfed__seed{seed}" for seed in (1, 2)]
    assert [(Path(o["results-dir"]) / o["run-name"], o["seed"]) for o, *_ in runs] == [
        (folder, seed) for folder, seed in zip(folders, (1, 2), strict=True)
    ]
    assert all(o["num-sites"] == 2 for o, *_ in runs)
    assert [run[1:] for run in runs] == [(99.0, 0.0, address)] * 2
    record = json.loads((folders[0] / cells.CELL_FILE).read_text())
    assert record["runtime"] == {
        "name": "flower",
        "timeout": 99.0,
        "gpus_per_client": 0.0,
        "ray_address": address if given == "--ray-address" else "",
    }


# --- cells at once (--jobs) ---------------------------------------------------------------

# A cell's process, stood in for: it notes when it starts (with the size it was given for its
# thread pools) and ends, one appended line each, so the lines of cells running at once
# interleave; it waits, and writes a complete metrics.json.
STAND_IN = """
import json, os, sys, time
trace = os.environ["STAND_IN_TRACE"]
with open(trace, "a") as out:
    out.write("+" + os.environ.get("OMP_NUM_THREADS", "unset") + "\\n")
time.sleep(float(os.environ["STAND_IN_S"]))
metrics = {"accuracy_matrix": [[50.0]], "final_average_accuracy": 50.0, "final_forgetting": 0.0}
with open(os.path.join(sys.argv[1], "metrics.json"), "w") as out:
    json.dump(metrics, out)
with open(trace, "a") as out:
    out.write("-\\n")
"""


@pytest.fixture
def stand_in_cells(tmp_path: Path, monkeypatch) -> tuple[Path, Path, list]:
    """A four-cell grid whose cells' processes are ``STAND_IN``: the grid file, the trace, and
    the processes started (to check that none outlives the command)."""
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("STAND_IN_TRACE", str(trace))
    monkeypatch.setenv("STAND_IN_S", "1.0")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def stand_in(command: list[str], **kwargs) -> subprocess.Popen:
        assert command[1:4] == ["-P", "-m", "starfed.simulations.cell"], command
        started.append(popen([sys.executable, "-c", STAND_IN, command[4]], **kwargs))
        return started[-1]

    monkeypatch.setattr(cells.subprocess, "Popen", stand_in)
    path = tmp_path / "grid.toml"
    path.write_text(
        '[experiment]\nname = "jobs"\nseeds = [1, 2, 3, 4]\nmethods = ["single-site"]\n'
        "[[scenario]]\nnum-sites = 2\n"
    )
    return path, trace, started


def _most_at_once(trace: Path) -> int:
    running = most = 0
    for line in trace.read_text().split():
        running += 1 if line.startswith("+") else -1
        most = max(most, running)
    return most


@pytest.mark.parametrize("jobs", [1, 2])
def test_at_most_jobs_cells_run_at_once(jobs: int, stand_in_cells, tmp_path: Path) -> None:
    """--jobs N: N cells' processes at once, never more, each with its share of the cores for
    its thread pools; each cell's record is its own (its time, the CPU time of its own
    process); the summary lists the cells in grid order."""
    path, trace, started = stand_in_cells
    code, printed, progress = run_cli(
        str(path), f"--results-dir={tmp_path}", "--json", f"--jobs={jobs}"
    )
    assert code == 0, progress
    assert _most_at_once(trace) == jobs, trace.read_text()
    share = "unset" if jobs == 1 else str(max(1, (os.cpu_count() or 1) // jobs))
    assert {line[1:] for line in trace.read_text().split() if line[0] == "+"} == {share}
    summary = json.loads(printed)
    assert [c["seed"] for c in summary["cells"]] == [1, 2, 3, 4]
    assert all(c["status"] == "done" and c["seconds"] >= 1.0 for c in summary["cells"])
    assert all(0 < c["cpu_seconds"] < c["seconds"] for c in summary["cells"]), summary["cells"]
    assert [line.split("]")[0] for line in progress.splitlines()] == [
        f"[{i}/4" for i in range(1, 5)
    ]
    assert all(child.returncode == 0 for child in started)


def test_ctrl_c_stops_every_running_cell(stand_in_cells, tmp_path: Path, monkeypatch) -> None:
    """An interrupt while two cells run stops both by their PIDs (none is left running) and
    exits 130; the same command then runs them again, and the others."""
    path, trace, started = stand_in_cells
    monkeypatch.setenv("STAND_IN_S", "60")
    sleep = time.sleep

    def interrupt_once_both_started(seconds: float) -> None:
        if len(started) == 2 and trace.exists() and trace.read_text().count("+") == 2:
            raise KeyboardInterrupt
        sleep(seconds)

    clock = types.SimpleNamespace(monotonic=time.monotonic, sleep=interrupt_once_both_started)
    with monkeypatch.context() as patch:
        patch.setattr(experiment_module, "time", clock)  # the scheduler's wait, not Popen's
        code, _, progress = run_cli(str(path), f"--results-dir={tmp_path}", "--jobs=2")
    assert code == 130, progress
    assert "interrupted; the same command continues" in progress
    assert len(started) == 2 and all(child.poll() is not None for child in started)
    monkeypatch.setenv("STAND_IN_S", "0")
    code, printed, progress = run_cli(str(path), f"--results-dir={tmp_path}", "--json", "--jobs=2")
    assert code == 0, progress
    assert [c["status"] for c in json.loads(printed)["cells"]] == ["done"] * 4
