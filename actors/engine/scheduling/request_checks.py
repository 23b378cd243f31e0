"""Why the engine cannot run a request: the checks `EngineCore.add_request` makes before queueing it."""

from __future__ import annotations

from collections.abc import Container

from ringserve.actors.engine.core.reasoning_gate import plan_error
from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.messages import TokenizedRequest


def request_error(request: TokenizedRequest, live: Container[str], vocab_size: int, context_length: int,
                  num_slots: int, has_tokenizer: bool) -> ApiError | None:
    """The error (naming the parameter and the numbers involved) that stops `request`, or None when it can run;
    `live`: the rids the engine holds."""
    ids, params = request.input_ids, request.sampling
    if request.rid in live:
        return ApiError(f"request id {request.rid!r} is already in use by a live request", param="rid")
    if not ids:
        return ApiError("the prompt is empty", param="input_ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return ApiError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="input_ids")
    if params.max_new_tokens < 0:
        return ApiError(f"max_new_tokens must be at least 0, got {params.max_new_tokens}", param="max_new_tokens")
    if params.wants_prompt_logprobs and params.logprob_start_len >= len(ids):
        return ApiError(f"logprob_start_len must be less than the prompt's {len(ids)} tokens, got "
                        f"{params.logprob_start_len}", param="logprob_start_len")
    total = len(ids) + params.max_new_tokens
    for limit, what in ((context_length, "the context length"), (num_slots, "the KV pool")):
        if total > limit:
            return ApiError(f"{len(ids)} prompt tokens + {params.max_new_tokens} max_new_tokens = {total} "
                            f"exceeds {what} ({limit} tokens)", param="max_new_tokens")
    if any(not s for s in params.stop):
        return ApiError("stop strings must not be empty", param="stop")
    if params.stop and not has_tokenizer:
        return server_error("stop strings need a tokenizer, and this engine has none")
    if request.reasoning is not None:
        why = plan_error(request.reasoning, vocab_size)
        if why is not None:
            return server_error(why)
    return None
