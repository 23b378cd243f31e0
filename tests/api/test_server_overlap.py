"""The whole ring with the engine's overlap loop on (`--overlap-schedule on`, the cuda default, forced on the
CPU): concurrent requests get the tokens the plain loop gives, and a stream ended mid-way frees its KV."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.server_helpers import ServerHandle, wait_until_idle

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
           "Explain gravity to a child in one sentence.", "What is 12 * 7?", "Name a famous physicist."]


@pytest.fixture
def overlap_server(overlap_shards_server: ServerHandle) -> ServerHandle:
    """SmolLM2 with `--overlap-schedule on` (and two detokenizer shards), shared with
    tests/ring/test_detokenizer_elastic.py."""
    return overlap_shards_server


def generate(base_url: str, prompt: str, i: int) -> dict[str, Any]:
    sampling = {"max_new_tokens": 4 + 3 * i, "temperature": 0} if i % 2 == 0 else {
        "max_new_tokens": 4 + 3 * i, "temperature": 0.8, "seed": i, "frequency_penalty": 0.4}
    response = httpx.post(base_url + "/generate", json={"text": prompt, "sampling_params": sampling}, timeout=300)
    assert response.status_code == 200, response.text
    body = response.json()
    return {"ids": body["output_ids"], "finish": body["meta_info"]["finish_reason"]}


def test_overlap_loop_serves_the_plain_loops_tokens(smollm_server: ServerHandle,
                                                    overlap_server: ServerHandle) -> None:
    results = {}
    for server in (smollm_server, overlap_server):
        wait_until_idle(server.base_url)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # in flight together: shared batches, staggered finishes
            results[server.base_url] = list(pool.map(lambda a: generate(server.base_url, *a),
                                                     [(p, i) for i, p in enumerate(PROMPTS)]))
    assert results[overlap_server.base_url] == results[smollm_server.base_url]
    assert all(len(r["ids"]) >= 1 for r in results[overlap_server.base_url])
    cores = os.cpu_count() or 1
    for server, overlap in ((smollm_server, False), (overlap_server, True)):
        info = wait_until_idle(server.base_url)
        assert info["overlap_schedule"] is overlap
        if cores > 1:  # decode steps were timed on both thread counts and the cheaper one is reported
            assert info["torch_threads"] and set(info["torch_threads"].values()) <= {cores - 1, cores}


def test_a_stream_ended_mid_way_frees_its_kv(overlap_server: ServerHandle) -> None:
    base = overlap_server.base_url
    body = {"text": "Tell me a long story about a dragon.", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", base + "/generate", json=body, timeout=120) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 5:
                break  # the client goes away mid-stream
    info = wait_until_idle(base)
    assert info["num_running_reqs"] == 0 and info["kv_running_tokens"] == 0
    assert generate(base, "What is 12 * 7?", 0)["finish"]["type"] in ("stop", "length")
