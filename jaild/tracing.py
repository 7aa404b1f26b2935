"""OpenTelemetry traces: the daemon's spans, the client's trace context, the front ends' spans.

The one module of jaild that imports ``opentelemetry`` (``tests/unit/test_layering.py``
holds that), and only inside functions: jaild runs without the ``[otel]`` extra, and then
every hook here is a no-op. The in-jail runtime never imports it.

Theory of operation
-------------------
*Turning it on.* Tracing is off unless the standard environment asks for it:
``OTEL_TRACES_EXPORTER`` names one or more exporters (``otlp``, ``console``, or any
installed exporter's entry-point name such as ``otlp_proto_http``) and ``OTEL_SDK_DISABLED``
is not ``true``. jaild reads nothing else itself: the exporter reads its own variables
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``..._HEADERS``, ``..._TIMEOUT``, ...), the SDK its own
(``OTEL_TRACES_SAMPLER``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_BSP_*``). Unlike the SDK's own default (``otlp`` when unset), unset means off here:
a daemon does not start sending data somewhere because a package was installed. Asked for
but impossible (the SDK missing, an unknown exporter, OTLP over gRPC) is a
:class:`~jaild.errors.TracingError`: the daemon refuses to start. ``otlp`` is OTLP over
HTTP with protobuf (the ``[otel]`` extra's exporter). Spans leave through the SDK's
``BatchSpanProcessor``, on its own thread: the daemon never waits for a collector, and
when the queue is full (``OTEL_BSP_MAX_QUEUE_SIZE``) spans are dropped, not the job.

*The daemon's spans.* :class:`Tracing` is the daemon's third observer of a job, beside the
audit log and the metrics. Off, it is :data:`OFF` and the job's path asks ``tracing.on``
once per job and keeps ``None`` where a :class:`JobTrace` would be: a few ``is None``
tests per job and one per tool call, no call, no allocation. On, a :class:`JobTrace`
notes the monotonic times of the job's steps as they happen (admitted, the code sent
and ended, a kill, each tool call's end with its duration and sizes) -- a float or a
tuple each -- and makes every span at once when the record has been sent
(:meth:`JobTrace.finish`), with the times it noted::

    jaild.job                 submit .. JobFinished sent   (SERVER; parent: the caller's)
      jaild.admission         submit .. admitted
      jaild.jail_acquire      admitted .. code sent        (the pooled, fresh or session jail)
      jaild.run               code sent .. code ended (or killed, or its record)
        jaild.tool_call       one per call, as long as its round trip
      jaild.record            record .. sent (audit, accounting, metrics, the write)

A span is exported when it ends, so building them at the end loses nothing a live span
would give a collector, and costs the job's path nothing while it runs. Attributes are
counts, sizes, names jaild or the operator chose, statuses and error types -- never tool
arguments or results, code, output, messages, environment values or header values.
Limit hits (``timeout``, ``memory_limit``, ``output_limit``) are events on the job span at
the moment the daemon killed the job (for an OOM kill: when the record was made); a
seccomp kill is a ``jaild.policy_violation`` event. At most :data:`MAX_TOOL_SPANS` tool
calls of a job get spans; the rest are counted (``jaild.tool_calls.untraced``).

*Propagation.* A client sends its current span context as ``RunJob.traceparent`` (and
``OpenSession.traceparent``): :func:`current_traceparent` reads it from the caller's
OpenTelemetry context, if the caller has one (it never imports OpenTelemetry to find out:
a process that never loaded ``opentelemetry.trace`` has no span). The blocking client runs
its calls on its own thread, so it hands the caller's context across
(:func:`caller_context`, :func:`within`). The daemon parents the job span with it: the
caller's trace goes on through jaild. The protocol checks its form (W3C version 00); it
names a parent and reads nothing, and the sampler decides as for any remote parent
(``parentbased_always_on`` by default: an unsampled caller gets no spans).

*Front ends.* :func:`span` gives the code-mode loop (and anyone) spans through the
global tracer provider -- the application's, when it set one up -- and :func:`exporting`
sets one up from the same environment for ``jaild codemode`` and ``jaild mcp``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Awaitable, Iterator, Mapping
from typing import TYPE_CHECKING, Final, TypeVar

from jaild.errors import TracingError
from jaild.protocol.fields import TRACEPARENT
from jaild.protocol.records import JobRecord
from jaild.version import __version__

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace import TracerProvider as AnyTracerProvider
else:
    AnyTracerProvider = object
    """Any tracer provider of the OpenTelemetry API (for annotations only)."""

T = TypeVar("T")
AttributeValue = str | bool | int | float
Attributes = Mapping[str, AttributeValue]

MAX_TOOL_SPANS: Final = 1000
"""Tool calls of one job that get a span (as many as its record lists); the rest are counted."""
LIMIT_STATUSES: Final = frozenset({"timeout", "memory_limit", "output_limit"})
"""Statuses that mean the job hit one of its limits: a ``jaild.limit_hit`` event."""
OTLP_PROTOCOL: Final = "http/protobuf"
INSTALL_HINT: Final = "pip install 'jaild[otel]'"
_TRACEPARENT = re.compile(TRACEPARENT)


# --------------------------------------------------------------------------- turning it on


def requested_exporters(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the environment asks for (empty: tracing is off). Pure.

    ``OTEL_TRACES_EXPORTER`` is a comma-separated list; ``none`` anywhere in it, or
    ``OTEL_SDK_DISABLED=true``, turns tracing off.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n]
    if "none" in names:
        return ()
    return tuple(dict.fromkeys(names))


def build_provider(service: str) -> TracerProvider | None:
    """A tracer provider exporting as the process's environment asks (the SDK and the
    exporters read it too), or None when it asks for none.

    Args:
        service: ``service.name`` unless ``OTEL_SERVICE_NAME`` or
            ``OTEL_RESOURCE_ATTRIBUTES`` names one.

    Raises:
        TracingError: the SDK is not installed, an exporter is unknown or cannot be made,
            or OTLP is asked for over another protocol than http/protobuf.
    """
    environ = os.environ
    names = requested_exporters(environ)
    if not names:
        return None
    asked = f"OTEL_TRACES_EXPORTER={environ.get('OTEL_TRACES_EXPORTER', '')}"
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise TracingError(
            f"{asked} asks for traces, but the OpenTelemetry SDK is not installed: "
            f"{INSTALL_HINT} (or unset OTEL_TRACES_EXPORTER)"
        ) from None
    exporters = [_exporter(name, environ, asked) for name in names]
    resource = Resource.create({SERVICE_VERSION: __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporter(name: str, environ: Mapping[str, str], asked: str) -> SpanExporter:
    """The span exporter ``name`` stands for (see :func:`build_provider`)."""
    if name == "otlp":
        protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or OTLP_PROTOCOL)
        if protocol.strip().lower() != OTLP_PROTOCOL:
            raise TracingError(
                f"{asked} with OTLP protocol {protocol!r}: jaild's otlp exporter speaks "
                f"{OTLP_PROTOCOL} only (set OTEL_EXPORTER_OTLP_PROTOCOL={OTLP_PROTOCOL}, or name "
                "an installed exporter such as otlp_proto_grpc)"
            )
        name = "otlp_proto_http"
    from importlib.metadata import entry_points

    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        known = sorted({e.name for e in entry_points(group="opentelemetry_traces_exporter")})
        raise TracingError(
            f"{asked}: no trace exporter named {name!r} is installed (installed: "
            f"{', '.join(['otlp', *known]) if known else 'none'}; {INSTALL_HINT} brings otlp)"
        )
    try:
        exporter: SpanExporter = next(iter(found)).load()()
    except Exception as exc:
        raise TracingError(f"{asked}: cannot make the {name} exporter: {exc}") from None
    return exporter


# --------------------------------------------------------------------------- the daemon's spans


def _parent(traceparent: str | None) -> Context:
    """The context a request's spans start in: the caller's span as a remote parent, or an
    empty one (a trace of their own). A value that is not a W3C version-00 traceparent is
    treated as absent (the protocol refused it before it could get here)."""
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    if traceparent is None or _TRACEPARENT.fullmatch(traceparent) is None:
        return Context()
    caller = SpanContext(
        trace_id=int(traceparent[3:35], 16),
        span_id=int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(traceparent[53:55], 16)),
    )
    return set_span_in_context(NonRecordingSpan(caller), Context())


class _Clock:
    """Monotonic seconds (the job's clock, as its record's) to the epoch nanoseconds spans
    carry: one offset per batch of spans, taken when they are made."""

    __slots__ = ("offset_ns",)

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, monotonic_s: float) -> int:
        return round(monotonic_s * 1e9) + self.offset_ns


class Tracing:
    """The daemon's tracer: off (:data:`OFF`), or on with a tracer provider.

    Args:
        provider: an SDK ``TracerProvider`` (tests give one with an in-memory exporter);
            None: off.
        owned: :meth:`shutdown` shuts the provider down (it was made here).
    """

    def __init__(self, provider: TracerProvider | None = None, *, owned: bool = False) -> None:
        self.on = provider is not None
        self._provider = provider
        self._owned = owned
        self.tracer: Tracer | None = (
            provider.get_tracer("jaild", __version__) if provider is not None else None
        )

    @classmethod
    def from_env(cls, service: str = "jaild") -> Tracing:
        """On if the environment asks for traces (:func:`build_provider`), else :data:`OFF`.

        Raises:
            TracingError: it asks for traces that cannot be exported.
        """
        provider = build_provider(service)
        return OFF if provider is None else cls(provider, owned=True)

    def job(self, traceparent: str | None, uid: int) -> JobTrace:
        """A new job's trace, from its ``RunJob`` on (only when :attr:`on`)."""
        return JobTrace(self, _parent(traceparent), uid)

    def session(self, traceparent: str | None, uid: int, policy: str) -> SessionTrace:
        """A session's opening, from its ``OpenSession`` on (only when :attr:`on`)."""
        return SessionTrace(self, _parent(traceparent), uid, policy)

    def shutdown(self) -> None:
        """Export what is queued and stop (a provider made by :meth:`from_env` only)."""
        if self._owned and self._provider is not None:
            self._provider.shutdown()


OFF: Final = Tracing()
"""Tracing off: ``OFF.on`` is False, and nothing else of it is used."""


def _usage_attributes(record: JobRecord) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {}
    usage = record.usage
    if usage is not None:
        for key, value in usage.to_wire().items():
            if value is not None:
                out[f"jaild.usage.{key}"] = value
    if record.egress is not None:
        out["jaild.egress.requests"] = record.egress.requests
        out["jaild.egress.bytes_out"] = record.egress.bytes_out
        out["jaild.egress.bytes_in"] = record.egress.bytes_in
    if record.network_refused is not None:
        out["jaild.network_refused"] = record.network_refused
    return out


class JobTrace:
    """One job's trace: times noted as the job goes, spans made at its end (see the module
    docstring). Made by :meth:`Tracing.job`, only when tracing is on."""

    __slots__ = (
        "_admitted", "_calls", "_code_ended", "_code_sent", "_emitted", "_killed", "_parent",
        "_started", "_tracing", "_uid", "_untraced",
    )

    def __init__(self, tracing: Tracing, parent: Context, uid: int) -> None:
        self._started = time.monotonic()
        self._tracing = tracing
        self._parent = parent
        self._uid = uid
        self._admitted: float | None = None
        self._code_sent: float | None = None
        self._code_ended: float | None = None
        self._emitted: float | None = None
        self._killed: float | None = None
        # (end, name, outcome, duration_s, args_bytes, result_bytes)
        self._calls: list[tuple[float, str, str, float, int, int]] = []
        self._untraced = 0

    # -- as the job goes

    def admitted(self) -> None:
        """Admission is done (the job's terms are known)."""
        self._admitted = time.monotonic()

    def tool_call(
        self, name: str, outcome: str, duration_s: float, args_bytes: int, result_bytes: int
    ) -> None:
        """A tool call ended just now (``ok`` or its error type), after ``duration_s``."""
        if len(self._calls) < MAX_TOOL_SPANS:
            self._calls.append(
                (time.monotonic(), name, outcome, duration_s, args_bytes, result_bytes)
            )
        else:
            self._untraced += 1

    def killed(self) -> None:
        """The daemon kills the jail now (a limit, a cancel): the first kill counts."""
        if self._killed is None:
            self._killed = time.monotonic()

    def emitted(self, code_sent: float | None, code_ended: float | None) -> None:
        """The job's record is being made; its code was sent and ended at these monotonic
        times (None: it was not sent, or did not end by itself)."""
        self._emitted = time.monotonic()
        self._code_sent, self._code_ended = code_sent, code_ended

    # -- the spans

    def refused(self, code: str, policy: str) -> None:
        """The request was refused (``Error{code}``): the job span alone, ending now."""
        tracer = self._tracing.tracer
        assert tracer is not None
        from opentelemetry.trace import SpanKind, StatusCode

        clock = _Clock()
        span = tracer.start_span(
            "jaild.job", self._parent, SpanKind.SERVER, start_time=clock.ns(self._started),
            attributes={"jaild.policy": policy, "jaild.client.uid": self._uid,
                        "jaild.refused": code, "error.type": code},
        )
        span.set_status(StatusCode.ERROR, code)
        span.end(clock.ns(time.monotonic()))

    def finish(self, record: JobRecord, mode: str) -> None:
        """The record was sent: make the job's spans (see the module docstring).

        Args:
            record: the record the client got.
            mode: how the job got its jail: ``pooled``, ``fresh`` or ``session``.
        """
        tracer = self._tracing.tracer
        assert tracer is not None
        from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context

        end = time.monotonic()
        clock = _Clock()
        started = self._started
        admitted = self._admitted if self._admitted is not None else started
        emitted = self._emitted if self._emitted is not None else admitted
        attributes: dict[str, AttributeValue] = {
            "jaild.job.id": record.job_id,
            "jaild.policy": record.policy,
            "jaild.status": record.status,
            "jaild.jail.mode": mode,
            "jaild.client.uid": self._uid,
            "jaild.tool_calls": len(record.tool_calls) + record.tool_calls_omitted,
            **_usage_attributes(record),
        }
        if record.session is not None:
            attributes["jaild.session.id"] = record.session.id
            if record.session.run is not None:
                attributes["jaild.session.run"] = record.session.run
        error = record.error
        if error is not None:
            attributes["jaild.error.type"] = error.type
            for key in ("limit", "signal", "syscall"):
                value = getattr(error, key)
                if value:
                    attributes[f"jaild.error.{key}"] = value
        if self._untraced:
            attributes["jaild.tool_calls.untraced"] = self._untraced
        if record.flow is not None:  # label names, never values
            attributes["jaild.flow.labels"] = ",".join(record.flow.labels)
            attributes["jaild.flow.refused"] = len(record.flow.refusals)
            if record.flow.withheld:
                attributes["jaild.flow.withheld"] = ",".join(record.flow.withheld)
        job = tracer.start_span("jaild.job", self._parent, SpanKind.SERVER,
                                start_time=clock.ns(started), attributes=attributes)
        if record.status == "internal_error":
            job.set_status(StatusCode.ERROR, error.type if error is not None else "")
        inside = set_span_in_context(job)

        def phase(name: str, begin: float, until: float, extra: Attributes | None = None) -> Span:
            span = tracer.start_span(name, inside, start_time=clock.ns(begin), attributes=extra)
            span.end(clock.ns(max(begin, until)))
            return span

        phase("jaild.admission", started, admitted)
        sent = self._code_sent
        phase("jaild.jail_acquire", admitted, sent if sent is not None else emitted,
              {"jaild.jail.mode": mode})
        if sent is not None:
            self._run_span(tracer, inside, clock, sent, emitted)
        phase("jaild.record", emitted, end)
        when = self._killed if self._killed is not None else emitted
        if record.status in LIMIT_STATUSES:
            job.add_event("jaild.limit_hit", {
                "jaild.status": record.status,
                "jaild.limit": (error.limit if error is not None else None) or record.status,
            }, timestamp=clock.ns(when))
        elif record.status == "policy_violation":
            job.add_event("jaild.policy_violation", {
                "jaild.error.syscall": (error.syscall if error is not None else None) or "",
            }, timestamp=clock.ns(when))
        job.end(clock.ns(end))

    def _run_span(
        self, tracer: Tracer, inside: Context, clock: _Clock, sent: float, emitted: float
    ) -> None:
        from opentelemetry.trace import set_span_in_context

        ended = self._code_ended
        if ended is None:  # it did not end by itself: killed, or its jail was lost
            ended = self._killed if self._killed is not None else emitted
        run = tracer.start_span("jaild.run", inside, start_time=clock.ns(sent))
        calls = set_span_in_context(run)
        for done, name, outcome, duration_s, args_bytes, result_bytes in self._calls:
            attributes: dict[str, AttributeValue] = {
                "jaild.tool.name": name,
                "jaild.tool.outcome": outcome,
                "jaild.tool.args_bytes": args_bytes,
                "jaild.tool.result_bytes": result_bytes,
            }
            if outcome != "ok":
                attributes["error.type"] = outcome
            span = tracer.start_span("jaild.tool_call", calls,
                                     start_time=clock.ns(done - duration_s), attributes=attributes)
            span.end(clock.ns(done))
        run.end(clock.ns(max(sent, ended)))


class SessionTrace:
    """A session's opening (``OpenSession`` .. ``SessionOpened``, or its failure): one span,
    ``jaild.session.open``. Made by :meth:`Tracing.session`, only when tracing is on."""

    __slots__ = ("_parent", "_policy", "_started", "_tracing", "_uid")

    def __init__(self, tracing: Tracing, parent: Context, uid: int, policy: str) -> None:
        self._started = time.monotonic()
        self._tracing = tracing
        self._parent = parent
        self._uid = uid
        self._policy = policy

    def ended(self, session_id: str | None, error: str | None = None) -> None:
        """The session opened (``error`` None), or did not: refused (``session_id`` None,
        ``error`` the refusal's code) or its jail did not start (the error's type)."""
        tracer = self._tracing.tracer
        assert tracer is not None
        from opentelemetry.trace import SpanKind, StatusCode

        clock = _Clock()
        attributes: dict[str, AttributeValue] = {
            "jaild.policy": self._policy, "jaild.client.uid": self._uid,
            "jaild.jail.mode": "session",
        }
        if session_id is not None:
            attributes["jaild.session.id"] = session_id
        if error is not None:
            attributes["error.type"] = error
        span = tracer.start_span("jaild.session.open", self._parent, SpanKind.SERVER,
                                 start_time=clock.ns(self._started), attributes=attributes)
        if error is not None:
            span.set_status(StatusCode.ERROR, error)
        span.end(clock.ns(time.monotonic()))


# --------------------------------------------------------------------------- the client's side


def current_traceparent() -> str | None:
    """The caller's current span as a W3C ``traceparent``, or None: no span is current
    (or OpenTelemetry was never loaded in this process, which is checked first)."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry.trace import get_current_span

    context = get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def caller_context() -> Context | None:
    """The caller's OpenTelemetry context if a span is current in it (for :func:`within`),
    else None."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry.context import get_current
    from opentelemetry.trace import get_current_span

    if not get_current_span().get_span_context().is_valid:
        return None
    return get_current()


async def within(context: Context, work: Awaitable[T]) -> T:
    """Await ``work`` in ``context`` (the blocking client's calls, which run on its own
    thread, in the context of the thread that made them)."""
    from opentelemetry.context import attach, detach

    token = attach(context)
    try:
        return await work
    finally:
        detach(token)


# --------------------------------------------------------------------------- front ends


class SpanNote:
    """A front end's hold on its current span (nothing, when OpenTelemetry is absent)."""

    __slots__ = ("_span",)

    def __init__(self, span: Span | None) -> None:
        self._span = span

    def set(self, attributes: Attributes) -> None:
        if self._span is not None:
            self._span.set_attributes(attributes)

    def fail(self, error_type: str) -> None:
        """The operation failed (``error.type``; status ERROR, described by the type only)."""
        if self._span is not None:
            from opentelemetry.trace import StatusCode

            self._span.set_attribute("error.type", error_type)
            self._span.set_status(StatusCode.ERROR, error_type)


@contextlib.contextmanager
def span(
    name: str,
    attributes: Attributes | None = None,
    *,
    client: bool = False,
    tracer: str = "jaild",
    provider: AnyTracerProvider | None = None,
) -> Iterator[SpanNote]:
    """A span around the block, current inside it, from ``provider`` -- by default the
    global tracer provider (the application's; a no-op one unless it set one up, or
    :func:`exporting` did). An exception leaving the block marks it failed with its type
    (``error.type``) and nothing else: an exception's message (a model API's error, say)
    may quote what a span must not hold. ``client``: a call to another service (kind
    CLIENT); ``tracer``: the instrumentation scope's name. Without OpenTelemetry installed,
    nothing."""
    try:
        from opentelemetry import trace
    except ImportError:
        yield SpanNote(None)
        return
    kind = trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
    with trace.get_tracer(tracer, __version__, tracer_provider=provider).start_as_current_span(
        name, kind=kind, attributes=attributes, record_exception=False,
        set_status_on_exception=False,
    ) as current:
        note = SpanNote(current)
        try:
            yield note
        except BaseException as exc:
            note.fail(type(exc).__qualname__)
            raise


@contextlib.contextmanager
def exporting(service: str) -> Iterator[bool]:
    """For a front end's process (``jaild codemode``, ``jaild mcp``): when the environment
    asks for traces (:func:`build_provider`), make the global tracer provider export them
    for the block, and flush them at its end. Yields whether it does.

    Raises:
        TracingError: the environment asks for traces that cannot be exported.
    """
    provider = build_provider(service)
    if provider is None:
        yield False
        return
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    try:
        yield True
    finally:
        provider.shutdown()


__all__ = [
    "LIMIT_STATUSES",
    "MAX_TOOL_SPANS",
    "OFF",
    "AnyTracerProvider",
    "JobTrace",
    "SessionTrace",
    "SpanNote",
    "Tracing",
    "build_provider",
    "caller_context",
    "current_traceparent",
    "exporting",
    "requested_exporters",
    "span",
    "within",
]
