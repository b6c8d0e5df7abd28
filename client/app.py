"""The Flower ClientApp: one typed handler per protocol phase, all delegating to ``Site``.

Message contents (``RecordDict``):

* in: ``config`` (ConfigRecord: ``step``, ``round``) and, except for sync, ``codebook``
  (ConfigRecord ``data``: the serialised codebook the phase starts from);
* out: ``sync`` (classes and counts the site holds now, their positions in the class order —
  which fixes the server's registration order —, its backbone fingerprint), ``update``
  (ConfigRecord ``data``: a serialised ``ClientUpdate``) or ``metrics`` (MetricRecord).

Anything decoded is validated against this site's backbones; a bad codebook raises, which
Flower turns into an error reply the server logs. Raw images and features never leave.
"""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from starfed.client.site import Site
from starfed.shared.codebook.codebook import Codebook, Phase
from starfed.shared.config import BackboneOptions, parse
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.model.training import TrainConfig

app = ClientApp()

_SITES: dict[tuple[int, int], Site] = {}


def default_cache_dir() -> Path:
    return Path(os.environ.get("STARFED_CACHE_DIR", Path.home() / ".cache" / "starfed"))


def site_for(context: Context) -> Site:
    """The site of this node in this run (built once per process; backbones cached too).

    In simulation the node config gives ``partition-id``/``num-partitions``; a deployed site
    gives ``data-root`` (its own images, all of them this site's) and optionally ``cache-dir``.
    Both configs are checked against the schema (``starfed.shared.config``) first.
    """
    key = (context.run_id, context.node_id)
    if key not in _SITES:
        values, node = parse(context.run_config), parse(context.node_config, "node-config")
        if node["data-root"]:
            partition = 0
            site_values = {**values, "data-root": node["data-root"], "num-clients": 1}
        else:
            partition = node["partition-id"]
            site_values = {**values, "num-clients": node["num-partitions"] or values["num-clients"]}
        scenario_config = ScenarioConfig.from_config(site_values)
        cache_dir = Path(node["cache-dir"] or default_cache_dir())
        _SITES[key] = Site(
            Scenario(scenario_config),
            partition,
            BackboneOptions.from_config(values).load(),
            TrainConfig.from_config(values),
            cache_dir,
        )
    return _SITES[key]


def _step_and_round(message: Message) -> tuple[int, int]:
    config = message.content["config"]
    return int(config["step"]), int(config.get("round", 0))


def _codebook(message: Message, site: Site) -> Codebook:
    data = message.content["codebook"]["data"]
    return Codebook.from_bytes(data, fingerprint=site.fingerprint, dims=site.backbones.dims)


def _update_reply(message: Message, context: Context, phase: Phase) -> Message:
    site = site_for(context)
    step, round_index = _step_and_round(message)
    update = site.run_phase(phase, _codebook(message, site), step, round_index)
    wire = str(message.content["config"].get("wire-dtype", "float32"))
    content = RecordDict({"update": ConfigRecord({"data": update.to_bytes(wire)})})
    return Message(content, reply_to=message)


@app.query("sync")
def sync(message: Message, context: Context) -> Message:
    """Report the classes this site holds at the step (its task stream decides)."""
    site = site_for(context)
    step, _ = _step_and_round(message)
    counts = site.class_counts(step)
    task = site.task_at(step)
    record = ConfigRecord(
        {
            "classes": list(counts),
            "counts": list(counts.values()),
            "labels": [site.scenario.split.class_folders.index(name) for name in counts],
            "fingerprint": site.fingerprint,
            "task": -1 if task is None else task,
        }
    )
    return Message(RecordDict({"sync": record}), reply_to=message)


@app.train("stage1")
def train_stage1(message: Message, context: Context) -> Message:
    return _update_reply(message, context, Phase.STAGE1)


@app.query("stage1_stats")
def stage1_stats(message: Message, context: Context) -> Message:
    return _update_reply(message, context, Phase.STAGE1_STATS)


@app.train("stage2")
def train_stage2(message: Message, context: Context) -> Message:
    return _update_reply(message, context, Phase.STAGE2)


@app.query("stage2_stats")
def stage2_stats(message: Message, context: Context) -> Message:
    return _update_reply(message, context, Phase.STAGE2_STATS)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Accuracy on this site's test images of every task it has seen."""
    site = site_for(context)
    step, _ = _step_and_round(message)
    scores = site.evaluate(_codebook(message, site), step)
    record = MetricRecord({"task": -1})
    if scores is not None:
        record = MetricRecord(
            {
                "task": len(scores.accuracy) - 1,
                "accuracy": scores.accuracy,
                "selection-accuracy": scores.selection_accuracy,
            }
        )
    return Message(RecordDict({"metrics": record}), reply_to=message)
