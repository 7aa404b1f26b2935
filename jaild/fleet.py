"""A client of several daemons: :class:`AsyncFleet`, and :class:`Fleet` for plain code.

One :class:`~jaild.client.AsyncClient` connection carries every job it submits to the one
daemon at its other end, and a plain L4 load balancer balances *connections*, not jobs. A
fleet keeps a few connections -- one per endpoint, or three to a single load-balanced
address -- and places each job on one of them::

    from jaild.fleet import Fleet, current_attempt

    def fetch(url: str) -> str:
        "Fetch a page (safe to repeat)."
        return f"page {url} (attempt {current_attempt()})"

    with Fleet(["/run/jaild/a.sock", "/run/jaild/b.sock"]) as fleet:
        r = fleet.run("await tools.fetch(url='x')", tools=[fetch], idempotent=True)
        r.status, r.result, r.node, r.attempt

Theory of operation
-------------------

**Connections.** Each connection ("slot") has a task that connects it, waits until it is
lost, and connects it again with a jittered exponential back-off
(:data:`RECONNECT_MIN_S` to :data:`RECONNECT_MAX_S`). A slot is ``up`` (connected),
``down`` (not connected; being made again) or ``closed`` (the fleet was closed).

**Placement** (:func:`choose`, pure). Among the slots that are up and have not refused this
job yet: the one with the least *load* -- the fleet's jobs in flight on it plus its open
sessions, each of which holds a jail (the daemon's ``limits.max_jobs`` counts both) -- ties
broken at random. A full scan, not power-of-two random choices: a fleet has a handful of
connections, so looking at all of them costs nothing and never picks the busier of two
when an idle one is there. A slot that answered ``Busy`` recently (its *cool-down*,
:func:`cool_down_s`, doubling with each refusal in a row from :data:`COOL_MIN_S` to
:data:`COOL_MAX_S`, cleared by the next job it accepts) is ranked after every slot that did
not, whatever its load: a draining daemon (``Busy``, "the daemon is draining") has no jobs
and would otherwise be the first choice of every job.

**Refusals.** ``Busy`` (a daemon at a capacity limit, or draining) and ``ShuttingDown`` mean
"not here, not now": the job goes to the next slot. When every slot that is up has refused
it, the job waits (:func:`retry_delay_s`: from :data:`RETRY_MIN_S`, doubling to
:data:`RETRY_MAX_S`, or until a connection comes up) and tries them all again, until
``place_timeout_s`` has passed; then the last refusal is raised (no slot up at all:
:class:`~jaild.errors.DaemonUnavailable`). Every other refusal (``BadRequest``,
``UnknownPolicy``, ``PermissionDenied``, ...) is raised at once: another daemon would say
the same.

**Node loss.** A connection lost with jobs on it fails them with
:class:`~jaild.errors.ConnectionLost`. Their outcome is unknown: each may have run in part or
whole. A job not marked ``idempotent`` then raises :class:`~jaild.errors.NodeLost` and is
never run again. An idempotent one is placed again (on a slot that is up: never the lost
connection, which is down until it is made again), up to ``max_attempts`` attempts in all;
its tool handlers see the attempt in :func:`current_attempt`. A RunJob sent on a connection
lost before the daemon accepted it counts the same way (it may have started). A session
lives on one node and never moves: its next run raises :class:`~jaild.errors.SessionLost`.

**State on nodes.** A snapshot and a parked run live on the node that made them (its daemon's
state directory), and only that node's daemon can restore or resume them. The fleet gives
their ids out as *references* that name the node -- ``ID@NODE`` (:func:`state_ref`), the
node as its daemon's ``Welcome`` names it (``access.node_name``; in a DaemonSet the
Kubernetes node) -- and sends :meth:`AsyncFleet.restore`, :meth:`AsyncFleet.resume_run`,
:meth:`AsyncFleet.approve` and :meth:`AsyncFleet.delete_snapshot` to a connection of that
node, whatever its address is now: a rolled daemon on a new address is the same node, and
a request waits up to ``place_timeout_s`` for a connection to it (a node that is gone takes
its state with it: :class:`~jaild.errors.DaemonUnavailable` names it).

**Tasks.** Everything the fleet runs by itself -- the slots' connection loops and one task
per job that follows it to its end (and places it again) -- runs in one ``TaskGroup``,
held from :meth:`AsyncFleet.connect` to :meth:`AsyncFleet.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import random
import socket
import time
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Unpack

from jaild import loops
from jaild.address import parse_address
from jaild.blocking import Portal, blocking, wrapping
from jaild.client import (
    Approver,
    AsyncClient,
    AsyncJob,
    AsyncSession,
    JobResult,
    OutputCallback,
    RunOptions,
)
from jaild.errors import (
    Busy,
    ConnectionLost,
    DaemonUnavailable,
    JaildError,
    NodeLost,
    SentAndLost,
    SessionClosed,
    SessionLost,
    ShuttingDown,
    Starting,
    UnknownJob,
    UnknownSnapshot,
)
from jaild.toolspec import HostTool, normalize_tools
from jaild.transport import Transport

log = logging.getLogger("jaild.fleet")

T = TypeVar("T")

RECONNECT_MIN_S = 0.1
"""The first wait before a lost or refused connection is made again."""
RECONNECT_MAX_S = 5.0
"""The longest wait between two tries of a connection."""
COOL_MIN_S = 0.1
"""How long a connection that answered ``Busy`` once is ranked last."""
COOL_MAX_S = 2.0
"""The longest cool-down, after many ``Busy`` answers in a row (a draining daemon)."""
RETRY_MIN_S = 0.05
"""The first wait of a job every connection refused, before it tries them all again."""
RETRY_MAX_S = 1.0
"""The longest wait between two rounds of a job's placement."""
SINGLE_ENDPOINT_CONNECTIONS = 3
"""Connections to a single (load-balanced) endpoint: its balancer spreads them."""

REFUSALS: tuple[type[JaildError], ...] = (Busy, ShuttingDown, Starting)
"""The refusals that send a job to another connection: "not here, not now" (``Starting``: a
daemon still starting past its ``limits.startup_wait_s``)."""

# ----------------------------------------------------------------------------- the attempt

_ATTEMPT: contextvars.ContextVar[int] = contextvars.ContextVar("jaild_fleet_attempt", default=1)


def current_attempt() -> int:
    """Which attempt of its job the running tool handler serves: 1, then 2, ... for an
    idempotent job placed again after its node was lost (:meth:`AsyncFleet.submit`).

    Set for the handler's call only (plain handlers in their worker thread, ``async`` ones
    in their task); outside a fleet's tool handler -- a plain client's, a session's -- 1."""
    return _ATTEMPT.get()


def for_attempt(tools: Mapping[str, HostTool], attempt: int) -> dict[str, HostTool]:
    """``tools`` whose handlers run with :func:`current_attempt` ``== attempt``.

    Only each tool's handler is replaced: its name, description and parameter schema --
    what the daemon and the jail see -- are the ones made from the original function, so
    the job's tools are the same on every attempt. The wrapper is ``async`` exactly when
    the handler is (the client runs plain handlers in worker threads), and carries the
    handler's name, docstring and signature (``functools.wraps``)."""
    return {name: dataclasses.replace(tool, handler=_with_attempt(tool, attempt))
            for name, tool in tools.items()}


def _with_attempt(tool: HostTool, attempt: int) -> Callable[..., Any]:
    handler = tool.handler
    if tool.is_async:

        @functools.wraps(handler)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            token = _ATTEMPT.set(attempt)
            try:
                return await handler(*args, **kwargs)
            finally:
                _ATTEMPT.reset(token)

        return call_async

    @functools.wraps(handler)
    def call(*args: Any, **kwargs: Any) -> Any:
        token = _ATTEMPT.set(attempt)
        try:
            return handler(*args, **kwargs)
        finally:
            _ATTEMPT.reset(token)

    return call


# ----------------------------------------------------------------------------- placement (pure)

SlotState = Literal["down", "up", "closed"]


@dataclass(eq=False)
class Slot:
    """One connection of a fleet, with what placement reads and the counters
    :meth:`AsyncFleet.stats` reports."""

    index: int
    endpoint: str
    state: SlotState = "down"
    client: AsyncClient | None = None
    """The connection while ``up``."""
    in_flight: int = 0
    """The fleet's jobs on it: submitted (accepted or not yet) and not ended."""
    sessions: set[AsyncFleetSession] = field(default_factory=set)
    placed: int = 0
    refused_busy: int = 0
    jobs_lost: int = 0
    connections_lost: int = 0
    connects: int = 0
    last_error: str = ""
    last_refused: str = ""
    refusals_in_a_row: int = 0
    cool_until: float = 0.0
    gone: asyncio.Future[None] | None = None
    """Resolved when the fleet finds the connection broken before its link closed."""
    retiring: bool = False
    """Its endpoint is no longer discovered: no new work; closed once its work has ended."""

    @property
    def node(self) -> str:
        """The node of the daemon at the other end, as its ``Welcome`` named it (its
        endpoint if it did not); "" while not connected."""
        if self.client is None:
            return ""
        return self.client.node or self.endpoint

    @property
    def load(self) -> int:
        """Jobs in flight plus sessions open: each holds a jail on the node."""
        return self.in_flight + sum(1 for s in self.sessions if s.closed is None)

    def refused(self, now: float, message: str = "") -> None:
        """It answered ``Busy`` or ``ShuttingDown``: ranked last for a while."""
        self.refused_busy += 1
        self.last_refused = message
        self.refusals_in_a_row += 1
        self.cool_until = now + cool_down_s(self.refusals_in_a_row)

    def accepted(self) -> None:
        """It took a job or a session."""
        self.placed += 1
        self.refusals_in_a_row = 0
        self.cool_until = 0.0


def cool_down_s(refusals_in_a_row: int) -> float:
    """How long a connection is ranked last after this many refusals in a row."""
    return min(COOL_MAX_S, COOL_MIN_S * 2.0 ** max(0, refusals_in_a_row - 1))


def retry_delay_s(round_index: int) -> float:
    """How long a job waits after round ``round_index`` (0, 1, ...) in which every
    connection refused it (before jitter: the fleet waits between half and all of it)."""
    return min(RETRY_MAX_S, RETRY_MIN_S * 2.0 ** round_index)


def state_ref(ident: str, node: str) -> str:
    """A snapshot's or a parked run's id as a fleet gives it out: ``ID@NODE``, naming the
    node that holds it (ids have no ``@``)."""
    return f"{ident}@{node}"


def split_ref(ref: str) -> tuple[str, str]:
    """``(id, node)`` of a reference :func:`state_ref` made.

    Raises:
        ValueError: ``ref`` names no node (a daemon's bare id, not the fleet's).
    """
    ident, at, node = ref.partition("@")
    if not at or not ident or not node:
        raise ValueError(f"{ref!r} is not a fleet's reference to state on a node: ID@NODE, "
                         "as the fleet gave it out (a daemon's bare id names no node)")
    return ident, node


def choose(slots: Iterable[Slot], refused: Collection[int], now: float,
           rng: random.Random) -> Slot | None:
    """The slot for the next try of a job: up, not in ``refused`` (indexes of slots that
    refused it this round), not cooling down if any is not, least load; ties at random.
    None: no slot is left this round."""
    candidates = [s for s in slots if s.state == "up" and not s.retiring
                  and s.index not in refused]
    if not candidates:
        return None

    def rank(slot: Slot) -> tuple[bool, int]:
        return (slot.cool_until > now, slot.load)

    best = min(rank(s) for s in candidates)
    return rng.choice([s for s in candidates if rank(s) == best])


@dataclass(frozen=True)
class ConnectionStats:
    """One connection of a fleet, as :meth:`AsyncFleet.stats` reports it."""

    index: int
    endpoint: str
    state: SlotState
    """``up`` (connected), ``down`` (being connected again) or ``closed``."""
    in_flight: int
    """The fleet's jobs on it now."""
    sessions: int
    """The fleet's sessions open on it now."""
    placed: int
    """Jobs and sessions it accepted."""
    refused_busy: int
    """``Busy`` and ``ShuttingDown`` answers (the job then went elsewhere)."""
    jobs_lost: int
    """Jobs in flight on it when it was lost (each raised ``NodeLost`` or ran again)."""
    connections_lost: int
    """Times it was lost after connecting."""
    connects: int
    """Times it connected (1 + the reconnections)."""
    last_error: str
    """Why it was last lost or could not connect; "" if never."""
    last_refused: str
    """The last refusal's message (``Busy``: which limit, or "draining"); "" if none."""


# ----------------------------------------------------------------------------- results, jobs


@dataclass(frozen=True)
class FleetResult(JobResult):
    """A :class:`~jaild.client.JobResult` and where the job ran: :attr:`node` and
    :attr:`attempt` (2 or more: an idempotent job placed again after its node was lost)."""

    node: str = ""
    """The endpoint of the connection that ran the attempt whose record this is."""
    attempt: int = 1
    """That attempt's number (1, 2, ...)."""


def _fleet_result(result: JobResult, node: str, attempt: int) -> FleetResult:
    values = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.init}
    out = FleetResult(**values, node=node, attempt=attempt)
    object.__setattr__(out, "_record", result.record)  # the typed record, already checked
    return out


class AsyncFleetJob:
    """A job started with :meth:`AsyncFleet.submit` (or a fleet session's ``submit``).

    :attr:`job_id`, :attr:`node` and :attr:`attempt` are the current attempt's: they change
    when an idempotent job is placed again."""

    def __init__(self, slot: Slot, job: AsyncJob, attempt: int, idempotent: bool,
                 session: AsyncFleetSession | None = None) -> None:
        self._slot = slot
        self._job = job
        self.attempt = attempt
        self.idempotent = idempotent
        self._session = session
        self._cancelled = False
        self._outcome: asyncio.Future[FleetResult] = asyncio.get_running_loop().create_future()

    @property
    def job_id(self) -> str:
        """The current attempt's job id (the daemon's)."""
        return self._job.job_id

    @property
    def node(self) -> str:
        """The endpoint of the current attempt's connection."""
        return self._slot.endpoint

    @property
    def ref(self) -> str:
        """The current attempt's job id with its node (``JOB_ID@NODE``): what
        :meth:`AsyncFleet.approve` and :meth:`AsyncFleet.resume_run` take, once it parks."""
        return state_ref(self._job.job_id, self._slot.node)

    @property
    def connection(self) -> int:
        """The index of the current attempt's connection (:meth:`AsyncFleet.stats`)."""
        return self._slot.index

    @property
    def done(self) -> bool:
        return self._outcome.done()

    async def result(self) -> FleetResult:
        """Wait for the job's end. Cancelling the waiting task cancels the job.

        Returns:
            Its :class:`FleetResult` (a job that runs and fails is not an exception).

        Raises:
            NodeLost: the node was lost with the job on it, and the job is not idempotent,
                or was lost on its last attempt, or could not be placed again (the cause
                attached).
            SessionLost: (a session's run) the session's node was lost.
            ConnectionLost: the fleet was closed before the job ended.
        """
        try:
            return await asyncio.shield(self._outcome)
        except asyncio.CancelledError:
            if not self._outcome.done():
                with contextlib.suppress(Exception):
                    await self.cancel()
            raise

    async def cancel(self) -> None:
        """Ask the daemon to stop the job (:meth:`result` then reports ``cancelled``); a job
        between two attempts is not placed again."""
        self._cancelled = True
        if not self._outcome.done():
            with contextlib.suppress(ConnectionLost):
                await self._job.cancel()

    def _end(self, result: FleetResult | None = None, error: BaseException | None = None) -> None:
        if self._outcome.done():
            return
        if error is not None:
            self._outcome.set_exception(error)
            self._outcome.exception()  # result() still raises; an unawaited job stays quiet
        else:
            assert result is not None
            self._outcome.set_result(result)


# ----------------------------------------------------------------------------- the fleet


class AsyncFleet:
    """An asyncio client of several jaild daemons (docs/using/fleet.md).

    ``async with AsyncFleet(endpoints) as fleet:`` connects (:meth:`connect`), keeps the
    connections up and closes them. Jobs (:meth:`submit`, :meth:`run`) and sessions
    (:meth:`session`) are placed on the connection with the least load; a ``Busy`` daemon's
    work goes elsewhere; a lost connection is made again in the background.

    Args:
        endpoints: the daemons' addresses, each as :class:`~jaild.client.AsyncClient`
            takes it (a Unix socket's path; whatever else ``AsyncClient`` accepts).
        connections: how many connections to keep: at least one per endpoint, spread over
            them in turn. Default: one per endpoint, or 3 for a single endpoint (a
            load-balanced address, whose balancer spreads connections, not jobs).
        max_attempts: the most attempts of an idempotent job whose node is lost (1: never
            placed again).
        place_timeout_s: how long a job (or session) may wait for a connection that takes
            it while every connection refuses it ``Busy`` (or none is up).
        client_factory: makes a new, unconnected ``AsyncClient`` for an endpoint (default:
            ``AsyncClient(endpoint, **client_options)``); for tests
            (:mod:`jaild.testing`'s socketpairs).
        transport: how each connection connects (:class:`~jaild.transport.Transport`), as
            ``AsyncClient(transport=...)``; its fields as keywords (``cert=``, ...) are the
            shorthand of earlier releases, kept for this one.
        **client_options: passed unchanged to every ``AsyncClient`` (``name=``,
            ``handler_threads=``, ``approve=``, and any other keyword it takes).

    Raises:
        ValueError: no endpoint, fewer connections than endpoints, ``max_attempts`` < 1.
        TypeError: both ``client_factory`` and ``client_options``.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        connections: int | None = None,
        max_attempts: int = 3,
        place_timeout_s: float = 30.0,
        client_factory: Callable[[str], AsyncClient] | None = None,
        discover: Callable[[], Sequence[str]] | None = None,
        rediscover_s: float = 30.0,
        transport: Transport | None = None,
        **client_options: Any,
    ) -> None:
        if transport is not None:  # one Transport for every connection
            client_options = {**client_options, "transport": transport}
        if isinstance(endpoints, str):
            raise TypeError("endpoints is a sequence of addresses, not one string")
        if discover is not None and connections is not None:
            raise TypeError("a fleet that discovers its endpoints keeps one connection to "
                            "each: give discover= or connections=, not both")
        if rediscover_s <= 0:
            raise ValueError(f"rediscover_s must be above 0, got {rediscover_s}")
        self._discover = discover
        self.rediscover_s = rediscover_s
        self.endpoints = tuple(endpoints)
        if not self.endpoints:
            raise ValueError("a fleet needs at least one endpoint")
        if connections is None:
            connections = (len(self.endpoints) if len(self.endpoints) > 1 or discover
                           else SINGLE_ENDPOINT_CONNECTIONS)
        if connections < len(self.endpoints):
            raise ValueError(f"connections={connections} would leave endpoints unused: "
                             f"give at least one per endpoint ({len(self.endpoints)})")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        if place_timeout_s < 0:
            raise ValueError(f"place_timeout_s must be 0 or more, got {place_timeout_s}")
        if client_factory is not None and client_options:
            raise TypeError("give client_options or a client_factory, not both "
                            f"(got {', '.join(sorted(client_options))})")
        self.max_attempts = max_attempts
        self.place_timeout_s = place_timeout_s

        def connect_to(endpoint: str) -> AsyncClient:
            return AsyncClient(endpoint, **client_options)

        if client_factory is None:  # a mistake in the options is named now, per endpoint
            for endpoint in dict.fromkeys(self.endpoints):
                try:
                    connect_to(endpoint)
                except (ValueError, TypeError, JaildError) as exc:
                    message = exc.message if isinstance(exc, JaildError) else str(exc)
                    raise ValueError(f"fleet endpoint {endpoint!r}: {message}") from None
        self._factory = client_factory or connect_to
        self._slots = [Slot(i, self.endpoints[i % len(self.endpoints)])
                       for i in range(connections)]
        self._rng = random.Random()
        self._tasks: asyncio.TaskGroup | None = None
        self._holder: asyncio.Task[None] | None = None
        self._stop: asyncio.Future[None] | None = None
        self._waker: asyncio.Future[None] | None = None
        self._closing = False
        self._rediscover: asyncio.Event | None = None

    async def __aenter__(self) -> AsyncFleet:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> None:
        """Connect every connection; return once each has tried once. Those that could not
        connect keep trying in the background.

        Raises:
            DaemonUnavailable: no connection could be made (each endpoint's error named).
        """
        if self._holder is not None:
            raise RuntimeError("this fleet is connected already")
        loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self._waker = loop.create_future()
        group: asyncio.Future[asyncio.TaskGroup] = loop.create_future()
        stop = self._stop

        async def hold() -> None:
            async with asyncio.TaskGroup() as tasks:
                group.set_result(tasks)
                await stop

        # The tasks' group is held by a task of its own, so that it outlives this call and
        # an error of the caller's is never wrapped in the group's.
        self._holder = loop.create_task(hold(), name="jaild.fleet")
        self._tasks = await group
        tried = [loop.create_future() for _ in self._slots]
        for slot, first in zip(self._slots, tried, strict=True):
            self._tasks.create_task(self._keep(slot, first), name=f"jaild.fleet:{slot.index}")
        if self._discover is not None:
            self._rediscover = asyncio.Event()
            self._tasks.create_task(self._track(self._discover), name="jaild.fleet:discover")
        await asyncio.gather(*tried)
        if not any(s.state == "up" for s in self._slots):
            error = self._unavailable("could be reached")
            await self.close()
            raise error

    async def close(self) -> None:
        """Close every connection. Jobs still in flight raise ``ConnectionLost`` (never
        ``NodeLost``: no node was lost), sessions end. Idempotent."""
        if self._holder is None or self._closing:
            if self._holder is not None:
                await asyncio.shield(self._holder)
            return
        self._closing = True
        assert self._stop is not None
        self._stop.set_result(None)
        if self._rediscover is not None:
            self._rediscover.set()  # the discovery task sees the fleet close
        self._wake()
        await asyncio.shield(self._holder)

    def stats(self) -> list[ConnectionStats]:
        """Each connection's state and counters, as now."""
        return [ConnectionStats(s.index, s.endpoint, s.state, s.in_flight, len(s.sessions),
                                s.placed, s.refused_busy, s.jobs_lost, s.connections_lost,
                                s.connects, s.last_error, s.last_refused)
                for s in self._slots]

    # ------------------------------------------------------------------ jobs

    async def submit(
        self,
        code: str,
        policy: str = "default",
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        idempotent: bool = False,
        **options: Unpack[RunOptions],
    ) -> AsyncFleetJob:
        """Place ``code`` on a connection (the least loaded one that takes it) and start it
        there; return once a daemon accepted it.

        Args:
            code: Python source; may use top-level ``await`` and the ``tools`` global.
            policy: the policy to run under (every daemon must serve it).
            tools: host tools, as ``{"name": fn}`` or ``[fn, ...]`` (plain or async).
            idempotent: the job may run more than once (in part or whole): if its node is
                lost, it is placed again, up to ``max_attempts`` in all. Its tool handlers
                see which attempt calls them (:func:`current_attempt`), and its output
                callbacks see every attempt's output.
            **options: the run's options: :class:`~jaild.client.RunOptions`.

        Returns:
            An :class:`AsyncFleetJob`.

        Raises:
            Busy, ShuttingDown: every connection refused it for ``place_timeout_s``.
            DaemonUnavailable: no connection was up for ``place_timeout_s``.
            NodeLost: the connection was lost after the job was sent and before it was
                accepted, and it is not idempotent (or out of attempts).
            JaildError: any other refusal (``UnknownPolicy``, ``BadRequest``,
                ``PermissionDenied``, ...), at once.
            ConnectionLost: the fleet is not connected, or was closed meanwhile.
            TypeError, ValueError: a bad tool or option, or an upload that cannot be read
                (nothing was sent).
        """
        host_tools = normalize_tools(tools)
        download = options.get("download")
        if download is not None and not isinstance(download, bool):
            options = {**options, "download": tuple(download)}  # an iterator, read once
        attempt = 1
        while True:
            try:
                slot, job = await self._place_job(code, policy, host_tools, options, attempt)
            except SentAndLost as lost:  # it may have started
                error = self._lost_job(lost.error, attempt, idempotent, lost.endpoint, None)
                if error is not None:
                    raise error from lost.error
                attempt += 1
                continue
            break
        fleet_job = AsyncFleetJob(slot, job, attempt, idempotent)
        tasks = self._connected()
        tasks.create_task(self._follow(fleet_job, code, policy, host_tools, options),
                          name=f"jaild.fleet:{job.job_id}")
        return fleet_job

    async def run(
        self,
        code: str,
        policy: str = "default",
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        idempotent: bool = False,
        **options: Unpack[RunOptions],
    ) -> FleetResult:
        """:meth:`submit`, then :meth:`AsyncFleetJob.result`: the job's record, its
        :attr:`~FleetResult.node` and :attr:`~FleetResult.attempt`. Cancelling the awaiting
        task cancels the job. Raises what those two raise."""
        job = await self.submit(code, policy, tools, idempotent=idempotent, **options)
        return await job.result()

    def session(
        self,
        policy: str = "default",
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        limits: Mapping[str, float] | None = None,
        idle_s: float | None = None,
        max_lifetime_s: float | None = None,
        approve: Approver | None = None,
    ) -> AsyncFleetSession:
        """A session placed on one connection when it opens (``async with`` or ``open()``),
        and kept there: the arguments of :meth:`AsyncClient.session
        <jaild.client.AsyncClient.session>`. If that node is lost, the session is lost
        with it (:class:`~jaild.errors.SessionLost`); it never moves."""
        return AsyncFleetSession(self, policy, normalize_tools(tools), dict(limits or {}),
                                 idle_s, max_lifetime_s, approve)

    # ------------------------------------------------------------------ state on nodes

    def restore(
        self,
        snapshot_ref: str,
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        policy: str | None = None,
        limits: Mapping[str, float] | None = None,
        idle_s: float | None = None,
        max_lifetime_s: float | None = None,
        approve: Approver | None = None,
    ) -> AsyncFleetSession:
        """A session whose state is the snapshot's (:meth:`AsyncClient.restore
        <jaild.client.AsyncClient.restore>`), opened on the node that holds it
        (``snapshot_ref``: ``SNAPSHOT_ID@NODE``, as :meth:`AsyncFleetSession.snapshot` and
        :meth:`snapshots` give it). Not yet open: ``async with fleet.restore(ref) as s``.

        Raises:
            ValueError: ``snapshot_ref`` names no node (at once).
            On opening: UnknownSnapshot; DaemonUnavailable (no connection to its node
                within ``place_timeout_s``).
        """
        ident, node = split_ref(snapshot_ref)
        return AsyncFleetSession(self, policy or "", normalize_tools(tools),
                                 dict(limits or {}), idle_s, max_lifetime_s, approve,
                                 restore=(ident, node), pinned_policy=policy)

    async def snapshots(self) -> list[dict[str, Any]]:
        """The caller's snapshots on every node the fleet is connected to: each entry as
        :meth:`AsyncClient.snapshots <jaild.client.AsyncClient.snapshots>` gives it, its
        ``id`` a reference (``SNAPSHOT_ID@NODE``) and its ``node`` named."""
        entries: dict[str, dict[str, Any]] = {}
        for slot in self._one_per_endpoint():
            assert slot.client is not None
            node = slot.node
            for entry in await slot.client.snapshots():
                ref = state_ref(entry["id"], node)
                entries[ref] = {**entry, "id": ref, "node": node}
        return list(entries.values())

    async def delete_snapshot(self, snapshot_ref: str) -> None:
        """Delete a snapshot on its node (UnknownSnapshot: none of the caller's there)."""
        ident, node = split_ref(snapshot_ref)
        await self._on_node(node, f"snapshot {ident}",
                            lambda client: client.delete_snapshot(ident))

    async def approvals(self) -> list[dict[str, Any]]:
        """The tool calls waiting for the caller's approval on every node the fleet is
        connected to: as :meth:`AsyncClient.approvals
        <jaild.client.AsyncClient.approvals>`, each ``job_id`` a reference
        (``JOB_ID@NODE``) and its ``node`` named."""
        found: dict[tuple[str, int], dict[str, Any]] = {}
        for slot in self._one_per_endpoint():
            assert slot.client is not None
            node = slot.node
            for entry in await slot.client.approvals():
                ref = state_ref(entry["job_id"], node)
                found[(ref, entry["call_id"])] = {**entry, "job_id": ref, "node": node}
        return list(found.values())

    async def approve(self, job_ref: str, call_id: int, allow: bool = True,
                      reason: str = "") -> None:
        """Decide a call waiting for approval, on its run's node (``job_ref``: ``JOB_ID@NODE``,
        as :meth:`approvals` and :attr:`AsyncFleetJob.ref` give it).

        Raises:
            ValueError: ``job_ref`` names no node. UnknownJob, PermissionDenied: as
                :meth:`AsyncClient.approve <jaild.client.AsyncClient.approve>`.
                DaemonUnavailable: no connection to its node within ``place_timeout_s``.
        """
        ident, node = split_ref(job_ref)
        await self._on_node(node, f"job {ident}",
                            lambda client: client.approve(ident, call_id, allow, reason))

    async def resume_run(
        self,
        job_ref: str,
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        approve: Approver | None = None,
    ) -> AsyncFleetJob:
        """Host the tools of a parked run on its node (:meth:`AsyncClient.resume_run
        <jaild.client.AsyncClient.resume_run>`; ``job_ref``: ``JOB_ID@NODE``). The run is
        never placed again: if its node is lost, it raises ``NodeLost``.

        Raises:
            ValueError: ``job_ref`` names no node. UnknownJob, BadRequest: as
                ``AsyncClient.resume_run``. DaemonUnavailable: no connection to its node
                within ``place_timeout_s``.
        """
        ident, node = split_ref(job_ref)
        host_tools = normalize_tools(tools)
        slot, job = await self._on_node(
            node, f"parked run {ident}",
            lambda client: client.resume_run(ident, host_tools, on_stdout=on_stdout,
                                             on_stderr=on_stderr, approve=approve))
        slot.in_flight += 1
        fleet_job = AsyncFleetJob(slot, job, 1, False)
        self._connected().create_task(self._follow(fleet_job, "", "", host_tools, {}),
                                      name=f"jaild.fleet:{ident}")
        return fleet_job

    # ------------------------------------------------------------------ internals

    def _one_per_endpoint(self) -> list[Slot]:
        """A slot that is up for each endpoint (several connections to one daemon list its
        state once)."""
        self._connected()
        slots: dict[str, Slot] = {}
        for slot in self._slots:
            if slot.state == "up" and slot.client is not None and slot.client.lost is None:
                slots.setdefault(slot.endpoint, slot)
        return list(slots.values())

    async def _on_node(self, node: str, what: str,
                       send: Callable[[AsyncClient], Awaitable[T]]) -> tuple[Slot, T]:
        """``send`` on a connection to ``node``, waiting up to ``place_timeout_s`` for one to
        be up (a node whose daemon restarts, or moved to a new address the fleet has yet to
        discover). Where two endpoints name one node (daemons on one host that name none),
        each is tried while it answers that ``what`` is not its."""
        deadline = time.monotonic() + self.place_timeout_s
        while True:
            candidates = [s for s in self._one_per_endpoint()
                          if s.node == node and not s.retiring]
            if candidates:
                break
            now = time.monotonic()
            if now >= deadline:
                seen = ", ".join(sorted({s.node for s in self._one_per_endpoint()})) or "none"
                raise DaemonUnavailable(
                    f"node {node}, which holds {what}, has no connection of the fleet up "
                    f"within {self.place_timeout_s:g} s (nodes connected: {seen}); state on a "
                    "node lost is lost with it")
            await self._pause(min(0.25, deadline - now))
        last: JaildError | None = None
        for slot in candidates:
            assert slot.client is not None
            try:
                return slot, await send(slot.client)
            except (UnknownSnapshot, UnknownJob) as exc:
                last = exc
        assert last is not None
        raise last

    def _connected(self) -> asyncio.TaskGroup:
        if self._tasks is None or self._closing:
            raise ConnectionLost("the fleet is not connected; use 'async with' or connect()"
                                 if self._tasks is None else "the fleet was closed")
        return self._tasks

    async def _place_job(self, code: str, policy: str, tools: dict[str, HostTool],
                         options: RunOptions, attempt: int) -> tuple[Slot, AsyncJob]:
        async def send(client: AsyncClient) -> AsyncJob:
            return await client.submit(code, policy, for_attempt(tools, attempt), **options)

        slot, job = await self._place(send, side_effects=True)
        return slot, job

    async def _place(self, send: Callable[[AsyncClient], Awaitable[T]], *,
                     side_effects: bool) -> tuple[Slot, T]:
        """``send`` on the slot :func:`choose` picks, the next one if it refuses, rounds
        again after a wait if all did, until ``place_timeout_s``. The slot's ``in_flight``
        counts the try, and stays counted if it was accepted.

        A connection lost during ``send``: with ``side_effects`` (a job, which may have
        started) :class:`SentAndLost`; without (a session, gone with its node) the next
        slot is tried."""
        deadline = time.monotonic() + self.place_timeout_s
        refused: set[int] = set()
        last: JaildError | None = None
        rounds = 0
        while True:
            self._connected()
            now = time.monotonic()
            slot = choose(self._slots, refused, now, self._rng)
            if slot is None:
                if now >= deadline:
                    raise last or self._unavailable(f"was up within {self.place_timeout_s:g} s")
                delay = retry_delay_s(rounds) * self._rng.uniform(0.5, 1.0)
                rounds += 1
                refused.clear()
                await self._pause(min(delay, deadline - now))
                continue
            assert slot.client is not None
            if slot.client.lost is not None:  # lost, and its task has not seen it yet
                self._down(slot)
                continue
            slot.in_flight += 1
            try:
                value = await send(slot.client)
            except REFUSALS as exc:
                slot.in_flight -= 1
                slot.refused(time.monotonic(), f"{exc.code}: {exc.message}")
                refused.add(slot.index)
                last = exc
                log.debug("connection %d (%s) refused: %s", slot.index, slot.endpoint, exc)
                continue
            except ConnectionLost as exc:
                slot.in_flight -= 1
                self._down(slot)
                if self._closing:
                    raise ConnectionLost("the fleet was closed") from exc
                if side_effects and exc.reason != "not_sent":
                    slot.jobs_lost += 1
                    raise SentAndLost(exc, slot.endpoint) from exc
                continue
            except BaseException:
                slot.in_flight -= 1
                raise
            slot.accepted()
            return slot, value

    def _lost_job(self, exc: ConnectionLost, attempt: int, idempotent: bool, node: str,
                  job: AsyncFleetJob | None) -> JaildError | None:
        """A job's connection was lost: the error it ends with, or None to place it again."""
        if self._closing:
            return ConnectionLost("the fleet was closed before the job ended")
        reason = getattr(exc, "reason", "closed")
        what = f"job {job.job_id}" if job is not None else "the job"
        if not idempotent:
            return NodeLost(f"node {node} was lost with {what} on it ({exc.message}): its "
                            "outcome is unknown -- it may have run, in part or whole; it is "
                            "not run again (submit it with idempotent=True to have it run "
                            "again)", reason, node)
        if attempt >= self.max_attempts or (job is not None and job._cancelled):
            return NodeLost(f"node {node} was lost with {what} on it ({exc.message}), on "
                            f"attempt {attempt} of {self.max_attempts}: its outcome is unknown",
                            reason, node)
        return None

    async def _follow(self, job: AsyncFleetJob, code: str, policy: str,
                      tools: dict[str, HostTool], options: RunOptions) -> None:
        """Follow ``job`` to its end, placing it again after a node's loss if it may."""
        while True:
            slot = job._slot
            try:
                result = await job._job.result()
            except ConnectionLost as exc:
                slot.in_flight -= 1
                slot.jobs_lost += 1
                if self._closing:
                    job._end(error=ConnectionLost("the fleet was closed before the job ended"))
                    return
                if job._session is not None:
                    job._end(error=job._session._lost_error(exc))
                    return
                error = self._lost_job(exc, job.attempt, job.idempotent, slot.endpoint, job)
                if error is not None:
                    job._end(error=error)
                    return
                log.info("job %s lost with %s (%s); placing attempt %d", job.job_id,
                         slot.endpoint, exc.message, job.attempt + 1)
                try:
                    await self._again(job, code, policy, tools, options, exc)
                except Exception as placing:
                    job._end(error=placing)
                    return
                continue
            except Exception as exc:
                slot.in_flight -= 1
                job._end(error=exc)
                return
            except BaseException:
                slot.in_flight -= 1
                job._end(error=ConnectionLost("the fleet was closed before the job ended"))
                raise
            slot.in_flight -= 1
            job._end(_fleet_result(result, slot.endpoint, job.attempt))
            return

    async def _again(self, job: AsyncFleetJob, code: str, policy: str,
                     tools: dict[str, HostTool], options: RunOptions,
                     lost: ConnectionLost) -> None:
        """Place the next attempt of an idempotent ``job`` (and the ones after it, if its
        RunJob is lost before it is accepted). Raises the job's end: ``NodeLost``, with
        what kept it from being placed as the cause."""
        while True:
            attempt = job.attempt + 1
            try:
                slot, inner = await self._place_job(code, policy, tools, options, attempt)
            except SentAndLost as again:  # that attempt's node was lost too
                job.attempt = attempt
                error = self._lost_job(again.error, attempt, True, again.endpoint, job)
                if error is not None:
                    raise error from again.error
                continue
            except ConnectionLost:  # the fleet was closed
                raise
            except JaildError as exc:
                raise NodeLost(
                    f"node {job.node} was lost with job {job.job_id} on it ({lost.message}), "
                    f"and attempt {attempt} could not be placed: {exc.code}: {exc.message}",
                    getattr(lost, "reason", "closed"), job.node) from exc
            job._slot, job._job, job.attempt = slot, inner, attempt
            if job._cancelled:
                with contextlib.suppress(ConnectionLost):
                    await inner.cancel()
            return

    def _unavailable(self, what: str) -> DaemonUnavailable:
        errors = "; ".join(f"{s.endpoint}: {s.last_error or 'not connected yet'}"
                           for s in self._slots)
        return DaemonUnavailable(f"no connection of the fleet {what} ({errors})")

    def _wake(self) -> None:
        """Wake the jobs waiting for a connection (one came up, or the fleet closes)."""
        waker = self._waker
        if waker is not None and not waker.done():
            waker.set_result(None)
        if not self._closing:
            self._waker = asyncio.get_running_loop().create_future()

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less if a connection comes up or the fleet closes."""
        assert self._waker is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await asyncio.shield(self._waker)

    def _down(self, slot: Slot) -> None:
        """The fleet found ``slot``'s connection broken: its task makes it again."""
        slot.state = "down"
        if slot.gone is not None and not slot.gone.done():
            slot.gone.set_result(None)

    async def _keep(self, slot: Slot, tried: asyncio.Future[None]) -> None:
        """Keep ``slot`` connected until the fleet closes (``tried``: set after its first
        try, whatever came of it)."""
        assert self._stop is not None
        delay = RECONNECT_MIN_S
        try:
            while not self._closing and not slot.retiring:
                try:
                    client = self._factory(slot.endpoint)
                except Exception as exc:  # the factory's own mistake: no retry will mend it
                    slot.last_error = str(exc) or type(exc).__name__
                    log.warning("connection %d (%s): %s", slot.index, slot.endpoint,
                                slot.last_error)
                    break
                try:
                    if not await self._connect(client):
                        break  # the fleet closes
                except Exception as exc:  # refused, nobody there, a transport error
                    slot.last_error = str(exc) or type(exc).__name__
                    log.debug("connection %d (%s): %s", slot.index, slot.endpoint,
                              slot.last_error)
                    if not tried.done():
                        tried.set_result(None)
                    await self._sleep(delay * self._rng.uniform(0.5, 1.0))
                    delay = min(RECONNECT_MAX_S, delay * 2)
                    continue
                delay = RECONNECT_MIN_S
                slot.client, slot.state = client, "up"
                slot.gone = asyncio.get_running_loop().create_future()
                slot.connects += 1
                if slot.connects > 1:
                    log.info("connection %d (%s) made again", slot.index, slot.endpoint)
                if not tried.done():
                    tried.set_result(None)
                self._wake()
                await self._until_lost(slot, client)
                slot.state = "down"
                if self._closing or slot.retiring:
                    await client.close()
                    break
                why = client.lost or ConnectionLost("the connection was closed")
                slot.connections_lost += 1
                slot.last_error = why.message
                log.info("connection %d (%s) lost: %s", slot.index, slot.endpoint, why.message)
                if self._rediscover is not None:  # a node gone may be a node moved: look now
                    self._rediscover.set()
                for session in list(slot.sessions):
                    session._node_lost(why)
                await client.close()
                await self._sleep(delay * self._rng.uniform(0.5, 1.0))
        finally:
            slot.state = "closed"
            slot.client = None
            if not tried.done():
                tried.set_result(None)

    async def _track(self, discover: Callable[[], Sequence[str]]) -> None:
        """Every ``rediscover_s``, and at once when a connection is lost, ask ``discover``
        for the endpoints (in a thread: it may resolve names): connect to each new one, and
        retire each one gone -- no new work goes there, its jobs and sessions end where they
        are (none is run again because of it), then its connection closes."""
        assert self._rediscover is not None and self._tasks is not None
        loop = asyncio.get_running_loop()
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.rediscover_s):
                    await self._rediscover.wait()
            self._rediscover.clear()
            if self._closing:
                break
            try:
                found = list(dict.fromkeys(await asyncio.to_thread(discover)))
            except Exception as exc:  # a name that does not resolve now: keep what we have
                log.warning("fleet discovery failed, the endpoints stay as they were: %s",
                            exc)
                continue
            if not found:
                log.warning("fleet discovery found no endpoint; the endpoints stay as they were")
                continue
            current = {s.endpoint: s for s in self._slots
                       if not s.retiring and s.state != "closed"}
            for endpoint in found:
                if endpoint not in current:
                    slot = Slot(len(self._slots), endpoint)
                    self._slots.append(slot)
                    log.info("fleet: endpoint %s discovered", endpoint)
                    self._tasks.create_task(self._keep(slot, loop.create_future()),
                                            name=f"jaild.fleet:{slot.index}")
            for endpoint, slot in current.items():
                if endpoint not in found:
                    slot.retiring = True
                    log.info("fleet: endpoint %s gone from discovery: retired once its %d "
                             "jobs and sessions end", endpoint, slot.load)
                    self._tasks.create_task(self._retire(slot),
                                            name=f"jaild.fleet:{slot.index}:retire")
            self._endpoints_now()

    async def _retire(self, slot: Slot) -> None:
        """Close a retiring connection once nothing of the fleet's runs on it."""
        while slot.load and not self._closing and slot.state == "up":
            await self._sleep(0.05)
        if slot.gone is not None and not slot.gone.done():
            slot.gone.set_result(None)  # its _keep closes it and stops
        self._wake()

    def _endpoints_now(self) -> None:
        self.endpoints = tuple(dict.fromkeys(s.endpoint for s in self._slots
                                             if not s.retiring))

    async def _connect(self, client: AsyncClient) -> bool:
        """Connect ``client``, unless the fleet closes first (False; then it is closed)."""
        assert self._stop is not None
        connecting = asyncio.ensure_future(client.connect())
        try:
            await asyncio.wait({connecting, self._stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not connecting.done():  # the fleet closes (or this task is cancelled)
                connecting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await connecting
                await client.close()
        if connecting.cancelled():
            return False
        connecting.result()  # raises what connecting raised
        if self._closing:
            await client.close()
            return False
        return True

    async def _until_lost(self, slot: Slot, client: AsyncClient) -> None:
        assert self._stop is not None and slot.gone is not None
        closed = asyncio.ensure_future(client.wait_closed())
        try:
            await asyncio.wait({closed, slot.gone, self._stop},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closed

    async def _sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or until the fleet closes."""
        assert self._stop is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await asyncio.shield(self._stop)


# ----------------------------------------------------------------------------- sessions


class AsyncFleetSession:
    """A session of a fleet (:meth:`AsyncFleet.session`): placed when it opens, on one
    connection, and kept there. It wraps that connection's
    :class:`~jaild.client.AsyncSession`; when the connection is lost, its runs raise
    :class:`~jaild.errors.SessionLost` (the session, its jail and its state are gone)."""

    def __init__(self, fleet: AsyncFleet, policy: str, tools: dict[str, HostTool],
                 limits: dict[str, float], idle_s: float | None,
                 max_lifetime_s: float | None, approve: Approver | None, *,
                 restore: tuple[str, str] | None = None,
                 pinned_policy: str | None = None) -> None:
        self._fleet = fleet
        self._restore = restore  # (snapshot id, node): opened there, from it
        self._pinned_policy = pinned_policy
        self.policy = policy
        self._tools = tools
        self._limits = limits
        self._idle_s = idle_s
        self._max_lifetime_s = max_lifetime_s
        self._approve = approve
        self._slot: Slot | None = None
        self._session: AsyncSession | None = None
        self._lost: ConnectionLost | None = None

    @property
    def node(self) -> str:
        """The endpoint of the session's connection ("" before it opens)."""
        return self._slot.endpoint if self._slot is not None else ""

    @property
    def id(self) -> str | None:
        return self._session.id if self._session is not None else None

    @property
    def closed(self) -> str | None:
        """Why the session ended (as :attr:`AsyncSession.closed
        <jaild.client.AsyncSession.closed>`; ``lost`` when its node was lost), or None."""
        if self._lost is not None:
            return "lost"
        return self._session.closed if self._session is not None else None

    @property
    def info(self) -> dict[str, Any]:
        return self._session.info if self._session is not None else {}

    async def open(self) -> AsyncFleetSession:
        """Place the session (as a job is placed: ``Busy`` goes elsewhere) and open it;
        return once its jail is ready.

        Raises:
            Busy, ShuttingDown, DaemonUnavailable: as :meth:`AsyncFleet.submit`.
            JaildError: any other refusal, at once.
        """
        if self._session is not None:
            raise RuntimeError("this session was opened already")

        if self._restore is not None:
            ident, node = self._restore

            async def restore_on(client: AsyncClient) -> AsyncSession:
                session = client.restore(ident, self._tools, policy=self._pinned_policy,
                                         limits=self._limits, idle_s=self._idle_s,
                                         max_lifetime_s=self._max_lifetime_s,
                                         approve=self._approve)
                return await session.open()

            slot, session = await self._fleet._on_node(node, f"snapshot {ident}", restore_on)
            self.policy = session.policy or self.policy
        else:
            async def open_on(client: AsyncClient) -> AsyncSession:
                session = client.session(self.policy, self._tools, limits=self._limits,
                                         idle_s=self._idle_s,
                                         max_lifetime_s=self._max_lifetime_s,
                                         approve=self._approve)
                return await session.open()

            slot, session = await self._fleet._place(open_on, side_effects=False)
            slot.in_flight -= 1  # a session counts as one of the slot's sessions instead
        self._slot, self._session = slot, session
        slot.sessions.add(self)
        return self

    async def __aenter__(self) -> AsyncFleetSession:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self, code: str, **options: Unpack[RunOptions]) -> JobResult:
        """Run ``code`` in the session's jail (:meth:`AsyncSession.run
        <jaild.client.AsyncSession.run>`).

        Raises:
            SessionLost: the session's node was lost (before or during the run).
            SessionClosed, JaildError: as ``AsyncSession.run``.
        """
        session = self._open()
        try:
            result = await session.run(code, **options)
        except (ConnectionLost, SessionClosed) as exc:
            raise self._translated(exc) from exc
        if session.closed is not None:
            self._forget()
        return result

    async def submit(self, code: str, **options: Unpack[RunOptions]) -> AsyncFleetJob:
        """Start a run in the session's jail; its ``result()`` raises ``SessionLost`` if the
        node is lost meanwhile (see :meth:`AsyncSession.submit
        <jaild.client.AsyncSession.submit>`)."""
        session = self._open()
        assert self._slot is not None
        try:
            job = await session.submit(code, **options)
        except (ConnectionLost, SessionClosed) as exc:
            raise self._translated(exc) from exc
        self._slot.in_flight += 1
        fleet_job = AsyncFleetJob(self._slot, job, 1, False, self)
        self._fleet._connected().create_task(
            self._fleet._follow(fleet_job, code, self.policy, {}, options),
            name=f"jaild.fleet:{job.job_id}")
        return fleet_job

    async def snapshot(self, ttl_s: float | None = None) -> dict[str, Any]:
        """Snapshot the session's state on its node (:meth:`AsyncSession.snapshot
        <jaild.client.AsyncSession.snapshot>`): the entry, its ``id`` a reference
        (``SNAPSHOT_ID@NODE``) that :meth:`AsyncFleet.restore` takes, its ``node`` named.

        Raises:
            SessionLost: the session's node was lost. JaildError: as ``AsyncSession.snapshot``.
        """
        session = self._open()
        assert self._slot is not None
        try:
            entry = await session.snapshot(ttl_s)
        except (ConnectionLost, SessionClosed) as exc:
            raise self._translated(exc) from exc
        node = self._slot.node
        return {**entry, "id": state_ref(entry["id"], node), "node": node}

    async def upload(self, files: Any) -> JobResult:
        """Put files into the working directory (see ``AsyncSession.upload``)."""
        return await self.run("", files=files)

    async def download(self, *patterns: str) -> dict[str, bytes]:
        """The contents of files in the working directory (see ``AsyncSession.download``)."""
        result = await self.run("", download=patterns or ("*",))
        return result.downloads

    async def close(self) -> None:
        """End the session (its jail is killed). Idempotent; a lost session is gone already."""
        self._forget()
        if self._session is not None and self._lost is None:
            await self._session.close()

    def _open(self) -> AsyncSession:
        if self._lost is not None:
            raise self._lost_error(self._lost)
        if self._session is None:
            raise SessionClosed("the session is not open; use 'async with' or open()")
        return self._session

    def _forget(self) -> None:
        if self._slot is not None:
            self._slot.sessions.discard(self)

    def _node_lost(self, why: JaildError) -> None:
        """Its connection was lost (the fleet's connection task says so)."""
        self._lost = why if isinstance(why, ConnectionLost) else ConnectionLost(why.message)
        self._forget()

    def _lost_error(self, exc: ConnectionLost) -> SessionLost:
        if isinstance(exc, SessionLost):
            exc.node = exc.node or self.node
            return exc
        return SessionLost(f"session {self.id} on node {self.node} was lost with its "
                           f"connection ({exc.message}): its jail and its state are gone",
                           getattr(exc, "reason", "closed"), self.node)

    def _translated(self, exc: JaildError) -> JaildError:
        """What a run's error means for a fleet's session: a lost connection (the
        client's ``SessionClosed`` "disconnected" says so too) is ``SessionLost``."""
        if self._fleet._closing:
            return exc
        if isinstance(exc, ConnectionLost):
            self._node_lost(exc)
            return self._lost_error(exc)
        if isinstance(exc, SessionClosed) and (exc.reason == "disconnected"
                                               or self._lost is not None):
            lost = self._lost or ConnectionLost(exc.message)
            self._node_lost(lost)
            return self._lost_error(lost)
        return exc


# ----------------------------------------------------------------------------- blocking


BLOCKING = {"AsyncFleetJob": "FleetJob", "AsyncFleetSession": "FleetSession",
            "AsyncFleet": "Fleet", "AsyncJob": "FleetJob", "async with": "with",
            "await ": "", "awaiting task is cancelled":
            "caller is interrupted (``KeyboardInterrupt``)"}
"""How an asyncio docstring reads for the blocking class (:func:`jaild.blocking.blocking`)."""


class Fleet:
    """A blocking fleet: the same API as :class:`AsyncFleet`, without ``await``.

    Runs an :class:`AsyncFleet` on a private event-loop thread (``event_loop``: see
    :mod:`jaild.loops`), as :class:`~jaild.client.Client` runs an ``AsyncClient`` (both
    are :mod:`jaild.blocking` facades); it connects in its constructor. Output callbacks
    are called from that thread; plain tool handlers from worker threads.

    Args: as :class:`AsyncFleet`, and ``event_loop``.

    Raises:
        DaemonUnavailable: no connection could be made.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        connections: int | None = None,
        max_attempts: int = 3,
        place_timeout_s: float = 30.0,
        event_loop: str = loops.DEFAULT,
        client_factory: Callable[[str], AsyncClient] | None = None,
        transport: Transport | None = None,
        **client_options: Any,
    ) -> None:
        self._fleet = AsyncFleet(endpoints, connections=connections, max_attempts=max_attempts,
                                 place_timeout_s=place_timeout_s, client_factory=client_factory,
                                 transport=transport, **client_options)
        self._portal = Portal(event_loop, "jaild-fleet")
        try:
            self._call(self._fleet.connect())
        except BaseException:
            self._portal.close()
            raise

    @property
    def _async(self) -> AsyncFleet:
        return self._fleet

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the fleet's thread and wait for it (:meth:`Portal.call`)."""
        return self._portal.call(coro)

    submit = blocking(AsyncFleet.submit, wrap=lambda f, job: FleetJob(f, job),
                      returns="FleetJob", renames=BLOCKING)
    run = blocking(AsyncFleet.run, renames=BLOCKING)
    session = wrapping(AsyncFleet.session, lambda f, s: FleetSession(f, s),
                       returns="FleetSession", renames=BLOCKING)
    restore = wrapping(AsyncFleet.restore, lambda f, s: FleetSession(f, s),
                       returns="FleetSession", renames=BLOCKING)
    snapshots = blocking(AsyncFleet.snapshots, renames=BLOCKING)
    delete_snapshot = blocking(AsyncFleet.delete_snapshot, renames=BLOCKING)
    approvals = blocking(AsyncFleet.approvals, renames=BLOCKING)
    approve = blocking(AsyncFleet.approve, renames=BLOCKING)
    resume_run = blocking(AsyncFleet.resume_run, wrap=lambda f, job: FleetJob(f, job),
                          returns="FleetJob", renames=BLOCKING)

    def stats(self) -> list[ConnectionStats]:
        """See :meth:`AsyncFleet.stats` (read on the fleet's thread)."""

        async def snapshot() -> list[ConnectionStats]:
            return self._fleet.stats()

        return self._call(snapshot())

    def close(self) -> None:
        """Close every connection and stop the fleet's thread. Idempotent."""
        if self._portal.closed:
            return
        with contextlib.suppress(Exception):
            self._call(self._fleet.close())
        self._portal.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FleetJob:
    """A job started with :meth:`Fleet.submit` (see :class:`AsyncFleetJob`)."""

    def __init__(self, fleet: Fleet, job: AsyncFleetJob) -> None:
        self._fleet = fleet
        self._job = job

    @property
    def _async(self) -> AsyncFleetJob:
        return self._job

    @property
    def _portal(self) -> Portal:
        return self._fleet._portal

    @property
    def job_id(self) -> str:
        return self._job.job_id

    @property
    def node(self) -> str:
        return self._job.node

    @property
    def ref(self) -> str:
        """See :attr:`AsyncFleetJob.ref`."""
        return self._job.ref

    @property
    def attempt(self) -> int:
        return self._job.attempt

    @property
    def connection(self) -> int:
        return self._job.connection

    @property
    def done(self) -> bool:
        return self._job.done

    def result(self, timeout: float | None = None) -> FleetResult:
        """Wait for the job (``timeout`` seconds at most: TimeoutError, the job keeps
        running). Raises what :meth:`AsyncFleetJob.result` raises."""
        return self._portal.wait(self._job.result(), timeout)

    cancel = blocking(AsyncFleetJob.cancel, renames=BLOCKING)


class FleetSession:
    """A session of the blocking :class:`Fleet` (see :class:`AsyncFleetSession`)."""

    def __init__(self, fleet: Fleet, session: AsyncFleetSession) -> None:
        self._fleet = fleet
        self._session = session

    @property
    def _async(self) -> AsyncFleetSession:
        return self._session

    @property
    def _portal(self) -> Portal:
        return self._fleet._portal

    @property
    def node(self) -> str:
        return self._session.node

    @property
    def id(self) -> str | None:
        return self._session.id

    @property
    def closed(self) -> str | None:
        return self._session.closed

    @property
    def info(self) -> dict[str, Any]:
        return self._session.info

    open = blocking(AsyncFleetSession.open, wrap=lambda s, _: s, returns="FleetSession",
                    renames=BLOCKING)

    def __enter__(self) -> FleetSession:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    run = blocking(AsyncFleetSession.run, renames=BLOCKING)
    submit = blocking(AsyncFleetSession.submit, wrap=lambda s, job: FleetJob(s._fleet, job),
                      returns="FleetJob", renames=BLOCKING)
    snapshot = blocking(AsyncFleetSession.snapshot, renames=BLOCKING)
    upload = blocking(AsyncFleetSession.upload, renames=BLOCKING)
    download = blocking(AsyncFleetSession.download, renames=BLOCKING)

    def close(self) -> None:
        """End the session (its jail is killed). Idempotent."""
        if not self._portal.closed:
            self._portal.call(self._session.close())


def endpoints_of(address: str) -> list[str]:
    """Every endpoint a ``tls://NAME:PORT`` address names: one ``tls://IP:PORT`` per address
    ``NAME`` resolves to -- a Kubernetes *headless* Service's name resolves to each ready
    daemon pod's -- in the resolver's order, without repeats. Resolved when called: give it
    to a fleet as ``discover=lambda: endpoints_of(address)`` too, and the fleet follows the
    pods that come and go. Pass ``server_name=NAME`` to the fleet, so each daemon's
    certificate is checked for the Service's name rather than for a pod's address. Any
    other address is returned as it is.

    Raises:
        DaemonUnavailable: the name does not resolve.
    """
    kind, host, port = parse_address(address)
    if kind != "tls":
        return [address]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DaemonUnavailable(f"{address}: {host} does not resolve ({exc.strerror})") from None
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        endpoint = f"tls://[{ip}]:{port}" if family == socket.AF_INET6 else f"tls://{ip}:{port}"
        if endpoint not in out:
            out.append(endpoint)
    return out


__all__ = [
    "AsyncFleet",
    "AsyncFleetJob",
    "AsyncFleetSession",
    "ConnectionStats",
    "Fleet",
    "FleetJob",
    "FleetResult",
    "FleetSession",
    "Slot",
    "choose",
    "cool_down_s",
    "current_attempt",
    "endpoints_of",
    "for_attempt",
    "retry_delay_s",
]
