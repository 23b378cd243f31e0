"""The OpenAPI schemas of OpenAI's request bodies: chat completions, completions and embeddings. The sampling
parameters' schemas derive from their declarations in `ringserve.bus.params`, under the names OpenAI bodies use;
the entry's own fields (`n`, `stream`, the logprobs switches) from protocol.py's Specs."""

from __future__ import annotations

from typing import Any

from ringserve.actors.entry.openai.embeddings import DIMENSIONS, ENCODING_FORMAT, USER
from ringserve.actors.entry.openai.protocol import (BEST_OF, CHAT_LOGPROBS, COMPLETION_LOGPROBS, CONTINUOUS_USAGE, ECHO,
                                                    MAX_CHOICES, N, NO_EFFECT, PROMPT_LOGPROBS, REFUSED, STREAM,
                                                    STREAM_OPTIONS_NO_EFFECT, TOKENS_AS_IDS, TOP_LOGPROBS)
from ringserve.actors.entry.openapi.parts import (BOOL, FUNCTION_NAME, IMAGE_PROCESSOR_OPTIONS, TEMPLATE_KWARGS,
                                                  TOKEN_IDS)
from ringserve.actors.entry.template_switches import REASONING_EFFORT
from ringserve.bus.params import EMBED_SPECS, PROCESSOR_KWARGS, SPECS

# sampling parameters under the names OpenAI bodies use
_OPENAI_SAMPLING = {alias: spec.json_schema() for spec in SPECS.values()
                    for alias in (spec.openai if spec.openai is not None else (spec.name,))}
_OPENAI_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "must be the served model's id if given"},
    "n": N.json_schema(),
    "stream": STREAM.json_schema(),
    "stream_options": {"type": "object", "description": "only with stream: true", "properties": {
        "include_usage": BOOL,
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
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_IMAGE_URL_PART = {"type": "object", "required": ["type", "image_url"], "properties": {
    "type": {"type": "string", "enum": ["image_url"]},
    "image_url": {"type": "object", "required": ["url"], "properties": {
        "url": {"type": "string", "description": "a data URL; a file URL under --allowed-local-media-path; an "
                                                 "http(s) URL with --allow-remote-images"},
        "detail": {"type": "string", "enum": ["auto"]}}}}}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": FUNCTION_NAME, "arguments": {"type": "string"}}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_-]{0,31}$",
             "description": "system, developer, user, assistant, tool, or a custom role the chat template knows"},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [_TEXT_PART, _IMAGE_URL_PART]}},
                          {"type": "null"}]},
    "name": {"type": "string"},
    "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "an assistant turn's calls"},
    "tool_call_id": {"type": "string", "description": "a tool turn: the call it answers"}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": FUNCTION_NAME, "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": ["boolean", "null"]}}}}}

CHAT_COMPLETION_REQUEST = {"type": "object", "required": ["messages"], "properties": {
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
            "function": {"type": "object", "required": ["name"], "properties": {"name": FUNCTION_NAME}}}}]},
    "parallel_tool_calls": {"type": "boolean", "description": "more than one call per turn (default true)"},
    PROCESSOR_KWARGS: IMAGE_PROCESSOR_OPTIONS,
    **TEMPLATE_KWARGS,
    REASONING_EFFORT.name: REASONING_EFFORT.json_schema(),
    **_OPENAI_COMMON}}
COMPLETION_REQUEST = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": {"description": f"one prompt, or a list of prompts: n choices each, at most {MAX_CHOICES} in all",
               "oneOf": [{"type": "string"}, {**TOKEN_IDS, "minItems": 1},
                         {"type": "array", "minItems": 1, "items": {
                             "oneOf": [{"type": "string"}, {**TOKEN_IDS, "minItems": 1}]}}]},
    "logprobs": COMPLETION_LOGPROBS.json_schema(),
    "echo": ECHO.json_schema(),
    "best_of": BEST_OF.json_schema(),
    **{name: schema for name, schema in _OPENAI_COMMON.items() if name not in REFUSED}}}
EMBEDDING_REQUEST = {"type": "object", "required": ["input"], "properties": {
    "input": {"oneOf": [{"type": "string", "minLength": 1}, {**TOKEN_IDS, "minItems": 1},
                        {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string", "minLength": 1},
                                                                            {**TOKEN_IDS, "minItems": 1}]}}],
              "description": "a text, token ids, or a list of either (one embedding each, in order)"},
    "model": {"type": "string", "description": "must be the served model's id if given"},
    **{spec.name: spec.json_schema() for spec in (ENCODING_FORMAT, DIMENSIONS, USER, *EMBED_SPECS.values())}}}
