"""`/update_weights_from_disk` against real rings: a served tiny model gets a second checkpoint (a modified copy
saved to disk) swapped in under load, in "wait" mode (running requests finish first, a request arriving
meanwhile runs on the new weights), "pause" mode (running requests pause, then resume on the new weights) and
SGLang's `abort_all_requests`; outputs afterwards equal a fresh server's on the new weights, the prefix cache
was flushed, and the new version shows in /get_server_info and /v1/models. On the SmolLM2 server, a checkpoint
of another architecture is a 400 and the old weights keep serving. In process, the engine's swap is checked
exactly: tensors copied in place, running requests recompute their KV and continue as the new weights would,
quantized layers quantized again."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.engine.models.weights import Checkpoint, WeightMismatch, model_from_hf
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import engine_for, greedy, run_to_completion, tiny_hf_llama, tokens_of
from tests.server_helpers import ServerHandle, server_info, start_server

GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = ["Hello", "The weather today", "Once upon a time"]
LONG = {"max_new_tokens": 800, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's checkpoint with every matrix perturbed: same architecture, other outputs."""
    import torch
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("tiny-llama-v2")
    for item in tiny_model_dir.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy(item, directory / item.name)
    generator = torch.Generator().manual_seed(1)
    tensors = {name: (t + 0.05 * torch.randn(t.shape, generator=generator)).contiguous() if t.dim() == 2 else t
               for name, t in load_file(tiny_model_dir / "model.safetensors").items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def rings(tiny_model_dir: Path, new_weights: Path) -> Iterator[dict[str, ServerHandle]]:
    """"server" on the tiny model (its weights get swapped) and "fresh" on the new weights, started side by side."""
    with ThreadPoolExecutor(2) as pool:
        futures = {"server": pool.submit(start_server, str(tiny_model_dir)),
                   "fresh": pool.submit(start_server, str(new_weights))}
    try:
        yield {name: future.result() for name, future in futures.items()}
    finally:
        codes = {name: future.result().stop() for name, future in futures.items() if future.exception() is None}
    assert codes.get("server") == 0, codes


def generate(server: ServerHandle, prompts: list[str], sampling: dict[str, Any] = GREEDY) -> list[dict[str, Any]]:
    reply = httpx.post(server.base_url + "/generate", json={"text": prompts, "sampling_params": sampling}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def update(server: ServerHandle, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/update_weights_from_disk", json=body, timeout=120)


def in_flight(server: ServerHandle, count: int) -> tuple[threading.Thread, list[Any]]:
    """`count` long requests running in a thread (their results land in the list)."""
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.extend(generate(server, [f"long {i}" for i in range(count)],
                                                                       LONG)))
    thread.start()
    deadline = time.monotonic() + 30
    while server_info(server.base_url)["num_running_reqs"] < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return thread, results


def test_weights_swapped_under_load_match_a_fresh_server(rings: dict[str, ServerHandle], new_weights: Path) -> None:
    server, fresh = rings["server"], rings["fresh"]
    try:
        expected = [r["output_ids"] for r in generate(fresh, PROMPTS)]
    finally:
        fresh.stop()
    before = generate(server, PROMPTS)
    assert [r["output_ids"] for r in before] != expected, "the new checkpoint must change the outputs"
    assert server_info(server.base_url)["kv_cached_tokens"] > 0

    # "wait": the running requests finish on the old weights; one that arrives meanwhile runs on the new ones
    thread, finished = in_flight(server, 2)
    answer: dict[str, Any] = {}
    updating = threading.Thread(target=lambda: answer.update(
        reply=update(server, {"model_path": str(new_weights), "mode": "wait"})))
    updating.start()
    deadline = time.monotonic() + 30
    while server.log().count("loaded new weights") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    arrived = generate(server, PROMPTS[:1])
    updating.join(60)
    thread.join(60)
    reply = answer["reply"]
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["success"] and body["weight_version"] == "2" and body["num_waited_requests"] == 2
    assert body["freed_tokens"] > 0 and body["held_new_requests"] == 1
    assert [r["meta_info"]["completion_tokens"] for r in finished] == [800, 800]
    assert arrived[0]["output_ids"] == expected[0]

    after = generate(server, PROMPTS)
    assert [r["output_ids"] for r in after] == expected
    assert after[1]["meta_info"]["cached_tokens"] == 0, "the prefix cache kept KV of the old weights"
    info = server_info(server.base_url)
    assert info["weight_version"] == "2" and info["model_path"] == str(new_weights)
    card = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]
    assert card["weight_version"] == "2" and card["root"] == str(new_weights)

    # "pause": running requests pause, their KV is recomputed on the new weights, and they run to the end
    thread, finished = in_flight(server, 2)
    reply = update(server, {"model_path": str(new_weights), "mode": "pause", "weight_version": "step-3"})
    thread.join(60)
    assert reply.status_code == 200 and reply.json()["num_paused_requests"] == 2, reply.text
    assert [r["meta_info"]["completion_tokens"] for r in finished] == [800, 800]
    assert [r["meta_info"]["finish_reason"]["type"] for r in finished] == ["length", "length"]
    assert not server_info(server.base_url)["paused"]
    assert [r["output_ids"] for r in generate(server, PROMPTS)] == expected

    # SGLang's abort_all_requests: the running requests end with finish reason "abort"
    thread, finished = in_flight(server, 1)
    reply = update(server, {"model_path": str(new_weights), "abort_all_requests": True})
    thread.join(60)
    assert reply.status_code == 200 and reply.json()["num_aborted_requests"] == 1, reply.text
    assert finished[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert server_info(server.base_url)["weight_version"] == "4"


def test_a_checkpoint_of_another_architecture_is_a_400_and_the_old_weights_keep_serving(
        smollm_server: ServerHandle, tiny_model_dir: Path) -> None:
    sampling = {"max_new_tokens": 6, "temperature": 0}
    before = generate(smollm_server, ["The capital of France is"], sampling)
    reply = update(smollm_server, {"model_path": str(tiny_model_dir)})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "model_path" and "hidden_size is 64, the running model's 576" in error["message"]
    assert update(smollm_server, {"model_path": "/no/such/checkpoint"}).status_code == 400
    bad_mode = update(smollm_server, {"model_path": str(tiny_model_dir), "mode": "later"})
    assert bad_mode.status_code == 400 and bad_mode.json()["error"]["param"] == "mode"
    after = generate(smollm_server, ["The capital of France is"], sampling)
    assert after[0]["output_ids"] == before[0]["output_ids"]
    info = server_info(smollm_server.base_url)
    assert info["weight_version"] == "1" and not info["paused"]


def checkpoint_of(hf_model: Any, path: str = "v2") -> Checkpoint:
    return Checkpoint(path, hf_model.config, dict(model_from_hf(hf_model.config, hf_model.state_dict()).state_dict()))


@pytest.mark.parametrize("quantized", [False, True])
def test_the_engine_swaps_in_place_and_running_requests_continue_as_the_new_weights_would(quantized: bool) -> None:
    from ringserve.kernels.quantization import quantize_linears

    old, new = tiny_hf_llama(seed=0), tiny_hf_llama(seed=1)
    engine, reference = engine_for(old), engine_for(new)
    if quantized:
        quantize_linears(engine.runner.model, "int8")
        quantize_linears(reference.runner.model, "int8")
    prompts = [[1, 5, 9, 14], [1, 7, 7, 3, 30, 31]]
    for i, ids in enumerate(prompts):
        assert engine.add_request(TokenizedRequest(f"r{i}", ids, greedy(12))) is None
    before: dict[str, list[int]] = {f"r{i}": [] for i in range(2)}
    for _ in range(4):  # prefill, then a few decode steps on the old weights
        for row in engine.step():
            before[row.rid] += row.token_ids
    embed = engine.runner.model.model.embed_tokens.weight
    pointer = embed.data_ptr()
    with pytest.raises(WeightMismatch, match="hidden_size is 32"):
        engine.update_weights(checkpoint_of(tiny_hf_llama(hidden_size=32, intermediate_size=64)), "other")
    assert engine.update_weights(checkpoint_of(new), "v2") >= 0
    assert embed.data_ptr() == pointer and engine.stats().model == "v2"  # copied in place
    assert engine.cache.num_free == engine.num_slots, "KV of the old weights is left (cached or held)"
    after = run_to_completion(engine, [])
    for i, ids in enumerate(prompts):
        rid = f"r{i}"
        done = len(before[rid])
        expected = run_to_completion(reference, [TokenizedRequest(f"x{i}", ids + before[rid], greedy(12 - done))])
        assert 0 < done < 12 and tokens_of(after[rid]) == tokens_of(expected[f"x{i}"])
    engine.check_integrity()
