"""The entry's OpenAPI 3 document (served at `/openapi.json`): every route, its JSON body with realistic types
and ranges, and its answers. The sampling parameters' schemas derive from their declarations in `ringserve.bus.params`;
the entry's own fields (`n`, `stream`, the OpenAI logprobs switches) are written here. Clients can generate
code from it; the bad-input sweep (schemathesis) fuzzes the server from it.
"""

from __future__ import annotations

import copy
from typing import Any

from ringserve.actors.entry.anthropic import request as anthropic
from ringserve.actors.entry.responses import protocol as responses
from ringserve.actors.entry.openai.protocol import (BEST_OF, CHAT_LOGPROBS, COMPLETION_LOGPROBS, CONTINUOUS_USAGE, ECHO,
                                         MAX_CHOICES, N, NO_EFFECT, PROMPT_LOGPROBS, REFUSED, STREAM,
                                         STREAM_OPTIONS_NO_EFFECT, TOKENS_AS_IDS, TOP_LOGPROBS, Refused)
from ringserve.actors.entry.ops.control import PAUSE_REFUSED, UPDATE_WEIGHTS_REFUSED
from ringserve.actors.entry.openai.embeddings import DIMENSIONS, EMBEDDINGS_PATH, ENCODING_FORMAT, USER
from ringserve.actors.entry.template_switches import CHAT_TEMPLATE_KWARGS, REASONING_EFFORT
from ringserve.bus.params import EMBED_SPECS, PROCESSOR_KWARGS, PROCESSOR_SPECS, SPECS

JSON = "application/json"
RID = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_BOOL = {"type": "boolean"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

# sampling parameters under their native (/generate) names, and under the names OpenAI bodies use
_NATIVE_SAMPLING = {name: spec.json_schema() for name, spec in SPECS.items()}
_OPENAI_SAMPLING = {alias: spec.json_schema() for spec in SPECS.values()
                    for alias in (spec.openai if spec.openai is not None else (spec.name,))}
_OPENAI_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "must be the served model's id if given"},
    "n": N.json_schema(),
    "stream": STREAM.json_schema(),
    "stream_options": {"type": "object", "description": "only with stream: true", "properties": {
        "include_usage": _BOOL,
        "continuous_usage_stats": CONTINUOUS_USAGE.json_schema(),
        **{name: {"description": f"accepted, no effect ({what})"} for name, what in STREAM_OPTIONS_NO_EFFECT.items()}},
        "additionalProperties": False},
    **_OPENAI_SAMPLING,
    "response_format": {"description": "constrain the output: text (none), json_object, or json_schema", "oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"enum": ["json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "description": {"type": "string"},
                "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}]},
    "guided_json": {"description": "vLLM's: a JSON schema (object or string) the output must match",
                    "oneOf": [{"type": "object"}, {"type": "string", "minLength": 1}]},
    "guided_regex": {"type": "string", "minLength": 1, "description": "vLLM's: a regex the output must match"},
    "guided_grammar": {"type": "string", "minLength": 1, "description": "vLLM's: an EBNF grammar for the output"},
    "guided_choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1},
                      "description": "vLLM's: the output is one of these strings"},
    "regex": {"type": "string", "minLength": 1, "description": "SGLang's: a regex the output must match"},
    "grammar": {"type": "string", "minLength": 1,
                "description": "llama.cpp's: a GBNF grammar for the output (xgrammar's dialect, start rule root)"},
    "return_tokens_as_token_ids": TOKENS_AS_IDS.json_schema(),
    "prompt_logprobs": PROMPT_LOGPROBS.json_schema(),
    # accepted and ignored; the refused fields (openai/protocol.py REFUSED) and unknown ones are a 400
    **{name: {"description": f"accepted, no effect ({what})"} for name, what in NO_EFFECT.items()},
}
# the chat template's switches (actors/entry/template_switches.py), on every chat-shaped body
_TEMPLATE_KWARGS = {CHAT_TEMPLATE_KWARGS.name: CHAT_TEMPLATE_KWARGS.json_schema()}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_IMAGE_URL_PART = {"type": "object", "required": ["type", "image_url"], "properties": {
    "type": {"type": "string", "enum": ["image_url"]},
    "image_url": {"type": "object", "required": ["url"], "properties": {
        "url": {"type": "string", "description": "a data URL; a file URL under --allowed-local-media-path; an "
                                                 "http(s) URL with --allow-remote-images"},
        "detail": {"type": "string", "enum": ["auto"]}}}}}
def _neutral_only(refused: dict[str, Refused]) -> dict[str, Any]:
    """Schemas of SGLang's fields taken only with the value that changes nothing here."""
    return {name: {"enum": list(r.neutral), "description": f"SGLang's, only with this value ({r.reason})"}
            for name, r in refused.items()}


_IMAGE_SOURCE = {"type": "string", "description": "base64 or a data URL (file and http(s) URLs as image_url takes "
                                                  "them)"}
_FUNCTION_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": _FUNCTION_NAME, "arguments": {"type": "string"}}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_-]{0,31}$",
             "description": "system, developer, user, assistant, tool, or a custom role the chat template knows"},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [_TEXT_PART, _IMAGE_URL_PART]}},
                          {"type": "null"}]},
    "name": {"type": "string"},
    "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "an assistant turn's calls"},
    "tool_call_id": {"type": "string", "description": "a tool turn: the call it answers"}}}
_CACHE_HINT = {"type": "object", "description": "accepted, no effect (the prefix cache is automatic)"}
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["text"]}, "text": {"type": "string"}, "cache_control": _CACHE_HINT}}
_BLOCK = {"oneOf": [_TEXT_BLOCK, {
    "type": "object", "required": ["type", "id", "name", "input"], "description": "assistant turns only",
    "properties": {"type": {"enum": ["tool_use"]}, "id": {"type": "string"}, "name": _FUNCTION_NAME,
                   "input": {"type": "object"}, "cache_control": _CACHE_HINT}}, {
    "type": "object", "required": ["type", "tool_use_id"], "description": "user turns only",
    "properties": {"type": {"enum": ["tool_result"]}, "tool_use_id": {"type": "string"},
                   "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
                   "is_error": _BOOL, "cache_control": _CACHE_HINT}}, {
    "type": "object", "required": ["type", "thinking"], "description": "assistant turns only: earlier thinking "
                                                                       "(the turn's reasoning_content)",
    "properties": {"type": {"enum": ["thinking"]}, "thinking": {"type": "string"}, "signature": {"type": "string"},
                   "cache_control": _CACHE_HINT}}, {
    "type": "object", "required": ["type", "data"], "description": "assistant turns only (accepted, left out)",
    "properties": {"type": {"enum": ["redacted_thinking"]}, "data": {"type": "string"},
                   "cache_control": _CACHE_HINT}}, {
    "type": "object", "required": ["type", "source"], "description": "user turns of a vision-language model only",
    "properties": {"type": {"enum": ["image"]}, "cache_control": _CACHE_HINT, "source": {"oneOf": [
        {"type": "object", "required": ["type", "media_type", "data"], "properties": {
            "type": {"enum": ["base64"]}, "media_type": {"type": "string"}, "data": {"type": "string"}}},
        {"type": "object", "required": ["type", "url"], "properties": {
            "type": {"enum": ["url"]}, "url": {"type": "string"}}}]}}}]}
_ANTHROPIC_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}}}
_MESSAGES_REQUEST = {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
    "model": {"type": "string", "description": "the served model's id"},
    "messages": {"type": "array", "minItems": 1, "items": _ANTHROPIC_MESSAGE},
    "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
    **{name: spec.json_schema() for name, (_, spec) in anthropic.SAMPLING.items()},
    "stream": STREAM.json_schema(),
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
        "type": {"enum": ["custom"]}, "name": _FUNCTION_NAME, "description": {"type": "string"},
        "input_schema": {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["object"]}}},
        "cache_control": _CACHE_HINT}}},
    "tool_choice": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": [*anthropic.TOOL_CHOICES, "tool"]}, "name": _FUNCTION_NAME,
        "disable_parallel_tool_use": _BOOL}},
    anthropic.THINKING: {"description": "a reasoning model's thinking: enabled (the template's enable_thinking true, "
                                        "with a token budget; the answer opens with a thinking block), disabled "
                                        "(enable_thinking false), adaptive (the template's default, thinking "
                                        "returned); absent: the template's default, thinking not returned",
                         "oneOf": [
        {"type": "object", "required": ["type", "budget_tokens"], "additionalProperties": False, "properties": {
            "type": {"enum": ["enabled"]}, "budget_tokens": anthropic.BUDGET.json_schema(),
            "display": {"enum": [d for d in anthropic.DISPLAYS if d]}}},
        {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
            "type": {"enum": ["adaptive"]}, "display": {"enum": [d for d in anthropic.DISPLAYS if d]}}},
        {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
            "type": {"enum": ["disabled"]}}}]},
    **_TEMPLATE_KWARGS,
    **{name: {"description": f"accepted, no effect ({what})"} for name, what in anthropic.NO_EFFECT.items()}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _FUNCTION_NAME, "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": ["boolean", "null"]}}}}}
_TEXT_PART_ITEM = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
_TEXT_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART_ITEM}]}
_INPUT_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [_TEXT_PART_ITEM, {
    "type": "object", "required": ["type", "image_url"], "description": "a vision-language model's image",
    "properties": {"type": {"enum": ["input_image"]}, "image_url": _IMAGE_SOURCE, "detail": {"enum": ["auto"]}}}]}}]}
_RESPONSES_ITEM = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"enum": ["message"]}, "role": {"enum": list(responses.ROLES)}, "content": _INPUT_CONTENT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"enum": ["function_call"]}, "call_id": {"type": "string"}, "name": _FUNCTION_NAME,
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"enum": ["function_call_output"]}, "call_id": {"type": "string"}, "output": _TEXT_CONTENT}},
    {"type": "object", "required": ["type", "summary"], "description": "earlier thinking (the next assistant turn's "
     "reasoning_content)",
     "properties": {
        "type": {"enum": ["reasoning"]}, "id": {"type": "string"},
        "summary": {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"enum": ["summary_text"]}, "text": {"type": "string"}}}},
        "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"enum": ["reasoning_text"]}, "text": {"type": "string"}}}}}}]}
_RESPONSES_REQUEST = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string", "description": "the served model's id, if given"},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _RESPONSES_ITEM}]},
    "instructions": {"type": "string", "description": "the system turn (not carried to the next response)"},
    "previous_response_id": {"type": "string", "description": "continue this stored response's conversation"},
    **{name: spec.json_schema() for name, (_, spec) in responses.SAMPLING.items()},
    "stream": STREAM.json_schema(), "store": responses.STORE.json_schema(),
    "background": responses.BACKGROUND.json_schema(),
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"enum": ["function"]}, "name": _FUNCTION_NAME, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}},
    "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"enum": ["function"]}, "name": _FUNCTION_NAME}}]},
    "parallel_tool_calls": {"type": "boolean", "description": "more than one call per turn (default true)"},
    "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]}, "name": _FUNCTION_NAME,
        "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
    "metadata": {"type": "object", "maxProperties": responses.MAX_METADATA,
                 "additionalProperties": {"type": "string", "maxLength": 512}},
    "truncation": {"enum": ["disabled"]},
    responses.REASONING: {"type": "object", "additionalProperties": False, "properties": {
        "effort": {**REASONING_EFFORT.json_schema(), "description": "passed to the chat template as "
                                                                     "reasoning_effort, unless chat_template_kwargs "
                                                                     "sets it"},
        "summary": {"enum": [s for s in responses.SUMMARIES if s], "description": "no summaries are written: the "
                                                                                  "reasoning item has the text"},
        "generate_summary": {"enum": [s for s in responses.SUMMARIES if s]}}},
    **_TEMPLATE_KWARGS,
    **{name: {"description": f"accepted, no effect ({what})"} for name, what in responses.NO_EFFECT.items()}}}

_PROCESSOR_KWARGS = {"type": "object", "additionalProperties": False,
                     "description": "a vision-language model's image processor options (vLLM's field)",
                     "properties": {spec.name: spec.json_schema() for spec in PROCESSOR_SPECS.values()}}

SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"enum": ["error"]}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}},
    "MessagesRequest": _MESSAGES_REQUEST,
    "ResponsesRequest": _RESPONSES_REQUEST,
    "CountTokensRequest": {"type": "object", "required": ["model", "messages"], "properties": {
        name: _MESSAGES_REQUEST["properties"][name] for name in ("model", "messages", "system", "tools",
                                                                 "tool_choice", anthropic.THINKING,
                                                                 CHAT_TEMPLATE_KWARGS.name)}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "add_generation_prompt": {"type": "boolean", "description": "open the assistant's turn (default true)"},
        "continue_final_message": {"type": "boolean", "description": "continue the last (assistant) message "
                                                                      "instead of opening a new turn"},
        "logprobs": CHAT_LOGPROBS.json_schema(),
        "top_logprobs": TOP_LOGPROBS.json_schema(),
        "tools": {"type": "array", "items": _TOOL, "description": "function tools the model may call"},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": _FUNCTION_NAME}}}}]},
        "parallel_tool_calls": {"type": "boolean", "description": "more than one call per turn (default true)"},
        PROCESSOR_KWARGS: _PROCESSOR_KWARGS,
        **_TEMPLATE_KWARGS,
        REASONING_EFFORT.name: REASONING_EFFORT.json_schema(),
        **_OPENAI_COMMON}},
    "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"description": f"one prompt, or a list of prompts: n choices each, at most {MAX_CHOICES} in all",
                   "oneOf": [{"type": "string"}, {**_TOKEN_IDS, "minItems": 1},
                             {"type": "array", "minItems": 1, "items": {
                                 "oneOf": [{"type": "string"}, {**_TOKEN_IDS, "minItems": 1}]}}]},
        "logprobs": COMPLETION_LOGPROBS.json_schema(),
        "echo": ECHO.json_schema(),
        "best_of": BEST_OF.json_schema(),
        **{name: schema for name, schema in _OPENAI_COMMON.items() if name not in REFUSED}}},
    "GenerateRequest": {"type": "object", "properties": {
        "text": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}],
                 "description": "a prompt, or a list of prompts (a batch: a list of results)"},
        "input_ids": {"oneOf": [{**_TOKEN_IDS, "minItems": 1},
                                {"type": "array", "minItems": 1, "items": {**_TOKEN_IDS, "minItems": 1}}]},
        "stream_deltas": {"type": "boolean", "description": "streamed: send only what is new in each chunk, not "
                                                              "everything so far"},
        "image_data": {"description": "a vision-language model's images: one or a list for one prompt (the text "
                                      "holds the model's image placeholder where each goes); for a batch, one entry "
                                      "per prompt", "oneOf": [
            _IMAGE_SOURCE, {"type": "array", "minItems": 1, "items": {"oneOf": [
                _IMAGE_SOURCE, {"type": "array", "minItems": 1, "items": _IMAGE_SOURCE}, {"type": "null"}]}}]},
        PROCESSOR_KWARGS: _PROCESSOR_KWARGS,
        "rid": RID,
        "stream": STREAM.json_schema(),
        "return_logprob": _NATIVE_SAMPLING["return_logprob"],
        "top_logprobs_num": _NATIVE_SAMPLING["top_logprobs_num"],
        "logprob_start_len": _NATIVE_SAMPLING["logprob_start_len"],
        "sampling_params": {"type": "object", "properties": {**_NATIVE_SAMPLING, "n": N.json_schema()},
                            "additionalProperties": False}},
        "additionalProperties": False,  # native/generate.py FIELDS: any other field is a 400
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]},
    "EmbeddingRequest": {"type": "object", "required": ["input"], "properties": {
        "input": {"oneOf": [{"type": "string", "minLength": 1}, {**_TOKEN_IDS, "minItems": 1},
                            {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string", "minLength": 1},
                                                                                {**_TOKEN_IDS, "minItems": 1}]}}],
                  "description": "a text, token ids, or a list of either (one embedding each, in order)"},
        "model": {"type": "string", "description": "must be the served model's id if given"},
        **{spec.name: spec.json_schema() for spec in (ENCODING_FORMAT, DIMENSIONS, USER, *EMBED_SPECS.values())}}},
    "UpdateWeightsRequest": {"type": "object", "required": ["model_path"], "properties": {
        "model_path": {"type": "string", "minLength": 1, "description": "a .gguf file or safetensors directory of "
                                                                         "the same architecture"},
        "mode": {"enum": ["wait", "pause", "abort"], "description": "what happens to the requests the scheduler "
                                                                     "holds (default wait)"},
        "abort_all_requests": {"type": "boolean", "description": "SGLang's name for mode abort"},
        "weight_version": {"type": "string", "description": "names the new weights (default: the next number)"},
        **_neutral_only(UPDATE_WEIGHTS_REFUSED)},
        "additionalProperties": False},
    "AbortRequest": {"type": "object", "properties": {"rid": RID, "abort_all": _BOOL},
                     "description": "give rid, or abort_all: true", "additionalProperties": False},
    "PauseRequest": {"type": "object", "properties": _neutral_only(PAUSE_REFUSED), "additionalProperties": False},
    "Empty": {"type": "object", "description": "no fields", "additionalProperties": False},
    "ControlReply": {"type": "object", "required": ["success", "message"],
                     "properties": {"success": _BOOL, "message": {"type": "string"}}},
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
_ONE_RESPONSE = responses.RESPONSES_PATH + "/{response_id}"


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
        anthropic.MESSAGES_PATH: _post("Anthropic Messages", "MessagesRequest", "Object", *_BODY_ERRORS, 404,
                                       stream=True, error="AnthropicError"),
        anthropic.MESSAGES_PATH + "/count_tokens": _post(
            "Anthropic token count: the input tokens the same Messages body would send", "CountTokensRequest",
            "Object", *_BODY_ERRORS, 404, error="AnthropicError"),
        responses.RESPONSES_PATH: _post("OpenAI Responses: create (whole, streamed, or in the background)",
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
