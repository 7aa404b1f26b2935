"""The request pipeline: one path from a ``RunJob`` to its ``JobFinished``.

Theory of operation
-------------------
Every run, one-shot or in a session, goes the same way::

    RunJob -> admission -> placement -> accepted -> run_to_record -> JobFinished
               (pure)     (fresh, pooled   (registry)   (the owner's
                           or session jail)              task group)

1. *Admission* (:mod:`jaild.daemon.core.admission`, pure) gives the run's terms or a typed
   refusal, which the client gets as ``Error`` (audited and counted by the server).
   A session run first needs its session, open and idle (:mod:`jaild.daemon.sessions`);
   a one-shot job needs room: the connection's jobs, its uid's share of jails and
   memory, the daemon's jails and memory ceiling (``sessions.check_room``).
2. *Placement* (:mod:`jaild.daemon.placement`) picks the jail.
3. The job is registered (:mod:`jaild.daemon.registry`), ``JobAccepted`` is due (the
   connection holds it briefly to write it with the job's next message, usually its end:
   ``ClientConnection.accept``), and :meth:`Pipeline.run_to_record` runs in the owning
   connection's task group. It always ends in exactly one record: a failure inside jaild becomes an
   ``internal_error`` record (and ends a session), never silence. The record is
   audited and accounted before the client can see it; when tracing is on
   (:mod:`jaild.tracing`), the job's spans are made once it is sent.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaild.daemon import placement
from jaild.daemon.approvals import Approvals, DurableRun
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission, disclosure
from jaild.daemon.core.parked import Phase
from jaild.daemon.core.records import internal_error_record
from jaild.daemon.flowgate import flow_released
from jaild.daemon.jails.job import JailedJob, JobSpec, OutputSink, ToolRouter
from jaild.daemon.observe import Observers
from jaild.daemon.registry import ClientConnection, JailSession, LiveJob, Registry
from jaild.daemon.sessions import ParkedSessions, Sessions, check_room
from jaild.errors import JaildError, UnknownSnapshot
from jaild.protocol.messages import MAX_PAYLOAD_BYTES, JobFinished, RunJob
from jaild.protocol.records import JobRecord

if TYPE_CHECKING:
    from jaild.daemon.startup import Served


log = logging.getLogger("jaild")


def _a_child_has_exited() -> bool:
    """Whether any child of ours is a zombie (one ``waitid`` that reaps nothing)."""
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # no children at all
        return False


def _children() -> set[int]:
    """Our direct children, from /proc (every thread's list)."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
    return out


class Pipeline:
    """See the module docstring."""

    def __init__(
        self,
        config: DaemonConfig,
        registry: Registry,
        sessions: Sessions,
        served: Served,
        observers: Observers,
        catalog: Callable[[], admission.Catalog],
        *,
        reap_orphans: bool = True,
        approvals: Approvals | None = None,
        parked_sessions: ParkedSessions | None = None,
    ) -> None:
        """The pipeline of the daemon whose settings are ``config``: jobs kept in its
        ``registry``, session runs through its ``sessions``, jails from what it ``served``
        with (environment and pools), ends told to its ``observers``; ``catalog``: the
        policies it serves now. ``reap_orphans``: False where the process has children of
        its own."""
        self.config = config
        self.registry = registry
        self.sessions = sessions
        self.served = served
        self.observers = observers
        self.catalog = catalog
        self._reaps = reap_orphans
        self.approvals = approvals
        self.parked_sessions = parked_sessions  # sessions' part in parked runs

    def submit(self, client: ClientConnection, req: RunJob) -> None:
        """Admit a RunJob, place it and start it. Raises the JaildError the client gets
        as Error."""
        registry = self.registry
        tracing = self.observers.tracing  # off: trace stays None; each hook below is one test
        trace = tracing.job(req.traceparent, client.peer.uid) if tracing.on else None
        sess = None
        try:
            if req.session_id is None:
                admitted = admission.admit_job(self.catalog(), client.peer, req)
                check_room(registry, self.config, client.peer.principal,
                           admitted.limits.memory_mb, registry.job_count(client))
            else:
                sess = self.sessions.runnable(client, req.session_id)
                admitted = admission.admit_session_run(sess.terms, sess.id, req)
        except JaildError as refusal:
            if trace is not None:
                trace.refused(refusal.code, req.policy)
            raise
        if trace is not None:
            trace.admitted()
        job_id = placement.new_job_id()
        env = self.served.env
        assert env is not None
        route: ToolRouter = client.call_tool
        output: OutputSink = client.output
        durable = None
        approvals = self.approvals
        if approvals is not None and approvals.durable(admitted.policy):
            durable = approvals.track(job_id, client, admitted.policy, admitted.job,
                                      dict(req.limits), session=sess, hold=admitted.labels)
            route, output = durable.route, durable.output
        placed = placement.place(
            admitted, job_id, route, output, env, self.served.pools, sess,
            tenant=client.peer.principal.key, trace=trace,
            released=flow_released(admitted.policy, client.peer),
        )
        if durable is not None and approvals is not None:
            if placed.job_id != job_id:  # a pooled jail's id is the job's
                approvals.rename(durable, placed.job_id)
            durable.jail = placed.jail
        if sess is not None:
            self.sessions.run_started(sess, placed.job_id)
        # Accepted after a pooled jail got its code (it starts a write earlier); still before
        # anything about the job can reach the client (held: it goes out with the first).
        client.accept(req.ref, placed.job_id)
        memory_mb = 0 if sess is not None else admitted.limits.memory_mb  # a session holds its own
        registry.add_job(LiveJob(placed.job_id, placed.jail, client, sess, memory_mb=memory_mb))
        client.start(self.run_to_record(client, placed, durable))

    async def run_to_record(self, client: ClientConnection, placed: placement.Placed,
                            durable: DurableRun | None = None) -> None:
        """Run a placed job to its one record, and send it (see the module docstring). A
        run parked for approval (``durable``) has no record yet: it goes on later
        (:mod:`jaild.daemon.approvals`)."""
        spec, sess = placed.spec, placed.session
        job_id = spec.job_id
        try:
            try:
                if durable is not None and sess is not None:  # the state it may park with
                    assert self.parked_sessions is not None
                    await self.parked_sessions.state_before(sess, durable)
                record, result, downloads = await placed.run()
            except Exception as exc:  # a jaild bug: report it, keep serving
                if sess is None:
                    log.exception("job %s failed inside jaild", job_id)
                else:
                    log.exception("job %s of session %s failed inside jaild", job_id, sess.id)
                    sess.jail.cancel("internal error")  # and end the session
                record = internal_error_record(spec.job_id, spec.policy, spec.limits, exc)
                result, downloads = None, {}
            if durable is not None and self.approvals is not None:
                if durable.life.parked:
                    if placed.trace is not None:
                        placed.trace.finish(disclosure.operator_view(record, spec.policy),
                                            placed.mode)
                    return
                self.approvals.ended(durable)
            if sess is not None:
                record = sess.run_entry(record)
            # audited before the client can see the result; the operator's sinks get the
            # record as no release_to spares it (core/disclosure.py)
            seen = disclosure.operator_view(record, spec.policy)
            self.audit(client, seen, uploaded=len(spec.job.files), downloaded=len(downloads))
            client.send(_finished(job_id, record, result, downloads))
            if placed.trace is not None:  # its spans, once the record is out
                placed.trace.finish(seen, placed.mode)
        finally:
            self.registry.remove_job(job_id)
            if sess is None:
                self.reap_orphans()
            approvals = self.approvals
            if durable is not None and approvals is not None and durable.life.parked \
                    and approvals.jail_released(durable):
                self.continue_run(durable, durable.host, None)  # decided meanwhile
        if sess is not None:
            why = record.error.message if record.error is not None else ""
            self.sessions.run_ended(sess, job_id, record.status, why)

    # -- the continuation of a run parked for approval (jaild.daemon.approvals)

    def continue_run(self, run: DurableRun, host: ClientConnection | None,
                     ref: int | None) -> None:
        """A parked run was decided and has a ``host``: it goes on in a fresh jail -- a
        one-shot run's own, a session run's its session's, brought back with the state from
        before the run -- which replays it (:mod:`jaild.daemon.approvals`), then on to its
        record like any run (:meth:`run_to_record`). The one path for both. Refused (no room,
        the state gone), it stays parked and ``host`` is told; ``ResumeRun`` again later."""
        assert host is not None
        if self.registry.job(run.job_id) is not None:
            return  # its parked jail is still ending: run_to_record goes on from there
        policy = self.catalog().policies.get(run.policy.name, run.policy)
        sess = None
        try:
            if run.session_id is None:
                limits = admission.limits_for(policy, run.requested)
                check_room(self.registry, self.config, host.peer.principal, limits.memory_mb)
            else:
                assert self.parked_sessions is not None
                sess = self.parked_sessions.reopen_for(run, host, policy)
                limits = admission.limits_for(policy, {**sess.terms.requested,
                                                       **run.requested})
        except JaildError as exc:
            if run.session_id is not None:
                run.host = None  # ResumeRun again, from any of the owner's connections
            host.send_error(exc, ref=ref, job_id=None if ref is not None else run.job_id)
            return
        run.policy = policy
        run.life.continue_()
        admitted = admission.AdmittedJob(policy, limits, run.job, frozenset(run.hold))
        spec = placement.run_spec(admitted, run.job_id, host.peer.principal.key,
                                  keep=sess is not None,
                                  released=flow_released(policy, host.peer))
        host.start(self._continued(run, host, spec, sess))

    async def _continued(self, run: DurableRun, host: ClientConnection, spec: JobSpec,
                         sess: JailSession | None) -> None:
        if sess is not None:
            assert self.parked_sessions is not None
            failed = await self.parked_sessions.restore_for(sess, run)
            if failed is not None:
                if run.life.phase is Phase.CONTINUING:
                    run.life.set_back()  # it stays parked: ResumeRun again
                    run.host = None
                host.send_error(failed, job_id=run.job_id)
                if isinstance(failed, UnknownSnapshot) and self.approvals is not None \
                        and run.life.phase is not Phase.ENDED:
                    self.approvals.drop(run, f"its session's state is gone: {failed.message}")
                return
            jail = sess.jail
            memory_mb = 0  # the session holds its jail
        else:
            env = self.served.env
            assert env is not None
            jail = JailedJob(spec, env, run.route, run.output,
                             jail_id=f"{run.job_id}-r{run.life.resumes}")
            memory_mb = spec.limits.memory_mb
        run.restart_jail(jail)
        placed = placement.Placed(spec, jail, run.route, run.output, sess)
        self.registry.add_job(LiveJob(run.job_id, jail, host, sess, memory_mb=memory_mb))
        log.info("approvals: run %s continued", run.job_id)
        await self.run_to_record(host, placed, run)

    def audit(
        self, client: ClientConnection, record: JobRecord, uploaded: int = 0, downloaded: int = 0
    ) -> None:
        """A job's record: audited, accounted and counted."""
        observers = self.observers
        observers.audit.job(client.peer, record)
        observers.accounting.job(client.peer.principal, record, uploaded, downloaded)
        observers.metrics.job_finished(record, client.peer.uid)

    def reap_orphans(self) -> list[int]:
        """Reap children that are not a running job's nsjail.

        The daemon is a child subreaper: when an nsjail dies before its jail (it was
        SIGKILLed after the grace period), the jail's processes are reparented here, get
        their parent-death SIGKILL and must be reaped by us.

        It runs after every one-shot job, so it costs one ``waitid`` when no child has
        exited (the common case): only then are /proc's child lists read. An orphan still
        alive is reaped by a later call, as before.
        """
        if not self._reaps or not _a_child_has_exited():
            return []
        tracked = set(self.registry.pids())
        env = self.served.env
        if env is not None:
            tracked |= env.zygotes.pids()
        reaped = []
        for pid in _children() - tracked:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
        return reaped


def _finished(job_id: str, record: JobRecord, result: bytes | None,
              downloads: dict[str, bytes]) -> JobFinished:
    """A run's ``JobFinished``: its parts are checked already -- the record a struct, the job
    id ours, the result the jail's checked ``CodeFinished.result`` (or its redaction, at
    most as long here) -- except the files the jail left, whose listing the message's
    checks see (built checked when there are any)."""
    if downloads or (result is not None and len(result) > MAX_PAYLOAD_BYTES):
        return JobFinished(job_id=job_id, record=record, result=result, files=downloads)
    return JobFinished.trusted(job_id=job_id, record=record, result=result, files={})


__all__ = ["Pipeline"]
