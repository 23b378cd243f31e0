"""SGLang's native /generate against the real ring: batches, n, native error names, cumulative streaming (and
the delta option), and SGLang's server and model info names."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server_helpers import ServerHandle, sse_events

GREEDY = {"max_new_tokens": 6, "temperature": 0}


def generate(server: ServerHandle, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/generate", json=body, timeout=120)


def test_a_text_batch_answers_a_list_in_input_order(smollm_server: ServerHandle) -> None:
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    singles = [generate(smollm_server, {"text": p, "sampling_params": GREEDY}).json() for p in prompts]
    batch = generate(smollm_server, {"text": prompts, "sampling_params": GREEDY})
    assert batch.status_code == 200, batch.text
    results = batch.json()
    assert isinstance(results, list) and len(results) == 3
    assert [r["text"] for r in results] == [s["text"] for s in singles]
    assert [r["output_ids"] for r in results] == [s["output_ids"] for s in singles]
    assert all(r["meta_info"]["completion_tokens"] == 6 for r in results)


def test_an_input_ids_batch_answers_a_list_in_input_order(smollm_server: ServerHandle) -> None:
    prompts = [[504, 3575, 282, 4649, 314], [28, 30, 29, 30, 33]]
    singles = [generate(smollm_server, {"input_ids": p, "sampling_params": GREEDY}).json() for p in prompts]
    batch = generate(smollm_server, {"input_ids": prompts, "sampling_params": GREEDY})
    assert batch.status_code == 200, batch.text
    assert [r["output_ids"] for r in batch.json()] == [s["output_ids"] for s in singles]
    assert [r["meta_info"]["prompt_tokens"] for r in batch.json()] == [5, 5]


def test_n_answers_a_flat_list_with_seed_plus_i(smollm_server: ServerHandle) -> None:
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "seed": 11}
    both = generate(smollm_server, {"text": "Tell me a story.", "sampling_params": {**sampling, "n": 2}})
    assert both.status_code == 200, both.text
    results = both.json()
    assert isinstance(results, list) and len(results) == 2
    for i, result in enumerate(results):  # choice i samples with seed + i, as the OpenAI routes do
        alone = generate(smollm_server, {"text": "Tell me a story.",
                                         "sampling_params": {**sampling, "seed": 11 + i}}).json()
        assert result["output_ids"] == alone["output_ids"]
    batch = generate(smollm_server, {"text": ["a", "b"], "sampling_params": {**GREEDY, "n": 2}}).json()
    assert len(batch) == 4 and batch[0]["output_ids"] == batch[1]["output_ids"]  # prompt-major


def test_errors_name_the_native_parameter(smollm_server: ServerHandle) -> None:
    for sampling, param in (({"max_new_tokens": -1}, "max_new_tokens"),
                            ({"max_new_tokens": 4, "min_new_tokens": 9}, "min_new_tokens"),
                            ({"max_new_tokens": 10**6}, "max_new_tokens"),
                            ({"top_logprobs_num": 99}, "top_logprobs_num"),
                            ({"n": 0}, "n")):
        response = generate(smollm_server, {"text": "hi", "sampling_params": sampling})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, (sampling, error)
        assert "max_tokens" not in error["message"] and "min_tokens" not in error["message"], error
    chat = httpx.post(smollm_server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1})
    assert chat.json()["error"]["param"] == "max_tokens"  # the OpenAI routes keep the OpenAI names


def stream(server: ServerHandle, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return list(sse_events(r))


def test_streamed_chunks_are_cumulative_unless_deltas_are_asked(smollm_server: ServerHandle) -> None:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    full = generate(smollm_server, body).json()
    events = stream(smollm_server, body)
    assert events[-1] == "[DONE]" and len(events) > 2
    chunks = events[:-1]
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    deltas = stream(smollm_server, {**body, "stream_deltas": True})[:-1]
    assert "".join(c["text"] for c in deltas) == full["text"]
    assert [t for c in deltas for t in c["output_ids"]] == full["output_ids"]
    assert max(len(c["output_ids"]) for c in deltas) < len(full["output_ids"])


def test_a_streamed_batch_says_each_chunks_index(smollm_server: ServerHandle) -> None:
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    full = generate(smollm_server, {"text": prompts, "sampling_params": GREEDY}).json()
    chunks = stream(smollm_server, {"text": prompts, "sampling_params": GREEDY})[:-1]
    last = {c["index"]: c for c in chunks}
    assert [last[i]["output_ids"] for i in range(2)] == [r["output_ids"] for r in full]


def test_server_info_under_sglangs_names(smollm_server: ServerHandle) -> None:
    info = httpx.get(smollm_server.base_url + "/get_server_info", timeout=10).json()
    assert info["max_total_num_tokens"] == info["kv_total_tokens"] > 0
    assert isinstance(info["version"], str) and info["version"]
    assert isinstance(info["model_path"], str) and info["model_path"]


def test_server_info_reports_the_execution_plan_that_runs(smollm_server: ServerHandle) -> None:
    """`execution` (actors/engine/execution_plan.py): a float32 CPU server's choices, its graph mode the one its
    decode graphs run in."""
    info = httpx.get(smollm_server.base_url + "/get_server_info", timeout=10).json()
    execution = info["execution"]
    assert {key: execution[key] for key in ("attention_backend", "norm_rotary_kernels", "fused_cpu_decode",
                                            "moe_path", "row_invariant")} == {
        "attention_backend": "torch", "norm_rotary_kernels": "torch", "fused_cpu_decode": "false",
        "moe_path": "sorted", "row_invariant": "false"}
    assert execution["graph_mode"] == info["decode_graphs"]["mode"]


def test_get_model_info(smollm_server: ServerHandle) -> None:
    response = httpx.get(smollm_server.base_url + "/get_model_info", timeout=10)
    assert response.status_code == 200, response.text
    model = response.json()
    assert model["is_generation"] is True
    assert isinstance(model["model_path"], str) and model["model_path"]
    assert isinstance(model["tokenizer_path"], str) and model["tokenizer_path"]
    # a GGUF has no generation_config.json, and SmolLM2's template writes no thinking
    assert model["default_sampling_params"] == {} and model["reasoning_parser"] == "none"
