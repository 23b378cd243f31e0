"""OpenAI request bodies -> GenerateRequest, and ring outputs -> OpenAI response bodies and stream chunks.

Only shapes are checked here (what must be an object, a list, a string); the tokenizer actor validates
every sampling value, so the rules live in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from actors.entry.errors import ApiError
from bus.messages import ChatMessage, FinishReason, GenerateRequest

# OpenAI name -> ringserve (SGLang) sampling name; extensions pass through under their own names
_SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
}
_UNSUPPORTED_UNLESS_DEFAULT = {"n": 1, "logprobs": False, "echo": False, "best_of": 1,
                               "presence_penalty": 0, "frequency_penalty": 0}


@dataclass
class ApiOptions:
    """How the entry shapes the response of one OpenAI request."""

    kind: str  # "chat" or "completion"
    stream: bool
    include_usage: bool
    model: str
    created: int

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    for name, default in _UNSUPPORTED_UNLESS_DEFAULT.items():
        value = body.get(name)
        if value is not None and value != default:
            raise ApiError(f"{name}={value!r} is not supported yet", param=name)
    sampling = {ours: body[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if body.get(theirs) is not None}
    return sampling


def _options(body: dict[str, Any], kind: str, served_model: str) -> ApiOptions:
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(f"the model {model!r} does not exist; this server serves {served_model!r}", 404, "model",
                       "model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    return ApiOptions(kind, stream, bool(stream_options.get("include_usage")), served_model, int(time.time()))


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def parse_chat(body: dict[str, Any], rid: str, served_model: str) -> tuple[GenerateRequest, ApiOptions]:
    """A /v1/chat/completions body as a GenerateRequest plus response options."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string role", param="messages")
        turns.append(ChatMessage(role=message["role"], content=_content_text(message.get("content"), i)))
    options = _options(body, "chat", served_model)
    return GenerateRequest(rid=rid, messages=turns, sampling=_sampling(body)), options


def parse_completion(body: dict[str, Any], rid: str, served_model: str) -> tuple[GenerateRequest, ApiOptions]:
    """A /v1/completions body as a GenerateRequest plus response options."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    options = _options(body, "completion", served_model)
    sampling = _sampling(body)
    if isinstance(prompt, str):
        return GenerateRequest(rid=rid, text=prompt, sampling=sampling), options
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling), options
    raise ApiError("prompt must be a string, a list of token ids, or a list with one of those", param="prompt")


def finish_reason_name(finish: FinishReason | None) -> str | None:
    """OpenAI's finish_reason string ("stop", "length" or "abort")."""
    return None if finish is None else finish.type


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(rid: str, options: ApiOptions, text: str, finish: FinishReason | None,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The non-streamed response body."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason_name(finish),
                              "matched_stop": finish.matched if finish else None}
    if options.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
        choice["logprobs"] = None
    return {"id": response_id(rid, options), "object": options.object_name, "created": options.created,
            "model": options.model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def response_id(rid: str, options: ApiOptions) -> str:
    """The response id OpenAI clients see, derived from the rid."""
    return f"{'chatcmpl' if options.kind == 'chat' else 'cmpl'}-{rid}"


def stream_chunk(rid: str, options: ApiOptions, text: str | None, finish: FinishReason | None,
                 first: bool = False) -> dict[str, Any]:
    """One streamed chunk; the first chat chunk carries the assistant role."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason_name(finish)}
    if options.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
        choice["logprobs"] = None
    if finish is not None:
        choice["matched_stop"] = finish.matched
    chunk: dict[str, Any] = {"id": response_id(rid, options), "object": f"{options.object_name}.chunk"
                             if options.kind == "chat" else options.object_name,
                             "created": options.created, "model": options.model, "choices": [choice]}
    if options.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, options: ApiOptions, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage is set: no choices, only usage."""
    chunk = stream_chunk(rid, options, None, None)
    chunk["choices"] = []
    chunk["usage"] = usage(prompt_tokens, completion_tokens)
    return chunk
