"""``starfed server run|resume|status|check|repair``: the operator's commands for the
federation itself.

Actions of the ``server`` group (``starfed.cli.server`` registers them), on the same server folder.
``run`` submits the generated app (``starfed.ops.flower_runs``) to the running server with the
federation folder (default ``<server dir>/federation``), streams the ServerApp's progress and
follows the run to its end (``round``, its retired name, still works, with a note); ``resume`` is a
``run`` that first says which step it continues; ``status`` reads the folders
(``starfed.server.ops.status``) and works with the server stopped; ``check`` verifies every file of
the federation folder (``starfed.server.folder_check``) and ``repair`` rolls a damaged one back to a
good state (``starfed.server.folder_repair``). Exit codes (docs/federation.md): 0 completed, 3
degraded, 1 failed (or the run could not start; for ``status`` and ``check``: the folder is
damaged), 2 bad input (checked with the configuration schema before anything is submitted), 130
stopped with Ctrl-C (the run itself is stopped; ``resume`` continues it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

from starfed.cli import _common
from starfed.cli._common import (
    emit_json,
    federation_option,
    guard,
    server_folder,
)
from starfed.cli.federation_status import print_status
from starfed.cli.flags import Flag, add_command, add_run_config, run_config, same_name
from starfed.ops import exit_codes, flower_runs, processes
from starfed.ops.exit_codes import EXIT_OK
from starfed.server import folder_check, folder_lock, folder_repair
from starfed.server.federation import Federation
from starfed.server.folder_files import FederationError
from starfed.server.ops import sites, superlink
from starfed.server.ops.layout import ServerFolder
from starfed.server.ops.status import gather
from starfed.server.records import Checkpoint, Exchange
from starfed.shared import retired_names
from starfed.shared.knob import ConfigError, writable_dir
from starfed.shared.progress import counted

FLAGS = (Flag("--steps", ("max-steps",)), *same_name("min-sites", "wait-s", "timeout-s"))
guarded = guard(
    failed=(
        flower_runs.FlowerRunError,
        FederationError,
        superlink.ServerError,
        sites.SitesError,
        processes.ProcessError,
        folder_lock.FolderLocked,
    )
)


def add_actions(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``run`` (and its retired name ``round``), ``resume``, ``status``, ``check`` and
    ``repair`` on the ``server`` group."""
    for name, run in (("run", run_run), ("resume", run_resume), ("round", _retired_round)):
        hidden = run is _retired_round
        parser = add_command(actions, name, run, FLAGS, parents=[common], hidden=hidden)
        federation_option(parser)
        add_run_config(parser)
    federation_option(add_command(actions, "status", run_status, parents=[common]))
    check = add_command(actions, "check", run_check, parents=[common])
    repair = add_command(actions, "repair", run_repair, parents=[common])
    for parser in (check, repair):
        federation_option(parser)
        _deep_option(parser)
    repair.add_argument(
        "--to",
        type=int,
        default=None,
        metavar="STEPS",
        help="roll back to the codebook kept after this many completed steps "
        "(checkpoints/step-NNNN.bin; default: keep a good codebook.bin, else the newest good "
        "kept one)",
    )
    repair.add_argument(
        "--dry-run", action="store_true", help="say what it would do, change nothing"
    )


def _deep_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--deep",
        action="store_true",
        help="also decode every tensor of every codebook file, as a run reads them (tens of "
        "seconds at 10,000 classes; without it every byte is still checksummed)",
    )


def _depth(args: argparse.Namespace) -> folder_check.Depth:
    return folder_check.Depth.DECODE if args.deep else folder_check.Depth.CHECKSUMS


def _checkpoint(federation_dir: Path) -> Checkpoint | None:
    """Where the federation stands, None before its first step."""
    try:
        return Federation.open(federation_dir).checkpoints.last_checkpoint()
    except FederationError as err:
        if not (federation_dir / "federation.json").exists():
            return None
        raise err


# --- run and resume --------------------------------------------------------------------------


@guarded
def run_run(args: argparse.Namespace) -> int:
    """run aggregation steps over what the sites bring now, on the running server

    Submit starfed's ServerApp to the running server: it continues the federation folder,
    performs aggregation steps over the classes the sites bring now (until none brings anything
    new, or --steps), and writes metrics.json. Streams the ServerApp's log; Ctrl-C stops the run
    (continue it with `resume`). Exit code: 0 completed, 3 degraded, 1 failed, 2 bad input, 130
    stopped.
    """
    return _run(args, resume=False)


def _retired_round(args: argparse.Namespace) -> int:
    """`starfed server round`, the retired name of `server run`: a note, then the same run."""
    retired_names.note("`starfed server round`", "`starfed server run`")
    return run_run(args)


@guarded
def run_resume(args: argparse.Namespace) -> int:
    """continue an interrupted step from its last completed phase

    A `run` that continues the step a crash or Ctrl-C interrupted; refuses (exit 2) when no
    step is running. Options and exit codes as `run`.
    """
    return _run(args, resume=True)


def _run(args: argparse.Namespace, resume: bool) -> int:
    folder = server_folder(args)
    federation_dir = _common.federation_dir(args, folder)
    _, overrides = run_config(args, FLAGS)
    if "federation-dir" in overrides:
        raise ConfigError("--run-config federation-dir: use --federation")
    for key in ("site-names", "site-privacy"):
        if key in overrides:
            raise ConfigError(f"--run-config {key}: set from `starfed server sites`")
    say = _sayer(args)
    _refuse_damaged(folder, federation_dir)
    checkpoint = _checkpoint(federation_dir)
    running = checkpoint is not None and checkpoint.position.running
    if resume and not running:
        done = 0 if checkpoint is None else checkpoint.position.step
        raise ConfigError(
            f"nothing to resume in {federation_dir}: no step is running ({counted(done, 'step')} "
            "finished); `starfed server run` runs the next"
        )
    record, cli = _ready_server(folder, federation_dir)
    overrides["federation-dir"] = str(writable_dir(federation_dir, "--federation"))
    # a registered site is known by the name the operator gave its key, whatever it says
    registered = [r for r in sites.Registry.load(folder.sites_file).sites if r.removed_at is None]
    overrides["site-names"] = " ".join(f"{r.node_id}:{r.name}" for r in registered)
    # a site is private when its registration says so, never by its replies' word
    overrides["site-privacy"] = " ".join(
        f"{r.node_id}:{r.privacy.epsilon!r}" for r in registered if r.privacy is not None
    )
    if running and checkpoint is not None:  # running: a checkpoint says so
        say(_continues(checkpoint))
    offline = _offline(folder, registered)
    if registered and offline is not None and len(offline) == len(registered):
        say(
            f"no registered site is online now ({', '.join(offline)}): the run waits for them "
            "up to --wait-s"
        )
    app = flower_runs.write_app(folder.app)
    submitted_at = time.time()
    try:
        with flower_runs.sigterm_as_interrupt():
            outcome = flower_runs.run_to_end(
                cli,
                app,
                overrides,
                log_sink=sys.stderr if args.json else None,  # stdout: one JSON object
                kept_log=folder.run_log,
                on_submitted=lambda run_id: say(
                    f"run {run_id} on {record.internal_address} · federation {federation_dir}"
                ),
            )
    except flower_runs.FlowerRunError:
        if record.superlink_alive():
            raise
        checkpoint = _checkpoint(federation_dir)
        running = checkpoint is not None and checkpoint.position.running
        raise superlink.ServerError(superlink.gone(folder, federation_dir, running)) from None
    metrics = flower_runs.read_metrics(federation_dir, since=submitted_at)
    code = flower_runs.exit_code(outcome, metrics)
    if code == exit_codes.EXIT_FAILED:
        offline = _offline(folder, registered)
    return _report(args, folder, federation_dir, _Ended(code, cli, outcome, metrics, offline))


def _refuse_damaged(folder: ServerFolder, federation_dir: Path) -> None:
    """A damaged federation folder is said before anything is submitted."""
    if not (federation_dir / "federation.json").is_file():
        return
    report = folder_check.check(federation_dir, depth=folder_check.Depth.HEADERS, kept=False)
    if blocking := report.blocking:
        raise FederationError(
            f"the federation folder is damaged: {blocking[0]}"
            + (f" (and {counted(len(blocking) - 1, 'more problem')})" if blocking[1:] else "")
            + f"; `starfed server repair --dry-run --dir {folder.root}` says how to repair it"
        )


def _ready_server(
    folder: ServerFolder, federation_dir: Path
) -> tuple[superlink.RunRecord, flower_runs.FlowerCli]:
    """The running server's record and its ``flwr``, once nothing else holds the federation."""
    holder = folder_lock.holder(federation_dir) if federation_dir.is_dir() else None
    if holder is not None and holder.alive():  # the ServerApp refuses too; this says it first
        raise superlink.ServerError(
            f"the federation folder {federation_dir} is in use by {holder.describe()}"
        )
    record = superlink.RunRecord.load(folder.run_file)
    if record is None or not any(record.alive().values()):
        raise superlink.ServerError(
            f"the server is not running in {folder.root}: `starfed server start` first"
        )
    cli = flower_runs.FlowerCli(folder.flwr_home)
    if busy := cli.unfinished_runs():  # two ServerApps must never write one federation
        run_id = busy[0]["run-id"]
        raise superlink.ServerError(
            f"run {run_id} is still {busy[0]['status']} on this server: wait for it, or stop "
            f"it (FLWR_HOME={cli.flwr_home} flwr stop {run_id} {flower_runs.CONNECTION})"
        )
    return record, cli


@dataclasses.dataclass(frozen=True)
class _Ended:
    """A run followed to its end: its exit code, what Flower and metrics.json say, and the
    registered sites offline."""

    code: int
    cli: flower_runs.FlowerCli
    outcome: flower_runs.RunOutcome
    metrics: dict | None
    offline: list[str] | None


def _report(
    args: argparse.Namespace, folder: ServerFolder, federation_dir: Path, ended: _Ended
) -> int:
    """Say how the run ended (one JSON object with --json); returns its exit code."""
    code, outcome, metrics = ended.code, ended.outcome, ended.metrics
    resume_command = f"starfed server resume --dir {folder.root}" + (
        f" --federation {federation_dir}" if args.federation else ""
    )
    details = ""
    if code == exit_codes.EXIT_FAILED:
        details = _failure(ended.cli, outcome, metrics, ended.offline)
    if args.json:
        emit_json(
            {
                "success": code in (exit_codes.EXIT_OK, exit_codes.EXIT_DEGRADED),
                "exit_code": code,
                "run_id": outcome.run_id,
                "flower_status": outcome.status,
                "status": (metrics or {}).get("status"),
                "reason": details or (metrics or {}).get("reason") or None,
                "federation_dir": str(federation_dir),
                "offline_sites": ended.offline,
                "metrics": metrics,
                "resume": resume_command if code == exit_codes.EXIT_INTERRUPTED else None,
            }
        )
        return code
    if code == exit_codes.EXIT_INTERRUPTED:
        checkpoint = _checkpoint(federation_dir)
        where = "" if checkpoint is None else f" ({_where(checkpoint)})"
        print(f"stopped run {outcome.run_id}{where}; continue it: {resume_command}")
    elif code == exit_codes.EXIT_FAILED:
        print(f"starfed server {args.server_action}: error: {details}", file=sys.stderr)
    else:
        print(f"run {outcome.run_id} {outcome.status} · {flower_runs.summarize(metrics or {})}")
        if code == exit_codes.EXIT_DEGRADED:
            print(f"degraded: {_lost(metrics or {})}")
        print(f"federation {federation_dir}; see `starfed server status --dir {folder.root}`")
    return code


def _offline(folder: ServerFolder, registered: list[sites.SiteRecord]) -> list[str] | None:
    """The registered sites Flower does not see online; None when it cannot say."""
    try:
        online = {s.node_id for s in sites.status(folder) if s.status == "online"}
    except sites.SitesError:
        return None
    return [r.name for r in registered if r.node_id not in online]


def _sayer(args: argparse.Namespace) -> Callable[[str], None]:
    """Progress lines: stdout for people, stderr with --json (stdout is the one object)."""
    stream = sys.stderr if args.json else sys.stdout
    return lambda line: print(line, file=stream, flush=True)


def _where(checkpoint: Checkpoint) -> str:
    p = checkpoint.position
    if not p.running:
        return f"{counted(p.step, 'step')} finished, none running"
    return f"step {p.step + 1} running, {p.done_text() or 'no phase'} done"


def _continues(checkpoint: Checkpoint) -> str:
    p = checkpoint.position
    classes = ", ".join(p.in_play) or "none registered yet"
    return (
        f"continuing step {p.step + 1} after its completed phases "
        f"({p.done_text() or 'none'}); classes in play: {classes}"
    )


def _failure(
    cli: flower_runs.FlowerCli,
    outcome: flower_runs.RunOutcome,
    metrics: dict | None,
    offline: list[str] | None,
) -> str:
    """Why a run failed, in one line, which registered sites were offline, and where to read
    more."""
    if outcome.run_id is None:
        return outcome.status
    reason = (metrics or {}).get("reason") or ""
    if not reason:
        with contextlib.suppress(flower_runs.FlowerRunError):
            reason = str(cli.run_info(outcome.run_id).get("status-details") or "")
    reason = " ".join(reason.split()) or "no metrics.json written"
    if offline:
        reason += f"; registered sites offline: {', '.join(offline)} (`starfed site start`)"
    return (
        f"run {outcome.run_id} {outcome.status}: {reason} (its log: "
        f"FLWR_HOME={cli.flwr_home} flwr log {outcome.run_id} {flower_runs.CONNECTION} --show)"
    )


def _lost(metrics: dict) -> str:
    """Which sites did not answer what, in this run."""
    lost: dict[str, set[str]] = {}
    for e in (Exchange(**raw) for raw in metrics.get("exchanges", [])):
        if e.failed:
            lost.setdefault(e.site or f"node-{e.node_id}", set()).add(e.phase)
    return "; ".join(f"{site}: {', '.join(sorted(p))}" for site, p in sorted(lost.items()))


# --- status ----------------------------------------------------------------------------------


@guarded
def run_status(args: argparse.Namespace) -> int:
    """the federation at a glance: classes, steps, sites, errors, server processes

    Read the federation folder and the server folder (and, when the server runs, Flower's node
    list). Works with the server stopped. Lists what `check` finds damaged (without decoding
    tensors) and then exits 1.
    """
    folder = server_folder(args) if args.federation else _common.existing_server_folder(args)
    status = gather(folder, _common.federation_dir(args, folder))
    if args.json:
        emit_json({"success": not status.damaged, **status.to_json()})
    else:
        print_status(status)
    return exit_codes.EXIT_FAILED if status.damaged else EXIT_OK


@guarded
def run_check(args: argparse.Namespace) -> int:
    """verify every file of the federation folder: exit 0 whole, 1 damaged

    Checks the codebook (the checksum of every byte of it and of its store, each class's
    line; with --deep every tensor decoded as a run would), the kept checkpoints, the registry
    and the history (each line) and whether they agree with the codebook and the protocol
    position. One line per problem; `starfed server repair` fixes them. Works with the server
    stopped or running.
    """
    folder = server_folder(args)
    report = folder_check.check(_common.federation_dir(args, folder), depth=_depth(args))
    if args.json:
        emit_json({"success": report.ok, **dataclasses.asdict(report)})
    else:
        for line in report.notes:
            print(f"note: {line}")
        for line in report.problems:
            print(line)
        if report.ok:
            print(f"{report.folder}: whole (codebook version {report.codebook_version})")
    return EXIT_OK if report.ok else exit_codes.EXIT_FAILED


@guarded
def run_repair(args: argparse.Namespace) -> int:
    """roll a damaged federation folder back to a good state (--dry-run: only say how)

    Restores a damaged or missing codebook from the kept checkpoint furthest along that reads
    whole (its checksums; with --deep every tensor decoded), or from the one --to names,
    whatever the state of the current one, on a new version line;
    rewrites the history and the registry to agree with it (damaged lines, duplicates and steps
    beyond it left out, an interrupted step's record added, a completed step whose record is
    lost kept as a placeholder without scores). Every replaced file is kept beside as
    <name>.before-repair-<time>. Refused while a run holds the folder. Then runs `check`: exit
    0 when the folder is whole.
    """
    folder = server_folder(args)
    federation_dir = _common.federation_dir(args, folder)
    repair = folder_repair.plan(federation_dir, args.to, depth=_depth(args))
    if not args.dry_run:
        folder_repair.apply(repair)
    report = None if args.dry_run else folder_check.check(federation_dir, depth=_depth(args))
    if args.json:
        emit_json(
            {
                "success": report is None or report.ok,
                "dry_run": args.dry_run,
                "actions": [a.what for a in repair.actions],
                "problems": [] if report is None else report.problems,
            }
        )
    else:
        verb = "would" if args.dry_run else "did"
        if not repair.actions:
            print(f"nothing to repair in {federation_dir}")
        for action in repair.actions:
            print(f"{verb}: {action.what}")
        for line in [] if report is None else report.problems:
            print(f"still: {line}")
    return EXIT_OK if report is None or report.ok else exit_codes.EXIT_FAILED
