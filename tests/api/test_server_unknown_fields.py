"""No route silently ignores a body field it does not know, against the real ring (SmolLM2): SGLang's `/generate`
and the operator routes answer an unknown field, or one of SGLang's fields they do not implement, with a 400 in
OpenAI's error shape naming it; a refused field with its neutral value (or null) passes. The OpenAI, Anthropic,
Responses, embeddings and tokenize routes have their own tests of this (test_server_openai_conformance.py,
test_server_messages.py, test_server_responses.py, test_server_embeddings.py, test_server_tokenize.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from ringserve.actors.entry.native import generate
from ringserve.actors.entry.ops import control
from ringserve.actors.entry.openapi.document import openapi_document
from tests.server_helpers import ServerHandle

PROMPT = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def refused(reply: httpx.Response, field: str) -> dict[str, Any]:
    """The 400's OpenAI-shaped error, checked to name `field`."""
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400, error
    assert error["param"] == field and field in error["message"], error
    return error


@pytest.mark.parametrize("field, value, says", [
    ("bogus", 1, "Unrecognized request argument supplied: bogus"),
    ("max_new_tokens", 3, "Unrecognized request argument"),  # a sampling parameter belongs in sampling_params
    ("lora_path", "adapter", "sampling_params.lora_name"),
    ("session_params", {"id": "s"}, "sessions are not supported"),
    ("custom_logit_processor", "x", "not supported"),
    ("return_hidden_states", True, "hidden states"),
    ("return_text_in_logprobs", False, "always carry the token's text"),
    ("bootstrap_host", "10.0.0.1", "disaggregation"),
])
def test_generate_refuses_a_field_it_does_not_honour(smollm_server: ServerHandle, field: str, value: Any,
                                                    says: str) -> None:
    for stream in (False, True):
        reply = httpx.post(smollm_server.base_url + "/generate", json={**PROMPT, "stream": stream, field: value},
                           timeout=60)
        assert says in refused(reply, field)["message"]


def test_generate_takes_neutral_values_and_refuses_unknown_sampling_keys(smollm_server: ServerHandle) -> None:
    base = smollm_server.base_url
    neutral = {**PROMPT, "return_text_in_logprobs": True, "return_hidden_states": False, "lora_path": None,
               "return_logprob": True}
    result = httpx.post(base + "/generate", json=neutral, timeout=60).json()
    assert result["meta_info"]["completion_tokens"] == 2
    assert all(isinstance(entry[2], str) for entry in result["meta_info"]["output_token_logprobs"])
    body = {**PROMPT, "sampling_params": {"max_new_tokens": 2, "spaces_between_special_tokens": False}}
    refused(httpx.post(base + "/generate", json=body, timeout=60), "spaces_between_special_tokens")
    with httpx.stream("POST", base + "/generate", json={**body, "stream": True}, timeout=60) as reply:
        reply.read()
        refused(reply, "spaces_between_special_tokens")


def test_operator_routes_refuse_fields_they_do_not_take(smollm_server: ServerHandle) -> None:
    base = smollm_server.base_url
    for path in ("/flush_cache", "/continue_generation", "/pause_generation"):
        assert "takes no fields" in refused(httpx.post(base + path, json={"bogus": 1}, timeout=60), "bogus")["message"]
    assert "in_place" in refused(httpx.post(base + "/pause_generation", json={"mode": "abort"}, timeout=60),
                                 "mode")["message"]
    refused(httpx.post(base + "/abort_request", json={"rid": "r1", "abort_message": "x"}, timeout=60),
            "abort_message")
    update = {"model_path": "/no/such/checkpoint"}
    for field, value in (("load_format", "dummy"), ("flush_cache", False), ("keep_pause", True)):
        refused(httpx.post(base + "/update_weights_from_disk", json={**update, field: value}, timeout=60), field)
    # the neutral values pass on to the route's own checks
    reply = httpx.post(base + "/update_weights_from_disk", json={**update, "load_format": "auto", "flush_cache": True},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] != "load_format", reply.text
    try:
        assert httpx.post(base + "/pause_generation", json={"mode": "in_place"}, timeout=60).json()["success"]
    finally:
        assert httpx.post(base + "/continue_generation", json={}, timeout=60).json()["success"]
    assert httpx.post(base + "/generate", json=PROMPT, timeout=60).json()["meta_info"]["completion_tokens"] == 2


def test_the_accepted_fields_are_described_once() -> None:
    """The OpenAPI bodies take exactly the fields the routes read, and docs/api.md names each refused field."""
    schemas = openapi_document()["components"]["schemas"]
    generate_schema = schemas["GenerateRequest"]
    assert set(generate_schema["properties"]) == generate.FIELDS and generate_schema["additionalProperties"] is False
    assert set(schemas["AbortRequest"]["properties"]) == set(control.ABORT_FIELDS)
    assert set(schemas["UpdateWeightsRequest"]["properties"]) == (set(control.UPDATE_WEIGHTS_FIELDS)
                                                                  | set(control.UPDATE_WEIGHTS_REFUSED))
    docs = DOCS.read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `POST /generate` |"))
    for name in (*generate.FIELDS, *generate.REFUSED):
        assert re.search(rf"[`\"]{name}[`\"]", row), name


def test_count_tokens_and_cancel_check_their_fields_as_their_routes_do(smollm_server: ServerHandle) -> None:
    """count_tokens takes what Messages takes without effect (a null field is absent only if known); a
    Responses cancel takes no body fields."""
    count = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
    path = smollm_server.base_url + "/v1/messages/count_tokens"
    reply = httpx.post(path, json={**count, "thinking": {"type": "disabled"}}, timeout=60)
    assert reply.status_code == 200 and reply.json()["input_tokens"] > 0, reply.text
    reply = httpx.post(path, json={**count, "bogus": None}, timeout=60)
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    error = {"type": "invalid_request_error", "message": "bogus: Extra inputs are not permitted"}
    assert reply.json()["error"] == error, reply.text
    cancel = smollm_server.base_url + "/v1/responses/resp_0123/cancel"
    refusal = refused(httpx.post(cancel, json={"bogus": 1}, timeout=60), "bogus")
    assert refusal["message"] == "Unknown parameter: 'bogus'."
    assert httpx.post(cancel, json={}, timeout=60).status_code == 404  # no such response: the route's own check
