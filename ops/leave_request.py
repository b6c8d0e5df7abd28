"""A site's signed request to leave the federation (``starfed site leave``), and the operator's
check of it (``starfed server sites withdraw NAME --request FILE``).

A site cannot reach the server's folder, and the federation's messages go from the server to the
sites, so the request travels as a file the site hands to the operator (mail, a ticket). It is
signed with the site's own key, the one the operator registered with ``server sites add``: the
operator can show that the site asked, and for which mode, and no one else can ask in its name.
The withdrawal's record keeps the whole signed request (``Withdrawal.request``), so the proof
stays with the federation. A request signed before the site's current registration is refused:
a site that left and was added again is not withdrawn by its old request.

The signature is ECDSA with SHA-384 (the site key's curve is P-384, ``ops/pki.py``) over the
request's canonical JSON (sorted keys, no spaces), by ``cryptography``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from starfed.ops import pki
from starfed.shared.files import write_atomic

MAX_BYTES = 64 * 1024  # a request is a few hundred bytes; a larger file is not one


class LeaveRequestError(ValueError):
    """A request that cannot be used: unreadable, not signed by the site's key, not its own."""


class Mode(StrEnum):
    """The two ways a site can leave (docs/security.md#a-site-leaves)."""

    IMMEDIATE = "immediate"
    EXACT = "exact"


@dataclass(frozen=True)
class LeaveRequest:
    """What the site asks: who, how, when, and why (free text for the operator)."""

    site: str
    mode: Mode
    made: str  # ISO 8601, UTC
    reason: str = ""

    def body(self) -> bytes:
        """The bytes signed: canonical JSON."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class SignedRequest:
    """A request, the fingerprint of the key that signed it, and the signature (base64 DER)."""

    request: LeaveRequest
    fingerprint: str
    signature: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "request": asdict(self.request),
                "fingerprint": self.fingerprint,
                "signature": self.signature,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> SignedRequest:
        raw = json.loads(text)
        body = raw["request"]
        extra = set(body) - {"site", "mode", "made", "reason"}
        if extra:
            raise ValueError(f"unknown request fields {sorted(extra)}")
        request = LeaveRequest(
            str(body["site"]), Mode(body["mode"]), str(body["made"]), str(body.get("reason", ""))
        )
        datetime.fromisoformat(request.made)  # a time, or ValueError
        return cls(request, str(raw["fingerprint"]), str(raw["signature"]))


def sign(key_path: Path, site: str, mode: Mode, reason: str = "") -> SignedRequest:
    """The site's request, signed with its private key (checked as the SuperNode checks it)."""
    key = pki.private_key(key_path)
    made = datetime.now(UTC).isoformat(timespec="seconds")
    request = LeaveRequest(pki.check_site_name(site), mode, made, " ".join(reason.split()))
    signature = key.sign(request.body(), ec.ECDSA(hashes.SHA384()))
    return SignedRequest(
        request, pki.describe(key.public_key()).fingerprint, base64.b64encode(signature).decode()
    )


def write(path: Path, signed: SignedRequest) -> None:
    write_atomic(path, (signed.to_json() + "\n").encode())


def read(path: Path) -> SignedRequest:
    """A request file, read and parsed (not yet verified: ``verify``)."""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise LeaveRequestError(f"{path} is not a leave request (over {MAX_BYTES} bytes)")
        return SignedRequest.from_json(path.read_text())
    except OSError as err:
        raise LeaveRequestError(f"cannot read {path}: {err.strerror}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise LeaveRequestError(
            f"{path} is not a leave request written by `starfed site leave` ({err})"
        ) from None


def verify(signed: SignedRequest, site: str, public_key: str, registered_at: str) -> None:
    """Refuse (``LeaveRequestError``) a request that is not ``site``'s own, not signed by its
    registered key (``public_key``: its OpenSSH line), or older than its registration
    (``registered_at``, ISO 8601)."""
    request = signed.request
    if request.site != site:
        raise LeaveRequestError(f"the request is {request.site}'s, not {site}'s")
    fingerprint = pki.fingerprint(public_key)
    if signed.fingerprint != fingerprint:
        raise LeaveRequestError(
            f"the request is signed by key {signed.fingerprint}; {site}'s registered key is "
            f"{fingerprint}"
        )
    key = serialization.load_ssh_public_key(public_key.encode())
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise LeaveRequestError(f"{site}'s registered key is not an EC key")
    try:
        key.verify(base64.b64decode(signed.signature), request.body(), ec.ECDSA(hashes.SHA384()))
    except (InvalidSignature, ValueError):
        raise LeaveRequestError(
            f"the request's signature does not verify with {site}'s registered key {fingerprint}"
        ) from None
    if datetime.fromisoformat(request.made) < datetime.fromisoformat(registered_at):
        raise LeaveRequestError(
            f"the request was signed at {request.made}, before {site}'s current registration "
            f"({registered_at}): ask the site for a new one"
        )
