"""Decide after each new token whether a request is finished: stop token, stop string, or length.

This is the only place stop strings are decided; the detokenizer just trims the string it is told matched.
"""

from __future__ import annotations

import logging
from typing import Any

from ringserve.actors.engine.core.request import Req
from ringserve.bus.errors import server_error
from ringserve.bus.messages import FinishReason

log = logging.getLogger("engine")


class StopChecker:
    """Finish checks in priority order: stop token ids, stop strings, max_new_tokens / context length.

    Neither stop tokens nor stop strings end a request before `min_new_tokens`. Stop strings are searched in
    the decoded tail of the output. A string of `n` characters spans at most about `4 n` tokens (byte-fallback
    tokens carry a single UTF-8 byte), so decoding the last `4 * max_stop_len + 2` tokens always covers a
    match ending at the newest token; an earlier match would already have finished the request.
    """

    def __init__(self, tokenizer: Any | None, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length

    def verdict(self, req: Req) -> FinishReason | None:
        """`check`, and a grammar that has ended ends the request; a failing check ends this request only
        (with an "error" finish), never the step."""
        try:
            finish = self.check(req)
        except Exception as exc:
            log.exception("stop check failed for %s", req.rid)
            return FinishReason("error", error=server_error(f"checking the stop conditions failed: {exc!r}"))
        if finish is None and req.matcher is not None and req.matcher.is_terminated():
            finish = FinishReason("stop", matched=req.ids[-1])
        return finish

    def check(self, req: Req) -> FinishReason | None:
        """The finish reason after `req`'s newest token, or None to keep going."""
        params = req.params
        if req.output_len >= params.min_new_tokens:
            token = req.ids[-1]
            if token in params.stop_token_ids:
                return FinishReason("stop", matched=token)
            if params.stop:
                matched = self._stop_string(req)
                if matched is not None:
                    return FinishReason("stop", matched=matched)
        if req.output_len >= params.max_new_tokens or req.seq_len >= self.context_length:
            return FinishReason("length")
        return None

    def _stop_string(self, req: Req) -> str | None:
        assert self.tokenizer is not None, "stop strings need a tokenizer (checked in EngineCore.add_request)"
        stops = req.params.stop
        tail_len = min(4 * max(len(s) for s in stops) + 2, req.output_len)
        text = self.tokenizer.decode(req.ids[-tail_len:], skip_special_tokens=req.params.skip_special_tokens)
        for stop in stops:
            if stop in text:
                return stop
        return None
