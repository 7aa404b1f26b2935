"""The parked-run machine: a durable run's life around its held call, and its file.

Theory of operation
-------------------
Under a policy with ``[approvals] park_after_s``, a run's tool calls go through a durable
run (:class:`jaild.daemon.approvals.DurableRun`, the IO: journal, tool host, jail, timers).
What the run may do next is decided here, by :class:`RunLife`, which does no IO: its phase,
the call held for a decision, the decision, and the moves between them as data
(:data:`MOVES`). The driver asks it before it acts and tells it what happened; a move not
in the table raises :class:`~jaild.errors.LocalProtocolError` (a jaild bug), so a run
cannot be continued twice, nor its decided call sent twice.

==========  =========================================  ==========  ==========================
phase       event                                      next        the driver then
==========  =========================================  ==========  ==========================
live        a call needs approval (:meth:`hold`)        held        ``ApprovalPending``, timer
held        decided while the jail waits (decide)      live        the call goes, or denied
held        the jail stopped waiting (withdrawn)       live        nothing
held        parking refused (its quota)                live        the call fails, journaled
held        ``park_after_s`` passed (:meth:`park`)     parked      saved; the jail killed
parked      decided (decide)                           parked      saved with its decision
parked      decided and hosted (:meth:`continue_`)     continuing  a fresh jail replays
continuing  the jail did not come back (set_back)      parked      ``ResumeRun`` again
continuing  replay reached the held call (at_held):
            allowed                                    dispatched  the call goes, *once*
            denied / sent before a crash               live        ``denied`` /
                                                                   ``unknown_outcome``
            another call than the held one             (same)      stopped, ``replay_diverged``
dispatched  its reply came (replied)                   live        its file forgotten
dispatched  another call needs approval                held        as live
any         its run ended, or it was dropped (end)     ended       its files deleted
==========  =========================================  ==========  ==========================

A replay's answers (:func:`replay_step`) are typed: the journaled call matches, or the
replay :class:`Diverged` (time, randomness or the network made the code take another path).

The file a parked run leaves on disk is :class:`ParkedRunFile`, declared once here and
checked when read back (a file that does not check is dropped, logged): format 3. Files of
formats 1 and 2 (earlier daemons) are read through :func:`upgrade` and rewritten.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaild.daemon.core.admission import SessionAsked
from jaild.errors import LocalProtocolError
from jaild.protocol.fields import (
    Struct,
    binary,
    boolean,
    describe,
    integer,
    list_of,
    map_of,
    nested,
    number,
    optional,
    string,
    struct,
)
from jaild.protocol.fields import field as checked
from jaild.protocol.messages import MAX_MESSAGE_CHARS, JobDescription


class Phase(enum.Enum):
    """Where a durable run is (see the module docstring)."""

    LIVE = "live"
    HELD = "held"
    PARKED = "parked"
    CONTINUING = "continuing"
    DISPATCHED = "dispatched"
    ENDED = "ended"


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.LIVE: frozenset({Phase.HELD, Phase.ENDED}),
    Phase.HELD: frozenset({Phase.LIVE, Phase.PARKED, Phase.ENDED}),
    Phase.PARKED: frozenset({Phase.CONTINUING, Phase.ENDED}),
    Phase.CONTINUING: frozenset({Phase.PARKED, Phase.LIVE, Phase.DISPATCHED, Phase.ENDED}),
    Phase.DISPATCHED: frozenset({Phase.LIVE, Phase.HELD, Phase.ENDED}),
    Phase.ENDED: frozenset(),
}
"""The legal moves of a durable run: phase -> the phases it may go to."""


# -- the records -------------------------------------------------------------------

_JOB_ID = string(64, min_len=1, pattern=r"job-[0-9a-z-]{1,59}")


def _tenant(path: str, value: Any) -> Any:
    """A principal's key: a uid, or a principal's words (docs/security.md)."""
    if type(value) is int and 0 <= value < 1 << 32:
        return value
    if type(value) is str and 0 < len(value) <= 256:
        return value
    raise LocalProtocolError(f"{path}: expected a uid or a principal's key, got {value!r:.40}")


_tenant_check = describe(_tenant, "a uid or a principal's key")


@struct
class HeldCall(Struct):
    """A call waiting for its decision: its place among the run's routed calls, its id in
    the jail, its tool and packed arguments, since when it waits."""

    index: int = checked(integer(0, 1 << 31))
    call_id: int = checked(integer(0, 1 << 53))
    name: str = checked(string(256, min_len=1))
    args: bytes = checked(binary(1 << 30))
    since: float = checked(number(0, 1 << 53))


@struct
class Decision(Struct):
    """A held call's decision: allowed or denied, why, and by whom."""

    allow: bool = checked(boolean())
    reason: str = checked(string(MAX_MESSAGE_CHARS), default="")
    by: str = checked(string(MAX_MESSAGE_CHARS), default="")


@struct
class ParkedSession(Struct):
    """A parked run's session: its id, the terms it was opened with, the run's number in
    it, and its state before the run (a snapshot of kind ``parked``)."""

    id: str = checked(string(64, min_len=1, pattern=r"ses-[0-9a-z-]{1,60}"))
    asked: SessionAsked = checked(nested(SessionAsked))
    run: int = checked(integer(1, 1 << 53))
    state: str | None = checked(optional(string(64, min_len=1, pattern=r"snap-[0-9a-z]{1,59}")),
                                default=None)


FILE_FORMAT = 3
"""1: the journal inline; 2: terms as a loose map; 3: :class:`ParkedRunFile`."""


@struct
class ParkedRunFile(Struct):
    """A parked run on disk (``<job id>.run``, msgpack), written by the daemon only."""

    job_id: str = checked(_JOB_ID)
    owner_key: int | str = checked(_tenant_check)
    owner_name: str = checked(string(512, min_len=1))
    policy: str = checked(string(64, min_len=1))
    job: JobDescription = checked(nested(JobDescription))
    requested: dict[str, float] = checked(
        map_of(string(64, min_len=1), number(0, 1 << 53), 32), default_factory=dict)
    journal_entries: int = checked(integer(0, 1 << 53), default=0)
    journal_bytes: int = checked(integer(0, 1 << 62), default=0)
    held: HeldCall | None = checked(optional(nested(HeldCall)), default=None)
    decision: Decision | None = checked(optional(nested(Decision)), default=None)
    dispatched: bool = checked(boolean(), default=False)
    """The decided call was sent to the tool host (a crash after: ``unknown_outcome``)."""
    parked_at: float = checked(number(0, 1 << 53), default=0.0)
    resumes: int = checked(integer(0, 1 << 31), default=0)
    hold: tuple[str, ...] = checked(list_of(string(64, min_len=1), 256), default=())
    session: ParkedSession | None = checked(optional(nested(ParkedSession)), default=None)
    format: int = checked(integer(FILE_FORMAT, FILE_FORMAT), default=FILE_FORMAT)


def upgrade(data: Mapping[str, Any]) -> dict[str, Any]:
    """A format-2 file's map in format 3 (a format-1 file's, once its inline journal was
    moved to its own file: the caller does that, and passes the journal's size in
    ``journal``). Raises KeyError/TypeError/ValueError for a map that is neither."""
    journal = data["journal"]
    held = data["held"]
    decision = data["decision"]
    session = data.get("session")
    out: dict[str, Any] = {
        "format": FILE_FORMAT,
        "job_id": data["job_id"], "owner_key": data["owner_key"],
        "owner_name": data["owner_name"], "policy": data["policy"], "job": data["job"],
        "requested": dict(data["requested"]),
        "journal_entries": int(journal["entries"]), "journal_bytes": int(journal["bytes"]),
        "held": None if held is None else dict(zip(
            ("index", "call_id", "name", "args", "since"), held, strict=True)),
        "decision": None if decision is None else dict(zip(
            ("allow", "reason", "by"), decision, strict=True)),
        "dispatched": bool(data["dispatched"]), "parked_at": data["parked_at"],
        "resumes": int(data["resumes"]), "hold": list(data.get("hold", ())),
    }
    if session is not None:
        terms = dict(session["terms"])
        run = int(terms.pop("run", 1))
        out["session"] = {"id": session["id"], "asked": terms, "run": run,
                          "state": session["state"]}
    return out


# -- the replay --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Diverged:
    """A replay that took another path: the ``replay_diverged`` error's words."""

    why: str


def replay_step(index: int, journaled: tuple[str, bytes], called: tuple[str, bytes], *,
                held: bool = False) -> Diverged | None:
    """Is the replay's call ``index`` (tool, packed arguments) the journaled one (``held``:
    the call that waited for approval)? None if so, else how the replay diverged."""
    if journaled == called:
        return None
    name, was = called[0], journaled[0]
    where = "the call that waited for approval" if held else f"call {index + 1}"
    return Diverged(f"the replay diverged at {where}: the run called {name!r} where it had "
                    f"called {was!r}" + ("" if was != name else " with other arguments"))


class AtHeld(enum.Enum):
    """What a continuation does at the call that waited for approval."""

    DISPATCH = "dispatch"  # allowed: it goes to the tool host, once
    DENY = "deny"  # denied: ``denied``
    UNKNOWN_OUTCOME = "unknown_outcome"  # sent before the daemon stopped: never sent twice


# -- the machine -------------------------------------------------------------------


@dataclass
class RunLife:
    """A durable run's phase, held call and decision (see the module docstring)."""

    phase: Phase = Phase.LIVE
    held: HeldCall | None = None
    decision: Decision | None = None
    dispatched: bool = False  # the decided call was sent; its reply not yet journaled
    parked_at: float = 0.0
    resumes: int = 0
    continued: int = 0  # continuations begun: at most one per park (the invariant)

    def _go(self, phase: Phase) -> None:
        if phase not in MOVES[self.phase]:
            raise LocalProtocolError(
                f"a durable run cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase

    @property
    def parked(self) -> bool:
        return self.phase is Phase.PARKED

    @property
    def waiting(self) -> bool:
        """A call waits for a decision nobody gave yet (``jaild approvals`` lists it)."""
        return self.held is not None and self.decision is None and self.phase in (
            Phase.HELD, Phase.PARKED)

    @property
    def on_disk(self) -> bool:
        """Its file is kept: parked, or the decided call is on its way (``dispatched``)."""
        return self.phase is Phase.PARKED or self.dispatched or self.decision is not None

    def hold(self, call: HeldCall) -> None:
        """A call needs approval: it waits for its decision."""
        self._go(Phase.HELD)
        self.held = call
        self.decision = None

    def released(self) -> HeldCall:
        """The held call is let go while the jail waits: decided live, withdrawn, or its
        parking refused. Returns it."""
        held = self.held
        assert held is not None and self.phase is Phase.HELD
        self._go(Phase.LIVE)
        self.held = None
        return held

    def park(self, now: float) -> None:
        """The held call waited ``park_after_s``: the run waits on disk."""
        assert self.held is not None and self.decision is None
        self._go(Phase.PARKED)
        self.parked_at = now
        self.continued = 0

    def decide(self, decision: Decision) -> None:
        """A parked run's decision (a live one's is :meth:`released`)."""
        if self.phase is not Phase.PARKED or self.held is None or self.decision is not None:
            raise LocalProtocolError(f"a durable run in {self.phase.name} cannot be decided")
        self.decision = decision

    @property
    def can_continue(self) -> bool:
        return self.phase is Phase.PARKED and self.decision is not None

    def continue_(self) -> None:
        """A decided parked run has a host: a fresh jail replays it."""
        if not self.can_continue:
            raise LocalProtocolError(
                f"a durable run in {self.phase.name} cannot be continued"
                + ("" if self.decision is not None else " (not decided)"))
        self._go(Phase.CONTINUING)
        self.continued += 1
        self.resumes += 1

    def set_back(self) -> None:
        """The continuation's jail did not come back: parked again, as it was."""
        self._go(Phase.PARKED)
        self.resumes -= 1

    def at_held(self) -> AtHeld:
        """The replay reached the call that waited (the same call: the driver checked).
        Dispatched, the held call and its decision stay (on disk) until its reply."""
        assert self.held is not None and self.decision is not None
        if self.phase is not Phase.CONTINUING:
            raise LocalProtocolError(f"a durable run in {self.phase.name} replays nothing")
        if self.dispatched or not self.decision.allow:
            outcome = AtHeld.UNKNOWN_OUTCOME if self.dispatched else AtHeld.DENY
            self._go(Phase.LIVE)
            self.held = self.decision = None
            self.dispatched = False
            return outcome
        self._go(Phase.DISPATCHED)
        self.dispatched = True
        return AtHeld.DISPATCH

    def replied(self) -> bool:
        """The dispatched call's reply came (journaled). Returns True when nothing of the
        run need stay on disk any more (its file goes)."""
        self.dispatched = False
        if self.phase is Phase.DISPATCHED:
            self._go(Phase.LIVE)
            self.held = self.decision = None
        return not self.on_disk

    def end(self) -> None:
        """The run ended (its record), or was dropped."""
        if self.phase is not Phase.ENDED:
            self._go(Phase.ENDED)

    # -- its file

    def record(self) -> dict[str, Any]:
        """This machine's part of :class:`ParkedRunFile`."""
        return {"held": self.held, "decision": self.decision, "dispatched": self.dispatched,
                "parked_at": self.parked_at, "resumes": self.resumes}

    @classmethod
    def parked_from(cls, saved: ParkedRunFile) -> RunLife:
        """A run read back from its file: parked, with what it waited for."""
        return cls(Phase.PARKED, saved.held, saved.decision, saved.dispatched,
                   saved.parked_at, saved.resumes)


__all__ = [
    "FILE_FORMAT", "MOVES", "AtHeld", "Decision", "Diverged", "HeldCall", "ParkedRunFile",
    "ParkedSession", "Phase", "RunLife", "replay_step", "upgrade",
]
