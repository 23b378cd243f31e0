"""Speculative decoding through the whole ring on the real SmolLM2 model: a server started with
`--speculative-algorithm ngram` answers greedy requests with the tokens of a server without it (a prompt the
answer copies from, stop strings inside its accepted runs, an output constraint, an opted-out request), and
`/get_server_info` and `/metrics` (ours and vLLM's names) show the drafts accepted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from tests.server_helpers import ServerHandle, server_info, servers_side_by_side

MODEL = "SmolLM2-135M-Instruct"
# two rings side by side, without background graph compiles and with small pools, so they fit a loaded 2-core
# host beside the other test files (a third ring starved it: lost heartbeats). Verify steps through compiled
# graphs: bench/bench_speculative.py; a draft model: tests/engine/test_speculative.py.
FLAGS = ["--torch-threads", "1", "--disable-cuda-graph", "--max-total-tokens", "4096"]
QUOTE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
         "    return a * b\n")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerHandle]]:
    with servers_side_by_side({"off": (MODEL, FLAGS),
                               "ngram": (MODEL, [*FLAGS, "--speculative-algorithm", "ngram"])}) as handles:
        yield handles


def chat(server: ServerHandle, content: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 96, **extra}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "copy": (f"Copy this code exactly, then stop:\n\n{QUOTE}", {}),
    "stop": (f"Copy this code exactly:\n\n{QUOTE}", {"stop": ["mul"]}),
    "schema": ("Give the name and age of a person as JSON.", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                      "age": {"type": "integer"}},
                                     "required": ["name", "age"]}}}}),
    "opt-out": (f"Copy this code exactly:\n\n{QUOTE}", {"speculative": False}),
}


def test_greedy_answers_equal_the_server_without_speculation(servers: dict[str, ServerHandle]) -> None:
    def answers(server: ServerHandle) -> dict[str, tuple[str, str]]:
        with ThreadPoolExecutor(len(CASES)) as pool:  # sent together: they share batches
            replies = dict(zip(CASES, pool.map(lambda case: chat(server, case[0], **case[1]), CASES.values())))
        return {name: (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"])
                for name, r in replies.items()}

    off, on = answers(servers["off"]), answers(servers["ngram"])
    assert on == off
    assert "return a + b" in on["copy"][0] and on["stop"][1] == "stop" and "mul" not in on["stop"][0]
    info = server_info(servers["ngram"].base_url)
    assert info["speculative"] == "ngram" and info["spec_accepted_tokens"] > 20, info
    assert info["spec_emitted_tokens"] == info["spec_accepted_tokens"] + info["spec_verify_rows"]
    assert server_info(servers["off"].base_url)["spec_verify_rows"] == 0


def test_usage_metrics_and_server_info_show_the_drafts(servers: dict[str, ServerHandle]) -> None:
    """The response's usage counts its accepted and rejected drafts (OpenAI's predicted-output fields), /generate's
    meta_info too, and /metrics shows the totals under our names and vLLM's."""
    reply = chat(servers["ngram"], CASES["copy"][0])
    details = reply["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0, reply["usage"]
    assert "completion_tokens_details" not in chat(servers["off"], CASES["copy"][0])["usage"]
    generated = httpx.post(servers["ngram"].base_url + "/generate", json={
        "text": QUOTE * 3 + "\n\ndef add(a, b):\n", "sampling_params": {"max_new_tokens": 48, "temperature": 0}},
        timeout=300).json()
    meta = generated["meta_info"]
    assert meta["spec_drafted_tokens"] >= meta["spec_accepted_tokens"] > 0, (meta, generated["text"])
    ours = httpx.get(servers["ngram"].base_url + "/metrics", timeout=10).text
    accepted = [line for line in ours.splitlines() if line.startswith("ringserve:spec_accepted_tokens{")]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0, ours
    vllm = httpx.get(servers["ngram"].base_url + "/metrics", params={"names": "vllm"}, timeout=10).text
    assert "vllm:spec_decode_num_accepted_tokens{" in vllm and "vllm:spec_decode_num_drafts{" in vllm
