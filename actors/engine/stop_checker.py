"""Decide after each new token whether a request is finished: stop token, stop string, or length."""

from __future__ import annotations

from typing import Any

from actors.engine.request import Request
from bus.messages import FinishReason


class StopChecker:
    """Finish checks in priority order: stop token ids, stop strings, max_new_tokens / context length.

    Stop strings are searched in the decoded tail of the output. A string of `n` characters spans at most
    about `4 n` tokens (byte-fallback tokens carry a single UTF-8 byte), so decoding the last
    `4 * max_stop_len + 2` tokens always covers a match ending at the newest token; an earlier match would
    already have finished the request.
    """

    def __init__(self, tokenizer: Any | None, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length

    def check(self, req: Request) -> FinishReason | None:
        """The finish reason after `req`'s newest token, or None to keep going."""
        sampling = req.sampling
        token = req.output_ids[-1]
        if token in sampling.stop_token_ids:
            return FinishReason("stop", matched=token)
        if sampling.stop:
            matched = self._stop_string(req)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= sampling.max_new_tokens or req.seq_len >= self.context_length:
            return FinishReason("length")
        return None

    def _stop_string(self, req: Request) -> str | None:
        assert self.tokenizer is not None, "stop strings need a tokenizer (checked in Engine.add_request)"
        stops = req.sampling.stop
        tail_len = 4 * max(len(s) for s in stops) + 2
        text = self.tokenizer.decode(
            req.output_ids[-tail_len:], skip_special_tokens=req.sampling.skip_special_tokens
        )
        for stop in stops:
            if stop in text:
                return stop
        return None
