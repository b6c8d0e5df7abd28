"""Is the federation folder whole? Every file checked, one line per problem (``server check``).

A federation folder is years of a consortium's work; a damaged file must be found before a run
builds on it, and said plainly. ``check`` reads every file of the folder on its own (one that
cannot be read never hides the others): the identity, the lock, the codebook (its frame, the
checksum of every byte of its store and each class's line; with ``Depth.DECODE`` every tensor,
as a run would read it), the kept checkpoints, the
registry and the history — and whether they agree: the registry names exactly the codebook's
classes, the history holds one finished record per completed step and none beyond the protocol
position, the position itself is one the protocol can be in. ``starfed server status`` shows the
same problems of the current files, without decoding tensors (no torch, about a second);
``starfed server repair`` (``server.folder_repair``) fixes what they name.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from starfed.proto import codebook_pb2 as pb
from starfed.server import folder_lock
from starfed.server.folder_files import (
    CODEBOOK_FILE,
    CONTRIBUTIONS_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    PENDING_FILE,
    REGISTRY_FILE,
    STEP_FINDINGS_FILE,
    STEP_START_FILE,
    WITHDRAWALS_FILE,
    WITHDRAWING_FILE,
    DamagedFile,
    FederationError,
    Identity,
    read_withdrawals,
    temporaries,
)
from starfed.server.history import HistoryLines
from starfed.server.records import Position, StepRecord
from starfed.server.registry import Registration, read_registry
from starfed.server.step_findings import read_step_findings
from starfed.shared.codebook import store_layout
from starfed.shared.codebook.framing import CodebookError, read_message
from starfed.shared.protocol import PHASES, SYNC
from starfed.shared.run_status import COMPLETED, DEGRADED, FAILED


class Depth(enum.Enum):
    """How far ``check`` reads the codebook files."""

    HEADERS = "headers"  # frames of the manifests, store files present: ``server run``, ~0.1 s
    CHECKSUMS = "checksums"  # every store byte checksummed, class lines: ``check``/``status``, ~2 s
    DECODE = "decode"  # every tensor decoded as a run would: ``check --deep``, ~15 s


@dataclass
class Report:
    """What ``check`` found: ``problems`` (the folder is damaged: exit 1) and ``notes`` (worth
    knowing, nothing wrong: who holds the lock, a federation with no step yet)."""

    folder: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    codebook_version: int | None = None
    position: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def blocking(self) -> list[str]:
        """The problems a run cannot get past (an interrupted close and a damaged
        ``metrics.json`` are the next run's to finish and rewrite)."""
        later = (PENDING_FILE, WITHDRAWING_FILE, METRICS_FILE)
        return [p for p in self.problems if not p.startswith(later)]


def phase_marks() -> set[str]:
    """Every phase a position's done marks may name (``PhaseRound.phase``; rounds: any
    non-negative)."""
    return {SYNC.phase.key, *(spec.phase.key for spec in PHASES)}


def check(root: str | Path, *, depth: Depth = Depth.CHECKSUMS, kept: bool = True) -> Report:
    """Every file of the federation folder ``root``, its codebook files read to ``depth``;
    ``kept`` also reads the kept checkpoints (``previous.bin``, ``checkpoints/``). ``status``
    checksums the current codebook's store, not the kept ones: it answers in about a second per
    2 GB of codebook, however many steps are kept. ``Depth.CHECKSUMS`` (``check``) finds every
    flipped byte (each base and record is sha256-framed, and was validated before it was
    written); ``Depth.DECODE`` also decodes every tensor (needs torch)."""
    root = Path(root).expanduser()
    report = Report(str(root))
    try:
        federation = Identity.read(root)
    except FederationError as err:
        report.problems.append(str(err))
        return report
    _lock(report, root)
    if found := federation.temporary_files():
        report.notes.append(
            f"{temporaries(found, root)} that killed writes left: the next run (or `starfed "
            "server repair`) removes them"
        )
    seen: dict = {}  # store pieces decoded so far: each is read once, however many share it
    names = _codebook(report, federation, depth, seen)
    registry = _registry(report, root)
    history = _history(report, root)
    position = Position(**report.position) if report.position else None
    if names is not None and registry is not None:
        _agree_registry(report, names, registry)
    if position is not None and history is not None:
        _agree_history(report, position, history)
    if position is not None and names is not None:
        _position(report, position, names, federation, depth, seen)
    for path in federation.kept_codebooks() if kept else ():
        _codebook_file(report, federation, path, depth, seen)
    _withdrawals(report, federation, depth, seen)
    if (root / PENDING_FILE).is_file():
        report.problems.append(
            f"{PENDING_FILE}: a step's close was interrupted; the next run (or `starfed server "
            "repair`) finishes it"
        )
    try:
        read_step_findings(root)
    except FederationError:
        report.problems.append(
            f"{STEP_FINDINGS_FILE}: damaged; `starfed server repair` sets it aside (a resumed "
            "step then goes on without the screening's findings so far)"
        )
    if (root / METRICS_FILE).is_file():
        try:
            json.loads((root / METRICS_FILE).read_text())
        except (OSError, ValueError) as err:
            report.problems.append(f"{METRICS_FILE}: damaged ({err}); the next run rewrites it")
    return report


def _withdrawals(report: Report, federation: Identity, depth: Depth, seen: dict) -> None:
    """The files a site's leaving reads and writes: the kept rows (a codebook of the store),
    the withdrawals made, and one interrupted (``server.withdrawal``)."""
    root = federation.root
    if (root / CONTRIBUTIONS_FILE).is_file():
        _codebook_file(report, federation, root / CONTRIBUTIONS_FILE, depth, seen)
    try:
        read_withdrawals(root)
    except DamagedFile as err:
        report.problems.append(f"{WITHDRAWALS_FILE}: {err.why}")
    if (root / WITHDRAWING_FILE).is_file():
        report.problems.append(
            f"{WITHDRAWING_FILE}: a withdrawal was interrupted; the next run (or `starfed server "
            "repair`) finishes it if it was committed, else drops it"
        )


def _lock(report: Report, root: Path) -> None:
    try:
        holder = folder_lock.holder(root)
    except folder_lock.FolderLocked as err:
        report.problems.append(str(err))
        return
    if holder is None:
        return
    if holder.alive():
        report.notes.append(f"in use by {holder.describe()}")
    else:
        report.notes.append(f"a stale lock of {holder.describe()} (the next run takes it over)")


def read_codebook_file(identity: Identity, path: Path, depth: Depth, seen: dict) -> pb.Codebook:
    """The message of the codebook file ``path`` (a manifest's: metadata and class lines), read
    to ``depth``: frame, checksum, backbones, its store's files, and past ``Depth.HEADERS`` its
    store's bytes (each store piece once per ``seen``); ``CodebookError`` or ``OSError`` when
    it does not read whole. The one test of a good codebook file: ``check`` reports what it
    finds, ``repair`` goes back to the last file it passes."""
    fingerprint, dims = identity.fingerprint, identity.dims
    message = read_message(path)
    if message.backbone_fingerprint != fingerprint:
        raise CodebookError("a codebook of other backbones")
    ref = store_layout.Ref.of(message.metadata)
    if ref is not None and (problem := store_layout.missing(path, ref)):
        raise CodebookError(problem)
    if depth is Depth.DECODE:  # torch: only when decoding
        from starfed.shared.codebook import store_io, wire

        if ref is None:
            wire.read_file(path, fingerprint=fingerprint, dims=dims)
        else:
            names = [entry.name for entry in message.entries]
            store_io.verify(path, ref, names, fingerprint=fingerprint, dims=dims, seen=seen)
    elif depth is Depth.CHECKSUMS and ref is not None:  # a whole file: read_message did
        store_layout.verify(path, message, fingerprint=fingerprint, dims=dims, seen=seen)
    return message


def _codebook_file(
    report: Report, federation: Identity, path: Path, depth: Depth, seen: dict
) -> pb.Codebook | None:
    """One codebook file read to ``depth``: its message, None (and a problem) when damaged."""
    try:
        return read_codebook_file(federation, path, depth, seen)
    except (CodebookError, OSError) as err:
        report.problems.append(f"{path.relative_to(federation.root)}: {_short(err, path)}")
        return None


def _short(err: Exception, path: Path) -> str:
    """The error without the path it already starts with (the line names the file)."""
    return str(err).removeprefix(f"{path}: ")


def _codebook(report: Report, federation: Identity, depth: Depth, seen: dict) -> set[str] | None:
    """The codebook's class names (None when it cannot be read); its version and position
    go into the report."""
    path = federation.root / CODEBOOK_FILE
    if not path.is_file():
        if traces := federation.traces():
            report.problems.append(
                f"{CODEBOOK_FILE}: missing, but the folder holds {traces} (never replaced by an "
                "empty codebook: `starfed server repair` restores the last good checkpoint)"
            )
            return None
        report.notes.append("no codebook yet: the first `starfed server run` makes it")
        report.position = Position().to_json()
        return set()
    message = _codebook_file(report, federation, path, depth, seen)
    if message is None:
        return None
    try:
        position = Position.from_metadata(message.metadata)
    except (ValueError, TypeError) as err:
        report.problems.append(f"{CODEBOOK_FILE}: its protocol position is damaged ({err})")
        return None
    report.codebook_version = message.version
    report.position = position.to_json()
    return {entry.name for entry in message.entries}


def _registry(report: Report, root: Path) -> dict[str, Registration] | None:
    try:
        return read_registry(root)
    except DamagedFile as err:
        report.problems.append(f"{REGISTRY_FILE}: damaged ({err.why})")
        return None


def _history(report: Report, root: Path) -> list[StepRecord] | None:
    """The readable records; each damaged line is a problem of its own."""
    try:
        lines = HistoryLines.read(root)
    except (OSError, UnicodeDecodeError) as err:
        report.problems.append(f"{HISTORY_FILE}: unreadable ({err})")
        return None
    report.problems += [f"{HISTORY_FILE}:{n}: damaged ({why})" for n, why in lines.damaged]
    return lines.records


def _agree_registry(report: Report, names: set[str], registry: dict[str, Registration]) -> None:
    missing = sorted(names - set(registry))
    extra = sorted(set(registry) - names)
    if missing:
        report.problems.append(
            f"{REGISTRY_FILE}: {len(missing)} class(es) of the codebook are not in it "
            f"({', '.join(missing[:3])}{'…' if len(missing) > 3 else ''})"
        )
    if extra:
        report.problems.append(
            f"{REGISTRY_FILE}: {len(extra)} class(es) are not in the codebook "
            f"({', '.join(extra[:3])}{'…' if len(extra) > 3 else ''})"
        )


def _agree_history(report: Report, position: Position, history: list[StepRecord]) -> None:
    """One finished record per completed step (0 .. position.step - 1), none beyond."""
    finished = Counter(r.step for r in history if r.status in (COMPLETED, DEGRADED))
    for step, count in sorted(finished.items()):
        if count > 1:
            report.problems.append(
                f"{HISTORY_FILE}: step {step + 1} is recorded as finished {count} times"
            )
        if step >= position.step:
            report.problems.append(
                f"{HISTORY_FILE}: step {step + 1} is recorded as finished, but the codebook is "
                f"at step {position.step + 1}"
            )
    lost = [step + 1 for step in range(position.step) if step not in finished]
    if lost:
        report.problems.append(
            f"{HISTORY_FILE}: no record of completed step(s) {', '.join(map(str, lost))}"
        )
    beyond = [r for r in history if r.status == FAILED and r.step > position.step]
    if beyond:
        report.problems.append(
            f"{HISTORY_FILE}: failed attempts at step {beyond[0].step + 1}, beyond the codebook's "
            f"step {position.step + 1}"
        )


def _position(
    report: Report,
    position: Position,
    names: set[str],
    federation: Identity,
    depth: Depth,
    seen: dict,
) -> None:
    """A position the protocol can be in, with the files it needs."""
    marks = phase_marks()
    odd = [str(d) for d in position.done if d.phase not in marks]
    if odd:
        report.problems.append(f"{CODEBOOK_FILE}: its position names unknown phases {odd}")
    if not position.running:
        if position.done or position.in_play:
            report.problems.append(
                f"{CODEBOOK_FILE}: no step is running, but its position names phases or classes"
            )
        return
    stray = sorted(set(position.in_play) - names)
    if stray:
        report.problems.append(f"{CODEBOOK_FILE}: classes in play not in the codebook: {stray}")
    start = federation.root / STEP_START_FILE
    if not start.is_file():
        report.problems.append(
            f"{STEP_START_FILE}: missing while step {position.step + 1} runs (a failure could "
            "not roll back)"
        )
    else:
        _codebook_file(report, federation, start, depth, seen)
