"""Validation of a request's raw sampling parameters into a `SamplingParams` the scheduler can trust."""

from __future__ import annotations

import math
from typing import Any

from bus.messages import SamplingParams

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
_KNOWN = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "return_logprob", "top_logprobs_num",
}


class ParamError(ValueError):
    """A request parameter that is invalid; `param` names it in the OpenAI error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(raw: dict[str, Any], name: str, default: float) -> float:
    value = raw.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def _in_range(raw: dict[str, Any], name: str, default: float, low: float, high: float,
              low_open: bool = False) -> float:
    value = _number(raw, name, default)
    if value < low or value > high or (low_open and value == low):
        raise ParamError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}", name)
    return value


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON object keys are strings) to biases in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids", "logit_bias")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise ParamError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        bias[token] = _in_range({"logit_bias": amount}, "logit_bias", 0.0, -100.0, 100.0)
    return bias


def _flag(raw: dict[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ParamError(f"{name} must be a boolean, got {value!r}", name)
    return value


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ParamError("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ParamError(f"stop allows at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters", "stop")
    return list(dict.fromkeys(stops))


def _token_ids(value: Any, vocab_size: int, name: str) -> list[int]:
    if value is None:
        return []
    if (not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS
            or not all(_is_int(t) and 0 <= t < vocab_size for t in value)):
        raise ParamError(f"{name} must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab_size})",
                         name)
    return value


def validate_sampling(
    raw: dict[str, Any], prompt_tokens: int, context_length: int, vocab_size: int, eos_token_ids: list[int]
) -> SamplingParams:
    """Check every raw parameter's type and range and fill defaults; raise ParamError on the first bad one.

    Without `max_new_tokens` the request may use the rest of the context window. Clamps: a temperature below
    1e-5 samples greedily (the sampler's GREEDY_BELOW), a top_k at or above the vocabulary size is off.
    """
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise ParamError(f"unknown sampling parameter {unknown[0]!r}", unknown[0])
    temperature = _number(raw, "temperature", 1.0)
    if temperature < 0:
        raise ParamError(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = _number(raw, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ParamError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = raw.get("top_k", -1)
    top_k = -1 if top_k is None else top_k
    if not _is_int(top_k) or top_k < -1:
        raise ParamError(f"top_k must be an integer >= 1, or -1/0 to disable, got {top_k!r}", "top_k")
    if top_k >= vocab_size:
        top_k = -1
    seed = raw.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise ParamError(f"seed must be an integer in [0, 2^63), got {seed!r}", "seed")

    remaining = context_length - prompt_tokens
    max_new = raw.get("max_new_tokens")
    if max_new is None:
        if remaining < 1:
            raise ParamError(
                f"the prompt has {prompt_tokens} tokens, which leaves no room in the context length of "
                f"{context_length}", "messages")
        max_new = remaining
    elif not _is_int(max_new) or max_new < 1:
        raise ParamError(f"max_tokens must be an integer >= 1, got {max_new!r}", "max_tokens")
    elif prompt_tokens + max_new > context_length:
        raise ParamError(
            f"this model's maximum context length is {context_length} tokens, but {prompt_tokens + max_new} "
            f"were requested ({prompt_tokens} in the prompt, {max_new} for the completion)", "max_tokens")

    min_new = raw.get("min_new_tokens", 0)
    min_new = 0 if min_new is None else min_new
    if not _is_int(min_new) or not 0 <= min_new <= max_new:
        raise ParamError(f"min_tokens must be an integer in [0, max_tokens={max_new}], got {min_new!r}", "min_tokens")
    top_logprobs = raw.get("top_logprobs_num", 0)
    top_logprobs = 0 if top_logprobs is None else top_logprobs
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ParamError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}",
                         "top_logprobs")
    ignore_eos = _flag(raw, "ignore_eos", False)
    stop_ids = _token_ids(raw.get("stop_token_ids"), vocab_size, "stop_token_ids")
    if not ignore_eos:
        stop_ids = stop_ids + [t for t in eos_token_ids if t not in stop_ids]
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1,
        min_p=_in_range(raw, "min_p", 0.0, 0.0, 1.0),
        frequency_penalty=_in_range(raw, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_in_range(raw, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_in_range(raw, "repetition_penalty", 1.0, 0.0, 2.0, low_open=True),
        logit_bias=_logit_bias(raw.get("logit_bias"), vocab_size),
        seed=seed,
        stop=_stop_strings(raw.get("stop")),
        stop_token_ids=stop_ids,
        skip_special_tokens=_flag(raw, "skip_special_tokens", True),
        no_stop_trim=_flag(raw, "no_stop_trim", False),
        return_logprob=_flag(raw, "return_logprob", False) or top_logprobs > 0,
        top_logprobs_num=top_logprobs,
    )
