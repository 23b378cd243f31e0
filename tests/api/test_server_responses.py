"""OpenAI's Responses API (`/v1/responses`) with the official `openai` client against the real ring (SmolLM2,
greedy): create, streamed events (their deltas are the non-streamed text), retrieve, delete, a conversation
continued with previous_response_id on another entry replica (the store is the bus's key-value bucket), a forced
function call and its output, json_schema output, cancelling a background response, a stored response
surviving its entry's death, another API key seeing none of it, and errors naming the field."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
from typing import Any, Iterator
from unittest import mock

import openai
import pytest

from ringserve.actors.launcher.nats_auth import generate_auth
from ringserve.bus.connection import BusConnection
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.permissions import inbox_prefix
from ringserve.bus.response_store import ResponseStore
from tests.server_helpers import ServerHandle, free_port
from tests.scale_out.test_workers import Worker, start_worker, wait_healthy, wait_ready

MODEL = "SmolLM2-135M-Instruct"
KEY_B, KEY_C = ("sk-b-" + secrets.token_hex(8)), ("sk-c-" + secrets.token_hex(8))
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


def greedy(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, **{"max_output_tokens": 12, **fields})


class Entries:
    """Keyed entry workers on the session ring's namespace, started on demand (a key each)."""

    def __init__(self, server: ServerHandle) -> None:
        self.server = server
        self.workers: list[Worker] = []

    def start(self, key: str) -> tuple[Worker, openai.OpenAI]:
        port = free_port()
        with mock.patch.dict(os.environ, {"RINGSERVE_API_KEY": key}):
            worker = start_worker(self.server.nats_url, self.server.namespace, "entry", "--port", str(port),
                                  "--served-model-name", MODEL)
        self.workers.append(worker)
        wait_ready(worker)
        wait_healthy(f"http://127.0.0.1:{port}")
        return worker, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def entries(smollm_server: ServerHandle) -> Iterator[Entries]:
    made = Entries(smollm_server)
    yield made
    for worker in made.workers:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
            worker.exited(timeout=30)


def test_create_stream_retrieve_delete(client: openai.OpenAI) -> None:
    whole = greedy(client, input="Name three colours.", instructions="Answer briefly.")
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.output_text
    assert whole.status in ("completed", "incomplete") and whole.output[0].type == "message"
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 12
    events = list(greedy(client, input="Name three colours.", instructions="Answer briefly.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    assert [i.content[0].text for i in client.responses.input_items.list(whole.id).data] == ["Name three colours."]
    client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)


def test_a_conversation_continues_on_another_entry(client: openai.OpenAI, entries: Entries) -> None:
    first = greedy(client, input="My name is Ada. Say hi.")
    _, other = entries.start(KEY_B)
    second = greedy(other, input="What is my name?", previous_response_id=first.id)
    replay = greedy(client, input=[{"role": "user", "content": "My name is Ada. Say hi."},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "What is my name?"}])
    assert second.output_text == replay.output_text and second.usage.input_tokens == replay.usage.input_tokens
    assert second.previous_response_id == first.id


def test_forced_function_call_then_its_output(client: openai.OpenAI) -> None:
    choice = {"type": "function", "name": "get_weather"}
    called = greedy(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice,
                    max_output_tokens=40)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)
    events = list(greedy(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice,
                         max_output_tokens=40, stream=True))
    kinds = {e.type for e in events}
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments
    answer = greedy(client, previous_response_id=called.id, tools=[WEATHER],
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees, sunny"}])
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens > called.usage.input_tokens


def test_json_schema_output(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    reply = greedy(client, input="Give a colour as JSON.", max_output_tokens=40,
                   text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}})
    assert set(json.loads(reply.output_text)) == {"colour"}


def test_cancel_a_background_response(client: openai.OpenAI) -> None:
    many = {"type": "array", "minItems": 400, "items": {"type": "integer"}}  # far longer than the test
    queued = greedy(client, input="List numbers.", background=True, max_output_tokens=1500,
                    text={"format": {"type": "json_schema", "name": "numbers", "schema": many}})
    assert queued.status == "queued"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(queued.id)


def test_cancel_a_streaming_response_from_another_entry(client: openai.OpenAI, entries: Entries) -> None:
    many = {"type": "array", "minItems": 400, "items": {"type": "integer"}}
    _, other = entries.start(KEY_B)  # the stream was made without a key: any entry may cancel it
    events = greedy(client, input="List numbers.", stream=True, max_output_tokens=1500,
                    text={"format": {"type": "json_schema", "name": "numbers", "schema": many}})
    created = next(iter(events))
    assert created.type == "response.created"
    assert other.responses.cancel(created.response.id).status == "cancelled"
    last = list(events)[-1]
    assert last.type == "response.failed" and last.response.status == "cancelled"
    assert client.responses.retrieve(created.response.id).status == "cancelled"


def test_stored_response_survives_its_entry_and_is_its_keys_alone(client: openai.OpenAI, entries: Entries) -> None:
    worker, keyed = entries.start(KEY_B)
    made = greedy(keyed, input="Say yes.")
    worker.proc.kill()
    worker.exited(timeout=30)
    _, again = entries.start(KEY_B)  # a new entry process: the response is on the bus
    assert again.responses.retrieve(made.id).output_text == made.output_text
    _, stranger = entries.start(KEY_C)
    for outsider in (stranger, client):
        with pytest.raises(openai.NotFoundError):
            outsider.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            greedy(outsider, input="And?", previous_response_id=made.id)


@pytest.mark.parametrize(("fields", "param"), [
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True, "store": False}, "background"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"previous_response_id": "resp_nothing"}, "previous_response_id"),
])
def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        greedy(client, **{"input": "hi", **fields})
    assert caught.value.status_code == (404 if param == "previous_response_id" else 400)
    assert caught.value.param == param and param in caught.value.message


def test_a_prompt_longer_than_the_context_names_input(client: openai.OpenAI) -> None:
    """The tokenizer names a chat prompt that does not fit `messages`; a Responses body's prompt is `input`."""
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(client, input="hi " * 10_000)
    assert caught.value.param == "input" and "context length" in caught.value.message


def test_the_entry_user_keeps_responses_and_a_full_bucket_drops_the_oldest(tmp_path: Any) -> None:
    namespace = f"r{secrets.token_hex(5)}"
    auth = generate_auth(namespace, tmp_path / "creds")

    async def run(url: str) -> None:
        bus = await BusConnection.connect(url, "entry", credentials=auth.credentials("entry"),
                                          inbox_prefix=inbox_prefix(namespace, "entry"))
        try:
            store = ResponseStore(lambda: bus.client, namespace, ttl=60, max_bytes=1024 * 1024)
            for i in range(12):  # 12 records of 100 kB: the first ones go
                await store.put({"id": f"resp_{i}", "pad": "x" * 100_000})
            assert await store.get("resp_0") is None and (await store.get("resp_11"))["pad"]
            await store.delete("resp_11")
            assert await store.get("resp_11") is None
        finally:
            await bus.close()

    with EmbeddedNatsServer(extra_config=auth.authorization()) as nats:
        asyncio.run(run(nats.url))
