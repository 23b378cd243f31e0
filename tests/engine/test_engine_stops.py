"""Stop strings, decoded with the real SmolLM2 tokenizer over a tiny random model's output."""

from __future__ import annotations

from typing import Any

import pytest

from ringserve.actors.common.model_source import load_tokenizer, resolve_model
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import FinishReason, SamplingParams, TokenizedRequest
from tests.engine_helpers import (
    engine_for,
    greedy,
    run_to_completion,
    tiny_hf_llama,
    tokens_of,
)

MAX_NEW = 16


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))
    engine = engine_for(tiny_hf_llama(vocab_size=len(tokenizer)), tokenizer)
    prompt = tokenizer.encode("The quick brown fox")
    free_run, _ = run(engine, prompt, greedy(MAX_NEW))
    return {"tokenizer": tokenizer, "engine": engine, "prompt": prompt, "free_run": free_run}


def run(engine: EngineCore, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], FinishReason]:
    rows = run_to_completion(engine, [TokenizedRequest("s", prompt, sampling)])["s"]
    assert rows[-1].finish is not None
    return tokens_of(rows), rows[-1].finish


def first_match(tokenizer: Any, tokens: list[int], stop: str) -> int:
    """Index of the token whose arrival first makes `stop` appear in the decoded output."""
    return next(k for k in range(len(tokens)) if stop in tokenizer.decode(tokens[: k + 1]))


def test_stop_string_spanning_tokens(setup: dict[str, Any]) -> None:
    tokenizer, free_run = setup["tokenizer"], setup["free_run"]
    start = len(tokenizer.decode(free_run[:6])) - 3
    end = len(tokenizer.decode(free_run[:9])) - 2
    stop = tokenizer.decode(free_run)[start:end]  # ends inside token 8, begins inside token 5
    k = first_match(tokenizer, free_run, stop)
    assert all(stop not in tokenizer.decode([t]) for t in free_run), "the stop string must span tokens"

    tokens, finish = run(setup["engine"], setup["prompt"], greedy(MAX_NEW, stop=["never there", stop]))
    assert tokens == free_run[: k + 1]
    assert finish == FinishReason("stop", matched=stop)


def test_stop_string_late_in_a_long_output(setup: dict[str, Any]) -> None:
    # Only the decoded tail is searched; a short stop near the end of 16 tokens must still be found.
    tokenizer, free_run = setup["tokenizer"], setup["free_run"]
    stop = tokenizer.decode(free_run[-1:]).strip()[:2]
    k = first_match(tokenizer, free_run, stop)
    tokens, finish = run(setup["engine"], setup["prompt"], greedy(MAX_NEW, stop=[stop]))
    assert (tokens, finish) == (free_run[: k + 1], FinishReason("stop", matched=stop))


def test_stop_token_wins_over_stop_string_and_absent_stop_gives_length(setup: dict[str, Any]) -> None:
    tokenizer, free_run = setup["tokenizer"], setup["free_run"]
    token = free_run[2]
    text = tokenizer.decode([token]).strip()
    tokens, finish = run(setup["engine"], setup["prompt"], greedy(MAX_NEW, stop=[text], stop_token_ids=[token]))
    assert finish == FinishReason("stop", matched=token) and tokens[-1] == token

    tokens, finish = run(setup["engine"], setup["prompt"], greedy(MAX_NEW, stop=["\x00never"]))
    assert (tokens, finish) == (free_run, FinishReason("length"))
    assert setup["engine"].stats().kv_running_tokens == 0
