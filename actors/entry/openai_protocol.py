"""OpenAI request bodies -> GenerateRequest, and ring outputs -> OpenAI response bodies and stream chunks.

Only shapes are checked here (what must be an object, a list, a string), plus what the entry itself acts on
(`n`, the logprobs switches); the tokenizer actor validates every sampling value. Which OpenAI fields are
sampling parameters, and under which native name, comes from their declarations in `bus.params`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bus.errors import ApiError
from actors.entry.openai_logprobs import LogprobFormatter
from bus.messages import ChatMessage, FinishReason, GenerateRequest, RequestOutput, TokenLogprob
from bus.param_spec import Spec
from bus.params import MAX_TOP_LOGPROBS, openai_names

# OpenAI name -> native (SGLang) sampling name; SGLang's extensions are accepted under their own names
_SAMPLING_FIELDS = openai_names()
_UNSUPPORTED_UNLESS_DEFAULT = {"echo": False, "best_of": 1}
MAX_N = 16
# The fields of OpenAI bodies that the entry itself acts on, declared once: checked here, and described in the
# OpenAPI document from the same Spec (the sampling parameters are declared in bus.params).
N = Spec("choices to generate for the prompt; choice i samples with seed + i", low=1, high=MAX_N, kind="integer",
         name="n")
STREAM = Spec("answer as server-sent events", kind="boolean", name="stream")
CHAT_LOGPROBS = Spec("return the logprob of every generated token", kind="boolean", name="logprobs")
TOP_LOGPROBS = Spec("this many most likely alternatives with every token (needs logprobs)", low=0,
                    high=MAX_TOP_LOGPROBS, kind="integer", name="top_logprobs")
COMPLETION_LOGPROBS = Spec("return logprobs, with this many most likely alternatives per token", low=0,
                           high=MAX_TOP_LOGPROBS, kind="integer", name="logprobs")


@dataclass
class ApiOptions:
    """How the entry shapes the response of one OpenAI request."""

    kind: str  # "chat" or "completion"
    stream: bool
    include_usage: bool
    model: str
    created: int
    n: int = 1  # choices per prompt
    logprobs: bool = False  # the client asked for logprobs
    top_logprobs: int = 0  # and this many alternatives per token

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def logprob_formatter(self) -> LogprobFormatter:
        """A fresh formatter for one choice's logprobs."""
        return LogprobFormatter(self.kind, self.logprobs, self.top_logprobs > 0)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    for name, default in _UNSUPPORTED_UNLESS_DEFAULT.items():
        value = body.get(name)
        if value is not None and value != default:
            raise ApiError(f"{name}={value!r} is not supported", param=name)
    sampling = {ours: body[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if body.get(theirs) is not None}
    return sampling


def _chat_logprobs(body: dict[str, Any], sampling: dict[str, Any]) -> tuple[bool, int]:
    """Chat's `logprobs` (bool) and `top_logprobs` (int, needs logprobs) -> return_logprob, top_logprobs_num."""
    logprobs = CHAT_LOGPROBS.read(body, False)
    if body.get("top_logprobs") is not None and not logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")
    top = TOP_LOGPROBS.read(body, 0)
    if logprobs:
        sampling["return_logprob"] = True
        sampling["top_logprobs_num"] = top
    return logprobs, top


def _completion_logprobs(body: dict[str, Any], sampling: dict[str, Any]) -> tuple[bool, int]:
    """Completions' `logprobs: k` -> return_logprob with k alternatives per token."""
    k = body.get("logprobs")
    if k is None or k is False:
        return False, 0
    k = COMPLETION_LOGPROBS.check(k)
    sampling["return_logprob"] = True
    sampling["top_logprobs_num"] = k
    return True, k


def _options(body: dict[str, Any], kind: str, served_model: str) -> ApiOptions:
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(f"the model {model!r} does not exist; this server serves {served_model!r}", 404, "model",
                       "model_not_found")
    stream = STREAM.read(body, False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    return ApiOptions(kind, stream, bool(stream_options.get("include_usage")), served_model, int(time.time()),
                      n=N.read(body, 1))


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
    sampling = _sampling(body)
    options.logprobs, options.top_logprobs = _chat_logprobs(body, sampling)
    return GenerateRequest(rid=rid, messages=turns, sampling=sampling), options


def parse_completion(body: dict[str, Any], rid: str, served_model: str) -> tuple[GenerateRequest, ApiOptions]:
    """A /v1/completions body as a GenerateRequest plus response options."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    options = _options(body, "completion", served_model)
    sampling = _sampling(body)
    options.logprobs, options.top_logprobs = _completion_logprobs(body, sampling)
    if isinstance(prompt, str):
        return GenerateRequest(rid=rid, text=prompt, sampling=sampling), options
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling), options
    raise ApiError("prompt must be a string, a list of token ids, or a list with one of those", param="prompt")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choices_usage(lasts: list[RequestOutput]) -> dict[str, Any]:
    """Usage of the n choices of one prompt, given each choice's last output.

    Completion tokens add up; the prompt is counted once, and so are its cached tokens (the least any choice
    found cached: choices that reused a sibling's just-computed prefix do not make the prompt cheaper).
    """
    return usage(lasts[0].prompt_tokens, sum(out.completion_tokens for out in lasts),
                 min(out.cached_tokens for out in lasts))


def full_response(rid: str, options: ApiOptions, choices: list[list[RequestOutput]]) -> dict[str, Any]:
    """The non-streamed response body; `choices[i]` holds every output of choice i, in order."""
    body_choices = []
    for index, outputs in enumerate(choices):
        finish = outputs[-1].finish
        entries: list[TokenLogprob] = [e for out in outputs for e in out.logprobs]
        choice: dict[str, Any] = {"index": index, "finish_reason": finish.type if finish else None,
                                  "matched_stop": finish.matched if finish else None,
                                  "logprobs": options.logprob_formatter().format(entries)}
        text = "".join(out.text for out in outputs)
        if options.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body_choices.append(choice)
    return {"id": response_id(rid, options), "object": options.object_name, "created": options.created,
            "model": options.model, "choices": body_choices, "usage": choices_usage([c[-1] for c in choices])}


def response_id(rid: str, options: ApiOptions) -> str:
    """The response id OpenAI clients see, derived from the rid."""
    return f"{'chatcmpl' if options.kind == 'chat' else 'cmpl'}-{rid}"


def stream_chunk(rid: str, options: ApiOptions, text: str | None, finish: FinishReason | None,
                 first: bool = False, index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index`; a choice's first chat chunk carries the assistant role."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish.type if finish else None}
    if options.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    if finish is not None:
        choice["matched_stop"] = finish.matched
    chunk: dict[str, Any] = {"id": response_id(rid, options), "object": f"{options.object_name}.chunk"
                             if options.kind == "chat" else options.object_name,
                             "created": options.created, "model": options.model, "choices": [choice]}
    if options.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, options: ApiOptions, lasts: list[RequestOutput]) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage is set: no choices, only usage."""
    chunk = stream_chunk(rid, options, None, None)
    chunk["choices"] = []
    chunk["usage"] = choices_usage(lasts)
    return chunk
