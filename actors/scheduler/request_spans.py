"""The scheduler's spans: one `generate` span per request in the request's own trace, and one `scheduler step`
span per engine step in a trace of its own, linked to the requests the step served.

A request's `generate` span (child of its `process req.tokenized` span) runs from arrival to finish and has
three children: `queue` (arrival to first admission), `prefill` (admission to the first token; one
`prefill chunk` event per step that computed part of the prompt) and `decode` (first token to finish; the
token count as an attribute, not a span per token). A constrained request that waited for its grammar (longer
than actors/engine/scheduling/grammar.py's `WAIT_NOTE_SECONDS`: the compiler being made, a compile worker, a long
compile) gets a `grammar wait` event on its `queue` span saying where the time went, and the wait in seconds as
`ringserve.grammar.wait_s` on `generate`. Its context travels to the detokenizer on the request's
first TokenRow. A step serves many requests, so it is not a child of any; its links name them all. Aborts and
errors mark the spans failed. A prefix fetched from another replica before the request reached the engine is a
`kv fetch` span beside `generate`. With tracing off, `create()` returns `NoSpans`, whose methods do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringserve.actors.engine.interface import StepPlan
from ringserve.bus.messages import TokenizedRequest, TokenRow
from ringserve.observability import tracing


@dataclass
class _Request:
    generate: Any
    traceparent: str
    queue: Any = None
    prefill: Any = None
    decode: Any = None
    chunks: int = 0
    steps: int = 0


class NoSpans:
    """Tracing off: every hook is a no-op."""

    def arrived(self, rid: str, traceparent: str) -> None:
        """A request arrived on the bus with this trace context."""

    def queued(self, req: TokenizedRequest) -> None:
        """The request is being handed to the engine."""

    def fetched(self, rid: str, start_ns: int, attributes: dict[str, Any], error: str = "") -> None:
        """Before it was handed over, the request's prefix was fetched from another replica (`kv fetch`)."""

    def rejected(self, rid: str, message: str) -> None:
        """The engine refused the request."""

    def grammar_waited(self, rid: str, fields: dict[str, Any]) -> None:
        """The request waited for its grammar; `fields`: where the time went (called on the engine's thread)."""

    def step(self, plan: StepPlan | None, step: int, start_ns: int, end_ns: int) -> str | None:
        """One engine step ran; the traceparent of its span (None: no span)."""
        return None

    def traceparent(self, rid: str) -> str | None:
        """The trace context the request's first TokenRow carries to the detokenizer."""
        return None

    def output(self, row: TokenRow, now_ns: int) -> None:
        """A row of the request is being published (the first token ends prefill, a finish ends it all)."""

    def close_all(self, reason: str) -> None:
        """End every open span (the scheduler is stopping)."""


class RequestSpans(NoSpans):
    """Tracing on: the spans of every live request."""

    def __init__(self) -> None:
        self._arrived: dict[str, tuple[str, int]] = {}
        self._live: dict[str, _Request] = {}

    def arrived(self, rid: str, traceparent: str) -> None:
        self._arrived[rid] = (traceparent, tracing.now_ns())

    def queued(self, req: TokenizedRequest) -> None:
        parent, start = self._arrived.pop(req.rid, (None, tracing.now_ns()))
        sampling = req.sampling
        generate = tracing.start_span("generate", parent, start_ns=start, attributes={
            "ringserve.rid": req.rid, "gen_ai.usage.input_tokens": len(req.input_ids),
            "gen_ai.request.max_tokens": sampling.max_new_tokens, "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p})
        tp = tracing.traceparent_of(generate) or ""
        self._live[req.rid] = _Request(generate, tp, queue=tracing.start_span("queue", tp, start_ns=start))

    def fetched(self, rid: str, start_ns: int, attributes: dict[str, Any], error: str = "") -> None:
        parent = self._arrived.get(rid, (None, 0))[0]
        span = tracing.start_span("kv fetch", parent, start_ns=start_ns, attributes=attributes)
        if error:
            tracing.set_error(span, error)
        tracing.end_span(span, tracing.now_ns())

    def rejected(self, rid: str, message: str) -> None:
        self._end(rid, tracing.now_ns(), f"rejected: {message}")

    def grammar_waited(self, rid: str, fields: dict[str, Any]) -> None:
        r = self._live.get(rid)  # read only: the loop's thread may add others meanwhile
        if r is None:
            return
        r.generate.set_attribute("ringserve.grammar.wait_s", float(fields.get("waited_s", 0.0)))
        span = r.queue if r.queue is not None else r.generate
        span.add_event("grammar wait", {f"ringserve.grammar.{key}": value for key, value in fields.items()})

    def step(self, plan: StepPlan | None, step: int, start_ns: int, end_ns: int) -> str | None:
        if plan is None:
            return None
        served = [self._live[rid].traceparent for rid in plan.decode_rids if rid in self._live]
        for rid, start, length in plan.prefill:
            r = self._live.get(rid)
            if r is None:
                continue
            served.append(r.traceparent)
            if r.queue is not None:
                tracing.end_span(r.queue, start_ns)
                r.queue = None
                r.prefill = tracing.start_span("prefill", r.traceparent, start_ns=start_ns)
            target = r.prefill if r.prefill is not None else r.decode
            if target is not None:
                r.chunks += 1
                name = "prefill chunk" if r.prefill is not None else "recompute after retraction"
                target.add_event(name, {"ringserve.prompt.start": start, "ringserve.prompt.tokens": length,
                                        "ringserve.step": step}, timestamp=start_ns)
        span = tracing.start_span("scheduler step", root=True, start_ns=start_ns, link_to=served, attributes={
            "ringserve.step": step, "ringserve.batch.requests": len(plan.decode_rids) + len(plan.prefill),
            "ringserve.batch.decode": len(plan.decode_rids), "ringserve.batch.prefill": len(plan.prefill),
            "ringserve.batch.tokens": plan.num_tokens})
        tracing.end_span(span, end_ns)
        return tracing.traceparent_of(span)

    def traceparent(self, rid: str) -> str | None:
        r = self._live.get(rid)
        return r.traceparent if r is not None else None

    def output(self, row: TokenRow, now_ns: int) -> None:
        r = self._live.get(row.rid)
        if r is None:
            return
        if row.token_ids:
            r.steps += 1
            if r.prefill is not None:
                r.prefill.set_attribute("ringserve.prefill.chunks", r.chunks)
                r.prefill.set_attribute("gen_ai.usage.cache_read.input_tokens", row.cached_tokens)
                tracing.end_span(r.prefill, now_ns)
                r.prefill = None
                r.decode = tracing.start_span("decode", r.traceparent, start_ns=now_ns)
        if row.finish is None:
            return
        r.generate.set_attribute("gen_ai.usage.output_tokens", row.completion_tokens)
        r.generate.set_attribute("gen_ai.usage.cache_read.input_tokens", row.cached_tokens)
        r.generate.set_attribute("gen_ai.response.finish_reasons", [row.finish.type])
        if r.decode is not None:
            r.decode.set_attribute("gen_ai.usage.output_tokens", row.completion_tokens)
            r.decode.set_attribute("ringserve.decode.steps", r.steps)
        error = None
        if row.finish.type in ("abort", "error"):
            error = f"{row.finish.type}: {row.finish.error}" if row.finish.error else row.finish.type
        self._end(row.rid, now_ns, error)

    def _end(self, rid: str, now_ns: int, error: str | None) -> None:
        self._arrived.pop(rid, None)
        r = self._live.pop(rid, None)
        if r is None:
            return
        for span in (r.queue, r.prefill, r.decode):
            tracing.end_span(span, now_ns, error)
        tracing.end_span(r.generate, now_ns, error)

    def close_all(self, reason: str) -> None:
        now = tracing.now_ns()
        for rid in list(self._live):
            self._end(rid, now, reason)
        self._arrived.clear()


def create() -> NoSpans:
    """The spans of this process's scheduler: real ones when tracing is on, else no-ops."""
    return RequestSpans() if tracing.enabled() else NoSpans()
