"""Durable approvals: tool calls decided by the policy's approvers, runs that wait on disk.

Theory of operation
-------------------
Under a policy with ``[approvals] park_after_s`` above 0, a one-shot run's tool calls go
through a :class:`DurableRun` (its tool router). Every call's reply is *journaled* (tool,
arguments, reply). A call that needs approval is held here, not sent to the client: its
owner's connection gets ``ApprovalPending`` (the client library asks its ``approve``
callback, which answers ``ApproveCall``), and any principal the policy's ``approvers`` name
may decide it (``ApproveCall``, ``jaild approve``):

============  ===============================  ======================================
state         event                            action
============  ===============================  ======================================
live          call needing approval            held; ``ApprovalPending``; park timer
held          allowed (before the timer)       the call goes to the tool host, once
held          denied                           the jail gets ``ToolFailed`` ``denied``
held          ``park_after_s`` passed          *parked*: saved to disk, ``RunParked``,
                                               the jail killed (its record is not sent)
parked        decided, a tool host attached    *continued* in a fresh jail (below)
parked        its host leaves                  it waits for ``ResumeRun`` (any of the
                                               owner's connections, after restarts too)
parked        ``max_wait_s`` passed, not yet   dropped (logged)
              continued
============  ===============================  ======================================

A continuation is a *replay*: a fresh jail (new namespaces, cgroup, uid) runs the same code
with the same files; its first calls are answered from the journal -- each must be the
journaled call, tool and packed arguments byte for byte, else the run is stopped
(``replay_diverged``: time, randomness or the network made the code take another path) --
and the call that waited then gets its decision: allowed, it goes to the tool host *once*
(marked dispatched on disk before it is sent; after a crash between the two, the call is
answered ``unknown_outcome`` rather than made again); denied, ``denied``. From there the run
goes on live (a later call needing approval may park it again). What the run printed before
the call that waited is not sent again.

A session's run parks too (:mod:`jaild.daemon.sessions`): before each of its runs the
session's state is taken (a snapshot, kept in memory); parking saves that state to the
snapshot store (``kind = "parked"``) and pauses the session. The continuation restores it in
the session's fresh jail and replays the run the same way; the session then goes on, on the
connection that continued it (its original one, or any of the owner's: ``ResumeRun``).
A session run whose state could not be taken (something unpicklable) waits live.

The journal is on disk from the first reply, not in the daemon's memory:
``<state_dir>/parked/<instance>/<job id>.journal``, appended as replies arrive and read back
one entry at a time by a replay (:mod:`jaild.daemon.journal`); the daemon holds its path,
count and size. A parked run's own file is ``<job id>.run`` beside it (msgpack: the job, the
held call, its decision, the journal's count and size), written to a temporary name and
renamed once the journal is synced. Both are made by the daemon only: never a name or a
format from a jail or a client.

Quotas per principal (:class:`~jaild.daemon.journal.ApprovalQuota`: the daemon's
``limits.approvals_parked_max_count`` and ``limits.approvals_journal_quota_mb``):

================================  ==============================================================
past the quota                    what happens
================================  ==============================================================
a run would park, its principal   parking is refused: the held call is answered, in the jail,
has the most runs parked          ``ToolError`` ``quota_exceeded`` naming the key, the count and
                                  the limit (journaled, so a later replay answers it the same);
                                  the run goes on live; logged
a reply would take the            the reply is not journaled and not given: the call fails
principal's journals past         ``quota_exceeded`` and the run is stopped (``cancelled``,
their bytes                       ``quota_exceeded: ...``), as a replay could not give it again
a journal cannot be written       the same, ``journal_unwritable: ...``
(disk full)
a journal read back is damaged    a replay: the run is stopped, ``journal_damaged: ...``; at
                                  start: the parked run is dropped (logged)
================================  ==============================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from jaild.daemon.core import admission, disclosure
from jaild.daemon.core.peer import Peer
from jaild.daemon.flowgate import flow_released, names
from jaild.daemon.jails.job import CallReply, JailedJob, JobSpec, Reply
from jaild.daemon.journal import ApprovalQuota, Journal, Journaled
from jaild.daemon.registry import ClientConnection, LiveJob, Registry
from jaild.errors import (
    BadRequest,
    ConnectionLost,
    JaildError,
    JournalDamaged,
    PermissionDenied,
    QuotaExceeded,
    UnknownJob,
)
from jaild.policy.schema import Policy
from jaild.protocol.messages import (
    ApprovalPending,
    JobDescription,
    JobFinished,
    RunParked,
)
from jaild.protocol.records import ApprovalEntry, JobRecord

if TYPE_CHECKING:
    from jaild.daemon.observe import Observers
    from jaild.daemon.registry import JailSession
    from jaild.daemon.startup import Served

log = logging.getLogger("jaild")

FILE_FORMAT = 2  # 1: the journal inline in the run's file (read, and moved to its own file)
MAX_SHOWN_ARGS = 1 << 20


class SessionHooks(Protocol):
    """What the approvals need of the daemon's sessions (:class:`~jaild.daemon.sessions.Sessions`)
    for session runs."""

    def keep_state(self, run: DurableRun) -> str | None:
        """Save the run's session's state before it; its snapshot id (None: not saved)."""

    def parked(self, run: DurableRun) -> None:
        """The run parked: its session (if still attached) waits on disk with it."""

    def continue_run(self, run: DurableRun, host: ClientConnection, ref: int | None) -> None:
        """The run was decided and has a host: restore its session and continue it."""

    def dropped(self, run: DurableRun) -> None:
        """The run was dropped: its session's state goes (an attached session closes)."""

    def run_done(self, run: DurableRun) -> None:
        """The run ended (not parked): the state it parked with, if any, goes."""


class _NoSessions:
    def keep_state(self, run: DurableRun) -> str | None:
        return None

    def parked(self, run: DurableRun) -> None:
        pass

    def continue_run(self, run: DurableRun, host: ClientConnection, ref: int | None) -> None:
        raise AssertionError("no sessions")

    def dropped(self, run: DurableRun) -> None:
        pass

    def run_done(self, run: DurableRun) -> None:
        pass


_NO_SESSIONS = _NoSessions()


@dataclass
class Held:
    """A call waiting for its decision."""

    index: int  # its place among the run's routed calls
    call_id: int
    name: str
    args: bytes
    since: float
    reply: CallReply | None = None  # the live jail waits on it (None once parked)
    timer: Any = None


@dataclass(eq=False)
class DurableRun:
    """One run whose tool calls go through the approvals service (see the module)."""

    job_id: str
    owner_key: int | str
    owner_name: str
    policy: Policy
    job: JobDescription
    requested: dict[str, float]
    journal: Journal = field(default_factory=lambda: Journal(""))  # on disk (the service's)
    held: Held | None = None
    decision: tuple[bool, str, str] | None = None  # (allow, reason, by) of the held call
    dispatched: bool = False  # the decided call went to the tool host (a continuation)
    parked: bool = False
    parked_at: float = 0.0
    host: ClientConnection | None = None  # routes its calls, gets its output and record
    jail: JailedJob | None = None
    continuing: bool = False
    session_id: str | None = None  # a session's run: the session
    session_terms: dict[str, Any] | None = None  # what re-opens it after its connection went
    before: bytes | None = None  # the session's state before the run (memory only)
    before_labels: tuple[str, ...] = ()  # the session's labels then
    hold: tuple[str, ...] = ()  # the caller's (RunJob.labels): its continuation holds them too
    state_id: str | None = None  # once parked: ``before`` in the snapshot store
    _replay_upto: int = 0  # calls of the current jail answered from the journal
    _replay_offset: int = 0  # where in the journal's file the next replayed entry starts
    _calls: int = 0  # calls routed in the current jail
    _muted: bool = False  # output of a replay before the held call: not sent again
    resumes: int = 0

    @property
    def session(self) -> bool:
        return self.session_id is not None

    @property
    def can_park(self) -> bool:
        """A one-shot run, or a session run whose state before it was taken."""
        return self.session_id is None or self.before is not None or self.state_id is not None

    # -- what the jail sees

    def route(self, job_id: str, call_id: int, name: str, args: bytes,
              approval: bool) -> CallReply:
        """The jail's tool router (a ToolRouter)."""
        index = self._calls
        self._calls += 1
        if index < self._replay_upto:
            return self._replayed(index, name, args)
        if self.held is not None and self.held.index == index and self.decision is not None:
            return self._decided_after_replay(call_id, name, args)
        self._muted = False
        if approval:
            return self._hold(index, call_id, name, args)
        return self._dispatch(call_id, name, args)

    def output(self, job_id: str, stream: str, data: bytes) -> None:
        if not self._muted and self.host is not None:
            self.host.output(job_id, stream, data)

    # -- internals

    def _replayed(self, index: int, name: str, args: bytes) -> CallReply:
        reply = CallReply()
        try:
            entry, self._replay_offset = self.journal.read(self._replay_offset)
        except JournalDamaged as exc:
            reply.resolve(False, ("journal_damaged", "the run's journal on the daemon's disk "
                                  "is damaged; the run is stopped"))
            self._stop("journal_damaged", str(exc))
            return reply
        if (entry.name, entry.args) != (name, args):
            why = (f"the replay diverged at call {index + 1}: the run called {name!r} where it "
                   f"had called {entry.name!r}" + ("" if entry.name != name else
                                                     " with other arguments"))
            reply.resolve(False, ("replay_diverged", why))
            if self.jail is not None:
                self.jail.cancel(f"replay_diverged: {why}")
            return reply
        value = entry.value if entry.ok else tuple(entry.value)
        reply.resolve(entry.ok, value, entry.labels)
        return reply

    def _decided_after_replay(self, call_id: int, name: str, args: bytes) -> CallReply:
        held = self.held
        assert held is not None and self.decision is not None
        self._muted = False
        if (held.name, held.args) != (name, args):
            reply = CallReply()
            why = (f"the replay diverged at the call that waited for approval: the run called "
                   f"{name!r} where it had called {held.name!r}")
            reply.resolve(False, ("replay_diverged", why))
            if self.jail is not None:
                self.jail.cancel(f"replay_diverged: {why}")
            return reply
        allow, reason, _ = self.decision
        if self.dispatched:  # the daemon stopped while the call ran: never made twice
            self._live()
            return self._answer(name, args, False, (
                "unknown_outcome", f"{name}: the daemon stopped while this call ran; it may "
                "or may not have happened, and is not made again"))
        if not allow:
            self._live()
            return self._answer(name, args, False, ("denied", reason or f"{name}: denied"))
        self.dispatched = True
        self.service.save(self)  # the held call, its decision and "dispatched", before it goes
        self.held = None
        self.decision = None
        return self._dispatch(call_id, name, args)

    def _live(self) -> None:
        """The continuation is past the call that waited: nothing of it stays on disk (a
        crash from here loses the run, as it does any running job)."""
        self.held = None
        self.decision = None
        self.dispatched = False
        self.service.forget(self)

    def _answer(self, name: str, args: bytes, ok: bool, value: Any) -> CallReply:
        reply = CallReply()
        failed = self._journal(Journaled(name, args, ok, list(value) if not ok else value))
        if failed is not None:
            reply.resolve(False, failed)
        else:
            reply.resolve(ok, value)
        return reply

    def _journal(self, entry: Journaled) -> tuple[str, str] | None:
        """Journal a reply; None, or (when it could not be: the quota, the disk) the error
        the call fails with instead -- the run is then stopped, since a replay could not
        give it the reply again."""
        try:
            self.service.journal_append(self, entry)
        except QuotaExceeded as exc:
            self._stop("quota_exceeded", exc.message)
            return ("quota_exceeded", exc.message)
        except OSError as exc:
            why = f"the run's journal could not be written: {exc.strerror or exc}"
            self._stop("journal_unwritable", why)
            return ("journal_unwritable", why)
        return None

    def _stop(self, code: str, why: str) -> None:
        log.warning("approvals: run %s stopped: %s: %s", self.job_id, code, why)
        if self.jail is not None:
            self.jail.cancel(f"{code}: {why}")

    def _dispatch(self, call_id: int, name: str, args: bytes) -> CallReply:
        host = self.host
        if host is None:
            raise ConnectionLost("the run's tool host is gone")
        inner = host.call_tool(self.job_id, call_id, name, args, False)
        outer = CallReply(inner.withdraw)

        def replied(reply: Reply) -> None:
            if reply is None:
                outer.lost()
                return
            ok, value = reply
            failed = self._journal(Journaled(name, args, ok, value if ok else list(value),
                                             inner.labels))
            if self.dispatched:
                self._live()
            if failed is not None:
                outer.resolve(False, failed)
            else:
                outer.resolve(ok, value, inner.labels)

        inner.listen(replied)
        return outer

    def _hold(self, index: int, call_id: int, name: str, args: bytes) -> CallReply:
        reply = CallReply(self._withdrawn)
        held = Held(index, call_id, name, args, time.time(), reply)
        self.held = held
        self.decision = None
        if self.host is not None:
            self.host.send(ApprovalPending(job_id=self.job_id, call_id=call_id, name=name,
                                           args=args))
        park_after = self.policy.approvals.park_after_s
        if park_after and self.can_park:
            held.timer = asyncio.get_running_loop().call_later(park_after, self._park)
        return reply

    def _withdrawn(self) -> None:
        """The jail no longer waits (its wall time ran out, it was killed)."""
        held = self.held
        if held is not None and not self.parked:
            if held.timer is not None:
                held.timer.cancel()
            self.held = None

    def park_now(self) -> None:
        held = self.held
        if held is not None and held.timer is not None:
            held.timer.cancel()
        self._park()

    def _park(self) -> None:
        held = self.held
        if held is None or self.decision is not None or self.jail is None:
            return
        try:
            self.service.may_park(self)
        except QuotaExceeded as exc:
            self._refuse_parking(held, exc)
            return
        if self.session_id is not None and self.state_id is None:
            self.state_id = self.service.keep_state(self)
            if self.state_id is None:  # not saved (the quota): the call waits live
                return
        self.parked = True
        self.parked_at = time.time()
        held.reply = None
        self.service.save(self)
        self.service.audit_event(self, "parked")
        if self.host is not None:
            self.host.send(RunParked(
                job_id=self.job_id, call_id=held.call_id, session_id=self.session_id,
                message=f"{held.name} waited {self.policy.approvals.park_after_s:g} s for "
                        "approval; the run is parked until it is decided"))
        self.jail.cancel(f"parked: call {held.call_id} ({held.name}) waits for approval")
        if self.session_id is not None:
            self.service.sessions.parked(self)

    def _refuse_parking(self, held: Held, exc: QuotaExceeded) -> None:
        """Its principal has the most runs parked: the held call is answered
        ``quota_exceeded`` (journaled, so that a later replay answers it the same) and the
        run goes on live, its jail kept."""
        log.warning("approvals: run %s not parked: %s", self.job_id, exc.message)
        self.service.audit_event(self, f"not parked: {exc.message}")
        reply = held.reply
        self.held = None
        if reply is not None:
            self._settle(reply, self._answer(held.name, held.args, False,
                                             ("quota_exceeded", exc.message)))

    @staticmethod
    def _settle(reply: CallReply, answer: CallReply) -> None:
        answer.listen(lambda r: reply.lost() if r is None
                      else reply.resolve(r[0], r[1], answer.labels))

    def decide(self, allow: bool, reason: str, by: str) -> None:
        """A decision for the held call (checked by the service)."""
        held = self.held
        assert held is not None
        if self.parked:
            self.decision = (allow, reason, by)
            self.service.save(self)
            return
        if held.timer is not None:
            held.timer.cancel()
        reply = held.reply
        self.held = None
        assert reply is not None
        if not allow:
            answer = self._answer(held.name, held.args, False,
                                  ("denied", reason or f"{held.name}: denied"))
        else:
            try:
                answer = self._dispatch(held.call_id, held.name, held.args)
            except ConnectionLost:
                reply.lost()
                return
        self._settle(reply, answer)

    def restart_jail(self) -> None:
        """A continuation begins: replay the journal, then the decided call."""
        self._calls = 0
        self._replay_upto = self.journal.entries
        self._replay_offset = 0
        self._muted = True
        self.parked = False
        self.resumes += 1

    # -- disk

    def to_file(self) -> bytes:
        held = self.held
        data = {
            "format": FILE_FORMAT,
            "job_id": self.job_id,
            "owner_key": self.owner_key,
            "owner_name": self.owner_name,
            "policy": self.policy.name,
            "job": self.job.to_wire(),
            "requested": self.requested,
            "journal": {"entries": self.journal.entries, "bytes": self.journal.bytes},
            "held": None if held is None else [held.index, held.call_id, held.name, held.args,
                                               held.since],
            "decision": None if self.decision is None else list(self.decision),
            "dispatched": self.dispatched,
            "parked_at": self.parked_at,
            "resumes": self.resumes,
            "hold": list(self.hold),
            "session": None if self.session_id is None else {
                "id": self.session_id, "terms": self.session_terms, "state": self.state_id},
        }
        packed: bytes = msgpack.packb(data, use_bin_type=True)
        return packed

    service: Approvals = field(init=False, repr=False)


class Approvals:
    """The daemon's held calls and parked runs (see the module docstring)."""

    def __init__(self, directory: str, registry: Registry, served: Served,
                 observers: Observers, catalog: Callable[[], admission.Catalog],
                 room: Callable[[Peer, int | str, int], None], *,
                 quota: ApprovalQuota) -> None:
        """Args (besides the daemon's parts): ``directory``: where parked runs and every
        durable run's journal are kept; ``room``: raises when a continuation does not fit
        the principal's share of the daemon; ``quota``: the limits per principal on parked
        runs and journals (the daemon's ``limits.approvals_*``)."""
        self.directory = directory
        self.quota = quota
        self.registry = registry
        self.served = served
        self.observers = observers
        self.catalog = catalog
        self._room = room
        self.runs: dict[str, DurableRun] = {}
        self.sessions: SessionHooks = _NO_SESSIONS  # set by the daemon (its Sessions)

    # -- runs

    def durable(self, policy: Policy) -> bool:
        """Do this policy's calls needing approval go through here?"""
        return policy.approvals.park_after_s > 0

    def track(self, job_id: str, host: ClientConnection, policy: Policy, job: JobDescription,
              requested: dict[str, float], session: JailSession | None = None,
              hold: frozenset[str] = frozenset()) -> DurableRun:
        run = DurableRun(job_id, host.peer.principal.key, str(host.peer.principal), policy, job,
                         dict(requested), host=host, journal=Journal(self._path(job_id, "journal")),
                         hold=tuple(sorted(hold)))
        if session is not None:
            terms = session.terms
            run.session_id = session.id
            run.session_terms = {
                "tools": [t.to_wire() for t in terms.tools], "requested": dict(terms.requested),
                "idle_s": terms.idle_s, "max_lifetime_s": terms.max_lifetime_s,
                "pause_after_s": terms.pause_after_s, "run": session.runs + 1}
        run.service = self
        self.runs[job_id] = run
        return run

    def rename(self, run: DurableRun, job_id: str) -> None:
        """The run took a pooled jail: its id is the jail's (before any call)."""
        self.runs.pop(run.job_id, None)
        run.job_id = job_id
        run.journal.rename(self._path(job_id, "journal"))
        self.runs[job_id] = run

    def ended(self, run: DurableRun) -> None:
        """Its run ended (not parked): forget it."""
        if not run.parked and self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]
            self._delete(run)
            if run.session_id is not None:
                self.sessions.run_done(run)

    def park_held(self, host: ClientConnection | None = None) -> None:
        """Park now every one-shot run (of ``host``; None: all) whose call waits for a
        decision: its connection is leaving, or the daemon is stopping. Each waits on disk."""
        for run in list(self.runs.values()):
            if (host is None or run.host is host) and run.held is not None \
                    and run.decision is None and not run.parked and run.can_park:
                run.park_now()

    def detach(self, host: ClientConnection) -> None:
        """A connection is gone: the parked runs it hosted wait for a ResumeRun."""
        for run in self.runs.values():
            if run.host is host and run.parked:
                run.host = None

    # -- decisions

    def may_approve(self, peer: Peer, run: DurableRun) -> bool:
        principal = peer.principal
        if principal.admin:
            return True
        approvers = run.policy.approvals.approvers
        own = principal.key == run.owner_key
        if not approvers:
            return own
        if own and "owner" in approvers:
            return True
        return names([a for a in approvers if a != "owner"], peer)

    def decide(self, peer: Peer, job_id: str, call_id: int, allow: bool, reason: str) -> None:
        """An ``ApproveCall``.

        Raises:
            UnknownJob: no call of that run waits for approval, or the run is another
                principal's and the caller may not decide it; PermissionDenied: the caller's
                own run, which the policy's approvers do not include it for.
        """
        self._expire()
        run = self.runs.get(job_id)
        held = run.held if run is not None else None
        if run is None or held is None or held.call_id != call_id or run.decision is not None:
            raise UnknownJob(f"no call {call_id} of run {job_id} waits for approval")
        if not self.may_approve(peer, run):
            if peer.principal.key != run.owner_key:  # another tenant's run: not even seen
                raise UnknownJob(f"no call {call_id} of run {job_id} waits for approval")
            raise PermissionDenied(
                f"{peer.principal} may not approve calls of policy {run.policy.name!r} "
                "(its [approvals] approvers)")
        by = str(peer.principal)
        self.audit_event(run, "approved" if allow else "denied", by=by)
        run.decide(allow, reason, by)
        if run.parked and run.host is not None and not run.continuing:
            self._continue(run, run.host, None)

    def pending(self, peer: Peer) -> list[ApprovalEntry]:
        """The calls waiting for a decision this peer may give."""
        self._expire()
        now = time.time()
        out = []
        for run in self.runs.values():
            held = run.held
            if held is None or run.decision is not None or not self.may_approve(peer, run):
                continue
            out.append(ApprovalEntry(
                job_id=run.job_id, call_id=held.call_id, tool=held.name,
                args=held.args[:MAX_SHOWN_ARGS], policy=run.policy.name, owner=run.owner_name,
                waiting_s=round(max(0.0, now - held.since), 3), parked=run.parked,
                attached=run.host is not None, session=run.session_id))
        return out

    # -- resuming

    def resume(self, host: ClientConnection, ref: int, job_id: str, tools: set[str]) -> None:
        """A ``ResumeRun``: ``host`` hosts the parked run's tools (``tools``: its names)
        from now on.

        Raises:
            UnknownJob: no parked run of the caller's principal has that id; BadRequest: it
                is hosted by another connection already, or ``tools`` lacks one of its tools.
        """
        self._expire()
        run = self.runs.get(job_id)
        if run is None or not run.parked or run.owner_key != host.peer.principal.key:
            raise UnknownJob(f"no parked run {job_id} of yours")
        if run.host is not None:
            which = "this connection" if run.host is host else "another connection"
            raise BadRequest(f"run {job_id} is hosted by {which} already")
        missing = sorted({t.name for t in run.job.tools} - tools)
        if missing:
            raise BadRequest(f"run {job_id} calls tools this connection does not host: "
                             f"{', '.join(missing)}")
        run.host = host
        host.accept(ref, job_id, run.session_id)
        if run.decision is not None and not run.continuing:
            self._continue(run, host, ref)

    def _continue(self, run: DurableRun, host: ClientConnection, ref: int | None) -> None:
        if self.registry.job(run.job_id) is not None:
            return  # its parked jail is still ending: jail_released() goes on from there
        if run.session_id is not None:
            self.sessions.continue_run(run, host, ref)
            return
        env = self.served.env
        assert env is not None
        try:
            policy = self.catalog().policies[run.policy.name]
        except KeyError:
            policy = run.policy
        limits = admission.limits_for(policy, run.requested)
        try:
            self._room(host.peer, host.peer.principal.key, limits.memory_mb)
        except JaildError as exc:  # it stays parked; ResumeRun again later
            host.send_error(exc, ref=ref, job_id=None if ref is not None else run.job_id)
            return
        run.policy = policy
        run.continuing = True
        run.restart_jail()
        spec = JobSpec(run.job_id, policy, limits, run.job, tenant=host.peer.principal.key,
                       released=flow_released(policy, host.peer), hold=frozenset(run.hold))
        jail = JailedJob(spec, env, run.route, run.output,
                         jail_id=f"{run.job_id}-r{run.resumes}")
        run.jail = jail
        self.registry.add_job(LiveJob(run.job_id, jail, host, memory_mb=limits.memory_mb))
        self.audit_event(run, "continued")
        host.start(self._run_continuation(run, host, jail))

    async def _run_continuation(self, run: DurableRun, host: ClientConnection,
                                jail: JailedJob) -> None:
        try:
            record = await jail.run()
            result, downloads = jail.result, jail.downloads
        finally:
            self.registry.remove_job(run.job_id)
            run.continuing = False
        if run.parked:  # parked again at a later call
            self.jail_released(run)
            return
        self.ended(run)
        self.finish(host, record, result, downloads, len(run.job.files), run.policy)

    def jail_released(self, run: DurableRun) -> None:
        """A parked run's jail is gone (its live job unregistered): a decision that came
        while it was ending goes on now."""
        run.continuing = False
        if run.parked and run.decision is not None and run.host is not None \
                and self.runs.get(run.job_id) is run:
            self._continue(run, run.host, None)

    def finish(self, host: ClientConnection, record: JobRecord, result: bytes | None,
               downloads: dict[str, bytes], uploaded: int, policy: Policy | None = None) -> None:
        """A continued run's record: to the operator's sinks as ``policy``'s flow rules
        close it (core/disclosure.py), then to its host."""
        observers = self.observers
        seen = record if policy is None else disclosure.operator_view(record, policy)
        observers.audit.job(host.peer, seen)
        observers.accounting.job(host.peer.principal, seen, uploaded, len(downloads))
        observers.metrics.job_finished(seen, host.peer.uid)
        host.send(JobFinished(job_id=record.job_id, record=record, result=result,
                              files=downloads))

    # -- quotas (jaild.daemon.journal)

    def may_park(self, run: DurableRun) -> None:
        """Raises QuotaExceeded when ``run``'s principal has the most runs parked."""
        parked = sum(1 for r in self.runs.values() if r.parked and r.owner_key == run.owner_key)
        self.quota.may_park(run.owner_key, run.owner_name, parked)

    def journal_append(self, run: DurableRun, entry: Journaled) -> None:
        """Journal one reply of ``run`` (its file, and its principal's bytes).

        Raises:
            QuotaExceeded: it would take the principal's journals past their quota;
            OSError: it could not be written.
        """
        size = len(entry.pack())
        self.quota.may_journal(run.owner_key, run.owner_name, size)
        if run.journal.entries == 0:
            self._make_directory()
        added = run.journal.append(entry)
        self.quota.add(run.owner_key, added)

    def usage(self, owner: int | str | None) -> tuple[int, int, int]:
        """(durable runs, of which parked, their journals' bytes): of ``owner``'s runs, or
        of all (None)."""
        runs = [r for r in self.runs.values() if owner is None or r.owner_key == owner]
        return (len(runs), sum(1 for r in runs if r.parked),
                self.quota.total() if owner is None else self.quota.held[owner])

    # -- disk

    def _path(self, job_id: str, kind: str) -> str:
        return os.path.join(self.directory, f"{job_id}.{kind}")

    def _make_directory(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)

    def save(self, run: DurableRun) -> None:
        if not run.parked and not run.dispatched and run.decision is None:
            return  # a live run: nothing on disk until it parks
        self._make_directory()
        run.journal.sync()  # what the run's file will name is on disk first
        path = self._path(run.job_id, "run")
        temp = f"{path}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, run.to_file())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)

    def forget(self, run: DurableRun) -> None:
        """The parked run's file (it runs live again; its journal stays, for a later
        park)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(run.job_id, "run"))

    def keep_state(self, run: DurableRun) -> str | None:
        """A session run parks: its session's state before it, into the snapshot store."""
        return self.sessions.keep_state(run)

    def drop(self, run: DurableRun, why: str) -> None:
        """Forget a parked run for good (and its session's state)."""
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]
        self._delete(run)
        self.audit_event(run, f"dropped: {why}")
        if run.session_id is not None:
            self.sessions.dropped(run)

    def session_run(self, session_id: str) -> DurableRun | None:
        """The parked run of that session, if it has one."""
        for run in self.runs.values():
            if run.session_id == session_id and run.parked:
                return run
        return None

    def _expire(self) -> None:
        """Drop the parked runs not decided and continued within their policy's ``max_wait_s``
        (checked at start, and whenever approvals are listed, decided or resumed)."""
        now = time.time()
        for run in list(self.runs.values()):
            if run.parked and not run.continuing \
                    and now - run.parked_at > run.policy.approvals.max_wait_s:
                self.drop(run, "not decided and resumed within max_wait_s")

    def _delete(self, run: DurableRun) -> None:
        """Everything on disk of ``run`` (its file, its journal), and its journal's bytes
        from its principal's."""
        self.quota.remove(run.owner_key, run.journal.bytes)
        run.journal.delete()
        self._delete_files(run.job_id)

    def _delete_files(self, job_id: str) -> None:
        for kind in ("run", "journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(job_id, kind))

    def load(self) -> int:
        """At start: the parked runs on disk (those past ``max_wait_s``, and those whose
        file or journal is damaged, are dropped, logged). Their journals count against their
        principals' quota, even past it (the quota was lowered): nothing parked is lost to
        a quota; new parks are refused until they are under it."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return 0
        policies = self.catalog().policies
        now = time.time()
        for name in names:
            path = os.path.join(self.directory, name)
            if name.endswith(".journal"):
                continue  # its run's (below), or a run's that was live at a crash
            if not name.endswith(".run"):
                with contextlib.suppress(OSError):
                    os.unlink(path)  # a temporary left by a crash
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    data = msgpack.unpackb(os.read(fd, 1 << 30), raw=False)
                finally:
                    os.close(fd)
                run = self._from_file(data, policies)
            except Exception as exc:
                log.warning("parked run %s unreadable (%s); dropped", name, exc)
                self._delete_files(name[:-4])
                continue
            if run is None or run.held is None \
                    or now - run.parked_at > run.policy.approvals.max_wait_s:
                self._delete_files(name[:-4])  # a run live at a crash is lost, as any
                continue  # running job (its session's state, if any, goes in the sweep)
            self.runs[run.job_id] = run
            self.quota.add(run.owner_key, run.journal.bytes)
        for name in names:  # journals of runs live at a crash (or dropped above)
            if name.endswith(".journal") and name[:-8] not in self.runs:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
        return len(self.runs)

    def _from_file(self, data: Any, policies: Any) -> DurableRun | None:
        """A parked run from its file (its journal checked against what the file records).

        Raises:
            JournalDamaged: its journal is not what was written; (anything else): the file
            is not one the daemon wrote.
        """
        if not isinstance(data, dict) or data.get("format") not in (1, FILE_FORMAT):
            return None
        policy = policies.get(data["policy"])
        if policy is None:
            return None
        job_id = data["job_id"]
        if not isinstance(job_id, str) or os.path.basename(job_id) != job_id \
                or job_id.startswith("."):
            return None
        journal = Journal(self._path(job_id, "journal"))
        if data["format"] == 1:  # the journal inline: moved to its own file
            journal.delete()
            if data["journal"]:
                self._make_directory()
            for j in data["journal"]:
                journal.append(Journaled(j[0], j[1], j[2], j[3],
                                         tuple(j[4]) if len(j) > 4 else ()))
        else:
            recorded = data["journal"]
            journal.entries, journal.bytes = int(recorded["entries"]), int(recorded["bytes"])
            journal.check()
        run = DurableRun(
            job_id, data["owner_key"], data["owner_name"], policy,
            JobDescription.from_wire(data["job"]), dict(data["requested"]),
            journal=journal,
            dispatched=bool(data["dispatched"]), parked=True, parked_at=data["parked_at"],
            resumes=int(data["resumes"]),
            hold=tuple(str(label) for label in data.get("hold", ())),
        )
        run.service = self
        if data["held"] is not None:
            index, call_id, name, args, since = data["held"]
            run.held = Held(index, call_id, name, args, since)
        if data["decision"] is not None:
            allow, reason, by = data["decision"]
            run.decision = (bool(allow), str(reason), str(by))
        session = data.get("session")
        if session is not None:
            run.session_id = str(session["id"])
            run.session_terms = dict(session["terms"])
            run.state_id = str(session["state"])
        if data["format"] == 1 and run.held is not None:
            self.save(run)  # in this format from now on (its journal already moved)
        return run

    def states(self) -> set[str]:
        """The snapshot ids of parked session runs' states (kept by the start's sweep)."""
        return {run.state_id for run in self.runs.values() if run.state_id is not None}

    def audit_event(self, run: DurableRun, what: str, by: str = "") -> None:
        held = run.held
        log.info("approvals: run %s %s%s%s", run.job_id, what,
                 f" call {held.call_id} ({held.name})" if held is not None else "",
                 f" by {by}" if by else "")


__all__ = ["Approvals", "DurableRun", "Journaled"]
