"""Sessions: a jail kept for a series of runs of one client (``OpenSession``).

Theory of operation
-------------------
A session's life is a pure machine (:class:`~jaild.daemon.core.session.SessionMachine`: its
phases, events and actions are tabled there). :class:`Sessions` is its driver: it turns
requests and what the jails do into the machine's events, and carries out the actions the
machine gives back -- timers, retiring and cancelling jails, deleting states, dropping a
parked run, telling the client. It keeps no state of a session's life of its own.

An open session holds a jail: it counts as one of its uid's jails, with its memory
limit, against the uid's share and the daemon's limits (:func:`check_room`) from
``OpenSession`` until it is closed, idle or running; paused or parked, it holds disk only.

The tasks of a session -- opening its jail, watching it between runs, discarding
it at the end -- run in its owner connection's task group, so the connection is
not done until its sessions' jails are. While a closed session's jail is being
discarded it is *retiring* in the registry, and shutdown waits for it.

A session whose run parks for approval (:mod:`jaild.daemon.approvals`) comes back for the
run's continuation through :meth:`ParkedSessions.reopen_for` and
:meth:`ParkedSessions.restore_for`, called by the pipeline's one continuation path
(:meth:`jaild.daemon.pipeline.Pipeline.continue_run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaild.daemon import placement
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission, disclosure
from jaild.daemon.core import session as machine
from jaild.daemon.core.peer import Principal
from jaild.daemon.core.session import Op, Phase, SessionMachine, Start
from jaild.daemon.flowgate import flow_released
from jaild.daemon.jails.job import CallReply, JailedJob
from jaild.daemon.observe import Observers
from jaild.daemon.registry import ClientConnection, JailSession, Registry
from jaild.daemon.state.parkedruns import ParkedRuns
from jaild.daemon.state.snapshots import SnapshotStore
from jaild.errors import (
    BadRequest,
    InternalError,
    JaildError,
    PermissionDenied,
    SnapshotFailed,
    UnknownSession,
    UnknownSnapshot,
)
from jaild.policy.schema import Policy, flow_rules
from jaild.protocol.messages import (
    OpenSession,
    PauseSession,
    ResumeSession,
    SessionOpened,
    SnapshotSession,
    SnapshotTaken,
)
from jaild.protocol.messages import SessionClosed as SessionClosedMsg
from jaild.protocol.messages import SessionPaused as SessionPausedMsg
from jaild.protocol.records import SessionInfo, SnapshotEntry, SnapshotKind
from jaild.tracing import SessionTrace

if TYPE_CHECKING:
    from jaild.daemon.approvals import DurableRun
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
    """Opening, running in and closing sessions, for one daemon: the driver of their
    machines."""

    def __init__(
        self,
        config: DaemonConfig,
        registry: Registry,
        served: Served,
        observers: Observers,
        catalog: Callable[[], admission.Catalog],
        snapshots: Callable[[], SnapshotStore],
        parked: ParkedRuns[DurableRun],
    ) -> None:
        """Sessions of the daemon whose settings are ``config``, kept in its ``registry``,
        made in the jail environment it ``served`` with, told to its ``observers``;
        ``catalog``: the policies it serves now (admission's view); ``snapshots``: its
        snapshot store (made on first use); ``parked``: its durable runs (a session closed
        with its run parked drops the run)."""
        self.config = config
        self.registry = registry
        self.served = served
        self.observers = observers
        self.catalog = catalog
        self._snapshots = snapshots
        self.parked_runs = parked

    @property
    def store(self) -> SnapshotStore:
        """The daemon's snapshots (made on first use: ``config.snapshot_dir``)."""
        return self._snapshots()

    # -- the machine's driver

    def handle(self, sess: JailSession, event: machine.Event) -> None:
        """Feed ``event`` to the session's machine and carry out its actions, in order.
        Raises the refusal of a request the machine does not allow now."""
        for action in sess.machine.handle(event):
            self._do(sess, action)

    def _do(self, sess: JailSession, action: machine.Action) -> None:
        owner = sess.owner
        match action:
            case machine.Timers(idle=idle):
                self._timers(sess, idle)
            case machine.ArmLifetime():
                if sess.life_timer is not None:
                    sess.life_timer.cancel()
                sess.reopened()
                lifetime = sess.terms.max_lifetime_s
                sess.life_timer = asyncio.get_running_loop().call_later(
                    lifetime, self.close, sess, "lifetime",
                    f"the session reached its maximum lifetime of {lifetime:g} s")
            case machine.StopTimers():
                sess.stop_timers(lifetime=True)
            case machine.RetireJail(why=why):
                owner.start(self._retire(sess.jail, why))
            case machine.CancelJail(why=why):
                sess.jail.cancel(why)
            case machine.DeleteState(state_id=state_id):
                with contextlib.suppress(JaildError, OSError):
                    self.store.delete(owner.peer.principal.key, state_id)
            case machine.DropParkedRun(job_id=job_id, why=why):
                run = self.parked_runs.get(job_id)
                if run is not None:
                    self.parked_runs.drop(run, why)
            case machine.Detach(job_id=job_id):
                self._forget(sess)
                self.observers.audit.session(owner.peer, "detached", sess.id, sess.policy.name,
                                             reason=job_id)
            case machine.Forget():
                self._forget(sess)
            case machine.Discard(why=why):
                owner.start(self._retire(sess.jail, why))
            case machine.SendClosed(reason=reason, message=message):
                self.observers.audit.session(owner.peer, "closed", sess.id, sess.policy.name,
                                             reason=reason)
                owner.send(SessionClosedMsg(session_id=sess.id, reason=reason,
                                            message=message[:4096]))

    def _timers(self, sess: JailSession, idle: bool) -> None:
        """The idle and pause clocks stop; with ``idle`` they start again (the pause clock
        only for a session that pauses when idle and is idle)."""
        sess.stop_timers()
        sess.last_used = time.monotonic()
        if not idle:
            return
        loop = asyncio.get_running_loop()
        idle_s = sess.terms.idle_s
        sess.idle_timer = loop.call_later(
            idle_s, self.close, sess, "idle",
            f"no run for {idle_s:g} s (the session's idle limit)")
        pause_after_s = sess.terms.pause_after_s
        if pause_after_s and sess.phase is Phase.IDLE:
            sess.pause_timer = loop.call_later(pause_after_s, self._pause_idle, sess)

    def close(self, sess: JailSession, reason: str, message: str) -> None:
        """End a session: its jail is killed (a run in progress ends ``cancelled``), its
        client is told; a paused session's state is deleted. Idempotent. A session whose
        run is parked is detached instead when its client leaves or the daemon stops
        (:data:`~jaild.daemon.core.session.DETACHING`); closed otherwise, it drops the run."""
        self.handle(sess, machine.Close(reason, message))

    # -- opening

    def runnable(self, client: ClientConnection, session_id: str) -> JailSession:
        """The client's session a ``RunJob`` names, if a run may start in it now.

        Raises:
            UnknownSession, SessionClosed, Busy (a run in progress; the daemon draining).
        """
        sess = self.registry.session(session_id, owner=client)
        if sess is None:
            raise UnknownSession(f"no open session {session_id} of this connection")
        admission.check_not_draining(self.catalog())
        sess.machine.check_runnable()
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
            labels = terms.labels  # the caller's (OpenSession.labels)
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
        state = SessionMachine("ses-" + secrets.token_hex(8), labels=labels)
        sess = JailSession(client, terms, state, self.make_jail(state.session_id, terms, client,
                                                            state.labels))
        registry.add_session(sess)
        self.observers.metrics.sessions_open(registry.session_count())
        client.start(self._open(sess, req.ref, trace, req.from_snapshot))

    def make_jail(self, jail_id: str, terms: admission.SessionTerms,
              client: ClientConnection, labels: frozenset[str]) -> JailedJob:
        """A session's jail, holding ``labels`` from its start: the session's (its machine's
        labels: the caller's and those of the state it will restore -- a snapshot's, a
        paused or parked session's), so that no byte of that state runs before its labels
        close what they close. Every path that brings state into a fresh jail comes through
        here, and the jail's machine refuses a restore whose labels its jail does not hold
        (:class:`jaild.daemon.core.machine.JobSpec`)."""
        env = self.served.env
        assert env is not None
        spec = placement.session_jail_spec(jail_id, terms, client.peer.principal.key, labels)
        return JailedJob(spec, env, None, None, jail_id=jail_id)

    async def _open(self, sess: JailSession, ref: int, trace: SessionTrace | None,
                    from_snapshot: str | None = None) -> None:
        client = sess.owner
        failed = await self.start_jail(sess, from_snapshot)
        if failed is not None:
            self.handle(sess, machine.JailFailed(failed.message))
            sess.jail.cleanup()
            client.send_error(failed, ref=ref)
            if trace is not None:
                trace.ended(sess.id, failed.code)
            return
        self.handle(sess, machine.JailReady())
        client.start(self.watch(sess, sess.jail))
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
                idle_s=sess.terms.idle_s,
                max_lifetime_s=sess.terms.max_lifetime_s,
                limits=dataclasses.asdict(sess.limits),
            ),
        )

    async def start_jail(self, sess: JailSession, snapshot_id: str | None,
                          blob: bytes | None = None,
                          labels: tuple[str, ...] = ()) -> JaildError | None:
        """Start the session's jail and, with ``snapshot_id``, restore that snapshot in it
        (``blob``: its bytes and ``labels`` its labels, loaded already). The jail was made
        holding the snapshot's labels (:meth:`_jail`); the restore carries them too, and is
        refused if they are not all held. Returns the error its client gets if either fails
        (the jail is then ending)."""
        ready = await sess.jail.prepare()
        if not ready or not sess.machine.open:
            detail = sess.machine.closed or "the jail did not start"
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
            await self.op(sess, restore=blob, labels=frozenset(labels))
        except JaildError as exc:
            sess.jail.cancel(f"the snapshot was not restored: {exc.message}")
            return exc
        return None

    async def watch(self, sess: JailSession, jail: JailedJob) -> None:
        """A session's jail that dies between runs (its code left a thread that broke the
        channel protocol, a background process hit a limit) ends the session at once (the
        machine: only an idle session's); one released by a pause does not."""
        status, error = await jail.ended()
        if jail is sess.jail:
            self.handle(sess, machine.JailDied(status, (error or {}).get("message", "")))

    # -- runs (the pipeline's)

    def run_started(self, sess: JailSession, job_id: str) -> None:
        self.handle(sess, machine.RunAsked(job_id))

    def run_ended(self, sess: JailSession, job_id: str, status: str, message: str) -> None:
        """A run's record was sent: the session goes on, or ends with its jail. What its
        jail holds now is the session's (its labels only grow)."""
        self.handle(sess, machine.Labeled(sess.jail.labels))
        self.handle(sess, machine.RunEnded(job_id, sess.jail.alive, status, message))

    # -- snapshots, forks, pauses (docs/using/sessions.md)

    def _idle(self, client: ClientConnection, session_id: str) -> JailSession:
        sess = self.registry.session(session_id, owner=client)
        if sess is None:
            raise UnknownSession(f"no open session {session_id} of this connection")
        if not sess.policy.session.snapshots:
            raise PermissionDenied(f"policy {sess.policy.name!r} does not allow snapshots "
                                   "(session.snapshots = false)")
        sess.machine.check_runnable()
        return sess

    def snapshot(self, client: ClientConnection, req: SnapshotSession) -> None:
        """Take an idle session's snapshot; answered SnapshotTaken (or Error). Raises the
        refusal the client gets."""
        sess = self._idle(client, req.session_id)
        most = sess.policy.session.snapshot_ttl_s
        if req.ttl_s is not None and req.ttl_s > most:
            raise BadRequest(f"ttl_s={req.ttl_s:g} is longer than policy {sess.policy.name!r} "
                             f"keeps snapshots ({most:g} s)")
        self.handle(sess, machine.OpAsked(Op.SNAPSHOT))
        client.start(self._snapshot(sess, req.ref, req.ttl_s or most))

    async def _snapshot(self, sess: JailSession, ref: int, ttl_s: float) -> None:
        client = sess.owner
        try:
            blob = await self.op(sess, snapshot=True)
            entry = await asyncio.to_thread(
                self.store.save, client.peer.principal.key, blob, policy=sess.policy.name,
                session=sess.id, ttl_s=ttl_s, labels=sess.machine.labels)
        except JaildError as exc:
            client.send_error(exc, ref=ref)
        else:
            self.observers.audit.session(client.peer, "snapshot", sess.id, sess.policy.name,
                                         reason=entry.id)
            client.send(SnapshotTaken(ref=ref, snapshot=self._entry_view(entry, client)))
        finally:
            self._op_ended(sess, None)

    def pause(self, client: ClientConnection, req: PauseSession) -> None:
        """Pause an idle session to disk now; answered SessionPaused (or Error)."""
        sess = self._idle(client, req.session_id)
        self.handle(sess, machine.OpAsked(Op.PAUSE))
        client.start(self._pause(sess, req.ref))

    def _pause_idle(self, sess: JailSession) -> None:
        sess.pause_timer = None
        if sess.phase is Phase.IDLE:
            self.handle(sess, machine.OpAsked(Op.PAUSE))
            sess.owner.start(self._pause(sess, 0))

    async def _pause(self, sess: JailSession, ref: int) -> None:
        """Snapshot the session (kind ``pause``), then end its jail: it holds disk only."""
        client = sess.owner
        try:
            blob = await self.op(sess, snapshot=True)
            entry = await asyncio.to_thread(
                self.store.save, client.peer.principal.key, blob, policy=sess.policy.name,
                session=sess.id, ttl_s=max(60.0, sess.terms.max_lifetime_s),
                kind=SnapshotKind.PAUSE, labels=sess.machine.labels)
        except JaildError as exc:
            if ref:
                client.send_error(exc, ref=ref)
            else:  # an idle pause that failed: the session stays as it was
                log.warning("session %s was not paused: %s", sess.id, exc.message)
            self._op_ended(sess, None)
            return
        self._op_ended(sess, entry.id)
        self.observers.audit.session(client.peer, "paused", sess.id, sess.policy.name)
        client.send(SessionPausedMsg(ref=ref, session_id=sess.id,
                                     bytes=self._entry_view(entry, client).bytes))

    def _op_ended(self, sess: JailSession, state_id: str | None) -> None:
        jail = sess.jail
        status, error = ("ok", None) if jail.alive else jail.outcome()
        self.handle(sess, machine.OpEnded(state_id, jail.alive, status,
                                           (error or {}).get("message", "")))

    def resume(self, client: ClientConnection, req: ResumeSession) -> None:
        """Bring a paused session back in a fresh jail; answered SessionOpened (at once for
        a session that is not paused)."""
        sess = self.registry.session(req.session_id, owner=client)
        if sess is None:
            raise UnknownSession(f"no open session {req.session_id} of this connection")
        state = sess.machine
        if state.phase is not Phase.PAUSED:
            state.check_runnable()
            client.send(self._opened(sess, req.ref))
            return
        assert state.state_id is not None
        admission.check_not_draining(self.catalog())
        check_room(self.registry, self.config, client.peer.principal,
                   sess.terms.jail_limits.memory_mb)
        try:
            labels = frozenset(self.store.entry(client.peer.principal.key, state.state_id).labels)
        except JaildError as exc:
            self.close(sess, "restore_failed", f"the paused session was not restored: "
                       f"{exc.message}")
            raise
        self.handle(sess, machine.ResumeAsked(labels))
        sess.jail = self.make_jail(f"{sess.id}-{state.jails}", sess.terms, client, state.labels)
        client.start(self._resume(sess, req.ref, state.state_id))

    async def _resume(self, sess: JailSession, ref: int, state_id: str) -> None:
        client = sess.owner
        failed = await self.start_jail(sess, state_id)
        if failed is not None:
            client.send_error(failed, ref=ref)
            self.handle(sess, machine.JailFailed(failed.message))
            return
        self.handle(sess, machine.JailReady())
        client.start(self.watch(sess, sess.jail))
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
        if self.store.entry(owner, snapshot_id).kind in (SnapshotKind.PAUSE, SnapshotKind.PARKED):
            raise UnknownSnapshot(f"no snapshot {snapshot_id} of yours (it is a paused "
                                  "session's state: close the session instead)")
        self.store.delete(owner, snapshot_id)

    async def op(self, sess: JailSession, *, snapshot: bool = False,
                  restore: bytes | None = None, labels: frozenset[str] = frozenset()) -> bytes:
        """Run a snapshot (returns it) or a restore (of state carrying ``labels``) in the
        session's jail. The op is a run like any other: its record and error pass the flow
        rules of the labels the jail holds, for the session's owner (a snapshot's bytes stay
        in the daemon: no rule withholds them from the store).

        Raises:
            SnapshotFailed: naming what stopped it (the jail's own words, or its status;
                withheld as a run's would be).
        """
        spec = placement.op_spec(
            placement.new_job_id(), sess.terms, sess.owner.peer.principal.key,
            snapshot=snapshot, restore=restore, labels=labels,
            released=flow_released(sess.policy, sess.owner.peer))
        record, result, _ = await sess.jail.run_next(spec, _no_tools, _no_output)
        if record.status == "ok" and (result is not None or not snapshot):
            return result or b""
        why = record.error.message if record.error is not None else record.status
        verb = "taken" if snapshot else "restored"
        raise SnapshotFailed(f"the snapshot was not {verb}: {why}")

    async def _retire(self, jail: JailedJob, reason: str) -> None:
        async with self.registry.retiring():
            await jail.discard(reason)

    def _forget(self, sess: JailSession) -> None:
        registry = self.registry
        registry.remove_session(sess)
        self.observers.metrics.sessions_open(registry.session_count())


class ParkedSessions:
    """The sessions' part in their runs parked for approval (:mod:`jaild.daemon.approvals`):
    the state taken before a run that may park, the session paused with its parked run or
    closed with its dropped one (the approvals' :class:`~jaild.daemon.approvals.SessionHooks`),
    and the session brought back for the run's continuation (the pipeline's
    :meth:`~jaild.daemon.pipeline.Pipeline.continue_run`)."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.registry = sessions.registry
        self.observers = sessions.observers

    async def state_before(self, sess: JailSession, run: DurableRun) -> None:
        """Before a run that may park: the session's state (kept in memory, saved only if
        the run parks). Not taken (something unpicklable, too large): the run's calls wait
        live."""
        if run.before is not None or run.state_id is not None:  # a continuation: restored
            return
        try:
            run.before_labels = tuple(sorted(sess.jail.labels))
            run.before = await self.sessions.op(sess, snapshot=True)
        except JaildError as exc:
            log.info("session %s: run %s cannot park (its state was not taken: %s); a call "
                     "needing approval waits live", sess.id, run.job_id, exc.message)

    def parked(self, run: DurableRun) -> None:
        """The run parked: its session, if still here, is paused with it (its jail goes)."""
        sess = self.registry.session(run.session_id or "")
        if sess is None or run.state_id is None:
            return
        self.sessions.handle(sess, machine.RunParked(run.job_id, run.state_id))
        if sess.phase is Phase.PARKED:
            self.observers.audit.session(sess.owner.peer, "parked", sess.id, sess.policy.name,
                                         reason=run.job_id)

    def dropped(self, run: DurableRun) -> None:
        """The parked run was dropped (its state with it): its session, if here, closes."""
        sess = self.registry.session(run.session_id or "")
        if sess is not None:
            self.sessions.handle(sess, machine.ParkedRunDropped(run.job_id))

    def reopen_for(self, run: DurableRun, host: ClientConnection,
                   policy: Policy) -> JailSession:
        """A parked session run was decided and has a ``host``: its session (re-made on
        ``host`` if it was detached, with the terms it was opened with) gets a fresh jail
        holding the session's labels, to restore its state in (:meth:`restore_for`).

        Raises:
            JaildError: no room for the jail, or the state is gone (the run stays parked).
        """
        assert run.session_id is not None and run.state_id is not None
        sess = self.registry.session(run.session_id)
        if sess is not None:
            terms = sess.terms
        else:
            assert run.session_asked is not None
            terms = admission.session_terms(policy, run.session_asked)
        check_room(self.registry, self.sessions.config, host.peer.principal,
                   terms.jail_limits.memory_mb)
        labels = frozenset(self.sessions.store.entry(run.owner_key, run.state_id).labels)
        jail_id = f"{run.session_id}-r{run.life.resumes + 1}"
        if sess is None:
            state = SessionMachine(run.session_id, labels=labels, runs=run.session_run,
                                   phase=Phase.PARKED, start=Start.CONTINUE,
                                   state_id=run.state_id, parked_run=run.job_id)
            jail = self.sessions.make_jail(jail_id, terms, host, labels)
            sess = JailSession(host, terms, state, jail)
            self.registry.add_session(sess)
            self.observers.metrics.sessions_open(self.registry.session_count())
            self.sessions.handle(sess, machine.ContinueAsked(run.job_id, labels))
        else:
            sess.owner = host
            self.sessions.handle(sess, machine.ContinueAsked(run.job_id, labels))
            sess.jail = self.sessions.make_jail(jail_id, terms, host, sess.machine.labels)
        return sess

    async def restore_for(self, sess: JailSession, run: DurableRun) -> JaildError | None:
        """Restore the parked run's state in the session's fresh jail; None once it is up
        (the session runs the continuation), else the error (the session is parked again,
        its jail retired; the run stays parked)."""
        state = run.state_id
        assert state is not None
        try:
            entry, blob = await asyncio.to_thread(self.sessions.store.load, run.owner_key, state)
        except JaildError as exc:
            failed: JaildError | None = exc
            blob = None
        else:
            run.before_labels = entry.labels
            failed = await self.sessions.start_jail(sess, state, blob, entry.labels)
        if failed is None and sess.machine.open:
            run.before = blob
            self.sessions.handle(sess, machine.JailReady())
            sess.owner.start(self.sessions.watch(sess, sess.jail))
            self.observers.audit.session(sess.owner.peer, "continued", sess.id,
                                         sess.policy.name, reason=run.job_id)
            return None
        self.sessions.handle(sess, machine.JailFailed(failed.message if failed else "closed"))
        return failed or InternalError(f"session {sess.id} was closed")


__all__ = ["ParkedSessions", "Sessions", "capacity", "check_room"]
