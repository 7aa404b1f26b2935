"""Traces end to end: the real daemon with real jails, exporting OTLP/HTTP to a receiver on
loopback (``tests/otlp.py``, built on ``opentelemetry-proto``), configured by nothing but
the standard ``OTEL_*`` environment; the client library and the code-mode loop in this
process, whose spans (an in-memory exporter's) must share the daemon's traces."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from jaild.client import Client
from jaild.codemode import CodeMode
from tests.conftest import DaemonHandle, guard, policy_texts, start_daemon
from tests.integration.test_codemode import ChatServer, py
from tests.otlp import Receiver, SpanRecord, daemon_environment, encode, otlp_json

pytestmark = pytest.mark.integration

SPANS_OUT = "JAILD_TRACE_SPANS_OUT"
"""If set, the code-mode test writes every span of its trace there as OTLP/JSON (the picture
on docs/using/tracing.md: ``scripts/trace_picture.py``)."""


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()
    assert r.errors == []


@pytest.fixture(scope="module")
def traced(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """A daemon (the default and tiny policies) tracing to ``receiver``."""
    handle = start_daemon(tmp_path_factory.mktemp("traced"), policy_texts("default", "tiny"),
                          with_repo_policies=False, extra_env=daemon_environment(receiver))
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


@pytest.fixture
def caller() -> tuple[TracerProvider, InMemorySpanExporter]:
    """This process's own tracing (the client's side), apart from the global provider."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "jaild-codemode"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def job_tree(receiver: Receiver, job_id: str) -> tuple[SpanRecord, list[SpanRecord]]:
    """The job span of ``job_id`` and every span below it, once they have all arrived."""

    def complete(spans: list[SpanRecord]) -> bool:
        return any(s.name == "jaild.job" and s.attributes.get("jaild.job.id") == job_id
                   for s in spans)

    spans = receiver.wait_for(complete, f"the spans of {job_id}", guard(30))
    job = next(s for s in spans if s.name == "jaild.job"
               and s.attributes.get("jaild.job.id") == job_id)
    below, frontier = [], {job.span_id}
    while frontier:
        found = [s for s in spans if s.parent_id in frontier]
        below += found
        frontier = {s.span_id for s in found}
    return job, below


def lookup(key: str) -> dict[str, Any]:
    """A host tool."""
    return {"key": key, "length": len(key)}


def test_a_jailed_job_joins_the_callers_trace(
    traced: DaemonHandle, receiver: Receiver, caller: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, _ = caller
    with Client(traced.socket) as c, provider.get_tracer("agent").start_as_current_span(
        "agent step"
    ) as step:
        r = c.run("import asyncio\n"
                  "a, b = await asyncio.gather(tools.lookup(key='abc'), tools.lookup(key='de'))\n"
                  "print('done')\n[a, b]", tools={"lookup": lookup})
    assert r.status == "ok", r.error
    job, below = job_tree(receiver, r.job_id)
    context = step.get_span_context()
    assert job.trace_id == format_trace_id(context.trace_id)
    assert job.parent_id == format_span_id(context.span_id)
    assert job.service == "jaild" and job.kind == "server"
    assert sorted(s.name for s in below if s.parent_id == job.span_id) == [
        "jaild.admission", "jaild.jail_acquire", "jaild.record", "jaild.run"]
    attrs = job.attributes
    assert attrs["jaild.status"] == "ok" and attrs["jaild.policy"] == "default"
    assert attrs["jaild.jail.mode"] in ("pooled", "fresh")  # the default policy keeps a pool
    assert attrs["jaild.usage.memory_peak_bytes"] > 0  # the job's real cgroup
    assert attrs["jaild.usage.wall_s"] == r.usage["wall_s"]
    run = next(s for s in below if s.name == "jaild.run")
    calls = [s for s in below if s.parent_id == run.span_id]
    assert [c.attributes["jaild.tool.name"] for c in calls] == ["lookup", "lookup"]
    assert all(c.attributes["jaild.tool.outcome"] == "ok" for c in calls)
    assert all(c.attributes["jaild.tool.result_bytes"] > 0 for c in calls)
    assert all(run.start_ns <= c.start_ns <= c.end_ns <= run.end_ns for c in calls)
    text = json.dumps([s.attributes for s in [job, *below]])
    assert "abc" not in text and "done" not in text


@pytest.mark.parametrize(("code", "policy", "timeout", "status", "limit"), [
    ("import time\ntime.sleep(60)", "default", 1.0, "timeout", "wall_time_s"),
    ("x = []\nwhile True:\n    x.append(bytearray(1 << 20))", "tiny", None, "memory_limit",
     "memory_mb"),
    ("while True:\n    print('y' * 100)", "tiny", None, "output_limit", "output_bytes"),
])
def test_a_limit_hit_by_a_real_jail_is_an_event(
    traced: DaemonHandle, receiver: Receiver, code: str, policy: str, timeout: float | None,
    status: str, limit: str,
) -> None:
    with Client(traced.socket) as c:
        r = c.run(code, policy, timeout=timeout)
    assert r.status == status, r.error
    job, below = job_tree(receiver, r.job_id)
    assert [(name, attrs) for name, _, attrs in job.events] == [
        ("jaild.limit_hit", {"jaild.status": status, "jaild.limit": limit})]
    ((_, when, _),) = job.events
    assert job.start_ns <= when <= job.end_ns
    run = next(s for s in below if s.name == "jaild.run")
    if status != "memory_limit":  # the daemon's own kill ends the run
        assert run.end_ns == when
    assert job.attributes["jaild.error.limit"] == limit


def test_a_session_is_traced_at_its_opening_and_each_run(
    traced: DaemonHandle, receiver: Receiver, caller: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, _ = caller
    with Client(traced.socket) as c, provider.get_tracer("agent").start_as_current_span("s"):
        with c.session() as s:
            s.run("x = 20")
            r = s.run("x + 22")
        session_id = s.id
    assert r.result == 42
    spans = receiver.wait_for(
        lambda spans: any(x.name == "jaild.session.open"
                          and x.attributes.get("jaild.session.id") == session_id for x in spans),
        "the session's opening", guard(30))
    opened = next(x for x in spans if x.attributes.get("jaild.session.id") == session_id
                  and x.name == "jaild.session.open")
    job, below = job_tree(receiver, r.job_id)
    assert job.trace_id == opened.trace_id
    assert job.attributes["jaild.jail.mode"] == "session"
    assert job.attributes["jaild.session.run"] == 2
    acquire = next(x for x in below if x.name == "jaild.jail_acquire")
    assert acquire.duration_s < opened.duration_s  # the session's jail was made at its opening


def test_the_code_mode_loop_and_its_jail_runs_are_one_trace(
    traced: DaemonHandle, receiver: Receiver, caller: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = caller
    chat = ChatServer()
    chat.thread.start()
    try:
        chat.reply(  # the first program prints without end: the output limit stops it
            py("row = await tools.lookup(key='jails')\nwhile True:\n    print(row)"),
            py("import asyncio\n"
               "rows = await asyncio.gather(*(tools.lookup(key=k) for k in ('jails', 'nsjail')))\n"
               "sum(r['length'] for r in rows)"),
        )
        cm = CodeMode(tools={"lookup": lookup}, model="scripted-model", base_url=chat.base_url,
                      api_key="test-key", socket=traced.socket, max_retries=2,
                      tracer_provider=provider)
        result = asyncio.run(cm.run("Add up the lengths of the keys 'jails' and 'nsjail'"))
    finally:
        chat.httpd.shutdown()
        chat.httpd.server_close()
    assert result.success and result.result == 11, result.to_dict()
    assert [a.status for a in result.attempts] == ["output_limit", "ok"]
    loop_spans = exporter.get_finished_spans()
    task = next(s for s in loop_spans if s.name == "codemode.task")
    trace_id = format_trace_id(task.context.trace_id)
    attempts = sorted((s for s in loop_spans if s.name == "codemode.attempt"),
                      key=lambda s: s.start_time or 0)
    chats = [s for s in loop_spans if s.name == "chat scripted-model"]
    assert len(attempts) == len(chats) == 2
    job_ids = [a.job.job_id for a in result.attempts if a.job is not None]
    jobs = []
    for attempt, job_id in zip(attempts, job_ids, strict=True):
        job, below = job_tree(receiver, job_id)
        assert job.trace_id == trace_id
        assert job.parent_id == format_span_id(attempt.context.span_id)
        assert {s.trace_id for s in below} == {trace_id}
        jobs.append(job)
    assert [name for name, _, _ in jobs[0].events] == ["jaild.limit_hit"]
    everything = [s for s in receiver.spans() if s.trace_id == trace_id]
    assert {s.service for s in everything} == {"jaild"}
    out = os.environ.get(SPANS_OUT)
    if out:  # the picture on docs/using/tracing.md
        requests = [encode(loop_spans)]
        trace_only = otlp_json(requests)["resourceSpans"] + [
            rs for rs in otlp_json(receiver.requests)["resourceSpans"]]
        for rs in trace_only:
            for ss in rs["scopeSpans"]:
                ss["spans"] = [s for s in ss["spans"] if s["traceId"] == trace_id]
        Path(out).write_text(json.dumps({"resourceSpans": trace_only}, indent=1) + "\n")


def test_the_daemon_exports_what_is_queued_when_it_stops(
    private_daemon: Callable[..., DaemonHandle], tmp_path: Path
) -> None:
    receiver = Receiver().start()
    try:
        env = {**daemon_environment(receiver), "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # 10 min
        d = private_daemon(policy_texts("default"), with_repo_policies=False, extra_env=env)
        r = d.run("1 + 1")
        assert r.result == 2
        assert not any(s.name == "jaild.job" for s in receiver.spans())  # still queued
        assert d.stop() == 0
        assert any(s.name == "jaild.job" and s.attributes["jaild.job.id"] == r.job_id
                   for s in receiver.spans())
    finally:
        receiver.stop()


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRACES_EXPORTER": "nonexistent"}, "no trace exporter named 'nonexistent'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "speaks http/protobuf only"),
])
def test_traces_that_cannot_be_exported_stop_the_daemon(
    private_daemon: Callable[..., DaemonHandle], env: dict[str, str], message: str
) -> None:
    d = private_daemon(extra_env=env, wait=False)
    assert d.proc.wait(timeout=guard(60)) == 1, d.log()[-3000:]
    assert "jaild: cannot start: " in d.log() and message in d.log()
    assert not os.path.exists(d.socket)
