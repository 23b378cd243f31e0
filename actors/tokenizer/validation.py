"""Validation of a request's raw sampling parameters into a `SamplingParams` the scheduler can trust.

Each value is checked against its declaration in `ringserve.bus.params` (`Spec.check`: type, range, shape); only the
rules that relate parameters to each other or to the model (context length, vocabulary, EOS ids) are written
out here. Every failure is an `ApiError` naming the parameter. A parameter the request leaves out takes the
model's default where it has one (`--generation-config auto`: generation_defaults.py), else the declared one.
"""

from __future__ import annotations

from typing import Any

from ringserve.bus.errors import ApiError, quote
from ringserve.bus.params import GRAMMAR_PARAMS, SPECS, SamplingParams, default_of


def validate_sampling(
    raw: dict[str, Any], prompt_tokens: int, context_length: int, vocab_size: int, eos_token_ids: list[int],
    openai_names: bool = True, defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Check every raw parameter and fill defaults; raise ApiError on the first bad one, naming it by its
    OpenAI name (`openai_names`) or its native one. `defaults`: the model's own defaults (checked values by
    native name), which a parameter the request leaves out takes instead of the declared one.

    Without `max_new_tokens` the request may use the rest of the context window (at most the model's default
    `max_new_tokens`, if it has one). Normalised: a top_k of 0 or at or above the vocabulary size is off (-1); EOS
    ids join `stop_token_ids` unless `ignore_eos`; `top_logprobs_num` > 0 implies `return_logprob`.
    """
    unknown = sorted((str(name) for name in set(raw) - SPECS.keys()))
    if unknown:
        raise ApiError(f"unknown sampling parameter {quote(unknown[0])}", param=unknown[0])
    defaults = defaults or {}
    values = {name: defaults.get(name, default_of(name)) if raw.get(name) is None
              else spec.check(raw[name], vocab_size, openai_names) for name, spec in SPECS.items()}
    default_max = values["max_new_tokens"] if raw.get("max_new_tokens") is None else None
    if default_max is not None:  # the model's default length: cut to what the context leaves, never refused
        values["max_new_tokens"] = None
    params = SamplingParams(**values)
    _check_lengths(params, prompt_tokens, context_length, openai_names, default_max)
    if params.top_k == 0 or params.top_k >= vocab_size:
        params.top_k = -1
    if not params.ignore_eos:
        params.stop_token_ids += [t for t in eos_token_ids if t not in params.stop_token_ids]
    params.return_logprob = params.return_logprob or params.top_logprobs_num > 0
    _check_prompt_logprobs(params, prompt_tokens)
    constraints = [name for name in GRAMMAR_PARAMS if getattr(params, name) is not None]
    if len(constraints) > 1:
        raise ApiError(f"give at most one output constraint, got {' and '.join(constraints)}", param=constraints[1])
    return params


def _check_prompt_logprobs(params: SamplingParams, prompt_tokens: int) -> None:
    """`logprob_start_len` asks for logprobs, and falls inside the prompt."""
    start = params.logprob_start_len
    if start < 0:
        return
    if not params.return_logprob:
        raise ApiError("logprob_start_len needs return_logprob", param="logprob_start_len")
    if start >= prompt_tokens:
        raise ApiError(f"logprob_start_len must be less than the prompt's {prompt_tokens} tokens, got {start}",
                       param="logprob_start_len")


def _check_lengths(params: SamplingParams, prompt_tokens: int, context_length: int, openai_names: bool,
                   default_max: int | None = None) -> None:
    """max_new_tokens fits the context (and defaults to what is left of it, at most `default_max`);
    min_new_tokens <= max_new_tokens."""
    max_name, min_name = SPECS["max_new_tokens"].label(openai_names), SPECS["min_new_tokens"].label(openai_names)
    if params.max_new_tokens is None:
        remaining = context_length - prompt_tokens
        if remaining < 1:
            raise ApiError(f"the prompt has {prompt_tokens} tokens, which leaves no room in the context length of "
                           f"{context_length}", param="messages")
        params.max_new_tokens = remaining if default_max is None else min(remaining, default_max)
    elif prompt_tokens + params.max_new_tokens > context_length:
        raise ApiError(
            f"this model's maximum context length is {context_length} tokens, but "
            f"{prompt_tokens + params.max_new_tokens} were requested ({prompt_tokens} in the prompt, "
            f"{params.max_new_tokens} for the completion)", param=max_name)
    if params.min_new_tokens > params.max_new_tokens:
        raise ApiError(f"{min_name} must be at most {max_name}={params.max_new_tokens}, got {params.min_new_tokens}",
                       param=min_name)
