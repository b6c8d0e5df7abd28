"""The federation at a glance (``starfed server status``), gathered from files, without torch.

An operator asks "what does the federation know, where does it stand, who is missing" while a
step runs, after a crash, or with the server stopped. Everything here is read from the federation
folder (``federation.json``, ``registry.json``, ``history.jsonl``, ``codebook.bin``'s header and
``metrics.json``) and the server folder (``run.json``), plus Flower's node list when the server
runs — so it works on a stopped server and answers in about a second. Each file is read on its
own: one that cannot be read (damaged, mid-copy, unreadable) is named in ``unreadable`` and the
rest is shown; the folder's own check (``server.folder_check``: the current codebook's store
checksummed, about a second per 2 GB, no tensor decoded) lists its ``problems``, and a damaged
folder makes ``status`` exit non-zero. The dashboard
(``starfed.server.ops.dashboard``) draws the same reading (:func:`read`), with the step records
it came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from starfed.ops import flower_runs
from starfed.ops.processes import ProcessError
from starfed.server import folder_check
from starfed.server.federation import Federation
from starfed.server.folder_files import (
    CODEBOOK_FILE,
    HISTORY_FILE,
    IDENTITY_FILE,
    METRICS_FILE,
    QUARANTINE_FILE,
    REGISTRY_FILE,
    STEP_FINDINGS_FILE,
    WITHDRAWALS_FILE,
    FederationError,
)
from starfed.server.ops import sites, superlink
from starfed.server.ops.layout import ServerFolder
from starfed.server.quarantine import Quarantined
from starfed.server.records import Exchange, Finding, Outcome, StepRecord
from starfed.server.step_failures import read_step_failures

RECENT_STEPS = 3  # steps whose failed exchanges and screening findings count as recent
#: A site whose last exchanges failed, whatever Flower says of it (an online site can fail
#: every message: a broken install, a missing data folder).
FAILING = "failing"
#: What reading a file of the folders may raise when it is damaged or cannot be read.
UNREADABLE = (
    FederationError,
    superlink.ServerError,
    ProcessError,
    OSError,
    ValueError,
    TypeError,
    KeyError,
)
T = TypeVar("T")


@dataclass
class ClassRow:
    name: str
    step: int  # the step that registered it (0-based)
    registered: str
    sites: dict[str, str]  # site -> when it first brought the class
    frozen: bool
    #: brought by one site alone: no median over sites checks its rows, only the screening's
    #: references (server/screening.py, docs/security.md)
    single_site: bool = False


@dataclass
class StepRow:
    step: int  # 0-based, as in history.jsonl
    attempt: int
    status: str
    reason: str
    classes: list[str]
    sites: list[str]
    faa: float | None  # mean accuracy over the arrival steps after this step (%)
    wall_s: float
    finished: str
    findings: int = 0  # contributions the screening capped or rejected (server/screening.py)
    quarantined: list[str] = field(default_factory=list)  # sites left out of the step's rest
    replay_s: float = 0.0  # the server's replays (``StepRecord.replays``)


@dataclass
class SiteRow:
    """A site as the federation saw it (its last step) and, when the server runs, as Flower
    sees it now."""

    name: str
    node_id: int | None = None  # Flower's, from the site's exchanges or its registration
    last_step: int | None = None
    last_seen: str | None = None  # when the last phase round it answered in ended
    status: str | None = None  # Flower's: registered | online | offline | unregistered
    online_at: str | None = None
    offline_at: str | None = None
    epsilon: float | None = None  # privacy spent (ε for one image), as its last reply said
    failing: str | None = None  # its last exchange's error, when its last exchanges failed
    failed_in_a_row: int = 0  # how many of its last exchanges failed

    @property
    def state(self) -> str | None:
        """What to show first: ``failing`` over Flower's word for the node."""
        return FAILING if self.failing else self.status

    @property
    def failure(self) -> str:
        """Its failing streak in words (``status`` and the dashboard say it alike)."""
        n = self.failed_in_a_row
        which = "its last exchange" if n == 1 else f"its last {n} exchanges"
        return f"{which} failed, the last with {self.failing}"


@dataclass
class ErrorRow:
    site: str
    step: int
    phase: str
    round: int
    status: str


@dataclass
class FindingRow:
    """A contribution the server's screening capped or rejected, or a site it quarantined."""

    site: str
    step: int
    phase: str
    round: int
    action: str  # capped | rejected | quarantined
    name: str  # the class ("" for a whole reply)
    reason: str


@dataclass
class TakenRow:
    """What a step's new classes, brought by ``by``, took from a site's earlier classes: points
    of its accuracy there (``server.taken``; a record, not a finding)."""

    site: str
    step: int
    by: list[str]
    points: float
    classes: list[str]


@dataclass
class Status:
    server_dir: str
    federation_dir: str
    federation: dict | None = None  # id, created, fingerprint
    problem: str | None = None  # why there is no federation to show
    codebook_version: int | None = None
    position: dict | None = None  # step, running, done, in_play
    classes: list[ClassRow] = field(default_factory=list)
    steps: list[StepRow] = field(default_factory=list)
    sites: list[SiteRow] = field(default_factory=list)
    errors: list[ErrorRow] = field(default_factory=list)
    refusals: list[ErrorRow] = field(default_factory=list)  # sites' answers that refused
    findings: list[FindingRow] = field(default_factory=list)  # of the last steps and this one
    taken: list[TakenRow] = field(default_factory=list)  # of the last steps
    quarantine: dict[str, Quarantined] = field(default_factory=dict)  # kept out of later steps
    last_run: dict | None = None
    server: dict = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)  # unfinished runs on the SuperLink
    sites_error: str | None = None
    hint: str | None = None  # what to do now: a step is running and the SuperLink is not
    logs: dict[str, str] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)  # files left out, and why
    problems: list[str] = field(default_factory=list)  # the folder's damage (``check``'s lines)
    notes: list[str] = field(default_factory=list)  # the folder's lock holder, and the like

    @property
    def damaged(self) -> bool:
        """The federation folder needs repair: ``status`` exits non-zero."""
        return bool(self.problems)

    def to_json(self) -> dict:
        """Plain JSON (NaN accuracies become null)."""
        return _finite(asdict(self))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


@dataclass
class Reading:
    """One reading of the folders: what ``status`` shows, and the step records it came from."""

    status: Status
    history: list[StepRecord] = field(default_factory=list)


@dataclass
class FlowerView:
    """What the running SuperLink says now: its nodes and its unfinished runs."""

    sites: list[sites.SiteStatus] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    error: str | None = None


def gather(folder: ServerFolder, federation_dir: Path) -> Status:
    """Everything ``status`` shows; never fails because the server is down or the federation
    does not exist yet (``problem``, ``sites_error`` say so)."""
    status = read(folder, federation_dir).status
    if status.server["running"]:
        join_flower(status, flower_view(folder))
    return status


def read(
    folder: ServerFolder,
    federation_dir: Path,
    depth: folder_check.Depth = folder_check.Depth.CHECKSUMS,
) -> Reading:
    """The folders' files only (no Flower, no process started): every file guarded; the
    current codebook's files read to ``depth`` (the dashboard, reading every second, reads
    headers: ``status`` checksums them)."""
    status = Status(str(folder.root), str(federation_dir))
    status.logs = {
        "superlink": str(folder.superlink_log),
        "gateway": str(folder.gateway_log),
        "serverapps": str(folder.output_log("superexec")),
    }
    load = superlink.RunRecord.load
    record = _guarded(status, folder.run_file, lambda: load(folder.run_file), None)
    status.server = _server(record)
    if (federation_dir / IDENTITY_FILE).is_file():  # a folder with no identity is a new one
        report = folder_check.check(federation_dir, depth=depth, kept=False)
        status.problems, status.notes = report.problems, report.notes
    try:  # the registered sites: a damaged sites.json is damage too (exit 1), not a detail
        sites.Registry.load(folder.sites_file)
    except sites.SitesError as err:
        status.problems.append(
            f"{err}: restore it, or move it aside and record the sites again "
            "(`starfed server sites add NAME KEY --adopt`)"
        )
    try:
        federation = Federation.open(federation_dir)  # reads federation.json and registry.json
    except UNREADABLE as err:
        status.problem = str(err)
        federation = None
    history = [] if federation is None else _federation(status, federation)
    step_running = bool(status.position and status.position["running"])
    if step_running and not (record and record.superlink_alive()):
        status.hint = superlink.gone(folder, federation_dir, step_running=True)
    return Reading(status, history)


def _guarded(status: Status, path: Path, read: Callable[[], T], default: T) -> T:
    """``read()``, or ``default`` with the file named in ``status.unreadable``."""
    try:
        return read()
    except UNREADABLE as err:
        status.unreadable.append(f"{path.name}: {err}")
        return default


def flower_view(folder: ServerFolder) -> FlowerView:
    """Ask the running SuperLink (through ``flwr``, a second or two)."""
    try:
        rows = sites.status(folder)
        runs = flower_runs.FlowerCli(folder.flwr_home).unfinished_runs()
    except (sites.SitesError, flower_runs.FlowerRunError) as err:
        return FlowerView(error=str(err))
    return FlowerView(rows, [{k: r.get(k) for k in ("run-id", "status", "elapsed")} for r in runs])


def join_flower(status: Status, view: FlowerView) -> None:
    status.sites_error = view.error
    status.runs = list(view.runs)
    _flower_sites(status, view.sites)


def _server(record: superlink.RunRecord | None) -> dict:
    if record is None:
        return {"running": False, "processes": {}}
    alive = record.alive()
    return {
        "running": any(alive.values()),
        "started_at": record.started_at,
        "public_address": record.public_address,
        "processes": {p.name: {"pid": p.pid, "alive": alive[p.name]} for p in record.processes},
    }


def _federation(status: Status, federation: Federation) -> list[StepRecord]:
    root = federation.root
    known = {"id": federation.id, "fingerprint": federation.fingerprint}
    identity = _guarded(
        status, root / IDENTITY_FILE, lambda: json.loads((root / IDENTITY_FILE).read_text()), known
    )
    status.federation = {k: identity.get(k) for k in ("id", "created", "fingerprint")}
    last = federation.checkpoints.last_checkpoint
    checkpoint = _guarded(status, root / CODEBOOK_FILE, last, None)
    frozen: frozenset[str] = frozenset()
    if checkpoint is not None:
        status.codebook_version = checkpoint.version
        status.position = checkpoint.position.to_json()
        frozen = checkpoint.frozen
        unregistered = [name for name in checkpoint.classes if name not in federation.registry]
        if unregistered:
            status.unreadable.append(
                f"{REGISTRY_FILE}: {len(unregistered)} class(es) of the codebook are not in it "
                "(missing or older than the codebook): their steps and sites are unknown"
            )
    status.classes = [
        ClassRow(name, r.step, r.registered, dict(r.sites), name in frozen, len(r.sites) == 1)
        for name, r in federation.registry.items()
    ]
    history: list[StepRecord] = _guarded(status, root / HISTORY_FILE, federation.history, [])
    status.steps = [_step(record) for record in history]
    metrics = root / METRICS_FILE
    run = _guarded(status, metrics, lambda: _read_metrics(metrics), None)
    unrecorded = _unrecorded(history, run[2]) if run else []
    if checkpoint is not None and checkpoint.position.running:  # the step in progress, so far
        unrecorded += read_step_failures(root, checkpoint.position.step)
    status.sites = _site_rows(history, (run[1], unrecorded) if run else None)
    recent = {r.step for r in history[-RECENT_STEPS:]}
    lately = [e for r in history if r.step in recent for e in r.exchanges] + unrecorded
    rows = [(e, ErrorRow(_name(e), e.step, e.phase, e.round, str(e.status))) for e in lately]
    status.errors = [row for e, row in rows if e.failed]
    status.refusals = [row for e, row in rows if e.status.outcome is Outcome.REFUSED]
    findings = [
        (record.step, f) for record in history if record.step in recent for f in record.findings
    ]
    if checkpoint is not None and checkpoint.position.running:  # the step in progress, so far
        step = checkpoint.position.step
        so_far: list[Finding] = _guarded(
            status, root / STEP_FINDINGS_FILE, lambda: federation.step_findings(step), []
        )
        findings += [(step, f) for f in so_far]
    status.findings = [
        FindingRow(f.site, step, f.phase, f.round, f.action, f.name, f.reason)
        for step, f in findings
    ]
    status.taken = [
        TakenRow(t.site, r.step, list(t.by), round(t.points, 1), list(t.classes))
        for r in history
        if r.step in recent
        for t in r.taken
    ]
    status.quarantine = _guarded(status, root / QUARANTINE_FILE, federation.quarantine, {})
    if rerun := _guarded(status, root / WITHDRAWALS_FILE, federation.rerunning, None):
        status.notes.append(rerun)  # an exact withdrawal's steps, run again
    status.last_run = _last_run(run[0], run[1]) if run else None
    return history


def _site_rows(
    history: list[StepRecord], unrecorded: tuple[float, list[Exchange]] | None
) -> list[SiteRow]:
    """Each site as its last answer left it, and failing when its last exchanges failed (in
    the step records, or ``unrecorded`` by them at that time: ``_unrecorded``)."""
    last: dict[str, SiteRow] = {}
    epsilon: dict[str, float] = {}
    for record in history:
        answered = {e.site: e.node_id for e in record.exchanges if not e.failed and e.site}
        epsilon.update({e.site: e.epsilon for e in record.exchanges if e.epsilon is not None})
        heard = _heard_at(record)
        for site, node_id in answered.items():
            last[site] = SiteRow(site, node_id, record.step, _when(heard[site]))
            last[site].epsilon = epsilon.get(site)
    batches: list[tuple[float, Sequence[Exchange]]] = [(r.ended, r.exchanges) for r in history]
    batches += [unrecorded] if unrecorded else []
    for name, (node_id, error, count) in _failing(batches).items():
        row = last.setdefault(name, SiteRow(name, node_id))
        row.failing, row.failed_in_a_row = error, count
    return sorted(last.values(), key=lambda row: row.name)


def _read_metrics(metrics: Path) -> tuple[dict, float, list[Exchange]] | None:
    """The last finished run's metrics.json, when it was written, and the run's exchanges."""
    if not metrics.is_file():
        return None
    with_metrics = json.loads(metrics.read_text())
    exchanges = [Exchange.from_json(e) for e in with_metrics.get("exchanges", ())]
    return with_metrics, metrics.stat().st_mtime, exchanges


def _last_run(with_metrics: dict, written: float) -> dict:
    keys = ("status", "reason", "steps_this_run", "wall_time_s", "final_average_accuracy")
    return {**{k: with_metrics.get(k) for k in keys}, "written": _when(written)}


def _name(e: Exchange) -> str:
    """A site as the records name it: by its name once known, else by its node id."""
    return e.site or f"node-{e.node_id}"


def _unrecorded(history: list[StepRecord], exchanges: list[Exchange]) -> list[Exchange]:
    """The last run's exchanges that no step record holds: a run whose sync found nothing
    to do (every site failed it, say) records no step, only its metrics."""
    recorded = {
        (e.step, e.phase, e.round, e.node_id, e.status) for r in history for e in r.exchanges
    }
    return [e for e in exchanges if (e.step, e.phase, e.round, e.node_id, e.status) not in recorded]


def _failing(
    batches: list[tuple[float, Sequence[Exchange]]],
) -> dict[str, tuple[int, str, int]]:
    """Sites whose last exchanges failed -> (node id, the last one's error, how many in a
    row), from batches of exchanges with the time each batch ended, read oldest first."""
    streak: dict[str, tuple[int, str, int]] = {}
    for _, exchanges in sorted(batches, key=lambda batch: batch[0]):
        for e in exchanges:
            if e.failed:
                count = streak.get(_name(e), (0, "", 0))[2] + 1
                streak[_name(e)] = (e.node_id, str(e.status), count)
            else:
                streak.pop(_name(e), None)
    return streak


def _heard_at(record: StepRecord) -> dict[str, float]:
    """Site -> when the last phase round it answered in ended (its reply came in that round).
    Not the step's end: a site killed mid-step went offline long before its step ended."""
    ended, clock = {}, record.started
    for phase in record.phase_seconds:  # in the order they ran
        clock += phase.seconds
        ended[phase.phase, phase.round] = clock
    heard: dict[str, float] = {}
    for e in record.exchanges:
        if not e.failed and e.site:
            when = ended.get((e.phase, e.round), record.ended)  # a failed phase: no time of its own
            heard[e.site] = max(heard.get(e.site, when), when)
    return heard


def _step(record: StepRecord) -> StepRow:
    faa = _number(record.scores.mean_accuracy if record.scores else None)
    return StepRow(
        record.step,
        record.attempt,
        record.status,
        record.reason or _why_degraded(record),
        list(record.classes),
        list(record.sites),
        faa,
        record.wall_s,
        _when(record.ended),
        len([f for f in record.findings if f.action != "quarantined"]),
        list(record.quarantined),
        sum(replay.seconds for replay in record.replays),
    )


def _why_degraded(record: StepRecord) -> str:
    """A degraded step's record has no reason (a failed one has): what degraded it, from its
    exchanges and quarantine, in the words of the errors table."""
    failed = [f"{_name(e)} {e.status} in {e.phase}/{e.round}" for e in record.exchanges if e.failed]
    said = failed[:3] + ([f"{len(failed) - 3} more"] if len(failed) > 3 else [])
    if record.quarantined:
        said.append(f"quarantined {', '.join(record.quarantined)}")
    return "; ".join(said)


def _flower_sites(status: Status, rows: list[sites.SiteStatus]) -> None:
    """Join Flower's view of the nodes onto the federation's sites, by node id (a site
    registered in sites.json has the operator's name in the federation too, since `server
    run` passes ``site-names``; steps recorded before, and unregistered nodes, have the name
    a site calls itself)."""
    by_node = {row.node_id: row for row in status.sites}
    by_name = {row.name: row for row in status.sites}
    for flower in rows:
        if flower.removed_at:
            continue
        row = by_node.get(flower.node_id) or by_name.get(flower.name or "")
        if row is None:
            row = SiteRow(flower.name or f"node-{flower.node_id}")
            status.sites.append(row)
        row.node_id, row.status = flower.node_id, flower.status
        row.online_at, row.offline_at = flower.online_at, flower.offline_at
    status.sites.sort(key=lambda row: row.name)
