"""The detokenizer's `detokenize` span: one per request, in the request's own trace.

The request's first TokenRow carries the scheduler's `generate` span context (`TokenRow.traceparent`); the
span starts there and ends with the request's last output, counting outputs and tokens instead of a span
per token. The outputs on `{ns}.out.{rid}` carry its context. With tracing off, `create()` returns no-ops.
"""

from __future__ import annotations

from typing import Any

from ringserve.bus.messages import RequestOutput, TokenRow
from ringserve.observability import tracing


class NoDetokenizeSpans:
    """Tracing off: every hook is a no-op."""

    def begin(self, row: TokenRow) -> str | None:
        """Before decoding `row`: the trace context its output carries (None: the step message's)."""
        return None

    def after(self, row: TokenRow, output: RequestOutput | None) -> None:
        """After publishing `row`'s output: the request's last output ends its span."""

    def close(self, rid: str, reason: str) -> None:
        """End request `rid`'s span with an error (it was forgotten without its last row)."""

    def close_all(self, reason: str) -> None:
        """End every open span (the detokenizer is stopping)."""


class DetokenizeSpans(NoDetokenizeSpans):
    """Tracing on: the open `detokenize` span of every live request of this shard."""

    def __init__(self) -> None:
        self._live: dict[str, tuple[Any, str]] = {}
        self._outputs: dict[str, int] = {}

    def begin(self, row: TokenRow) -> str | None:
        live = self._live.get(row.rid)
        if live is None and row.traceparent:
            span = tracing.start_span("detokenize", row.traceparent, attributes={"ringserve.rid": row.rid})
            live = self._live[row.rid] = (span, tracing.traceparent_of(span) or row.traceparent)
            self._outputs[row.rid] = 0
        return live[1] if live is not None else None

    def after(self, row: TokenRow, output: RequestOutput | None) -> None:
        live = self._live.get(row.rid)
        if live is None:
            return
        if output is not None:
            self._outputs[row.rid] += 1
        if output is None or not output.is_last:
            return
        span = live[0]
        span.set_attribute("ringserve.outputs", self._outputs.pop(row.rid, 0))
        span.set_attribute("gen_ai.usage.output_tokens", output.completion_tokens)
        error = None
        if output.error is not None:
            error = output.error.message
        elif output.finish is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [output.finish.type])
            if output.finish.type == "abort":
                error = "aborted"
        del self._live[row.rid]
        tracing.end_span(span, error=error)

    def close(self, rid: str, reason: str) -> None:
        live = self._live.pop(rid, None)
        self._outputs.pop(rid, None)
        if live is not None:
            tracing.end_span(live[0], error=reason)

    def close_all(self, reason: str) -> None:
        for span, _ in self._live.values():
            tracing.end_span(span, error=reason)
        self._live.clear()
        self._outputs.clear()


def create() -> NoDetokenizeSpans:
    """Real spans when tracing is on, else no-ops."""
    return DetokenizeSpans() if tracing.enabled() else NoDetokenizeSpans()
