"""The egress gateway's interception CA: certificates for the hosts whose requests get a
credential added on the host side (``[[egress.inject]]``).

Theory of operation
-------------------
To add a header to an HTTPS request the gateway must read it, so for those hosts -- and
only those -- it ends the jail's TLS itself, with a certificate for the host signed by
this CA, and opens its own TLS to the host (checked against the host's trust store). Jails
of such a policy trust the CA's certificate (never its key); nothing else on the host
does.

The CA is made once per daemon state directory: ``ca.pem`` (public) and ``ca.key``
(mode 0600 in a 0700 directory, owned by the daemon's user). A leaf certificate per host
is made on first use (an EC P-256 key, valid for :data:`LEAF_DAYS` days, the host as its
subject alternative name) and kept in memory, at most :data:`LEAVES_CACHED` of them.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import ssl
import tempfile
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 7
LEAVES_CACHED = 256
CA_NAME = "jaild egress interception CA"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_private(path: Path, data: bytes) -> None:
    """``data`` to ``path``, mode 0600 from the first byte (never readable by others)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class EgressCA:
    """See the module docstring. ``directory`` is made (0700) if it does not exist."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        key_path, cert_path = self.directory / "ca.key", self.directory / "ca.pem"
        # two daemons sharing a state directory make one CA: the first, under the lock
        lock = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not key_path.exists():
                self._create(key_path, cert_path)
        finally:
            os.close(lock)
        loaded = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not the EC key jaild makes")
        self._key = loaded
        self.certificate_pem = cert_path.read_bytes()
        self._cert = x509.load_pem_x509_certificate(self.certificate_pem)
        self._leaves: OrderedDict[str, ssl.SSLContext] = OrderedDict()

    @property
    def certificate_path(self) -> Path:
        """What a jail trusts (``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``)."""
        return self.directory / "ca.pem"

    def _create(self, key_path: Path, cert_path: Path) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(CA_NAME))
            .issuer_name(_name(CA_NAME))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        # the certificate first: a key on disk means a complete CA
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        os.chmod(cert_path, 0o644)
        _write_private(key_path, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server-side TLS context presenting a certificate for ``host`` (made once)."""
        context = self._leaves.get(host)
        if context is not None:
            self._leaves.move_to_end(host)
            return context
        context = self._leaf_context(host)
        self._leaves[host] = context
        if len(self._leaves) > LEAVES_CACHED:
            self._leaves.popitem(last=False)
        return context

    def _leaf_context(self, host: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(host))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # ssl loads a chain from files only: a private temporary pair, gone at once
        with tempfile.TemporaryDirectory(prefix="jaild-leaf-") as tmp:
            os.chmod(tmp, 0o700)
            cert_file, key_file = Path(tmp) / "leaf.pem", Path(tmp) / "leaf.key"
            cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            _write_private(key_file, key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ))
            context.load_cert_chain(cert_file, key_file)
        return context


__all__ = ["CA_DAYS", "LEAF_DAYS", "EgressCA"]
