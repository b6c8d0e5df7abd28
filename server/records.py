"""The federation's typed records: what a step's history line, a checkpoint's position and a
withdrawal hold (each record file's reader and writer is its own module: ``server.history``,
``server.registry``, ``server.quarantine``, ``server.step_findings``, …).

Each is a frozen (or plain) dataclass written as JSON exactly as the folders hold it, through
explicit ``to_json``/``from_json``: an exchange's status as its text (``"ok"``, ``"no reply"``,
``"<outcome>: <reason>"``), a position's phase rounds as ``"<phase>/<round>"``; folders written
before these types read unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

POSITION_KEY = "position"  # codebook metadata key of the protocol position


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class PhaseRound:
    """One round of one phase of a step, as a position's ``done`` and the logs name it; written
    as ``"<phase>/<round>"`` (``"sync/0"``: ``to_json``, ``from_json``), which it also prints as."""

    phase: str
    round: int = 0

    def __post_init__(self) -> None:
        if not self.phase or "/" in self.phase or self.round < 0:
            raise ValueError(f"phase round {self.phase!r}/{self.round!r} is not <phase>/<round>")

    def __str__(self) -> str:
        return f"{self.phase}/{self.round}"

    def to_json(self) -> str:
        return str(self)

    @classmethod
    def from_json(cls, text: str) -> PhaseRound:
        """The phase round ``text`` names (ValueError: not ``<phase>/<round>``)."""
        phase, slash, number = text.rpartition("/")
        if not slash or not phase or not number.isdigit():
            raise ValueError(f"phase round {text!r} is not <phase>/<round>")
        return cls(phase, int(number))


@dataclass(frozen=True)
class Position:
    """Where the protocol stands: ``step`` is in progress (``running``) with the phase rounds
    ``done`` and ``in_play`` classes, or it is the next step to run. Phase rounds given as text
    are read (``PhaseRound.from_json``)."""

    step: int = 0
    running: bool = False
    done: tuple[PhaseRound, ...] = ()
    in_play: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        done = tuple(d if isinstance(d, PhaseRound) else PhaseRound.from_json(d) for d in self.done)
        object.__setattr__(self, "done", done)
        object.__setattr__(self, "in_play", tuple(self.in_play))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> Position:
        """The position a codebook's metadata carries (ValueError, TypeError: damaged)."""
        return cls(**json.loads(metadata.get(POSITION_KEY, "{}")))

    def to_json(self) -> dict[str, Any]:
        """Its JSON form: phase rounds as their text (``"sync/0"``)."""
        return {
            "step": self.step,
            "running": self.running,
            "done": [d.to_json() for d in self.done],
            "in_play": list(self.in_play),
        }

    def as_metadata(self) -> dict[str, str]:
        """The metadata entry that carries it."""
        return {POSITION_KEY: json.dumps(self.to_json())}

    def done_text(self) -> str:
        """The phase rounds done, comma-separated ("" when none)."""
        return ", ".join(str(d) for d in self.done)


class Outcome(StrEnum):
    """How one message to one site ended."""

    OK = "ok"
    ERROR = "error"  # the site's app failed (Flower's error reply)
    NO_REPLY = "no reply"  # nothing came back in time
    REJECTED = "rejected"  # the reply failed the server's checks
    REFUSED = "refused"  # a private site's exhausted budget, or the site's policy: an answer


@dataclass(frozen=True)
class ExchangeStatus:
    """An exchange's outcome and why; written as one text (``to_json``, ``from_json``), which it
    also prints as: ``"ok"``, ``"no reply"``, ``"error: <reason>"``, ``"rejected: <reason>"``,
    ``"refused: <why>"``."""

    outcome: Outcome = Outcome.OK
    reason: str = ""

    def __str__(self) -> str:
        if self.outcome in _WITH_REASON:
            return f"{self.outcome}: {self.reason}"
        return self.outcome.value

    def to_json(self) -> str:
        return str(self)

    @classmethod
    def from_json(cls, text: str) -> ExchangeStatus:
        """The status ``text`` writes (ValueError: none of the forms above)."""
        if text in (Outcome.OK, Outcome.NO_REPLY):
            return cls(Outcome(text))
        outcome, colon, reason = text.partition(": ")
        if not colon or outcome not in _WITH_REASON:
            raise ValueError(f"exchange status {text!r} is none of ok, no reply, <outcome>: why")
        return cls(Outcome(outcome), reason)

    @property
    def failed(self) -> bool:
        """Not answered as asked: an error, no reply or a rejected reply. A site's refusal
        (a private site's exhausted budget, or its policy) is an answer."""
        return self.outcome not in (Outcome.OK, Outcome.REFUSED)


_WITH_REASON = (Outcome.ERROR, Outcome.REJECTED, Outcome.REFUSED)  # "<outcome>: <reason>"


@dataclass
class Exchange:
    """One message to one node and its answer: what the wire carried and what came back (filled
    in while its phase runs, then kept in the step's record). A status given as text (a record
    read back) is read (``ExchangeStatus.from_json``)."""

    step: int
    phase: str
    round: int
    node_id: int
    site: str
    bytes_down: int
    bytes_up: int = 0
    status: ExchangeStatus = field(default_factory=ExchangeStatus)
    epsilon: float | None = None  # a private site's ε so far, as its reply says
    reply_sha256: str = ""  # of the reply's bytes (``protocol.reply_sha256``): the site's record

    def __post_init__(self) -> None:
        if not isinstance(self.status, ExchangeStatus):
            self.status = ExchangeStatus.from_json(self.status)

    @property
    def failed(self) -> bool:
        """Not answered as asked (``ExchangeStatus.failed``)."""
        return self.status.failed

    def to_json(self) -> dict[str, Any]:
        """Its JSON form: the status as its text; no ``reply_sha256`` where there is none (no
        reply, or a line written before the hashes: it writes back the same)."""
        raw = {**{f.name: getattr(self, f.name) for f in fields(self)}, "status": str(self.status)}
        if not self.reply_sha256:
            del raw["reply_sha256"]
        return raw

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Exchange:
        return cls(**{**raw, "status": ExchangeStatus.from_json(raw["status"])})


CAPPED, REJECTED, QUARANTINED = "capped", "rejected", "quarantined"  # a finding's action
#: A finding's action for a claim the server knows better (a reply's privacy key against the
#: site's registration): recorded and counted, and nothing is changed by it.
CONTRADICTED = "contradicted"
#: A finding's action for what an operator should see but is no fault of the site's (a catch-up
#: the step's end stopped after the site staged parts: it resumes): recorded, not counted.
NOTED = "noted"


@dataclass(frozen=True)
class Finding:
    """One contribution the server's screening capped or rejected, a claim it contradicted, or
    a site it quarantined (``server.screening``): kept in the step's record so an operator sees
    who did what."""

    site: str
    phase: str
    round: int
    action: str  # CAPPED, REJECTED, CONTRADICTED, NOTED or QUARANTINED
    reason: str
    name: str = ""  # the class, when the finding is about one class's row

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Finding:
        return cls(**raw)


@dataclass(frozen=True)
class PhaseTime:
    """The wall time of one phase round of a step."""

    phase: str
    round: int
    seconds: float


@dataclass(frozen=True)
class ReplayCost:
    """What the server's replay after one statistics phase cost: its wall time, the classes it
    sampled (every class of the codebook: each one's mixture is drawn) and the step's classes
    among them (its new ones: at most ``max-step-classes``; docs/security.md, "Bounded
    registration")."""

    phase: str
    seconds: float
    classes: int
    new_classes: int


@dataclass(frozen=True)
class Taken:
    """What a step's new classes took (``server.taken``): ``images`` of ``site``'s test images
    of classes it held before the step (``of`` in all), predicted as the step's new classes
    ``classes``, brought by ``by``."""

    site: str
    by: tuple[str, ...]  # the sites that brought the classes
    classes: tuple[str, ...]
    images: int
    of: int

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Taken:
        return cls(**{**raw, "by": tuple(raw["by"]), "classes": tuple(raw["classes"])})

    @property
    def points(self) -> float:
        return 100.0 * self.images / self.of if self.of else math.nan

    def line(self, step: int) -> str:
        """The log's line; ``step`` as numbered for people (from 1)."""
        return (
            f"step {step}'s classes of {', '.join(self.by)} took {self.points:.1f} points of "
            f"{self.site}'s accuracy on its earlier classes ({self.images} of {self.of} test "
            f"images, to {', '.join(self.classes[:5])}{' …' if len(self.classes) > 5 else ''})"
        )


@dataclass
class StepScores:
    """The federation's scores after one step, by arrival step (``server.scores.aggregate``)."""

    accuracy: list[float]  # % per arrival step 0..step (NaN: nobody holds test images of it)
    selection_accuracy: list[float]  # % of prompt selections of a key of the same step
    mean_accuracy: float  # over the arrival steps with test images
    sites: dict[str, dict] = field(default_factory=dict)  # site -> images, correct, accuracy
    classes: dict[str, dict] = field(default_factory=dict)  # class -> images, correct, sites


@dataclass(frozen=True)
class StepRecord:
    """One line of ``history.jsonl``: a finished step (or a failed attempt at one)."""

    step: int
    status: str  # COMPLETED, DEGRADED or FAILED
    started: float  # time.time() at its start
    wall_s: float
    attempt: int = 0  # earlier failed attempts at the same step
    reason: str = ""  # why it failed
    classes: tuple[str, ...] = ()  # the classes it registered
    sites: tuple[str, ...] = ()  # the sites that took part
    phase_seconds: tuple[PhaseTime, ...] = ()
    exchanges: tuple[Exchange, ...] = ()
    codebook_version: int = 0
    scores: StepScores | None = None  # the sites' evaluation
    server_eval: StepScores | None = None  # the server's test set (``server-test-dir``)
    findings: tuple[Finding, ...] = ()  # contributions capped or rejected (``server.screening``)
    quarantined: tuple[str, ...] = ()  # sites excluded from the rest of the step
    replays: tuple[ReplayCost, ...] = ()  # the server's replays of this run of the step
    taken: tuple[Taken, ...] = ()  # what its new classes took from the sites' earlier ones

    @property
    def ended(self) -> float:
        return self.started + self.wall_s

    def to_json(self) -> str:
        raw = {**asdict(self), "exchanges": [e.to_json() for e in self.exchanges]}
        if not self.replays:  # none ran (or a line from before issue 43): read back the same
            del raw["replays"]
        if not self.taken:  # nothing over the bound (or a line from before): read back the same
            del raw["taken"]
        return json.dumps({k: v for k, v in raw.items() if v is not None})

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        raw: dict[str, Any] = json.loads(line)
        scores = {k: StepScores(**raw[k]) for k in ("scores", "server_eval") if raw.get(k)}
        return cls(
            **{
                **raw,
                **scores,
                "classes": tuple(raw.get("classes", ())),
                "sites": tuple(raw.get("sites", ())),
                "phase_seconds": tuple(PhaseTime(**p) for p in raw.get("phase_seconds", ())),
                "exchanges": tuple(Exchange.from_json(e) for e in raw.get("exchanges", ())),
                "findings": tuple(Finding.from_json(f) for f in raw.get("findings", ())),
                "quarantined": tuple(raw.get("quarantined", ())),
                "replays": tuple(ReplayCost(**r) for r in raw.get("replays", ())),
                "taken": tuple(Taken.from_json(t) for t in raw.get("taken", ())),
            }
        )


@dataclass(frozen=True)
class Checkpoint:
    """What ``codebook.bin`` says without decoding its tensors (no torch): for views of the
    folder (``starfed server status``, an interrupted run's marker)."""

    version: int
    classes: tuple[str, ...]
    frozen: frozenset[str]
    position: Position


@dataclass(frozen=True)
class Withdrawal:
    """One line of ``withdrawals.jsonl``: a site that left and what its leaving changed
    (``server.withdrawal``). ``steps`` completed when it was made; ``touched``: the later
    steps in which other sites trained on a codebook that held its values (not undone)."""

    site: str
    when: str
    steps: int
    removed: tuple[str, ...] = ()  # the classes only it brought
    remerged: tuple[str, ...] = ()  # the classes it shared, merged again without it
    touched: tuple[int, ...] = ()
    codebook_version: int = 0
    # exact mode: the steps completed the federation went back to (the checkpoint before the
    # site's first step), to be run again without it; None: immediate mode
    rerun_from: int | None = None
    # the site's signed request (`starfed site leave`, ``ops.leave_request``), verified by the
    # operator's command and kept whole as the proof that the site asked; "": the operator's own
    request: str = ""

    @property
    def id(self) -> str:
        """What the codebook committed with it names (``WITHDRAWAL_KEY``)."""
        return f"{self.site}@{self.when}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> Withdrawal:
        raw: dict[str, Any] = json.loads(line)
        return cls(
            str(raw["site"]),
            str(raw["when"]),
            int(raw["steps"]),
            tuple(raw.get("removed", ())),
            tuple(raw.get("remerged", ())),
            tuple(int(s) for s in raw.get("touched", ())),
            int(raw.get("codebook_version", 0)),
            None if raw.get("rerun_from") is None else int(raw["rerun_from"]),
            str(raw.get("request", "")),
        )


@dataclass(frozen=True)
class ExportRecord:
    """One line of ``exports.jsonl``: a deployable codebook written out of the folder
    (``starfed server export``), so that a withdrawal can name the copies made before it."""

    path: str
    when: str
    version: int
    classes: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> ExportRecord:
        raw: dict[str, Any] = json.loads(line)
        return cls(str(raw["path"]), str(raw["when"]), int(raw["version"]), tuple(raw["classes"]))
