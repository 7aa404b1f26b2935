"""The session machine: one session's life, as a sans-IO state machine.

Theory of operation
-------------------
A session (``OpenSession``) is a jail kept for a series of runs of one client; it can be
snapshotted, paused to disk and resumed in a fresh jail, and a run of it can park for an
approval and continue later in a fresh jail. :class:`SessionMachine` is the whole
decision-making of that life. It has one verb, :meth:`SessionMachine.handle`: an
:data:`Event` (what the daemon saw or was asked) goes in, a list of :data:`Action` (what the
driver, :class:`jaild.daemon.sessions.Sessions`, must now do, in order) comes out. A request
that may not be made now raises its refusal instead, naming why, and changes nothing.

Three machines meet in a session (as h11's client and server machines meet in one
connection): this one; the job machine of its jail (:mod:`jaild.daemon.core.machine`: one
per jail, a session having a new one each time it comes back from disk), which ends each
run; and, for a run that parks, the parked run's (:mod:`jaild.daemon.core.parked`). The
driver feeds this machine what the others decide: a run's end (:class:`RunEnded`, from
the job machine's record), a park (:class:`RunParked`, from the parked run's), a dropped
parked run (:class:`ParkedRunDropped`).

States (:class:`Phase`), and the events that move between them:

============  ===================================  ============  ===============================
phase         event                                next          actions
============  ===================================  ============  ===============================
starting      JailReady (opening)                  idle          ArmLifetime, Timers(idle)
starting      JailReady (resuming a pause)         idle          DeleteState(paused), Timers
starting      JailReady (continuing a parked run)  running       ArmLifetime
starting      JailFailed (opening)                 closed        Forget (the client gets Error)
starting      JailFailed (resuming a pause)        closed        the close below, restore_failed
starting      JailFailed (continuing)              parked        RetireJail (it stays parked)
idle          RunAsked                             running       Timers(busy)
idle          OpAsked(snapshot | pause)            snapshotting  Timers(busy)
running       RunEnded, jail alive                 idle          Timers(idle)
running       RunEnded, jail gone                  closed        the close below, its status
running       RunParked                            parked        StopTimers, RetireJail
snapshotting  OpEnded, a pause's state saved       paused        RetireJail, Timers(idle)
snapshotting  OpEnded, jail alive                  idle          Timers(idle)
snapshotting  OpEnded, jail gone                   closed        the close below, its status
paused        ResumeAsked                          starting      (a fresh jail, its labels)
parked        ContinueAsked                        starting      (a fresh jail, its labels)
parked        ParkedRunDropped                     closed        the close, parked_run_dropped
idle          JailDied                             closed        the close, its status
parked        Close(disconnected | shutdown)       closed        StopTimers, Detach (the parked
                                                                 run keeps its state)
any open      Close                                closed        StopTimers, DropParkedRun |
                                                                 DeleteState | CancelJail,
                                                                 Forget, Discard, SendClosed
any open      Labeled                              (same)        (the labels grow)
============  ===================================  ============  ===============================

"Open" is every phase but closed. An event not listed for a phase is a late fact and
changes nothing there (a run's end after the session was closed; a jail's death during a
run, which the run's end reports). The phases' legal moves are :data:`MOVES` (data; the
machine refuses any other, a jaild bug).

Labels (docs/using/flow.md): what the session holds is part of its state and only grows:
the caller's at open, a snapshot's it restores, every label its runs' tool replies
carried (:class:`Labeled`). A jail made for the session (:meth:`SessionMachine.labels`) starts
holding them all, so no byte of restored state runs before its labels close what they close.

Invariants (tested with generated event orders in ``tests/unit/test_session_machine.py``):
no run or second op while a snapshot is taken; the labels never shrink; a closed session
stays closed and says so once; every phase change is in :data:`MOVES`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaild.errors import Busy, LocalProtocolError, SessionClosed, SessionPaused


class Phase(enum.Enum):
    """Where a session is; the value is what ``jaild ps`` shows."""

    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    SNAPSHOTTING = "snapshotting"
    PAUSED = "paused"
    PARKED = "parked"
    CLOSED = "closed"


def shown(phase: Phase) -> str:
    """The phase in the wire's words (``JobEntry.state`` in ``jaild ps``): a snapshot in
    progress is work, so ``running``."""
    return "running" if phase is Phase.SNAPSHOTTING else phase.value


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.IDLE, Phase.RUNNING, Phase.PARKED, Phase.CLOSED}),
    Phase.IDLE: frozenset({Phase.RUNNING, Phase.SNAPSHOTTING, Phase.CLOSED}),
    Phase.RUNNING: frozenset({Phase.IDLE, Phase.PARKED, Phase.CLOSED}),
    Phase.SNAPSHOTTING: frozenset({Phase.IDLE, Phase.PAUSED, Phase.CLOSED}),
    Phase.PAUSED: frozenset({Phase.STARTING, Phase.CLOSED}),
    Phase.PARKED: frozenset({Phase.STARTING, Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}
"""The legal moves of a session: phase -> the phases it may go to."""


class Start(enum.Enum):
    """Why a session's jail is starting."""

    OPEN = "open"  # a new session (from nothing, or from a snapshot)
    RESUME = "resume"  # a paused session comes back
    CONTINUE = "continue"  # a session whose run parked comes back to go on with it


class Op(enum.Enum):
    """An operation on an idle session's state (docs/using/sessions.md)."""

    SNAPSHOT = "snapshot"
    PAUSE = "pause"


DETACHING = frozenset({"disconnected", "shutdown"})
"""The close reasons that detach a session whose run is parked, instead of closing it: its
client left or the daemon stops, and the parked run keeps the session's state to go on later
on any of its owner's connections."""


# -- events ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JailReady:
    """The session's jail started (and restored the state it came back with)."""


@dataclass(frozen=True, slots=True)
class JailFailed:
    """The session's jail did not start, or did not restore its state."""

    message: str


@dataclass(frozen=True, slots=True)
class RunAsked:
    """A run of the session was admitted (refused by raising if it may not start now)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class RunEnded:
    """The run's record was sent; ``jail_alive``: the jail survived it; ``status``,
    ``message``: what ended the run (the session's close reason if the jail did not)."""

    job_id: str
    jail_alive: bool
    status: str = "ok"
    message: str = ""


@dataclass(frozen=True, slots=True)
class OpAsked:
    """A snapshot or pause of the idle session (refused by raising if it may not be now)."""

    op: Op


@dataclass(frozen=True, slots=True)
class OpEnded:
    """The op ended: ``state_id`` is a pause's saved state (None: not paused, or the op was
    a snapshot); ``jail_alive``, ``status``, ``message`` as :class:`RunEnded`."""

    state_id: str | None
    jail_alive: bool
    status: str = "ok"
    message: str = ""


@dataclass(frozen=True, slots=True)
class ResumeAsked:
    """A paused session is asked back (``ResumeSession``); ``labels``: its state's."""

    labels: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RunParked:
    """The session's run parked for approval; its state before the run is ``state_id``."""

    job_id: str
    state_id: str


@dataclass(frozen=True, slots=True)
class ContinueAsked:
    """The parked run was decided and has a host: the session comes back to go on with it;
    ``labels``: its state's."""

    job_id: str
    labels: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ParkedRunDropped:
    """The session's parked run was dropped (not decided in time, its state gone)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class JailDied:
    """The session's jail ended on its own; ``status``, ``message``: what ended it."""

    status: str
    message: str


@dataclass(frozen=True, slots=True)
class Close:
    """End the session: its idle or lifetime timer, its client (``CloseSession``, or it
    left), ``jaild kill``, shutdown, a failed restore."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Labeled:
    """The session's jail now holds these labels too."""

    labels: frozenset[str]


Event = (
    JailReady | JailFailed | RunAsked | RunEnded | OpAsked | OpEnded | ResumeAsked | RunParked
    | ContinueAsked | ParkedRunDropped | JailDied | Close | Labeled
)


# -- actions -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timers:
    """Stop the idle and pause timers; with ``idle``, start the idle clock again (and the
    pause clock of a session that pauses when idle, if it is idle)."""

    idle: bool


@dataclass(frozen=True, slots=True)
class ArmLifetime:
    """Its jail is (back) up: its lifetime counts from now."""


@dataclass(frozen=True, slots=True)
class StopTimers:
    """Stop every timer of the session (idle, pause, lifetime)."""


@dataclass(frozen=True, slots=True)
class RetireJail:
    """Discard the session's current jail (it paused, parked, or failed to come back)."""

    why: str


@dataclass(frozen=True, slots=True)
class CancelJail:
    """Kill the jail: what runs in it ends ``cancelled``."""

    why: str


@dataclass(frozen=True, slots=True)
class DeleteState:
    """Delete the session's state from the snapshot store."""

    state_id: str


@dataclass(frozen=True, slots=True)
class DropParkedRun:
    """Drop the session's parked run for good."""

    job_id: str
    why: str


@dataclass(frozen=True, slots=True)
class Detach:
    """Take the session out of the registry without telling its client: its parked run keeps
    its state, to re-make it on any of its owner's connections (audited ``detached``)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Take the session out of the registry."""


@dataclass(frozen=True, slots=True)
class Discard:
    """Discard its jail (in the registry's *retiring* count until it is gone)."""

    why: str


@dataclass(frozen=True, slots=True)
class SendClosed:
    """Tell its client ``SessionClosed`` (and audit it)."""

    reason: str
    message: str


Action = (
    Timers | ArmLifetime | StopTimers | RetireJail | CancelJail | DeleteState | DropParkedRun
    | Detach | Forget | Discard | SendClosed
)


# -- the machine -------------------------------------------------------------------


@dataclass
class SessionMachine:
    """One session's life (see the module docstring).

    Args:
        session_id: its id (in refusals).
        labels: what it holds from its start (the caller's, a snapshot's it restores).
        runs: the client's runs so far (a session re-made for a parked run: the runs before).
        phase, start, state_id, parked_run: a session re-made for its parked run starts
            :attr:`Phase.PARKED` with the run and its state.
    """

    session_id: str
    labels: frozenset[str] = frozenset()
    runs: int = 0
    phase: Phase = Phase.STARTING
    start: Start = Start.OPEN
    state_id: str | None = None
    parked_run: str | None = None
    run: str | None = None
    op: Op | None = None
    closed: str | None = None
    jails: int = 1

    # -- what others ask of it

    @property
    def open(self) -> bool:
        return self.phase is not Phase.CLOSED

    @property
    def busy(self) -> bool:
        """A run or an op is in progress (or its jail is starting): no idle expiry."""
        return self.phase in (Phase.STARTING, Phase.RUNNING, Phase.SNAPSHOTTING)

    @property
    def holds_jail(self) -> bool:
        """Its jail counts against the limits: not paused or parked (a session coming back
        from disk holds its new jail)."""
        return self.phase not in (Phase.PAUSED, Phase.PARKED, Phase.CLOSED)

    def check_runnable(self) -> None:
        """May a run (or an op) start now?

        Raises:
            SessionClosed, SessionPaused, Busy: naming why not.
        """
        phase = self.phase
        if phase is Phase.IDLE:
            return
        if phase is Phase.CLOSED:
            raise SessionClosed(f"session {self.session_id} is closed: {self.closed}")
        if phase is Phase.RUNNING:
            raise Busy(f"session {self.session_id} is running job {self.run}; one run at a "
                       "time")
        if phase is Phase.SNAPSHOTTING:
            assert self.op is not None
            doing = "taking a snapshot" if self.op is Op.SNAPSHOT else "pausing to disk"
            raise Busy(f"session {self.session_id} is {doing}; one run or snapshot at a time")
        if phase is Phase.PARKED:
            raise Busy(f"session {self.session_id}'s run {self.parked_run} is parked for "
                       "approval; the session goes on once the call is decided "
                       "(jaild approvals)")
        if phase is Phase.PAUSED:
            raise SessionPaused(f"session {self.session_id} is paused to disk; resume it "
                                "first (ResumeSession)")
        if self.start is Start.OPEN:
            raise Busy(f"session {self.session_id} is still starting; wait for SessionOpened")
        raise Busy(f"session {self.session_id} is being resumed already")

    # -- the verb

    def handle(self, event: Event) -> list[Action]:
        """What ``event`` does (see the module's table). Raises the refusal of a request
        that may not be made now (:class:`RunAsked`, :class:`OpAsked`, :class:`ResumeAsked`)."""
        return _HANDLERS[type(event)](self, event)  # every Event has one: the unit test

    def _go(self, phase: Phase) -> None:
        if phase not in MOVES[self.phase]:
            raise LocalProtocolError(
                f"session {self.session_id} cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase

    # -- handlers (the table's rows)

    def _jail_ready(self, _: JailReady) -> list[Action]:
        if self.phase is not Phase.STARTING:
            return []
        start = self.start
        if start is Start.CONTINUE:
            self.parked_run = None
            self.state_id = None  # the parked run's: it deletes it when it ends
            self._go(Phase.RUNNING)
            return [ArmLifetime()]
        paused, self.state_id = self.state_id, None
        self._go(Phase.IDLE)
        if start is Start.RESUME:
            assert paused is not None
            return [DeleteState(paused), Timers(idle=True)]
        return [ArmLifetime(), Timers(idle=True)]

    def _jail_failed(self, event: JailFailed) -> list[Action]:
        if self.phase is not Phase.STARTING:
            return []
        if self.start is Start.OPEN:
            self.closed = "start_failed"
            self._go(Phase.CLOSED)
            return [Forget()]
        if self.start is Start.RESUME:
            return self._close(Close("restore_failed",
                                     f"the paused session was not restored: {event.message}"))
        self.run = None
        self._go(Phase.PARKED)  # it stays parked: ResumeRun again
        return [RetireJail("the parked run did not go on")]

    def _run_asked(self, event: RunAsked) -> list[Action]:
        self.check_runnable()
        self.run = event.job_id
        self.runs += 1
        self._go(Phase.RUNNING)
        return [Timers(idle=False)]

    def _run_ended(self, event: RunEnded) -> list[Action]:
        if self.phase is not Phase.RUNNING or self.run != event.job_id:
            return []  # closed (or parked) meanwhile
        self.run = None
        if not event.jail_alive:
            return self._close(Close(event.status, f"run {event.job_id} ended the session: "
                                                   f"{event.message}"))
        self._go(Phase.IDLE)
        return [Timers(idle=True)]

    def _op_asked(self, event: OpAsked) -> list[Action]:
        self.check_runnable()
        self.op = event.op
        self._go(Phase.SNAPSHOTTING)
        return [Timers(idle=False)]

    def _op_ended(self, event: OpEnded) -> list[Action]:
        if self.phase is not Phase.SNAPSHOTTING:
            return []
        op, self.op = self.op, None
        if op is Op.PAUSE and event.state_id is not None:
            self.state_id = event.state_id
            self.start = Start.RESUME
            self._go(Phase.PAUSED)
            return [RetireJail("session paused"), Timers(idle=True)]
        if not event.jail_alive:
            return self._close(Close(event.status, "the session's jail ended during a "
                                                   f"snapshot: {event.message}"))
        self._go(Phase.IDLE)
        return [Timers(idle=True)]

    def _resume_asked(self, event: ResumeAsked) -> list[Action]:
        if self.phase is not Phase.PAUSED:
            self.check_runnable()
            raise LocalProtocolError(f"session {self.session_id} is not paused")
        self.labels |= event.labels
        self.jails += 1
        self.start = Start.RESUME
        self._go(Phase.STARTING)
        return []

    def _run_parked(self, event: RunParked) -> list[Action]:
        if self.phase is not Phase.RUNNING or self.run != event.job_id:
            return []
        self.run = None
        self.parked_run = event.job_id
        self.state_id = event.state_id
        self._go(Phase.PARKED)
        return [StopTimers(), RetireJail("session run parked")]

    def _continue_asked(self, event: ContinueAsked) -> list[Action]:
        if self.phase is not Phase.PARKED or self.parked_run != event.job_id:
            raise LocalProtocolError(
                f"session {self.session_id} has no parked run {event.job_id} to go on with")
        self.labels |= event.labels
        self.jails += 1
        self.run = event.job_id
        self.start = Start.CONTINUE
        self._go(Phase.STARTING)
        return []

    def _parked_run_dropped(self, event: ParkedRunDropped) -> list[Action]:
        if self.phase is not Phase.PARKED or self.parked_run != event.job_id:
            return []
        self.parked_run = None  # the approvals drop it (and its state)
        self.state_id = None
        return self._close(Close("parked_run_dropped",
                                 f"its run {event.job_id}, parked for approval, was dropped"))

    def _jail_died(self, event: JailDied) -> list[Action]:
        if self.phase is not Phase.IDLE:
            return []  # a run's or op's end reports it; a paused session's jail was let go
        return self._close(Close(event.status,
                                 f"the session's jail ended between runs: {event.message}"))

    def _close(self, event: Close) -> list[Action]:
        phase = self.phase
        if phase is Phase.CLOSED:
            return []
        self.closed = event.reason
        actions: list[Action] = [StopTimers()]
        if phase in (Phase.STARTING, Phase.RUNNING, Phase.SNAPSHOTTING):
            actions.append(CancelJail(f"the session was closed ({event.reason}): "
                                      f"{event.message}"))
        parked = self.parked_run if phase is Phase.PARKED else (
            self.run if phase is Phase.STARTING and self.start is Start.CONTINUE else None)
        self.run = None
        if parked is not None:
            if event.reason in DETACHING:
                self._go(Phase.CLOSED)
                return [*actions, Detach(parked)]
            actions.append(DropParkedRun(parked, f"its session was closed ({event.reason})"))
        elif self.state_id is not None and self.start is Start.RESUME:  # paused, or resuming
            actions.append(DeleteState(self.state_id))
        self._go(Phase.CLOSED)
        return [*actions, Forget(), Discard(f"session {event.reason}"),
                SendClosed(event.reason, event.message)]

    def _labeled(self, event: Labeled) -> list[Action]:
        if self.phase is not Phase.CLOSED:
            self.labels |= event.labels
        return []


_HANDLERS: dict[type[Any], Callable[[SessionMachine, Any], list[Action]]] = {
    JailReady: SessionMachine._jail_ready,
    JailFailed: SessionMachine._jail_failed,
    RunAsked: SessionMachine._run_asked,
    RunEnded: SessionMachine._run_ended,
    OpAsked: SessionMachine._op_asked,
    OpEnded: SessionMachine._op_ended,
    ResumeAsked: SessionMachine._resume_asked,
    RunParked: SessionMachine._run_parked,
    ContinueAsked: SessionMachine._continue_asked,
    ParkedRunDropped: SessionMachine._parked_run_dropped,
    JailDied: SessionMachine._jail_died,
    Close: SessionMachine._close,
    Labeled: SessionMachine._labeled,
}


__all__ = [
    "DETACHING",
    "MOVES",
    "Action",
    "ArmLifetime",
    "CancelJail",
    "Close",
    "ContinueAsked",
    "DeleteState",
    "Detach",
    "Discard",
    "DropParkedRun",
    "Event",
    "Forget",
    "JailDied",
    "JailFailed",
    "JailReady",
    "Labeled",
    "Op",
    "OpAsked",
    "OpEnded",
    "ParkedRunDropped",
    "Phase",
    "ResumeAsked",
    "RetireJail",
    "RunAsked",
    "RunEnded",
    "RunParked",
    "SendClosed",
    "SessionMachine",
    "Start",
    "StopTimers",
    "Timers",
]
