"""``starfed server certs``: the CA, the server certificate and site keys of a first deployment.

So that nobody copies openssl recipes: one call makes a private CA (EC P-384, 10 years), a
server certificate signed by it (EC P-384, 825 days, serverAuth, SANs for every name and address
sites dial plus ``127.0.0.1`` and ``localhost`` for the operator's own tools) and, on request,
site key pairs (``starfed.ops.pki``). Sites receive ``ca.pem`` and, if the operator made it,
their private key.

Idempotent: what exists is kept. A new CA means every site needs the new ``ca.pem`` and a new
server key means restarting the SuperLink, so only ``--force`` replaces the CA and keys, and
``--renew-server`` issues a new server certificate from the existing CA (sites keep their
``ca.pem``), e.g. when a host name is added.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from starfed.ops import pki
from starfed.server.ops.layout import ServerFolder

LOCAL_NAMES = ("127.0.0.1", "localhost")
CA_DAYS = 3650
SERVER_DAYS = 825  # the longest validity clients commonly accept for a server certificate
CLOCK_SKEW = datetime.timedelta(minutes=5)


class CertError(ValueError):
    """Bad input or files that do not fit together; one line for the user."""


@dataclass
class CertReport:
    """What a ``certs`` call did: files written, files kept, and each site's key."""

    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    sans: list[str] = field(default_factory=list)
    sites: dict[str, pki.SiteKey] = field(default_factory=dict)


def subject_alt_name(name: str) -> x509.GeneralName:
    """An IP address SAN for addresses, a DNS SAN for host names (checked, not guessed)."""
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    labels = name.rstrip(".").split(".")
    if not name or len(name) > 253 or not all(_dns_label(label) for label in labels):
        raise CertError(f"not a host name or IP address: {name!r}")
    return x509.DNSName(name.rstrip(".").lower())


def _dns_label(label: str) -> bool:
    return (
        0 < len(label) <= 63
        and label[0] != "-"
        and label[-1] != "-"
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
    )


def certificate_sans(path: Path) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n.value) for n in names]


def _unique_sans(hosts: Sequence[str]) -> list[str]:
    sans: list[str] = []
    for host in [*hosts, *LOCAL_NAMES]:
        value = str(subject_alt_name(host).value)
        if value not in sans:
            sans.append(value)
    return sans


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates; an EC server key signs handshakes and agrees on keys (ECDH)."""
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        key_agreement=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = pki.new_private_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA384())
    )
    return key, cert


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, sans: Sequence[str]
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = pki.new_private_key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sans[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName([subject_alt_name(s) for s in sans]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(ca_key, hashes.SHA384())
    )
    return key, cert


def _load_ca(folder: ServerFolder) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    try:
        key = serialization.load_pem_private_key(folder.ca_key.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(folder.ca_cert.read_bytes())
    except (OSError, ValueError) as err:
        raise CertError(f"cannot load the CA in {folder.certs}: {err}") from None
    public = cert.public_key()
    if (
        not isinstance(key, ec.EllipticCurvePrivateKey)
        or not isinstance(public, ec.EllipticCurvePublicKey)
        or key.public_key().public_numbers() != public.public_numbers()
    ):
        raise CertError(f"{folder.ca_key} does not belong to {folder.ca_cert}")
    return key, cert


def ensure_certificates(
    folder: ServerFolder,
    hosts: Sequence[str],
    sites: Sequence[str] = (),
    *,
    force: bool = False,
    renew_server: bool = False,
) -> CertReport:
    """Make what is missing of the CA, the server certificate and the named sites' keys.

    An existing server certificate that lacks one of ``hosts`` is an error (sites could not
    connect under that name) unless ``renew_server`` or ``force`` asks for a new one.
    """
    report = CertReport(sans=_unique_sans(hosts))
    for name in sites:
        pki.check_site_name(name)
    have_ca = folder.ca_cert.exists() and folder.ca_key.exists()
    if not force and (folder.ca_cert.exists() != folder.ca_key.exists()):
        raise CertError(f"{folder.certs} has only half of the CA (ca.pem, ca.key); use --force")
    folder.create()
    folder.certs.mkdir(mode=0o700, exist_ok=True)

    if have_ca and not force:
        ca_key, ca_cert = _load_ca(folder)
        report.kept += [folder.ca_cert, folder.ca_key]
    else:
        ca_key, ca_cert = make_ca("starfed federation CA")
        pki.write_file(folder.ca_key, _private_pem(ca_key), pki.PRIVATE_MODE, force=True)
        pki.write_file(folder.ca_cert, _pem(ca_cert), pki.PUBLIC_MODE, force=True)
        report.written += [folder.ca_key, folder.ca_cert]
        renew_server = True  # a certificate from the old CA would not verify

    have_server = folder.server_cert.exists() and folder.server_key.exists()
    if have_server and not (renew_server or force):
        missing = [s for s in report.sans if s not in certificate_sans(folder.server_cert)]
        if missing:
            raise CertError(
                f"the server certificate does not cover {', '.join(missing)}; pass "
                "--renew-server for a new one from the same CA (sites keep their ca.pem)"
            )
        report.kept += [folder.server_cert, folder.server_key]
    else:
        server_key, server_cert = make_server_cert(ca_key, ca_cert, report.sans)
        pki.write_file(folder.server_key, _private_pem(server_key), pki.PRIVATE_MODE, force=True)
        pki.write_file(folder.server_cert, _pem(server_cert), pki.PUBLIC_MODE, force=True)
        report.written += [folder.server_key, folder.server_cert]
    report.sans = certificate_sans(folder.server_cert)

    for name in sites:
        path = folder.site_key(name)
        if path.exists() and not force:
            report.sites[name] = pki.read_private_key(path)
            report.kept += [path, pki.public_key_path(path)]
        else:
            folder.site_keys.mkdir(mode=0o700, exist_ok=True)
            report.sites[name] = pki.write_site_key(path, f"starfed-site-{name}", force=True)
            report.written += [path, pki.public_key_path(path)]
    return report
