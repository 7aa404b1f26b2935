"""Draw a trace as a Gantt chart (SVG): one row per span, under its parent, on one time axis.

Reads spans as OTLP/JSON -- one ``ExportTraceServiceRequest`` object (``{"resourceSpans":
[...]}``), or one per line as the OpenTelemetry Collector's file exporter writes them --
and draws every span of one trace (the only one, or ``--trace ID``). Standard library only.

    python scripts/trace_picture.py spans.json -o docs/trace-codemode.svg

The picture on docs/using/tracing.md (docs/trace-codemode.svg) is drawn from the spans of a
code-mode task, written by ``tests/integration/test_tracing.py`` when ``JAILD_TRACE_SPANS_OUT``
names a file.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

ROW_PX = 22
BAR_PX = 14
LABEL_PX = 330
CHART_PX = 560
RIGHT_PX = 90
TOP_PX = 56
INDENT_PX = 14
FONT = "font-family='DejaVu Sans, Verdana, sans-serif'"
CALLER_COLOR, CALLER = "#4c78a8", "the caller: code-mode loop, model calls"
DAEMON_COLOR, DAEMON = "#f58518", "the jaild daemon"
TOOL_COLOR = "#e45756"
ERROR_STROKE = "#b00020"


@dataclass
class Span:
    name: str
    service: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool
    events: list[tuple[str, int, dict[str, Any]]]
    children: list[Span] = field(default_factory=list)


def _value(v: dict[str, Any]) -> Any:
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attributes(kvs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in kvs or []}


def load(text: str) -> dict[str, list[Span]]:
    """Spans by trace id, from OTLP/JSON (one object, or JSON lines)."""
    text = text.strip()
    try:
        documents = [json.loads(text)]
    except json.JSONDecodeError:
        documents = [json.loads(line) for line in text.splitlines() if line.strip()]
    traces: dict[str, list[Span]] = {}
    for document in documents:
        for rs in document.get("resourceSpans", []):
            service = str(_attributes(rs.get("resource", {}).get("attributes")).get(
                "service.name", "?"))
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    traces.setdefault(s["traceId"], []).append(Span(
                        name=s["name"], service=service, span_id=s["spanId"],
                        parent_id=s.get("parentSpanId", ""),
                        start_ns=int(s["startTimeUnixNano"]), end_ns=int(s["endTimeUnixNano"]),
                        attributes=_attributes(s.get("attributes")),
                        error=s.get("status", {}).get("code") == 2,
                        events=[(e["name"], int(e["timeUnixNano"]),
                                 _attributes(e.get("attributes")))
                                for e in s.get("events", [])],
                    ))
    return traces


def rows(spans: list[Span]) -> list[tuple[int, Span]]:
    """(depth, span), depth first, children by start time; a span whose parent is not in
    the trace (the caller's, in another process) is a root."""
    by_id = {s.span_id: s for s in spans}
    roots = []
    for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        parent = by_id.get(s.parent_id)
        (parent.children if parent is not None else roots).append(s)
    out: list[tuple[int, Span]] = []

    def walk(span: Span, depth: int) -> None:
        out.append((depth, span))
        for child in span.children:
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return out


def label(span: Span) -> str:
    """What a row says: the span's name and the attribute that tells it apart."""
    a = span.attributes
    if span.name == "codemode.attempt":
        number, status = a.get("jaild.codemode.attempt", "?"), a.get("jaild.codemode.status", "")
        return f"attempt {number}: {status}"
    if span.name.startswith("chat "):
        tokens = a.get("gen_ai.usage.input_tokens", 0) + a.get("gen_ai.usage.output_tokens", 0)
        return f"{span.name} ({tokens} tokens)"
    if span.name == "jaild.job":
        return f"jaild.job: {a.get('jaild.status', '')}, {a.get('jaild.jail.mode', '')} jail"
    if span.name == "jaild.tool_call":
        return f"tool {a.get('jaild.tool.name', '?')}: {a.get('jaild.tool.outcome', '')}"
    return span.name


def _ms(ns: float) -> str:
    ms = ns / 1e6
    if ms == 0:
        return "0 ms"
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def _ticks(total_ns: int) -> list[int]:
    """About five round tick steps across ``total_ns``."""
    step = 1_000  # 1 µs
    while total_ns / step > 6:
        for factor in (2, 2.5, 2):
            step = int(step * factor)
            if total_ns / step <= 6:
                break
    return list(range(0, total_ns + 1, step))


def render(spans: list[Span], title: str = "") -> str:
    """The SVG of one trace."""
    drawn = rows(spans)
    t0 = min(s.start_ns for s in spans)
    total = max(1, max(s.end_ns for s in spans) - t0)

    def x(ns: int) -> float:
        return LABEL_PX + (ns - t0) / total * CHART_PX

    height = TOP_PX + ROW_PX * len(drawn) + 48
    width = LABEL_PX + CHART_PX + RIGHT_PX
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' {FONT} font-size='12'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
    ]
    if title:
        out.append(f"<text x='10' y='20' font-size='14' font-weight='bold'>{escape(title)}</text>")
    for tick in _ticks(total):
        tx = x(t0 + tick)
        out.append(f"<line x1='{tx:.1f}' y1='{TOP_PX - 8}' x2='{tx:.1f}' "
                   f"y2='{TOP_PX + ROW_PX * len(drawn)}' stroke='#e0e0e0'/>")
        out.append(f"<text x='{tx:.1f}' y='{TOP_PX - 12}' text-anchor='middle' fill='#555' "
                   f"font-size='10'>{_ms(tick)}</text>")
    for i, (depth, span) in enumerate(drawn):
        y = TOP_PX + i * ROW_PX
        if i % 2:
            out.append(f"<rect x='0' y='{y}' width='{width}' height='{ROW_PX}' fill='#f7f7f7'/>")
        colour = (TOOL_COLOR if span.name == "jaild.tool_call"
                  else DAEMON_COLOR if span.name.startswith("jaild.") else CALLER_COLOR)
        out.append(f"<text x='{8 + depth * INDENT_PX}' y='{y + 15}'>{escape(label(span))}</text>")
        x0, x1 = x(span.start_ns), x(span.end_ns)
        stroke = f" stroke='{ERROR_STROKE}' stroke-width='2'" if span.error else ""
        out.append(f"<rect x='{x0:.1f}' y='{y + (ROW_PX - BAR_PX) / 2:.1f}' "
                   f"width='{max(1.0, x1 - x0):.1f}' height='{BAR_PX}' rx='2' "
                   f"fill='{colour}'{stroke}><title>{escape(span.name)}: "
                   f"{_ms(span.end_ns - span.start_ns)}</title></rect>")
        out.append(f"<text x='{max(x0, x1) + 4:.1f}' y='{y + 15}' fill='#555' "
                   f"font-size='10'>{_ms(span.end_ns - span.start_ns)}</text>")
        for name, when, attrs in span.events:
            ex, ey = x(when), y + ROW_PX / 2
            out.append(f"<path d='M{ex:.1f},{ey - 7:.1f} l6,7 l-6,7 l-6,-7 z' fill='black'>"
                       f"<title>{escape(name)} {escape(json.dumps(attrs))}</title></path>")
    legend_y = TOP_PX + ROW_PX * len(drawn) + 26
    lx = 10
    legend = [(CALLER_COLOR, CALLER), (DAEMON_COLOR, DAEMON),
              (TOOL_COLOR, "a tool call (host round trip)")]
    for colour, what in legend:
        out.append(f"<rect x='{lx}' y='{legend_y - 10}' width='12' height='12' fill='{colour}'/>")
        out.append(f"<text x='{lx + 16}' y='{legend_y}'>{escape(what)}</text>")
        lx += 30 + 7 * len(what)
    if any(span.events for span in spans):
        out.append(f"<path d='M{lx + 6},{legend_y - 11} l6,7 l-6,7 l-6,-7 z' fill='black'/>")
        out.append(f"<text x='{lx + 16}' y='{legend_y}'>an event (a limit hit)</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("spans", type=Path, help="OTLP/JSON file")
    p.add_argument("-o", "--out", type=Path, help="SVG file (default: stdout)")
    p.add_argument("--trace", help="the trace id to draw (default: the only one)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    traces = load(args.spans.read_text())
    if args.trace is None and len(traces) != 1:
        p.error(f"{len(traces)} traces in {args.spans}: name one with --trace "
                f"({', '.join(sorted(traces))})")
    spans = traces.get(args.trace or next(iter(traces)), [])
    if not spans:
        p.error(f"no trace {args.trace} in {args.spans}")
    svg = render(spans, args.title)
    if args.out is None:
        sys.stdout.write(svg)
    else:
        args.out.write_text(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
