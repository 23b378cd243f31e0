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

    `ids` is the prompt followed by the output so far. Its first `cached_len` tokens have slots on table row
    `row`; of those, the first `prefix_len` belong to the prefix cache (locked through `prefix_handle`) and the
    rest are the request's own. The tokens to compute next are `ids[cached_len:]`: the whole uncached
    sequence (in chunks) after admission or retraction, a single token while decoding.
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
    pending: int = 0  # tokens sampled by a launched step but not yet appended to `ids` (overlap loop)

    @property
    def seq_len(self) -> int:
        return len(self.ids)

    @property
    def output_len(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    @property
    def uncached_len(self) -> int:
        """Tokens still to compute before this request can sample again."""
        return len(self.ids) - self.cached_len

    def sampling_row(self) -> SamplingRow:
        """This request's settings for drawing its next token, in the shape `kernels.sampling` takes."""
        p = self.params
        position = self.output_len + self.pending  # the output index of the token being drawn
        banned = p.stop_token_ids if position < p.min_new_tokens and p.stop_token_ids else None
        return SamplingRow(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias or None, banned_ids=banned,
            penalties=self.penalties, seed=self.seed, position=position,
            num_top_logprobs=p.top_logprobs_num if p.return_logprob else -1,
        )
