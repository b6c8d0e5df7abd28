"""``starfed server audit --site NAME``: the sha256 of every reply the server received from a site.

The server's side of a site's release record (docs/security.md#the-release-record): the
history keeps the hash of each reply's bytes (``Exchange.reply_sha256``), so a site compares
its record's hashes with these and both hold the same account.
"""

from __future__ import annotations

import argparse
from typing import Any

from starfed.cli import _common
from starfed.cli._common import emit_json, guard, server_folder
from starfed.cli.flags import add_command
from starfed.ops.exit_codes import EXIT_OK
from starfed.server.history import HistoryLines


def add_action(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``audit`` on the ``server`` group."""
    parser = add_command(actions, "audit", guard()(run_audit), parents=[common])
    _common.federation_option(parser)
    parser.add_argument("--site", required=True, help="the site's name")


def run_audit(args: argparse.Namespace) -> int:
    """the hashes of a site's replies, as the history keeps them

    One line per reply the server received from --site: step, phase, round, bytes, status and
    the sha256 of the reply's bytes, which the site's `starfed site audit` lists too.
    """
    history = HistoryLines.read(_common.federation_dir(args, server_folder(args)))
    rows: list[dict[str, Any]] = [
        {
            "step": e.step,
            "phase": e.phase,
            "round": e.round,
            "bytes": e.bytes_up,
            "status": str(e.status),
            "sha256": e.reply_sha256,
        }
        for record in history.records
        for e in record.exchanges
        if e.site == args.site and e.reply_sha256
    ]
    if args.json:
        emit_json({"site": args.site, "replies": rows})
        return EXIT_OK
    for row in rows:
        where = f"{row['phase']}/{row['round']}"
        print(
            f"step {row['step'] + 1:<4} {where:<16} {row['bytes']:>10,} B "
            f"{row['sha256']} {row['status']}"
        )
    print(f"{len(rows)} replies from {args.site}")
    return EXIT_OK
