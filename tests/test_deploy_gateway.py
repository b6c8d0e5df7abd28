"""The fleet-only gateway: what it forwards, what it refuses, and how it fails.

In-process: the gateway (an ASGI app) is driven through ``httpx.ASGITransport`` and its upstream
is an ``httpx.MockTransport`` that records what arrives, so every case runs in milliseconds.
The e2e test (test_deploy_e2e.py) runs it as a real TLS process in front of a real SuperLink.
"""

from __future__ import annotations

import asyncio
from base64 import b64encode
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common import constant as flwr_constant
from flwr.supercore import constant as supercore_constant
from flwr.supercore.date import now as flwr_now
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

from starfed.cli.command_knobs import TABLES
from starfed.ops import pki
from starfed.server.ops import fleet_proxy, fleet_signatures
from starfed.server.ops.connection_guard import MAX_PER_ADDRESS
from starfed.server.ops.fleet_proxy import FleetGateway, allowed
from starfed.server.ops.fleet_signatures import SiteKeys
from starfed.server.ops.sites import Registry, SiteRecord
from starfed.server.ops.superlink import ServerOptions
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES

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


# --- signatures before bodies ----------------------------------------------------------------


def _flower_signed_headers(private_key: ec.EllipticCurvePrivateKey, **at: float) -> dict[str, str]:
    """The headers Flower 1.42's SuperNode adds to every Fleet call (NodeAuthHttpInterceptor),
    made with Flower's own functions; ``at`` shifts the signed time by ``seconds``."""
    timestamp = (flwr_now() + timedelta(seconds=at.get("seconds", 0.0))).isoformat()
    return {
        flwr_constant.TIMESTAMP_HEADER: timestamp,
        supercore_constant.FLEET_HTTP_PUBLIC_KEY_HEADER: b64encode(
            public_key_to_bytes(private_key.public_key())
        ).decode(),
        supercore_constant.FLEET_HTTP_SIGNATURE_HEADER: b64encode(
            sign_message(private_key, timestamp.encode("ascii"))
        ).decode(),
    }


@pytest.fixture
def registered(tmp_path: Path) -> tuple[SiteKeys, ec.EllipticCurvePrivateKey]:
    """sites.json as `starfed server sites add` writes it, with one active and one removed key."""
    key, removed = pki.new_private_key(), pki.new_private_key()
    registry = Registry(
        [
            SiteRecord("farm-a", 1, pki.describe(key.public_key()).openssh, "fp-a", "t"),
            SiteRecord("old", 2, pki.describe(removed.public_key()).openssh, "fp-o", "t", "t2"),
        ]
    )
    registry.save(tmp_path / "sites.json")
    return SiteKeys(tmp_path / "sites.json"), key


def test_gateway_header_names_and_time_window_are_flowers() -> None:
    assert fleet_signatures.PUBLIC_KEY_HEADER == supercore_constant.FLEET_HTTP_PUBLIC_KEY_HEADER
    assert fleet_signatures.SIGNATURE_HEADER == supercore_constant.FLEET_HTTP_SIGNATURE_HEADER
    assert fleet_signatures.TIMESTAMP_HEADER == flwr_constant.TIMESTAMP_HEADER
    assert fleet_signatures.MIN_AGE_S == supercore_constant.MIN_TIMESTAMP_DIFF_SECONDS
    assert fleet_signatures.MAX_AGE_S == supercore_constant.MAX_TIMESTAMP_DIFF_SECONDS


def test_the_body_limit_is_the_codebook_wire_limit_plus_an_envelope() -> None:
    assert fleet_proxy.MAX_BODY_BYTES == DEFAULT_MAX_BYTES + fleet_proxy.ENVELOPE_BYTES
    mib = fleet_proxy.MAX_BODY_BYTES >> 20
    assert mib << 20 == fleet_proxy.MAX_BODY_BYTES
    assert TABLES["server start"]["max-body-mib"].default == mib
    assert ServerOptions("0.0.0.0", 9092).max_body_mib == mib


def test_only_a_registered_key_signing_in_time_is_a_signer(registered, tmp_path: Path) -> None:
    keys, key = registered
    assert keys.signer(_flower_signed_headers(key)) == "farm-a"
    assert keys.signer(_flower_signed_headers(key, seconds=-200)) == "farm-a"
    assert keys.signer(_flower_signed_headers(key, seconds=-400)) is None  # stale
    assert keys.signer(_flower_signed_headers(key, seconds=60)) is None  # from the future
    assert keys.signer(_flower_signed_headers(pki.new_private_key())) is None  # unknown key
    assert keys.signer({}) is None
    forged = _flower_signed_headers(key)
    other = _flower_signed_headers(pki.new_private_key())
    forged[fleet_signatures.SIGNATURE_HEADER] = other[fleet_signatures.SIGNATURE_HEADER]
    assert keys.signer(forged) is None
    garbled = {**_flower_signed_headers(key), fleet_signatures.PUBLIC_KEY_HEADER: "%%%"}
    assert keys.signer(garbled) is None
    (tmp_path / "sites.json").write_text("{")  # damaged: nobody
    assert keys.signer(_flower_signed_headers(key)) is None


def test_a_removed_key_signs_nothing_and_sites_json_is_read_again(registered, tmp_path) -> None:
    keys, key = registered
    assert keys.signer(_flower_signed_headers(key)) == "farm-a"
    registry = Registry.load(tmp_path / "sites.json")
    registry.sites[0].removed_at = "now"
    registry.save(tmp_path / "sites.json")
    assert keys.signer(_flower_signed_headers(key)) is None


def _call_with_keys(keys: SiteKeys, upstream: Upstream, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        gateway = FleetGateway(
            UPSTREAM,
            max_body=1 << 20,
            site_keys=keys,
            max_unsigned_body=1024,
            transport=httpx.MockTransport(upstream),
        )
        transport = httpx.ASGITransport(app=gateway, client=("198.51.100.9", 4711))
        async with httpx.AsyncClient(transport=transport, base_url="https://gw") as client:
            try:
                return await client.post("/v1/fleet/push-object", **kwargs)
            finally:
                await gateway.aclose()

    return asyncio.run(go())


def test_unsigned_calls_get_a_small_body_and_401_past_it(registered) -> None:
    keys, _ = registered
    upstream = Upstream()
    assert _call_with_keys(keys, upstream, content=b"x" * 1024).status_code == 200
    declared = _call_with_keys(keys, upstream, content=b"x" * 1025)
    assert declared.status_code == 401
    assert b"registered site key" in declared.content

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b"y" * 512

    streamed = _call_with_keys(keys, upstream, content=chunks())
    assert streamed.status_code == 401
    stranger = _flower_signed_headers(pki.new_private_key())
    assert _call_with_keys(keys, upstream, content=b"x" * 2048, headers=stranger).status_code == 401
    assert len(upstream.requests) == 1  # only the small one reached the SuperLink


def test_signed_calls_get_the_protocols_limit(registered) -> None:
    keys, key = registered
    upstream = Upstream()
    signed = _call_with_keys(
        keys, upstream, content=b"x" * 4096, headers=_flower_signed_headers(key)
    )
    assert signed.status_code == 200
    assert upstream.requests[0].content == b"x" * 4096
    too_large = _call_with_keys(
        keys, upstream, content=b"x" * ((1 << 20) + 1), headers=_flower_signed_headers(key)
    )
    assert too_large.status_code == 413
    assert len(upstream.requests) == 1


def test_an_unsigned_body_must_arrive_within_its_deadline(registered) -> None:
    keys, key = registered

    async def go(headers: dict[str, str], pause: float) -> int:
        async def trickle() -> AsyncIterator[bytes]:
            yield b"y" * 8
            await asyncio.sleep(pause)
            yield b"y"

        gateway = FleetGateway(
            UPSTREAM,
            site_keys=keys,
            unsigned_body_timeout=0.3,
            idle_timeout=1.0,
            transport=httpx.MockTransport(Upstream()),
        )
        transport = httpx.ASGITransport(app=gateway, client=("198.51.100.9", 4711))
        async with httpx.AsyncClient(transport=transport, base_url="https://gw") as client:
            try:
                sent = client.post("/v1/fleet/push-object", content=trickle(), headers=headers)
                return (await asyncio.wait_for(sent, 5)).status_code
            finally:
                await gateway.aclose()

    assert asyncio.run(go({}, pause=0.6)) == 408
    assert asyncio.run(go({}, pause=0.0)) == 200
    assert asyncio.run(go(_flower_signed_headers(key), pause=0.6)) == 200  # only pauses count


def test_server_start_defaults_are_the_gateways() -> None:
    assert TABLES["server start"]["max-per-address"].default == MAX_PER_ADDRESS
    assert ServerOptions("0.0.0.0", 9092).max_per_address == MAX_PER_ADDRESS
