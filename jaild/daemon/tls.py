"""The network listeners (``daemon.listen = ["tls://HOST:PORT"]``): mutual TLS in front of
the same protocol the Unix socket speaks.

Theory of operation
-------------------
A TCP connection is accepted by a :class:`_Door`, which reads nothing itself: it hands the
connection to :meth:`TlsListeners._handshake`, which runs the TLS handshake
(``loop.start_tls``) with the context current at that moment -- so a renewed certificate
(:meth:`TlsListeners.reload`: the files changed, or SIGHUP) is served to every connection
accepted after it, and a connection mid-handshake keeps the one it began with.

The context admits TLS 1.3 only and requires a client certificate verified against
``tls.client_ca`` and the files of ``tls.scoped_client_cas`` together (OpenSSL checks the
chain and its validity dates). A handshake that fails
-- no certificate, another CA, expired or not yet valid, an older TLS version, bytes that are
not TLS at all, or nothing within ``limits.handshake_timeout_s`` -- is refused there: it
never reaches the protocol. Each refusal is audited (the client's address and OpenSSL's
reason: for a certificate that failed verification, OpenSSL keeps no copy of it to show)
and counted (``jaild_refused_requests_total{code}``, ``jaild_tls_refused_connections_total
{reason}``); at most ``limits.max_connections`` handshakes run at once, and past that a new
connection is closed at once.

Which principals a CA may name (:class:`ClientTrust`): a CA of ``tls.client_ca``, any; a CA
of ``tls.scoped_client_cas``, only those its pattern matches -- one CA per tenant
(a Kubernetes namespace's own cert-manager Issuer) cannot mint another tenant's principal.
OpenSSL does not say which anchor verified a chain (Python's ``ssl`` on 3.11 gives no chain),
so where any CA is scoped the daemon requires the certificate to be issued directly by a
listed CA and judges it by the CAs that did: a certificate no listed CA issued directly (a
scoped CA's key made an intermediate of its own, say), or whose principal no issuing CA
may name, is refused right after the handshake (``tls_reason`` ``ca_removed`` or
``out_of_scope``), before the protocol begins.

A connection whose handshake succeeded becomes a :class:`~jaild.daemon.server.
ServedConnection` like any Unix-socket one, with a :class:`~jaild.daemon.core.peer.Peer`
for its certificate's principal (:func:`principal_of`: its URI SAN, else its subject): the
daemon's door (``access.principals``, connection limits per principal and in all) admits
or refuses it with an ``Error`` frame before ``Welcome``, exactly as it does a uid, and the
pre-``Hello`` limits (64 KiB frames, the handshake timeout) are the same.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import os
import ssl
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from jaild.daemon.config import DaemonConfig, parse_listener
from jaild.daemon.core.peer import Peer
from jaild.errors import (
    PermissionDenied,
    ReadTimeout,
    RemoteProtocolError,
    StartupError,
    UnsupportedVersion,
)
from jaild.policy.schema import principal_matches

if typing.TYPE_CHECKING:
    from jaild.daemon.observe.metrics import Metrics


class Server(typing.Protocol):
    """What the listeners need of the daemon (:class:`jaild.daemon.server.Daemon`)."""

    @property
    def stopping(self) -> bool: ...

    @property
    def metrics(self) -> Metrics: ...

    def refused(self, peer: Peer, code: str, message: str, **extra: typing.Any) -> bool: ...

    def serve_connection(
        self, transport: asyncio.Transport, peer: Peer, pending: _Pending
    ) -> Served: ...


class Served(typing.Protocol):
    """A served connection, as the listeners end one (:class:`jaild.daemon.server.
    ServedConnection`)."""

    closed: bool
    peer: Peer

    def send_error(self, err: typing.Any, ref: int | None = None,
                   job_id: str | None = None) -> None: ...

    def close(self, why: str = ...) -> None: ...


@dataclass
class _Live:
    """A connection served over TLS, with the certificate it was let in with: it ends when
    that certificate expires or its CA leaves ``tls.client_ca``."""

    session: Served
    leaf: x509.Certificate
    principal: str
    address: str
    timer: asyncio.TimerHandle | None = None

log = logging.getLogger("jaild")


def principal_of(der: bytes) -> str:
    """The principal a verified client certificate names: its URI SAN (the first one; a
    SPIFFE ID has exactly one), else its subject as RFC 4514 text (``CN=ci,O=example``)."""
    cert = x509.load_der_x509_certificate(der)
    with contextlib.suppress(x509.ExtensionNotFound):
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        uris = san.value.get_values_for_type(x509.UniformResourceIdentifier)
        if uris:
            return str(uris[0])
    return cert.subject.rfc4514_string()


@dataclass(frozen=True)
class Anchor:
    """A CA that signs clients, and which principals its certificates may name."""

    ca: x509.Certificate
    principals: tuple[str, ...] | None
    """Glob patterns (``tls.scoped_client_cas``); None: any (``tls.client_ca``)."""
    source: str
    """The setting and file it came from, for messages."""


@dataclass(frozen=True)
class ClientTrust:
    """The CAs that sign clients (``tls.client_ca`` and ``tls.scoped_client_cas``), each
    with the principals it may name. Pure: :meth:`refusal` judges a verified certificate."""

    anchors: tuple[Anchor, ...]

    @property
    def scoped(self) -> bool:
        """Is any CA limited to some principals? Then every certificate is judged by the
        CAs that issued it directly, at the handshake."""
        return any(a.principals is not None for a in self.anchors)

    def pem(self) -> str:
        """Every CA, for OpenSSL's verification (which principal a CA may name is checked
        after it, by :meth:`refusal`)."""
        return "".join(a.ca.public_bytes(serialization.Encoding.PEM).decode()
                       for a in self.anchors)

    def refusal(self, leaf: x509.Certificate, principal: str) -> tuple[str, str] | None:
        """None if ``leaf`` (verified), naming ``principal``, may be served; else (reason,
        what is wrong): ``ca_removed``, no CA listed issued it directly; ``out_of_scope``,
        none of the CAs that did may name ``principal``."""
        issuers = [a for a in self.anchors if _issued_by(leaf, a.ca)]
        if not issuers:
            return "ca_removed", (
                "no CA of tls.client_ca or tls.scoped_client_cas issued the client "
                f"certificate ({leaf.issuer.rfc4514_string()}) directly")
        if any(a.principals is None or principal_matches(a.principals, principal)
               for a in issuers):
            return None
        allowed = sorted({p for a in issuers for p in a.principals or ()})
        return "out_of_scope", (
            f"the client certificate names {principal!r}, and its CA "
            f"({issuers[0].ca.subject.rfc4514_string()}, {issuers[0].source}) may name only "
            f"{', '.join(allowed)}")


def scoped_entry(entry: str) -> tuple[str, str]:
    """``"FILE=PATTERN"`` (``tls.scoped_client_cas``) -> (file, pattern)."""
    path, _, pattern = entry.partition("=")
    return path, pattern


def load_client_trust(client_ca: str, scoped: typing.Sequence[str] = ()) -> ClientTrust:
    """The CAs of ``client_ca`` (any principal) and of each ``scoped`` ``"FILE=PATTERN"``.

    Raises:
        StartupError: a file cannot be read, holds no certificate, or a CA is both in
            ``client_ca`` and scoped (where it could name any principal all the same).
    """
    anchors: list[Anchor] = []
    files: list[tuple[str, tuple[str, ...] | None, str]] = []
    if client_ca:
        files.append((client_ca, None, f"tls.client_ca {client_ca}"))
    patterns: dict[str, list[str]] = {}
    for entry in scoped:
        path, pattern = scoped_entry(entry)
        patterns.setdefault(path, []).append(pattern)
    for path, found in patterns.items():
        files.append((path, tuple(found), f"tls.scoped_client_cas {path}"))
    for path, principals, source in files:
        try:
            cas = x509.load_pem_x509_certificates(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise StartupError(f"{source}: cannot be used: {exc}") from None
        anchors += [Anchor(ca, principals, source) for ca in cas]
    unscoped = {_identity(a.ca) for a in anchors if a.principals is None}
    for a in anchors:
        if a.principals is not None and _identity(a.ca) in unscoped:
            raise StartupError(
                f"{a.source}: the CA {a.ca.subject.rfc4514_string()} is in tls.client_ca "
                "too, where it may name any principal: take it out of one of them")
    return ClientTrust(tuple(anchors))


def _identity(ca: x509.Certificate) -> tuple[bytes, bytes]:
    """A CA as a verifier sees it: its name and key (a renewal with the same key is the
    same CA)."""
    return ca.subject.public_bytes(), ca.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def server_context(cert: str, key: str, trust: ClientTrust) -> ssl.SSLContext:
    """TLS 1.3 only, a client certificate required and verified against ``trust``'s CAs.

    Raises:
        StartupError: a file cannot be read or used (named, with OpenSSL's reason).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.options |= ssl.OP_NO_TICKET  # no resumption: every connection shows its certificate
    what = f"tls.cert {cert} / tls.key {key}"
    try:
        ctx.load_cert_chain(cert, key)
        what = "tls.client_ca / tls.scoped_client_cas"
        ctx.load_verify_locations(cadata=trust.pem())
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise StartupError(f"{what}: cannot be used: {exc}") from None
    return ctx


_REASONS = (
    # (what OpenSSL's message contains, our reason, the wire code)
    ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "no_certificate", PermissionDenied),
    ("CERTIFICATE_REQUIRED", "no_certificate", PermissionDenied),
    ("certificate has expired", "expired", PermissionDenied),
    ("certificate is not yet valid", "not_yet_valid", PermissionDenied),
    ("unable to get local issuer certificate", "unknown_ca", PermissionDenied),
    ("self-signed certificate", "unknown_ca", PermissionDenied),
    ("self signed certificate", "unknown_ca", PermissionDenied),
    ("certificate signature failure", "unknown_ca", PermissionDenied),
    ("UNSUPPORTED_PROTOCOL", "protocol_version", UnsupportedVersion),
    ("NO_PROTOCOLS_AVAILABLE", "protocol_version", UnsupportedVersion),
    ("VERSION_TOO_LOW", "protocol_version", UnsupportedVersion),
    ("WRONG_VERSION_NUMBER", "not_tls", RemoteProtocolError),
    ("HTTP_REQUEST", "not_tls", RemoteProtocolError),
    ("PACKET_LENGTH_TOO_LONG", "not_tls", RemoteProtocolError),
    ("RECORD_LAYER_FAILURE", "not_tls", RemoteProtocolError),
)


def refusal_reason(exc: BaseException) -> tuple[str, type[Exception], str]:
    """(reason, error class, OpenSSL's words) for a failed handshake."""
    if isinstance(exc, TimeoutError) or (  # asyncio says so with a ConnectionAbortedError
        isinstance(exc, ConnectionAbortedError) and "taking longer" in str(exc)
    ):
        return "handshake_timeout", ReadTimeout, "no TLS handshake within the handshake timeout"
    text = str(exc) or type(exc).__name__
    for needle, reason, cls in _REASONS:
        if needle in text:
            return reason, cls, text
    return "handshake_failed", RemoteProtocolError, text


@dataclass
class _Files:
    """The files a context is made of (the certificate, its key, the clients' CAs), and
    when each last changed."""

    paths: tuple[str, ...]

    def stamp(self) -> tuple[tuple[int, int], ...]:
        out = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                out.append((-1, -1))
            else:
                out.append((st.st_mtime_ns, st.st_ino))
        return tuple(out)


class _Door(asyncio.Protocol):
    """A TCP connection just accepted: handed to the TLS handshake, read by nothing else."""

    def __init__(self, listeners: TlsListeners) -> None:
        self.listeners = listeners

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.listeners.accepted(typing.cast(asyncio.Transport, transport))


class _Pending(asyncio.Protocol):
    """The TLS connection's protocol from its handshake's end until it is served: what
    arrives meanwhile (a client's Hello right behind its Finished) is kept."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False
        self.lost: tuple[Exception | None] | None = None

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = (exc,)


class TlsListeners:
    """The daemon's network listeners (see the module docstring)."""

    def __init__(self, config: DaemonConfig, daemon: Server) -> None:
        self.config = config
        self.daemon = daemon
        scoped = config.tls_scoped_client_cas
        self.files = _Files((config.tls_cert, config.tls_key,
                             *([config.tls_client_ca] if config.tls_client_ca else []),
                             *dict.fromkeys(scoped_entry(e)[0] for e in scoped)))
        self.trust, self.context = self._load()
        self._stamp = self.files.stamp()
        self.servers: list[asyncio.AbstractServer] = []
        self.addresses: list[tuple[str, int]] = []  # where each listener listens (port 0: chosen)
        self.handshakes: set[asyncio.Task[None]] = set()
        self.live: dict[int, _Live] = {}  # id(session) -> its certificate
        self.by_source: collections.Counter[str] = collections.Counter()  # handshakes per host
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen on every ``daemon.listen`` address.

        Raises:
            StartupError: an address cannot be listened on.
        """
        loop = asyncio.get_running_loop()
        for entry in self.config.listen:
            host, port = parse_listener(entry)
            try:
                server = await loop.create_server(
                    lambda: _Door(self), host or None, port, reuse_address=True, backlog=1024
                )
            except OSError as exc:
                self.close()
                raise StartupError(
                    f"daemon.listen {entry}: cannot listen: {exc.strerror}"
                ) from None
            self.servers.append(server)
            for sock in server.sockets:
                bound = sock.getsockname()[:2]
                self.addresses.append(bound)
                shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
                log.info("listening on tls://%s:%d (mutual TLS)", shown, bound[1])
        if self.config.tls_reload_s > 0:
            self._watch = loop.create_task(self._watch_files(), name="tls files")

    def close(self) -> None:
        """Stop listening; handshakes under way are abandoned."""
        for server in self.servers:
            server.close()
        self.servers.clear()
        if self._watch is not None:
            self._watch.cancel()
        for task in list(self.handshakes):
            task.cancel()
        for live in list(self.live.values()):
            self._forget(live)

    # ------------------------------------------------------------------ certificates

    def reload(self) -> bool:
        """Make a new context from the files as they are now; new connections get it. A
        context that cannot be made keeps the old one (logged). True: reloaded."""
        try:
            self.trust, self.context = self._load()
        except StartupError as exc:
            log.error("TLS certificates not reloaded, the old ones stay in use: %s", exc)
            return False
        self._stamp = self.files.stamp()
        log.info("TLS certificates reloaded (%s)", ", ".join(self.files.paths))
        self.recheck()
        return True

    def _load(self) -> tuple[ClientTrust, ssl.SSLContext]:
        config = self.config
        trust = load_client_trust(config.tls_client_ca, config.tls_scoped_client_cas)
        return trust, server_context(config.tls_cert, config.tls_key, trust)

    def recheck(self) -> None:
        """End every live connection whose certificate's CA is no longer in
        ``tls.client_ca`` or ``tls.scoped_client_cas`` (as they were read last), whose CA
        may no longer name its principal, or whose certificate has expired. A certificate
        counts as the CA's when one of the files' certificates issued it directly (the
        client's chain is not kept after the handshake: list intermediates in the file)."""
        now = datetime.datetime.now(datetime.UTC)
        for live in list(self.live.values()):
            if live.session.closed:
                self._forget(live)
            elif live.leaf.not_valid_after_utc <= now:
                self._expire(live, "expired")
            elif (refusal := self.trust.refusal(live.leaf, live.principal)) is not None:
                self._expire(live, refusal[0])

    def _expire(self, live: _Live, reason: str) -> None:
        """End ``live``'s connection: an ``Error`` first, then its jobs are cancelled and
        it closes; audited and counted as a refusal."""
        self._forget(live)
        session = live.session
        if session.closed:
            return
        why = {"expired": "its client certificate expired at "
                          f"{live.leaf.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC",
               "ca_removed": "the CA that issued its client certificate is no longer trusted "
                             "(tls.client_ca)",
               "out_of_scope": "the CA that issued its client certificate may no longer "
                               f"name {live.principal!r} (tls.scoped_client_cas)"}[reason]
        err = PermissionDenied(f"the connection from {live.address} ends: {why}")
        session.send_error(err)
        session.close(err.message)
        self.daemon.metrics.tls_refused(reason)
        if self.daemon.refused(session.peer, err.code, err.message, tls_reason=reason):
            log.warning("%s", err.message)

    def _forget(self, live: _Live) -> None:
        self.live.pop(id(live.session), None)
        if live.timer is not None:
            live.timer.cancel()

    async def _watch_files(self) -> None:
        while True:
            await asyncio.sleep(self.config.tls_reload_s)
            stamp = self.files.stamp()
            if stamp != self._stamp:
                self._stamp = stamp  # a broken file is reported once, not every period
                if self.reload():
                    continue
            for live in list(self.live.values()):  # the closed ones' entries go
                if live.session.closed:
                    self._forget(live)

    # ------------------------------------------------------------------ connections

    def accepted(self, transport: asyncio.Transport) -> None:
        address = _address(transport)
        source = _source(transport)
        if self.daemon.stopping or len(self.handshakes) >= self.config.max_connections:
            transport.abort()  # past the limit: before a byte of TLS is spent on it
            self._refused(address, "busy", PermissionDenied, "too many TLS handshakes at once")
            return
        if self.by_source[source] >= self.config.max_handshakes_per_source:
            transport.abort()
            self._refused(address, "busy", PermissionDenied,
                          f"{self.config.max_handshakes_per_source} TLS handshakes from "
                          f"{source} at once already (limits.max_handshakes_per_source)")
            return
        self.by_source[source] += 1
        task = asyncio.get_running_loop().create_task(self._handshake(transport, address))
        self.handshakes.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self.handshakes.discard(task)
            self.by_source[source] -= 1
            if not self.by_source[source]:
                del self.by_source[source]

        task.add_done_callback(done)

    async def _handshake(self, transport: asyncio.Transport, address: str) -> None:
        loop = asyncio.get_running_loop()
        pending = _Pending()
        try:
            tls = await loop.start_tls(
                transport, pending, self.context, server_side=True,
                ssl_handshake_timeout=self.config.handshake_timeout_s,
            )
        except asyncio.CancelledError:
            transport.abort()
            raise
        except Exception as exc:
            transport.abort()
            reason, cls, text = refusal_reason(exc)
            self._refused(address, reason, cls, text)
            return
        if tls is None:  # the connection went away during the handshake
            transport.abort()
            return
        try:
            der = tls.get_extra_info("ssl_object").getpeercert(binary_form=True)
            name = principal_of(der)
        except Exception as exc:  # verified, yet unreadable: refused like a bad one
            tls.abort()
            self._refused(address, "handshake_failed", PermissionDenied,
                          f"the client certificate cannot be read: {exc}")
            return
        leaf = x509.load_der_x509_certificate(der)
        refusal = self.trust.refusal(leaf, name) if self.trust.scoped else None
        if refusal is not None:  # before a byte of the protocol: refused as in the handshake
            tls.abort()
            self._refused(address, refusal[0], PermissionDenied, refusal[1])
            return
        peer = Peer.of_certificate(name, address)
        session = self.daemon.serve_connection(tls, peer, pending)
        live = _Live(session, leaf, name, address)
        left = live.leaf.not_valid_after_utc.timestamp() - time.time()
        live.timer = loop.call_later(max(0.0, left), self._expire, live, "expired")
        self.live[id(session)] = live

    def _refused(self, address: str, reason: str, cls: Callable[[str], Exception],
                 text: str) -> None:
        err = cls(f"TLS handshake from {address} refused: {reason}: {text}")
        code = getattr(err, "code", "permission_denied")
        self.daemon.metrics.tls_refused(reason)
        peer = Peer.of_certificate("", address)
        if self.daemon.refused(peer, code, str(err), tls_reason=reason):
            log.warning("%s", err)


def _issued_by(leaf: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _source(transport: asyncio.BaseTransport) -> str:
    """The host a connection comes from (its address without the port)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


def _address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = peer[0]
        return f"[{host}]:{peer[1]}" if ":" in str(host) else f"{host}:{peer[1]}"
    return str(peer)


def replay(connection: asyncio.Protocol, pending: _Pending) -> None:
    """Hand what arrived before the connection was served to it, in order."""
    for data in pending.data:
        connection.data_received(data)
    if pending.eof:
        connection.eof_received()
    if pending.lost is not None:
        connection.connection_lost(pending.lost[0])


__all__ = ["Anchor", "ClientTrust", "TlsListeners", "load_client_trust", "principal_of",
           "refusal_reason", "replay", "scoped_entry", "server_context"]
