"""What one phase's exchange records and logs of a reply that failed, one missing and one that
came: statuses without Flower's doubled "Error:", sites named as the step's record names them."""

from __future__ import annotations

import logging
import uuid

import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.server.superlink.linkstate.utils import NODE_UNAVAILABLE_ERROR_REASON

from starfed.ops.flower_internals import SUPERLINK_NODE_ID, TaskIdentity
from starfed.server import messaging
from starfed.shared.protocol import PHASES


@pytest.fixture(autouse=True)
def serverapp_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Flower sets in a ServerApp's process before messages can be made (as LocalGrid)."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)


class Grid:
    """Answers node 7 with Flower's "node unavailable" error, node 8 not at all, node 9."""

    def send_and_receive(self, messages: list[Message], timeout: float) -> list[Message]:
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as a grid's push does
            node = message.metadata.dst_node_id
            if node == 7:
                error = Error(ErrorCode.NODE_UNAVAILABLE, NODE_UNAVAILABLE_ERROR_REASON)
                replies.append(Message(error, reply_to=message))
            elif node == 9:
                content = RecordDict({"update": ConfigRecord({"data": b"xyz"})})
                replies.append(Message(content, reply_to=message))
        return replies


def test_failed_and_missing_replies_are_recorded_and_logged_by_site_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = PHASES[0]
    with caplog.at_level(logging.WARNING, logger=messaging.__name__):
        good, exchanges = messaging.exchange(
            Grid(),
            spec.message_type,
            spec.phase.key,
            0,
            0,
            {},
            [7, 8, 9],
            {7: "farm-a", 9: "farm-c"},
            None,
            1.0,
        )
    assert [entry.site for entry, _ in good] == ["farm-c"]
    statuses = {entry.node_id: str(entry.status) for entry in exchanges}
    assert statuses == {
        7: "error: Node Unavailable — The destination node failed to report a heartbeat "
        "within 2 × its expected interval.",
        8: "no reply",
        9: "ok",
    }
    logged = [record.getMessage() for record in caplog.records]
    assert logged[0].startswith(f"farm-a failed {spec.phase.key}: Error: Node Unavailable")
    assert logged[1] == f"node-8 sent no {spec.phase.key} reply within 1s"  # no name told yet


@pytest.mark.parametrize(
    ("reason", "short"),
    [
        ("Error: Message Unavailable - expired", "Message Unavailable - expired"),
        ("ERROR:  boom", "boom"),
        (
            "Traceback ...\n  File x\nValueError: bad\nException Message: it broke",
            "Exception Message: it broke",
        ),
        ("an error: inside", "an error: inside"),
        (None, ""),
    ],
)
def test_short_reason_is_the_informative_line_without_an_error_prefix(
    reason: str | None, short: str
) -> None:
    assert messaging.short_reason(reason) == short
