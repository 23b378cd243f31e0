"""Request-level Prometheus metrics, measured in the entry as each request's outputs arrive from the ring.

Multi-process safe without prometheus-client's multi-process mode: every request's outputs (`RequestOutput` on
`{ns}.out.{rid}`) travel over the bus to the entry that submitted it, so one process sees every token of every
request it serves and keeps the request-level series itself. The ring's other processes (tokenizers, scheduler
ranks, detokenizer shards) hold no request-level series; the scheduler's load figures are asked for over the
bus when `/metrics` is scraped (`actors/entry/ops/metrics_route.py`). Run several entries and Prometheus sums
their series, as for any replicated service.

Series (names as users of vLLM and SGLang expect, with a `model_name` label: the served model, or the LoRA adapter
a request named):

- `ringserve:prompt_tokens_total`, `ringserve:cached_tokens_total` (prompt tokens served from the prefix
  cache), counted when a request's first output reports them; `ringserve:generation_tokens_total`, counted
  as tokens arrive. They add up to the `usage` the API reports (one request per choice of `n`).
- `ringserve:num_requests_total{finish_reason}`: `stop`, `length`, `abort` (aborted by the ring, or ended by the
  entry without a last output: client gone, submission failed) or `error`.
- `ringserve:time_to_first_token_seconds`, `ringserve:inter_token_latency_seconds` (the gap between two
  outputs, split evenly over the tokens the later one carries), `ringserve:e2e_request_latency_seconds`
  (requests the ring finished: stop, length, abort), all from the time the entry admitted the request.
- `ringserve:request_queue_time_seconds`: how long each request waited in the scheduler's queue before its
  first admission (measured by the engine, carried on the request's first output).
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

from ringserve.bus.connection import BusConnection
from ringserve.bus.messages import RequestOutput
from ringserve.bus.ring_client import RequestStream, RingClient
from ringserve.bus.subjects import Subjects, validate_rid

PREFIX = "ringserve:"
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets, from 1 ms on fast GPUs to minutes on a loaded CPU
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class ModelSeries:
    """The request-level series of one `model_name` label: the served model, or one LoRA adapter by its name."""

    def __init__(self, metrics: "RequestMetrics", model: str) -> None:
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.cached_tokens = metrics.cached_tokens.labels(model)
        self.generation_tokens = metrics.generation_tokens.labels(model)
        self.requests = {reason: metrics.requests.labels(model, reason) for reason in FINISH_REASONS}
        self.ttft = metrics.ttft.labels(model)
        self.itl = metrics.itl.labels(model)
        self.queue_time = metrics.queue_time.labels(model)
        self.e2e = metrics.e2e.labels(model)


class RequestMetrics:
    """The entry's request-level series, in a registry of their own (not prometheus-client's global one).
    Requests for a LoRA adapter count under the adapter's name as `model_name`, as vLLM labels them."""

    def __init__(self, served_model: str, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        disable_created_metrics()  # no `_created` series: nobody asked for them, and they double the scrape
        self.served_model = served_model
        self.registry = registry if registry is not None else CollectorRegistry()
        self.clock = clock
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=self.registry, buckets=buckets)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests served.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.requests = counter("num_requests", "Requests ended, by finish reason (stop, length, abort, error).",
                                ("finish_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time from admission to the first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two generated tokens.", ITL_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited in the scheduler's queue before it was admitted.",
                                    E2E_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from admission to the last output.",
                             E2E_BUCKETS)
        self._series: dict[str, ModelSeries] = {}
        self.series()  # the served model's series exist (at zero) before its first request

    def series(self, lora_name: str | None = None) -> ModelSeries:
        """The series requests for `lora_name` (None: the served model itself) count in."""
        model = lora_name or self.served_model
        if model not in self._series:
            self._series[model] = ModelSeries(self, model)
        return self._series[model]

    def timer(self, lora_name: str | None = None) -> "RequestTimer":
        """The bookkeeping of one request admitted now, for the adapter `lora_name` (None: the served model)."""
        return RequestTimer(self, lora_name)

    def stream(self, client: RingClient, rid: str, traceparent: str | None,
               lora_name: str | None = None) -> "MeteredStream":
        """`client.stream(rid, traceparent)`, measured: a stream that records its outputs here as they are read."""
        return MeteredStream(client.bus, client.subjects, validate_rid(rid), traceparent, client.stall_timeout,
                             timer=self.timer(lora_name))


class RequestTimer:
    """One request's measurements: fed every output in order, then ended once (by its last output or an abort)."""

    def __init__(self, metrics: RequestMetrics, lora_name: str | None) -> None:
        self.all, self.lora_name, self.clock = metrics, lora_name, metrics.clock
        self.admitted_at = self.clock()
        self._series: ModelSeries | None = None
        self.last_token_at: float | None = None
        self.completion_tokens = 0
        self.prompt_counted = False
        self.queue_timed = False
        self.ended = False

    def output(self, out: RequestOutput) -> None:
        """Record one output as it is handed to the reader; the last one ends the request."""
        if self.ended:
            return
        if self._series is None:  # a request refused at once (an adapter not loaded) labels no series of its own
            self._series = self.all.series(self.lora_name if out.error is None else None)
        m = self._series
        now = self.clock()
        if not self.prompt_counted and out.prompt_tokens > 0:
            self.prompt_counted = True
            m.prompt_tokens.inc(out.prompt_tokens)
            m.cached_tokens.inc(out.cached_tokens)
        if out.queue_time is not None and not self.queue_timed:
            self.queue_timed = True
            m.queue_time.observe(out.queue_time)
        new = out.completion_tokens - self.completion_tokens
        if new > 0:
            self.completion_tokens = out.completion_tokens
            m.generation_tokens.inc(new)
            if self.last_token_at is None:
                m.ttft.observe(now - self.admitted_at)
            else:
                gap = (now - self.last_token_at) / new
                for _ in range(new):
                    m.itl.observe(gap)
            self.last_token_at = now
        if out.error is not None:
            self.end("error")
        elif out.finish is not None:
            m.e2e.observe(now - self.admitted_at)
            self.end(out.finish.type if out.finish.type in FINISH_REASONS else "abort")

    def end(self, reason: str) -> None:
        """Count the request as ended with `reason` (only the first call counts)."""
        if not self.ended:
            self.ended = True
            (self._series or self.all.series()).requests[reason].inc()


class MeteredStream(RequestStream):
    """A RequestStream whose reads feed a RequestTimer; ending it before its last output counts an abort."""

    def __init__(self, bus: BusConnection, subjects: Subjects, rid: str, traceparent: str | None,
                 stall_timeout: float | None, *, timer: RequestTimer) -> None:
        super().__init__(bus, subjects, rid, traceparent, stall_timeout)
        self.timer = timer

    async def next(self) -> RequestOutput:
        out = await super().next()
        self.timer.output(out)
        return out

    async def abort(self, reason: str = "client") -> None:
        if not self.finished:
            self.timer.end("abort")
        await super().abort(reason)
