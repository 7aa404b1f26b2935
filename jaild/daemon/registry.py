"""The registry: every live connection, job and session of a daemon, in one place.

Theory of operation
-------------------
A job is *live* from the moment it is accepted (``JobAccepted`` is sent) until its
record has been sent; a session from ``OpenSession`` until it is closed; a
session's jail is *retiring* from its close until its jail is gone. Each live job
and session has one owner, the connection that made it: only that connection may
cancel it or answer its tool calls, and ``jaild ps``/``kill`` show others' only
to root. Everything that asks "which jobs", "whose", "how many" -- admission's
limits, ps, kill, stats, cancel on disconnect, shutdown -- asks here. What a uid
*holds* against its share (:meth:`held`) is counted in jails: a one-shot job
running or a session open, each with its memory limit.

===============  ===========================  ==============================
event            registry                     who calls
===============  ===========================  ==============================
accepted         :meth:`add_job`              the pipeline (submit)
record sent      :meth:`remove_job`           the pipeline (run_to_record)
session opened   :meth:`add_session`          sessions (open)
session closed   :meth:`remove_session`,      sessions (close)
                 :meth:`retiring` until gone
===============  ===========================  ==============================

:meth:`drained` waits until no job is live and no session's jail is retiring:
shutdown waits for it (within its grace period) before it stops the zygotes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaild.daemon.core import admission
from jaild.daemon.core.peer import Peer, Principal, Tenant
from jaild.daemon.core.records import with_session
from jaild.daemon.jails.job import CallReply, JailedJob
from jaild.errors import Busy, JaildError, SessionClosed, SessionPaused
from jaild.policy.schema import Limits, Policy
from jaild.protocol.messages import Message, ToolSpec
from jaild.protocol.records import JobRecord


class ClientConnection(Protocol):
    """What the daemon's core needs of a client connection (the server's
    :class:`~jaild.daemon.server.ServedConnection`): who it is, sending to it, running work
    in its task group, its part of a job (output, tool calls), and shutting it at the
    stop. Declared here, where connections are registered, so that the core does not
    depend on the server."""

    @property
    def peer(self) -> Peer: ...

    def send(self, msg: Message) -> None: ...

    def accept(self, ref: int, job_id: str, session_id: str | None = None) -> None: ...

    def send_error(
        self, err: JaildError, ref: int | None = None, job_id: str | None = None
    ) -> None: ...

    def start(self, work: Coroutine[Any, Any, None]) -> None: ...

    def output(self, job_id: str, stream: str, data: bytes) -> None: ...

    def call_tool(
        self, job_id: str, call_id: int, name: str, args: bytes, approval: bool = False
    ) -> CallReply: ...

    async def shut(self) -> None: ...


@dataclass(eq=False)
class LiveJob:
    """A job accepted and not yet finished (a one-shot job, or a session's run)."""

    job_id: str
    jail: JailedJob  # its jail (a session's run: the session's)
    owner: ClientConnection
    session: JailSession | None = None
    started: float = field(default_factory=time.time)
    memory_mb: int = 0  # its jail's memory limit (a session's run: 0, the session holds it)


Close = Callable[["JailSession", str, str], None]


class JailSession:
    """A jail kept for a series of runs of one client."""

    def __init__(
        self,
        session_id: str,
        owner: ClientConnection,
        terms: admission.SessionTerms,
        jail: JailedJob,
    ) -> None:
        self.id = session_id
        self.owner = owner
        self.policy: Policy = terms.policy
        self.limits: Limits = terms.limits
        self.tools: tuple[ToolSpec, ...] = terms.tools
        self.terms = terms
        self.jail = jail
        self.idle_s = terms.idle_s
        self.max_lifetime_s = terms.max_lifetime_s
        self.created = time.time()
        self._opened = time.monotonic()
        self.last_used = time.monotonic()
        self.busy: str | None = None  # the job id of the run in progress
        self.closed: str | None = None  # why it ended
        self.idle_timer: asyncio.TimerHandle | None = None
        self.life_timer: asyncio.TimerHandle | None = None  # set once the jail is ready
        self.pause_after_s = terms.pause_after_s  # 0: never paused when idle
        self.pause_timer: asyncio.TimerHandle | None = None
        self.paused: str | None = None  # paused to disk: the id of its state's snapshot
        self.parked_run: str | None = None  # paused with its run, which waits for approval
        self.runs = 0  # the client's runs (snapshots and restores are not runs)
        self.jails = 1  # jails it has had: a resumed session is in its second

    def touch(self, close: Close, idle: bool = True) -> None:
        """A run starts (idle=False: no idle expiry while it runs) or ends (idle clock
        restarts; at its end ``close`` is called)."""
        self.last_used = time.monotonic()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if idle:
            self.idle_timer = asyncio.get_running_loop().call_later(
                self.idle_s,
                close,
                self,
                "idle",
                f"no run for {self.idle_s:g} s (the session's idle limit)",
            )

    def reopened(self) -> None:
        """Its jail is back after a parked run: its lifetime counts anew."""
        self._opened = time.monotonic()
        self.last_used = self._opened

    def expires_in(self) -> float:
        left = self.max_lifetime_s - (time.monotonic() - self._opened)
        if self.busy is None:
            left = min(left, self.idle_s - (time.monotonic() - self.last_used))
        return max(0.0, left)

    def check_runnable(self) -> None:
        """May a run start now?

        Raises:
            SessionClosed, Busy: naming why not.
        """
        if self.closed is not None:
            raise SessionClosed(f"session {self.id} is closed: {self.closed}")
        if self.busy is not None:
            raise Busy(f"session {self.id} is running job {self.busy}; one run at a time")
        if self.parked_run is not None:
            raise Busy(f"session {self.id}'s run {self.parked_run} is parked for approval; the "
                       "session goes on once the call is decided (jaild approvals)")
        if self.paused is not None:
            raise SessionPaused(f"session {self.id} is paused to disk; resume it first "
                                "(ResumeSession)")
        if self.life_timer is None:
            raise Busy(f"session {self.id} is still starting; wait for SessionOpened")

    def run_entry(self, record: JobRecord) -> JobRecord:
        """``record`` as this session's run (with the status that ended it, if it did)."""
        closed = None if self.jail.alive else record.status
        return with_session(record, self.id, self.runs, closed)

    def ps_row(self, now: float) -> dict[str, Any]:
        """This session as ``jaild ps`` shows it."""
        owner = self.owner.peer
        return {
            "id": self.id,
            "kind": "session",
            "policy": self.policy.name,
            "uid": owner.uid if owner.uid >= 0 else None,
            "principal": owner.principal.name if owner.principal.kind == "cert" else None,
            "pod": owner.principal.pod,
            "client_pid": owner.pid,
            "state": "starting"
            if self.life_timer is None
            else ("running" if self.busy else "parked" if self.parked_run
                  else "paused" if self.paused else "idle"),
            "age_s": round(max(0.0, now - self.created), 3),  # the wall clock may step back
            "runs": self.runs,
            "running": self.busy,
            "idle_s": round(time.monotonic() - self.last_used, 3),
            "expires_in_s": round(self.expires_in(), 3),
            **({} if self.paused else self.jail.live_usage()),
        }

    @property
    def holds_jail(self) -> bool:
        """Not paused (or being resumed): its jail counts against the limits."""
        return self.paused is None or self.busy is not None


class Registry:
    """See the module docstring."""

    def __init__(self) -> None:
        self.connections: set[ClientConnection] = set()
        self._jobs: dict[str, LiveJob] = {}
        self._sessions: dict[str, JailSession] = {}
        self._retiring = 0
        self._drained = asyncio.Event()
        self._drained.set()

    # -- connections

    def connect(self, conn: ClientConnection) -> None:
        self.connections.add(conn)

    def disconnect(self, conn: ClientConnection) -> None:
        self.connections.discard(conn)

    # -- jobs

    def add_job(self, live: LiveJob) -> None:
        assert live.job_id not in self._jobs, live.job_id
        self._jobs[live.job_id] = live
        self._update()

    def remove_job(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._update()

    def job(self, job_id: str, owner: ClientConnection | None = None) -> LiveJob | None:
        """A live job; with ``owner``, only if it is that connection's."""
        live = self._jobs.get(job_id)
        if live is None or (owner is not None and live.owner is not owner):
            return None
        return live

    def jobs(self, owner: ClientConnection | None = None) -> list[LiveJob]:
        """The live jobs (of ``owner``), oldest first."""
        return [j for j in self._jobs.values() if owner is None or j.owner is owner]

    def job_count(self, owner: ClientConnection | None = None) -> int:
        if owner is None:
            return len(self._jobs)
        return sum(1 for j in self._jobs.values() if j.owner is owner)

    def held(self, tenant: Tenant | None = None, *, pod_uid: str = "") -> admission.Held:
        """The jails held (of connections of the principal ``tenant``; with ``pod_uid``, of
        that pod's, whatever its key) and their memory limits: one-shot jobs running and
        sessions open; a session's run is its session's jail."""

        def mine(principal: Principal) -> bool:
            if pod_uid:
                return principal.in_pod(pod_uid)
            return tenant is None or principal.key == tenant

        jails = memory = 0
        for live in self._jobs.values():
            if live.session is None and mine(live.owner.peer.principal):
                jails += 1
                memory += live.memory_mb
        for sess in self._sessions.values():
            if not sess.holds_jail:
                continue
            if mine(sess.owner.peer.principal):
                jails += 1
                memory += sess.terms.jail_limits.memory_mb
        return admission.Held(jails, memory)

    def pids(self) -> Iterator[int]:
        """The nsjail pids of the live jobs (our children)."""
        for live in self._jobs.values():
            if live.jail.pid is not None:
                yield live.jail.pid

    # -- sessions

    def add_session(self, sess: JailSession) -> None:
        self._sessions[sess.id] = sess

    def remove_session(self, sess: JailSession) -> None:
        self._sessions.pop(sess.id, None)

    def session(self, session_id: str, owner: ClientConnection | None = None) -> JailSession | None:
        """An open session; with ``owner``, only if it is that connection's."""
        sess = self._sessions.get(session_id)
        if sess is None or (owner is not None and sess.owner is not owner):
            return None
        return sess

    def sessions(self, owner: ClientConnection | None = None) -> list[JailSession]:
        return [s for s in self._sessions.values() if owner is None or s.owner is owner]

    def session_count(self, tenant: Tenant | None = None) -> int:
        """Open sessions (of connections of the principal ``tenant``)."""
        if tenant is None:
            return len(self._sessions)
        return sum(1 for s in self._sessions.values() if s.owner.peer.principal.key == tenant)

    @contextlib.asynccontextmanager
    async def retiring(self) -> AsyncIterator[None]:
        """Around the discard of a closed session's jail: :meth:`drained` waits for it."""
        self._retiring += 1
        self._update()
        try:
            yield
        finally:
            self._retiring -= 1
            self._update()

    # -- shutdown

    async def drained(self) -> None:
        """Until no job is live and no session's jail is retiring."""
        await self._drained.wait()

    def _update(self) -> None:
        if self._jobs or self._retiring:
            self._drained.clear()
        else:
            self._drained.set()


__all__ = ["LiveJob", "Registry"]
