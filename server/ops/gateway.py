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

Robustness: request bodies stream through with a size limit (413 past it, checked from
Content-Length before anything is forwarded), body reads and upstream calls have timeouts, a
client that sends garbage gets an HTTP error and never stops the gateway, at most 512
connections are served at once (503 beyond), and every refusal and every forwarded call that
did not succeed is one line in the log file (all calls with ``--debug``); a call Flower refused
for its timestamp says so, with the clock difference (``server.ops.clock``). Built on uvicorn and
httpx, which Flower itself runs on.

Run: ``python -m starfed.server.ops.gateway --listen 0.0.0.0:9092 --upstream https://127.0.0.1:9093
--ca ca.pem --cert server.pem --key server.key --log-file gateway.log`` (``starfed server start``
does this).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import logging.handlers
import re
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from starfed.server.ops import clock, pki
from starfed.server.ops.flower_internals import FLEET_HTTP_PUBLIC_KEY_HEADER, TIMESTAMP_HEADER
from starfed.server.ops.processes import ProcessId
from starfed.shared.addresses import parse_address

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The only requests forwarded: POST to one Fleet API method (lower-case words and dashes).
FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z0-9-]{0,63}")
MAX_BODY_BYTES = 128 * 1024 * 1024
UPSTREAM_TIMEOUT_S = 120.0  # Flower's Fleet client gives up after 30 s per call
IDLE_TIMEOUT_S = 60.0  # longest pause between two pieces of a request body
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


class FleetGateway:
    """ASGI app: forward ``POST /v1/fleet/*`` to ``upstream``, refuse everything else.

    ``verify`` is how the upstream's certificate is checked (a CA file's context, or False for
    plain HTTP upstreams). ``transport`` replaces the network in tests.
    """

    def __init__(
        self,
        upstream: str,
        *,
        verify: ssl.SSLContext | bool = True,
        max_body: int = MAX_BODY_BYTES,
        timeout: float = UPSTREAM_TIMEOUT_S,
        idle_timeout: float = IDLE_TIMEOUT_S,
        scheme: str = "https",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.max_body = max_body
        self.idle_timeout = idle_timeout
        self.scheme = scheme
        self._client_options: dict[str, Any] = {
            "verify": verify,
            "timeout": httpx.Timeout(timeout, connect=10.0),
            "limits": httpx.Limits(max_connections=256, max_keepalive_connections=32),
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
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            status = 413 if length.isdigit() else 400
            log.warning("refused %s %s from %s: content-length %s", method, path, client, length)
            await _reply(send, status, b"request body too large\n" if status == 413 else b"")
            return
        headers["x-forwarded-for"] = client
        headers["x-forwarded-proto"] = self.scheme
        received = [0]
        request = self.client.build_request(
            "POST",
            self.upstream + path,
            headers=headers,
            content=self._body(receive, received),
        )
        try:
            response = await self.client.send(request, stream=True)
        except _BodyTooLarge:
            log.warning("refused %s from %s: body over %d bytes", path, client, self.max_body)
            await _reply(send, 413, b"request body too large\n")
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
            "%s %s %d in=%d out=%d %.0fms",
            client,
            path,
            response.status_code,
            received[0],
            sent,
            (time.monotonic() - started) * 1000,
        )

    async def _body(self, receive: Receive, received: list[int]) -> AsyncIterator[bytes]:
        """The request body as it arrives, at most ``max_body`` bytes, no long pauses."""
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout)
            except TimeoutError:
                raise _ClientGone from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            received[0] += len(chunk)
            if received[0] > self.max_body:
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
        key = pki.fingerprint(base64.b64decode(headers.get(FLEET_HTTP_PUBLIC_KEY_HEADER, "")))
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
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
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


def _tls_context_factory(config: uvicorn.Config, default: Callable[[], ssl.SSLContext]):
    context = default()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def _exit_with(server: uvicorn.Server, process: ProcessId) -> None:
    """Stop when ``process`` (the SuperLink) ends: a gateway to nothing only misleads."""
    while process.alive():
        await asyncio.sleep(2.0)
    log.warning("upstream process %d ended; shutting down", process.pid)
    server.should_exit = True


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
        timeout=args.timeout,
        scheme="https" if tls else "http",
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        proxy_headers=False,  # the client's own X-Forwarded-For means nothing here
        server_header=False,
        limit_concurrency=args.max_connections,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
        ssl_certfile=str(args.cert) if tls else None,
        ssl_keyfile=str(args.key) if tls else None,
        ssl_context_factory=_tls_context_factory if tls else None,
    )
    server = uvicorn.Server(config)
    log.info(
        "fleet gateway on %s:%d (%s) -> %s, max body %d MiB",
        host,
        port,
        "TLS" if tls else "PLAIN HTTP",
        upstream,
        args.max_body_mib,
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
    p.add_argument("--max-body-mib", type=int, default=MAX_BODY_BYTES >> 20)
    p.add_argument("--timeout", type=float, default=UPSTREAM_TIMEOUT_S, help="upstream, seconds")
    p.add_argument("--max-connections", type=int, default=512, help="then 503")
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
