"""`ringserve.Engine` end to end: a real ring of SmolLM2-135M-Instruct started from Python (embedded NATS, scheduler,
tokenizer and detokenizer processes, no HTTP), compared with the HTTP server's `/generate` and chat answers for
the same greedy inputs; a 500-prompt batch through continuous batching; the stream and async forms; and
shutdown leaving no process behind, also when the caller is interrupted or killed."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

import ringserve
from tests.server_helpers import REPO, ServerHandle, process_alive, wait_for

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"max_new_tokens": 12, "temperature": 0}
PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[ringserve.Engine]:
    """The Engine, started as `ringserve serve` would start the same model (same default flags)."""
    with ringserve.Engine(model=MODEL, grammar_warm_up=False) as started:  # no warm compile workers (~200 MB)
        pids = started.pids()
        yield started
    assert set(pids) == {"scheduler0", "tokenizer0", "detokenizer0", "nats-server"}
    assert [name for name, pid in pids.items() if process_alive(pid)] == [], "shutdown left processes running"


def http_generate(server: ServerHandle, body: dict[str, Any]) -> Any:
    reply = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def same_result(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Equal but for the rid and the prefix-cache hits (each ring has its own cache); logprobs to 1e-4."""
    assert (ours["text"], ours["output_ids"]) == (theirs["text"], theirs["output_ids"])
    a, b = dict(ours["meta_info"]), dict(theirs["meta_info"])
    assert a.keys() == b.keys()
    for key in ("id", "cached_tokens", "output_token_logprobs", "output_top_logprobs"):
        a.pop(key, None), b.pop(key, None)
    assert a == b
    for mine, http in zip(ours["meta_info"].get("output_token_logprobs", []),
                          theirs["meta_info"].get("output_token_logprobs", [])):
        assert mine[1:] == http[1:] and math.isclose(mine[0], http[0], abs_tol=1e-4)


def test_results_equal_http_generate_for_a_list_token_ids_and_chat(engine: ringserve.Engine,
                                                                    smollm_server: ServerHandle) -> None:
    ours = engine.generate(PROMPTS, GREEDY)
    theirs = http_generate(smollm_server, {"text": PROMPTS, "sampling_params": GREEDY})
    assert len(ours) == len(theirs) == 3
    for mine, http in zip(ours, theirs):
        same_result(mine.to_dict(), http)
        assert mine.finish_reason == http["meta_info"]["finish_reason"] and mine["text"] == mine.text

    ids = httpx.post(smollm_server.base_url + "/v1/tokenize", json={"prompt": PROMPTS[0]}, timeout=30).json()["tokens"]
    with_logprobs = {**GREEDY, "return_prompt_ids": True}
    one = engine.generate(input_ids=ids, sampling_params=with_logprobs, return_logprob=True, top_logprobs_num=2)
    http = http_generate(smollm_server, {"input_ids": ids, "sampling_params": with_logprobs, "return_logprob": True,
                                         "top_logprobs_num": 2})
    same_result(one.to_dict(), http)
    assert one.meta_info["prompt_token_ids"] == ids and len(one.meta_info["output_top_logprobs"][0]) == 2

    chat = engine.chat(CHAT, max_tokens=12, temperature=0)
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    answer = httpx.post(smollm_server.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    assert chat.message == answer["choices"][0]["message"] and chat.text == answer["choices"][0]["message"]["content"]
    assert chat.response["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
    assert chat.response["choices"][0]["finish_reason"] == answer["choices"][0]["finish_reason"]

    with pytest.raises(ringserve.ApiError) as refused:  # the HTTP API's error, same message and parameter
        engine.generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": -1})
    http_error = httpx.post(smollm_server.base_url + "/generate", timeout=30, json={
        "text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": -1}}).json()["error"]
    assert (refused.value.code, refused.value.param, refused.value.message) == (
        http_error["code"], http_error["param"], http_error["message"])


def test_a_500_prompt_batch_runs_batched_and_returns_in_order(engine: ringserve.Engine,
                                                             smollm_server: ServerHandle) -> None:
    prompts = [[1, 100 + i % 97, 2000 + i] for i in range(500)]  # distinct token-id prompts
    sampling = {"max_new_tokens": 2, "temperature": 0, "return_prompt_ids": True}
    running: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            running.append(engine.get_server_info()["num_running_reqs"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = engine.generate(input_ids=prompts, sampling_params=sampling, progress=False)
    finally:
        done.set()
        watcher.join()
    assert [r.meta_info["prompt_token_ids"] for r in results] == prompts
    assert all(r.meta_info["completion_tokens"] == 2 for r in results)
    assert max(running) > 1, f"the batch ran one request at a time: {running}"
    http = http_generate(smollm_server, {"input_ids": prompts[:8], "sampling_params": sampling})
    assert [r.output_ids for r in results[:8]] == [h["output_ids"] for h in http]


def test_stream_and_async_forms(engine: ringserve.Engine) -> None:
    whole = engine.generate(PROMPTS[0], GREEDY)
    deltas = list(engine.generate(PROMPTS[0], GREEDY, stream=True))
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.output_ids] == whole.output_ids
    assert deltas[-1].finished and not deltas[0].finished or len(deltas) == 1
    assert deltas[-1].meta_info["finish_reason"] == whole.finish_reason

    listed = list(engine.generate(PROMPTS, GREEDY, stream=True))
    texts = ["".join(d.text for d in listed if d.index == i) for i in range(3)]
    assert texts == [r.text for r in engine.generate(PROMPTS, GREEDY)]

    async def use_from_another_loop() -> tuple[Any, list[Any], list[Any], Any]:
        one = await engine.async_generate(PROMPTS[0], GREEDY)
        pieces = [d async for d in engine.async_generate(PROMPTS[0], GREEDY, stream=True)]
        awaited = await engine.async_generate(PROMPTS[1], GREEDY, stream=True)  # SGLang's form
        more = [d async for d in awaited]
        chat = await engine.async_chat(CHAT, max_tokens=6, temperature=0)
        return one, pieces, more, chat

    one, pieces, more, chat = asyncio.run(use_from_another_loop())
    assert one.output_ids == whole.output_ids and "".join(d.text for d in pieces) == whole.text
    assert "".join(d.text for d in more) == engine.generate(PROMPTS[1], GREEDY).text
    assert chat.text == engine.chat(CHAT, max_tokens=6, temperature=0).text

    long = engine.generate(PROMPTS[0], {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
    next(long)
    long.close()  # closing the stream early aborts the request
    deadline = time.monotonic() + 10
    while engine.get_server_info()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get_server_info()["num_running_reqs"] == 0


SCRIPT = """
import json, signal, sys, time
import ringserve
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even when launched in the background
engine = ringserve.Engine(model=sys.argv[1], grammar_warm_up=False)
print(json.dumps(engine.pids()), flush=True)
while True:  # interrupted in a generate, however fast the machine makes each one
    engine.generate(["a", "b", "c"], {"max_new_tokens": 3000, "ignore_eos": True})
"""


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_no_process_is_left_behind_when_the_caller_is_interrupted_or_killed(tiny_model_dir: Path,
                                                                           how: signal.Signals) -> None:
    """Ctrl-C in `generate` (no `with`, no `shutdown()`: the exit handler stops the ring), or the caller killed
    (its children get SIGTERM from the kernel)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline() or "{}")  # type: ignore[union-attr]
        assert set(pids) == {"scheduler0", "tokenizer0", "detokenizer0", "nats-server"}, proc.stderr.read()
        time.sleep(0.5)  # the script is generating now
        proc.send_signal(how)
        proc.wait(timeout=60)
        wait_for(lambda: not any(process_alive(pid) for pid in pids.values()), 20)
        assert [name for name, pid in pids.items() if process_alive(pid)] == []
        if how == signal.SIGINT:
            assert "KeyboardInterrupt" in (proc.stderr.read() or "")  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_operator_commands_reach_every_replica(tiny_model_dir: Path) -> None:
    """With `dp=2` the Python Engine's info and commands go to both replicas and combine their answers, as the
    HTTP routes do: both listed, the cache of both flushed, the load counters summed."""
    prompts = [f"{word} " * 70 for word in ("alpha", "beta", "gamma", "delta")]  # four distinct 64-token blocks
    with ringserve.Engine(model=str(tiny_model_dir), dp=2, grammar_warm_up=False) as engine:
        engine.generate(prompts, {"max_new_tokens": 2, "temperature": 0})
        info = engine.get_server_info()
        assert sorted(r["id"] for r in info["replicas"]) == [0, 1]
        assert info["requests_routed"] == sum(r["requests_routed"] for r in info["replicas"]) >= 4
        cached = sum(r["kv_used_tokens"] for r in info["replicas"])
        flushed = engine.flush_cache()
        assert flushed["success"] and flushed["freed_tokens"] == cached > 0, (flushed, info["replicas"])
        assert all(r["kv_used_tokens"] == 0 for r in engine.get_server_info()["replicas"])
