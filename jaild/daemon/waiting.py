"""The requests that wait for a starting daemon: the driver of its readiness.

A starting daemon serves at once (:mod:`jaild.daemon.core.readiness`, pure, decides what a
client is told and which requests wait); :class:`WaitingRoom` holds those that wait, in
arrival order, each with its timer: a request that would be refused anyway is refused at
once (and again whenever the start moves on: a policy whose zygote failed meanwhile), one
that waited ``limits.startup_wait_s`` gets ``starting``, and once the daemon is ready they
go on, in the order they came.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission
from jaild.daemon.core.peer import Peer
from jaild.daemon.core.readiness import Phase, Readiness, check_waiting
from jaild.errors import JaildError
from jaild.protocol.messages import Message, OpenSession, RunJob

log = logging.getLogger("jaild")


class Waiter(Protocol):
    """What the room needs of a connection (:class:`~jaild.daemon.server.ServedConnection`)."""

    @property
    def peer(self) -> Peer: ...

    @property
    def who(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def send_error(self, err: JaildError, ref: int | None = None,
                   job_id: str | None = None) -> None: ...

    def go_on(self, msg: Message) -> None: ...


@dataclass
class _Waiting:
    session: Waiter
    msg: Message
    timer: asyncio.TimerHandle | None = None  # when it has waited limits.startup_wait_s


class WaitingRoom:
    """See the module docstring. ``refused``: counts and audits a refusal (the daemon's)."""

    def __init__(self, readiness: Readiness, config: DaemonConfig,
                 catalog: Callable[[], admission.Catalog],
                 refused: Callable[..., bool]) -> None:
        self.readiness = readiness
        self._config = config
        self._catalog = catalog
        self._refused = refused
        self._waiting: list[_Waiting] = []

    def wait(self, session: Waiter, msg: Message) -> None:
        """A request that waits while the daemon starts (``must_wait``): refused at once if
        it would be refused anyway (an unknown policy, one not the peer's, one whose zygote
        failed already, a looser limit) or if too many wait already (``busy``), else held
        until the daemon is ready -- for ``limits.startup_wait_s`` at most, then answered
        ``starting``."""
        if self._refuse_early(session, msg):
            return
        config = self._config
        try:
            check_waiting(sum(w.session is session for w in self._waiting), len(self._waiting),
                          config.max_jobs_per_connection, config.max_jobs)
        except JaildError as busy:
            self._refused(session.peer, busy.code, busy.message)
            session.send_error(busy, ref=getattr(msg, "ref", None))
            return
        waiting = _Waiting(session, msg)
        waiting.timer = asyncio.get_running_loop().call_later(
            self.readiness.wait_s, self._waited, waiting)
        self._waiting.append(waiting)

    def _refuse_early(self, session: Waiter, msg: Message) -> bool:
        """Refuse a waiting job or session now if admission would (True: refused)."""
        if not isinstance(msg, (RunJob, OpenSession)):
            return False
        try:
            if isinstance(msg, RunJob):
                admission.admit_job(self._catalog(), session.peer, msg)
            else:
                admission.choose_policy(self._catalog(), session.peer, msg.policy, msg.tools)
        except JaildError as exc:
            if self._refused(session.peer, exc.code, exc.message, policy=msg.policy):
                log.info("refused %s from %s while starting: %s: %s", msg.TYPE, session.who,
                         exc.code, exc.message)
            session.send_error(exc, ref=msg.ref)
            return True
        return False

    def _waited(self, waiting: _Waiting) -> None:
        """A request waited ``limits.startup_wait_s``: it gets ``starting``."""
        with contextlib.suppress(ValueError):
            self._waiting.remove(waiting)
        readiness = self.readiness
        err = readiness.timed_out()
        if self._refused(waiting.session.peer, err.code, err.message):
            log.info("%s from %s waited %g s for the start: %s", waiting.msg.TYPE,
                     waiting.session.who, readiness.wait_s, readiness.pending())
        waiting.session.send_error(err, ref=getattr(waiting.msg, "ref", None))

    def progress(self, phase: Phase, policies: Collection[str]) -> None:
        """The start moved on: refuse now the waiting requests of a policy that can no
        longer be served (its zygote or self-test failed meanwhile)."""
        self.readiness.advance(phase, policies)
        log.debug("starting: %s", self.readiness.pending())
        for waiting in list(self._waiting):
            if waiting.session.closed or self._refuse_early(waiting.session, waiting.msg):
                self._waiting.remove(waiting)
                if waiting.timer is not None:
                    waiting.timer.cancel()

    def ready(self) -> None:
        """Ready: the requests that waited go on, in the order they came."""
        self.readiness.advance(Phase.READY)
        for each in self._take():
            each.session.go_on(each.msg)

    def failed(self) -> bool:
        """The start failed: the waiting requests are dropped (their connections are told
        why, and closed, by the daemon). False if it was not starting any more."""
        if not self.readiness.starting:
            return False
        self.readiness.advance(Phase.FAILED)
        self._take()
        return True

    def _take(self) -> list[_Waiting]:
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            if each.timer is not None:
                each.timer.cancel()
        return waiting


__all__ = ["Waiter", "WaitingRoom"]
