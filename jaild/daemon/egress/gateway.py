"""The egress gateway: a job's HTTP(S) proxy, served by the daemon on the host.

Theory of operation
-------------------
A jail in ``network.mode = "egress"`` has no interface but loopback. Its one way out is a
listening socket made inside its network namespace and handed to the daemon (an
:class:`EgressDoor` serves it): the jail's HTTP clients reach it as ``HTTP_PROXY`` /
``HTTPS_PROXY``, and everything past it happens on the host, under the policy's rules
(:mod:`jaild.policy.egress`):

1. The request head is read with h11 -- bounded in size (:data:`MAX_HEAD_BYTES`) and time
   (``head_timeout_s``): a slow or oversized head gets ``400``/``431`` and the connection
   ends; it holds nothing of another job's.
2. ``CONNECT host:port`` (HTTPS) or an absolute-form request (``GET http://host/...``,
   plain HTTP) names the target. Anything else (an origin-form request, an ``https://``
   absolute form) is refused ``400``: this is a proxy, not a server.
3. The job's request quota, then the allow-list (name and port), are checked before any
   name is resolved; a refusal is a ``403`` whose body says why and what is allowed, in
   words a model can act on.
4. The name is resolved here, once; with ``deny_private`` every address is checked, and
   the gateway dials the addresses it checked, in order -- never the name again, so a name
   that answers differently the second time (DNS rebinding) is never asked twice.
5. ``CONNECT``: ``200``, then bytes both ways, untouched (TLS stays end to end; the
   jail's client checks the certificate chain). Plain HTTP: the request is re-framed by
   h11 towards the host (hop-by-hop and ``Proxy-*`` headers dropped) and the response
   back, one request per connection (``Connection: close``) -- a second request smuggled
   behind the first is never read.
6. Every byte both ways counts against the job's ``max_bytes``; past it the connection is
   cut. Each request is reported to ``observe`` (host, port, method, status, bytes; never
   a header value) for the audit log, and summed in :class:`EgressUsage` for the record.

7. Information flow (:mod:`jaild.policy.flow`): after the allow-list, the labels the job
   holds *now* are checked against their ``[[flow.sink]]`` egress rules -- a refusal is a
   ``403`` (kind ``flow``) naming the label and the rule. When a tool reply brings the job a
   label (before the jail can read it), :meth:`EgressDoor.recheck` cuts every connection
   already open to a host that label closes: a tunnel opened before the read carries nothing
   after it. Both are the door's :class:`~jaild.daemon.egress.flowwatch.FlowWatch`.

One door per job: its quotas and usage are the job's (a session's per run).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import logging
import os
import socket
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import h11

from jaild.daemon.egress.flowwatch import FlowWatch, OnRefused
from jaild.daemon.jails.netns import made_in
from jaild.errors import EgressRefusal as _Refusal
from jaild.policy.egress import Address, EgressRules, parse_host
from jaild.policy.flow import FlowRules

if TYPE_CHECKING:
    from jaild.daemon.egress.ca import EgressCA

log = logging.getLogger("jaild")

MAX_HEAD_BYTES = 16384
MAX_REASON_CHARS = 1024
MAX_CONNECTIONS = 32  # a job's connections through its door at once
CHUNK = 65536
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade",
})

_SUMMARY: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("egress_summary")
"""The summary of the connection a task serves (its tasks share it): bytes are counted there
too, per request, for the audit."""

Resolver = Callable[[str, int], Awaitable[list[Address]]]
Connector = Callable[
    [Address, int, float], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
]


async def resolve(host: str, port: int) -> list[Address]:
    """The host's addresses, as the host's resolver gives them (the gateway's default)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    out: list[Address] = []
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if address not in out:
            out.append(address)
    return out


async def connect(
    address: Address, port: int, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to exactly this address (the gateway's default)."""
    async with asyncio.timeout(timeout_s):
        return await asyncio.open_connection(str(address), port, limit=CHUNK)


async def dial(
    host: str, port: int, rules: EgressRules, policy: str, resolver: Resolver,
    connector: Connector, timeout_s: float,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``host:port`` (gateway step 4): resolve once, check every address
    against ``rules`` (``egress.deny_private``), dial the checked ones in order -- never the
    name again.

    Raises:
        EgressRefusal: ``502`` unresolved or unreachable, ``403`` every address refused.
    """
    try:
        literal: Address | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    try:
        addresses = [literal] if literal is not None else await resolver(host, port)
    except OSError as exc:
        raise _Refusal(502, "unresolved", f"cannot resolve {host}: {exc}") from None
    allowed = []
    reasons = []
    for address in addresses:
        why = rules.address_refusal(address)
        if why is None:
            allowed.append(address)
        else:
            reasons.append(why)
    if not allowed:
        why = "; ".join(reasons) or "it has no address"
        raise _Refusal(
            403, "private_address",
            f"egress to {host}:{port} is not allowed by policy {policy!r}: {why} "
            "(egress.deny_private)",
        )
    failures = []
    for address in allowed:
        try:
            return await connector(address, port, timeout_s)
        except (OSError, TimeoutError) as exc:
            failures.append(f"{address}: {exc or type(exc).__name__}")
    raise _Refusal(502, "unreachable", f"cannot connect to {host}:{port}: "
                   + "; ".join(failures))


def listen_in(netns: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP listener on ``127.0.0.1:port`` inside the network namespace at ``netns`` (such
    as ``/proc/PID/ns/net`` of a jail), for the daemon to serve.

    A socket belongs to the namespace it was made in, whoever holds it later: the jail
    reaches this one on its own loopback, and nothing else of the host, while the daemon
    accepts on it from here. ``setns`` changes the namespace of one thread, so a thread of
    its own enters the jail's namespace, makes the socket and ends
    (:func:`jaild.daemon.jails.netns.made_in`)."""
    def listen() -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", port))
            listener.listen(backlog)
        except OSError:
            listener.close()
            raise
        return listener

    fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return made_in(fd, listen, netns)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class EgressQuota:
    """A job's egress allowance (``egress.max_requests``, ``egress.max_bytes``)."""

    max_requests: int = 200
    max_bytes: int = 100 << 20


@dataclass
class EgressUsage:
    """What a job's egress used: for its record."""

    requests: int = 0
    bytes_out: int = 0  # jail -> host
    bytes_in: int = 0  # host -> jail
    hosts: set[str] = field(default_factory=set)
    refused: Counter[str] = field(default_factory=Counter)  # why -> how many

    @property
    def bytes(self) -> int:
        return self.bytes_out + self.bytes_in

    def to_wire(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "hosts": sorted(self.hosts),
            "refused": dict(self.refused),
        }


class EgressDoor:
    """One job's way out (see the module docstring).

    Args:
        rules: the policy's egress rules.
        quota: the job's allowance.
        policy: the policy's name, for messages.
        observe: called once per request with its summary (for the audit log).
        resolver, connector: how names are resolved and addresses dialled (tests give
            their own; the defaults use the host's resolver and TCP).
    """

    def __init__(
        self,
        rules: EgressRules,
        quota: EgressQuota,
        policy: str,
        *,
        observe: Callable[[dict[str, Any]], None] = lambda _: None,
        resolver: Resolver = resolve,
        connector: Connector = connect,
        head_timeout_s: float = 10.0,
        connect_timeout_s: float = 10.0,
        idle_timeout_s: float = 300.0,
        max_connections: int = MAX_CONNECTIONS,
        injections: Mapping[str, Sequence[tuple[str, str]]] | None = None,
        ca: EgressCA | None = None,
        upstream_tls: ssl.SSLContext | None = None,
        flow: FlowRules | None = None,
        labels: Callable[[], frozenset[str]] = frozenset,
        on_flow_refused: OnRefused = lambda *_: None,
    ) -> None:
        self.rules = rules
        self._watch = FlowWatch(rules, flow, labels, on_flow_refused)
        # canonical host -> (header, value): added on the host side, never seen in the jail
        self._injections = {
            str(parse_host(h)): [(k.lower().encode(), v.encode()) for k, v in headers]
            for h, headers in (injections or {}).items()
        }
        if self._injections and ca is None:
            raise ValueError("injecting credentials needs the interception CA")
        self._ca = ca
        self._upstream_tls = upstream_tls or ssl.create_default_context()
        self.quota = quota
        self.policy = policy
        self.usage = EgressUsage()
        self._observe = observe
        self._resolve = resolver
        self._connect = connector
        self._head_timeout_s = head_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self.open_connections = 0
        self.peak_connections = 0

    # ------------------------------------------------------------------ serving

    async def serve(self, listener: socket.socket) -> None:
        """Accept the jail's connections on ``listener`` until cancelled; each is served in
        a task of this door's group (cancelled with it). At most ``max_connections`` at
        once: past them the door stops accepting (the kernel's backlog holds the rest), so
        a job cannot spend the daemon's descriptors."""
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as connections:
            while True:
                await self._slots.acquire()
                try:
                    sock, _ = await loop.sock_accept(listener)
                except BaseException:
                    self._slots.release()
                    raise
                connections.create_task(self._serve_socket(sock))

    async def _serve_socket(self, sock: socket.socket) -> None:
        self.open_connections += 1
        self.peak_connections = max(self.peak_connections, self.open_connections)
        try:
            reader, writer = await _server_streams(sock)
            try:
                await self.handle(reader, writer)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        except Exception:  # a jaild bug: this connection ends, the door keeps serving
            log.exception("egress connection of policy %s failed inside jaild", self.policy)
        finally:
            self.open_connections -= 1
            self._slots.release()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection from the jail: one request, or one tunnel."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        summary: dict[str, Any] = {"policy": self.policy, "bytes_out": 0, "bytes_in": 0}
        _SUMMARY.set(summary)
        try:
            request = await self._head(conn, reader)
            summary["method"] = request.method.decode("ascii", "replace")
            if request.method == b"CONNECT":
                await self._tunnel(conn, request, reader, writer, summary)
            else:
                await self._forward(conn, request, reader, writer, summary)
        except _Refusal as refusal:
            await self._refuse(conn, writer, refusal, summary)
        except (ConnectionError, TimeoutError, h11.ProtocolError, OSError) as exc:
            summary.setdefault("error", type(exc).__name__)
        finally:
            if "method" in summary or "refused" in summary:
                self._observe(summary)

    # ------------------------------------------------------------------ steps

    async def _head(self, conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Request:
        try:
            async with asyncio.timeout(self._head_timeout_s):
                event = await _next_event(conn, reader)
            if isinstance(event, h11.Request):
                return _checked_head(event)
            raise _Refusal(400, "bad_request", "expected an HTTP request")
        except TimeoutError:
            raise _Refusal(
                408, "slow_request", f"no request head within {self._head_timeout_s:g} s"
            ) from None
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            kind = "head_too_large" if status == 431 else "bad_request"
            raise _Refusal(status, kind, f"not a request this proxy reads: {exc}") from None

    def _admit(self, host: str, port: int, summary: dict[str, Any]) -> str:
        """The request quota, then the allow-list: before any name is resolved. Returns the
        host's canonical form (what is resolved, dialled and recorded)."""
        summary.update(host=host, port=port)
        if self.usage.requests >= self.quota.max_requests:
            raise _Refusal(
                403, "quota",
                f"egress quota reached: {self.quota.max_requests} requests per job "
                f"(policy {self.policy!r}, egress.max_requests)",
            )
        self.usage.requests += 1
        if self.usage.bytes >= self.quota.max_bytes:
            raise _Refusal(
                403, "quota",
                f"egress quota reached: {self.quota.max_bytes} bytes per job "
                f"(policy {self.policy!r}, egress.max_bytes)",
            )
        why = self.rules.target_refusal(host, port)
        if why is not None:
            raise _Refusal(
                403, "not_allowed",
                f"egress to {host}:{port} is not allowed by policy {self.policy!r}: {why}; "
                f"allowed: {self.rules.describe()}",
            )
        canonical = str(parse_host(host))
        summary["host"] = canonical
        self._watch.check(canonical, port)
        return canonical

    def recheck(self) -> None:
        """The job holds new labels: cut every open connection to a host they close
        (:meth:`FlowWatch.recheck`)."""
        cut = self._watch.recheck()
        if cut:
            self.usage.refused["flow"] += cut

    async def _dial(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await dial(host, port, self.rules, self.policy, self._resolve, self._connect,
                          self._connect_timeout_s)

    async def _tunnel(
        self,
        conn: h11.Connection,
        request: h11.Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        summary: dict[str, Any],
    ) -> None:
        host, port = _authority(request.target)
        host = self._admit(host, port, summary)
        while conn.next_event() not in (h11.PAUSED, h11.NEED_DATA):
            pass  # the request's (empty) end: h11 now waits for our answer to switch
        early = conn.trailing_data[0]  # bytes sent behind the head (a TLS hello)
        inject = self._injections.get(host)
        if inject is not None and early:
            raise _Refusal(400, "bad_request",
                           "send the TLS handshake after the proxy's answer to CONNECT")
        up_reader, up_writer = await self._dial(host, port)
        live = self._watch.track(writer, up_writer, host, port)
        try:
            self.usage.hosts.add(host)
            writer.write(conn.send(h11.Response(status_code=200, headers=[],
                                                reason=b"Connection established")) or b"")
            summary["status"] = 200
            if inject is not None:
                await self._intercept(host, port, inject, reader, writer, up_reader, up_writer,
                                      summary)
                return
            if early:
                self._count(len(early), out=True)
                up_writer.write(early)
            await self._splice(reader, writer, up_reader, up_writer, summary)
        finally:
            self._watch.forget(live)
            up_writer.close()

    async def _intercept(
        self,
        host: str,
        port: int,
        inject: list[tuple[bytes, bytes]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        summary: dict[str, Any],
    ) -> None:
        """An injection host's tunnel: the jail's TLS ends here (a certificate of the
        interception CA), one request is read, the credential added, and it goes on over
        a TLS connection of our own, checked against the host's trust store."""
        assert self._ca is not None
        summary["intercepted"] = True
        timeout = self._head_timeout_s
        await writer.start_tls(self._ca.server_context(host), ssl_handshake_timeout=timeout)
        await up_writer.start_tls(self._upstream_tls, server_hostname=host,
                                  ssl_handshake_timeout=self._connect_timeout_s)
        inner = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            request = await self._head(inner, reader)
            summary["method"] = request.method.decode("ascii", "replace")
            target = _same_origin(request, host, port)
            names = {name for name, _ in inject}
            headers = [(k, v) for k, v in request.headers
                       if k.lower() not in HOP_BY_HOP and k.lower() not in names]
            await self._exchange(
                h11.Request(method=request.method, target=target,
                            headers=[*headers, *inject, (b"connection", b"close")]),
                inner, reader, writer, up_reader, up_writer, summary,
            )
        except _Refusal as refusal:
            await self._refuse(inner, writer, refusal, summary)

    async def _forward(
        self,
        conn: h11.Connection,
        request: h11.Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        summary: dict[str, Any],
    ) -> None:
        url = urlsplit(request.target.decode("ascii", "replace"))
        if url.scheme != "http" or not url.hostname:
            raise _Refusal(
                400, "bad_request",
                "this is an egress proxy: send absolute http:// requests or CONNECT host:port "
                "(set HTTP_PROXY / HTTPS_PROXY)",
            )
        try:
            port = url.port or 80
        except ValueError:
            raise _Refusal(400, "bad_request", f"bad port in {url.netloc!r}") from None
        host = self._admit(url.hostname, port, summary)
        up_reader, up_writer = await self._dial(host, port)
        live = self._watch.track(writer, up_writer, host, port)
        try:
            self.usage.hosts.add(host)
            target = (url.path or "/") + (f"?{url.query}" if url.query else "")
            headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_BY_HOP
                       and k.lower() != b"host"]
            await self._exchange(
                h11.Request(method=request.method, target=target.encode(), headers=[
                    (b"host", url.netloc.encode()), *headers, (b"connection", b"close")]),
                conn, reader, writer, up_reader, up_writer, summary,
                # the request is all sent: nothing more of the jail's goes this way (one
                # request a connection), so a label arriving now has nothing to cut
                sent=lambda: self._watch.forget(live),
            )
        finally:
            self._watch.forget(live)
            up_writer.close()

    async def _exchange(
        self,
        request: h11.Request,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        summary: dict[str, Any],
        sent: Callable[[], None] = lambda: None,
    ) -> None:
        """``request`` (its head, re-written) to the host, the jail's body behind it
        (``sent()`` once it all is), then the host's response back to the jail."""
        up = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        head = up.send(request) or b""
        self._count(len(head), out=True)
        up_writer.write(head)
        await self._relay_body(conn, reader, up, up_writer, out=True)
        sent()
        await self._relay_response(up, up_reader, conn, writer, summary)

    async def _relay_body(
        self,
        src: h11.Connection,
        src_reader: asyncio.StreamReader,
        dst: h11.Connection,
        dst_writer: asyncio.StreamWriter,
        out: bool,
    ) -> None:
        """A message body from ``src`` to ``dst``, re-framed, until its end."""
        while True:
            async with asyncio.timeout(self._idle_timeout_s):
                event = await _next_event(src, src_reader)
            if isinstance(event, h11.Data):
                data = dst.send(h11.Data(data=event.data)) or b""
                self._count(len(data), out)
                dst_writer.write(data)
                await dst_writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                dst_writer.write(dst.send(h11.EndOfMessage()) or b"")
                return
            elif event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return

    async def _relay_response(
        self,
        up: h11.Connection,
        up_reader: asyncio.StreamReader,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        summary: dict[str, Any],
    ) -> None:
        while True:
            async with asyncio.timeout(self._idle_timeout_s):
                event = await _next_event(up, up_reader)
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                summary["status"] = event.status_code
                headers = [(k, v) for k, v in event.headers if k.lower() not in HOP_BY_HOP]
                head = conn.send(h11.Response(
                    status_code=event.status_code, reason=event.reason,
                    headers=[*headers, (b"connection", b"close")],
                )) or b""
                self._count(len(head), out=False)
                writer.write(head)
                await self._relay_body(up, up_reader, conn, writer, out=False)
                await writer.drain()
                return
            raise ConnectionError("the host closed the connection before its response")

    async def _splice(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        summary: dict[str, Any],
    ) -> None:
        """Bytes both ways until both sides are done (or the byte quota is gone)."""

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, out: bool) -> None:
            while True:
                async with asyncio.timeout(self._idle_timeout_s):
                    data = await src.read(CHUNK)
                if not data:
                    if dst.can_write_eof():
                        with contextlib.suppress(OSError):
                            dst.write_eof()
                    return
                self._count(len(data), out)
                dst.write(data)
                await dst.drain()

        try:
            async with asyncio.TaskGroup() as both:
                both.create_task(pump(reader, up_writer, True))
                both.create_task(pump(up_reader, writer, False))
        except* _Refusal as group:
            refusal = group.exceptions[0]
            assert isinstance(refusal, _Refusal)
            self.usage.refused[refusal.kind] += 1
            summary["refused"] = refusal.kind
        except* (ConnectionError, TimeoutError, OSError):
            summary.setdefault("error", "connection lost")

    def _count(self, n: int, out: bool) -> None:
        """``n`` bytes passed, jail -> host (``out``) or back; past the job's ``max_bytes``
        the connection is cut."""
        summary = _SUMMARY.get(None)
        if out:
            self.usage.bytes_out += n
            if summary is not None:
                summary["bytes_out"] += n
        else:
            self.usage.bytes_in += n
            if summary is not None:
                summary["bytes_in"] += n
        if self.usage.bytes > self.quota.max_bytes:
            raise _Refusal(
                403, "quota",
                f"egress quota reached: {self.quota.max_bytes} bytes per job "
                f"(policy {self.policy!r}, egress.max_bytes)",
            )

    async def _refuse(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        refusal: _Refusal,
        summary: dict[str, Any],
    ) -> None:
        """Count the refusal and answer it as a plain-text response, if the connection can
        still carry one."""
        self.usage.refused[refusal.kind] += 1
        summary.update(status=refusal.status, refused=refusal.kind)
        body = (refusal.message + "\n").encode()
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # mid-response or tunnelling: the cut is the answer
        with contextlib.suppress(h11.ProtocolError, ConnectionError, OSError):
            writer.write(conn.send(h11.Response(
                status_code=refusal.status,
                reason=_reason_phrase(refusal.message),
                headers=[(b"content-type", b"text/plain; charset=utf-8"),
                         (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")],
            )) or b"")
            writer.write(conn.send(h11.Data(data=body)) or b"")
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()


def _reason_phrase(message: str) -> bytes:
    """The refusal as the status line's reason phrase too: a client that drops the body of
    a refused ``CONNECT`` (urllib, requests, httpx do) still shows why ("Tunnel connection
    failed: 403 egress to ..."). Printable ASCII, at most :data:`MAX_REASON_CHARS`."""
    text = "".join(c if " " <= c <= "~" else "?" for c in message)
    return text[:MAX_REASON_CHARS].encode("ascii")


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    """``conn``'s next event, reading from ``reader`` until it has one (the caller bounds
    the time)."""
    while (event := conn.next_event()) is h11.NEED_DATA:
        conn.receive_data(await reader.read(CHUNK))
    return event


async def _server_streams(
    sock: socket.socket,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over an accepted socket, marked as the server's side (so that
    ``start_tls`` on them ends a client's TLS rather than starting one)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=CHUNK)
    made: list[asyncio.StreamWriter] = []
    protocol = asyncio.StreamReaderProtocol(reader, lambda _r, w: made.append(w))
    await loop.connect_accepted_socket(lambda: protocol, sock)
    return reader, made[0]


def _same_origin(request: h11.Request, host: str, port: int) -> bytes:
    """The origin-form target of a request inside an intercepted tunnel -- refused unless
    it names the tunnel's own host and port: a credential for one name must not travel to
    another name served at the same address (a CDN routes by ``Host``)."""
    target = request.target
    authority = next((v for k, v in request.headers if k.lower() == b"host"), b"")
    if not target.startswith(b"/"):  # absolute form: its authority is the one that counts
        url = urlsplit(target.decode("ascii", "replace"))
        authority = url.netloc.encode()
        target = ((url.path or "/") + (f"?{url.query}" if url.query else "")).encode()
    shown = authority.decode("ascii", "replace")
    try:
        named = urlsplit("//" + shown)
        same = str(parse_host(named.hostname or "")) == host and named.port in (None, port)
    except ValueError:
        same = False
    if not same:
        raise _Refusal(
            421, "misdirected",
            f"this tunnel is for {host}:{port}; a request for {shown!r} cannot use it "
            "(a host's credential never goes to another)",
        )
    return target


def _checked_head(request: h11.Request) -> h11.Request:
    """A head within MAX_HEAD_BYTES (h11 bounds only an unfinished one), with one framing
    of its body: both ``Content-Length`` and ``Transfer-Encoding`` is how a request is
    smuggled past a proxy that reads one and a server that reads the other."""
    size = len(request.method) + len(request.target) + sum(
        len(k) + len(v) + 4 for k, v in request.headers
    )
    if size > MAX_HEAD_BYTES:
        raise _Refusal(431, "head_too_large",
                       f"the request head is {size} bytes; this proxy reads {MAX_HEAD_BYTES}")
    names = {k.lower() for k, _ in request.headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise _Refusal(400, "bad_request",
                       "a request with both Content-Length and Transfer-Encoding is refused")
    return request


def _authority(target: bytes) -> tuple[str, int]:
    """``host:port`` of a CONNECT (an IPv6 literal in brackets), or a 400."""
    text = target.decode("ascii", "replace")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or not host:
        raise _Refusal(400, "bad_request", f"CONNECT needs host:port, got {text!r}")
    return host.strip("[]") if host.startswith("[") else host, int(port)


__all__ = [
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "EgressDoor",
    "EgressQuota",
    "EgressUsage",
    "connect",
    "dial",
    "listen_in",
    "resolve",
]
