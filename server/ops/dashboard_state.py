"""What the dashboard shows (``starfed server dashboard``): the federation's state, read once.

One reading of the folders feeds the page, its images and ``/api/state`` (:class:`State` as
JSON). It is ``status.read`` (the reader ``starfed server status`` uses) plus what only a page
draws: each step record's bytes and phase times, the scores by site and class, the step in
progress and the server folder's logs. :class:`Reader` reads the files at most every
``READ_EVERY_S``, whoever asks, and what costs a process or a whole log (Flower's node list,
``sites.json``, the SuperLink log's refused keys) at most every ``SLOW_EVERY_S``. Read-only: no
lock, no cache file; a file that cannot be read is named under "cannot read" and the rest is
shown (``status.read`` guards each one).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from starfed.server import folder_check
from starfed.server.folder_files import CODEBOOK_FILE, STEP_START_FILE
from starfed.server.ops import sites, status
from starfed.server.ops.layout import ServerFolder
from starfed.server.records import PhaseRound, StepRecord
from starfed.shared.metrics import AccuracyMatrix, nan_to_none
from starfed.shared.protocol import Phase

READ_EVERY_S = 1.0  # a page and its images share one reading of the folders
SLOW_EVERY_S = 15.0  # Flower's node list and the SuperLink log's refused keys
RUNNING = "running"  # the status word of the step in progress (badges, the timeline)
PHASE_ORDER = [phase.key for phase in Phase]  # the sync, then the codebook phases


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
    done: list[str]  # its phase rounds' text (PhaseRound), as the position holds them
    phase: str  # the phase under way: the one after the last completed
    in_play: list[str]
    started: str | None  # when the step began (its rollback copy was written)
    checkpointed: str | None  # the last completed phase's checkpoint
    started_s: float | None = None
    wall_s: float | None = None  # so far, when the folders were read

    def rounds_done(self) -> dict[str, int]:
        """Phase -> how many of its rounds this step completed (the page's phase strip)."""
        return dict(Counter(PhaseRound.from_json(entry).phase for entry in self.done))


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
    last = PhaseRound.from_json(done[-1]).phase if done else None
    after = PHASE_ORDER.index(last) + 1 if last in PHASE_ORDER else 0
    phase = PHASE_ORDER[after] if after < len(PHASE_ORDER) else "closing the step"
    started = _mtime(federation_dir / STEP_START_FILE)
    checkpointed = _mtime(federation_dir / CODEBOOK_FILE)
    return Running(
        position["step"],
        done,
        phase,
        list(position["in_play"]),
        None if started is None else _iso(started),
        None if checkpointed is None else _iso(checkpointed),
        started,
        None if started is None else now - started,
    )


def _detail(record: StepRecord) -> StepDetail:
    phases: dict[str, float] = {}
    for timing in record.phase_seconds:
        phases[timing.phase] = phases.get(timing.phase, 0.0) + timing.seconds
    return StepDetail(
        record.step,
        record.attempt,
        record.status,
        record.started,
        record.wall_s,
        sum(e.bytes_down for e in record.exchanges),
        sum(e.bytes_up for e in record.exchanges),
        phases,
    )


def log_files(folder: ServerFolder) -> list[LogFile]:
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
        logs=log_files(folder),
    )


@dataclass
class _Slow:
    """What costs a process or a whole log, read at most every ``SLOW_EVERY_S``."""

    at: float
    flower: status.FlowerView | None
    registrations: list[sites.SiteRecord]
    refused: list[sites.Refusal]
    notes: list[str]  # what of it could not be read


class Reader:
    """The state of one server folder and one federation folder, read at most once a second."""

    def __init__(self, folder: ServerFolder, federation_dir: Path) -> None:
        self.folder = folder
        self.federation_dir = federation_dir
        self._lock = threading.Lock()
        self._state: tuple[float, State] | None = None
        self._slow: _Slow | None = None

    def state(self) -> State:
        """The folders read now, or at most ``READ_EVERY_S`` ago."""
        with self._lock:
            now = time.monotonic()
            if self._state is None or now - self._state[0] >= READ_EVERY_S:
                self._state = (now, self._read(now))
            return self._state[1]

    def _read(self, now: float) -> State:
        reading = status.read(self.folder, self.federation_dir, folder_check.Depth.HEADERS)
        running = bool(reading.status.server.get("running"))
        if self._slow is None or now - self._slow.at >= SLOW_EVERY_S:
            self._slow = self._read_slow(now, running)
        slow = self._slow
        if running and slow.flower is not None:
            status.join_flower(reading.status, slow.flower)
        reading.status.unreadable += slow.notes
        return build_state(reading, self.folder, slow.registrations, slow.refused)

    def _read_slow(self, now: float, running: bool) -> _Slow:
        """The SuperLink's view, sites.json, the refused keys; each guarded on its own."""
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
        return _Slow(now, flower, registrations, refused, notes)
