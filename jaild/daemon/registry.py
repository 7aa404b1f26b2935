"""The registry: every live connection, job and session of a daemon, in one place.

Theory of operation
-------------------
A job is *live* from the moment it is accepted (``JobAccepted`` is sent) until its
record has been sent; a session from ``OpenSession`` until it is closed; a
session's jail is *retiring* from its close until its jail is gone. Each live job
and session has one owner, the connection that made it: only that connection may
cancel it or answer its tool calls, and ``jaild ps``/``kill`` show others' only
to root. Everything that asks "which jobs", "whose", "how many" -- admission's
limits, ps, kill, stats, cancel on disconnect, shutdown -- asks here.

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
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaild.daemon.job import JailedJob

if TYPE_CHECKING:
    from jaild.daemon.server import ClientSession
    from jaild.daemon.sessions import JailSession


@dataclass(eq=False)
class LiveJob:
    """A job accepted and not yet finished (a one-shot job, or a session's run)."""

    job_id: str
    jail: JailedJob  # its jail (a session's run: the session's)
    owner: ClientSession
    session: JailSession | None = None
    started: float = field(default_factory=time.time)


class Registry:
    """See the module docstring."""

    def __init__(self) -> None:
        self.connections: set[ClientSession] = set()
        self._jobs: dict[str, LiveJob] = {}
        self._sessions: dict[str, JailSession] = {}
        self._retiring = 0
        self._drained = asyncio.Event()
        self._drained.set()

    # -- connections

    def connect(self, conn: ClientSession) -> None:
        self.connections.add(conn)

    def disconnect(self, conn: ClientSession) -> None:
        self.connections.discard(conn)

    # -- jobs

    def add_job(self, live: LiveJob) -> None:
        assert live.job_id not in self._jobs, live.job_id
        self._jobs[live.job_id] = live
        self._update()

    def remove_job(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._update()

    def job(self, job_id: str, owner: ClientSession | None = None) -> LiveJob | None:
        """A live job; with ``owner``, only if it is that connection's."""
        live = self._jobs.get(job_id)
        if live is None or (owner is not None and live.owner is not owner):
            return None
        return live

    def jobs(self, owner: ClientSession | None = None) -> list[LiveJob]:
        """The live jobs (of ``owner``), oldest first."""
        return [j for j in self._jobs.values() if owner is None or j.owner is owner]

    def job_count(self, owner: ClientSession | None = None) -> int:
        if owner is None:
            return len(self._jobs)
        return sum(1 for j in self._jobs.values() if j.owner is owner)

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

    def session(self, session_id: str, owner: ClientSession | None = None) -> JailSession | None:
        """An open session; with ``owner``, only if it is that connection's."""
        sess = self._sessions.get(session_id)
        if sess is None or (owner is not None and sess.owner is not owner):
            return None
        return sess

    def sessions(self, owner: ClientSession | None = None) -> list[JailSession]:
        return [s for s in self._sessions.values() if owner is None or s.owner is owner]

    def session_count(self, uid: int | None = None) -> int:
        """Open sessions (of connections of ``uid``)."""
        if uid is None:
            return len(self._sessions)
        return sum(1 for s in self._sessions.values() if s.owner.peer.uid == uid)

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
