"""The server's aggregation steps: the phases of ``starfed.shared.protocol.PHASES``, in order.

For each phase the ``Coordinator`` sends one message to every participating site and hands the
replies to the phase's reducer (``REDUCERS``): sync registers the classes sites bring, training
phases merge, statistics phases merge and replay (``starfed.server.replay``), evaluation adds up
the sites' scores. The codebook is the single source of truth: every reducer replaces it with a
new value, and it is checkpointed in the federation folder after every phase, with the protocol
position, so an interrupted step can resume (``server.federation``).

A run performs steps until no site brings a new class (or ``max_steps``). A phase in which no
class in play gets an update fails the step (rolled back); a step in which some site failed or
was rejected completes ``degraded``. Sites that keep the last codebook receive deltas.

It talks to sites only through a Flower ``Grid`` (``get_node_ids``, ``send_and_receive``), so
tests drive it with an in-process grid. Every send has a timeout; error replies and missing
replies are logged with node and phase. Replies are decoded (= validated) once, at this
boundary; a bad one is rejected, never half-applied.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from rich.console import Console

from starfed.server import replay
from starfed.server.federation import EPOCH_KEY, Federation, Position
from starfed.server.messaging import Exchange, Reply, exchange, malformed, reject, update_digest
from starfed.server.scores import StepScores, aggregate
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.config import ProtocolOptions
from starfed.shared.data.site_folder import class_key
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import PHASES, Phase, PhaseSpec
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)

COMPLETED, DEGRADED, FAILED = "completed", "degraded", "failed"
SAMPLED = (Phase.STAGE1, Phase.STAGE1_STATS, Phase.STAGE2, Phase.STAGE2_STATS)  # fraction-train
WAIT_POLL_S = 1.0


class StepFailed(RuntimeError):
    """A phase in which no class in play got an update: the step cannot finish."""


@dataclass
class RunLog:
    """What one server run did."""

    steps: list[dict] = field(default_factory=list)  # the records it wrote to the history
    exchanges: list[Exchange] = field(default_factory=list)
    status: str = COMPLETED
    reason: str = ""


class Coordinator:
    """Drives the phases of every step of one server run; owns the codebook."""

    def __init__(
        self,
        grid,
        backbones: Backbones,
        train: TrainConfig,
        protocol: ProtocolOptions,
        federation: Federation,
        console: Console | None = None,
        server_eval: Callable[[Codebook, dict[str, int], int], dict] | None = None,
    ) -> None:
        self.grid = grid
        self.backbones = backbones
        self.train = train
        self.protocol = protocol
        self.federation = federation
        self.console = console or Console(stderr=True)
        self.server_eval = server_eval  # a simulation's scores on a global test set
        self.codebook = federation.codebook()
        self.position = federation.position(self.codebook)
        self.log = RunLog()
        self.in_play: list[str] = list(self.position.in_play)
        self.sites: dict[int, str] = {}  # node id -> site name (from its sync)
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
            if record["status"] == FAILED:
                break
        statuses = {record["status"] for record in self.log.steps} | {self.log.status}
        if FAILED in statuses:
            self.log.status = FAILED
            failed = (r["reason"] for r in self.log.steps if r["status"] == FAILED)
            self.log.reason = next(failed, self.log.reason)
        elif DEGRADED in statuses:
            self.log.status = DEGRADED
        return self.log

    def _end_without_step(self) -> None:
        """The sync found nothing in play: the run is over — unless sites failed to answer,
        which says nothing about what they hold (all failed: the run failed; some: degraded)."""
        failed = [e for e in self._steps if e.status != "ok"]
        if failed and len(failed) == len(self._steps):
            self.log.status = FAILED
            self.log.reason = f"no site answered the sync ({failed[0].site}: {failed[0].status})"
            self.console.print(f"[red]{self.log.reason}")
            return
        if failed:
            self.log.status = DEGRADED
            self.console.print(
                f"[yellow]{len(failed)} site(s) did not answer the sync; the others bring "
                "nothing new: the run is over"
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
                    f"{len(online)} site(s) connected, {self.protocol.min_sites} needed "
                    f"(waited {self.protocol.wait_s:.0f}s)"
                )
                self.console.print(f"[red]{self.log.reason}")
                return False
            time.sleep(WAIT_POLL_S)

    def run_step(self) -> dict | None:
        """One aggregation step, or the rest of an interrupted one; its history record, or
        None when no site brings anything new (nothing is recorded then)."""
        resume = self.position.running
        step = self.position.step
        if not resume:
            self.codebook = self.federation.begin_step(self.codebook, step)
            self.position = self.federation.position(self.codebook)
        started, status, reason = time.time(), COMPLETED, ""
        self._steps, self._scores = [], None
        self._node_ids = sorted(self.grid.get_node_ids())
        rounds = {Phase.STAGE1: self.protocol.stage1_rounds,
                  Phase.STAGE2: self.protocol.stage2_rounds}  # fmt: skip
        phase_seconds = []
        try:
            for spec in PHASES:
                for round_index in range(rounds.get(spec.phase, 1)):
                    done = f"{spec.phase.key}/{round_index}"
                    if done in self.position.done and spec.phase is not Phase.SYNC:
                        continue
                    t0 = time.perf_counter()
                    nodes = self._sample(spec.phase, step, round_index)
                    replies = self._exchange(spec, step, round_index, nodes)
                    if spec.phase is Phase.SYNC and resume:
                        self._participants(replies)  # who is here; nothing is registered again
                    else:
                        REDUCERS[spec.phase](self, spec.phase, step, replies)
                    if spec.phase is Phase.SYNC and not self.in_play:  # nothing new: no step
                        self.position = Position(step)
                        self.codebook = self.federation.checkpoint(self.codebook, self.position)
                        return None
                    finished = tuple(dict.fromkeys((*self.position.done, done)))
                    self.position = replace(self.position, done=finished,
                                            in_play=tuple(self.in_play))  # fmt: skip
                    self.codebook = self.federation.checkpoint(self.codebook, self.position)
                    phase_seconds.append({"phase": spec.phase.key, "round": round_index,
                                          "seconds": time.perf_counter() - t0})  # fmt: skip
        except StepFailed as err:
            # Sites that all stop answering may be a run that was stopped (`flwr stop`): then
            # this grid call fails in Flower (its token is revoked) and the run ends here,
            # recording nothing, instead of as a failed step.
            self.grid.get_node_ids()
            status, reason = FAILED, str(err)
            self.console.print(f"[red]step {step + 1} failed: {reason}; rolled back")
        if status != FAILED and any(e.status != "ok" for e in self._steps):
            status = DEGRADED
        record = self._record(step, status, reason, started, phase_seconds)
        kept = None if status == FAILED else self.codebook
        self.codebook = self.federation.end_step(record, kept)
        self.position = self.federation.position(self.codebook)
        self.in_play = []
        self.log.steps.append(record)
        return record

    def _record(self, step: int, status: str, reason: str, started: float, seconds: list) -> dict:
        attempts = sum(r["step"] == step for r in self.federation.history())
        exchanges = [asdict(e) for e in self._steps]
        record = {
            "step": step, "attempt": attempts, "status": status, "reason": reason,
            "started": started, "wall_s": time.time() - started,
            "classes": list(self.in_play), "sites": sorted(set(self.sites.values())),
            "phase_seconds": seconds, "exchanges": exchanges,
            "codebook_version": self.codebook.version,
        }  # fmt: skip
        if self._scores is not None:
            record["scores"] = asdict(self._scores)
        if self.server_eval is not None and status != FAILED:
            steps = {name: self.federation.registry[name].step for name in self.codebook.names}
            record["server_eval"] = self.server_eval(self.codebook, steps, step)
        return record

    # --- messaging --------------------------------------------------------------------------

    def _config(self, spec: PhaseSpec, step: int, round_index: int) -> dict:
        config = {
            "step": step, "round": round_index, "wire-dtype": self.protocol.wire_dtype,
            "federation": self.federation.id, "epoch": self.codebook.metadata[EPOCH_KEY],
        }  # fmt: skip
        if spec.phase is Phase.SYNC:
            config["frozen"] = sorted(self.codebook.frozen)
        if spec.phase is Phase.EVALUATE:
            registry = self.federation.registry
            config["class-steps"] = [registry[name].step for name in self.codebook.names]
        return config

    def _payloads(self) -> Callable[[int], bytes]:
        """The broadcast for each node: a delta from the version it holds, else the whole
        codebook (computed once per distinct base version)."""
        metadata = {k: self.codebook.metadata[k] for k in ("federation", EPOCH_KEY)}
        full = replace(self.codebook.broadcast(), metadata=metadata)
        cache: dict[int, bytes] = {}

        def payload(node: int) -> bytes:
            since = self._held.get(node, 0)
            if since not in cache:
                value = full if not 0 < since < full.version else self.codebook.delta(since)
                value.metadata = dict(full.metadata)
                cache[since] = value.to_bytes(self.protocol.wire_dtype)
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
        self, spec: PhaseSpec, step: int, round_index: int, nodes: list[int]
    ) -> list[Reply]:
        """Send one phase to ``nodes``; the good replies with their log entries. A site that
        answered holds the codebook it was sent."""
        payload = self._payloads() if spec.sends_codebook else None
        config = self._config(spec, step, round_index)
        good, exchanges = exchange(
            self.grid, spec, step, round_index, config, nodes, self.sites, payload,
            self.protocol.timeout_s,
        )  # fmt: skip
        if payload:
            for entry in exchanges:
                if entry.status == "ok":
                    self._held[entry.node_id] = self.codebook.version
                else:
                    self._held.pop(entry.node_id, None)
        self.log.exchanges.extend(exchanges)
        self._steps.extend(exchanges)
        return good

    def _updates(
        self, replies: list[Reply], phase: Phase
    ) -> Iterator[tuple[Exchange, ClientUpdate]]:
        """Decode (= validate) each update against the codebook the phase was sent with, one at
        a time (a phase never holds every decoded update); drop bad ones and rows of classes
        not in play."""
        in_play = set(self.in_play)
        # Merge order changes float rounding: order by content, not by node id (random per run).
        for entry, reply in sorted(replies, key=lambda r: update_digest(r[1])):
            try:
                data = reply.content["update"]["data"]
                update = ClientUpdate.from_bytes(data, against=self.codebook, phase=phase)
            except (CodebookError, KeyError, TypeError) as err:
                reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
                continue
            if phase is not Phase.SYNC:
                stray = [e.name for e in update.entries if e.name not in in_play]
                if stray:
                    logger.info("node %s sent rows of classes not in play: %s",
                                entry.node_id, stray)  # fmt: skip
                    update.entries = [e for e in update.entries if e.name in in_play]
            yield entry, update

    # --- reducers, one per phase ------------------------------------------------------------

    def _participants(self, replies: list[Reply]) -> list[tuple[Exchange, ClientUpdate]]:
        """Accepted syncs: the nodes that take part in the rest of the step, their site names
        and the codebook version each holds. A silent node costs one timeout per step, not
        one per phase; a node with other backbones or a malformed reply sits the step out."""
        accepted = sorted(self._updates(replies, Phase.SYNC), key=lambda r: r[0].node_id)
        self._node_ids = [entry.node_id for entry, _ in accepted]
        for entry, update in accepted:
            site = update.metadata.get("site") or f"node-{entry.node_id}"
            self.sites[entry.node_id] = entry.site = site
            self._brings[entry.node_id] = {class_key(e.name) for e in update.entries}
            held = update.base_version
            if 0 < held <= self.codebook.version:
                self._held[entry.node_id] = held
            else:
                self._held.pop(entry.node_id, None)
        return accepted

    def _sync(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        """Register the classes sites bring that the federation does not know yet, in the
        order of their class keys (``class_key``); they start from the same values everywhere.
        A class known under another spelling is the same class; a finished (frozen) class
        brought again is logged and stays frozen."""
        known = {class_key(name): name for name in self.codebook.names}
        new: dict[str, str] = {}  # key -> the first spelling in name order
        brought: dict[str, list[str]] = {}
        for entry, update in self._participants(replies):
            for class_entry in update.entries:
                key = class_key(class_entry.name)
                if key in known and self.codebook[known[key]].frozen:
                    logger.info("site %s brings %r again: it is finished and stays frozen",
                                entry.site, known[key])  # fmt: skip
                name = known.get(key) or min(new.get(key, class_entry.name), class_entry.name)
                if key not in known:
                    new[key] = name
                brought.setdefault(name, []).append(entry.site)
        self.in_play = [new[key] for key in sorted(new)]
        if self.in_play:
            self.codebook = replay.register(self.codebook, self.in_play, self.backbones, self.train)
            self.federation.register(self.in_play, step, brought)
            self.console.print(
                f"step {step + 1}: {len(self.in_play)} new classes from "
                f"{len({s for n in self.in_play for s in brought[n]})} site(s) · "
                f"{len(self._node_ids)} site(s) take part"
            )

    def _merge(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        """Each reply decoded and added to the phase's merge as it comes (docs/design.md)."""
        merge = MergeAccumulator(self.codebook, n_components=self.train.mixture_components)
        for _, update in self._updates(replies, phase):
            merge.add(update)
        if not merge.carried & set(self.in_play):
            raise StepFailed(f"no site's {phase.key} update arrived for any class in play")
        self.codebook = merge.result()

    def _drop_unfitted(self, field_name: str) -> None:
        """Classes no site sent statistics for cannot be replayed: unregister them."""
        missing = [n for n in self.in_play if field_name not in self.codebook[n].values]
        if missing:
            logger.warning("no statistics for %s; unregistering them", missing)
            self.codebook = self.codebook.without(missing)
            self.federation.unregister(missing)
            self.in_play = [n for n in self.in_play if n not in missing]

    def _stage1_stats(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        self._merge(phase, step, replies)
        self._drop_unfitted("clip_mixture")
        self.codebook = replay.replay_first_level(self.codebook, self.backbones, self.train, step)

    def _stage2_stats(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        self._merge(phase, step, replies)
        self._drop_unfitted("vit_mixture")
        self.codebook = replay.replay_head(
            self.codebook, self.train, step, self.in_play, self.backbones.device
        )

    def _evaluate(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        reports = []
        for entry, reply in replies:
            try:
                data = reply.content["report"]["data"]
                report = EvaluationReport.from_bytes(data, against=self.codebook)
                reports.append((entry.site, report))
            except (CodebookError, KeyError, TypeError) as err:
                reject(entry, str(err) if isinstance(err, CodebookError) else malformed(err))
        registry = self.federation.registry
        class_steps = {name: registry[name].step for name in self.codebook.names}
        self._scores = aggregate(reports, class_steps, step, self.codebook.dims.n_layers)
        row = " ".join(f"{a:.0f}" for a in self._scores.accuracy)
        self.console.print(
            f"step {step + 1}: {len(self.codebook)} classes · federation accuracy "
            f"{self._scores.mean_accuracy:.1f}% by arrival step: {row}"
        )


REDUCERS: dict[Phase, Callable[[Coordinator, Phase, int, list[Reply]], None]] = {
    Phase.SYNC: Coordinator._sync,
    Phase.STAGE1: Coordinator._merge,
    Phase.STAGE1_STATS: Coordinator._stage1_stats,
    Phase.STAGE2: Coordinator._merge,
    Phase.STAGE2_STATS: Coordinator._stage2_stats,
    Phase.EVALUATE: Coordinator._evaluate,
}
