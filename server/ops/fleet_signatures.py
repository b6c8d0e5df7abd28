"""Which Fleet API calls are signed by a registered site key, checked at the gateway from the
headers alone, before any of a request's body is read.

Why: Flower 1.42's SuperLink reads and parses a Fleet request's whole body before its SuperNode
authentication runs (its middleware needs the parsed request to find the node id), so anyone who
reaches the port could make it buffer and parse large bodies. The signature itself needs no body:
a SuperNode signs the current time (ECDSA, SHA-256) and sends its public key (PEM, base64), the
time and the signature as headers (``flwr/supernode/node_auth_http_interceptor.py``;
``flwr/superlink/routers/fleet/node_auth.py`` checks them the same way). The gateway checks them
against the keys ``starfed server sites add`` registered (``sites.json``) and lets only signed
calls carry a large body. The SuperLink still checks every call itself (the node id bound to the
key, keys registered with Flower but not through starfed), so this check only ever refuses more.
"""

from __future__ import annotations

import binascii
import json
import logging
from base64 import b64decode
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from starfed.ops import clock, pki

#: Flower 1.42's header names (flwr/common/constant.py, flwr/supercore/constant.py); tests
#: compare them with Flower's.
PUBLIC_KEY_HEADER = "flwr-public-key"
SIGNATURE_HEADER = "flwr-signature"
TIMESTAMP_HEADER = "flwr-timestamp"
#: The ages (seconds, on the server's clock) a signed timestamp must lie strictly between:
#: Flower's time window, read from ``flower_internals`` as ``clock.limits`` reads it, so the
#: gateway's check and the clock-skew diagnosis cannot drift apart (the gateway imports
#: Flower's constants once, at its start).
_AHEAD_S, _BEHIND_S = clock.limits()
MIN_AGE_S = -_AHEAD_S
MAX_AGE_S = _BEHIND_S

log = logging.getLogger("starfed.gateway")


class SiteKeys:
    """The registered site keys of ``sites.json``, read again whenever the file changes (so
    ``sites add``/``remove`` take effect at once); a missing or damaged file means no keys."""

    def __init__(self, sites_file: Path) -> None:
        self.sites_file = sites_file
        self._stamp: tuple[int, int, int] | None = None
        self._keys: dict[bytes, tuple[str, ec.EllipticCurvePublicKey]] = {}

    def _current(self) -> dict[bytes, tuple[str, ec.EllipticCurvePublicKey]]:
        try:
            stat = self.sites_file.stat()
            stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            self._keys = self._load() if stamp else {}
            log.info("%d registered site keys from %s", len(self._keys), self.sites_file)
        return self._keys

    def _load(self) -> dict[bytes, tuple[str, ec.EllipticCurvePublicKey]]:
        # sites.json as server/ops/sites.py's Registry writes it, read here without that module's
        # imports (they pull in plotting), which the gateway process has no use for.
        try:
            records = json.loads(self.sites_file.read_text())["sites"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.error("no site keys: %s is unreadable (%s)", self.sites_file, err)
            return {}
        keys: dict[bytes, tuple[str, ec.EllipticCurvePublicKey]] = {}
        for record in records:
            if not isinstance(record, dict) or record.get("removed_at"):
                continue
            try:
                pem = pki.flower_public_key_bytes(str(record["public_key"]))
                key = serialization.load_pem_public_key(pem)
            except (KeyError, ValueError, TypeError, UnsupportedAlgorithm) as err:
                log.error("a site key in %s is unreadable (%s)", self.sites_file, err)
                continue
            if isinstance(key, ec.EllipticCurvePublicKey):
                keys[pem] = (str(record.get("name", "?")), key)
        return keys

    def signer(self, headers: Mapping[str, str], now: datetime | None = None) -> str | None:
        """The name of the registered site whose key signed this call's headers within Flower's
        time window, or None (no, malformed, stale or wrong signature, unknown key)."""
        try:
            public_key = b64decode(headers[PUBLIC_KEY_HEADER], validate=True)
            signature = b64decode(headers[SIGNATURE_HEADER], validate=True)
            timestamp = headers[TIMESTAMP_HEADER]
        except (KeyError, ValueError, binascii.Error):
            return None
        entry = self._current().get(public_key)  # unknown keys cost no signature check
        if entry is None:
            return None
        try:
            signed_at = datetime.fromisoformat(timestamp)
            age = ((now or datetime.now(UTC)) - signed_at).total_seconds()
        except (ValueError, TypeError):  # unparsable, or without a time zone
            return None
        if not MIN_AGE_S < age < MAX_AGE_S:
            return None
        name, key = entry
        try:
            key.verify(signature, timestamp.encode("ascii"), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, UnicodeError):
            return None
        return name
