"""What people read: the console's width when piped, counts and percentages in words, the
federation's log lines on a command's console, a negative forgetting explained, and Flower's
SuperNode-count warning kept out of ``starfed simulate``'s output."""

from __future__ import annotations

import io
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from starfed.ops.flower_runs import summarize
from starfed.shared.metrics import SCORES_DOC, faa_text, forgetting_text, percentage
from starfed.shared.progress import PIPED_WIDTH, console, counted, logged_to, percent_text
from starfed.simulations.simulate import filtered_stdout, without_noise

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stderr", [False, True])
def test_piped_console_is_wide_and_does_not_wrap(
    stderr: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A train-local-style table of ten tasks and a long path stay one line each."""
    monkeypatch.delenv("COLUMNS", raising=False)
    out = console(stderr=stderr)
    assert (out.width, out.soft_wrap) == (PIPED_WIDTH, True)
    table = Table("task", "accuracy per seen task (%)", "avg", "selection (%)", "s")
    for t in range(10):
        table.add_row(str(t + 1), " ".join(f"{a:5.1f}" for a in range(t + 1)), "1.0", "2.0", "9")
    out.print(table)
    path = "/results/" + "a-long-folder-name/" * 20 + "metrics.json"
    out.print(f"results: {path}")
    lines = (capsys.readouterr().err if stderr else capsys.readouterr().out).splitlines()
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 10 and all(line.endswith("│") for line in rows)
    assert f"results: {path}" in lines


def test_piped_console_takes_a_wider_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert console().width == PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", str(PIPED_WIDTH + 100))
    assert console().width == PIPED_WIDTH + 100


def test_counted_says_one_in_the_singular() -> None:
    assert counted(1, "new class") == "1 new class"
    assert counted(2, "new class") == "2 new classes"
    assert counted(0, "site") == "0 sites"
    assert counted(1, "step") == "1 step"


def test_a_percentage_from_counts_and_its_text() -> None:
    """One home each: an accuracy from counts is NaN with nothing to count, and its text is a
    dash for NaN or None (a score left out of JSON)."""
    assert percentage(1, 8) == 12.5 and math.isnan(percentage(0, 0))
    assert percent_text(100 / 3) == "33.33"
    assert percent_text(percentage(0, 0)) == percent_text(None) == "—"


def test_the_federations_lines_show_on_the_console_while_it_runs() -> None:
    """Lines the core logs under ``starfed`` print on the command's console, whole and as
    written (a class name with brackets is not markup), warnings and failures styled; debug
    lines, other libraries' lines and lines after the run do not."""
    out = io.StringIO()
    shown = Console(file=out, force_terminal=True, color_system="standard", width=200)
    coordinator = logging.getLogger("starfed.server.coordinator")
    with logged_to(shown):
        coordinator.info("step 1: 2 new classes from 1 site · [red]apple[/] taking part")
        coordinator.warning("federation folder: %s", "rolled back to step 3")
        coordinator.error("step 2 failed: no site answered; rolled back")
        coordinator.debug("a debug line")
        logging.getLogger("flwr").warning("a line of another library")
    coordinator.info("after the run")
    text = out.getvalue()
    lines = [line for line in text.splitlines() if line]
    assert len(lines) == 3, text
    assert "step 1: 2 new classes from 1 site · [red]apple[/] taking part" in lines[0]
    assert "\x1b[33mfederation folder: rolled back to step 3" in lines[1]  # yellow
    assert "\x1b[31mstep 2 failed: no site answered; rolled back" in lines[2]  # red
    assert logging.getLogger("starfed").handlers == []


def test_negative_forgetting_says_what_it_means_and_where() -> None:
    assert forgetting_text(3.214) == "forgetting 3.21"
    assert forgetting_text(0.0) == "forgetting 0.00"
    text = forgetting_text(-20.37)
    assert text.startswith("forgetting -20.37 (negative: the earlier tasks score better")
    assert text.endswith(f"{SCORES_DOC})")
    page, anchor = SCORES_DOC.split("#")
    headings = [line for line in (ROOT / page).read_text().splitlines() if line.startswith("#")]
    assert any(h.lstrip("#").strip().lower().replace(" ", "-") == anchor for h in headings)


def test_run_summary_line() -> None:
    metrics = {
        "status": "completed",
        "steps": 1,
        "final_average_accuracy": 41.67,
        "final_forgetting": -2.5,
        "wall_time_s": 59,
    }
    line = summarize(metrics)
    assert line.startswith("completed · 1 step · FAA 41.67% · forgetting -2.50 (negative:")
    assert line.endswith(" · server wall 59s")
    assert summarize({**metrics, "steps": 2, "final_forgetting": 1.0}) == (
        "completed · 2 steps · FAA 41.67% · forgetting 1.00 · server wall 59s"
    )
    # counted as the ServerApp's own last line counts them: this run's steps, then the total
    second = {**metrics, "steps_this_run": [], "final_forgetting": 1.0}
    assert summarize(second).startswith("completed · 0 steps this run, 1 in the federation · ")
    first = {**second, "steps_this_run": [{"step": 0, "status": "completed"}]}
    assert summarize(first).startswith("completed · 1 step this run · FAA")
    none_yet = {"status": "failed", "steps": 0, "steps_this_run": []}  # no FAA yet
    assert summarize(none_yet).startswith("failed · 0 steps this run · FAA n/a · ")
    assert faa_text(float("nan")) == "FAA n/a" and faa_text(16.8) == "FAA 16.80%"


#: The start of a simulation's log as ``flwr log`` prints it (Flower 1.42, colours and all).
FLOWER_LOG = """\
\x1b[92mINFO \x1b[0m:      Starting Flower Simulation
\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.
\x1b[92mINFO \x1b[0m:      Federation `@none/default` (5 simulated SuperNodes)
\x1b[92mINFO \x1b[0m:      To change federation size, use the following command:
\x1b[92mINFO \x1b[0m: \tflwr federation simulation-config @none/default <superlink> \
--num-supernodes <N>
step 1: 4 new classes from 2 sites · 2 sites taking part
"""


def test_simulation_log_drops_the_supernode_count_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The run's log reaches stdout through a pipe, as ``flwr log``'s does: Flower's warning
    about a default this command never uses and its resize hint are gone, every other line is
    there, in order."""
    with filtered_stdout() as sink:
        child = [sys.executable, "-c", f"import sys; sys.stdout.write({FLOWER_LOG!r})"]
        subprocess.run(child, stdout=sink, check=True)
    shown = capsys.readouterr().out
    assert "changed from 10 to 2" not in shown and "simulation-config" not in shown
    lines = FLOWER_LOG.splitlines()
    assert shown.splitlines() == [lines[0], lines[2], lines[5]]


#: A run's log as ``flwr log`` printed it after ``flwr run .`` from a shell without
#: ``PYTHONWARNINGS`` (issue 47's walkthrough): Ray's FutureWarning, with its source line.
RAY_WARNING = (
    "/opt/venv/lib/python3.11/site-packages/ray/_private/worker.py:2051: FutureWarning: Tip: In "
    "future versions of Ray, Ray will no longer override accelerator visible devices env var if "
    "num_gpus=0 or num_gpus=None (default). To enable this behavior and turn off this error "
    "message, set RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0\n"
    "  warnings.warn(\n"
)
FLWR_RUN_LOG = (
    FLOWER_LOG.replace("step 1", RAY_WARNING + "starfed server: federation 9e0e17de\n" + "step 1")
    + RAY_WARNING
    + "  an indented line of the run's own\n"
    + "(ClientAppActor pid=29556) WARNING :   Manually terminating ClientAppActor\n"
)


def test_a_followed_run_shows_no_warning_of_ray_or_flower() -> None:
    """``starfed simulate --follow`` shows a run that ``flwr run .`` started: Ray's warning and
    the source line under it are gone wherever they come, Flower's notes and its warning at the
    run's end too; the run's own
    lines stay, an indented one after a warning's source line included."""
    shown = list(without_noise(FLWR_RUN_LOG.splitlines(keepends=True)))
    assert not any("Warning" in line or "warnings.warn" in line for line in shown), shown
    assert [line.rstrip("\n") for line in shown] == [
        FLOWER_LOG.splitlines()[0],
        FLOWER_LOG.splitlines()[2],
        "starfed server: federation 9e0e17de",
        FLOWER_LOG.splitlines()[5],
        "  an indented line of the run's own",
    ]
