"""Incremental detokenization of one request's output, with SGLang's offsets and stop-string hold-back.

`IncrementalDecoder.feed` turns newly generated token ids into a text delta that is safe to send: never a
partial UTF-8 character and never any part of a stop string that may still be trimmed. The scheduler alone
decides that a stop string matched (it reports it in the finish reason of the token that completes it); the
decoder only holds back text that could be the start of one, and on finish cuts at the matched string. The
concatenated deltas equal a one-shot `tokenizer.decode` of the same ids with the same trimming, for any split
of the ids into feeds.

Token coordinates follow SGLang's DecodeStatus. `read_offset` ends the committed tokens; `surr_offset` starts
the "surrounding" tokens of the previous commit, kept only as decode context (tokenizers that drop a leading
space need it). Each step decodes `ids[surr:read]` and `ids[surr:]`; the difference is the new text. Ids
before `surr_offset` are dropped, so the cost of a step depends on the chunk size, never on the output
length. Committed text stays in a small unsent buffer only while it could be the start of a stop string;
because such text is always held back, a matched stop string begins inside that buffer.

With a reasoning plan (`DecodeParams.reasoning`), `feed_split` splits the released text into the thinking and
the answer (`reasoning_split.py`), so the split sees only text that stop strings have already trimmed.
"""

from __future__ import annotations

from typing import Any

from ringserve.actors.detokenizer.held_text import held_suffix
from ringserve.actors.detokenizer.reasoning_split import ReasoningSplitter
from ringserve.bus.messages import DecodeParams, FinishReason

REPLACEMENT_CHAR = "\ufffd"  # what decode yields for an incomplete or invalid UTF-8 sequence
MAX_PENDING_TOKENS = 4  # a valid character's bytes span at most 4 tokens; past that the bytes are invalid


class IncrementalDecoder:
    """One request's decode state: feed token ids, get sendable text deltas back.

    `ids` holds only `ids[surr_offset:]` of the request's output; `surr_offset` and `read_offset` are
    token indices into the whole output.
    """

    def __init__(self, tokenizer: Any, params: DecodeParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._stops = [s for s in params.stop if s]
        self.ids: list[int] = []
        self.surr_offset = 0
        self.read_offset = 0
        self._stable = 0  # chars of the pending text (after read_offset) already moved to _unsent
        self._stall = 0  # token index where the pending text last completed a character
        self._unsent = ""  # committed text not yet sent: a possible stop-string start
        self._done = False
        self._split = None if params.reasoning is None else ReasoningSplitter(params.reasoning)

    def feed(self, token_ids: list[int], finish: FinishReason | None = None) -> str:
        """Add newly generated ids; return the text now safe to send (the final delta when `finish` is given).

        Raises RuntimeError once finished.
        """
        if self._done:
            raise RuntimeError("IncrementalDecoder.feed after finish")
        self._done = finish is not None
        ids = list(token_ids)
        matched = finish.matched if finish is not None and finish.type == "stop" else None
        if isinstance(matched, int) and not isinstance(matched, bool) and ids and ids[-1] == matched:
            ids.pop()  # the stop token (EOS or a stop_token_id) is never part of the text
        if not ids and finish is None:
            return ""
        self.ids.extend(ids)
        text = self._pending_text(self._end())
        if finish is not None:
            # bytes of a character cut off by the end of generation will never complete: drop them
            text = text.rstrip(REPLACEMENT_CHAR)
        if finish is None and text.endswith(REPLACEMENT_CHAR):
            stable = len(text.rstrip(REPLACEMENT_CHAR))
            if stable > self._stable:  # characters before the incomplete tail are final: release them
                self._unsent += text[self._stable : stable]
                self._stable, self._stall = stable, self._end()
            elif self._end() - self._stall > MAX_PENDING_TOKENS:
                # No character completed in that many tokens: the bytes are invalid. Commit all but the last
                # 3 tokens, which may hold the start of a valid character (SGLang #34740: never committing).
                cut = self._end() - MAX_PENDING_TOKENS + 1
                self._commit(cut, self._pending_text(cut))
        else:
            self._commit(self._end(), text)
        return self._release(finish, matched if isinstance(matched, str) else None)

    def feed_split(self, token_ids: list[int], finish: FinishReason | None = None) -> tuple[str, str]:
        """`feed`, its text split into (reasoning, answer) by the request's reasoning plan; without a plan the
        reasoning is always empty and the answer is `feed`'s text."""
        text = self.feed(token_ids, finish)
        if self._split is None:
            return "", text
        return self._split.feed(text, finish is not None)

    def _end(self) -> int:
        """Token index just past the last fed id."""
        return self.surr_offset + len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._params.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _pending_text(self, end: int) -> str:
        """Text of the ids in [read_offset, end): decode(ids[surr:end]) minus decode(ids[surr:read])."""
        prefix = self._decode(self.ids[: self.read_offset - self.surr_offset])
        return self._decode(self.ids[: end - self.surr_offset])[len(prefix) :]

    def _commit(self, end: int, text: str) -> None:
        """Move the rest of `text` (the ids up to `end`) to `_unsent`, advance the offsets, drop old ids."""
        self._unsent += text[self._stable :]
        del self.ids[: self.read_offset - self.surr_offset]
        self.surr_offset = self.read_offset
        self.read_offset = self._stall = end
        self._stable = 0

    def _release(self, finish: FinishReason | None, matched: str | None) -> str:
        """Return the sendable part of `_unsent`: on finish all of it, cut at the matched stop string; before
        that, all but a suffix that may be the start of a stop string."""
        text = self._unsent
        if finish is None:
            # Hold back a possible stop-string start, and a whole one too: its finish is on its way.
            starts = [i for i in (text.find(s) for s in self._stops) if i >= 0]
            cut = min(starts) if starts else len(text) - held_suffix(text, self._stops)
            self._unsent = text[cut:]
            return text[:cut]
        self._unsent = ""
        start = text.find(matched) if matched else -1
        if start < 0:
            return text
        return text[: start + len(matched)] if self._params.no_stop_trim else text[:start]
