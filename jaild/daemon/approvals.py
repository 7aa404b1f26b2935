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
one entry at a time by a replay (:mod:`jaild.daemon.state.journal`); the daemon holds its path,
count and size. A parked run's own file is ``<job id>.run`` beside it (a
:class:`~jaild.daemon.core.parked.ParkedRunFile`: the job, the held call, its decision, the
journal's count and size), written to a temporary name and renamed once the journal is
synced. Both are made by the daemon only: never a name or a format from a jail or a client
(:mod:`jaild.daemon.state.parkedruns` keeps them).

What a run may do next -- hold, park, continue, send its decided call -- is decided by its
:class:`~jaild.daemon.core.parked.RunLife` (a pure machine, its moves as data); this module
is its IO: the journal's replies, the tool host, the jail, the park timer. A continuation is
made by the pipeline, the one path every run takes to its record
(:meth:`jaild.daemon.pipeline.Pipeline.continue_run`): :meth:`Approvals.decide`,
:meth:`Approvals.resume` and :meth:`Approvals.jail_released` say when one is due.

Quotas per principal (:class:`~jaild.daemon.state.journal.ApprovalQuota`: the daemon's
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
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from jaild.daemon.core import admission
from jaild.daemon.core.parked import (
    AtHeld,
    Decision,
    HeldCall,
    ParkedRunFile,
    ParkedSession,
    Phase,
    RunLife,
    replay_step,
)
from jaild.daemon.core.peer import Peer, Tenant
from jaild.daemon.flowgate import names
from jaild.daemon.jails.job import CallReply, JailedJob, Reply
from jaild.daemon.registry import ClientConnection
from jaild.daemon.state.journal import Journal, Journaled
from jaild.daemon.state.parkedruns import ParkedRuns
from jaild.errors import (
    BadRequest,
    ConnectionLost,
    JournalDamaged,
    PermissionDenied,
    QuotaExceeded,
    UnknownJob,
)
from jaild.policy.schema import Policy
from jaild.protocol.messages import ApprovalPending, JobDescription, RunParked
from jaild.protocol.records import ApprovalEntry

if TYPE_CHECKING:
    from jaild.daemon.registry import JailSession

log = logging.getLogger("jaild")

MAX_SHOWN_ARGS = 1 << 20


class SessionHooks(Protocol):
    """What the approvals tell the daemon's sessions (:class:`~jaild.daemon.sessions.Sessions`)
    of their runs."""

    def parked(self, run: DurableRun) -> None:
        """The run parked: its session (if still attached) waits on disk with it."""

    def dropped(self, run: DurableRun) -> None:
        """The run was dropped: an attached session closes."""


@dataclass(eq=False)
class DurableRun:
    """One run whose tool calls go through the approvals service (see the module): the IO
    around its :class:`~jaild.daemon.core.parked.RunLife`."""

    job_id: str
    owner_key: Tenant
    owner_name: str
    policy: Policy
    job: JobDescription
    requested: dict[str, float]
    service: Approvals = field(repr=False)
    journal: Journal = field(default_factory=lambda: Journal(""))  # on disk (the service's)
    life: RunLife = field(default_factory=RunLife)
    host: ClientConnection | None = None  # routes its calls, gets its output and record
    jail: JailedJob | None = None
    hold: tuple[str, ...] = ()  # the caller's (RunJob.labels): its continuation holds them too
    session_id: str | None = None  # a session's run: the session
    session_asked: admission.SessionAsked | None = None  # what re-opens it, if detached
    session_run: int = 0  # its number among the session's runs
    state_id: str | None = None  # once parked: ``before`` in the snapshot store
    before: bytes | None = None  # the session's state before the run (memory only)
    before_labels: tuple[str, ...] = ()  # the session's labels then
    _reply: CallReply | None = None  # the held call's, while a live jail waits on it
    _timer: asyncio.TimerHandle | None = None  # the park timer
    _replay_upto: int = 0  # calls of the current jail answered from the journal
    _replay_offset: int = 0  # where in the journal's file the next replayed entry starts
    _calls: int = 0  # calls routed in the current jail
    _muted: bool = False  # output of a replay before the held call: not sent again

    @property
    def parked(self) -> bool:
        return self.life.parked

    @property
    def held(self) -> HeldCall | None:
        return self.life.held

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
        held = self.life.held
        if self.life.phase is Phase.CONTINUING and held is not None and held.index == index:
            return self._at_held(held, name, args, call_id)
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
        diverged = replay_step(index, (entry.name, entry.args), (name, args))
        if diverged is not None:
            reply.resolve(False, ("replay_diverged", diverged.why))
            self._stop("replay_diverged", diverged.why)
            return reply
        value = entry.value if entry.ok else tuple(entry.value)
        reply.resolve(entry.ok, value, entry.labels)
        return reply

    def _at_held(self, held: HeldCall, name: str, args: bytes, call_id: int) -> CallReply:
        self._muted = False
        diverged = replay_step(held.index, (held.name, held.args), (name, args), held=True)
        if diverged is not None:
            reply = CallReply()
            reply.resolve(False, ("replay_diverged", diverged.why))
            self._stop("replay_diverged", diverged.why)
            return reply
        decision = self.life.decision
        assert decision is not None
        outcome = self.life.at_held()
        if outcome is AtHeld.UNKNOWN_OUTCOME:  # the daemon stopped while the call ran
            self.service.runs.forget(self)
            return self._answer(name, args, False, (
                "unknown_outcome", f"{name}: the daemon stopped while this call ran; it may "
                "or may not have happened, and is not made again"))
        if outcome is AtHeld.DENY:
            self.service.runs.forget(self)
            return self._answer(name, args, False,
                                ("denied", decision.reason or f"{name}: denied"))
        self.service.runs.save(self)  # the held call, its decision and "dispatched", first
        return self._dispatch(call_id, name, args, decided=True)

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
            self.service.runs.journal_append(self, entry)
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

    def _dispatch(self, call_id: int, name: str, args: bytes,
                  decided: bool = False) -> CallReply:
        """Send a call to the tool host and journal its reply (``decided``: the call that
        waited for approval, sent by a continuation: on disk as sent until its reply)."""
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
            if decided and self.life.replied():
                self.service.runs.forget(self)  # live again: nothing of it on disk
            if failed is not None:
                outer.resolve(False, failed)
            else:
                outer.resolve(ok, value, inner.labels)

        inner.listen(replied)
        return outer

    def _hold(self, index: int, call_id: int, name: str, args: bytes) -> CallReply:
        reply = CallReply(self._withdrawn)
        self.life.hold(HeldCall(index=index, call_id=call_id, name=name, args=args,
                                since=time.time()))
        self._reply = reply
        if self.host is not None:
            self.host.send(ApprovalPending(job_id=self.job_id, call_id=call_id, name=name,
                                           args=args))
        park_after = self.policy.approvals.park_after_s
        if park_after and self.can_park:
            self._timer = asyncio.get_running_loop().call_later(park_after, self._park)
        return reply

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _withdrawn(self) -> None:
        """The jail no longer waits (its wall time ran out, it was killed)."""
        if self.life.phase is Phase.HELD:
            self._stop_timer()
            self._reply = None
            self.life.released()

    def park_now(self) -> None:
        self._stop_timer()
        self._park()

    def _park(self) -> None:
        self._timer = None
        life = self.life
        if life.phase is not Phase.HELD or self.jail is None or life.dispatched:
            return  # decided or withdrawn meanwhile; or a decided call's reply is awaited
        runs = self.service.runs
        try:
            runs.may_park(self)
        except QuotaExceeded as exc:
            self._refuse_parking(exc)
            return
        if self.session_id is not None and self.state_id is None:
            self.state_id = runs.keep_state(self)
            if self.state_id is None:  # not saved (the quota): the call waits live
                return
        held = life.held
        assert held is not None
        life.park(time.time())
        self._reply = None
        runs.save(self)
        self.service.audit_event(self, "parked")
        if self.host is not None:
            self.host.send(RunParked(
                job_id=self.job_id, call_id=held.call_id, session_id=self.session_id,
                message=f"{held.name} waited {self.policy.approvals.park_after_s:g} s for "
                        "approval; the run is parked until it is decided"))
        self.jail.cancel(f"parked: call {held.call_id} ({held.name}) waits for approval")
        if self.session_id is not None:
            self.service.sessions.parked(self)

    def _refuse_parking(self, exc: QuotaExceeded) -> None:
        """Its principal has the most runs parked: the held call is answered
        ``quota_exceeded`` (journaled, so that a later replay answers it the same) and the
        run goes on live, its jail kept."""
        log.warning("approvals: run %s not parked: %s", self.job_id, exc.message)
        self.service.audit_event(self, f"not parked: {exc.message}")
        reply, self._reply = self._reply, None
        held = self.life.released()
        if reply is not None:
            self._settle(reply, self._answer(held.name, held.args, False,
                                             ("quota_exceeded", exc.message)))

    @staticmethod
    def _settle(reply: CallReply, answer: CallReply) -> None:
        answer.listen(lambda r: reply.lost() if r is None
                      else reply.resolve(r[0], r[1], answer.labels))

    def decide(self, allow: bool, reason: str, by: str) -> None:
        """A decision for the held call (checked by the service)."""
        if self.life.parked:
            self.life.decide(Decision(allow=allow, reason=reason, by=by))
            self.service.runs.save(self)
            return
        self._stop_timer()
        reply, self._reply = self._reply, None
        held = self.life.released()
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

    def restart_jail(self, jail: JailedJob) -> None:
        """A continuation's jail is up: replay the journal, then the decided call."""
        self.jail = jail
        self._calls = 0
        self._replay_upto = self.journal.entries
        self._replay_offset = 0
        self._muted = True

    # -- disk

    def to_file(self) -> ParkedRunFile:
        session = None
        if self.session_id is not None:
            assert self.session_asked is not None
            session = ParkedSession(id=self.session_id, asked=self.session_asked,
                                    run=self.session_run, state=self.state_id)
        return ParkedRunFile(
            job_id=self.job_id, owner_key=self.owner_key, owner_name=self.owner_name,
            policy=self.policy.name, job=self.job, requested=self.requested,
            journal_entries=self.journal.entries, journal_bytes=self.journal.bytes,
            hold=self.hold, session=session, **self.life.record())


class Approvals:
    """The daemon's held calls and parked runs (see the module docstring)."""

    def __init__(self, runs: ParkedRuns[DurableRun], sessions: SessionHooks) -> None:
        """``runs``: the daemon's durable runs and what they keep on disk; ``sessions``:
        its sessions, told when a session's run parks or is dropped."""
        self.runs = runs
        self.sessions = sessions

    @property
    def quota(self) -> Any:
        return self.runs.quota

    # -- runs

    def durable(self, policy: Policy) -> bool:
        """Do this policy's calls needing approval go through here?"""
        return policy.approvals.park_after_s > 0

    def track(self, job_id: str, host: ClientConnection, policy: Policy, job: JobDescription,
              requested: dict[str, float], session: JailSession | None = None,
              hold: frozenset[str] = frozenset()) -> DurableRun:
        run = DurableRun(job_id, host.peer.principal.key, str(host.peer.principal), policy, job,
                         dict(requested), self, Journal(self.runs.path(job_id, "journal")),
                         host=host, hold=tuple(sorted(hold)))
        if session is not None:
            run.session_id = session.id
            run.session_asked = session.terms.asked
            run.session_run = session.machine.runs + 1
        self.runs.add(run)
        return run

    def rename(self, run: DurableRun, job_id: str) -> None:
        """The run took a pooled jail: its id is the jail's (before any call)."""
        self.runs.rename(run, job_id)

    def ended(self, run: DurableRun) -> None:
        """Its run ended (not parked): forget it, and the state a session run parked with."""
        if not run.life.parked:
            run._stop_timer()
            self.runs.ended(run)

    def park_held(self, host: ClientConnection | None = None) -> None:
        """Park now every run (of ``host``; None: all) whose call waits for a decision: its
        connection is leaving, or the daemon is stopping. Each waits on disk."""
        for run in self.runs:
            if (host is None or run.host is host) and run.life.phase is Phase.HELD \
                    and run.can_park:
                run.park_now()

    def detach(self, host: ClientConnection) -> None:
        """A connection is gone: the parked runs it hosted wait for a ResumeRun."""
        for run in self.runs:
            if run.host is host and run.life.parked:
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

    def decide(self, peer: Peer, job_id: str, call_id: int, allow: bool,
               reason: str) -> DurableRun | None:
        """An ``ApproveCall``; returns the run if it is now due to continue (parked, decided,
        hosted: :meth:`jaild.daemon.pipeline.Pipeline.continue_run`).

        Raises:
            UnknownJob: no call of that run waits for approval, or the run is another
                principal's and the caller may not decide it; PermissionDenied: the caller's
                own run, which the policy's approvers do not include it for.
        """
        self.expire()
        run = self.runs.get(job_id)
        held = run.life.held if run is not None else None
        if run is None or held is None or held.call_id != call_id or not run.life.waiting:
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
        return run if run.life.can_continue and run.host is not None else None

    def pending(self, peer: Peer) -> list[ApprovalEntry]:
        """The calls waiting for a decision this peer may give."""
        self.expire()
        now = time.time()
        out = []
        for run in self.runs:
            held = run.life.held
            if held is None or not run.life.waiting or not self.may_approve(peer, run):
                continue
            out.append(ApprovalEntry(
                job_id=run.job_id, call_id=held.call_id, tool=held.name,
                args=held.args[:MAX_SHOWN_ARGS], policy=run.policy.name, owner=run.owner_name,
                waiting_s=round(max(0.0, now - held.since), 3), parked=run.life.parked,
                attached=run.host is not None, session=run.session_id))
        return out

    # -- resuming

    def resume(self, host: ClientConnection, ref: int, job_id: str,
               tools: set[str]) -> DurableRun | None:
        """A ``ResumeRun``: ``host`` hosts the parked run's tools (``tools``: its names)
        from now on. Returns the run if it is now due to continue (decided already).

        Raises:
            UnknownJob: no parked run of the caller's principal has that id; BadRequest: it
                is hosted by another connection already, or ``tools`` lacks one of its tools.
        """
        self.expire()
        run = self.runs.get(job_id)
        if run is None or not run.life.parked or run.owner_key != host.peer.principal.key:
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
        return run if run.life.can_continue else None

    def jail_released(self, run: DurableRun) -> bool:
        """A parked run's jail is gone (its live job unregistered): is a decision that came
        while it was ending to go on now?"""
        return run.life.can_continue and run.host is not None \
            and self.runs.get(run.job_id) is run

    # -- dropping

    def drop(self, run: DurableRun, why: str) -> None:
        """Forget a parked run for good (and its session's state; an attached session
        closes)."""
        self.runs.drop(run, why)
        if run.session_id is not None:
            self.sessions.dropped(run)

    def expire(self) -> None:
        """Drop the parked runs not decided and continued within their policy's ``max_wait_s``
        (checked at start, and whenever approvals are listed, decided or resumed)."""
        for run in self.runs.expired():
            self.drop(run, "not decided and resumed within max_wait_s")

    def load(self, policies: Any) -> int:
        """At start: the parked runs on disk (:meth:`ParkedRuns.load`)."""
        return self.runs.load(policies, self._from_file)

    def _from_file(self, saved: ParkedRunFile, policy: Policy, journal: Journal) -> DurableRun:
        run = DurableRun(saved.job_id, saved.owner_key, saved.owner_name, policy, saved.job,
                         dict(saved.requested), self, journal,
                         life=RunLife.parked_from(saved), hold=saved.hold)
        if saved.session is not None:
            run.session_id = saved.session.id
            run.session_asked = saved.session.asked
            run.session_run = saved.session.run
            run.state_id = saved.session.state
        return run

    def audit_event(self, run: DurableRun, what: str, by: str = "") -> None:
        held = run.life.held
        log.info("approvals: run %s %s%s%s", run.job_id, what,
                 f" call {held.call_id} ({held.name})" if held is not None else "",
                 f" by {by}" if by else "")


__all__ = ["Approvals", "DurableRun", "Journaled", "SessionHooks"]
