"""Site key pairs and key files, as Flower's SuperNode authentication needs them.

Flower 1.42 signs every Fleet API call with the SuperNode's private key and looks the public key
up in the keys the operator registered (``flwr supernode register``). It reads the private key
with ``load_ssh_private_key`` and the registered public key with ``load_ssh_public_key``, both on
a NIST EC curve: so a site key is an EC P-384 key, the private half in OpenSSH format (file mode
0600), the public half as one OpenSSH line (what ``ssh-keygen -t ecdsa -b 384`` writes).

The **fingerprint** (``SHA256:...``, as ``ssh-keygen -l`` prints it) is how an operator and a
site talk about a key: the site prints it when it makes or uses the key, the operator sees it
in ``starfed server sites list`` and next to refused connections (the SuperLink logs a refused
key as a PEM block, which :func:`fingerprint` reads too).
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from starfed.shared.files import write_atomic

CURVE = ec.SECP384R1
PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644


class SiteKeyError(ValueError):
    """A site key file or site name that cannot be used; one line for the user."""


def new_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(CURVE())


def write_file(path: Path, data: bytes, mode: int, *, force: bool = False) -> bool:
    """Write ``data`` to ``path`` atomically with ``mode``; an existing file is kept (returns
    False) unless ``force``. A private file never exists with wider permissions, not even for a
    moment: the temporary file is created 0600 and only widened for public modes."""
    if path.exists() and not force:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    os.chmod(path, mode)
    return True


def public_key_path(private_key_path: Path) -> Path:
    """``site.key`` -> ``site.pub``; ``site`` (ssh-keygen style) -> ``site.pub``."""
    return private_key_path.with_suffix(".pub")


@dataclass(frozen=True)
class SiteKey:
    """A site's public key: the OpenSSH line Flower registers, and its fingerprint."""

    openssh: str  # "ecdsa-sha2-nistp384 AAAA..." without a comment
    fingerprint: str  # "SHA256:..."


def describe(public_key: ec.EllipticCurvePublicKey) -> SiteKey:
    line = public_key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    return SiteKey(line, fingerprint(line))


def flower_public_key_bytes(openssh_line: str) -> bytes:
    """The bytes Flower has for this key: PEM SubjectPublicKeyInfo, as a SuperNode sends it and
    the SuperLink stores it (``flwr.supercore.primitives.asymmetric.public_key_to_bytes``)."""
    key = serialization.load_ssh_public_key(openssh_line.encode())
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def fingerprint(key: str | bytes) -> str:
    """``SHA256:<base64 without padding>`` of a public key given as an OpenSSH line or as a PEM
    block (SubjectPublicKeyInfo); equal to ``ssh-keygen -l -E sha256`` on the same key."""
    text = key.decode() if isinstance(key, bytes) else key
    if "-----BEGIN" in text:
        try:
            pem_key = serialization.load_pem_public_key(text.encode())
        except ValueError as err:
            raise SiteKeyError(f"not a PEM public key: {err}") from None
        text = pem_key.public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        ).decode()
    parts = text.split()
    if len(parts) < 2:
        raise SiteKeyError("not an OpenSSH public key line")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except ValueError:
        raise SiteKeyError("not an OpenSSH public key line (bad base64)") from None
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"


def _is_private_key(data: bytes) -> bool:
    """Any PEM private key (OpenSSH, PKCS#8, SEC1): the usual mix-up, named in one line."""
    return b"PRIVATE KEY-----" in data


def _is_public_key_line(data: bytes) -> bool:
    return data.lstrip().startswith((b"ecdsa-sha2-", b"ssh-", b"sk-"))


def read_public_key(path: Path) -> SiteKey:
    """A registrable public key file, checked the way Flower checks it (OpenSSH, NIST EC)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SiteKeyError(f"cannot read public key {path}: {err.strerror}") from None
    if _is_private_key(data):
        raise SiteKeyError(
            f"{path} is a private key: register the site's public key "
            f"({public_key_path(path).name}); a private key stays at its site"
        )
    try:
        key = serialization.load_ssh_public_key(data.strip())
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise SiteKeyError(
            f"{path} is not an OpenSSH public key line ({err}); make one with `starfed site keygen`"
        ) from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not _nist(key.curve):
        raise SiteKeyError(f"{path}: Flower needs an EC key on a NIST curve (P-256/384/521)")
    return describe(key)


def read_private_key(path: Path) -> SiteKey:
    """Check a site's private key file as the SuperNode will load it; return its public key.

    Refuses a key that others can read: it is the site's identity in the federation.
    """
    return describe(private_key(path).public_key())


def private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """A site's private key, checked as ``read_private_key`` says (to sign with it)."""
    try:
        data = path.read_bytes()
        mode = path.stat().st_mode & 0o777
    except OSError as err:
        raise SiteKeyError(f"cannot read private key {path}: {err.strerror}") from None
    if _is_public_key_line(data):
        raise SiteKeyError(
            f"{path} is the public key: --key takes the private key beside it "
            f"({path.with_suffix('.key').name}); the .pub is what the operator registers"
        )
    if mode & 0o077:
        raise SiteKeyError(f"{path} is readable by others (mode {mode:o}); run `chmod 600 {path}`")
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise SiteKeyError(
            f"{path} is not an unencrypted OpenSSH private key ({err}); "
            "make one with `starfed site keygen`"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not _nist(key.curve):
        raise SiteKeyError(f"{path}: Flower needs an EC key on a NIST curve (P-256/384/521)")
    return key


def _nist(curve: ec.EllipticCurve) -> bool:
    return isinstance(curve, ec.SECP256R1 | ec.SECP384R1 | ec.SECP521R1)


def write_site_key(path: Path, comment: str, *, force: bool = False) -> SiteKey:
    """Make a site key pair: ``path`` (private, 0600) and its ``.pub`` (one OpenSSH line).

    Refuses to replace an existing private key unless ``force``: the SuperLink knows a site by
    its key, and a key that was unregistered can never be registered again.
    """
    pub_path = public_key_path(path)
    if path == pub_path:
        raise SiteKeyError(f"the private key file cannot end in .pub: {path}")
    if path.exists() and not force:
        raise SiteKeyError(f"{path} exists; pass --force to replace it (the old key stops working)")
    key = new_private_key()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    site_key = describe(key.public_key())
    comment = "".join(comment.split())  # one line, one token
    write_file(path, private, PRIVATE_MODE, force=True)
    line = f"{site_key.openssh} {comment}".rstrip() + "\n"
    write_file(pub_path, line.encode(), PUBLIC_MODE, force=True)
    return site_key


SITE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_site_name(name: str) -> str:
    """Site names become file names and table keys: letters, digits, ``._-``, 1-64 chars."""
    if not (0 < len(name) <= 64) or not set(name) <= SITE_NAME_CHARS or name[0] in ".-":
        raise SiteKeyError(
            f"bad site name {name!r}: use 1-64 letters, digits, '.', '_' or '-' "
            "(not starting with '.' or '-')"
        )
    return name
