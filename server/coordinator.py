"""The server's aggregation steps: the sync, then the phases of ``PHASES``, in order.

A step starts with the sync (``starfed.shared.protocol.SYNC``): every connected site
says what its current task brings, and the classes the federation does not know yet are
registered. Then, for each codebook phase, the ``Coordinator`` sends one message to the synced
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
replies are logged with node and phase. Replies are decoded (= validated) and screened once, at
this boundary (``server.replies``); a bad one is rejected, never half-applied. Who takes part
and which classes a step registers is the sync's (``server.participants``); what a step
leaves in the history is ``server.step_records``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from starfed.server import catch_up, replay, step_records
from starfed.server.change_scale import ChangeScale
from starfed.server.federation import COMPLETED, DEGRADED, FAILED, Federation
from starfed.server.messaging import Reply, SiteGrid, exchange, message_config
from starfed.server.participants import Participants, new_classes, sync_config
from starfed.server.records import (
    Exchange,
    Outcome,
    PhaseRound,
    PhaseTime,
    Position,
    StepRecord,
    StepScores,
)
from starfed.server.replies import reports, screened
from starfed.server.screening import Screen, ScreeningOptions
from starfed.server.step_records import RUN_END_LEVELS, RunLog, StepFailed, StepTally
from starfed.server.strategy import ConfigValue, PhaseState, Strategy
from starfed.shared import progress
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.config import ProtocolOptions
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import (
    ALSO,
    CLASS_STEPS,
    PHASES,
    SPECS,
    STATISTICS,
    SYNC,
    UPDATE_RECORD,
    Phase,
    PhaseSpec,
)

logger = logging.getLogger(__name__)

SYNCED = PhaseRound(SYNC.phase.key)  # the position's mark of a step's finished sync
WAIT_POLL_S = 1.0

#: A simulation's scores on a global test set: (codebook, class steps, step, the evaluate
#: message's config) -> scores.
ServerEval = Callable[[Codebook, Mapping[str, int], int, Mapping[str, ConfigValue]], StepScores]


class Coordinator:
    """Drives the sync and the phases of every step of one server run; owns the codebook.

    ``strategy`` reduces the replies (starfed's own by default); ``before_step(step)`` runs at
    the start of every step, fresh or resumed, before the sync (a simulation writes its
    sites' data folders there).
    """

    def __init__(
        self,
        grid: SiteGrid,
        backbones: Backbones,
        train: TrainConfig,
        protocol: ProtocolOptions,
        federation: Federation,
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
        self.server_eval = server_eval
        self.strategy = strategy or Strategy()
        self.before_step = before_step
        self.screening = screening or ScreeningOptions()
        self.codebook = federation.codebook()
        self.position = federation.position(self.codebook)
        self.screen = Screen(self.screening, self.position.step)  # the step's: run_step
        self.log = RunLog()
        self.participants = Participants()
        self.tally = StepTally()  # the step's: run_step

    @property
    def in_play(self) -> tuple[str, ...]:
        """The classes the step in progress registered and still trains: its position's (one
        home, checkpointed with it); none between steps."""
        return self.position.in_play

    # --- runs and steps ---------------------------------------------------------------------

    def run(self, max_steps: int | None = None) -> RunLog:
        """Steps until no site brings a new class, a step fails, or ``max_steps`` ran."""
        if not self._wait_for_sites():
            return self.log
        while max_steps is None or len(self.log.steps) < max_steps:
            record = self.run_step()
            if record is None:
                line = self.log.end_without_step(self.tally.exchanges)
                logger.log(RUN_END_LEVELS.get(self.log.status, logging.INFO), line)
                break
            if record.status == FAILED:
                break
        self.log.settle()
        return self.log

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
                logger.error(self.log.reason)
                return False
            time.sleep(WAIT_POLL_S)

    def run_step(self) -> StepRecord | None:
        """One aggregation step, or the rest of an interrupted one; its history record, or
        None when no site brings anything new (nothing is recorded then)."""
        step = self.position.step
        if self.before_step is not None:
            self.before_step(step)
        status, reason = COMPLETED, ""
        self.tally = StepTally()
        self.screen = Screen(self.screening, step, ChangeScale.read(self.federation.root))
        if SYNCED in self.position.done:
            self._restore_findings(step)
        self.participants.node_ids = sorted(self.grid.get_node_ids())
        t0 = time.perf_counter()
        if not self._sync(step):
            return None  # nothing new: no step
        self.tally.seconds.append(PhaseTime(SYNC.phase.key, 0, time.perf_counter() - t0))
        try:
            for spec in PHASES:
                for round_index in range(self._rounds(spec.phase)):
                    done = PhaseRound(spec.phase.key, round_index)
                    if done not in self.position.done:
                        self._run_phase(spec, step, round_index, done)
        except StepFailed as err:
            # Sites that all stop answering may be a run that was stopped (`flwr stop`): then
            # this grid call fails in Flower (its token is revoked) and the run ends here,
            # recording nothing, instead of as a failed step.
            self.grid.get_node_ids()
            status, reason = FAILED, str(err)
            logger.error("step %d failed: %s; rolled back", step + 1, reason)
        if status != FAILED and (
            any(e.failed for e in self.tally.exchanges) or self.screen.findings
        ):
            status = DEGRADED
        return self._end_step(step, status, reason)

    def _end_step(self, step: int, status: str, reason: str) -> StepRecord:
        """Record the step and commit its codebook, or roll it back (failed)."""
        if self.screening.quarantine_persists and self.screen.quarantined:
            self.federation.add_quarantine(self.screen.quarantined, step)
        record = self._record(step, status, reason)
        kept = None if status == FAILED else self.codebook
        self.codebook = self.federation.end_step(record, kept, self.protocol.checkpoints_kept)
        if kept is not None:  # committed: its phases' honest changes inform later steps' bounds
            self.screen.scale.save(self.federation.root, step, self.screen.observed)
        self.position = self.federation.position(self.codebook)  # between steps: none in play
        self.log.steps.append(record)
        return record

    def _rounds(self, phase: Phase) -> int:
        rounds = {
            Phase.STAGE1: self.protocol.stage1_rounds,
            Phase.STAGE2: self.protocol.stage2_rounds,
        }
        return rounds.get(phase, 1)

    def _riders(self, spec: PhaseSpec, state: PhaseState) -> list[PhaseSpec]:
        """The phases that travel with this round of ``spec``: at its last round, those that
        name it (``travels_with``), not done yet and whose message the strategy adds nothing
        to (their config would be the protocol's alone)."""
        if state.round != self._rounds(spec.phase) - 1:
            return []
        return [
            rider
            for rider in PHASES
            if rider.travels_with is spec.phase
            and PhaseRound(rider.phase.key) not in self.position.done
            and not self.strategy.configure(rider.phase, state)
        ]

    def _run_phase(self, spec: PhaseSpec, step: int, round_index: int, done: PhaseRound) -> None:
        """Send one codebook phase, asking for the updates of the phases that travel with it,
        and reduce the replies phase by phase; the seconds of each go to the step's tally."""
        t0 = time.perf_counter()
        state = self._state(step, round_index)
        riders = self._riders(spec, state)
        nodes = self.participants.sample(
            spec.phase, step, round_index, self.in_play, self.protocol, self.train.seed
        )
        replies = self._exchange(spec, state, nodes, [rider.phase.key for rider in riders])
        self._reduce(spec, state, replies, done)
        seconds = [PhaseTime(spec.phase.key, round_index, time.perf_counter() - t0)]
        for rider in riders:
            t0 = time.perf_counter()
            # decoded against the codebook the message carried, merged into the one just made
            self._reduce(
                rider,
                self._state(step, 0),
                replies,
                PhaseRound(rider.phase.key),
                record=rider.phase.key,
                sent=state.codebook,
            )
            seconds.append(PhaseTime(rider.phase.key, 0, time.perf_counter() - t0))
        self.tally.seconds.extend(seconds)

    def _reduce(
        self,
        spec: PhaseSpec,
        state: PhaseState,
        replies: list[Reply],
        done: PhaseRound,
        record: str = UPDATE_RECORD,
        sent: Codebook | None = None,
    ) -> None:
        """Hand a phase's validated updates (the replies' ``record``, made from ``sent``: by
        default the codebook now) to the strategy and keep what it makes of them: a new
        codebook (checkpointed) or, for evaluation, the step's scores (recorded when the step
        ends, which follows at once)."""
        if spec.phase is Phase.EVALUATE:
            evaluated = reports(replies, state.codebook, self.screen)
            self.tally.scores = scores = self.strategy.aggregate_evaluation(evaluated, state)
            logger.info(step_records.scores_line(state.step, len(self.codebook), scores))
            return
        carried: set[str] = set()
        updates = screened(
            replies,
            state,
            spec.phase,
            self.screen,
            carried,
            against=sent or self.codebook,
            record=record,
        )
        aggregate = (
            self.strategy.aggregate_statistics
            if spec.phase in STATISTICS
            else self.strategy.aggregate_training
        )
        codebook = aggregate(spec.phase, updates, state)
        for _ in updates:  # a strategy that stopped early: the rest is validated all the same
            pass
        if not carried & set(self.in_play):
            raise step_records.no_update(spec.phase, self.screen, self.in_play)
        if spec.phase in STATISTICS:
            codebook = self._drop_unfitted(codebook, spec.phase)
            state = replace(state, in_play=self.in_play)
            codebook = self.strategy.replay(spec.phase, codebook, state)
        before = self.codebook, self.position
        self.codebook = codebook
        try:  # validated before it is written: a phase's bad result is never checkpointed
            self._checkpoint(done)
        except CodebookError as err:
            self.codebook, self.position = before
            raise StepFailed(step_records.blame(spec.phase, err, self.screen)) from None
        self.participants.leave(self.screen.quarantined)

    def _drop_unfitted(self, codebook: Codebook, phase: Phase) -> Codebook:
        """Classes no site sent statistics for cannot be replayed: unregister them."""
        fields = schema.trained_in(phase)
        missing = [n for n in self.in_play if any(f not in codebook[n].values for f in fields)]
        if not missing:
            return codebook
        logger.warning(
            "no statistics for %s: unregistered for now; they are registered and trained again "
            "at the next step a site brings them",
            ", ".join(missing),
        )
        self.federation.unregister(missing)
        left = tuple(n for n in self.in_play if n not in missing)
        self.position = replace(self.position, in_play=left)
        return codebook.without(missing)

    def _restore_findings(self, step: int) -> None:
        """A resumed step goes on with what the screening found in the phases it does not
        repeat (the sync is repeated, and records its own)."""
        not_repeated = set(self.position.done) - {SYNCED}
        kept = step_records.findings_kept(self.federation.step_findings(step), not_repeated)
        if kept:
            self.screen.restore(kept)
            held = sorted(self.screen.quarantined)
            logger.info(
                f"step {step + 1} resumes with {progress.counted(len(kept), 'finding')} of the "
                "screening from before" + (f"; quarantined: {', '.join(held)}" if held else "")
            )

    def _checkpoint(self, done: PhaseRound) -> None:
        # ahead of the commit: what a crash after it must not lose (``_restore_findings``)
        self.federation.save_findings(self.position.step, self.screen.findings)
        finished = tuple(dict.fromkeys((*self.position.done, done)))
        self.position = replace(self.position, done=finished)
        self.codebook = self.federation.checkpoint(self.codebook, self.position)

    def _state(self, step: int, round_index: int) -> PhaseState:
        codebook = self.codebook
        registry = self.federation.registry
        return PhaseState(
            step,
            round_index,
            codebook,
            self.in_play,
            {name: registry[name].step for name in codebook.names},
            self.backbones,
            self.train,
        )

    def _record(self, step: int, status: str, reason: str) -> StepRecord:
        server_eval = None
        if self.server_eval is not None and status != FAILED:
            state = self._state(step, 0)
            config = self._config(SPECS[Phase.EVALUATE], state)
            server_eval = self.server_eval(self.codebook, state.class_steps, step, config)
        return step_records.step_record(
            step,
            status,
            reason,
            self.federation.attempts(step),
            self.tally,
            classes=self.in_play,
            sites=self.participants.sites.values(),
            version=self.codebook.version,
            screen=self.screen,
            server_eval=server_eval,
        )

    # --- the sync ----------------------------------------------------------------------

    def _sync(self, step: int) -> bool:
        """Ask every connected site what it brings (``server.participants``). A fresh step
        registers the classes the federation does not know yet and begins (False when there
        are none: no step); a resumed step, synced before, only learns who is here. Either
        way the sites that answered take part in the rest of the step."""
        config = sync_config(step, self.codebook, self.protocol.wire_dtype)
        replies = self._send(SYNC, step, 0, config, self.participants.node_ids, None)
        accepted = self.participants.sync(
            replies, self.screen, self.codebook, self.federation.quarantine()
        )
        if SYNCED in self.position.done:
            return True
        new, brought = new_classes(self.codebook, accepted)
        if not new:
            return False
        start = self.codebook
        self.codebook = replay.register(self.codebook, new, self.backbones, self.train)
        self.federation.register(new, step, brought)
        logger.info(
            f"step {step + 1}: {progress.counted(len(new), 'new class')} from "
            f"{progress.counted(len({s for n in new for s in brought[n]}), 'site')} · "
            f"{progress.counted(len(self.participants.node_ids), 'site')} taking part"
        )
        self.federation.begin_step(start)
        self.position = Position(step, running=True, in_play=tuple(new))
        self._checkpoint(SYNCED)
        return True

    # --- messaging --------------------------------------------------------------------------

    def _config(
        self, spec: PhaseSpec, state: PhaseState, also: list[str] | None = None
    ) -> dict[str, ConfigValue]:
        """The message config of a codebook phase: the protocol's (with the keys of the phases
        that travel with it, ``also``), then the strategy's."""
        config = message_config(state.step, state.round, state.codebook, self.protocol.wire_dtype)
        if also:
            config[ALSO] = also
        if spec.phase is Phase.EVALUATE:
            config[CLASS_STEPS] = [state.class_steps[name] for name in state.codebook.names]
        extra = self.strategy.configure(spec.phase, state)
        clash = sorted(set(extra) & set(config))
        if clash:
            raise ValueError(f"the strategy's config may not set the protocol's {clash}")
        return {**config, **extra}

    def _exchange(
        self, spec: PhaseSpec, state: PhaseState, nodes: list[int], also: list[str]
    ) -> list[Reply]:
        """Send one codebook phase to ``nodes``, asking for the updates of the phases ``also``
        too; the good replies. A site that answered holds the codebook it was sent. Nodes too
        far behind for one message are caught up first (``catch_up.before_phase``)."""
        config = self._config(spec, state, also)
        nodes, caught_up = catch_up.before_phase(
            self.grid,
            self.codebook,
            self.participants,
            nodes,
            state.step,
            self.protocol.wire_dtype,
            self._site_names(),
            self.protocol.timeout_s,
        )
        self._logged(caught_up)
        payload = self.participants.payloads(self.codebook, self.protocol.wire_dtype)
        return self._send(spec, state.step, state.round, config, nodes, payload)

    def _site_names(self) -> dict[int, str]:
        """Node id -> site name for the log. A registered site's name is known before its
        sync: a site that fails even that is recorded under the operator's name for it,
        not as node-<id>."""
        return {**self.screen.registered, **self.participants.sites}

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
            self.grid,
            spec,
            step,
            round_index,
            config,
            nodes,
            self._site_names(),
            payload,
            self.protocol.timeout_s,
        )
        if payload:
            for entry in exchanges:
                if entry.status.outcome is Outcome.OK:  # a refusal kept nothing
                    self.participants.hold(entry.node_id, self.codebook.version)
                else:
                    self.participants.hold(entry.node_id, None)
        self._logged(exchanges)
        return good

    def _logged(self, exchanges: list[Exchange]) -> None:
        """The run's and the step's log of what was exchanged."""
        self.log.exchanges.extend(exchanges)
        self.tally.exchanges.extend(exchanges)
