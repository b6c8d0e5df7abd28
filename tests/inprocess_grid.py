"""An in-process Flower grid: the real ServerApp logic talks to real ClientApp handlers.

Each node is a (ClientApp, Context) pair; ``send_and_receive`` calls the app like Flower's
runtime does and turns an exception into an error reply. ``faults`` lets a test make a node
silent, raise, or tamper with its replies for one message type.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from starfed.shared.codebook.codebook import Codebook, Delta
from starfed.shared.codebook.wire import decode_broadcast

Fault = Callable[[Message], Message | None]  # gets the reply; None = the node stays silent


@dataclass
class InProcessGrid:
    app: ClientApp
    run_config: dict
    node_configs: dict[int, dict]
    run_id: int = 1
    faults: dict[tuple[int, str], Fault] = field(default_factory=dict)
    sent: list[Message] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Flower's runtime sets the identity of the ServerApp process; messages need it.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = self.run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_configs)

    def codebooks_sent(self) -> dict[str, Codebook]:
        """The codebook each sent message carried, keyed by message id: deltas are applied to
        what the same node was sent before, as the site does."""
        held: dict[int, Codebook] = {}
        out = {}
        for message in self.sent:
            if "codebook" not in message.content:
                continue
            node = message.metadata.dst_node_id
            received = decode_broadcast(message.content["codebook"]["data"])
            if isinstance(received, Delta):
                received = held[node].apply(received)
            held[node] = out[message.metadata.message_id] = received
        return out

    def _context(self, node_id: int) -> Context:
        return Context(
            run_id=self.run_id,
            node_id=node_id,
            node_config=self.node_configs[node_id],
            state=RecordDict(),
            run_config=self.run_config,
        )

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        assert timeout is not None, "every send needs a timeout"
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.sent.append(message)
            node = message.metadata.dst_node_id
            try:
                reply = self.app(message, self._context(node))
            except Exception as err:  # the runtime reports client failures as error replies
                reply = Message(
                    Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message
                )
            reply.metadata.__dict__["_src_node_id"] = node
            fault = self.faults.get((node, message.metadata.message_type))
            if fault is not None:
                reply = fault(reply)
            if reply is not None:
                replies.append(reply)
        return replies
