"""One decision per record field (jaild.daemon.core.disclosure): the table covers every
field of every record a closed sink is given, and closing a record leaves none of the
jail's words in it -- with the control, the same record open, where each of them is."""

from __future__ import annotations

import dataclasses
import json

from jaild.daemon.core import disclosure
from jaild.daemon.core.disclosure import (
    CUSTOM,
    RECORD,
    TABLES,
    Chooser,
    Closed,
    bucket,
    close_record,
    close_snapshot,
    field_paths,
)
from jaild.policy.flow import compile_flow, parse_sink
from jaild.policy.schema import load_policy_text
from jaild.protocol.records import (
    EgressRecord,
    FileEntry,
    FlowRecord,
    FlowRefusal,
    JobError,
    JobRecord,
    SessionRun,
    SkippedFile,
    SnapshotEntry,
    ToolCallEntry,
    Usage,
)


def test_every_field_of_every_closed_record_has_one_decision() -> None:
    for cls, table in TABLES.items():
        paths = field_paths(cls)
        assert len(paths) == len(set(paths))
        missing = sorted(set(paths) - set(table))
        stale = sorted(set(table) - set(paths))
        assert not missing, f"{cls.__name__}: fields without a decision: {missing}"
        assert not stale, f"{cls.__name__}: decisions for no field: {stale}"


def test_every_decision_says_who_chooses_why_and_custom_ones_are_carried_out() -> None:
    for table in TABLES.values():
        for path, decision in table.items():
            assert decision.why, path
            assert isinstance(decision.chooser, Chooser) and isinstance(decision.closed, Closed)
            if decision.closed is Closed.CUSTOM:
                assert path in CUSTOM, f"{path}: custom, but no rule carries it out"
            if decision.chooser is Chooser.JAIL:  # never kept as it is past a closed sink
                assert decision.closed is not Closed.KEEP, path


def test_the_field_walk_sees_a_field_added_to_a_nested_record() -> None:
    """The control for the walk: it reaches nested structs and lists of them."""
    paths = field_paths(JobRecord)
    for path in ("error.lineno", "tool_calls[].name", "egress.hosts",
                 "flow.refusals[].target", "files_skipped[].path", "usage.pids_peak"):
        assert path in paths


POLICY = load_policy_text("", "flow.toml")

JAIL_WORDS = ("Leak_type", "leak.example", "leak_file", "refused-target.example")


def hostile_record() -> JobRecord:
    """A record with a jail-chosen value in every field the jail can choose."""
    return JobRecord(
        job_id="job-0123456789abcdef", policy="flow", status="error",
        stdout="", stderr="",
        error=JobError(type="Leak_type", message="(withheld)", traceback="",
                       lineno=123456789, signal="SIGUSR1", syscall="keyctl"),
        tool_calls=(ToolCallEntry(name="read_mail", duration_s=0.1, ok=True),
                    ToolCallEntry(name="(unknown)", duration_s=0.0, ok=False,
                                  error_type="unknown_tool")),
        duration_s=1.5, limits={"wall_time_s": 10.0},
        usage=Usage(wall_s=1.0, cpu_user_s=0.5, cpu_system_s=0.1,
                    memory_peak_bytes=123_456_789, pids_peak=37, output_bytes=1_000_003,
                    tool_calls=77, tool_time_s=0.2, stream_paused_s=0.0,
                    stream_dropped_bytes=999),
        files=(FileEntry(path="out.txt", size=3, sha256="0" * 64),),
        files_skipped=(SkippedFile(path="leak_file", reason="too large"),),
        tool_calls_omitted=75,
        session=SessionRun(id="ses-0123456789abcdef", run=3, closed=None),
        egress=EgressRecord(requests=1001, bytes_out=77777, bytes_in=5, refused={"flow": 13},
                            hosts=("api.example.com", "leak.example")),
        flow=FlowRecord(labels=("private",), withheld=("output", "result"), refusals=tuple(
            FlowRefusal(sink="egress", label="private", target=f"x{i}.refused-target.example:80",
                        code="flow_denied",
                        reason=f"egress to x{i}.refused-target.example:80 is closed")
            for i in range(40))),
        network_refused=987654321,
    )


def test_a_closed_record_keeps_none_of_the_jails_words_and_the_open_one_all() -> None:
    record = hostile_record()
    shown = json.dumps(record.to_dict())
    for word in JAIL_WORDS:  # the control: each is in the record as the jail made it
        assert word in shown
    closed = close_record(record, ["api.example.com"])
    shown = json.dumps(closed.to_dict())
    for word in JAIL_WORDS:
        assert word not in shown, word
    assert closed.error is not None and closed.error.type == disclosure.WITHHELD
    assert (closed.error.lineno, closed.error.signal, closed.error.syscall) == (None,) * 3
    assert closed.tool_calls == () and closed.tool_calls_omitted == 0
    assert closed.usage is not None and closed.usage.tool_calls == 128
    assert closed.usage.memory_peak_bytes == 1 << 27 and closed.usage.pids_peak == 64
    assert closed.network_refused == 1 << 30
    assert closed.egress is not None
    assert closed.egress.hosts == (disclosure.OTHER_HOST, "api.example.com")
    assert closed.egress.requests == 1024 and closed.egress.refused == {"flow": 16}
    assert closed.flow is not None and len(closed.flow.refusals) == 1  # one per kind
    # what is not the jail's stays
    assert (closed.job_id, closed.status, closed.limits) == (
        record.job_id, record.status, record.limits)
    assert closed.session == record.session and closed.files == record.files
    assert closed.flow.labels == ("private",)


def test_the_daemons_own_error_words_are_kept() -> None:
    record = hostile_record()
    for word in ("Timeout", "MemoryLimit", "PolicyViolation"):
        error = JobError(type=word, message="m")
        assert close_record(JobRecord.from_wire({**record.to_wire(),
                                                 "error": error.to_wire()})).error.type == word


def test_closed_is_when_the_result_or_the_output_is_withheld_or_redacted() -> None:
    record = hostile_record()
    assert disclosure.closed(record)
    for withheld, redacted, expected in [((), (), False), (("downloads",), (), False),
                                         (("result",), (), True), ((), ("output",), True)]:
        flow = FlowRecord(labels=("x",), refusals=(), withheld=withheld, redacted=redacted)
        view = disclosure.caller_view(dataclasses.replace(record, flow=flow), POLICY)
        assert disclosure.closed(dataclasses.replace(record, flow=flow)) is expected
        assert (view.error.type == disclosure.WITHHELD) is expected  # type: ignore[union-attr]


def test_the_operator_sees_the_record_closed_when_any_unreleased_caller_would() -> None:
    """A caller in release_to gets the record open; the audit log, traces and metrics get
    it as a caller not released would -- closed."""
    policy = load_policy_text('[[flow.sink]]\nlabel = "private"\nresult = "withhold"\n'
                              'release_to = ["root"]\n', "flow.toml")
    released = dataclasses.replace(hostile_record(), flow=FlowRecord(
        labels=("private",), refusals=(), withheld=(), redacted=()))
    assert disclosure.caller_view(released, policy) is released  # the released caller: open
    seen = disclosure.operator_view(released, policy)
    assert seen.error is not None and seen.error.type == disclosure.WITHHELD
    unlabelled = dataclasses.replace(released, flow=None)  # the control: nothing held
    assert disclosure.operator_view(unlabelled, policy) is unlabelled


def test_a_snapshot_entry_closed_has_its_size_bucketed_and_no_digest() -> None:
    entry = SnapshotEntry(id="snap-" + "0" * 32, policy="p", bytes=40_961, created=1.0,
                          expires=2.0, session="ses-0123456789abcdef", sha256="a" * 64,
                          labels=("secret",))
    closed = close_snapshot(entry)
    assert closed.bytes == 65536 and closed.sha256 == "0" * 64 and closed.labels == ("secret",)


def test_bucket() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000)] == [0, 1, 2, 4, 4, 8, 1024]
    assert bucket(None) is None and bucket(-3) == 0


def test_literal_hosts_are_the_policys_names_without_a_wildcard() -> None:
    policy = load_policy_text('[network]\nmode = "egress"\n[egress]\nallow = '
                              '["api.example.com", "*.cdn.example", "pypi.org:443"]\n', "p.toml")
    assert disclosure.literal_hosts(policy) == {"api.example.com", "pypi.org"}


def test_record_table_names_the_fields_the_issue_found_leaking() -> None:
    """The findings of issue 41: each is decided, and not kept."""
    for path in ("tool_calls[].name", "error.type", "error.lineno", "network_refused",
                 "egress.hosts", "flow.refusals[].target"):
        assert RECORD[path].closed is not Closed.KEEP


def test_a_closed_jobs_live_use_is_bucketed_and_an_open_ones_exact() -> None:
    """``jaild ps``, polled, would carry the jail's memory as a channel: closed while its
    labels withhold (the control: labels that close nothing, or no labels, leave it)."""
    withhold = parse_sink({"label": "secret", "output": "withhold"})
    egress_only = parse_sink({"label": "private", "egress": []})
    rules = compile_flow("flow", (), (withhold, egress_only), ("untrusted",), (), "refuse")
    live = {"memory_bytes": 12_345_678, "cpu_s": 0.25, "pids": 3}
    assert disclosure.closes(rules, {"secret"})
    assert disclosure.close_live(live) == {"memory_bytes": 1 << 24, "cpu_s": 0.25, "pids": 4}
    assert not disclosure.closes(rules, {"private"}) and not disclosure.closes(rules, set())
    released = compile_flow("flow", (), (parse_sink(
        {"label": "secret", "output": "withhold", "release_to": ["root"]}),),
        ("untrusted",), (), "refuse")
    assert disclosure.closes(released, {"secret"})  # release_to opens it to a caller only
