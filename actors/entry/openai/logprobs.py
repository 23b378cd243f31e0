"""Ring logprobs (`TokenLogprob` entries, parallel to a delta's token ids) in OpenAI's two response shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}] or null, "text_offset"}`.
Every generated token has an entry, the stop token (EOS) too, although its text is empty.
"""

from __future__ import annotations

import math
from typing import Any

from ringserve.bus.messages import TokenLogprob, TopLogprob

# what OpenAI reports for a token the sampler could never pick (JSON has no -Infinity)
FLOOR_LOGPROB = -9999.0


def finite(logprob: float | None) -> float | None:
    """`logprob` as a JSON-safe number: -inf (and NaN) become FLOOR_LOGPROB; None (the prompt's first token,
    which nothing predicts) stays null."""
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def token_bytes(token: str, raw: list[int] | None = None) -> list[int]:
    """OpenAI's `bytes` field: the token's raw bytes as the detokenizer found them (exact for a token that
    holds part of a character), else the UTF-8 byte values of its text (outputs of older detokenizers)."""
    return list(raw) if raw is not None else list(token.encode("utf-8", errors="replace"))


def _chat_entry(entry: TokenLogprob | TopLogprob, as_ids: bool) -> dict[str, Any]:
    return {"token": _name(entry, as_ids), "logprob": finite(entry.logprob),
            "bytes": token_bytes(entry.token, entry.bytes)}


def _name(entry: TokenLogprob | TopLogprob, as_ids: bool) -> str:
    """How a token is named in logprobs: its text, or vLLM's `token_id:<id>` (`return_tokens_as_token_ids`,
    for tokens whose text is not unique or not valid UTF-8 on its own)."""
    return f"token_id:{entry.token_id}" if as_ids else entry.token


class LogprobFormatter:
    """Formats one choice's logprob entries, delta by delta; keeps the completion text offset between deltas.

    `requested`: the client asked for logprobs (else `format` returns None, OpenAI's `logprobs: null`);
    `top`: it asked for alternatives (completions' `top_logprobs` is null without them); `as_ids`: tokens are
    named `token_id:<id>` (text offsets still count the tokens' text).
    """

    def __init__(self, kind: str, requested: bool, top: bool, as_ids: bool = False) -> None:
        self.kind = kind
        self.requested = requested
        self.top = top
        self.as_ids = as_ids
        self.text_offset = 0

    def format(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """The `logprobs` object of a choice (or of a stream chunk) holding `entries`."""
        if not self.requested:
            return None
        ids = self.as_ids
        if self.kind == "chat":
            return {"content": [{**_chat_entry(e, ids), "top_logprobs": [_chat_entry(t, ids) for t in e.top]}
                                for e in entries]}
        offsets = []
        for entry in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(entry.token)
        return {
            "tokens": [_name(e, ids) for e in entries],
            "token_logprobs": [finite(e.logprob) for e in entries],
            "top_logprobs": [{_name(t, ids): finite(t.logprob) for t in e.top} if e.logprob is not None else None
                             for e in entries] if self.top else None,
            "text_offset": offsets,
        }


def vllm_prompt_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else `{token id: {logprob, rank,
    decoded_token}}` holding the token itself and its alternatives (1-based ranks)."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        item = {str(t.token_id): {"logprob": finite(t.logprob), "rank": rank, "decoded_token": t.token}
                for rank, t in enumerate(e.top, 1)}
        item[str(e.token_id)] = {"logprob": finite(e.logprob), "rank": e.rank, "decoded_token": e.token}
        out.append(item)
    return out
