"""How a client reaches a daemon: :class:`Transport`, and the stream it opens.

A :class:`Transport` is the one record of a client's connection options -- TLS material,
the name the daemon's certificate must hold, the connect and liveness timeouts --
accepted by :class:`~jaild.client.AsyncClient`, :class:`~jaild.client.Client`,
:class:`~jaild.fleet.AsyncFleet` and :class:`~jaild.fleet.Fleet` (``transport=``); a fleet
uses it for each of its connections. The address stays apart from it (a fleet has many).

:class:`Wire` is a client's framed connection to its daemon below its API: the handshake,
framing both ways, liveness. :func:`open_stream` opens the stream it runs over, to a Unix
socket or over TLS, and translates the failures a caller can act on into
``DaemonUnavailable`` with what to do; :class:`Link` is the asyncio protocol that hands what
the daemon sends to the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from jaild.address import TLS_ENV, parse_address
from jaild.errors import (
    ConnectionLost,
    DaemonUnavailable,
    JaildError,
    PermissionDenied,
    RemoteProtocolError,
    error_from_wire,
)
from jaild.protocol import CLOSED, NEED_DATA, Connection, Role
from jaild.protocol.messages import MAX_PAYLOAD_BYTES, Error, Hello, Message, Ping, Pong, Welcome


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


MAX_FRAME = MAX_PAYLOAD_BYTES + (16 << 20)
"""The largest frame a client takes from its daemon (a payload and its record)."""


class Wire:
    """One client's framed connection to its daemon, below the client's API: opening it
    (the stream, TLS, ``Hello`` and ``Welcome``), framing both ways, and liveness -- an
    idle daemon is pinged every third of ``transport.liveness_timeout_s`` and given up on
    after all of it (PROTOCOL.md section 8).

    Every message after ``Welcome`` goes to ``deliver``, in the loop iteration that read
    it; the connection's end (the daemon closed it, it broke, sent garbage or fell silent)
    goes to ``ended``, as a ``ConnectionLost``.

    Raises:
        ValueError: TLS material in ``transport`` for an address that is not ``tls://``.
        DaemonUnavailable: a ``tls://`` address without a usable certificate and key.
    """

    def __init__(self, address: str, transport: Transport, *, sock: socket.socket | None,
                 deliver: Callable[[Message], None],
                 ended: Callable[[JaildError], None]) -> None:
        self.address = address
        self.transport = transport
        self.kind, host, self.port = parse_address(address)
        self.host = host if self.kind == "tls" else ""
        self.socket_path = host if self.kind == "unix" else ""
        self._tls: ssl.SSLContext | None = None
        if self.kind == "tls" and sock is None:
            self._tls = transport.context()
        elif transport.uses_tls_material():
            raise ValueError(f"cert, key, ca and tls are for a tls:// address, not {address}")
        self.server_name = transport.name_for(self.host) if self.kind == "tls" else ""
        self._sock = sock
        self._deliver = deliver
        self._on_end = ended
        self._conn = Connection(Role.CLIENT, MAX_FRAME)
        self._stream: asyncio.Transport | None = None
        self._link: Link | None = None
        self._welcome: asyncio.Future[Message | None] | None = None  # during the handshake
        self._last_read = 0.0
        self._pings = 0
        self._timer: asyncio.TimerHandle | None = None
        self._watching = True  # until the end: no timer set after it

    async def open(self, hello: Hello) -> Welcome:
        """Connect, send ``hello`` and return the daemon's ``Welcome``; then watch liveness.

        Raises:
            DaemonUnavailable: nobody answers; PermissionDenied: the daemon refused this
                client's certificate; ConnectionLost: no ``Welcome`` in time, or the
                connection ended during the handshake; the daemon's refusal (an ``Error``
                instead of ``Welcome``) as its exception.
        """
        self._welcome = asyncio.get_running_loop().create_future()
        self._stream, self._link = await open_stream(
            self.address, lambda: Link(self._received, self._ended), sock=self._sock,
            tls=self._tls, server_name=self.server_name,
            connect_timeout_s=self.transport.connect_timeout_s)
        timeout_s = self.transport.connect_timeout_s
        try:
            if not self._welcome.done():  # else refused at the door before our Hello (uvloop
                self._stream.write(self._conn.send(hello))  # reads at once)
            try:
                async with asyncio.timeout(timeout_s or None):
                    welcome = await self._welcome
            except TimeoutError:
                raise ConnectionLost(f"no Welcome from {self.address} within {timeout_s:g} s",
                                     reason="timeout") from None
            except ConnectionLost as exc:
                if self._tls is not None and exc.reason in ("closed", "reset"):
                    # TLS 1.3: the daemon judges our certificate after our side of the
                    # handshake is done, and drops the connection if it refuses it
                    raise tls_refusal(exc, self.address) from None
                raise
            if isinstance(welcome, Error):
                raise error_from_wire(welcome.code, welcome.message)
            if not isinstance(welcome, Welcome):
                raise ConnectionLost("the daemon closed the connection during the handshake")
        except BaseException:
            self._stream.close()
            await self._link.closed()
            raise
        finally:
            self._welcome = None
        self._watch()
        return welcome

    async def send(self, msg: Message) -> None:
        """Frame and write ``msg``; wait only while the daemon is not reading."""
        if self._stream is None or self._link is None:
            raise ConnectionLost("not connected; call connect() or use 'async with'")
        self._stream.write(self._conn.send(msg))
        await self._link.drain()  # returns at once unless the daemon is not reading

    async def close(self) -> None:
        """Close the connection and wait until it is closed."""
        self.stop_watching()
        if self._stream is not None:
            self._stream.close()
            assert self._link is not None
            await self._link.closed()

    async def closed(self) -> None:
        """Until the connection has closed (at once if it never opened)."""
        if self._link is not None:
            await self._link.closed()

    def stop_watching(self) -> None:
        """No more liveness pings (the connection is over, for whatever reason)."""
        self._watching = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _watch(self) -> None:
        bound = self.transport.liveness_timeout_s
        if bound <= 0 or not self._watching or self._stream is None:
            return
        idle = time.monotonic() - self._last_read
        if idle >= bound:
            self._ended(ConnectionLost(
                f"nothing from the daemon at {self.address} for {idle:.1f} s "
                f"(liveness_timeout_s {bound:g}): it is dead, frozen or cut off",
                reason="timeout",
            ))
            self._stream.abort()
            return
        period = bound / 3
        if idle >= period:
            self._pings += 1
            with contextlib.suppress(JaildError):
                self._stream.write(self._conn.send(Ping(seq=self._pings)))
            wait = min(period, bound - idle)
        else:
            wait = period - idle
        self._timer = asyncio.get_running_loop().call_later(wait, self._watch)

    def _received(self, data: bytes) -> None:
        """Bytes from the daemon (b"": it closed the connection): every message in them is
        handled now, in the loop iteration that read them."""
        self._last_read = time.monotonic()
        try:
            self._conn.receive_data(data)
            while True:
                event = self._conn.next_event()
                if event is NEED_DATA:
                    return
                if event is CLOSED:
                    self._ended(ConnectionLost("the daemon closed the connection"))
                    return
                if isinstance(event, (Ping, Pong)):
                    if isinstance(event, Ping) and self._stream is not None:
                        self._stream.write(self._conn.send(Pong(seq=event.seq)))
                    continue
                assert isinstance(event, Message)
                if self._welcome is not None and not self._welcome.done():
                    self._welcome.set_result(event)  # Welcome, or the Error that refuses us
                else:
                    self._deliver(event)
        except RemoteProtocolError as exc:
            self._ended(ConnectionLost(f"the daemon sent invalid data: {exc.message}",
                                       reason="invalid"))
            if self._stream is not None:
                self._stream.close()

    def _ended(self, exc: JaildError) -> None:
        """The connection is over: whatever waits on it fails with ``exc``."""
        self.stop_watching()
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(exc)
        self._on_end(exc)
