"""`GET /metrics`: the entry's request-level series (`actors/entry/ops/metrics.py`) and the scheduler's load.

The load gauges come from the scheduler's `SchedulerInfo`, asked for over the bus at each scrape with a short
timeout; when the scheduler does not answer, `ringserve:scheduler_up` is 0, the load gauges are left out and
the request-level series still render. The text format is Prometheus' (OpenMetrics when the scraper asks);
`?names=vllm` or `?names=sglang` renders the series under those servers' names (`metric_names.py`).

Gauges: `ringserve:num_running_reqs`, `ringserve:num_queue_reqs` (waiting in the scheduler),
`ringserve:token_usage` (KV slots used / total), `ringserve:kv_cached_tokens` (held only by the prefix cache),
`ringserve:cache_hit_rate` (cached / all prompt tokens since start), `ringserve:num_retractions` (since start);
speculative decoding's `ringserve:spec_drafted_tokens`, `spec_accepted_tokens`, `spec_emitted_tokens`,
`spec_verify_rows` (since start) and `spec_accept_length` (emitted per verify row).
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ringserve.actors.entry.errors import error_response
from ringserve.actors.entry.ops.metrics import PREFIX
from ringserve.actors.entry.ops.metric_names import DIALECTS, renamed
from ringserve.actors.entry.request_flow import EntryService
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import InfoQuery, SchedulerInfo

log = logging.getLogger("entry")
SCHEDULER_INFO_TIMEOUT = 1.0  # seconds a scrape waits for the scheduler's answer


def scheduler_families(info: SchedulerInfo | None, served_model: str) -> list[Metric]:
    """The scheduler's load as gauge families; only `scheduler_up` (0) when `info` is None."""
    labels = ["model_name"]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        family.add_metric([served_model], value)
        return family

    families = [gauge("scheduler_up", "1 if the scheduler answered this scrape's load query, else 0.",
                      0.0 if info is None else 1.0)]
    if info is None:
        return families
    usage = info.kv_used_tokens / info.kv_total_tokens if info.kv_total_tokens else 0.0
    return families + [
        gauge("num_running_reqs", "Requests the scheduler is running.", info.num_running_reqs),
        gauge("num_queue_reqs", "Requests waiting in the scheduler's queue.", info.num_waiting_reqs),
        gauge("token_usage", "Fraction of KV cache slots in use (running requests and the prefix cache).", usage),
        gauge("kv_cached_tokens", "KV slots held only by the prefix cache (evictable).", info.kv_cached_tokens),
        gauge("cache_hit_rate", "Cached / all prompt tokens of the requests admitted since start.",
              info.cache_hit_rate),
        gauge("num_retractions", "Requests retracted to the queue since start (KV cache ran short).",
              info.num_retractions),
        gauge("spec_drafted_tokens", "Draft tokens speculative decoding proposed since start.",
              info.spec_drafted_tokens),
        gauge("spec_accepted_tokens", "Draft tokens verification accepted since start.", info.spec_accepted_tokens),
        gauge("spec_emitted_tokens", "Tokens verify steps emitted since start (accepted drafts plus one each).",
              info.spec_emitted_tokens),
        gauge("spec_verify_rows", "Verify rows (a request's drafts checked in one forward) since start.",
              info.spec_verify_rows),
        gauge("spec_accept_length", "Tokens a verify row emitted on average since start (1 + accepted drafts).",
              info.spec_emitted_tokens / info.spec_verify_rows if info.spec_verify_rows else 0.0),
        gauge("kv_tier_blocks", "KV blocks the second tier (--kv-tier-bytes) holds.", info.kv_tier_blocks),
        gauge("kv_tier_bytes", "Bytes the KV tier holds.", info.kv_tier_bytes),
        gauge("kv_tier_saved_blocks",
              "KV blocks written to the tier since start (evicted, written through, or at a stop).",
              info.kv_tier_saved_blocks),
        gauge("kv_tier_loaded_blocks", "KV blocks loaded from the tier since start instead of computed.",
              info.kv_tier_loaded_blocks),
        gauge("kv_tier_loaded_bytes", "Bytes loaded from the KV tier since start.", info.kv_tier_loaded_bytes),
        gauge("kv_tier_load_seconds", "Seconds spent loading from the KV tier since start.",
              info.kv_tier_load_seconds),
        gauge("kv_tier_corrupt_blocks", "KV tier blocks dropped for a bad checksum since start (computed instead).",
              info.kv_tier_corrupt_blocks),
        gauge("kv_fetched_blocks", "KV blocks fetched from other replicas since start (--kv-share).",
              info.kv_fetched_blocks),
        gauge("kv_fetched_bytes", "Bytes of KV fetched from other replicas since start.", info.kv_fetched_bytes),
        gauge("kv_fetch_seconds", "Seconds spent fetching KV from other replicas since start.",
              info.kv_fetch_seconds),
        gauge("kv_fetch_failures", "KV fetches that stopped short since start (deadline, holder gone, bad "
              "checksum): the rest was computed.", info.kv_fetch_failures),
        gauge("kv_served_blocks", "KV blocks sent to other replicas since start.", info.kv_served_blocks),
    ]


class ScrapeView:
    """What one scrape renders: a registry's series followed by extra families (a prometheus-client Collector),
    under the names of `dialect`."""

    def __init__(self, registry: CollectorRegistry, extra: Iterable[Metric], dialect: str = "ringserve") -> None:
        self.registry = registry
        self.extra = list(extra)
        self.dialect = dialect

    def collect(self) -> Iterator[Metric]:
        yield from renamed([*self.registry.collect(), *self.extra], self.dialect)


async def fetch_scheduler_info(service: EntryService, timeout: float = SCHEDULER_INFO_TIMEOUT) -> SchedulerInfo | None:
    """The scheduler's `SchedulerInfo`, or None if it does not answer within `timeout` seconds (or NATS is down)."""
    client = service.client
    try:
        return await client.bus.request(client.subjects.scheduler_info, InfoQuery(), SchedulerInfo, timeout=timeout)
    except Exception as exc:  # timeout, no responders, disconnected: the scrape goes on without the gauges
        log.debug("metrics: no scheduler info: %r", exc)
        return None


def metrics_route(service: EntryService) -> Route:
    """`GET /metrics` over `service` (public: the entry's guard lists it in PUBLIC_PATHS)."""

    async def metrics(request: Request) -> Response:
        dialect = request.query_params.get("names", "ringserve")
        if dialect not in DIALECTS:
            return error_response(ApiError(f"names must be one of {list(DIALECTS)}, got {dialect[:50]!r}",
                                           param="names"))
        info = await fetch_scheduler_info(service)
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        view = ScrapeView(service.metrics.registry, scheduler_families(info, service.served_model), dialect)
        return Response(encoder(view), headers={"Content-Type": content_type})  # type: ignore[arg-type]

    return Route("/metrics", metrics, methods=["GET"])
