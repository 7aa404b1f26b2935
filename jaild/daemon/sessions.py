"""Sessions: a jail kept for a series of runs of one client (``OpenSession``).

Theory of operation
-------------------
A session's states, and what moves it on:

===========  ==================================  =========  =============================
state        event                               next       action
===========  ==================================  =========  =============================
starting     its jail is ready                   idle       ``SessionOpened``; timers set
starting     its jail does not start             (gone)     ``Error`` to its client
idle         a ``RunJob`` is admitted            running    idle timer stopped
running      the run's record is sent            idle       idle timer restarted
running      the run ended the jail              closed     ``SessionClosed``
idle         its jail ends between runs          closed     ``SessionClosed``
any          idle or lifetime timer, the client  closed     its jail killed (a run in
             closes or leaves, ``jaild kill``,              progress ends ``cancelled``)
             shutdown                                       and discarded
===========  ==================================  =========  =============================

An open session holds a jail: it counts as one of its uid's jails, with its memory
limit, against the uid's share and the daemon's limits (:func:`check_room`) from
``OpenSession`` until it is closed, idle or running.

The tasks of a session -- opening its jail, watching it between runs, discarding
it at the end -- run in its owner connection's task group, so the connection is
not done until its sessions' jails are. While a closed session's jail is being
discarded it is *retiring* in the registry, and shutdown waits for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission
from jaild.daemon.core.peer import Principal
from jaild.daemon.jails.job import JailedJob, JobSpec
from jaild.daemon.observe import Observers
from jaild.daemon.registry import ClientConnection, JailSession, Registry
from jaild.errors import InternalError, JaildError, UnknownSession
from jaild.protocol.messages import JobDescription, OpenSession, SessionOpened
from jaild.protocol.messages import SessionClosed as SessionClosedMsg
from jaild.protocol.records import JobRecord, SessionInfo
from jaild.tracing import SessionTrace

if TYPE_CHECKING:
    from jaild.daemon.startup import Served


def capacity(config: DaemonConfig) -> admission.Capacity:
    """The daemon's limits on what runs at once, derived defaults resolved."""
    return admission.Capacity(
        max_jobs=config.max_jobs,
        max_jobs_per_connection=config.max_jobs_per_connection,
        max_jobs_per_uid=config.jobs_per_uid,
        max_memory_mb=config.memory_ceiling_mb,
        max_memory_mb_per_uid=config.memory_mb_per_uid,
        memory_overcommit=config.memory_overcommit,
    )


def check_room(
    registry: Registry, config: DaemonConfig, who: Principal, memory_mb: int,
    on_connection: int | None = None,
) -> None:
    """Room for one more jail of ``memory_mb`` for the principal ``who``
    (:func:`~jaild.daemon.core.admission.check_capacity` on what ``registry`` holds now).

    Raises:
        Busy: naming the limit reached.
    """
    load = admission.Load(
        daemon=registry.held(),
        uid=registry.held(who.key),
        on_connection=on_connection,
    )
    admission.check_capacity(who, load, capacity(config), memory_mb)

log = logging.getLogger("jaild")

class Sessions:
    """Opening, running in and closing sessions, for one daemon."""

    def __init__(
        self,
        config: DaemonConfig,
        registry: Registry,
        served: Served,
        observers: Observers,
        catalog: Callable[[], admission.Catalog],
    ) -> None:
        """Sessions of the daemon whose settings are ``config``, kept in its ``registry``,
        made in the jail environment it ``served`` with, told to its ``observers``;
        ``catalog``: the policies it serves now (admission's view)."""
        self.config = config
        self.registry = registry
        self.served = served
        self.observers = observers
        self.catalog = catalog

    def runnable(self, client: ClientConnection, session_id: str) -> JailSession:
        """The client's session a ``RunJob`` names, if a run may start in it now.

        Raises:
            UnknownSession, SessionClosed, Busy (a run in progress; the daemon draining).
        """
        sess = self.registry.session(session_id, owner=client)
        if sess is None:
            raise UnknownSession(f"no open session {session_id} of this connection")
        admission.check_not_draining(self.catalog())
        sess.check_runnable()
        return sess

    def open(self, client: ClientConnection, req: OpenSession) -> None:
        """Make a jail that stays for a series of runs; answered by SessionOpened once it
        is ready (or Error if it cannot be made). Raises the refusal the client gets."""
        registry = self.registry
        tracing = self.observers.tracing
        trace = (
            tracing.session(req.traceparent, client.peer.uid, req.policy) if tracing.on else None
        )
        mine = registry.session_count(client.peer.principal.key)
        try:
            terms = admission.admit_session(self.catalog(), client.peer, req, mine)
            check_room(registry, self.config, client.peer.principal, terms.jail_limits.memory_mb)
        except JaildError as refusal:
            if trace is not None:
                trace.ended(None, refusal.code)
            raise
        env = self.served.env
        assert env is not None
        session_id = "ses-" + secrets.token_hex(8)
        spec = JobSpec(
            session_id, terms.policy, terms.jail_limits,
            JobDescription(code="", filename="<session>", tools=terms.tools), keep=True,
            tenant=client.peer.principal.key,
        )
        jail = JailedJob(spec, env, None, None, jail_id=session_id)
        sess = JailSession(session_id, client, terms, jail)
        registry.add_session(sess)
        self.observers.metrics.sessions_open(registry.session_count())
        client.start(self._open(sess, req.ref, trace))

    async def _open(self, sess: JailSession, ref: int, trace: SessionTrace | None) -> None:
        client = sess.owner
        ready = await sess.jail.prepare()
        if not ready or sess.closed is not None:
            detail = sess.closed or "the jail did not start"
            if not ready:
                _, error = await sess.jail.ended()
                error = error or {}
                detail = f"{error.get('type', 'JailStartFailed')}: {error.get('message', '')}"
            self._forget(sess)
            sess.jail.cleanup()
            client.send_error(InternalError(f"the session's jail did not start: {detail}"), ref=ref)
            if trace is not None:
                trace.ended(sess.id, InternalError.code)
            return
        loop = asyncio.get_running_loop()
        sess.life_timer = loop.call_later(
            sess.max_lifetime_s,
            self.close,
            sess,
            "lifetime",
            f"the session reached its maximum lifetime of {sess.max_lifetime_s:g} s",
        )
        sess.touch(self.close)
        client.start(self._watch(sess))
        self.observers.accounting.session(client.peer.principal, sess.policy.name)
        self.observers.audit.session(client.peer, "opened", sess.id, sess.policy.name)
        client.send(
            SessionOpened(
                ref=ref,
                session_id=sess.id,
                record=SessionInfo(
                    policy=sess.policy.name,
                    idle_s=sess.idle_s,
                    max_lifetime_s=sess.max_lifetime_s,
                    limits=dataclasses.asdict(sess.limits),
                ),
            )
        )
        if trace is not None:
            trace.ended(sess.id)

    async def _watch(self, sess: JailSession) -> None:
        """A session's jail that dies between runs (its code left a thread that broke the
        channel protocol, a background process hit a limit) ends the session at once."""
        status, error = await sess.jail.ended()
        if sess.closed is None and sess.busy is None:
            why = (error or {}).get("message", "")
            self.close(sess, status, f"the session's jail ended between runs: {why}")

    def run_started(self, sess: JailSession, job_id: str) -> None:
        sess.busy = job_id
        sess.touch(self.close, idle=False)

    def run_ended(self, sess: JailSession) -> None:
        sess.busy = None

    def after_run(self, sess: JailSession, job_id: str, record: JobRecord) -> None:
        """A run's record was sent: the session goes on, or ends with its jail."""
        if not sess.jail.alive:
            why = f"run {job_id} ended the session: {record.error.message if record.error else ''}"
            self.close(sess, record.status, why)
        elif sess.closed is None:
            sess.touch(self.close)

    def close(self, sess: JailSession, reason: str, message: str) -> None:
        """End a session: its jail is killed (a run in progress ends ``cancelled``), its
        client is told. Idempotent."""
        if sess.closed is not None:
            return
        sess.closed = reason
        for timer in (sess.idle_timer, sess.life_timer):
            if timer is not None:
                timer.cancel()
        if sess.busy is not None:
            sess.jail.cancel(f"the session was closed ({reason}): {message}")
        self._forget(sess)
        sess.owner.start(self._discard(sess, f"session {reason}"))
        self.observers.audit.session(sess.owner.peer, "closed", sess.id, sess.policy.name,
                                     reason=reason)
        sess.owner.send(SessionClosedMsg(session_id=sess.id, reason=reason, message=message[:4096]))

    async def _discard(self, sess: JailSession, reason: str) -> None:
        async with self.registry.retiring():
            await sess.jail.discard(reason)

    def _forget(self, sess: JailSession) -> None:
        registry = self.registry
        registry.remove_session(sess)
        self.observers.metrics.sessions_open(registry.session_count())


__all__ = ["JailSession", "Sessions", "capacity", "check_room"]
