"""Validation of a request's raw sampling parameters into a `SamplingParams` the scheduler can trust.

The rules come from the declarations in `bus.params`: each field's type, range and shape there is checked
here generically; only the rules that relate parameters to each other or to the model (context length,
vocabulary, EOS ids) are written out below. Every failure is an `ApiError` naming the parameter.
"""

from __future__ import annotations

import math
from typing import Any

from bus.errors import ApiError
from bus.params import (
    LOGIT_BIAS, LOGIT_BIAS_LIMIT, MAX_STOP_CHARS, SPECS, STOP_STRINGS, TOKEN_IDS, SamplingParams, Spec, default_of,
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(spec: Spec, what: str, value: Any) -> ApiError:
    return ApiError(f"{spec.error_name} must be {what}, got {value!r}"[:1000], param=spec.error_name)


def _scalar(spec: Spec, value: Any) -> Any:
    if spec.kind == "boolean":
        if not isinstance(value, bool):
            raise _bad(spec, "a boolean", value)
        return value
    if spec.kind == "integer" and not _is_int(value):
        raise _bad(spec, "an integer" + (f" in {spec.range_text()}" if spec.range_text() else ""), value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(spec, "a finite number", value)
    low, high = spec.low, spec.high
    if (low is not None and (value < low or (spec.low_open and value == low))) or (high is not None and value > high):
        raise _bad(spec, f"in {spec.range_text()}", value)
    return value if spec.kind == "integer" else float(value)


def _token_id(value: Any, vocab_size: int) -> int | None:
    """`value` as a token id in the vocabulary (JSON object keys arrive as decimal strings), else None."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 20:
        value = int(value)
    return value if _is_int(value) and 0 <= value < vocab_size else None


def _composite(spec: Spec, value: Any, vocab_size: int) -> Any:
    limit = spec.max_items or 0
    if spec.shape == STOP_STRINGS:
        stops = [value] if isinstance(value, str) else value
        if (not isinstance(stops, list) or len(stops) > limit
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
            raise _bad(spec, f"a string or a list of {spec.range_text()}", value)
        return list(dict.fromkeys(stops))
    if spec.shape == TOKEN_IDS:
        if not isinstance(value, list) or len(value) > limit or any(_token_id(t, vocab_size) is None or
                                                                    not _is_int(t) for t in value):
            raise _bad(spec, f"a list of at most {limit} token ids in [0, {vocab_size})", value)
        return list(value)
    assert spec.shape == LOGIT_BIAS, spec.shape
    if not isinstance(value, dict) or len(value) > limit:
        raise _bad(spec, f"an object of at most {limit} token ids", value)
    bias: dict[int, float] = {}
    for key, amount in value.items():
        token = _token_id(key, vocab_size)
        if token is None:
            raise ApiError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})"[:1000],
                           param=spec.error_name)
        if (isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount)
                or abs(amount) > LOGIT_BIAS_LIMIT):
            raise _bad(spec, f"biases in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]", amount)
        bias[token] = float(amount)
    return bias


def validate_sampling(
    raw: dict[str, Any], prompt_tokens: int, context_length: int, vocab_size: int, eos_token_ids: list[int]
) -> SamplingParams:
    """Check every raw parameter's type and range and fill defaults; raise ApiError on the first bad one.

    Without `max_new_tokens` the request may use the rest of the context window. Normalised: a top_k of 0 or at
    or above the vocabulary size is off (-1); EOS ids join `stop_token_ids` unless `ignore_eos`;
    `top_logprobs_num` > 0 implies `return_logprob`.
    """
    unknown = sorted(set(raw) - SPECS.keys(), key=str)
    if unknown:
        raise ApiError(f"unknown sampling parameter {unknown[0]!r}"[:1000], param=str(unknown[0]))
    values: dict[str, Any] = {}
    for name, spec in SPECS.items():
        value = raw.get(name)
        if value is None:
            values[name] = default_of(name)
        else:
            values[name] = _composite(spec, value, vocab_size) if spec.shape else _scalar(spec, value)
    params = SamplingParams(**values)
    _check_lengths(params, prompt_tokens, context_length)
    if params.top_k == 0 or params.top_k >= vocab_size:
        params.top_k = -1
    if not params.ignore_eos:
        params.stop_token_ids += [t for t in eos_token_ids if t not in params.stop_token_ids]
    params.return_logprob = params.return_logprob or params.top_logprobs_num > 0
    return params


def _check_lengths(params: SamplingParams, prompt_tokens: int, context_length: int) -> None:
    """max_new_tokens fits the context (and defaults to what is left of it); min_new_tokens <= max_new_tokens."""
    max_new, min_new = SPECS["max_new_tokens"], SPECS["min_new_tokens"]
    if params.max_new_tokens is None:
        remaining = context_length - prompt_tokens
        if remaining < 1:
            raise ApiError(f"the prompt has {prompt_tokens} tokens, which leaves no room in the context length of "
                           f"{context_length}", param="messages")
        params.max_new_tokens = remaining
    elif prompt_tokens + params.max_new_tokens > context_length:
        raise ApiError(
            f"this model's maximum context length is {context_length} tokens, but "
            f"{prompt_tokens + params.max_new_tokens} were requested ({prompt_tokens} in the prompt, "
            f"{params.max_new_tokens} for the completion)", param=max_new.error_name)
    if params.min_new_tokens > params.max_new_tokens:
        raise _bad(min_new, f"at most {max_new.error_name}={params.max_new_tokens}", params.min_new_tokens)
