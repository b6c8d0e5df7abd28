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

from starfed.cli import server
from starfed.server.ops import sites


def add_actions(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``sites`` and its actions on the ``server`` group."""
    p = actions.add_parser(
        "sites",
        help="register, list and remove site keys; see refused SuperNodes",
        description="Site keys the SuperLink accepts (wrapping `flwr supernode ...`).",
    )
    site_actions = p.add_subparsers(dest="sites_action", metavar="ACTION", required=True)
    q = site_actions.add_parser(
        "add",
        parents=[common],
        help="register a site's public key under a name",
        description="Register PUBKEY (one OpenSSH line, EC P-384; `starfed site keygen` makes "
        "it) for site NAME. Keep the site's private key where it is: only the .pub travels.",
    )
    q.add_argument("name", help="site name (letters, digits, . _ -)")
    q.add_argument("pubkey", type=Path, help="the site's public key file (.pub)")
    q.set_defaults(func=run_sites_add)
    q = site_actions.add_parser(
        "list",
        parents=[common],
        help="sites with node id, status and online/offline times",
    )
    q.set_defaults(func=run_sites_list)
    q = site_actions.add_parser(
        "remove",
        parents=[common],
        help="unregister a site's key (final: that key can never be registered again)",
        description="Unregister site NAME's key. A SuperNode using it stops within seconds. "
        "Flower never accepts a removed key again: a returning site needs a new key pair.",
    )
    q.add_argument("name")
    q.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    q.set_defaults(func=run_sites_remove)
    q = site_actions.add_parser(
        "refused",
        parents=[common],
        help="SuperNodes the SuperLink turned away, by key fingerprint (from its log)",
    )
    q.set_defaults(func=run_sites_refused)


@server._guard
def run_sites_add(args: argparse.Namespace) -> int:
    record = sites.add(server._folder(args), args.name, args.pubkey)
    if args.json:
        server._emit_json({"success": True, **asdict(record)})
    else:
        print(
            f"site {record.name} registered: node {record.node_id}, key {record.fingerprint}. "
            "Note: a key that is removed can never be registered again."
        )
    return server.EXIT_OK


@server._guard
def run_sites_list(args: argparse.Namespace) -> int:
    rows = sites.status(server._folder(args))
    if args.json:
        server._emit_json({"success": True, "sites": [asdict(r) for r in rows]})
        return server.EXIT_OK
    table = Table("site")
    table.add_column("node id", no_wrap=True)
    for header in ("status", "online at", "offline at"):
        table.add_column(header)
    table.add_column("key", no_wrap=True)
    table.add_column("added")
    for r in rows:
        table.add_row(
            r.name or "(not added by starfed)",
            str(r.node_id),
            r.status,
            r.online_at or "—",
            r.offline_at or "—",
            r.fingerprint or "—",
            r.added_at or "—",
        )
    server._console().print(table)
    if not rows:
        print("no sites yet: `starfed server sites add NAME site.pub`")
    return server.EXIT_OK


@server._guard
def run_sites_remove(args: argparse.Namespace) -> int:
    warning = (
        f"Removing site {args.name}: its key can NEVER be registered again (Flower refuses a "
        "removed key); if the site returns it needs a new key pair."
    )
    if not args.yes:
        if not sys.stdin.isatty():
            raise server.UsageError(f"{warning} Pass --yes to confirm.")
        print(warning, file=sys.stderr)
        if input("remove? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not removed")
            return server.EXIT_FAILED
    record = sites.remove(server._folder(args), args.name)
    if args.json:
        server._emit_json({"success": True, **asdict(record)})
    else:
        print(f"site {record.name} removed (node {record.node_id}, key {record.fingerprint})")
    return server.EXIT_OK


@server._guard
def run_sites_refused(args: argparse.Namespace) -> int:
    folder = server._folder(args)
    refusals = sites.refused(folder)
    if args.json:
        server._emit_json({"success": True, "refused": [asdict(r) for r in refusals]})
        return server.EXIT_OK
    if not refusals:
        print(f"no refused SuperNodes in {folder.superlink_log}")
        return server.EXIT_OK
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
    server._console().print(table)
    print("times are the SuperLink's local time; the site prints its key's fingerprint at start")
    return server.EXIT_OK
