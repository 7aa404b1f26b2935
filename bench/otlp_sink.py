"""An OTLP/HTTP endpoint on loopback that keeps what it is sent and answers at once: what
the traced warm variant exports to (a collector's cost is not jaild's, so this one does as
little as it can while the jobs are timed: no decoding until :meth:`OtlpSink.spans`)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


class OtlpSink:
    """``POST /v1/traces`` on ``127.0.0.1``: bodies kept, ``200`` with an empty response
    message (a valid empty ``ExportTraceServiceResponse``)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                sink.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="otlp-sink")

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def environment(self) -> dict[str, str]:
        """A daemon's environment to trace here (the SDK's batching left as it is)."""
        return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint}

    def spans(self) -> dict[str, int]:
        """Span names -> how many arrived (decoded now, with opentelemetry-proto)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        counts: dict[str, int] = {}
        for body in list(self.bodies):
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        counts[span.name] = counts.get(span.name, 0) + 1
        return counts
