"""The server's aggregation steps: the sync, then the phases of ``PHASES``, each one pipeline.

A step starts with the sync (``starfed.shared.protocol.SYNC``): every connected site says what its
current task brings, and the classes the federation does not know yet are registered. Then each
round of each codebook phase runs the same stages, in order (``Coordinator._run_phase``, drawn in
docs/design.md#one-step):

1. **plan** — the phase's ``PhaseState``, the phases that travel with it
   (``PhaseSpec.travels_with``), its message config (the strategy is asked once per phase round,
   ``_configure``) and its nodes (``server.participants``: every synced site, or a seeded share
   for training and statistics);
2. **send** and **collect** — nodes too far behind caught up in parts (``server.catch_up``), then
   one message each, with a timeout (``server.messaging``);
3. **decode** — each reply's update read against the codebook sent, a bad one rejected
   (``server.decode``);
4. **screen** — each update held to what its site said at the sync and to the phase's bounds
   (``server.field_bounds``, ``server.screening``): the updates kept and the findings;
5. **merge** — the strategy's (``server.strategy``): a new codebook, or the step's scores;
6. **replay** — after a statistics phase, the server's generative replay (``server.replay``;
   before the first level's, a lone class whose G_c is another site's class's, ``server.copies``,
   and after the head's, a lone class that impersonates another site's are rejected);
7. **commit** — the codebook checkpointed with the position (``server.federation``).

A phase that travels with another is asked for in that phase's message and runs stages 3-7 on
the same replies, right after it — a message less per step — unless a resumed step checkpointed
the phase it travels with before it. The evaluation travels with the next step's sync
(``_evaluate_with_next_sync``), unless the step is the run's last: that sync is sent when the
step's statistics are done, the next step's folders written first, with the codebook to the
sites that evaluate; their reports end the step, and the next step starts from the sync's
replies (``SyncAhead``). The codebook is the single source of truth: each phase replaces it with
a new value, checkpointed so an interrupted step can resume.

A run performs steps until no site brings a new class (or ``max_steps``). A phase in which no
class in play gets an update fails the step (rolled back); a step in which some site failed or
was rejected completes ``degraded``. It talks to sites only through a Flower ``Grid``
(``get_node_ids``, ``send_and_receive``), so tests drive it with an in-process grid. What a step
leaves in the history is ``server.step_records``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from starfed.server import catch_up, copies, decode, replay, step_records
from starfed.server.change_scale import ChangeScale
from starfed.server.federation import Federation
from starfed.server.field_bounds import Screened, screen_phase
from starfed.server.messaging import (
    Reply,
    SiteGrid,
    exchange,
    message_config,
    note_error,
    record_size,
    reject,
)
from starfed.server.participants import Participants, new_classes, sync_config
from starfed.server.records import (
    NOTED,
    REJECTED,
    Exchange,
    Outcome,
    PhaseRound,
    PhaseTime,
    Position,
    ReplayCost,
    StepRecord,
    StepScores,
)
from starfed.server.screening import Screen, ScreeningOptions
from starfed.server.step_records import RUN_END_LEVELS, RunLog, StepFailed, StepTally
from starfed.server.strategy import MeanStrategy, PhaseState, Strategy
from starfed.server.taken import taken
from starfed.shared import progress
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.config import ProtocolOptions
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import (
    CATCH_UP_KEY,
    CLASS_STEPS,
    EVALUATION_REFUSED,
    PHASES,
    RECORD_DATA,
    REPORT_RECORD,
    SPECS,
    STATISTICS,
    SYNC,
    TRAVELLING,
    UPDATE_RECORD,
    ConfigValue,
    Phase,
    PhaseSpec,
)
from starfed.shared.run_status import COMPLETED, DEGRADED, FAILED

logger = logging.getLogger(__name__)

SYNCED = PhaseRound(SYNC.phase.key)  # the position's mark of a step's finished sync
WAIT_POLL_S = 1.0

#: A simulation's scores on a global test set: (codebook, class steps, step, the evaluate
#: message's config) -> scores.
ServerEval = Callable[[Codebook, Mapping[str, int], int, Mapping[str, ConfigValue]], StepScores]


@dataclass(frozen=True)
class Part:
    """One phase a message's replies are reduced for: the phase sent, or one that travelled
    with it (its updates in the reply record named after it)."""

    spec: PhaseSpec
    done: PhaseRound  # its mark in the position once committed
    record: str  # the reply record of its updates


@dataclass(frozen=True)
class SyncAhead:
    """A step's sync, sent at the end of the step before with that step's evaluation travelling
    with it: the nodes it went to, its good replies and its log entries, what the step starts
    from instead of sending its own (``Coordinator.run_step``)."""

    node_ids: list[int]
    replies: list[Reply]
    exchanges: list[Exchange]


@dataclass(frozen=True)
class PhasePlan:
    """The plan stage's output: what one phase round sends, to whom, and what it reduces."""

    state: PhaseState  # its codebook is the one the message carries
    config: dict[str, ConfigValue]
    nodes: list[int]
    parts: tuple[Part, ...]  # the phase sent, then the phases that travel with it


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
        self.strategy = strategy or MeanStrategy()
        self.before_step = before_step
        self.screening = screening or ScreeningOptions()
        self.codebook = federation.checkpoints.codebook()
        self.position = federation.checkpoints.position  # the step's, checkpointed with it
        self.contributions = federation.contributions()  # each site's last rows per class
        self.log = RunLog()
        self.participants = Participants()
        # the step's, made new by ``run_step``
        self.tally = StepTally()
        self.screen: Screen
        self.catch_ups = catch_up.Ledger()
        self.configured: dict[PhaseRound, dict[str, ConfigValue]] = {}
        self.ahead: SyncAhead | None = None  # the next step's sync, sent with an evaluation

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
            last = max_steps is not None and len(self.log.steps) + 1 >= max_steps
            record = self.run_step(last=last)
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

    def run_step(self, *, last: bool = True) -> StepRecord | None:
        """One aggregation step, or the rest of an interrupted one; its history record, or
        None when no site brings anything new (nothing is recorded then). Unless it is the
        run's ``last``, its evaluation travels with the next step's sync."""
        step = self.position.step
        ahead, self.ahead = self.ahead, None
        if self.before_step is not None and ahead is None:
            self.before_step(step)
        status, reason = COMPLETED, ""
        self.tally = StepTally()
        self.screen = Screen(self.screening, step, ChangeScale.read(self.federation.root))
        self.catch_ups = self.catch_ups.next_step()
        self.configured = {}
        if SYNCED in self.position.done:
            self._restore_findings(step)
        t0 = time.perf_counter()
        if not self._sync(step, ahead):
            return None  # nothing new: no step
        self.tally.seconds.append(PhaseTime(SYNC.phase.key, 0, time.perf_counter() - t0))
        try:
            for spec in PHASES:
                for round_index in range(self._rounds(spec.phase)):
                    if PhaseRound(spec.phase.key, round_index) in self.position.done:
                        continue
                    if spec.travels_with is Phase.SYNC and not last:
                        self._evaluate_with_next_sync(step)
                    else:
                        self._run_phase(spec, step, round_index)
        except StepFailed as err:
            # Sites that all stop answering may be a run that was stopped (`flwr stop`): then
            # this grid call fails in Flower (its token is revoked) and the run ends here,
            # recording nothing, instead of as a failed step.
            self.grid.get_node_ids()
            status, reason = FAILED, str(err)
            logger.error("step %d failed: %s; rolled back", step + 1, reason)
        self._taking_part(catch_up.abandon(self.catch_ups, self.participants, step))
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
        self.position = self.federation.checkpoints.position  # between steps: none in play
        self.log.steps.append(record)
        return record

    def _rounds(self, phase: Phase) -> int:
        rounds = {
            Phase.STAGE1: self.protocol.stage1_rounds,
            Phase.STAGE2: self.protocol.stage2_rounds,
        }
        return rounds.get(phase, 1)

    # --- one phase round: plan, send, collect, decode, screen, merge, replay, commit ----------

    def _run_phase(self, spec: PhaseSpec, step: int, round_index: int) -> None:
        """One round of a codebook phase, stage by stage; the seconds of each phase it reduces
        go to the step's tally."""
        t0 = time.perf_counter()
        plan = self._plan(spec, step, round_index)
        replies = self._send_phase(plan)
        seconds = []
        for part in plan.parts:
            # a phase that travelled merges into the codebook the one before it just made
            state = plan.state if part.spec is spec else self._state(step, 0)
            phase = part.spec.phase
            if phase is Phase.EVALUATE:
                self._evaluate(replies, state)
            else:
                sent = plan.state.codebook
                bound = self.screen.max_entries(phase, sent)
                decoded = decode.updates(replies, phase, sent, bound, part.record)
                screened = screen_phase(
                    self.screen, decoded, phase, state.round, state.codebook, state.in_play
                )
                merged = self._merge(phase, screened, state)
                replayed = self._replay(phase, merged, state)
                self._commit(phase, replayed, part.done, screened)
            seconds.append(PhaseTime(phase.key, state.round, time.perf_counter() - t0))
            t0 = time.perf_counter()
        self.tally.seconds.extend(seconds)

    def _plan(self, spec: PhaseSpec, step: int, round_index: int) -> PhasePlan:
        """The plan stage: the phase's state, the phases that travel with it (at its last
        round, those that name it in ``travels_with``, not done yet and whose message the
        strategy adds nothing to), its message config and its nodes."""
        state = self._state(step, round_index)
        travelling = []
        if round_index == self._rounds(spec.phase) - 1:
            travelling = [
                other
                for other in PHASES
                if other.travels_with is spec.phase
                and PhaseRound(other.phase.key) not in self.position.done
                and not self._configure(other.phase, 0, state)
            ]
        config = self._config(spec, state, [other.phase.key for other in travelling])
        nodes = self.participants.sample(
            spec.phase, step, round_index, self.in_play, self.protocol, self.train.seed
        )
        parts = (
            Part(spec, PhaseRound(spec.phase.key, round_index), UPDATE_RECORD),
            *(Part(other, PhaseRound(other.phase.key), other.phase.key) for other in travelling),
        )
        return PhasePlan(state, config, nodes, parts)

    def _send_phase(self, plan: PhasePlan) -> list[Reply]:
        """The send and collect stages: the plan's nodes too far behind for one message caught
        up first (``_caught_up``: a slow one sits the phase out), then the phase sent to each,
        and to those whose catch-up ended while it ran (``catch_up.joined``); the good replies.
        A site that answered holds the codebook it was sent."""
        state, spec = plan.state, plan.parts[0].spec
        payload = self.participants.payloads(state.codebook, self.protocol.wire_dtype)
        nodes = self._caught_up(state, plan.nodes)
        replies = self._send(spec, state.step, state.round, plan.config, nodes, payload)
        late = catch_up.joined(self.catch_ups, self.participants, state.codebook.version)
        if nodes := self._taking_part(late):
            replies += self._send(spec, state.step, state.round, plan.config, nodes, payload)
        return replies

    def _caught_up(self, state: PhaseState, nodes: list[int]) -> list[int]:
        """Of ``nodes``, those taking part once the ones too far behind for one message were
        caught up in parts (``catch_up.before_phase``; a slow one's parts go on beside the
        phase); a failed catch-up is a finding."""
        caught_up = catch_up.before_phase(
            self.grid,
            state.codebook,
            self.participants,
            nodes,
            state.step,
            self.protocol.wire_dtype,
            self.protocol.part_bytes,
            self._site_names(),
            self.protocol.timeout_s,
            self.catch_ups,
        )
        return self._taking_part(caught_up)

    def _taking_part(self, caught_up: catch_up.CaughtUp) -> list[int]:
        """The catch-ups' parts logged and their findings noted (a catch-up costs the whole
        codebook); of their nodes, those still in the step (not quarantined)."""
        self._logged(caught_up.exchanges)
        names = self._site_names()
        for said, action in ((caught_up.findings, REJECTED), (caught_up.noted, NOTED)):
            for node, why in said.items():
                self.screen.note(names.get(node, f"node-{node}"), CATCH_UP_KEY, 0, action, why)
        self.participants.leave(self.screen.quarantined)
        return [node for node in caught_up.nodes if node in self.participants.node_ids]

    def _evaluate_with_next_sync(self, step: int) -> None:
        """The evaluation travelling with the next step's sync: the next step's folders
        written (``before_step``), then its sync sent to every connected node and this step's
        participants, with the codebook and the evaluation's config to the latter (caught up
        first);
        their reports are the step's scores (``_evaluate``), the replies the next step's sync
        (``self.ahead``)."""
        t0 = time.perf_counter()
        spec, state = SPECS[Phase.EVALUATE], self._state(step, 0)
        sample = self.participants.sample(
            spec.phase, step, 0, self.in_play, self.protocol, self.train.seed
        )
        evaluating = set(self._caught_up(state, sample))
        codebook = self.participants.payloads(state.codebook, self.protocol.wire_dtype)
        if self.before_step is not None:
            self.before_step(step + 1)
        nodes = sorted({*self.grid.get_node_ids(), *evaluating})  # as its own message would
        plain = sync_config(step + 1, state.codebook, self.protocol.wire_dtype)
        riding = {**self._config(spec, state), **plain, TRAVELLING: [spec.phase.key]}
        good, exchanges = exchange(
            self.grid,
            SYNC.message_type,
            SYNC.phase.key,
            step + 1,
            0,
            lambda node: riding if node in evaluating else plain,
            nodes,
            self._site_names(),
            lambda node: codebook(node) if node in evaluating else b"",
            self.protocol.timeout_s,
        )
        self.log.exchanges.extend(exchanges)  # the next step's: its tally gets them
        self.federation.journal_failures(exchanges)
        self.ahead = SyncAhead(nodes, good, exchanges)
        parts, reports = evaluation_parts(step, exchanges, good, evaluating)
        self._logged(parts)
        self._evaluate(reports, state, spec.phase.key)
        self.tally.seconds.append(PhaseTime(spec.phase.key, 0, time.perf_counter() - t0))

    def _evaluate(
        self, replies: list[Reply], state: PhaseState, record: str = REPORT_RECORD
    ) -> None:
        """The evaluation's decode, screen and merge: the step's scores (recorded when the step
        ends, which follows at once); ``record``: the replies' record of the reports."""
        reports = self.screen.reports(decode.reports(replies, state.codebook, record))
        self.tally.scores = scores = self.strategy.aggregate_evaluation(reports, state)
        logger.info(step_records.scores_line(state.step, len(self.codebook), scores))
        self.tally.taken = taken(reports, state.class_steps, self._holders(), state.step)
        for took in self.tally.taken:
            logger.warning(took.line(state.step + 1))

    def _merge(self, phase: Phase, screened: Screened, state: PhaseState) -> Codebook:
        """The merge stage: the screened updates reduced by the strategy into a new codebook;
        a phase in which no class in play was answered fails the step."""
        aggregate = (
            self.strategy.aggregate_statistics
            if phase in STATISTICS
            else self.strategy.aggregate_training
        )
        codebook = aggregate(phase, screened.updates, state)
        if not screened.answered & set(self.in_play):
            raise step_records.no_update(phase, self.screen, self.in_play)
        return codebook

    def _replay(self, phase: Phase, codebook: Codebook, state: PhaseState) -> Codebook:
        """The replay stage, after a statistics phase: classes no site sent statistics for
        unregistered; before the first level's replay, a lone class whose G_c is another
        site's class's (``copies.copies``) is rejected; then the strategy's replay over the
        classes left; after the head's, a lone class whose statistics impersonate another
        site's class is rejected, and the replay runs again without it
        (``_impersonators_left_out``)."""
        if phase not in STATISTICS:
            return codebook
        codebook = self._drop_unfitted(codebook, phase)
        if phase is Phase.STAGE1_STATS:
            found = copies.copies(codebook, self.in_play, self._holders())
            codebook = self._left_out(codebook, phase, state.round, found)
        t0 = time.perf_counter()
        replayed = self.strategy.replay(phase, codebook, replace(state, in_play=self.in_play))
        if phase is Phase.STAGE2_STATS:
            kept = self._impersonators_left_out(codebook, replayed, state.round)
            if kept is not codebook:
                codebook = kept
                replayed = self.strategy.replay(phase, kept, replace(state, in_play=self.in_play))
        cost = ReplayCost(phase.key, time.perf_counter() - t0, len(codebook), len(self.in_play))
        self.tally.replays.append(cost)
        logger.info(
            "replay after %s: %.1f s over %s (%d of the step's)",
            cost.phase,
            cost.seconds,
            progress.counted(cost.classes, "class"),
            cost.new_classes,
        )
        return replayed

    def _impersonators_left_out(
        self, merged: Codebook, replayed: Codebook, round_index: int
    ) -> Codebook:
        """``merged`` without the lone classes whose replayed head row moved toward another
        site's class (``replay.impersonations``)."""
        found = replay.impersonations(merged, replayed, self.in_play, self._holders())
        return self._left_out(merged, Phase.STAGE2_STATS, round_index, found)

    def _holders(self) -> dict[str, set[str]]:
        """Each registered class's sites (the registry's)."""
        return {name: set(entry.sites) for name, entry in self.federation.registry.items()}

    def _left_out(
        self,
        codebook: Codebook,
        phase: Phase,
        round_index: int,
        found: Sequence[copies.Copy | replay.Impersonation],
    ) -> Codebook:
        """``codebook`` without the lone classes a check of ``phase``'s statistics found
        (``copies.copies``, ``replay.impersonations``), each a finding against its site and
        unregistered for the step, as a class without statistics is; ``codebook`` itself when
        there are none. None of the step's classes left fails the step."""
        if not found:
            return codebook
        for one in found:
            self.screen.note(one.site, phase.key, round_index, REJECTED, one.reason, one.name)
        names = [one.name for one in found]
        if set(names) >= set(self.in_play):
            raise step_records.no_update(phase, self.screen, names)
        return self._unregistered(codebook, names)

    def _commit(
        self, phase: Phase, codebook: Codebook, done: PhaseRound, screened: Screened
    ) -> None:
        """The commit stage: the rows merged kept per site (``server.contributions``, written
        ahead), then the phase's codebook checkpointed, validated before it is written (a
        phase's bad result is never checkpointed: the step fails, naming the class and site);
        quarantined sites get no more messages in the step."""
        before = self.codebook, self.position
        self.codebook = codebook
        try:
            rows = self.contributions.merged(phase, screened.sites, screened.updates)
            self.contributions = self.federation.save_contributions(rows, codebook)
            self._checkpoint(done)
        except CodebookError as err:
            self.codebook, self.position = before
            raise StepFailed(step_records.blame(phase, err, self.screen)) from None
        self.participants.leave(self.screen.quarantined)

    def _drop_unfitted(self, codebook: Codebook, phase: Phase) -> Codebook:
        """Classes no site sent statistics for cannot be replayed: unregister them."""
        fields = schema.trained_in(phase)
        missing = [n for n in self.in_play if any(f not in codebook[n].values for f in fields)]
        if not missing:
            return codebook
        logger.warning("no statistics for %s", ", ".join(missing))
        return self._unregistered(codebook, missing)

    def _unregistered(self, codebook: Codebook, names: list[str]) -> Codebook:
        """Classes of the step left out of it: unregistered, out of play and of ``codebook``."""
        logger.warning(
            "%s unregistered for now; registered and trained again at the next step a site "
            "brings them",
            ", ".join(names),
        )
        self.federation.unregister(names)
        left = tuple(n for n in self.in_play if n not in names)
        self.position = replace(self.position, in_play=left)
        return codebook.without(names)

    def _restore_findings(self, step: int) -> None:
        """A resumed step goes on with what the screening found in the phases it does not
        repeat (the sync is repeated, and records its own)."""
        not_repeated = set(self.position.done) - {SYNCED}
        kept = step_records.findings_kept(self.federation.step_findings(step), not_repeated)
        if kept:
            self.screen.restore(kept)
            quarantined = ", ".join(sorted(self.screen.quarantined))
            logger.info(
                f"step {step + 1} resumes with {progress.counted(len(kept), 'finding')} of the "
                "screening from before" + (f"; quarantined: {quarantined}" if quarantined else "")
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

    def _sync(self, step: int, ahead: SyncAhead | None = None) -> bool:
        """The sync's send, collect, decode and screen: every connected site says what it
        brings (``ahead``: it was sent with the step before's evaluation); those the screening
        accepts take part in the rest of the step (``Participants.join``). A fresh step
        registers the classes the federation does not know yet and begins (False when there
        are none: no step); a resumed step, synced before, only learns who is here."""
        if ahead is None:
            self.participants.node_ids = sorted(self.grid.get_node_ids())
            config = sync_config(step, self.codebook, self.protocol.wire_dtype)
            replies = self._send(SYNC, step, 0, config, self.participants.node_ids, None)
        else:
            self.participants.node_ids = ahead.node_ids
            self.tally.exchanges.extend(ahead.exchanges)
            replies = ahead.replies
        bound = self.screen.max_entries(Phase.SYNC, self.codebook)
        named = self.screen.named(decode.updates(replies, Phase.SYNC, self.codebook, bound))
        accepted = self.screen.sync(named, self.codebook, self.federation.quarantine())
        self.participants.join(named, accepted, self.codebook)
        self.participants.leave(self.screen.quarantined)  # a resumed step's quarantines hold
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
        self, spec: PhaseSpec, state: PhaseState, travelling: list[str] | None = None
    ) -> dict[str, ConfigValue]:
        """The message config of a codebook phase: the protocol's (with the keys of the phases
        that travel with it, ``travelling``), then the strategy's."""
        config = message_config(state.step, state.round, state.codebook, self.protocol.wire_dtype)
        if travelling:
            config[TRAVELLING] = travelling
        if spec.phase is Phase.EVALUATE:
            config[CLASS_STEPS] = [state.class_steps[name] for name in state.codebook.names]
        extra = self._configure(spec.phase, state.round, state)
        clash = sorted(set(extra) & set(config))
        if clash:
            raise ValueError(f"the strategy's config may not set the protocol's {clash}")
        return {**config, **extra}

    def _configure(
        self, phase: Phase, round_index: int, state: PhaseState
    ) -> dict[str, ConfigValue]:
        """What the strategy adds to a phase round's message, asked once per step: a phase
        that may travel with another is asked when that one is planned (``state`` is then
        that phase's), and the answer holds if it is sent on its own."""
        done = PhaseRound(phase.key, round_index)
        if done not in self.configured:
            self.configured[done] = self.strategy.configure(phase, state)
        return self.configured[done]

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
            spec.message_type,
            spec.phase.key,
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
                    self.participants.set_version(entry.node_id, self.codebook.version)
                else:
                    self.participants.set_version(entry.node_id, None)
        self._logged(exchanges)
        return good

    def _logged(self, exchanges: list[Exchange]) -> None:
        """The run's and the step's log of what was exchanged; what failed, journaled in the
        folder at once (`server status` during the step)."""
        self.log.exchanges.extend(exchanges)
        self.tally.exchanges.extend(exchanges)
        self.federation.journal_failures(exchanges)


def evaluation_parts(
    step: int, sent: list[Exchange], good: list[Reply], evaluating: set[int]
) -> tuple[list[Exchange], list[Reply]]:
    """An evaluation that travelled with the next step's sync, apart from the sync: a log entry
    per node that evaluates (the codebook's bytes down, the report's up, the sync's failure if
    it failed; the sync's entry keeps the whole reply's hash, as the site's record does), and
    the replies that carry a report, each with its entry. The policy's refusal is a refusal; a
    reply with neither is rejected — a site of a release before the evaluation travelled."""
    key = Phase.EVALUATE.key
    parts: dict[int, Exchange] = {}
    for entry in sent:
        if entry.node_id in evaluating:
            parts[entry.node_id] = part = Exchange(
                step, key, 0, entry.node_id, entry.site, entry.bytes_down
            )
            part.status, entry.bytes_down = entry.status, 0
    reports = []
    for entry, reply in good:
        if entry.node_id not in parts:
            continue
        evaluation = parts[entry.node_id]
        if key in reply.content:
            evaluation.bytes_up = record_size(reply.content[key])
            entry.bytes_up -= evaluation.bytes_up
            reports.append((evaluation, reply))
        elif EVALUATION_REFUSED in reply.content:
            why = reply.content[EVALUATION_REFUSED].get(RECORD_DATA)
            note_error(evaluation, why.decode(errors="replace") if isinstance(why, bytes) else None)
        else:
            reject(
                evaluation, "its sync reply carries no evaluation (a site of an earlier release?)"
            )
    return list(parts.values()), reports
