"""``starfed server status`` for people: the federation at a glance, as lines and tables
(``--json`` prints ``Status.to_json()`` instead; ``starfed.server.ops.status`` gathers it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from starfed.cli._common import console
from starfed.server.ops.layout import ServerFolder
from starfed.server.ops.status import Status
from starfed.shared.progress import counted


def print_status(status: Status) -> None:
    out = console()
    say = functools.partial(out.print, markup=False, highlight=False)
    if not _print_folders(status, say):
        return
    _print_classes_and_steps(status, out)
    _print_sites(status, out, say)
    _print_findings(status, out, say)
    for kept_out, entry in status.quarantine.items():
        since, why = entry.step + 1, entry.reason
        say(
            f"quarantine {kept_out}: kept out since step {since} ({why}); remove it from "
            "quarantine.json to let it back in"
        )
    if status.last_run:
        run = status.last_run
        reason = f" · {run['reason']}" if run.get("reason") else ""
        say(f"metrics    {run['status']} (of the last finished run, {run['written']}){reason}")
    say(
        f"logs       {status.logs['superlink']}; SuperExec: {status.logs['serverapps']}; "
        "a run's ServerApp output: flwr log RUN_ID"
    )


def _print_folders(status: Status, say: Callable[[str], None]) -> bool:
    """The server's processes, the federation folder's state and where the codebook stands;
    False when there is no federation to say more of."""
    s = status.server
    if s["running"]:
        processes = ", ".join(
            f"{name} {p['pid']}" + ("" if p["alive"] else " (gone)")
            for name, p in s["processes"].items()
        )
        say(f"server     running since {s['started_at']} · {processes}")
        for run in status.runs:
            say(f"           run {run['run-id']} {run['status']} ({run['elapsed']})")
    elif Path(status.server_dir).is_dir():
        say(f"server     not running ({status.server_dir}); showing the folders' state")
    else:  # a simulation's folder, or one copied off a server
        say("server     none (no server folder here); showing the federation folder's state")
    say(f"federation {status.federation_dir}")
    for note in status.unreadable:
        say(f"unreadable {note}")
    for problem in status.problems:
        say(f"DAMAGED    {problem}")
    if status.problems:
        say("           `starfed server repair --dry-run` says how to repair it")
    for note in status.notes:
        say(f"note       {note}")
    if status.federation is None:
        new = "" if status.problems else "; the first `starfed server run` creates it"
        say(f"           {status.problem}{new}")
        return False
    f = status.federation
    say(f"           id {f['id'][:8]} · created {f['created']} · backbones {f['fingerprint'][:12]}")
    position = status.position or {}
    where = counted(len(status.steps), "step record")
    if position.get("running"):
        where = (
            f"step {position['step'] + 1} RUNNING · done: {', '.join(position['done']) or '—'}"
            f" · in play: {', '.join(position['in_play']) or '—'}"
        )
    say(f"codebook   version {status.codebook_version} · {len(status.classes)} classes · {where}")
    if status.hint:
        say(f"next       {status.hint}")
    return True


def _print_classes_and_steps(status: Status, out: Console) -> None:
    table = Table("class", "step", "brought by (first time)", "frozen", title="classes")
    for c in status.classes:
        brought = ", ".join(f"{site} ({when})" for site, when in c.sites.items())
        brought += " · one site alone" if c.single_site else ""
        table.add_row(c.name, str(c.step + 1), brought or "—", "yes" if c.frozen else "no")
    out.print(table)
    table = Table(
        "step",
        "status",
        "classes",
        "sites",
        "FAA %",
        "wall s",
        "replay s",
        "finished",
        title="steps",
    )
    for r in status.steps:
        state = r.status + (f" (attempt {r.attempt + 1})" if r.attempt else "")
        faa = "—" if r.faa is None else f"{r.faa:.2f}"
        table.add_row(
            str(r.step + 1),
            state,
            str(len(r.classes)),
            ", ".join(r.sites) or "—",
            faa,
            f"{r.wall_s:.0f}",
            f"{r.replay_s:.1f}",
            r.finished,
        )
    out.print(table)


def _print_sites(status: Status, out: Console, say: Callable[[str], None]) -> None:
    table = Table(
        "site",
        "last step",
        "last seen",
        "now",
        "online at",
        "offline at",
        "privacy ε",
        title="sites",
    )
    for site in status.sites:
        now = site.status or "—"
        table.add_row(
            site.name,
            "—" if site.last_step is None else str(site.last_step + 1),
            site.last_seen or "—",
            f"failing ({now})" if site.failing else now,
            site.online_at or "—",
            site.offline_at or "—",
            "—" if site.epsilon is None else f"{site.epsilon:.3g}",
        )
    out.print(table)
    for site in (site for site in status.sites if site.failing):
        say(f"failing    {site.name}: {site.failure}")
    if status.sites_error:
        say(f"sites now: unknown ({status.sites_error})")


def _print_findings(status: Status, out: Console, say: Callable[[str], None]) -> None:
    """The errors and the screened contributions of the last steps."""
    if status.errors:
        table = Table("site", "step", "phase", "what", title="errors in the last steps")
        for e in status.errors:
            table.add_row(e.site, str(e.step + 1), f"{e.phase}/{e.round}", e.status)
        out.print(table)
    else:
        say("errors     none in the last steps")
    if status.refusals:  # a site's policy or spent budget: an answer, not a failure
        table = Table("site", "step", "phase", "why", title="refused by sites in the last steps")
        for e in status.refusals:
            table.add_row(e.site, str(e.step + 1), f"{e.phase}/{e.round}", e.status)
        out.print(table)
    if (status.position or {}).get("running") and status.runs:
        # a step's exchanges are recorded when it ends; its run's log has them as they happen
        run = status.runs[0]["run-id"]
        home = ServerFolder.at(status.server_dir).flwr_home
        say(
            f"           the step running: its failures so far are in its log, "
            f"`FLWR_HOME={home} flwr log {run} --show`"
        )
    if status.findings:
        table = Table(
            "site",
            "step",
            "phase",
            "class",
            "what",
            "why",
            title="screened contributions in the last steps",
        )
        for finding in status.findings:
            table.add_row(
                finding.site,
                str(finding.step + 1),
                f"{finding.phase}/{finding.round}",
                finding.name or "—",
                finding.action,
                finding.reason,
            )
        out.print(table)
    else:
        say("screening  nothing capped or rejected in the last steps")
    if status.taken:  # docs/security.md#1c-honest-sites-keep-their-accuracy-issue-43, item 5
        table = Table(
            "site",
            "step",
            "taken by",
            "points",
            "by the classes",
            title="what new classes took from sites' earlier classes (their reports)",
        )
        for took in status.taken:
            more = " …" if len(took.classes) > 3 else ""
            table.add_row(
                took.site,
                str(took.step + 1),
                ", ".join(took.by),
                f"{took.points:.1f}",
                ", ".join(took.classes[:3]) + more,
            )
        out.print(table)
        say(
            "           a site's word, not a finding; `starfed server sites withdraw SITE "
            "--dry-run` shows what its leaving takes out"
        )
