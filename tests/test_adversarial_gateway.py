"""Hostile traffic against a real gateway process (TLS, 127.0.0.1 only), bounded in count and
time: oversized and chunked bodies, slow headers, many connections from one address, a full
gateway; a real site's signed call must still go through, and what reaches the upstream (the
SuperLink's place, here a counting HTTP server) must stay small.

Attackers connect from 127.0.0.2-127.0.0.5 (Linux routes all of 127/8 to the loopback device),
so that the per-address limits apply to them and not to the site on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from base64 import b64encode
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.proto.message_pb2 import PushObjectRequest
from flwr.proto.node_pb2 import Node
from flwr.supernode.fleet_http_client import FleetHttpClient
from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

from starfed.host.process_identity import ProcessId
from starfed.ops import pki
from starfed.ops.processes import free_port
from starfed.server.ops import certs, fleet_signatures, gateway
from starfed.server.ops.layout import ServerFolder
from starfed.server.ops.sites import Registry, SiteRecord

pytestmark = [pytest.mark.adversarial, pytest.mark.e2e]

MIB = 1024 * 1024
UNSIGNED_LIMIT = 64 * 1024


class CountingUpstream:
    """The SuperLink's place: reads every body to the end and records how many bytes came."""

    def __init__(self) -> None:
        self.bodies: list[int] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        received = 0
        while True:
            message = await receive()
            received += len(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                break
        self.bodies.append(received)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"\x08\x01"})


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[ServerFolder, ec.EllipticCurvePrivateKey]]:
    """Certificates and one registered site key (sites.json as `sites add` writes it)."""
    folder = ServerFolder.at(tmp_path_factory.mktemp("server"))
    certs.ensure_certificates(folder, ["127.0.0.1"])
    key = pki.new_private_key()
    record = SiteRecord("farm-a", 1, pki.describe(key.public_key()).openssh, "fp", "t")
    Registry([record]).save(folder.sites_file)
    yield folder, key


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[CountingUpstream, int]]:
    app, port = CountingUpstream(), free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="error")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not instance.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield app, port
    instance.should_exit = True
    thread.join(10)


@pytest.fixture
def start_gateway(server, upstream, tmp_path) -> Iterator[Callable[..., tuple[int, int]]]:
    """Start a gateway process with extra flags; returns (its port, its PID)."""
    folder, _ = server
    started: list[subprocess.Popen] = []

    def start(*flags: str, files: int | None = None) -> tuple[int, int]:
        """``files``: the gateway's limit of open files (soft and hard)."""
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "starfed.server.ops.gateway",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            f"http://127.0.0.1:{upstream[1]}",
            "--cert",
            str(folder.server_cert),
            "--key",
            str(folder.server_key),
            "--site-keys",
            str(folder.sites_file),
            "--log-file",
            str(tmp_path / f"gateway-{port}.log"),
            *flags,
        ]
        limit = (
            None
            if files is None
            else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (files, files)))
        )
        process = subprocess.Popen(command, preexec_fn=limit)
        started.append(process)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return port, process.pid
            assert process.poll() is None, "the gateway ended during start-up"
            time.sleep(0.1)
        raise AssertionError("the gateway did not start")

    yield start
    for process in started:  # each by its own PID
        process.terminate()
        process.wait(15)


def _tls(folder: ServerFolder) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(folder.ca_cert))


def _signed(key: ec.EllipticCurvePrivateKey) -> dict[str, str]:
    """What Flower 1.42's SuperNode sends with every Fleet call (see test_deploy_gateway.py
    for the same headers made with Flower's own functions)."""
    timestamp = datetime.now(UTC).isoformat()
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return {
        fleet_signatures.TIMESTAMP_HEADER: timestamp,
        fleet_signatures.PUBLIC_KEY_HEADER: b64encode(pem).decode(),
        fleet_signatures.SIGNATURE_HEADER: b64encode(
            key.sign(timestamp.encode(), ec.ECDSA(hashes.SHA256()))
        ).decode(),
    }


def _site_call(folder: ServerFolder, key, port: int, body: bytes = b"\x0a\x02hi") -> float:
    """A real site's signed Fleet call from 127.0.0.1 on a fresh connection; its seconds."""
    started = time.monotonic()
    with httpx.Client(verify=_tls(folder), timeout=10) as client:
        response = client.post(
            f"https://127.0.0.1:{port}/v1/fleet/pull-messages",
            content=body,
            headers={"content-type": "application/protobuf", **_signed(key)},
        )
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def _connect(folder: ServerFolder, port: int, source: str) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return _tls(folder).wrap_socket(raw, server_hostname="127.0.0.1")


def _closed(sock: ssl.SSLSocket, within: float) -> bool:
    """Whether the gateway closes ``sock`` within ``within`` seconds (after whatever error
    response it sends first)."""
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    except (ConnectionError, ssl.SSLError):
        return True
    return False


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _chunked_flood(folder: ServerFolder, port: int, source: str, limit: int) -> tuple[int, str]:
    """An unsigned chunked protobuf body of up to ``limit`` bytes: how much of it could be sent,
    and the status line it got ("closed" if none)."""
    sock = _connect(folder, port, source)
    sock.sendall(
        b"POST /v1/fleet/push-object HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/protobuf\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n" % (256 * 1024) + b"\x0a" * (256 * 1024) + b"\r\n"
    sent = 0
    try:
        while sent < limit:
            sock.sendall(chunk)
            sent += 256 * 1024
    except (ConnectionError, ssl.SSLError, TimeoutError):
        pass  # the gateway stopped reading: what it answered is below
    sock.settimeout(10)
    try:
        return sent, sock.recv(64).split(b"\r\n")[0].decode() or "closed"
    except (ConnectionError, ssl.SSLError, TimeoutError):
        return sent, "closed"
    finally:
        sock.close()


def _declared(folder: ServerFolder, port: int, length: int, headers: dict[str, str]) -> str:
    """Headers declaring a ``length``-byte body, and no body; the status line they got."""
    with _connect(folder, port, "127.0.0.1") as sock:
        lines = [f"{k}: {v}" for k, v in {**headers, "content-length": str(length)}.items()]
        head = "POST /v1/fleet/push-object HTTP/1.1\r\nhost: x\r\n" + "\r\n".join(lines)
        sock.sendall(head.encode() + b"\r\n\r\n")
        return sock.recv(256).split(b"\r\n")[0].decode()


def test_large_unsigned_bodies_never_reach_the_superlink(server, upstream, start_gateway) -> None:
    folder, key = server
    app, _ = upstream
    port, pid = start_gateway()
    before_rss, before_bodies = _rss_mib(pid), len(app.bodies)
    # four 32 MiB chunked bodies at once, each from its own address (what filled the SuperLink)
    with ThreadPoolExecutor(4) as pool:
        sources = [f"127.0.0.{i}" for i in range(2, 6)]
        answers = list(pool.map(lambda s: _chunked_flood(folder, port, s, 32 * MIB), sources))
    assert all(a in ("HTTP/1.1 401 Unauthorized", "closed") for _, a in answers), answers
    assert "HTTP/1.1 401 Unauthorized" in [a for _, a in answers]
    assert all(sent <= 16 * MIB for sent, _ in answers), answers  # cut off, not read to the end
    forwarded = app.bodies[before_bodies:]
    assert all(n <= UNSIGNED_LIMIT for n in forwarded), forwarded
    assert _rss_mib(pid) - before_rss < 32, "the gateway buffered the bodies"
    # a declared 120 MiB: refused before a byte of it is read, signed or not
    unsigned = _declared(folder, port, 120 * MIB, {})
    signed = _declared(folder, port, 120 * MIB, _signed(key))
    assert (unsigned, signed) == (
        "HTTP/1.1 401 Unauthorized",
        "HTTP/1.1 413 Request Entity Too Large",
    )
    # and a site's real, signed body of 1 MiB goes through whole
    _site_call(folder, key, port, body=b"\x0a" * MIB)
    assert app.bodies[-1] == MIB


def test_slow_headers_are_cut_off_while_a_site_gets_in(server, start_gateway) -> None:
    folder, key = server
    port, _ = start_gateway("--header-timeout", "2", "--max-per-address", "16")
    quiet = [_site_call(folder, key, port) for _ in range(3)]
    slow: list[ssl.SSLSocket] = []
    for _ in range(60):  # a slow-loris from one address: 16 admitted, 44 closed at once
        with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
            slow.append(_connect(folder, port, "127.0.0.2"))
    started = time.monotonic()

    def trickle() -> None:  # one header line per second, as long as the gateway lets it
        for line in range(4):
            for sock in slow:
                with contextlib.suppress(OSError):
                    sock.sendall(
                        b"POST /v1/fleet/pull-messages HTTP/1.1\r\n"
                        if line == 0
                        else b"x-slow-%d: 1\r\n" % line
                    )
            time.sleep(1.0)

    trickler = threading.Thread(target=trickle)
    trickler.start()
    during = [_site_call(folder, key, port) for _ in range(5)]
    trickler.join()
    closed_at_once = sum(_closed(s, 0.01) for s in slow)
    assert len(slow) - closed_at_once <= 16
    for sock in slow:  # every one of them is gone by the header deadline (2 s) plus slack
        assert _closed(sock, max(0.1, 6 - (time.monotonic() - started)))
        sock.close()
    assert max(during) < 2.0, (quiet, during)


def test_a_full_gateway_makes_room_for_a_site(server, start_gateway) -> None:
    folder, key = server
    port, _ = start_gateway(
        "--max-connections", "48", "--max-per-address", "16", "--header-timeout", "60"
    )
    idle = [_connect(folder, port, f"127.0.0.{2 + i // 16}") for i in range(48)]
    seventeenth = _connect(folder, port, "127.0.0.2")
    assert _closed(seventeenth, 2.0)  # per address: at most 16
    assert _site_call(folder, key, port) < 2.0  # the oldest idle connection made room
    assert _closed(idle[0], 2.0)
    assert not _closed(idle[-1], 0.2)
    for sock in [*idle, seventeenth]:
        sock.close()


def test_idle_and_garbage_connections_do_not_stop_the_gateway(server, start_gateway) -> None:
    folder, key = server
    port, pid = start_gateway("--header-timeout", "1")
    garbage = _connect(folder, port, "127.0.0.2")
    garbage.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
    huge_header = _connect(folder, port, "127.0.0.3")
    with contextlib.suppress(OSError):  # the gateway may close it before all is sent
        huge_header.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nx: " + b"a" * 64 * 1024)
    silent = _connect(folder, port, "127.0.0.4")
    assert _closed(garbage, 3) and _closed(huge_header, 3) and _closed(silent, 3)
    for sock in (garbage, huge_header, silent):
        sock.close()
    assert _site_call(folder, key, port) < 2.0
    assert Path(f"/proc/{pid}").exists()


def test_a_trickled_unsigned_body_is_cut_at_the_deadline(server, start_gateway) -> None:
    """Complete headers, then 60,000 declared bytes at one a second: a request under way is
    never evicted, so its body gets the header deadline too."""
    folder, key = server
    port, _ = start_gateway("--header-timeout", "2")
    with _connect(folder, port, "127.0.0.2") as sock:
        sock.sendall(
            b"POST /v1/fleet/push-object HTTP/1.1\r\nhost: x\r\ncontent-length: 60000\r\n\r\n"
        )
        started = time.monotonic()
        answer = b""
        sock.settimeout(1.0)
        while time.monotonic() - started < 8 and not answer:
            with contextlib.suppress(OSError):
                sock.sendall(b"\x0a")
            with contextlib.suppress(TimeoutError):
                answer = sock.recv(256)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < 5
        assert _closed(sock, 2.0)
    assert _site_call(folder, key, port) < 2.0


def test_flowers_own_supernode_client_uploads_through_the_signature_check(
    server, upstream, start_gateway
) -> None:
    """What Flower 1.42's SuperNode really sends (its HTTP client and its signing interceptor):
    a registered site's 1 MiB upload reaches the SuperLink whole; another key's is refused."""
    folder, key = server
    app, _ = upstream
    port, _ = start_gateway()
    request = PushObjectRequest(
        node=Node(node_id=1), object_id="ab" * 32, object_content=b"\x00" * MIB
    )

    def push(signing_key: ec.EllipticCurvePrivateKey) -> int:
        interceptor = NodeAuthHttpInterceptor(signing_key, signing_key.public_key())
        with FleetHttpClient.from_server_address(
            f"127.0.0.1:{port}", False, str(folder.ca_cert), interceptors=[interceptor]
        ) as client:
            try:
                client.PushObject(request)
            except httpx.HTTPStatusError as err:
                return err.response.status_code
            return 200

    assert push(key) == 200
    assert app.bodies[-1] == request.ByteSize()
    assert push(pki.new_private_key()) == 401
    assert app.bodies[-1] == request.ByteSize()  # nothing more reached the upstream


def _unfinished_handshakes(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections from 127.0.0.2-127.0.0.5 that start a TLS handshake (a record
    header announcing a 512-byte ClientHello) and never finish it."""
    socks = []
    for i in range(n):
        sock = socket.create_connection(
            ("127.0.0.1", port), timeout=10, source_address=(f"127.0.0.{2 + i % 4}", 0)
        )
        sock.sendall(b"\x16\x03\x01\x02\x00")
        socks.append(sock)
    return socks


def _raw_closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(64) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_unfinished_tls_handshakes_are_bounded_per_address_in_all_and_in_time(
    server, start_gateway, tmp_path
) -> None:
    """300 connections from 4 addresses that never finish their handshake: beyond 8 per
    address they are closed at once, the rest when the 3 s handshake timeout ends; meanwhile a
    site gets in (the attackers' 32 leave room in the 64 places) and the gateway's memory stays
    flat (asyncio gave each 60 s and 256 KiB)."""
    folder, key = server
    port, pid = start_gateway(
        "--max-handshakes", "64", "--max-handshakes-per-address", "8", "--handshake-timeout", "3"
    )
    before = _rss_mib(pid)
    socks = _unfinished_handshakes(port, 300)
    assert _site_call(folder, key, port) < 3.0
    grew = _rss_mib(pid) - before
    closed_at_once = sum(_raw_closed(sock, 0.01) for sock in socks)
    assert closed_at_once >= 300 - 4 * 8, closed_at_once
    time.sleep(3.5)
    assert all(_raw_closed(sock, 1.0) for sock in socks)
    for sock in socks:
        sock.close()
    assert grew < 32, grew
    log = (tmp_path / f"gateway-{port}.log").read_text()
    assert "8 TLS handshakes from this address under way" in log


def test_a_low_open_file_limit_lowers_the_limits_before_handles_run_out(
    server, start_gateway, tmp_path
) -> None:
    """With 400 file handles (most kept for the upstream's connections) the gateway takes in
    fewer handshakes than asked and refuses the rest while it still has handles: asyncio never
    runs out of them accepting, and a site gets in."""
    folder, key = server
    port, pid = start_gateway(
        "--max-handshakes",
        "128",
        "--max-handshakes-per-address",
        "2",
        "--handshake-timeout",
        "6",
        files=400,
    )
    socks = _unfinished_handshakes(port, 200)
    assert _site_call(folder, key, port) < 3.0
    assert Path(f"/proc/{pid}").exists()
    for sock in socks:
        sock.close()
    log = (tmp_path / f"gateway-{port}.log").read_text()
    assert "open-file limit 400: at most 64 connections and 16 TLS handshakes" in log
    assert "Too many open files" not in log


def test_a_process_status_unreadable_for_want_of_handles_is_not_its_end() -> None:
    """Out of file handles, /proc cannot be read: that says nothing of the SuperLink (the
    gateway used to take it for its end and shut itself down)."""
    me = ProcessId.of(os.getpid())
    assert me is not None and me.alive()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        with pytest.raises(OSError, match="Too many open files"):
            me.alive()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert me.alive()


def test_the_gateway_keeps_serving_while_it_cannot_look(monkeypatch, caplog) -> None:
    """``_exit_with`` logs a look that failed and goes on; it stops only when the process is
    seen gone."""
    looks = iter([OSError(errno.EMFILE, "Too many open files"), True, False])

    def alive(process: ProcessId) -> bool:
        look = next(looks)
        if isinstance(look, OSError):
            raise look
        return look

    async def no_wait(seconds: float) -> None:
        return None

    monkeypatch.setattr(ProcessId, "alive", alive)
    monkeypatch.setattr(gateway.asyncio, "sleep", no_wait)
    server = SimpleNamespace(should_exit=False)
    with caplog.at_level("WARNING", logger="starfed.gateway"):
        asyncio.run(gateway._exit_with(server, ProcessId(1, 1)))
    assert server.should_exit
    assert "cannot read the upstream process 1's status" in caplog.text
    assert "upstream process 1 ended" in caplog.text
