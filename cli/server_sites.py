"""``starfed server sites add|list|remove|refused``: the site keys the SuperLink accepts.

Actions of the ``server`` group (``starfed.cli.server`` registers them), wrapping
``flwr supernode ...`` through ``starfed.server.ops.sites`` (docs/deployment.md#3-register-sites).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from starfed.cli._common import (
    add_group,
    add_switches,
    console,
    emit_json,
    federation_dir,
    federation_option,
    guard,
    server_folder,
)
from starfed.cli.flags import add_command
from starfed.ops import leave_request, pki, processes
from starfed.ops.exit_codes import EXIT_FAILED, EXIT_OK
from starfed.server import folder_lock, withdrawal
from starfed.server.federation import Federation
from starfed.server.folder_files import FederationError
from starfed.server.ops import sites
from starfed.server.ops.layout import ServerFolder
from starfed.shared.knob import ConfigError
from starfed.shared.privacy.unit import PrivacyUnit

guarded = guard(bad_input=(pki.SiteKeyError,), failed=(sites.SitesError, processes.ProcessError))
withdrawing = guard(
    bad_input=(withdrawal.WithdrawalError, leave_request.LeaveRequestError),
    failed=(FederationError, folder_lock.FolderLocked, sites.SitesError, processes.ProcessError),
)


def add_actions(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """register, list and remove site keys; see refused SuperNodes

    Site keys the SuperLink accepts (wrapping `flwr supernode ...`).
    """
    site_actions = add_group(actions, "sites", add_actions)
    p = add_command(site_actions, "add", guarded(run_sites_add), parents=[common])
    p.add_argument("name", help="site name (letters, digits, . _ -)")
    p.add_argument("pubkey", type=Path, help="the site's public key file (.pub)")
    p.add_argument(
        "--privacy-epsilon",
        type=float,
        metavar="E",
        help="the site runs with the privacy setting at this ε (its node config's "
        "privacy-epsilon): its rows are then held to its release's bound; a site registered "
        "without it whose replies claim privacy is a finding",
    )
    p.add_argument(
        "--privacy-unit",
        choices=[unit.value for unit in PrivacyUnit],
        help="what the site's ε protects (its node config's privacy-unit; with --privacy-epsilon)",
    )
    add_switches(
        p,
        {
            "--adopt": "record a key Flower has already registered (bare `flwr "
            "supernode register`, or an add that died halfway) under NAME"
        },
    )
    p = add_command(site_actions, "remove", guarded(run_sites_remove), parents=[common])
    p.add_argument("name")
    add_switches(p, {"--yes": "do not ask for confirmation"})
    p = add_command(site_actions, "withdraw", withdrawing(run_sites_withdraw), parents=[common])
    p.add_argument("name")
    p.add_argument(
        "--request",
        type=Path,
        metavar="FILE",
        help="the site's signed request (`starfed site leave`): checked against NAME's "
        "registered key and kept in the withdrawal's record; its mode must be the one asked",
    )
    federation_option(p)
    add_switches(
        p,
        {
            "--dry-run": "only say what would change and what would not be undone",
            "--exact": "go back to the checkpoint before the site's first step; the next "
            "`server run` runs the steps since again without it",
            "--yes": "do not ask for confirmation",
        },
    )
    add_command(site_actions, "list", guarded(run_sites_list), parents=[common])
    add_command(site_actions, "refused", guarded(run_sites_refused), parents=[common])


def run_sites_add(args: argparse.Namespace) -> int:
    """register a site's public key under a name

    Register PUBKEY (one OpenSSH line, EC P-384; `starfed site keygen` makes it) for site NAME.
    Keep the site's private key where it is: only the .pub travels. A key Flower knows but
    sites.json does not (Flower answers "[code: 23]") is recorded with --adopt.
    """
    folder = server_folder(args)
    privacy = None
    if args.privacy_epsilon is not None:
        if not 0 < args.privacy_epsilon < float("inf"):
            raise ConfigError(f"--privacy-epsilon {args.privacy_epsilon:g}: a number over 0")
        unit = PrivacyUnit(args.privacy_unit or PrivacyUnit.IMAGE.value)
        privacy = sites.DeclaredPrivacy(args.privacy_epsilon, unit)
    elif args.privacy_unit is not None:
        raise ConfigError("--privacy-unit goes with --privacy-epsilon (the ε it protects)")
    record = sites.add(folder, args.name, args.pubkey, adopt=args.adopt, privacy=privacy)
    try:
        if withdrawal.readmit(folder.federation, record.name):
            print(f"site {record.name} had withdrawn: it may take part again", file=sys.stderr)
    except (FederationError, folder_lock.FolderLocked) as err:
        print(
            f"starfed server sites add: warning: {record.name} had withdrawn and stays "
            f"quarantined: {err}",
            file=sys.stderr,
        )
    if args.json:
        emit_json({"success": True, **record.to_json()})
    else:
        print(
            f"site {record.name} registered: node {record.node_id}, key {record.fingerprint}"
            f"{_privacy_words(record.privacy)}. Note: a key that is removed can never be "
            "registered again."
        )
    return EXIT_OK


def _privacy_words(privacy: sites.DeclaredPrivacy | None) -> str:
    if privacy is None:
        return ""
    return f", private at ε {privacy.epsilon:g} per {privacy.unit.value}"


def run_sites_list(args: argparse.Namespace) -> int:
    """sites with node id, status and online/offline times"""
    rows = sites.status(server_folder(args))
    if args.json:
        emit_json({"success": True, "sites": [r.to_json() for r in rows]})
        return EXIT_OK
    table = Table("site")
    table.add_column("node id", no_wrap=True)
    for header in ("status", "online at", "offline at"):
        table.add_column(header)
    table.add_column("key", no_wrap=True)
    table.add_column("added")
    table.add_column("privacy")
    for r in rows:
        table.add_row(
            r.name or "(not added by starfed)",
            str(r.node_id),
            r.status,
            r.online_at or "—",
            r.offline_at or "—",
            r.fingerprint or "—",
            r.added_at or "—",
            "—" if r.privacy is None else f"ε {r.privacy.epsilon:g} per {r.privacy.unit.value}",
        )
    console().print(table)
    if not rows:
        print("no sites yet: `starfed server sites add NAME site.pub`")
    return EXIT_OK


def run_sites_remove(args: argparse.Namespace) -> int:
    """unregister a site's key (final: that key can never be registered again)

    Unregister site NAME's key. A SuperNode using it stops within seconds. Flower never accepts
    a removed key again: a returning site needs a new key pair.
    """
    warning = (
        f"Removing site {args.name}: its key can NEVER be registered again (Flower refuses a "
        "removed key); if the site returns it needs a new key pair."
    )
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"{warning} Pass --yes to confirm.")
        print(warning, file=sys.stderr)
        if input("remove? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not removed")
            return EXIT_FAILED
    record = sites.remove(server_folder(args), args.name)
    if args.json:
        emit_json({"success": True, **record.to_json()})
    else:
        print(f"site {record.name} removed (node {record.node_id}, key {record.fingerprint})")
    return EXIT_OK


def run_sites_refused(args: argparse.Namespace) -> int:
    """SuperNodes the SuperLink turned away, by key fingerprint (from its log)

    Also those refused for their clock (from the gateway's log): Flower answers them as it
    answers a removed key; the line says how far the site's clock is off.
    """
    folder = server_folder(args)
    refusals = sites.refused(folder)
    if args.json:
        emit_json({"success": True, "refused": [asdict(r) for r in refusals]})
        return EXIT_OK
    if not refusals:
        print(f"no refused SuperNodes in {folder.superlink_log} or {folder.gateway_log}")
        return EXIT_OK
    table = Table()
    table.add_column("key fingerprint", no_wrap=True)
    for header in ("site", "why", "times", "first", "last"):
        table.add_column(header)
    for r in refusals:
        site = "—" if r.site is None else (f"{r.site} (removed)" if r.removed else r.site)
        table.add_row(
            r.fingerprint or "(no key)",
            site,
            f"{r.reason} [{r.code}]",
            str(r.count),
            r.first,
            r.last,
        )
    console().print(table)
    print("times are the server's local time; the site prints its key's fingerprint at start")
    return EXIT_OK


def run_sites_withdraw(args: argparse.Namespace) -> int:
    """take a site's data out of the federation's codebook (a site leaves; --dry-run: only say)

    Removes every class only NAME brought, merges every class it shared again from the other
    holders' kept rows, runs the server's replays again, and unregisters NAME (its key too,
    when `sites add` registered it): it cannot take part again without a new `sites add`. One
    commit, under the federation folder's lock. What it does not undo (later steps other sites
    trained on a codebook holding its values, kept checkpoints) is listed by --dry-run.
    """
    folder = server_folder(args)
    federation = Federation.open(federation_dir(args, folder))
    chosen = withdrawal.plan(federation, args.name)
    request = _checked_request(folder, args) if args.request else None
    asked = [] if request is None else [_asked(request)]
    if args.dry_run:
        if args.json:
            emit_json({"success": True, "dry_run": True, **chosen.to_json(), "request": asked})
        else:
            print("\n".join([*chosen.lines(), *asked]))
        return EXIT_OK
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"withdrawing {args.name} cannot be undone. Pass --yes to confirm.")
        print("\n".join([*chosen.lines(), *asked]), file=sys.stderr)
        if input("withdraw? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not withdrawn")
            return EXIT_FAILED
    proof = "" if request is None else request.to_json()
    record = (
        withdrawal.withdraw_exact(federation, args.name, proof)
        if args.exact
        else withdrawal.withdraw(federation, args.name, withdrawal.Setting.of(federation), proof)
    )
    key, kept = None, ""
    if folder.sites_file.is_file() and sites.Registry.load(folder.sites_file).active(args.name):
        try:
            key = sites.remove(folder, args.name).fingerprint
        except (sites.SitesError, processes.ProcessError) as err:
            # withdrawn all the same: the quarantine keeps the site out of every later step
            kept = (
                f"{args.name} is withdrawn but its key is still registered ({err}); it is "
                f"quarantined meanwhile: run `starfed server sites remove {args.name}` with the "
                "server running"
            )
    if args.json:
        emit_json({"success": True, **asdict(record), "key_removed": key, "key_kept": kept})
    else:
        print(withdrawal.done_line(record) + (f"; its key {key} unregistered" if key else ""))
    if kept:
        print(f"starfed server sites withdraw: warning: {kept}", file=sys.stderr)
    return EXIT_OK


def _checked_request(folder: ServerFolder, args: argparse.Namespace) -> leave_request.SignedRequest:
    """The site's request file, verified against its registration in ``sites.json`` and
    matching the mode the operator chose."""
    signed = leave_request.read(args.request)
    registration = sites.Registry.load(folder.sites_file).active(args.name)
    if registration is None:
        raise leave_request.LeaveRequestError(
            f"{args.name} has no registered key (`starfed server sites list`): its request "
            "cannot be checked"
        )
    leave_request.verify(signed, args.name, registration.public_key, registration.added_at)
    wanted = leave_request.Mode.EXACT if args.exact else leave_request.Mode.IMMEDIATE
    if signed.request.mode is not wanted:
        flag = "with" if signed.request.mode is leave_request.Mode.EXACT else "without"
        raise leave_request.LeaveRequestError(
            f"{args.name} asked to leave in {signed.request.mode} mode: run this {flag} --exact"
        )
    return signed


def _asked(signed: leave_request.SignedRequest) -> str:
    request = signed.request
    why = f" ({request.reason})" if request.reason else ""
    return (
        f"request    verified: {request.site} asked at {request.made} to leave in "
        f"{request.mode} mode{why}, signed by its key {signed.fingerprint}"
    )
