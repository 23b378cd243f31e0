"""Validation of a request's raw sampling parameters into a `SamplingParams` the scheduler can trust."""

from __future__ import annotations

import math
from typing import Any

from bus.messages import SamplingParams

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1
_KNOWN = {
    "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "no_stop_trim",
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
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in value):
        raise ParamError(f"{name} must be a list of token ids in [0, {vocab_size})", name)
    return value


def validate_sampling(
    raw: dict[str, Any], prompt_tokens: int, context_length: int, vocab_size: int, eos_token_ids: list[int]
) -> SamplingParams:
    """Check every raw parameter's type and range and fill defaults; raise ParamError on the first bad one.

    Without `max_new_tokens` the request may use the rest of the context window.
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

    ignore_eos = _flag(raw, "ignore_eos", False)
    stop_ids = _token_ids(raw.get("stop_token_ids"), vocab_size, "stop_token_ids")
    if not ignore_eos:
        stop_ids = stop_ids + [t for t in eos_token_ids if t not in stop_ids]
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1,
        seed=seed,
        stop=_stop_strings(raw.get("stop")),
        stop_token_ids=stop_ids,
        skip_special_tokens=_flag(raw, "skip_special_tokens", True),
        no_stop_trim=_flag(raw, "no_stop_trim", False),
    )
