"""The job machine without a jail: scenarios, then generated event orders against its invariants.

:class:`Sim` plays the driver: it answers the machine's requests the way
:class:`jaild.daemon.jails.job.JailedJob` does (Spawned after StartJail, Drained after DrainOutput,
EvidenceRead after CollectEvidence) and keeps a jail-side Connection fed with what the
machine sends, so it can write the jail's frames. Everything else -- the jail's messages,
output, EOFs, exits, timers, replies, cancels -- is fed by the test, or by hypothesis.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaild.daemon.core.machine import (
    LIVE,
    Action,
    ArmRunTimers,
    Assign,
    Cancel,
    ChannelBroken,
    ChannelOpened,
    Cleanup,
    CollectEvidence,
    CpuExceeded,
    Drained,
    DrainOutput,
    EmitRecord,
    Event,
    EvidenceRead,
    Exited,
    ForwardOutput,
    JailData,
    JailEnded,
    JobMachine,
    JobSpec,
    Kill,
    Launch,
    LaunchFailed,
    LeftoversGone,
    LogData,
    ObserveCall,
    Output,
    Phase,
    Reaped,
    Release,
    ReleaseTimedOut,
    RouteCall,
    SendToJail,
    Spawned,
    StartJail,
    StreamClosed,
    TimerFired,
    ToolLost,
    ToolReplied,
    ToolTimedOut,
    Vanished,
    WithdrawCall,
)
from jaild.errors import LocalProtocolError
from jaild.policy.schema import Limits, load_policy_text
from jaild.protocol import PROTOCOL_VERSION, Connection, Role, pack
from jaild.protocol.framing import encode_frame
from jaild.protocol.messages import (
    CodeFinished,
    ErrorInfo,
    Harden,
    JailCallTool,
    JailReady,
    JailToolFailed,
    JailToolReturned,
    JobDescription,
    Message,
    RunCode,
    ToolSpec,
    encode,
)

POLICY = load_policy_text("", "p.toml")
DIGEST = "sha256:good"
HARDEN = Harden(protocol=PROTOCOL_VERSION, seccomp={})
TOOLS = (ToolSpec(name="echo"), ToolSpec(name="slow", timeout_s=0.5))
ARGS = pack([[], {}])
EXITED_0 = "[I][t] pid=41 ([STANDALONE MODE]) exited with status: 0, (PIDs left: 0)"
KILLED = "[I][t] pid=41 ([STANDALONE MODE]) terminated with signal: SIGKILL (9), (PIDs left: 0)"


def spec(job_id: str = "j1", *, keep: bool = False, **limits: Any) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        policy=POLICY,
        limits=dataclasses.replace(Limits(), **limits),
        job=JobDescription(code="print(1)", filename="<job>", tools=TOOLS),
        keep=keep,
    )


class Sim:
    """A stand-in driver that answers the machine's requests and checks its invariants."""

    def __init__(
        self, job: JobSpec, *, has_job: bool = True, forked: bool = False, oom: bool = False
    ) -> None:
        self.m = JobMachine(job, has_job=has_job, harden=HARDEN, seccomp_digests=frozenset({DIGEST}))
        self.forked = forked
        self.oom = oom
        self.jail = Connection(Role.JAIL, self.m.conn.max_frame_bytes)
        self.actions: list[Action] = []
        self.jobs: list[str] = [job.job_id] if has_job else []
        self.records: dict[str, list[EmitRecord]] = {}
        self.open_calls: set[int] = set()
        self.replies: list[Message] = []
        self.killed = 0
        self.ended = 0
        self.released = False
        self.finished = False  # a final record, Kill or JailEnded happened: no routing now

    # -- feeding

    def feed(self, event: Event) -> list[Action]:
        """Feed ``event``; every action it caused, the driver's answers' included, in order."""
        start = len(self.actions)
        for action in self.m.handle(event):
            self._check(action)
            self._respond(action)
        return self.actions[start:]

    def frame(self, message: Message) -> list[Action]:
        """The jail sends ``message`` (legal or not on the link: the machine must cope)."""
        try:
            data = self.jail.send(message)
        except LocalProtocolError:
            data = encode_frame(encode(message), self.jail.max_frame_bytes)
        return self.feed(JailData(data))

    def kinds(self, actions: list[Action]) -> list[str]:
        return [type(a).__name__ for a in actions]

    def end_of_jail(self, *, log: str = EXITED_0, returncode: int = 0) -> list[Action]:
        out = self.feed(LogData(log.encode()))
        out += self.feed(Exited(returncode=returncode, cpu_s=0.1))
        for _ in range(4 if not self.forked else 3):
            out += self.feed(StreamClosed())
        return out

    # -- the driver's part

    def _respond(self, action: Action) -> None:
        if isinstance(action, StartJail):
            self.feed(Spawned(self.forked, 3 if self.forked else 4))
            self.feed(ChannelOpened())
        elif isinstance(action, SendToJail):
            self.jail.receive_data(action.data)
            while isinstance(msg := self.jail.next_event(), Message):
                self.replies.append(msg)
        elif isinstance(action, DrainOutput):
            self.feed(Drained())
        elif isinstance(action, CollectEvidence):
            self.feed(EvidenceRead(oom=self.oom, syscall=None))

    def _check(self, action: Action) -> None:
        assert not self.released, f"{action} after Release"
        self.actions.append(action)
        if isinstance(action, EmitRecord):
            assert action.job_id in self.jobs
            self.records.setdefault(action.job_id, []).append(action)
            assert len(self.records[action.job_id]) == 1, "two records for one job"
            self.finished = self.finished or action.final
        elif isinstance(action, RouteCall):
            assert not self.finished, "a call routed after the job's end"
            assert self.m.phase is Phase.RUNNING
            assert action.call.call_id not in self.open_calls
            self.open_calls.add(action.call.call_id)
        elif isinstance(action, ObserveCall) and action.call_id is not None:
            self.open_calls.remove(action.call_id)  # answered exactly once
        elif isinstance(action, WithdrawCall):
            self.open_calls.remove(action.call_id)
        elif isinstance(action, Kill):
            self.killed += 1
            assert self.killed == 1, "killed twice"
            self.finished = True
        elif isinstance(action, JailEnded):
            self.ended += 1
            assert self.ended == 1, "ended twice"
            self.finished = True
            assert not self.open_calls, "calls left unanswered at the jail's end"
            if self.m.phase is Phase.DONE:  # its end is known: every job has its record
                assert all(job in self.records for job in self.jobs), (self.jobs, self.records)
        elif isinstance(action, Release):
            self.released = True

    def assign(self, job: JobSpec) -> list[Action]:
        self.jobs.append(job.job_id)
        return self.feed(Assign(job))


def ready(sim: Sim) -> list[Action]:
    out = sim.feed(Launch())
    out += sim.frame(JailReady(protocol=PROTOCOL_VERSION, seccomp_digest=DIGEST))
    return out


def record(sim: Sim, job_id: str = "j1") -> EmitRecord:
    (rec,) = sim.records[job_id]
    return rec


# --------------------------------------------------------------------------- scenarios


def test_one_shot_spawned_job() -> None:
    sim = Sim(spec())
    out = ready(sim)
    assert sim.kinds(out) == [
        "StartJail", "SendToJail", "Ready", "StartRun", "SendToJail", "ArmRunTimers",
    ]
    assert isinstance(sim.replies[0], Harden) and isinstance(sim.replies[1], RunCode)
    assert sim.replies[1].job == sim.m.spec.job  # the admitted description, sent whole
    assert out[-1] == ArmRunTimers(1, 30.0, watch_cpu=False)
    assert sim.m.phase is Phase.RUNNING and sim.m.alive
    (route,) = sim.frame(JailCallTool(call_id=1, name="echo", args=ARGS))
    assert isinstance(route, RouteCall) and route.call.timeout_s == 60.0
    out = sim.feed(ToolReplied(1, True, b"\x01", 0.25))
    # the jail gets its answer first: audit and metrics are not on the round trip
    assert sim.kinds(out) == ["SendToJail", "ObserveCall"]
    assert out[-1] == ObserveCall(1, "echo", "ok", 0.25, args_bytes=len(ARGS), result_bytes=1)
    assert sim.replies[-1] == JailToolReturned(call_id=1, value=b"\x01")
    assert sim.kinds(sim.feed(Output("stdout", b"hi\n"))) == ["ForwardOutput"]
    assert sim.kinds(sim.frame(CodeFinished(ok=True, result=b"\x02"))) == ["CodeEnded"]
    assert sim.m.phase is Phase.REPORTED
    out = sim.end_of_jail()
    assert sim.kinds(out) == ["CloseChannel", "CollectEvidence", "EmitRecord", "JailEnded"]
    rec = record(sim)
    assert (rec.status, rec.error, rec.final) == ("ok", None, True)
    assert bytes(rec.tally.stdout) == b"hi\n" and rec.tally.output_bytes == 3
    assert rec.tally.calls == [{"name": "echo", "duration_s": 0.25, "ok": True}]
    assert sim.kinds(sim.feed(Cleanup())) == ["Teardown", "Release"]
    assert sim.m.phase is Phase.RELEASED and sim.feed(Output("stdout", b"x")) == []


def test_zygote_claim_ends_the_job_before_the_jail_exits() -> None:
    sim = Sim(spec(), forked=True)
    ready(sim)
    sim.feed(Output("stdout", b"a"))
    out = sim.frame(CodeFinished(ok=False, error=ErrorInfo(type="E", message="m", traceback="")))
    assert sim.kinds(out) == [
        "CodeEnded", "DrainOutput", "CloseChannel", "CollectEvidence", "EmitRecord", "JailEnded",
    ]
    assert record(sim).status == "error" and record(sim).error["type"] == "E"  # type: ignore[index]
    assert sim.feed(Exited(termination=("signaled", 9, "SIGKILL", 7))) == []  # too late to count
    assert sim.kinds(sim.feed(Cleanup())) == ["Teardown", "ArmReleaseTimer"]
    assert sim.m.phase is Phase.CLOSED
    assert sim.kinds(sim.feed(Reaped())) == ["Release"]
    assert sim.feed(ReleaseTimedOut()) == []


def test_wall_timeout_kills_once_and_wins() -> None:
    sim = Sim(spec(wall_time_s=2.0))
    ready(sim)
    assert sim.feed(TimerFired("wall", run=1)) == [Kill("timeout", "")]
    assert sim.feed(Cancel()) == [] and sim.feed(TimerFired("wall", run=1)) == []
    assert sim.feed(Output("stdout", b"late")) == []  # a killed job's output is not taken
    sim.end_of_jail(log=KILLED, returncode=0)
    assert record(sim).status == "timeout"
    assert record(sim).error["limit"] == "wall_time_s"  # type: ignore[index]


def test_output_limit() -> None:
    sim = Sim(spec(output_bytes=4))
    ready(sim)
    out = sim.feed(Output("stderr", b"abcdef"))
    assert out == [ForwardOutput("stderr", b"abcd"), Kill("output_limit", "")]
    sim.end_of_jail(log=KILLED)
    assert record(sim).status == "output_limit"
    assert bytes(record(sim).tally.stderr) == b"abcd"


def test_wrong_seccomp_digest_is_refused() -> None:
    sim = Sim(spec())
    sim.feed(Launch())
    (kill,) = sim.frame(JailReady(protocol=PROTOCOL_VERSION, seccomp_digest="other"))
    assert isinstance(kill, Kill) and kill.reason == "start_failed" and "'other'" in kill.detail
    assert not sim.m.alive
    sim.end_of_jail(log=KILLED)
    assert record(sim).status == "internal_error"


def test_start_timeout_only_while_starting() -> None:
    sim = Sim(spec())
    sim.feed(Launch())
    (kill,) = sim.feed(TimerFired("start"))
    assert kill == Kill("start_failed", "the jail did not become ready within 30 s")
    late = Sim(spec())
    ready(late)
    assert late.feed(TimerFired("start")) == []


def test_channel_garbage_kills_the_job() -> None:
    sim = Sim(spec())
    ready(sim)
    (kill,) = sim.feed(JailData(b"\x00\x00\x00\x03\xc1\xc1\xc1"))
    assert isinstance(kill, Kill) and kill.reason == "channel_error"
    sim.end_of_jail(log=KILLED)
    assert record(sim).status == "error" and record(sim).error["type"] == "ChannelError"  # type: ignore[index]


def test_refused_and_violating_calls() -> None:
    sim = Sim(spec())
    ready(sim)
    out = sim.frame(JailCallTool(call_id=1, name="nope", args=ARGS))
    assert sim.kinds(out) == ["SendToJail", "ObserveCall"]
    assert isinstance(sim.replies[-1], JailToolFailed) and sim.replies[-1].error_type == "unknown_tool"
    sim.frame(JailCallTool(call_id=2, name="echo", args=ARGS))
    (kill,) = sim.frame(JailCallTool(call_id=2, name="echo", args=ARGS))
    assert kill == Kill("channel_error", "the jail reused call id 2 while in flight")
    # being killed: calls are refused without routing; the pending one is withdrawn at the end
    out = sim.frame(JailCallTool(call_id=3, name="echo", args=ARGS))
    assert sim.kinds(out) == ["SendToJail"] and sim.replies[-1].error_type == "cancelled"  # type: ignore[attr-defined]
    out = sim.end_of_jail(log=KILLED)
    assert WithdrawCall(2) in out
    assert [e["error_type"] for e in record(sim).tally.calls] == ["unknown_tool"]


def test_tool_timeout_and_lost_client() -> None:
    sim = Sim(spec())
    ready(sim)
    sim.frame(JailCallTool(call_id=1, name="slow", args=ARGS))
    sim.frame(JailCallTool(call_id=2, name="echo", args=ARGS))
    out = sim.feed(ToolTimedOut(1, 0.5))
    assert sim.kinds(out) == ["SendToJail", "ObserveCall"]
    assert out[-1] == ObserveCall(1, "slow", "timeout", 0.5, args_bytes=len(ARGS))
    assert sim.replies[-1] == JailToolFailed(
        call_id=1, error_type="timeout", message="slow did not answer within 0.5 s"
    )
    assert sim.feed(ToolReplied(1, True, b"", 0.6)) == []  # too late
    assert sim.feed(ToolLost(2)) == [
        WithdrawCall(2), Kill("cancelled", "the client disconnected during a tool call")
    ]
    sim.end_of_jail(log=KILLED)
    assert record(sim).status == "cancelled"


def test_killed_nsjail_waits_for_leftovers() -> None:
    sim = Sim(spec())
    ready(sim)
    sim.feed(Cancel("stop"))
    out = sim.end_of_jail(log=KILLED, returncode=-9)
    assert sim.kinds(out) == ["AwaitLeftovers"]
    assert sim.feed(StreamClosed()) == []  # still waiting
    out = sim.feed(LeftoversGone())
    assert sim.kinds(out) == ["CloseChannel", "CollectEvidence", "EmitRecord", "JailEnded"]
    assert record(sim).error == {
        "type": "Cancelled", "message": "stop", "traceback": "", "lineno": None,
    }


def test_cancel_before_launch_and_launch_failure() -> None:
    sim = Sim(spec())
    out = sim.feed(Cancel("early"))
    assert sim.kinds(out) == ["CloseChannel", "CollectEvidence", "EmitRecord", "JailEnded"]
    assert sim.feed(Launch()) == []  # nothing is started for an ended job
    failed = Sim(spec())
    failed.feed(Launch())
    failed.feed(LaunchFailed("no uids"))
    assert record(failed).status == "internal_error"
    assert record(failed).error["message"] == "could not start the jail: no uids"  # type: ignore[index]


def test_nothing_to_kill() -> None:
    sim = Sim(spec())
    sim.feed(Launch())
    assert sim.feed(Cancel()) == [Kill("cancelled", "the job was cancelled")]
    out = sim.feed(Vanished())
    assert sim.kinds(out) == ["CloseChannel", "CollectEvidence", "EmitRecord", "JailEnded"]


def test_pooled_jail_gets_its_job_later() -> None:
    sim = Sim(spec("pool-1"), has_job=False)
    assert sim.kinds(ready(sim)) == ["StartJail", "SendToJail", "Ready"]
    assert sim.m.phase is Phase.IDLE and sim.m.alive
    sim.feed(Output("stderr", b"warming"))  # before its job: kept, not streamed
    out = sim.assign(spec("pool-1"))
    assert sim.kinds(out) == [
        "ForwardOutput", "StartRun", "SendToJail", "ArmRunTimers",
    ]
    with pytest.raises(LocalProtocolError):
        sim.m.handle(Assign(spec("pool-1")))
    sim.frame(CodeFinished(ok=True))
    sim.end_of_jail()
    assert record(sim, "pool-1").status == "ok"


def test_a_jail_made_before_its_job_takes_the_jobs_labels_before_its_code() -> None:
    """``JobSpec.hold`` (``RunJob.labels``): a pooled jail, made holding nothing, holds the
    job's labels once assigned -- ``Relabeled`` comes before the code is sent; a fresh jail
    is made holding them. A job without them leaves the jail as it was (the control)."""
    sim = Sim(spec("pool-3"), has_job=False)
    ready(sim)
    given = dataclasses.replace(spec("pool-3"), hold=frozenset({"untrusted"}))
    out = sim.assign(given)
    assert sim.kinds(out)[:3] == ["Relabeled", "StartRun", "SendToJail"]
    assert sim.m.broker.labels == {"untrusted"}
    plain = Sim(spec("pool-4"), has_job=False)
    ready(plain)
    assert "Relabeled" not in plain.kinds(plain.assign(spec("pool-4")))
    assert plain.m.broker.labels == set()
    fresh = JobMachine(dataclasses.replace(spec("j9"), hold=frozenset({"private"})),
                       has_job=True, harden=HARDEN, seccomp_digests=frozenset({DIGEST}))
    assert fresh.broker.labels == {"private"}


def test_pooled_jail_that_died_gives_no_record_until_assigned() -> None:
    sim = Sim(spec("pool-2"), has_job=False)
    ready(sim)
    out = sim.end_of_jail(log=KILLED, returncode=0)
    assert sim.kinds(out) == ["CloseChannel", "CollectEvidence", "JailEnded"]
    assert sim.records == {}
    out = sim.assign(spec("pool-2"))
    assert sim.kinds(out) == ["EmitRecord"] and record(sim, "pool-2").status == "killed"


def test_session_runs() -> None:
    sim = Sim(spec("ses-1", keep=True), has_job=False, forked=True)
    ready(sim)
    sim.assign(spec("r1", keep=True))
    assert sim.actions[-1] == ArmRunTimers(1, 30.0, watch_cpu=True)
    sim.feed(Output("stdout", b"one"))
    out = sim.frame(CodeFinished(ok=True, result=b"\x01"))
    assert sim.kinds(out) == [
        "CodeEnded", "DrainOutput", "StopRunTimers", "CollectEvidence", "EmitRecord",
    ]
    assert record(sim, "r1").status == "ok" and not record(sim, "r1").final
    assert bytes(record(sim, "r1").tally.stdout) == b"one"
    assert sim.m.phase is Phase.IDLE and sim.m.alive
    sim.feed(Output("stdout", b"between"))  # kept for the next run
    assert sim.feed(TimerFired("wall", run=1)) == []  # the last run's timer: stale
    out = sim.assign(spec("r2", keep=True))
    assert out[0] == ForwardOutput("stdout", b"between") and sim.m.runs == 2
    assert isinstance(out[-1], ArmRunTimers) and out[-1].run == 2
    sim.oom = True
    sim.frame(CodeFinished(ok=False))
    assert record(sim, "r2").status == "memory_limit"
    assert sim.actions[-1] == Kill("cancelled", "the run ended memory_limit")
    sim.feed(Exited(termination=("signaled", 9, "SIGKILL", 5)))
    for _ in range(3):
        sim.feed(StreamClosed())
    assert sim.m.phase is Phase.DONE
    assert sim.m.outcome()[0] == "cancelled"


def test_session_run_hits_its_cpu_time() -> None:
    sim = Sim(spec("ses-2", keep=True), has_job=False)
    ready(sim)
    sim.assign(spec("r1", keep=True))
    assert sim.feed(CpuExceeded("CPU time limit of 1 s exceeded (this run)")) == [
        Kill("cpu_time", "CPU time limit of 1 s exceeded (this run)")
    ]
    sim.end_of_jail(log=KILLED)
    assert record(sim, "r1").status == "timeout" and record(sim, "r1").final


def test_cleanup_while_running_withdraws_calls_and_drops_the_record() -> None:
    sim = Sim(spec())
    ready(sim)
    sim.frame(JailCallTool(call_id=9, name="echo", args=ARGS))
    out = sim.feed(Cleanup())
    assert sim.kinds(out) == ["WithdrawCall", "JailEnded", "Teardown", "Release"]
    assert sim.records == {}
    with pytest.raises(LocalProtocolError):
        sim.m.handle(Assign(spec("x")))


def test_evidence_nobody_asked_for() -> None:
    sim = Sim(spec())
    ready(sim)
    with pytest.raises(LocalProtocolError):
        sim.m.handle(EvidenceRead(oom=False))


# --------------------------------------------------------------------------- generated orders


def _jail_frames(draw: Any) -> Message | bytes:
    """Mostly tool calls; now and then the code's end, a second JailReady, or garbage."""
    call = st.builds(
        JailCallTool,
        call_id=st.integers(0, 40),
        name=st.sampled_from(["echo", "slow", "nope"]),
        args=st.just(ARGS),
    )
    rare = st.one_of(
        st.builds(CodeFinished, ok=st.booleans(), result=st.none()),
        st.builds(
            JailReady,
            protocol=st.just(PROTOCOL_VERSION),
            seccomp_digest=st.sampled_from([DIGEST, "bad"]),
        ),
        st.binary(max_size=12),
    )
    if draw(st.integers(0, 9)) < 8:
        return draw(call)
    return draw(rare)


@st.composite
def _step(draw: Any) -> tuple[str, Any]:
    kind = draw(
        st.sampled_from(
            [
                *["frame"] * 16, *["reply"] * 8, *["output"] * 3, "eof", "eof", "exit",
                "timeout", "timeout", "lost", "timer", "cpu", "cancel", "vanish", "leftovers",
                "reaped", "release_timer", "assign", "assign", "cleanup", "log", "broken",
            ]
        )
    )
    if kind == "frame":
        return kind, _jail_frames(draw)
    if kind == "output":
        return kind, (draw(st.sampled_from(["stdout", "stderr"])), draw(st.binary(max_size=40)))
    if kind == "exit":
        return kind, draw(st.sampled_from([0, 1, -9, None]))
    if kind in ("reply", "timeout", "lost"):  # (which call in flight, or any id), ok?
        return kind, (draw(st.integers(0, 40)), draw(st.booleans()))
    if kind == "timer":
        return kind, (draw(st.sampled_from(["start", "wall"])), draw(st.integers(0, 3)))
    return kind, None


def _apply(sim: Sim, kind: str, arg: Any, serial: list[int]) -> None:
    if kind == "frame":
        if isinstance(arg, bytes):
            sim.feed(JailData(arg))
        else:
            sim.frame(arg)
    elif kind == "output":
        sim.feed(Output(*arg))
    elif kind == "eof":
        sim.feed(StreamClosed())
    elif kind == "exit":
        if arg is None:
            sim.feed(Exited(failure="the zygote could not fork"))
        elif sim.forked:
            term = ("signaled", -arg, "SIGKILL", 3) if arg < 0 else ("exited", arg, "", 3)
            sim.feed(Exited(termination=term))
        else:
            sim.feed(Exited(returncode=arg))
    elif kind in ("reply", "timeout", "lost"):
        pending = sorted(sim.open_calls)
        call_id = pending[arg[0] % len(pending)] if pending and arg[0] < 30 else arg[0]
        if kind == "reply":
            sim.feed(ToolReplied(call_id, arg[1], b"v" if arg[1] else ("E", "m"), 0.1))
        elif kind == "timeout":
            sim.feed(ToolTimedOut(call_id, 0.5))
        else:
            sim.feed(ToolLost(call_id))
    elif kind == "timer":
        sim.feed(TimerFired(arg[0], arg[1]))
    elif kind == "assign":
        if not sim.m.has_job and sim.m.phase not in (Phase.CLOSED, Phase.RELEASED):
            serial[0] += 1
            sim.assign(spec(f"job-{serial[0]}", keep=sim.m.keep, output_bytes=64))
    else:
        event = {
            "cpu": CpuExceeded("cpu"),
            "cancel": Cancel(),
            "vanish": Vanished(),
            "leftovers": LeftoversGone(),
            "reaped": Reaped(),
            "release_timer": ReleaseTimedOut(),
            "cleanup": Cleanup(),
            "log": LogData(b"[W] noise\n"),
            "broken": ChannelBroken("the jail does not read its tool replies"),
        }[kind]
        sim.feed(event)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    has_job=st.booleans(),
    keep=st.booleans(),
    forked=st.booleans(),
    oom=st.booleans(),
    early_ready=st.sampled_from([True, True, True, False]),
    steps=st.lists(_step(), min_size=4, max_size=60),
)
def test_invariants_hold_for_any_event_order(
    has_job: bool,
    keep: bool,
    forked: bool,
    oom: bool,
    early_ready: bool,
    steps: list[tuple[str, Any]],
) -> None:
    """Whatever the jail, the client and the timers do, in whatever order: one record per
    job (exactly one once the jail's end is known), no call routed after the job's end,
    every routed call answered or withdrawn once, one Kill, one JailEnded, nothing after
    Release. (The checks are in Sim._check.)"""
    sim = Sim(spec("first", keep=keep, output_bytes=64), has_job=has_job, forked=forked, oom=oom)
    sim.feed(Launch())
    if early_ready:  # most jails come up: start most examples from there
        sim.frame(JailReady(protocol=PROTOCOL_VERSION, seccomp_digest=DIGEST))
    serial = [0]
    for kind, arg in steps:
        _apply(sim, kind, arg, serial)
    # then the jail ends, whatever it was doing: every job must have its record
    if sim.m.phase in LIVE:
        sim.feed(Cancel("the test ends"))
        sim.feed(Exited(returncode=-9, termination=("signaled", 9, "SIGKILL", 3)))
        for _ in range(4):
            sim.feed(StreamClosed())
        sim.feed(LeftoversGone())
    if sim.m.phase is Phase.DONE:
        assert all(job in sim.records for job in sim.jobs)
    assert sim.m.phase in (Phase.DONE, Phase.CLOSED, Phase.RELEASED, Phase.SETTLING) or (
        sim.m.phase is Phase.NEW
    ), sim.m.phase
    sim.feed(Cleanup())
    sim.feed(Reaped())
    assert sim.released and sim.m.phase is Phase.RELEASED
    assert not sim.open_calls


def test_the_driver_performs_every_action_the_machine_can_return() -> None:
    """JailedJob._perform looks each action up by its type: the table must hold every one."""
    from jaild.daemon.core.machine import Action
    from jaild.daemon.jails.job import _PERFORM

    assert set(_PERFORM) == set(typing.get_args(Action))


def test_every_event_has_a_handler_and_every_handler_an_event() -> None:
    """JobMachine.handle looks each event up by its type (machine._HANDLERS, built at import,
    so an event without a handler fails the import): no handler may be left without its
    event either, which would be a rule nothing ever runs."""
    from jaild.daemon.core.machine import _HANDLERS, Event, JobMachine

    assert set(_HANDLERS) == set(typing.get_args(Event))
    handlers = {name.removeprefix("_on_") for name in vars(JobMachine) if name.startswith("_on_")}
    assert handlers == {event.__name__ for event in typing.get_args(Event)}


def test_a_session_result_beyond_its_limit_is_refused_though_its_frame_fits() -> None:
    """A session's link carries snapshots, so its frame limit is the larger of the two: a
    run's result past ``result_bytes`` (the jail's runtime bypassed) is refused by the daemon
    itself, not by the frame limit (positive control: one byte less is the run's result)."""
    for size, expected in ((64, "ok"), (65, "channel_error")):
        sim = Sim(spec(keep=True, result_bytes=64))
        assert sim.m.conn.max_frame_bytes > 1 << 20  # room for a snapshot
        ready(sim)
        out = sim.frame(CodeFinished(ok=True, result=b"r" * size))
        if expected == "ok":
            assert sim.kinds(out)[0] == "CodeEnded"
        else:
            assert Kill("channel_error", "the jail sent a result of 65 bytes; this run's "
                        "limit is 64") in out


def test_a_policys_flow_rules_are_known_by_the_policy_object() -> None:
    """Two jobs' worth of flow rules per jail: compiled once per policy object, found by its
    identity (not by hashing the whole policy); another policy object, even an equal one,
    gets its own, as the cache of ``flow_rules`` would give."""
    from jaild.daemon.core.machine import _flow_rules
    from jaild.policy.schema import flow_rules

    first = _flow_rules(POLICY)
    assert _flow_rules(POLICY) is first and first == flow_rules(POLICY)
    other = load_policy_text("", "q.toml")
    assert _flow_rules(other) == flow_rules(other)


def test_the_code_a_jail_receives_is_what_the_checked_message_would_be() -> None:
    """``RunCode`` is built from the admitted job without its checks run again: the jail's end
    decodes it, every check run, into the message the checked constructor makes."""
    sim = Sim(spec())
    ready(sim)
    limits = sim.m.spec.limits
    assert sim.replies[1] == RunCode(job=sim.m.spec.job, result_bytes=limits.result_bytes,
                                     tool_payload_bytes=limits.tool_payload_bytes)
