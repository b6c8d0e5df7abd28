"""The server's aggregation steps: the enrolment, then the phases of ``PHASES``, in order.

A step starts with the enrolment (``starfed.shared.protocol.ENROLMENT``): every connected site
says what its current task brings, and the classes the federation does not know yet are
registered. Then, for each codebook phase, the ``Coordinator`` sends one message to the enrolled
sites (a seeded share of them for training and statistics rounds, ``fraction-train``), decodes
(= validates) the replies one at a time and hands them to its ``Strategy``
(``starfed.server.strategy``), which reduces them into a new codebook (or, for evaluation, the
step's scores). A phase that travels with another (``PhaseSpec.travels_with``: the stage-1
statistics, with the last stage-1 round) is asked for in that phase's message and reduced from
the same replies, right after it — a message less per step — unless a resumed step checkpointed
the phase it travels with before it. The codebook is the single source of truth: each phase
replaces it with a new value, checkpointed in the federation folder with the protocol position,
so an interrupted step can resume (``server.federation``).

A run performs steps until no site brings a new class (or ``max_steps``). A phase in which no
class in play gets an update fails the step (rolled back); a step in which some site failed or
was rejected completes ``degraded``. Sites that keep the last codebook receive deltas; a site
whose broadcast would pass one message is caught up in parts first (``server.catch_up``).

It talks to sites only through a Flower ``Grid`` (``get_node_ids``, ``send_and_receive``), so
tests drive it with an in-process grid. Every send has a timeout; error replies and missing
replies are logged with node and phase. Replies are decoded (= validated) once, at this
boundary; a bad one is rejected, never half-applied.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
from rich.console import Console

from starfed.server import catch_up, replay
from starfed.server.change_scale import ChangeScale
from starfed.server.federation import COMPLETED, DEGRADED, FAILED, Federation
from starfed.server.messaging import (
    Reply,
    SiteGrid,
    exchange,
    malformed,
    note_privacy,
    refused_classes,
    reject,
)
from starfed.server.records import Exchange, PhaseRound, PhaseTime, Position, StepRecord, StepScores
from starfed.server.screening import Screen, ScreeningOptions
from starfed.server.strategy import ConfigValue, PhaseState, Strategy
from starfed.shared import progress
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.config import ProtocolOptions
from starfed.shared.data.site_folder import class_key
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import (
    ALSO,
    ENROLMENT,
    PHASES,
    SPECS,
    STATISTICS,
    Phase,
    PhaseSpec,
    record_bytes,
)
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)

SAMPLED = (Phase.STAGE1, Phase.STAGE1_STATS, Phase.STAGE2, Phase.STAGE2_STATS)  # fraction-train
ENROLLED = PhaseRound(ENROLMENT.phase.key)  # the position's mark of a step's finished enrolment
WAIT_POLL_S = 1.0

#: A simulation's scores on a global test set: (codebook, class steps, step, the evaluate
#: message's config) -> scores.
ServerEval = Callable[[Codebook, Mapping[str, int], int, Mapping[str, ConfigValue]], StepScores]


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a phase's updates are decoded and held:
    each holds a few objects per tensor (140 for 35 classes at stage 2) and none is part of a
    cycle, but every collection walks all of them again — at 1000 sites that cost more than the
    decoding (docs/benchmarks.md#server-merge-at-scale-benchmerge_scalepy)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class StepFailed(RuntimeError):
    """A phase in which no class in play got an update: the step cannot finish."""


@dataclass
class RunLog:
    """What one server run did."""

    steps: list[StepRecord] = field(default_factory=list)  # the records it wrote to the history
    exchanges: list[Exchange] = field(default_factory=list)
    status: str = COMPLETED
    reason: str = ""


class Coordinator:
    """Drives the enrolment and the phases of every step of one server run; owns the codebook.

    ``strategy`` reduces the replies (starfed's own by default); ``before_step(step)`` runs at
    the start of every step, fresh or resumed, before the enrolment (a simulation writes its
    sites' data folders there).
    """

    def __init__(
        self,
        grid: SiteGrid,
        backbones: Backbones,
        train: TrainConfig,
        protocol: ProtocolOptions,
        federation: Federation,
        console: Console | None = None,
        server_eval: ServerEval | None = None,
        *,
        strategy: Strategy | None = None,
        before_step: Callable[[int], None] | None = None,
        screening: ScreeningOptions | None = None,
    ) -> None:
        self.grid = grid
        self.backbones = backbones
        self.train = train
        self.protocol = protocol
        self.federation = federation
        self.console = console or progress.console(stderr=True)
        self.server_eval = server_eval
        self.strategy = strategy or Strategy()
        self.before_step = before_step
        self.screening = screening or ScreeningOptions()
        self.codebook = federation.codebook()
        self.position = federation.position(self.codebook)
        self.screen = Screen(self.screening, self.position.step)  # the step's: run_step
        self.log = RunLog()
        self.in_play: list[str] = list(self.position.in_play)
        self.sites: dict[int, str] = {}  # node id -> site name (from its enrolment)
        self._brings: dict[int, set[str]] = {}  # node id -> class keys of its current task
        self._node_ids: list[int] = []
        self._held: dict[int, int] = {}  # node id -> codebook version it holds (when known)
        self._steps: list[Exchange] = []
        self._scores: StepScores | None = None

    # --- runs and steps ---------------------------------------------------------------------

    def run(self, max_steps: int | None = None) -> RunLog:
        """Steps until no site brings a new class, a step fails, or ``max_steps`` ran."""
        if not self._wait_for_sites():
            return self.log
        while max_steps is None or len(self.log.steps) < max_steps:
            record = self.run_step()
            if record is None:
                self._end_without_step()
                break
            if record.status == FAILED:
                break
        statuses = {record.status for record in self.log.steps} | {self.log.status}
        if FAILED in statuses:
            self.log.status = FAILED
            failed = (r.reason for r in self.log.steps if r.status == FAILED)
            self.log.reason = next(failed, self.log.reason)
        elif DEGRADED in statuses:
            self.log.status = DEGRADED
        return self.log

    def _end_without_step(self) -> None:
        """The enrolment found nothing in play: the run is over — unless sites failed to
        answer, which says nothing about what they hold (all failed: the run failed; some:
        degraded)."""
        failed = [e for e in self._steps if e.failed]
        if failed and len(failed) == len(self._steps):
            self.log.status = FAILED
            self.log.reason = f"no site answered the sync ({failed[0].site}: {failed[0].status})"
            self.console.print(f"[red]{self.log.reason}")
            return
        if failed:
            self.log.status = DEGRADED
            self.console.print(
                f"[yellow]{progress.counted(len(failed), 'site')} did not answer the sync; the "
                "others bring nothing new: the run is over"
            )
            return
        self.console.print("no site brings a new class: the run is over")

    def _wait_for_sites(self) -> bool:
        """Wait up to ``wait-s`` for ``min-sites`` connected sites."""
        deadline = time.monotonic() + self.protocol.wait_s
        while True:
            online = list(self.grid.get_node_ids())
            if len(online) >= self.protocol.min_sites:
                return True
            if time.monotonic() >= deadline:
                self.log.status = FAILED
                self.log.reason = (
                    f"{progress.counted(len(online), 'site')} connected, "
                    f"{self.protocol.min_sites} needed "
                    f"(waited {self.protocol.wait_s:.0f}s)"
                )
                self.console.print(f"[red]{self.log.reason}")
                return False
            time.sleep(WAIT_POLL_S)

    def run_step(self) -> StepRecord | None:
        """One aggregation step, or the rest of an interrupted one; its history record, or
        None when no site brings anything new (nothing is recorded then)."""
        step = self.position.step
        if self.before_step is not None:
            self.before_step(step)
        started, status, reason = time.time(), COMPLETED, ""
        self._steps, self._scores = [], None
        self.screen = Screen(self.screening, step, ChangeScale.read(self.federation.root))
        if ENROLLED in self.position.done:
            self._restore_findings(step)
        self._node_ids = sorted(self.grid.get_node_ids())
        t0 = time.perf_counter()
        if not self._enrol(step):
            return None  # nothing new: no step
        phase_seconds = [PhaseTime(ENROLMENT.phase.key, 0, time.perf_counter() - t0)]
        try:
            for spec in PHASES:
                for round_index in range(self._rounds(spec.phase)):
                    done = PhaseRound(spec.phase.key, round_index)
                    if done not in self.position.done:
                        phase_seconds += self._run_phase(spec, step, round_index, done)
        except StepFailed as err:
            # Sites that all stop answering may be a run that was stopped (`flwr stop`): then
            # this grid call fails in Flower (its token is revoked) and the run ends here,
            # recording nothing, instead of as a failed step.
            self.grid.get_node_ids()
            status, reason = FAILED, str(err)
            self.console.print(f"[red]step {step + 1} failed: {reason}; rolled back")
        if status != FAILED and (any(e.failed for e in self._steps) or self.screen.findings):
            status = DEGRADED
        if self.screening.quarantine_persists and self.screen.quarantined:
            self.federation.add_quarantine(self.screen.quarantined, step)
        record = self._record(step, status, reason, started, phase_seconds)
        kept = None if status == FAILED else self.codebook
        self.codebook = self.federation.end_step(record, kept, self.protocol.checkpoints_kept)
        if kept is not None:  # committed: its phases' honest changes inform later steps' bounds
            self.screen.scale.save(self.federation.root, step, self.screen.observed)
        self.position = self.federation.position(self.codebook)
        self.in_play = []
        self.log.steps.append(record)
        return record

    def _rounds(self, phase: Phase) -> int:
        rounds = {Phase.STAGE1: self.protocol.stage1_rounds,
                  Phase.STAGE2: self.protocol.stage2_rounds}  # fmt: skip
        return rounds.get(phase, 1)

    def _riders(self, spec: PhaseSpec, state: PhaseState) -> list[PhaseSpec]:
        """The phases that travel with this round of ``spec``: at its last round, those that
        name it (``travels_with``), not done yet and whose message the strategy adds nothing
        to (their config would be the protocol's alone)."""
        if state.round != self._rounds(spec.phase) - 1:
            return []
        return [
            rider for rider in PHASES
            if rider.travels_with is spec.phase
            and PhaseRound(rider.phase.key) not in self.position.done
            and not self.strategy.configure(rider.phase, state)
        ]  # fmt: skip

    def _run_phase(
        self, spec: PhaseSpec, step: int, round_index: int, done: PhaseRound
    ) -> list[PhaseTime]:
        """Send one codebook phase, asking for the updates of the phases that travel with it,
        and reduce the replies phase by phase; the seconds of each."""
        t0 = time.perf_counter()
        state = self._state(step, round_index)
        riders = self._riders(spec, state)
        nodes = self._sample(spec.phase, step, round_index)
        replies = self._exchange(spec, state, nodes, [rider.phase.key for rider in riders])
        self._reduce(spec, state, replies, done)
        seconds = [PhaseTime(spec.phase.key, round_index, time.perf_counter() - t0)]
        for rider in riders:
            t0 = time.perf_counter()
            # decoded against the codebook the message carried, merged into the one just made
            self._reduce(rider, self._state(step, 0), replies, PhaseRound(rider.phase.key),
                         record=rider.phase.key, sent=state.codebook)  # fmt: skip
            seconds.append(PhaseTime(rider.phase.key, 0, time.perf_counter() - t0))
        return seconds

    def _reduce(
        self,
        spec: PhaseSpec,
        state: PhaseState,
        replies: list[Reply],
        done: PhaseRound,
        record: str = "update",
        sent: Codebook | None = None,
    ) -> None:
        """Hand a phase's validated updates (the replies' ``record``, made from ``sent``: by
        default the codebook now) to the strategy and keep what it makes of them: a new
        codebook (checkpointed) or, for evaluation, the step's scores (recorded when the step
        ends, which follows at once)."""
        if spec.phase is Phase.EVALUATE:
            reports = self._reports(replies, state.codebook)
            self._scores = scores = self.strategy.aggregate_evaluate(reports, state)
            self._print_scores(state.step, scores)
            return
        carried: set[str] = set()
        updates = self._updates(replies, state, spec.phase, carried, record, sent)
        aggregate = (self.strategy.aggregate_statistics if spec.phase in STATISTICS
                     else self.strategy.aggregate_train)  # fmt: skip
        codebook = aggregate(spec.phase, updates, state)
        for _ in updates:  # a strategy that stopped early: the rest is validated all the same
            pass
        if not carried & set(self.in_play):
            key = spec.phase.key
            in_play = set(self.in_play)
            rejected = [f for f in self.screen.findings if f.phase == key and f.name in in_play]
            if rejected:  # they arrived, and the screening rejected them all
                named = "; ".join(f"class {f.name!r}: {f.site} ({f.reason})" for f in rejected[:3])
                raise StepFailed(f"the screening rejected every {key} update of the classes in "
                                 f"play: {named}")  # fmt: skip
            raise StepFailed(f"no site's {key} update arrived for any class in play")
        if spec.phase in STATISTICS:
            codebook = self._drop_unfitted(codebook, spec.phase)
            state = replace(state, in_play=tuple(self.in_play))
            codebook = self.strategy.replay(spec.phase, codebook, state)
        before = self.codebook, self.position
        self.codebook = codebook
        try:  # validated before it is written: a phase's bad result is never checkpointed
            self._checkpoint(done)
        except CodebookError as err:
            self.codebook, self.position = before
            raise StepFailed(self._blame(spec.phase, err)) from None
        self._leave_quarantined()

    def _blame(self, phase: Phase, err: CodebookError) -> str:
        """Why a phase's result cannot be kept: the class and field, and the site whose kept
        update to that class went furthest this step (``Screen.furthest``: an update passes
        validation on its own; what overflows is what the merge or the replay made of it)."""
        name, field_name = getattr(err, "name", None), getattr(err, "field", None)
        where = f"class {name!r}, field {field_name}" if name else "its codebook"
        detail = str(err).removeprefix(f"{name}/{field_name}: ")
        furthest = self.screen.furthest.get(name) if name else None
        source = "" if furthest is None else (
            f"; the furthest update to it came from site {furthest[1]} ({furthest[2]})"
        )  # fmt: skip
        return f"the {phase.key} result is invalid at {where}: {detail}{source}"

    def _leave_quarantined(self) -> None:
        """Quarantined sites get no more messages in this step."""
        quarantined = self.screen.quarantined
        self._node_ids = [n for n in self._node_ids if self.sites.get(n) not in quarantined]

    def _restore_findings(self, step: int) -> None:
        """A resumed step goes on with what the screening found in the phases it does not
        repeat (the enrolment is repeated, and records its own)."""
        not_repeated = set(self.position.done) - {ENROLLED}
        kept = [f for f in self.federation.step_findings(step)
                if PhaseRound(f.phase, f.round) in not_repeated]  # fmt: skip
        if kept:
            self.screen.restore(kept)
            held = sorted(self.screen.quarantined)
            self.console.print(
                f"step {step + 1} resumes with {progress.counted(len(kept), 'finding')} of the "
                "screening from before" + (f"; quarantined: {', '.join(held)}" if held else "")
            )

    def _checkpoint(self, done: PhaseRound) -> None:
        # ahead of the commit: what a crash after it must not lose (``_restore_findings``)
        self.federation.save_findings(self.position.step, self.screen.findings)
        finished = tuple(dict.fromkeys((*self.position.done, done)))
        self.position = replace(self.position, done=finished, in_play=tuple(self.in_play))
        self.codebook = self.federation.checkpoint(self.codebook, self.position)

    def _state(self, step: int, round_index: int) -> PhaseState:
        codebook = self.codebook
        registry = self.federation.registry
        return PhaseState(
            step, round_index, codebook, tuple(self.in_play),
            {name: registry[name].step for name in codebook.names}, self.backbones, self.train,
        )  # fmt: skip

    def _record(
        self, step: int, status: str, reason: str, started: float, seconds: list[PhaseTime]
    ) -> StepRecord:
        server_eval = None
        if self.server_eval is not None and status != FAILED:
            state = self._state(step, 0)
            config = self._config(SPECS[Phase.EVALUATE], state)
            server_eval = self.server_eval(self.codebook, state.class_steps, step, config)
        return StepRecord(
            step=step, status=status, started=started, wall_s=time.time() - started,
            attempt=self.federation.attempts(step), reason=reason,
            classes=tuple(self.in_play), sites=tuple(sorted(set(self.sites.values()))),
            phase_seconds=tuple(seconds), exchanges=tuple(self._steps),
            codebook_version=self.codebook.version, scores=self._scores, server_eval=server_eval,
            findings=tuple(self.screen.findings), quarantined=tuple(self.screen.quarantined),
        )  # fmt: skip

    def _print_scores(self, step: int, scores: StepScores) -> None:
        row = " ".join(f"{a:.0f}" for a in scores.accuracy)
        self.console.print(
            f"step {step + 1}: {progress.counted(len(self.codebook), 'class')} · "
            f"federation accuracy {scores.mean_accuracy:.1f}% by arrival step: {row}"
        )

    # --- the enrolment ----------------------------------------------------------------------

    def _enrol(self, step: int) -> bool:
        """Ask every connected site what it brings. A fresh step registers the classes the
        federation does not know yet and begins (False when there are none: no step); a resumed
        step, enrolled before, only learns who is here. Either way the sites that answered
        take part in the rest of the step."""
        config: dict[str, ConfigValue] = {"step": step, "round": 0,
                  "wire-dtype": self.protocol.wire_dtype,
                  **Lineage.of(self.codebook).as_metadata(),
                  "frozen": sorted(self.codebook.frozen)}  # fmt: skip
        replies = self._send(ENROLMENT, step, 0, config, self._node_ids, None)
        accepted = self._participants(replies)
        if ENROLLED in self.position.done:
            return True
        new, brought = self._new_classes(accepted)
        if not new:
            return False
        start = self.codebook
        self.in_play = new
        self.codebook = replay.register(self.codebook, new, self.backbones, self.train)
        self.federation.register(new, step, brought)
        self.console.print(
            f"step {step + 1}: {progress.counted(len(new), 'new class')} from "
            f"{progress.counted(len({s for n in new for s in brought[n]}), 'site')} · "
            f"{progress.counted(len(self._node_ids), 'site')} taking part"
        )
        self.federation.begin_step(start)
        self.position = Position(step, running=True)
        self._checkpoint(ENROLLED)
        return True

    def _participants(self, replies: list[Reply]) -> list[tuple[Exchange, ClientUpdate]]:
        """Accepted enrolments: the nodes that take part in the rest of the step, their site
        names and the codebook version each holds. A silent node costs one timeout per step,
        not one per phase; a node with other backbones or a malformed reply sits the step
        out."""
        accepted = sorted(self._decoded(replies, Phase.SYNC), key=lambda r: r[0].node_id)
        for entry, update in accepted:
            claimed = update.metadata.get("site") or f"node-{entry.node_id}"
            site = self.screen.name_of(entry.node_id, claimed)
            self.sites[entry.node_id] = entry.site = site
        accepted = self.screen.enrol(accepted, self.codebook, self.federation.quarantine())
        self._node_ids = [entry.node_id for entry, _ in accepted]
        self._leave_quarantined()  # a resumed step's quarantines hold
        for entry, update in accepted:
            self._brings[entry.node_id] = {class_key(e.name) for e in update.entries}
            held = update.base_version
            if 0 < held <= self.codebook.version:
                self._held[entry.node_id] = held
            else:
                self._held.pop(entry.node_id, None)
        return accepted

    def _new_classes(
        self, accepted: list[tuple[Exchange, ClientUpdate]]
    ) -> tuple[list[str], dict[str, list[str]]]:
        """The classes sites bring that the federation does not know yet, in the order of their
        class keys (``class_key``), and the sites that bring each class. A class known under
        another spelling is the same class; a finished (frozen) class brought again is logged
        and stays frozen."""
        known = {class_key(name): name for name in self.codebook.names}
        new: dict[str, str] = {}  # key -> the first spelling in name order
        brought: dict[str, list[str]] = {}
        for entry, update in accepted:
            for class_entry in update.entries:
                key = class_key(class_entry.name)
                if key in known and self.codebook[known[key]].frozen:
                    logger.info("site %s brings %r again: it is finished and stays frozen",
                                entry.site, known[key])  # fmt: skip
                name = known.get(key) or min(new.get(key, class_entry.name), class_entry.name)
                if key not in known:
                    new[key] = name
                brought.setdefault(name, []).append(entry.site)
        return [new[key] for key in sorted(new)], brought

    # --- messaging --------------------------------------------------------------------------

    def _config(
        self, spec: PhaseSpec, state: PhaseState, also: list[str] | None = None
    ) -> dict[str, ConfigValue]:
        """The message config of a codebook phase: the protocol's (with the keys of the phases
        that travel with it, ``also``), then the strategy's."""
        config: dict[str, ConfigValue] = {
            "step": state.step, "round": state.round, "wire-dtype": self.protocol.wire_dtype,
            **Lineage.of(state.codebook).as_metadata(),
        }  # fmt: skip
        if also:
            config[ALSO] = also
        if spec.phase is Phase.EVALUATE:
            config["class-steps"] = [state.class_steps[name] for name in state.codebook.names]
        extra = self.strategy.configure(spec.phase, state)
        clash = sorted(set(extra) & set(config))
        if clash:
            raise ValueError(f"the strategy's config may not set the protocol's {clash}")
        return {**config, **extra}

    def _payloads(self) -> Callable[[int], bytes]:
        """The broadcast for each node: a delta from the version it holds, else the whole
        codebook (each encoded once per distinct base version)."""
        lineage = Lineage.of(self.codebook).as_metadata()
        full = replace(self.codebook.broadcast(), metadata=lineage)
        cache: dict[int, bytes] = {}

        def payload(node: int) -> bytes:
            since = self._held.get(node, 0)
            if since not in cache:  # held == version: caught up (catch_up), the delta is empty
                whole = not 0 < since <= full.version
                value = full if whole else replace(self.codebook.delta(since), metadata=lineage)
                cache[since] = wire.encode(value, self.protocol.wire_dtype)
            return cache[since]

        return payload

    def _sample(self, phase: Phase, step: int, round_index: int) -> list[int]:
        """The nodes of one round: every participant, or for a training or statistics round a
        seeded share of them (``fraction-train``, at least ``min-train-sites``), drawn over
        site names (node ids change from run to run), plus the first holder of any class in
        play the draw missed, so every class gets an update and statistics."""
        nodes = self._node_ids
        if phase not in SAMPLED or self.protocol.fraction_train >= 1 or not nodes:
            return nodes
        by_name = sorted(nodes, key=lambda node: self.sites[node])
        size = max(
            self.protocol.min_train_sites, math.ceil(self.protocol.fraction_train * len(nodes))
        )
        rng = np.random.default_rng([self.train.seed, step, phase.value, round_index])
        chosen = {
            by_name[i] for i in rng.choice(len(by_name), min(size, len(by_name)), replace=False)
        }
        for name in self.in_play:
            holders = [node for node in by_name if class_key(name) in self._brings.get(node, ())]
            if holders and not chosen & set(holders):
                chosen.add(holders[0])
        return sorted(chosen)

    def _exchange(
        self, spec: PhaseSpec, state: PhaseState, nodes: list[int], also: list[str]
    ) -> list[Reply]:
        """Send one codebook phase to ``nodes``, asking for the updates of the phases ``also``
        too; the good replies. A site that answered holds the codebook it was sent. Nodes too
        far behind for one message are caught up first (``_catch_up``)."""
        config = self._config(spec, state, also)
        nodes = self._catch_up(state.step, nodes)
        return self._send(spec, state.step, state.round, config, nodes, self._payloads())

    def _catch_up(self, step: int, nodes: list[int]) -> list[int]:
        """Send the codebook in parts to the nodes whose broadcast would pass one message
        (``server.catch_up``); the nodes to send the phase to: all but those that failed a
        part (they sit the phase out, and start their catch-up again at the next)."""
        late = catch_up.behind(self.codebook, self._held, nodes, self.protocol.wire_dtype)
        if not late:
            return nodes
        lineage = Lineage.of(self.codebook).as_metadata()
        config = {"step": step, "wire-dtype": self.protocol.wire_dtype, **lineage}
        codebook = replace(self.codebook, metadata=lineage)
        caught, exchanges = catch_up.send(self.grid, codebook, late, config, self._site_names(),
                                          self.protocol.timeout_s)  # fmt: skip
        for node in late:
            if node in caught:
                self._held[node] = self.codebook.version
            else:
                self._held.pop(node, None)
        self.log.exchanges.extend(exchanges)
        self._steps.extend(exchanges)
        left = set(late) - set(caught)
        return [node for node in nodes if node not in left]

    def _site_names(self) -> dict[int, str]:
        """Node id -> site name for the log. A registered site's name is known before its
        enrolment: a site that fails even that is recorded under the operator's name for it,
        not as node-<id>."""
        return {**self.screen.registered, **self.sites}

    def _send(
        self,
        spec: PhaseSpec,
        step: int,
        round_index: int,
        config: dict[str, ConfigValue],
        nodes: list[int],
        payload: Callable[[int], bytes] | None,
    ) -> list[Reply]:
        good, exchanges = exchange(
            self.grid, spec, step, round_index, config, nodes, self._site_names(), payload,
            self.protocol.timeout_s,
        )  # fmt: skip
        if payload:
            for entry in exchanges:
                if not entry.failed:
                    self._held[entry.node_id] = self.codebook.version
                else:
                    self._held.pop(entry.node_id, None)
        self.log.exchanges.extend(exchanges)
        self._steps.extend(exchanges)
        return good

    # --- replies: decoded (= validated) one at a time ---------------------------------------

    def _decoded(
        self,
        replies: list[Reply],
        phase: Phase,
        record: str = "update",
        sent: Codebook | None = None,
    ) -> Iterator[tuple[Exchange, ClientUpdate]]:
        """Decode (= validate) each update (the replies' ``record``) against the codebook the
        phase was sent with (``sent``: the message it travelled with; by default the codebook
        now), one at a time; reject bad ones. A decoded update's tensors are views of its
        reply's bytes, so holding one costs a few objects per tensor, not a copy."""
        # Merge order changes float rounding and the k-means of pooled mixtures: merge in the
        # order of site names (unique in a step: the screening refuses a second enrolment under
        # one), the same from run to run and whatever message carried an update — not in node
        # id order (random per run) nor as they arrived.
        for entry, reply in sorted(replies, key=lambda r: (r[0].site, r[0].node_id)):
            try:
                data = record_bytes(reply.content[record]["data"], record)
                against = sent or self.codebook
                bound = self.screen.max_entries(phase, against)
                update = wire.decode_update(data, against=against, phase=phase, max_entries=bound)
                note_privacy(entry, update)
            except (CodebookError, KeyError, TypeError, ValueError) as err:
                reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
                continue
            yield entry, update

    def _updates(
        self,
        replies: list[Reply],
        state: PhaseState,
        phase: Phase,
        carried: set[str],
        record: str,
        sent: Codebook | None,
    ) -> Iterator[ClientUpdate]:
        """The phase's valid updates (``_decoded``: the replies' ``record``, made from ``sent``)
        without rows of classes not in play, screened (``server.screening``: a first pass
        measures every row, the second hands the screened updates on, in the same order); the
        classes they carry are added to ``carried`` as they go by. The decoded updates are held
        between the passes: their tensors are views of the replies' bytes, which the phase
        holds anyway, so that costs a few objects per update, not a copy — except with
        ``wire-dtype = "float16"``, whose rows are converted: then the phase holds their float32
        copies, twice the replies' bytes."""
        in_play = set(self.in_play)
        screen = self.screen.phase(phase, state.round, state.codebook)
        valid = []
        with without_cyclic_gc():
            for entry, update in self._decoded(replies, phase, record, sent):
                stray = [e.name for e in update.entries if e.name not in in_play]
                if stray:
                    logger.info("node %s sent rows of classes not in play: %s", entry.node_id,
                                stray[:10])  # fmt: skip
                    screen.frozen_rows(entry.site, [n for n in stray if n in state.codebook.frozen])
                update = update.only(in_play)
                screen.observe(entry.site, update)
                valid.append((entry, update))
        screen.decide()
        for entry, update in valid:
            screened = screen.apply(entry.site, update)
            if screened is None:
                continue
            carried.update(e.name for e in screened.entries)
            carried.update(refused_classes(update))  # answered: kept as they are
            yield screened

    def _reports(
        self, replies: list[Reply], codebook: Codebook
    ) -> Iterator[tuple[str, EvaluationReport]]:
        """The valid evaluation reports, with their sites, one at a time."""
        for entry, reply in replies:
            try:
                data = record_bytes(reply.content["report"]["data"], "report")
                report = EvaluationReport.from_bytes(data, against=codebook)
            except (CodebookError, KeyError, TypeError) as err:
                reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
                continue
            if self.screen.report(entry, report):
                yield entry.site, report

    def _drop_unfitted(self, codebook: Codebook, phase: Phase) -> Codebook:
        """Classes no site sent statistics for cannot be replayed: unregister them."""
        fields = schema.trained_in(phase)
        missing = [n for n in self.in_play if any(f not in codebook[n].values for f in fields)]
        if not missing:
            return codebook
        logger.warning("no statistics for %s; unregistering them", missing)
        self.federation.unregister(missing)
        self.in_play = [n for n in self.in_play if n not in missing]
        return codebook.without(missing)
