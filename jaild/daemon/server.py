"""The jaild daemon's shell: accept connections, converse, dispatch.

Theory of operation
-------------------
Lifecycle: :meth:`Daemon.start` (:mod:`jaild.daemon.startup`: load and check every
policy -- refusing to start on any error --, claim the socket, check the host, prepare
the cgroup subtree and serve the socket, sweep what a crash left, stage the runtime,
seal one nsjail config per policy, start zygotes, self-tests and pools; then load the
runs parked for approval and the snapshots, open the network listeners; ready: notify
systemd) ->
:meth:`Daemon.serve_forever` -> :meth:`Daemon.stop` (stop accepting, cancel running
jobs so they end ``cancelled``, close sessions, wait for the records to reach their
clients, close connections, remove the socket and the cgroup subtree).

While it starts, the daemon answers at once (:mod:`jaild.daemon.core.readiness`): a
client's ``Hello`` gets ``Welcome`` saying it is starting; requests that need no jail are
answered; those that need one wait (:class:`~jaild.daemon.waiting.WaitingRoom`), in arrival
order, until it is ready (then dispatched as if they had just come), for
``limits.startup_wait_s`` at most (then ``starting``); one whose policy admission refuses
-- at once, or when its zygote or self-test fails meanwhile -- gets that refusal. A start
that fails tells every connection why (``daemon_unavailable``) and closes it.

Each connection is a :class:`ServedConnection` wrapping the sans-IO
:class:`~jaild.protocol.Connection`. Its life is one :class:`asyncio.TaskGroup`:
the conversation (read a message, dispatch it) and every task it starts -- its
jobs' runs, its sessions' jails opening, watched and discarded, the drain of its
paused output -- belong to it, so a connection is not done until they are. When
the conversation ends (the client left, sent garbage, or the daemon stops), its
jobs are cancelled, its sessions closed and its pending tool calls failed; the
group then waits for them to end. Cancellation is never swallowed.

A job belongs to the connection that submitted it: only that connection may cancel
it or answer its tool calls. A tool call from a jail goes out as
``CallTool{job_id, call_id}`` to the owning connection, and its
``ToolReturned``/``ToolFailed`` for that pair resolves it. Every live job, session
and connection is in the :class:`~jaild.daemon.registry.Registry`; requests go
through the :class:`~jaild.daemon.pipeline.Pipeline` (admission, placement,
``run_to_record``) and :class:`~jaild.daemon.sessions.Sessions`.

The front door: a connection is admitted or refused the moment it is accepted, on
its peer credentials (``SO_PEERCRED``) alone -- before it has sent a byte. A uid not
in ``access.users``, or one at ``limits.max_connections_per_uid``, or any uid when
the daemon is at ``limits.max_connections``, gets an ``Error`` frame
(``permission_denied`` or ``busy``) at once and is closed; it never enters the
registry, so it takes no connection slot from anyone. An admitted connection counts
against its uid and the daemon from then on, Hello or not, and until ``Hello`` its
frames may be at most 64 KiB (:data:`~jaild.protocol.connection.HANDSHAKE_FRAME_BYTES`):
``max_frame_bytes`` is for clients that have said who they are, and the unfinished
frames of one uid's connections together may hold at most
``limits.max_frame_bytes_per_uid`` of the daemon's memory (the connection that would
pass it gets ``frame_too_large`` and is closed). So that the refused
client reads the reason rather than a broken pipe, a refused connection lingers for
at most :data:`REFUSED_LINGER_S` reading (and dropping) at most 64 KiB -- its Hello --
and only while fewer than :data:`REFUSED_LINGER_MAX` refused connections (and
:data:`REFUSED_LINGER_PER_UID` of its uid) linger; past that it is closed right
after the ``Error``. Refusals are audited, rate-limited per uid
(:mod:`jaild.daemon.observe.audit`), and counted in the metrics.

Hostile input on a connection (a bad frame, an oversize frame, a message out of
order) gets an ``Error`` frame and that connection is closed; a well-formed but
unacceptable request (unknown policy, looser limits, unknown job) gets an
``Error`` frame and the connection carries on. Either way every other client is
unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import struct
import time
import typing
from collections import Counter
from collections.abc import Collection, Coroutine
from typing import Any

from jaild.daemon import sched, startup, systemd, tls, wiring
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission
from jaild.daemon.core.peer import Peer, PrincipalKind, Tenant
from jaild.daemon.core.readiness import Phase, Readiness, must_wait
from jaild.daemon.jails.job import CallReply, JailedJob, JailEnvironment
from jaild.daemon.jails.pool import JailPool
from jaild.daemon.observe import Observers
from jaild.daemon.observe.accounting import Accounting
from jaild.daemon.observe.audit import AuditLog
from jaild.daemon.observe.metrics import Metrics
from jaild.daemon.principals import Principals, principals
from jaild.daemon.registry import JailSession
from jaild.daemon.selftest import Check
from jaild.daemon.tls import TlsListeners
from jaild.errors import (
    ConnectionLost,
    DaemonUnavailable,
    FrameTooLarge,
    InternalError,
    JaildError,
    ReadTimeout,
    RemoteProtocolError,
    StartupError,
    UnknownJob,
)
from jaild.policy.schema import Policy
from jaild.protocol import CLOSED, NEED_DATA, PROTOCOL_VERSION, Connection, Role
from jaild.protocol.connection import HANDSHAKE_FRAME_BYTES
from jaild.protocol.messages import (
    ClientCallTool,
    ClientToolFailed,
    ClientToolReturned,
    Error,
    JobAccepted,
    JobOutput,
    Message,
    Ping,
    Welcome,
)
from jaild.tracing import OFF, Tracing
from jaild.version import __version__

log = logging.getLogger("jaild")

SO_PEERGROUPS = 59
WRITE_BUFFER_HIGH = 8 << 20

ACCEPT_HOLD_S = 0.01
"""How long a job's ``JobAccepted`` may wait to go out in one write with the job's next
message to the client -- for a warm job, its ``JobFinished``: the client is woken once
per job instead of twice. A job still running then is announced on its own."""

TRACES_FLUSH_S = 5.0
"""How long a stopping daemon waits for its queued spans to be exported (tracing on)."""

REFUSED_LINGER_S = 1.0
"""How long a refused connection stays open to read its client's Hello (then closed)."""
REFUSED_LINGER_MAX = 64
"""Refused connections lingering at once, all uids; more are closed right after the Error."""
REFUSED_LINGER_PER_UID = 8
"""Refused connections of one uid lingering at once."""


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int, tuple[int, ...]]:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    groups: tuple[int, ...] = ()
    with contextlib.suppress(OSError):
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
        groups = struct.unpack(f"{len(raw) // 4}I", raw)
    return pid, uid, gid, groups


class ServedConnection(asyncio.Protocol):
    """One client connection: an asyncio protocol over the sans-IO :class:`Connection`.

    Frames are decoded and dispatched as they arrive, in the loop iteration that read
    them (no reader task between the socket and the dispatch: a request costs no extra
    trip round the loop). The connection's work -- its jobs' runs, its sessions' jails,
    the drain of its paused output -- runs in its task group (:meth:`serve`), which ends
    once the conversation is over and that work is done.

    Its life: accepted (:meth:`connection_made`: peer credentials, then the daemon admits
    or refuses it) -> converse (``Hello`` within ``handshake_timeout_s``; a frame, once
    started, must keep coming within ``frame_timeout_s``) -> closed (:meth:`close`: its
    calls fail, its jobs are cancelled, its sessions closed; what is buffered is sent,
    for a second at most). While its replies back up past :data:`WRITE_BUFFER_HIGH` (the
    client does not read them), its requests are not read either.
    """

    peer: Peer

    def __init__(self, daemon: Daemon, peer: Peer | None = None) -> None:
        """``peer``: who it is, known already (a network client's certificate); None: read
        from the socket's credentials when it is accepted."""
        self.daemon = daemon
        if peer is not None:
            self.peer = peer
        self.conn = Connection(Role.DAEMON, daemon.config.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.jobs = _JobLink()  # its tool calls and its jobs' output
        self.closed = False
        self._tasks: asyncio.TaskGroup | None = None  # the connection's scope, while it serves
        # work started before serve() began (see start); None once it has
        self._early: list[Coroutine[Any, Any, None]] | None = []
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._frame_held = 0  # this connection's share of daemon.frame_bytes[uid]
        # job id -> its JobAccepted's bytes, not yet written, and the timer that writes them
        self._held: dict[str, tuple[bytes, asyncio.TimerHandle]] = {}
        self._greeted = False  # Hello received, Welcome sent
        self._linger: int | None = None  # refused: bytes of its Hello still read and dropped
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._write_paused = False  # the transport's buffer is over its high-water mark
        self._reading_paused = False  # ... and past WRITE_BUFFER_HIGH: requests wait
        self._unadmitted: list[bytes] | None = None  # read before it was admitted (hold())
        self._drain_waiters: list[asyncio.Future[None]] = []
        # liveness (limits.liveness_timeout_s): when it last sent us anything, the timer that
        # pings it when idle and gives up on it when silent, the last ping's number
        self._last_read = 0.0
        self._liveness_timer: asyncio.TimerHandle | None = None
        self._pings = 0

    @property
    def who(self) -> str:
        return str(self.peer)

    # ------------------------------------------------------------------ asyncio's calls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (uvloop's is one without being an asyncio.Transport)
        self.transport = typing.cast(asyncio.Transport, transport)
        try:
            if not hasattr(self, "peer"):
                self.peer = Peer(*_peer_credentials(transport.get_extra_info("socket")))
            limit = self.daemon.config.stream_buffer_bytes
            self.transport.set_write_buffer_limits(high=limit, low=limit // 2)
        except OSError:
            self.closed = True
            self.transport.abort()
            self._end()
            return
        self.daemon.connected(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._unadmitted is not None:  # not admitted yet: whom it is from is being found
            self._unadmitted.append(data)
            if sum(map(len, self._unadmitted)) > HANDSHAKE_FRAME_BYTES and self.transport:
                self.transport.pause_reading()  # the rest waits in the kernel
            return
        if self._linger is not None:  # refused: its Hello is read and dropped
            self._linger -= len(data)
            if self._linger <= 0:
                self.close()
            return
        self._received(data)

    def eof_received(self) -> bool:
        if not self.closed and self._linger is None:
            self._received(b"")
        self.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()
        self._write_paused = False
        self._wake_drainers()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drainers()
        if self._reading_paused and not self.closed:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
            self._process()  # what was read before the pause

    # ------------------------------------------------------------------ reading

    def _received(self, data: bytes) -> None:
        self._last_read = time.monotonic()
        try:
            self.conn.receive_data(data)
            self._count_buffered()
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
            return
        self._process()

    def _process(self) -> None:
        """Dispatch every complete message read so far (unless the client's replies are
        backed up); a frame left unfinished must be completed in time."""
        try:
            while not self.closed and not self._reading_paused:
                event = self.conn.next_event()
                if event is NEED_DATA:
                    self._watch_frame()
                    return
                if event is CLOSED:
                    self.close()
                    return
                assert isinstance(event, Message)
                self._count_buffered()
                if not self._greeted:  # the link's state lets only Hello through first
                    self._greeted = True
                    if self._handshake_timer is not None:
                        self._handshake_timer.cancel()
                    self.send(Welcome(protocol=PROTOCOL_VERSION, daemon=f"jaild/{__version__}",
                                      node=self.daemon.config.node,
                                      starting=self.daemon.readiness.welcome()))
                    self._watch_liveness()
                    continue
                self._dispatch(event)
                if self._write_paused and self.buffered() > WRITE_BUFFER_HIGH:
                    self._reading_paused = True
                    if self.transport is not None:
                        self.transport.pause_reading()
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
        except Exception:  # a jaild bug: this connection ends, its jobs end as usual
            log.exception("connection of %s failed inside jaild", self.who)
            self.close()

    def _watch_frame(self) -> None:
        """A frame begun must be finished within ``frame_timeout_s`` of its last bytes."""
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None
        if self.conn.inside_frame:  # the client owes us the rest: not forever
            timeout = self.daemon.config.frame_timeout_s
            self._frame_timer = asyncio.get_running_loop().call_later(
                timeout,
                self._timed_out,
                f"a frame was started but not finished within {timeout:g} s",
            )

    def _watch_liveness(self) -> None:
        """Ping the client when it has been idle for a third of ``liveness_timeout_s``; give
        up on it when it has been silent for all of it (PROTOCOL.md section 8)."""
        bound = self.daemon.config.liveness_timeout_s
        if bound <= 0 or self.closed:
            return
        idle = time.monotonic() - self._last_read
        if idle >= bound:
            self._lost(f"nothing from the client for {idle:.1f} s "
                       f"(limits.liveness_timeout_s {bound:g})")
            return
        period = bound / 3
        if idle >= period:
            self._pings += 1
            self.send(Ping(seq=self._pings))
            wait = min(period, bound - idle)
        else:
            wait = period - idle
        self._liveness_timer = asyncio.get_running_loop().call_later(wait, self._watch_liveness)

    def _lost(self, why: str) -> None:
        """The client is lost (dead, frozen or partitioned away): its work ends as if it
        had closed the connection, and the transport is dropped (nothing can reach it)."""
        log.warning("client %s lost: %s; its jobs are cancelled", self.who, why)
        self.daemon.metrics.connection_lost()
        self.daemon.audit.connection_lost(self.peer, why)
        self.close(f"the client was lost: {why}")
        if self.transport is not None:
            self.transport.abort()

    def _timed_out(self, message: str) -> None:
        if not self.closed:
            self._protocol_error(ReadTimeout(message))

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        """The client broke the protocol: it is told why, then the connection ends."""
        if self.daemon.refused(self.peer, exc.code, exc.message):
            log.warning("client %s sent bad input: %s", self.who, exc.message)
        self.send_error(exc)
        self.close()

    def _count_buffered(self) -> None:
        """Keep the uid's total of unfinished frame bytes (every connection of it) up to
        date; past ``max_frame_bytes_per_uid``, this connection ends ``frame_too_large``."""
        now = self.conn.buffered_bytes
        grew, self._frame_held = now - self._frame_held, now
        if grew == 0:
            return
        uid = self.peer.principal.key
        totals = self.daemon.frame_bytes
        totals[uid] += grew
        if not totals[uid]:
            del totals[uid]
        limit = self.daemon.config.frame_bytes_per_uid
        if grew > 0 and totals[uid] > limit:
            raise FrameTooLarge(
                f"{self.peer.principal} has {totals[uid]} bytes of unfinished frames on its "
                "connections, "
                f"over its limit (limits.max_frame_bytes_per_uid {limit})"
            )

    # ------------------------------------------------------------------ writing

    def send(self, msg: Message) -> None:
        """Write ``msg`` -- after its job's ``JobAccepted``, in the same write, if that is
        still held (:meth:`accept`)."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return
        data = self.conn.send(msg)
        if self._held:
            job_id = getattr(msg, "job_id", None)
            held = self._held.pop(job_id, None) if job_id is not None else None
            if held is not None:
                held[1].cancel()
                data = held[0] + data
        transport.write(data)

    def accept(self, ref: int, job_id: str, session_id: str | None = None) -> None:
        """Tell the client its job ``job_id`` (of request ``ref``) runs: the ``JobAccepted``
        goes out with the job's next message, or after :data:`ACCEPT_HOLD_S`, whichever
        comes first. Nothing about the job can reach the client before it."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        # the ref and the session's id were checked in the client's request; the job id is ours
        accepted = JobAccepted.trusted(ref=ref, job_id=job_id, session_id=session_id)
        data = self.conn.send(accepted)
        timer = asyncio.get_running_loop().call_later(ACCEPT_HOLD_S, self._announce, job_id)
        self._held[job_id] = (data, timer)

    def _announce(self, job_id: str) -> None:
        held = self._held.pop(job_id, None)
        transport = self.transport
        if held is not None and not self.closed and transport and not transport.is_closing():
            transport.write(held[0])

    def send_error(
        self, err: JaildError, ref: int | None = None, job_id: str | None = None
    ) -> None:
        with contextlib.suppress(JaildError):
            self.send(Error(code=err.code, message=err.message[:65536], ref=ref, job_id=job_id))

    def buffered(self) -> int:
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return 0
        return transport.get_write_buffer_size()

    async def drain(self) -> None:
        """Until the transport's buffer is below its low-water mark (or the connection is
        gone)."""
        if not self._write_paused or self.transport is None or self.transport.is_closing():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def _wake_drainers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ------------------------------------------------------------------ lifecycle

    def start(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in this connection's task group: the connection waits for it.
        Work started before :meth:`serve` has begun (a loop such as uvloop may deliver the
        first bytes before the task running :meth:`serve` has taken its first step) waits
        for it, and is then started in the group."""
        if self._tasks is not None:
            self._tasks.create_task(work)
        elif self._early is not None:
            self._early.append(work)
        else:
            work.close()
            raise RuntimeError("the connection is not serving")

    def hold(self) -> None:
        """Keep what arrives until :meth:`release` (the daemon is finding out whom the
        connection is from: nothing it sends may be acted on before)."""
        self._unadmitted = []

    def release(self) -> None:
        """Admitted or refused: what was held is read now, as if it had just arrived."""
        held, self._unadmitted = self._unadmitted or [], None
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        for data in held:
            self.data_received(data)

    def converse(self) -> None:
        """Admitted: the conversation begins (``Hello`` is due within
        ``handshake_timeout_s``)."""
        timeout = self.daemon.config.handshake_timeout_s
        self._handshake_timer = asyncio.get_running_loop().call_later(
            timeout, self._timed_out, f"no Hello within {timeout:g} s of connecting"
        )

    async def serve(self) -> None:
        """The connection's whole life: until the conversation is over, then until its
        work has ended."""
        early, self._early = self._early or [], None
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                for work in early:
                    tasks.create_task(work)
                try:
                    await self._ended
                finally:
                    self.close()
        finally:
            self._tasks = None

    async def finished(self) -> None:
        """Until the conversation is over (not its work: :meth:`serve` waits for that)."""
        await asyncio.shield(self._ended)

    def refuse(self, refusal: JaildError, linger: bool) -> None:
        """Refused at the door: the Error, then (``linger``) read and drop the client's
        Hello -- at most 64 KiB, for at most REFUSED_LINGER_S -- so that it can read the
        reason instead of a broken pipe; then close."""
        self.send_error(refusal)
        if not linger:
            self.close()
            return
        self._linger = HANDSHAKE_FRAME_BYTES
        timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.close)
        self._ended.add_done_callback(lambda _: timer.cancel())

    async def shut(self) -> None:
        """The daemon stops: what is buffered goes out (for a second at most), then close."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.drain(), timeout=1.0)
        self.close()

    def close(self, why: str = "the client disconnected") -> None:
        """End the conversation: fail its pending tool calls, cancel its jobs (``why``),
        close its sessions, close the socket (what is buffered still goes out, for a second
        at most). Idempotent; :meth:`serve` then waits for that work."""
        if self.closed:
            return
        self.closed = True
        daemon = self.daemon
        for timer in (self._handshake_timer, self._frame_timer, self._liveness_timer):
            if timer is not None:
                timer.cancel()
        if self._frame_held:  # what its unfinished frame held is free again
            key = self.peer.principal.key
            daemon.frame_bytes[key] -= self._frame_held
            if not daemon.frame_bytes[key]:
                del daemon.frame_bytes[key]
            self._frame_held = 0
        daemon.registry.disconnect(self)
        self.jobs.close()  # its tool calls are lost, its paused jobs' output goes on
        daemon.approvals.park_held(self)  # its runs waiting for approval wait on disk
        daemon.approvals.detach(self)
        for live in daemon.registry.jobs(owner=self):
            live.jail.cancel(why)
        for sess in daemon.registry.sessions(owner=self):
            daemon.close_session(sess, "disconnected", why)
        for _, timer in self._held.values():
            timer.cancel()
        self._held.clear()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()  # flushes what is buffered, then closes
            if transport.get_write_buffer_size():
                asyncio.get_running_loop().call_later(1.0, transport.abort)
        self._end()

    def _end(self) -> None:
        if not self._ended.done():
            self._ended.set_result(None)

    # ------------------------------------------------------------------ requests

    def go_on(self, msg: Message) -> None:
        """Dispatch a request that waited for the daemon to be ready (its connection may
        have ended meanwhile: then nothing)."""
        if self.closed:
            return
        try:
            self._dispatch(msg)
        except Exception:  # a jaild bug: this connection ends, its jobs end as usual
            log.exception("connection of %s failed inside jaild", self.who)
            self.close()

    def _dispatch(self, msg: Message) -> None:
        daemon = self.daemon
        if daemon.readiness.starting and must_wait(msg):  # until ready (core/readiness.py)
            daemon.waiting.wait(self, msg)
        elif isinstance(msg, (ClientToolReturned, ClientToolFailed)):
            self.jobs.replied(self, msg)
        else:  # a request: what it does is jaild.daemon.requests (a Pong: nothing)
            daemon.requests.handle(self, msg)

    def call_tool(
        self, job_id: str, call_id: int, name: str, args: bytes, approval: bool = False
    ) -> CallReply:
        """Send a tool call to this client (see :meth:`_JobLink.call_tool`)."""
        return self.jobs.call_tool(self, job_id, call_id, name, args, approval)

    def output(self, job_id: str, stream: str, data: bytes) -> None:
        """Stream a job's output (see :meth:`_JobLink.output`)."""
        self.jobs.output(self, job_id, stream, data)


class _JobLink:
    """A connection's part in its jobs: the tool calls it hosts (sent out, their replies
    routed back as soon as they are read) and the output it streams, held to its buffer.
    It is given its connection with each call and keeps no reference to it: a closed
    connection (and the unfinished frame it may hold) is freed as soon as it is dropped,
    not at the cycle collector's next pass."""

    def __init__(self) -> None:
        self.pending_calls: dict[tuple[str, int], CallReply] = {}
        self._paused: set[JailedJob] = set()  # jobs whose output waits for this client
        self._draining = False  # _drain_paused is on its way

    def call_tool(
        self, conn: ServedConnection, job_id: str, call_id: int, name: str, args: bytes,
        approval: bool = False,
    ) -> CallReply:
        """Send a tool call to the client; its reply resolves the :class:`CallReply` as
        soon as it is read (a ToolRouter). ``approval``: the client must ask its approval
        callback before the handler."""
        if conn.closed:
            raise ConnectionLost("the client is gone")
        key = (job_id, call_id)
        reply = CallReply(functools.partial(self.pending_calls.pop, key, None))
        self.pending_calls[key] = reply
        conn.send(
            ClientCallTool(job_id=job_id, call_id=call_id, name=name, args=args, approval=approval)
        )
        return reply

    def replied(self, conn: ServedConnection, msg: ClientToolReturned | ClientToolFailed) -> None:
        """A tool call's reply from the client."""
        reply = self.pending_calls.pop((msg.job_id, msg.call_id), None)
        if reply is None:
            if conn.daemon.registry.job(msg.job_id, owner=conn) is None:
                conn.send_error(
                    UnknownJob(f"no job {msg.job_id} of this connection"), job_id=msg.job_id
                )
            return  # a late answer for a call that already ended: harmless
        if isinstance(msg, ClientToolReturned):
            reply.resolve(True, msg.value, msg.labels)
        else:
            reply.resolve(False, (msg.error_type, msg.message))

    def output(self, conn: ServedConnection, job_id: str, stream: str, data: bytes) -> None:
        """Stream a job's output -- within the connection's buffer (``stream_buffer_bytes``).
        Past it, by the job's ``slow_client`` limit: its output is paused until the client
        reads (the jail blocks on write), or skipped on the stream (the record has it all)."""
        live = conn.daemon.registry.job(job_id, owner=conn)
        if live is not None and conn.buffered() > conn.daemon.config.stream_buffer_bytes:
            job = live.jail
            if job.spec.limits.slow_client == "truncate":
                job.output_dropped(len(data))
                return
            job.pause_output()
            self._paused.add(job)
            if not self._draining:
                self._draining = True
                conn.start(self._drain_paused(conn))
        conn.send(JobOutput(job_id=job_id, stream=stream, data=data))

    async def _drain_paused(self, conn: ServedConnection) -> None:
        with contextlib.suppress(Exception):
            await conn.drain()  # until the buffer is below half of stream_buffer_bytes
        self._draining = False
        self.resume()

    def close(self) -> None:
        """The connection is closing: its pending calls are lost, its paused jobs go on."""
        calls, self.pending_calls = self.pending_calls, {}
        for reply in calls.values():
            reply.lost()
        self.resume()

    def resume(self) -> None:
        paused, self._paused = self._paused, set()
        for job in paused:
            job.resume_output()


class Daemon:
    """See the module docstring."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        served: startup.Served | None = None,
        tracing: Tracing | None = None,
        reap_orphans: bool = True,
    ) -> None:
        """A daemon of ``config``, started by :meth:`start` (or given what it serves with).

        Args:
            config: its settings.
            served: what it serves with, made elsewhere (:mod:`jaild.testing`: policies and a
                jail environment whose jails need no root); None: :meth:`start` makes it.
            tracing: its traces; None: as the ``OTEL_*`` environment asks, read at start.
            reap_orphans: reap children of this process that are no job's (it is the
                jails' subreaper); False where the process has children of its own.
        """
        self.config = config
        self.served = served or startup.Served()
        self._tracing_given = tracing is not None
        self.observers = Observers(
            audit=AuditLog(),  # its file once start() has read the config
            accounting=Accounting(),
            metrics=Metrics(config.metrics_address, tool_labels=config.metrics_tool_labels),
            tracing=tracing or OFF,  # else on at start() if OTEL_* asks for it
        )
        parts = wiring.build(config, self.served, self.observers, self.catalog,
                             reap_orphans=reap_orphans,
                             ready=served is not None)  # the one place parts are joined
        self.registry = parts.registry
        self.parked_runs = parts.parked_runs
        self.sessions = parts.sessions
        self.approvals = parts.approvals
        self.pipeline = parts.pipeline
        self.requests = parts.requests
        # Ready from the start when given what it serves with (jaild.testing); else once
        # start() is done. Requests that need a jail wait meanwhile, in arrival order.
        self.waiting = parts.waiting
        self._lingering: Counter[Tenant] = Counter()  # refused connections open, by principal
        self.frame_bytes: Counter[Tenant] = Counter()  # unfinished frames' bytes, by principal
        self._stopping = False
        self._draining: float | None = None  # draining for this long (drain())
        self._stopped = asyncio.Event()
        self._serving = False  # start() finished: only then is a stop "jaild stopped"
        # The connections' scope (a task group held by its own task; jaild.testing lends
        # one of its own): each connection's serve() runs in it.
        self.connections: asyncio.TaskGroup | None = None
        self._holder: asyncio.Task[None] | None = None
        self._stopped_accepting = asyncio.Event()
        # Whom clients are served as, where it is not their uid (access.identity): at start
        self.principals: Principals | None = None
        self.listeners: TlsListeners | None = None  # daemon.listen: at start

    # What is told of it (see :class:`~jaild.daemon.observe.Observers`).

    @property
    def audit(self) -> AuditLog:
        return self.observers.audit

    @property
    def accounting(self) -> Accounting:
        return self.observers.accounting

    @property
    def metrics(self) -> Metrics:
        return self.observers.metrics

    @property
    def tracing(self) -> Tracing:
        return self.observers.tracing

    # What start-up made (see :class:`~jaild.daemon.startup.Served`).

    @property
    def policies(self) -> dict[str, Policy]:
        return self.served.policies

    @property
    def unavailable(self) -> dict[str, str]:
        return self.served.unavailable

    @property
    def env(self) -> JailEnvironment | None:
        return self.served.env

    @property
    def pools(self) -> dict[str, JailPool]:
        return self.served.pools

    @property
    def probe_results(self) -> dict[str, list[Check]]:
        return self.served.probe_results

    @property
    def swept(self) -> list[str]:
        return self.served.swept

    # ------------------------------------------------------------------ lifecycle

    async def start(self, only_policies: set[str] | None = None) -> None:
        """Start serving. ``only_policies``: serve just these (a private one-job daemon).

        Raises:
            StartupError: why not (see :mod:`jaild.daemon.startup`).
        """
        self.observers.audit = AuditLog(self.config.audit_log)
        if not self._tracing_given:
            # TracingError (a StartupError) if it cannot be
            self.observers.tracing = Tracing.from_env()
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._holder = loop.create_task(self._hold_connections(ready), name="jaild connections")
        await ready
        self.principals = principals(self.config)  # StartupError: the API cannot be named
        if self.principals is not None:  # the pod watch catches up while the jails start
            self.principals.start()
        try:
            await startup.start(
                self.config, self.served, self.metrics, self._tool_called, self.protocol,
                only_policies, on_egress=self._egress_request, progress=self._progress,
            )
            await self._start_state()
        except BaseException as exc:  # whoever connected meanwhile is told why
            self._start_failed(exc)
            raise
        self._serving = True
        self.waiting.ready()
        systemd.notify(f"READY=1\nSTATUS=serving {len(self.policies)} policies")

    async def _start_state(self) -> None:
        """After start-up proper: the runs parked for approval, the snapshots, the network
        listeners."""
        self._progress(Phase.STATE, ())
        parked = self.approvals.load(self.catalog().policies)
        if os.path.isdir(self.config.snapshot_dir):  # expired ones, and the paused sessions'
            gone = await asyncio.to_thread(self.sessions.store.sweep, True,
                                           self.parked_runs.states())
            if gone:
                log.info("deleted %d expired snapshots and paused sessions' states", gone)
        if parked:
            log.info("%d parked runs wait for approval (jaild approvals)", parked)
        if self.config.listen:
            self._progress(Phase.LISTENERS, ())
            try:
                self.listeners = TlsListeners(self.config, self)
                await self.listeners.start()
            except StartupError as exc:
                self.listeners = None
                self._start_failed(exc)
                await self.stop()
                raise

    # ------------------------------------------------------------------ readiness

    @property
    def readiness(self) -> Readiness:
        return self.waiting.readiness

    def _progress(self, phase: Phase, policies: Collection[str]) -> None:
        self.waiting.progress(phase, policies)

    def _start_failed(self, exc: BaseException) -> None:
        """The start failed after the socket was served: every connection is told why (as
        :func:`~jaild.daemon.startup.answer_waiting` tells those it never served) -- its
        waiting requests fail with it -- and closed."""
        if not self.waiting.failed():
            return
        if isinstance(exc, (StartupError, JaildError)):
            reason = str(exc)
        elif isinstance(exc, asyncio.CancelledError):
            reason = "it was stopped while it started"
        else:
            reason = f"it failed inside jaild ({type(exc).__name__}); its log says more"
        for session in list(self.registry.connections):
            assert isinstance(session, ServedConnection)
            told = session.peer.uid == os.geteuid()
            session.send_error(DaemonUnavailable(
                startup.cannot_start(self.config.socket_path, reason, told)))
            session.close("the daemon failed to start")

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    def protocol(self) -> ServedConnection:
        """A new connection's protocol (the listening socket's protocol factory)."""
        return ServedConnection(self)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def serve_connection(self, transport: asyncio.Transport, peer: Peer,
                         pending: Any) -> ServedConnection:
        """A network client whose TLS handshake succeeded: served as the principal its
        certificate names (``peer``), admitted or refused as any connection is. ``pending``:
        what arrived since the handshake (:func:`jaild.daemon.tls.replay`)."""
        session = ServedConnection(self, peer)
        transport.set_protocol(session)
        session.connection_made(transport)
        tls.replay(session, pending)
        return session

    def connected(self, session: ServedConnection) -> None:
        """A connection was accepted and its peer is known: admit it and let it converse,
        or refuse it (before it has sent a byte). Where clients are served as their pods,
        their principal is resolved first, off the event loop (nothing they send is read
        meanwhile)."""
        scope = self.connections
        if self._stopping or scope is None:
            session.close()
            return
        if (self.principals is not None and session.transport is not None
                and session.peer.principal.kind is not PrincipalKind.CERT):
            session.hold()
            scope.create_task(self._identified(session, self.principals, session.transport))
            return
        self._admitted(session, self.admit(session))

    async def _identified(
        self, session: ServedConnection, resolver: Principals, transport: asyncio.Transport
    ) -> None:
        """Resolve the connection's principal (its pod), then admit it or refuse it."""
        sock = transport.get_extra_info("socket")
        refusal: JaildError | None = None
        try:
            principal = await asyncio.to_thread(resolver.resolve, sock, session.peer)
        except JaildError as exc:
            refusal = exc
        except Exception as exc:  # a bug here refuses this client only
            log.exception("resolving the principal of %s failed", session.who)
            refusal = InternalError(f"cannot tell whom the connection is from: {exc}")
        else:
            session.peer = dataclasses.replace(session.peer, principal=principal)
        if session.closed or self._stopping:
            session.close()
            return
        self._admitted(session, refusal or self.admit(session))
        session.release()

    def _admitted(self, session: ServedConnection, refusal: JaildError | None) -> None:
        """Let an admitted connection converse; refuse the other at the door."""
        scope = self.connections
        assert scope is not None
        if refusal is None:
            self.registry.connect(session)  # it counts from now on, Hello or not
            session.converse()
            scope.create_task(self._serve(session))
            return
        uid = session.peer.principal.key
        if self.refused(session.peer, refusal.code, refusal.message):
            log.warning("refused connection from %s: %s", session.who, refusal.message)
        linger = (
            self._lingering.total() < REFUSED_LINGER_MAX
            and self._lingering[uid] < REFUSED_LINGER_PER_UID
        )
        session.refuse(refusal, linger)
        if linger:
            self._lingering[uid] += 1
            scope.create_task(self._lingered(session, uid))

    async def _serve(self, session: ServedConnection) -> None:
        """One connection's life. A failure inside jaild ends that connection only."""
        try:
            await session.serve()
        except Exception:
            log.exception("connection of %s failed inside jaild", session.who)

    async def _lingered(self, session: ServedConnection, uid: Tenant) -> None:
        try:
            await session.finished()
        finally:
            self._lingering[uid] -= 1
            if not self._lingering[uid]:
                del self._lingering[uid]

    async def _hold_connections(self, ready: asyncio.Future[None]) -> None:
        """The connections' scope: every connection's task runs in it, until :meth:`stop`."""
        async with asyncio.TaskGroup() as tasks:
            self.connections = tasks
            ready.set_result(None)
            await self._stopped_accepting.wait()
        self.connections = None

    async def drain(self, seconds: float) -> None:
        """Take no new work (each new job, session or session run is refused ``Busy``,
        "draining") and give the jobs running up to ``seconds`` to finish; :meth:`stop`
        then cancels whatever still runs. The socket stays open meanwhile, so a client
        gets that answer rather than a refused connection."""
        if self._stopping or self._draining is not None:
            return
        self._draining = seconds
        running = len(self.registry.jobs())
        log.info("draining: %d job(s) running get up to %g s to finish; new work is refused",
                 running, seconds)
        systemd.notify(f"STATUS=draining: {running} job(s) running, up to {seconds:g} s")
        try:
            async with asyncio.timeout(seconds):
                await self.registry.drained()
        except TimeoutError:
            log.info("drained for %g s: %d job(s) still running are cancelled", seconds,
                     len(self.registry.jobs()))
        else:
            log.info("drained: every running job finished")

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, end every job and session (their clients get their records
        within ``grace_s``), close connections, release what start-up made."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        systemd.notify("STOPPING=1")
        if self.served.server is not None:
            self.served.server.close()
        if self.listeners is not None:
            self.listeners.close()
        self.approvals.park_held()  # runs waiting for approval wait on disk for the next start
        for live in self.registry.jobs():
            live.jail.cancel("the daemon is shutting down")
        for sess in self.registry.sessions():
            self.close_session(sess, "shutdown", "the daemon is shutting down")
        pools, self.served.pools = list(self.served.pools.values()), {}
        await asyncio.gather(*(pool.close() for pool in pools), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s or self.config.shutdown_grace_s):
                await self.registry.drained()
        self.served.stop_zygotes()
        for session in list(self.registry.connections):
            await session.shut()
        self._stopped_accepting.set()
        if self._holder is not None:  # each connection's work ends with its jobs
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.shutdown_grace_s):
                    await asyncio.shield(self._holder)
            self._holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._holder
        if self.principals is not None:
            self.principals.stop()
        self.audit.close()
        self.metrics.stop()
        await self.metrics.wait_closed()
        tracing, self.observers.tracing = self.observers.tracing, OFF
        if tracing.on:  # the spans queued go to the collector (in a thread: it may be slow)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(tracing.shutdown), TRACES_FLUSH_S)
        await asyncio.sleep(0)  # let the cleanups of the jobs just ended run
        # Only ours (we held the socket): whatever a job left is killed and removed, so the
        # subtree goes too -- nothing of a stopped daemon stays behind.
        self.served.release(self.config)
        if self._serving:  # a start that failed says so itself ("cannot start: ..."), last
            log.info("jaild stopped")
        else:
            log.debug("start-up undone")
        self._stopped.set()

    # ------------------------------------------------------------------ requests

    def admit(self, session: ServedConnection) -> JaildError | None:
        """May this connection, just accepted, stay? (peer credentials, connection limits:
        every connection admitted before counts, whether it has said Hello or not)"""
        try:
            admission.admit_connection(
                session.peer,
                [s.peer for s in self.registry.connections if s is not session],
                allowed_users=self.config.allowed_users,
                max_connections=self.config.max_connections,
                max_connections_per_uid=self.config.max_connections_per_uid,
                allowed_principals=self.config.allowed_principals,
            )
        except JaildError as refusal:
            return refusal
        return None

    def catalog(self) -> admission.Catalog:
        """The policies served, as admission sees them now."""
        return admission.Catalog(self.policies, self.unavailable, self._stopping,
                                 draining=self._draining)

    def close_session(self, sess: JailSession, reason: str, message: str) -> None:
        """End a session (see :meth:`Sessions.close`). Idempotent."""
        self.sessions.close(sess, reason, message)

    def reap_orphans(self) -> list[int]:
        """Reap children that are not a running job's nsjail (see :class:`Pipeline`)."""
        return self.pipeline.reap_orphans()

    def _tool_called(
        self, job_id: str, policy: str, tool: str, outcome: str, duration_s: float
    ) -> None:
        if job_id.startswith(startup.PROBE_JOB_PREFIX):  # the daemon's own self-test:
            return  # not a user's call (its result is logged as the policy's self-test)
        live = self.registry.job(job_id)
        self.audit.tool_call(live.owner.peer if live else None, job_id, tool, outcome, duration_s)
        self.metrics.tool_call(policy, tool, outcome, duration_s)

    def _egress_request(self, job_id: str, policy: str, summary: dict[str, Any]) -> None:
        live = self.registry.job(job_id)
        self.audit.egress(live.owner.peer if live else None, job_id, summary)
        self.metrics.egress(policy, summary)

    def refused(self, peer: Peer, code: str, message: str, **extra: Any) -> bool:
        """A connection or request was refused: counted, and audited -- rate-limited per
        uid (False: only counted, for the uid's ``refused_summary``)."""
        return self.requests.refused(peer, code, message, **extra)


async def serve(config: DaemonConfig) -> None:
    """Run a daemon until SIGTERM/SIGINT, then stop it gracefully: after SIGTERM, with
    ``daemon.drain_s`` set, its running jobs first get that long to finish (:meth:`Daemon.
    drain`; a SIGINT, or a second SIGTERM, ends the drain at once).

    The signal handlers are installed before start-up, so a stop request that
    arrives while the daemon is still starting stops it as soon as it serves.
    """
    import signal

    log.debug("scheduling: %s", sched.request_slice(config.sched_slice_us))  # not news
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals: list[int] = []

    def requested(sig: int) -> None:
        signals.append(sig)
        stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, requested, sig)

    def reload() -> None:
        if daemon.listeners is not None:
            daemon.listeners.reload()

    loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        await daemon.start()
        await stop_requested.wait()  # only a signal stops this daemon (stop() runs below)
        if config.drain_s > 0 and signals[0] == signal.SIGTERM:
            stop_requested.clear()
            draining = asyncio.ensure_future(daemon.drain(config.drain_s))
            interrupted = asyncio.ensure_future(stop_requested.wait())
            await asyncio.wait({draining, interrupted}, return_when=asyncio.FIRST_COMPLETED)
            for task in (draining, interrupted):
                task.cancel()
            if signals[-1] == signal.SIGINT or len(signals) > 1:
                log.info("the drain was cut short by signal %d", signals[-1])
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await daemon.stop()


__all__ = ["Daemon", "InternalError", "ServedConnection", "StartupError", "serve"]
