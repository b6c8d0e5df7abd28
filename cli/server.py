"""``starfed server ...``: the operator's commands (docs/deployment.md).

Every action works on one server folder (``--dir``, default ``$STARFED_SERVER_DIR`` or
``./starfed-server``; ``starfed.server.ops.layout``). Exit codes (``starfed.cli._common``): 0 done,
1 failed (a process would not start, Flower refused), 2 bad input (arguments, key files, names).
``--json`` prints one JSON object for scripts instead of text for people. This module registers
the group: ``certs``, ``start``, ``stop`` and ``dashboard`` here; ``sites`` (``server_sites``),
``run``, ``resume``, ``status``, ``check`` and ``repair`` (``federation``), ``export`` and ``serve``
(``inference_server``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from starfed.cli import _common, federation, inference_server, server_audit, server_sites
from starfed.cli._common import (
    Failed,
    add_group,
    add_switches,
    emit_json,
    federation_option,
    guard,
    server_folder,
    server_options,
)
from starfed.cli.flags import add_command, parsed, same_name
from starfed.ops import pki, processes
from starfed.ops.exit_codes import EXIT_FAILED, EXIT_OK
from starfed.server.ops import certs, superlink
from starfed.server.ops.layout import ServerFolder
from starfed.shared import addresses
from starfed.shared.knob import ConfigError, as_float, as_int, as_str

START = "server start"  # the table of `start`'s own knobs
START_FLAGS = same_name("listen", "internal-port", "isolation", "max-body-mib", "max-per-address")
DASHBOARD = "server dashboard"
DASHBOARD_FLAGS = same_name("listen", "refresh-s")
guarded = guard(
    bad_input=(certs.CertError, pki.SiteKeyError),
    failed=(superlink.ServerError, processes.ProcessError),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """run the federation's server: certificates, SuperLink, sites

    The operator's commands. A first deployment: `certs --host NAME --site A --site B`, `start`,
    `sites add A site-keys/A.pub`, ...; see docs/deployment.md.
    """
    actions = add_group(subparsers, "server", add_parser)
    common = server_options()
    p = add_command(actions, "certs", guarded(run_certs), parents=[common])
    for name, text in (
        ("--host", "public host name or IP address sites dial (repeatable)"),
        ("--site", "make a key pair (repeatable)"),
    ):
        p.add_argument(name, action="append", default=[], metavar="NAME", help=text)
    add_switches(
        p,
        {
            "--renew-server": "new server certificate from the existing CA (e.g. for a new --host)",
            "--force": "replace the CA and all keys: every site then needs the new ca.pem and keys",
        },
    )

    p = add_command(
        actions, "start", guarded(run_start), START_FLAGS, parents=[common], table=START
    )
    add_switches(
        p,
        {
            "--insecure": "plain HTTP and no SuperNode authentication: for a local test only",
            "--foreground": "stay attached; stop everything on Ctrl-C/SIGTERM or when a process "
            "dies (for systemd)",
        },
    )

    add_command(actions, "stop", guarded(run_stop), parents=[common])
    p = add_command(
        actions,
        "dashboard",
        guarded(run_dashboard),
        DASHBOARD_FLAGS,
        parents=[common],
        table=DASHBOARD,
    )
    federation_option(p)
    add_switches(
        p,
        {
            "--allow-remote": "let --listen be an address other machines reach: the page has no "
            "authentication and no TLS (prefer an SSH tunnel)"
        },
    )
    inference_server.add_actions(actions, common)  # export, serve
    server_sites.add_actions(actions, common)  # sites add|list|remove|refused
    federation.add_actions(actions, common)  # run, resume, status, check, repair
    server_audit.add_action(actions, common)  # audit


# --- certs ---------------------------------------------------------------------------------


def run_certs(args: argparse.Namespace) -> int:
    """create the CA, the server certificate and site key pairs (idempotent)

    Create what is missing of: a private CA (certs/ca.pem, certs/ca.key), the server certificate
    for the names sites dial (plus 127.0.0.1 and localhost), and key pairs for sites that do not
    make their own (site-keys/NAME.key + .pub). Existing files are kept.
    """
    folder = server_folder(args)
    report = certs.ensure_certificates(
        folder, args.host, args.site, force=args.force, renew_server=args.renew_server
    )
    if args.json:
        emit_json(
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
    _, own, _ = parsed(args, START_FLAGS, START)
    host, port = addresses.parse_address(as_str(own, "listen"))  # checked by the knob
    return superlink.ServerOptions(
        listen_host=host,
        listen_port=port,
        internal_port=as_int(own, "internal-port"),
        insecure=args.insecure,
        isolation=as_str(own, "isolation"),
        max_body_mib=as_int(own, "max-body-mib"),
        max_per_address=as_int(own, "max-per-address"),
    )


def run_start(args: argparse.Namespace) -> int:
    """start the SuperLink, its SuperExec and the fleet-only gateway in the background

    Start the federation's server in the background: a Flower SuperLink on
    127.0.0.1:INTERNAL_PORT (TLS, SuperNode authentication, state in superlink.db), a SuperExec
    for ServerApps, and a TLS gateway on --listen that forwards only the Fleet API (what sites
    use). The SuperLink's port serves Flower's Control API without authentication: it is never
    exposed. Writes flwr-home/config.toml for the operator's own `flwr` (run it with
    FLWR_HOME=DIR/flwr-home).
    """
    folder = server_folder(args)
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
        emit_json(summary)
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
    listening = f"gateway listens on {options.public_address}"
    if addresses.is_wildcard(options.listen_host):
        listening += ": all interfaces, a bind address, not one sites can dial"
    where = "names in the server certificate"
    if options.insecure:
        where = "no TLS: or any other name or address of this machine"
    rows = [("sites connect to", f"{', '.join(names)}  ({where}; {listening}; Fleet API only)")]
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
        ("processes", record.pids()),
        ("stop", f"starfed server stop --dir {folder.root}"),
    ]
    print(f"starfed server running in {folder.root}")
    for key, value in rows:
        print(f"  {key:<17} {value}")


def run_stop(args: argparse.Namespace) -> int:
    """stop what `start` started (by PID), report anything that survived

    SIGTERM, then SIGKILL after a grace period, for the recorded processes and their children;
    exit 1 if any survived.
    """
    folder = server_folder(args)
    report = superlink.stop(folder)
    survivors = [p.pid for p in report.survivors]
    if args.json:
        emit_json(
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


# --- dashboard -------------------------------------------------------------------------------


def run_dashboard(args: argparse.Namespace) -> int:
    """serve a read-only web page of the federation, live while a run is under way

    Serve the federation at a glance as a web page that updates itself every --refresh-s
    seconds: the sites (online, last seen, registered and refused keys), the steps over time
    with their status and the phase under way, the accuracy by arrival step and per site, the
    accuracy matrix, the classes and who brought them, bytes per step, the logs. It reads the
    server folder and the federation folder as `status` does and never writes them; /api/state
    is the same as JSON. On 127.0.0.1 (no authentication): from your machine, `ssh -N -L
    9097:127.0.0.1:9097 SERVER`, then open http://localhost:9097. Ctrl-C stops.
    """
    from starfed.server.ops import dashboard

    _, own, _ = parsed(args, DASHBOARD_FLAGS, DASHBOARD)
    host, port = addresses.parse_address(as_str(own, "listen"))  # checked by the knob
    local = addresses.is_loopback(host)
    if not local and not args.allow_remote:
        raise ConfigError(
            f"--listen {own['listen']}: the dashboard has no authentication; keep it on "
            "127.0.0.1 and use an SSH tunnel, or add --allow-remote"
        )
    folder = server_folder(args)
    federation_dir = _common.federation_dir(args, folder)
    if not local:
        print(
            f"WARNING: --allow-remote: anyone who reaches {own['listen']} reads the federation's "
            "state and logs (no authentication, no TLS)",
            file=sys.stderr,
        )
    try:
        listening = dashboard.bind(host, port)
    except OSError as err:
        why = os.strerror(err.errno) if err.errno else str(err)
        raise Failed(f"{own['listen']} is in use or cannot be bound ({why})") from None
    url = f"http://{addresses.format_address(host, port)}/"
    if args.json:
        emit_json(
            {
                "success": True,
                "url": url,
                "server_dir": str(folder.root),
                "federation_dir": str(federation_dir),
                "pid": os.getpid(),
            }
        )
    else:
        print(
            f"dashboard of {folder.root} on {url} (read-only, every {own['refresh-s']:g} s); "
            f"from another machine: ssh -N -L {port}:127.0.0.1:{port} THIS-HOST, then "
            f"http://localhost:{port}/; Ctrl-C stops"
        )
    sys.stdout.flush()
    # uvicorn stops gracefully on SIGINT/SIGTERM and raises the signal again: both end here
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how it ends
        dashboard.serve(
            dashboard.Dashboard(folder, federation_dir, as_float(own, "refresh-s")), listening
        )
    return EXIT_OK
