"""The server's aggregation step: the phases of ``starfed.shared.protocol.PHASES``, in order.

For each phase the ``Coordinator`` sends one message to every participating site and hands the
replies to the phase's reducer (``REDUCERS``): sync registers the classes sites bring, training
phases merge, statistics phases merge and replay (``starfed.server.replay``), evaluation
collects scores. The codebook is the single source of truth: every reducer replaces it with a
new value, and it is checkpointed after every phase.

It talks to sites only through a Flower ``Grid`` (``get_node_ids``, ``send_and_receive``), so
tests drive it with an in-process grid. Every send has a timeout; error replies and missing
replies are logged with node and phase, and the round goes on with the rest. Replies are
decoded (= validated) once, at this boundary; a bad one is rejected, never half-applied.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from rich.console import Console

from starfed.server import replay
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError
from starfed.shared.codebook.merge import merge_updates
from starfed.shared.data.cropdiseases import DecodedImages, decode_images
from starfed.shared.data.scenario import Scenario
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.evaluation import evaluate_decoded
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, clip_features
from starfed.shared.protocol import PHASES, Phase, PhaseSpec
from starfed.shared.run_config import ProtocolOptions

logger = logging.getLogger(__name__)

CODEBOOK_FILE = "codebook.bin"


@dataclass
class Exchange:
    """One message to one node and its answer: what the wire carried and what came back."""

    step: int
    phase: str
    round: int
    node_id: int
    bytes_down: int
    bytes_up: int = 0
    status: str = "ok"  # ok | error: <reason> | no reply | rejected: <reason>


@dataclass
class RunLog:
    exchanges: list[Exchange] = field(default_factory=list)
    phase_seconds: list[dict] = field(default_factory=list)
    client_reports: list[dict] = field(default_factory=list)
    accuracy_matrix: list[list[float]] = field(default_factory=list)
    selection_matrix: list[list[float]] = field(default_factory=list)


Reply = tuple[Exchange, Message]


class Coordinator:
    """Drives the phases of every step; owns the codebook."""

    def __init__(
        self,
        grid,
        backbones: Backbones,
        train: TrainConfig,
        protocol: ProtocolOptions,
        n_steps: int,
        run_dir: Path,
        scenario: Scenario | None = None,
        console: Console | None = None,
    ) -> None:
        self.grid = grid
        self.backbones = backbones
        self.train = train
        self.protocol = protocol
        self.n_steps = n_steps
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.scenario = scenario  # for the server's global test set (simulation only)
        self.console = console or Console(stderr=True)
        self.codebook = Codebook(backbones.fingerprint, backbones.dims)
        self.log = RunLog()
        self.in_play: list[str] = []  # classes the current step trains
        self._node_ids: list[int] = []
        self._global_test: tuple[DecodedImages, torch.Tensor] | None = None

    def run(self) -> RunLog:
        for step in range(self.n_steps):
            self.run_step(step)
        return self.log

    def run_step(self, step: int) -> None:
        """One aggregation step: every phase of the protocol table, in order."""
        self._node_ids = sorted(self.grid.get_node_ids())
        rounds = {
            Phase.STAGE1: self.protocol.stage1_rounds,
            Phase.STAGE2: self.protocol.stage2_rounds,
        }
        for spec in PHASES:
            for round_index in range(rounds.get(spec.phase, 1)):
                with self._phase(step, spec, round_index):
                    replies = self._exchange(spec, step, round_index)
                    REDUCERS[spec.phase](self, spec.phase, step, replies)

    # --- messaging --------------------------------------------------------------------------

    def _exchange(self, spec: PhaseSpec, step: int, round_index: int) -> list[Reply]:
        """Send one phase to every node; return the good replies with their log entries."""
        config = ConfigRecord(
            {"step": step, "round": round_index, "wire-dtype": self.protocol.wire_dtype}
        )
        payload = b""
        if spec.sends_codebook:  # sites never read the mixtures
            payload = self.codebook.without_mixtures().to_bytes(self.protocol.wire_dtype)
        messages, exchanges = [], []
        for node in self._node_ids:
            content = RecordDict({"config": config})
            if spec.sends_codebook:
                content["codebook"] = ConfigRecord({"data": payload})
            group = f"{step}/{spec.phase.key}/{round_index}"
            messages.append(Message(content, node, spec.message_type, group_id=group))
            exchanges.append(Exchange(step, spec.phase.key, round_index, node, len(payload)))
        replies = self.grid.send_and_receive(messages, timeout=self.protocol.timeout_s)
        # Grids fill in each message's id when they push it; replies point back to it.
        logs = {m.metadata.message_id: e for m, e in zip(messages, exchanges, strict=True)}
        good, answered = [], set()
        for reply in replies:
            entry = logs.get(reply.metadata.reply_to_message_id)
            if entry is None:
                logger.warning(
                    "reply to an unknown message from node %s", reply.metadata.src_node_id
                )
                continue
            answered.add(entry.node_id)
            if reply.has_error():
                entry.status = f"error: {_short_reason(reply.error.reason)}"
                logger.warning(
                    "node %s failed %s: %s", entry.node_id, spec.phase.key, reply.error.reason
                )
                continue
            entry.bytes_up = _content_bytes(reply.content)
            good.append((entry, reply))
        for entry in logs.values():
            if entry.node_id not in answered:
                entry.status = "no reply"
                logger.warning(
                    "node %s sent no %s reply within %.0fs",
                    entry.node_id,
                    spec.phase.key,
                    self.protocol.timeout_s,
                )
        self.log.exchanges.extend(logs.values())
        return good

    def _updates(
        self, replies: list[Reply], phase: Phase
    ) -> list[tuple[Exchange, ClientUpdate]]:
        """Decode (= validate) each update against the codebook the phase was sent with; drop
        bad ones and rows of classes not in play."""
        updates = []
        # Merge order changes float rounding: order by content, not by node id (random per run).
        for entry, reply in sorted(replies, key=lambda r: _update_digest(r[1])):
            try:
                data = reply.content["update"]["data"]
                update = ClientUpdate.from_bytes(data, against=self.codebook, phase=phase)
            except (CodebookError, KeyError, TypeError) as err:
                _reject(entry, str(err) if isinstance(err, CodebookError) else _malformed(err))
                continue
            if phase is not Phase.SYNC:
                in_play = set(self.in_play)
                stray = [e.name for e in update.entries if e.name not in in_play]
                if stray:
                    logger.warning(
                        "node %s sent rows of classes not in play: %s", entry.node_id, stray
                    )
                    update.entries = [e for e in update.entries if e.name in in_play]
            updates.append((entry, update))
        return updates

    # --- reducers, one per phase ------------------------------------------------------------

    def _sync(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        """Register the classes sites hold now; new ones get deterministic initial values.

        Only nodes whose sync was accepted take part in the rest of the step: a silent node
        costs one timeout per step, not one per phase, and a node with other backbones or a
        malformed reply is not asked again until the next step.
        """
        new: dict[str, float] = {}  # class name -> its first position in the sites' class order
        accepted: list[int] = []
        for entry, update in sorted(self._updates(replies, phase), key=lambda r: r[0].node_id):
            accepted.append(entry.node_id)
            for class_entry, position in zip(update.entries, update.class_order, strict=True):
                if class_entry.name not in self.codebook:
                    new[class_entry.name] = min(new.get(class_entry.name, math.inf), position)
        self._node_ids = accepted
        # Registration order fixes the initial values (they are seeded by the ordered names),
        # so it must not depend on node ids, which differ from run to run.
        self.in_play = sorted(new, key=lambda name: (new[name], name))
        if self.in_play:
            self.codebook = replay.register(self.codebook, self.in_play, self.backbones, self.train)

    def _merge(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        updates = [update for _, update in self._updates(replies, phase)]
        self.codebook = merge_updates(
            self.codebook, updates, n_components=self.train.mixture_components
        )

    def _drop_unfitted(self, field_name: str) -> None:
        """Classes no site sent statistics for cannot be replayed: unregister them."""
        missing = [n for n in self.in_play if field_name not in self.codebook[n].values]
        if missing:
            logger.warning("no statistics for %s; unregistering them", missing)
            self.codebook = self.codebook.without(missing)
            self.in_play = [n for n in self.in_play if n not in missing]

    def _stage1_stats(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        self._merge(phase, step, replies)
        self._drop_unfitted("clip_mixture")
        self.codebook = replay.replay_first_level(self.codebook, self.backbones, self.train, step)

    def _stage2_stats(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        self._merge(phase, step, replies)
        self._drop_unfitted("vit_mixture")
        self.codebook = replay.replay_head(self.codebook, self.train, step, freeze=self.in_play)

    def _evaluate(self, phase: Phase, step: int, replies: list[Reply]) -> None:
        for entry, reply in replies:
            try:
                metrics = dict(reply.content["metrics"])
            except (KeyError, TypeError) as err:
                _reject(entry, _malformed(err))
                continue
            self.log.client_reports.append({"step": step, "node_id": entry.node_id, **metrics})
        if self.scenario is None or len(self.codebook) == 0:
            return
        if self._global_test is None:  # frozen CLIP: decode and encode the test set once
            test = decode_images(
                self.scenario.global_test_samples(range(self.scenario.n_tasks)),
                self.backbones.config.image_size,
                progress=False,
            )
            self._global_test = test, clip_features(self.backbones, test.images)
        n_tasks = min(step, self.scenario.n_tasks - 1) + 1
        model = StarPrompt(self.backbones, confidence_modulation=self.train.confidence_modulation)
        model.load_bank(self.codebook.bank())
        # Images of classes not learned yet are left out by evaluate_decoded.
        scores = evaluate_decoded(model, *self._global_test, self.scenario.split, n_tasks)
        self.log.accuracy_matrix.append(scores.accuracy)
        self.log.selection_matrix.append(scores.selection_accuracy)
        mean = sum(scores.accuracy) / len(scores.accuracy)
        self.console.print(
            f"step {step + 1}/{self.n_steps}: {len(self.codebook)} classes · "
            f"global accuracy {mean:.1f}% · " + " ".join(f"{a:.0f}" for a in scores.accuracy)
        )

    # --- bookkeeping ------------------------------------------------------------------------

    @contextmanager
    def _phase(self, step: int, spec: PhaseSpec, round_index: int) -> Iterator[None]:
        """Time a phase, then checkpoint the codebook."""
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.log.phase_seconds.append(
            {"step": step, "phase": spec.phase.key, "round": round_index, "seconds": seconds}
        )
        self.codebook.save(self.run_dir / CODEBOOK_FILE)

    def exchanges_as_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.log.exchanges]


REDUCERS: dict[Phase, Callable[[Coordinator, Phase, int, list[Reply]], None]] = {
    Phase.SYNC: Coordinator._sync,
    Phase.STAGE1: Coordinator._merge,
    Phase.STAGE1_STATS: Coordinator._stage1_stats,
    Phase.STAGE2: Coordinator._merge,
    Phase.STAGE2_STATS: Coordinator._stage2_stats,
    Phase.EVALUATE: Coordinator._evaluate,
}


def _reject(entry: Exchange, reason: str) -> None:
    entry.status = f"rejected: {reason}"
    logger.warning("rejected %s reply of node %s: %s", entry.phase, entry.node_id, reason)


def _malformed(err: Exception) -> str:
    return f"malformed reply ({err})"


def _update_digest(reply: Message) -> str:
    try:
        return hashlib.sha256(reply.content["update"]["data"]).hexdigest()
    except (KeyError, TypeError):
        return ""  # malformed: rejected in _updates anyway


def _short_reason(reason: str | None, limit: int = 300) -> str:
    """The informative line of an error reason (runtimes wrap a traceback around it)."""
    lines = [line.strip() for line in (reason or "").splitlines() if line.strip()]
    fallback = lines[-1] if lines else ""
    return next((line for line in reversed(lines) if "Message:" in line), fallback)[:limit]


def _content_bytes(content: RecordDict) -> int:
    """Payload bytes of a reply: serialised updates count fully, other records by their values."""
    total = 0
    for record in content.values():
        for value in record.values():
            if isinstance(value, bytes):
                total += len(value)
            else:
                total += len(str(value).encode())
    return total
