"""``starfed server certs`` and site keys: files, permissions, SANs, keys Flower can load.

No processes: the certificates are checked with ``cryptography`` and, where ``ssh-keygen``
exists, fingerprints against OpenSSH's own.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from starfed.ops import pki
from starfed.server.ops import certs
from starfed.server.ops.layout import ServerFolder


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.fixture
def folder(tmp_path: Path) -> ServerFolder:
    return ServerFolder.at(tmp_path / "server")


def test_first_call_makes_ca_server_cert_and_site_keys(folder: ServerFolder) -> None:
    report = certs.ensure_certificates(folder, ["fed.example.org", "203.0.113.7"], ["A", "b-2"])

    assert set(report.written) == {
        folder.ca_cert,
        folder.ca_key,
        folder.server_cert,
        folder.server_key,
        folder.site_key("A"),
        pki.public_key_path(folder.site_key("A")),
        folder.site_key("b-2"),
        pki.public_key_path(folder.site_key("b-2")),
    }
    for private in (folder.ca_key, folder.server_key, folder.site_key("A")):
        assert _mode(private) == 0o600, private
    assert _mode(folder.ca_cert) == 0o644
    assert _mode(folder.certs) == 0o700 and _mode(folder.root) == 0o700

    ca, server = _cert(folder.ca_cert), _cert(folder.server_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["fed.example.org", "localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [
        "203.0.113.7",
        "127.0.0.1",
    ]
    usage = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert report.sans == ["fed.example.org", "203.0.113.7", "127.0.0.1", "localhost"]

    # the server key matches its certificate; the site keys load as Flower loads them
    server_key = serialization.load_pem_private_key(folder.server_key.read_bytes(), None)
    assert server_key.public_key().public_numbers() == server.public_key().public_numbers()
    private = serialization.load_ssh_private_key(folder.site_key("A").read_bytes(), None)
    public = serialization.load_ssh_public_key(
        pki.public_key_path(folder.site_key("A")).read_bytes()
    )
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert isinstance(private.curve, ec.SECP384R1)
    assert private.public_key().public_numbers() == public.public_numbers()
    assert report.sites["A"].fingerprint == pki.fingerprint(
        pki.public_key_path(folder.site_key("A")).read_text()
    )


def test_second_call_keeps_everything(folder: ServerFolder) -> None:
    certs.ensure_certificates(folder, ["fed.example.org"], ["A"])
    before = {p: p.read_bytes() for p in folder.root.rglob("*") if p.is_file()}
    report = certs.ensure_certificates(folder, ["fed.example.org"], ["A"])
    assert report.written == []
    assert {p: p.read_bytes() for p in before} == before


def test_a_new_host_needs_renew_server_and_keeps_the_ca(folder: ServerFolder) -> None:
    certs.ensure_certificates(folder, ["fed.example.org"])
    ca_before = folder.ca_cert.read_bytes()
    with pytest.raises(certs.CertError, match=r"does not cover other\.example\.org"):
        certs.ensure_certificates(folder, ["other.example.org"])
    report = certs.ensure_certificates(folder, ["other.example.org"], renew_server=True)
    assert folder.ca_cert.read_bytes() == ca_before
    assert folder.server_cert in report.written and folder.ca_cert in report.kept
    assert "other.example.org" in certs.certificate_sans(folder.server_cert)
    _cert(folder.server_cert).verify_directly_issued_by(_cert(folder.ca_cert))


def test_force_replaces_the_ca_and_reissues_from_it(folder: ServerFolder) -> None:
    certs.ensure_certificates(folder, [], ["A"])
    old_ca, old_site = folder.ca_cert.read_bytes(), folder.site_key("A").read_bytes()
    certs.ensure_certificates(folder, [], ["A"], force=True)
    assert folder.ca_cert.read_bytes() != old_ca
    assert folder.site_key("A").read_bytes() != old_site
    _cert(folder.server_cert).verify_directly_issued_by(_cert(folder.ca_cert))


def test_half_a_ca_and_bad_names_are_refused(folder: ServerFolder) -> None:
    certs.ensure_certificates(folder, [])
    folder.ca_key.unlink()
    with pytest.raises(certs.CertError, match="half of the CA"):
        certs.ensure_certificates(folder, [])
    for host in ("bad_host!", "-x.example.org", "a" * 64 + ".org", ""):
        with pytest.raises(certs.CertError, match="not a host name"):
            certs.subject_alt_name(host)
    for name in ("", ".hidden", "a/b", "x" * 65, "site a"):
        with pytest.raises(pki.SiteKeyError, match="bad site name"):
            pki.check_site_name(name)


def test_site_keygen_refuses_to_overwrite_and_to_load_open_keys(tmp_path: Path) -> None:
    path = tmp_path / "site.key"
    key = pki.write_site_key(path, "site@host")
    assert pki.public_key_path(path) == tmp_path / "site.pub"
    assert pki.public_key_path(path).read_text().endswith(" site@host\n")
    with pytest.raises(pki.SiteKeyError, match="exists"):
        pki.write_site_key(path, "again")
    assert pki.read_private_key(path) == key == pki.read_public_key(tmp_path / "site.pub")
    path.chmod(0o644)
    with pytest.raises(pki.SiteKeyError, match="readable by others"):
        pki.read_private_key(path)


def test_keys_flower_would_reject_are_rejected_here(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    ed = ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "ed.pub").write_bytes(
        ed.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    with pytest.raises(pki.SiteKeyError, match="NIST curve"):
        pki.read_public_key(tmp_path / "ed.pub")
    pem = tmp_path / "pkcs8.key"  # PEM PKCS#8: Flower exits with "Exit Code: 302"
    pem.write_bytes(
        pki.new_private_key().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pem.chmod(0o600)
    with pytest.raises(pki.SiteKeyError, match="OpenSSH private key"):
        pki.read_private_key(pem)


def test_fingerprint_is_openssh_s_and_reads_the_superlink_s_pem(tmp_path: Path) -> None:
    key = pki.write_site_key(tmp_path / "site.key", "c")
    public = serialization.load_ssh_public_key(key.openssh.encode())
    spki_pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    assert pki.fingerprint(spki_pem) == key.fingerprint
    if shutil.which("ssh-keygen"):
        out = subprocess.run(
            ["ssh-keygen", "-l", "-E", "sha256", "-f", str(tmp_path / "site.pub")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.split()[1] == key.fingerprint
