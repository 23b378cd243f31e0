"""The entry's OpenAPI 3.1 document (served at `/openapi.json`): every route, its JSON body with realistic types
and ranges, and its answers. Each API's bodies are described beside it (`openai/schema.py`, `anthropic/schema.py`,
`responses/schema.py`, `native/schema.py`, `ops/schema.py`), their sampling parameters derived from the
declarations in `ringserve.bus.params`. Clients can generate code from it; the bad-input sweep (schemathesis)
fuzzes the server from it.
"""

from __future__ import annotations

import copy
from typing import Any

from ringserve.actors.entry.anthropic import schema as anthropic
from ringserve.actors.entry.anthropic.request import MESSAGES_PATH
from ringserve.actors.entry.native import schema as native
from ringserve.actors.entry.openai import schema as openai
from ringserve.actors.entry.openai.embeddings import EMBEDDINGS_PATH
from ringserve.actors.entry.openapi.parts import JSON
from ringserve.actors.entry.ops import schema as ops
from ringserve.actors.entry.responses import schema as responses
from ringserve.actors.entry.responses.protocol import RESPONSES_PATH

SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}},
    "AnthropicError": anthropic.ERROR,
    "MessagesRequest": anthropic.MESSAGES_REQUEST,
    "ResponsesRequest": responses.RESPONSES_REQUEST,
    "CountTokensRequest": anthropic.COUNT_TOKENS_REQUEST,
    "ChatCompletionRequest": openai.CHAT_COMPLETION_REQUEST,
    "CompletionRequest": openai.COMPLETION_REQUEST,
    "GenerateRequest": native.GENERATE_REQUEST,
    "EmbeddingRequest": openai.EMBEDDING_REQUEST,
    "UpdateWeightsRequest": ops.UPDATE_WEIGHTS_REQUEST,
    "AbortRequest": ops.ABORT_REQUEST,
    "PauseRequest": ops.PAUSE_REQUEST,
    "Empty": {"type": "object", "description": "no fields", "additionalProperties": False},
    "ControlReply": ops.CONTROL_REPLY,
    "Object": {"type": "object"},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _answers(ok: str, *errors: int, stream: bool = False, error: str = "Error") -> dict[str, Any]:
    content: dict[str, Any] = {JSON: {"schema": _ref(ok)}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out: dict[str, Any] = {"200": {"description": "success", "content": content}}
    for status in errors:
        out[str(status)] = {"description": _ERROR_TEXT[status], "content": {JSON: {"schema": _ref(error)}}}
    return out


_ERROR_TEXT = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
               408: "the body did not arrive in time", 413: "request body too large",
               415: "the body is not JSON (state-changing routes need Content-Type: application/json)",
               421: "the Host header names a host not served here", 499: "the client went away",
               409: "another weight update is in progress",
               500: "the scheduler refused the command", 503: "busy (Retry-After) or the ring is not serving"}
_BODY_ERRORS = (400, 401, 408, 413, 415, 421, 503)
_ONE_RESPONSE = RESPONSES_PATH + "/{response_id}"


def _post(summary: str, body: str, ok: str, *errors: int, stream: bool = False, required: bool = True,
          error: str = "Error") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": _answers(ok, *errors, stream=stream, error=error)}
    op["requestBody"] = {"required": required, "content": {JSON: {"schema": _ref(body)}}}
    return {"post": op}


def _get(summary: str, ok: str, *errors: int, public: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": _answers(ok, *errors)}
    if public:
        op["security"] = []
    return {"get": op}


def openapi_document(served_model: str | None = None) -> dict[str, Any]:
    """A fresh copy of the OpenAPI 3.1 document of the entry's HTTP API (`model` limited to `served_model`)."""
    paths = {
        "/v1/chat/completions": _post("OpenAI chat completion", "ChatCompletionRequest", "Object", *_BODY_ERRORS,
                                      404, stream=True),
        "/v1/completions": _post("OpenAI completion", "CompletionRequest", "Object", *_BODY_ERRORS, 404,
                                 stream=True),
        MESSAGES_PATH: _post("Anthropic Messages", "MessagesRequest", "Object", *_BODY_ERRORS, 404, stream=True,
                             error="AnthropicError"),
        MESSAGES_PATH + "/count_tokens": _post(
            "Anthropic token count: the input tokens the same Messages body would send", "CountTokensRequest",
            "Object", *_BODY_ERRORS, 404, error="AnthropicError"),
        RESPONSES_PATH: _post("OpenAI Responses: create (whole, streamed, or in the background)",
                              "ResponsesRequest", "Object", *_BODY_ERRORS, 404, stream=True),
        _ONE_RESPONSE: {**_get("a stored response", "Object", 401, 404, 503),
                        "delete": {"summary": "delete a stored response", "responses": _answers("Object", 401, 404,
                                                                                                 503)}},
        _ONE_RESPONSE + "/cancel": _post("cancel a running (background or streamed) response", "Empty", "Object",
                                         400, 401, 404, 503, required=False),
        _ONE_RESPONSE + "/input_items": _get("the input items of a stored response", "Object", 400, 401, 404, 503),
        "/v1/models": _get("the served model and its LoRA adapters", "Object", 401, 503),
        "/v1/models/{model}": _get("the served model's card; 404 for any other id", "Object", 401, 404, 503),
        EMBEDDINGS_PATH: _post("OpenAI embeddings: the served model's pooled final-norm hidden states",
                               "EmbeddingRequest", "Object", *_BODY_ERRORS, 404),
        "/generate": _post("native generation", "GenerateRequest", "Object", *_BODY_ERRORS, stream=True),
        "/health": _get("200 while every role heartbeats", "Object", 503, public=True),
        "/health_generate": _get("one token through the whole ring", "Object", 401, 503),
        "/get_server_info": _get("scheduler load, entry counters, actors", "Object", 401, 503),
        "/get_model_info": _get("SGLang's model info: model_path, tokenizer_path, is_generation; "
                                "default_sampling_params (generation_config.json) and reasoning_parser",
                                "Object", 401, 503),
        "/v1/tokenize": _post("token ids of a prompt or chat messages", "Object", "Object", *_BODY_ERRORS, 404),
        "/v1/detokenize": _post("text of token ids", "Object", "Object", *_BODY_ERRORS, 404),
        "/flush_cache": _post("drop cached prefixes no request uses", "Empty", "ControlReply", *_BODY_ERRORS, 500,
                              required=False),
        "/abort_request": _post("abort one request or all", "AbortRequest", "Object", *_BODY_ERRORS, 500),
        "/pause_generation": _post("stop stepping", "PauseRequest", "ControlReply", *_BODY_ERRORS, 500, required=False),
        "/continue_generation": _post("resume stepping", "Empty", "ControlReply", *_BODY_ERRORS, 500,
                                      required=False),
        "/update_weights_from_disk": _post("swap in a checkpoint of the same architecture; flushes the prefix cache",
                                           "UpdateWeightsRequest", "ControlReply", *_BODY_ERRORS, 409, 500),
        "/v1/load_lora_adapter": _post("serve a PEFT LoRA adapter as a model (lora_name, lora_path)", "Object",
                                       "ControlReply", *_BODY_ERRORS, 404, 500),
        "/v1/unload_lora_adapter": _post("stop serving a LoRA adapter (lora_name)", "Object", "ControlReply",
                                         *_BODY_ERRORS, 404, 409, 500),
        "/openapi.json": _get("this document", "Object", public=True),
        "/metrics": {"get": {"summary": "Prometheus metrics", "security": [], "responses": {"200": {
            "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    doc = copy.deepcopy({
        "openapi": "3.1.0",
        "info": {"title": "ringserve", "version": "0.1.0",
                 "description": "OpenAI-compatible and native LLM serving over a NATS request ring"},
        "paths": paths,
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "the key in RINGSERVE_API_KEY, if set"},
                                           "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                                         "description": "the same key, as Anthropic's clients "
                                                                        "send it"}}},
        "security": [{"bearer": []}, {"x-api-key": []}],
    })
    doc["paths"]["/v1/models/{model}"]["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    for path in (_ONE_RESPONSE, _ONE_RESPONSE + "/cancel", _ONE_RESPONSE + "/input_items"):
        doc["paths"][path]["parameters"] = [
            {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    if served_model:
        for name in ("ChatCompletionRequest", "CompletionRequest", "MessagesRequest", "EmbeddingRequest",
                     "ResponsesRequest"):
            doc["components"]["schemas"][name]["properties"]["model"]["enum"] = [served_model]
    return doc
