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

The requests it forwards and refuses, and how much each may send, are
``starfed.server.ops.fleet_proxy``'s; this module is the process: TLS (its handshake under
``connection_guard``'s limits), the open-file budget, logging, following the SuperLink's life,
and the command line.

Run: ``python -m starfed.server.ops.gateway --listen 0.0.0.0:9092 --upstream https://127.0.0.1:9093
--ca ca.pem --cert server.pem --key server.key --site-keys sites.json --log-file gateway.log``
(``starfed server start`` does this).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.handlers
import resource
import ssl
import sys
from asyncio import sslproto
from pathlib import Path

import uvicorn

from starfed.ops.processes import ProcessId
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
from starfed.server.ops.fleet_proxy import (
    MAX_BODY_BYTES,
    UPSTREAM_CONNECTIONS,
    UPSTREAM_TIMEOUT_S,
    FleetGateway,
)
from starfed.server.ops.fleet_signatures import SiteKeys
from starfed.shared.addresses import parse_address

OWN_FILES = 64  # the process's own: the listening socket, logs, /proc, the interpreter's

log = logging.getLogger("starfed.gateway")


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
    log.warning(
        "open-file limit %d: at most %d connections and %d TLS handshakes (asked: %d and %d)",
        files,
        guard.max_connections,
        guard.max_handshakes,
        *asked,
    )


def _app(args: argparse.Namespace) -> FleetGateway:
    """The request handler: the upstream, its certificate check, the signed-body limit."""
    upstream = args.upstream
    verify: ssl.SSLContext | bool = (
        ssl.create_default_context(cafile=str(args.ca)) if upstream.startswith("https") else False
    )
    return FleetGateway(
        upstream,
        verify=verify,
        max_body=args.max_body_mib * 1024 * 1024,
        site_keys=SiteKeys(args.site_keys) if args.site_keys else None,
        unsigned_body_timeout=args.header_timeout,
        timeout=args.timeout,
        scheme="https" if args.cert is not None else "http",
    )


def _guard(args: argparse.Namespace) -> ConnectionGuard:
    """The connection limits, lowered to what the open-file limit allows."""
    guard = ConnectionGuard(
        max_connections=args.max_connections,
        per_address=args.max_per_address,
        header_timeout=args.header_timeout,
        max_handshakes=args.max_handshakes,
        handshakes_per_address=args.max_handshakes_per_address,
        handshake_timeout=args.handshake_timeout,
    )
    _fit_open_files(guard, _raise_open_files_limit())
    return guard


def _server(args: argparse.Namespace, app: FleetGateway, guard: ConnectionGuard) -> uvicorn.Server:
    host, port = parse_address(args.listen)
    tls = _tls_context(args.cert, args.key) if args.cert is not None else None
    # The handshake is the guard's (connection_guard.TlsGate): uvicorn listens on plain TCP, on
    # asyncio's own loop, whose TLS read buffer can be made small (this process's only).
    sslproto.SSLProtocol.max_size = TLS_READ_BUFFER
    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            loop="asyncio",
            http=guard.protocol_class(tls),
            ws="none",  # the Fleet API has no websockets: never upgrade
            log_config=None,
            access_log=False,
            proxy_headers=False,  # the client's own X-Forwarded-For means nothing here
            server_header=False,
            limit_concurrency=None,  # the guard's limits instead: uvicorn's counts slow ones
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,
        )
    )


def _log_start(args: argparse.Namespace) -> None:
    log.info(
        "fleet gateway on %s (%s) -> %s, max body %d MiB (%s), %d connections, %d per "
        "address, headers within %g s, %d TLS handshakes, %d per address, within %g s",
        args.listen,
        "TLS" if args.cert is not None else "PLAIN HTTP",
        args.upstream,
        args.max_body_mib,
        f"signed by a key of {args.site_keys}" if args.site_keys else "no signature check",
        args.max_connections,
        args.max_per_address,
        args.header_timeout,
        args.max_handshakes,
        args.max_handshakes_per_address,
        args.handshake_timeout,
    )


def serve(args: argparse.Namespace) -> None:
    """Serve until stopped, or until the ``--exit-with`` process (the SuperLink) ends."""
    server = _server(args, _app(args), _guard(args))
    _log_start(args)

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
    p.add_argument(
        "--max-handshakes",
        type=int,
        default=MAX_HANDSHAKES,
        help="TLS handshakes under way at once; more are closed at once",
    )
    p.add_argument("--max-handshakes-per-address", type=int, default=MAX_HANDSHAKES_PER_ADDRESS)
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=HANDSHAKE_TIMEOUT_S,
        help="seconds a TLS handshake may take",
    )
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
