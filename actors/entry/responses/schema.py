"""The OpenAPI schema of OpenAI's Responses body (`/v1/responses`)."""

from __future__ import annotations

from ringserve.actors.entry.openai.protocol import STREAM
from ringserve.actors.entry.openapi.parts import FUNCTION_NAME, IMAGE_SOURCE, TEMPLATE_KWARGS
from ringserve.actors.entry.responses.protocol import (BACKGROUND, MAX_METADATA, NO_EFFECT, REASONING, ROLES, SAMPLING,
                                                       STORE, SUMMARIES)
from ringserve.actors.entry.template_switches import REASONING_EFFORT

_TEXT_PART_ITEM = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
_TEXT_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART_ITEM}]}
_INPUT_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [_TEXT_PART_ITEM, {
    "type": "object", "required": ["type", "image_url"], "description": "a vision-language model's image",
    "properties": {"type": {"enum": ["input_image"]}, "image_url": IMAGE_SOURCE, "detail": {"enum": ["auto"]}}}]}}]}
_RESPONSES_ITEM = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"enum": ["message"]}, "role": {"enum": list(ROLES)}, "content": _INPUT_CONTENT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"enum": ["function_call"]}, "call_id": {"type": "string"}, "name": FUNCTION_NAME,
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
RESPONSES_REQUEST = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string", "description": "the served model's id, if given"},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _RESPONSES_ITEM}]},
    "instructions": {"type": "string", "description": "the system turn (not carried to the next response)"},
    "previous_response_id": {"type": "string", "description": "continue this stored response's conversation"},
    **{name: spec.json_schema() for name, (_, spec) in SAMPLING.items()},
    "stream": STREAM.json_schema(), "store": STORE.json_schema(),
    "background": BACKGROUND.json_schema(),
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"enum": ["function"]}, "name": FUNCTION_NAME, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}},
    "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"enum": ["function"]}, "name": FUNCTION_NAME}}]},
    "parallel_tool_calls": {"type": "boolean", "description": "more than one call per turn (default true)"},
    "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]}, "name": FUNCTION_NAME,
        "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
    "metadata": {"type": "object", "maxProperties": MAX_METADATA,
                 "additionalProperties": {"type": "string", "maxLength": 512}},
    "truncation": {"enum": ["disabled"]},
    REASONING: {"type": "object", "additionalProperties": False, "properties": {
        "effort": {**REASONING_EFFORT.json_schema(), "description": "passed to the chat template as "
                                                                     "reasoning_effort, unless chat_template_kwargs "
                                                                     "sets it"},
        "summary": {"enum": [s for s in SUMMARIES if s], "description": "no summaries are written: the reasoning "
                                                                        "item has the text"},
        "generate_summary": {"enum": [s for s in SUMMARIES if s]}}},
    **TEMPLATE_KWARGS,
    **{name: {"description": f"accepted, no effect ({what})"} for name, what in NO_EFFECT.items()}}}
