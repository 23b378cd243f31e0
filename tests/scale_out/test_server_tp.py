"""Tensor parallelism over HTTP: SmolLM2-135M (9 heads, 3 KV heads) served with `--tp 3` (three scheduler
processes) is one replica with `tp_size` 3 whose greedy tokens equal transformers'; a follower rank killed
mid-stream ends the stream with an error within 5 s, and as the last replica the ring fail-stops leaving no
process behind. With `--dp 2 --tp 2` (a tiny model), a stopped follower's replica fails its requests, is
restarted as a whole, and serves again while the other replica serves on; its ranks 0 draft with a draft
model (`--speculative-algorithm draft`) whose drafts the sharded ranks verify."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.common.model_source import DEFAULT_MODEL
from tests.engine_helpers import assert_greedy_matches, hf_greedy
from tests.server_helpers import ServerHandle, servers_side_by_side, sse_events

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]
MAX_NEW = 12  # the "first dozen tokens": fp32 all-reduces sum in another order than one rank


@pytest.fixture(scope="module")
def rings(tiny_model_dir: Path) -> Iterator[dict[str, ServerHandle]]:
    """Both rings of this module, started side by side: "tp" (SmolLM2, `--tp 3`) and "dp_tp" (the tiny model,
    `--dp 2 --tp 2`)."""
    with servers_side_by_side({
        "tp": (DEFAULT_MODEL, ["--tp", "3", "--torch-threads", "1", "--max-total-tokens", "8192"]),
        # each replica's rank 0 also runs a draft model whole (the tiny model drafting for itself)
        "dp_tp": (str(tiny_model_dir), ["--dp", "2", "--tp", "2", "--torch-threads", "1", "--max-total-tokens",
                                        "4096", "--watchdog-timeout", "5", "--speculative-algorithm", "draft",
                                        "--speculative-draft-model-path", str(tiny_model_dir)]),
    }) as handles:
        yield handles


@pytest.fixture(scope="module")
def tp_server(rings: dict[str, ServerHandle]) -> Iterator[ServerHandle]:
    handle = rings["tp"]
    yield handle
    handle.stop()
    assert handle.live_actors() == [], f"actors left running:\n{handle.log()[-3000:]}"


def _info(server: ServerHandle) -> dict[str, Any]:
    return httpx.get(server.base_url + "/get_server_info", timeout=30).json()


def _stream(server: ServerHandle, started: threading.Event, prompt: str = "Once upon a time") -> tuple[str, float]:
    """Stream a long completion: ("done" | "error" | "cut", when it ended)."""
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    outcome = "cut"
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
            for event in sse_events(response):
                started.set()
                if event == "[DONE]":
                    outcome = "done"
                    break
                if "error" in event:
                    outcome = "error"
                    break
    except httpx.HTTPError:
        pass
    return outcome, time.monotonic()


def test_the_rank_group_is_one_replica(tp_server: ServerHandle) -> None:
    info = _info(tp_server)
    assert [(r["id"], r["tp_size"], r["up"]) for r in info["replicas"]] == [(0, 3, True)], info["replicas"]
    assert {"scheduler0", "scheduler1000", "scheduler2000"} <= set(info["actors"]), info["actors"]


def test_greedy_matches_transformers(tp_server: ServerHandle, smollm_hf: Any) -> None:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    model = smollm_hf
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for text in PROMPTS]

    def generate(ids: list[int]) -> httpx.Response:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
        return httpx.post(tp_server.base_url + "/generate", json=body, timeout=300)

    with ThreadPoolExecutor(len(prompts)) as pool:  # one batch: the group's steps serve all three
        responses = list(pool.map(generate, prompts))
    for ids, response in zip(prompts, responses):
        assert response.status_code == 200, response.text
        got = response.json()["output_ids"]
        assert len(got) == MAX_NEW
        assert_greedy_matches(model, ids, hf_greedy(model, ids, MAX_NEW, None), got)


def test_a_killed_follower_ends_the_stream_and_the_last_replica_fail_stops(tp_server: ServerHandle) -> None:
    """Runs last in this module: the ring is gone afterwards."""
    started = threading.Event()
    result: list[tuple[str, float]] = []
    thread = threading.Thread(target=lambda: result.append(_stream(tp_server, started)))
    thread.start()
    assert started.wait(120)
    time.sleep(0.5)  # mid-stream
    os.kill(tp_server.actor_pids()["scheduler1000"], signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(timeout=60)
    outcome, ended_at = result[0]
    assert outcome == "error", outcome
    assert ended_at - killed_at < 5.0
    assert tp_server.proc.wait(timeout=60) == 1  # fail-stop: it was the only replica
    assert tp_server.live_actors() == [], tp_server.log()[-3000:]
    assert "scheduler1000" in tp_server.log() and "fail-stop" in tp_server.log()


@pytest.fixture(scope="module")
def dp_tp_server(rings: dict[str, ServerHandle]) -> Iterator[ServerHandle]:
    handle = rings["dp_tp"]
    yield handle
    assert handle.stop() == 0
    assert handle.live_actors() == []


def test_dp2_tp2_restarts_a_replica_whose_follower_stopped(dp_tp_server: ServerHandle) -> None:
    info = _info(dp_tp_server)
    assert sorted((r["id"], r["tp_size"]) for r in info["replicas"]) == [(0, 2), (1, 2)]
    pids = dp_tp_server.actor_pids()
    assert {"scheduler0", "scheduler1000", "scheduler1", "scheduler1001"} <= set(pids)
    events = [threading.Event() for _ in range(6)]
    results: list[tuple[str, float]] = []
    threads = [threading.Thread(target=lambda e=e, i=i: results.append(_stream(dp_tp_server, e, f"Tale {i}:")))
               for i, e in enumerate(events)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in events)
    running = {r["id"]: r["num_running_reqs"] for r in _info(dp_tp_server)["replicas"]}
    victim = pids["scheduler1001"]  # replica 1's follower
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        for t in threads:
            t.join(timeout=120)
        errors = [at - stopped_at for outcome, at in results if outcome == "error"]
        assert len(errors) == running[1], (results, running)
        assert max(errors, default=0) < 5.0, errors
        assert [o for o, _ in results].count("done") == len(events) - running[1], results
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both ranks of replica 1 started again, and it serves
            now = dp_tp_server.actor_pids()
            replicas = {r["id"] for r in _info(dp_tp_server)["replicas"] if r["up"]}
            if now["scheduler1"] != pids["scheduler1"] and now["scheduler1001"] != victim and replicas == {0, 1}:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"replica 1 did not come back:\n{dp_tp_server.log()[-3000:]}")
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)  # killed with its group, not resumed
    for i in range(2):
        body = {"prompt": f"After the restart {i}", "max_tokens": 4, "temperature": 0}
        response = httpx.post(dp_tp_server.base_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    info = _info(dp_tp_server)
    assert info["speculative"] == "draft" and info["spec_accepted_tokens"] > 100, info  # replica 0's streams


def test_a_tp_that_does_not_divide_the_heads_is_refused_at_launch() -> None:
    import subprocess
    import sys

    from tests.server_helpers import REPO

    for flags, reason in ((["--tp", "2"], "must divide the model's 9 attention heads"),
                          (["--tp", "3", "--quantization", "gguf"], "--quantization gguf")):
        done = subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--model", DEFAULT_MODEL, *flags],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and reason in done.stderr, done.stderr[-2000:]
