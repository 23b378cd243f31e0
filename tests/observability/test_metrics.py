"""`GET /metrics`: the request-level series move by what the API reported as requests are served (real ring),
the scheduler's gauges are there, and (in-process) the route is public, renders without the scheduler, and the
per-request bookkeeping times tokens and ends each request once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.testclient import TestClient

from ringserve.actors.entry.guard import EntryGuard
from ringserve.actors.entry.settings import EntrySettings
from ringserve.actors.entry.ops.metrics import MeteredStream, RequestMetrics
from ringserve.actors.entry.ops.metrics_route import metrics_route
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import FinishReason, RequestOutput
from ringserve.bus.subjects import Subjects
from tests.server_helpers import ServerHandle, sse_events, wait_until_idle

MODEL = "SmolLM2-135M-Instruct"
GAUGES = ("num_running_reqs", "num_queue_reqs", "token_usage", "kv_cached_tokens", "cache_hit_rate",
          "num_retractions")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels without model_name) -> value, from a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(base_url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


def value(scraped: dict[Any, float], name: str, **labels: str) -> float:
    return scraped.get(("ringserve:" + name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_as_requests_are_served(smollm_server: ServerHandle) -> None:
    base = smollm_server.base_url
    wait_until_idle(base)
    before = scrape(base)
    usages = []  # (prompt, completion, cached) as each API reported them
    finishes = []  # finish reasons, as reported
    # a length finish over the OpenAI API, not streamed
    reply = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    finishes.append("length")
    usage = reply["usage"]
    usages.append((usage["prompt_tokens"], usage["completion_tokens"],
                   (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
    # a stop finish over /generate: the second greedy token is a stop token
    first = httpx.post(base + "/generate", timeout=120, json={
        "text": "Once upon a time", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    meta = first["meta_info"]
    finishes.append(meta["finish_reason"]["type"])
    usages.append((meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]))
    stopped = httpx.post(base + "/generate", timeout=120, json={
        "text": "Once upon a time", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                          "stop_token_ids": [first["output_ids"][1]]}}).json()
    meta = stopped["meta_info"]
    assert meta["finish_reason"]["type"] == "stop"
    finishes.append("stop")
    usages.append((meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]))
    # a streamed chat with usage: its tokens arrive one output at a time
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 5,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = [e for e in sse_events(response) if e != "[DONE]"]
    usage = events[-1]["usage"]
    finishes.append(next(e["choices"][0]["finish_reason"] for e in events
                         if e["choices"] and e["choices"][0]["finish_reason"]))
    usages.append((usage["prompt_tokens"], usage["completion_tokens"],
                   (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
    after = scrape(base)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt, generated, cached = (sum(column) for column in zip(*usages))
    assert moved("prompt_tokens_total") == prompt
    assert moved("generation_tokens_total") == generated
    assert moved("cached_tokens_total") == cached and cached > 0  # the repeated /generate prompt was cached
    assert moved("num_requests_total", finish_reason="length") == finishes.count("length") >= 1
    assert moved("num_requests_total", finish_reason="stop") == finishes.count("stop") >= 1
    assert moved("num_requests_total", finish_reason="error") == moved("num_requests_total", finish_reason="abort") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert moved(name + "_count") == 4
        assert moved(name + "_sum") > 0
        assert moved(name + "_bucket", le="+Inf") == 4
    # queue time is part of the time to the first token
    assert moved("request_queue_time_seconds_sum") < moved("time_to_first_token_seconds_sum")
    assert moved("inter_token_latency_seconds_count") == generated - 4  # every token after each first one
    assert value(after, "e2e_request_latency_seconds_sum") >= value(after, "time_to_first_token_seconds_sum")
    assert value(after, "scheduler_up") == 1
    for gauge in GAUGES:
        assert ("ringserve:" + gauge, ()) in after, gauge
    assert 0 <= value(after, "token_usage") <= 1 and value(after, "num_running_reqs") == 0


def test_metrics_need_no_api_key_and_render_without_a_scheduler() -> None:
    class SilentBus:
        async def request(self, *args: Any, **kwargs: Any) -> Any:
            raise asyncio.TimeoutError("nobody answered")

    metrics = RequestMetrics("m")
    timer = metrics.timer()
    timer.output(RequestOutput(rid="r", prompt_tokens=7, completion_tokens=1, finish=FinishReason("length")))
    service = SimpleNamespace(metrics=metrics, served_model="m",
                              client=SimpleNamespace(bus=SilentBus(), subjects=Subjects("t")))
    app = Starlette(routes=[metrics_route(service)],  # type: ignore[arg-type]
                    middleware=[Middleware(EntryGuard, settings=EntrySettings(api_key="secret", allowed_hosts=["*"]))])
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200
    scraped = samples(response.text)
    assert value(scraped, "scheduler_up") == 0
    assert not any(("ringserve:" + gauge, ()) in scraped for gauge in GAUGES)
    assert value(scraped, "prompt_tokens_total") == 7 and value(scraped, "generation_tokens_total") == 1
    assert value(scraped, "num_requests_total", finish_reason="length") == 1
    assert "ringserve:" not in generate_latest(REGISTRY).decode()  # a registry of its own, not the global one
    openmetrics = TestClient(app).get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_request_timer_times_tokens_and_ends_once() -> None:
    clock = Clock()
    metrics = RequestMetrics("m", clock=clock)
    timer = metrics.timer()
    clock.now += 0.5
    timer.output(RequestOutput(rid="r", prompt_tokens=10, cached_tokens=4, completion_tokens=1, queue_time=0.25))
    clock.now += 0.3
    timer.output(RequestOutput(rid="r", prompt_tokens=10, cached_tokens=4, completion_tokens=4))  # 3 tokens
    clock.now += 0.2
    timer.output(RequestOutput(rid="r", prompt_tokens=10, cached_tokens=4, completion_tokens=4,
                               finish=FinishReason("stop", matched="!")))  # held-back text: no new token
    timer.output(RequestOutput(rid="r", completion_tokens=9, error=ApiError("late")))  # ignored: ended
    scraped = samples(generate_latest(metrics.registry).decode())
    assert value(scraped, "prompt_tokens_total") == 10 and value(scraped, "cached_tokens_total") == 4
    assert value(scraped, "generation_tokens_total") == 4
    assert value(scraped, "time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(scraped, "request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value(scraped, "request_queue_time_seconds_count") == 1
    assert value(scraped, "inter_token_latency_seconds_count") == 3
    assert value(scraped, "inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert value(scraped, "e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert value(scraped, "num_requests_total", finish_reason="stop") == 1
    assert value(scraped, "num_requests_total", finish_reason="error") == 0

    failed = metrics.timer()
    failed.output(RequestOutput(rid="bad", error=ApiError("top_p must be in (0, 1]")))
    scraped = samples(generate_latest(metrics.registry).decode())
    assert value(scraped, "num_requests_total", finish_reason="error") == 1
    assert value(scraped, "e2e_request_latency_seconds_count") == 1  # errors are not timed
    assert value(scraped, "time_to_first_token_seconds_count") == 1


def test_a_stream_ended_early_counts_one_abort() -> None:
    published = []

    class Bus:
        async def publish(self, subject: str, msg: Any, traceparent: str | None = None) -> None:
            published.append(subject)

    async def main() -> None:
        metrics = RequestMetrics("m")
        stream = MeteredStream(Bus(), Subjects("t"), "r1", None, None, timer=metrics.timer())  # type: ignore[arg-type]
        await stream.abort("client disconnected")
        await stream.abort("client disconnected")
        scraped = samples(generate_latest(metrics.registry).decode())
        assert value(scraped, "num_requests_total", finish_reason="abort") == 1
        assert published == ["t.abort.r1"]

    asyncio.run(main())


def test_metrics_render_under_vllm_and_sglang_names_without_created_series() -> None:
    class SilentBus:
        async def request(self, *args: Any, **kwargs: Any) -> Any:
            raise asyncio.TimeoutError("nobody answered")

    metrics = RequestMetrics("m")
    metrics.timer().output(RequestOutput(rid="r", prompt_tokens=7, completion_tokens=1, finish=FinishReason("stop")))
    service = SimpleNamespace(metrics=metrics, served_model="m",
                              client=SimpleNamespace(bus=SilentBus(), subjects=Subjects("t")))
    client = TestClient(Starlette(routes=[metrics_route(service)]))  # type: ignore[arg-type]
    ours = client.get("/metrics").text
    assert "_created" not in ours and "ringserve:prompt_tokens_total" in ours
    vllm = samples(client.get("/metrics", params={"names": "vllm"}).text)
    assert vllm[("vllm:prompt_tokens_total", ())] == 7
    assert vllm[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert ("vllm:time_to_first_token_seconds_count", ()) in vllm
    assert ("ringserve:scheduler_up", ()) in vllm  # no vLLM counterpart: our name
    sglang = client.get("/metrics", params={"names": "sglang"}).text
    assert "sglang:prompt_tokens_total" in sglang and "ringserve:prompt_tokens" not in sglang
    refused = client.get("/metrics", params={"names": "tgi"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "names"
