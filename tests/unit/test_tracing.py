"""Traces: the daemon's spans for a job, the client's trace context, turning tracing on.

The daemon here is the real core with the fake launcher (:mod:`jaild.testing`), tracing to
the SDK's in-memory exporter; the jails are plain subprocesses, so what needs a cgroup (an
OOM kill) is tested on :class:`~jaild.tracing.JobTrace` directly, and in the integration
suite with real jails (``tests/integration/test_tracing.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    format_span_id,
    format_trace_id,
    use_span,
)

import jaild
from jaild import tracing
from jaild.client import AsyncClient, Client
from jaild.codemode import CodeMode
from jaild.daemon.core import records
from jaild.errors import LocalProtocolError, TracingError, UnknownPolicy
from jaild.protocol import PROTOCOL_VERSION, encode_frame
from jaild.protocol.messages import (
    Error,
    Hello,
    JobAccepted,
    JobDescription,
    JobFinished,
    OpenSession,
    RunJob,
    Welcome,
)
from jaild.testing import daemon_thread, fake_daemon, frame, frames, load_policies
from jaild.tracing import MAX_TOOL_SPANS, Tracing, current_traceparent, requested_exporters
from tests.conftest import guard
from tests.otlp import Receiver, daemon_environment

POLICY = """
[limits]
wall_time_s = 20
tool_calls = 2000
"""
SECRET = "s3cr3t-argument-value"
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


class Spans:
    """What an in-memory exporter got, by name and parentage."""

    def __init__(self, finished: Sequence[ReadableSpan]) -> None:
        self.all = list(finished)

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        (found,) = self.named(name)
        return found

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        span_id = parent.context.span_id
        return sorted((s for s in self.all if s.parent is not None
                       and s.parent.span_id == span_id and not s.parent.is_remote),
                      key=lambda s: (s.start_time or 0, s.name))


def provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    made = TracerProvider()
    made.add_span_processor(SimpleSpanProcessor(exporter))
    return made, exporter


@contextlib.asynccontextmanager
async def traced(policies: Any = None) -> AsyncIterator[tuple[AsyncClient, InMemorySpanExporter]]:
    made, exporter = provider()
    async with asyncio.timeout(guard(60)), fake_daemon(
        policies or {"default": POLICY}, tracing=Tracing(made)
    ) as fake:
        yield await fake.connect(), exporter


def run(test: Any) -> None:
    asyncio.run(test())


def attribute_values(spans: Sequence[ReadableSpan]) -> list[str]:
    """Every attribute and event-attribute value of ``spans``, as text."""
    out = []
    for s in spans:
        out += [str(v) for v in (s.attributes or {}).values()]
        for e in s.events:
            out += [str(v) for v in (e.attributes or {}).values()]
    return out


# ----------------------------------------------------------------------------- the span tree


def lookup(key: str) -> str:
    """A host tool whose schema wants a string."""
    return f"value-of-{key}"



def test_a_job_is_one_span_with_its_phases_and_tool_calls() -> None:
    code = (
        f"await tools.lookup(key={SECRET!r})\n"
        "await tools.lookup(key='x')\n"
        "try:\n    await tools.lookup(key=5)\nexcept Exception:\n    pass\n"
        "print('printed-output-text')\n"
        "'the-result-value'"
    )

    async def test() -> None:
        async with traced() as (client, exporter):
            r = await client.run(code, tools={"lookup": lookup})
            assert r.status == "ok", r.error
        spans = Spans(exporter.get_finished_spans())
        job = spans.one("jaild.job")
        assert job.parent is None and job.kind is SpanKind.SERVER
        assert [s.name for s in spans.children(job)] == [
            "jaild.admission", "jaild.jail_acquire", "jaild.run", "jaild.record"]
        attrs = dict(job.attributes or {})
        assert attrs["jaild.job.id"] == r.job_id and attrs["jaild.policy"] == "default"
        assert attrs["jaild.status"] == "ok" and attrs["jaild.jail.mode"] == "fresh"
        assert attrs["jaild.tool_calls"] == 3 and attrs["jaild.usage.tool_calls"] == 3
        assert attrs["jaild.usage.wall_s"] == r.usage["wall_s"]
        assert attrs["jaild.usage.output_bytes"] == len("printed-output-text\n")
        assert job.status.status_code is StatusCode.UNSET

        run_span = spans.one("jaild.run")
        calls = spans.children(run_span)
        assert [(c.attributes or {})["jaild.tool.outcome"] for c in calls] == [
            "ok", "ok", "invalid_arguments"]
        first = dict(calls[0].attributes or {})
        assert first["jaild.tool.name"] == "lookup"
        assert first["jaild.tool.args_bytes"] > len(SECRET)  # sizes, never the values
        assert first["jaild.tool.result_bytes"] == len(msgpack.packb(f"value-of-{SECRET}"))
        refused = dict(calls[2].attributes or {})
        assert refused["error.type"] == "invalid_arguments"
        assert refused["jaild.tool.result_bytes"] == 0 and refused["jaild.tool.args_bytes"] > 0
        assert calls[2].start_time == calls[2].end_time  # refused by the daemon: no round trip

        # the phases follow each other inside the job, the calls inside the run
        phases = spans.children(job)
        for before, after in itertools.pairwise(phases):
            assert before.end_time is not None and after.start_time is not None
            assert before.end_time <= after.start_time
        assert job.start_time == phases[0].start_time and phases[-1].end_time == job.end_time
        for c in calls:
            assert run_span.start_time <= c.start_time <= c.end_time <= run_span.end_time  # type: ignore[operator]
        assert {s.context.trace_id for s in spans.all} == {job.context.trace_id}

        # what a span never holds: arguments, results, code, output
        text = " ".join(attribute_values(spans.all))
        for private in (SECRET, "value-of", "printed-output-text", "the-result-value", "tools."):
            assert private not in text

    run(test)


def test_a_timeout_is_an_event_at_the_kill() -> None:
    async def test() -> None:
        async with traced() as (client, exporter):
            r = await client.run("import time\ntime.sleep(30)", timeout=0.5)
            assert r.status == "timeout"
        spans = Spans(exporter.get_finished_spans())
        job, run_span = spans.one("jaild.job"), spans.one("jaild.run")
        (event,) = job.events
        assert event.name == "jaild.limit_hit"
        assert dict(event.attributes or {}) == {"jaild.status": "timeout",
                                                "jaild.limit": "wall_time_s"}
        assert run_span.end_time == event.timestamp  # the run ends where the daemon killed it
        assert (run_span.end_time - run_span.start_time) / 1e9 >= 0.5  # type: ignore[operator]
        assert (job.attributes or {})["jaild.error.limit"] == "wall_time_s"

    run(test)


def record_of(status: str, error: dict[str, Any] | None) -> Any:
    policy = load_policies(None)["default"]
    usage = records.run_usage(
        code_started=1.0, code_ended=1.5, cpu_base=(0.0, 0.0), cpu_end=(0.3, 0.1),
        memory_peak_bytes=64 << 20, pids_peak=3, output_bytes=0, tool_calls=0,
        tool_time_s=0.0, stream_paused_s=0.0, stream_dropped_bytes=0,
    )
    return records.job_record(
        job_id="job-1", policy=policy, limits=policy.limits, status=status, error=error,
        stdout=b"", stderr=b"", tool_calls=(), tool_calls_omitted=0, duration_s=0.6, usage=usage,
    )


@pytest.mark.parametrize(("status", "error", "event", "expected"), [
    ("memory_limit", {"type": "MemoryLimit", "message": "oom", "limit": "memory_mb"},
     "jaild.limit_hit", {"jaild.status": "memory_limit", "jaild.limit": "memory_mb"}),
    ("output_limit", {"type": "OutputLimit", "message": "too much", "limit": "output_bytes"},
     "jaild.limit_hit", {"jaild.status": "output_limit", "jaild.limit": "output_bytes"}),
    ("policy_violation", {"type": "PolicyViolation", "message": "x", "syscall": "ptrace",
                          "signal": "SIGSYS"},
     "jaild.policy_violation", {"jaild.error.syscall": "ptrace"}),
])
def test_limit_hits_and_seccomp_kills_are_events(
    status: str, error: dict[str, Any], event: str, expected: dict[str, str]
) -> None:
    """Without a daemon: a job trace given the record a real jail's end makes."""
    made, exporter = provider()
    trace = Tracing(made).job(None, 1000)
    trace.admitted()
    trace.emitted(code_sent=None, code_ended=None)
    trace.finish(record_of(status, error), "pooled")
    spans = Spans(exporter.get_finished_spans())
    job = spans.one("jaild.job")
    assert [(e.name, dict(e.attributes or {})) for e in job.events] == [(event, expected)]
    attrs = dict(job.attributes or {})
    assert attrs["jaild.usage.memory_peak_bytes"] == 64 << 20
    assert attrs["jaild.usage.cpu_user_s"] == 0.3 and attrs["jaild.client.uid"] == 1000
    assert "jaild.run" not in [s.name for s in spans.all]  # its code was never sent


def test_tool_spans_are_capped_and_the_rest_counted() -> None:
    made, exporter = provider()
    trace = Tracing(made).job(None, 0)
    trace.admitted()
    for _ in range(MAX_TOOL_SPANS + 5):
        trace.tool_call("t", "ok", 0.0, 10, 1)
    trace.emitted(code_sent=0.0, code_ended=None)
    trace.finish(record_of("ok", None), "fresh")
    spans = Spans(exporter.get_finished_spans())
    assert len(spans.named("jaild.tool_call")) == MAX_TOOL_SPANS
    assert (spans.one("jaild.job").attributes or {})["jaild.tool_calls.untraced"] == 5


def test_a_syntax_error_is_a_jails_and_a_refusal_is_an_error_span() -> None:
    async def test() -> None:
        async with traced() as (client, exporter):
            r = await client.run("def (")
            assert r.status == "error"
            with pytest.raises(UnknownPolicy):
                await client.run("1", "no-such-policy")
        spans = Spans(exporter.get_finished_spans())
        compiled, refused = spans.named("jaild.job")
        # the daemon never compiles a job's code: the jail does, and its error is the job's
        assert (compiled.attributes or {})["jaild.jail.mode"] == "fresh"
        assert (compiled.attributes or {})["jaild.error.type"] == "SyntaxError"
        assert [s.name for s in spans.children(compiled)] == [
            "jaild.admission", "jaild.jail_acquire", "jaild.run", "jaild.record"]
        assert spans.children(refused) == []
        assert refused.status.status_code is StatusCode.ERROR
        assert (refused.attributes or {})["jaild.refused"] == "unknown_policy"

    run(test)


# ----------------------------------------------------------------------------- propagation


def test_the_callers_span_parents_the_job() -> None:
    caller_provider, caller_exporter = provider()
    tracer = caller_provider.get_tracer("test")

    async def test() -> None:
        async with traced() as (client, exporter):
            with tracer.start_as_current_span("agent step") as step:
                r = await client.run("1 + 1")
            assert r.result == 2
            await client.run("2")  # outside the span: a trace of its own
        caller = step.get_span_context()
        first, second = Spans(exporter.get_finished_spans()).named("jaild.job")
        assert first.context.trace_id == caller.trace_id
        assert first.parent is not None and first.parent.span_id == caller.span_id
        assert first.parent.is_remote
        assert second.context.trace_id != caller.trace_id and second.parent is None
        assert [s.name for s in caller_exporter.get_finished_spans()] == ["agent step"]

    run(test)


def test_the_blocking_client_carries_the_callers_context_to_its_thread() -> None:
    caller_provider, _ = provider()
    made, exporter = provider()
    tracer = caller_provider.get_tracer("test")
    with (
        daemon_thread({"default": POLICY}, tracing=Tracing(made)) as d,
        Client(d.socket_path) as c,
        tracer.start_as_current_span("caller") as caller,
    ):
        assert c.run("6 * 7").result == 42
        with c.session() as s:
            s.run("x = 1")
    spans = Spans(exporter.get_finished_spans())
    trace_id = caller.get_span_context().trace_id
    assert {s.context.trace_id for s in spans.all} == {trace_id}
    opened = spans.one("jaild.session.open")
    assert opened.parent is not None and opened.parent.span_id == caller.get_span_context().span_id
    attrs = dict(opened.attributes or {})
    assert attrs["jaild.jail.mode"] == "session" and attrs["jaild.session.id"].startswith("ses-")
    run_job = [j for j in spans.named("jaild.job") if (j.attributes or {}).get("jaild.session.id")]
    assert [(j.attributes or {})["jaild.jail.mode"] for j in run_job] == ["session"]
    assert (run_job[0].attributes or {})["jaild.session.run"] == 1


def test_an_unsampled_caller_gets_no_spans() -> None:
    """The caller's sampling decision holds (the SDK's default sampler is parent-based)."""
    unsampled = SpanContext(int(CALLER_TRACE, 16), int(CALLER_SPAN, 16), is_remote=True,
                            trace_flags=TraceFlags(0))

    async def test() -> None:
        async with traced() as (client, exporter):
            with use_span(NonRecordingSpan(unsampled)):
                assert current_traceparent() == f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"
                assert (await client.run("1")).result == 1
            assert exporter.get_finished_spans() == ()
            await client.run("2")  # positive control: no caller, sampled
            assert len(exporter.get_finished_spans()) == 5

    run(test)


def test_current_traceparent_is_the_current_span_in_w3c_form() -> None:
    made, _ = provider()
    assert current_traceparent() is None  # no span
    with made.get_tracer("t").start_as_current_span("s") as s:
        ctx = s.get_span_context()
        flags = f"{ctx.trace_flags:02x}"  # sampled (01), and the SDK's random-id bit (02)
        assert ctx.trace_flags.sampled and flags in ("01", "03")
        assert current_traceparent() == (
            f"00-{format_trace_id(ctx.trace_id)}-{format_span_id(ctx.span_id)}-{flags}")


def test_without_opentelemetry_loaded_nothing_imports_it() -> None:
    """A job through the client and the daemon core, tracing off: no OpenTelemetry module
    is loaded (the client checks ``sys.modules``; the daemon asks ``tracing.on``)."""
    probe = (
        "import asyncio, json, sys\n"
        "from jaild.testing import daemon_pair\n"
        "async def main():\n"
        "    async with daemon_pair() as c:\n"
        "        r = await c.run('1 + 1')\n"
        "        assert r.result == 2, r\n"
        "asyncio.run(main())\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=guard(120), check=True)
    assert json.loads(out.stdout) == []


def test_a_code_mode_task_is_one_trace_of_model_calls_and_jobs() -> None:
    """The loop's spans (through the provider it is given) and the daemon's spans for its
    jobs share one trace: each job is a child of its attempt."""
    replies = ["```python\n1 / 0\n```", f"```python\nawait tools.lookup(key={SECRET!r})\n```"]

    class Completions:
        async def create(self, model: str, messages: Any, **_: Any) -> Any:
            message = SimpleNamespace(content=replies.pop(0))
            return SimpleNamespace(
                choices=[SimpleNamespace(message=message)], model=model,
                usage=SimpleNamespace(prompt_tokens=10, completion_tokens=5, total_tokens=15))

    llm: Any = SimpleNamespace(chat=SimpleNamespace(completions=Completions()))
    loop_provider, loop_exporter = provider()

    async def test() -> None:
        async with traced() as (client, exporter):
            cm = CodeMode(tools={"lookup": lookup}, model="scripted", client=client, llm=llm,
                          max_retries=2, tracer_provider=loop_provider)
            result = await cm.run(f"use the key {SECRET}")
            assert result.success and len(result.attempts) == 2
        loop, daemon = Spans(loop_exporter.get_finished_spans()), Spans(
            exporter.get_finished_spans())
        task = loop.one("codemode.task")
        assert task.parent is None
        attempts = loop.children(task)
        assert [s.name for s in attempts] == ["codemode.attempt", "codemode.attempt"]
        assert [(a.attributes or {})["jaild.codemode.status"] for a in attempts] == ["error", "ok"]
        jobs = daemon.named("jaild.job")
        assert len(jobs) == 2
        for attempt, job in zip(attempts, jobs, strict=True):
            (chat,) = loop.children(attempt)
            assert chat.name == "chat scripted" and chat.kind is SpanKind.CLIENT
            assert (chat.attributes or {})["gen_ai.usage.input_tokens"] == 10
            assert job.parent is not None and job.parent.span_id == attempt.context.span_id
        traces = {s.context.trace_id for s in loop.all + daemon.all}
        assert traces == {task.context.trace_id}
        assert (task.attributes or {})["jaild.codemode.attempts"] == 2
        text = " ".join(attribute_values(loop.all + daemon.all))
        assert SECRET not in text and "1 / 0" not in text

    run(test)


def test_a_failed_model_call_is_an_error_span_without_its_message() -> None:
    """An API's error message may quote a request header (a key): the span keeps the type."""

    class Completions:
        async def create(self, model: str, messages: Any, **_: Any) -> Any:
            raise PermissionError(f"bad key {SECRET}")

    llm: Any = SimpleNamespace(chat=SimpleNamespace(completions=Completions()))
    loop_provider, loop_exporter = provider()

    async def test() -> None:
        async with traced() as (client, _):
            cm = CodeMode(model="scripted", client=client, llm=llm,
                          tracer_provider=loop_provider)
            with pytest.raises(PermissionError):
                await cm.run("anything")

    run(test)
    spans = Spans(loop_exporter.get_finished_spans())
    assert [s.name for s in spans.all] == ["chat scripted", "codemode.attempt", "codemode.task"]
    for span in spans.all:
        assert span.status.status_code is StatusCode.ERROR
        assert (span.attributes or {})["error.type"] == "PermissionError"
        assert span.events == ()  # no exception event: its message is not kept
    assert SECRET not in " ".join([*attribute_values(spans.all),
                                   *(str(s.status.description) for s in spans.all)])


# ----------------------------------------------------------------------------- untrusted input

BAD_TRACEPARENTS = [
    "",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-01-",  # too long
    f"00-{CALLER_TRACE.upper()}-{CALLER_SPAN}-01",  # upper case
    f"00-{'0' * 32}-{CALLER_SPAN}-01",  # the invalid trace id
    f"00-{CALLER_TRACE}-{'0' * 16}-01",  # the invalid span id
    f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01",  # the forbidden version
    f"01-{CALLER_TRACE}-{CALLER_SPAN}-01",  # a version this protocol does not know
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-0g",
    f"00_{CALLER_TRACE}_{CALLER_SPAN}_01",
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-01" + "x" * 1000,
]


@pytest.mark.parametrize("bad", BAD_TRACEPARENTS)
def test_a_malformed_traceparent_cannot_be_built(bad: str) -> None:
    with pytest.raises(LocalProtocolError, match="traceparent"):
        RunJob(ref=1, job=JobDescription(code="1"), policy="default", traceparent=bad)
    with pytest.raises(LocalProtocolError, match="traceparent"):
        OpenSession(ref=1, policy="default", traceparent=bad)


def _raw_run_job(traceparent: object) -> bytes:
    wire = RunJob(ref=1, job=JobDescription(code="6 * 7"), policy="default").to_wire()
    wire["traceparent"] = traceparent
    return encode_frame(msgpack.packb(wire, use_bin_type=True), 1 << 20)


@pytest.mark.parametrize("bad", [BAD_TRACEPARENTS[4], BAD_TRACEPARENTS[-1], 7, b"\x00" * 55])
def test_the_daemon_refuses_a_malformed_traceparent_with_an_error_frame(bad: object) -> None:
    """The hostile form gets ``bad_frame`` and a close, like any malformed field; the
    positive control, the same frame with a valid traceparent, runs and joins its trace."""

    async def exchange(run_job: bytes) -> list[Any]:
        made, exporter = provider()
        async with asyncio.timeout(guard(60)), fake_daemon(tracing=Tracing(made)) as fake:
            reader, writer = await asyncio.open_unix_connection(sock=fake.raw_connection())
            writer.write(frame(Hello(protocol=PROTOCOL_VERSION, client="raw")) + run_job)
            answer: list[Any] = []
            while not any(isinstance(m, JobFinished | Error) for m in answer):
                data = await reader.read(1 << 16)
                if not data:
                    break
                answer += frames(data, "daemon->client")
            writer.close()
        return [answer, exporter.get_finished_spans()]

    refused, no_spans = asyncio.run(exchange(_raw_run_job(bad)))
    assert [type(m) for m in refused] == [Welcome, Error]
    assert refused[1].code == "bad_frame" and "traceparent" in refused[1].message
    assert no_spans == ()

    good = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    served, spans = asyncio.run(exchange(_raw_run_job(good)))
    assert [type(m) for m in served] == [Welcome, JobAccepted, JobFinished]
    job = Spans(spans).one("jaild.job")
    assert format_trace_id(job.context.trace_id) == CALLER_TRACE
    assert job.parent is not None and format_span_id(job.parent.span_id) == CALLER_SPAN


def test_a_traceparent_that_got_past_the_protocol_starts_a_trace_of_its_own() -> None:
    """Defence in depth: the daemon's tracer parses only what matches the form again."""
    made, exporter = provider()
    trace = Tracing(made).job("00-not-a-traceparent", 0)
    trace.refused("bad_request", "default")
    (job,) = exporter.get_finished_spans()
    assert job.parent is None


# ----------------------------------------------------------------------------- turning it on


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, ()),
    ({"OTEL_TRACES_EXPORTER": ""}, ()),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": " OTLP , console,otlp"}, ("otlp", "console")),
    ({"OTEL_TRACES_EXPORTER": "otlp,none"}, ()),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ()),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ()),  # where, not whether
])
def test_only_otel_traces_exporter_turns_tracing_on(
    environ: dict[str, str], expected: tuple[str, ...]
) -> None:
    assert requested_exporters(environ) == expected


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The process's environment without any OTEL_* variable (set them on the patch)."""
    import os

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    yield monkeypatch


def test_the_daemon_tracer_from_the_environment(environ: pytest.MonkeyPatch) -> None:
    off = Tracing.from_env()
    assert off is tracing.OFF and not off.on
    environ.setenv("OTEL_TRACES_EXPORTER", "otlp")
    environ.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    on = Tracing.from_env()
    try:
        assert on.on
        resource = on._provider.resource  # type: ignore[union-attr]
        assert resource.attributes["service.name"] == "jaild"
        assert resource.attributes["service.version"] == jaild.__version__
    finally:
        on.shutdown()
    environ.setenv("OTEL_TRACES_EXPORTER", "console")
    environ.setenv("OTEL_SERVICE_NAME", "sandbox")
    named = Tracing.from_env()
    try:
        assert named._provider.resource.attributes["service.name"] == "sandbox"  # type: ignore[union-attr]
    finally:
        named.shutdown()


def test_the_otlp_exporter_delivers_to_a_receiver(environ: pytest.MonkeyPatch) -> None:
    """The environment's exporter, end to end: OTLP/HTTP protobuf to a receiver on loopback
    (the daemon core in memory; ``tests/integration/test_tracing.py`` does it with the real
    daemon and real jails)."""
    receiver = Receiver().start()
    try:
        for name, value in daemon_environment(receiver).items():
            environ.setenv(name, value)
        on = Tracing.from_env()

        async def test() -> str:
            async with asyncio.timeout(guard(60)), fake_daemon(tracing=on) as fake:
                client = await fake.connect()
                return (await client.run("6 * 7")).job_id

        job_id = asyncio.run(test())
        on.shutdown()  # flushes what is queued
        spans = receiver.wait_for(lambda s: any(x.name == "jaild.job" for x in s),
                                  "the job's spans", guard(30))
    finally:
        receiver.stop()
    assert receiver.errors == [] and {p for p, _ in receiver.posts} == {"/v1/traces"}
    assert {t for _, t in receiver.posts} == {"application/x-protobuf"}
    job = next(s for s in spans if s.name == "jaild.job")
    assert job.service == "jaild" and job.kind == "server"
    assert job.attributes["jaild.job.id"] == job_id and job.attributes["jaild.status"] == "ok"
    assert sorted(s.name for s in spans if s.parent_id == job.span_id) == [
        "jaild.admission", "jaild.jail_acquire", "jaild.record", "jaild.run"]


@pytest.mark.parametrize(("variables", "why"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin-nonexistent"}, "no trace exporter named 'zipkin-nonexistent'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf only"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
     "http/protobuf only"),
])
def test_traces_that_cannot_be_exported_are_refused(
    environ: pytest.MonkeyPatch, variables: dict[str, str], why: str
) -> None:
    for name, value in variables.items():
        environ.setenv(name, value)
    with pytest.raises(TracingError, match=why):
        Tracing.from_env()


def test_without_the_sdk_asking_for_traces_is_refused(environ: pytest.MonkeyPatch) -> None:
    environ.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    assert not Tracing.from_env().on  # off needs nothing
    environ.setenv("OTEL_TRACES_EXPORTER", "otlp")
    with pytest.raises(TracingError, match=r"pip install 'jaild\[otel\]'"):
        Tracing.from_env()


@contextlib.contextmanager
def _no_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [m for m in sys.modules if m.startswith("opentelemetry")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    yield


def test_the_front_end_helpers_are_no_ops_without_opentelemetry(
    environ: pytest.MonkeyPatch,
) -> None:
    with _no_opentelemetry(environ):
        assert current_traceparent() is None and tracing.caller_context() is None
        with tracing.span("codemode.task", {"x": 1}) as note:
            note.set({"y": 2})
            note.fail("Boom")
        with tracing.exporting("svc") as exporting:
            assert exporting is False
