"""The operator's dashboard (``starfed server dashboard``): the federation on one web page.

``starfed server status`` answers once, in a terminal; an operator who watches a federation for
months keeps a page open instead. This one shows the same reading of the folders as ``status``
(``status.read``: one reader for both) and draws what a person would rather look at than read:
the steps over time, the accuracy by arrival step and per site, the accuracy matrix, the bytes
on the wire. It updates itself every few seconds while a round runs, and between rounds, or
with the server stopped, it shows the folders as they are (docs/deployment.md#dashboard).

- **Read-only.** Only GET routes; the server folder and the federation folder are read, never
  written (no lock, no cache file). Logs are served by name from the listing of the server
  folder's ``logs/`` only: a name that is not a regular file there (``..``, a link, a
  sub-folder) is 404, and they go out as ``text/plain`` with ``nosniff``, so a log line is never
  a page.
- **Holds up.** ``status.read`` guards every file: a damaged, truncated or missing one is named
  under "cannot read" and the rest is shown. The codebook, the registry and the history are
  each written atomically by the server, so a reading mid-step sees the old file or the new.
- **Cheap.** The files are read at most once a second, whoever asks; the running SuperLink
  (``flwr``, a second or two) and its log's refused keys at most every ``SLOW_EVERY_S``. Plots
  are drawn once per change of what they show: an image's address carries a digest of its data,
  so the browser fetches it again only when it changed.
- **No authentication**, so it listens on 127.0.0.1 and is reached through an SSH tunnel.

Why Starlette and uvicorn: Flower 1.42 depends on both (they serve its REST Fleet API), so nothing
new is installed; Starlette is the small ASGI toolkit (routing, responses, file streaming, a
test client) that FastAPI is built on, and a few read-only GET routes need none of FastAPI's
request models or OpenAPI; uvicorn is the ASGI server Flower itself runs. Plots come from
matplotlib (a dependency; ``Figure`` without pyplot renders with Agg), the accuracy plots being
the very ones ``train-local`` and the simulations write (``starfed.shared.metrics``). Nothing here
imports torch.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import uvicorn
from matplotlib import dates
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from starlette.routing import Route

from starfed.server.federation import CODEBOOK_FILE, COMPLETED, DEGRADED, FAILED, STEP_START_FILE
from starfed.server.ops import sites, status
from starfed.server.ops.layout import ServerFolder
from starfed.shared.metrics import (
    LABEL_EVERY_TASK,
    TASK_COLOURS,
    AccuracyMatrix,
    nan_to_none,
    plot_accuracy_matrix,
    plot_accuracy_over_time,
    short_class_name,
    task_ticks,
)
from starfed.shared.progress import counted
from starfed.shared.protocol import Phase

READ_EVERY_S = 1.0  # a page and its images share one reading of the folders
SLOW_EVERY_S = 15.0  # Flower's node list and the SuperLink log's refused keys
RUNNING = "running"
#: the hover text of a class one site brought alone (``status.ClassRow.single_site``)
SINGLE_SITE = (
    "brought by one site alone: no median over sites checks its rows, only the "
    "screening's references (docs/security.md)"
)
#: A status word -> its colour (badges and the timeline); anything else is drawn grey.
COLOURS = {
    COMPLETED: "#2e7d32",
    DEGRADED: "#ef6c00",
    FAILED: "#c62828",
    RUNNING: "#1565c0",
    "online": "#2e7d32",
    "offline": "#c62828",
    status.FAILING: "#c62828",  # its last exchanges failed (server/ops/status.py)
    "registered": "#6d6d6d",
    "unregistered": "#6d6d6d",
    "capped": "#ef6c00",  # screening findings (server/screening.py)
    "rejected": "#c62828",
    "quarantined": "#c62828",
}
PHASE_ORDER = [phase.key for phase in Phase]  # the enrolment, then the codebook phases


# --- what the page shows ---------------------------------------------------------------------


@dataclass
class StepDetail:
    """One step record, as the plots and the steps table need it."""

    step: int
    attempt: int
    status: str
    started_s: float
    wall_s: float
    bytes_down: int  # every message to a site, as sent
    bytes_up: int  # every reply
    phase_seconds: dict[str, float]  # phase -> seconds over its rounds


@dataclass
class Running:
    """The step in progress: its completed phases, the one under way, since when."""

    step: int
    done: list[str]
    phase: str  # the phase under way: the one after the last completed
    in_play: list[str]
    started: str | None  # when the step began (its rollback copy was written)
    checkpointed: str | None  # the last completed phase's checkpoint
    started_s: float | None = None
    wall_s: float | None = None  # so far, when the folders were read


@dataclass
class LogFile:
    name: str
    bytes: int
    modified: str


@dataclass
class State:
    """Everything the page shows, read in one go; ``/api/state`` is this as JSON."""

    status: status.Status
    read_at: str
    running: Running | None = None
    steps: list[StepDetail] = field(default_factory=list)
    accuracy_matrix: AccuracyMatrix = field(default_factory=list)  # the sites' scores
    site_accuracy: dict[str, dict[int, float]] = field(default_factory=dict)  # site -> step -> %
    class_accuracy: dict[str, float] = field(default_factory=dict)  # after the last scored step
    registrations: list[sites.SiteRecord] = field(default_factory=list)
    refused: list[sites.Refusal] = field(default_factory=list)
    logs: list[LogFile] = field(default_factory=list)

    def to_json(self) -> dict:
        return nan_to_none(asdict(self))


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _running(position: dict | None, federation_dir: Path, now: float) -> Running | None:
    if not position or not position.get("running"):
        return None
    done = list(position["done"])
    last = done[-1].partition("/")[0] if done else None
    after = PHASE_ORDER.index(last) + 1 if last in PHASE_ORDER else 0
    phase = PHASE_ORDER[after] if after < len(PHASE_ORDER) else "closing the step"
    started = _mtime(federation_dir / STEP_START_FILE)
    checkpointed = _mtime(federation_dir / CODEBOOK_FILE)
    return Running(
        position["step"], done, phase, list(position["in_play"]),
        None if started is None else _iso(started),
        None if checkpointed is None else _iso(checkpointed), started,
        None if started is None else now - started,
    )  # fmt: skip


def _detail(record) -> StepDetail:
    phases: dict[str, float] = {}
    for timing in record.phase_seconds:
        phases[timing.phase] = phases.get(timing.phase, 0.0) + timing.seconds
    return StepDetail(
        record.step, record.attempt, record.status, record.started, record.wall_s,
        sum(e.bytes_down for e in record.exchanges), sum(e.bytes_up for e in record.exchanges),
        phases,
    )  # fmt: skip


def _log_files(folder: ServerFolder) -> list[LogFile]:
    """The regular files directly in ``logs/`` (not links, not folders): all the page serves."""
    try:
        entries = list(os.scandir(folder.logs))
    except OSError:
        return []  # no logs before the first `server start`
    files = []
    for entry in sorted(entries, key=lambda e: e.name):
        try:
            if entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                files.append(LogFile(entry.name, info.st_size, _iso(info.st_mtime)))
        except OSError:
            continue  # rotated away while listed
    return files


def build_state(
    reading: status.Reading,
    folder: ServerFolder,
    registrations: list[sites.SiteRecord],
    refused: list[sites.Refusal],
) -> State:
    """The page's data from one reading of the folders (and the slower parts, read apart)."""
    s = reading.status
    scored = [(r, r.scores) for r in reading.history if r.scores is not None]
    site_accuracy: dict[str, dict[int, float]] = {}
    for record, scores in scored:
        for site, score in sorted(scores.sites.items()):
            site_accuracy.setdefault(site, {})[record.step] = score["accuracy"]
    classes = scored[-1][1].classes if scored else {}
    now = time.time()
    return State(
        status=s,
        read_at=_iso(now),
        running=_running(s.position, Path(s.federation_dir), now),
        steps=[_detail(record) for record in reading.history],
        accuracy_matrix=[scores.accuracy for _, scores in scored],
        site_accuracy=site_accuracy,
        class_accuracy={
            name: 100.0 * c["correct"] / c["images"] for name, c in classes.items() if c["images"]
        },
        registrations=registrations,
        refused=refused,
        logs=_log_files(folder),
    )


# --- plots -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plot:
    """One image: the data it draws (JSON; its digest names the image) and how it draws it."""

    title: str
    data: Callable[[State], Any]  # falsy: nothing to draw yet
    draw: Callable[[Any, BinaryIO], object]


def _step_label(step: int, attempt: int) -> str:
    return f"{step + 1}" + (f"·{attempt + 1}" if attempt else "")


def _timeline_data(state: State) -> list[tuple[str, str, float, float]]:
    bars = [(_step_label(d.step, d.attempt), d.status, d.started_s, d.wall_s) for d in state.steps]
    run = state.running
    if run is not None and run.started_s is not None and run.wall_s is not None:
        bars.append((_step_label(run.step, 0), RUNNING, run.started_s, run.wall_s))
    return bars


def _clock_axis(ax, first: float, last: float) -> None:
    """UTC clock times from ``first`` to ``last`` (seconds) on the x axis, the date in its
    label; a span under a minute is widened to one, so no tick reads as a fraction."""
    pad = max(60.0 - (last - first), 0.0) / 2 + 0.02 * (last - first)
    ends = (dates.date2num(datetime.fromtimestamp(t, UTC)) for t in (first - pad, last + pad))
    ax.set_xlim(*ends)
    ax.xaxis.set_major_locator(dates.AutoDateLocator(minticks=3, maxticks=6, tz=UTC))
    days = sorted({datetime.fromtimestamp(t, UTC).date() for t in (first, last)})
    clock = "%H:%M:%S" if len(days) == 1 else "%d %b %H:%M"
    ax.xaxis.set_major_formatter(dates.DateFormatter(clock, tz=UTC))
    ax.set_xlabel("UTC, " + " to ".join(f"{day:%Y-%m-%d}" for day in days))


def _draw_timeline(bars: list[tuple[str, str, float, float]], out: BinaryIO) -> None:
    """Clock times on the axis (the date in its label), never fractions of a second: a span
    shorter than a minute is widened to one."""
    fig = Figure(figsize=(6.5, 1.6 + 0.3 * len(bars)), layout="constrained")
    ax = fig.subplots()
    for row, (_, state, start, wall) in enumerate(bars):
        left = dates.date2num(datetime.fromtimestamp(start, UTC))
        ax.barh(row, max(wall, 1.0) / 86400, left=left, color=COLOURS.get(state, "#9e9e9e"))
    ax.set_yticks(range(len(bars)), [label for label, *_ in bars])
    ax.invert_yaxis()
    ax.set_ylabel("step")
    first = min(start for *_, start, _ in bars)
    _clock_axis(ax, first, max(start + max(wall, 1.0) for *_, start, wall in bars))
    shown = dict.fromkeys(state for _, state, *_ in bars)
    ax.legend(
        handles=[Patch(color=COLOURS.get(s, "#9e9e9e"), label=s) for s in shown],
        fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False,
    )  # fmt: skip
    fig.savefig(out, format="png", dpi=110)


def _bytes_data(state: State) -> list[tuple[str, int, int]]:
    return [(_step_label(d.step, d.attempt), d.bytes_down, d.bytes_up) for d in state.steps]


def _draw_bytes(rows: list[tuple[str, int, int]], out: BinaryIO) -> None:
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] / 2**20 for r in rows], 0.4, label="to the sites")
    ax.bar([i + 0.2 for i in x], [r[2] / 2**20 for r in rows], 0.4, label="from the sites")
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("MiB on the wire")
    ax.legend(fontsize=7)
    fig.savefig(out, format="png", dpi=110)


def _sites_data(state: State) -> dict[str, dict[int, float]]:
    return state.site_accuracy


def _draw_sites(series: dict[str, dict[int, float]], out: BinaryIO) -> None:
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    for i, (site, by_step) in enumerate(series.items()):
        steps = sorted(by_step, key=int)
        ax.plot([int(s) + 1 for s in steps], [by_step[s] for s in steps], marker="o",
                color=TASK_COLOURS[i % len(TASK_COLOURS)], label=site)  # fmt: skip
    ax.set_xlabel("after step")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    shown = sorted({int(s) + 1 for by_step in series.values() for s in by_step})
    ax.set_xlim(shown[0] - 0.5, shown[-1] + 0.5)
    ax.set_xticks([t + 1 for t in task_ticks(shown[-1])])
    ax.legend(fontsize=7, loc="lower left")
    fig.savefig(out, format="png", dpi=110)


def _matrix_data(state: State) -> AccuracyMatrix:
    return state.accuracy_matrix


PLOTS: dict[str, Plot] = {
    "steps": Plot("the steps over time (UTC), by status", _timeline_data, _draw_timeline),
    "accuracy": Plot(
        "the federation's accuracy by arrival step, and their mean (FAA)",
        _matrix_data,
        lambda m, out: plot_accuracy_over_time(m, out, "accuracy by arrival step (sites' tests)"),
    ),
    "sites": Plot("each site's accuracy on its own test images", _sites_data, _draw_sites),
    "matrix": Plot(
        "the accuracy matrix: row i after step i, column j the classes of step j",
        _matrix_data,
        lambda m, out: plot_accuracy_matrix(m, out, "accuracy matrix (sites' test images)"),
    ),
    "bytes": Plot("bytes per step, to the sites and from them", _bytes_data, _draw_bytes),
}


def _digest(data: Any) -> str:
    text = json.dumps(nan_to_none(data), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- HTML --------------------------------------------------------------------------------------


class Html(str):
    """Markup made here: written as it is, where any other text is escaped."""


def _text(value: object) -> str:
    if isinstance(value, Html):
        return value
    return html.escape("—" if value is None or value == "" else str(value))


def _badge(word: str | None) -> Html:
    colour = COLOURS.get(word or "", "#6d6d6d")
    return Html(f'<span class="badge" style="background:{colour}">{_text(word)}</span>')


def _table(
    headers: Iterable[str], rows: Iterable[Iterable[object]], empty: str, name: str = ""
) -> Html:
    rows = list(rows)
    if not rows:
        return Html(f'<p class="empty">{_text(empty)}</p>')
    head = "".join(f"<th>{_text(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_text(c)}</td>" for c in r) + "</tr>" for r in rows)
    ident = f' id="{name}"' if name else ""
    return Html(f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _class_name(name: str | None) -> Html | None:
    """A class name that fits a table cell, cut in the middle (the disease stays); the whole
    name on hover."""
    if name is None:
        return None
    return Html(f'<span title="{_text(name)}">{_text(short_class_name(name))}</span>')


def _percent(value: float | None) -> str:
    return "—" if value is None or value != value else f"{value:.2f}"


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f}"


def _section(title: str, *parts: str) -> str:
    return f'<section id="{title}"><h2>{_text(title)}</h2>{"".join(parts)}</section>'


def _plot(state: State, name: str, wide: bool = False) -> str:
    """A plot in the grid; ``wide``: a row of its own, at its own size (scrolls when the window
    is narrower), so a large accuracy matrix is never squeezed into a column."""
    plot = PLOTS[name]
    data = plot.data(state)
    if not data:
        return f'<p class="empty">{_text(plot.title)}: nothing to draw yet</p>'
    return (
        f"<figure{' class=wide' if wide else ''}>"
        f'<img class="plot" src="plots/{name}.png?v={_digest(data)}" '
        f'alt="{_text(plot.title)}"><figcaption>{_text(plot.title)}</figcaption></figure>'
    )


def _problems(state: State) -> str:
    s = state.status
    notes = [*s.unreadable, *([s.problem] if s.problem else [])]
    if s.sites_error:
        notes.append(f"the SuperLink's node list: {s.sites_error}")
    damaged = "".join(f"<li>{_text(problem)}</li>" for problem in s.problems)
    if damaged:  # the folder's check: what `starfed server repair` fixes
        damaged = (
            '<div class="problems" id="damaged"><b>the federation folder is damaged '
            f"(<code>starfed server repair --dry-run</code>)</b><ul>{damaged}</ul></div>"
        )
    if not notes:
        return damaged
    items = "".join(f"<li>{_text(note)}</li>" for note in notes)
    return (f'{damaged}<div class="problems" id="unreadable"><b>cannot read</b><ul>{items}</ul>'
            "</div>")  # fmt: skip


def _header(state: State) -> str:
    s = state.status
    lines = []
    if s.server.get("running"):
        processes = ", ".join(
            f"{name} {p['pid']}" + ("" if p["alive"] else " (gone)")
            for name, p in s.server["processes"].items()
        )
        lines.append(f"server {_badge('online')} since {_text(s.server['started_at'])} · "
                     f"{_text(processes)}")  # fmt: skip
        lines += [f"run {_text(r['run-id'])} {_text(r['status'])} ({_text(r['elapsed'])})"
                  for r in s.runs]  # fmt: skip
    else:
        lines.append(f"server {_badge('offline')} not running: the folders as they are")
    if s.federation is not None:
        f = s.federation
        lines.append(
            f"federation <code>{_text((f['id'] or '')[:8])}</code> · created "
            f"{_text(f['created'])} · backbones <code>{_text((f['fingerprint'] or '')[:12])}</code>"
            f" · codebook version {_text(s.codebook_version)} · {len(s.classes)} classes"
        )
    lines.append(f"<span class='muted'>{_text(s.federation_dir)} · read {state.read_at}</span>")
    return "".join(f"<div>{line}</div>" for line in lines)


def _now(state: State) -> str:
    run = state.running
    s = state.status
    if run is None:
        last = s.last_run or {}
        finished = f"{counted(len(s.steps), 'step record')}, no step running"
        if last:
            reason = f" · {_text(last.get('reason'))}" if last.get("reason") else ""
            finished += (f" · last run {_badge(last.get('status'))} "
                         f"(written {_text(last.get('written'))}){reason}")  # fmt: skip
        return _section("now", f"<p>{finished}</p>")
    done: dict[str, int] = {}
    for entry in run.done:
        phase = entry.partition("/")[0]
        done[phase] = done.get(phase, 0) + 1
    strip = "".join(
        f'<span class="phase {"done" if key in done else "now" if key == run.phase else ""}">'
        f"{_text(key)}{' ✓' * min(done.get(key, 0), 1)}"
        f"{f' ×{done[key]}' if done.get(key, 0) > 1 else ''}</span>"
        for key in PHASE_ORDER
    )
    text = (
        f"<p>step {run.step + 1} {_badge(RUNNING)} since {_text(run.started)} · phase now: "
        f"<b>{_text(run.phase)}</b> · last checkpoint {_text(run.checkpointed)}</p>"
        f'<div class="phases">{strip}</div>'
        f"<p>classes in play: {_text(', '.join(run.in_play))}</p>"
    )
    return _section("now", text)


def _site_state(row: status.SiteRow) -> Html | None:
    """Flower's word for the node, after ``failing`` and the last error when its last
    exchanges failed (an online site can fail every message)."""
    now = _badge(row.status) if row.status else Html("")
    if not row.failing:
        return now or None
    return Html(f"{_badge(row.state)} {now} <small>{_text(row.failure)}</small>")


def _sites(state: State) -> str:
    s = state.status
    table = _table(
        ("site", "node", "now", "last step", "last seen", "online at", "offline at"),
        (
            (r.name, r.node_id, _site_state(r),
             None if r.last_step is None else r.last_step + 1, r.last_seen, r.online_at,
             r.offline_at)
            for r in s.sites
        ),
        "no site has answered yet",
        name="sites-table",
    )  # fmt: skip
    if not s.server.get("running"):
        table = Html(table + "<p class='muted'>now: known while the server runs</p>")
    keys = _table(
        ("site", "node", "key", "added", "removed"),
        ((r.name, r.node_id, Html(f"<code>{_text(r.fingerprint)}</code>"), r.added_at,
          r.removed_at) for r in state.registrations),
        "no key registered with `starfed server sites add`",
    )  # fmt: skip
    refused = _table(
        ("key", "why", "times", "first", "last", "site"),
        ((Html(f"<code>{_text(r.fingerprint)}</code>"), r.reason, r.count, r.first, r.last,
          r.site and r.site + (" (removed)" if r.removed else "")) for r in state.refused),
        "none in the SuperLink's log",
    )  # fmt: skip
    errors = _table(
        ("site", "step", "phase", "what"),
        ((e.site, e.step + 1, f"{e.phase}/{e.round}", e.status) for e in s.errors),
        "none in the last steps",
    )
    screened = _table(
        ("site", "step", "phase", "class", "what", "why"),
        ((f.site, f.step + 1, f"{f.phase}/{f.round}", _class_name(f.name or None), _badge(f.action),
          f.reason) for f in s.findings),
        "nothing capped or rejected in the last steps",
    )  # fmt: skip
    quarantine = _table(
        ("site", "since step", "why"),
        ((site, held.get("step", 0) + 1, held.get("reason")) for site, held in
         s.quarantine.items()),
        "no site is kept out of later steps",
    )  # fmt: skip
    return _section(
        "sites", table, "<h3>registered keys</h3>", keys, "<h3>refused keys</h3>", refused,
        "<h3>failed exchanges in the last steps</h3>", errors,
        "<h3>screened contributions in the last steps</h3>", screened,
        "<h3>quarantined sites</h3>", quarantine,
    )  # fmt: skip


def _steps(state: State) -> str:
    details = {(d.step, d.attempt): d for d in state.steps}
    rows = []
    for r in state.status.steps:
        d = details.get((r.step, r.attempt))
        rows.append((
            _step_label(r.step, r.attempt), _badge(r.status), r.reason, len(r.classes),
            ", ".join(r.sites), _percent(r.faa), d and _mib(d.bytes_down), d and _mib(d.bytes_up),
            f"{r.wall_s:.0f}", r.finished,
        ))  # fmt: skip
    table = _table(
        ("step", "status", "reason", "classes", "sites", "FAA %", "MiB down", "MiB up",
         "wall s", "finished"),
        rows, "no step finished yet", name="steps-table",
    )  # fmt: skip
    plots = f'<div class="plots">{_plot(state, "steps")}{_plot(state, "bytes")}</div>'
    return _section("steps", plots, table)


def _accuracy(state: State) -> str:
    wide = len(state.accuracy_matrix) > LABEL_EVERY_TASK
    plots = _plot(state, "accuracy") + _plot(state, "sites") + _plot(state, "matrix", wide)
    return _section("accuracy", f'<div class="plots">{plots}</div>')


def _brought(row: status.ClassRow) -> Html:
    """Who brought the class; one site alone marked, as `server status` marks it."""
    sites = _text(", ".join(f"{site} ({when})" for site, when in row.sites.items()))
    if not row.single_site:
        return Html(sites)
    return Html(f'{sites} <span class="alone" title="{_text(SINGLE_SITE)}">one site alone</span>')


def _classes(state: State) -> str:
    rows = (
        (_class_name(c.name), c.step + 1, _brought(c), "yes" if c.frozen else "no",
         _percent(state.class_accuracy.get(c.name)))
        for c in state.status.classes
    )  # fmt: skip
    table = _table(
        ("class", "step", "brought by (first time)", "frozen", "accuracy %"),
        rows, "no class registered yet", name="classes-table",
    )  # fmt: skip
    return _section("classes", table)


def _logs(state: State) -> str:
    table = _table(
        ("log", "bytes", "modified"),
        ((Html(f'<a href="logs/{_text(f.name)}">{_text(f.name)}</a>'), f.bytes, f.modified)
         for f in state.logs),
        "no logs yet: `starfed server start` writes them",
    )  # fmt: skip
    return _section("logs", table, "<p class='muted'>A run's ServerApp output: "
                    "<code>flwr log RUN_ID</code> with the server's FLWR_HOME.</p>")  # fmt: skip


def fragment(state: State) -> str:
    """The page's live part: what ``/live`` answers and the script swaps in."""
    return "".join((
        _problems(state), f'<header>{_header(state)}</header>', _now(state), _sites(state),
        _steps(state), _accuracy(state), _classes(state), _logs(state),
    ))  # fmt: skip


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 1.5em 2em;color:#222}
h1{font-size:20px;margin:.6em 0 .2em}
h2{font-size:16px;border-bottom:1px solid #ccc;margin-top:1.4em}
h3{font-size:14px;margin:.9em 0 .3em}table{border-collapse:collapse;margin:.3em 0}
th,td{border:1px solid #ddd;padding:2px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.badge{color:#fff;border-radius:3px;padding:0 6px;font-size:12px}
.muted,.empty{color:#777}
.problems{background:#fdecea;border:1px solid #c62828;padding:.4em .8em;margin:.6em 0}
.problems ul{margin:.2em 0}.phases{display:flex;gap:4px;flex-wrap:wrap}
.phase{border:1px solid #bbb;border-radius:3px;padding:1px 8px;color:#777}
.phase.done{background:#e8f5e9;border-color:#2e7d32;color:#2e7d32}
.phase.now{background:#1565c0;border-color:#1565c0;color:#fff;font-weight:bold}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:1em}
figure{margin:0}figcaption{color:#555;font-size:12px}img.plot{width:100%;height:auto}
figure.wide{grid-column:1/-1;overflow-x:auto}figure.wide img.plot{width:auto;max-width:none}
#lost{background:#fff3e0;border:1px solid #ef6c00;padding:.3em .8em}
.alone{border:1px solid #ef6c00;border-radius:3px;padding:0 4px;color:#ef6c00;font-size:12px}
"""

SCRIPT = """
async function update() {
  if (document.hidden) return;
  try {
    const reply = await fetch("live", {cache: "no-store"});
    if (!reply.ok) throw new Error(reply.status);
    document.getElementById("live").innerHTML = await reply.text();
    document.getElementById("lost").hidden = true;
  } catch (err) {
    document.getElementById("lost").hidden = false;
  }
}
setInterval(update, EVERY_MS);
"""


def page(state: State, refresh_s: float) -> str:
    script = SCRIPT.replace("EVERY_MS", str(int(refresh_s * 1000)))
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>starfed · {_text(Path(state.status.server_dir).name)}</title>"
        f"<noscript><meta http-equiv='refresh' content='{max(int(refresh_s), 1) * 2}'></noscript>"
        f"<style>{STYLE}</style></head><body><h1>starfed federation</h1>"
        f"<p class='muted'>read-only · updates every {refresh_s:g} s · "
        "<a href='api/state'>as JSON</a></p>"
        "<p id='lost' hidden>the dashboard does not answer: showing the last reading</p>"
        f"<main id='live'>{fragment(state)}</main><script>{script}</script></body></html>"
    )


# --- the app -----------------------------------------------------------------------------------


class Dashboard:
    """The dashboard of one server folder and one federation folder (reads only)."""

    def __init__(self, folder: ServerFolder, federation_dir: Path, refresh_s: float) -> None:
        self.folder = folder
        self.federation_dir = federation_dir
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._state: tuple[float, State] | None = None
        self._slow: tuple[float, status.FlowerView | None, list, list, list[str]] | None = None
        self._images: dict[str, tuple[str, bytes]] = {}

    def state(self) -> State:
        """The folders read now, or at most ``READ_EVERY_S`` ago."""
        with self._lock:
            now = time.monotonic()
            if self._state is None or now - self._state[0] >= READ_EVERY_S:
                self._state = (now, self._read(now))
            return self._state[1]

    def _read(self, now: float) -> State:
        reading = status.read(self.folder, self.federation_dir)
        running = bool(reading.status.server.get("running"))
        if self._slow is None or now - self._slow[0] >= SLOW_EVERY_S:
            self._slow = (now, *self._read_slow(running))
        _, flower, registrations, refused, notes = self._slow
        if running and flower is not None:
            status.join_flower(reading.status, flower)
        reading.status.unreadable += notes
        return build_state(reading, self.folder, registrations, refused)

    def _read_slow(self, running: bool) -> tuple[status.FlowerView | None, list, list, list[str]]:
        """What costs a process or a whole log: the SuperLink's view, sites.json, refusals."""
        notes: list[str] = []

        def guarded(read: Callable[[], list], what: str) -> list:
            try:
                return read()
            except (sites.SitesError, OSError, ValueError) as err:
                notes.append(f"{what}: {err}")
                return []

        flower = status.flower_view(self.folder) if running else None
        registrations = guarded(
            lambda: sites.Registry.load(self.folder.sites_file).sites, self.folder.sites_file.name
        )
        refused = guarded(lambda: sites.refused(self.folder), "the SuperLink log's refused keys")
        return flower, registrations, refused, notes

    def image(self, name: str) -> tuple[str, bytes] | None:
        """(digest, PNG) of a plot of the current state; drawn again only when its data changed."""
        data = PLOTS[name].data(self.state())
        if not data:
            return None
        digest = _digest(data)
        with self._lock:
            cached = self._images.get(name)
        if cached is None or cached[0] != digest:
            out = io.BytesIO()
            PLOTS[name].draw(data, out)
            cached = (digest, out.getvalue())
            with self._lock:
                self._images[name] = cached
        return cached

    def log(self, name: str) -> Path | None:
        """A log of the listing by its exact name, else None: nothing else is ever served."""
        if any(f.name == name for f in _log_files(self.folder)):
            return self.folder.logs / name
        return None

    def app(self) -> Starlette:
        def index(request: Request) -> Response:
            return HTMLResponse(page(self.state(), self.refresh_s), headers=NO_STORE)

        def live(request: Request) -> Response:
            return HTMLResponse(fragment(self.state()), headers=NO_STORE)

        def api_state(request: Request) -> Response:
            return JSONResponse(self.state().to_json(), headers=NO_STORE)

        def plot(request: Request) -> Response:
            name = request.path_params["name"]
            image = self.image(name) if name in PLOTS else None
            if image is None:
                return PlainTextResponse("no such plot, or nothing to draw yet", 404)
            digest, png = image
            fresh = request.query_params.get("v") == digest
            headers = {"Cache-Control": "max-age=86400"} if fresh else NO_STORE
            return Response(png, media_type="image/png", headers=headers)

        def log(request: Request) -> Response:
            path = self.log(request.path_params["name"])
            if path is None:
                return PlainTextResponse("no such log", 404)
            headers = {**NO_STORE, "X-Content-Type-Options": "nosniff"}
            return FileResponse(path, media_type="text/plain; charset=utf-8", headers=headers)

        return Starlette(
            routes=[
                Route("/", index),
                Route("/live", live),
                Route("/api/state", api_state),
                Route("/plots/{name}.png", plot),
                Route("/logs/{name}", log),
            ]
        )


NO_STORE = {"Cache-Control": "no-store"}


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (OSError when the address is taken), before anything is served."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def serve(dashboard: Dashboard, listening: socket.socket) -> None:
    """Answer until SIGINT/SIGTERM (uvicorn's own handling: requests in flight finish)."""
    config = uvicorn.Config(dashboard.app(), log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[listening])
