"""A site's worker: one long-lived process that answers every phase for its site.

In deployment Flower starts a fresh ClientApp process for every message (docs/deployment.md):
each would import torch, build the backbones and read the site's caches again, most of what a
message costs. ``starfed site start`` therefore runs this worker next to the SuperNode, and the
ClientApp, told so by its node config (``worker-socket``), forwards each message to it over a
Unix socket in the site's state folder and returns the reply: the heavy state is built once.

A frame is a 4-byte length and a JSON header, then an 8-byte length and raw bytes (the codebook
in, the update or report out: protobuf, never a pickle). The socket is created private to the
site's user. The worker answers through ``starfed.client.answer``, as a ClientApp process does.
This module imports nothing heavy at its top, so the forwarding ClientApp stays light and the
worker listens at once (``PRELOAD``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import socket
import socketserver
import struct
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
#: Its log lines, which ``site start`` reads (``client/ops/site_processes.told``): time, level,
#: logger, message.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

_HEADER = struct.Struct("<I")
_PAYLOAD = struct.Struct("<Q")
MAX_HEADER = 16 * 2**20  # a header holds configs and class names, never tensors
MAX_PAYLOAD = 1024 * 2**20


class WorkerError(RuntimeError):
    """The worker could not answer (the message says why, in one line)."""


def _read_exactly(stream: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.recv(min(left, 2**20))
        if not chunk:
            raise WorkerError("the connection closed mid-frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_frame(stream: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    encoded = json.dumps(header).encode()
    stream.sendall(_HEADER.pack(len(encoded)) + encoded + _PAYLOAD.pack(len(payload)))
    # No empty write: the peer may already have answered the frame and closed, and a write
    # then fails with EPIPE (a sync without payload, lost on a loaded machine).
    if payload:
        stream.sendall(payload)


def read_frame(stream: socket.socket) -> tuple[dict[str, Any], bytes]:
    (size,) = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
    if size > MAX_HEADER:
        raise WorkerError(f"a frame header of {size} bytes is over the limit")
    header = json.loads(_read_exactly(stream, size))
    (size,) = _PAYLOAD.unpack(_read_exactly(stream, _PAYLOAD.size))
    if size > MAX_PAYLOAD:
        raise WorkerError(f"a frame payload of {size} bytes is over the limit")
    return header, _read_exactly(stream, size)


def request(path: str | Path, header: dict[str, Any], payload: bytes) -> list[tuple[str, bytes]]:
    """Ask the worker at ``path`` to answer one message: the reply's records, (name, bytes)
    each (their bytes travel back to back in one frame, their names and sizes in its header)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
        try:
            stream.connect(str(path))
        except OSError as err:
            raise WorkerError(f"no site worker at {path} ({err.strerror})") from None
        send_frame(stream, header, payload)
        reply, data = read_frame(stream)
    if not reply.get("ok"):
        raise WorkerError(str(reply.get("error", "the worker failed")))
    records, start = [], 0
    for name, size in zip(reply["records"], reply["sizes"], strict=True):
        records.append((str(name), data[start : start + int(size)]))
        start += int(size)
    if start != len(data):
        raise WorkerError(f"the reply's records hold {start} bytes, its frame {len(data)}")
    return records


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            header, payload = read_frame(self.request)
        except (WorkerError, ValueError, OSError) as err:
            logger.warning("dropped a malformed request: %s", err)
            return
        try:
            # Imported here, not above, so the worker listens before torch is loaded
            # (``PRELOAD`` loads it meanwhile), and inside the ``try`` so a failed import is
            # the reply's error; not a cycle: ``answer`` imports nothing from this module.
            from starfed.client.answer import answer

            with _Server.lock:  # one message at a time: they share the site's state
                records = answer(header, payload)
            names, sizes = [name for name, _ in records], [len(data) for _, data in records]
            reply = {"ok": True, "records": names, "sizes": sizes}
            send_frame(self.request, reply, b"".join(data for _, data in records))
        except Exception as err:  # reported to the ClientApp, which turns it into an error reply
            logger.exception("answering %s failed", header.get("phase"))
            send_frame(self.request, {"ok": False, "error": f"{type(err).__name__}: {err}"})


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    lock = threading.Lock()


#: What a site's first message would import (torch, torchvision, scikit-learn, scipy: ≈ 14 s of
#: a deployed step's first sync on 2 cores, measured); imported while the SuperNode connects.
PRELOAD = "starfed.client.answer"
#: The worker's last line when it cannot work (``site start`` shows what follows it).
CANNOT_START = "the site worker cannot start: "


def _preload(server: _Server, failed: list[str]) -> None:
    """Import what every message needs; if that fails no message can be answered, so the
    traceback goes to the log, the reason to the last line, and the worker stops."""
    try:
        importlib.import_module(PRELOAD)
    except Exception as err:  # any start-up failure: the site cannot work
        logger.exception("importing %s failed", PRELOAD)
        failed.append(f"{type(err).__name__}: {err}")
        server.shutdown()


def serve(path: str | Path) -> str | None:
    """Answer requests at ``path`` until interrupted (the socket file is private); the heavy
    modules are imported in the background meanwhile (a request that needs them first waits on
    Python's import lock). Returns why it stopped by itself: its start-up failed."""
    path = Path(path)
    path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        server = _Server(str(path), _Handler)
    finally:
        os.umask(old)
    failed: list[str] = []
    preload = threading.Thread(target=_preload, args=(server, failed), name="preload")
    preload.daemon = True
    preload.start()
    logger.info("site worker listening on %s", path)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        path.unlink(missing_ok=True)
    return failed[0] if failed else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path, help="Unix socket to listen on")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.captureWarnings(True)  # an unreadable image: a warning the site engineer reads
    failed = None
    with contextlib.suppress(KeyboardInterrupt):
        failed = serve(args.socket)
    if failed:
        logger.critical("%s%s", CANNOT_START, failed)
        logging.shutdown()
        # Nothing to clean up, and tearing down a half-imported torch took over a minute on a
        # loaded machine (measured): the site's start waits on this exit.
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
