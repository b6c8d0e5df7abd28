"""Submitting and following a run through ``flwr``, without a SuperLink: the generated app
folder (checked by Flower's own bundler) and a fake ``flwr`` that answers like Flower 1.42
(``tests/fake_flwr.py``) — ``--format json`` errors with exit code 0, runs that go running ->
finished, ``stop``, a working folder that holds a ``starfed/`` checkout."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import tomllib
import zipfile
from io import BytesIO
from pathlib import Path

import fake_flwr as fake
import pytest

from starfed.ops import flower_runs
from starfed.ops.flower_runs import FlowerCli, FlowerRunError, RunOutcome
from starfed.simulations.simulate import APP_COMPONENTS as SIMULATION_APP

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_flwr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return fake.install(tmp_path / "bin", monkeypatch)


def _cli(tmp_path: Path) -> FlowerCli:
    flower_runs.write_connection(tmp_path / "home", "127.0.0.1:1")
    return FlowerCli(tmp_path / "home")


def _calls(bin_dir: Path) -> list[list[str]]:
    return [call["argv"] for call in fake.calls(bin_dir)]


def _statuses(bin_dir: Path, *statuses: str) -> None:
    fake.set_state(bin_dir, statuses=list(statuses))


# --- the app folder --------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # typer's use of click, on import
def test_generated_app_is_the_repository_app_and_flower_bundles_it(tmp_path: Path) -> None:
    from flwr.cli.build import build_fab_from_disk

    app = flower_runs.write_app(tmp_path / "app", SIMULATION_APP)  # `flwr run .` simulates
    generated = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    checkout = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert generated == checkout  # components, publisher, every run-config key and default
    fab = zipfile.ZipFile(BytesIO(build_fab_from_disk(app)))
    assert sorted(fab.namelist()) == [".info/CONTENT", "pyproject.toml"]  # no code: installed


def test_connection_config_names_one_superlink(tmp_path: Path) -> None:
    flower_runs.write_connection(tmp_path, "127.0.0.1:9", tmp_path / "ca.pem")
    config = tomllib.loads((tmp_path / "config.toml").read_text())["superlink"]
    assert config == {
        "default": "starfed",
        "starfed": {"address": "127.0.0.1:9", "root-certificates": str(tmp_path / "ca.pem")},
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_toml_values_round_trip_through_flower_parser() -> None:
    from flwr.common.config import parse_config_args

    values = {"a": True, "b": 3, "c": 0.5, "d": "/tmp/with space/x", "e": ""}
    lines = [f"{k}={flower_runs.toml_value(v)}" for k, v in values.items()]
    assert parse_config_args(lines) == values


# --- following a run -------------------------------------------------------------------------


def test_a_run_is_submitted_streamed_and_followed_to_its_end(fake_flwr, tmp_path, capfd) -> None:
    _statuses(fake_flwr, "pending", "running", "finished:completed")
    seen = []
    outcome = flower_runs.run_to_end(
        _cli(tmp_path),
        tmp_path / "app",
        {"federation-dir": "/x y", "max-steps": 2, "confidence-modulation": False},
        on_submitted=seen.append,
    )
    assert outcome == RunOutcome(42, "finished:completed") and seen == [42]
    calls = _calls(fake_flwr)
    assert calls[0] == [
        *("run", str(tmp_path / "app"), "starfed", "--run-config", 'federation-dir="/x y"'),
        *("--run-config", "max-steps=2", "--run-config", "confidence-modulation=false"),
        *("--format", "json"),
    ]
    assert ["log", "42", "starfed", "--stream"] in calls
    polls = [call for call in calls if call[0] == "ls"]  # the log stream runs alongside
    assert polls == [["ls", "starfed", "--run-id", "42", "--format", "json"]] * 3
    assert "ServerApp: step 1" in capfd.readouterr().out


def test_while_the_log_streams_the_status_is_asked_seldom(fake_flwr, tmp_path) -> None:
    """Flower ends a run's log stream once the run has finished: the follower waits on that
    and asks the status (each ``flwr ls`` a Python process) at the start, at the stream's end
    and every ``STATUS_POLL_S``, not every ``POLL_S`` (issue 47: the suite's end-to-end time)."""
    fake.set_state(fake_flwr, statuses=["running", "finished:completed"], streaming=True)
    finish = threading.Timer(1.0, (fake_flwr / "finished").touch)
    finish.start()
    outcome = flower_runs.run_to_end(_cli(tmp_path), tmp_path / "app", {})
    finish.join()
    assert outcome == RunOutcome(42, "finished:completed")
    assert [call[0] for call in _calls(fake_flwr)].count("ls") == 2


def test_an_error_answer_with_exit_code_0_is_an_error(fake_flwr, tmp_path) -> None:
    fake.set_state(fake_flwr, refuse=True, statuses=["running"])
    with pytest.raises(FlowerRunError, match=r"^\[code: 7\] no$"):
        _cli(tmp_path).submit(tmp_path, {})


def test_no_flower_config_is_refused_before_flwr_starts_a_superlink(tmp_path) -> None:
    with pytest.raises(FlowerRunError, match="no Flower config"):
        FlowerCli(tmp_path / "nothing").status(1)


def test_unfinished_runs(fake_flwr, tmp_path) -> None:
    assert [r["run-id"] for r in _cli(tmp_path).unfinished_runs()] == ["42"]  # running
    _statuses(fake_flwr, "finished:stopped")
    assert _cli(tmp_path).unfinished_runs() == []


def test_ctrl_c_stops_the_run_itself(fake_flwr, tmp_path) -> None:
    polls = []

    def interrupt() -> None:
        polls.append(1)
        if len(polls) == 2:
            raise KeyboardInterrupt

    outcome = flower_runs.run_to_end(_cli(tmp_path), tmp_path, {}, on_poll=interrupt)
    assert outcome.interrupted and outcome.run_id == 42
    assert ["stop", "42", "starfed", "--format", "json"] in _calls(fake_flwr)


def test_a_timeout_stops_the_run(fake_flwr, tmp_path) -> None:
    outcome = flower_runs.run_to_end(_cli(tmp_path), tmp_path, {}, timeout_s=0.05)
    assert outcome.status == "timed out after 0s"
    assert ["stop", "42", "starfed", "--format", "json"] in _calls(fake_flwr)


def test_flwr_runs_in_the_flower_home_whatever_the_callers_folder(
    fake_flwr, tmp_path, monkeypatch
) -> None:
    cli = _cli(tmp_path)
    monkeypatch.chdir(fake.checkout(tmp_path / "work"))
    _statuses(fake_flwr, "running", "finished:completed")
    assert cli.unfinished_runs() == [{"run-id": "42", "status": "running"}]
    assert flower_runs.run_to_end(cli, tmp_path / "app", {}).status == "finished:completed"
    calls = fake.calls(fake_flwr)
    assert {call["argv"][0] for call in calls} == {"ls", "run", "log"}
    assert {call["cwd"] for call in calls} == {str(cli.flwr_home)}
    # a relative Flower home is the caller's: flwr gets it absolute, as FLWR_HOME and folder
    relative = FlowerCli(Path("..") / "home")
    cwd, home = relative.process_options["cwd"], Path(relative.env["FLWR_HOME"])
    assert cwd.is_absolute() and home.is_absolute()
    assert cwd.resolve() == home.resolve() == cli.flwr_home.resolve()


def test_the_legacy_usage_check_is_what_a_checkout_trips(fake_flwr, tmp_path) -> None:
    """The fake's check, so the test above would fail if flwr ran in the caller's folder."""
    bare = [str(fake_flwr / "flwr"), "ls", "starfed", "--format", "json"]
    home = tmp_path / "home"
    home.mkdir()
    result = subprocess.run(
        bare, cwd=fake.checkout(tmp_path / "work"), capture_output=True, text=True
    )
    assert result.returncode == 1 and "Heads up from Flower!" in result.stdout
    assert subprocess.run(bare, cwd=home, capture_output=True).returncode == 0


def test_the_log_stream_drops_flowers_own_messages(fake_flwr, tmp_path, capfd) -> None:
    """Its stdout is the ServerApp's progress; its stderr, e.g. the "Connection to the
    SuperLink is unavailable" box, is said once, in one line, by whoever follows the run."""
    fake.set_state(fake_flwr, statuses=["gone"], killed=True)  # the SuperLink is gone
    _cli(tmp_path).stream_logs(42).wait(30)
    out, err = capfd.readouterr()
    assert "ServerApp: step 1" in out and fake.UNAVAILABLE not in out + err


# --- the result ------------------------------------------------------------------------------


def test_exit_codes_come_from_flower_and_this_runs_metrics(tmp_path: Path) -> None:
    before = time.time() - 1
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "degraded"}))
    metrics = flower_runs.read_metrics(tmp_path, since=before)
    assert flower_runs.read_metrics(tmp_path, since=time.time() + 5) is None  # an older run's
    done = RunOutcome(1, "finished:completed")
    assert flower_runs.exit_code(done, metrics) == 3
    assert flower_runs.exit_code(done, {"status": "completed"}) == 0
    assert flower_runs.exit_code(done, {"status": "failed"}) == 1  # e.g. no site answered
    assert flower_runs.exit_code(done, None) == 1
    assert flower_runs.exit_code(RunOutcome(1, "finished:failed"), {"status": "failed"}) == 1
    assert flower_runs.exit_code(RunOutcome(1, "interrupted"), None) == 130


#: What `flwr log --stream` showed for `server run` with no site online (Flower 1.42).
NO_SITE_LOG = """\
starfed server federation 7118f3ce in /srv/federation · 0 steps so far · backbones tiny (012a)
0 sites connected, 1 needed (waited 3s)
failed · 0 steps this run · FAA nan% · forgetting 0.00 · wall 5s
\x1b[91mERROR \x1b[0m:     ServerApp raised an exception
Traceback (most recent call last):
  File "/venv/flwr/superlink/runtime/run_serverapp.py", line 221, in run_serverapp
    context = run_(
              ^^^^^
  File "/starfed/server/app.py", line 154, in _run_locked
    raise RunFailed(log.reason)
starfed.server.app.RunFailed: 0 sites connected, 1 needed (waited 3s)
\x1b[91mERROR \x1b[0m:     Exit Code: 201

An unhandled exception occurred in the ServerApp.

For more information, visit: <https://flower.ai/docs/framework/1.42/en/ref-exit-codes/201.html>
"""


def test_an_expected_failure_is_its_one_line_not_flowers_traceback() -> None:
    from starfed.server.app import RunFailed

    assert f"{RunFailed.__module__}.{RunFailed.__qualname__}: " == flower_runs.EXPECTED_FAILURE
    kept = "".join(flower_runs.without_expected_failure(NO_SITE_LOG.splitlines(keepends=True)))
    assert kept == "".join(NO_SITE_LOG.splitlines(keepends=True)[:3])
    # any other exception keeps its traceback
    bug = NO_SITE_LOG.replace("starfed.server.app.RunFailed", "KeyError")
    assert "".join(flower_runs.without_expected_failure(bug.splitlines(True))) == bug


def test_a_streamed_log_written_to_a_file_has_no_colour_codes(tmp_path: Path) -> None:
    """Flower colours its levels; redirected output kept the codes (issue 47)."""
    coloured = "\x1b[92mINFO \x1b[0m:      step 1: 4 classes\n"
    popen = subprocess.Popen(["printf", "%s", coloured], stdout=subprocess.PIPE)
    with (tmp_path / "out.txt").open("w") as sink:
        stream = flower_runs.LogStream(popen, sink)
        stream.wait(10)
    assert (tmp_path / "out.txt").read_text() == "INFO :      step 1: 4 classes\n"


#: The start of a real run's stream, Flower 1.42 (`starfed server run` with no site online).
RUN_START = """\
Using SuperLink: starfed (127.0.0.1:43903)
\x1b[92mINFO \x1b[0m:      Start `flwr-serverapp` process
Successfully installed starfed to /srv/flwr-home/apps/starfed.starfed.0.1.0.4ba81cc9.
starfed server: federation 08e992ba in /srv/federation · 0 steps so far
\x1b[92mINFO \x1b[0m:
\x1b[93mWARNING \x1b[0m:   a warning of Flower's
0 sites connected, 1 needed (waited 3s)
"""


def test_flowers_chatter_goes_to_the_kept_log_only(tmp_path: Path) -> None:
    """`server run`'s terminal showed Flower's INFO lines where docs/deployment.md shows none
    (issue 47): they go to the run's log file, with everything else; warnings stay in view."""
    popen = subprocess.Popen(["printf", "%s", RUN_START], stdout=subprocess.PIPE)
    kept = tmp_path / "logs" / "run-42.log"
    with (tmp_path / "out.txt").open("w") as sink:
        flower_runs.LogStream(popen, sink, kept).wait(10)
    assert (tmp_path / "out.txt").read_text() == (
        "starfed server: federation 08e992ba in /srv/federation · 0 steps so far\n"
        "WARNING :   a warning of Flower's\n"
        "0 sites connected, 1 needed (waited 3s)\n"
    )
    assert kept.read_text() == re.sub(r"\x1b\[[0-9;]*m", "", RUN_START)
