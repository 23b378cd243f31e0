"""A busy scheduler is not a dead one: on a host kept busy by two CPU hog processes, 32 chat streams asking for
`top_logprobs` run beside one long scoring request (a 3,000-token prompt, its top-20 prompt logprobs), on the real
model over real HTTP, and every one of them ends with 200 and no error event (no 503 "the ring lost ..."), the
entry never logs a lost heartbeat, and `/get_server_info` reports the heartbeat timeout it judges by."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.common.model_source import DEFAULT_MODEL
from ringserve.actors.entry.settings import DEFAULT_HEARTBEAT_TIMEOUT
from tests.server_helpers import ServerHandle, start_server

STREAMS = 32
LONG_PROMPT_TOKENS = 3000
pytestmark = pytest.mark.host_load  # its CPU hogs would starve any test beside it
DEADLINE = 150.0  # a guard against a hang, not a measured threshold


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = start_server(DEFAULT_MODEL, extra=["--max-total-tokens", "16384"])
    yield handle
    handle.stop()


def _chat_stream(base: str, i: int) -> tuple[int, list[str]]:
    """One streamed chat request with top_logprobs: its status and the error events it got."""
    body = {"messages": [{"role": "user", "content": f"Count slowly from {i} upwards, one number per line."}],
            "max_tokens": 16, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 20,
            "ignore_eos": True}
    errors: list[str] = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=DEADLINE) as response:
        if response.status_code != 200:
            return response.status_code, [response.read().decode(errors="replace")[:300]]
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"error"' in line:
                errors.append(line[:300])
    return 200, errors


def _scoring(base: str) -> tuple[int, list[str]]:
    """One long prompt scored: every prompt token's logprob (echo), one new token."""
    prompt = "".join(f"Line {k}: the quick brown fox jumps over the lazy dog. " for k in range(LONG_PROMPT_TOKENS // 15))
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 20, "temperature": 0}
    reply = httpx.post(base + "/v1/completions", json=body, timeout=DEADLINE)
    if reply.status_code != 200:
        return reply.status_code, [reply.text[:300]]
    scored = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    return 200, [] if len(scored) >= LONG_PROMPT_TOKENS * 0.9 else [f"only {len(scored)} prompt logprobs"]


def test_streams_beside_a_long_prompt_on_a_busy_host_end_without_a_503(
        server: ServerHandle, cpu_hogs: list[subprocess.Popen[bytes]]) -> None:
    base = server.base_url
    info: Any = httpx.get(base + "/get_server_info", timeout=30).json()
    assert info["heartbeat_timeout"] == DEFAULT_HEARTBEAT_TIMEOUT
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(STREAMS + 1) as pool:
        long_one = pool.submit(_scoring, base)
        time.sleep(1.0)  # the long prompt is prefilling when the streams come
        streams = [pool.submit(_chat_stream, base, i) for i in range(STREAMS)]
        outcomes = [f.result(timeout=DEADLINE) for f in streams] + [long_one.result(timeout=DEADLINE)]
    took = time.monotonic() - started
    failed = [(status, errors) for status, errors in outcomes if status != 200 or errors]
    log = server.log()
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed in {took:.0f} s: " \
                       f"{json.dumps(failed[:3])}\n{log[-3000:]}"
    assert "actor heartbeat lost" not in log
    print(f"{len(outcomes)} requests in {took:.0f} s under two CPU hogs; actors:",
          httpx.get(base + "/get_server_info", timeout=30).json()["actors"])
