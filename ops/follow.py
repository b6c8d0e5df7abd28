"""The device's side of the codebook-distribution service: a local copy kept current.

``fetch`` asks the service (``server.serving.distribution``) what changed since the version the
cached copy holds and hands the reply to the cached copy, a ``HeldCodebook`` like a site's: it
validates what arrives (``wire``), applies a delta by the same rule as a site, and replaces the
cache file atomically. A device that cannot reach the service keeps predicting with the copy it
has (``offline``, with the reason). A delta the held copy refuses (a damaged cache, or another
version line after the federation rolled back) is answered by fetching the whole codebook once.
What crosses the network: the held version and federation id up; the frozen classes'
broadcast fields down, only those that changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from starfed.proto import distribution_pb2 as pb
from starfed.proto import distribution_pb2_grpc as pb_grpc
from starfed.shared.addresses import is_loopback, parse_address
from starfed.shared.codebook.codebook import Codebook, CodebookError, Delta
from starfed.shared.codebook.held import HeldCodebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.codebook.wire import DEFAULT_MAX_BYTES, broadcast_from_proto

CACHE_FILE = "codebook.bin"
TIMEOUT_S = 30.0
_REPLY_OVERHEAD = 64  # bytes of the reply around its codebook (tags, lengths, version)


#: gRPC's words for a failed TLS handshake -> what to tell the user (like `site start`'s).
_TLS_FAILURES = (
    ("CERTIFICATE_VERIFY_FAILED", "TLS: the service's certificate is not signed by {ca}"),
    (
        "Hostname Verification Check failed",
        "TLS: {host} is not a name in the service's certificate",
    ),
)


class DistributionError(RuntimeError):
    """No codebook could be had; one line for the user."""


class SourceError(ValueError):
    """A bad address, CA file or plain-text request: bad input, one line."""


@dataclass
class Fetched:
    codebook: Codebook
    status: str  # full | delta | unchanged | offline (the cached copy, not updated)
    reply_bytes: int = 0
    reason: str = ""  # offline: why the service could not be used


def open_channel(address: str, ca: Path | None, insecure: bool, max_bytes: int) -> grpc.Channel:
    """A TLS channel that trusts ``ca`` (the federation's CA), or plain text to loopback."""
    try:
        host, _ = parse_address(address)
    except ValueError as err:
        raise SourceError(f"--from: {err}") from None
    options = [("grpc.max_receive_message_length", max_bytes + _REPLY_OVERHEAD)]
    if insecure:
        if not is_loopback(host):
            raise SourceError(f"--insecure: only to a loopback address, not {host}")
        return grpc.insecure_channel(address, options=options)
    if ca is None or not ca.is_file():
        raise SourceError(f"--ca: no CA certificate at {ca} (the federation's ca.pem)")
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    return grpc.secure_channel(address, credentials, options=options)


def _ask(
    stub: pb_grpc.CodebookDistributionStub, cached: Codebook | None, timeout: float
) -> pb.FetchReply:
    request = pb.FetchRequest(
        held_version=cached.version if cached else 0, federation=Lineage.of(cached).federation
    )
    reply: pb.FetchReply = stub.Fetch(request, timeout=timeout)  # generated stubs: untyped
    return reply


def _receive(reply: pb.FetchReply, cache: HeldCodebook) -> tuple[Codebook, str]:
    """The codebook a reply leads to from what is held; CodebookError if it does not fit."""
    current = cache.codebook()
    if reply.WhichOneof("answer") == "unchanged":
        if current is None or current.version != reply.version:
            raise CodebookError("the service says unchanged about a version not held here")
        return current, "unchanged"
    received = broadcast_from_proto(reply.codebook)
    status = "delta" if isinstance(received, Delta) else "full"
    if received.version != reply.version:
        raise CodebookError(f"reply for version {reply.version} holds {received.version}")
    return cache.receive(received), status


def _reason(address: str, ca: Path | None, err: grpc.RpcError) -> str:
    details = err.details() or ""
    for needle, reason in _TLS_FAILURES:
        if needle in details:
            return f"{address}: " + reason.format(ca=ca, host=parse_address(address)[0])
    return f"{address}: {err.code().name}: {details}"


def fetch(
    address: str,
    cache_dir: str | Path,
    *,
    ca: Path | None = None,
    insecure: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout: float = TIMEOUT_S,
) -> Fetched:
    """Bring the cached copy in ``cache_dir`` up to the service's current codebook."""
    cache = HeldCodebook(Path(cache_dir).expanduser() / CACHE_FILE)
    with open_channel(address, ca, insecure, max_bytes) as channel:
        stub = pb_grpc.CodebookDistributionStub(channel)
        try:
            reply = _ask(stub, cache.codebook(), timeout)
            try:
                codebook, status = _receive(reply, cache)
            except CodebookError:  # the held copy does not fit: start over, once
                reply = _ask(stub, None, timeout)
                codebook, status = _receive(reply, cache)
        except grpc.RpcError as err:
            reason = _reason(address, ca, err)
            if (cached := cache.codebook()) is None:
                raise DistributionError(reason) from None
            return Fetched(cached, "offline", reason=reason)
    return Fetched(codebook, status, reply.ByteSize())
