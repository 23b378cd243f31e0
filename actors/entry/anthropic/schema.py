"""The OpenAPI schemas of Anthropic's Messages bodies (`/v1/messages` and its token count) and of its errors."""

from __future__ import annotations

from ringserve.actors.entry.anthropic.request import BUDGET, DISPLAYS, NO_EFFECT, SAMPLING, THINKING, TOOL_CHOICES
from ringserve.actors.entry.openai.protocol import STREAM
from ringserve.actors.entry.openapi.parts import BOOL, FUNCTION_NAME, TEMPLATE_KWARGS
from ringserve.actors.entry.template_switches import CHAT_TEMPLATE_KWARGS

_CACHE_HINT = {"type": "object", "description": "accepted, no effect (the prefix cache is automatic)"}
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["text"]}, "text": {"type": "string"}, "cache_control": _CACHE_HINT}}
_BLOCK = {"oneOf": [_TEXT_BLOCK, {
    "type": "object", "required": ["type", "id", "name", "input"], "description": "assistant turns only",
    "properties": {"type": {"enum": ["tool_use"]}, "id": {"type": "string"}, "name": FUNCTION_NAME,
                   "input": {"type": "object"}, "cache_control": _CACHE_HINT}}, {
    "type": "object", "required": ["type", "tool_use_id"], "description": "user turns only",
    "properties": {"type": {"enum": ["tool_result"]}, "tool_use_id": {"type": "string"},
                   "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
                   "is_error": BOOL, "cache_control": _CACHE_HINT}}, {
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
MESSAGES_REQUEST = {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
    "model": {"type": "string", "description": "the served model's id"},
    "messages": {"type": "array", "minItems": 1, "items": _ANTHROPIC_MESSAGE},
    "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
    **{name: spec.json_schema() for name, (_, spec) in SAMPLING.items()},
    "stream": STREAM.json_schema(),
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
        "type": {"enum": ["custom"]}, "name": FUNCTION_NAME, "description": {"type": "string"},
        "input_schema": {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["object"]}}},
        "cache_control": _CACHE_HINT}}},
    "tool_choice": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": [*TOOL_CHOICES, "tool"]}, "name": FUNCTION_NAME,
        "disable_parallel_tool_use": BOOL}},
    THINKING: {"description": "a reasoning model's thinking: enabled (the template's enable_thinking true, with a "
                              "token budget; the answer opens with a thinking block), disabled (enable_thinking "
                              "false), adaptive (the template's default, thinking returned); absent: the template's "
                              "default, thinking not returned",
               "oneOf": [
        {"type": "object", "required": ["type", "budget_tokens"], "additionalProperties": False, "properties": {
            "type": {"enum": ["enabled"]}, "budget_tokens": BUDGET.json_schema(),
            "display": {"enum": [d for d in DISPLAYS if d]}}},
        {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
            "type": {"enum": ["adaptive"]}, "display": {"enum": [d for d in DISPLAYS if d]}}},
        {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
            "type": {"enum": ["disabled"]}}}]},
    **TEMPLATE_KWARGS,
    **{name: {"description": f"accepted, no effect ({what})"} for name, what in NO_EFFECT.items()}}}
COUNT_TOKENS_REQUEST = {"type": "object", "required": ["model", "messages"], "properties": {
    name: MESSAGES_REQUEST["properties"][name] for name in ("model", "messages", "system", "tools", "tool_choice",
                                                            THINKING, CHAT_TEMPLATE_KWARGS.name)}}
ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"enum": ["error"]}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
