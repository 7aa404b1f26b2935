"""The job machine: one jail's lifecycle and its jobs' ends, as a sans-IO state machine.

Theory of operation
-------------------
A :class:`JobMachine` is the whole decision-making of one jail and the job (or,
for a session, the runs) it serves. It has one verb, :meth:`JobMachine.handle`:
an :data:`Event` -- something the daemon's IO saw or wants -- goes in, a list of
:data:`Action` -- what the IO must now do, in order -- comes out. It never touches
a socket, a pipe, a process, a cgroup or a clock: the asyncio driver
(:class:`jaild.daemon.jails.job.JailedJob`) does, and feeds back what happens.

The machine owns the jail link's :class:`~jaild.protocol.Connection` (every frame
from the jail is hostile input: anything out of order kills the job with
``channel_error``), the tool :class:`~jaild.daemon.core.broker.Broker`, the job's output
(counted against ``output_bytes``), the :class:`~jaild.daemon.core.classify.Evidence` of
how the jail ended, and so the classification of each job's end.

A jail is made either by nsjail (it ends when nsjail has exited and its stdout,
stderr, log and channel reached EOF -- after a killed nsjail, once no process of
the jail is left) or by a zygote. A zygote jail's ``CodeFinished`` ends a one-shot
job at once (the *claim*): everything that can overrule a claim -- the daemon's kill
reasons, the output limit, a limit or seccomp kill, OOM -- either happened before it
(a killed process sends nothing; OOM kills are counted by the cgroup, read with the
evidence) or is the code's own doing after it had its result. So the record need not
wait for the jail's exit, which tears down its namespaces; the output written before
the claim is already in the pipes and is drained first (DrainOutput). A *pooled*
jail is made before its job (:class:`Assign` gives it one); a *session's* jail
(``keep``) serves one run after another.

Size: :class:`JobMachine` is one class of about 400 lines (some 320 of code) on
purpose -- its handlers are the rows of the table above, and splitting them over
classes would hide which state may do what. The tool calls' glue is apart
(:class:`_CallDesk`), the rules themselves in the broker.

States (:class:`Phase`) and the events that move between them. An event not listed
for a state is a late fact and changes nothing there; of the driver's own commands,
marked (c), an Assign to a jail that serves a job (or is closed) and an EvidenceRead
nobody asked for are bugs (:class:`~jaild.errors.LocalProtocolError`):

============  =====================================  ===========================================
state         event                                  next state (actions)
============  =====================================  ===========================================
new           Launch (c)                             starting (StartJail)
new           Assign (c)                             new (the job waits for its jail)
new           Cancel                                 settling (CollectEvidence)
starting      ChannelOpened (c)                      starting (SendToJail Harden)
starting      JailReady, digest right                idle (Ready), or running if a job waits
starting      JailReady, digest wrong; start timer   killing (Kill start_failed)
starting      LaunchFailed                           settling (CollectEvidence)
starting      StartFailed                            killing (Kill start_failed)
idle          Assign (c)                             running (StartRun, SendToJail RunCode,
                                                     ArmRunTimers)
idle          Cancel, ChannelBroken                  killing (Kill)
running       CallTool                               running (RouteCall | SendToJail ToolFailed
                                                     + ObserveCall | Kill channel_error)
running       ToolReplied/TimedOut                   running (SendToJail answer, ObserveCall)
running       CodeFinished                           reported (CodeEnded [, DrainOutput])
running       wall timer, CPU, output limit, Cancel  killing (Kill)
reported      Drained, session                       run-over (StopRunTimers, CollectEvidence)
reported      Drained, zygote                        settling (the claim ends the job)
run-over      EvidenceRead (c)                       idle (EmitRecord) or killing (EmitRecord,
                                                     Kill: the run hit a limit)
killing       CodeFinished (zygote, one-shot)        killing (CodeEnded, DrainOutput)
any live      the jail's end is complete             settling (CloseChannel, WithdrawCall*,
                                                     CollectEvidence), or AwaitLeftovers first
                                                     after a killed nsjail
any live      Vanished (nothing was started)         settling
settling      EvidenceRead (c)                       done (EmitRecord if a job waits, JailEnded)
done          Assign (c)                             done (EmitRecord at once)
any           Cleanup (c)                            closed (Teardown, ArmReleaseTimer) while a
                                                     zygote owes its reap, else released
                                                     (Teardown, Release)
closed        Reaped, ReleaseTimedOut                released (Release)
============  =====================================  ===========================================

"Live" is starting, idle, running, reported, run-over and killing. Facts --
Output, LogData, StreamClosed, Exited, Reaped, ToolReplied, ToolTimedOut, ToolLost,
TimerFired, CpuExceeded, Cancel, ChannelBroken -- may come in any state.

Invariants (tested with generated event orders in ``tests/unit/test_machine.py``):
every job gets at most one record, and exactly one once its jail's end is known; no
call is routed once the job is being killed or has ended; every routed call is
answered or withdrawn exactly once; Kill and JailEnded come at most once; nothing
comes after Release.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from jaild.daemon.core.broker import Admitted, Answer, Answered, Broker, Refused, Validators
from jaild.daemon.core.classify import Evidence, KillReason, classify
from jaild.daemon.core.peer import Tenant
from jaild.errors import LocalProtocolError, RemoteProtocolError
from jaild.policy.flow import FlowRules
from jaild.policy.schema import Limits, Policy, flow_rules
from jaild.protocol import NEED_DATA, Connection, Role, State
from jaild.protocol.messages import (
    CodeFinished,
    Harden,
    JailCallTool,
    JailReady,
    JailToolFailed,
    JailToolReturned,
    JobDescription,
    Message,
    RunCode,
    jail_link_max_frame,
)

TimerKind = Literal["start", "wall"]
"""The machine's timers: the jail's start (:data:`START_TIMEOUT_S`) and a run's wall clock."""
Leftovers = Literal["", "awaited", "gone"]
"""What is known of a killed nsjail's processes: nothing yet, waited for, none left."""

START_TIMEOUT_S = 30.0
"""A jail must be ready this long after it was started."""
MAX_LOG_BYTES = 256 * 1024
"""nsjail's log kept for the classification."""


@dataclass(frozen=True)
class JobSpec:
    """One job: what runs, under which policy and limits, with which tools and files."""

    job_id: str
    policy: Policy
    limits: Limits
    job: JobDescription  # the client's, as admitted: sent to the jail whole in RunCode
    keep: bool = False  # a session's jail: it outlives the run
    tenant: Tenant | None = None  # the client's principal: whose zygote forks it (None: none)
    snapshot: bool = False  # a session's run that takes its snapshot (the result) instead
    restore: bytes | None = None  # a fresh session's first run: restore this snapshot
    released: frozenset[str] = frozenset()  # labels whose withholding spares this caller
    # Labels held from the jail's start, before any of its code or a byte of ``restore``
    # runs: a restored (forked, resumed, continued) state's. The machine's broker is made
    # holding them, and a run that restores state is refused in a jail that does not hold
    # its ``labels`` (docs/security.md, "Paths that carry jail-chosen bytes").
    labels: frozenset[str] = frozenset()
    # Labels the caller asked the job to hold (``RunJob.labels``, ``OpenSession.labels``):
    # what it passes on of what it read. A fresh jail's broker is made holding them; a jail
    # made before its job (pooled, or a session's for its next run) takes them at
    # ``Assign``, before the job's code is sent.
    hold: frozenset[str] = frozenset()


class Phase(enum.Enum):
    NEW = "new"  # nothing started
    STARTING = "starting"  # the jail is being made and hardened
    IDLE = "idle"  # hardened, waiting for code (a warm pool's jail; a session between runs)
    RUNNING = "running"  # RunCode sent: the wall clock runs, tool calls flow
    REPORTED = "reported"  # the code sent CodeFinished; its output is drained, or nsjail exits
    RUN_OVER = "run-over"  # a session's run is over: its evidence is read, then its record
    KILLING = "killing"  # the daemon ordered the jail's end
    SETTLING = "settling"  # the jail is gone: the host's evidence (OOM, audit) is read
    DONE = "done"  # the jail is gone, its job's record is out
    CLOSED = "closed"  # torn down; a zygote still owes the jail's reap
    RELEASED = "released"  # cgroup and uid released: the end


LIVE = frozenset(
    {Phase.STARTING, Phase.IDLE, Phase.RUNNING, Phase.REPORTED, Phase.RUN_OVER, Phase.KILLING}
)


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Launch:
    """(c) Start making the jail (once)."""


@dataclass(frozen=True, slots=True)
class Spawned:
    """The jail was started (nsjail) or requested (zygote); ``streams`` will each close."""

    forked: bool
    streams: int


@dataclass(frozen=True, slots=True)
class LaunchFailed:
    detail: str


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The jail came up wrong (not the zygote's, or not movable into its cgroup)."""

    detail: str


@dataclass(frozen=True, slots=True)
class ChannelOpened:
    """(c) The jail's channel is connected: it is owed ``Harden``."""


@dataclass(frozen=True, slots=True)
class JailData:
    """Bytes the jail wrote on its channel."""

    data: bytes


@dataclass(frozen=True, slots=True)
class ChannelBroken:
    """The jail misused its channel in a way only the IO sees (it reads no replies)."""

    detail: str


@dataclass(frozen=True, slots=True)
class Assign:
    """(c) The job (or a session's next run) this jail serves now."""

    job: JobSpec


@dataclass(frozen=True, slots=True)
class Output:
    stream: str  # "stdout" | "stderr"
    data: bytes


@dataclass(frozen=True, slots=True)
class LogData:
    """nsjail's log (its private descriptor)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Drained:
    """(c) What the pipes held when DrainOutput was asked for has been fed as Output."""


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """One of the jail's streams (stdout, stderr, nsjail's log, the channel) reached EOF."""


@dataclass(frozen=True, slots=True)
class Exited:
    """The jail's top process ended: nsjail's exit (``returncode``, its rusage CPU time), or
    the zygote's report (the jail's ``termination``, or ``failure``: it was never made)."""

    returncode: int | None = None
    termination: tuple[str, int, str, int] | None = None
    cpu_s: float = 0.0
    failure: str | None = None


@dataclass(frozen=True, slots=True)
class Vanished:
    """There is no jail to wait for (killed before anything was started)."""


@dataclass(frozen=True, slots=True)
class LeftoversGone:
    """After a killed nsjail: no process of the jail is left (or the wait gave up)."""


@dataclass(frozen=True, slots=True)
class Reaped:
    """The zygote reaped the jail: nothing of it runs any more."""


@dataclass(frozen=True, slots=True)
class ToolReplied:
    """The client answered a routed call: ``(True, packed)`` or ``(False, (type, message))``."""

    call_id: int
    ok: bool
    value: Any
    duration_s: float
    labels: tuple[str, ...] = ()  # the reply's own (ClientToolReturned.labels)


@dataclass(frozen=True, slots=True)
class ToolTimedOut:
    call_id: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class ToolLost:
    """The client went away with the call in flight."""

    call_id: int


@dataclass(frozen=True, slots=True)
class TimerFired:
    timer: TimerKind
    run: int = 0  # the run a wall timer was armed for


@dataclass(frozen=True, slots=True)
class CpuExceeded:
    """A session's run used its CPU time (the driver watches the cgroup)."""

    detail: str


@dataclass(frozen=True, slots=True)
class Cancel:
    detail: str = "the job was cancelled"


@dataclass(frozen=True, slots=True)
class EvidenceRead:
    """(c) The answer to CollectEvidence: the cgroup's OOM count, the audit log's syscall."""

    oom: bool
    syscall: str | None = None


@dataclass(frozen=True, slots=True)
class Cleanup:
    """(c) Tear down what is left of the jail."""


@dataclass(frozen=True, slots=True)
class ReleaseTimedOut:
    """The zygote did not report the reap in time; the jail is long dead."""


Event = (
    Launch | Spawned | LaunchFailed | StartFailed | ChannelOpened | JailData | ChannelBroken
    | Assign | Output | LogData | Drained | StreamClosed | Exited | Vanished | LeftoversGone
    | Reaped | ToolReplied | ToolTimedOut | ToolLost | TimerFired | CpuExceeded | Cancel
    | EvidenceRead | Cleanup | ReleaseTimedOut
)


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class StartJail:
    """Make the jail (allocate its uid and cgroup, spawn it), then feed Spawned/LaunchFailed."""


@dataclass(frozen=True, slots=True)
class SendToJail:
    message: Message
    data: bytes  # the framed bytes


@dataclass(frozen=True, slots=True)
class Ready:
    """The jail is hardened and waiting for code."""


@dataclass(frozen=True, slots=True)
class StartRun:
    """A run starts: reset the cgroup's peak counters and take its CPU base (before RunCode)."""

    run: int


@dataclass(frozen=True, slots=True)
class ArmRunTimers:
    """The run's wall-clock timer (TimerFired("wall", run)); for a session also its CPU watch."""

    run: int
    wall_time_s: float
    watch_cpu: bool


@dataclass(frozen=True, slots=True)
class StopRunTimers:
    pass


@dataclass(frozen=True, slots=True)
class RouteCall:
    """Send the call to the client; feed its reply, timeout (after ``call.timeout_s``) or loss."""

    call: Admitted


@dataclass(frozen=True, slots=True)
class WithdrawCall:
    """The job is over: the call's reply is no longer wanted."""

    call_id: int


@dataclass(frozen=True, slots=True)
class ObserveCall:
    """A call ended (audit, metrics)."""

    call_id: int | None  # None: refused before it was routed
    name: str
    outcome: str
    duration_s: float
    args_bytes: int = 0  # the packed arguments' size
    result_bytes: int = 0  # the packed result's size (0 unless it returned)


@dataclass(frozen=True, slots=True)
class Relabeled:
    """The job holds new labels (before the reply that carries them reaches the jail): its
    egress door closes what they close."""

    added: frozenset[str]


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    stream: str
    data: bytes


@dataclass(frozen=True, slots=True)
class DrainOutput:
    """Read what the output pipes hold now, feed it as Output, then feed Drained."""


@dataclass(frozen=True, slots=True)
class CodeEnded:
    """The runtime's report: note the end of the code's time, take its result and files."""

    report: CodeFinished


@dataclass(frozen=True, slots=True)
class Kill:
    reason: KillReason
    detail: str


@dataclass(frozen=True, slots=True)
class AwaitLeftovers:
    """nsjail was killed: kill what is left of the jail, feed LeftoversGone when none is."""


@dataclass(frozen=True, slots=True)
class CloseChannel:
    pass


@dataclass(frozen=True, slots=True)
class CollectEvidence:
    """Read the cgroup's OOM count (and, for a SIGSYS, the audit record of ``sigsys_pid``);
    feed EvidenceRead."""

    final: bool
    sigsys_pid: int | None = None


@dataclass
class Tally:
    """What one run produced and consumed, for its record."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    output_bytes: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    calls_omitted: int = 0
    tool_time_s: float = 0.0
    flow_refusals: list[dict[str, str]] = field(default_factory=list)

    def take(self, stream: str, data: bytes, limit: int) -> tuple[bytes, bool]:
        """Keep what fits under ``limit`` bytes of output in all: (the part kept, whether
        ``data`` was cut there)."""
        room = limit - self.output_bytes
        chunk = data[:room] if len(data) > room else data
        if chunk:
            self.output_bytes += len(chunk)
            (self.stdout if stream == "stdout" else self.stderr).extend(chunk)
        return chunk, len(data) > room


@dataclass(frozen=True, slots=True)
class EmitRecord:
    """The job's end: build and deliver its record. ``final``: the jail is gone with it."""

    job_id: str
    status: str
    error: dict[str, Any] | None
    final: bool
    tally: Tally


@dataclass(frozen=True, slots=True)
class JailEnded:
    """The jail is gone and its evidence read (waiters on its end may go on)."""


@dataclass(frozen=True, slots=True)
class Teardown:
    """Cancel the timers, close the channel, kill whatever of the jail is left."""


@dataclass(frozen=True, slots=True)
class ArmReleaseTimer:
    pass


@dataclass(frozen=True, slots=True)
class Release:
    """Remove the job's cgroup and free its uid. The last action."""


Action = (
    StartJail | SendToJail | Ready | StartRun | ArmRunTimers | StopRunTimers | RouteCall
    | WithdrawCall | ObserveCall | ForwardOutput | DrainOutput | CodeEnded | Kill
    | AwaitLeftovers | CloseChannel | CollectEvidence | EmitRecord | JailEnded | Teardown
    | ArmReleaseTimer | Release | Relabeled
)


_FLOWS: dict[int, tuple[Policy, FlowRules]] = {}
"""``id(policy)`` -> (the policy, its compiled ``[flow]``); each policy kept alive here so
that its id is not reused. A reload makes new policies: past 256 the memo starts over."""


def _flow_rules(policy: Policy) -> FlowRules:
    """:func:`~jaild.policy.schema.flow_rules` of ``policy``, known by identity: its cache
    hashes the whole policy (every section, field by field) at each call, twice a job."""
    known = _FLOWS.get(id(policy))
    if known is not None and known[0] is policy:
        return known[1]
    rules = flow_rules(policy)
    if len(_FLOWS) >= 256:
        _FLOWS.clear()
    _FLOWS[id(policy)] = (policy, rules)
    return rules


def frame_limit(spec: JobSpec) -> int:
    """The jail link's frame limit (see :func:`jaild.protocol.messages.jail_link_max_frame`)."""
    files = spec.policy.files
    result_bytes = spec.limits.result_bytes
    if spec.keep and spec.policy.session.snapshots:  # a snapshot comes back as a result
        result_bytes = max(result_bytes, spec.policy.session.snapshot_max_bytes)
    return jail_link_max_frame(
        tool_payload_bytes=spec.limits.tool_payload_bytes,
        result_bytes=result_bytes,
        max_bytes=files.max_bytes,
        max_files=files.max_files,
        max_path_chars=files.max_path_chars,
    )


@dataclass
class _Facts:
    """What the IO has reported about the jail's end (facts, not a lifecycle)."""

    forked: bool = False  # made by a zygote
    open_streams: int = 0
    exited: bool = False
    claimed: bool = False  # a zygote job's CodeFinished, drained: it decides the record
    leftovers: Leftovers = ""  # processes of a killed nsjail
    reaped: bool = False


class _CallDesk:
    """A job's tool calls between its jail link and the broker: which frames answer the
    jail, and what is observed. It decides no kill; it says when the job must die."""

    def __init__(self, broker: Broker, conn: Connection) -> None:
        self._broker = broker
        self._conn = conn

    def call(self, call: JailCallTool, *, routing: bool) -> list[Action] | str:
        """The actions for a ``CallTool`` -- or, as a string, why the jail must be killed
        (``channel_error``). ``routing``: the job's code is running (not being killed)."""
        if not routing:
            return self.reply(call.call_id, False, ("cancelled", "the job is ending"))
        verdict = self._broker.admit(call.call_id, call.name, call.args)
        if isinstance(verdict, Admitted):
            return [RouteCall(verdict)]
        if isinstance(verdict, Answered):  # the broker's own: an intent (flow.plan)
            return [
                *self.reply(call.call_id, True, verdict.value),
                ObserveCall(None, verdict.name, "ok", 0.0, len(call.args)),
            ]
        if isinstance(verdict, Refused):
            return [
                *self.reply(call.call_id, False, (verdict.error_type, verdict.message)),
                ObserveCall(None, verdict.name, verdict.error_type, 0.0, len(call.args)),
            ]
        return verdict.message

    def answered(self, answer: Answer | None, duration_s: float) -> list[Action]:
        """A routed call's end (the broker's checked answer): tell the jail, then observe
        it (audit and metrics are not on the call's round trip)."""
        if answer is None:  # not in flight: withdrawn, or answered already
            return []
        value = answer.value if answer.ok else (answer.error_type, answer.message)
        observed = ObserveCall(answer.call_id, answer.name, answer.outcome, duration_s,
                               answer.args_bytes, answer.result_bytes)
        return [*self.reply(answer.call_id, answer.ok, value), observed]

    def reply(self, call_id: int, ok: bool, value: Any) -> list[Action]:
        if self._conn.state is not State.RUNNING:
            return []  # the code has finished (or the link is broken): nobody reads it
        if ok:
            message: Message = JailToolReturned(call_id=call_id, value=value)
        else:
            message = JailToolFailed(call_id=call_id, error_type=value[0], message=value[1])
        return [SendToJail(message, self._conn.send(message))]

    def withdraw_all(self) -> list[Action]:
        """The job is over: every call in flight is withdrawn (and not logged)."""
        calls = list(self._broker.in_flight)
        for call_id in calls:
            self._broker.withdraw(call_id)
        return [WithdrawCall(call_id) for call_id in calls]


class JobMachine:
    """One jail's lifecycle and its jobs' ends. See the module docstring.

    Args:
        spec: the jail's spec: its job's, or a placeholder's (a pooled or session jail,
            made before its job; ``has_job`` False).
        has_job: ``spec`` is a real job, owed a record.
        harden: the policy's first frame to its jails.
        seccomp_digests: the digests of the filters the jail may report it loaded (its
            policy's filters whole, or its zygote's and its own: the same verdicts).
        validators: the shared schema cache for the broker.
    """

    def __init__(
        self,
        spec: JobSpec,
        *,
        has_job: bool,
        harden: Harden,
        seccomp_digests: frozenset[str],
        validators: Validators | None = None,
    ) -> None:
        self.phase = Phase.NEW
        self.spec = spec
        self.keep = spec.keep
        self._job: JobSpec | None = spec if has_job else None
        self._harden = harden
        self._digests = seccomp_digests
        self.conn = Connection(Role.SUPERVISOR, frame_limit(spec))
        self.broker = Broker(spec.job.tools, spec.limits, spec.policy.needs_approval, validators,
                             _flow_rules(spec.policy), labels=spec.labels | spec.hold)
        self.calls = _CallDesk(self.broker, self.conn)
        self.evidence = Evidence(cpu_limit_s=float(spec.limits.cpu_time_s))
        self._facts = _Facts()
        self._log = bytearray()
        self.tally = Tally()
        self.runs = 0
        self._set_limits(spec)

    # -- queries

    @property
    def alive(self) -> bool:
        """Hardened (ready for, or running, a job) and not ended."""
        return self.evidence.jail_ready and self.phase in LIVE

    @property
    def jail_exited(self) -> bool:
        """The jail's top process (nsjail, or the zygote's child) has ended."""
        return self._facts.exited

    @property
    def has_job(self) -> bool:
        return self._job is not None

    def outcome(self) -> tuple[str, dict[str, Any] | None]:
        """How the jail ended (or the current run stands): ``(status, error)``."""
        return classify(self.evidence)

    # -- the verb

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; return what the IO must do now, in order."""
        if self.phase is Phase.RELEASED:
            if isinstance(event, (Launch, ChannelOpened, Assign, EvidenceRead, Drained)):
                raise LocalProtocolError(f"{type(event).__name__} after the jail's release")
            return []
        return _HANDLERS[type(event)](self, event)  # every Event has one: test_machine.py

    # -- commands

    def _on_Launch(self, _: Launch) -> list[Action]:
        if self.phase is not Phase.NEW:
            return []  # launched once, or ended before it was
        self.phase = Phase.STARTING
        return [StartJail()]

    def _on_Spawned(self, event: Spawned) -> list[Action]:
        self._facts.forked = event.forked
        self._facts.open_streams = event.streams
        return []

    def _on_LaunchFailed(self, event: LaunchFailed) -> list[Action]:
        self._set_kill("start_failed", f"could not start the jail: {event.detail}")
        return self._settle() if self.phase in LIVE else []

    def _on_StartFailed(self, event: StartFailed) -> list[Action]:
        return self._kill("start_failed", event.detail)

    def _on_ChannelOpened(self, _: ChannelOpened) -> list[Action]:
        if self.phase is not Phase.STARTING or self.conn.state is not State.SEND_HARDEN:
            return []
        return [self._send(self._harden)]

    def _on_Assign(self, event: Assign) -> list[Action]:
        if self._job is not None:
            raise LocalProtocolError(f"{event.job.job_id}: the jail already serves a job")
        if self.phase in (Phase.CLOSED, Phase.SETTLING):
            raise LocalProtocolError(f"{event.job.job_id}: the jail is {self.phase.value}")
        if not event.job.labels <= self.broker.labels:
            # restored state in a jail started without its labels: never run it
            raise LocalProtocolError(
                f"{event.job.job_id}: the jail does not hold the labels "
                f"{sorted(event.job.labels - self.broker.labels)} its state carries")
        spec = self.spec = self._job = event.job
        self.broker.set_job(spec.job.tools, spec.limits, spec.policy.needs_approval,
                            _flow_rules(spec.policy))
        self._set_limits(spec)
        added = self.broker.hold(spec.hold)  # before its code: what they close, closed
        actions: list[Action] = [Relabeled(added)] if added else []
        actions += [  # what the jail printed between runs is this run's
            ForwardOutput(stream, bytes(kept))
            for stream, kept in (("stdout", self.tally.stdout), ("stderr", self.tally.stderr))
            if kept
        ]
        if self.phase is Phase.IDLE and self._can_begin():
            actions += self._begin()
        elif self.phase is Phase.DONE:
            actions += self._record(final=True)
        return actions

    def _on_Drained(self, _: Drained) -> list[Action]:
        if self.phase is Phase.REPORTED and self.keep:
            self.phase = Phase.RUN_OVER
            return [StopRunTimers(), CollectEvidence(final=False)]
        if self.phase in (Phase.REPORTED, Phase.KILLING) and self._facts.forked and not self.keep:
            self._facts.claimed = self.evidence.claim is not None
            return self._maybe_settle()
        return []

    def _on_EvidenceRead(self, event: EvidenceRead) -> list[Action]:
        if self.phase is Phase.SETTLING:
            self.evidence.oom = self.evidence.oom or event.oom
            if event.syscall is not None:
                self.evidence.syscall = event.syscall
            actions = self._record(final=True) if self._job is not None else []
            self.phase = Phase.DONE
            return [*actions, JailEnded()]
        if self.phase is Phase.RUN_OVER:
            return self._run_over(event.oom)
        raise LocalProtocolError(f"evidence nobody asked for (state {self.phase.value})")

    def _on_Cleanup(self, _: Cleanup) -> list[Action]:
        if self.phase is Phase.CLOSED:
            return []
        actions: list[Action] = self.calls.withdraw_all()
        if self.phase is not Phase.DONE:
            actions.append(JailEnded())  # nothing of it will be waited for any more
        actions.append(Teardown())
        if self._facts.forked and not self._facts.reaped:
            self.phase = Phase.CLOSED
            return [*actions, ArmReleaseTimer()]
        self.phase = Phase.RELEASED
        return [*actions, Release()]

    # -- the jail's channel

    def _on_JailData(self, event: JailData) -> list[Action]:
        if self.phase not in LIVE or not event.data:
            return []
        actions: list[Action] = []
        try:
            self.conn.receive_data(event.data)
            while self.phase in LIVE:
                message = self.conn.next_event()
                if message is NEED_DATA or not isinstance(message, Message):
                    break
                actions += self._jail_message(message)
        except RemoteProtocolError as exc:
            why = f"the jail broke the tool channel protocol: {exc}"
            actions += self._kill("channel_error", why)
        return actions

    def _on_ChannelBroken(self, event: ChannelBroken) -> list[Action]:
        return self._kill("channel_error", event.detail)

    def _jail_message(self, message: Message) -> list[Action]:
        if isinstance(message, JailReady):
            return self._jail_ready(message)
        if isinstance(message, JailCallTool):
            return self._call(message)
        if isinstance(message, CodeFinished):
            return self._code_finished(message)
        return []

    def _jail_ready(self, message: JailReady) -> list[Action]:
        if message.seccomp_digest not in self._digests:
            return self._kill(
                "start_failed",
                f"the jail loaded a seccomp filter other than policy {self.spec.policy.name!r}"
                f"'s (digest {message.seccomp_digest!r}, expected one of "
                f"{sorted(self._digests)!r}); refusing it",
            )
        self.evidence.jail_ready = True
        if self.phase is not Phase.STARTING:
            return []
        self.phase = Phase.IDLE
        return [Ready(), *(self._begin() if self._job is not None and self._can_begin() else [])]

    def _can_begin(self) -> bool:
        """Not when the jail is dying already (it exited, or broke its link): its job's
        record then comes with its end."""
        ready_link = self.conn.state in (State.AWAIT_CODE, State.FINISHED)
        return ready_link and self.evidence.kill_reason is None and not self._facts.exited

    def _begin(self) -> list[Action]:
        """Send the job's code; its wall-clock limit counts from here."""
        spec = self.spec
        self.runs += 1
        self.phase = Phase.RUNNING
        # The job was checked where it arrived (a client's RunJob), the byte limits where the
        # policy was loaded (its schema's bounds are the message's); a snapshot to restore
        # comes from the store, so that message is built checked.
        make = RunCode.trusted if spec.restore is None else RunCode
        run_code = make(
            job=spec.job,
            tool_payload_bytes=spec.limits.tool_payload_bytes,
            result_bytes=spec.limits.result_bytes,
            keep=self.keep,
            snapshot=spec.snapshot,
            restore=spec.restore,
        )
        return [
            StartRun(self.runs),
            self._send(run_code),
            ArmRunTimers(self.runs, spec.limits.wall_time_s, watch_cpu=self.keep),
        ]

    def _code_finished(self, message: CodeFinished) -> list[Action]:
        result, most = message.result, self.spec.limits.result_bytes
        if result is not None and len(result) > most:  # the frame fits: a session's link
            # also carries snapshots, so its frame limit is not the result's (frame_limit)
            return self._kill("channel_error", f"the jail sent a result of {len(result)} "
                                               f"bytes; this run's limit is {most}")
        self.evidence.claim = message
        actions: list[Action] = [CodeEnded(message)]
        if self.phase is Phase.RUNNING:
            self.phase = Phase.REPORTED
            if self.keep or self._facts.forked:
                actions.append(DrainOutput())
        elif self.phase is Phase.KILLING and self._facts.forked and not self.keep:
            actions.append(DrainOutput())
        return actions

    # -- tool calls

    def _call(self, call: JailCallTool) -> list[Action]:
        # being killed: no call is routed any more
        verdict = self.calls.call(call, routing=self.phase is Phase.RUNNING)
        if isinstance(verdict, str):
            return self._kill("channel_error", verdict)
        return verdict

    def _on_ToolReplied(self, event: ToolReplied) -> list[Action]:
        answer = self.broker.answer(event.call_id, event.ok, event.value, event.duration_s,
                                    event.labels)
        actions = self.calls.answered(answer, event.duration_s)
        if answer is not None and answer.labels_added:
            actions.insert(0, Relabeled(answer.labels_added))
        return actions

    def _on_ToolTimedOut(self, event: ToolTimedOut) -> list[Action]:
        answer = self.broker.timed_out(event.call_id, event.duration_s)
        return self.calls.answered(answer, event.duration_s)

    def _on_ToolLost(self, event: ToolLost) -> list[Action]:
        if not self.broker.withdraw(event.call_id):
            return []
        why = "the client disconnected during a tool call"
        return [WithdrawCall(event.call_id), *self._kill("cancelled", why)]

    # -- output, timers, limits

    def _on_Output(self, event: Output) -> list[Action]:
        if self.evidence.kill_reason is not None or self.phase not in LIVE:
            return []
        chunk, cut = self.tally.take(event.stream, event.data, self.spec.limits.output_bytes)
        actions: list[Action] = []
        if chunk and self._job is not None:  # before its job, a jail's output is only kept
            actions.append(ForwardOutput(event.stream, chunk))
        return actions + (self._kill("output_limit", "") if cut else [])

    def _on_LogData(self, event: LogData) -> list[Action]:
        if len(self._log) < MAX_LOG_BYTES:
            self._log += event.data
        return []

    def _on_TimerFired(self, event: TimerFired) -> list[Action]:
        if event.timer == "start" and self.phase is Phase.STARTING:
            detail = f"the jail did not become ready within {START_TIMEOUT_S:g} s"
            return self._kill("start_failed", detail)
        if event.timer == "wall" and event.run == self.runs and self.phase in (
            Phase.RUNNING, Phase.REPORTED,
        ):
            return self._kill("timeout", "")
        return []

    def _on_CpuExceeded(self, event: CpuExceeded) -> list[Action]:
        if self.phase in (Phase.RUNNING, Phase.REPORTED):
            return self._kill("cpu_time", event.detail)
        return []

    def _on_Cancel(self, event: Cancel) -> list[Action]:
        return self._kill("cancelled", event.detail)

    # -- the jail's end

    def _on_StreamClosed(self, _: StreamClosed) -> list[Action]:
        self._facts.open_streams -= 1
        return self._maybe_settle()

    def _on_Exited(self, event: Exited) -> list[Action]:
        if self._facts.exited or self.phase not in (*LIVE, Phase.NEW):
            return []
        ev = self.evidence
        self._facts.exited = True
        if event.returncode is not None:
            ev.nsjail_returncode = event.returncode
        if event.failure is not None:
            self._log += event.failure.encode()
            if not ev.jail_ready:
                self._set_kill("start_failed", event.failure)
        if event.termination is not None:
            ev.termination = event.termination
        ev.cpu_s = event.cpu_s
        return self._maybe_settle()

    def _on_Vanished(self, _: Vanished) -> list[Action]:
        return self._settle() if self.phase in LIVE else []

    def _on_LeftoversGone(self, _: LeftoversGone) -> list[Action]:
        self._facts.leftovers = "gone"
        return self._maybe_settle()

    def _on_Reaped(self, _: Reaped) -> list[Action]:
        self._facts.reaped = True
        if self.phase is Phase.CLOSED:
            self.phase = Phase.RELEASED
            return [Release()]
        return []

    def _on_ReleaseTimedOut(self, _: ReleaseTimedOut) -> list[Action]:
        return self._on_Reaped(Reaped()) if self.phase is Phase.CLOSED else []

    # -- helpers

    def _send(self, message: Message) -> SendToJail:
        return SendToJail(message, self.conn.send(message))

    def _set_limits(self, spec: JobSpec) -> None:
        ev = self.evidence
        if not self.keep:  # a session's jail keeps its own (session-wide) CPU rlimit
            ev.cpu_limit_s = float(spec.limits.cpu_time_s)
        ev.wall_limit_s = spec.limits.wall_time_s
        ev.output_limit = spec.limits.output_bytes

    def _set_kill(self, reason: KillReason, detail: str) -> None:
        if self.evidence.kill_reason is None:
            self.evidence.kill_reason = reason
            self.evidence.kill_detail = detail

    def _kill(self, reason: KillReason, detail: str) -> list[Action]:
        """The daemon ends the jail. The first reason is the one that counts."""
        self._set_kill(reason, detail)
        if self.phase is Phase.NEW:
            return self._settle()  # nothing was started
        if self.phase in (Phase.KILLING, Phase.RUN_OVER) or self.phase not in LIVE:
            return []  # RUN_OVER: the run's record says why, then the jail is killed
        if self._facts.exited:
            return []  # nothing left to kill; its streams are draining
        self.phase = Phase.KILLING
        return [Kill(self.evidence.kill_reason or reason, self.evidence.kill_detail)]

    def _maybe_settle(self) -> list[Action]:
        if self.phase not in LIVE or self.phase is Phase.RUN_OVER:
            return []
        facts = self._facts
        if facts.claimed:
            return self._settle()
        if not facts.exited or facts.open_streams > 0:
            return []
        rc = self.evidence.nsjail_returncode
        if not facts.forked and rc is not None and rc < 0 and facts.leftovers != "gone":
            if facts.leftovers == "awaited":
                return []
            facts.leftovers = "awaited"
            return [AwaitLeftovers()]
        return self._settle()

    def _settle(self) -> list[Action]:
        """The jail is gone (or its result is claimed): read the host's evidence."""
        self.phase = Phase.SETTLING
        ev = self.evidence
        ev.log = self._log.decode("utf-8", "replace")
        ev.stderr_tail = self.tally.stderr[-2048:].decode("utf-8", "replace")
        actions: list[Action] = [CloseChannel()]
        actions += self.calls.withdraw_all()
        term = ev.term
        sigsys = term[3] if term and term[0] == "signaled" and term[2] == "SIGSYS" else None
        return [*actions, CollectEvidence(final=True, sigsys_pid=sigsys)]

    def _record(self, *, final: bool) -> list[Action]:
        assert self._job is not None
        status, error = classify(self.evidence)
        broker = self.broker
        tally = self.tally
        tally.calls, tally.calls_omitted = broker.entries, broker.omitted
        tally.tool_time_s = broker.tool_time_s
        tally.flow_refusals = broker.flow_refusals
        record = EmitRecord(self._job.job_id, status, error, final, tally)
        self._job = None
        return [record]

    def _run_over(self, oom: bool) -> list[Action]:
        """A session's run reported: its record, then the next run (or the jail's end)."""
        self.evidence.oom = oom
        actions = self._record(final=False)
        status = actions[0].status  # type: ignore[union-attr]
        self.evidence.oom = False
        self.evidence.claim = None
        self.broker.new_run()
        self.tally = Tally()
        self.phase = Phase.IDLE
        if status not in ("ok", "error"):  # e.g. OOM: the session cannot go on
            self.evidence.kill_reason = None  # this run's reason is in its record
            actions += self._kill("cancelled", f"the run ended {status}")
        return actions + self._maybe_settle()


_HANDLERS: dict[type[Any], Callable[[JobMachine, Any], list[Action]]] = {
    event: getattr(JobMachine, "_on_" + event.__name__) for event in get_args(Event)
}
"""Each event type's handler, :meth:`JobMachine.handle`'s one lookup (an event without a
handler fails the import; a handler without an event fails tests/unit/test_machine.py)."""


__all__ = [
    "LIVE",
    "Action",
    "Event",
    "JobMachine",
    "JobSpec",
    "Phase",
    "frame_limit",
]
