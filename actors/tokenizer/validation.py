"""Validation of a request's raw sampling parameters into a `SamplingParams` the scheduler can trust.

Each value is checked against its declaration in `ringserve.bus.params` (`Spec.check`: type, range, shape); only the
rules that relate parameters to each other or to the model (context length, vocabulary, EOS ids) are written
out here. Every failure is an `ApiError` naming the parameter. A parameter the request leaves out takes the
model's default where it has one (`--generation-config auto`: generation_defaults.py), else the declared one.
"""

from __future__ import annotations

from typing import Any

from ringserve.bus.errors import ApiError, quote
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.params import GRAMMAR_PARAMS, SPECS, SamplingParams, default_of


def prompt_param(req: GenerateRequest) -> str:
    """The request field its prompt came in, for an error about the prompt itself: `input` (embeddings),
    `messages` (chat, Messages; the Responses route renames it `input`), `input_ids` (token ids), else `prompt`
    (OpenAI completions) or `text` (`/generate` and other native requests)."""
    if req.embed is not None:
        return "input"
    if req.messages is not None:
        return "messages"
    if req.input_ids is not None:
        return "input_ids"
    return "prompt" if req.openai_names else "text"


def validate_sampling(
    raw: dict[str, Any], prompt_tokens: int, context_length: int, vocab_size: int, eos_token_ids: list[int],
    openai_names: bool = True, defaults: dict[str, Any] | None = None, prompt_field: str = "prompt",
) -> SamplingParams:
    """Check every raw parameter and fill defaults; raise ApiError on the first bad one, naming it by its
    OpenAI name (`openai_names`) or its native one. `defaults`: the model's own defaults (checked values by
    native name), which a parameter the request leaves out takes instead of the declared one. `prompt_field`:
    the field a prompt too long for the context is named by (`prompt_param`).

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
    _check_lengths(params, prompt_tokens, context_length, openai_names, default_max, prompt_field)
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
                   default_max: int | None = None, prompt_field: str = "prompt") -> None:
    """The prompt leaves room in the context (else an error naming `prompt_field`), max_new_tokens fits what it
    leaves (else an error naming max_new_tokens; without it, it is what is left, at most `default_max`);
    min_new_tokens <= max_new_tokens."""
    max_name, min_name = SPECS["max_new_tokens"].label(openai_names), SPECS["min_new_tokens"].label(openai_names)
    wanted = 1 if params.max_new_tokens is None else min(params.max_new_tokens, 1)  # 0: prefill only (embeddings)
    if prompt_tokens + wanted > context_length:
        room = "is longer than" if prompt_tokens > context_length else "leaves no room for output in"
        raise ApiError(f"the prompt is {prompt_tokens} tokens, which {room} this model's maximum "
                       f"context length of {context_length} tokens: shorten it", param=prompt_field)
    if params.max_new_tokens is None:
        remaining = context_length - prompt_tokens
        params.max_new_tokens = remaining if default_max is None else min(remaining, default_max)
    elif prompt_tokens + params.max_new_tokens > context_length:
        raise ApiError(
            f"this model's maximum context length is {context_length} tokens, but "
            f"{prompt_tokens + params.max_new_tokens} were requested ({prompt_tokens} in the prompt, "
            f"{params.max_new_tokens} for the completion)", param=max_name)
    if params.min_new_tokens > params.max_new_tokens:
        raise ApiError(f"{min_name} must be at most {max_name}={params.max_new_tokens}, got {params.min_new_tokens}",
                       param=min_name)
