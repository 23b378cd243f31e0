"""Serving throughput of a running ringserve: concurrency N against a sequential baseline in the same run.

    .venv/bin/python bench/serving_throughput.py --url http://127.0.0.1:8000 --requests 16 --concurrency 8

Prints output tokens/s, mean TTFT and TPOT for each run, and the ratio of batched to sequential throughput
(what continuous batching buys). Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

PROMPTS = ["Tell me about the ocean.", "Explain photosynthesis.", "Write a short poem about autumn.",
           "What makes a good friend?", "Describe a busy city street.", "How do airplanes fly?"]


@dataclass
class Sample:
    """Timings of one streamed request."""

    ttft: float
    e2e: float
    tokens: int


def one_request(url: str, prompt: str, max_tokens: int) -> Sample:
    """Stream one chat completion and time it."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not ttft and chunk["choices"]:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return Sample(ttft, time.perf_counter() - start, tokens)


def run(url: str, requests: int, concurrency: int, max_tokens: int) -> tuple[float, list[Sample]]:
    """Send `requests` requests, `concurrency` at a time; wall time and samples."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(lambda i: one_request(url, PROMPTS[i % len(PROMPTS)], max_tokens), range(requests)))
    return time.perf_counter() - start, samples


def report(name: str, wall: float, samples: list[Sample]) -> float:
    """Print one run's figures; returns its output tokens/s."""
    tokens = sum(s.tokens for s in samples)
    tpot = statistics.mean((s.e2e - s.ttft) / max(1, s.tokens - 1) for s in samples)
    print(f"{name:<14} {tokens / wall:8.1f} tok/s   TTFT {statistics.mean(s.ttft for s in samples) * 1e3:7.0f} ms"
          f"   TPOT {tpot * 1e3:6.1f} ms   ({len(samples)} requests, {wall:.1f} s)")
    return tokens / wall


def main() -> None:
    """Run the baseline and the batched run against --url and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    one_request(args.url, PROMPTS[0], 4)  # warm-up
    base = report("sequential", *run(args.url, max(2, args.requests // 4), 1, args.max_tokens))
    batched = report(f"concurrency {args.concurrency}", *run(args.url, args.requests, args.concurrency,
                                                             args.max_tokens))
    print(f"ratio batched/sequential throughput: {batched / base:.2f}x")


if __name__ == "__main__":
    main()
