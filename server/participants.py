"""The sync: who takes part in a step, and which classes it registers.

A step starts with one ``query.sync`` message to every connected node (``SYNC``). Each
answer names the site, the classes its current task brings with their image counts, and the
codebook version it holds. The screening (``server.screening``) names each site once and bounds
what it may bring; the sites it accepts join the step's ``Participants`` (``join``), which the
rest of the step's messages go to — all of them, or for a training or statistics round a seeded
share (``Participants.sample``) — each carrying the delta from the version that node holds
(``Participants.payloads``). The classes no one brought before are the step's new classes
(``new_classes``), registered by the coordinator (``server.coordinator``).

Costs: the sync decodes one small update per node; a sample is one draw over the sites'
names plus one pass over what each node brings and one over the classes in play; a phase's
payloads encode the codebook once per distinct version the nodes hold.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from starfed.server.decode import Decoded
from starfed.server.messaging import message_config
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.config import ProtocolOptions
from starfed.shared.data.site_folder import class_key
from starfed.shared.protocol import FROZEN, ConfigValue, Phase

logger = logging.getLogger(__name__)

SAMPLED = (Phase.STAGE1, Phase.STAGE1_STATS, Phase.STAGE2, Phase.STAGE2_STATS)  # fraction-train


def sync_config(step: int, codebook: Codebook, wire_dtype: str) -> dict[str, ConfigValue]:
    """The sync's message config: the protocol's (``message_config``) and the codebook's
    finished classes; no codebook travels either way."""
    return {**message_config(step, 0, codebook, wire_dtype), FROZEN: sorted(codebook.frozen)}


@dataclass
class Participants:
    """The nodes of the step and what the server knows of each: its site name (from its
    sync), the class keys of its current task, and the codebook version it holds (when
    known: it answered a message that carried that version)."""

    node_ids: list[int] = field(default_factory=list)
    sites: dict[int, str] = field(default_factory=dict)  # node id -> site name
    brings: dict[int, set[str]] = field(default_factory=dict)  # node id -> class keys
    versions: dict[int, int] = field(default_factory=dict)  # node id -> codebook version

    def join(self, named: list[Decoded], accepted: list[Decoded], codebook: Codebook) -> None:
        """The step's nodes after its sync: every node that answered is known by its name
        (``named``, ``Screen.named``); those the screening accepted (``accepted``) take part, with
        what they bring and the codebook version each holds. A silent node costs one timeout
        per step, not one per phase; a node with other backbones or a malformed reply sits the
        step out."""
        for entry, _ in named:
            self.sites[entry.node_id] = entry.site
        self.node_ids = [entry.node_id for entry, _ in accepted]
        for entry, update in accepted:
            self.brings[entry.node_id] = {class_key(e.name) for e in update.entries}
            base = update.base_version
            if 0 < base <= codebook.version:
                self.versions[entry.node_id] = base
            else:
                self.versions.pop(entry.node_id, None)

    def leave(self, quarantined: Collection[str]) -> None:
        """Quarantined sites get no more messages in this step."""
        self.node_ids = [n for n in self.node_ids if self.sites.get(n) not in quarantined]

    def sample(
        self,
        phase: Phase,
        step: int,
        round_index: int,
        in_play: Sequence[str],
        protocol: ProtocolOptions,
        seed: int,
    ) -> list[int]:
        """The nodes of one round: every participant, or for a training or statistics round a
        seeded share of them (``fraction-train``, at least ``min-train-sites``), drawn over
        site names (node ids change from run to run), plus the first holder of any class in
        play the draw missed, so every class gets an update and statistics."""
        nodes = self.node_ids
        if phase not in SAMPLED or protocol.fraction_train >= 1 or not nodes:
            return nodes
        by_name = sorted(nodes, key=lambda node: self.sites[node])
        size = max(protocol.min_train_sites, math.ceil(protocol.fraction_train * len(nodes)))
        rng = np.random.default_rng([seed, step, phase.value, round_index])
        chosen = {
            by_name[i] for i in rng.choice(len(by_name), min(size, len(by_name)), replace=False)
        }
        first: dict[str, int] = {}  # class key -> its first holder in name order
        for node in by_name:
            for key in self.brings.get(node, ()):
                first.setdefault(key, node)
        covered = {key for node in chosen for key in self.brings.get(node, ())}
        for key in map(class_key, in_play):
            holder = first.get(key)
            if holder is not None and key not in covered:
                chosen.add(holder)
                covered |= self.brings.get(holder, set())
        return sorted(chosen)

    def payloads(self, codebook: Codebook, wire_dtype: str) -> Callable[[int], bytes]:
        """The broadcast for each node: a delta from the version it holds, else the whole
        codebook (each encoded once per distinct base version)."""
        lineage = Lineage.of(codebook).as_metadata()
        full = replace(codebook.broadcast(), metadata=lineage)
        cache: dict[int, bytes] = {}

        def payload(node: int) -> bytes:
            since = self.versions.get(node, 0)
            if since not in cache:  # since == version: caught up (catch_up), the delta is empty
                whole = not 0 < since <= full.version
                value = full if whole else replace(codebook.delta(since), metadata=lineage)
                cache[since] = wire.encode(value, wire_dtype)
            return cache[since]

        return payload

    def set_version(self, node: int, version: int | None) -> None:
        """``node`` holds codebook ``version`` now (None: unknown — it gets the whole
        codebook next)."""
        if version is None:
            self.versions.pop(node, None)
        else:
            self.versions[node] = version


def new_classes(
    codebook: Codebook, accepted: list[Decoded]
) -> tuple[list[str], dict[str, list[str]]]:
    """The classes sites bring that the federation does not know yet, in the order of their
    class keys (``class_key``), and the sites that bring each class. A class known under
    another spelling is the same class; a finished (frozen) class brought again is logged
    and stays frozen."""
    known = {class_key(name): name for name in codebook.names}
    new: dict[str, str] = {}  # key -> the first spelling in name order
    brought: dict[str, list[str]] = {}
    for entry, update in accepted:
        for class_entry in update.entries:
            key = class_key(class_entry.name)
            if key in known and codebook[known[key]].frozen:
                logger.info(
                    "site %s brings %r again: it is finished and stays frozen",
                    entry.site,
                    known[key],
                )
            name = known.get(key) or min(new.get(key, class_entry.name), class_entry.name)
            if key not in known:
                new[key] = name
            brought.setdefault(name, []).append(entry.site)
    return [new[key] for key in sorted(new)], brought
