"""`POST /v1/tokenize` and `POST /v1/detokenize` against the real ring (the entry asks a tokenizer over NATS):
the ids the model's own tokenizer gives, counts equal to a chat completion's prompt_tokens, a detokenize round
trip, 400s naming the field, and 503 when no tokenizer answers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from ringserve.actors.common.model_source import load_config, load_tokenizer, resolve_model
from ringserve.actors.entry.native.tokenize import tokenize_routes
from ringserve.bus.connection import BusConnection
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.subjects import Subjects
from tests.conftest import DEFAULT_MODEL
from tests.server_helpers import ServerHandle

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def context_length() -> int:
    return int(load_config(resolve_model(DEFAULT_MODEL)).max_position_embeddings)


def post(base: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def test_tokenize_text_gives_the_models_ids(smollm_server: ServerHandle, tokenizer: Any, context_length: int) -> None:
    text = "The quick brown fox jumps over the lazy dog. ünïcödé ✓"
    reply = post(smollm_server.base_url, "/v1/tokenize", {"prompt": text})
    assert reply.status_code == 200, reply.text
    expected = tokenizer.encode(text)
    assert reply.json() == {"tokens": expected, "count": len(expected), "max_model_len": context_length}
    plain = post(smollm_server.base_url, "/v1/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert post(smollm_server.base_url, "/v1/tokenize", {"prompt": ""}).json()["tokens"] == tokenizer.encode("")


def test_tokenize_messages_counts_what_a_chat_completion_uses(smollm_server: ServerHandle, tokenizer: Any) -> None:
    base = smollm_server.base_url
    reply = post(base, "/v1/tokenize", {"messages": MESSAGES})
    assert reply.status_code == 200, reply.text
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert reply.json()["tokens"] == expected and reply.json()["count"] == len(expected)
    chat = post(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == reply.json()["count"]

    bare = post(base, "/v1/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["count"] < reply.json()["count"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    flat = [{"role": "user", "content": "Hello there"}]
    assert (post(base, "/v1/tokenize", {"messages": parts}).json()["tokens"]
            == post(base, "/v1/tokenize", {"messages": flat}).json()["tokens"])


def test_detokenize_round_trips(smollm_server: ServerHandle, tokenizer: Any) -> None:
    base = smollm_server.base_url
    text = "Round trip: naïve café, 42 ✓"
    tokens = post(base, "/v1/tokenize", {"prompt": text}).json()["tokens"]
    reply = post(base, "/v1/detokenize", {"tokens": tokens})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": tokenizer.decode(tokens)} and reply.json()["prompt"].endswith(text)
    chat_ids = post(base, "/v1/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert post(base, "/v1/detokenize", {"tokens": chat_ids}).json()["prompt"] == tokenizer.decode(chat_ids)
    assert post(base, "/v1/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/tokenize", {}, "prompt"),
    ("/v1/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/v1/tokenize", {"prompt": 5}, "prompt"),
    ("/v1/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/v1/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/v1/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/v1/tokenize", {"messages": []}, "messages"),
    ("/v1/tokenize", {"messages": "hi"}, "messages"),
    ("/v1/tokenize", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/tokenize", {"messages": [{"role": "<|im_start|>wizard", "content": "hi"}]}, "messages"),
    ("/v1/tokenize", {"messages": MESSAGES, "add_generation_prompt": 1}, "add_generation_prompt"),
    ("/v1/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ("/v1/detokenize", {}, "tokens"),
    ("/v1/detokenize", {"tokens": "1 2 3"}, "tokens"),
    ("/v1/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/v1/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/v1/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/v1/detokenize", {"tokens": [1, 10_000_000]}, "tokens"),
    ("/v1/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_invalid_bodies_are_400s_naming_the_field(smollm_server: ServerHandle, path: str, body: dict[str, Any],
                                                  param: str) -> None:
    reply = post(smollm_server.base_url, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "invalid_request_error"


def test_another_model_is_a_404(smollm_server: ServerHandle) -> None:
    for path, body in (("/v1/tokenize", {"prompt": "a"}), ("/v1/detokenize", {"tokens": [1]})):
        reply = post(smollm_server.base_url, path, {**body, "model": "not-this-one"})
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
        assert post(smollm_server.base_url, path, {**body, "model": DEFAULT_MODEL}).status_code == 200


def test_a_token_id_past_the_vocabulary_is_refused_by_the_tokenizer(smollm_server: ServerHandle,
                                                                    tokenizer: Any) -> None:
    reply = post(smollm_server.base_url, "/v1/detokenize", {"tokens": [0, len(tokenizer)]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"
    assert str(len(tokenizer)) in reply.json()["error"]["message"]
    ok = post(smollm_server.base_url, "/v1/detokenize", {"tokens": [len(tokenizer) - 1]})
    assert ok.status_code == 200


def test_get_is_not_allowed_and_non_json_is_refused(smollm_server: ServerHandle) -> None:
    assert httpx.get(smollm_server.base_url + "/v1/tokenize", timeout=30).status_code == 405
    reply = httpx.post(smollm_server.base_url + "/v1/tokenize", content=b"{", timeout=30,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400


def test_no_tokenizer_answering_is_a_503(nats_server: EmbeddedNatsServer) -> None:
    """The routes over a namespace nothing serves: the query finds no responder, the entry answers 503."""

    async def run() -> httpx.Response:
        bus = await BusConnection.connect(nats_server.url, "tokenize-test")
        try:
            service = SimpleNamespace(client=SimpleNamespace(bus=bus, subjects=Subjects("nobody_home")),
                                      served_model="m")
            from starlette.applications import Starlette

            app = Starlette(routes=tokenize_routes(service))  # type: ignore[arg-type]
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.post("/v1/tokenize", json={"prompt": "hi"})
        finally:
            await bus.close()

    reply = asyncio.run(run())
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
    assert reply.headers.get("retry-after") == "1"
