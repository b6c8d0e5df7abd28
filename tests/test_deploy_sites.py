"""Server-side deployment logic without processes: the safe SuperLink command, the site
registry, refusals read from the SuperLink's log, Flower's JSON answers, the run record."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from starfed.ops import pki, processes
from starfed.ops.flower_runs import CONNECTION
from starfed.ops.processes import ManagedProcess, ProcessId
from starfed.server.ops import sites, superlink
from starfed.server.ops.layout import ServerFolder
from starfed.shared.privacy.unit import PrivacyUnit

# Real SuperLink log lines (Flower 1.41, the same in 1.42, --log-file), keys shortened where they
# do not matter.
REGISTERED_ELSEWHERE = (
    "ERROR flwr 2026-11-23 02:57:33,323 | http.py:76 | [/v1/control/register-node]"
    "[ApiError:23] Public key already in use while registering node for flwr_aid=<id:none>.\n"
)


def _refusal_line(code: str, when: str, pem: str | None) -> str:
    path = "/v1/fleet/activate-node" if code == "2004" else "/v1/fleet/register-node"
    key = repr(pem.encode()) if pem else "b''"
    return (
        f"ERROR flwr {when},473 | http.py:76 | [{path}][ApiError:{code}] Attempted to register "
        f"SuperNode with public key: {key}, exception: No SuperNode found with the given "
        "public key.\n"
    )


def _pem(key: pki.SiteKey) -> str:
    from cryptography.hazmat.primitives import serialization

    public = serialization.load_ssh_public_key(key.openssh.encode())
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


@pytest.fixture
def folder(tmp_path: Path) -> ServerFolder:
    return ServerFolder.at(tmp_path / "server")


def test_superlink_command_is_the_safe_layout(folder: ServerFolder) -> None:
    options = superlink.ServerOptions("0.0.0.0", 9092, 9093)
    command = superlink.superlink_command(folder, options)

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--host") == "127.0.0.1" and value("--port") == "9093"
    assert value("--database") == str(folder.database)
    assert value("--log-file") == str(folder.superlink_log)
    assert value("--isolation") == "process"
    assert value("--superexec-auth-secret-file") == str(folder.superexec_secret)
    for flag in ("--enable-supernode-auth", "--disable-runtime-dependency-installation"):
        assert flag in command
    assert "--insecure" not in command
    assert "--ssl-certfile" in command and "--ssl-ca-certfile" in command

    superexec = superlink.superexec_command(folder, options, 1234)
    assert "--superexec-auth-secret-file" in superexec and "--insecure" not in superexec
    assert superexec[superexec.index("--parent-pid") + 1] == "1234"
    gateway = superlink.gateway_command(folder, options, 1234)
    assert gateway[gateway.index("--listen") + 1] == "0.0.0.0:9092"
    assert gateway[gateway.index("--upstream") + 1] == "https://127.0.0.1:9093"

    insecure = superlink.ServerOptions("127.0.0.1", 9092, 9093, insecure=True)
    command = superlink.superlink_command(folder, insecure)
    assert "--insecure" in command and "--enable-supernode-auth" not in command
    assert command[command.index("--host") + 1] == "127.0.0.1"


def test_flower_config_points_at_the_internal_port_only(folder: ServerFolder) -> None:
    superlink.write_flower_config(folder, superlink.ServerOptions("0.0.0.0", 9092, 9555))
    config = tomllib.loads(folder.flwr_config.read_text())
    assert config["superlink"]["default"] == CONNECTION
    assert config["superlink"][CONNECTION] == {
        "address": "127.0.0.1:9555",
        "root-certificates": str(folder.ca_cert),
    }
    assert Path(config["superlink"][CONNECTION]["root-certificates"]).is_absolute()


def test_superexec_secret_is_private_random_and_made_once(folder: ServerFolder) -> None:
    path = superlink.ensure_superexec_secret(folder)
    secret = path.read_bytes()
    assert len(secret) == 64 and path.stat().st_mode & 0o777 == 0o600
    assert superlink.ensure_superexec_secret(folder).read_bytes() == secret


def test_run_record_round_trips_and_sees_dead_processes(folder: ServerFolder) -> None:
    folder.create()
    me = ProcessId.of(__import__("os").getpid())
    assert me is not None
    record = superlink.RunRecord.begin(
        public_address="127.0.0.1:1",
        internal_address="127.0.0.1:2",
        insecure=False,
        isolation="process",
        processes=[
            ManagedProcess("superlink", me.pid, me.started, ["x"], "out"),
            ManagedProcess("gateway", me.pid, me.started + 1, ["y"], "out"),
        ],
    )
    record.save(folder.run_file)
    loaded = superlink.RunRecord.load(folder.run_file)
    assert loaded == record and loaded.boot_id == processes.boot_id()
    assert loaded.alive() == {"superlink": True, "gateway": False}  # reused PID: not ours
    assert loaded.superlink_alive() and loaded.running() == loaded.processes[:1]
    assert loaded.pids() == f"superlink {me.pid}, gateway {me.pid}"
    loaded.boot_id = "another boot"
    assert loaded.alive() == {"superlink": False, "gateway": False}
    folder.run_file.write_text("{not json")
    with pytest.raises(processes.ProcessError, match="damaged"):
        superlink.RunRecord.load(folder.run_file)


def test_refusals_are_grouped_by_key_and_named_when_known(
    folder: ServerFolder, tmp_path: Path
) -> None:
    known = pki.write_site_key(tmp_path / "known.key", "k")
    stranger = pki.write_site_key(tmp_path / "stranger.key", "s")
    folder.logs.mkdir(parents=True)
    folder.superlink_log.write_text(
        REGISTERED_ELSEWHERE
        + _refusal_line("2004", "2026-11-23 02:59:05", _pem(stranger))
        + "INFO flwr 2026-11-23 02:59:06,000 | x.py:1 | unrelated line\n"
        + _refusal_line("2004", "2026-11-23 03:10:00", _pem(stranger))
        + _refusal_line("2001", "2026-11-23 03:11:00", _pem(known))
        + _refusal_line("2004", "2026-11-23 03:12:00", None)
    )
    sites.Registry(
        [sites.SiteRecord("hospital-a", 7, known.openssh, known.fingerprint, "t", "t2")]
    ).save(folder.sites_file)

    refusals = sites.refused(folder)

    assert [(r.fingerprint, r.code, r.count) for r in refusals] == [
        (stranger.fingerprint, "2004", 2),
        (known.fingerprint, "2001", 1),
        (None, "2004", 1),
    ]
    assert refusals[0].first == "2026-11-23 02:59:05" and refusals[0].last == "2026-11-23 03:10:00"
    assert refusals[0].site is None
    assert refusals[1].site == "hospital-a" and refusals[1].removed


def test_add_refuses_a_removed_key_without_asking_flower(
    folder: ServerFolder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = pki.write_site_key(tmp_path / "a.key", "a")
    calls: list[tuple[str, ...]] = []

    def fake_flwr(folder: ServerFolder, *args: str) -> dict:
        calls.append(args)
        return {"success": True, "node-id": 42}

    monkeypatch.setattr(sites, "flwr_json", fake_flwr)
    record = sites.add(folder, "a", tmp_path / "a.pub")
    assert (record.node_id, record.fingerprint) == (42, key.fingerprint)
    assert calls == [("supernode", "register", str(tmp_path / "a.pub"), "--name", "a")]
    with pytest.raises(sites.SitesError, match="is registered"):
        sites.add(folder, "a", tmp_path / "a.pub")
    with pytest.raises(sites.SitesError, match="already belongs to site a"):
        sites.add(folder, "b", tmp_path / "a.pub")
    sites.remove(folder, "a")
    assert calls[-1] == ("supernode", "unregister", "42")
    with pytest.raises(sites.SitesError, match="never accepts a removed key"):
        sites.add(folder, "a", tmp_path / "a.pub")
    assert len(calls) == 2
    saved = json.loads(folder.sites_file.read_text())["sites"]
    assert saved[0]["removed_at"] and saved[0]["node_id"] == 42


def test_flower_errors_become_one_line(folder: ServerFolder) -> None:
    message = "Using SuperLink: starfed (127.0.0.1:9093)\n\n[code: 23] Public key already in use."
    assert sites._flower_message(message).startswith("[code: 23] Public key already in use.")
    with pytest.raises(sites.SitesError, match="starfed server start"):
        sites.flwr_json(folder, "supernode", "list")  # no config: never a default SuperLink


def test_sites_are_told_names_in_the_certificate_never_a_bind_address(
    folder: ServerFolder,
) -> None:
    from starfed.server.ops import certs

    def names(listen: str) -> list[str]:
        host, port = listen.rsplit(":", 1)
        return list(superlink.public_names(folder, superlink.ServerOptions(host, int(port))))

    certs.ensure_certificates(folder, [], [])
    assert names("0.0.0.0:9092") == ["127.0.0.1:9092", "localhost:9092"]
    certs.ensure_certificates(folder, ["hospital.example"], [], renew_server=True)
    assert names("0.0.0.0:9092") == ["hospital.example:9092"]
    assert names("127.0.0.1:9092") == ["127.0.0.1:9092", "localhost:9092"]  # loopback only
    insecure = superlink.ServerOptions("0.0.0.0", 9092, insecure=True)
    assert superlink.public_names(folder, insecure) == ["127.0.0.1:9092"]


def test_a_site_that_cannot_reach_its_server_says_where_and_gives_up() -> None:
    from starfed.client.ops.dialling import Dialling

    retry = "WARNING :      Connection attempt failed, retrying in 2.51 seconds\n"
    dial = Dialling("hospital.example:9093", give_up_s=300)
    assert "cannot reach the server at hospital.example:9093" in dial.see(retry, 10.0)
    assert dial.see(retry, 40.0) is None  # one line a minute, not one per attempt
    assert "still cannot reach the server at hospital.example:9093 after 60 s" in dial.see(
        retry, 70.0
    )
    assert dial.gave_up(309.0) is None
    assert "gave up: could not reach the server at hospital.example:9093 in 300 s" in (
        dial.gave_up(310.0) or ""
    )
    # reached once: it waits for the server for as long as it takes
    back = "INFO :      Connection successful after 330.00 seconds and 40 tries.\n"
    assert "reached the server at hospital.example:9093 after 330 s" in dial.see(back, 340.0)
    dial.see(retry, 400.0)
    assert dial.gave_up(10_000.0) is None
    assert Dialling("x:1", give_up_s=0).gave_up(1e9) is None


def test_the_site_terminal_gets_starfed_words_and_the_log_everything() -> None:
    """Flower's lines (rounds counted from 0, its REST server's address, its push failures
    while stopping) stay in the log; the terminal gets starfed's lines (issue 47)."""
    import io
    import logging

    from starfed.client.ops.dialling import Dialling
    from starfed.client.ops.site_processes import told
    from starfed.client.ops.supernode_log import pump
    from starfed.client.worker import LOG_FORMAT

    flower = [
        "INFO :      Uvicorn running on http://127.0.0.1:40321 (Press CTRL+C to quit)\n",
        "INFO :      SuperNode ID: 4242\n",
        "INFO :      [RUN 77, ROUND 5/stage1/0]\n",
        "ERROR :     Failed to push task output: [Errno 111] Connection refused\n",
    ]
    log, echo = io.StringIO(), io.StringIO()
    dial = Dialling("fed.example:9092", site="farm-a")
    pump(io.BytesIO("".join(flower).encode()), log, echo, lambda line: dial.see(line, 0.0))
    assert echo.getvalue() == (
        "starfed: joined the server at fed.example:9092 as farm-a (node 4242); waiting for a step\n"
    )
    assert all(line in log.getvalue() for line in flower)

    def worker_line(name: str, level: int, message: str) -> str:
        record = logging.LogRecord(name, level, "x.py", 1, message, None, None)
        record.created = 1_795_000_000.0  # 2026-11-18, whatever the zone: the time is kept
        return logging.Formatter(LOG_FORMAT).format(record) + "\n"

    step = worker_line("starfed.client.site", logging.INFO, "step 2 · stage1/0: trained A")
    assert told(step).endswith(" step 2 · stage1/0: trained A")
    assert len(told(step).split()[0]) == 8  # HH:MM:SS
    warning = worker_line(
        "py.warnings", logging.WARNING, "/x/images.py:177: RuntimeWarning: skipped 1 unreadable"
    )
    assert told(warning).endswith(" warning: skipped 1 unreadable")
    assert told(worker_line("starfed.client.worker", logging.INFO, "listening on s")) is None
    assert told("Traceback (most recent call last):\n") is None


def test_a_sites_declared_privacy_is_kept_in_its_registration(
    folder: ServerFolder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sites add --privacy-epsilon`` is recorded with the key (issue 43: a site's privacy is
    its registration's, never its replies' word), read back typed; a record written before
    has none; a damaged one is one line."""
    pki.write_site_key(tmp_path / "a.key", "a")
    pki.write_site_key(tmp_path / "b.key", "b")
    nodes = iter((7, 8))
    monkeypatch.setattr(sites, "flwr_json", lambda *_: {"success": True, "node-id": next(nodes)})
    declared = sites.DeclaredPrivacy(4.0, PrivacyUnit.PATIENT)
    sites.add(folder, "a", tmp_path / "a.pub", privacy=declared)
    sites.add(folder, "b", tmp_path / "b.pub")
    saved = json.loads(folder.sites_file.read_text())["sites"]
    assert saved[0]["privacy"] == {"epsilon": 4.0, "unit": "patient"}
    assert saved[1]["privacy"] is None
    registry = sites.Registry.load(folder.sites_file)
    assert [r.privacy for r in registry.sites] == [declared, None]
    del saved[1]["privacy"]  # as written before issue 43
    saved[0]["privacy"]["epsilon"] = -1
    folder.sites_file.write_text(json.dumps({"sites": saved}))
    with pytest.raises(sites.SitesError, match="is damaged: privacy epsilon -1"):
        sites.Registry.load(folder.sites_file)
    saved[0]["privacy"]["epsilon"] = 4
    folder.sites_file.write_text(json.dumps({"sites": saved}))
    assert [r.privacy for r in sites.Registry.load(folder.sites_file).sites] == [declared, None]
