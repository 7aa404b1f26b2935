"""Throwaway certificate authorities and certificates for tests that need TLS.

:class:`CertAuthority` is a CA whose certificate and key live as PEM files in a directory; it
issues server certificates (DNS and IP SANs, ``serverAuth``) and client certificates
(``clientAuth``; a URI SAN such as ``spiffe://jaild.test/agent/alice``, or only a subject CN),
valid now, expired or not yet valid. :func:`make_pki` makes the usual set for mutual-TLS
tests at once: a CA, a foreign CA, a server certificate and clients good and bad.
:func:`client_context` and :func:`server_context` turn them into ``ssl.SSLContext``\\ s
(a client limited to TLS 1.2 too, for refusal tests).

Everything is EC P-256, signed with SHA-256. Files are written as ``<stem>.pem`` (the
certificate) and ``<stem>-key.pem`` (its key, PKCS#8, unencrypted); issuing the same stem
again overwrites them.

``test_ca`` is the older one-call form (a CA and one server certificate), kept for its callers.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SPIFFE_DOMAIN = "jaild.test"
"""The trust domain of the client identities :func:`make_pki` issues
(``spiffe://jaild.test/agent/NAME``)."""


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "cert"


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    path.chmod(0o600)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: str
    """The certificate's PEM file."""
    key: str
    """Its private key's PEM file (PKCS#8, unencrypted, mode 0600)."""
    certificate: x509.Certificate
    """The certificate itself, to read its fields in assertions."""


class CertAuthority:
    """A test CA: its certificate and key as PEM files in ``directory``.

    Args:
        directory: where the CA's files and every certificate it issues are written (made if
            missing).
        name: the CA's subject CN.
        stem: the CA's own files are ``<stem>.pem`` and ``<stem>-key.pem``.
        valid_days: the CA is valid from that many days ago to that many days ahead (wider
            than any certificate it issues, so an expired or not-yet-valid one fails on its
            own dates, never on the CA's).
    """

    def __init__(self, directory: Path, name: str = "jaild test CA", *, stem: str = "ca",
                 valid_days: int = 30) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        public = self._key.public_key()
        self.certificate = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=valid_days))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = str(self.directory / f"{stem}.pem")
        """The CA's certificate (PEM file): what a peer trusts."""
        Path(self.cert).write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        _write_key(self.directory / f"{stem}-key.pem", self._key)

    def intermediate(self, directory: Path, name: str) -> CertAuthority:
        """A CA whose certificate this CA signs (``basicConstraints CA:TRUE``): an
        intermediate, its files in ``directory``."""
        sub = CertAuthority(directory, name)
        public = sub.certificate.public_key()
        now = _now()
        sub.certificate = (
            x509.CertificateBuilder().subject_name(sub.certificate.subject)
            .issuer_name(self.certificate.subject).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        Path(sub.cert).write_bytes(sub.certificate.public_bytes(serialization.Encoding.PEM))
        return sub

    def issue(self, stem: str, common_name: str, *, sans: Sequence[x509.GeneralName] = (),
              usage: Sequence[x509.ObjectIdentifier] = (),
              not_before: datetime.datetime | None = None,
              not_after: datetime.datetime | None = None) -> Issued:
        """A leaf certificate signed by this CA.

        Args:
            stem: its files, ``<stem>.pem`` and ``<stem>-key.pem`` in the CA's directory.
            common_name: the subject CN.
            sans: the subjectAltName entries (none: no such extension).
            usage: the extendedKeyUsage purposes (none: no such extension).
            not_before: default five minutes ago.
            not_after: default a day from now.
        """
        now = _now()
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(self.certificate.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
            .not_valid_after(not_after or now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self._key.public_key()), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)),
                                            critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
        certificate = builder.sign(self._key, hashes.SHA256())
        cert_path, key_path = self.directory / f"{stem}.pem", self.directory / f"{stem}-key.pem"
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return Issued(cert=str(cert_path), key=str(key_path), certificate=certificate)

    def server(self, names: Sequence[str] = ("localhost",), ips: Sequence[str] = ("127.0.0.1",),
               *, stem: str | None = None) -> Issued:
        """A server certificate (``serverAuth``) for DNS ``names`` and IP ``ips``; its CN is
        the first name (or address). Files ``server-<CN>`` unless ``stem`` is given."""
        cn = (list(names) + list(ips))[0]
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
        return self.issue(stem or f"server-{_stem(cn)}", cn, sans=sans,
                          usage=[ExtendedKeyUsageOID.SERVER_AUTH])

    def client(self, name: str, *, uri: str | None = None, stem: str | None = None,
               not_before: datetime.datetime | None = None,
               not_after: datetime.datetime | None = None) -> Issued:
        """A client certificate (``clientAuth``) with subject CN ``name`` and, when given, a
        URI SAN (``spiffe://jaild.test/agent/alice``); none: the CN is all it says. Files
        ``client-<name>`` unless ``stem`` is given."""
        sans = [x509.UniformResourceIdentifier(uri)] if uri else []
        return self.issue(stem or f"client-{_stem(name)}", name, sans=sans,
                          usage=[ExtendedKeyUsageOID.CLIENT_AUTH],
                          not_before=not_before, not_after=not_after)

    def expired_client(self, name: str, *, uri: str | None = None) -> Issued:
        """A client certificate that expired a day ago (valid two days ago to one day ago).
        Files ``client-<name>-expired``."""
        now = _now()
        return self.client(name, uri=uri, stem=f"client-{_stem(name)}-expired",
                           not_before=now - datetime.timedelta(days=2),
                           not_after=now - datetime.timedelta(days=1))

    def future_client(self, name: str, *, uri: str | None = None) -> Issued:
        """A client certificate not valid until tomorrow (valid one to two days ahead).
        Files ``client-<name>-future``."""
        now = _now()
        return self.client(name, uri=uri, stem=f"client-{_stem(name)}-future",
                           not_before=now + datetime.timedelta(days=1),
                           not_after=now + datetime.timedelta(days=2))


def spiffe_id(agent: str) -> str:
    """The URI SAN of an agent's client certificate: ``spiffe://jaild.test/agent/<agent>``."""
    return f"spiffe://{SPIFFE_DOMAIN}/agent/{agent}"


@dataclass(frozen=True)
class Pki:
    """What mutual-TLS tests usually need, from :func:`make_pki`."""

    ca: CertAuthority
    """The CA both sides trust."""
    foreign_ca: CertAuthority
    """A second CA nobody trusts (its files in ``foreign/``)."""
    server: Issued
    """A server certificate from ``ca``."""
    client: Issued
    """``alice``: CN ``alice``, URI SAN ``spiffe://jaild.test/agent/alice``."""
    cn_only_client: Issued
    """``bob``: a subject CN and no SAN at all."""
    expired_client: Issued
    """``alice``'s name and URI, expired a day ago."""
    future_client: Issued
    """``alice``'s name and URI, not valid until tomorrow."""
    foreign_client: Issued
    """``alice``'s name and URI, issued by ``foreign_ca``."""


def make_pki(directory: Path, server_names: Sequence[str] = ("localhost",),
             server_ips: Sequence[str] = ("127.0.0.1",)) -> Pki:
    """A CA, a foreign CA and their certificates (see :class:`Pki`), as PEM files in
    ``directory`` (the foreign CA's in ``directory/foreign``). The server certificate is for
    ``server_names`` and ``server_ips``."""
    directory = Path(directory)
    ca = CertAuthority(directory)
    foreign = CertAuthority(directory / "foreign", "foreign test CA")
    alice = spiffe_id("alice")
    return Pki(
        ca=ca, foreign_ca=foreign,
        server=ca.server(server_names, server_ips),
        client=ca.client("alice", uri=alice),
        cn_only_client=ca.client("bob"),
        expired_client=ca.expired_client("alice", uri=alice),
        future_client=ca.future_client("alice", uri=alice),
        foreign_client=foreign.client("alice", uri=alice),
    )


def client_context(ca: str | Path, cert: Issued | None = None, *, tls12_only: bool = False,
                   check_hostname: bool = True) -> ssl.SSLContext:
    """A client's ``ssl.SSLContext``: it trusts ``ca`` (a PEM file) alone and presents
    ``cert`` (none: no client certificate).

    Args:
        ca: the CA file the server's certificate must chain to.
        cert: the client certificate and key to present.
        tls12_only: offer TLS 1.2 and nothing else (for tests that a server refuses it).
        check_hostname: check the server's certificate names the host dialled (pass the name
            as ``server_hostname``).
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.check_hostname = check_hostname
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    if tls12_only:
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_context(ca: str | Path, cert: Issued, *, require_client_cert: bool = True,
                   minimum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3) -> ssl.SSLContext:
    """A server's ``ssl.SSLContext`` presenting ``cert``; with ``require_client_cert``, a
    client must present a certificate chaining to ``ca`` (with ``clientAuth``, in its
    validity). ``minimum``: the oldest TLS version accepted (default 1.3)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = minimum
    context.load_cert_chain(cert.cert, cert.key)
    if require_client_cert:
        context.load_verify_locations(cafile=str(ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def test_ca(
    directory: Path, names: tuple[str, ...] = ("tls.test",), ips: tuple[str, ...] = ()
) -> tuple[str, str, str]:
    """A CA and a server certificate for ``names`` and ``ips``, as PEM files in
    ``directory``: (ca, cert, key). The CA's file is ``directory/ca.pem``."""
    ca = CertAuthority(directory)
    server = ca.server(names, ips, stem="cert")
    return ca.cert, server.cert, server.key


test_ca.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test
