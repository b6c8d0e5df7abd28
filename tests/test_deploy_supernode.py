"""Site-side logic without a SuperLink: inputs checked once, the node config Flower reads,
the SuperNode command, the failure lines, and the process helpers behind ``site start``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from starfed.client.ops import site_options, supernode, supernode_log
from starfed.ops import pki, processes
from starfed.ops.processes import ManagedProcess, ProcessId, ProcessRecord
from starfed.shared import addresses
from starfed.shared.config import parse

# Lines Flower 1.41's SuperNode printed (the same in 1.42) in the situations each failure names.
WRONG_CA = (
    "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer "
    "certificate (_ssl.c:1006)"
)
WRONG_NAME = (
    "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: Hostname mismatch, "
    "certificate is not valid for 'other.example.org'. (_ssl.c:1006)"
)
NOT_REGISTERED = "[code: 2004] Failed to activate SuperNode."
SELF_REGISTER = (
    "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered via "
    "the CLI."
)


@pytest.fixture
def site(tmp_path: Path) -> dict:
    data = tmp_path / "my data"  # spaces on purpose
    data.mkdir()
    key = tmp_path / "site.key"
    pki.write_site_key(key, "t")
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    return {"data": data, "key": key, "ca": ca, "state": tmp_path / "st ate"}


def _prepare(site: dict, data: Path | None = None, **overrides) -> site_options.SiteOptions:
    kwargs = {"ca": site["ca"], "key": site["key"], "state": site["state"], **overrides}
    return site_options.prepare("fed.example.org:9092", data or site["data"], **kwargs)


def test_inputs_are_checked_before_anything_starts(site: dict, tmp_path: Path) -> None:
    with pytest.raises(site_options.SiteError, match="must not join"):
        site_options.prepare("h:1", tmp_path / "missing", ca=site["ca"], key=site["key"])
    with pytest.raises(ValueError, match="HOST:PORT"):
        site_options.prepare("no-port", site["data"], ca=site["ca"], key=site["key"])
    with pytest.raises(site_options.SiteError, match="--ca and --key"):
        site_options.prepare("h:1", site["data"], ca=None, key=site["key"])
    with pytest.raises(site_options.SiteError, match="inside --data"):
        _prepare(site, state=site["data"] / "state")
    with pytest.raises(site_options.SiteError, match="one word"):
        _prepare(site, device="cuda 0")
    site["key"].chmod(0o640)
    with pytest.raises(pki.SiteKeyError, match="readable by others"):
        _prepare(site)


def test_node_config_file_survives_spaces_quotes_and_unicode(site: dict, tmp_path: Path) -> None:
    from flwr.common.config import parse_config_args

    weird = tmp_path / 'da"ta \\ é 🌱'
    weird.mkdir()
    options = _prepare(site, data=weird, name="hospital-a", device="cuda:1")
    path = tmp_path / "node-config.toml"
    site_options.write_node_config(path, options)
    parsed = parse_config_args([str(path)])  # exactly what flower-supernode does
    assert parsed == {
        "data-dir": str(weird),
        "state-dir": str(site["state"].resolve()),
        "site-name": "hospital-a",
        "device": "cuda:1",
        "worker-socket": str(site["state"].resolve() / "worker.sock"),
    }
    # every key is one the ClientApp knows (shared/config.py)
    assert parse(parsed, "node-config")["device"] == "cuda:1"


def test_default_state_folder_and_name(
    site: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    options = site_options.prepare("h:1", site["data"], ca=site["ca"], key=site["key"], name="a")
    assert options.state == tmp_path / "xdg" / "starfed" / "sites" / "a"
    options = site_options.prepare("h:1", site["data"], ca=site["ca"], key=site["key"])
    assert options.name == "my-data"  # from the data folder's name "my data"
    with pytest.raises(pki.SiteKeyError, match="bad site name"):
        site_options.prepare("h:1", site["data"], ca=site["ca"], key=site["key"], name="a b")


def test_supernode_command(site: dict) -> None:
    options = _prepare(site, name="a")
    command = site_options.supernode_command(options, Path("/s/node-config.toml"), 40123)
    assert command[command.index("--superlink") + 1] == "fed.example.org:9092"
    assert command[command.index("--node-config") + 1] == "/s/node-config.toml"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--port") + 1] == "40123"
    assert command[command.index("--root-certificates") + 1] == str(site["ca"])
    assert command[command.index("--auth-supernode-private-key") + 1] == str(site["key"])
    assert command[command.index("--isolation") + 1] == "process"  # tasks go to our SuperExec
    secret = command[command.index("--superexec-auth-secret-file") + 1]
    assert secret == str(options.superexec_secret)
    assert "--insecure" not in command
    assert options.fingerprint == pki.read_private_key(site["key"]).fingerprint


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (WRONG_CA, "not signed by"),
        (WRONG_NAME, "is not a name in the server's certificate"),
        (NOT_REGISTERED, "is not registered"),
        (SELF_REGISTER, "did not authenticate"),
    ],
)
def test_failure_lines_get_one_clear_sentence(site: dict, line: str, expected: str) -> None:
    options = _prepare(site, name="a")
    matches = [f.explain(options) for f in supernode_log.FAILURES if f.pattern.search(line)]
    assert matches and expected in matches[0]
    assert all(not f.pattern.search("INFO: SuperNode ID: 123") for f in supernode_log.FAILURES)


def test_exit_code_is_zero_only_when_stopped_as_told() -> None:
    assert supernode.SiteRun(returncode=0, stopped_by="SIGINT").exit_code == 0
    assert supernode.SiteRun(returncode=0).exit_code == 1  # ended by itself
    assert supernode.SiteRun(returncode=0, stopped_by="SIGTERM", failure="x").exit_code == 1
    survivor = {ProcessId(1, 1)}
    assert supernode.SiteRun(stopped_by="SIGTERM", survivors=survivor).exit_code == 1


def test_terminate_ends_a_tree_and_never_a_reused_pid() -> None:
    # a parent that ignores SIGTERM, with a child: both must go (SIGKILL after the grace)
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('ready', flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        root = ProcessId.of(parent.pid)
        assert root is not None
        tree = processes.descendants([root])
        assert len(tree) == 2
        stale = ProcessId(root.pid, root.started - 1)  # same PID, other start: not ours
        assert not stale.alive()
        processes.send_signal([stale], signal.SIGKILL)
        assert root.alive()
        started = time.monotonic()
        assert processes.terminate([root], grace=0.5) == set()
        assert time.monotonic() - started < 10
        assert not any(p.alive() for p in tree)
    finally:
        parent.kill()
        parent.wait()


def test_addresses() -> None:
    assert addresses.parse_address("fed.example.org:9092") == ("fed.example.org", 9092)
    assert addresses.parse_address("[::1]:9092") == ("::1", 9092)
    assert addresses.format_address("::1", 9092) == "[::1]:9092"
    for bad in ("9092", "host:", "host:0", "host:70000", "::1:9092", ":9092"):
        with pytest.raises(ValueError):
            addresses.parse_address(bad)


def test_site_start_records_its_processes_while_they_run(
    site: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real ``site start`` against an address where nothing listens: the SuperNode keeps
    trying, its processes run, and we stop it as Ctrl-C would once they are recorded."""
    monkeypatch.setenv("FLWR_HOME", str(site["state"] / "unused-home"))  # never the user's
    options = site_options.prepare(
        f"127.0.0.1:{processes.free_port()}",
        site["data"],
        ca=None,
        key=None,
        state=site["state"],
        name="a",
        device="cpu",
        insecure=True,
        worker=False,
    )
    me = ProcessId.of(os.getpid())
    assert me is not None
    site["state"].mkdir()
    stale = ManagedProcess("supernode", me.pid, me.started - 1, [], "")  # ended long ago
    ProcessRecord.begin(processes=[stale]).save(options.run_file)
    seen: list[ProcessRecord] = []

    def started(record: ProcessRecord) -> None:
        seen.append(record)
        assert ProcessRecord.load(options.run_file) == record
        assert all(record.alive().values())
        os.kill(os.getpid(), signal.SIGTERM)  # as the service manager would

    outcome = supernode.run(options, echo=None, on_started=started)
    [record] = seen
    assert [p.name for p in record.processes] == ["supernode", "superexec"]
    assert "flower-supernode" in record.processes[0].command[0]
    assert record.pids() == ", ".join(f"{p.name} {p.pid}" for p in record.processes)
    assert outcome.stopped_by == "SIGTERM" and outcome.exit_code == 0
    assert not any(p.id.alive() for p in record.processes)
    assert not options.run_file.exists()  # all ended: nothing left to find


def test_a_worker_that_dies_stops_site_start(site: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message needs the worker: once it is gone (here killed, as the OOM killer would),
    ``site start`` stops with one line saying so rather than failing every message."""
    monkeypatch.setenv("FLWR_HOME", str(site["state"] / "unused-home"))  # never the user's
    options = site_options.prepare(
        f"127.0.0.1:{processes.free_port()}",
        site["data"],
        ca=None,
        key=None,
        state=site["state"],
        name="a",
        device="cpu",
        insecure=True,
    )

    def started(record: ProcessRecord) -> None:
        [worker] = [p for p in record.processes if p.name == "worker"]
        os.kill(worker.pid, signal.SIGKILL)

    outcome = supernode.run(options, echo=None, on_started=started)
    assert outcome.failure is not None and outcome.exit_code == 1
    assert outcome.failure.startswith("the site worker ended (exit code -9)"), outcome.failure
    assert outcome.stopped_by is None and not outcome.survivors
    assert not options.run_file.exists()


def test_site_start_refuses_while_a_recorded_process_still_runs(site: dict) -> None:
    options = _prepare(site, name="a")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        left = ManagedProcess.of("supernode", sleeper, sleeper.args, Path("log"))
        assert left is not None
        options.state.mkdir()
        ProcessRecord.begin(processes=[left]).save(options.run_file)
        with pytest.raises(
            site_options.SiteError,
            match=f"earlier `site start` \\(supernode {left.pid}\\): end them first "
            f"\\(`kill {left.pid}`\\)",
        ):
            supernode.run(options, echo=None)
        assert options.run_file.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


#: Put on PYTHONPATH, it makes one module unimportable in every process of the site, as a
#: wheel that left ``starfed.shared.privacy`` out did (issue 31): only the worker imports it.
BLOCK_MODULE = """
import sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name == "starfed.shared.privacy":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
"""


@pytest.mark.e2e
def test_a_worker_that_cannot_start_stops_site_start_with_its_error(
    site: dict, tmp_path: Path
) -> None:
    """A real ``site start`` (nothing listens at its server address) whose worker cannot
    import the site code: it stops with the import's error on stderr and exit 1, instead of
    a SuperNode whose every message fails; nothing it started is left."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK_MODULE)
    env = {**os.environ, "PYTHONPATH": str(blocker), "FLWR_HOME": str(tmp_path / "flwr-home")}
    server = f"127.0.0.1:{processes.free_port()}"
    command = [
        sys.executable,
        "-m",
        "starfed.cli",
        "site",
        "start",
        "--server",
        server,
        "--insecure",
        "--data",
        str(site["data"]),
        "--state",
        str(site["state"]),
        "--name",
        "a",
        "--device",
        "cpu",
        "--quiet",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        _, stderr = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        process.terminate()  # as Ctrl-C would: site start stops what it started
        _, stderr = process.communicate(timeout=60)
        pytest.fail(f"site start did not stop by itself:\n{stderr[-2000:]}")
    assert process.returncode == 1, stderr
    [error] = [line for line in stderr.splitlines() if "error:" in line]
    assert error.startswith("starfed site start: error: the site worker cannot start: ")
    assert "ModuleNotFoundError: No module named 'starfed.shared.privacy'" in error
    log = site["state"] / "logs" / "supernode.log"
    assert str(log) in error and "Traceback" in log.read_text()
    assert not (site["state"] / "run.json").exists()  # every process it started has ended
