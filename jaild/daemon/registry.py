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
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaild.daemon.core import admission
from jaild.daemon.core.peer import Peer, Principal, PrincipalKind, Tenant
from jaild.daemon.core.records import with_session
from jaild.daemon.core.session import Phase, SessionMachine, shown
from jaild.daemon.jails.job import CallReply, JailedJob
from jaild.errors import JaildError
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


class JailSession:
    """A jail kept for a series of runs of one client: its life is its
    :class:`~jaild.daemon.core.session.SessionMachine` (``machine``); this holds what the
    driver (:class:`jaild.daemon.sessions.Sessions`) needs around it -- its owner, terms,
    current jail, timers and clocks."""

    def __init__(
        self,
        owner: ClientConnection,
        terms: admission.SessionTerms,
        machine: SessionMachine,
        jail: JailedJob,
    ) -> None:
        self.id = machine.session_id
        self.owner = owner
        self.terms = terms
        self.machine = machine
        self.jail = jail
        self.created = time.time()
        self._opened = time.monotonic()
        self.last_used = time.monotonic()
        self.idle_timer: asyncio.TimerHandle | None = None
        self.life_timer: asyncio.TimerHandle | None = None  # set once the jail is ready
        self.pause_timer: asyncio.TimerHandle | None = None

    @property
    def policy(self) -> Policy:
        return self.terms.policy

    @property
    def limits(self) -> Limits:
        return self.terms.limits

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        return self.terms.tools

    @property
    def phase(self) -> Phase:
        return self.machine.phase

    def stop_timers(self, *, lifetime: bool = False) -> None:
        """Stop the idle and pause timers (and, with ``lifetime``, the lifetime's)."""
        timers = ("idle_timer", "pause_timer", "life_timer") if lifetime \
            else ("idle_timer", "pause_timer")
        for name in timers:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

    def reopened(self) -> None:
        """Its jail is (back) up: its lifetime counts anew."""
        self._opened = time.monotonic()
        self.last_used = self._opened

    def expires_in(self) -> float:
        left = self.terms.max_lifetime_s - (time.monotonic() - self._opened)
        if not self.machine.busy:
            left = min(left, self.terms.idle_s - (time.monotonic() - self.last_used))
        return max(0.0, left)

    def run_entry(self, record: JobRecord) -> JobRecord:
        """``record`` as this session's run (with the status that ended it, if it did)."""
        closed = None if self.jail.alive else record.status
        return with_session(record, self.id, self.machine.runs, closed)

    def ps_row(self, now: float) -> dict[str, Any]:
        """This session as ``jaild ps`` shows it."""
        owner = self.owner.peer
        machine = self.machine
        return {
            "id": self.id,
            "kind": "session",
            "policy": self.policy.name,
            "uid": owner.uid if owner.uid >= 0 else None,
            "principal": (owner.principal.name
                          if owner.principal.kind is PrincipalKind.CERT else None),
            "pod": owner.principal.pod,
            "client_pid": owner.pid,
            "state": shown(machine.phase),
            "age_s": round(max(0.0, now - self.created), 3),  # the wall clock may step back
            "runs": machine.runs,
            "running": machine.run if machine.phase is Phase.RUNNING else None,
            "idle_s": round(time.monotonic() - self.last_used, 3),
            "expires_in_s": round(self.expires_in(), 3),
            **(self.jail.live_usage() if machine.holds_jail else {}),
        }

    @property
    def holds_jail(self) -> bool:
        """Not paused or parked (a session coming back holds its new jail): its jail counts
        against the limits."""
        return self.machine.holds_jail


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


__all__ = ["ClientConnection", "JailSession", "LiveJob", "Registry"]
