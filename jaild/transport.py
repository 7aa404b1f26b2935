"""How a client reaches a daemon: :class:`Transport`, and the stream it opens.

A :class:`Transport` is the one record of a client's connection options -- TLS material,
the name the daemon's certificate must hold, the connect and liveness timeouts --
accepted by :class:`~jaild.client.AsyncClient`, :class:`~jaild.client.Client`,
:class:`~jaild.fleet.AsyncFleet` and :class:`~jaild.fleet.Fleet` (``transport=``); a fleet
uses it for each of its connections. The address stays apart from it (a fleet has many).

:func:`open_stream` opens the connection it describes, to a Unix socket or over TLS, and
translates the failures a caller can act on into ``DaemonUnavailable`` with what to do;
:class:`Link` is the asyncio protocol that hands what the daemon sends to the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from jaild.address import TLS_ENV, parse_address
from jaild.errors import ConnectionLost, DaemonUnavailable, JaildError, PermissionDenied


@dataclass(frozen=True)
class Transport:
    """How a client connects to a daemon (frozen: one may serve many clients, a fleet's).

    Over a Unix socket only the timeouts apply; ``cert``, ``key``, ``ca``, ``server_name``
    and ``tls`` are for a ``tls://HOST:PORT`` address (given with another, a ValueError).
    """

    cert: str | None = None
    """This client's certificate chain (PEM file; default: ``$JAILD_TLS_CERT``): the daemon
    serves the client as the principal the certificate names."""
    key: str | None = None
    """The certificate's private key (PEM file; default: ``$JAILD_TLS_KEY``)."""
    ca: str | None = None
    """The CA bundle (PEM) that signs the daemon's certificate (default: ``$JAILD_TLS_CA``,
    else the system's)."""
    server_name: str | None = None
    """The name the daemon's certificate must hold (default: ``$JAILD_TLS_SERVER_NAME``,
    else the address's host)."""
    tls: ssl.SSLContext | None = None
    """A ready ``ssl.SSLContext`` instead of ``cert``/``key``/``ca``."""
    liveness_timeout_s: float = 30.0
    """A daemon this client has read nothing from for this long (it pings an idle one
    every third of it) is lost -- dead, frozen or partitioned away: everything in flight
    fails with ``ConnectionLost`` (``reason = "timeout"``). 0: off."""
    connect_timeout_s: float = 30.0
    """How long connecting (and the TLS handshake, and the daemon's ``Welcome``) may take."""

    def uses_tls_material(self) -> bool:
        return bool(self.cert or self.key or self.ca or self.tls)

    def context(self) -> ssl.SSLContext:
        """The TLS context to connect with: ``tls``, else one from ``cert``/``key``/``ca``
        (or their environment variables)."""
        env = os.environ.get
        return self.tls or client_context(self.cert or env(TLS_ENV["cert"]),
                                          self.key or env(TLS_ENV["key"]),
                                          self.ca or env(TLS_ENV["ca"]))

    def name_for(self, host: str) -> str:
        """The name the daemon at ``host`` must hold in its certificate."""
        return self.server_name or os.environ.get(TLS_ENV["server_name"]) or host


class TransportOptions(TypedDict, total=False):
    """:class:`Transport`'s fields as keywords: the shorthand ``AsyncClient(address,
    cert=..., key=...)`` for ``AsyncClient(address, transport=Transport(cert=..., ...))``,
    kept for one release (tests/unit/test_client_api.py holds the two lists equal)."""

    cert: str | None
    key: str | None
    ca: str | None
    server_name: str | None
    tls: ssl.SSLContext | None
    liveness_timeout_s: float
    connect_timeout_s: float


def transport_of(transport: Transport | None, options: TransportOptions) -> Transport:
    """The :class:`Transport` a client was given: ``transport``, or one built from the
    shorthand keywords ``options``.

    Raises:
        TypeError: both, or a keyword that is no field of ``Transport``.
    """
    if transport is not None and options:
        raise TypeError(f"give transport= or its fields as keywords ({', '.join(options)}), "
                        "not both")
    unknown = options.keys() - {f.name for f in dataclasses.fields(Transport)}
    if unknown:
        raise TypeError(f"unexpected keyword argument {min(unknown)!r}")
    return transport if transport is not None else Transport(**options)


def client_context(cert: str | None, key: str | None, ca: str | None) -> ssl.SSLContext:
    """A client's TLS context: TLS 1.3, the daemon's certificate verified against ``ca``
    (default: the system's CAs) and its name checked, this client's certificate presented.

    Raises:
        DaemonUnavailable: no certificate or key (the daemon requires a client certificate),
            or a file that cannot be used (named): no daemon can be reached so.
    """
    if not cert or not key:
        raise DaemonUnavailable(
            "a tls:// address needs this client's certificate and key: cert= and key= "
            "($JAILD_TLS_CERT and $JAILD_TLS_KEY; --tls-cert and --tls-key on the command "
            "line): the daemon lets in no client without one"
        )
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise DaemonUnavailable(f"ca {ca}: cannot be used: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise DaemonUnavailable(f"cert {cert} / key {key}: cannot be used: {exc}") from None
    return ctx


def tls_refusal(exc: ConnectionLost, address: str) -> PermissionDenied:
    """A TLS connection dropped before ``Welcome``: the daemon refused this client's
    certificate (none, expired, not yet valid, signed by a CA it does not trust, or naming
    a principal its CA may not name) and says which only in its audit log -- a refused
    client learns nothing it could probe with."""
    return PermissionDenied(
        f"the daemon at {address} refused this client's certificate during the TLS "
        f"handshake ({exc.message}): is it signed by a CA the daemon trusts "
        "(tls.client_ca, or tls.scoped_client_cas for the name it carries), and valid now? "
        "The daemon's audit log names the reason."
    )


async def open_stream(
    address: str, link: Callable[[], Link], *, sock: socket.socket | None = None,
    tls: ssl.SSLContext | None = None, server_name: str = "", connect_timeout_s: float = 30.0,
) -> tuple[asyncio.Transport, Link]:
    """The connection to the daemon at ``address``: over ``sock`` if given, else over TLS
    with ``tls`` (a ``tls://`` address), else to its Unix socket.

    Raises:
        DaemonUnavailable: nobody answers, or the TLS handshake failed (saying why and
            what to check).
    """
    loop = asyncio.get_running_loop()
    if sock is not None:
        return await loop.create_unix_connection(link, sock=sock)
    _, host, port = parse_address(address)
    if tls is not None:
        try:
            async with asyncio.timeout(connect_timeout_s or None):
                return await loop.create_connection(
                    link, host, port, ssl=tls, server_hostname=server_name or host,
                    ssl_handshake_timeout=connect_timeout_s or None,
                )
        except ssl.SSLCertVerificationError as exc:
            raise DaemonUnavailable(
                f"the daemon at {address} is not trusted: {exc.verify_message} "
                "(is ca= the CA that signs its certificate, and server_name its name?)"
            ) from None
        except (ssl.SSLError, ConnectionResetError) as exc:
            raise DaemonUnavailable(
                f"the TLS handshake with {address} failed: {exc} (a jaild daemon "
                "speaks TLS 1.3 only, and requires a client certificate)"
            ) from None
        except TimeoutError:
            raise DaemonUnavailable(
                f"no answer from {address} within {connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise DaemonUnavailable(
                f"no jaild daemon at {address} ({exc.strerror or exc})"
            ) from None
    try:
        return await loop.create_unix_connection(link, host)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise DaemonUnavailable(
            f"no jaild daemon at {host} ({exc.strerror}); start one with "
            "'jaild serve' or set JAILD_SOCKET"
        ) from None
    except PermissionError:
        raise DaemonUnavailable(
            f"permission denied connecting to {host}; ask the operator to add "
            "you to the daemon's socket group"
        ) from None


class Link(asyncio.Protocol):
    """A client's connection, as asyncio's protocol: what the daemon sends is handed to
    ``received`` as it is read (b"": the daemon closed its side), the connection's end to
    ``ended``; writes wait only while the daemon is not reading."""

    def __init__(self, received: Callable[[bytes], None],
                 ended: Callable[[JaildError], None]) -> None:
        self._received = received
        self._ended = ended
        self._paused = False
        self._drainers: list[asyncio.Future[None]] = []
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._received(data)

    def eof_received(self) -> bool:
        self._received(b"")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            lost = ConnectionLost("the connection was closed")
        else:
            lost = ConnectionLost(f"connection to the daemon lost: {exc}", reason="reset")
            lost.__cause__ = exc
        self._ended(lost)
        self._paused = False
        self._wake()
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake()

    async def drain(self) -> None:
        """Until the transport's buffer is below its low-water mark."""
        if self._paused:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._drainers.append(waiter)
            await waiter

    async def closed(self) -> None:
        await asyncio.shield(self._lost)

    def _wake(self) -> None:
        waiters, self._drainers = self._drainers, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
