"""A small OTLP/HTTP trace receiver on loopback, for tests that need a real collector's end.

The OpenTelemetry Collector is not available here; this is the part of it the tests need:
``POST /v1/traces`` with an ``ExportTraceServiceRequest`` protobuf (``Content-Type:
application/x-protobuf``, optionally gzip-encoded), decoded with the ``opentelemetry-proto``
package, answered with an ``ExportTraceServiceResponse``. What arrived is kept as it came
and read back as flat :class:`SpanRecord` s, or as OTLP/JSON (the collector's file
exporter's format, ids in hex), which ``scripts/trace_picture.py`` draws.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import ReadableSpan

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer",
         5: "consumer"}
STATUSES = {0: "unset", 1: "ok", 2: "error"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


@dataclass(frozen=True)
class SpanRecord:
    """One span as it arrived: ids in hex, times in epoch nanoseconds."""

    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str | None
    kind: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def records(requests: Sequence[ExportTraceServiceRequest]) -> list[SpanRecord]:
    """Every span of ``requests``, flat."""
    out = []
    for request in requests:
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(SpanRecord(
                        name=s.name,
                        service=str(resource.get("service.name", "")),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex() or None,
                        kind=KINDS.get(s.kind, str(s.kind)),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status=STATUSES.get(s.status.code, str(s.status.code)),
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        events=[(e.name, e.time_unix_nano,
                                 {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in s.events],
                    ))
    return out


def _json_value(v: AnyValue) -> dict[str, Any]:
    which = v.WhichOneof("value")
    if which == "string_value":
        return {"stringValue": v.string_value}
    if which == "bool_value":
        return {"boolValue": v.bool_value}
    if which == "int_value":
        return {"intValue": str(v.int_value)}  # OTLP/JSON: 64-bit integers as strings
    if which == "double_value":
        return {"doubleValue": v.double_value}
    if which == "array_value":
        return {"arrayValue": {"values": [_json_value(x) for x in v.array_value.values]}}
    return {}


def _json_attributes(kvs: Any) -> list[dict[str, Any]]:
    return [{"key": kv.key, "value": _json_value(kv.value)} for kv in kvs]


def otlp_json(requests: Sequence[ExportTraceServiceRequest]) -> dict[str, Any]:
    """``requests`` as one OTLP/JSON ``ExportTraceServiceRequest`` (trace and span ids in
    hex, 64-bit integers as strings, enums as numbers), as the Collector's file exporter
    writes them."""
    resource_spans = []
    for request in requests:
        for rs in request.resource_spans:
            resource_spans.append({
                "resource": {"attributes": _json_attributes(rs.resource.attributes)},
                "scopeSpans": [{
                    "scope": {"name": ss.scope.name, "version": ss.scope.version},
                    "spans": [{
                        "traceId": s.trace_id.hex(),
                        "spanId": s.span_id.hex(),
                        "parentSpanId": s.parent_span_id.hex(),
                        "name": s.name,
                        "kind": s.kind,
                        "startTimeUnixNano": str(s.start_time_unix_nano),
                        "endTimeUnixNano": str(s.end_time_unix_nano),
                        "attributes": _json_attributes(s.attributes),
                        "events": [{"timeUnixNano": str(e.time_unix_nano), "name": e.name,
                                    "attributes": _json_attributes(e.attributes)}
                                   for e in s.events],
                        "status": {"code": s.status.code},
                    } for s in ss.spans],
                } for ss in rs.scope_spans],
            })
    return {"resourceSpans": resource_spans}


def encode(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """Spans the SDK finished in this process (an in-memory exporter's) as the OTLP request
    its OTLP exporter would send."""
    return encode_spans(spans)


class Receiver:
    """``POST /v1/traces`` on ``127.0.0.1:<port>``; :attr:`endpoint` is the base URL for
    ``OTEL_EXPORTER_OTLP_ENDPOINT``. Start with :meth:`start`, stop with :meth:`stop`."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.posts: list[tuple[str, str]] = []  # (path, content type) of every request
        self.errors: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.posts.append((self.path, self.headers.get("Content-Type", "")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    receiver.errors.append(f"POST {self.path}")
                    self._answer(404, b"")
                    return
                request = ExportTraceServiceRequest()
                try:
                    request.ParseFromString(body)
                except Exception as exc:  # a broken exporter: the test says so
                    receiver.errors.append(f"undecodable request: {exc}")
                    self._answer(400, b"")
                    return
                with receiver._lock:
                    receiver.requests.append(request)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="otlp-receiver")

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)

    def spans(self) -> list[SpanRecord]:
        with self._lock:
            return records(list(self.requests))

    def wait_for(
        self, condition: Callable[[list[SpanRecord]], bool], what: str, timeout_s: float
    ) -> list[SpanRecord]:
        """Until ``condition(spans)`` holds; ``timeout_s`` is a liveness guard only."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if condition(spans):
                return spans
            assert time.monotonic() < deadline, (
                f"{what} did not arrive within {timeout_s} s; got {[s.name for s in spans]}, "
                f"errors {self.errors}")
            time.sleep(0.05)

    def __iter__(self) -> Iterator[SpanRecord]:
        return iter(self.spans())


def daemon_environment(receiver: Receiver) -> dict[str, str]:
    """What a ``jaild serve`` needs in its environment to trace to ``receiver`` promptly."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: the tests wait for spans, not for batches
        "OTEL_SERVICE_NAME": "jaild",
    }
