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
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import DEFAULT_ACTION

from starfed.client.worker import request
from starfed.shared.config import parse, run_dir
from starfed.shared.protocol import PHASES, Phase, PhaseSpec

if TYPE_CHECKING:  # the site code imports torch: only where a message is answered
    from starfed.client.site import Site

app = ClientApp()

_SITES: dict[tuple[int, int], Site] = {}


class NoDataError(RuntimeError):
    """A node that is neither a configured site nor a simulated one."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("STARFED_CACHE_DIR", Path.home() / ".cache" / "starfed"))


def site_for(run_id: int, node_id: int, run_config: dict, node_config: dict) -> Site:
    """The site of this node in this run (built once per process; backbones cached too).

    Run and node config are checked against the schema (``starfed.shared.config``) first.
    """
    from starfed.client.memory import SiteMemory
    from starfed.client.site import Site
    from starfed.shared.config import BackboneOptions
    from starfed.shared.data.scenario import ScenarioConfig, shared_scenario
    from starfed.shared.model.training import TrainConfig

    key = (run_id, node_id)
    if key not in _SITES:
        values, node = parse(run_config), parse(node_config, "node-config")
        backbones = BackboneOptions.from_config(values).load(node["device"] or values["device"])
        before_scan = None
        if node["data-dir"]:
            name = node["site-name"] or f"node-{node_id}"
            data_dir = Path(node["data-dir"])
            state_dir = Path(node["state-dir"] or data_dir / ".starfed")
            cache_dir = Path(node["cache-dir"] or state_dir / "cache")
        elif "partition-id" in node_config:
            partition = node["partition-id"]
            clients = node["num-partitions"] or values["num-clients"]
            scenario = shared_scenario(
                ScenarioConfig.from_config({**values, "num-clients": clients})
            )
            name = f"site-{partition}"
            root = run_dir(values, run_id) / "sites" / name
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
        )  # fmt: skip
    return _SITES[key]


def answer(header: dict[str, Any], payload: bytes) -> tuple[str, bytes]:
    """The reply to one message: (record name, bytes) — an update, or the site's report.

    ``header`` holds the phase, the message's config and the run's and node's configs;
    ``payload`` the codebook the message carries (or nothing). A ClientApp process and a site
    worker (``starfed.client.worker``) both answer through here.
    """
    phase = Phase[header["phase"].upper()]
    config = header["config"]
    site = site_for(header["run-id"], header["node-id"], header["run-config"],
                    header["node-config"])  # fmt: skip
    step, round_index = int(config["step"]), int(config.get("round", 0))
    federation = str(config["federation"])
    if phase is Phase.SYNC:
        frozen = [str(name) for name in config.get("frozen", [])]
        update = site.sync(step, frozen, federation, str(config["epoch"]))
    else:
        site.memory.join(federation)
        codebook = site.memory.receive(payload)
        if phase is Phase.EVALUATE:
            report = site.evaluate(codebook, [int(s) for s in config["class-steps"]])
            return "report", report.to_bytes()
        update = site.run_phase(phase, codebook, step, round_index)
    return "update", update.to_bytes(str(config.get("wire-dtype", "float32")))


def _handle(phase: Phase, message: Message, context: Context) -> Message:
    """A Flower message answered here, or by the site's worker when the node config names one."""
    header = {
        "phase": phase.key,
        "config": dict(message.content["config"]),
        "run-config": dict(context.run_config),
        "node-config": dict(context.node_config),
        "run-id": context.run_id,
        "node-id": context.node_id,
    }
    payload = message.content["codebook"]["data"] if "codebook" in message.content else b""
    worker = parse(context.node_config, "node-config")["worker-socket"]
    record, data = request(worker, header, payload) if worker else answer(header, payload)
    return Message(RecordDict({record: ConfigRecord({"data": data})}), reply_to=message)


def _register(spec: PhaseSpec) -> None:
    """Route the phase's Flower message type ("<category>[.<action>]") to ``_handle``."""
    category, _, action = spec.message_type.partition(".")

    def handler(message: Message, context: Context) -> Message:
        return _handle(spec.phase, message, context)

    getattr(app, category)(action or DEFAULT_ACTION)(handler)


for _spec in PHASES:
    _register(_spec)
