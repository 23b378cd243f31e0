"""Streaming load generator for OpenAI-compatible servers: fixed concurrency or Poisson arrivals (httpx async).

TTFT is taken at the first chunk that carries text, ITLs are the gaps between text-carrying chunks (a chunk
may carry several tokens; token counts come from the final `usage` chunk, `stream_options.include_usage`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.metrics import RequestResult


@dataclass
class ClientConfig:
    """Where and how to send requests."""

    base_url: str
    model: str
    max_tokens: int
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    ignore_eos: bool = True
    timeout: float = 1800.0

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def body(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> dict[str, Any]:
        """The request body for one conversation: greedy, streamed, with usage."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens or self.max_tokens,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = messages
        else:  # plain completion: the messages joined as text (no chat template)
            body["prompt"] = "\n\n".join(m["content"] for m in messages)
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def _chunk_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


async def stream_one(client: httpx.AsyncClient, cfg: ClientConfig, messages: list[dict[str, str]],
                     max_tokens: int | None = None) -> RequestResult:
    """Send one streamed request and time its chunks; failures come back as `ok=False` with the reason."""
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = 0.0
    try:
        async with client.stream("POST", cfg.url, json=cfg.body(messages, max_tokens)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter() - start
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                if chunk.get("usage"):
                    result.completion_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
                if any(_chunk_text(c) for c in chunk.get("choices") or []):
                    if result.chunks == 0:
                        result.ttft = now
                    else:
                        result.itls.append(now - last)
                    last = now
                    result.chunks += 1
        result.e2e = time.perf_counter() - start
        if result.chunks == 0:
            result.error = "the stream carried no text"
            return result
        if result.completion_tokens == 0:  # no usage chunk: count one token per chunk
            result.completion_tokens = result.chunks
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


def _client(cfg: ClientConfig, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout, connect=30.0), limits=limits)


async def run_concurrency(cfg: ClientConfig, conversations: list[list[dict[str, str]]],
                          concurrency: int) -> tuple[list[RequestResult], float]:
    """Send every conversation with `concurrency` streams in flight; results (in order) and wall seconds."""
    results: list[RequestResult | None] = [None] * len(conversations)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(conversations)):
        queue.put_nowait(i)

    async with _client(cfg, concurrency) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await stream_one(client, cfg, conversations[i])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return [r for r in results if r is not None], wall


async def run_poisson(cfg: ClientConfig, conversations: list[list[dict[str, str]]], rate: float,
                      max_concurrency: int = 0, seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send the conversations with exponential gaps (mean 1/rate s); at most `max_concurrency` in flight (0 = any)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None

    async with _client(cfg, max_concurrency or len(conversations)) as client:
        async def one(messages: list[dict[str, str]]) -> RequestResult:
            if limit is None:
                return await stream_one(client, cfg, messages)
            async with limit:
                return await stream_one(client, cfg, messages)

        start = time.perf_counter()
        tasks = []
        for i, messages in enumerate(conversations):
            if i:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one(messages)))
        results = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - start
    return results, wall


async def single(cfg: ClientConfig, messages: list[dict[str, str]], max_tokens: int) -> RequestResult:
    """One request on its own (warm-up and prefix-cache probes)."""
    async with _client(cfg, 1) as client:
        return await stream_one(client, cfg, messages, max_tokens)
