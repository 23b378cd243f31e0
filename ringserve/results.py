"""What a generation returns: `/generate`'s result shape (`text`, `output_ids`, `meta_info`), built from the ring's
`RequestOutput` deltas, for one request, a streamed delta, and a chat completion; a chat request's thinking (the
ring's `RequestOutput.reasoning_text`) is `reasoning_text`, apart from the answer's `text`.

`meta_info` holds what `/generate` puts there: `id`, `finish_reason` (`{"type", "matched", "error"}`, None while
unfinished), `prompt_tokens`, `completion_tokens`, `cached_tokens`; with `return_prompt_ids` the
`prompt_token_ids`; with `return_logprob` (or `top_logprobs_num`) SGLang's `input_token_logprobs`,
`input_top_logprobs`, `output_token_logprobs` and `output_top_logprobs` (`[logprob, token_id, text]` each).
Both it and `actors/entry/native/generate.py` build it with `actors/entry/native/meta.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.entry.native.meta import meta_info
from ringserve.bus.messages import RequestOutput, TokenLogprob


@dataclass
class GenerateResult:
    """One request's result, as `/generate` answers it. Also readable as a dict (`result["text"]`), as SGLang's
    `Engine.generate` returns it. `reasoning_text`: a chat request's thinking (a reasoning model served with a
    reasoning parser), apart from `text`, the answer; empty when the model did not think."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    reasoning_text: str = ""

    @classmethod
    def from_outputs(cls, rid: str, outputs: list[RequestOutput], sampling: dict[str, Any]) -> "GenerateResult":
        """The result of request `rid` from all its outputs (the last one terminal)."""
        entries = [e for out in outputs for e in out.logprobs]
        return cls(text="".join(out.text for out in outputs),
                   output_ids=[t for out in outputs for t in out.token_ids],
                   meta_info=meta_info(rid, outputs[-1], entries, outputs[0], sampling),
                   reasoning_text="".join(out.reasoning_text for out in outputs))

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        """`{"type": "stop"|"length"|"abort", "matched": ..., "error": ...}` (`meta_info["finish_reason"]`)."""
        return self.meta_info["finish_reason"]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `/generate` answers (with `reasoning_text` when there was thinking)."""
        body = {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info}
        return {**body, "reasoning_text": self.reasoning_text} if self.reasoning_text else body

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]


@dataclass
class GenerateDelta:
    """A streamed piece of a result: the text and output ids new since the previous delta of the same request,
    and its meta_info so far (`finish_reason` set on its last delta). `index`: which prompt of a list."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int = 0
    reasoning_text: str = ""  # a chat request's new thinking (`text` is then only the answer's)

    @classmethod
    def from_output(cls, rid: str, out: RequestOutput, sampling: dict[str, Any], index: int = 0) -> "GenerateDelta":
        """The delta of one output (as `/generate` streams it with `"stream_deltas": true`)."""
        return cls(out.text, list(out.token_ids), meta_info(rid, out, out.logprobs, out, sampling), index,
                   out.reasoning_text)

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        """`{"type": "stop"|"length"|"abort", "matched": ..., "error": ...}` on a request's last delta, else None
        (the same as `meta_info["finish_reason"]`)."""
        return self.meta_info["finish_reason"]

    @property
    def finished(self) -> bool:
        """Whether this is the request's last delta."""
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        body = {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info, "index": self.index}
        return {**body, "reasoning_text": self.reasoning_text} if self.reasoning_text else body

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]


@dataclass
class ChatResult(GenerateResult):
    """A chat completion: `text` is the assistant message's content, `reasoning_text` its thinking
    (`message["reasoning_content"]`), `message` the message (with `tool_calls` when the model called tools),
    `response` the whole `/v1/chat/completions` body."""

    message: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])
