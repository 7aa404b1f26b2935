"""Run one job in one jail: the asyncio driver of the job's machine.

Theory of operation
-------------------
Three parts make a job, and this module wires them together:

* the :class:`~jaild.daemon.core.machine.JobMachine` decides everything -- the jail link's
  protocol, the tool broker's rules, the output limit, the timers' meaning, when the
  jail's end is complete and how the job ended (:mod:`jaild.daemon.core.classify`). It does
  no IO;
* a :class:`~jaild.daemon.jails.launch.handle.JailHandle`, filled by a launcher -- nsjail per
  job (:mod:`jaild.daemon.jails.launch.spawned`) or the policy's zygote
  (:class:`~jaild.daemon.jails.launch.forked.ZygoteLauncher`), the policy's ``pool.mode`` --
  holds the jail's channel, pipes, cgroup, uid and top process;
* :class:`JailedJob` feeds the machine every event the handle, the timers and the
  client's replies produce, and performs the actions it returns, in order (an action
  may feed the machine again: drained output, the host's evidence). What a run measures
  besides the machine's tally (times, CPU, the client's stream, result and files) is
  its :class:`~jaild.daemon.jails.run_account.RunAccount`'s, which builds the run's record.

Everything is event driven on the daemon's loop. A jail may be made before its job
(the warm pool, :mod:`jaild.daemon.jails.pool`): it stops once hardened, and its job is
assigned later (:meth:`JailedJob.assign`). A session's jail (``keep``) serves one
:meth:`JailedJob.run_next` after another.

The jail link goes ``Harden`` -> ``JailReady`` -> ``RunCode`` -> (``CallTool``
<-> ``ToolReturned``/``ToolFailed``)* -> ``CodeFinished``. The wall-clock deadline
starts when ``RunCode`` is sent. Every frame from the jail is hostile input: see
:mod:`jaild.daemon.core.machine` and :mod:`jaild.daemon.core.broker`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from jaild.daemon.core import disclosure
from jaild.daemon.core.broker import Admitted, Validators
from jaild.daemon.core.classify import STATUSES, Evidence, classify, parse_termination
from jaild.daemon.core.machine import (
    START_TIMEOUT_S,
    Action,
    ArmReleaseTimer,
    ArmRunTimers,
    Assign,
    AwaitLeftovers,
    Cancel,
    Cleanup,
    CloseChannel,
    CodeEnded,
    CollectEvidence,
    CpuExceeded,
    Drained,
    DrainOutput,
    EmitRecord,
    Event,
    ForwardOutput,
    JailEnded,
    JobMachine,
    JobSpec,
    Kill,
    Launch,
    LaunchFailed,
    ObserveCall,
    Phase,
    Ready,
    Relabeled,
    Release,
    RouteCall,
    SendToJail,
    StartFailed,
    StartJail,
    StartRun,
    StopRunTimers,
    Tally,
    Teardown,
    TimerFired,
    ToolLost,
    ToolReplied,
    ToolTimedOut,
    WithdrawCall,
)
from jaild.daemon.core.records import WITHHELD_ERROR, flow_at_end, flow_sinks, withheld_error
from jaild.daemon.egress.gateway import EgressDoor
from jaild.daemon.egress.service import EgressService
from jaild.daemon.jails.cgroups import Cgroups, JobCgroup
from jaild.daemon.jails.kernlog import KernelAuditLog
from jaild.daemon.jails.launch.forked import Zygote, ZygoteLauncher
from jaild.daemon.jails.launch.handle import JailHandle, Launcher
from jaild.daemon.jails.launch.spawned import SpawnLauncher
from jaild.daemon.jails.launch.zygotes import ZygoteSet
from jaild.daemon.jails.run_account import RunAccount
from jaild.errors import ConnectionLost
from jaild.policy.compile import JOB_UIDS, HostLayout, harden
from jaild.policy.flow import Delivery, Disposition
from jaild.policy.redact import Budget, RedactionFailed, Redactor
from jaild.policy.schema import Policy
from jaild.protocol.messages import ErrorInfo, Harden, pack, unpack
from jaild.protocol.records import JobRecord
from jaild.tracing import JobTrace

log = logging.getLogger("jaild")

Reply = tuple[bool, Any] | None
"""A tool call's reply: (True, packed value), (False, (error type, message)), or None: the
client is gone (its connection was lost before it answered)."""


class CallReply:
    """The reply to one routed tool call, handed to whoever listens the moment the router
    resolves it -- in the loop iteration that read it, not on the next one as a future's
    callbacks are. The router resolves it at most once; the job withdraws it when it no
    longer waits (a timeout, the job's end), which tells the router (``on_withdraw``)."""

    __slots__ = ("_listener", "_on_withdraw", "_reply", "_settled", "labels")

    def __init__(self, on_withdraw: Callable[[], Any] | None = None) -> None:
        self._on_withdraw = on_withdraw
        self._listener: Callable[[Reply], None] | None = None
        self._reply: Reply = None
        self._settled = False
        self.labels: tuple[str, ...] = ()  # the reply's own labels (docs/using/flow.md)

    def done(self) -> bool:
        return self._settled

    def resolve(self, ok: bool, value: Any, labels: tuple[str, ...] = ()) -> None:
        """The client answered: (True, packed value) or (False, (type, message)); ``labels``:
        the labels it gave this reply."""
        if not self._settled:
            self.labels = tuple(labels)
        self._settle((ok, value))

    def lost(self) -> None:
        """The client is gone before answering."""
        self._settle(None)

    def listen(self, listener: Callable[[Reply], None]) -> None:
        """Call ``listener`` with the reply when it comes (on the next loop iteration if it
        is here already: never inside the caller)."""
        if self._settled:
            asyncio.get_running_loop().call_soon(listener, self._reply)
        else:
            self._listener = listener

    def withdraw(self) -> None:
        """No one waits for the reply any more."""
        if not self._settled:
            self._settled = True
            self._listener = None
            if self._on_withdraw is not None:
                self._on_withdraw()

    def _settle(self, reply: Reply) -> None:
        if self._settled:
            return
        self._settled, self._reply = True, reply
        listener, self._listener = self._listener, None
        if listener is not None:
            listener(reply)


ToolRouter = Callable[[str, int, str, bytes, bool], CallReply]
"""(job_id, call_id, tool name, packed args, needs approval) -> the call's :class:`CallReply`;
it may raise ConnectionLost. The router sends the call at once; withdrawing the reply
withdraws the call."""
ToolObserver = Callable[[str, str, str, str, float], None]
"""(job_id, policy, tool, outcome, duration_s): every tool call, as it ends (audit, metrics).
``outcome`` is ``ok`` or the error type (``invalid_arguments``, ``denied``, ``timeout``,
``quota_exceeded``, ``unknown_tool``, the handler's exception type, ...)."""
OutputSink = Callable[[str, str, bytes], None]
"""(job_id, "stdout"|"stderr", bytes) -> None."""
Outcome = tuple[JobRecord, bytes | None, dict[str, bytes]]
"""A run's record, its packed result (None unless ok) and its downloaded files."""
REDACT_TIME_S = 10.0
"""How long the redaction of one run's result, output and error may take (in a worker
thread, :func:`_redact_run`): past it they are withheld."""
REDACT_THREADS = 4
"""Redaction's own worker threads: however busy redacting, the daemon still makes jails'
cgroups and loads snapshots on the event loop's default executor."""


@functools.cache
def _redaction_threads() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(REDACT_THREADS, "jaild-redact")


@dataclass
class _Unredacted:
    """A run's end whose result, output or error waits for redaction: its outcome, not yet
    the caller's (:meth:`JailedJob._settle` redacts it off the event loop, then hands it on).
    ``redact``: what to redact (``result``, ``output``); ``stdout``/``stderr``: the run's
    bytes as the jail wrote them (the record holds them decoded)."""

    record: JobRecord
    result: bytes | None
    downloads: dict[str, bytes]
    redact: tuple[str, ...]
    stdout: bytes
    stderr: bytes
    secrets: dict[str | bytes, str]
    redactor: Redactor | None  # the jail's, if built for these secrets already
    final: bool


def _redact_run(run: _Unredacted, time_s: float) -> tuple[Redactor, JobRecord, bytes | None]:
    """``run``'s record and result redacted (a worker thread's work: no loop state).

    Raises:
        RedactionFailed: too deep, too much, or longer than ``time_s``.
        Exception: anything else that stops it (a result that does not unpack or pack).
    """
    budget = Budget(deadline=time.monotonic() + time_s, clock=time.monotonic)
    redactor = run.redactor or Redactor(run.secrets)
    budget.check_time()
    record, result = run.record, run.result
    if Delivery.RESULT in run.redact and result is not None:
        result = pack(redactor.value(unpack(result), budget))
    if Delivery.OUTPUT in run.redact:
        out = redactor.data(run.stdout, budget).decode("utf-8", "replace")
        err = redactor.data(run.stderr, budget).decode("utf-8", "replace")
        error = record.error
        if error is not None:
            error = replace(error, message=redactor.text(error.message, budget),
                            traceback=redactor.text(error.traceback, budget))
        record = replace(record, stdout=out, stderr=err, error=error)
    return redactor, record, result


def _withheld_instead(run: _Unredacted) -> tuple[JobRecord, bytes | None]:
    """``run``'s record and result when its redaction failed: what it covered, withheld."""
    record, result = run.record, run.result
    if Delivery.RESULT in run.redact:
        result = None
    changes: dict[str, Any] = {}
    if Delivery.OUTPUT in run.redact:  # (a result is redacted only when the run ended ok)
        changes["stdout"] = changes["stderr"] = ""
        if record.error is not None:
            changes["error"] = replace(record.error, message=WITHHELD_ERROR, traceback="")
    flow = record.flow
    if flow is not None:
        changes["flow"] = replace(
            flow, withheld=tuple(sorted({*flow.withheld, *run.redact})),
            redacted=tuple(r for r in flow.redacted if r not in run.redact),
            redaction=flow.redaction or "failed")
    return replace(record, **changes), result




@dataclass
class JailEnvironment:
    """What every job of one daemon shares."""

    nsjail: str
    host: HostLayout
    cgroups: Cgroups
    config_fds: dict[str, int]  # policy name -> sealed memfd with its nsjail config
    seccomp_specs: dict[str, dict[str, Any]]
    seccomp_digests: dict[str, frozenset[str]]
    """Policy name -> the digests of the BPF its jails may load (startup._seccomp_digests)."""
    audit: KernelAuditLog
    uid_base: int
    launcher: tuple[str, ...] = ()  # e.g. setpriv --pdeathsig TERM --: nsjail dies with us
    kill_grace_s: float = 1.0
    zygotes: ZygoteSet = field(default_factory=ZygoteSet)  # by (policy, client uid)
    stand_in: Launcher | None = None
    """A launcher that makes every jail instead of nsjail or a zygote, with no cgroup: only
    :class:`jaild.testing.FakeLauncher`, which isolates nothing. The daemon never sets it."""
    on_tool_call: ToolObserver = lambda *_: None
    egress: EgressService | None = None
    """The egress gateway's side of ``network.mode = "egress"`` (None: no policy uses it)."""
    _free_slots: list[int] = field(default_factory=list)
    _next_slot: int = 0
    _hardens: dict[str, Harden] = field(default_factory=dict)

    def harden(self, policy: Policy) -> Harden:
        """The policy's first frame to its jails, built (and its fields checked) once."""
        msg = self._hardens.get(policy.name)
        if msg is None:
            msg = harden(policy, self.seccomp_specs[policy.name])  # the compiler's
            self._hardens[policy.name] = msg
        return msg

    validators: Validators = field(default_factory=Validators)

    def tool_arguments(
        self, schema: dict[str, Any], tool: str, packed: bytes
    ) -> tuple[str, str] | None:
        """See :meth:`jaild.daemon.core.broker.Validators.check_arguments`."""
        return self.validators.check_arguments(schema, tool, packed)

    def allocate_uid(self) -> int:
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        if slot == self._next_slot:
            if slot >= JOB_UIDS:
                raise RuntimeError(f"all {JOB_UIDS} job uids are in use")
            self._next_slot += 1
        return self.uid_base + slot

    def release_uid(self, uid: int) -> None:
        self._free_slots.append(uid - self.uid_base)

    async def start_jail(
        self, handle: JailHandle, spec: JobSpec, *, pooled: bool, on_sent: Callable[[], None]
    ) -> None:
        """Give ``handle`` a uid and a cgroup (named after its jail) and start its jail:
        nsjail per job, or a fork of the policy's zygote (its ``pool.mode``). See
        :meth:`jaild.daemon.jails.launch.handle.Launcher.start`.

        Raises:
            OSError, RuntimeError: the jail cannot be started (no uid left, no cgroup, ...).
        """
        limits = spec.limits
        uid = handle.outside_uid = self.allocate_uid()
        launcher = self.stand_in  # jaild.testing's unisolated stand-in: no cgroup
        if launcher is None:
            # the zygote of the job's uid, if it is up; else a fresh exec (see ZygoteSet)
            zygote = self.zygotes.for_job(spec.policy, spec.tenant, pooled=pooled)
            # a zygote that forks into the job's cgroup has it made in its home, for it
            home = None
            if zygote is not None and zygote.clone_into:
                home = (zygote.ensure_home(), zygote.uid)
            make = functools.partial(
                self.cgroups.create_job,
                handle.jail_id, limits.memory_mb, limits.pids, with_cpu=limits.cpu_cores > 0,
                home=home,
            )
            # A jail made ahead of its job (the pool) makes its cgroup in a worker thread:
            # its mkdirs (0.6-1.2 ms on cgroup v1) would hold up the loop, and so a job
            # arriving meanwhile. A job's own jail makes it at once: it waits either way.
            handle.cgroup = await _aside(make) if pooled else make()
            launcher = SpawnLauncher() if zygote is None else ZygoteLauncher(zygote)
        await launcher.start(handle, spec, uid, pooled=pooled, on_sent=on_sent)


async def _aside(make: Callable[[], JobCgroup]) -> JobCgroup:
    """``make()`` in a worker thread. Cancelled meanwhile, the cgroup it makes is removed."""
    made = asyncio.get_running_loop().run_in_executor(None, make)
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        made.add_done_callback(_remove_unclaimed)
        raise


def _remove_unclaimed(made: asyncio.Future[JobCgroup]) -> None:
    if not made.cancelled() and made.exception() is None:
        with contextlib.suppress(OSError):
            made.result().remove()


# --------------------------------------------------------------------------- the job


class JailedJob:
    """One jail and the job (or a session's runs) it serves: the asyncio driver of a
    :class:`~jaild.daemon.core.machine.JobMachine`. ``await run()`` returns the result record
    (without ``result``).

    A jail may also be made ahead of its job (the warm pool): construct it with the
    policy's :func:`placeholder_spec` and no router, ``await prepare()`` -- it is then
    hardened and waiting for its code -- and later :meth:`assign` the real job and
    ``await run()``. Each jail serves exactly one job, except a session's (``keep``),
    which serves one :meth:`run_next` after another.
    """

    def __init__(
        self,
        spec: JobSpec,
        env: JailEnvironment,
        route_tool: ToolRouter | None,
        output: OutputSink | None,
        *,
        jail_id: str | None = None,
        trace: JobTrace | None = None,
    ) -> None:
        self.spec = spec
        self.jail_id = jail_id or spec.job_id
        self._env = env
        self._route_tool = route_tool
        self._output = output
        self._trace = trace  # the job's trace (None: tracing is off, or no job yet)
        self._loop = asyncio.get_running_loop()
        self._machine = JobMachine(
            spec,
            has_job=route_tool is not None,
            harden=env.harden(spec.policy),
            seccomp_digests=env.seccomp_digests[spec.policy.name],
            validators=env.validators,
        )
        self._handle = JailHandle(env, self.jail_id, self._feed, self._machine.conn.max_frame_bytes)
        self._calls_out = _Calls(self)
        self._run = RunAccount(self._handle)  # what the run measures besides the tally
        self._run_timers: list[asyncio.TimerHandle] = []
        self._done = asyncio.Event()  # the jail is gone (JailEnded)
        self._on_done: list[Callable[[], None]] = []  # called soon after _done is set
        self._settled = asyncio.Event()  # it was hardened (Ready), or it is gone
        self._outcome_wait: asyncio.Future[Outcome | _Unredacted] = self._loop.create_future()
        self._redactor: tuple[int, Redactor] | None = None  # for the secrets held: (count, it)
        self.ready_at: float | None = None
        # network.mode = "egress": the jail's door (made once it is hardened, before any
        # job code), served by a door of each run's own
        self._egress = _Egress(env.egress, self._loop)

    # -- public

    @property
    def result(self) -> bytes | None:
        """The packed result of the last run (None unless it ended ``ok``)."""
        return self._run.result

    @property
    def downloads(self) -> dict[str, bytes]:
        """The files the last run left for download (empty unless it ended ``ok``)."""
        return self._run.downloads

    @property
    def pid(self) -> int | None:
        """nsjail's pid while it runs (None for a zygote jail: not our child)."""
        return self._handle.pid

    @property
    def outside_uid(self) -> int | None:
        """The host uid the jail runs as (its first; see ``JOB_UIDS``)."""
        return self._handle.outside_uid

    @property
    def zygote(self) -> Zygote | None:
        return self._env.zygotes.get(self.spec.policy.name, self.spec.tenant)

    @property
    def alive(self) -> bool:
        """Ready for (or running) its job, not ended."""
        return self._machine.alive

    @property
    def runs(self) -> int:
        """Runs started in this jail (a session's count)."""
        return self._machine.runs

    def cancel(self, reason: str = "the job was cancelled") -> None:
        self._feed(Cancel(reason))

    def assign(
        self,
        spec: JobSpec,
        route_tool: ToolRouter,
        output: OutputSink,
        trace: JobTrace | None = None,
    ) -> None:
        """Give a prepared jail its job (same policy; the jail's limits already apply)."""
        assert self._route_tool is None and spec.policy is self.spec.policy
        # The job's cgroup is named after the job, as ever: a pooled jail is made under the
        # id its job will have (cgroup v2 cannot rename a cgroup), see JailPool.
        assert spec.job_id == self.jail_id, (spec.job_id, self.jail_id)
        self._take_job(spec, route_tool, output, trace)
        self._feed(Assign(spec))  # its code is sent now if the jail is ready

    def _take_job(
        self, spec: JobSpec, route_tool: ToolRouter, output: OutputSink, trace: JobTrace | None
    ) -> None:
        self.spec = spec
        self._route_tool = route_tool
        self._output = output
        self._trace = trace
        self._run.job_started = time.monotonic()

    async def prepare(self) -> bool:
        """Start the jail and wait until it is hardened and waiting (True) or ended (False)."""
        await self._launch()
        await self._settled.wait()
        return self.alive

    async def run(self) -> JobRecord:
        try:
            await self._launch()
            record, _, _ = await self._settle(await self._outcome_wait)
            return record
        finally:
            # after the caller has sent the record: killing what is left is not on its path
            self._loop.call_soon(self.cleanup)

    async def run_next(
        self,
        spec: JobSpec,
        route_tool: ToolRouter,
        output: OutputSink,
        trace: JobTrace | None = None,
    ) -> Outcome:
        """A session's jail (prepared with ``keep``): run one more job in it, in the same
        namespace. The jail outlives the run unless the run hit a limit (then :attr:`alive`
        is False and the record says why). Returns the record, the packed result and the
        downloaded files."""
        assert self._machine.keep and spec.policy is self.spec.policy
        self._take_job(spec, route_tool, output, trace)
        self._outcome_wait = self._loop.create_future()
        self._feed(Assign(spec))
        return await self._settle(await self._outcome_wait)

    async def _settle(self, ended: Outcome | _Unredacted) -> Outcome:
        """A run's outcome, redacted first if its labels say so: in a worker thread of
        redaction's own (:data:`REDACT_THREADS`), so the event loop (every other job, every
        tenant) goes on meanwhile, within :data:`REDACT_TIME_S` of its start -- past it, or
        if it fails, what it covers is withheld. The caller has the outcome only once it is
        done (a session's next run, which waits for it, cannot start before)."""
        if not isinstance(ended, _Unredacted):
            return ended
        try:
            # the thread's own deadline bounds it (checked once a window of the search)
            redactor, record, result = await self._loop.run_in_executor(
                _redaction_threads(), _redact_run, ended, REDACT_TIME_S)
        except Exception as exc:  # RedactionFailed, anything else: fail closed
            if not isinstance(exc, RedactionFailed):
                log.exception("job %s: redaction failed; withheld instead", ended.record.job_id)
            record, result = _withheld_instead(ended)
        else:
            self._redactor = (len(ended.secrets), redactor)
        if ended.final:
            self._run.result = result
        return record, result, ended.downloads

    def outcome(self) -> tuple[str, dict[str, Any] | None]:
        """How the jail ended, or stands: ``(status, error)``."""
        return self._machine.outcome()

    async def ended(self) -> tuple[str, dict[str, Any] | None]:
        """Wait for the jail to end; its status and error (a session's jail between runs)."""
        await self._done.wait()
        return self._machine.outcome()

    def host_view(self) -> dict[str, Any]:
        """The job seen from the host while it runs: its processes' ids, its cgroup's limits."""
        return self._handle.host_view()

    def live_usage(self) -> dict[str, Any]:
        """For ``jaild ps``: what the jail uses right now -- coarsened once its labels
        withhold or redact a run's result or output (core/disclosure.py: polled, a jail's
        memory would be a channel)."""
        usage = self._handle.live_usage()
        broker = self._machine.broker
        if broker.labels and disclosure.closes(broker.flow, broker.labels):
            return disclosure.close_live(usage)
        return usage

    def pause_output(self) -> None:
        """Stop reading the jail's stdout/stderr (a slow client): the jail blocks on write."""
        self._run.pause_output()

    def resume_output(self) -> None:
        self._run.resume_output()

    def output_dropped(self, n: int) -> None:
        """The client's stream skipped ``n`` bytes of output (still in the record)."""
        self._run.output_dropped(n)

    async def finished(self) -> None:
        await self._done.wait()

    def when_finished(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (soon, never inside the caller) once the jail is gone."""
        if self._done.is_set():
            self._loop.call_soon(callback)
        else:
            self._on_done.append(callback)

    async def discard(self, reason: str) -> None:
        """End a jail that will not run a job (an idle pooled jail, a shutdown)."""
        self._feed(Cancel(reason))
        await self._done.wait()
        self.cleanup()

    def without_warm_up(self) -> None:
        """A pooled jail that skips its throwaway job (:mod:`jaild.daemon.jails.pool`)."""
        self._handle.warm_up = False

    def cleanup(self) -> None:
        """Kill what is left of the jail; release its cgroup and uid once nothing of it runs.

        A zygote jail's record is out at its claim, while the jail may still be tearing
        down its namespaces; the cgroup and uid are released when the zygote has reaped
        it (or after ``RELEASE_TIMEOUT_S``, by then long dead)."""
        self._feed(Cleanup())

    # -- start

    async def _launch(self) -> None:
        if not self._machine.handle(Launch()):
            return  # launched once already, or ended before it was
        try:
            await self._env.start_jail(
                self._handle,
                self.spec,
                pooled=self._route_tool is None,
                on_sent=self._arm_start_timeout,  # a zygote's: when the request left its queue
            )
        except (OSError, RuntimeError) as exc:
            self._feed(LaunchFailed(str(exc)))

    def _arm_start_timeout(self) -> None:
        """The jail has START_TIMEOUT_S to become ready, counted from its own start (not
        from a place in the zygote's queue, where a burst waits its turn)."""
        if self._machine.phase is Phase.STARTING:
            self._handle.later(START_TIMEOUT_S, TimerFired("start"))

    # -- the machine's actions

    def _feed(self, event: Event) -> None:
        """Feed the machine; do what it says, in order (its answers may feed it again)."""
        for action in self._machine.handle(event):
            self._perform(action)

    def _perform(self, action: Action) -> None:
        _PERFORM[type(action)](self, action)  # one dict lookup, not a chain of isinstance

    # One method per action (the table _PERFORM, after the class, maps each type to one).

    def _send_to_jail(self, action: SendToJail) -> None:
        self._handle.write(action.data)

    def _forward_output(self, action: ForwardOutput) -> None:
        if self._output is not None and Delivery.OUTPUT not in self.withheld() \
                and Delivery.OUTPUT not in self.withheld(Disposition.REDACT):  # at the end
            self._output(self.spec.job_id, action.stream, action.data)

    # -- information flow (jaild.policy.flow; docs/using/flow.md)

    @property
    def labels(self) -> frozenset[str]:
        """The labels the jail's job (a session: the session) holds."""
        return frozenset(self._machine.broker.labels)

    def withheld(self, how: Disposition = Disposition.WITHHOLD) -> dict[str, str]:
        """What its labels withhold (``how = "redact"``: redact) from this run's caller
        (:func:`jaild.daemon.core.records.flow_sinks`)."""
        broker = self._machine.broker
        if not broker.labels:  # every chunk of output asks: no label, nothing closed
            return {}
        return flow_sinks(broker.flow, frozenset(broker.labels), self.spec.released,
                          broker.redaction_exhausted, how)

    def _relabeled(self, action: Relabeled) -> None:
        self._egress.recheck()

    def _apply_flow(self, withheld: frozenset[str], tally: Tally) -> None:
        """Withhold what the run's labels say (:func:`~jaild.daemon.core.records.flow_at_end`),
        before anyone can read it (what they redact is redacted later, off the event loop:
        :meth:`_settle`)."""
        run = self._run
        if Delivery.RESULT in withheld:
            run.result = None
        if Delivery.DOWNLOADS in withheld:
            run.withhold_files()
        if Delivery.OUTPUT in withheld:
            tally.stdout.clear()
            tally.stderr.clear()

    def _route_call(self, action: RouteCall) -> None:
        self._calls_out.route(action.call)

    def _withdraw_call(self, action: WithdrawCall) -> None:
        self._calls_out.withdraw(action.call_id)

    def _observe_call(self, action: ObserveCall) -> None:
        self._env.on_tool_call(
            self.spec.job_id, self.spec.policy.name, action.name, action.outcome,
            action.duration_s,
        )
        if self._trace is not None:
            self._trace.tool_call(action.name, action.outcome, action.duration_s,
                                  action.args_bytes, action.result_bytes)

    def _ready(self, _: Ready) -> None:
        self.ready_at = time.monotonic()
        if self.spec.policy.network.mode == "egress":
            try:
                self._egress.open(self._handle.jail_process())
            except OSError as exc:
                log.error("jail %s: cannot open its egress door: %s", self.jail_id, exc)
                self._feed(StartFailed(f"cannot open the jail's egress door: {exc}"))
        self._settled.set()

    def _start_run(self, _: StartRun) -> None:
        self._run.run_started()
        broker = self._machine.broker
        self._egress.serve(self.spec.policy, self.spec.job_id,
                           lambda: frozenset(broker.labels), broker.flow_refused)

    def _stop_run_timers(self, _: StopRunTimers) -> None:
        for timer in self._run_timers:
            timer.cancel()
        self._run_timers.clear()

    def _code_ended(self, action: CodeEnded) -> None:
        self._run.code_ended(action.report, self.spec.policy)

    def _drain_output(self, _: DrainOutput) -> None:
        self._handle.drain()  # what the code printed is in the pipes
        self._feed(Drained())

    def _collect_evidence(self, action: CollectEvidence) -> None:
        self._feed(self._handle.evidence(action.sigsys_pid))

    def _kill(self, _: Kill) -> None:
        if self._trace is not None:
            self._trace.killed()
        self._handle.kill()

    def _await_leftovers(self, _: AwaitLeftovers) -> None:
        self._handle.await_leftovers()

    def _close_channel(self, _: CloseChannel) -> None:
        self._handle.close_channel()

    def _jail_ended(self, _: JailEnded) -> None:
        self._egress.close()
        self._done.set()
        self._settled.set()
        callbacks, self._on_done = self._on_done, []
        for callback in callbacks:
            self._loop.call_soon(callback)

    def _teardown(self, _: Teardown) -> None:
        self._handle.teardown()

    def _arm_release_timer(self, _: ArmReleaseTimer) -> None:
        self._handle.arm_release_timer()

    def _release(self, _: Release) -> None:
        self._handle.release()

    def _start_jail(self, _: StartJail) -> None:
        """Nothing: :meth:`_launch` starts the jail."""

    def _arm_run_timers(self, action: ArmRunTimers) -> None:
        """The run's code is on its way: its wall-clock limit counts from here."""
        self._run.code_sent()
        timer = self._handle.later(action.wall_time_s, TimerFired("wall", action.run))
        if action.watch_cpu:  # the jail's CPU rlimit is the session's: each run is watched
            self._run_timers.append(timer)
            self._watch_cpu()

    def _watch_cpu(self) -> None:
        """End a session's run that used its ``cpu_time_s`` (all its processes together).
        Checks when the budget could be gone at the earliest, so rarely."""
        if self._machine.phase not in (Phase.RUNNING, Phase.REPORTED):
            return
        used = self._run.cpu_used_s()
        if used is None:
            return
        limit = self.spec.limits.cpu_time_s
        left = limit - used
        if left <= 0:
            self._feed(CpuExceeded(f"CPU time limit of {limit:g} s exceeded (this run)"))
            return
        cores = self.spec.limits.cpu_cores or os.cpu_count() or 1
        self._run_timers.append(
            self._loop.call_later(max(0.05, left / cores), self._watch_cpu)
        )

    def _emit(self, action: EmitRecord) -> None:
        """The job's (or run's) record, for whoever awaits it."""
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.emitted(self._run.code_sent_at, self._run.code_ended_at)
        egress = self._egress.end_run()
        broker = self._machine.broker
        decided = flow_at_end(broker.flow, frozenset(broker.labels), self.spec.released,
                              exhausted=broker.redaction_exhausted,
                              refusals=action.tally.flow_refusals, snapshot=self.spec.snapshot)
        flow, redact = decided.record, decided.redact
        error = withheld_error(action.error, decided.withheld)
        self._apply_flow(decided.withheld, action.tally)
        # what output redaction needs: the bytes the jail wrote (the record decodes them)
        stdout = bytes(action.tally.stdout) if Delivery.OUTPUT in redact else b""
        stderr = bytes(action.tally.stderr) if Delivery.OUTPUT in redact else b""
        record = self._run.record(self.spec, action.status, error, action.tally, egress, flow)
        record = disclosure.caller_view(record, self.spec.policy)  # core/disclosure.py
        ended: Outcome | _Unredacted = (record, self._run.result, self._run.downloads)
        if redact:  # the caller has it once redacted (:meth:`_settle`, off the event loop)
            secrets = self._machine.broker.secrets
            cached = self._redactor
            ended = _Unredacted(
                record, self._run.result, self._run.downloads, redact, stdout, stderr,
                dict(secrets), cached[1] if cached and cached[0] == len(secrets) else None,
                action.final)
            if action.final:
                self._run.result = None  # until then
        if not action.final:  # a session's jail waits for its next run
            self._output = None
            self._route_tool = None
            self._run.reset()
        if not self._outcome_wait.done():
            self._outcome_wait.set_result(ended)


_PERFORM: dict[type[Any], Callable[[JailedJob, Any], None]] = {
    SendToJail: JailedJob._send_to_jail,
    ForwardOutput: JailedJob._forward_output,
    RouteCall: JailedJob._route_call,
    WithdrawCall: JailedJob._withdraw_call,
    ObserveCall: JailedJob._observe_call,
    EmitRecord: JailedJob._emit,
    Relabeled: JailedJob._relabeled,
    Ready: JailedJob._ready,
    StartRun: JailedJob._start_run,
    ArmRunTimers: JailedJob._arm_run_timers,
    StopRunTimers: JailedJob._stop_run_timers,
    CodeEnded: JailedJob._code_ended,
    DrainOutput: JailedJob._drain_output,
    CollectEvidence: JailedJob._collect_evidence,
    Kill: JailedJob._kill,
    AwaitLeftovers: JailedJob._await_leftovers,
    CloseChannel: JailedJob._close_channel,
    JailEnded: JailedJob._jail_ended,
    Teardown: JailedJob._teardown,
    ArmReleaseTimer: JailedJob._arm_release_timer,
    Release: JailedJob._release,
    StartJail: JailedJob._start_jail,
}
"""What :meth:`JailedJob._perform` does for each action of the machine."""


class _Egress:
    """A jail's egress (an egress policy's): its listener on the jail's own loopback, opened
    once the jail is hardened (before any of a job's code runs in it), and a door of its own
    per run (quotas and usage per run), given a read-only view of the labels the jail holds
    (the broker's, which only the job machine changes)."""

    def __init__(self, service: EgressService | None, loop: asyncio.AbstractEventLoop) -> None:
        self._service = service
        self._loop = loop
        self._listener: socket.socket | None = None
        self._run: tuple[EgressDoor, asyncio.Task[None]] | None = None
        self._stopping: asyncio.Task[None] | None = None  # the last run's door

    def open(self, pid: int | None) -> None:
        """Raises OSError: the door cannot be made (the jail then does not serve)."""
        if self._service is None:
            return
        if pid is None:
            raise OSError("the jail's process is not known")
        self._listener = self._service.listener(pid)

    def serve(self, policy: Policy, job_id: str, labels: Callable[[], frozenset[str]],
              refused: Callable[..., Any]) -> None:
        """A run starts: its door serves the jail."""
        service, listener = self._service, self._listener
        if service is None or listener is None:
            return
        door = service.door(policy, job_id, labels, refused)
        task = self._loop.create_task(door.serve(listener), name=f"egress-{job_id}")
        task.add_done_callback(_egress_ended)
        self._run = (door, task)

    def recheck(self) -> None:
        """The jail holds new labels: the run's door cuts what they close."""
        if self._run is not None:
            self._run[0].recheck()

    def end_run(self) -> dict[str, Any] | None:
        """The run is over: its door stops (its connections are cut); its usage."""
        run, self._run = self._run, None
        if run is None:
            return None
        door, task = run
        task.cancel()
        self._stopping = task
        return door.usage.to_wire()

    def close(self) -> None:
        """The jail is gone: its listener is closed once no door waits on it (closing a
        descriptor the loop still watches could take a reused number's registration)."""
        self.end_run()
        listener, self._listener = self._listener, None
        if listener is None:
            return
        stopping = self._stopping
        if stopping is None or stopping.done():
            listener.close()
        else:
            stopping.add_done_callback(lambda _: listener.close())


def _egress_ended(task: asyncio.Task[None]) -> None:
    """A run's door stopped: cancelled at the run's end, or failed (a jaild bug: logged)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("egress door %s failed", task.get_name(), exc_info=exc)


# --------------------------------------------------------------------------- tool calls


class _Calls:
    """The routed tool calls of one jail: each a :class:`CallReply` with its timeout.
    Replies, timeouts and losses are fed to the job's machine."""

    def __init__(self, job: JailedJob) -> None:
        self._job = job
        self._in_flight: dict[int, tuple[CallReply, asyncio.TimerHandle]] = {}

    def route(self, call: Admitted) -> None:
        """Hand the call to the router now; its reply is fed to the machine as soon as the
        client's answer is read (no task, no future: a round trip is loop iterations
        shorter)."""
        job = self._job
        assert job._route_tool is not None  # calls arrive only after RunCode
        # the clock starts before the call can reach the client, so the handler's whole time
        # is inside what is recorded (the call is written to the client within _route_tool)
        started = time.monotonic()
        try:
            reply = job._route_tool(
                job.spec.job_id, call.call_id, call.name, call.args, call.needs_approval
            )
        except ConnectionLost:
            job._feed(ToolLost(call.call_id))
            return
        timer = job._loop.call_later(call.timeout_s, self._timed_out, call, started)
        self._in_flight[call.call_id] = (reply, timer)
        reply.listen(functools.partial(self._done, call, started))

    def withdraw(self, call_id: int) -> None:
        entry = self._in_flight.pop(call_id, None)
        if entry is not None:
            entry[1].cancel()
            entry[0].withdraw()

    def _timed_out(self, call: Admitted, started: float) -> None:
        entry = self._in_flight.pop(call.call_id, None)
        if entry is not None:
            entry[0].withdraw()
            self._job._feed(ToolTimedOut(call.call_id, time.monotonic() - started))

    def _done(self, call: Admitted, started: float, reply: Reply) -> None:
        entry = self._in_flight.pop(call.call_id, None)
        if entry is None:  # withdrawn, or timed out: the machine knows
            return
        entry[1].cancel()
        if reply is None:
            self._job._feed(ToolLost(call.call_id))
            return
        ok, value = reply
        self._job._feed(ToolReplied(call.call_id, ok, value, time.monotonic() - started,
                                    entry[0].labels))


__all__ = [
    "STATUSES",
    "CallReply",
    "ErrorInfo",
    "Evidence",
    "JailEnvironment",
    "JailedJob",
    "JobSpec",
    "classify",
    "parse_termination",
]
