"""How a site answers one message, whichever process holds it: the one code behind the adapters.

The ClientApp (``starfed.client.app``) answers in its own process, or hands the message to the
site's worker (``starfed.client.worker``), which answers here too; both send a header — the
phase, the message's config, the run's and node's configs — and the codebook bytes.

A node is a site when its node config names its folders: ``data-dir`` (and ``state-dir``,
``site-name``; ``starfed site start`` writes them). A node of a simulation (``partition-id``)
finds its folders by a naming rule (``simulated_site_dir``) inside the run folder, where the
simulation writes the site's data before each step (``starfed.simulations.simulated_sites``): a
node knows only its folders, never the scenario. A node with neither refuses every message: it
must not train on data it was never given.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from starfed.client import release_gate
from starfed.client.memory import SiteMemory
from starfed.client.policy import (
    COUNTS,
    EVALUATION,
    read_policy,
    releases_of,
    server_certificate,
)
from starfed.client.privacy import PrivacySetting
from starfed.client.release_gate import Outgoing
from starfed.client.site import Site
from starfed.shared.codebook import parts, schema, wire
from starfed.shared.codebook.codebook import ClientUpdate
from starfed.shared.codebook.lineage import EPOCH_KEY, FEDERATION_KEY
from starfed.shared.config import environment, parse, run_dir
from starfed.shared.knob import as_int, as_str
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import (
    CATCH_UP_KEY,
    CLASS_STEPS,
    CLASSIFY_WITH_KEYS,
    EVALUATION_REFUSED,
    FROZEN,
    HELD,
    POLICY_REFUSED,
    REPORT_RECORD,
    ROUND,
    STAGED,
    STEP,
    TRAVELLING,
    UPDATE_RECORD,
    WIRE_DTYPE,
    Phase,
)

#: How many built sites a process keeps (``SiteCache``).
SITES_KEPT = 128


@dataclass(frozen=True)
class SiteKey:
    """What a site is built from: its run and node ids, and the run's and node's configs as
    canonical JSON. Two runs under the same ids with other configs (two in-process runs, one
    after the other) are two sites: the second never gets the first's."""

    run_id: int
    node_id: int
    configs: str

    @classmethod
    def of(cls, run_id: int, node_id: int, run_config: dict, node_config: dict) -> SiteKey:
        # repr: a value JSON cannot hold is refused by the schema when the site is built
        configs = json.dumps([run_config, node_config], sort_keys=True, default=repr)
        return cls(run_id, node_id, configs)


class SiteCache:
    """The sites a process has built, the last one used last: backbones and caches load once.

    A process of a simulation answers for many sites; it keeps the ``kept`` it used last, so
    its memory does not grow with the number of sites (what a site must remember is in its
    folders: a site built again reads it there, as a deployed site's next ClientApp process
    does)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._sites: OrderedDict[SiteKey, Site] = OrderedDict()

    def get(self, key: SiteKey, build: Callable[[], Site]) -> Site:
        """The site built from ``key``: the one kept, or ``build()``'s (then kept)."""
        site = self._sites.get(key)
        if site is not None:
            self._sites.move_to_end(key)
            return site
        site = self._sites[key] = build()
        while len(self._sites) > self.kept:
            self._sites.popitem(last=False)
        return site

    def clear(self) -> None:
        """Forget every site (to free its memory: the next message builds it again)."""
        self._sites.clear()


#: This process's sites.
SITES = SiteCache(SITES_KEPT)


class NoDataError(RuntimeError):
    """A node that is neither a configured site nor a simulated one."""


def default_cache_dir() -> Path:
    """Where a simulated site caches decoded images and CLIP features, shared by all of them."""
    return Path(as_str(environment(), "cache-dir") or Path.home() / ".cache" / "starfed")


def simulated_site_dir(run_folder: Path, partition: int) -> Path:
    """The folder of simulated site ``partition`` in a simulation's run folder: its ``data``
    folder (written by the simulation) and its ``state`` folder. The site is named after it."""
    return run_folder / "sites" / f"site-{partition}"


def site_for(run_id: int, node_id: int, run_config: dict, node_config: dict) -> Site:
    """The site of this node in this run (built once per process; backbones cached too).

    Run and node config are checked against the schema (``starfed.shared.config``) first.
    """
    key = SiteKey.of(run_id, node_id, run_config, node_config)
    return SITES.get(key, lambda: _build_site(run_id, node_id, run_config, node_config))


def _build_site(run_id: int, node_id: int, run_config: dict, node_config: dict) -> Site:
    """A site from the configs: a configured site's folders, or a simulated node's."""
    values, node = parse(run_config), parse(node_config, "node-config")
    device = as_str(node, "device") or as_str(values, "device")
    backbones = BackboneOptions.from_config(values).load(device)
    if node["data-dir"]:
        name = as_str(node, "site-name") or f"node-{node_id}"
        data_dir = Path(as_str(node, "data-dir"))
        state_dir = Path(as_str(node, "state-dir") or data_dir / ".starfed")
        cache_dir = Path(as_str(node, "cache-dir") or state_dir / "cache")
    elif "partition-id" in node_config:
        root = simulated_site_dir(run_dir(values, run_id), as_int(node, "partition-id"))
        name, data_dir, state_dir = root.name, root / "data", root / "state"
        cache_dir = Path(as_str(node, "cache-dir") or default_cache_dir())
    else:
        raise NoDataError(
            "this SuperNode has no data folder: start it with `starfed site start --data "
            "DIR` (node config data-dir), so it never trains on data it was not given"
        )
    memory = SiteMemory(state_dir, backbones.fingerprint, backbones.dims)
    config = TrainConfig.from_config(values)
    privacy = PrivacySetting.of(values, node)
    policy = read_policy(None, state_dir)
    return Site(name, data_dir, memory, backbones, config, cache_dir, privacy, policy)


@dataclass(frozen=True)
class Incoming:
    """One message as the site reads it: its header converted once, where it enters (a bad
    value raises here, which Flower turns into an error reply), then trusted."""

    asks: Phase | parts.Label  # a phase's work, or a catch-up part to stage
    step: int
    round: int
    federation: str
    epoch: str  # the lineage's epoch: read by the sync and a catch-up part, "" otherwise
    wire_dtype: str
    travelling: tuple[Phase, ...] = ()  # the phases whose updates the reply carries too
    frozen: tuple[str, ...] = ()  # the sync's
    class_steps: tuple[int, ...] = ()  # the evaluation's
    classify_with_keys: bool = False  # the evaluation's

    @classmethod
    def of(cls, key: str, config: dict) -> Incoming:
        """The message of ``key`` (a phase's key, or ``CATCH_UP_KEY``) with ``config``."""
        asks: Phase | parts.Label
        if key == CATCH_UP_KEY:
            asks = parts.Label.of(config)
        else:
            asks = Phase[key.upper()]
        travelling = tuple(Phase[str(k).upper()] for k in config.get(TRAVELLING, []))
        evaluates = Phase.EVALUATE in (asks, *travelling)
        return cls(
            asks,
            int(config[STEP]),
            int(config.get(ROUND, 0)),
            str(config[FEDERATION_KEY]),
            str(config[EPOCH_KEY]) if asks is Phase.SYNC or key == CATCH_UP_KEY else "",
            str(config.get(WIRE_DTYPE, "float32")),
            travelling,
            tuple(str(name) for name in config.get(FROZEN, [])),
            tuple(int(s) for s in config[CLASS_STEPS]) if evaluates else (),
            bool(config.get(CLASSIFY_WITH_KEYS, False)),
        )

    @property
    def key(self) -> str:
        """Its one spelling in the site's release record: the phase's key, or the catch-up's."""
        return CATCH_UP_KEY if isinstance(self.asks, parts.Label) else self.asks.key


def answer(header: dict[str, Any], payload: bytes) -> list[tuple[str, bytes]]:
    """The reply to one message: its records as (name, bytes) — an update, the site's report,
    or for a catch-up part the version it holds — then the update of each phase that travels
    with it (``TRAVELLING``), named by its key. The site's gate admits the message before
    anything is computed and records the reply before it is sent
    (``starfed.client.release_gate``).

    ``header`` holds the message's key (``phase``: a phase's, or the catch-up's), its config
    and the run's and node's configs; ``payload`` the codebook the message carries (or a part
    of one, or nothing).
    """
    message = Incoming.of(header["phase"], header["config"])
    asks = message.asks
    site = site_for(
        header["run-id"], header["node-id"], header["run-config"], header["node-config"]
    )
    request = release_gate.Request(
        int(header["run-id"]),
        message.step,
        message.key,
        message.round,
        message.federation,
        message.wire_dtype,
        () if isinstance(asks, parts.Label) else releases_of(asks, message.travelling),
        server_certificate(site.memory.root),
    )
    release_gate.admit(site, request)
    if isinstance(asks, parts.Label):
        records, version = _catch_up(site, message, asks, payload)
    elif asks is Phase.SYNC and Phase.EVALUATE in message.travelling:
        evaluation, version = _travelling_evaluation(site, message, request, payload)
        records = [*_reply(site, message, asks, b"")[0], evaluation]
    else:
        records, version = _reply(site, message, asks, payload)
    return release_gate.release(site, request, records, version)


def _travelling_evaluation(
    site: Site, message: Incoming, sync: release_gate.Request, payload: bytes
) -> tuple[Outgoing, int]:
    """The previous step's evaluation, travelling with a sync: the report of the codebook the
    sync carries, made before the sync's own answer (which then says this codebook is held),
    or, when the site's policy withholds evaluations, the refusal (recorded as the site's
    refusal of an ``evaluate``; the sync is still answered)."""
    key = Phase.EVALUATE.key
    request = replace(sync, phase=key, releases=releases_of(Phase.EVALUATE, ()))
    reason = release_gate.refused(site, request)
    if reason is not None:
        return Outgoing(EVALUATION_REFUSED, f"{POLICY_REFUSED}: {reason}".encode()), 0
    reply, version = _reply(site, message, Phase.EVALUATE, payload)
    (report,) = reply
    return replace(report, name=key), version


def _catch_up(
    site: Site, message: Incoming, part: parts.Label, payload: bytes
) -> tuple[list[Outgoing], int]:
    """A part of a codebook too large for one message, staged; the reply says the version the
    site holds after it (0 until every part is staged) and the version each part is staged
    at."""
    site.memory.join(message.federation)
    staged = site.memory.catch_up(payload, part, message.step, message.wire_dtype)
    version = str(site.memory.held_version(message.epoch)).encode()
    return [Outgoing(HELD, version), Outgoing(STAGED, staged)], 0


def _reply(
    site: Site, message: Incoming, phase: Phase, payload: bytes
) -> tuple[list[Outgoing], int]:
    """A phase's reply records, and the version of the codebook the message carried (0:
    none)."""
    if phase is Phase.SYNC:
        site.memory.held.drop_idle_staging(message.step)  # a catch-up gone quiet is abandoned
        update = site.sync(message.step, list(message.frozen), message.federation, message.epoch)
        return [_update(UPDATE_RECORD, update, message.wire_dtype, (COUNTS,))], 0
    site.memory.join(message.federation)
    codebook = site.memory.receive(payload)
    if phase is Phase.EVALUATE:
        steps = list(message.class_steps)
        report = site.evaluate(codebook, steps, message.classify_with_keys)
        scored = tuple(score.name for score in report.classes)
        fields = (EVALUATION,) if scored else ()
        return [Outgoing(REPORT_RECORD, report.to_bytes(), scored, fields)], codebook.version
    update = site.run_phase(phase, codebook, message.step, message.round)
    records = [_update(UPDATE_RECORD, update, message.wire_dtype)]
    for other_phase in message.travelling:
        other = site.run_phase(other_phase, codebook, message.step)
        records.append(_update(other.phase.key, other, message.wire_dtype))
    return records, codebook.version


def _update(
    name: str, update: ClientUpdate, wire_dtype: str, fields: tuple[str, ...] = ()
) -> Outgoing:
    """An update as it leaves: its bytes, its classes and the fields it carries."""
    names = tuple(entry.name for entry in update.entries)
    carried = fields or schema.trained_in(update.phase)
    return Outgoing(name, wire.encode(update, wire_dtype), names, carried if names else ())
