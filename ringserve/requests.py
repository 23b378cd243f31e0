"""Python arguments -> the ring's `GenerateRequest`s: the prompt forms `/generate` takes (one text or a list, one
token-id list or a list of them), sampling parameters (one dict for all, or one per prompt), rids, and chat
messages through the OpenAI chat parser the HTTP entry uses (`actors/entry/openai/protocol.py`), so chat has
the same template (`chat_template_kwargs`, `reasoning_effort`), structured-output and tool options as
`/v1/chat/completions`.

Only shapes are checked here (ApiError 400 naming the argument); the tokenizer validates the values, as it
does for HTTP.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Sequence

from ringserve.bus.errors import ApiError
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.subjects import InvalidRidError, new_rid, validate_rid

DEFAULT_MAX_NEW_TOKENS = 128  # as /generate (actors/entry/native/generate.py DEFAULT_GENERATE_MAX_NEW_TOKENS)
_TOP_LEVEL = ("return_logprob", "top_logprobs_num", "logprob_start_len")  # SGLang passes these beside sampling


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: Any, input_ids: Any) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    """(text, input_ids) of every prompt, and whether a list was given."""
    if (prompt is None) == (input_ids is None):
        raise ApiError("give exactly one of prompt or input_ids", param="prompt")
    if prompt is not None:
        if isinstance(prompt, str):
            return [(prompt, None)], False
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return [(p, None) for p in prompt], True
        raise ApiError("prompt must be a string or a non-empty list of strings", param="prompt")
    if isinstance(input_ids, list) and input_ids and all(isinstance(p, list) for p in input_ids):
        if not all(_is_ids(p) for p in input_ids):
            raise ApiError("input_ids must be a list of integers or a non-empty list of such lists", param="input_ids")
        return [(None, list(p)) for p in input_ids], True
    if not _is_ids(input_ids):
        raise ApiError("input_ids must be a list of integers or a non-empty list of such lists", param="input_ids")
    return [(None, list(input_ids))], False


def _rids(rid: str | Sequence[str] | None, count: int, listed: bool) -> list[str]:
    """One rid per prompt: the given ones, or `{rid}-{i}` for a list under one rid (as /generate names a batch)."""
    try:
        if rid is None or isinstance(rid, str):
            base = validate_rid(rid) if rid is not None else new_rid()
            return [f"{base}-{i}" for i in range(count)] if listed else [base]
        rids = [validate_rid(r) for r in rid]
    except InvalidRidError as exc:
        raise ApiError(str(exc), param="rid") from exc
    if len(rids) != count or len(set(rids)) != count:
        raise ApiError(f"give {count} distinct rids, one per prompt, got {len(rids)}", param="rid")
    return rids


def _sampling(sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None, count: int,
              top_level: dict[str, Any]) -> list[dict[str, Any]]:
    if sampling_params is None or isinstance(sampling_params, dict):
        each = [dict(sampling_params or {}) for _ in range(count)]
    else:
        each = [dict(p) for p in sampling_params]
        if len(each) != count:
            raise ApiError(f"give one sampling_params for all prompts or one per prompt ({count}), got {len(each)}",
                           param="sampling_params")
    for params in each:
        n = params.pop("n", 1)
        if n != 1:
            raise ApiError(f"n={n!r}: pass the prompt n times instead (each its own result)", param="n")
        params.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        for name, value in top_level.items():
            if value is not None:
                params.setdefault(name, value)
    return each


def image_source(image: Any) -> Any:
    """One image as the Python API takes it, as a source `/generate`'s `image_data` takes: file bytes or a PIL
    image (base64), a `pathlib.Path` (a file URL); a string (base64, a data or file URL) as it is."""
    if isinstance(image, (bytes, bytearray)):
        return base64.b64encode(bytes(image)).decode()
    if isinstance(image, Path):
        return image.resolve().as_uri()
    if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return base64.b64encode(buffer.getvalue()).decode()
    if isinstance(image, (list, tuple)):
        return [image_source(each) for each in image]
    return image


def generate_requests(prompt: str | Sequence[str] | None = None,
                      sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                      input_ids: list[int] | list[list[int]] | None = None, rid: str | Sequence[str] | None = None,
                      image_data: Any = None, mm_processor_kwargs: dict[str, Any] | None = None,
                      **top_level: Any) -> tuple[list[GenerateRequest], bool]:
    """The requests of one `generate` call, in prompt order, and whether the answer is a list.

    `image_data`: `/generate`'s (one image or a list for one prompt, a list per prompt for a list of prompts), each
    image as `image_source` takes it; the caller stores them (`ImageIntake.resolve_all`). `mm_processor_kwargs`:
    the image processor's options, as `/generate` takes them (checked by the tokenizer). `top_level`:
    `return_logprob`, `top_logprobs_num`, `logprob_start_len` (SGLang's names beside `sampling_params`; None: not
    given). `max_new_tokens` defaults to 128, as in /generate.
    """
    from ringserve.actors.entry.image_input import image_data_sources

    unknown = set(top_level) - set(_TOP_LEVEL)
    if unknown:
        raise TypeError(f"unknown argument(s) {sorted(unknown)}; sampling parameters go in sampling_params")
    prompts, listed = _prompts(prompt, input_ids)
    rids = _rids(rid, len(prompts), listed)
    sampling = _sampling(sampling_params, len(prompts), top_level)
    images = image_data_sources(image_source(image_data), len(prompts), listed)
    return [GenerateRequest(rid=r, text=text, input_ids=ids, sampling=params, image_data=sources,
                            mm_processor_kwargs=mm_processor_kwargs)
            for r, (text, ids), params, sources in zip(rids, prompts, sampling, images)], listed


def chat_request(messages: list[dict[str, Any]], rid: str | None, served_model: str,
                 sampling_params: dict[str, Any] | None, openai_fields: dict[str, Any],
                 chat_template_kwargs: dict[str, Any] | None = None) -> tuple[GenerateRequest, Any]:
    """The request of one chat completion and the response options the OpenAI shaping needs.

    `openai_fields`: anything a `/v1/chat/completions` body takes besides `messages` (`max_tokens`,
    `temperature`, `tools`, `tool_choice`, `response_format`, `reasoning_effort`, ...), checked as the HTTP entry
    checks them; `sampling_params`: native parameters on top (`max_new_tokens`, `regex`, ...);
    `chat_template_kwargs`: the chat template's extra variables, as the HTTP body's field.
    """
    from ringserve.actors.entry.openai.protocol import parse_chat

    if openai_fields.get("stream"):
        raise ApiError("use chat(..., stream=True) to stream", param="stream")
    body = {**openai_fields, "messages": messages}
    if chat_template_kwargs is not None:
        body["chat_template_kwargs"] = chat_template_kwargs
    body.pop("stream", None)
    try:
        rid = validate_rid(rid) if rid is not None else new_rid()
    except InvalidRidError as exc:
        raise ApiError(str(exc), param="rid") from exc
    request, options = parse_chat(body, rid, served_model)
    if options.n != 1:
        raise ApiError(f"n={options.n}: call chat n times instead", param="n")
    request.sampling.update(sampling_params or {})
    return request, options
