"""The fleet-only gateway: the one port of a starfed server that sites can reach.

Why it exists: Flower 1.42's SuperLink is one HTTPS server that answers the Fleet API (what
SuperNodes call), the Control API (what the ``flwr`` CLI calls: start and stop runs, read logs,
register and unregister SuperNodes) and the Runtime API (what ServerApps and the SuperExec call)
on the same port, and open-source Flower has no user authentication on the Control API. A
SuperLink port that sites can reach is therefore a port from which anyone can run code on the
server and on every site. Flower cannot bind the three APIs apart (the old per-API address
flags only print a warning), so ``starfed server start`` binds the SuperLink to 127.0.0.1 and puts
this gateway on the public address. It terminates TLS with the server certificate and forwards
exactly ``POST /v1/fleet/<method>`` to the SuperLink; every other method, path, ``/docs``,
``/openapi.json`` and ``/health`` gets 403. What stays reachable is the Fleet API, where
``--enable-supernode-auth`` makes every call carry a signature by a registered site key
(docs/deployment.md, "What is exposed").

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
logged with the clock difference (``server.ops.clock``), so the operator tells clock skew from a
removed key.

Run: ``python -m starfed.server.ops.gateway --listen 0.0.0.0:9092 --upstream https://127.0.0.1:9093
--ca ca.pem --cert server.pem --key server.key --site-keys sites.json --log-file gateway.log``
(``starfed server start`` does this).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import logging.handlers
import re
import resource
import ssl
import sys
import time
from asyncio import sslproto
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from starfed.server.ops import clock, pki
from starfed.server.ops.connection_guard import (
    HANDSHAKE_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_ADDRESS,
    MAX_PER_ADDRESS,
    TLS_READ_BUFFER,
    ConnectionGuard,
)
from starfed.server.ops.fleet_signatures import PUBLIC_KEY_HEADER, TIMESTAMP_HEADER, SiteKeys
from starfed.server.ops.processes import ProcessId
from starfed.shared.addresses import parse_address
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES

UPSTREAM_CONNECTIONS = 256  # to the SuperLink, at most: each a file handle
OWN_FILES = 64  # the process's own: the listening socket, logs, /proc, the interpreter's

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


class FleetGateway:
    """ASGI app: forward ``POST /v1/fleet/*`` to ``upstream``, refuse everything else.

    ``verify`` is how the upstream's certificate is checked (a CA file's context, or False for
    plain HTTP upstreams). With ``site_keys``, only calls signed by one of them may send more
    than ``max_unsigned_body`` bytes; without (plain HTTP, where Flower authenticates nobody)
    every call may send ``max_body``. ``transport`` replaces the network in tests.
    """

    def __init__(
        self,
        upstream: str,
        *,
        verify: ssl.SSLContext | bool = True,
        max_body: int = MAX_BODY_BYTES,
        site_keys: SiteKeys | None = None,
        max_unsigned_body: int = MAX_UNSIGNED_BODY_BYTES,
        timeout: float = UPSTREAM_TIMEOUT_S,
        idle_timeout: float = IDLE_TIMEOUT_S,
        unsigned_body_timeout: float = UNSIGNED_BODY_TIMEOUT_S,
        scheme: str = "https",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.max_body = max_body
        self.site_keys = site_keys
        self.max_unsigned_body = max_unsigned_body
        self.idle_timeout = idle_timeout
        self.unsigned_body_timeout = unsigned_body_timeout
        self.scheme = scheme
        self._client_options: dict[str, Any] = {
            "verify": verify,
            "timeout": httpx.Timeout(timeout, connect=10.0),
            "limits": httpx.Limits(
                max_connections=UPSTREAM_CONNECTIONS, max_keepalive_connections=32
            ),
            "transport": transport,
            "follow_redirects": False,
            "trust_env": False,  # never route the SuperLink's traffic through a proxy
        }
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(**self._client_options)
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
        client = (scope.get("client") or ("?", 0))[0]
        method, path = scope["method"], scope["path"]
        if not allowed(method, path, scope.get("raw_path")):
            log.warning("refused %s %s from %s", method, _printable(path), client)
            await _reply(send, 403, b"forbidden: this port serves the Flower Fleet API only\n")
            return
        headers = _forward_headers(scope["headers"])
        signer = None if self.site_keys is None else self.site_keys.signer(headers)
        unsigned = self.site_keys is not None and signer is None
        limit = self.max_unsigned_body if unsigned else self.max_body
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            log.warning("refused %s %s from %s: content-length %r", method, path, client, length)
            await _reply(send, 400, b"")
            return
        if length is not None and int(length) > limit:
            await self._too_large(send, path, client, limit, f"content-length {length}", unsigned)
            return
        headers["x-forwarded-for"] = client
        headers["x-forwarded-proto"] = self.scheme
        received = [0]
        request = self.client.build_request(
            "POST",
            self.upstream + path,
            headers=headers,
            content=self._body(receive, received, limit, unsigned),
        )
        try:
            response = await self.client.send(request, stream=True)
        except _BodyTooLarge:
            await self._too_large(send, path, client, limit, f"body over {limit} bytes", unsigned)
            return
        except _TooSlow:
            log.warning("refused %s from %s: unsigned body too slow", path, client)
            await _reply(send, 408, b"request body too slow\n")
            return
        except _ClientGone:
            log.info("%s from %s: client went away", path, client)
            return
        except httpx.TimeoutException as err:
            log.error("%s from %s: upstream timeout (%s)", path, client, type(err).__name__)
            await _reply(send, 504, b"upstream timeout\n")
            return
        except httpx.HTTPError as err:
            log.error("%s from %s: upstream unreachable (%s)", path, client, err)
            await _reply(send, 502, b"upstream unavailable\n")
            return
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
        except httpx.HTTPError as err:  # upstream broke mid-response: drop the connection
            log.error("%s from %s: upstream failed mid-response (%s)", path, client, err)
        finally:
            await response.aclose()
        if response.status_code == 401:
            _log_clock_skew(headers, path, client)
        log.log(
            logging.DEBUG if response.status_code < 400 else logging.INFO,
            "%s (%s) %s %d in=%d out=%d %.0fms",
            client,
            signer or "unsigned",
            path,
            response.status_code,
            received[0],
            sent,
            (time.monotonic() - started) * 1000,
        )

    async def _too_large(
        self, send: Send, path: str, client: str, limit: int, what: str, unsigned: bool
    ) -> None:
        """413 for a body over what the protocol needs; 401 for an unsigned one over the
        unsigned limit (a registered site's signature would have let it through)."""
        log.warning("refused %s from %s: %s%s", path, client, what, " unsigned" if unsigned else "")
        if unsigned:
            message = f"a body over {limit} bytes needs a signature by a registered site key\n"
            await _reply(send, 401, message.encode())
        else:
            await _reply(send, 413, f"request body over {limit} bytes\n".encode())

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


def _log_clock_skew(headers: dict[str, str], path: str, client: str) -> None:
    """A 401 to a call whose signed timestamp is outside Flower's window: Flower's answer is
    the same as for a removed key, so say what it was (``server.ops.clock``), with the key."""
    offset = clock.signed_offset(headers.get(TIMESTAMP_HEADER, ""))
    if offset is None or not clock.refused(offset):
        return
    try:
        key = pki.fingerprint(base64.b64decode(headers.get(PUBLIC_KEY_HEADER, "")))
    except (pki.SiteKeyError, ValueError):
        key = "(no key)"
    log.warning("refused %s from %s: %s %+.1f s key %s (%s)", path, client, clock.SKEW_LINE,
                offset, key, clock.describe(offset))  # fmt: skip


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


# --- the process ---------------------------------------------------------------------------


def _setup_logging(log_file: Path | None, debug: bool = False) -> None:
    handler: logging.Handler
    if log_file is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(
            log_file, maxBytes=20 * 1024 * 1024, backupCount=5
        )
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("starfed.gateway", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(logging.DEBUG if debug else logging.INFO)
        logger.propagate = False


def _tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server side of TLS 1.2 or later, with the gateway's certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


async def _exit_with(server: uvicorn.Server, process: ProcessId) -> None:
    """Stop when ``process`` (the SuperLink) ends: a gateway to nothing only misleads. Not
    being able to look (``/proc`` unreadable: out of file handles or memory) is the gateway's
    own trouble, not the SuperLink's end: logged, and it keeps serving."""
    while True:
        try:
            if not process.alive():
                break
        except OSError as err:
            log.warning(
                "cannot read the upstream process %d's status (%s): the gateway's own "
                "resources, not the SuperLink's end; still serving",
                process.pid,
                err,
            )
        await asyncio.sleep(2.0)
    log.warning("upstream process %d ended; shutting down", process.pid)
    server.should_exit = True


def _raise_open_files_limit() -> int:
    """Every connection is a file descriptor; the usual soft limit (1024) would run out before
    the connection limit does, and then nobody gets in. The limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def _fit_open_files(guard: ConnectionGuard, files: int) -> None:
    """Lower the guard's limits to what the open-file limit leaves after the upstream's
    connections and the process's own files: a gateway out of file handles cannot even accept a
    connection to close it (asyncio then logs and retries every accept), so it refuses them
    while it still has handles."""
    budget = max(2, files - UPSTREAM_CONNECTIONS - OWN_FILES)
    if guard.max_connections + guard.max_handshakes <= budget:
        return
    asked = guard.max_connections, guard.max_handshakes
    guard.max_handshakes = max(1, min(guard.max_handshakes, budget // 5))
    guard.max_connections = budget - guard.max_handshakes
    log.warning("open-file limit %d: at most %d connections and %d TLS handshakes (asked: %d "
                "and %d)", files, guard.max_connections, guard.max_handshakes, *asked)  # fmt: skip


def serve(args: argparse.Namespace) -> None:
    host, port = parse_address(args.listen)
    upstream = args.upstream
    tls = args.cert is not None
    verify: ssl.SSLContext | bool = (
        ssl.create_default_context(cafile=str(args.ca)) if upstream.startswith("https") else False
    )
    app = FleetGateway(
        upstream,
        verify=verify,
        max_body=args.max_body_mib * 1024 * 1024,
        site_keys=SiteKeys(args.site_keys) if args.site_keys else None,
        unsigned_body_timeout=args.header_timeout,
        timeout=args.timeout,
        scheme="https" if tls else "http",
    )
    guard = ConnectionGuard(
        max_connections=args.max_connections,
        per_address=args.max_per_address,
        header_timeout=args.header_timeout,
        max_handshakes=args.max_handshakes,
        handshakes_per_address=args.max_handshakes_per_address,
        handshake_timeout=args.handshake_timeout,
    )
    _fit_open_files(guard, _raise_open_files_limit())
    # The handshake is the guard's (connection_guard.TlsGate): uvicorn listens on plain TCP, on
    # asyncio's own loop, whose TLS read buffer can be made small (this process's only).
    sslproto.SSLProtocol.max_size = TLS_READ_BUFFER
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="asyncio",
        http=guard.protocol_class(_tls_context(args.cert, args.key) if tls else None),
        ws="none",  # the Fleet API has no websockets: never upgrade
        log_config=None,
        access_log=False,
        proxy_headers=False,  # the client's own X-Forwarded-For means nothing here
        server_header=False,
        limit_concurrency=None,  # the guard's limits instead: uvicorn's counts slow connections
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    log.info(
        "fleet gateway on %s:%d (%s) -> %s, max body %d MiB (%s), %d connections, %d per "
        "address, headers within %g s, %d TLS handshakes, %d per address, within %g s",
        host,
        port,
        "TLS" if tls else "PLAIN HTTP",
        upstream,
        args.max_body_mib,
        f"signed by a key of {args.site_keys}" if args.site_keys else "no signature check",
        args.max_connections,
        args.max_per_address,
        args.header_timeout,
        args.max_handshakes,
        args.max_handshakes_per_address,
        args.handshake_timeout,
    )

    async def main() -> None:
        watcher = None
        if args.exit_with and (process := ProcessId.of(args.exit_with)):
            watcher = asyncio.create_task(_exit_with(server, process))
        try:
            await server.serve()
        finally:
            if watcher:
                watcher.cancel()

    asyncio.run(main())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m starfed.server.ops.gateway",
        description="TLS gateway that forwards only POST /v1/fleet/* to a Flower SuperLink.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--listen", required=True, help="public HOST:PORT")
    p.add_argument("--upstream", required=True, help="SuperLink URL, e.g. https://127.0.0.1:9093")
    p.add_argument("--ca", type=Path, help="CA certificate that signed the SuperLink's")
    p.add_argument("--cert", type=Path, help="server certificate (omit for plain HTTP)")
    p.add_argument("--key", type=Path, help="server private key")
    p.add_argument("--log-file", type=Path, help="log here instead of stderr (rotated)")
    p.add_argument(
        "--site-keys",
        type=Path,
        help="sites.json of `starfed server sites`: only calls signed by one of its keys may "
        "send more than 64 KiB (omit for plain HTTP, where Flower authenticates no one)",
    )
    p.add_argument(
        "--max-body-mib",
        type=int,
        default=MAX_BODY_BYTES >> 20,
        help="largest body of a signed call (the codebook wire limit plus an envelope)",
    )
    p.add_argument("--timeout", type=float, default=UPSTREAM_TIMEOUT_S, help="upstream, seconds")
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="then the oldest connection without a request is closed",
    )
    p.add_argument("--max-per-address", type=int, default=MAX_PER_ADDRESS)
    p.add_argument(
        "--header-timeout", type=float, default=HEADER_TIMEOUT_S, help="seconds per request"
    )
    p.add_argument("--max-handshakes", type=int, default=MAX_HANDSHAKES,
                   help="TLS handshakes under way at once; more are closed at once")  # fmt: skip
    p.add_argument("--max-handshakes-per-address", type=int, default=MAX_HANDSHAKES_PER_ADDRESS)
    p.add_argument("--handshake-timeout", type=float, default=HANDSHAKE_TIMEOUT_S,
                   help="seconds a TLS handshake may take")  # fmt: skip
    p.add_argument("--exit-with", type=int, help="PID: stop when this process ends")
    p.add_argument("--debug", action="store_true", help="log every forwarded call too")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.cert is None) != (args.key is None):
        parser.error("--cert and --key go together")
    if args.upstream.startswith("https") and args.ca is None:
        parser.error("an https upstream needs --ca")
    try:
        parse_address(args.listen)
    except ValueError as err:
        parser.error(str(err))
    _setup_logging(args.log_file, args.debug)
    serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
