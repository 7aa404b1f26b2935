"""Typed records (jaild.protocol.records) and the daemon's one place that builds them
(jaild.daemon.core.records): validation, the wire round trip, the user's view, malformed input."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaild.client import JobResult
from jaild.daemon.core import records as build
from jaild.errors import LocalProtocolError, RemoteProtocolError
from jaild.policy.flow import ClosedSend, FlowCode
from jaild.policy.schema import load_policy_text
from jaild.protocol.messages import (
    MAX_MESSAGE_CHARS,
    JobFinished,
    JobList,
    PolicyList,
    SessionOpened,
    Stats,
    decode,
    encode,
    pack,
    unpack,
)
from jaild.protocol.records import (
    MAX_CALL_RECORDS,
    RECORDS,
    STATUSES,
    DaemonStats,
    EgressRecord,
    FlowRefusal,
    JobEntry,
    JobError,
    JobRecord,
    PolicyEntry,
    PoolInfo,
    Report,
    SessionInfo,
    SnapshotEntry,
    SnapshotKind,
    ToolCallEntry,
)

JOB = "job-0123456789abcdef"
POLICY = load_policy_text('description = "test"\n', "/etc/jaild/policies/default.toml")
USAGE = build.run_usage(
    code_started=10.0, code_ended=11.25, cpu_base=(1.0, 0.5), cpu_end=(1.75, 0.625),
    memory_peak_bytes=1 << 20, pids_peak=3, output_bytes=6, tool_calls=1, tool_time_s=0.1,
    stream_paused_s=0.0, stream_dropped_bytes=0,
)


def run_record(**changes: Any) -> JobRecord:
    kwargs: dict[str, Any] = {
        "job_id": JOB, "policy": POLICY, "limits": POLICY.limits, "status": "ok", "error": None,
        "stdout": b"hello\n", "stderr": b"", "tool_calls": [build.tool_call("search", 0.25, True)],
        "tool_calls_omitted": 0, "duration_s": 1.5, "usage": USAGE,
    }
    return build.job_record(**{**kwargs, **changes})


def over_the_wire(record: JobRecord) -> JobRecord:
    msg = decode(encode(JobFinished(job_id=record.job_id, record=record)), "daemon->client")
    assert isinstance(msg, JobFinished)
    return msg.record


# --------------------------------------------------------------------------- the structs


def test_every_record_is_a_frozen_report() -> None:
    record = run_record()
    assert all(issubclass(cls, Report) for cls in RECORDS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.status = "error"  # type: ignore[misc]


def test_a_record_round_trips_through_the_wire_unchanged() -> None:
    record = build.with_session(
        run_record(status="timeout", error=build.job_error("Timeout", "too slow",
                                                           limit="wall_time_s"),
                   files=[{"path": "out/a.txt", "size": 2, "sha256": "a" * 64}],
                   files_skipped=[{"path": "fifo", "reason": "not a regular file"}],
                   network_refused=2),
        "ses-0123abcd", 2, "timeout",
    )
    assert over_the_wire(record) == record
    assert over_the_wire(record).network_refused == 2
    assert over_the_wire(record).usage == USAGE  # typed all the way down
    assert over_the_wire(record).session.closed == "timeout"  # type: ignore[union-attr]


@pytest.mark.parametrize("status", STATUSES)
def test_error_is_nil_exactly_when_the_status_is_ok(status: str) -> None:
    error = build.job_error("E", "m")
    if status == "ok":
        run_record(status=status, error=None)
        with pytest.raises(LocalProtocolError, match="nil exactly when"):
            run_record(status=status, error=error)
    else:
        run_record(status=status, error=error)
        with pytest.raises(LocalProtocolError, match="nil exactly when"):
            run_record(status=status, error=None)


def test_there_is_no_status_outside_the_closed_set() -> None:
    """Positive control first: the same record with a real status is built."""
    run_record(status="error", error=build.job_error("E", "m"))
    for status in ("refused", "OK", "", "timeout "):
        with pytest.raises(LocalProtocolError, match="status"):
            run_record(status=status, error=build.job_error("E", "m"))


@pytest.mark.parametrize(("field", "value"), [
    ("job_id", "JOB-1"),
    ("duration_s", -0.5),
    ("duration_s", float("nan")),
    ("stdout", "\udc80"),
    ("tool_calls", ({"name": "", "duration_s": 0, "ok": True},)),
    ("tool_calls", ({"name": "t", "duration_s": 0, "ok": 1},)),
    ("limits", {"memory_mb": True}),
    ("usage", {}),
    ("files", ({"path": "a", "size": -1, "sha256": "0" * 64},)),
    ("tool_calls_omitted", -1),
    ("session", {"id": "ses-1", "run": 1}),
    ("network_refused", -1),
    ("network_refused", "3"),
])
def test_a_malformed_field_cannot_be_built_nor_received(field: str, value: Any) -> None:
    good = run_record().to_wire()
    JobRecord.from_wire(good)  # positive control
    with pytest.raises(LocalProtocolError):
        JobRecord.from_wire({**good, field: value})
    frame = msgpack.packb({"type": "JobFinished", "job_id": JOB, "record": {**good, field: value}},
                          use_bin_type=True, unicode_errors="surrogateescape")  # \udc80: 0x80
    with pytest.raises(RemoteProtocolError):
        decode(frame, "daemon->client")


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_a_record_map_with_an_unknown_or_a_missing_field_is_rejected(cls: type[Report]) -> None:
    required = sorted(cls._required)
    assert required, f"{cls.__name__} has no required field"
    with pytest.raises(LocalProtocolError, match="missing"):
        cls.from_wire({})
    with pytest.raises(LocalProtocolError, match="unknown"):
        cls.from_wire({"surprise": 1})


def test_the_daemon_to_client_reports_are_typed_and_checked() -> None:
    entry = {"id": JOB, "kind": "job", "policy": "default", "uid": 1000, "client_pid": 42,
             "state": "running", "age_s": 0.5, "memory_bytes": 4096, "cpu_s": 0.1, "pids": 2}
    jobs = decode(encode(JobList(ref=1, jobs=(JobEntry.from_wire(entry),))), "daemon->client")
    assert isinstance(jobs, JobList) and jobs.jobs[0].memory_bytes == 4096
    assert jobs.jobs[0].to_dict() == {**entry, "session": None}  # a job's fields, as ever
    starting = JobEntry.from_wire({**entry, "kind": "session", "state": "starting", "runs": 0,
                                   "running": False, "idle_s": 0.0, "expires_in_s": 60.0,
                                   "memory_bytes": None, "cpu_s": None, "pids": None})
    assert set(starting.to_dict()) == {"id", "kind", "policy", "uid", "client_pid", "state",
                                       "age_s", "runs", "running", "idle_s", "expires_in_s"}
    no_cpu = JobEntry.from_wire({**entry, "cpu_s": None})
    assert no_cpu.to_dict()["cpu_s"] is None  # a cgroup without CPU accounting
    pool = PoolInfo(mode="spawn", min=0, max=2, target=0, ready=0)
    policy = PolicyEntry(name="default", description="", limits={"memory_mb": 256},
                         network="none", egress=(), seccomp={"profile": "default", "action": "kill"},
                         env="default", available=True, problems="", pool=pool)
    listed = decode(encode(PolicyList(ref=2, policies=(policy,))), "daemon->client")
    assert isinstance(listed, PolicyList) and listed.policies == (policy,)
    assert "hits" not in listed.policies[0].to_dict()["pool"]


def test_a_session_as_opened_is_typed_and_its_view_is_the_old_map() -> None:
    info = SessionInfo(policy="default", idle_s=300.0, max_lifetime_s=3600.0,
                       limits=build.limits_map(POLICY, POLICY.limits))
    opened = decode(encode(SessionOpened(ref=1, session_id="ses-0123abcd", record=info)),
                    "daemon->client")
    assert isinstance(opened, SessionOpened) and opened.record == info
    assert opened.record.to_dict() == {"policy": "default", "idle_s": 300.0,
                                       "max_lifetime_s": 3600.0, "limits": info.limits}
    with pytest.raises(LocalProtocolError):
        SessionOpened(ref=1, session_id="ses-0123abcd", record={})  # type: ignore[arg-type]


def test_stats_are_typed_down_to_the_totals() -> None:
    totals = {"jobs": 2, "statuses": {"ok": 1, "timeout": 1}, "wall_s": 1.0, "cpu_user_s": 0.5,
              "cpu_system_s": 0.1, "memory_peak_bytes": 10, "pids_peak": 2, "output_bytes": 3,
              "tool_calls": 0, "tool_time_s": 0.0, "files_uploaded": 0, "files_downloaded": 0,
              "sessions": 0}
    stats = DaemonStats.from_wire({
        "since": 1.0, "policies": {"default": totals}, "uids": {"1000": totals}, "pods": {}, "principals": {},
        "running": {"jobs": 0, "sessions": 0, "connections": 1}, "pools": {},
        "metrics": {"refused": {"busy": 1}},
    })
    got = decode(encode(Stats(ref=1, stats=stats)), "daemon->client")
    assert isinstance(got, Stats) and got.stats == stats
    assert got.stats.uids["1000"].statuses == {"ok": 1, "timeout": 1}
    assert json.loads(json.dumps(got.stats.to_dict()))["policies"]["default"] == totals


# --------------------------------------------------------------------------- the user's view


def test_the_users_view_is_the_shape_of_protocol_version_2() -> None:
    """What ``jaild run --json`` prints and the client's dict attributes hold did not change:
    sparse fields are left out when nil or empty, the rest is plain JSON."""
    ok = run_record().to_dict()
    assert set(ok) == {"job_id", "policy", "status", "stdout", "stderr", "error", "tool_calls",
                       "duration_s", "limits", "usage", "files"}
    assert ok["tool_calls"] == [{"name": "search", "duration_s": 0.25, "ok": True}]
    failed = run_record(status="killed",
                        error=build.job_error("Killed", "x", signal="SIGSEGV")).to_dict()
    assert failed["error"] == {"type": "Killed", "message": "x", "traceback": "",
                               "lineno": None, "signal": "SIGSEGV"}
    assert json.loads(json.dumps(failed)) == failed
    seccomp = run_record(status="policy_violation", error=build.job_error(
        "PolicyViolation", "x", signal="SIGSYS", syscall=None)).to_dict()
    assert seccomp["error"]["syscall"] is None  # the kill is known, the call is not


def test_the_client_result_keeps_its_dicts_and_offers_the_typed_record() -> None:
    record = build.with_session(run_record(), "ses-0123abcd", 1, None)
    result = JobResult.from_wire(record, msgpack.packb(42), {"out/a.txt": b"hi"})
    assert result.result == 42 and result.downloads == {"out/a.txt": b"hi"}
    assert result.usage["wall_s"] == 1.25 and result.usage == USAGE.to_dict()
    assert result.session == {"id": "ses-0123abcd", "run": 1, "closed": None}
    assert result.record is record and result.record.usage.cpu_user_s == 0.75  # type: ignore[union-attr]
    # a result made by hand (a test double) has the typed record too
    by_hand = dataclasses.replace(result)
    assert by_hand.record == record


def test_an_egress_records_traffic_is_in_the_client_result_and_its_json() -> None:
    egress = EgressRecord(requests=3, bytes_out=120, bytes_in=4096, hosts=("pypi.org",),
                          refused={"not_allowed": 1})
    record = dataclasses.replace(run_record(), egress=egress)
    result = JobResult.from_wire(record.to_wire(), None)
    assert result.egress == egress.to_dict()
    view = result.to_dict()  # what `jaild run --json` prints
    assert view["egress"] == {"requests": 3, "bytes_out": 120, "bytes_in": 4096,
                              "hosts": ["pypi.org"], "refused": {"not_allowed": 1}}
    assert json.loads(json.dumps(view)) == view
    assert dataclasses.replace(result).record == record  # a copy re-checks its fields
    assert "egress" not in JobResult.from_wire(run_record(), None).to_dict()


def test_a_record_without_usage_shows_an_empty_usage_map() -> None:
    never_ran = build.internal_error_record(JOB, POLICY, POLICY.limits, RuntimeError("x"))
    assert JobResult.from_wire(never_ran, None).usage == {}
    assert JobResult.from_wire(never_ran.to_wire(), None).record == never_ran


# --------------------------------------------------------------------------- the builders


def test_run_usage_rounds_and_knows_when_there_is_no_cpu_accounting() -> None:
    assert (USAGE.wall_s, USAGE.cpu_user_s, USAGE.cpu_system_s) == (1.25, 0.75, 0.125)
    usage = build.run_usage(
        code_started=None, code_ended=5.0, cpu_base=None, cpu_end=(1.0, 1.0),
        memory_peak_bytes=None, pids_peak=None, output_bytes=0, tool_calls=0,
        tool_time_s=1e-9, stream_paused_s=0.0, stream_dropped_bytes=0,
    )
    assert usage.wall_s == 0.0 and usage.cpu_user_s is None and usage.tool_time_s == 0.0


def test_job_record_counts_calls_beyond_the_listed_ones() -> None:
    calls = [build.tool_call("t", 0.0, True)] * (MAX_CALL_RECORDS + 5)
    record = run_record(tool_calls=calls, tool_calls_omitted=7)
    assert len(record.tool_calls) == MAX_CALL_RECORDS and record.tool_calls_omitted == 12


def test_job_record_takes_calls_and_errors_as_maps_too() -> None:
    """The job's own bookkeeping may still hold maps: they are checked on the way in."""
    record = run_record(
        status="killed", error={"type": "Killed", "message": "SIGSEGV", "traceback": "",
                                "lineno": None, "signal": "SIGSEGV"},
        tool_calls=[{"name": "t", "duration_s": 0.1234567, "ok": False, "error_type": "E"}],
    )
    assert record.error == JobError(type="Killed", message="SIGSEGV", signal="SIGSEGV")
    assert record.tool_calls == (ToolCallEntry(name="t", duration_s=0.123457, ok=False,
                                               error_type="E"),)
    with pytest.raises(LocalProtocolError):
        run_record(tool_calls=[{"name": "t", "duration_s": 0.0, "ok": "yes"}])


def test_a_fork_refused_at_the_pids_limit_says_so_in_the_record() -> None:
    """The kernel's EAGAIN at ``limits.pids`` reaches Python as a bare BlockingIOError: the
    record's message and traceback name the limit when the cgroup peaked at it."""
    tb = 'Traceback (most recent call last):\n  File "<job>", line 3\nBlockingIOError: [Errno 11] x\n'
    error = {"type": "BlockingIOError", "message": "[Errno 11] x", "traceback": tb, "lineno": 3}
    at_limit = dataclasses.replace(USAGE, pids_peak=POLICY.limits.pids)
    # the control: under the limit the same error is the code's own, left as it came
    under = run_record(status="error", error=error)
    assert under.error == JobError(type="BlockingIOError", message="[Errno 11] x",
                                   traceback=tb, lineno=3)
    noted = run_record(status="error", error=error, usage=at_limit)
    assert noted.error is not None and noted.error.type == "BlockingIOError"
    limit = f"limits.pids = {POLICY.limits.pids}"
    assert noted.error.message.startswith("[Errno 11] x (the job reached its process limit")
    assert limit in noted.error.message
    assert noted.error.traceback.startswith(tb) and limit in noted.error.traceback.splitlines()[-1]
    assert over_the_wire(noted) == noted


def test_text_from_elsewhere_is_made_to_fit() -> None:
    """An nsjail log or an exception message of any length or encoding never breaks a record."""
    error = build.job_error("JailLost", "x" * (3 * MAX_MESSAGE_CHARS) + "\udc80end")
    assert len(error.message) == MAX_MESSAGE_CHARS and error.message.endswith("\\udc80end")
    record = run_record(status="internal_error", error=error, stdout=b"\xff\xfe ok")
    assert record.stdout == "\ufffd\ufffd ok"
    assert over_the_wire(record) == record


def test_internal_error_records() -> None:
    internal = build.internal_error_record(JOB, POLICY, POLICY.limits, RuntimeError("y" * 9000))
    assert internal.status == "internal_error" and internal.error is not None
    assert internal.error.type == "InternalError" and len(internal.error.message) == 4096
    for record in (internal,):
        assert record.limits == build.limits_map(POLICY, POLICY.limits)
        assert record.limits["network"] == "none" and record.limits["tmp_mb"] == 64
        assert over_the_wire(record) == record


def test_a_records_limits_are_its_jobs_own_and_each_record_has_its_own_map() -> None:
    # the map is built once per distinct Limits value; each record still gets its own dict
    lower = dataclasses.replace(POLICY.limits, wall_time_s=1.5, memory_mb=64)
    first = build.limits_map(POLICY, POLICY.limits)
    assert first == {**dataclasses.asdict(POLICY.limits), "network": "none", "tmp_mb": 64}
    first["wall_time_s"] = 999
    assert build.limits_map(POLICY, POLICY.limits)["wall_time_s"] == POLICY.limits.wall_time_s
    other = build.limits_map(POLICY, lower)
    assert (other["wall_time_s"], other["memory_mb"]) == (1.5, 64)


@given(st.binary(max_size=200), st.binary(max_size=200),
       st.floats(0, 1e6), st.text(max_size=300), st.sampled_from(STATUSES))
def test_any_run_builds_a_record_that_survives_the_wire(
    stdout: bytes, stderr: bytes, duration: float, message: str, status: str
) -> None:
    error = None if status == "ok" else build.job_error("E", message)
    record = run_record(stdout=stdout, stderr=stderr, duration_s=duration, status=status,
                        error=error)
    assert over_the_wire(record) == record
    assert JobResult.from_wire(record, None).to_dict()["status"] == status


def test_the_client_result_shows_refused_network_attempts_only_when_there_were_some() -> None:
    caught = JobResult.from_wire(run_record(network_refused=2), msgpack.packb(1))
    assert caught.network_refused == 2 and caught.to_dict()["network_refused"] == 2
    assert caught.record.network_refused == 2
    by_hand = dataclasses.replace(caught)  # the typed record rebuilt from the fields
    assert by_hand.record.network_refused == 2
    for quiet in (run_record(network_refused=0), run_record()):
        result = JobResult.from_wire(quiet, msgpack.packb(1))
        assert "network_refused" not in result.to_dict()
        assert "network_refused" not in quiet.to_dict()


def test_a_typed_word_is_held_as_the_word_the_wire_carries() -> None:
    """A daemon's typed word (a StrEnum member, such as a flow code) given to a field that
    takes a string or one of some words is held as the plain string: the struct, its wire
    form and the bytes packed are what the word would give."""
    typed = FlowRefusal(sink=ClosedSend.EGRESS, label="private", target="example.com:443",
                        code=FlowCode.FLOW_CUT)
    plain = FlowRefusal(sink="egress", label="private", target="example.com:443",
                        code="flow_cut")
    assert type(typed.sink) is str and type(typed.code) is str
    assert typed == plain and pack(typed.to_wire()) == pack(plain.to_wire())
    with pytest.raises(LocalProtocolError, match="expected one of"):
        FlowRefusal(sink=FlowCode.FLOW_CUT, label="private", target="x", code="flow_cut")


def test_a_snapshot_kind_reads_as_its_member_and_goes_as_its_word() -> None:
    base = {"id": "snap-" + "0" * 32, "policy": "p", "bytes": 1, "created": 1.0,
            "expires": 2.0, "session": "ses-" + "0" * 32}
    entry = SnapshotEntry.from_wire({**base, "kind": "parked"})
    assert entry.kind is SnapshotKind.PARKED
    assert SnapshotEntry.from_wire(base).kind is SnapshotKind.SNAPSHOT  # the default
    assert unpack(pack(entry.to_wire()))["kind"] == "parked"
    assert pack(entry.to_wire()) == pack({**entry.to_wire(), "kind": "parked"})
    with pytest.raises(LocalProtocolError,
                       match=r"expected one of \['parked', 'pause', 'snapshot'\], got 'held'"):
        SnapshotEntry.from_wire({**base, "kind": "held"})


def test_the_daemon_builds_a_record_unchecked_only_from_what_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``job_record`` builds with ``JobRecord.trusted`` when what it is given is as the
    checks want it (its parts are structs built checked): the record the checked
    constructor makes, field for field. Anything else goes through the checks, which
    refuse it as before."""
    trusted: list[JobRecord] = []
    real = JobRecord.trusted

    def spy(**fields: Any) -> JobRecord:
        trusted.append(real(**fields))
        return trusted[-1]

    monkeypatch.setattr(JobRecord, "trusted", spy)
    record = run_record(files=[{"path": "out/a.txt", "size": 2, "sha256": "a" * 64}],
                        network_refused=1)
    assert trusted == [record]
    assert record == JobRecord(**{name: getattr(record, name) for name in record._order})
    assert type(record.limits) is dict and type(record.files) is tuple
    for wrong, match in (({"status": "bogus"}, "'status'"),
                         ({"job_id": "Not A Job"}, "'job_id'"),
                         ({"tool_calls_omitted": -1}, "'tool_calls_omitted'")):
        with pytest.raises(LocalProtocolError, match=match):
            run_record(**wrong)
    assert len(trusted) == 1  # none of those was built unchecked
    # the parts are still checked as they are built: a file entry from the jail's listing
    with pytest.raises(LocalProtocolError, match="'sha256'"):
        run_record(files=[{"path": "a", "size": 1, "sha256": "not hex"}])


def test_job_finished_checks_the_files_a_jail_left() -> None:
    """The pipeline's ``JobFinished``: built unchecked from the record and the jail's checked
    result, but the files the jail left for download are checked (the control: without
    files the same path takes what it is given)."""
    from jaild.daemon.pipeline import _finished

    record = run_record()
    assert _finished(JOB, record, b"\x01", {}) == JobFinished(job_id=JOB, record=record,
                                                              result=b"\x01")
    assert _finished(JOB, record, None, {"out/a": b"x"}).files == {"out/a": b"x"}
    with pytest.raises(LocalProtocolError, match="files"):
        _finished(JOB, record, None, {"": b"x"})
