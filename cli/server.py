"""``starfed server ...``: the operator's commands (docs/deployment.md).

Every action works on one server folder (``--dir``, default ``$STARFED_SERVER_DIR`` or
``./starfed-server``; ``starfed.server.ops.layout``). Exit codes: 0 done, 1 failed (a process would
not start, Flower refused), 2 bad input (arguments, key files, names). ``--json`` prints one JSON
object for scripts instead of text for people.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from starfed.cli import inference_server
from starfed.server.ops import certs, pki, processes, sites, superlink
from starfed.server.ops.layout import DIR_ENV, ServerFolder, default_dir
from starfed.shared import addresses

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(ValueError):
    """A bad argument value; one line, exit code 2."""


#: Errors that mean bad input (exit 2) and errors that mean something failed (exit 1).
USAGE_ERRORS: tuple[type[Exception], ...] = (
    UsageError,
    certs.CertError,
    pki.SiteKeyError,
    inference_server.BadInput,
)
FAILURES: tuple[type[Exception], ...] = (
    inference_server.Failed,
    superlink.ServerError,
    sites.SitesError,
    processes.ProcessError,
    OSError,
)


def common_options() -> argparse.ArgumentParser:
    """``--dir`` and ``--json``, accepted by every ``server`` action (after the action name)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"server folder (default: ${DIR_ENV} or ./starfed-server)",
    )
    parent.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parent


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``server`` and its actions on the root CLI."""
    parser = subparsers.add_parser(
        "server",
        help="run the federation's server: certificates, SuperLink, sites",
        description=(
            "The operator's commands. A first deployment: `certs --host NAME --site A --site "
            "B`, `start`, `sites add A site-keys/A.pub`, ...; see docs/deployment.md."
        ),
    )
    actions = parser.add_subparsers(dest="server_action", metavar="ACTION", required=True)
    common = common_options()

    p = actions.add_parser(
        "certs",
        parents=[common],
        help="create the CA, the server certificate and site key pairs (idempotent)",
        description=(
            "Create what is missing of: a private CA (certs/ca.pem, certs/ca.key), the server "
            "certificate for the names sites dial (plus 127.0.0.1 and localhost), and key pairs "
            "for sites that do not make their own (site-keys/NAME.key + .pub). Existing files "
            "are kept."
        ),
    )
    p.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME",
        help="public host name or IP address sites dial (repeatable)",
    )
    p.add_argument(
        "--site", action="append", default=[], metavar="NAME", help="make a key pair (repeatable)"
    )
    p.add_argument(
        "--renew-server",
        action="store_true",
        help="new server certificate from the existing CA (e.g. for a new --host)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the CA and all keys: every site then needs the new ca.pem and keys",
    )
    p.set_defaults(func=run_certs)

    p = actions.add_parser(
        "start",
        parents=[common],
        help="start the SuperLink, its SuperExec and the fleet-only gateway in the background",
        description=(
            "Start the federation's server in the background: a Flower SuperLink on "
            "127.0.0.1:INTERNAL_PORT (TLS, SuperNode authentication, state in superlink.db), a "
            "SuperExec for ServerApps, and a TLS gateway on --listen that forwards only the "
            "Fleet API (what sites use). The SuperLink's port serves Flower's Control API "
            "without authentication: it is never exposed. Writes flwr-home/config.toml for the "
            "operator's own `flwr` (run it with FLWR_HOME=DIR/flwr-home)."
        ),
    )
    p.add_argument(
        "--listen",
        default=superlink.DEFAULT_LISTEN,
        help="public HOST:PORT of the gateway (default: %(default)s)",
    )
    p.add_argument(
        "--internal-port",
        type=int,
        default=superlink.DEFAULT_INTERNAL_PORT,
        help="the SuperLink's port on 127.0.0.1, serving Fleet, Control and Runtime APIs "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--isolation",
        choices=("process", "subprocess"),
        default="process",
        help="process: our SuperExec, authenticated with a shared secret; subprocess: "
        "Flower's own (its task API is then open to local users) (default: %(default)s)",
    )
    p.add_argument(
        "--max-body-mib",
        type=int,
        default=128,
        help="gateway request size limit (default: %(default)s)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plain HTTP and no SuperNode authentication: for a local test only",
    )
    p.add_argument(
        "--foreground",
        action="store_true",
        help="stay attached; stop everything on Ctrl-C/SIGTERM or when a process dies "
        "(for systemd)",
    )
    p.set_defaults(func=run_start)

    p = actions.add_parser(
        "stop",
        parents=[common],
        help="stop what `start` started (by PID), report anything that survived",
        description="SIGTERM, then SIGKILL after a grace period, for the recorded processes "
        "and their children; exit 1 if any survived.",
    )
    p.set_defaults(func=run_stop)

    inference_server.add_actions(actions, common, _guard)  # export, serve
    # They build on this module's helpers: imported once it is loaded.
    from starfed.cli import federation, server_sites

    server_sites.add_actions(actions, common)
    federation.add_actions(actions, common)


# --- helpers -------------------------------------------------------------------------------


def _folder(args: argparse.Namespace) -> ServerFolder:
    return ServerFolder.at(args.dir if args.dir is not None else default_dir())


def _console() -> Console:
    """Rich output for people; wide when piped, so ids and fingerprints are never cut."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def _emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """One line on stderr and the right exit code for every expected error."""

    @functools.wraps(func)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except USAGE_ERRORS as err:
            _error(args, err, EXIT_USAGE)
            return EXIT_USAGE
        except FAILURES as err:
            _error(args, err, EXIT_FAILED)
            return EXIT_FAILED
        except KeyboardInterrupt:  # start cleans up after itself; say so in one line
            _error(args, RuntimeError("interrupted"), EXIT_FAILED)
            return EXIT_FAILED

    return wrapped


def _error(args: argparse.Namespace, err: Exception, code: int) -> None:
    action = " ".join(
        a for a in ("server", args.server_action, getattr(args, "sites_action", None)) if a
    )
    message = " ".join(str(err).split())
    if getattr(args, "json", False):
        _emit_json({"success": False, "error": message, "exit_code": code})
    print(f"starfed {action}: error: {message}", file=sys.stderr)


# --- certs ---------------------------------------------------------------------------------


@_guard
def run_certs(args: argparse.Namespace) -> int:
    folder = _folder(args)
    report = certs.ensure_certificates(
        folder, args.host, args.site, force=args.force, renew_server=args.renew_server
    )
    if args.json:
        _emit_json(
            {
                "success": True,
                "written": [str(p) for p in report.written],
                "kept": [str(p) for p in report.kept],
                "server_names": report.sans,
                "ca_certificate": str(folder.ca_cert),
                "sites": {
                    name: {
                        "private_key": str(folder.site_key(name)),
                        "public_key": str(pki.public_key_path(folder.site_key(name))),
                        "fingerprint": key.fingerprint,
                    }
                    for name, key in report.sites.items()
                },
            }
        )
        return EXIT_OK
    for path in report.written:
        print(f"wrote {path}")
    for path in report.kept:
        print(f"kept  {path}")
    print(f"server certificate valid for: {', '.join(report.sans)}")
    if not [s for s in report.sans if s not in certs.LOCAL_NAMES]:
        print(
            "note: only local names; remote sites need --host <the name they dial> "
            "(with --renew-server once a certificate exists)"
        )
    print(f"every site needs: {folder.ca_cert}")
    for name, key in report.sites.items():
        public = pki.public_key_path(folder.site_key(name))
        print(
            f"site {name}: key {key.fingerprint}; send it {folder.site_key(name)} (private: over "
            f"a safe channel) and ca.pem; register it: starfed server sites add {name} {public}"
        )
    print(f"keep {folder.ca_key} private (an offline copy is best)")
    return EXIT_OK


# --- start / stop --------------------------------------------------------------------------


def _options(args: argparse.Namespace) -> superlink.ServerOptions:
    try:
        host, port = addresses.parse_address(args.listen)
    except ValueError as err:
        raise UsageError(f"--listen: {err}") from None
    if not 0 < args.internal_port < 65536:
        raise UsageError(f"--internal-port must be 1-65535, got {args.internal_port}")
    if args.max_body_mib < 1:
        raise UsageError("--max-body-mib must be at least 1")
    return superlink.ServerOptions(
        listen_host=host,
        listen_port=port,
        internal_port=args.internal_port,
        insecure=args.insecure,
        isolation=args.isolation,
        max_body_mib=args.max_body_mib,
    )


@_guard
def run_start(args: argparse.Namespace) -> int:
    folder = _folder(args)
    options = _options(args)
    if options.insecure:
        print(
            "WARNING: --insecure: plain HTTP, no TLS, NO SuperNode authentication: anyone who "
            f"reaches {options.public_address} can join as a site. Local tests only.",
            file=sys.stderr,
        )
    record = superlink.start(folder, options)
    names = list(superlink.public_names(folder, options))
    summary = {
        "success": True,
        "server_dir": str(folder.root),
        "sites_connect_to": names,
        "listen": options.public_address,
        "ca_certificate": None if options.insecure else str(folder.ca_cert),
        "internal_address": options.internal_address,
        "flwr_home": str(folder.flwr_home),
        "logs": {
            "superlink": str(folder.superlink_log),
            "gateway": str(folder.gateway_log),
            "process_output": str(folder.logs),
        },
        "processes": {p.name: p.pid for p in record.processes},
        "insecure": options.insecure,
        "isolation": options.isolation,
    }
    if args.json:
        _emit_json(summary)
    else:
        _print_started(folder, options, names, record)
    if not args.foreground:
        return EXIT_OK
    reason = superlink.wait_foreground(record)
    report = superlink.stop(folder)
    print(f"stopping ({reason}): {', '.join(report.stopped) or 'nothing was running'}")
    return EXIT_FAILED if report.survivors or not reason.startswith("SIG") else EXIT_OK


def _print_started(
    folder: ServerFolder,
    options: superlink.ServerOptions,
    names: list[str],
    record: superlink.RunRecord,
) -> None:
    rows = [
        (
            "sites connect to",
            f"{', '.join(names)}  (gateway on {options.public_address}, Fleet API only)",
        )
    ]
    if not options.insecure:
        rows.append(("CA certificate", f"{folder.ca_cert}  (send it to every site)"))
    rows += [
        (
            "SuperLink",
            f"{options.internal_address}  (keep private: Flower's Control API has "
            "no authentication)",
        ),
        ("operator's flwr", f"FLWR_HOME={folder.flwr_home} flwr ls"),
        ("logs", f"{folder.superlink_log}  (refused sites: `starfed server sites refused`)"),
        ("", f"{folder.gateway_log}; process output {folder.logs}/*.out"),
        ("processes", ", ".join(f"{p.name} {p.pid}" for p in record.processes)),
        ("stop", f"starfed server stop --dir {folder.root}"),
    ]
    print(f"starfed server running in {folder.root}")
    for key, value in rows:
        print(f"  {key:<17} {value}")


@_guard
def run_stop(args: argparse.Namespace) -> int:
    folder = _folder(args)
    report = superlink.stop(folder)
    survivors = [p.pid for p in report.survivors]
    if args.json:
        _emit_json(
            {
                "success": not survivors,
                "was_running": report.was_running,
                "stopped": report.stopped,
                "survivors": survivors,
            }
        )
    elif not report.was_running:
        print(f"nothing to stop: no run file in {folder.root}")
    else:
        print(f"stopped: {', '.join(report.stopped) or 'nothing was still running'}")
    if survivors:
        print(f"starfed server stop: error: still running: PIDs {survivors}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
