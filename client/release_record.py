"""The site's release record: one hash-chained JSON line per message answered or refused.

A governance office asks afterwards what left the site, when and to whom
(docs/sites.md#for-a-governance-office). The record is ``release-record.jsonl`` in the state
folder, append-only: each line is a ``Release`` — time, server, run, step, phase, classes,
fields, bytes, the sha256 of the exact bytes sent, ε and δ spent per class, the codebook
version received, or the policy's reason for a refusal — with ``previous``, the hash of the
line before, and ``hash``, its own. ``verify`` names the first line that was changed, removed
or moved; ``release-record.head`` (the last line's hash and the count) catches a cut at the
end. What the chain proves, and what it does not, is docs/security.md#the-release-record: the
server's history keeps the same hashes (``reply_sha256``), the cross-check.

Appends hold the state folder's ``release-record.lock`` (``starfed.host.locks``): a site's
worker and ClientApp processes, or the processes of a simulation, never interleave lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starfed.host import locks
from starfed.shared.files import write_atomic

RECORD_FILE = "release-record.jsonl"
HEAD_FILE = "release-record.head"
LOCK_FILE = "release-record.lock"
GENESIS = "0" * 64  # the ``previous`` of the first line
LOCK_WAIT_S = 30.0  # how long an append waits for another process's append


class RecordBroken(ValueError):
    """The record fails its chain: ``line`` (1-based) is the first that does not hold."""

    def __init__(self, line: int, why: str) -> None:
        super().__init__(f"line {line}: {why}")
        self.line = line


@dataclass(frozen=True)
class Release:
    """One message answered (``sha256`` of the bytes sent) or refused (``refused``: why)."""

    time: str  # ISO 8601, UTC
    server: str  # sha256 of the ca.pem the site trusts, its server ("": a simulation)
    federation: str
    run: int
    step: int
    phase: str
    round: int
    codebook_version: int  # of the codebook the message carried (0: none)
    classes: tuple[str, ...] = ()  # the classes whose rows or counts left
    fields: tuple[str, ...] = ()  # what left of them (``policy.RELEASES``)
    bytes: int = 0
    sha256: str = ""  # of the reply's bytes (``protocol.reply_sha256``)
    privacy: dict[str, tuple[float, float]] = field(default_factory=dict)  # class: ε, δ spent
    refused: str = ""  # the policy's reason

    def to_json(self, previous: str) -> str:
        """The line, chained to ``previous`` and sealed with its own hash."""
        content = {**self.as_dict(), "previous": previous}
        return json.dumps({**content, "hash": _hash(content)}, sort_keys=True, separators=SEP)

    def as_dict(self) -> dict[str, Any]:
        raw = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {
            **raw,
            "classes": list(self.classes),
            "fields": list(self.fields),
            "privacy": {k: list(v) for k, v in self.privacy.items()},
        }

    @classmethod
    def from_json(cls, line: str) -> Release:
        """The release a line holds (its chain keys aside: ``verify`` checks them)."""
        raw = json.loads(line)
        values = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(
            **{
                **values,
                "classes": tuple(raw.get("classes", ())),
                "fields": tuple(raw.get("fields", ())),
                "privacy": {k: (float(e), float(d)) for k, (e, d) in raw["privacy"].items()},
            }
        )

    @property
    def when(self) -> datetime:
        return datetime.fromisoformat(self.time)


SEP = (",", ":")


def _hash(content: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=SEP).encode()).hexdigest()


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class Head:
    """The last line's hash and the number of lines: what a cut at the end is told by."""

    lines: int
    hash: str

    def to_json(self) -> str:
        return json.dumps({"lines": self.lines, "hash": self.hash})

    @classmethod
    def from_json(cls, text: str) -> Head:
        raw = json.loads(text)
        return cls(int(raw["lines"]), str(raw["hash"]))


class ReleaseRecord:
    """A state folder's release record."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / RECORD_FILE
        self.head_path = state_dir / HEAD_FILE
        self.lock_path = state_dir / LOCK_FILE

    def append(self, release: Release) -> None:
        """Add ``release`` after the last line, under the record's lock; synced."""
        with _locked(self.lock_path):
            head = self.head()
            line = release.to_json(head.hash)
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(line + "\n")
                out.flush()
                os.fsync(out.fileno())
            sealed = json.loads(line)["hash"]
            write_atomic(self.head_path, Head(head.lines + 1, sealed).to_json().encode())

    def head(self) -> Head:
        if not self.head_path.is_file():
            return Head(0, GENESIS)
        return Head.from_json(self.head_path.read_text())

    def releases(self) -> Iterator[Release]:
        """Every line, in order, as written (``verify`` first to trust them)."""
        if not self.path.is_file():
            return
        with open(self.path, encoding="utf-8") as lines:
            for line in lines:
                yield Release.from_json(line)

    def verify(self) -> int:
        """The number of lines, when every line holds its own hash and follows the one
        before and the head names the last; else ``RecordBroken`` naming the first line that
        does not."""
        previous, count = GENESIS, 0
        if self.path.is_file():
            with open(self.path, encoding="utf-8") as lines:
                for count, line in enumerate(lines, start=1):
                    previous = _check(line, count, previous)
        head = self.head()
        if head.lines != count:
            missing = "lines after it were removed" if head.lines > count else "unrecorded lines"
            raise RecordBroken(count, f"the head says {head.lines} lines ({missing})")
        if head.hash != previous:
            raise RecordBroken(count, "the last line is not the one the head names")
        return count


def _check(line: str, number: int, previous: str) -> str:
    """The hash of line ``number`` once it holds its own hash and follows ``previous``."""
    try:
        raw = json.loads(line)
        sealed = raw.pop("hash")
        follows = raw["previous"]
    except (ValueError, KeyError, AttributeError, TypeError):
        raise RecordBroken(number, "not a record line") from None
    if _hash(raw) != sealed:
        raise RecordBroken(number, "changed: its content does not match its hash")
    if follows != previous:
        raise RecordBroken(number, f"does not follow line {number - 1} (removed or moved)")
    return str(sealed)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The record's lock for a ``with`` block: waits up to ``LOCK_WAIT_S`` for another
    process's append; a holder that died is taken over (``starfed.host.locks``)."""
    me, deadline = locks.Owner.me(), time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            locks.acquire(path, me)
            break
        except locks.LockBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    try:
        yield
    finally:
        locks.release(path, me)


def summary(releases: list[Release]) -> dict[str, Any]:
    """What left, summed by class and by run: messages, bytes and the last time; and the
    refusals with their reasons (``starfed site audit``)."""
    by_class: dict[str, dict[str, Any]] = {}
    by_run: dict[int, dict[str, Any]] = {}
    refusals = []
    for r in releases:
        if r.refused:
            refusals.append(
                {
                    "time": r.time,
                    "run": r.run,
                    "step": r.step,
                    "phase": r.phase,
                    "reason": r.refused,
                }
            )
            continue
        run = by_run.setdefault(r.run, {"messages": 0, "bytes": 0, "classes": set()})
        run["messages"] += 1
        run["bytes"] += r.bytes
        run["classes"].update(r.classes)
        for name in r.classes:
            row = by_class.setdefault(name, {"messages": 0, "fields": set(), "last": r.time})
            row["messages"] += 1
            row["fields"].update(r.fields)
            row["last"] = r.time
            if name in r.privacy:
                row["epsilon"], row["delta"] = r.privacy[name]
    return {
        "messages": sum(1 for r in releases if not r.refused),
        "bytes": sum(r.bytes for r in releases),
        "by_class": {k: {**v, "fields": sorted(v["fields"])} for k, v in sorted(by_class.items())},
        "by_run": {str(k): {**v, "classes": len(v["classes"])} for k, v in sorted(by_run.items())},
        "refusals": refusals,
    }
