"""The sans-IO protocol: framing, messages, the connection state machine, error codes.

Every input is fed twice: whole, and one byte at a time. Every hostile input has its
positive control: the same message without the defect is accepted, so a rejection can
only come from the defect.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest

from jaild import errors
from jaild.errors import (
    ERROR_CLASSES,
    FrameTooLarge,
    InternalError,
    JaildError,
    LocalProtocolError,
    RemoteProtocolError,
    UnexpectedMessage,
    UnsupportedVersion,
    error_from_wire,
)
from jaild.protocol import (
    CLOSED,
    MESSAGES,
    NEED_DATA,
    PROTOCOL_VERSION,
    Connection,
    FrameDecoder,
    Role,
    State,
    decode,
    encode,
    encode_frame,
)
from jaild.protocol.connection import INITIAL_STATE, RECV, SEND, TRANSITIONS
from jaild.protocol.fields import MAX_ANY_DEPTH
from jaild.protocol.framing import HEADER_BYTES
from jaild.protocol.messages import (
    MAX_CODE_CHARS,
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    MAX_PAYLOAD_BYTES,
    MAX_REF,
    MAX_TOOLS,
    ApprovalList,
    ApprovalPending,
    ApprovalRecorded,
    ApproveCall,
    CancelJob,
    ClientCallTool,
    ClientToolFailed,
    ClientToolReturned,
    CloseSession,
    CodeFinished,
    DeleteSnapshot,
    Error,
    ErrorInfo,
    GetStats,
    Harden,
    Hello,
    JailCallTool,
    JailReady,
    JailToolFailed,
    JailToolReturned,
    JobAccepted,
    JobDescription,
    JobFinished,
    JobList,
    JobOutput,
    Kill,
    Killed,
    ListApprovals,
    ListJobs,
    ListPolicies,
    ListSnapshots,
    Message,
    NetworkRefusal,
    OpenSession,
    PauseSession,
    Ping,
    PolicyList,
    Pong,
    ResumeRun,
    ResumeSession,
    RunCode,
    RunJob,
    RunParked,
    SessionClosed,
    SessionOpened,
    SessionPaused,
    SnapshotDeleted,
    SnapshotList,
    SnapshotSession,
    SnapshotTaken,
    Starting,
    Stats,
    ToolSpec,
    Welcome,
)

MAX_FRAME = 1 << 22

SENDER = {
    "client->daemon": Role.CLIENT,
    "daemon->client": Role.DAEMON,
    "daemon->jail": Role.SUPERVISOR,
    "jail->daemon": Role.JAIL,
}
RECEIVER = {
    "client->daemon": Role.DAEMON,
    "daemon->client": Role.CLIENT,
    "daemon->jail": Role.JAIL,
    "jail->daemon": Role.SUPERVISOR,
}
RECV_DIRECTION = {role: d for d, role in RECEIVER.items()}
SEND_DIRECTION = {role: d for d, role in SENDER.items()}

JOB = "job-0123456789abcdef"
SPEC = ToolSpec(
    name="search",
    description="Search the catalogue.",
    parameters={"type": "object", "properties": {"query": {"type": "string"}}},
)
RECORD = {
    "job_id": JOB,
    "policy": "default",
    "status": "error",
    "stdout": "hi\n",
    "stderr": "",
    "error": {"type": "ValueError", "message": "bad", "traceback": "", "lineno": 3},
    "tool_calls": [{"name": "search", "duration_s": 0.25, "ok": True}],
    "duration_s": 1.5,
    "limits": {"wall_time_s": 30.0, "memory_mb": 256, "network": "none"},
    "usage": {
        "wall_s": 1.2, "cpu_user_s": 0.5, "cpu_system_s": None, "memory_peak_bytes": 1 << 20,
        "pids_peak": 3, "output_bytes": 3, "tool_calls": 1, "tool_time_s": 0.25,
        "stream_paused_s": 0.0, "stream_dropped_bytes": 0,
    },
    "files": [{"path": "out/r.csv", "size": 4, "sha256": "0" * 64}],
    "files_skipped": [],
    "tool_calls_omitted": 0,
    "session": None,
}
SESSION = {"policy": "default", "idle_s": 300.0, "max_lifetime_s": 3600.0,
           "limits": {"wall_time_s": 30.0, "slow_client": "pause"}}
OK_RECORD = {**RECORD, "status": "ok", "error": None, "usage": None, "files": [],
             "tool_calls": []}
POOL = {"mode": "spawn", "min": 0, "max": 4, "target": 1, "ready": 1}
POLICY = {
    "name": "default", "description": "", "limits": {"memory_mb": 256}, "network": "none", "egress": [],
    "seccomp": {"profile": "default", "action": "kill"}, "env": "default", "available": True,
    "problems": "", "pool": POOL,
}
JOB_ENTRY = {"id": JOB, "kind": "job", "policy": "default", "uid": 0, "client_pid": 1,
             "state": "running", "age_s": 0.5}
TOTALS = {
    "jobs": 1, "statuses": {"ok": 1}, "wall_s": 0.1, "cpu_user_s": 0.0, "cpu_system_s": 0.0,
    "memory_peak_bytes": 0, "pids_peak": 0, "output_bytes": 0, "tool_calls": 0,
    "tool_time_s": 0.0, "files_uploaded": 0, "files_downloaded": 0, "sessions": 0,
}
SNAP = "snap-0123456789abcdef0123456789abcdef"
SNAPSHOT = {"id": SNAP, "policy": "default", "bytes": 4096, "created": 1.7e9,
            "expires": 1.7e9 + 604800, "session": "ses-0123abcd", "kind": "snapshot",
            "sha256": "ab" * 32}
PAUSED_STATE = {"id": "snap-" + "f" * 32, "policy": "p", "bytes": 0, "created": 0.0,
                "expires": 0.0, "session": "ses-" + "z" * 60}  # kind and sha256: the defaults
APPROVAL = {"job_id": JOB, "call_id": 1, "tool": "search",
            "args": msgpack.packb([[], {"query": "x"}]), "policy": "default", "owner": "uid 1000",
            "waiting_s": 12.5, "parked": False, "attached": True}
PARKED_APPROVAL = {**APPROVAL, "call_id": MAX_REF, "tool": "t" * MAX_NAME_CHARS,
                   "args": b"x" * (1 << 20), "owner": "o" * 1024, "waiting_s": 0.0,
                   "parked": True, "attached": False, "session": "ses-" + "a" * 60}
STATS = {"since": 1.0, "policies": {"default": TOTALS}, "uids": {"0": TOTALS},
         "pods": {"agents/agent-7f9c": TOTALS}, "principals": {"spiffe://jaild.test/agent/alice": TOTALS}, "running": {"jobs": 0, "sessions": 0, "connections": 1}, "pools": {"default": POOL},
         "metrics": {"jobs": {}}}

# Every message class, at least twice: required fields only, and every field set (edges where
# a limit is cheap to reach). Keyed by direction, in MESSAGES order.
SAMPLES: dict[str, list[Message]] = {
    "client->daemon": [
        Hello(protocol=PROTOCOL_VERSION),
        Hello(protocol=PROTOCOL_VERSION, client="jaild-py/0.1.0 ünïcode ✓"),
        RunJob(ref=0, job=JobDescription(code=""), policy="d"),
        RunJob(
            ref=MAX_REF,
            job=JobDescription(
                code="print(await tools.search(query='x'))\n" * 3,
                tools=(SPEC, ToolSpec(name="_x.y-z")),
                filename="<job>",
            ),
            policy="default",
            limits={"wall_time_s": 0.5, "memory_mb": 64},
        ),
        CancelJob(job_id=JOB),
        CancelJob(job_id="a" * 64),
        ListPolicies(ref=7),
        ClientToolReturned(job_id=JOB, call_id=1, value=b""),
        ClientToolReturned(job_id=JOB, call_id=MAX_REF, value=msgpack.packb([1, "two", b"3"])),
        ClientToolReturned(job_id=JOB, call_id=1, value=b"", labels=("private", "user:alice")),
        ClientToolFailed(job_id=JOB, call_id=2, error_type="KeyError", message=""),
        ClientToolFailed(job_id=JOB, call_id=2, error_type="E" * 256, message="m" * 1000),
        RunJob(
            ref=2,
            job=JobDescription(
                code="x += 1",
                files={"in/data.csv": b"a,b\n1,2\n", "blob": bytes(range(256))},
                download=["*.csv", "out/*"],
            ),
            policy="default",
            session_id="ses-0123abcd",
        ),
        OpenSession(ref=4, policy="default"),
        OpenSession(
            ref=5, policy="p", tools=(SPEC,), limits={"wall_time_s": 1}, idle_s=30,
            max_lifetime_s=600,
        ),
        CloseSession(session_id="ses-0123abcd"),
        ListJobs(ref=6),
        Kill(ref=8, id=JOB),
        Kill(ref=8, id="ses-0123abcd"),
        GetStats(ref=9),
        OpenSession(ref=10, policy="default", from_snapshot=SNAP),
        OpenSession(
            ref=MAX_REF, policy="p", tools=(SPEC, ToolSpec(name="t", approval=True)),
            limits={"memory_mb": 64}, idle_s=0.001, max_lifetime_s=1 << 31,
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            from_snapshot="snap-" + "f" * 32, pause_after_s=0.001,
        ),
        OpenSession(ref=11, policy="p", pause_after_s=1 << 31),
        SnapshotSession(ref=12, session_id="ses-0123abcd"),
        SnapshotSession(ref=MAX_REF, session_id="ses-" + "z" * 60, ttl_s=1),
        SnapshotSession(ref=12, session_id="ses-0", ttl_s=1 << 31),
        PauseSession(ref=13, session_id="ses-0123abcd"),
        ResumeSession(ref=14, session_id="ses-0123abcd"),
        ListSnapshots(ref=15),
        DeleteSnapshot(ref=16, snapshot_id=SNAP),
        DeleteSnapshot(ref=MAX_REF, snapshot_id="snap-" + "0" * 32),
        ApproveCall(ref=17, job_id=JOB, call_id=1, allow=True),
        ApproveCall(ref=MAX_REF, job_id="a" * 64, call_id=MAX_REF, allow=False,
                    reason="réason ✓" * 128),
        ApproveCall(ref=0, job_id=JOB, call_id=0, allow=False, reason=""),
        ResumeRun(ref=18, job_id=JOB),
        ResumeRun(ref=MAX_REF, job_id=JOB,
                  tools=(SPEC, ToolSpec(name="_x.y-z", timeout_s=86400, approval=True))),
        ListApprovals(ref=19),
        Ping(seq=1),
        Pong(seq=2),
    ],
    "daemon->client": [
        Welcome(protocol=PROTOCOL_VERSION),
        Welcome(protocol=PROTOCOL_VERSION, daemon="jaild/0.1.0"),
        Welcome(protocol=PROTOCOL_VERSION, daemon="jaild/0.1.0",
                starting=Starting(pending="running the self-tests of policies default",
                                  wait_s=300.0)),
        JobAccepted(ref=1, job_id=JOB),
        JobAccepted(ref=1, job_id=JOB, session_id="ses-0123456789abcdef"),
        JobOutput(job_id=JOB, stream="stdout", data=b"hello\n"),
        JobOutput(job_id=JOB, stream="stderr", data=b"\xff\xfe not utf-8"),
        ClientCallTool(job_id=JOB, call_id=0, name="search", args=msgpack.packb([[], {}])),
        JobFinished(job_id=JOB, record=OK_RECORD),  # type: ignore[arg-type]
        JobFinished(job_id=JOB, record=RECORD,  # type: ignore[arg-type]
                    result=msgpack.packb({"answer": 42})),
        PolicyList(ref=3, policies=()),
        PolicyList(ref=3, policies=(POLICY,)),  # type: ignore[arg-type]
        Error(code="busy", message="try later"),
        Error(code="unknown_job", message="no job", ref=5, job_id=JOB),
        JobFinished(job_id=JOB, record=RECORD,  # type: ignore[arg-type]
                    files={"out/r.csv": b"x,y\n"}),
        SessionOpened(ref=4, session_id="ses-0123abcd", record=SESSION),  # type: ignore[arg-type]
        SessionClosed(session_id="ses-0123abcd", reason="idle", message="idle for 300 s"),
        JobList(ref=6, jobs=()),
        JobList(ref=6, jobs=(JOB_ENTRY,)),  # type: ignore[arg-type]
        Killed(ref=8, id=JOB, kind="job"),
        Stats(ref=9, stats=STATS),  # type: ignore[arg-type]
        SnapshotTaken(ref=12, snapshot=SNAPSHOT),  # type: ignore[arg-type]
        SnapshotTaken(ref=MAX_REF, snapshot=PAUSED_STATE),  # type: ignore[arg-type]
        SessionPaused(ref=13, session_id="ses-0123abcd", bytes=4096),
        SessionPaused(ref=0, session_id="ses-" + "z" * 60, bytes=1 << 40),  # an idle pause
        SessionPaused(ref=MAX_REF, session_id="ses-0", bytes=0),
        SnapshotList(ref=15, snapshots=()),
        SnapshotList(ref=15, snapshots=(SNAPSHOT, {**PAUSED_STATE, "kind": "pause"})),  # type: ignore[arg-type]
        SnapshotDeleted(ref=16, snapshot_id=SNAP),
        ApprovalPending(job_id=JOB, call_id=1, name="search",
                        args=msgpack.packb([[], {"query": "x"}])),
        ApprovalPending(job_id="a" * 64, call_id=MAX_REF, name="n" * MAX_NAME_CHARS, args=b""),
        RunParked(job_id=JOB, call_id=1),
        RunParked(job_id=JOB, call_id=MAX_REF, message="parked after 300 s ✓"),
        RunParked(job_id=JOB, call_id=1, session_id="ses-0123456789abcdef"),
        ApprovalRecorded(ref=17, job_id=JOB, call_id=1, allow=True),
        ApprovalRecorded(ref=MAX_REF, job_id=JOB, call_id=MAX_REF, allow=False),
        ApprovalList(ref=19, approvals=()),
        ApprovalList(ref=19, approvals=(APPROVAL, PARKED_APPROVAL)),  # type: ignore[arg-type]
        Ping(seq=3),
        Pong(seq=4),
    ],
    "daemon->jail": [
        Harden(protocol=PROTOCOL_VERSION, seccomp={}),
        Harden(
            protocol=PROTOCOL_VERSION,
            seccomp={"default": "kill",
                     "rules": [["read", "allow", []], ["clone", "allow", [[0, 1]]]]},
        ),
        Harden(
            protocol=PROTOCOL_VERSION, seccomp={},
            network=NetworkRefusal(families=(2, 10), explanation="policy 'p' has no network"),
        ),
        RunCode(
            job=JobDescription(code="1 + 1", filename="<job>"),
            tool_payload_bytes=0,
            result_bytes=0,
        ),
        RunCode(
            job=JobDescription(code="x", filename="f.py", tools=(SPEC,)),
            tool_payload_bytes=MAX_PAYLOAD_BYTES,
            result_bytes=MAX_PAYLOAD_BYTES,
        ),
        RunCode(
            job=JobDescription(
                code="y = x",
                filename="<job>",
                files={"a.txt": b"1"},
                download=["*"],
            ),
            tool_payload_bytes=64,
            result_bytes=64,
            keep=True,
        ),
        RunCode(
            job=JobDescription(code="", filename="<snapshot>"),
            tool_payload_bytes=64,
            result_bytes=32 << 20,
            keep=True,
            snapshot=True,
        ),
        RunCode(
            job=JobDescription(code="", filename="<restore>", tools=(SPEC,)),
            tool_payload_bytes=0,
            result_bytes=0,
            keep=True,
            restore=msgpack.packb({"format": "jaild-snapshot", "version": 1, "state": b"\x80"}),
        ),
        RunCode(
            job=JobDescription(code="", filename="<restore>"),
            tool_payload_bytes=0,
            result_bytes=0,
            snapshot=False,
            restore=b"",
        ),
        JailToolReturned(call_id=1, value=msgpack.packb(None)),
        JailToolFailed(call_id=1, error_type="unknown_tool", message="no tool named 'x'"),
    ],
    "jail->daemon": [
        JailReady(protocol=PROTOCOL_VERSION),
        JailReady(protocol=PROTOCOL_VERSION, python="3.12.3"),
        JailCallTool(call_id=1, name="search", args=msgpack.packb([["x"], {"k": 1}])),
        JailCallTool(call_id=MAX_REF, name="n" * MAX_NAME_CHARS, args=b""),
        CodeFinished(ok=True),
        CodeFinished(ok=True, result=msgpack.packb([1, 2.5, None])),
        CodeFinished(
            ok=False,
            error=ErrorInfo(type="ZeroDivisionError", message="division by zero",
                            traceback="Traceback ...", lineno=1),
        ),
        CodeFinished(ok=False, error=ErrorInfo(type="E", message="")),
        CodeFinished(ok=True, network_refused=MAX_REF),
        CodeFinished(
            ok=True,
            files={"files": [{"path": "o.txt", "size": 1, "sha256": "0" * 64}],
                   "data": {"o.txt": b"1"}, "skipped": []},
        ),
    ],
}

ALL_SAMPLES = [(d, m) for d, ms in SAMPLES.items() for m in ms]


def sample_id(value: Any) -> str:
    if isinstance(value, Message):
        return value.TYPE
    return str(value)


def first(direction: str, type_name: str) -> Message:
    return next(m for m in SAMPLES[direction] if type_name == m.TYPE)


def states_of(role: Role) -> list[State]:
    """Every state a role can be in: the table's keys, their targets, and CLOSED."""
    found = [INITIAL_STATE[role]]
    for (r, s), moves in TRANSITIONS.items():
        if r is role:
            found += [s, *moves.values()]
    found.append(State.CLOSED)
    return list(dict.fromkeys(found))


def legal_state(role: Role, verb: str, type_name: str) -> State:
    for (r, s), moves in TRANSITIONS.items():
        if r is role and (verb, type_name) in moves:
            return s
    raise AssertionError(f"{role} can never {verb} {type_name}")


def conn_in(role: Role, state: State, max_frame: int = MAX_FRAME) -> Connection:
    conn = Connection(role, max_frame)
    conn.state = state
    return conn


def chunks(data: bytes, how: str) -> Iterator[bytes]:
    if how == "whole":
        yield data
    else:
        for i in range(len(data)):
            yield data[i : i + 1]


def receive_all(conn: Connection, data: bytes, how: str) -> list[Any]:
    """Feed ``data`` as ``how`` says and return every event after each chunk (NEED_DATA too)."""
    events: list[Any] = []
    for chunk in chunks(data, how):
        conn.receive_data(chunk)
        while True:
            event = conn.next_event()
            events.append(event)
            if event is NEED_DATA or event is CLOSED:
                break
    return events


def messages(events: list[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, Message)]


FEEDS = ["whole", "bytewise"]


def test_samples_cover_every_message_of_every_direction() -> None:
    for direction, table in MESSAGES.items():
        assert {type(m) for m in SAMPLES[direction]} == set(table.values()), direction


# --------------------------------------------------------------------------- framing


def test_frame_is_a_big_endian_length_then_the_payload() -> None:
    assert encode_frame(b"abc", 10) == b"\x00\x00\x00\x03abc"
    assert encode_frame(b"", 10) == b"\x00\x00\x00\x00"
    assert encode_frame(b"x" * 258, 300)[:4] == b"\x00\x00\x01\x02"


@pytest.mark.parametrize("how", FEEDS)
def test_decoder_yields_each_frame_exactly_when_complete(how: str) -> None:
    payloads = [b"", b"a", b"hello world", bytes(range(256)) * 3, b"\x00\x00\x00\x05"]
    stream = b"".join(encode_frame(p, 1 << 16) for p in payloads)
    ends = []
    pos = 0
    for p in payloads:
        pos += HEADER_BYTES + len(p)
        ends.append(pos)
    dec = FrameDecoder(1 << 16)
    got: list[tuple[int, bytes]] = []
    fed = 0
    for chunk in chunks(stream, how):
        dec.feed(chunk)
        fed += len(chunk)
        while (frame := dec.next_frame()) is not None:
            got.append((fed, frame))
    assert [f for _, f in got] == payloads
    if how == "bytewise":
        assert [at for at, _ in got] == ends  # not a byte earlier, not a byte later
    assert dec.buffered_bytes == 0
    assert dec.next_frame() is None


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 4096])
def test_decoder_any_chunk_size_and_long_streams(size: int) -> None:
    # more than the decoder's compaction threshold (64 KiB) in total
    payloads = [bytes([i % 251]) * (i % 97) for i in range(3000)]
    stream = b"".join(encode_frame(p, 1 << 16) for p in payloads)
    assert len(stream) > 1 << 17
    dec = FrameDecoder(1 << 16)
    got = []
    for i in range(0, len(stream), size):
        dec.feed(stream[i : i + size])
        while (frame := dec.next_frame()) is not None:
            got.append(frame)
    assert got == payloads


def test_frame_of_exactly_the_maximum_is_accepted() -> None:
    dec = FrameDecoder(100)
    dec.feed(encode_frame(b"x" * 100, 100))
    assert dec.next_frame() == b"x" * 100


def test_sender_refuses_a_frame_over_its_limit() -> None:
    with pytest.raises(LocalProtocolError, match="101-byte frame"):
        encode_frame(b"x" * 101, 100)


@pytest.mark.parametrize("how", FEEDS)
def test_oversize_frame_is_rejected_from_the_header_alone(how: str) -> None:
    header = (101).to_bytes(4, "big")
    dec = FrameDecoder(100)
    for chunk in chunks(header, how):
        dec.feed(chunk)
        if dec.buffered_bytes < HEADER_BYTES:
            assert dec.next_frame() is None
    assert dec.buffered_bytes == HEADER_BYTES  # the header and not one byte of body
    with pytest.raises(FrameTooLarge, match="announces 101 bytes"):
        dec.next_frame()


def test_oversize_frame_breaks_the_connection() -> None:
    conn = conn_in(Role.DAEMON, State.READY, max_frame=100)
    conn.receive_data((2**32 - 1).to_bytes(4, "big"))
    with pytest.raises(FrameTooLarge) as first_exc:
        conn.next_event()
    assert first_exc.value.code == "frame_too_large"
    assert conn.state is State.CLOSED
    conn.receive_data(encode_frame(encode(first("client->daemon", "ListPolicies")), 100))
    with pytest.raises(FrameTooLarge) as again:
        conn.next_event()
    assert again.value is first_exc.value


def test_positive_control_a_frame_of_the_same_shape_under_the_limit_is_read() -> None:
    conn = conn_in(Role.DAEMON, State.READY, max_frame=100)
    conn.receive_data(encode_frame(encode(ListPolicies(ref=1)), 100))
    assert conn.next_event() == ListPolicies(ref=1)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("how", FEEDS)
@pytest.mark.parametrize(("direction", "msg"), ALL_SAMPLES, ids=sample_id)
def test_every_message_round_trips_through_connections(direction: str, msg: Message,
                                                       how: str) -> None:
    sender_role, receiver_role = SENDER[direction], RECEIVER[direction]
    sender = conn_in(sender_role, legal_state(sender_role, SEND, msg.TYPE))
    receiver = conn_in(receiver_role, legal_state(receiver_role, RECV, msg.TYPE))
    receiver_state = receiver.state
    data = sender.send(msg)
    assert data[:4] == (len(data) - 4).to_bytes(4, "big")
    events = receive_all(receiver, data, how)
    assert messages(events) == [msg]
    received = messages(events)[0]
    assert type(received) is type(msg)
    if how == "bytewise":
        # NEED_DATA after every byte but the last; the message exactly at the last byte
        assert events[:-2] == [NEED_DATA] * (len(data) - 1)
        assert events[-2:] == [msg, NEED_DATA]
    assert receiver.state is TRANSITIONS[(receiver_role, receiver_state)][(RECV, msg.TYPE)]
    assert decode(encode(msg), direction) == msg  # type: ignore[arg-type]


def test_several_messages_in_one_read_come_out_in_order() -> None:
    sender = conn_in(Role.DAEMON, State.READY)
    msgs = [m for m in SAMPLES["daemon->client"] if not isinstance(m, Welcome)]
    data = b"".join(sender.send(m) for m in msgs)
    for how in FEEDS:
        receiver = conn_in(Role.CLIENT, State.READY)
        assert messages(receive_all(receiver, data, how)) == msgs


def test_a_whole_client_conversation() -> None:
    client = Connection(Role.CLIENT, MAX_FRAME)
    daemon = Connection(Role.DAEMON, MAX_FRAME)

    def to_daemon(msg: Message) -> Message:
        daemon.receive_data(client.send(msg))
        event = daemon.next_event()
        assert event == msg
        return event  # type: ignore[return-value]

    def to_client(msg: Message) -> Message:
        client.receive_data(daemon.send(msg))
        event = client.next_event()
        assert event == msg
        return event  # type: ignore[return-value]

    assert (client.state, daemon.state) == (State.SEND_HELLO, State.AWAIT_HELLO)
    to_daemon(Hello(protocol=PROTOCOL_VERSION, client="test"))
    assert (client.state, daemon.state) == (State.AWAIT_WELCOME, State.SEND_WELCOME)
    to_client(Welcome(protocol=PROTOCOL_VERSION, daemon="jaild/test"))
    assert client.state is State.READY
    to_daemon(RunJob(
        ref=1,
        job=JobDescription(code="await tools.search(query='x')", tools=(SPEC,)),
        policy="default",
    ))
    to_client(JobAccepted(ref=1, job_id=JOB))
    to_client(JobOutput(job_id=JOB, stream="stdout", data=b"..."))
    to_client(ClientCallTool(job_id=JOB, call_id=1, name="search", args=msgpack.packb([[], {}])))
    to_daemon(ClientToolReturned(job_id=JOB, call_id=1, value=msgpack.packb(["X"])))
    to_client(JobFinished(job_id=JOB, record=RECORD,  # type: ignore[arg-type]
                          result=msgpack.packb(["X"])))
    to_daemon(ListPolicies(ref=2))
    to_client(PolicyList(ref=2, policies=[POLICY]))  # type: ignore[arg-type]
    daemon.receive_data(b"")
    assert daemon.next_event() is CLOSED
    assert (client.state, daemon.state) == (State.READY, State.READY)


def test_a_whole_jail_conversation() -> None:
    sup = Connection(Role.SUPERVISOR, MAX_FRAME)
    jail = Connection(Role.JAIL, MAX_FRAME)

    def to_jail(msg: Message) -> None:
        jail.receive_data(sup.send(msg))
        assert jail.next_event() == msg

    def to_sup(msg: Message) -> None:
        sup.receive_data(jail.send(msg))
        assert sup.next_event() == msg

    to_jail(Harden(protocol=PROTOCOL_VERSION, seccomp={"rules": []}))
    assert (sup.state, jail.state) == (State.AWAIT_READY, State.HARDENING)
    to_sup(JailReady(protocol=PROTOCOL_VERSION, python="3.12"))
    assert (sup.state, jail.state) == (State.AWAIT_CODE, State.AWAIT_CODE)
    to_jail(RunCode(
        job=JobDescription(code="x", filename="<job>", tools=(SPEC,)),
        tool_payload_bytes=64,
        result_bytes=64,
    ))
    assert (sup.state, jail.state) == (State.RUNNING, State.RUNNING)
    to_sup(JailCallTool(call_id=1, name="search", args=b"\x92\x90\x80"))
    to_sup(JailCallTool(call_id=2, name="search", args=b"\x92\x90\x80"))
    to_jail(JailToolFailed(call_id=2, error_type="too_many_calls", message="..."))
    # the code finishes with call 1 still in flight; its late answer is harmless to the jail
    late = sup.send(JailToolReturned(call_id=1, value=b"\xc0"))
    to_sup(CodeFinished(ok=True, result=b"\x01"))
    assert (sup.state, jail.state) == (State.FINISHED, State.FINISHED)
    jail.receive_data(late)
    assert jail.next_event() == JailToolReturned(call_id=1, value=b"\xc0")
    with pytest.raises(LocalProtocolError):
        sup.send(JailToolReturned(call_id=1, value=b"\xc0"))


# --------------------------------------------------------------------------- end of stream


@pytest.mark.parametrize("role", list(Role))
def test_clean_eof_between_frames_is_closed(role: Role) -> None:
    conn = Connection(role, MAX_FRAME)
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    assert conn.next_event() is CLOSED
    assert conn.next_event() is CLOSED  # and stays so


@pytest.mark.parametrize("how", FEEDS)
def test_eof_right_after_a_frame_still_delivers_it(how: str) -> None:
    conn = conn_in(Role.DAEMON, State.READY)
    msg = ListPolicies(ref=9)
    for chunk in chunks(encode_frame(encode(msg), MAX_FRAME), how):
        conn.receive_data(chunk)
    conn.receive_data(b"")
    assert conn.next_event() == msg
    assert conn.next_event() is CLOSED


@pytest.mark.parametrize("cut", [1, 3, 4, 5, -1])
def test_eof_inside_a_frame_is_a_remote_protocol_error(cut: int) -> None:
    frame = encode_frame(encode(ListPolicies(ref=9)), MAX_FRAME)
    for how in FEEDS:
        conn = conn_in(Role.DAEMON, State.READY)
        for chunk in chunks(frame[:cut], how):
            conn.receive_data(chunk)
            assert conn.next_event() is NEED_DATA
        conn.receive_data(b"")
        with pytest.raises(RemoteProtocolError, match="closed inside a frame") as exc:
            conn.next_event()
        assert type(exc.value) is RemoteProtocolError
        with pytest.raises(RemoteProtocolError):
            conn.next_event()


# --------------------------------------------------------------------------- garbage

DELETE = object()


JOB_FIELDS = frozenset(f.name for f in dataclasses.fields(JobDescription))


def wire(msg: Message, **changes: Any) -> bytes:
    """``msg``'s msgpack payload with fields replaced (``DELETE`` removes one). A job
    description's field (``code``, ``tools``, ...) is replaced inside the message's ``job``."""
    data = copy.deepcopy(msg.to_wire())
    for key, value in changes.items():
        target = data["job"] if key in JOB_FIELDS and "job" in data else data
        if value is DELETE:
            del target[key]
        else:
            target[key] = value
    return msgpack.packb(data, use_bin_type=True)


def wire_raw(msg: Message, mutate: Callable[[dict[Any, Any]], None]) -> bytes:
    data = copy.deepcopy(msg.to_wire())  # to_wire shares the message's own dicts
    mutate(data)
    return msgpack.packb(data, use_bin_type=True)


def wire_splice(msg: Message, key: str, raw: bytes) -> bytes:
    """``msg``'s payload with field ``key``'s value replaced by raw msgpack bytes."""
    marker = "\x00splice\x00"
    packed = wire(msg, **{key: marker})
    assert packed.count(msgpack.packb(marker)) == 1
    return packed.replace(msgpack.packb(marker), raw)


def nested_lists(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def deep_harden(depth: int) -> bytes:
    """A Harden whose seccomp map nests ``depth`` arrays (deeper than msgpack.packb will go)."""
    head = msgpack.packb({"type": "Harden", "protocol": PROTOCOL_VERSION})
    return (b"\x83" + head[1:] + msgpack.packb("seccomp") + b"\x81" + msgpack.packb("x")
            + b"\x91" * (depth - 1) + b"\x90")


def ext(code: int, data: bytes = b"x") -> msgpack.ExtType:
    return msgpack.ExtType(code, data)


def _add(key: Any, value: Any) -> Callable[[dict[Any, Any]], None]:
    def mutate(d: dict[Any, Any]) -> None:
        d[key] = value

    return mutate


RUN = first("client->daemon", "RunJob")
CANCEL = CancelJob(job_id=JOB)
TOOL_OK = ClientToolReturned(job_id=JOB, call_id=1, value=b"\xc0")
FINISHED = JobFinished(job_id=JOB, record=RECORD)  # type: ignore[arg-type]
HARDEN = Harden(protocol=PROTOCOL_VERSION, seccomp={"rules": []})
CODE = RunCode(
    job=JobDescription(code="x", filename="<job>", tools=(SPEC,)),
    tool_payload_bytes=1,
    result_bytes=1,
)
CALL = JailCallTool(call_id=1, name="search", args=b"")
DONE = CodeFinished(ok=False, error=ErrorInfo(type="E", message="m"))
POLICIES = PolicyList(ref=1, policies=[POLICY])  # type: ignore[arg-type]
STATS_MSG = Stats(ref=1, stats=STATS)  # type: ignore[arg-type]
JOBS = JobList(ref=1, jobs=[JOB_ENTRY])  # type: ignore[arg-type]
SNAPSHOTS = SnapshotList(ref=1, snapshots=[SNAPSHOT])  # type: ignore[arg-type]
APPROVALS = ApprovalList(ref=1, approvals=[APPROVAL])  # type: ignore[arg-type]
DELETE_SNAPSHOT = DeleteSnapshot(ref=1, snapshot_id=SNAP)


def metrics(value: dict[Any, Any]) -> bytes:
    """STATS_MSG with ``value`` as its free-form ``stats.metrics`` map."""
    return wire_raw(STATS_MSG, lambda d: d["stats"].update(metrics=value))


def metrics_splice(raw: bytes) -> bytes:
    """STATS_MSG with raw msgpack bytes as its ``stats.metrics``."""
    marker = "\x00splice\x00"
    packed = metrics(marker)  # type: ignore[arg-type]
    assert packed.count(msgpack.packb(marker)) == 1
    return packed.replace(msgpack.packb(marker), raw)
SPEC_WIRE = SPEC.to_wire()

# (id, direction, base message, the defective payload). The base message is the positive
# control: encoded as it is, it must be accepted.
MUTATIONS: list[tuple[str, str, Message, bytes]] = [
    ("unknown-type", "client->daemon", RUN, wire(RUN, type="RunJobs")),
    ("type-of-other-direction", "client->daemon", RUN, wire(RUN, type="Welcome")),
    ("type-of-other-link", "daemon->jail", CODE, wire(CODE, type="Hello")),
    ("type-missing", "client->daemon", RUN, wire(RUN, type=DELETE)),
    ("type-not-str", "client->daemon", RUN, wire(RUN, type=1)),
    ("type-bytes", "client->daemon", RUN, wire(RUN, type=b"RunJob")),
    ("type-nil", "client->daemon", RUN, wire(RUN, type=None)),
    ("missing-field", "client->daemon", RUN, wire(RUN, code=DELETE)),
    ("missing-job", "client->daemon", RUN, wire(RUN, job=DELETE)),
    ("job-not-a-map", "client->daemon", RUN, wire(RUN, job="print(1)")),
    ("job-field-beside-job", "client->daemon", RUN, wire_raw(RUN, _add("code", "1"))),
    ("missing-nested-field", "client->daemon", RUN,
     wire(RUN, tools=[{"description": "no name"}])),
    ("extra-field", "client->daemon", CANCEL, wire(CANCEL, ref=1)),
    ("extra-field-jail-forges-job-id", "jail->daemon", CALL, wire(CALL, job_id=JOB)),
    ("extra-nested-field", "client->daemon", RUN, wire(RUN, tools=[{**SPEC_WIRE, "x": 1}])),
    ("extra-int-key", "client->daemon", CANCEL, wire_raw(CANCEL, _add(1, "x"))),
    ("extra-nil-key", "client->daemon", CANCEL, wire_raw(CANCEL, _add(None, "x"))),
    ("ref-str", "client->daemon", RUN, wire(RUN, ref="1")),
    ("ref-bool", "client->daemon", RUN, wire(RUN, ref=True)),
    ("ref-float", "client->daemon", RUN, wire(RUN, ref=1.0)),
    ("ref-negative", "client->daemon", RUN, wire(RUN, ref=-1)),
    ("ref-over-max", "client->daemon", RUN, wire(RUN, ref=MAX_REF + 1)),
    ("ref-nil", "client->daemon", RUN, wire(RUN, ref=None)),
    ("call-id-bool", "jail->daemon", CALL, wire(CALL, call_id=False)),
    ("ok-int", "jail->daemon", DONE, wire(DONE, ok=1)),
    ("str-for-bytes", "jail->daemon", CALL, wire(CALL, args="\x90")),
    ("bytes-for-str", "client->daemon", RUN, wire(RUN, code=b"print(1)")),
    ("list-for-str", "client->daemon", RUN, wire(RUN, code=["print(1)"])),
    ("map-for-list", "client->daemon", RUN, wire(RUN, tools={"name": "x"})),
    ("tool-not-a-map", "client->daemon", RUN, wire(RUN, tools=["search"])),
    ("record-not-a-map", "daemon->client", FINISHED, wire(FINISHED, record=[1, 2])),
    ("record-nil", "daemon->client", FINISHED, wire(FINISHED, record=None)),
    ("policy-not-a-map", "daemon->client", POLICIES, wire(POLICIES, policies=["default"])),
    ("seccomp-not-a-map", "daemon->jail", HARDEN, wire(HARDEN, seccomp="kill")),
    ("parameters-not-a-map", "daemon->jail", CODE,
     wire(CODE, tools=[{**SPEC_WIRE, "parameters": b"{}"}])),
    ("error-not-a-map", "jail->daemon", DONE, wire(DONE, error="boom")),
    ("lineno-negative", "jail->daemon", DONE,
     wire(DONE, error={"type": "E", "message": "m", "lineno": -1})),
    ("stream-stdin", "daemon->client", first("daemon->client", "JobOutput"),
     wire(first("daemon->client", "JobOutput"), stream="stdin")),
    ("limit-negative", "client->daemon", RUN, wire(RUN, limits={"wall_time_s": -1})),
    ("limit-nan", "client->daemon", RUN, wire(RUN, limits={"wall_time_s": math.nan})),
    ("limit-inf", "client->daemon", RUN, wire(RUN, limits={"wall_time_s": math.inf})),
    ("limit-str", "client->daemon", RUN, wire(RUN, limits={"wall_time_s": "1"})),
    ("limit-key-int", "client->daemon", RUN, wire(RUN, limits={1: 1})),
    ("limit-too-many", "client->daemon", RUN,
     wire(RUN, limits={f"l{i}": 1 for i in range(33)})),
    ("job-id-too-long", "client->daemon", CANCEL, wire(CANCEL, job_id="a" * 65)),
    ("job-id-empty", "client->daemon", CANCEL, wire(CANCEL, job_id="")),
    ("job-id-pattern", "client->daemon", CANCEL, wire(CANCEL, job_id="JOB-1")),
    ("job-id-path", "client->daemon", CANCEL, wire(CANCEL, job_id="../x")),
    ("code-too-long", "client->daemon", RUN, wire(RUN, code="x" * (MAX_CODE_CHARS + 1))),
    ("policy-too-long", "client->daemon", RUN, wire(RUN, policy="p" * 65)),
    ("policy-empty", "client->daemon", RUN, wire(RUN, policy="")),
    ("filename-empty", "client->daemon", RUN, wire(RUN, filename="")),
    ("tool-name-pattern", "client->daemon", RUN, wire(RUN, tools=[{"name": "1x"}])),
    ("tool-name-too-long", "client->daemon", RUN, wire(RUN, tools=[{"name": "t" * 129}])),
    ("too-many-tools", "client->daemon", RUN,
     wire(RUN, tools=[{"name": f"t{i}"} for i in range(MAX_TOOLS + 1)])),
    ("call-name-too-long", "jail->daemon", CALL, wire(CALL, name="n" * (MAX_NAME_CHARS + 1))),
    ("call-name-empty", "jail->daemon", CALL, wire(CALL, name="")),
    ("message-too-long", "client->daemon", first("client->daemon", "ToolFailed"),
     wire(first("client->daemon", "ToolFailed"), message="m" * (MAX_MESSAGE_CHARS + 1))),
    ("error-type-too-long", "daemon->jail", first("daemon->jail", "ToolFailed"),
     wire(first("daemon->jail", "ToolFailed"), error_type="E" * 257)),
    ("error-code-empty", "daemon->client", Error(code="busy", message=""),
     wire(Error(code="busy", message=""), code="")),
    ("payload-too-large", "jail->daemon", CALL, wire(CALL, args=b"x" * (MAX_PAYLOAD_BYTES + 1))),
    ("protocol-over-range", "client->daemon", Hello(protocol=PROTOCOL_VERSION),
     wire(Hello(protocol=PROTOCOL_VERSION), protocol=(1 << 16) + 1)),
    ("ext-field", "jail->daemon", CALL, wire(CALL, args=ext(5))),
    ("ext-type", "client->daemon", RUN, wire(RUN, type=ext(1))),
    ("ext-in-record", "daemon->client", STATS_MSG, metrics({"x": [ext(0)]})),
    ("ext-negative", "daemon->client", STATS_MSG,
     metrics_splice(b"\x81\xa1x\xd4\xfb\x00")),  # {"x": fixext1 type -5}
    ("timestamp-ext", "daemon->client", STATS_MSG, metrics({"at": msgpack.Timestamp(1, 0)})),
    ("timestamp-as-field", "client->daemon", RUN, wire(RUN, ref=msgpack.Timestamp(1, 0))),
    ("deep-record", "daemon->client", STATS_MSG, metrics({"x": nested_lists(MAX_ANY_DEPTH)})),
    ("deep-seccomp", "daemon->jail", HARDEN, deep_harden(5000)),
    ("deep-parameters", "client->daemon", RUN,
     wire(RUN, tools=[{"name": "t", "parameters": {"p": nested_lists(MAX_ANY_DEPTH)}}])),
    ("record-bytes-key", "daemon->client", STATS_MSG, metrics({b"k": 1})),
    ("record-float-key", "daemon->client", STATS_MSG, metrics({1.5: 1})),
    ("record-nil-key", "daemon->client", STATS_MSG, metrics({None: 1})),
    ("record-status-not-a-status", "daemon->client", FINISHED,
     wire_raw(FINISHED, lambda d: d["record"].update(status="refused"))),
    ("record-unknown-field", "daemon->client", FINISHED,
     wire_raw(FINISHED, lambda d: d["record"].update(result=1))),
    ("record-missing-field", "daemon->client", FINISHED,
     wire_raw(FINISHED, lambda d: d["record"].pop("usage"))),
    ("record-usage-missing-field", "daemon->client", FINISHED,
     wire_raw(FINISHED, lambda d: d["record"]["usage"].pop("wall_s"))),
    ("record-ext-in-stdout", "daemon->client", FINISHED,
     wire_raw(FINISHED, lambda d: d["record"].update(stdout=ext(0)))),
    ("record-call-not-a-map", "daemon->client", FINISHED,
     wire_raw(FINISHED, lambda d: d["record"].update(tool_calls=["search"]))),
    ("stats-free-form", "daemon->client", STATS_MSG,
     wire_raw(STATS_MSG, lambda d: d["stats"].update(extra=1))),
    ("job-entry-unknown-field", "daemon->client", JOBS,
     wire_raw(JOBS, lambda d: d["jobs"][0].update(extra=1))),
    ("policy-entry-pool-unknown-field", "daemon->client", POLICIES,
     wire_raw(POLICIES, lambda d: d["policies"][0]["pool"].update(extra=1))),
    ("job-entry-state", "daemon->client", JOBS,
     wire_raw(JOBS, lambda d: d["jobs"][0].update(state="frozen"))),
    ("snapshot-id-pattern", "client->daemon", DELETE_SNAPSHOT,
     wire(DELETE_SNAPSHOT, snapshot_id="snap-" + "G" * 32)),
    ("snapshot-id-too-long", "client->daemon", DELETE_SNAPSHOT,
     wire(DELETE_SNAPSHOT, snapshot_id=SNAP + "0")),
    ("runcode-restore-str", "daemon->jail", CODE, wire(CODE, restore="state")),
    ("runcode-snapshot-nil", "daemon->jail", CODE, wire(CODE, snapshot=None)),
    ("snapshot-entry-unknown-field", "daemon->client", SNAPSHOTS,
     wire_raw(SNAPSHOTS, lambda d: d["snapshots"][0].update(extra=1))),
    ("snapshot-entry-kind", "daemon->client", SNAPSHOTS,
     wire_raw(SNAPSHOTS, lambda d: d["snapshots"][0].update(kind="fork"))),
    ("approval-entry-missing-field", "daemon->client", APPROVALS,
     wire_raw(APPROVALS, lambda d: d["approvals"][0].pop("attached"))),
    ("approval-entry-args-str", "daemon->client", APPROVALS,
     wire_raw(APPROVALS, lambda d: d["approvals"][0].update(args="x"))),
]


# Payloads that are not a message at all, whatever the base.
RAW_GARBAGE: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("reserved-byte", b"\xc1"),
    ("truncated-array", b"\x92\x01"),
    ("truncated-map", b"\x81\xa4type"),
    ("truncated-str", b"\xdb\xff\xff\xff\xff"),
    ("huge-array-header", b"\xdd\xff\xff\xff\xff"),
    ("huge-map-header", b"\xdf\xff\xff\xff\xff"),
    ("not-a-map-int", msgpack.packb(1)),
    ("not-a-map-nil", msgpack.packb(None)),
    ("not-a-map-str", msgpack.packb("RunJob")),
    ("not-a-map-list", msgpack.packb(["RunJob", {}])),
    ("not-a-map-bin", msgpack.packb(b"\x81\xa4type")),
    ("map-in-map-key", b"\x81\x81\x01\x02\x03"),
    ("list-as-map-key", b"\x81\x91\x01\x02"),
    ("invalid-utf8", b"\x81\xa4type\xa2\xff\xfe"),
    ("surrogate-utf8", b"\x81\xa4type\xa3\xed\xa0\x80"),
    ("trailing-bytes", wire(CANCEL) + b"\x00"),
    ("two-messages", wire(CANCEL) * 2),
    ("json", b'{"type": "CancelJob", "job_id": "job-1"}'),
    ("deep-arrays", b"\x91" * 100_000 + b"\xc0"),
    ("deep-maps", b"\x81\xa1k" * 100_000 + b"\xc0"),
    ("ext-alone", msgpack.packb(ext(3))),
    ("float32-nan", b"\xca\x7f\xc0\x00\x00"),
]


BUSY_STATE = {Role.DAEMON: State.READY, Role.CLIENT: State.READY,
              Role.JAIL: State.RUNNING, Role.SUPERVISOR: State.RUNNING}


def _check_broken(conn: Connection, first_error: BaseException) -> None:
    assert conn.state is State.CLOSED
    with pytest.raises(RemoteProtocolError) as again:
        conn.next_event()
    assert again.value is first_error


def feed_payload(direction: str, payload: bytes, how: str, state: State | None = None) -> Any:
    """Feed one framed payload to the receiving end (in ``state``, else a busy state)."""
    role = RECEIVER[direction]
    if state is None:
        state = BUSY_STATE[role]
    conn = conn_in(role, state, max_frame=MAX_PAYLOAD_BYTES * 2)
    events = receive_all(conn, encode_frame(payload, MAX_PAYLOAD_BYTES * 2), how)
    return conn, events


def _state_for(base: Message, direction: str) -> State:
    return legal_state(RECEIVER[direction], RECV, base.TYPE)


@pytest.mark.parametrize(("case", "direction", "base", "payload"), MUTATIONS,
                         ids=[m[0] for m in MUTATIONS])
def test_defective_message_is_a_remote_protocol_error(case: str, direction: str, base: Message,
                                                      payload: bytes) -> None:
    state = _state_for(base, direction)
    # positive control: the same message without the defect is accepted
    conn, events = feed_payload(direction, encode(base), "whole", state)
    assert messages(events) == [base]
    assert decode(encode(base), direction) == base  # type: ignore[arg-type]

    with pytest.raises(RemoteProtocolError) as exc:
        decode(payload, direction)  # type: ignore[arg-type]
    assert type(exc.value) is RemoteProtocolError and exc.value.code == "bad_frame"

    hows = ["whole"] if len(payload) > 1 << 16 else FEEDS
    for how in hows:
        with pytest.raises(RemoteProtocolError) as exc:
            feed_payload(direction, payload, how, state)
        assert type(exc.value) is RemoteProtocolError
    conn = conn_in(RECEIVER[direction], state, max_frame=MAX_PAYLOAD_BYTES * 2)
    conn.receive_data(encode_frame(payload, MAX_PAYLOAD_BYTES * 2))
    with pytest.raises(RemoteProtocolError) as exc:
        conn.next_event()
    _check_broken(conn, exc.value)


@pytest.mark.parametrize(("case", "payload"), RAW_GARBAGE, ids=[g[0] for g in RAW_GARBAGE])
@pytest.mark.parametrize("direction", list(MESSAGES))
def test_garbage_payload_is_a_remote_protocol_error(case: str, payload: bytes,
                                                    direction: str) -> None:
    with pytest.raises(RemoteProtocolError) as exc:
        decode(payload, direction)  # type: ignore[arg-type]
    assert type(exc.value) is RemoteProtocolError
    for how in FEEDS if len(payload) < 4096 else ["whole"]:
        conn = conn_in(RECEIVER[direction], BUSY_STATE[RECEIVER[direction]])
        with pytest.raises(RemoteProtocolError) as exc:
            receive_all(conn, encode_frame(payload, MAX_FRAME), how)
        assert type(exc.value) is RemoteProtocolError
        _check_broken(conn, exc.value)


def test_garbage_after_good_messages_delivers_the_good_ones_first() -> None:
    good = [ListPolicies(ref=1), CancelJob(job_id=JOB)]
    data = b"".join(encode_frame(encode(m), MAX_FRAME) for m in good)
    data += encode_frame(b"\xc1", MAX_FRAME) + encode_frame(encode(ListPolicies(ref=2)), MAX_FRAME)
    for how in FEEDS:
        conn = conn_in(Role.DAEMON, State.READY)
        got: list[Any] = []
        with pytest.raises(RemoteProtocolError):
            for chunk in chunks(data, how):
                conn.receive_data(chunk)
                while (event := conn.next_event()) is not NEED_DATA:
                    got.append(event)
        assert got == good  # nothing after the garbage is parsed


# --------------------------------------------------------------------------- the state table


def _illegal(role: Role, verb: str) -> list[tuple[State, str]]:
    direction = RECV_DIRECTION[role] if verb == RECV else SEND_DIRECTION[role]
    return [
        (state, type_name)
        for state in states_of(role)
        for type_name in MESSAGES[direction]  # type: ignore[index]
        if (verb, type_name) not in TRANSITIONS.get((role, state), {})
    ]


def _legal() -> list[tuple[Role, State, str, str, State]]:
    return [
        (role, state, verb, type_name, nxt)
        for (role, state), moves in TRANSITIONS.items()
        for (verb, type_name), nxt in moves.items()
    ]


ILLEGAL_RECV = [(r, s, t) for r in Role for s, t in _illegal(r, RECV)]
ILLEGAL_SEND = [(r, s, t) for r in Role for s, t in _illegal(r, SEND)]


def _transition_id(value: Any) -> str:
    return value.value if isinstance(value, Role | State) else str(value)


def test_the_table_only_names_messages_of_the_right_direction() -> None:
    for (role, _), moves in TRANSITIONS.items():
        for verb, type_name in moves:
            direction = RECV_DIRECTION[role] if verb == RECV else SEND_DIRECTION[role]
            assert type_name in MESSAGES[direction]  # type: ignore[index]


@pytest.mark.parametrize(("role", "state", "verb", "type_name", "nxt"), _legal(),
                         ids=_transition_id)
def test_every_legal_transition_is_taken(role: Role, state: State, verb: str, type_name: str,
                                         nxt: State) -> None:
    conn = conn_in(role, state)
    if verb == SEND:
        conn.send(first(SEND_DIRECTION[role], type_name))
    else:
        conn.receive_data(encode_frame(encode(first(RECV_DIRECTION[role], type_name)), MAX_FRAME))
        assert isinstance(conn.next_event(), Message)
    assert conn.state is nxt


@pytest.mark.parametrize(("role", "state", "type_name"), ILLEGAL_RECV, ids=_transition_id)
def test_every_illegal_receive_is_unexpected_message(role: Role, state: State,
                                                     type_name: str) -> None:
    msg = first(RECV_DIRECTION[role], type_name)
    frame = encode_frame(encode(msg), MAX_FRAME)
    for how in FEEDS:
        conn = conn_in(role, state)
        with pytest.raises(UnexpectedMessage, match=type_name) as exc:
            receive_all(conn, frame, how)
        assert exc.value.code == "unexpected_message"
        _check_broken(conn, exc.value)


@pytest.mark.parametrize(("role", "state", "type_name"), ILLEGAL_SEND, ids=_transition_id)
def test_every_illegal_send_is_a_local_protocol_error(role: Role, state: State,
                                                      type_name: str) -> None:
    conn = conn_in(role, state)
    with pytest.raises(LocalProtocolError, match=f"cannot send {type_name}"):
        conn.send(first(SEND_DIRECTION[role], type_name))
    assert conn.state is state  # nothing happened


@pytest.mark.parametrize("role", list(Role))
def test_a_role_cannot_send_messages_of_another_direction(role: Role) -> None:
    own = SEND_DIRECTION[role]
    for direction, msgs in SAMPLES.items():
        for msg in msgs:
            if type(msg) in MESSAGES[own].values():  # type: ignore[index]
                continue
            for state in states_of(role):
                conn = conn_in(role, state)
                with pytest.raises(LocalProtocolError):
                    conn.send(msg)
                assert conn.state is state, (direction, msg.TYPE)


def test_a_message_too_large_for_the_link_is_not_sent() -> None:
    conn = conn_in(Role.JAIL, State.RUNNING, max_frame=100)
    with pytest.raises(LocalProtocolError, match="refusing to send"):
        conn.send(JailCallTool(call_id=1, name="t", args=b"x" * 100))
    assert conn.state is State.RUNNING
    assert conn.send(JailCallTool(call_id=1, name="t", args=b"x" * 10))


# --------------------------------------------------------------------------- versions

HANDSHAKES = [
    (Role.DAEMON, State.AWAIT_HELLO, Hello),
    (Role.CLIENT, State.AWAIT_WELCOME, Welcome),
    (Role.JAIL, State.AWAIT_HARDEN, Harden),
    (Role.SUPERVISOR, State.AWAIT_READY, JailReady),
]


def _handshake(cls: type[Message], version: int) -> Message:
    if cls is Harden:
        return Harden(protocol=version, seccomp={})
    return cls(protocol=version)  # type: ignore[call-arg]


@pytest.mark.parametrize(("role", "state", "cls"), HANDSHAKES,
                         ids=[cls.__name__ for _, _, cls in HANDSHAKES])
def test_version_mismatch_is_unsupported_version(role: Role, state: State,
                                                 cls: type[Message]) -> None:
    good = conn_in(role, state)
    good.receive_data(encode_frame(encode(_handshake(cls, PROTOCOL_VERSION)), MAX_FRAME))
    assert isinstance(good.next_event(), cls)  # positive control
    for version in (0, PROTOCOL_VERSION + 1, 1 << 16):
        for how in FEEDS:
            conn = conn_in(role, state)
            frame = encode_frame(encode(_handshake(cls, version)), MAX_FRAME)
            with pytest.raises(UnsupportedVersion, match=f"version {version};") as exc:
                receive_all(conn, frame, how)
            assert exc.value.code == "unsupported_version"
            _check_broken(conn, exc.value)


@pytest.mark.parametrize("make_error", [
    lambda c: c.receive_data((1 << 31).to_bytes(4, "big")),
    lambda c: c.receive_data(encode_frame(encode(Hello(protocol=PROTOCOL_VERSION + 1)), MAX_FRAME)),
    lambda c: c.receive_data(encode_frame(encode(ListPolicies(ref=1)), MAX_FRAME)),
    lambda c: c.receive_data(encode_frame(b"\xc1", MAX_FRAME)),
], ids=["frame_too_large", "unsupported_version", "unexpected_message", "bad_frame"])
def test_the_daemon_can_still_say_why_it_hangs_up(make_error: Callable[[Connection], None]) -> None:
    daemon = Connection(Role.DAEMON, MAX_FRAME)
    client = Connection(Role.CLIENT, MAX_FRAME)
    client.send(Hello(protocol=PROTOCOL_VERSION))
    make_error(daemon)
    with pytest.raises(RemoteProtocolError) as exc:
        daemon.next_event()
    assert daemon.state is State.CLOSED
    client.receive_data(daemon.send(Error(code=exc.value.code, message=exc.value.message)))
    reply = client.next_event()
    assert isinstance(reply, Error) and client.state is State.CLOSED
    rebuilt = error_from_wire(reply.code, reply.message)
    assert type(rebuilt) is type(exc.value)
    with pytest.raises(LocalProtocolError):  # and nothing but an Error
        daemon.send(JobAccepted(ref=1, job_id=JOB))


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SUPERVISOR, Role.JAIL])
def test_other_roles_send_nothing_once_closed(role: Role) -> None:
    for msg in SAMPLES[SEND_DIRECTION[role]]:
        with pytest.raises(LocalProtocolError):
            conn_in(role, State.CLOSED).send(msg)


# --------------------------------------------------------------------------- construction

_RUN = {"ref": 1, "job": {"code": ""}, "policy": "p"}
_CODE = {"job": {"code": "", "filename": "f"}, "tool_payload_bytes": 0, "result_bytes": 0}
_FAILED = {"job_id": JOB, "call_id": 1, "error_type": "E", "message": ""}

# (case, class, keyword arguments): each must be refused by the class itself.
BAD_CONSTRUCTIONS: list[tuple[str, type[Any], dict[str, Any]]] = [
    ("hello-protocol-str", Hello, {"protocol": "1"}),
    ("hello-protocol-negative", Hello, {"protocol": -1}),
    ("runjob-ref-negative", RunJob, {**_RUN, "ref": -1}),
    ("runjob-ref-bool", RunJob, {**_RUN, "ref": True}),
    ("runjob-code-too-long", RunJob, {**_RUN, "job": {"code": "x" * (MAX_CODE_CHARS + 1)}}),
    ("runjob-code-lone-surrogate", RunJob, {**_RUN, "job": {"code": "print('\udc80')"}}),
    ("runjob-tools-str", RunJob, {**_RUN, "job": {"code": "", "tools": "search"}}),
    ("runjob-tool-unknown-key", RunJob,
     {**_RUN, "job": {"code": "", "tools": ({"name": "t", "x": 1},)}}),
    ("runjob-job-not-a-map", RunJob, {**_RUN, "job": "1 + 1"}),
    ("runjob-job-unknown-key", RunJob, {**_RUN, "job": {"code": "", "policy": "p"}}),
    ("runjob-limit-nan", RunJob, {**_RUN, "limits": {"x": math.nan}}),
    ("cancel-job-id-pattern", CancelJob, {"job_id": "Job_1"}),
    ("tool-returned-value-str", ClientToolReturned, {"job_id": JOB, "call_id": 1, "value": "x"}),
    ("tool-failed-error-type-empty", ClientToolFailed, {**_FAILED, "error_type": ""}),
    ("tool-failed-message-surrogate", ClientToolFailed, {**_FAILED, "message": "\ud800"}),
    ("job-output-stream", JobOutput, {"job_id": JOB, "stream": "stdin", "data": b""}),
    ("call-tool-args-none", ClientCallTool, {"job_id": JOB, "call_id": 1, "name": "t",
                                             "args": None}),
    ("job-finished-record-list", JobFinished, {"job_id": JOB, "record": []}),
    ("job-finished-record-empty", JobFinished, {"job_id": JOB, "record": {}}),
    ("job-finished-record-unknown-field", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "result": 1}}),
    ("job-finished-record-status", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "status": "refused"}}),
    ("job-finished-record-ok-with-error", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "status": "ok"}}),
    ("job-finished-record-error-without-error", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "error": None}}),
    ("job-finished-record-surrogate-stdout", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "stdout": "\udc80"}}),
    ("job-finished-record-usage-negative", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "usage": {**RECORD["usage"], "wall_s": -1.0}}}),
    ("job-finished-record-call-unknown-key", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "tool_calls": [{"name": "t", "duration_s": 0,
                                                          "ok": True, "x": 1}]}}),
    ("job-finished-record-file-sha", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "files": [{"path": "a", "size": 1, "sha256": "x"}]}}),
    ("job-finished-record-limit-nan", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "limits": {"x": math.nan}}}),
    ("job-finished-record-session-id", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "session": {"id": JOB, "run": 1, "closed": None}}}),
    ("job-finished-record-calls-over-max", JobFinished,
     {"job_id": JOB, "record": {**RECORD, "tool_calls": RECORD["tool_calls"] * 1001}}),
    ("policy-list-not-maps", PolicyList, {"ref": 1, "policies": ["default"]}),
    ("policy-list-empty-map", PolicyList, {"ref": 1, "policies": [{}]}),
    ("policy-list-pool-missing", PolicyList,
     {"ref": 1, "policies": [{k: v for k, v in POLICY.items() if k != "pool"}]}),
    ("job-list-kind", JobList, {"ref": 1, "jobs": [{**JOB_ENTRY, "kind": "jail"}]}),
    ("job-list-uid-negative", JobList, {"ref": 1, "jobs": [{**JOB_ENTRY, "uid": -1}]}),
    ("stats-free-form", Stats, {"ref": 1, "stats": {"policies": {}, "uids": {}}}),
    ("stats-status-unknown", Stats,
     {"ref": 1, "stats": {**STATS, "uids": {"0": {**TOTALS, "statuses": {"refused": 1}}}}}),
    ("stats-uid-not-decimal", Stats, {"ref": 1, "stats": {**STATS, "uids": {"root": TOTALS}}}),
    ("stats-pod-not-namespaced", Stats,
     {"ref": 1, "stats": {**STATS, "pods": {"agent-7f9c": TOTALS}}}),
    ("stats-pod-name-hostile", Stats,
     {"ref": 1, "stats": {**STATS, "pods": {"agents/../x": TOTALS, "a/b\n": TOTALS}}}),
    ("error-code-empty", Error, {"code": "", "message": ""}),
    ("error-job-id-pattern", Error, {"code": "c", "message": "", "job_id": "X"}),
    ("harden-seccomp-list", Harden, {"protocol": 1, "seccomp": []}),
    ("harden-seccomp-set", Harden, {"protocol": 1, "seccomp": {"s": {1}}}),
    ("harden-seccomp-surrogate-key", Harden, {"protocol": 1, "seccomp": {"\udc80": 1}}),
    ("harden-seccomp-too-deep", Harden,
     {"protocol": 1, "seccomp": {"x": nested_lists(MAX_ANY_DEPTH)}}),
    ("runcode-payload-over-max", RunCode, {**_CODE, "tool_payload_bytes": MAX_PAYLOAD_BYTES + 1}),
    ("runcode-filename-empty", RunCode, {**_CODE, "job": {"code": "", "filename": ""}}),
    ("call-tool-name-empty", JailCallTool, {"call_id": 1, "name": "", "args": b""}),
    ("code-finished-ok-int", CodeFinished, {"ok": 1}),
    ("code-finished-network-refused-negative", CodeFinished, {"ok": True, "network_refused": -1}),
    ("harden-network-not-a-refusal", Harden, {"protocol": 1, "seccomp": {}, "network": "none"}),
    ("network-refusal-no-explanation", NetworkRefusal, {"families": [2], "explanation": ""}),
    ("network-refusal-family-str", NetworkRefusal, {"families": ["AF_INET"], "explanation": "x"}),
    ("code-finished-error-str", CodeFinished, {"ok": False, "error": "boom"}),
    ("tool-spec-name-pattern", ToolSpec, {"name": "has space"}),
    ("tool-spec-parameters-bytes", ToolSpec, {"name": "t", "parameters": b"{}"}),
    ("error-info-type-too-long", ErrorInfo, {"type": "E" * 257, "message": ""}),
    ("error-info-lineno-negative", ErrorInfo, {"type": "E", "message": "", "lineno": -1}),
    ("open-session-snapshot-id-not-hex", OpenSession,
     {"ref": 1, "policy": "p", "from_snapshot": "snap-" + "g" * 32}),
    ("open-session-pause-after-zero", OpenSession, {"ref": 1, "policy": "p", "pause_after_s": 0}),
    ("snapshot-session-ttl-under-a-second", SnapshotSession,
     {"ref": 1, "session_id": "ses-1", "ttl_s": 0.5}),
    ("snapshot-session-id-pattern", SnapshotSession, {"ref": 1, "session_id": JOB}),
    ("delete-snapshot-id-uppercase", DeleteSnapshot, {"ref": 1, "snapshot_id": "snap-" + "A" * 32}),
    ("delete-snapshot-id-short", DeleteSnapshot, {"ref": 1, "snapshot_id": "snap-" + "0" * 31}),
    ("session-paused-bytes-over-max", SessionPaused,
     {"ref": 0, "session_id": "ses-1", "bytes": (1 << 40) + 1}),
    ("approve-call-allow-int", ApproveCall, {"ref": 1, "job_id": JOB, "call_id": 1, "allow": 1}),
    ("approve-call-reason-too-long", ApproveCall,
     {"ref": 1, "job_id": JOB, "call_id": 1, "allow": True, "reason": "r" * 1025}),
    ("resume-run-too-many-tools", ResumeRun,
     {"ref": 1, "job_id": JOB, "tools": [{"name": f"t{i}"} for i in range(MAX_TOOLS + 1)]}),
    ("run-parked-call-id-negative", RunParked, {"job_id": JOB, "call_id": -1}),
    ("runcode-snapshot-int", RunCode, {**_CODE, "snapshot": 1}),
    ("runcode-restore-str", RunCode, {**_CODE, "restore": "state"}),
    ("snapshot-entry-kind", SnapshotTaken, {"ref": 1, "snapshot": {**SNAPSHOT, "kind": "fork"}}),
    ("snapshot-entry-sha-uppercase", SnapshotTaken,
     {"ref": 1, "snapshot": {**SNAPSHOT, "sha256": "AB" * 32}}),
    ("snapshot-entry-missing-session", SnapshotList,
     {"ref": 1, "snapshots": [{k: v for k, v in SNAPSHOT.items() if k != "session"}]}),
    ("approval-entry-args-over-max", ApprovalList,
     {"ref": 1, "approvals": [{**APPROVAL, "args": b"x" * ((1 << 20) + 1)}]}),
    ("approval-entry-tool-empty", ApprovalList, {"ref": 1, "approvals": [{**APPROVAL, "tool": ""}]}),
    ("job-list-state", JobList, {"ref": 1, "jobs": [{**JOB_ENTRY, "state": "frozen"}]}),
]


@pytest.mark.parametrize(("case", "cls", "kwargs"), BAD_CONSTRUCTIONS,
                         ids=[b[0] for b in BAD_CONSTRUCTIONS])
def test_an_illegal_message_cannot_be_built(case: str, cls: type[Any],
                                            kwargs: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError):
        cls(**kwargs)


def test_positive_control_the_same_messages_without_the_defect_are_built() -> None:
    tools = ({"name": "t", "description": "d"},)
    job = JobDescription(code="print('ü ✓ \U0001f600')", tools=tools)  # type: ignore[arg-type]
    RunJob(ref=1, job=job, policy="p", limits={"x": 0.5})
    JobFinished(job_id=JOB, record=RECORD)  # type: ignore[arg-type]
    JailToolFailed(call_id=1, error_type="E", message="\u00e9")
    Harden(protocol=1, seccomp={})
    ToolSpec(name="t", parameters={})
    PolicyList(ref=1, policies=[POLICY])  # type: ignore[arg-type]
    JobList(ref=1, jobs=[JOB_ENTRY])  # type: ignore[arg-type]
    Stats(ref=1, stats=STATS)  # type: ignore[arg-type]
    Harden(protocol=1, seccomp={"x": nested_lists(MAX_ANY_DEPTH - 1)})  # 32 levels
    OpenSession(ref=1, policy="p", from_snapshot="snap-" + "a" * 32, pause_after_s=0.001)
    SnapshotSession(ref=1, session_id="ses-1", ttl_s=1)
    DeleteSnapshot(ref=1, snapshot_id="snap-" + "a" * 32)
    SessionPaused(ref=0, session_id="ses-1", bytes=1 << 40)
    ApproveCall(ref=1, job_id=JOB, call_id=1, allow=True, reason="r" * 1024)
    RunCode(job=JobDescription(code="", filename="f"), tool_payload_bytes=0, result_bytes=0,
            snapshot=True, restore=b"state")
    SnapshotTaken(ref=1, snapshot=SNAPSHOT)  # type: ignore[arg-type]
    ApprovalList(ref=1, approvals=[{**APPROVAL, "args": b"x" * (1 << 20)}])  # type: ignore[arg-type]
    JobList(ref=1, jobs=[{**JOB_ENTRY, "state": "paused"}])  # type: ignore[arg-type]
    JobList(ref=1, jobs=[{**JOB_ENTRY, "state": "parked"}])  # type: ignore[arg-type]


def test_messages_are_frozen_and_normalised() -> None:
    job = JobDescription(code="", tools=[{"name": "t"}])  # type: ignore[arg-type]
    msg = RunJob(ref=1, job=job, policy="p")
    assert msg.job.tools == (ToolSpec(name="t"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.ref = 2  # type: ignore[misc]


# --------------------------------------------------------------------------- error codes


@pytest.mark.parametrize(("code", "cls"), list(ERROR_CLASSES.items()))
def test_error_from_wire_rebuilds_each_class(code: str, cls: type[JaildError]) -> None:
    err = error_from_wire(code, "what happened; what to do")
    assert type(err) is cls
    assert err.code == code and err.message == "what happened; what to do"
    assert error_from_wire(**err.to_wire()).to_wire() == err.to_wire()


@pytest.mark.parametrize("code", ["", "nope", "BUSY", "local_protocol_error", "invalid_policy"])
def test_unknown_error_codes_become_internal_error(code: str) -> None:
    err = error_from_wire(code, "detail")
    assert type(err) is InternalError
    assert err.code == "internal_error"
    assert err.message == f"{code}: detail"


def test_error_codes_are_one_to_one() -> None:
    classes = [
        obj for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, JaildError) and obj is not JaildError
    ]
    codes = [cls.code for cls in classes]
    assert len(codes) == len(set(codes)), sorted(codes)
    assert set(codes) - set(ERROR_CLASSES) == {
        "local_protocol_error", "invalid_policy", "node_lost", "session_lost"
    }
    for code, cls in ERROR_CLASSES.items():
        assert cls.code == code
    assert all(issubclass(c, RemoteProtocolError) for c in
               (FrameTooLarge, UnexpectedMessage, UnsupportedVersion))


# --------------------------------------------------------------------------- trusted construction


def test_trusted_construction_is_the_checked_one_without_the_checks() -> None:
    """``Struct.trusted``: what the daemon builds from values it has checked already. The
    same struct as the class makes; its fields' checks are not run (a value a check would
    refuse is taken as given -- the control: the class refuses it)."""
    assert Error.trusted(code="busy", message="m", ref=3) == Error(code="busy", message="m", ref=3)
    assert Error.trusted("busy", "m") == Error("busy", "m")  # positional, as the class
    with pytest.raises(LocalProtocolError, match="'code'"):
        Error(code="", message="m")
    assert Error.trusted(code="", message="m").code == ""
    # defaults and default factories are the class's, a fresh map each time
    job = JobDescription(code="1")
    first, second = RunJob.trusted(ref=1, job=job, policy="p"), RunJob.trusted(1, job, "p")
    assert first == RunJob(ref=1, job=job, policy="p") and first.limits == {}
    assert first.limits is not second.limits
    with pytest.raises(TypeError):
        Error.trusted(code="busy", message="m", nonsense=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.ref = 2  # type: ignore[misc]


def test_what_arrives_from_a_peer_is_checked_as_ever() -> None:
    """Trusted construction is never the receive path: a frame holding what ``trusted`` would
    take is refused by ``decode``."""
    frame = msgpack.packb({"type": "Error", "code": "", "message": "m"})
    with pytest.raises(RemoteProtocolError, match="'code'"):
        decode(frame, "daemon->client")


def test_a_struct_with_checks_of_its_own_keeps_them_when_trusted() -> None:
    """A class whose ``__post_init__`` adds checks of its own (the zygote link's) is built
    checked by ``trusted``; the job record's cross-field rule (its ``_invariant``) runs in
    both."""
    from jaild.protocol.records import JobRecord
    from jaild.protocol.zygote_link import JailSetup, SpawnJail

    assert SpawnJail.trusted is SpawnJail and JailSetup.trusted is JailSetup
    fields = {"job_id": "job-1", "policy": "p", "status": "error", "stdout": "", "stderr": "",
              "error": None, "tool_calls": (), "duration_s": 0.0, "limits": {}, "usage": None,
              "files": (), "files_skipped": (), "tool_calls_omitted": 0, "session": None}
    for make in (JobRecord, JobRecord.trusted):
        with pytest.raises(LocalProtocolError, match="nil exactly when the status is ok"):
            make(**fields)
    assert JobRecord.trusted(**{**fields, "status": "ok"}) == JobRecord(**{**fields,
                                                                          "status": "ok"})


def test_a_harden_is_encoded_once_and_its_bytes_sent_again() -> None:
    """The daemon sends one ``Harden`` per policy to every jail of it: encoded once."""
    harden = Harden(protocol=PROTOCOL_VERSION, seccomp={"default": "kill", "allow": ["read"]})
    first = encode(harden)
    assert encode(harden) is first  # the same bytes, not packed again
    assert decode(first, "daemon->jail") == harden
    other = Harden(protocol=PROTOCOL_VERSION, seccomp={"default": "kill", "allow": ["write"]})
    assert encode(other) != first and decode(encode(other), "daemon->jail") == other
    # other messages are encoded each time
    hello = Hello(protocol=PROTOCOL_VERSION)
    assert encode(hello) == encode(hello) and encode(hello) is not encode(hello)


def test_a_link_state_is_hashed_as_the_object_it_is() -> None:
    """``Role`` and ``State`` are looked up twice a frame: identity hashing, in C."""
    assert hash(State.READY) == object.__hash__(State.READY)
    assert {Role.DAEMON: 1}[Role.DAEMON] == 1 and State("ready") is State.READY
