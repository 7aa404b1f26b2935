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
running      a call waits past the policy's      parked     its jail ends; the state from
             ``approvals.park_after_s``                     before the run waits on disk
parked       the call decided, a host attached   running    a fresh jail restores the state
                                                            and replays the run
parked       the client leaves, shutdown         detached   the parked run keeps it (any
                                                            of the owner's connections
                                                            may ``ResumeRun`` it)
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
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from jaild.daemon import placement
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission, disclosure
from jaild.daemon.core.peer import Principal
from jaild.daemon.flowgate import flow_released
from jaild.daemon.jails.job import CallReply, JailedJob, JobSpec
from jaild.daemon.observe import Observers
from jaild.daemon.registry import ClientConnection, JailSession, LiveJob, Registry
from jaild.daemon.snapshots import SnapshotStore
from jaild.errors import (
    BadRequest,
    Busy,
    InternalError,
    JaildError,
    PermissionDenied,
    SnapshotFailed,
    UnknownSession,
    UnknownSnapshot,
)
from jaild.policy.schema import Policy, flow_rules
from jaild.protocol.messages import (
    JobDescription,
    OpenSession,
    PauseSession,
    ResumeSession,
    SessionOpened,
    SnapshotSession,
    SnapshotTaken,
    ToolSpec,
)
from jaild.protocol.messages import SessionClosed as SessionClosedMsg
from jaild.protocol.messages import SessionPaused as SessionPausedMsg
from jaild.protocol.records import JobRecord, SessionInfo, SnapshotEntry
from jaild.tracing import SessionTrace

if TYPE_CHECKING:
    from jaild.daemon.approvals import Approvals, DurableRun
    from jaild.daemon.startup import Served

    RunPlaced = Callable[[ClientConnection, placement.Placed, DurableRun], Awaitable[None]]


def capacity(config: DaemonConfig) -> admission.Capacity:
    """The daemon's limits on what runs at once, derived defaults resolved."""
    return admission.Capacity(
        max_jobs=config.max_jobs,
        max_jobs_per_connection=config.max_jobs_per_connection,
        max_jobs_per_uid=config.jobs_per_uid,
        max_memory_mb=config.memory_ceiling_mb,
        max_memory_mb_per_uid=config.memory_mb_per_uid,
        memory_overcommit=config.memory_overcommit,
        slot_resource=config.slot_resource,
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
        pod_jails=registry.held(pod_uid=who.pod_uid).jails if who.slots else 0,
    )
    admission.check_capacity(who, load, capacity(config), memory_mb)

log = logging.getLogger("jaild")


def _no_tools(job_id: str, call_id: int, name: str, args: bytes, approval: bool) -> CallReply:
    """A snapshot's or restore's tool calls (code of the session's own, a ``__reduce__``):
    refused at once."""
    reply = CallReply()
    reply.resolve(False, ("ToolError", "no tool calls while a snapshot is taken or restored"))
    return reply


def _no_output(job_id: str, stream: str, data: bytes) -> None:
    """What a snapshot or restore prints (a ``__reduce__`` of the session's): dropped."""


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
        self._store: SnapshotStore | None = None
        self.approvals: Approvals | None = None  # the daemon's (parked session runs)
        self.run_placed: RunPlaced | None = None  # the pipeline's run_to_record

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
        labels = terms.labels  # the caller's (OpenSession.labels)
        try:
            if req.from_snapshot is not None:
                entry = self.store.entry(client.peer.principal.key, req.from_snapshot)
                labels |= frozenset(entry.labels)
                if entry.policy != terms.policy.name:
                    raise BadRequest(
                        f"snapshot {entry.id} was taken under policy {entry.policy!r}; a "
                        f"session restoring it must use that policy, not {terms.policy.name!r}")
        except JaildError as refusal:
            if trace is not None:
                trace.ended(None, refusal.code)
            raise
        session_id = "ses-" + secrets.token_hex(8)
        sess = JailSession(session_id, client, terms,
                           self._jail(session_id, terms, client, labels))
        registry.add_session(sess)
        self.observers.metrics.sessions_open(registry.session_count())
        client.start(self._open(sess, req.ref, trace, req.from_snapshot))

    def _jail(self, jail_id: str, terms: admission.SessionTerms,
              client: ClientConnection, labels: frozenset[str]) -> JailedJob:
        """A session's jail, holding ``labels`` from its start: the labels of the state it
        will restore (a snapshot's, a paused or parked session's), so that no byte of that
        state runs before its labels close what they close. Every path that brings state
        into a fresh jail comes through here, and the jail's machine refuses a restore whose
        labels its jail does not hold (:class:`jaild.daemon.core.machine.JobSpec`)."""
        env = self.served.env
        assert env is not None
        spec = JobSpec(
            jail_id, terms.policy, terms.jail_limits,
            JobDescription(code="", filename="<session>", tools=terms.tools), keep=True,
            tenant=client.peer.principal.key, labels=labels,
        )
        return JailedJob(spec, env, None, None, jail_id=jail_id)

    async def _open(self, sess: JailSession, ref: int, trace: SessionTrace | None,
                    from_snapshot: str | None = None) -> None:
        client = sess.owner
        failed = await self._start_jail(sess, from_snapshot)
        if failed is not None:
            self._forget(sess)
            sess.jail.cleanup()
            client.send_error(failed, ref=ref)
            if trace is not None:
                trace.ended(sess.id, failed.code)
            return
        loop = asyncio.get_running_loop()
        sess.life_timer = loop.call_later(
            sess.max_lifetime_s,
            self.close,
            sess,
            "lifetime",
            f"the session reached its maximum lifetime of {sess.max_lifetime_s:g} s",
        )
        self._touch(sess)
        client.start(self._watch(sess, sess.jail))
        self.observers.accounting.session(client.peer.principal, sess.policy.name)
        self.observers.audit.session(client.peer, "opened", sess.id, sess.policy.name)
        client.send(self._opened(sess, ref))
        if trace is not None:
            trace.ended(sess.id)

    @staticmethod
    def _opened(sess: JailSession, ref: int) -> SessionOpened:
        return SessionOpened(
            ref=ref,
            session_id=sess.id,
            record=SessionInfo(
                policy=sess.policy.name,
                idle_s=sess.idle_s,
                max_lifetime_s=sess.max_lifetime_s,
                limits=dataclasses.asdict(sess.limits),
            ),
        )

    async def _start_jail(self, sess: JailSession, snapshot_id: str | None,
                          blob: bytes | None = None,
                          labels: tuple[str, ...] = ()) -> JaildError | None:
        """Start the session's jail and, with ``snapshot_id``, restore that snapshot in it
        (``blob``: its bytes and ``labels`` its labels, loaded already). The jail was made
        holding the snapshot's labels (:meth:`_jail`); the restore carries them too, and is
        refused if they are not all held. Returns the error its client gets if either fails
        (the jail is then ending)."""
        ready = await sess.jail.prepare()
        if not ready or sess.closed is not None:
            detail = sess.closed or "the jail did not start"
            if not ready:
                _, error = await sess.jail.ended()
                error = error or {}
                detail = f"{error.get('type', 'JailStartFailed')}: {error.get('message', '')}"
            return InternalError(f"the session's jail did not start: {detail}")
        if snapshot_id is None:
            return None
        try:
            if blob is None:
                entry, blob = await asyncio.to_thread(
                    self.store.load, sess.owner.peer.principal.key, snapshot_id)
                labels = entry.labels
            await self._op(sess, restore=blob, labels=frozenset(labels))
        except JaildError as exc:
            sess.jail.cancel(f"the snapshot was not restored: {exc.message}")
            return exc
        return None

    async def _watch(self, sess: JailSession, jail: JailedJob) -> None:
        """A session's jail that dies between runs (its code left a thread that broke the
        channel protocol, a background process hit a limit) ends the session at once; one
        released by a pause does not."""
        status, error = await jail.ended()
        if sess.closed is None and sess.busy is None and jail is sess.jail and not sess.paused:
            why = (error or {}).get("message", "")
            self.close(sess, status, f"the session's jail ended between runs: {why}")

    def _touch(self, sess: JailSession, idle: bool = True) -> None:
        """A run (or snapshot) starts (``idle`` False) or ends: the idle clock, and the
        pause clock of a session that pauses when idle."""
        sess.touch(self.close, idle=idle)
        if sess.pause_timer is not None:
            sess.pause_timer.cancel()
            sess.pause_timer = None
        if idle and sess.pause_after_s and sess.paused is None and sess.closed is None:
            sess.pause_timer = asyncio.get_running_loop().call_later(
                sess.pause_after_s, self._pause_idle, sess)

    def run_started(self, sess: JailSession, job_id: str) -> None:
        sess.busy = job_id
        sess.runs += 1
        self._touch(sess, idle=False)

    def run_ended(self, sess: JailSession) -> None:
        sess.busy = None

    def after_run(self, sess: JailSession, job_id: str, record: JobRecord) -> None:
        """A run's record was sent: the session goes on, or ends with its jail."""
        if not sess.jail.alive:
            why = f"run {job_id} ended the session: {record.error.message if record.error else ''}"
            self.close(sess, record.status, why)
        elif sess.closed is None:
            self._touch(sess)

    # -- snapshots, forks, pauses (docs/using/sessions.md)

    @property
    def store(self) -> SnapshotStore:
        """The daemon's snapshots (made on first use: ``config.snapshot_dir``)."""
        if self._store is None:
            config = self.config
            self._store = SnapshotStore(config.snapshot_dir, config.snapshot_quota_mb << 20,
                                        config.snapshot_max_count,
                                        total_bytes=config.snapshot_total_quota_mb << 20)
        return self._store

    def _idle(self, client: ClientConnection, session_id: str) -> JailSession:
        sess = self.registry.session(session_id, owner=client)
        if sess is None:
            raise UnknownSession(f"no open session {session_id} of this connection")
        if not sess.policy.session.snapshots:
            raise PermissionDenied(f"policy {sess.policy.name!r} does not allow snapshots "
                                   "(session.snapshots = false)")
        sess.check_runnable()
        return sess

    def snapshot(self, client: ClientConnection, req: SnapshotSession) -> None:
        """Take an idle session's snapshot; answered SnapshotTaken (or Error). Raises the
        refusal the client gets."""
        sess = self._idle(client, req.session_id)
        most = sess.policy.session.snapshot_ttl_s
        if req.ttl_s is not None and req.ttl_s > most:
            raise BadRequest(f"ttl_s={req.ttl_s:g} is longer than policy {sess.policy.name!r} "
                             f"keeps snapshots ({most:g} s)")
        self._begin_op(sess, "snapshot")
        client.start(self._snapshot(sess, req.ref, req.ttl_s or most))

    async def _snapshot(self, sess: JailSession, ref: int, ttl_s: float) -> None:
        client = sess.owner
        try:
            blob = await self._op(sess, snapshot=True)
            entry = await asyncio.to_thread(
                self.store.save, client.peer.principal.key, blob, policy=sess.policy.name,
                session=sess.id, ttl_s=ttl_s, labels=sess.jail.labels)
        except JaildError as exc:
            client.send_error(exc, ref=ref)
        else:
            self.observers.audit.session(client.peer, "snapshot", sess.id, sess.policy.name,
                                         reason=entry.id)
            client.send(SnapshotTaken(ref=ref, snapshot=self._entry_view(entry, client)))
        finally:
            self._end_op(sess)

    def pause(self, client: ClientConnection, req: PauseSession) -> None:
        """Pause an idle session to disk now; answered SessionPaused (or Error)."""
        sess = self._idle(client, req.session_id)
        self._begin_op(sess, "pause")
        client.start(self._pause(sess, req.ref))

    def _pause_idle(self, sess: JailSession) -> None:
        sess.pause_timer = None
        if sess.closed is None and sess.busy is None and sess.paused is None:
            self._begin_op(sess, "pause")
            sess.owner.start(self._pause(sess, 0))

    async def _pause(self, sess: JailSession, ref: int) -> None:
        """Snapshot the session (kind ``pause``), then end its jail: it holds disk only."""
        client = sess.owner
        try:
            blob = await self._op(sess, snapshot=True)
            entry = await asyncio.to_thread(
                self.store.save, client.peer.principal.key, blob, policy=sess.policy.name,
                session=sess.id, ttl_s=max(60.0, sess.max_lifetime_s), kind="pause",
                labels=sess.jail.labels)
        except JaildError as exc:
            if ref:
                client.send_error(exc, ref=ref)
            else:  # an idle pause that failed: the session stays as it was
                log.warning("session %s was not paused: %s", sess.id, exc.message)
            self._end_op(sess)
            return
        sess.paused = entry.id
        jail = sess.jail
        self._end_op(sess)
        client.start(self._retire(jail, "session paused"))
        self.observers.audit.session(client.peer, "paused", sess.id, sess.policy.name)
        client.send(SessionPausedMsg(ref=ref, session_id=sess.id,
                                     bytes=self._entry_view(entry, client).bytes))

    def resume(self, client: ClientConnection, req: ResumeSession) -> None:
        """Bring a paused session back in a fresh jail; answered SessionOpened (at once for
        a session that is not paused)."""
        sess = self.registry.session(req.session_id, owner=client)
        if sess is None:
            raise UnknownSession(f"no open session {req.session_id} of this connection")
        if sess.paused is None:
            sess.check_runnable()
            client.send(self._opened(sess, req.ref))
            return
        if sess.parked_run is not None:
            sess.check_runnable()  # Busy: its run waits for approval
        if sess.busy is not None:
            raise Busy(f"session {sess.id} is being resumed already")
        admission.check_not_draining(self.catalog())
        check_room(self.registry, self.config, client.peer.principal,
                   sess.terms.jail_limits.memory_mb)
        try:
            labels = frozenset(self.store.entry(client.peer.principal.key, sess.paused).labels)
        except JaildError as exc:
            self.close(sess, "restore_failed", f"the paused session was not restored: "
                       f"{exc.message}")
            raise
        sess.jails += 1
        sess.jail = self._jail(f"{sess.id}-{sess.jails}", sess.terms, client, labels)
        sess.busy = "resuming"
        client.start(self._resume(sess, req.ref))

    async def _resume(self, sess: JailSession, ref: int) -> None:
        client = sess.owner
        snapshot_id = sess.paused
        failed = await self._start_jail(sess, snapshot_id)
        sess.busy = None
        if failed is not None:
            client.send_error(failed, ref=ref)
            self.close(sess, "restore_failed", f"the paused session was not restored: "
                       f"{failed.message}")
            return
        sess.paused = None
        if snapshot_id is not None:
            with contextlib.suppress(JaildError):
                self.store.delete(client.peer.principal.key, snapshot_id)
        self._touch(sess)
        client.start(self._watch(sess, sess.jail))
        self.observers.audit.session(client.peer, "resumed", sess.id, sess.policy.name)
        client.send(self._opened(sess, ref))

    def snapshots(self, client: ClientConnection) -> list[SnapshotEntry]:
        return [self._entry_view(e, client) for e in self.store.entries(client.peer.principal.key)]

    def _entry_view(self, entry: SnapshotEntry, client: ClientConnection) -> SnapshotEntry:
        """A snapshot's entry as ``client`` may see it: closed (its size bucketed, no
        digest: core/disclosure.py) when its labels withhold or redact a run's result or
        output from that client. Taking it released nothing: the state stays in the store."""
        if not entry.labels:
            return entry
        policy = self.catalog().policies.get(entry.policy)
        if policy is None:
            return disclosure.close_snapshot(entry)  # its rules are not known: closed
        if disclosure.closes(flow_rules(policy), entry.labels,
                             flow_released(policy, client.peer)):
            return disclosure.close_snapshot(entry)
        return entry

    def delete_snapshot(self, client: ClientConnection, snapshot_id: str) -> None:
        """Raises UnknownSnapshot: none of the client's principal has that id (a paused
        session's state is deleted by closing the session)."""
        owner = client.peer.principal.key
        if self.store.entry(owner, snapshot_id).kind in ("pause", "parked"):
            raise UnknownSnapshot(f"no snapshot {snapshot_id} of yours (it is a paused "
                                  "session's state: close the session instead)")
        self.store.delete(owner, snapshot_id)

    def _begin_op(self, sess: JailSession, what: str) -> None:
        sess.busy = what
        self._touch(sess, idle=False)

    def _end_op(self, sess: JailSession) -> None:
        sess.busy = None
        if not sess.jail.alive and sess.paused is None:
            status, error = sess.jail.outcome()  # memory_limit, timeout, ...: what ended it
            why = (error or {}).get("message", "")
            self.close(sess, status, f"the session's jail ended during a snapshot: {why}")
        elif sess.closed is None:
            self._touch(sess)

    async def _op(self, sess: JailSession, *, snapshot: bool = False,
                  restore: bytes | None = None, labels: frozenset[str] = frozenset()) -> bytes:
        """Run a snapshot (returns it) or a restore (of state carrying ``labels``) in the
        session's jail. The op is a run like any other: its record and error pass the flow
        rules of the labels the jail holds, for the session's owner (a snapshot's bytes stay
        in the daemon: no rule withholds them from the store).

        Raises:
            SnapshotFailed: naming what stopped it (the jail's own words, or its status;
                withheld as a run's would be).
        """
        policy = sess.policy
        limits = dataclasses.replace(sess.limits, result_bytes=policy.session.snapshot_max_bytes)
        what = "<snapshot>" if snapshot else "<restore>"
        spec = JobSpec(
            placement.new_job_id(), policy, limits,
            JobDescription(code="", filename=what, tools=sess.tools), keep=True,
            tenant=sess.owner.peer.principal.key, snapshot=snapshot, restore=restore,
            released=flow_released(policy, sess.owner.peer), labels=labels,
        )
        record, result, _ = await sess.jail.run_next(spec, _no_tools, _no_output)
        if record.status == "ok" and (result is not None or not snapshot):
            return result or b""
        why = record.error.message if record.error is not None else record.status
        verb = "taken" if snapshot else "restored"
        raise SnapshotFailed(f"the snapshot was not {verb}: {why}")

    def close(self, sess: JailSession, reason: str, message: str) -> None:
        """End a session: its jail is killed (a run in progress ends ``cancelled``), its
        client is told; a paused session's state is deleted. Idempotent.

        A session whose run is parked for approval is *detached* instead when its client
        leaves or the daemon stops (the parked run keeps its state, to go on later); closed
        otherwise, it drops that run."""
        if sess.closed is not None:
            return
        sess.closed = reason
        for timer in (sess.idle_timer, sess.life_timer, sess.pause_timer):
            if timer is not None:
                timer.cancel()
        parked = self._parked_run(sess)
        if parked is not None and reason in ("disconnected", "shutdown"):
            self._forget(sess)
            self.observers.audit.session(sess.owner.peer, "detached", sess.id, sess.policy.name,
                                         reason=parked.job_id)
            return
        if parked is not None and self.approvals is not None:
            self.approvals.drop(parked, f"its session was closed ({reason})")
        if sess.paused is not None:
            with contextlib.suppress(JaildError, OSError):
                self.store.delete(sess.owner.peer.principal.key, sess.paused)
        if sess.busy is not None:
            sess.jail.cancel(f"the session was closed ({reason}): {message}")
        self._forget(sess)
        sess.owner.start(self._discard(sess, f"session {reason}"))
        self.observers.audit.session(sess.owner.peer, "closed", sess.id, sess.policy.name,
                                     reason=reason)
        sess.owner.send(SessionClosedMsg(session_id=sess.id, reason=reason, message=message[:4096]))

    async def _discard(self, sess: JailSession, reason: str) -> None:
        await self._retire(sess.jail, reason)

    async def _retire(self, jail: JailedJob, reason: str) -> None:
        async with self.registry.retiring():
            await jail.discard(reason)

    # -- session runs parked for approval (jaild.daemon.approvals; docs/using/tools.md)

    def _parked_run(self, sess: JailSession) -> DurableRun | None:
        if sess.parked_run is None or self.approvals is None:
            return None
        return self.approvals.session_run(sess.id)

    async def state_before(self, sess: JailSession, run: DurableRun) -> None:
        """Before a run that may park: the session's state (kept in memory, saved only if
        the run parks). Not taken (something unpicklable, too large): the run's calls wait
        live."""
        if run.before is not None or run.state_id is not None:  # a continuation: restored
            return
        try:
            run.before_labels = tuple(sess.jail.labels)
            run.before = await self._op(sess, snapshot=True)
        except JaildError as exc:
            log.info("session %s: run %s cannot park (its state was not taken: %s); a call "
                     "needing approval waits live", sess.id, run.job_id, exc.message)

    def keep_state(self, run: DurableRun) -> str | None:
        """The run parks: its session's state before it goes to the snapshot store."""
        blob = run.before
        if blob is None or run.session_id is None:
            return None
        ttl_s = run.policy.approvals.max_wait_s + 86400.0
        try:
            entry = self.store.save(run.owner_key, blob, policy=run.policy.name,
                                    session=run.session_id, ttl_s=ttl_s, kind="parked",
                                    labels=run.before_labels)
        except (JaildError, OSError) as exc:
            log.warning("session %s: run %s waits live, not parked: its state was not saved "
                        "(%s)", run.session_id, run.job_id, getattr(exc, "message", exc))
            return None
        run.before = None
        return entry.id

    def parked(self, run: DurableRun) -> None:
        """The run parked: its session, if still here, is paused with it (its jail goes)."""
        sess = self.registry.session(run.session_id or "")
        if sess is None or sess.closed is not None:
            return
        sess.paused = run.state_id
        sess.parked_run = run.job_id
        for timer in (sess.idle_timer, sess.life_timer, sess.pause_timer):
            if timer is not None:
                timer.cancel()
        sess.pause_timer = None
        sess.owner.start(self._retire(sess.jail, "session run parked"))
        self.observers.audit.session(sess.owner.peer, "parked", sess.id, sess.policy.name,
                                     reason=run.job_id)

    def dropped(self, run: DurableRun) -> None:
        """The parked run was dropped: its state goes; its session, if here, closes."""
        with contextlib.suppress(JaildError, OSError):
            if run.state_id is not None:
                self.store.delete(run.owner_key, run.state_id)
        sess = self.registry.session(run.session_id or "")
        if sess is not None and sess.parked_run == run.job_id:
            sess.paused = None
            sess.parked_run = None
            self.close(sess, "parked_run_dropped",
                       f"its run {run.job_id}, parked for approval, was dropped")

    def run_done(self, run: DurableRun) -> None:
        """A session run that had parked has ended: the state it parked with goes."""
        if run.state_id is not None:
            with contextlib.suppress(JaildError, OSError):
                self.store.delete(run.owner_key, run.state_id)
            run.state_id = None

    def continue_run(self, run: DurableRun, host: ClientConnection, ref: int | None) -> None:
        """A parked session run was decided and has a host: its session (re-made on
        ``host`` if it was detached) gets a fresh jail, the state from before the run is
        restored there and the run replayed (:mod:`jaild.daemon.approvals`)."""
        assert run.session_id is not None and run.state_id is not None
        policy = self.catalog().policies.get(run.policy.name, run.policy)
        sess = self.registry.session(run.session_id)
        try:
            terms = sess.terms if sess is not None else self._terms_of(run, policy)
            check_room(self.registry, self.config, host.peer.principal,
                       terms.jail_limits.memory_mb)
            labels = frozenset(self.store.entry(run.owner_key, run.state_id).labels)
        except JaildError as exc:  # it stays parked: ResumeRun again later
            run.host = None
            host.send_error(exc, job_id=run.job_id)
            return
        if sess is None:
            sess = JailSession(run.session_id, host, terms,
                               self._jail(f"{run.session_id}-r{run.resumes + 1}", terms, host,
                                          labels))
            sess.paused, sess.parked_run = run.state_id, run.job_id
            sess.runs = int((run.session_terms or {}).get("run", 1))  # the run's number
            self.registry.add_session(sess)
            self.observers.metrics.sessions_open(self.registry.session_count())
        else:
            sess.owner = host
            sess.jails += 1
            sess.jail = self._jail(f"{sess.id}-{sess.jails}", terms, host, labels)
        run.policy = policy
        run.continuing = True
        sess.busy = run.job_id
        host.start(self._continue_run(sess, run, host))

    @staticmethod
    def _terms_of(run: DurableRun, policy: Policy) -> admission.SessionTerms:
        """The terms a detached session is re-made with (as it was opened)."""
        saved = run.session_terms or {}
        requested = {str(k): float(v) for k, v in dict(saved.get("requested", {})).items()}
        limits = admission.limits_for(policy, requested)
        return admission.SessionTerms(
            policy=policy, limits=limits,
            jail_limits=dataclasses.replace(limits, cpu_time_s=policy.session.cpu_time_s),
            tools=tuple(ToolSpec.from_wire(t) for t in saved.get("tools", ())),
            requested=requested, idle_s=float(saved.get("idle_s", policy.session.idle_s)),
            max_lifetime_s=float(saved.get("max_lifetime_s", policy.session.max_lifetime_s)),
            pause_after_s=float(saved.get("pause_after_s", 0.0)))

    async def _continue_run(self, sess: JailSession, run: DurableRun,
                            host: ClientConnection) -> None:
        state = run.state_id
        assert state is not None
        try:
            entry, blob = await asyncio.to_thread(self.store.load, run.owner_key, state)
        except JaildError as exc:
            failed: JaildError | None = exc
            blob = None
        else:
            run.before_labels = entry.labels
            failed = await self._start_jail(sess, state, blob, entry.labels)
        if failed is not None or sess.closed is not None:
            run.continuing = False
            run.host = None  # it stays parked: ResumeRun again
            sess.busy = None
            host.send_error(failed or InternalError(f"session {sess.id} was closed"),
                            job_id=run.job_id)
            if isinstance(failed, UnknownSnapshot) and self.approvals is not None:
                self.approvals.drop(run, f"its session's state is gone: {failed.message}")
            elif sess.owner is host and sess.closed is None:
                self._forget(sess)  # detached again, as before the attempt
                host.start(self._retire(sess.jail, "the parked run did not go on"))
            return
        run.before = blob
        sess.paused = None
        sess.parked_run = None
        loop = asyncio.get_running_loop()
        sess.reopened()
        sess.life_timer = loop.call_later(
            sess.max_lifetime_s, self.close, sess, "lifetime",
            f"the session reached its maximum lifetime of {sess.max_lifetime_s:g} s")
        host.start(self._watch(sess, sess.jail))
        self.observers.audit.session(host.peer, "continued", sess.id, sess.policy.name,
                                     reason=run.job_id)
        run.restart_jail()
        run.jail = sess.jail
        limits = admission.limits_for(sess.policy, {**sess.terms.requested, **run.requested})
        spec = JobSpec(run.job_id, sess.policy, limits, run.job, keep=True,
                       tenant=host.peer.principal.key,
                       released=flow_released(sess.policy, host.peer), hold=frozenset(run.hold))
        placed = placement.Placed(spec, sess.jail, run.route, run.output, sess)
        self.registry.add_job(LiveJob(run.job_id, sess.jail, host, sess, memory_mb=0))
        assert self.run_placed is not None
        await self.run_placed(host, placed, run)

    def _forget(self, sess: JailSession) -> None:
        registry = self.registry
        registry.remove_session(sess)
        self.observers.metrics.sessions_open(registry.session_count())


__all__ = ["JailSession", "Sessions", "capacity", "check_room"]
