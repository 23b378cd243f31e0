"""A request's trace as a terminal waterfall: one line per span, indented under its parent, with a time bar.

`select_request` finds the trace(s) of a request id among decoded spans (the spans with attribute
`ringserve.rid`, or `ringserve.rids` for an n > 1 response, name the trace) and the scheduler steps that
link to it; `render` draws them. Plain text, no terminal control codes, so it can be piped or pasted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.observability.otlp_decode import SpanRecord

RID_ATTRIBUTE = "ringserve.rid"
RIDS_ATTRIBUTE = "ringserve.rids"
SUMMARY_ATTRIBUTES = (  # root span attributes shown on the summary line
    ("gen_ai.usage.input_tokens", "prompt tokens"), ("gen_ai.usage.output_tokens", "completion tokens"),
    ("gen_ai.usage.cache_read.input_tokens", "cached tokens"), ("gen_ai.server.time_to_first_token", "TTFT s"),
    ("gen_ai.server.request.duration", "e2e s"), ("gen_ai.response.finish_reasons", "finish"),
)


@dataclass
class RequestTrace:
    """The spans of one request's trace and the scheduler steps that served it (linked, other traces)."""

    trace_id: str
    spans: list[SpanRecord]
    steps: list[SpanRecord] = field(default_factory=list)


def _names_rid(span: SpanRecord, rid: str) -> bool:
    if span.attributes.get(RID_ATTRIBUTE) == rid:
        return True
    rids = span.attributes.get(RIDS_ATTRIBUTE)
    return isinstance(rids, list) and rid in rids


def select_request(spans: list[SpanRecord], rid: str) -> list[RequestTrace]:
    """The traces (usually one; more if the rid was reused) whose spans name `rid`, oldest first."""
    trace_ids = {s.trace_id for s in spans if _names_rid(s, rid)}
    traces = []
    for trace_id in trace_ids:
        members = {s.span_id: s for s in spans if s.trace_id == trace_id}  # a span id seen twice counts once
        ids = set(members)
        steps = [s for s in spans if s.trace_id != trace_id and any(t == trace_id and i in ids for t, i in s.links)]
        traces.append(RequestTrace(trace_id, sorted(members.values(), key=lambda s: s.start_ns),
                                   sorted({s.span_id: s for s in steps}.values(), key=lambda s: s.start_ns)))
    return sorted(traces, key=lambda t: t.spans[0].start_ns)


def _ordered(spans: list[SpanRecord]) -> list[tuple[int, SpanRecord]]:
    """(depth, span) in tree order: each span after its parent, siblings by start time; orphans are roots."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRecord]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    out: list[tuple[int, SpanRecord]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, s.end_ns)):
            out.append((depth, s))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


def _fact(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _role(span: SpanRecord) -> str:
    name = span.service.removeprefix("ringserve-")
    rank = span.resource.get("ringserve.rank")
    return f"{name}{rank}" if rank not in (None, 0) else name


def _bar(start: int, end: int, t0: int, total: int, width: int) -> str:
    a = int((start - t0) / total * width)
    b = max(a + 1, int((end - t0) / total * width + 0.5))
    a, b = min(a, width - 1), min(b, width)
    return " " * a + "█" * (b - a) + " " * (width - b)


def render(trace: RequestTrace, width: int = 48, show_steps: bool = False, show_events: bool = True) -> str:
    """The waterfall of `trace`: a summary line, then one line per span (and its events) with a time bar."""
    spans = trace.spans + (trace.steps if show_steps else [])
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    total = max(t1 - t0, 1)
    root = next((s for s in trace.spans if not s.parent_id or s.parent_id not in {x.span_id for x in trace.spans}),
                trace.spans[0])
    facts = [f"{label} {_fact(root.attributes[key])}" for key, label in SUMMARY_ATTRIBUTES if key in root.attributes]
    processes = len({s.process for s in trace.spans})
    lines = [f"trace {trace.trace_id}  {len(trace.spans)} spans from {processes} processes  "
             f"{total / 1e6:.1f} ms" + (f"  ({', '.join(facts)})" if facts else "")]
    lines.append(f"{'start ms':>9} {'dur ms':>9}  {'actor':<13} {'span':<44} |{'timeline':^{width}}|")
    for depth, s in _ordered(spans):
        label = ("  " * depth + s.name)[:44]
        status = f"  ERROR {s.status_message}".rstrip() if s.status == "error" else ""
        lines.append(f"{(s.start_ns - t0) / 1e6:9.1f} {s.duration_ms:9.1f}  {_role(s):<13} {label:<44} "
                     f"|{_bar(s.start_ns, s.end_ns, t0, total, width)}|{status}")
        if show_events:
            for event in s.events:
                detail = " ".join(f"{k}={v}" for k, v in event.attributes.items())
                lines.append(f"{(event.time_ns - t0) / 1e6:9.1f} {'':>9}  {'':<13} "
                             f"{'  ' * (depth + 1)}· {event.name} {detail}".rstrip())
    if trace.steps and not show_steps:
        first, last = trace.steps[0], trace.steps[-1]
        busy = sum(s.end_ns - s.start_ns for s in trace.steps) / 1e6
        lines.append(f"served by {len(trace.steps)} scheduler steps (linked spans, other traces) from "
                     f"{(first.start_ns - t0) / 1e6:.1f} to {(last.end_ns - t0) / 1e6:.1f} ms, {busy:.1f} ms busy; "
                     "--steps lists them")
    return "\n".join(lines)
