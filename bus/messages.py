"""Typed wire messages of the request ring, narrowest-first.

`GenerateRequest -> TokenizedRequest -> BatchTokenOutput -> RequestOutput`: each hop drops what the next
actor does not need. Every message is a dataclass encoded by `bus.codec`. README.md documents the schema for
clients that speak NATS directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatMessage:
    """One chat turn, already flattened to text."""

    role: str
    content: str


@dataclass
class GenerateRequest:
    """A client's request, as submitted on `{ns}.req.submit` (HTTP entry or any NATS client).

    Exactly one of `text`, `messages` (chat template applied) or `input_ids` is set. `sampling` holds the
    raw parameters as the client sent them (SGLang names: max_new_tokens, temperature, top_p, top_k, seed,
    stop, stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim); the tokenizer validates them.
    Subscribe to `{ns}.out.{rid}` before publishing, or the first outputs may be missed.
    """

    rid: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    """Validated sampling parameters; everything that affects the model is fixed here."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # EOS ids included unless ignore_eos
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class TokenizedRequest:
    """A validated, tokenized request on `{ns}.req.tokenized`, ready for the scheduler."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass
class FinishReason:
    """Why a request ended. `type` is "stop", "length" or "abort"; `matched` is the stop string or token id."""

    type: str
    matched: int | str | None = None
    message: str | None = None


@dataclass
class TokenRow:
    """One request's new tokens in one scheduler step."""

    rid: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish: FinishReason | None = None
    sampling: SamplingParams | None = None  # set on the request's first row only, for the detokenizer


@dataclass
class BatchTokenOutput:
    """Everything one scheduler step produced for one detokenizer shard: one message per step, not per token."""

    step: int
    rows: list[TokenRow]


@dataclass
class ErrorInfo:
    """An error in OpenAI's shape; `code` is the HTTP status the entry answers with."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int = 400


@dataclass
class RequestOutput:
    """A delta of one request's output on `{ns}.out.{rid}`.

    `text` and `token_ids` are new since the previous message (never repeated, never a partial UTF-8
    character, never part of a stop string). The last message has `finish` or `error` set.
    """

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: FinishReason | None = None
    error: ErrorInfo | None = None

    @property
    def is_last(self) -> bool:
        return self.finish is not None or self.error is not None


@dataclass
class AbortRequest:
    """Stop a request and free its KV at once; published on `{ns}.abort.{rid}`."""

    rid: str
    reason: str = "client"


@dataclass
class InfoQuery:
    """Request body for control queries such as `{ns}.control.scheduler.info`."""

    detail: bool = False


@dataclass
class SchedulerInfo:
    """Scheduler load as reported on `{ns}.control.scheduler.info`."""

    rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    kv_used_tokens: int
    kv_total_tokens: int
    context_length: int
    step: int
    model: str


@dataclass
class Accepted:
    """Reply to a submission sent as a NATS request: the next actor has taken the request.

    The entry submits with request/reply, so a ring with no tokenizer or scheduler answers at once
    ("no responders") or not at all (a timeout) instead of leaving the client waiting for outputs forever.
    """

    rid: str


@dataclass
class ActorReady:
    """An actor announces it is serving, on `{ns}.control.ready`."""

    role: str
    rank: int
    pid: int
    detail: dict[str, Any] = field(default_factory=dict)
