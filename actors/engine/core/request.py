"""The engine's per-request state: its tokens, how many have KV in the pool, and its place in the cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.engine.core.embedding import EmbedState
from ringserve.actors.engine.core.reasoning_gate import ReasoningGate
from ringserve.bus.kv_blocks import cache_namespace
from ringserve.bus.params import SamplingParams
from ringserve.bus.reasoning import ReasoningPlan
from ringserve.kernels.sampling import PenaltyState, SamplingRow


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
    matcher: Any = None  # a GrammarMatcher while the request has an output constraint (actors/engine/scheduling/grammar.py)
    reasoning: ReasoningPlan | None = None  # its output opens with thinking (bus/reasoning.py; on its first row)
    gate: ReasoningGate | None = None  # its thinking phase, until it answers, where the plan matters to the engine
    # logprob_start_len: the prompt tokens' logprobs, gathered chunk by chunk until the first row carries them
    prompt_logprobs: PromptLogprobs | None = None
    spec_drafted: int = 0  # speculative decoding: draft tokens verified for this request, and accepted
    spec_accepted: int = 0
    embed: EmbedState | None = None  # an embedding request's pooling (actors/engine/core/embedding.py)
    lora_cache_name: str | None = None  # its adapter's cache name (LoraPool.cache_name), set on admission
    rope_floor: int = 0  # a length-dependent rotary turns its tokens for max(position + 1, rope_floor) (rope.py)
    rope_cache_name: str | None = None  # RopeLengthRule.cache_name of that floor
    images: list[Any] = field(default_factory=list)  # its `ReqImage`s in prompt order (scheduling/images.py)
    rope_shift: int = 0  # M-RoPE: rope position minus position after its last image (batch.rope_positions)
    image_key: list[int] | None = None  # its prompt as the prefix cache keys it, when it has images

    def key_ids(self, end: int) -> list[int]:
        """Its first `end` token ids as the prefix cache keys them: image tokens as their image's pseudo ids
        (`images.image_key`), so KV is shared only between equal images."""
        key = self.image_key
        if key is None:
            return self.ids[:end]
        return key[:end] if end <= len(key) else key + self.ids[len(key):end]

    def __post_init__(self) -> None:
        self.device_len = len(self.ids)
        if self.params.wants_prompt_logprobs:
            self.prompt_logprobs = PromptLogprobs(self.params.logprob_start_len)

    @property
    def cache_key(self) -> str | None:
        """The prefix-cache tree this request's KV belongs to: its `cache_salt`, apart per LoRA adapter (KV
        computed under one adapter is never another's) and per rotary length class."""
        return cache_namespace(self.params.cache_salt, self.lora_cache_name, self.rope_cache_name)

    @property
    def prefix_limit(self) -> int:
        """How many of its tokens admission may take from the prefix cache: all but the last, or, while its
        prompt logprobs are still to come, none past the first position whose logits they need; none at all
        for a mean-pooled embedding, which needs every position's hidden state."""
        if self.embed is not None and self.embed.pooling == "mean":
            return 0
        if self.prompt_logprobs is not None and not self.first_row_sent:
            return min(self.prompt_logprobs.first_logit, self.seq_len - 1)
        return self.seq_len - 1

    def prompt_logit_span(self, start: int, n: int) -> tuple[int, int]:
        """Of the positions `[start, start + n)` a step computes, those whose logits score a prompt token this
        request wants the logprob of: `(first position, count)`, count 0 when none."""
        if self.prompt_logprobs is None or self.first_row_sent:
            return start, 0
        first = max(start, self.prompt_logprobs.first_logit)
        last = min(start + n, self.prompt_len - 1)  # position prompt_len - 1 predicts the first output token
        return first, max(last - first, 0)

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
        """This request's settings for drawing its next token, in the shape `ringserve.kernels.sampling` takes."""
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


@dataclass
class PromptLogprobs:
    """Prompt tokens' logprobs from `start` on; the logits at position `p` score token `p + 1`, so token
    `start` (or 1, when `start` is 0: the first token has no logprob) needs the logits at `first_logit`."""

    start: int
    logprobs: list[float | None] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.start == 0:  # nothing predicts the first token
            self.logprobs.append(None)
            self.ranks.append(0)
            self.top_ids.append([])
            self.top_logprobs.append([])

    @property
    def first_logit(self) -> int:
        return max(self.start, 1) - 1

    def extend(self, logprobs: list[float], ranks: list[int], top_ids: list[list[int]],
               top_logprobs: list[list[float]]) -> None:
        """Add the next scored prompt tokens (one step's chunk)."""
        self.logprobs += logprobs
        self.ranks += ranks
        self.top_ids += [list(t) for t in top_ids]
        self.top_logprobs += [list(t) for t in top_logprobs]

    def complete(self, prompt_len: int) -> bool:
        """Whether every prompt token from `start` on is scored."""
        return len(self.logprobs) == prompt_len - self.start

    def fill(self, row: Any) -> None:
        """Put the scores into a `TokenRow` (the request's first)."""
        row.prompt_logprobs, row.prompt_ranks = self.logprobs, self.ranks
        row.prompt_top_ids, row.prompt_top_logprobs = self.top_ids, self.top_logprobs
