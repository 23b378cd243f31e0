"""The engine's own request and output types; the scheduler actor maps them to and from bus messages."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationParams:
    """What the engine needs of a request's validated parameters (the tokenizer actor validated them)."""

    max_new_tokens: int
    min_new_tokens: int = 0  # no stop token or stop string ends the request before this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # None: a random seed is drawn at admission
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True  # how stop strings are searched in the decoded text
    return_logprob: bool = False
    top_logprobs_num: int = 0

    @property
    def uses_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


@dataclass
class EngineRequest:
    """A tokenized request handed to `Engine.add_request`."""

    rid: str
    input_ids: list[int]
    params: GenerationParams


@dataclass
class Finish:
    """Why a request ended: "stop" (`matched` is the stop token id or string), "length", "abort", or "error"
    (`message` says what failed; the request's own failure, the engine goes on)."""

    type: str
    matched: int | str | None = None
    message: str | None = None


@dataclass
class Rejection:
    """Why the engine refused a request, in the terms of the API error it becomes (`code` is an HTTP status)."""

    message: str
    param: str | None = None
    code: int = 400
    type: str = "invalid_request_error"


@dataclass
class TokenOutput:
    """One request's new tokens from one step (or its final, token-less row after an abort).

    `first` marks the request's first row, which also carries the request's `queue_time`.
    `logprobs`/`top_ids`/`top_logprobs` run parallel to `token_ids` when the request asked for logprobs, else
    they are empty.
    """

    rid: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish: Finish | None = None
    first: bool = False
    queue_time: float | None = None  # first row of an admitted request: seconds it waited to be admitted
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass
class StepPlan:
    """What one step ran, as plain data for the scheduler's tracing: the decode rids, then each prefill row's
    rid with the prompt positions `[start, start + length)` it computed (a chunk when it ends before the prompt)."""

    decode_rids: list[str]
    prefill: list[tuple[str, int, int]]  # (rid, start, length)
    num_tokens: int
