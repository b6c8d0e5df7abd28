"""``starfed site ...``: a site engineer's commands (docs/deployment.md).

``keygen`` makes the site's key pair (the private key never leaves the site; the ``.pub`` goes to
the operator); ``start`` runs this site's SuperNode in the foreground until Ctrl-C. Exit codes:
0 done (or stopped when told), 1 failed (refused, wrong CA, the SuperNode died), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from starfed.client.ops import supernode
from starfed.server.ops import pki, processes

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``site`` and its actions on the root CLI."""
    parser = subparsers.add_parser(
        "site",
        help="join a federation as a site: key pair, SuperNode",
        description="A site's commands: `keygen` once, then `start` (see docs/deployment.md).",
    )
    actions = parser.add_subparsers(dest="site_action", metavar="ACTION", required=True)

    p = actions.add_parser(
        "keygen",
        help="make this site's key pair and print the public key and its fingerprint",
        description=(
            "Make an EC P-384 key pair: --out (private, mode 0600, stays here) and the same "
            "name with .pub (send it to the operator, who runs `starfed server sites add`)."
        ),
    )
    p.add_argument(
        "--out", type=Path, default=Path("site.key"), help="private key file (default: %(default)s)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing key")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=run_keygen)

    p = actions.add_parser(
        "start",
        help="run this site's SuperNode in the foreground (Ctrl-C stops it)",
        description=(
            "Connect this site to the federation: a Flower SuperNode with TLS (--ca) and the "
            "site's key (--key), given its data and state folders through a node-config file "
            "(data-dir, state-dir, site-name, device). Logs stream here and to "
            "STATE/logs/supernode.log. Ctrl-C or SIGTERM stops it cleanly."
        ),
    )
    p.add_argument("--server", required=True, help="HOST:PORT the operator gave you")
    p.add_argument("--ca", type=Path, help="the federation's ca.pem (from the operator)")
    p.add_argument("--key", type=Path, help="this site's private key (`starfed site keygen`)")
    p.add_argument("--data", type=Path, required=True, help="this site's data folder")
    p.add_argument(
        "--state",
        type=Path,
        help="this site's own writable folder (default: $XDG_DATA_HOME or "
        "~/.local/share, then starfed/sites/NAME)",
    )
    p.add_argument("--name", help="site name given to the ClientApp (default: the data folder's)")
    p.add_argument(
        "--device",
        default="auto",
        help="torch device for training: auto, cpu, cuda:0 (default: %(default)s)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plain HTTP, no key: only against a `server start --insecure` test server",
    )
    p.add_argument("--quiet", action="store_true", help="do not echo the SuperNode's log")
    p.add_argument(
        "--no-worker",
        action="store_true",
        help="no site worker: every message builds the model in its own process (slower)",
    )
    p.set_defaults(func=run_start)

    from starfed.cli import site_check  # its own module: it builds on this one

    site_check.add_action(actions)


def _fail(action: str, err: Exception, code: int) -> int:
    print(f"starfed site {action}: error: {' '.join(str(err).split())}", file=sys.stderr)
    return code


def run_keygen(args: argparse.Namespace) -> int:
    try:
        key = pki.write_site_key(args.out, f"starfed-site@{socket.gethostname()}", force=args.force)
    except pki.SiteKeyError as err:
        return _fail("keygen", err, EXIT_USAGE)
    except OSError as err:
        return _fail("keygen", err, EXIT_FAILED)
    public = pki.public_key_path(args.out)
    if args.json:
        print(
            json.dumps(
                {
                    "private_key": str(args.out.resolve()),
                    "public_key": str(public.resolve()),
                    "openssh": key.openssh,
                    "fingerprint": key.fingerprint,
                },
                indent=2,
            )
        )
        return EXIT_OK
    print(f"private key: {args.out}  (mode 0600; keep it here, back it up)")
    print(f"public key:  {public}  (send this file to the operator)")
    print(f"fingerprint: {key.fingerprint}")
    print(key.openssh)
    return EXIT_OK


def run_start(args: argparse.Namespace) -> int:
    try:
        options = supernode.prepare(
            args.server,
            args.data,
            ca=args.ca,
            key=args.key,
            state=args.state,
            name=args.name,
            device=args.device,
            insecure=args.insecure,
            worker=not args.no_worker,
        )
    except (ValueError, supernode.SiteError) as err:  # SiteKeyError is a ValueError
        return _fail("start", err, EXIT_USAGE)
    print(
        f"site {options.name} -> {options.server}"
        + (f", key {options.fingerprint}" if options.fingerprint else ", INSECURE (no TLS)")
    )
    print(f"data {options.data}; state {options.state}; log {options.state}/logs/supernode.log")
    sys.stdout.flush()
    try:
        outcome = supernode.run(options, echo=None if args.quiet else sys.stdout)
    except (supernode.SiteError, processes.ProcessError, OSError) as err:
        return _fail("start", err, EXIT_FAILED)
    if outcome.failure:
        print(f"starfed site start: error: {outcome.failure}", file=sys.stderr)
    elif outcome.stopped_by is None:
        print(
            f"starfed site start: error: the SuperNode exited with code {outcome.returncode}; "
            f"see {outcome.log_file}",
            file=sys.stderr,
        )
    else:
        print(f"stopped ({outcome.stopped_by})")
    if outcome.survivors:
        pids = sorted(p.pid for p in outcome.survivors)
        print(f"starfed site start: error: still running: PIDs {pids}", file=sys.stderr)
    return outcome.exit_code
