"""The Flower ClientApp: a handler for each phase of the protocol table, delegating to ``Site``.

Message contents (``RecordDict``):

* in: ``config`` (ConfigRecord: ``step``, ``round``, ``wire-dtype``) and, where the phase sends
  it, ``codebook`` (ConfigRecord ``data``: the serialised codebook the phase starts from);
* out: ``update`` (ConfigRecord ``data``: a serialised ``ClientUpdate``, for sync the classes the
  site holds now) or, for evaluation, ``metrics`` (MetricRecord).

Anything decoded is validated against this site's backbones; a bad codebook raises, which
Flower turns into an error reply the server logs. Raw images and features never leave.
"""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import DEFAULT_ACTION

from starfed.client.site import Site
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.protocol import PHASES, Phase, PhaseSpec
from starfed.shared.run_config import BackboneOptions, get, train_config

app = ClientApp()

_SITES: dict[tuple[int, int], Site] = {}


def default_cache_dir() -> Path:
    return Path(os.environ.get("STARFED_CACHE_DIR", Path.home() / ".cache" / "starfed"))


def site_for(context: Context) -> Site:
    """The site of this node in this run (built once per process; backbones cached too).

    In simulation the node config gives ``partition-id``/``num-partitions``; a deployed site
    gives ``data-root`` (its own images, all of them this site's) and optionally ``cache-dir``.
    """
    key = (context.run_id, context.node_id)
    if key not in _SITES:
        run_config, node_config = context.run_config, context.node_config
        if "data-root" in node_config:
            partition = 0
            site_keys = {"data-root": node_config["data-root"], "num-clients": 1}
        else:
            partition = get(node_config, "partition-id", int, 0)
            clients = get(node_config, "num-partitions", int, run_config.get("num-clients", 1))
            site_keys = {"num-clients": clients}
        scenario_config = ScenarioConfig.from_run_config({**run_config, **site_keys})
        cache_dir = Path(get(node_config, "cache-dir", str, "") or default_cache_dir())
        _SITES[key] = Site(
            Scenario(scenario_config),
            partition,
            BackboneOptions.from_run_config(run_config).load(),
            train_config(run_config),
            cache_dir,
        )
    return _SITES[key]


def _step_and_round(message: Message) -> tuple[int, int]:
    config = message.content["config"]
    return int(config["step"]), int(config.get("round", 0))


def _codebook(message: Message, site: Site) -> Codebook:
    data = message.content["codebook"]["data"]
    return Codebook.from_bytes(data, fingerprint=site.fingerprint, dims=site.backbones.dims)


def _answer(phase: Phase, message: Message, context: Context) -> Message:
    """The reply to one phase's message: an update, or for evaluation the site's scores."""
    site = site_for(context)
    step, round_index = _step_and_round(message)
    if phase is Phase.EVALUATE:
        return Message(
            RecordDict({"metrics": _scores(site, _codebook(message, site), step)}), reply_to=message
        )
    if phase is Phase.SYNC:
        update = site.sync(step)
    else:
        update = site.run_phase(phase, _codebook(message, site), step, round_index)
    wire = str(message.content["config"].get("wire-dtype", "float32"))
    content = RecordDict({"update": ConfigRecord({"data": update.to_bytes(wire)})})
    return Message(content, reply_to=message)


def _scores(site: Site, codebook: Codebook, step: int) -> MetricRecord:
    """Accuracy on this site's test images of every task it has seen."""
    scores = site.evaluate(codebook, step)
    if scores is None:
        return MetricRecord({"task": -1})
    return MetricRecord(
        {
            "task": len(scores.accuracy) - 1,
            "accuracy": scores.accuracy,
            "selection-accuracy": scores.selection_accuracy,
        }
    )


def _register(spec: PhaseSpec) -> None:
    """Route the phase's Flower message type ("<category>[.<action>]") to ``_answer``."""
    category, _, action = spec.message_type.partition(".")

    def handler(message: Message, context: Context) -> Message:
        return _answer(spec.phase, message, context)

    getattr(app, category)(action or DEFAULT_ACTION)(handler)


for _spec in PHASES:
    _register(_spec)
