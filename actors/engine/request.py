"""The engine's per-request state: its tokens, how many have KV in the pool, and its place in the cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bus.params import SamplingParams
from kernels.sampling import PenaltyState, SamplingRow


@dataclass(eq=False)
class Req:
    """One live request.

    `ids` is the prompt followed by the output applied so far (seen on the host). `device_len` counts the
    tokens the request has on the device: `ids` plus the one a launched step is still sampling (at most one;
    the token ids themselves are on its row of `TokenTable.ids`). Its first `cached_len` tokens have slots on
    table row `row`; of those, the first `prefix_len` belong to the prefix cache (locked through
    `prefix_handle`) and the rest are the request's own. The tokens to compute next are
    `[cached_len, device_len)`: the whole uncached sequence (in chunks) after admission or retraction, a
    single token while decoding.
    """

    rid: str
    prompt_len: int
    ids: list[int]
    params: SamplingParams
    seed: int
    cached_len: int = 0
    row: int | None = None
    prefix_handle: Any = None  # a PrefixHandle while the request holds a row
    prefix_len: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission (for usage)
    admitted: bool = False  # has been admitted at least once
    first_row_sent: bool = False
    penalties: PenaltyState | None = None
    arrived_at: float = field(default_factory=time.monotonic)
    queue_time: float | None = None  # seconds from arrival to first admission, once admitted
    device_len: int = field(init=False)  # len(ids) + the token in flight, advanced when a sampling step launches

    def __post_init__(self) -> None:
        self.device_len = len(self.ids)

    @property
    def seq_len(self) -> int:
        return len(self.ids)

    @property
    def output_len(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def uncached_len(self) -> int:
        """Tokens still to compute before this request can sample again."""
        return self.device_len - self.cached_len

    def ends_by_length(self, context_length: int) -> bool:
        """Whether the tokens it has on the device already end it by length (max_new_tokens or a full
        context): once they are applied it finishes, so it must not be scheduled again."""
        return self.device_len - self.prompt_len >= self.params.max_new_tokens or self.device_len >= context_length

    def sampling_row(self) -> SamplingRow:
        """This request's settings for drawing its next token, in the shape `kernels.sampling` takes."""
        p = self.params
        position = self.device_len - self.prompt_len  # the output index of the token being drawn
        banned = p.stop_token_ids if position < p.min_new_tokens and p.stop_token_ids else None
        return SamplingRow(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias or None, banned_ids=banned,
            penalties=self.penalties, seed=self.seed, position=position,
            num_top_logprobs=p.top_logprobs_num if p.return_logprob else -1,
        )
