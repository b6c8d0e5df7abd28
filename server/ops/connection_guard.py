"""The gateway's connections: a deadline for each request's headers, a cap per client address,
and, when every slot is taken, the longest-waiting connection without a request gives way.

Why: uvicorn (0.49) has no header timeout: a connection that sends one header line every few
seconds is held forever, and its ``limit_concurrency`` counts such connections, so a few hundred
of them made the gateway answer 503 to every real site. A site's SuperNode sends a request's
headers in one go right after the TLS handshake, so a deadline of seconds costs it nothing; a
cap per address keeps one peer from taking every slot; and because a connection that has not
yet sent a request is the one evicted when the gateway is full, a newly arriving site still
gets in while slow connections are being held. uvicorn's own HTTP/1.1 protocol over h11 (whose
header buffer is bounded: 400 past 16 KiB) does the HTTP; this only adds the bookkeeping.

The TLS handshake is the guard's too (``TlsGate``): the listening socket is plain TCP, and each
connection gets asyncio's TLS protocol here once it is counted — at most
``max_handshakes`` handshakes under way in all and ``handshakes_per_address`` from one address,
each given ``handshake_timeout`` seconds, with a small TLS read buffer. Before, asyncio did the
handshake before any protocol saw the address, gave it 60 s and a 256 KiB buffer: 20,000
unfinished handshakes from one address took the gateway to 6 GB and all its file handles.

Not covered here: an attacker with more addresses than ``max_connections / per_address`` (or
``max_handshakes / handshakes_per_address``): against those the firewall (only the sites'
addresses) helps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from asyncio import sslproto
from collections import Counter
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 512
MAX_PER_ADDRESS = 32
HANDSHAKE_TIMEOUT_S = 10.0
MAX_HANDSHAKES = 128
MAX_HANDSHAKES_PER_ADDRESS = 8
#: asyncio's TLS read buffer per connection (256 KiB by default, allocated at the handshake's
#: start); one TLS record is at most 16 KiB of payload, and a smaller buffer only means more
#: reads of a large body.
TLS_READ_BUFFER = 32 * 1024

log = logging.getLogger("starfed.gateway")


@dataclass(kw_only=True, eq=False)
class ConnectionGuard:
    """The limits, and the state they are kept with (one per server; the event loop's thread
    only, so no locks)."""

    max_connections: int = MAX_CONNECTIONS
    per_address: int = MAX_PER_ADDRESS
    header_timeout: float = HEADER_TIMEOUT_S
    max_handshakes: int = MAX_HANDSHAKES
    handshakes_per_address: int = MAX_HANDSHAKES_PER_ADDRESS
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    #: address -> TLS handshakes under way
    handshakes: Counter[str] = field(default_factory=Counter, init=False)
    open: set[GuardedH11Protocol] = field(default_factory=set, init=False)
    by_address: Counter[str] = field(default_factory=Counter, init=False)
    #: connections with no request under way, oldest first (a dict keeps insertion order)
    idle: dict[GuardedH11Protocol, None] = field(default_factory=dict, init=False)

    def protocol_class(self, tls: ssl.SSLContext | None = None) -> type:
        """uvicorn's ``http=``: its h11 protocol, bound to this guard; with ``tls``, behind a
        ``TlsGate`` that does the handshake (uvicorn then listens on plain TCP)."""
        h11_class = type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})
        if tls is None:
            return h11_class
        return type("BoundTlsGate", (TlsGate,), {"guard": self, "tls": tls, "inner": h11_class})

    def begin_handshake(self, address: str) -> str | None:
        """Count a handshake from ``address`` in, or say why not."""
        if self.handshakes[address] >= self.handshakes_per_address:
            return f"{self.handshakes_per_address} TLS handshakes from this address under way"
        if self.handshakes.total() >= self.max_handshakes:
            return f"{self.max_handshakes} TLS handshakes under way"
        self.handshakes[address] += 1
        return None

    def end_handshake(self, address: str) -> None:
        self.handshakes[address] -= 1
        if not self.handshakes[address]:
            del self.handshakes[address]

    def admit(self, connection: GuardedH11Protocol) -> str | None:
        """Take ``connection`` in, or say why not."""
        address = connection.address
        if self.by_address[address] >= self.per_address:
            return f"{self.per_address} connections from this address already"
        if len(self.open) >= self.max_connections:
            oldest = next(iter(self.idle), None)
            if oldest is None:
                return f"{self.max_connections} connections, each with a request"
            oldest.close("made room for a new connection")
        self.open.add(connection)
        self.by_address[address] += 1
        self.idle[connection] = None
        return None

    def release(self, connection: GuardedH11Protocol) -> None:
        if connection in self.open:
            self.open.discard(connection)
            self.by_address[connection.address] -= 1
            if not self.by_address[connection.address]:
                del self.by_address[connection.address]
        self.idle.pop(connection, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ``ConnectionGuard`` (``guard`` is set by
    ``ConnectionGuard.protocol_class``). It uses what uvicorn 0.49's ``H11Protocol`` keeps per
    connection (``transport``, ``client``, ``conn``: h11's state, ``loop``) and its
    ``on_response_complete`` hook; tests/test_adversarial_gateway.py runs it for real."""

    guard: ConnectionGuard

    _deadline: asyncio.TimerHandle | None = None
    address = "?"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = self.client[0] if self.client else "?"
        refusal = self.guard.admit(self)
        if refusal is not None:
            log.warning("closed a connection from %s: %s", self.address, refusal)
            self.transport.close()
            return
        self._arm_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # a request's headers are (still) on their way
            self._arm_deadline()
        else:
            self._disarm_deadline()
            self.guard.idle.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.guard.idle[self] = None  # between requests: uvicorn's keep-alive timeout runs

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        self.guard.release(self)
        super().connection_lost(exc)

    def close(self, why: str) -> None:
        log.warning("closed a connection from %s: %s", self.address, why)
        self.guard.release(self)
        self._disarm_deadline()
        self.transport.close()

    def _arm_deadline(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.guard.header_timeout, self._too_slow)

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            timeout = self.guard.header_timeout
            self.close(f"no complete request headers within {timeout:g} s")


class TlsGate(asyncio.Protocol):
    """A TCP connection before its TLS handshake: counted against the guard's handshake limits,
    then handed to asyncio's own TLS protocol (``sslproto.SSLProtocol``, as asyncio's TLS
    listener makes it, with ``handshake_timeout``) over the h11 protocol (built the way uvicorn
    builds it, with the same arguments), which starts once the handshake is done. ``guard``,
    ``tls`` and ``inner`` are set by ``ConnectionGuard.protocol_class``."""

    guard: ConnectionGuard
    tls: ssl.SSLContext
    inner: type[GuardedH11Protocol]

    def __init__(self, *args, **kwargs) -> None:
        self._args, self._kwargs = args, kwargs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        refusal = self.guard.begin_handshake(address)
        if refusal is not None:
            log.warning("closed a connection from %s: %s", address, refusal)
            transport.abort()
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()  # set when the handshake ends, either way
        done.add_done_callback(functools.partial(self._handshake_done, address))
        secure = sslproto.SSLProtocol(
            loop,
            self.inner(*self._args, **self._kwargs),
            self.tls,
            done,
            server_side=True,
            # typeshed types the timeout as int; asyncio takes any number of seconds
            ssl_handshake_timeout=self.guard.handshake_timeout,  # type: ignore[arg-type]
        )
        transport.set_protocol(secure)  # the bytes that follow are the handshake's
        secure.connection_made(transport)

    def _handshake_done(self, address: str, done: asyncio.Future) -> None:
        self.guard.end_handshake(address)
        if not done.cancelled() and (err := done.exception()) is not None:
            log.debug("TLS handshake from %s failed: %r", address, err)
