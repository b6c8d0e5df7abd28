"""The fleet-only gateway's requests: what it forwards to the SuperLink, and how much.

Robustness (docs/deployment.md, "The port sites reach"): a request body is at most what the
protocol can need — one Flower object holding a whole update or codebook, which the codebook's
wire format caps (``DEFAULT_MAX_BYTES``), plus its envelope —, refused with 413 from its
Content-Length before anything is forwarded, or as soon as a chunked body crosses it. Only a call
signed by a registered site key (``fleet_signatures``: the headers alone, checked before any of
the body is read) may send that much; any other call gets 64 KiB, ample for what a SuperNode
sends before it is registered, 401 past it, and must arrive whole within 10 s (408 past it), so
unauthenticated traffic can neither make the SuperLink buffer and parse large bodies nor hold a
connection with a trickled one. Connections (``connection_guard``) must send a request's headers
within 10 s, at most 32 come from one address, and when all 512 slots are taken the oldest
connection without a request gives way, so slow connections cannot keep sites out. The gateway's
own refusals close the connection (the rest of a refused body is never read). Body reads and
upstream calls have timeouts, a client that sends garbage gets an HTTP error and never stops the
gateway, and every refusal and every forwarded call that did not succeed is one line in the log
file (all calls with ``--debug``). Built on uvicorn (its h11 protocol) and httpx, which Flower
itself runs on. A call Flower refused for its timestamp is
logged with the clock difference (``ops.clock``), so the operator tells clock skew from a
removed key.

The process around it (TLS, connection limits, logging, the command line) is
``starfed.server.ops.gateway``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import httpx

from starfed.ops import clock, pki
from starfed.server.ops.connection_guard import HEADER_TIMEOUT_S
from starfed.server.ops.fleet_signatures import PUBLIC_KEY_HEADER, TIMESTAMP_HEADER, SiteKeys
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES

UPSTREAM_CONNECTIONS = 256  # to the SuperLink, at most: each a file handle

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The only requests forwarded: POST to one Fleet API method (lower-case words and dashes).
FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z0-9-]{0,63}")
#: A Flower object's envelope around its payload (a ConfigRecord of one ``bytes`` value adds
#: ~40 bytes, the PushObjectRequest around it a node id, run id and object id): generously.
ENVELOPE_BYTES = 1024 * 1024
#: The largest body a site needs: one object holding an update or codebook at the wire limit.
MAX_BODY_BYTES = DEFAULT_MAX_BYTES + ENVELOPE_BYTES
#: The most a call without a registered site's signature may send (a SuperNode's unsigned or
#: not-yet-registered calls are a few hundred bytes).
MAX_UNSIGNED_BODY_BYTES = 64 * 1024
UPSTREAM_TIMEOUT_S = 120.0  # Flower's Fleet client gives up after 30 s per call
IDLE_TIMEOUT_S = 60.0  # longest pause between two pieces of a signed request's body
#: An unsigned call's whole body must arrive within this (as its headers must: connection_guard),
#: so that trickling 64 KiB cannot hold a connection that may not be evicted.
UNSIGNED_BODY_TIMEOUT_S = HEADER_TIMEOUT_S
#: Headers that describe one connection, not the request; never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "forwarded",
        "x-real-ip",
    }
)

log = logging.getLogger("starfed.gateway")


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class _TooSlow(Exception):
    pass


@dataclass(frozen=True)
class _Call:
    """A request admitted for forwarding: who sent it, its signer, what it may send."""

    client: str
    path: str
    headers: dict[str, str]
    signer: str | None
    unsigned: bool
    limit: int


@dataclass(eq=False)
class FleetGateway:
    """ASGI app: forward ``POST /v1/fleet/*`` to ``upstream``, refuse everything else.

    ``verify`` is how the upstream's certificate is checked (a CA file's context, or False for
    plain HTTP upstreams). With ``site_keys``, only calls signed by one of them may send more
    than ``max_unsigned_body`` bytes; without (plain HTTP, where Flower authenticates nobody)
    every call may send ``max_body``. ``transport`` replaces the network in tests.
    """

    upstream: str
    _: KW_ONLY
    verify: ssl.SSLContext | bool = True
    max_body: int = MAX_BODY_BYTES
    site_keys: SiteKeys | None = None
    max_unsigned_body: int = MAX_UNSIGNED_BODY_BYTES
    timeout: float = UPSTREAM_TIMEOUT_S
    idle_timeout: float = IDLE_TIMEOUT_S
    unsigned_body_timeout: float = UNSIGNED_BODY_TIMEOUT_S
    scheme: str = "https"
    transport: httpx.AsyncBaseTransport | None = None
    _client: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.upstream = self.upstream.rstrip("/")

    @property
    def client(self) -> httpx.AsyncClient:
        """The pool of connections to the upstream, opened on first use."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                verify=self.verify,
                timeout=httpx.Timeout(self.timeout, connect=10.0),
                limits=httpx.Limits(
                    max_connections=UPSTREAM_CONNECTIONS, max_keepalive_connections=32
                ),
                transport=self.transport,
                follow_redirects=False,
                trust_env=False,  # never route the SuperLink's traffic through a proxy
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            try:
                await self._http(scope, receive, send)
            except Exception:  # never let one request take the gateway down
                log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
                raise
        # websockets and anything else: returning without accepting closes them

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        call = await self._admit(scope, send)
        if call is None:
            return
        received = [0]
        response = await self._forward(call, receive, received, send)
        if response is None:
            return
        sent = await _relay(response, send, call)
        if response.status_code == 401:
            _log_clock_skew(call.headers, call.path, call.client)
        log.log(
            logging.DEBUG if response.status_code < 400 else logging.INFO,
            "%s (%s) %s %d in=%d out=%d %.0fms",
            call.client,
            call.signer or "unsigned",
            call.path,
            response.status_code,
            received[0],
            sent,
            (time.monotonic() - started) * 1000,
        )

    async def _admit(self, scope: Scope, send: Send) -> _Call | None:
        """The call to forward, or None once it was refused: its method and path, and its
        declared length against what its signature (or the lack of one) allows."""
        client = (scope.get("client") or ("?", 0))[0]
        method, path = scope["method"], scope["path"]
        if not allowed(method, path, scope.get("raw_path")):
            log.warning("refused %s %s from %s", method, _printable(path), client)
            await _reply(send, 403, b"forbidden: this port serves the Flower Fleet API only\n")
            return None
        headers = _forward_headers(scope["headers"])
        signer = None if self.site_keys is None else self.site_keys.signer(headers)
        unsigned = self.site_keys is not None and signer is None
        limit = self.max_unsigned_body if unsigned else self.max_body
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            log.warning("refused %s %s from %s: content-length %r", method, path, client, length)
            await _reply(send, 400, b"")
            return None
        call = _Call(client, path, headers, signer, unsigned, limit)
        if length is not None and int(length) > limit:
            await self._too_large(send, call, f"content-length {length}")
            return None
        headers["x-forwarded-for"] = client
        headers["x-forwarded-proto"] = self.scheme
        return call

    async def _forward(
        self, call: _Call, receive: Receive, received: list[int], send: Send
    ) -> httpx.Response | None:
        """The upstream's streamed response to ``call``, its body read as it arrives; or None
        once the gateway answered itself (too large, too slow, client gone, upstream down)."""
        request = self.client.build_request(
            "POST",
            self.upstream + call.path,
            headers=call.headers,
            content=self._body(receive, received, call.limit, call.unsigned),
        )
        path, client = call.path, call.client
        try:
            return await self.client.send(request, stream=True)
        except _BodyTooLarge:
            await self._too_large(send, call, f"body over {call.limit} bytes")
        except _TooSlow:
            log.warning("refused %s from %s: unsigned body too slow", path, client)
            await _reply(send, 408, b"request body too slow\n")
        except _ClientGone:
            log.info("%s from %s: client went away", path, client)
        except httpx.TimeoutException as err:
            log.error("%s from %s: upstream timeout (%s)", path, client, type(err).__name__)
            await _reply(send, 504, b"upstream timeout\n")
        except httpx.HTTPError as err:
            log.error("%s from %s: upstream unreachable (%s)", path, client, err)
            await _reply(send, 502, b"upstream unavailable\n")
        return None

    @staticmethod
    async def _too_large(send: Send, call: _Call, what: str) -> None:
        """413 for a body over what the protocol needs; 401 for an unsigned one over the
        unsigned limit (a registered site's signature would have let it through)."""
        unsigned = " unsigned" if call.unsigned else ""
        log.warning("refused %s from %s: %s%s", call.path, call.client, what, unsigned)
        if call.unsigned:
            message = f"a body over {call.limit} bytes needs a signature by a registered site key\n"
            await _reply(send, 401, message.encode())
        else:
            await _reply(send, 413, f"request body over {call.limit} bytes\n".encode())

    async def _body(
        self, receive: Receive, received: list[int], limit: int, unsigned: bool
    ) -> AsyncIterator[bytes]:
        """The request body as it arrives: at most ``limit`` bytes, no long pauses, and for an
        unsigned call all of it within ``unsigned_body_timeout``."""
        deadline = time.monotonic() + self.unsigned_body_timeout if unsigned else None
        while True:
            wait = self.idle_timeout
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0.0))
            except TimeoutError:
                raise (_TooSlow if unsigned else _ClientGone) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            received[0] += len(chunk)
            if received[0] > limit:
                raise _BodyTooLarge
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return


async def _relay(response: httpx.Response, send: Send, call: _Call) -> int:
    """The upstream's response passed on as it streams (hop-by-hop headers dropped); the bytes
    sent. An upstream that breaks mid-response drops the connection."""
    sent = 0
    try:
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [
                    (k, v)
                    for k, v in response.headers.raw
                    if k.decode("latin-1").lower() not in HOP_BY_HOP
                ],
            }
        )
        async for chunk in response.aiter_raw():
            sent += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except httpx.HTTPError as err:
        log.error("%s from %s: upstream failed mid-response (%s)", call.path, call.client, err)
    finally:
        await response.aclose()
    return sent


def _log_clock_skew(headers: dict[str, str], path: str, client: str) -> None:
    """A 401 to a call whose signed timestamp is outside Flower's window: Flower's answer is
    the same as for a removed key, so say what it was (``ops.clock``), with the key."""
    offset = clock.signed_offset(headers.get(TIMESTAMP_HEADER, ""))
    if offset is None or not clock.refused(offset):
        return
    try:
        key = pki.fingerprint(base64.b64decode(headers.get(PUBLIC_KEY_HEADER, "")))
    except (pki.SiteKeyError, ValueError):
        key = "(no key)"
    log.warning(
        "refused %s from %s: %s %+.1f s key %s (%s)",
        path,
        client,
        clock.SKEW_LINE,
        offset,
        key,
        clock.describe(offset),
    )


def allowed(method: str, path: str, raw_path: bytes | None = None) -> bool:
    """Only ``POST /v1/fleet/<method>``, spelled plainly: no percent-escapes, dots or slashes
    that a server behind us might read differently."""
    if method != "POST" or not FLEET_PATH.fullmatch(path):
        return False
    return raw_path is None or raw_path == path.encode()


def _forward_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name not in HOP_BY_HOP:
            headers[name] = value.decode("latin-1")
    return headers


def _printable(text: str, limit: int = 200) -> str:
    return text[:limit].encode("unicode_escape").decode("ascii")


async def _reply(send: Send, status: int, body: bytes) -> None:
    """The gateway's own answer; it closes the connection, so that the rest of a refused body
    is never read (and a client that misbehaved starts over)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
