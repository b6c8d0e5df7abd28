"""The codebook-distribution service with a real gRPC server on 127.0.0.1 (docs/inference.md).

The federation folder is built from random tiny codebooks (no backbones, no training): a first
step's classes, frozen; then the folder grows as a server run would grow it — new classes
registered, then every aligned head replayed and the new classes frozen. TLS certificates come
from ``server.certs``. The server runs in this process's threads; one test starts
``starfed server serve`` as a process and stops it by PID.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from cryptography.hazmat.primitives import serialization

from starfed.cli import main
from starfed.ops import processes
from starfed.ops.follow import CACHE_FILE, DistributionError, SourceError, fetch
from starfed.proto import distribution_pb2 as pb
from starfed.server.federation import Federation
from starfed.server.ops.certs import ensure_certificates, make_ca, make_server_cert
from starfed.server.ops.layout import ServerFolder
from starfed.server.records import Position
from starfed.server.serving import distribution
from starfed.server.serving.export import deployable
from starfed.shared.codebook import wire
from starfed.shared.codebook.lineage import Lineage

sys.path.insert(0, str(Path(__file__).parent))
from conftest import FINGERPRINT, TINY_DIMS, random_entries


def begin(folder: Path, step: int, n_new: int) -> None:
    """A step in progress in the federation folder: ``n_new`` classes registered."""
    federation = Federation(folder, FINGERPRINT, TINY_DIMS)
    new = random_entries(TINY_DIMS, n_new, seed=step, prefix=f"step{step}", mixtures=False)
    federation.register([e.name for e in new], step, {e.name: ["farm-a"] for e in new})
    codebook = federation.checkpoints.codebook().register(new)
    federation.checkpoint(codebook, Position(step, running=True, in_play=tuple(codebook.names)))


def finish(folder: Path, step: int) -> None:
    """The step's head replay: every aligned head changes, the step's classes are frozen."""
    federation = Federation(folder, FINGERPRINT, TINY_DIMS)
    codebook = federation.checkpoints.codebook()
    generator = torch.Generator().manual_seed(100 + step)
    heads = {
        name: {"aligned_head_weight": torch.randn(TINY_DIMS.d_vit, generator=generator)}
        for name in codebook.names
    }
    federation.checkpoint(codebook.set_values(heads, freeze=codebook.names), Position(step + 1))


def grow(folder: Path, step: int, n_new: int) -> None:
    begin(folder, step, n_new)
    finish(folder, step)


@pytest.fixture
def folder(tmp_path) -> Path:
    grow(tmp_path / "federation", 0, 3)
    return tmp_path / "federation"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> ServerFolder:
    server = ServerFolder.at(tmp_path_factory.mktemp("server"))
    ensure_certificates(server, [])
    return server


@pytest.fixture
def serve(folder, certs):
    """Start a TLS service on a free port of 127.0.0.1 (options overridable); stop it after."""
    started = []

    def start(**overrides) -> str:
        listen = f"127.0.0.1:{processes.free_port()}"
        tls = {"cert": certs.server_cert, "key": certs.server_key}
        options = distribution.ServeOptions(folder, listen, **{**tls, **overrides})
        server, _, port = distribution.start(options)
        started.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in started:
        server.stop(grace=None)


def exported(folder: Path) -> bytes:
    """What `starfed server export` writes for the folder now, as bytes."""
    return wire.encode(deployable(Federation.open(folder)).codebook.broadcast())


def test_full_then_unchanged_then_a_delta_after_the_folder_grows(folder, serve, certs, tmp_path):
    address, cache = serve(), tmp_path / "device"
    first = fetch(address, cache, ca=certs.ca_cert)
    assert first.status == "full" and wire.encode(first.codebook) == exported(folder)
    assert wire.encode(wire.read_file(cache / CACHE_FILE)) == exported(folder)

    again = fetch(address, cache, ca=certs.ca_cert)
    assert again.status == "unchanged" and again.reply_bytes < 16

    begin(folder, 1, 2)  # a step in progress: nothing a device gets
    assert fetch(address, cache, ca=certs.ca_cert).status == "unchanged"

    finish(folder, 1)
    grown = fetch(address, cache, ca=certs.ca_cert)
    assert grown.status == "delta"
    assert wire.encode(grown.codebook) == exported(folder)  # the same as a fresh export
    assert len(grown.codebook) == 3 + 2
    assert grown.reply_bytes < 0.8 * len(exported(folder))  # old classes: only their heads
    assert wire.encode(wire.read_file(cache / CACHE_FILE)) == exported(folder)


def test_a_device_of_another_federation_or_with_a_damaged_copy_gets_the_whole(
    folder, serve, certs, tmp_path
):
    address = serve()
    servicer = distribution.CodebookDistribution(folder)
    codebook = servicer.current().codebook
    version, federation = codebook.version, codebook.metadata["federation"]
    assert servicer.answer(version, federation).unchanged
    assert servicer.answer(version, "another").codebook.base_version == 0
    assert servicer.answer(version + 5, federation).codebook.base_version == 0

    cache = tmp_path / "device"
    cache.mkdir()
    (cache / CACHE_FILE).write_bytes(b"SFCODEBK" + b"\0" * 60)  # damaged
    assert fetch(address, cache, ca=certs.ca_cert).status == "full"
    # A held copy the delta does not fit (a class missing): the device starts over, once.
    held = wire.read_file(cache / CACHE_FILE)
    wire.write_file(cache / CACHE_FILE, held.without([held.names[0]]))
    grow(folder, 1, 1)
    fixed = fetch(address, cache, ca=certs.ca_cert)
    assert fixed.status == "full" and wire.encode(fixed.codebook) == exported(folder)


def test_a_copy_of_another_version_line_gets_the_whole_codebook(folder, serve, certs, tmp_path):
    """A federation rolled back counts versions up again on a new line (epoch): a device's copy
    of the old line takes no delta, whatever its version (``HeldCodebook``, as a site)."""
    address, cache = serve(), tmp_path / "device"
    assert fetch(address, cache, ca=certs.ca_cert).status == "full"
    held = wire.read_file(cache / CACHE_FILE)
    old_line = Lineage.of(held).new_epoch().as_metadata()
    wire.write_file(cache / CACHE_FILE, replace(held, metadata={**held.metadata, **old_line}))
    grow(folder, 1, 1)
    fetched = fetch(address, cache, ca=certs.ca_cert)
    assert fetched.status == "full" and wire.encode(fetched.codebook) == exported(folder)
    assert fetch(address, cache, ca=certs.ca_cert).status == "unchanged"


def test_tls_is_checked_and_an_unreachable_service_leaves_the_copy(
    folder, serve, certs, tmp_path, tmp_path_factory
):
    address, cache = serve(), tmp_path / "device"
    other = ServerFolder.at(tmp_path_factory.mktemp("other-ca"))
    ensure_certificates(other, [])
    with pytest.raises(DistributionError) as err:  # a server this CA did not sign
        fetch(address, cache, ca=other.ca_cert)
    assert str(err.value) == (
        f"{address}: TLS: the service's certificate is not signed by {other.ca_cert}"
    )
    assert fetch(address, cache, ca=certs.ca_cert).status == "full"
    offline = fetch(address, cache, ca=other.ca_cert)
    assert offline.status == "offline" and "not signed by" in offline.reason
    assert wire.encode(offline.codebook) == exported(folder)
    # A certificate for another name than the one dialled.
    named = tmp_path / "named"
    named.mkdir()
    ca_key, ca_cert = make_ca("test CA")
    key, cert = make_server_cert(ca_key, ca_cert, ["fed.example.org"])
    (named / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (named / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (named / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    elsewhere = serve(cert=named / "server.pem", key=named / "server.key")
    with pytest.raises(DistributionError) as err:
        fetch(elsewhere, tmp_path / "fresh", ca=named / "ca.pem")
    assert str(err.value) == (
        f"{elsewhere}: TLS: 127.0.0.1 is not a name in the service's certificate"
    )
    with pytest.raises(SourceError, match="only to a loopback address"):
        fetch("192.0.2.1:9095", tmp_path / "none", insecure=True)
    with pytest.raises(DistributionError, match="UNAVAILABLE"):  # no plain text to TLS
        fetch(address, tmp_path / "none", insecure=True, timeout=5)


def test_size_limits_on_both_sides(folder, serve, certs, tmp_path):
    size = len(exported(folder))
    with pytest.raises(DistributionError, match="RESOURCE_EXHAUSTED: the codebook reply has"):
        fetch(serve(max_bytes=size // 2), tmp_path / "a", ca=certs.ca_cert)
    with pytest.raises(DistributionError, match="RESOURCE_EXHAUSTED"):
        fetch(serve(), tmp_path / "b", ca=certs.ca_cert, max_bytes=size // 2)
    # A request over the service's limit is refused before it is parsed.
    channel = grpc.secure_channel(serve(), grpc.ssl_channel_credentials(certs.ca_cert.read_bytes()))
    stub = distribution.pb_grpc.CodebookDistributionStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Fetch(pb.FetchRequest(federation="x" * distribution.REQUEST_LIMIT), timeout=10)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()


def test_plain_text_only_on_loopback(folder, serve, tmp_path, capsys):
    with pytest.raises(distribution.ServeError, match="only on a loopback address"):
        distribution.check(distribution.ServeOptions(folder, "0.0.0.0:9095", insecure=True))
    address = serve(insecure=True, cert=None, key=None)
    assert fetch(address, tmp_path / "device", insecure=True).status == "full"
    code = main(
        ["server", "serve", "--federation", str(folder), "--listen", "192.0.2.1:9095", "--insecure"]
    )
    assert code == 2
    assert capsys.readouterr().err == (
        "starfed server serve: error: --insecure serves codebooks in plain text: only on a "
        "loopback address (127.0.0.1, ::1, localhost), not 192.0.2.1\n"
    )


@pytest.mark.e2e
def test_serve_as_a_process_answers_and_stops_on_sigterm(folder, certs, tmp_path):
    port = processes.free_port()
    command = [
        sys.executable,
        "-m",
        "starfed.cli",
        "server",
        "serve",
        "--json",
        "--dir",
        certs.root,
        "--federation",
        folder,
        "--listen",
        f"127.0.0.1:{port}",
    ]
    proc = processes.spawn([str(c) for c in command], env=dict(os.environ), cwd=tmp_path)
    pid = processes.ProcessId.of(proc.pid)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["port"] == port and info["tls"] and info["classes"] == 3
        assert fetch(f"127.0.0.1:{port}", tmp_path / "device", ca=certs.ca_cert).status == "full"
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(timeout=20) == 0 and time.monotonic() - started < 10
    finally:
        assert not processes.terminate([pid], grace=5.0)
        proc.stdout.close()


def test_nothing_finished_yet_is_exported_or_served_as_nothing(tmp_path, certs, capsys):
    folder = tmp_path / "federation"
    begin(folder, 0, 2)
    code = main(["server", "export", "--federation", str(folder), "--out", str(tmp_path / "a")])
    federation = Federation.open(folder).id
    assert code == 1 and capsys.readouterr().err == (
        f"starfed server export: error: federation {federation[:8]} has no frozen class yet "
        "(2 in the step in progress)\n"
    )
    listen = f"127.0.0.1:{processes.free_port()}"
    options = distribution.ServeOptions(folder, listen, certs.server_cert, certs.server_key)
    server, _, _ = distribution.start(options)
    try:
        with pytest.raises(DistributionError, match="FAILED_PRECONDITION: no frozen class yet"):
            fetch(listen, tmp_path / "device", ca=certs.ca_cert)
    finally:
        server.stop(grace=None)
