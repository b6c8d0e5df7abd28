"""``starfed site audit``: what left this site, when, summed by class and by run.

Reads the site's release record (``starfed.client.release_record``); ``--verify`` checks its
chain first and exits 1 naming the first line changed, removed or moved
(docs/sites.md#for-a-governance-office).
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from starfed.cli._common import add_switches, emit_json, fail, guard
from starfed.cli.flags import add_command
from starfed.client.ops import site_options
from starfed.client.release_record import RecordBroken, ReleaseRecord, summary
from starfed.ops.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK


def add_action(actions: argparse._SubParsersAction) -> None:
    """Register ``audit`` on the ``site`` group."""
    parser = add_command(actions, "audit", guard()(run_audit))
    parser.add_argument("--state", type=Path, help="the site's state folder (default: from --name)")
    parser.add_argument("--name", help="the site's name (default state folder: as `site start`)")
    parser.add_argument(
        "--since",
        help="only messages from this time on (ISO 8601, e.g. 2026-11-28 or 2026-11-28T20:00)",
    )
    add_switches(
        parser,
        {
            "--verify": "check the record's chain first: exit 1 naming the first line that was "
            "changed, removed or moved",
            "--json": "one JSON object on stdout, every line included",
        },
    )


def run_audit(args: argparse.Namespace) -> int:
    """what left this site and when, from its hash-chained release record

    One line per message answered or refused (state folder, release-record.jsonl); the
    summary by class (messages, fields, ε and δ spent) and by run, and the refusals with their
    reasons. --verify checks the chain first (exit 1 on any change, cut or reordering).
    """
    if args.state is None and args.name is None:
        return fail(args, "--state or --name is required", EXIT_BAD_INPUT)
    state = args.state or site_options.default_state_dir(args.name)
    try:
        since = _since(args.since)
    except ValueError as err:
        return fail(args, f"--since {args.since}: {err}", EXIT_BAD_INPUT)
    record = ReleaseRecord(state.expanduser())
    if not record.path.is_file():
        return fail(
            args, f"no release record in {state} (the site answered nothing yet)", EXIT_FAILED
        )
    verified = None
    if args.verify:
        try:
            verified = record.verify()
        except RecordBroken as err:
            return fail(args, f"{record.path}: {err}", EXIT_FAILED)
    releases = [r for r in record.releases() if since is None or r.when >= since]
    result = summary(releases)
    if args.json:
        emit_json({**result, "verified": verified, "lines": [r.as_dict() for r in releases]})
        return EXIT_OK
    _print(result, record.path, verified)
    return EXIT_OK


def _since(text: str | None) -> datetime | None:
    if text is None:
        return None
    when = datetime.fromisoformat(text)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _print(result: dict, path: Path, verified: int | None) -> None:
    if verified is not None:
        print(f"{path}: {verified} lines, chain verified")
    print(f"{result['messages']} messages answered, {result['bytes']:,} bytes sent")
    for run, row in result["by_run"].items():
        size = f"{row['bytes']:,} bytes"
        print(f"  run {run}: {row['messages']} messages, {size}, {row['classes']} classes")
    for name, row in result["by_class"].items():
        spent = f", ε {row['epsilon']:.3g} δ {row['delta']:g}" if "epsilon" in row else ""
        fields = ", ".join(row["fields"])
        print(f"  class {name}: {row['messages']} messages ({fields}), last {row['last']}{spent}")
    for refusal in result["refusals"]:
        print(
            f"  refused run {refusal['run']} step {refusal['step'] + 1} {refusal['phase']} "
            f"at {refusal['time']}: {refusal['reason']}"
        )
