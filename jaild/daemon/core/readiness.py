"""Whether a starting daemon is ready: its phases, what it tells clients, which requests wait.

Theory of operation
-------------------
A daemon serves its socket as soon as it knows it can make jails here (policies loaded,
socket claimed, host checked: :mod:`jaild.daemon.startup`), before its zygotes, self-tests
and warm pools are up -- on a slow or loaded host those take tens of seconds, and a client
that connected then used to see no ``Welcome`` at all. So a client connecting while the
daemon starts gets its ``Welcome`` at once, with ``starting`` (a
:class:`~jaild.protocol.messages.Starting`: what is pending, and how long a request that
needs a jail waits); requests that need no jail (policies, stats, ps, ping) are answered at
once; requests that need a jail, or the state start-up loads (:data:`WAITING`), wait until
the daemon is ready, for ``limits.startup_wait_s`` at most, then get ``starting``
(:meth:`Readiness.timed_out`), which names what the daemon is still doing. As many may wait
as may run (:func:`check_waiting`).

The start's phases are :class:`Phase`, the moves between them :data:`TRANSITIONS` (data, as
the job machine's are): forward only, some skipped (no self-tests when they are off), and
every phase but the last two may fail. :class:`Readiness` holds the phase and the policies
it concerns; it does no IO: the shell (``server.Daemon``) keeps the waiting requests and
their timers, and asks this module what to say.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field

from jaild.errors import Busy
from jaild.errors import Starting as StartingError
from jaild.protocol.messages import (
    ApproveCall,
    DeleteSnapshot,
    ListApprovals,
    ListSnapshots,
    Message,
    OpenSession,
    ResumeRun,
    ResumeSession,
    RunJob,
    Starting,
)


class Phase(enum.Enum):
    """Where a daemon's start is, once it serves its socket; the value is what a client is
    told it is doing."""

    STAGING = "staging the runtime and sealing the jails' configurations"
    ZYGOTES = "starting the zygotes"
    SELF_TESTS = "running the self-tests"
    STATE = "loading the runs parked for approval and the snapshots"
    LISTENERS = "opening its network listeners"
    READY = "ready"
    FAILED = "failed to start"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STAGING: frozenset({Phase.ZYGOTES, Phase.FAILED}),
    Phase.ZYGOTES: frozenset({Phase.SELF_TESTS, Phase.STATE, Phase.FAILED}),  # tests off: skip
    Phase.SELF_TESTS: frozenset({Phase.STATE, Phase.FAILED}),
    Phase.STATE: frozenset({Phase.LISTENERS, Phase.READY, Phase.FAILED}),  # no listeners: skip
    Phase.LISTENERS: frozenset({Phase.READY, Phase.FAILED}),
    Phase.READY: frozenset(),
    Phase.FAILED: frozenset(),
}
"""The legal moves of a start: phase -> the phases it may go to."""

WAITING: tuple[type[Message], ...] = (
    RunJob, OpenSession, ResumeSession, ResumeRun, ApproveCall, ListApprovals, ListSnapshots,
    DeleteSnapshot,
)
"""The requests that wait for a starting daemon: they need a jail (a job, a session, a
restore, a parked run's continuation), or the state start-up loads (runs parked for
approval, the snapshots it sweeps). Every other request is answered at once: it needs
neither (policies, stats, ps, ping) or names something that cannot exist yet (a job, a
session: answered ``unknown_job``/``unknown_session`` as at any time)."""


def must_wait(msg: Message) -> bool:
    """Does ``msg`` wait for a starting daemon (:data:`WAITING`)? A run in a session does
    not: no session is open before the daemon is ready, so it is refused at once."""
    if isinstance(msg, RunJob):
        return msg.session_id is None
    return isinstance(msg, WAITING)


def check_waiting(on_connection: int, in_all: int, per_connection: int, total: int) -> None:
    """Room for one more waiting request, beside ``on_connection`` waiting on its connection
    and ``in_all`` in the daemon? As many may wait as may run: ``per_connection``
    (``limits.max_jobs_per_connection``) and ``total`` (``limits.max_jobs``) -- a waiting
    request holds its frame as a running job holds its code, so a client cannot pile up
    more of them while the daemon starts than it could while it serves.

    Raises:
        Busy: naming the limit reached.
    """
    if on_connection >= per_connection:
        raise Busy(
            f"{on_connection} requests of this connection already wait for the daemon to "
            f"start, the limit per connection (limits.max_jobs_per_connection {per_connection})"
        )
    if in_all >= total:
        raise Busy(
            f"{in_all} requests already wait for the daemon to start, its limit "
            f"(limits.max_jobs {total}); retry once it is ready"
        )


@dataclass
class Readiness:
    """A daemon's start, as its clients see it (see the module docstring).

    Args:
        wait_s: how long a request that needs a jail waits (``limits.startup_wait_s``).
        phase: where the start is; a daemon given what it serves with (``jaild.testing``)
            is ready from the start.
    """

    wait_s: float
    phase: Phase = Phase.STAGING
    policies: tuple[str, ...] = field(default=())
    """The policies the phase concerns (whose zygotes start, whose self-tests run)."""

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def starting(self) -> bool:
        """Still starting: requests that need a jail wait."""
        return self.phase not in (Phase.READY, Phase.FAILED)

    def advance(self, phase: Phase, policies: Collection[str] = ()) -> None:
        """The start moved on to ``phase`` (concerning ``policies``).

        Raises:
            ValueError: not a legal move (a jaild bug).
        """
        if phase not in TRANSITIONS[self.phase]:
            raise ValueError(f"a start cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase
        self.policies = tuple(sorted(policies))

    def pending(self) -> str:
        """What the daemon is still doing, in words."""
        if not self.policies:
            return self.phase.value
        return f"{self.phase.value} of policies {', '.join(self.policies)}"

    def welcome(self) -> Starting | None:
        """What ``Welcome.starting`` says: nil once ready."""
        if not self.starting:
            return None
        return Starting(pending=self.pending(), wait_s=self.wait_s)

    def timed_out(self) -> StartingError:
        """The error of a request that waited as long as it may."""
        return StartingError(
            f"the daemon is still starting ({self.pending()}); a request that needs a jail "
            f"waits at most {self.wait_s:g} s for it (limits.startup_wait_s), and this one "
            "has waited that long. Retry later, or raise limits.startup_wait_s on a slow host"
        )


__all__ = ["TRANSITIONS", "WAITING", "Phase", "Readiness", "check_waiting", "must_wait"]
