"""The Flower ClientApp: a handler for each phase of the protocol table, delegating to ``Site``.

A node is a site when its node config names its folders (``data-dir``, ``state-dir``, and
``site-name``; ``starfed site start`` writes them); in a simulation (``partition-id``) the
scenario fills a data folder per simulated site inside the run folder, which the same site code
then reads. A node with neither refuses every message: it must not train on data it was never
given.

Message contents (``RecordDict``):

* in: ``config`` (ConfigRecord: ``step``, ``round``, ``wire-dtype``, ``federation``; for sync
  the ``frozen`` class names, for evaluation the ``class-steps``) and, where the phase sends it,
  ``codebook`` (ConfigRecord ``data``: the codebook, or a delta from the one the site holds);
* out: ``update`` (ConfigRecord ``data``: a serialised ``ClientUpdate``, for sync the classes
  of the site's current task) or, for evaluation, ``report`` (an ``EvaluationReport``).

Anything decoded is validated against this site's backbones; a bad codebook raises, which
Flower turns into an error reply the server logs. Raw images and features never leave.
"""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import DEFAULT_ACTION

from starfed.client.memory import SiteMemory
from starfed.client.site import Site
from starfed.shared.config import BackboneOptions, parse, run_dir
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import PHASES, Phase, PhaseSpec

app = ClientApp()

_SITES: dict[tuple[int, int], Site] = {}


class NoDataError(RuntimeError):
    """A node that is neither a configured site nor a simulated one."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("STARFED_CACHE_DIR", Path.home() / ".cache" / "starfed"))


def site_for(context: Context) -> Site:
    """The site of this node in this run (built once per process; backbones cached too).

    Run and node config are checked against the schema (``starfed.shared.config``) first.
    """
    key = (context.run_id, context.node_id)
    if key not in _SITES:
        values, node = parse(context.run_config), parse(context.node_config, "node-config")
        backbones = BackboneOptions.from_config(values).load()
        before_scan = None
        if node["data-dir"]:
            name = node["site-name"] or f"node-{context.node_id}"
            data_dir = Path(node["data-dir"])
            state_dir = Path(node["state-dir"] or data_dir / ".starfed")
            cache_dir = Path(node["cache-dir"] or state_dir / "cache")
        elif "partition-id" in context.node_config:
            partition = node["partition-id"]
            clients = node["num-partitions"] or values["num-clients"]
            scenario = Scenario(ScenarioConfig.from_config({**values, "num-clients": clients}))
            name = f"site-{partition}"
            root = run_dir(values, context.run_id) / "sites" / name
            data_dir, state_dir = root / "data", root / "state"
            cache_dir = Path(node["cache-dir"] or default_cache_dir())

            def before_scan(step: int) -> None:
                scenario.write_site(partition, data_dir, step)

        else:
            raise NoDataError(
                "this SuperNode has no data folder: start it with `starfed site start --data "
                "DIR` (node config data-dir), so it never trains on data it was not given"
            )
        memory = SiteMemory(state_dir, backbones.fingerprint, backbones.dims)
        _SITES[key] = Site(
            name, data_dir, memory, backbones, TrainConfig.from_config(values), cache_dir,
            before_scan,
        )
    return _SITES[key]


def _answer(phase: Phase, message: Message, context: Context) -> Message:
    """The reply to one phase's message: an update, or for evaluation the site's report."""
    site = site_for(context)
    config = message.content["config"]
    step, round_index = int(config["step"]), int(config.get("round", 0))
    federation = str(config["federation"])
    if phase is Phase.SYNC:
        frozen = [str(name) for name in config.get("frozen", [])]
        update = site.sync(step, frozen, federation, str(config["epoch"]))
    else:
        site.memory.join(federation)
        codebook = site.memory.receive(message.content["codebook"]["data"])
        if phase is Phase.EVALUATE:
            report = site.evaluate(codebook, [int(s) for s in config["class-steps"]])
            content = RecordDict({"report": ConfigRecord({"data": report.to_bytes()})})
            return Message(content, reply_to=message)
        update = site.run_phase(phase, codebook, step, round_index)
    wire = str(config.get("wire-dtype", "float32"))
    content = RecordDict({"update": ConfigRecord({"data": update.to_bytes(wire)})})
    return Message(content, reply_to=message)


def _register(spec: PhaseSpec) -> None:
    """Route the phase's Flower message type ("<category>[.<action>]") to ``_answer``."""
    category, _, action = spec.message_type.partition(".")

    def handler(message: Message, context: Context) -> Message:
        return _answer(spec.phase, message, context)

    getattr(app, category)(action or DEFAULT_ACTION)(handler)


for _spec in PHASES:
    _register(_spec)
