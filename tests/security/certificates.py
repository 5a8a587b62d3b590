"""A certificate authority and the certificates it signed, made by the TLS tests: one for a
server on 127.0.0.1 and localhost and, where asked, one for its clients."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _builder(
    subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.now(UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
    )


def _write(
    cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, pem: Path, key_pem: Path
) -> None:
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_pem.chmod(0o600)


def make_certificates(folder: Path, client: bool = False) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1 and localhost: (ca, cert, key) files,
    named as ``laneway up --bus-tls-dir`` takes them; with ``client``, also client.pem and
    client-key.pem, a client certificate from the same CA."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        _builder("laneway test CA", _name("laneway test CA"), ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    issued_by = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder("localhost", ca.subject, key.public_key())
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(issued_by, False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write(cert, key, paths[1], paths[2])
    if client:
        client_key = ec.generate_private_key(ec.SECP256R1())
        client_cert = (
            _builder("laneway services", ca.subject, client_key.public_key())
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(issued_by, False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(client_cert, client_key, folder / "client.pem", folder / "client-key.pem")
    return paths
