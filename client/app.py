"""The Flower ClientApp: a handler for each message of the protocol table, answered by the site.

A thin adapter: each Flower message becomes a header and the codebook bytes, answered by
``starfed.client.answer`` in this process, or by the site's worker (``starfed.client.worker``)
when the node config names one (``worker-socket``); this process then never imports torch.
Which folders a node's site reads is ``answer``'s (``data-dir``, or a simulated node's folders).

Message contents (``RecordDict``):

* in: ``config`` (ConfigRecord: ``step``, ``round``, ``wire-dtype``, ``federation``; for sync
  the ``frozen`` class names, for evaluation the ``class-steps``, for the last stage-1 round
  ``also``) and, where the phase sends it, ``codebook`` (ConfigRecord ``data``: the codebook,
  or a delta from the one the site holds);
* out: ``update`` (ConfigRecord ``data``: a serialised ``ClientUpdate``, for sync the classes
  of the site's current task) or, for evaluation, ``report`` (an ``EvaluationReport``); when
  the config names phases that travel with this one (``also``), one more update record per
  phase, named by its key (``stage1_stats``);
* a catch-up part (``CATCH_UP_MESSAGE``, ``query.catch_up``: its own message type) carries one
  part of a codebook too large for one message, its config's ``catch-up`` saying which; out:
  ``held`` (the codebook version the site holds after it).

Anything decoded is validated against this site's backbones; a bad codebook raises, which
Flower turns into an error reply the server logs. Raw images and features never leave.
"""

from __future__ import annotations

import functools
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from starfed.client.worker import request
from starfed.shared.config import parse
from starfed.shared.knob import as_str
from starfed.shared.protocol import (
    CATCH_UP_KEY,
    CATCH_UP_MESSAGE,
    CODEBOOK_RECORD,
    CONFIG_RECORD,
    MESSAGES,
    RECORD_DATA,
    record_bytes,
)

app = ClientApp()


def _handle(key: str, message: Message, context: Context) -> Message:
    """A Flower message answered here, or by the site's worker when the node config names one;
    ``key``: what it is (a phase's key, or the catch-up's)."""
    header = {
        "phase": key,
        "config": dict(message.content[CONFIG_RECORD]),
        "run-config": dict(context.run_config),
        "node-config": dict(context.node_config),
        "run-id": context.run_id,
        "node-id": context.node_id,
    }
    content = message.content
    payload = (
        record_bytes(content[CODEBOOK_RECORD][RECORD_DATA], CODEBOOK_RECORD)
        if CODEBOOK_RECORD in content
        else b""
    )
    worker = _worker_socket(frozenset(context.node_config.items()))
    if worker:
        records = request(worker, header, payload)
    else:
        # Imported here, not above, to keep a forwarding ClientApp light: it never needs the
        # site code (torch, the backbones). Not a cycle: ``answer`` imports nothing from here.
        from starfed.client.answer import answer

        records = answer(header, payload)
    content = RecordDict({name: ConfigRecord({RECORD_DATA: data}) for name, data in records})
    return Message(content, reply_to=message)


@functools.cache
def _worker_socket(node_config: frozenset[tuple[str, Any]]) -> str:
    """The node config's ``worker-socket``, the config parsed (= checked) once per node config
    in a process: Flower 1.42's deployed ``flwr-clientapp`` process answers one message, but a
    simulation's process answers many nodes', each with its own node config (``partition-id``),
    so the parse is kept by the config, not once for the process. A bad config is not kept: it
    raises on every message."""
    return as_str(parse(dict(node_config), "node-config"), "worker-socket")


def _register(message_type: str, key: str) -> None:
    """Route the Flower message type ("<category>[.<action>]") to ``_handle``, as ``key``."""
    category, _, action = message_type.partition(".")

    def handler(message: Message, context: Context) -> Message:
        return _handle(key, message, context)

    register = getattr(app, category)
    (register(action) if action else register())(handler)


for _spec in MESSAGES:
    _register(_spec.message_type, _spec.phase.key)
_register(CATCH_UP_MESSAGE, CATCH_UP_KEY)
