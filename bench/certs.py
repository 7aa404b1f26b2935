"""Throwaway certificates for the bench's mutual-TLS daemon: a CA, a server certificate for
``127.0.0.1`` and ``localhost``, and one client certificate, as PEM files.

The bench carries its own few lines rather than import ``tests/tls.py`` (the bench does not
depend on the test suite). EC P-256, SHA-256, valid from an hour ago to a day ahead, with
the extensions a strict verifier asks for; keys are PKCS#8, unencrypted, mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CLIENT_PRINCIPAL = "spiffe://jaild.bench/client"
"""The client certificate's URI SAN: the principal the daemon serves it as."""


@dataclass(frozen=True)
class Pki:
    """PEM files: what the daemon's ``[tls]`` and the client's ``cert``/``key``/``ca`` take."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey | None) -> tuple[str, str]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        key_path.touch(mode=0o600)
        key_path.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def make_pki(directory: Path) -> Pki:
    """A CA and the two certificates it signs, written to ``directory`` (made if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())

    def builder(subject: str, public: ec.EllipticCurvePublicKey,
                ca: bool) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(_name(subject))
                .issuer_name(_name("jaild bench CA")).public_key(public)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))

    ca_public = ca_key.public_key()
    ca_cert = (builder("jaild bench CA", ca_public, True)
               .add_extension(x509.KeyUsage(
                   digital_signature=True, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=True,
                   crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_public),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    ca_path, _ = _write(directory, "ca", ca_cert, None)

    def leaf(stem: str, sans: list[x509.GeneralName],
             usage: x509.ObjectIdentifier) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (builder(stem, key.public_key(), False)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        return _write(directory, stem, cert, key)

    server = leaf("server", [x509.DNSName("localhost"),
                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                  ExtendedKeyUsageOID.SERVER_AUTH)
    client = leaf("client", [x509.UniformResourceIdentifier(CLIENT_PRINCIPAL)],
                  ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(ca_path, *server, *client)
