"""``starfed site ...``: a site engineer's commands (docs/deployment.md).

``keygen`` makes the site's key pair (the private key never leaves the site; the ``.pub`` goes to
the operator); ``start`` runs this site's SuperNode in the foreground until Ctrl-C; ``check``
(``starfed.cli.site_check``) says whether the site is ready to join; ``data``
(``starfed.cli.site_data``) writes a trial site's folder from the bundled images; ``leave`` writes
the site's signed request to be withdrawn (``starfed.ops.leave_request``). Exit codes
(``starfed.cli._common``): 0 done (or stopped when told), 1 failed (refused, wrong CA, the
SuperNode died), 2 bad input — every flag is checked before anything starts.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from starfed.cli import site_audit, site_check, site_data
from starfed.cli._common import add_group, add_switches, fail, guard
from starfed.cli.flags import Flag, add_command, device_flag, parsed, same_name
from starfed.client.ops import dialling, site_options, supernode
from starfed.ops import leave_request, pki, processes
from starfed.ops.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from starfed.shared.knob import as_float, as_str

KEYGEN, START = "site keygen", "site start"  # the tables of their own knobs
KEYGEN_FLAGS = same_name("out")
START_FLAGS = (
    device_flag("this site computes"),
    Flag(
        "--privacy-epsilon",
        ("privacy-epsilon",),
        help="this site's target epsilon for one "
        "of its training images over the federation's life (docs/security.md); 0: the run "
        "config's",
    ),
    Flag("--privacy-delta", ("privacy-delta",), help="this site's target delta"),
    Flag(
        "--privacy-unit",
        ("privacy-unit",),
        help="what the epsilon protects: one training "
        "image, or one patient (images named <patient>__<name>: docs/sites.md#patients)",
    ),
)
guarded = guard(bad_input=(pki.SiteKeyError, leave_request.LeaveRequestError))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """join a federation as a site: key pair, SuperNode

    A site's commands: `keygen` once, then `start` (see docs/deployment.md).
    """
    actions = add_group(subparsers, "site", add_parser)
    p = add_command(actions, "keygen", guarded(run_keygen), KEYGEN_FLAGS, table=KEYGEN)
    add_switches(p, {"--force": "replace an existing key", "--json": "one JSON object on stdout"})

    p = add_command(actions, "start", guarded(run_start), START_FLAGS, table=START)
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
        "--policy",
        type=Path,
        help="the site's policy, what it releases and to whom (default: STATE/policy.toml when "
        "there is one; docs/sites.md#for-a-governance-office)",
    )
    p.add_argument(
        "--give-up-after",
        type=float,
        default=dialling.GIVE_UP_S,
        metavar="SECONDS",
        help="stop (exit 1) when the server could not be reached once in this long since the "
        "first failed attempt (a wrong --server); once reached, it retries until the server is "
        "back; 0: never give up",
    )
    add_switches(
        p,
        {
            "--insecure": "plain HTTP, no key: only against a `server start --insecure` test "
            "server",
            "--quiet": "no progress lines on the terminal (the log keeps everything)",
            "--no-worker": "no site worker: every message builds the model in its own process "
            "(slower)",
        },
    )
    p = add_command(actions, "leave", guarded(run_leave))
    p.add_argument("--key", type=Path, required=True, help="this site's private key")
    p.add_argument("--name", required=True, help="the site name the operator registered")
    p.add_argument("--reason", default="", help="a line for the operator (kept in the record)")
    p.add_argument(
        "--out",
        type=Path,
        help="where to write the request (default: leave-request-NAME.json here)",
    )
    add_switches(
        p,
        {
            "--exact": "ask for the exact mode: the federation goes back to before this site's "
            "first step and runs the steps since again without it",
            "--json": "one JSON object on stdout",
        },
    )
    site_check.add_action(actions)
    site_audit.add_action(actions)
    site_data.add_action(actions)


def run_keygen(args: argparse.Namespace) -> int:
    """make this site's key pair and print the public key and its fingerprint

    Make an EC P-384 key pair: --out (private, mode 0600, stays here) and the same name with
    .pub (send it to the operator, who runs `starfed server sites add`).
    """
    _, own, _ = parsed(args, KEYGEN_FLAGS, KEYGEN)
    out = Path(as_str(own, "out"))
    key = pki.write_site_key(out, f"starfed-site@{socket.gethostname()}", force=args.force)
    public = pki.public_key_path(out)
    if args.json:
        print(
            json.dumps(
                {
                    "private_key": str(out.resolve()),
                    "public_key": str(public.resolve()),
                    "openssh": key.openssh,
                    "fingerprint": key.fingerprint,
                },
                indent=2,
            )
        )
        return EXIT_OK
    print(f"private key: {out}  (mode 0600; keep it here, back it up)")
    print(f"public key:  {public}  (send this file to the operator)")
    print(f"fingerprint: {key.fingerprint}")
    print(key.openssh)
    return EXIT_OK


def run_start(args: argparse.Namespace) -> int:
    """run this site's SuperNode in the foreground (Ctrl-C stops it)

    Connect this site to the federation: a Flower SuperNode with TLS (--ca) and the site's key
    (--key), given its data and state folders through a node-config file (data-dir, state-dir,
    site-name, device). Prints the PIDs of the processes it starts (SuperNode, SuperExec,
    worker) and records them in STATE/run.json while they run. Logs stream here and to
    STATE/logs/supernode.log. Ctrl-C or SIGTERM stops it cleanly.
    """
    values, _, _ = parsed(args, START_FLAGS, START)  # --device: bad input before anything runs
    try:
        options = site_options.prepare(
            args.server,
            args.data,
            ca=args.ca,
            key=args.key,
            state=args.state,
            name=args.name,
            device=as_str(values, "device"),
            privacy=(as_float(values, "privacy-epsilon"), as_float(values, "privacy-delta")),
            insecure=args.insecure,
            worker=not args.no_worker,
            give_up_s=args.give_up_after,
            privacy_unit=as_str(values, "privacy-unit"),
            policy=args.policy,
        )
    except (ValueError, site_options.SiteError) as err:  # SiteKeyError is a ValueError
        return fail(args, err, EXIT_BAD_INPUT)
    print(
        f"site {options.name} -> {options.server}"
        + (f", key {options.fingerprint}" if options.fingerprint else ", INSECURE (no TLS)")
    )
    print(f"data {options.data}; state {options.state}; log {options.state}/logs/supernode.log")
    sys.stdout.flush()
    try:
        outcome = supernode.run(
            options,
            echo=None if args.quiet else sys.stdout,
            on_started=lambda record: print(
                f"processes {record.pids()} (recorded in {options.run_file})", flush=True
            ),
        )
    except (site_options.SiteError, processes.ProcessError, OSError) as err:
        return fail(args, err, EXIT_FAILED)
    if outcome.failure:
        fail(args, outcome.failure, outcome.exit_code)
    elif outcome.stopped_by is None:
        fail(
            args,
            f"the SuperNode exited with code {outcome.returncode}; see {outcome.log_file}",
            outcome.exit_code,
        )
    else:
        print(f"stopped ({outcome.stopped_by})")
    if outcome.survivors:
        fail(args, f"still running: PIDs {sorted(p.pid for p in outcome.survivors)}", EXIT_FAILED)
    return outcome.exit_code


def run_leave(args: argparse.Namespace) -> int:
    """ask the operator to withdraw this site: a request signed with the site's key

    Writes a request (--out) signed with --key, the key the operator registered for --name. Send
    it to the operator, who checks it and withdraws the site with `starfed server sites withdraw
    NAME --request FILE` (docs/deployment.md#7b-a-site-leaves). Immediate mode by default; --exact
    asks for the exact one. Nothing leaves this machine but the file.
    """
    mode = leave_request.Mode.EXACT if args.exact else leave_request.Mode.IMMEDIATE
    signed = leave_request.sign(args.key, args.name, mode, args.reason)
    out = args.out or Path(f"leave-request-{signed.request.site}.json")
    leave_request.write(out, signed)
    if args.json:
        print(
            json.dumps(
                {
                    "request": str(out.resolve()),
                    "fingerprint": signed.fingerprint,
                    "mode": str(mode),
                    "made": signed.request.made,
                },
                indent=2,
            )
        )
        return EXIT_OK
    print(
        f"{out}: {signed.request.site} asks to leave in {mode} mode, signed by {signed.fingerprint}"
    )
    print(
        f"next: send {out} to the operator, who runs `starfed server sites withdraw "
        f"{signed.request.site} --request {out.name}{' --exact' if args.exact else ''}`"
    )
    return EXIT_OK
