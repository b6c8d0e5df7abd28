"""The fleet-only gateway: what it forwards, what it refuses, and how it fails.

In-process: the gateway (an ASGI app) is driven through ``httpx.ASGITransport`` and its upstream
is an ``httpx.MockTransport`` that records what arrives, so every case runs in milliseconds.
The e2e test (test_deploy_e2e.py) runs it as a real TLS process in front of a real SuperLink.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from starfed.server.ops.gateway import FleetGateway, allowed

UPSTREAM = "https://127.0.0.1:9093"


class Upstream:
    """A fake SuperLink: records requests, answers with a fixed protobuf-ish reply."""

    def __init__(self, status: int = 200, fail: Exception | None = None) -> None:
        self.requests: list[httpx.Request] = []
        self.status = status
        self.fail = fail

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        return httpx.Response(  # a stream, as from the network (not yet read)
            self.status,
            stream=httpx.ByteStream(b"\x08\x01reply"),
            headers={"content-type": "application/protobuf", "x-upstream": "yes"},
        )


def _call(
    upstream: Upstream, method: str, path: str, max_body: int = 1024, **kwargs
) -> httpx.Response:
    async def go() -> httpx.Response:
        gateway = FleetGateway(UPSTREAM, max_body=max_body, transport=httpx.MockTransport(upstream))
        transport = httpx.ASGITransport(app=gateway, client=("198.51.100.9", 4711))
        async with httpx.AsyncClient(transport=transport, base_url="https://gw") as client:
            try:
                return await client.request(method, path, **kwargs)
            finally:
                await gateway.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/control/list-runs"),
        ("POST", "/v1/control/register-node"),
        ("POST", "/v1/control/start-run"),
        ("POST", "/v1/runtime/acquire-task"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("GET", "/health"),
        ("GET", "/v1/fleet/pull-messages"),  # fleet, but not POST
        ("PUT", "/v1/fleet/push-messages"),
        ("POST", "/v1/fleet/"),
        ("POST", "/v1/fleet/../control/list-runs"),
        ("POST", "/v1/fleet/%2e%2e/control/list-runs"),
        ("POST", "/v1/fleet/pull-messages/../../control/list-runs"),
        ("POST", "/v1/fleet//control"),
        ("POST", "/V1/FLEET/PULL-MESSAGES"),
        ("POST", "/"),
    ],
)
def test_everything_but_fleet_posts_is_refused(method: str, path: str) -> None:
    upstream = Upstream()
    response = _call(upstream, method, path, content=b"")
    assert response.status_code == 403
    assert upstream.requests == []


def test_percent_escapes_never_pass_even_when_they_decode_to_a_fleet_path() -> None:
    assert allowed("POST", "/v1/fleet/pull-messages", b"/v1/fleet/pull-messages")
    assert not allowed("POST", "/v1/fleet/pull-messages", b"/v1/fleet/pull%2Dmessages")
    assert not allowed("POST", "/v1/fleet/pull-messages", b"/v1/%66leet/pull-messages")


def test_fleet_posts_are_forwarded_with_body_and_headers() -> None:
    upstream = Upstream(status=412)  # Flower's answer for an unregistered key
    response = _call(
        upstream,
        "POST",
        "/v1/fleet/activate-node?x=1",
        content=b"\x0a\x03key",
        headers={
            "content-type": "application/protobuf",
            "x-flwr-public-key": "abc",
            "x-forwarded-for": "10.0.0.1",  # a client's claim: replaced, not trusted
            "connection": "keep-alive",
        },
    )
    assert response.status_code == 412
    assert response.content == b"\x08\x01reply"
    assert response.headers["x-upstream"] == "yes"
    (request,) = upstream.requests
    assert str(request.url) == f"{UPSTREAM}/v1/fleet/activate-node"  # no query string
    assert request.content == b"\x0a\x03key"
    assert request.headers["x-flwr-public-key"] == "abc"
    assert request.headers["x-forwarded-for"] == "198.51.100.9"
    assert request.headers["x-forwarded-proto"] == "https"
    assert request.headers["host"] == "127.0.0.1:9093"
    assert request.headers["content-length"] == "5"


def test_bodies_over_the_limit_get_413_and_are_not_forwarded() -> None:
    upstream = Upstream()
    declared = _call(upstream, "POST", "/v1/fleet/push-object", max_body=16, content=b"x" * 17)
    assert declared.status_code == 413
    assert _call(upstream, "POST", "/v1/fleet/push-object", max_body=17, content=b"x" * 17)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
        for _ in range(4):
            yield b"y" * 8

    upstream = Upstream()
    streamed = _call(upstream, "POST", "/v1/fleet/push-object", max_body=16, content=chunks())
    assert streamed.status_code == 413


def test_garbage_content_length_is_a_bad_request() -> None:
    upstream = Upstream()
    response = _call(
        upstream, "POST", "/v1/fleet/push-object", content=b"x", headers={"content-length": "x1"}
    )
    assert response.status_code == 400
    assert upstream.requests == []


def test_upstream_down_or_slow_gives_502_or_504() -> None:
    down = Upstream(fail=httpx.ConnectError("refused"))
    assert _call(down, "POST", "/v1/fleet/pull-messages", content=b"").status_code == 502
    slow = Upstream(fail=httpx.ReadTimeout("slow"))
    assert _call(slow, "POST", "/v1/fleet/pull-messages", content=b"").status_code == 504
