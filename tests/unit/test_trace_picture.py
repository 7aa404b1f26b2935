"""scripts/trace_picture.py: a trace (OTLP/JSON) drawn as a Gantt chart in SVG."""

from __future__ import annotations

import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.otlp import encode, otlp_json

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_picture.py"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def picture(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("trace_picture", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "trace_picture", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def trace_json() -> dict[str, object]:
    """A small code-mode-shaped trace, made by the SDK, as OTLP/JSON."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    t = 1_700_000_000_000_000_000
    with tracer.start_as_current_span("codemode.task", start_time=t, end_on_exit=False) as task:
        with tracer.start_as_current_span("codemode.attempt", start_time=t + 1_000_000,
                                          attributes={"jaild.codemode.attempt": 1,
                                                      "jaild.codemode.status": "timeout"},
                                          end_on_exit=False) as attempt:
            job = tracer.start_span("jaild.job", start_time=t + 2_000_000,
                                    attributes={"jaild.status": "timeout",
                                                "jaild.jail.mode": "pooled"})
            job.add_event("jaild.limit_hit", {"jaild.limit": "wall_time_s"},
                          timestamp=t + 9_000_000)
            job.end(t + 10_000_000)
            attempt.end(t + 11_000_000)
        task.end(t + 12_000_000)
    return otlp_json([encode(exporter.get_finished_spans())])


def test_a_trace_is_drawn_one_row_per_span_under_its_parent(
    picture: ModuleType, tmp_path: Path
) -> None:
    source = tmp_path / "spans.json"
    source.write_text(json.dumps(trace_json()))
    out = tmp_path / "trace.svg"
    assert picture.main([str(source), "-o", str(out), "--title", "a <task>"]) == 0
    root = ET.fromstring(out.read_text())  # well-formed, text escaped
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert texts[0] == "a <task>"
    rows = [t for t in texts if t and t.startswith(("codemode", "attempt", "jaild"))]
    assert rows == ["codemode.task", "attempt 1: timeout", "jaild.job: timeout, pooled jail"]
    indents = [float(t.get("x", 0)) for t in root.iter(f"{SVG}text") if t.text in rows]
    assert indents[0] < indents[1] < indents[2]  # each under its parent
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(bars) == 3
    widths = [float(r.get("width", 0)) for r in bars]
    assert widths[0] > widths[1] > widths[2] > 0  # 12, 10 and 8 ms on one axis
    (event,) = [p for p in root.iter(f"{SVG}path") if p.find(f"{SVG}title") is not None]
    assert "jaild.limit_hit" in (event.find(f"{SVG}title").text or "")  # type: ignore[union-attr]


def test_json_lines_and_a_choice_of_traces(picture: ModuleType, tmp_path: Path) -> None:
    one, two = trace_json(), trace_json()
    source = tmp_path / "spans.jsonl"
    source.write_text(json.dumps(one) + "\n" + json.dumps(two) + "\n")
    traces = picture.load(source.read_text())
    assert len(traces) == 2 and all(len(spans) == 3 for spans in traces.values())
    with pytest.raises(SystemExit):  # two traces: which?
        picture.main([str(source)])
    chosen = sorted(traces)[0]
    assert picture.main([str(source), "--trace", chosen, "-o", str(tmp_path / "x.svg")]) == 0
