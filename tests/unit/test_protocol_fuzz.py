"""Property tests of the protocol's receive boundary (hypothesis).

The h11 invariant: whatever bytes arrive, split into whatever reads, a connection's
``next_event`` returns a message, ``NEED_DATA`` or ``CLOSED``, or raises
:class:`RemoteProtocolError` -- never anything else -- and once it has raised it keeps raising
the same error. The split never changes the outcome.

And the converse: every valid message of every direction survives encode -> frame -> any split
-> decode unchanged.

A coverage-guided harness for the same invariant is ``fuzz/atheris_protocol.py`` (run by hand).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaild.errors import RemoteProtocolError
from jaild.protocol import (
    CLOSED,
    MESSAGES,
    NEED_DATA,
    PROTOCOL_VERSION,
    Connection,
    Role,
    State,
    decode,
    encode,
    encode_frame,
)
from jaild.protocol.connection import RECV, TRANSITIONS, reachable_states
from jaild.protocol.fields import LABEL
from jaild.protocol.messages import (
    JOB_ID,
    MAX_PAYLOAD_BYTES,
    MAX_REF,
    SESSION_ID,
    SNAPSHOT_ID,
    TOOL_NAME,
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
from jaild.protocol.records import (
    STATUSES,
    ApprovalEntry,
    DaemonStats,
    EgressRecord,
    FileEntry,
    FlowRecord,
    FlowRefusal,
    JobEntry,
    JobError,
    JobRecord,
    PolicyEntry,
    PoolInfo,
    RunningCounts,
    SessionInfo,
    SessionRun,
    SkippedFile,
    SnapshotEntry,
    ToolCallEntry,
    Usage,
    UsageTotals,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUICK = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MAX_FRAME = 4096  # small, so that oversize frames are common

RECV_DIRECTION = {
    Role.CLIENT: "daemon->client",
    Role.DAEMON: "client->daemon",
    Role.SUPERVISOR: "jail->daemon",
    Role.JAIL: "daemon->jail",
}
SENDER = {
    "client->daemon": Role.CLIENT,
    "daemon->client": Role.DAEMON,
    "daemon->jail": Role.SUPERVISOR,
    "jail->daemon": Role.JAIL,
}
RECEIVER = {d: r for r, d in RECV_DIRECTION.items()}


ENDS = [(role, state) for role in Role for state in reachable_states(role)]
TYPE_NAMES = sorted({name for table in MESSAGES.values() for name in table})
FIELD_NAMES = sorted(
    {f.name for table in MESSAGES.values() for cls in table.values()
     for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
)

# --------------------------------------------------------------------------- valid messages

_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_scalars = (
    st.none() | st.booleans() | _ints | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20)
)
_keys = st.text(max_size=10) | _ints
plain = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)
"""Any plain msgpack value that survives a round trip unchanged (no NaN, lists not tuples)."""
plain_map = st.dictionaries(_keys, plain, max_size=5)

ref = st.integers(0, MAX_REF)
job_id = st.from_regex(JOB_ID, fullmatch=True)
payload = st.binary(max_size=64)
version = st.integers(0, 1 << 16)


def text(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(min_size=min_size, max_size=max_size)


label = st.from_regex(LABEL, fullmatch=True)
labels = st.lists(label, max_size=3).map(tuple)
tool_spec = st.builds(
    ToolSpec,
    name=st.from_regex(TOOL_NAME, fullmatch=True).filter(lambda s: len(s) <= 128),
    description=text(max_size=40),
    parameters=plain_map,
    labels=labels,
    protected=st.booleans(),
)
error_info = st.builds(
    ErrorInfo,
    type=text(1, 256),
    message=text(),
    traceback=text(max_size=80),
    lineno=st.none() | st.integers(0, 1 << 31),
)
limits = st.dictionaries(
    text(1, 64),
    st.integers(0, 1 << 53) | st.floats(0, float(1 << 53), allow_nan=False),
    max_size=5,
)
tools = st.lists(tool_spec, max_size=3).map(tuple)
session_id = st.from_regex(SESSION_ID, fullmatch=True)
snapshot_id = st.from_regex(SNAPSHOT_ID, fullmatch=True)
files = st.dictionaries(text(1, 40), payload, max_size=3)
patterns = st.lists(text(1, 20), max_size=3).map(tuple)


# the records (jaild.protocol.records): every field, nil or not, at its edges now and then
seconds = st.floats(0, 1e9, allow_nan=False)
count = st.integers(0, MAX_REF)
opt = st.none
policy_name = text(1, 64)
job_error = st.builds(
    JobError,
    type=text(1, 256),
    message=text(),
    traceback=text(max_size=80),
    lineno=opt() | st.integers(0, 1 << 31),
    signal=opt() | text(1, 32),
    syscall=opt() | text(1, 64),
    limit=opt() | text(1, 64),
)
record_limits = st.dictionaries(
    text(1, 64),
    st.integers(0, 1 << 53) | st.floats(0, float(1 << 53), allow_nan=False) | text(max_size=64),
    max_size=5,
)
usage = st.builds(
    Usage, wall_s=seconds, cpu_user_s=opt() | seconds, cpu_system_s=opt() | seconds,
    memory_peak_bytes=opt() | count, pids_peak=opt() | count, output_bytes=count,
    tool_calls=count, tool_time_s=seconds, stream_paused_s=seconds, stream_dropped_bytes=count,
)
job_record = st.fixed_dictionaries(dict(
    job_id=job_id,
    policy=policy_name,
    status=st.sampled_from(STATUSES),
    stdout=text(max_size=80),
    stderr=text(max_size=80),
    error=job_error,
    tool_calls=st.lists(st.builds(ToolCallEntry, name=text(1, 128), duration_s=seconds,
                                  ok=st.booleans(), error_type=opt() | text(1, 256)),
                        max_size=3).map(tuple),
    duration_s=seconds,
    limits=record_limits,
    usage=opt() | usage,
    files=st.lists(st.builds(FileEntry, path=text(1, 80), size=count,
                             sha256=st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
                   max_size=3).map(tuple),
    files_skipped=st.lists(st.builds(SkippedFile, path=text(max_size=40),
                                     reason=text(max_size=40)), max_size=3).map(tuple),
    tool_calls_omitted=count,
    session=opt() | st.builds(SessionRun, id=session_id, run=opt() | count,
                              closed=opt() | text(1, 64)),
    egress=opt() | st.builds(EgressRecord, requests=count, bytes_out=count, bytes_in=count,
                             hosts=st.lists(text(1, 64), max_size=3).map(tuple),
                             refused=st.dictionaries(text(1, 64), count, max_size=3)),
    flow=opt() | st.builds(
        FlowRecord, labels=labels,
        refusals=st.lists(st.builds(FlowRefusal, sink=st.sampled_from(["egress", "tool",
                                                                        "approval"]),
                                    label=label, target=text(max_size=64), code=text(1, 64),
                                    reason=text(max_size=64)),
                          max_size=2).map(tuple),
        withheld=st.lists(st.sampled_from(["result", "output", "downloads"]), max_size=3,
                          unique=True).map(tuple),
        redacted=st.lists(st.sampled_from(["result", "output"]), max_size=2,
                          unique=True).map(tuple),
        redaction=opt() | st.sampled_from(["exhausted", "failed"])),
)).map(lambda kw: JobRecord(**{**kw, "error": None if kw["status"] == "ok" else kw["error"]}))
session_info = st.builds(SessionInfo, policy=policy_name, idle_s=seconds,
                         max_lifetime_s=seconds, limits=record_limits)
pool_info = st.builds(
    PoolInfo, mode=text(1, 64), min=count, max=count, target=count, ready=count,
    hits=opt() | count, misses=opt() | count, made=opt() | count, failed=opt() | count,
    recycled=opt() | count, jails=opt() | st.lists(job_id, max_size=3).map(tuple),
)
uid = st.integers(0, (1 << 32) - 1)
POD = r"([a-z0-9][a-z0-9.-]*)?/[a-z0-9][a-z0-9.-]*"
job_entry = st.builds(
    JobEntry, id=job_id, kind=st.sampled_from(["job", "session"]), policy=policy_name,
    uid=opt() | uid, client_pid=uid,
    state=st.sampled_from(["starting", "running", "idle", "paused"]),
    age_s=seconds, session=opt() | session_id, runs=opt() | count,
    running=opt() | st.booleans(), idle_s=opt() | seconds, expires_in_s=opt() | seconds,
    memory_bytes=opt() | count, cpu_s=opt() | seconds, pids=opt() | count,
    pod=opt() | st.from_regex(POD, fullmatch=True).filter(lambda s: len(s) <= 317),
    principal=opt() | text(1, 1024),
)
policy_entry = st.builds(
    PolicyEntry, name=policy_name, description=text(), limits=record_limits,
    network=text(1, 64), egress=st.lists(text(1, 64), max_size=3).map(tuple), seccomp=st.dictionaries(text(1, 64), text(max_size=64), max_size=2),
    env=text(max_size=64), available=st.booleans(), problems=text(), pool=pool_info,
    flow=st.lists(text(max_size=80), max_size=2).map(tuple),
)
usage_totals = st.builds(
    UsageTotals, jobs=count, statuses=st.dictionaries(st.sampled_from(STATUSES), count),
    wall_s=seconds, cpu_user_s=seconds, cpu_system_s=seconds, memory_peak_bytes=count,
    pids_peak=count, output_bytes=count, tool_calls=count, tool_time_s=seconds,
    files_uploaded=count, files_downloaded=count, sessions=count,
)
snapshot_entry = st.builds(
    SnapshotEntry, id=snapshot_id, policy=policy_name, bytes=count, created=seconds,
    expires=seconds, session=session_id,
) | st.builds(
    SnapshotEntry, id=snapshot_id, policy=policy_name, bytes=count, created=seconds,
    expires=seconds, session=session_id, kind=st.sampled_from(["snapshot", "pause", "parked"]),
    sha256=st.from_regex(r"[0-9a-f]{64}", fullmatch=True), labels=labels,
)
approval_entry = st.builds(
    ApprovalEntry, job_id=job_id, call_id=count, tool=text(1, 128), args=payload,
    policy=policy_name, owner=text(max_size=1024), waiting_s=seconds, parked=st.booleans(),
    attached=st.booleans(), session=st.none() | session_id,
)
daemon_stats = st.builds(
    DaemonStats,
    since=st.floats(0, 1e10),
    policies=st.dictionaries(policy_name, usage_totals, max_size=2),
    uids=st.dictionaries(st.integers(0, 1 << 32).map(str), usage_totals, max_size=2),
    pods=st.dictionaries(st.from_regex(POD, fullmatch=True).filter(lambda s: len(s) <= 317),
                         usage_totals, max_size=2),
    principals=st.dictionaries(text(1, 1024), usage_totals, max_size=2),
    running=st.builds(RunningCounts, jobs=count, sessions=count, connections=count),
    pools=st.dictionaries(policy_name, pool_info, max_size=2),
    metrics=plain_map,
)


def message(cls: type[Message], required: dict[str, Any],
            optional: dict[str, Any] | None = None) -> st.SearchStrategy[Message]:
    """``cls`` built from the required fields and any subset of the optional ones."""
    return st.fixed_dictionaries(required, optional=optional or {}).map(lambda kw: cls(**kw))


job_description = st.fixed_dictionaries(
    {"code": text(max_size=120)},
    optional={"filename": text(1, 256), "tools": tools, "files": files, "download": patterns,
              "download_changed": st.booleans()},
).map(lambda kw: JobDescription(**kw))

STRATEGIES: dict[type[Message], st.SearchStrategy[Message]] = {
    Hello: message(Hello, {"protocol": version}, {"client": text(max_size=256)}),
    RunJob: message(
        RunJob,
        {"ref": ref, "job": job_description, "policy": text(1, 64)},
        {"limits": limits, "session_id": st.none() | session_id},
    ),
    OpenSession: message(
        OpenSession,
        {"ref": ref, "policy": text(1, 64)},
        {
            "tools": tools,
            "limits": limits,
            "idle_s": st.none() | st.floats(0.001, 1e6),
            "max_lifetime_s": st.none() | st.floats(0.001, 1e6),
            "from_snapshot": st.none() | snapshot_id,
            "pause_after_s": st.none() | st.floats(0.001, float(1 << 31)),
        },
    ),
    CloseSession: message(CloseSession, {"session_id": session_id}),
    SnapshotSession: message(
        SnapshotSession,
        {"ref": ref, "session_id": session_id},
        {"ttl_s": st.none() | st.floats(1, float(1 << 31))},
    ),
    PauseSession: message(PauseSession, {"ref": ref, "session_id": session_id}),
    ResumeSession: message(ResumeSession, {"ref": ref, "session_id": session_id}),
    ListSnapshots: message(ListSnapshots, {"ref": ref}),
    DeleteSnapshot: message(DeleteSnapshot, {"ref": ref, "snapshot_id": snapshot_id}),
    ApproveCall: message(
        ApproveCall,
        {"ref": ref, "job_id": job_id, "call_id": ref, "allow": st.booleans()},
        {"reason": text(max_size=1024)},
    ),
    ResumeRun: message(ResumeRun, {"ref": ref, "job_id": job_id}, {"tools": tools}),
    ListApprovals: message(ListApprovals, {"ref": ref}),
    SnapshotTaken: message(SnapshotTaken, {"ref": ref, "snapshot": snapshot_entry}),
    SessionPaused: message(
        SessionPaused, {"ref": ref, "session_id": session_id, "bytes": st.integers(0, 1 << 40)}
    ),
    SnapshotList: message(
        SnapshotList, {"ref": ref, "snapshots": st.lists(snapshot_entry, max_size=3).map(tuple)}
    ),
    SnapshotDeleted: message(SnapshotDeleted, {"ref": ref, "snapshot_id": snapshot_id}),
    ApprovalPending: message(
        ApprovalPending,
        {"job_id": job_id, "call_id": ref, "name": text(1, 128), "args": payload},
    ),
    RunParked: message(RunParked, {"job_id": job_id, "call_id": ref},
                       {"message": text(), "session_id": session_id}),
    ApprovalRecorded: message(
        ApprovalRecorded,
        {"ref": ref, "job_id": job_id, "call_id": ref, "allow": st.booleans()},
    ),
    ApprovalList: message(
        ApprovalList, {"ref": ref, "approvals": st.lists(approval_entry, max_size=3).map(tuple)}
    ),
    ListJobs: message(ListJobs, {"ref": ref}),
    Kill: message(Kill, {"ref": ref, "id": job_id}),
    GetStats: message(GetStats, {"ref": ref}),
    Ping: message(Ping, {"seq": ref}),
    Pong: message(Pong, {"seq": ref}),
    SessionOpened: message(
        SessionOpened, {"ref": ref, "session_id": session_id, "record": session_info}
    ),
    SessionClosed: message(
        SessionClosed, {"session_id": session_id, "reason": text(1, 64)}, {"message": text()}
    ),
    JobList: message(JobList, {"ref": ref, "jobs": st.lists(job_entry, max_size=3).map(tuple)}),
    Killed: message(
        Killed, {"ref": ref, "id": job_id, "kind": st.sampled_from(["job", "session"])}
    ),
    Stats: message(Stats, {"ref": ref, "stats": daemon_stats}),
    CancelJob: message(CancelJob, {"job_id": job_id}),
    ListPolicies: message(ListPolicies, {"ref": ref}),
    ClientToolReturned: message(
        ClientToolReturned, {"job_id": job_id, "call_id": ref, "value": payload},
        {"labels": labels}
    ),
    ClientToolFailed: message(
        ClientToolFailed,
        {"job_id": job_id, "call_id": ref, "error_type": text(1, 256), "message": text()},
    ),
    Welcome: message(Welcome, {"protocol": version}, {
        "daemon": text(max_size=256),
        "starting": st.none() | st.builds(Starting, pending=text(1, 1024),
                                          wait_s=st.floats(0, 3600))}),
    JobAccepted: message(JobAccepted, {"ref": ref, "job_id": job_id},
                         {"session_id": session_id}),
    JobOutput: message(
        JobOutput,
        {"job_id": job_id, "stream": st.sampled_from(["stdout", "stderr"]), "data": payload},
    ),
    ClientCallTool: message(
        ClientCallTool,
        {"job_id": job_id, "call_id": ref, "name": text(1, 128), "args": payload},
    ),
    JobFinished: message(
        JobFinished,
        {"job_id": job_id, "record": job_record},
        {"result": st.none() | payload, "files": files},
    ),
    PolicyList: message(
        PolicyList, {"ref": ref, "policies": st.lists(policy_entry, max_size=3).map(tuple)}
    ),
    Error: message(
        Error,
        {"code": text(1, 64), "message": text()},
        {"ref": st.none() | ref, "job_id": st.none() | job_id},
    ),
    Harden: message(
        Harden,
        {"protocol": version, "seccomp": plain_map},
        {"file_limits": st.dictionaries(text(1, 20), st.integers(0, 1 << 40), max_size=3)},
    ),
    RunCode: message(
        RunCode,
        {
            "job": job_description,
            "tool_payload_bytes": st.integers(0, MAX_PAYLOAD_BYTES),
            "result_bytes": st.integers(0, MAX_PAYLOAD_BYTES),
        },
        {"keep": st.booleans(), "snapshot": st.booleans(), "restore": st.none() | payload},
    ),
    JailToolReturned: message(JailToolReturned, {"call_id": ref, "value": payload}),
    JailToolFailed: message(
        JailToolFailed, {"call_id": ref, "error_type": text(1, 256), "message": text()}
    ),
    JailReady: message(JailReady, {"protocol": version}, {"python": text(max_size=256)}),
    JailCallTool: message(JailCallTool, {"call_id": ref, "name": text(1, 128), "args": payload}),
    CodeFinished: message(
        CodeFinished,
        {"ok": st.booleans()},
        {"result": st.none() | payload, "error": st.none() | error_info, "files": plain},
    ),
}


def messages_of(direction: Any) -> st.SearchStrategy[Message]:
    return st.one_of([STRATEGIES[cls] for cls in MESSAGES[direction].values()])


any_directed_message = st.sampled_from(sorted(MESSAGES)).flatmap(
    lambda d: st.tuples(st.just(d), messages_of(d))
)


def test_strategies_cover_every_message() -> None:
    every = {cls for table in MESSAGES.values() for cls in table.values()}
    assert set(STRATEGIES) == every


# --------------------------------------------------------------------------- hostile bytes


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def _flip(data: bytes, at: int, value: int) -> bytes:
    if not data:
        return data
    i = at % len(data)
    return data[:i] + bytes([value]) + data[i + 1 :]


_message_like = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPE_NAMES) | text(max_size=12) | plain},
    optional={name: plain for name in FIELD_NAMES},
)


_TOKENS = [
    *(bytes([b]) for b in (0x80, 0x81, 0x82, 0x83, 0x8F, 0x90, 0x91, 0x92, 0x9F)),  # map, array
    b"\xde\x00\x02", b"\xdc\x00\x02", b"\xdf\xff\xff\xff\xff",  # map16, array16, map32
    b"\xc0", b"\xc2", b"\xc3", b"\xc1",  # nil, false, true, never used
    b"\x00", b"\x01", b"\x7f", b"\xff", b"\xcc\xff",  # ints
    b"\xcf" + b"\xff" * 8, b"\xd3\x80" + b"\x00" * 7,  # uint64 max, int64 min
    b"\xca\x7f\xc0\x00\x00", b"\xcb" + b"\x00" * 8,  # floats: NaN, 0.0
    b"\xa0", b"\xa1k", b"\xa2\xff\xfe", b"\xd9\x05abc",  # strs: empty, ok, bad UTF-8, short
    b"\xc4\x00", b"\xc4\x01x", b"\xc6\xff\xff\xff\xff",  # bins
    b"\xd4\x05\x00", b"\xd4\xff\x00", b"\xd6\xff\x00\x00\x00\x01", b"\xc7\x00\x01",  # exts
    *(msgpack.packb(name) for name in (*TYPE_NAMES, *FIELD_NAMES, "type")),
]
msgpack_soup = st.lists(
    st.sampled_from(_TOKENS) | st.binary(max_size=2), min_size=1, max_size=24
).map(b"".join) | st.lists(st.sampled_from(_TOKENS), min_size=1, max_size=24).map(
    lambda tokens: b"\x83" + b"".join(tokens)  # a map of three entries, then anything
)
"""Structurally random msgpack: headers, scalars and the protocol's own names, in any order."""


def _current(msg: Message) -> Message:
    """``msg`` speaking this side's protocol version (handshakes only pass with it)."""
    if hasattr(msg, "protocol"):
        return dataclasses.replace(msg, protocol=PROTOCOL_VERSION)  # type: ignore[type-var]
    return msg


def streams_for(direction: str) -> st.SearchStrategy[bytes]:
    """Byte streams aimed at a receiver of ``direction``: mostly frames, some valid, most not."""
    valid = messages_of(direction).map(lambda m: encode(_current(m)))
    mutated = st.builds(_flip, valid, st.integers(0, 1 << 16), st.integers(0, 255)) | st.builds(
        lambda p, n: p[: n % (len(p) + 1)], valid, st.integers(0, 1 << 16)
    )
    payloads = st.one_of(
        valid,
        mutated,
        any_directed_message.map(lambda dm: encode(dm[1])),  # valid, but maybe not here
        _message_like.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        plain.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        msgpack_soup,
        st.binary(max_size=64),
    )
    pieces = st.one_of(
        valid.map(_frame),
        payloads.map(_frame),  # a frame with a true length
        st.integers(0, 2**32 - 1).map(lambda n: n.to_bytes(4, "big")),  # a bare header
        st.binary(max_size=16),  # noise
    )
    good_start = st.lists(valid.map(_frame), max_size=3).map(b"".join)
    return st.builds(bytes.__add__, good_start, st.lists(pieces, max_size=5).map(b"".join))


_BUSY = {Role.DAEMON: State.READY, Role.CLIENT: State.READY,
         Role.SUPERVISOR: State.RUNNING, Role.JAIL: State.RUNNING}

hostile = (st.sampled_from(list(_BUSY.items())) | st.sampled_from(ENDS)).flatmap(
    lambda end: st.tuples(st.just(end), streams_for(RECV_DIRECTION[end[0]]))
)
splits = st.lists(st.integers(1, 97), max_size=8)


def split(data: bytes, sizes: list[int]) -> list[bytes]:
    if not sizes:
        return [data] if data else []
    out, pos, i = [], 0, 0
    while pos < len(data):
        out.append(data[pos : pos + sizes[i % len(sizes)]])
        pos += sizes[i % len(sizes)]
        i += 1
    return out


def drive(role: Role, state: State, reads: list[bytes], eof: bool,
          max_frame: int = MAX_FRAME) -> tuple[list[Message], str]:
    """Feed ``reads`` (then EOF) and pull every event. Returns (messages, how it ended).

    Fails the test if anything but a message, NEED_DATA, CLOSED or RemoteProtocolError comes out.
    """
    conn = Connection(role, max_frame)
    conn.state = state
    direction = RECV_DIRECTION[role]
    got: list[Message] = []
    for data in [*reads, b""] if eof else reads:
        conn.receive_data(data)
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                assert conn.state is State.CLOSED
                for _ in range(2):  # broken for good: the same error, every time
                    try:
                        conn.next_event()
                    except RemoteProtocolError as again:
                        assert again is exc
                    else:
                        raise AssertionError("a broken connection produced an event")
                return got, f"{type(exc).__name__}: {exc.message}"
            if event is NEED_DATA:
                assert data != b"", "NEED_DATA after EOF"
                break
            if event is CLOSED:
                assert data == b"", "CLOSED without EOF"
                assert conn.next_event() is CLOSED
                return got, "CLOSED"
            assert isinstance(event, Message), event
            assert MESSAGES[direction][event.TYPE] is type(event)  # type: ignore[index]
            got.append(event)
    return got, "NEED_DATA"


@FUZZ
@given(target=hostile, sizes=splits, eof=st.booleans())
def test_any_bytes_any_split_parse_or_raise_remote_protocol_error(
    target: tuple[tuple[Role, State], bytes], sizes: list[int], eof: bool
) -> None:
    (role, state), data = target
    chunked = drive(role, state, split(data, sizes), eof)
    whole = drive(role, state, [data] if data else [], eof)
    bytewise = drive(role, state, [data[i : i + 1] for i in range(len(data))], eof)
    # the split never changes the outcome (compared by repr: NaN is legal, and NaN != NaN)
    assert repr(chunked) == repr(whole) == repr(bytewise)


@FUZZ
@given(end=st.sampled_from(ENDS), data=st.binary(max_size=300), eof=st.booleans())
def test_raw_noise_parses_or_raises_remote_protocol_error(
    end: tuple[Role, State], data: bytes, eof: bool
) -> None:
    drive(*end, [data] if data else [], eof)


@FUZZ
@given(
    direction=st.sampled_from(sorted(MESSAGES)),
    body=st.one_of(
        st.binary(max_size=64),
        plain.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        _message_like.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        any_directed_message.map(lambda dm: encode(dm[1])),
        msgpack_soup,
    ),
)
def test_decode_returns_a_message_of_the_direction_or_raises_remote_protocol_error(
    direction: str, body: bytes
) -> None:
    try:
        msg = decode(body, direction)  # type: ignore[arg-type]
    except RemoteProtocolError:
        return
    assert type(msg) is MESSAGES[direction][msg.TYPE]  # type: ignore[index]
    assert decode(encode(msg), direction) == msg  # type: ignore[arg-type]


# --------------------------------------------------------------------------- valid messages


def _legal(role: Role, verb: str, type_name: str) -> State:
    return next(s for (r, s), moves in TRANSITIONS.items()
                if r is role and (verb, type_name) in moves)


@QUICK
@given(dm=any_directed_message)
def test_valid_messages_round_trip_through_encode_and_decode(dm: tuple[str, Message]) -> None:
    direction, msg = dm
    assert decode(encode(msg), direction) == msg  # type: ignore[arg-type]


@QUICK
@given(dm=any_directed_message, sizes=splits)
def test_valid_messages_round_trip_through_connections(dm: tuple[str, Message],
                                                       sizes: list[int]) -> None:
    direction, msg = dm
    msg = _current(msg)
    sender = Connection(SENDER[direction], 1 << 20)
    sender.state = _legal(sender.role, "send", msg.TYPE)
    data = sender.send(msg)
    role = RECEIVER[direction]
    got, end = drive(role, _legal(role, RECV, msg.TYPE), split(data, sizes), eof=True,
                     max_frame=1 << 20)
    assert (got, end) == ([msg], "CLOSED")


def _steady(role: Role) -> list[type[Message]]:
    """Messages the role may receive in its busy state without leaving it."""
    moves = TRANSITIONS[(role, _BUSY[role])]
    table = MESSAGES[RECV_DIRECTION[role]]  # type: ignore[index]
    return [table[t] for (verb, t), nxt in moves.items() if verb == RECV and nxt is _BUSY[role]]


@QUICK
@given(
    batch=st.sampled_from(list(_BUSY)).flatmap(
        lambda role: st.tuples(
            st.just(role),
            st.lists(st.one_of([STRATEGIES[c] for c in _steady(role)]), max_size=6),
        )
    ),
    sizes=splits,
)
def test_a_stream_of_valid_messages_comes_out_in_order(
    batch: tuple[Role, list[Message]], sizes: list[int]
) -> None:
    role, msgs = batch
    data = b"".join(encode_frame(encode(m), MAX_PAYLOAD_BYTES) for m in msgs)
    conn = Connection(role, 1 << 20)
    conn.state = _BUSY[role]
    got: list[Message] = []
    for piece in split(data, sizes):
        conn.receive_data(piece)
        while (event := conn.next_event()) is not NEED_DATA:
            assert isinstance(event, Message)
            got.append(event)
    assert got == msgs
    assert conn.state is _BUSY[role]
