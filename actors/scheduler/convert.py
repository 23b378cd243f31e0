"""The one place where bus messages become engine types and back (the engine knows nothing of the bus)."""

from __future__ import annotations

import dataclasses

from actors.engine.types import EngineRequest, Finish, GenerationParams, Rejection, TokenOutput
from bus.messages import DecodeParams, ErrorInfo, FinishReason, TokenizedRequest, TokenRow

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationParams))


def engine_request(req: TokenizedRequest) -> EngineRequest:
    """A tokenized request as the engine takes it."""
    params = GenerationParams(**{name: getattr(req.sampling, name) for name in _PARAM_FIELDS})
    return EngineRequest(rid=req.rid, input_ids=req.input_ids, params=params)


def error_info(rejection: Rejection) -> ErrorInfo:
    """An engine rejection as the API error the client receives."""
    return ErrorInfo(message=rejection.message, type=rejection.type, param=rejection.param, code=rejection.code)


def finish_reason(finish: Finish | None) -> FinishReason | None:
    return None if finish is None else FinishReason(type=finish.type, matched=finish.matched, message=finish.message)


def token_row(out: TokenOutput, decode: DecodeParams | None) -> TokenRow:
    """An engine output row as the detokenizer's `TokenRow`; `decode` goes on a request's first row only."""
    return TokenRow(rid=out.rid, token_ids=out.token_ids, prompt_tokens=out.prompt_tokens,
                    completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
                    finish=finish_reason(out.finish), decode=decode, logprobs=out.logprobs, top_ids=out.top_ids,
                    top_logprobs=out.top_logprobs, queue_time=out.queue_time)
