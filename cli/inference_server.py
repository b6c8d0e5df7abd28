"""``starfed server export|serve``: the federation's codebook for inference-only devices.

``export`` writes the deployable codebook (finished classes, no mixtures) and its model card;
``serve`` answers devices that follow the federation over gRPC with TLS (``starfed predict
--from``). Both read the federation folder and load no backbones. Registered on the ``server``
command by ``starfed.cli.server``, whose guard gives every error one line and its exit code.
docs/inference.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from starfed.cli.predict import positive_int

Handler = Callable[[argparse.Namespace], int]
DEFAULT_LISTEN = "0.0.0.0:9095"


class BadInput(ValueError):
    """Not a federation folder, a bad address; exit 2."""


class Failed(RuntimeError):
    """Nothing to export or serve yet, a port in use; exit 1."""


def add_actions(
    actions: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    guard: Callable[[Handler], Handler],
) -> None:
    federation = argparse.ArgumentParser(add_help=False)
    federation.add_argument(
        "--federation", type=Path, required=True, metavar="FEDERATION", help="federation folder"
    )
    p = actions.add_parser(
        "export",
        parents=[federation],
        help="write a deployable codebook (finished classes, no mixtures) and its model card",
        description=(
            "Write the federation's deployable codebook for inference-only devices: finished "
            "classes only (a step in progress is left out, and named), no mixtures, class names "
            "and the step that registered each, the backbone fingerprint; and <out>.card.json "
            "with the classes, sites, backbones and the federation's scores."
        ),
    )
    p.add_argument("--out", type=Path, help="codebook file (default: codebook-v<VERSION>.bin here)")
    p.add_argument("--float16", action="store_true", help="tensors in float16 (half the bytes)")
    p.add_argument("--json", action="store_true", help="the model card as one JSON object")
    p.set_defaults(func=guard(run_export))

    p = actions.add_parser(
        "serve",
        parents=[common, federation],
        help="serve the deployable codebook to devices over gRPC/TLS (`predict --from`)",
        description=(
            "Answer devices that follow the federation: each sends the version it holds and gets "
            "the current deployable codebook, the delta since its version, or 'unchanged'. The "
            "folder is read again when it changes. TLS with the server folder's certificate "
            "(certs/server.pem, certs/server.key; `starfed server certs`). Stops on Ctrl-C."
        ),
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT (default: %(default)s)")
    p.add_argument("--cert", type=Path, help="server certificate (default: DIR/certs/server.pem)")
    p.add_argument("--key", type=Path, help="its private key (default: DIR/certs/server.key)")
    p.add_argument(
        "--insecure", action="store_true", help="no TLS: only on a loopback address, for tests"
    )
    p.add_argument("--float16", action="store_true", help="send tensors in float16")
    p.add_argument(
        "--max-mib", type=positive_int, default=64, help="largest reply (default: %(default)s)"
    )
    p.set_defaults(func=guard(run_serve))


def _federation(path: Path):
    from starfed.server.federation import Federation, FederationError
    from starfed.shared.codebook.codebook import CodebookError

    try:
        federation = Federation.open(path)
        federation.codebook()  # a damaged codebook.bin is bad input, found here
    except (FederationError, CodebookError) as err:
        raise BadInput(str(err)) from None
    return federation


def run_export(args: argparse.Namespace) -> int:
    from starfed.server.federation import FederationError
    from starfed.server.serving import export

    federation = _federation(args.federation)
    dtype = "float16" if args.float16 else "float32"
    try:
        result = export.deployable(federation)
        out = args.out or Path(f"codebook-v{result.codebook.version}.bin")
        out.parent.mkdir(parents=True, exist_ok=True)
        card = export.write(federation, result, out, dtype)
    except FederationError as err:
        raise BadInput(str(err)) from None
    except export.NothingToExport as err:
        raise Failed(str(err)) from None
    if args.json:
        print(json.dumps({"success": True, "codebook": str(out),
                          "card": str(export.card_path(out)), **card}, indent=2))  # fmt: skip
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
    from starfed.server.ops.layout import ServerFolder, default_dir
    from starfed.server.serving import distribution

    folder = ServerFolder.at(args.dir if args.dir is not None else default_dir())
    _federation(args.federation)
    options = distribution.ServeOptions(
        federation=args.federation,
        listen=args.listen,
        cert=None if args.insecure else (args.cert or folder.server_cert),
        key=None if args.insecure else (args.key or folder.server_key),
        insecure=args.insecure,
        dtype="float16" if args.float16 else "float32",
        max_bytes=args.max_mib * 2**20,
    )
    try:
        distribution.check(options)
    except distribution.ServeError as err:
        raise BadInput(str(err)) from None
    if args.insecure:
        print("WARNING: --insecure: codebooks in plain text, no server authentication; for a "
              "test on this machine only", file=sys.stderr)  # fmt: skip
    try:
        server, servicer, port = distribution.start(options)
    except distribution.ServeError as err:
        raise Failed(str(err)) from None
    current = servicer.current().codebook
    info = {"listen": args.listen, "port": port, "tls": not args.insecure,
            "federation": current.metadata["federation"], "version": current.version,
            "classes": len(current), "ca_certificate": None if args.insecure else
            str(folder.ca_cert)}  # fmt: skip
    if args.json:
        print(json.dumps(info), flush=True)
    else:
        print(f"serving federation {info['federation'][:8]} codebook version {current.version} "
              f"({len(current)} classes) on port {port} ({'TLS' if info['tls'] else 'plain'}); "
              "devices: starfed predict --from HOST:PORT --ca ca.pem; Ctrl-C stops",
              flush=True)  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    server.stop(grace=2.0).wait()
    return 0
