"""What each request a client may send does: the daemon's dispatch table.

Theory of operation
-------------------
A connection (:class:`~jaild.daemon.server.ServedConnection`) reads frames, keeps the link
alive and sends what it is given; what a request *does* is here. :data:`HANDLERS` maps each
request type to one method of :class:`Requests` (data, like the machines' tables; a test
checks every request of the protocol has one). Each handler either answers at once, or hands
the request to the part that owns it -- the pipeline (runs), the sessions, the approvals --
and turns the typed refusal it raises into the client's ``Error``. A tool call's reply is
not a request: the connection routes it to the call that waits for it.

A request that must wait for a starting daemon never gets here before it is ready
(:mod:`jaild.daemon.core.readiness`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from jaild.daemon.approvals import Approvals
from jaild.daemon.core import admission
from jaild.daemon.core.peer import Peer, Principal, PrincipalKind
from jaild.daemon.observe import Observers
from jaild.daemon.pipeline import Pipeline
from jaild.daemon.registry import ClientConnection, Registry
from jaild.daemon.sessions import Sessions
from jaild.daemon.startup import Served
from jaild.daemon.state.parkedruns import ParkedRuns
from jaild.errors import JaildError, UnknownJob, UnknownSession
from jaild.protocol.messages import (
    ApprovalList,
    ApprovalRecorded,
    ApproveCall,
    CancelJob,
    CloseSession,
    DeleteSnapshot,
    GetStats,
    JobList,
    Kill,
    Killed,
    ListApprovals,
    ListJobs,
    ListPolicies,
    ListSnapshots,
    Message,
    OpenSession,
    PauseSession,
    Ping,
    PolicyList,
    Pong,
    ResumeRun,
    ResumeSession,
    RunJob,
    SnapshotDeleted,
    SnapshotList,
    SnapshotSession,
    Stats,
)
from jaild.protocol.records import DaemonStats, JobEntry, PolicyEntry

log = logging.getLogger("jaild")


class Requests:
    """The daemon's answers to its clients' requests (see the module docstring)."""

    def __init__(self, registry: Registry, pipeline: Pipeline, sessions: Sessions,
                 approvals: Approvals, parked_runs: ParkedRuns[Any], served: Served,
                 observers: Observers, catalog: Callable[[], admission.Catalog]) -> None:
        self.registry = registry
        self.pipeline = pipeline
        self.sessions = sessions
        self.approvals = approvals
        self.parked_runs = parked_runs
        self.served = served
        self.observers = observers
        self.catalog = catalog

    def handle(self, conn: ClientConnection, msg: Message) -> None:
        """Do what ``msg`` asks (a Pong, or anything not a request: nothing)."""
        handler = HANDLERS.get(type(msg))
        if handler is not None:
            handler(self, conn, msg)

    def refused(self, peer: Peer, code: str, message: str, **extra: Any) -> bool:
        """A connection or request was refused: counted, and audited -- rate-limited per
        uid (False: only counted, for the uid's ``refused_summary``)."""
        self.observers.metrics.refused(code)
        return self.observers.audit.refused(peer, code, message, **extra)

    # -- runs and sessions

    def _run_job(self, conn: ClientConnection, msg: RunJob) -> None:
        try:
            self.pipeline.submit(conn, msg)
        except JaildError as exc:
            if self.refused(conn.peer, exc.code, exc.message, policy=msg.policy):
                log.info("refused job from %s: %s: %s", conn.peer, exc.code, exc.message)
            conn.send_error(exc, ref=msg.ref)

    def _cancel_job(self, conn: ClientConnection, msg: CancelJob) -> None:
        live = self.registry.job(msg.job_id, owner=conn)
        if live is None:
            conn.send_error(UnknownJob(f"no running job {msg.job_id} of this connection"),
                            job_id=msg.job_id)
        else:
            live.jail.cancel("cancelled by the client")

    def _open_session(self, conn: ClientConnection, msg: OpenSession) -> None:
        try:
            self.sessions.open(conn, msg)
        except JaildError as exc:
            self.refused(conn.peer, exc.code, exc.message, policy=msg.policy)
            conn.send_error(exc, ref=msg.ref)

    def _close_session(self, conn: ClientConnection, msg: CloseSession) -> None:
        sess = self.registry.session(msg.session_id, owner=conn)
        if sess is None:
            conn.send_error(UnknownSession(f"no open session {msg.session_id} of this "
                                           "connection"))
        else:
            self.sessions.close(sess, "closed", "closed by the client")

    def _snapshots(self, conn: ClientConnection, msg: SnapshotSession | PauseSession
                   | ResumeSession | ListSnapshots | DeleteSnapshot) -> None:
        """Snapshots, pauses and resumes of this connection's sessions; the principal's
        snapshots (docs/using/sessions.md)."""
        sessions = self.sessions
        try:
            if isinstance(msg, SnapshotSession):
                sessions.snapshot(conn, msg)
            elif isinstance(msg, PauseSession):
                sessions.pause(conn, msg)
            elif isinstance(msg, ResumeSession):
                sessions.resume(conn, msg)
            elif isinstance(msg, ListSnapshots):
                conn.send(SnapshotList(ref=msg.ref, snapshots=tuple(sessions.snapshots(conn))))
            else:
                sessions.delete_snapshot(conn, msg.snapshot_id)
                conn.send(SnapshotDeleted(ref=msg.ref, snapshot_id=msg.snapshot_id))
        except JaildError as exc:
            conn.send_error(exc, ref=msg.ref)

    def _approvals(self, conn: ClientConnection,
                   msg: ApproveCall | ResumeRun | ListApprovals) -> None:
        """Decisions on calls waiting for approval, and parked runs (docs/using/tools.md).
        A run a decision or a ``ResumeRun`` makes due goes on through the pipeline."""
        approvals = self.approvals
        try:
            if isinstance(msg, ApproveCall):
                due = approvals.decide(conn.peer, msg.job_id, msg.call_id, msg.allow,
                                       msg.reason)
                conn.send(ApprovalRecorded(ref=msg.ref, job_id=msg.job_id, call_id=msg.call_id,
                                           allow=msg.allow))
                if due is not None:  # parked and hosted: it goes on now
                    self.pipeline.continue_run(due, due.host, None)
            elif isinstance(msg, ResumeRun):
                due = approvals.resume(conn, msg.ref, msg.job_id, {t.name for t in msg.tools})
                if due is not None:  # decided already: it goes on now
                    self.pipeline.continue_run(due, conn, msg.ref)
            else:
                conn.send(ApprovalList(ref=msg.ref,
                                       approvals=tuple(approvals.pending(conn.peer))))
        except JaildError as exc:
            conn.send_error(exc, ref=msg.ref)

    # -- ps, kill, stats, policies

    def _list_jobs(self, conn: ClientConnection, msg: ListJobs) -> None:
        jobs = tuple(map(JobEntry.from_wire, self.list_jobs(conn.peer)))
        conn.send(JobList(ref=msg.ref, jobs=jobs))

    def list_jobs(self, peer: Peer) -> list[dict[str, Any]]:
        """Running jobs and open sessions: all of them for root (on the host), else the
        peer's principal's own (its uid's, or its pod's)."""
        now = time.time()
        out: list[dict[str, Any]] = []
        mine = peer.principal.key
        for live in self.registry.jobs():
            job, owner = live.jail, live.owner.peer
            if not peer.principal.admin and owner.principal.key != mine:
                continue
            out.append(
                {
                    "id": live.job_id,
                    "kind": "job",
                    "policy": job.spec.policy.name,
                    "uid": owner.uid if owner.uid >= 0 else None,
                    "principal": (owner.principal.name
                                  if owner.principal.kind is PrincipalKind.CERT else None),
                    "pod": owner.principal.pod,
                    "client_pid": owner.pid,
                    "state": "running" if job.alive else "starting",
                    "age_s": round(max(0.0, now - live.started), 3),  # the wall clock may step back
                    "session": job.jail_id if job.jail_id.startswith("ses-") else None,
                    **job.live_usage(),
                }
            )
        out.extend(
            sess.ps_row(now)
            for sess in self.registry.sessions()
            if peer.principal.admin or sess.owner.peer.principal.key == mine
        )
        return out

    def _kill(self, conn: ClientConnection, msg: Kill) -> None:
        try:
            kind = self.kill(conn.peer, msg.id)
        except JaildError as exc:
            conn.send_error(exc, ref=msg.ref)
        else:
            conn.send(Killed(ref=msg.ref, id=msg.id, kind=kind))

    def kill(self, peer: Peer, ident: str) -> str:
        """``jaild kill``: end a job or session of the peer's (any, for root)."""
        sess = self.registry.session(ident)
        live = self.registry.job(ident)
        owner = sess.owner if sess is not None else (live.owner if live is not None else None)
        if owner is None or (
            not peer.principal.admin and owner.peer.principal.key != peer.principal.key
        ):
            raise UnknownJob(f"no running job or open session {ident} of {peer.principal}")
        why = f"killed by {peer.principal} (jaild kill)"
        self.observers.audit.killed(peer, ident)
        if sess is not None:
            self.sessions.close(sess, "killed", why)
            return "session"
        assert live is not None
        live.jail.cancel(why)
        return "job"

    def _stats(self, conn: ClientConnection, msg: GetStats) -> None:
        who = None if conn.peer.principal.admin else conn.peer.principal
        conn.send(Stats(ref=msg.ref, stats=DaemonStats.from_wire(self.stats_wire(who))))

    def stats_wire(self, who: Principal | None) -> dict[str, Any]:
        """The daemon's stats as ``who`` may see them (None: root, all of them)."""
        observers = self.observers
        stats = observers.accounting.to_wire(who)
        stats["running"] = {
            "jobs": self.registry.job_count(),
            "sessions": self.registry.session_count(),
            "connections": len(self.registry.connections),
        }
        stats["pools"] = self.served.pool_summaries()
        stats["metrics"] = observers.metrics.summary()
        durable, parked, journal = self.parked_runs.usage(
            None if who is None else who.key)  # the caller's principal's own, unless root
        quota = self.parked_runs.quota
        stats["approvals"] = {
            "durable_runs": durable, "parked_runs": parked, "journal_bytes": journal,
            "max_parked_runs": quota.max_parked, "journal_quota_bytes": quota.journal_bytes}
        if who is not None:  # other users' tool names and counts are theirs
            for key in ("tool_calls", "tool_latency"):
                stats["metrics"].pop(key, None)
        return stats

    def _list_policies(self, conn: ClientConnection, msg: ListPolicies) -> None:
        policies = tuple(map(PolicyEntry.from_wire, self.list_policies(conn.peer)))
        conn.send(PolicyList(ref=msg.ref, policies=policies))

    def list_policies(self, peer: Peer) -> list[dict[str, Any]]:
        """The policies the peer may use, each with whether it is served and its pool."""
        served = self.served
        return [
            {
                **p.summary(),
                "available": p.name not in served.unavailable,
                "problems": served.unavailable.get(p.name, ""),
                "pool": served.pool_summary(p, jails=peer.principal.admin),
            }
            for p in served.policies.values()
            if admission.policy_allows(p, peer)
        ]

    def _ping(self, conn: ClientConnection, msg: Ping) -> None:
        conn.send(Pong(seq=msg.seq))


HANDLERS: dict[type[Message], Callable[[Requests, ClientConnection, Any], None]] = {
    RunJob: Requests._run_job,
    CancelJob: Requests._cancel_job,
    OpenSession: Requests._open_session,
    CloseSession: Requests._close_session,
    SnapshotSession: Requests._snapshots,
    PauseSession: Requests._snapshots,
    ResumeSession: Requests._snapshots,
    ListSnapshots: Requests._snapshots,
    DeleteSnapshot: Requests._snapshots,
    ApproveCall: Requests._approvals,
    ResumeRun: Requests._approvals,
    ListApprovals: Requests._approvals,
    ListJobs: Requests._list_jobs,
    Kill: Requests._kill,
    GetStats: Requests._stats,
    ListPolicies: Requests._list_policies,
    Ping: Requests._ping,
}
"""What each request does (a Pong, a tool call's reply and the handshake's frames are not
here: the connection itself handles them)."""


__all__ = ["HANDLERS", "Requests"]
