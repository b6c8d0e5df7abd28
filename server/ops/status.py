"""The federation at a glance (``starfed server status``), gathered from files, without torch.

An operator asks "what does the federation know, where does it stand, who is missing" while a
step runs, after a crash, or with the server stopped. Everything here is read from the federation
folder (``federation.json``, ``registry.json``, ``history.jsonl``, ``codebook.bin``'s header and
``metrics.json``) and the server folder (``run.json``), plus Flower's node list when the server
runs — so it works on a stopped server and answers in about a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from starfed.server.federation import Federation, FederationError, StepRecord
from starfed.server.ops import flower_runs, sites, superlink
from starfed.server.ops.layout import ServerFolder

RECENT_STEPS = 3  # steps whose failed exchanges count as recent errors


@dataclass
class ClassRow:
    name: str
    step: int  # the step that registered it (0-based)
    registered: str
    sites: dict[str, str]  # site -> when it first brought the class
    frozen: bool


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


@dataclass
class ErrorRow:
    site: str
    step: int
    phase: str
    round: int
    status: str


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
    last_run: dict | None = None
    server: dict = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)  # unfinished runs on the SuperLink
    sites_error: str | None = None
    hint: str | None = None  # what to do now: a step is running and the SuperLink is not
    logs: dict[str, str] = field(default_factory=dict)

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


def gather(folder: ServerFolder, federation_dir: Path) -> Status:
    """Everything ``status`` shows; never fails because the server is down or the federation
    does not exist yet (``problem``, ``sites_error`` say so)."""
    status = Status(str(folder.root), str(federation_dir))
    status.logs = {
        "superlink": str(folder.superlink_log),
        "gateway": str(folder.gateway_log),
        "serverapps": str(folder.output_log("superexec")),
    }
    record = superlink.RunRecord.load(folder.run_file)
    status.server = _server(record)
    try:
        _federation(status, Federation.open(federation_dir))
    except FederationError as err:
        status.problem = str(err)
    step_running = bool(status.position and status.position["running"])
    if step_running and not (record and record.superlink_alive()):
        status.hint = superlink.gone(folder, federation_dir, step_running=True)
    if status.server["running"]:
        try:
            _flower_sites(status, sites.status(folder))
            runs = flower_runs.FlowerCli(folder.flwr_home).unfinished_runs()
            status.runs = [{k: r.get(k) for k in ("run-id", "status", "elapsed")} for r in runs]
        except (sites.SitesError, flower_runs.FlowerRunError) as err:
            status.sites_error = str(err)
    return status


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


def _federation(status: Status, federation: Federation) -> None:
    identity = json.loads((federation.root / "federation.json").read_text())
    status.federation = {k: identity.get(k) for k in ("id", "created", "fingerprint")}
    checkpoint = federation.last_checkpoint()
    frozen: frozenset[str] = frozenset()
    if checkpoint is not None:
        status.codebook_version = checkpoint.version
        status.position = asdict(checkpoint.position)
        frozen = checkpoint.frozen
    status.classes = [
        ClassRow(name, r.step, r.registered, dict(r.sites), name in frozen)
        for name, r in federation.registry.items()
    ]
    history = federation.history()
    status.steps = [_step(record) for record in history]
    last: dict[str, SiteRow] = {}
    for record in history:
        answered = {e.site: e.node_id for e in record.exchanges if e.status == "ok" and e.site}
        heard = _heard_at(record)
        for site, node_id in answered.items():
            last[site] = SiteRow(site, node_id, record.step, _when(heard[site]))
    status.sites = sorted(last.values(), key=lambda row: row.name)
    recent = {r.step for r in history[-RECENT_STEPS:]}
    status.errors = [
        ErrorRow(e.site or f"node-{e.node_id}", e.step, e.phase, e.round, e.status)
        for record in history
        if record.step in recent
        for e in record.exchanges
        if e.status != "ok"
    ]
    metrics = federation.root / "metrics.json"
    if metrics.is_file():
        with_metrics = json.loads(metrics.read_text())
        keys = ("status", "reason", "steps_this_run", "wall_time_s", "final_average_accuracy")
        status.last_run = {k: with_metrics.get(k) for k in keys}
        status.last_run["written"] = _when(metrics.stat().st_mtime)


def _heard_at(record: StepRecord) -> dict[str, float]:
    """Site -> when the last phase round it answered in ended (its reply came in that round).
    Not the step's end: a site killed mid-step went offline long before its step ended."""
    ended, clock = {}, record.started
    for phase in record.phase_seconds:  # in the order they ran
        clock += phase.seconds
        ended[phase.phase, phase.round] = clock
    heard: dict[str, float] = {}
    for e in record.exchanges:
        if e.status == "ok" and e.site:
            when = ended.get((e.phase, e.round), record.ended)  # a failed phase: no time of its own
            heard[e.site] = max(heard.get(e.site, when), when)
    return heard


def _step(record: StepRecord) -> StepRow:
    return StepRow(
        record.step,
        record.attempt,
        record.status,
        record.reason,
        list(record.classes),
        list(record.sites),
        _number(record.scores.mean_accuracy if record.scores else None),
        record.wall_s,
        _when(record.ended),
    )


def _flower_sites(status: Status, rows: list[sites.SiteStatus]) -> None:
    """Join Flower's view of the nodes onto the federation's sites, by node id (a site's name
    in the federation is what it calls itself; sites.json has the operator's name)."""
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
