"""The codebook-distribution service: inference-only devices follow a live federation.

A device sends the version of the codebook it holds (0: none) and the federation it came from
(``proto/distribution.proto``); the service answers with the federation's deployable codebook
(``server.serving.export``: frozen classes, no mixtures — what ``starfed server export`` writes):
whole, as the delta since the held version (``Codebook.delta``), or "unchanged". A device of
another federation, or holding a version this one never had, gets the whole codebook. The
folder is read again when ``codebook.bin`` changes (one ``stat`` per request; the file is
replaced atomically, so a reader never sees half of it).

gRPC over TLS with the server certificate of the server folder (``server.ops.layout``); plain text
only on a loopback address, for tests and a device on the same machine. Requests are tiny and
limited to ``REQUEST_LIMIT`` bytes; a reply over ``max_bytes`` is refused (RESOURCE_EXHAUSTED)
rather than sent. The device's side is ``starfed.ops.follow``.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from starfed.proto import distribution_pb2 as pb
from starfed.proto import distribution_pb2_grpc as pb_grpc
from starfed.server.federation import Federation
from starfed.server.folder_files import CODEBOOK_FILE, FederationError
from starfed.server.serving.export import Deployable, deployable
from starfed.shared.addresses import format_address, is_loopback, parse_address
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.wire import DEFAULT_MAX_BYTES, to_proto

logger = logging.getLogger(__name__)

REQUEST_LIMIT = 4096  # bytes: a version and a federation id
WORKERS = 4


class ServeError(ValueError):
    """Options the service cannot run with; one line for the user."""


class CodebookDistribution(pb_grpc.CodebookDistributionServicer):
    """Answers ``Fetch`` from the federation folder, read again whenever it changes."""

    def __init__(
        self, federation_dir: str | Path, dtype: str = "float32", max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.root = Path(federation_dir)
        self.dtype, self.max_bytes = dtype, max_bytes
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._current: Deployable | None = None
        self._replies: dict[int, pb.FetchReply] = {}  # held version -> reply, for _current
        self.current()  # a bad folder fails at start, not at the first request

    def current(self) -> Deployable:
        """The deployable codebook of the folder as it is now."""
        path = self.root / CODEBOOK_FILE
        try:
            st = os.stat(path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = (0, 0, 0)
        with self._lock:
            if stamp != self._stamp or self._current is None:
                federation = Federation.open(self.root)  # the registry may have grown too
                self._current, self._stamp, self._replies = deployable(federation), stamp, {}
                logger.info(
                    "serving version %d (%d classes)",
                    self._current.codebook.version,
                    len(self._current.codebook),
                )
            return self._current

    def answer(self, held_version: int, federation: str) -> pb.FetchReply:
        """The reply to a device holding ``held_version`` of ``federation`` (0, "": nothing)."""
        current = self.current()
        codebook = current.codebook
        if federation != Lineage.of(codebook).federation or held_version > codebook.version:
            held_version = 0  # another federation's, or a version this one never had
        with self._lock:
            reply = self._replies.get(held_version) if current is self._current else None
        if reply is not None:
            return reply
        if held_version == codebook.version:
            reply = pb.FetchReply(unchanged=True, version=codebook.version)
        else:
            sent = codebook.delta(held_version) if held_version > 0 else codebook.broadcast()
            reply = pb.FetchReply(codebook=to_proto(sent, self.dtype), version=codebook.version)
        with self._lock:
            if current is self._current:  # not reloaded meanwhile
                self._replies[held_version] = reply
        return reply

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> pb.FetchReply:
        if request.held_version < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "held_version must be >= 0")
        try:
            current = self.current()
        except (FederationError, OSError) as err:  # e.g. the folder moved away
            logger.error("cannot read the federation folder: %s", err)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the federation folder cannot be read")
        if not len(current.codebook):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no frozen class yet")
        reply = self.answer(request.held_version, request.federation)
        size = reply.ByteSize()
        if size > self.max_bytes:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the codebook reply has {size} bytes, over this service's limit {self.max_bytes}",
            )
        return reply


@dataclass(frozen=True)
class ServeOptions:
    federation: Path
    listen: str  # HOST:PORT
    cert: Path | None = None  # server certificate and key (PEM); None with insecure
    key: Path | None = None
    insecure: bool = False
    dtype: str = "float32"
    max_bytes: int = DEFAULT_MAX_BYTES


def check(options: ServeOptions) -> tuple[str, int]:
    """The address to bind, or ServeError: plain text only on loopback, TLS files present."""
    try:
        host, port = parse_address(options.listen)
    except ValueError as err:
        raise ServeError(f"--listen: {err}") from None
    if options.insecure and not is_loopback(host):
        raise ServeError(
            f"--insecure serves codebooks in plain text: only on a loopback address "
            f"(127.0.0.1, ::1, localhost), not {host}"
        )
    if not options.insecure:
        for what, path in (("certificate", options.cert), ("key", options.key)):
            if path is None or not path.is_file():
                raise ServeError(
                    f"no server {what} at {path}: run `starfed server certs` (or pass --insecure "
                    "on a loopback address for a local test)"
                )
    return host, port


def start(options: ServeOptions) -> tuple[grpc.Server, CodebookDistribution, int]:
    """Start serving in background threads; returns the server, the servicer and the port."""
    host, port = check(options)
    servicer = CodebookDistribution(options.federation, options.dtype, options.max_bytes)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=WORKERS),
        options=[
            ("grpc.max_receive_message_length", REQUEST_LIMIT),
            ("grpc.max_send_message_length", options.max_bytes + REQUEST_LIMIT),
        ],
    )
    pb_grpc.add_CodebookDistributionServicer_to_server(servicer, server)
    address = format_address(host, port)
    try:
        if options.insecure:
            bound = server.add_insecure_port(address)
        else:
            assert options.cert is not None and options.key is not None
            credentials = grpc.ssl_server_credentials(
                [(options.key.read_bytes(), options.cert.read_bytes())]
            )
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpc's "Failed to bind"
        bound = 0
    if not bound:
        raise ServeError(f"cannot listen on {address}: in use, or not an address of this machine")
    server.start()
    return server, servicer, bound
