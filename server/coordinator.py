"""The server's phase loop (DESIGN §3): sync, stage-1 rounds, stage-1 statistics + first-level
replay, stage-2 rounds, stage-2 statistics + head replay, evaluation — for every global step.

It talks to clients only through a Flower ``Grid`` (``get_node_ids``, ``create_message``,
``send_and_receive``), so tests can drive it with an in-process grid. Every send has a
timeout; error replies and missing replies are logged with node and phase and the round goes
on with the rest. Every update is validated before it is merged; a bad one is dropped, never
half-applied. After every phase the codebook and the protocol position are saved atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from rich.console import Console

from starfed.shared.codebook.codebook import (
    MAX_NAME_LENGTH,
    ClientUpdate,
    Codebook,
    CodebookError,
    Phase,
)
from starfed.shared.codebook.merge import check_update, merge_updates
from starfed.shared.config import ProtocolOptions
from starfed.shared.data.cropdiseases import DecodedImages, decode_images
from starfed.shared.data.scenario import Scenario
from starfed.shared.files import write_atomic
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.evaluation import evaluate_decoded
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import (
    TrainConfig,
    clip_features,
    first_level_alignment,
    head_alignment,
)

logger = logging.getLogger(__name__)

CODEBOOK_FILE = "codebook.bin"
STATE_FILE = "state.json"

# Flower message type of each phase: "<train|query|evaluate>.<action>" (ClientApp handlers).
MESSAGE_TYPES = {
    Phase.SYNC: "query.sync",
    Phase.STAGE1: "train.stage1",
    Phase.STAGE1_STATS: "query.stage1_stats",
    Phase.STAGE2: "train.stage2",
    Phase.STAGE2_STATS: "query.stage2_stats",
    Phase.EVALUATE: "evaluate",
}


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


class Coordinator:
    """Drives all phases of all steps and owns the global codebook."""

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
        self.model = StarPrompt(backbones, confidence_modulation=train.confidence_modulation)
        self.codebook = Codebook.from_bank(self.model.bank, backbones.fingerprint)
        self.log = RunLog()
        self._node_ids: list[int] = []
        self._global_test: tuple[DecodedImages, torch.Tensor] | None = None

    # --- messaging --------------------------------------------------------------------------

    def _exchange(
        self, phase: Phase, step: int, round_index: int = 0, with_codebook: bool = True
    ) -> list[tuple[Exchange, Message]]:
        """Send one phase to every node; return the good replies with their log entries."""
        config = ConfigRecord(
            {"step": step, "round": round_index, "wire-dtype": self.protocol.wire_dtype}
        )
        broadcast = self.codebook.without_mixtures()  # sites never read the mixtures
        payload = broadcast.to_bytes(self.protocol.wire_dtype) if with_codebook else b""
        messages, exchanges = [], []
        for node in self._node_ids:
            content = RecordDict({"config": config})
            if with_codebook:
                content["codebook"] = ConfigRecord({"data": payload})
            group = f"{step}/{phase.name}/{round_index}"
            messages.append(Message(content, node, MESSAGE_TYPES[phase], group_id=group))
            exchanges.append(Exchange(step, phase.name, round_index, node, len(payload)))
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
                    "node %s failed %s: %s", entry.node_id, phase.name, reply.error.reason
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
                    phase.name,
                    self.protocol.timeout_s,
                )
        self.log.exchanges.extend(logs.values())
        return good

    def _updates(
        self, replies: list[tuple[Exchange, Message]], phase: Phase, allowed: set[str]
    ) -> list[ClientUpdate]:
        """Decode and validate each update; drop bad ones and rows of classes not in play."""
        updates = []
        # Merge order changes float rounding: order by content, not by node id (random per run).
        for entry, reply in sorted(replies, key=lambda r: _update_digest(r[1])):
            try:
                update = ClientUpdate.from_bytes(
                    reply.content["update"]["data"],
                    fingerprint=self.codebook.fingerprint,
                    dims=self.codebook.dims,
                )
                if update.phase != phase:
                    raise CodebookError(f"update answers {update.phase.name}, not {phase.name}")
                check_update(self.codebook, update)
            except (CodebookError, KeyError, TypeError) as err:
                _reject(entry, str(err) if isinstance(err, CodebookError) else _malformed(err))
                continue
            stray = [e.name for e in update.entries if e.name not in allowed]
            if stray:
                logger.warning("node %s sent rows of classes not in play: %s", entry.node_id, stray)
                update.entries = [e for e in update.entries if e.name in allowed]
            updates.append(update)
        return updates

    # --- phases -----------------------------------------------------------------------------

    def _set_codebook(self, codebook: Codebook) -> None:
        self.codebook = codebook
        self.model.load_bank(codebook.to_bank())

    def _from_model(self) -> None:
        self.codebook = Codebook.from_bank(
            self.model.bank,
            self.codebook.fingerprint,
            version=self.codebook.version + 1,
            frozen=self.codebook.frozen,
            metadata=self.codebook.metadata,
        )

    def _sync(self, step: int) -> list[str]:
        """Register the classes sites hold now; new ones get deterministic initial rows.

        Only nodes whose sync was accepted take part in the rest of the step: a silent node
        costs one timeout per step, not one per phase, and a node with other backbones or a
        malformed reply is not asked again until the next step.
        """
        replies = self._exchange(Phase.SYNC, step, with_codebook=False)
        new: dict[str, float] = {}  # class name -> its position in the sites' class order
        accepted: list[int] = []
        for entry, reply in sorted(replies, key=lambda r: r[0].node_id):
            try:
                record = reply.content["sync"]
                fingerprint, classes = record["fingerprint"], record["classes"]
            except (KeyError, TypeError) as err:
                _reject(entry, _malformed(err))
                continue
            if fingerprint != self.codebook.fingerprint:
                _reject(entry, "backbone fingerprint")
                continue
            if not isinstance(classes, list) or not all(map(_valid_name, classes)):
                _reject(entry, "invalid class names")
                continue
            accepted.append(entry.node_id)
            labels = record.get("labels")
            if not _valid_labels(labels, len(classes)):
                labels = [math.inf] * len(classes)
            for name, label in zip(classes, labels, strict=True):
                if name not in self.codebook.bank.names:
                    new[name] = min(new.get(name, math.inf), float(label))
        self._node_ids = accepted
        # Registration order fixes the initial values (they are seeded by the ordered names),
        # so it must not depend on node ids, which differ from run to run.
        names = sorted(new, key=lambda name: (new[name], name))
        if names:
            self.model.add_classes(names, seed=self.train.seed, version=self.codebook.version + 1)
            self._from_model()
        return names

    def _train_round(self, phase: Phase, step: int, round_index: int, in_play: set[str]) -> None:
        replies = self._exchange(phase, step, round_index)
        updates = self._updates(replies, phase, in_play)
        self._set_codebook(
            merge_updates(self.codebook, updates, n_components=self.train.mixture_components)
        )

    def _drop_untrained(self, in_play: list[str], mixture_field: str) -> list[str]:
        """Classes no site sent statistics for cannot be replayed: unregister them."""
        bank = self.codebook.bank
        missing = [n for n in in_play if getattr(bank, mixture_field)[bank.index(n)] is None]
        if missing:
            logger.warning("no statistics for %s; unregistering them", missing)
            keep = [n for n in bank.names if n not in missing]
            self.model.load_bank(bank.select(keep))
            self._from_model()
        return [n for n in in_play if n not in missing]

    @contextmanager
    def _phase(self, step: int, name: str) -> Iterator[None]:
        """Time a phase, then checkpoint the codebook and the protocol position."""
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.log.phase_seconds.append({"step": step, "phase": name, "seconds": seconds})
        self._checkpoint(step, name)

    def _stage(
        self,
        step: int,
        train_phase: Phase,
        rounds: int,
        stats_phase: Phase,
        mixture_field: str,
        align: Callable[[list[str]], None],
        in_play: list[str],
    ) -> list[str]:
        """Training rounds, then statistics and the server-side replay of one level."""
        for r in range(rounds):
            with self._phase(step, f"{train_phase.name.lower()}/{r}"):
                self._train_round(train_phase, step, r, set(in_play))
        with self._phase(step, f"{stats_phase.name.lower()}+replay"):
            self._train_round(stats_phase, step, 0, set(in_play))
            in_play = self._drop_untrained(in_play, mixture_field)
            align(in_play)
            self._from_model()
        return in_play

    def run_step(self, step: int) -> None:
        with self._phase(step, "sync"):
            self._node_ids = sorted(self.grid.get_node_ids())
            in_play = self._sync(step)
        n_past = len(self.codebook.frozen)

        def align_first_level(_: list[str]) -> None:
            first_level_alignment(self.model, n_past, self.train, step)

        def align_head_and_freeze(trained: list[str]) -> None:
            head_alignment(self.model, self.train, step)
            self.codebook.frozen |= set(trained)

        in_play = self._stage(
            step, Phase.STAGE1, self.protocol.stage1_rounds, Phase.STAGE1_STATS,
            "clip_mixtures", align_first_level, in_play,
        )  # fmt: skip
        self._stage(
            step, Phase.STAGE2, self.protocol.stage2_rounds, Phase.STAGE2_STATS,
            "vit_mixtures", align_head_and_freeze, in_play,
        )  # fmt: skip
        with self._phase(step, "evaluate"):
            self._evaluate(step)

    def _evaluate(self, step: int) -> None:
        replies = self._exchange(Phase.EVALUATE, step)
        for entry, reply in replies:
            try:
                metrics = dict(reply.content["metrics"])
            except (KeyError, TypeError) as err:
                _reject(entry, _malformed(err))
                continue
            self.log.client_reports.append({"step": step, "node_id": entry.node_id, **metrics})
        if self.scenario is None or len(self.codebook.bank) == 0:
            return
        if self._global_test is None:  # frozen CLIP: decode and encode the test set once
            test = decode_images(
                self.scenario.global_test_samples(range(self.scenario.n_tasks)),
                self.backbones.config.image_size,
                progress=False,
            )
            self._global_test = test, clip_features(self.backbones, test.images)
        n_tasks = min(step, self.scenario.n_tasks - 1) + 1
        # Images of classes not learned yet are left out by evaluate_decoded.
        scores = evaluate_decoded(self.model, *self._global_test, self.scenario.split, n_tasks)
        self.log.accuracy_matrix.append(scores.accuracy)
        self.log.selection_matrix.append(scores.selection_accuracy)
        mean = sum(scores.accuracy) / len(scores.accuracy)
        self.console.print(
            f"step {step + 1}/{self.n_steps}: {len(self.codebook.bank)} classes · "
            f"global accuracy {mean:.1f}% · " + " ".join(f"{a:.0f}" for a in scores.accuracy)
        )

    def _checkpoint(self, step: int, phase: str) -> None:
        self.codebook.save(self.run_dir / CODEBOOK_FILE)
        state = {
            "step": step,
            "phase": phase,
            "codebook_version": self.codebook.version,
            "frozen": sorted(self.codebook.frozen),
            "time": time.time(),
        }
        write_atomic(self.run_dir / STATE_FILE, json.dumps(state, indent=2).encode())

    def run(self, steps: Iterable[int] | None = None) -> RunLog:
        for step in steps if steps is not None else range(self.n_steps):
            self.run_step(step)
        return self.log

    def exchanges_as_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.log.exchanges]


def _reject(entry: Exchange, reason: str) -> None:
    entry.status = f"rejected: {reason}"
    logger.warning("rejected %s reply of node %s: %s", entry.phase, entry.node_id, reason)


def _malformed(err: Exception) -> str:
    return f"malformed reply ({err})"


def _valid_labels(labels: object, n: int) -> bool:
    """Class-order positions sent with a sync: integers, one per class."""
    return (
        isinstance(labels, list)
        and len(labels) == n
        and all(isinstance(v, int) and not isinstance(v, bool) for v in labels)
    )


def _valid_name(name: object) -> bool:
    """A class name the codebook accepts (its rules): registering any other would crash."""
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME_LENGTH and name.isprintable()


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
