"""``starfed server export|serve``: the federation's codebook for inference-only devices.

``export`` writes the deployable codebook (frozen classes, no mixtures) and its model card;
``serve`` answers devices that follow the federation over gRPC with TLS (``starfed predict
--from``). Both read the federation folder and load no backbones. Actions of the ``server``
group (``starfed.cli.server`` registers them); every error is one line with its exit code
(``starfed.cli._common.guard``). docs/inference.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from starfed.cli._common import (
    Failed,
    add_switches,
    federation_dir,
    federation_option,
    guard,
    server_folder,
)
from starfed.cli.flags import add_command, parsed, same_name
from starfed.shared.knob import ConfigError, as_int, as_str

SERVE = "server serve"  # the table of `serve`'s own knobs
SERVE_FLAGS = same_name("listen", "max-mib")


def add_actions(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``export`` and ``serve`` on the ``server`` group."""
    p = add_command(actions, "export", guard()(run_export), parents=[common])
    federation_option(p)
    p.add_argument("--out", type=Path, help="codebook file (default: codebook-v<VERSION>.bin here)")
    add_switches(p, {"--float16": "tensors in float16 (half the bytes)"})

    p = add_command(
        actions, "serve", guard()(run_serve), SERVE_FLAGS, parents=[common], table=SERVE
    )
    federation_option(p)
    p.add_argument("--cert", type=Path, help="server certificate (default: DIR/certs/server.pem)")
    p.add_argument("--key", type=Path, help="its private key (default: DIR/certs/server.key)")
    add_switches(
        p,
        {
            "--insecure": "no TLS: only on a loopback address, for tests",
            "--float16": "send tensors in float16",
        },
    )


def _federation(path: Path):
    from starfed.server.federation import Federation
    from starfed.server.folder_files import FederationError
    from starfed.shared.codebook.codebook import CodebookError

    try:
        federation = Federation.open(path)
        federation.checkpoints.codebook()  # a damaged codebook.bin is bad input, found here
    except (FederationError, CodebookError) as err:
        raise ConfigError(str(err)) from None
    return federation


def run_export(args: argparse.Namespace) -> int:
    """write a deployable codebook (frozen classes, no mixtures) and its model card

    Write the federation's deployable codebook for inference-only devices: frozen classes only
    (a step in progress is left out, and named), no mixtures, class names and the step that
    registered each, the backbone fingerprint; and <out>.card.json with the classes, sites,
    backbones and the federation's scores.
    """
    from starfed.server.folder_files import FederationError
    from starfed.server.serving import export

    federation = _federation(federation_dir(args, server_folder(args)))
    dtype = "float16" if args.float16 else "float32"
    try:
        result = export.deployable(federation)
        out = args.out or Path(f"codebook-v{result.codebook.version}.bin")
        out.parent.mkdir(parents=True, exist_ok=True)
        card = export.write(federation, result, out, dtype)
    except FederationError as err:
        raise ConfigError(str(err)) from None
    except export.NothingToExport as err:
        raise Failed(str(err)) from None
    if args.json:
        print(
            json.dumps(
                {"success": True, "codebook": str(out), "card": str(export.card_path(out)), **card},
                indent=2,
            )
        )
        return 0
    book, fingerprint = card["codebook"], card["backbones"]["fingerprint"]
    print(
        f"exported {out}: version {book['version']}, {book['classes']} classes, "
        f"{book['bytes']} bytes ({dtype}), backbones {fingerprint[:12]}"
    )
    print(f"model card {export.card_path(out)}")
    if result.left_out:
        print(f"left out (step in progress, not finished): {', '.join(result.left_out)}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """serve the deployable codebook to devices over gRPC/TLS (`predict --from`)

    Answer devices that follow the federation: each sends the version it holds and gets the
    current deployable codebook, the delta since its version, or 'unchanged'. The folder is read
    again when it changes. TLS with the server folder's certificate (certs/server.pem,
    certs/server.key; `starfed server certs`). Stops on Ctrl-C.
    """
    from starfed.server.serving import distribution

    _, own, _ = parsed(args, SERVE_FLAGS, SERVE)
    folder = server_folder(args)
    federation = federation_dir(args, folder)
    _federation(federation)
    options = distribution.ServeOptions(
        federation=federation,
        listen=as_str(own, "listen"),
        cert=None if args.insecure else (args.cert or folder.server_cert),
        key=None if args.insecure else (args.key or folder.server_key),
        insecure=args.insecure,
        dtype="float16" if args.float16 else "float32",
        max_bytes=as_int(own, "max-mib") * 2**20,
    )
    try:
        distribution.check(options)
    except distribution.ServeError as err:
        raise ConfigError(str(err)) from None
    if args.insecure:
        print(
            "WARNING: --insecure: codebooks in plain text, no server authentication; for a "
            "test on this machine only",
            file=sys.stderr,
        )
    try:
        server, servicer, port = distribution.start(options)
    except distribution.ServeError as err:
        raise Failed(str(err)) from None
    current = servicer.current().codebook
    info = {
        "listen": own["listen"],
        "port": port,
        "tls": not args.insecure,
        "federation": current.metadata["federation"],
        "version": current.version,
        "classes": len(current),
        "ca_certificate": None if args.insecure else str(folder.ca_cert),
    }
    if args.json:
        print(json.dumps(info), flush=True)
    else:
        served = current.metadata["federation"]
        print(
            f"serving federation {served[:8]} codebook version {current.version} "
            f"({len(current)} classes) on port {port} ({'TLS' if info['tls'] else 'plain'}); "
            "devices: starfed predict --from HOST:PORT --ca ca.pem; Ctrl-C stops",
            flush=True,
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    server.stop(grace=2.0).wait()
    return 0
