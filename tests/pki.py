"""A certificate authority of the tests' own: a server certificate for localhost and
127.0.0.1, a client certificate it signed, and one from a CA nobody trusts."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pki:
    ca: bytes
    server_cert: Path
    server_key: Path
    ca_file: Path
    client_cert: bytes
    client_key: bytes
    rogue_cert: bytes  # a client certificate from a CA the server does not trust
    rogue_key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (subject, key)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_pki(tmp: Path) -> Pki:
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("switchyard test CA", ca_key, None, ca=True)
    server_key, client_key, rogue_key = _key(), _key(), _key()
    server = _cert("localhost", server_key, ("switchyard test CA", ca_key), server=True)
    client = _cert("a client", client_key, ("switchyard test CA", ca_key))
    rogue = _cert("a stranger", rogue_key, ("another CA", rogue_ca_key))
    (tmp / "ca.pem").write_bytes(_pem(ca))
    (tmp / "server.pem").write_bytes(_pem(server))
    (tmp / "server.key").write_bytes(_pem_key(server_key))
    return Pki(
        ca=_pem(ca),
        server_cert=tmp / "server.pem",
        server_key=tmp / "server.key",
        ca_file=tmp / "ca.pem",
        client_cert=_pem(client),
        client_key=_pem_key(client_key),
        rogue_cert=_pem(rogue),
        rogue_key=_pem_key(rogue_key),
    )
