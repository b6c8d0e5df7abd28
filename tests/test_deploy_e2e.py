"""End to end on 127.0.0.1: ``starfed server`` and ``starfed site`` with real Flower processes.

One deployment for the module (``certs`` -> ``start``), then, in order: the safe layout (the
SuperLink on 127.0.0.1 only, the gateway refusing the Control API, ``flwr ls`` working only on
the internal port), two registered sites connecting and going offline on SIGTERM, an
unregistered key refused and visible in ``sites refused``, a wrong CA failing with one clear
line, and ``server stop`` leaving nothing. No ServerApp runs: the nodes' status comes from the
SuperLink.

Every process started here carries ``STARFED_DEPLOY_TEST=<this module's folder>`` in its
environment (Flower's children inherit it), so the last test and the fixture's finalizer find
any process left behind by scanning ``/proc``, and the finalizer ends it by PID.

``server`` actions run in-process (their processes are daemons anyway); ``site start`` runs as
a subprocess through a small runner that loads only the ``server``/``site`` CLI modules (the
full ``starfed`` entry point imports torch for the other subcommands). About a minute on 2 cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fake_flwr
import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from process_sampler import marked

from starfed.ops import pki, processes
from starfed.ops.processes import ProcessId, ProcessRecord
from starfed.server.ops import certs
from starfed.server.ops.layout import ServerFolder
from starfed.shared import addresses

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]

MARKER = "STARFED_DEPLOY_TEST"
CONNECT_TIMEOUT_S = 120.0
#: ``starfed`` with only the deployment subcommands (see the module docstring).
RUNNER = (
    "import argparse, sys\n"
    "from starfed.cli import server, site\n"
    "parser = argparse.ArgumentParser(prog='starfed')\n"
    "sub = parser.add_subparsers(dest='command')\n"
    "server.add_parser(sub); site.add_parser(sub)\n"
    "args = parser.parse_args()\n"
    "sys.exit(args.func(args))\n"
)


def starfed(*argv: str) -> tuple[int, str]:
    """Run a ``starfed server``/``site`` command in this process; (exit code, stdout)."""
    import argparse

    from starfed.cli import server, site

    parser = argparse.ArgumentParser(prog="starfed")
    sub = parser.add_subparsers(dest="command")
    server.add_parser(sub)
    site.add_parser(sub)
    args = parser.parse_args(list(argv))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.func(args)
    return code, out.getvalue()


def marked_processes(root: Path, home_under: Path | None = None) -> dict[ProcessId, str]:
    """Live processes with this module's marker (and, if given, a FLWR_HOME below
    ``home_under``)."""
    return marked(f"{MARKER}={root}", f"FLWR_HOME={home_under}/" if home_under else None)


@dataclass
class Deployment:
    root: Path
    folder: ServerFolder
    public: str
    internal_port: int
    started: dict  # what `server start --json` printed

    def site(self, name: str, key: Path, ca: Path | None = None, *extra: str) -> SiteProcess:
        data = self.root / "data" / name
        data.mkdir(parents=True, exist_ok=True)
        log = self.root / f"site-{name}-{time.monotonic_ns()}.log"
        command = [
            *("site", "start", "--server", self.public, "--data", str(data)),
            *("--ca", str(ca or self.folder.ca_cert), "--key", str(key), "--name", name),
            *("--state", str(self.root / "state" / name), "--device", "cpu"),
            *extra,
        ]
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-c", RUNNER, *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return SiteProcess(name, popen, log)


@dataclass
class SiteProcess:
    name: str
    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"site {self.name}: no {text!r}:\n{self.output()}")
            time.sleep(0.3)

    def finish(self, timeout: float = CONNECT_TIMEOUT_S) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            pytest.fail(f"site {self.name} did not end:\n{self.output()}")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("deploy")
    folder = ServerFolder.at(root / "server")
    public_port, internal_port = processes.free_port(), processes.free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(MARKER, str(root))
        env.setenv("XDG_DATA_HOME", str(root / "xdg"))
        try:
            code, out = starfed(
                *("server", "certs", "--dir", str(folder.root)),
                *("--site", "site-a", "--site", "site-b", "--site", "stranger"),
            )
            assert code == 0, out
            code, out = starfed(
                *("server", "start", "--dir", str(folder.root), "--json"),
                *("--listen", f"127.0.0.1:{public_port}", "--internal-port", str(internal_port)),
            )
            assert code == 0, out
            yield Deployment(
                root, folder, f"127.0.0.1:{public_port}", internal_port, json.loads(out)
            )
        finally:
            starfed("server", "stop", "--dir", str(folder.root))
            # never leak into the rest of the session
            processes.send_signal(marked_processes(root), signal.SIGKILL)


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def _flwr_ls(home: Path, connection: str | None = None) -> dict:
    command = [processes.flower_executable("flwr"), "ls"]
    command += [connection] if connection else []
    result = subprocess.run(
        [*command, "--format", "json"],
        env=processes.flower_env(home),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_server_runs_in_the_safe_layout(deployment: Deployment) -> None:
    record = json.loads(deployment.folder.run_file.read_text())
    assert [p["name"] for p in record["processes"]] == ["superlink", "superexec", "gateway"]
    assert all(processes.ProcessId.from_json(p).alive() for p in record["processes"])
    assert _listeners(deployment.internal_port) == {"0100007F"}  # 127.0.0.1 only
    assert (deployment.folder.superexec_secret.stat().st_mode & 0o777) == 0o600
    superlink = " ".join(record["processes"][0]["command"])
    for flag in ("--enable-supernode-auth", "--database", "--isolation process", "--log-file"):
        assert flag in superlink
    # sites are told names they can dial (the certificate's), and start-up probes log nothing
    port = addresses.parse_address(deployment.public)[1]
    assert deployment.started["sites_connect_to"] == [f"127.0.0.1:{port}", f"localhost:{port}"]
    assert "refused" not in deployment.folder.gateway_log.read_text()


def test_control_api_answers_only_on_the_internal_port(deployment: Deployment) -> None:
    ca = ssl.create_default_context(cafile=str(deployment.folder.ca_cert))
    public = f"https://{deployment.public}"
    protobuf = {"content-type": "application/protobuf"}  # an empty message: a valid request
    with httpx.Client(verify=ca, trust_env=False, timeout=10, headers=protobuf) as client:
        for path in (
            "/v1/control/list-runs",
            "/v1/control/register-node",
            "/v1/runtime/acquire-task",
        ):
            assert client.post(public + path, content=b"").status_code == 403, path
        for path in ("/docs", "/openapi.json", "/health"):
            assert client.get(public + path).status_code == 403, path
        internal = f"https://127.0.0.1:{deployment.internal_port}"
        assert client.post(internal + "/v1/control/list-runs", content=b"").status_code == 200

    # garbage on the public port: an error for that client, the gateway stays up
    with contextlib.suppress(OSError):
        raw = ssl.create_default_context(cafile=str(deployment.folder.ca_cert))
        host, port = addresses.parse_address(deployment.public)
        with raw.wrap_socket(
            __import__("socket").create_connection((host, port), timeout=10),
            server_hostname="127.0.0.1",
        ) as sock:
            sock.sendall(b"\x00\xff NOT HTTP \r\n\r\n" * 50)
            sock.recv(1024)
    with httpx.Client(verify=ca, trust_env=False, timeout=10) as client:
        assert client.get(public + "/").status_code == 403  # still there

    # the operator's flwr works on the internal port; pointed at the public one it is refused
    assert _flwr_ls(deployment.folder.flwr_home) == {"success": True, "runs": []}
    other_home = deployment.root / "flwr-public"
    other_home.mkdir()
    (other_home / "config.toml").write_text(
        '[superlink]\ndefault = "public"\n\n[superlink.public]\n'
        f'address = "{deployment.public}"\n'
        f'root-certificates = "{deployment.folder.ca_cert}"\n'
    )
    answer = _flwr_ls(other_home, "public")
    assert answer["success"] is False, answer
    gateway_log = deployment.folder.gateway_log.read_text()
    assert "refused POST /v1/control/list-runs" in gateway_log


def test_registered_sites_connect_then_go_offline_on_sigterm(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = deployment.folder
    node_ids = {}
    for name in ("site-a", "site-b"):
        code, out = starfed(
            "server",
            "sites",
            "add",
            name,
            str(pki.public_key_path(folder.site_key(name))),
            "--dir",
            str(folder.root),
            "--json",
        )
        assert code == 0, out
        node_ids[name] = json.loads(out)["node_id"]

    running = [deployment.site(name, folder.site_key(name)) for name in node_ids]
    for site in running:
        site.wait_for(
            f"joined the server at {deployment.public} as {site.name} (node {node_ids[site.name]})"
        )
        assert (
            folder.site_key(site.name)
            and pki.read_private_key(folder.site_key(site.name)).fingerprint in site.output()
        )
    code, out = starfed("server", "sites", "list", "--dir", str(folder.root), "--json")
    rows = {r["name"]: r for r in json.loads(out)["sites"]}
    assert {name: rows[name]["status"] for name in node_ids} == {
        "site-a": "online",
        "site-b": "online",
    }, out
    assert rows["site-a"]["node_id"] == node_ids["site-a"]
    with monkeypatch.context() as here:  # a folder holding a `starfed/` checkout: the same
        here.chdir(fake_flwr.checkout(deployment.root / "work"))
        assert starfed("server", "sites", "list", "--dir", str(folder.root), "--json") == (0, out)
    for site in running:  # what it started, printed and recorded in <state>/run.json
        site.wait_for("processes ")
        line = next(ln for ln in site.output().splitlines() if ln.startswith("processes "))
        record = ProcessRecord.load(deployment.root / "state" / site.name / "run.json")
        assert record is not None and line.startswith(f"processes {record.pids()} (recorded in")
        assert [p.name for p in record.processes] == ["worker", "supernode", "superexec"]
        assert all(record.alive().values())

    for site in running:
        site.popen.send_signal(signal.SIGTERM)
    for site in running:
        assert site.finish() == 0, site.output()
        # starfed's words on the site's terminal; Flower's (its REST server's address, its
        # push failures as it stops) in the log only (issue 47)
        assert "Uvicorn" not in site.output() and "ERROR" not in site.output(), site.output()
        assert "stopped (SIGTERM)" in site.output()
        assert not (deployment.root / "state" / site.name / "run.json").exists()
    code, out = starfed("server", "sites", "list", "--dir", str(folder.root), "--json")
    rows = {r["name"]: r for r in json.loads(out)["sites"]}
    assert {rows[name]["status"] for name in node_ids} == {"offline"}, out  # at once, not 60 s
    config = (deployment.root / "state" / "site-a" / "node-config.toml").read_text()
    assert 'site-name = "site-a"' in config and 'device = "cpu"' in config
    assert marked_processes(deployment.root, home_under=deployment.root / "state") == {}
    assert not any(site.popen.poll() is None for site in running)


def _flwr(deployment: Deployment, *args: str) -> str:
    result = subprocess.run(
        [processes.flower_executable("flwr"), *args],
        env=processes.flower_env(deployment.folder.flwr_home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.stdout


@pytest.mark.slow
def test_a_serverapp_reaches_a_site_through_the_gateway(deployment: Deployment) -> None:
    """A real message round trip: ServerApp (our SuperExec) -> gateway -> site -> back."""
    folder = deployment.folder
    if not any(r.get("name") == "site-a" for r in _sites(deployment)):
        starfed(
            *("server", "sites", "add", "site-a"),
            *(str(pki.public_key_path(folder.site_key("site-a"))), "--dir", str(folder.root)),
        )
    site = deployment.site("site-a", folder.site_key("site-a"))
    try:
        site.wait_for("joined the server at ")
        app = Path(__file__).parent / "deploy_app"
        answer = _flwr(deployment, "run", str(app), "starfed", "--format", "json")
        run_id = str(json.loads(answer[answer.index("{") :])["run-id"])
        deadline = time.monotonic() + 300
        status = ""
        while not status.startswith("finished") and time.monotonic() < deadline:
            time.sleep(2)
            reply = _flwr(deployment, "ls", "starfed", "--run-id", run_id, "--format", "json")
            status = json.loads(reply[reply.index("{") :])["runs"][0]["status"]
        log = _flwr(deployment, "log", run_id, "starfed", "--show")
        assert status == "finished:completed", log
        line = next(ln for ln in log.splitlines() if "DEPLOY_APP" in ln)
        config = json.loads(line.split("config=", 1)[1])
        assert config == {
            "data-dir": str(deployment.root / "data" / "site-a"),
            "state-dir": str(deployment.root / "state" / "site-a"),
            "site-name": "site-a",
            "device": "cpu",
            "worker-socket": str(deployment.root / "state" / "site-a" / "worker.sock"),
        }
    finally:
        site.popen.send_signal(signal.SIGTERM)
        assert site.finish() == 0, site.output()


def _sites(deployment: Deployment) -> list[dict]:
    _, out = starfed("server", "sites", "list", "--dir", str(deployment.folder.root), "--json")
    return json.loads(out)["sites"]


@pytest.mark.slow  # a ServerApp starts: about 50 s on 2 loaded cores
def test_a_run_with_no_site_online_names_the_offline_sites(
    deployment: Deployment, capsys: pytest.CaptureFixture
) -> None:
    folder = deployment.folder.root
    # the sites this module registered so far (site-a and site-b when the tests before ran;
    # `-m slow` deselects them, then site-a is registered here), none of them online now
    if not any(r.get("name") == "site-a" for r in _sites(deployment)):
        key = pki.public_key_path(deployment.folder.site_key("site-a"))
        starfed("server", "sites", "add", "site-a", str(key), "--dir", str(folder))
    registered = sorted(r["name"] for r in _sites(deployment))
    assert registered and all(r["status"] != "online" for r in _sites(deployment))
    settings = ("--min-sites", "1", "--wait-s", "1", "--run-config", "preset=tiny")
    code, out = starfed("server", "run", "--dir", str(folder), *settings, "--json")
    answer = json.loads(out)
    assert code == answer["exit_code"] == 1 and answer["offline_sites"] == registered
    assert "0 sites connected, 1 needed" in answer["reason"]
    assert f"registered sites offline: {', '.join(registered)}" in answer["reason"]
    log = capsys.readouterr().err  # the ServerApp's log: its reason, not Flower's traceback
    assert "0 sites connected, 1 needed" in log and "Traceback" not in log, log


def test_unregistered_key_is_refused_and_the_operator_sees_it(deployment: Deployment) -> None:
    key = deployment.folder.site_key("stranger")  # made by `certs`, never registered
    fingerprint = pki.read_private_key(key).fingerprint
    site = deployment.site("stranger", key)
    assert site.finish() == 1, site.output()
    assert f"this site's key ({fingerprint}) is not registered" in site.output()

    code, out = starfed(
        "server", "sites", "refused", "--dir", str(deployment.folder.root), "--json"
    )
    refused = json.loads(out)["refused"]
    assert code == 0 and [(r["fingerprint"], r["code"]) for r in refused] == [(fingerprint, "2004")]


def test_wrong_ca_fails_with_one_clear_line(deployment: Deployment) -> None:
    _, other_ca = certs.make_ca("not the federation's CA")
    wrong = deployment.root / "wrong-ca.pem"
    wrong.write_bytes(other_ca.public_bytes(serialization.Encoding.PEM))
    site = deployment.site("site-a", deployment.folder.site_key("site-a"), ca=wrong)
    assert site.finish() == 1, site.output()
    assert "error: TLS: the server's certificate is not signed by" in site.output()


def test_a_wrong_port_is_named_and_given_up_on(deployment: Deployment) -> None:
    wrong = f"127.0.0.1:{processes.free_port()}"  # nothing listens there
    key = deployment.folder.site_key("site-a")
    # the last --server wins (argparse): the fixture's own comes first
    command = ["--server", wrong, "--give-up-after", "2", "--no-worker"]
    site = deployment.site("site-a", key, None, *command)
    assert site.finish() == 1, site.output()
    out = site.output()
    assert f"starfed: cannot reach the server at {wrong}" in out, out
    assert f"error: gave up: could not reach the server at {wrong} in 2 s" in out, out
    log = (deployment.root / "state" / "site-a" / "logs" / "supernode.log").read_text()
    assert f"dials the server at {wrong}" in log and f"cannot reach the server at {wrong}" in log
    assert "Connection successful" not in out  # the SuperExec's local connection: log only,
    local = [line for line in log.splitlines() if "Connection successful" in line]
    assert all(line.startswith("(local SuperExec, not the server) ") for line in local)  # marked


def test_server_stop_leaves_nothing(deployment: Deployment) -> None:
    code, out = starfed("server", "stop", "--dir", str(deployment.folder.root), "--json")
    assert code == 0, out
    answer = json.loads(out)
    assert answer["stopped"] == ["gateway", "superexec", "superlink"] and not answer["survivors"]
    assert not deployment.folder.run_file.exists()
    assert marked_processes(deployment.root) == {}
    host, port = addresses.parse_address(deployment.public)
    assert processes.port_is_free(host, port)
    assert processes.port_is_free("127.0.0.1", deployment.internal_port)
