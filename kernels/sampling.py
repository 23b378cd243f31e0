"""Vectorised next-token sampling: penalties, logit bias, temperature, top-k, top-p, min-p and seeded draws.

Per step, logits are processed as: float32 -> repetition penalty -> frequency/presence penalties -> logit bias
-> banned ids (-inf). Greedy rows take the argmax of those processed logits (so with default settings exactly
`logits.argmax(-1)`); sampled rows divide by temperature, filter with top-k, top-p and min-p, then draw with
the exponential race `argmax(log p + Gumbel)`. The Gumbel noise is a counter-based hash of
(seed, position, token id) computed on the device, so a draw is a pure function of (seed, position, logits):
it does not depend on what else shares the batch, and no per-row generator or host sync is needed.

Logprobs are `log_softmax` of the raw logits (before penalties, bias and temperature), as vLLM reports them
by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringserve.kernels.grammar.torch_bitmask import apply_bitmask
from ringserve.kernels.host_copy import to_device

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (dividing by tiny temperatures gives inf/NaN)

_M32 = 0xFFFFFFFF


@dataclass
class SamplingRow:
    """One request's sampling settings for this step."""

    temperature: float  # < GREEDY_BELOW = greedy: exact argmax of the processed logits
    top_p: float = 1.0
    top_k: int = -1  # -1 = off; values >= vocab mean off
    min_p: float = 0.0  # drop tokens whose prob < min_p * max prob (after temperature)
    frequency_penalty: float = 0.0  # OpenAI: logit -= f * count(token in output so far)
    presence_penalty: float = 0.0  # logit -= p * (count > 0)
    repetition_penalty: float = 1.0  # tokens seen in prompt or output: logit / r if logit > 0 else logit * r
    logit_bias: dict[int, float] | None = None  # added to logits
    banned_ids: list[int] | None = None  # set to -inf
    penalties: PenaltyState | None = None  # required when any of the three penalties is non-default
    seed: int = 0  # draws are a pure function of (seed, position, logits)
    position: int = 0  # index of the token being drawn in this request's output
    num_top_logprobs: int = -1  # -1: no logprobs; 0: the chosen token's only; k > 0: also the top k

    @property
    def penalised(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


class PenaltyState:
    """Per-request token statistics for penalties, on the logits' device."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)  # [V] output occurrences
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] in prompt or output
        if len(prompt_ids):
            self.seen[to_device(list(prompt_ids), device)] = True
        self._one = torch.ones(1, dtype=torch.int32, device=device)

    def record(self, token: torch.Tensor) -> None:
        """Count `token` (`[1]` int64, on the device) as one more output token; no host sync."""
        self.counts.index_put_((token,), self._one, accumulate=True)
        self.seen.index_fill_(0, token, True)

    def fork(self, tokens: Sequence[int]) -> PenaltyState:
        """A copy that has also counted `tokens` (a speculative row's drafts before it); this one is unchanged."""
        copy = object.__new__(PenaltyState)
        copy.counts, copy.seen, copy._one = self.counts.clone(), self.seen.clone(), self._one
        if tokens:
            ids = to_device(list(tokens), self.counts.device)
            copy.counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
            copy.seen[ids] = True
        return copy


@dataclass
class SampleOutput:
    """The picked tokens and, when any row asked, raw-logit logprobs."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 logprob of each chosen token; None when no row asked
    top_ids: torch.Tensor | None  # [B, K] int64 sorted by logprob descending, K = max num_top_logprobs (<= V)
    top_logprobs: torch.Tensor | None  # [B, K] float32


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow],
           mask: tuple[torch.Tensor, Sequence[int]] | None = None) -> SampleOutput:
    """Pick one token per row of `logits` `[B, V]`; also records each chosen token in its row's PenaltyState.

    `mask` = (packed bitmask `[B, W]`, constrained rows): an output constraint's allowed tokens, applied to
    those rows only, after penalties and bias and before temperature and the draw. Logprobs are of the raw
    logits, before any of that (the mask too). Rows that did not ask for logprobs still get values in the
    returned tensors; callers read the rows (and the first `num_top_logprobs` columns) they asked for.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    if not rows:
        return SampleOutput(torch.zeros(0, dtype=torch.long, device=logits.device), None, None, None)
    x = _process(logits.float(), rows)  # [B, V], a new tensor whenever anything was changed
    if mask is not None:
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()  # the raw logits stay unmasked, for the logprobs
        apply_bitmask(x, mask[0], list(mask[1]))
    sampled = [b for b, r in enumerate(rows) if r.temperature >= GREEDY_BELOW]
    if len(sampled) == len(rows):
        tokens = _draw(x, rows)
    else:
        tokens = x.argmax(dim=-1)
        if sampled:
            index = to_device(sampled, x.device)
            tokens[index] = _draw(x[index], [rows[b] for b in sampled])
    for b, row in enumerate(rows):
        if row.penalties is not None:
            row.penalties.record(tokens[b : b + 1])

    k = max(r.num_top_logprobs for r in rows)
    if k < 0:
        return SampleOutput(tokens, None, None, None)
    raw = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = raw.gather(1, tokens[:, None]).squeeze(1)
    if k == 0:
        return SampleOutput(tokens, chosen, None, None)
    top_logprobs, top_ids = raw.topk(min(k, raw.shape[-1]), dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs)


def _process(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalties, logit bias and bans on `x` `[B, V]`, out of place (`x` may be the caller's logits)."""
    device = x.device
    pen = [b for b, r in enumerate(rows) if r.penalised]
    if pen:
        if any(rows[b].penalties is None for b in pen):
            raise ValueError("a row with a non-default penalty needs a PenaltyState")
        states = [rows[b].penalties for b in pen]
        counts = torch.stack([s.counts for s in states]).float()  # [P, V]
        seen = torch.stack([s.seen for s in states])  # [P, V]
        rep, freq, pres = (
            to_device([getattr(rows[b], name) for b in pen], device, torch.float32)[:, None]
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        )
        index = to_device(pen, device)
        sub = x[index]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0)
        x = x.index_copy(0, index, sub)

    # One flat (row, token, value) list for all biases, then one for all bans.
    bias = [(b, t, v) for b, r in enumerate(rows) if r.logit_bias for t, v in r.logit_bias.items()]
    if bias:
        b_rows, b_ids, b_vals = zip(*bias)
        where = (to_device(b_rows, device), to_device(b_ids, device))
        x = x.index_put(where, to_device(b_vals, device, x.dtype), accumulate=True)
    bans = [(b, t) for b, r in enumerate(rows) if r.banned_ids for t in r.banned_ids]
    if bans:
        n_rows, n_ids = zip(*bans)
        where = (to_device(n_rows, device), to_device(n_ids, device))
        x = x.index_put(where, torch.full((), float("-inf"), device=device))
    return x


def _draw(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the seeded exponential race; `x` `[S, V]` -> `[S]` token ids."""
    device, vocab = x.device, x.shape[1]
    temperature = to_device([r.temperature for r in rows], device, torch.float32)
    scaled = x / temperature[:, None]  # [S, V]
    top_k = [r.top_k if 0 < r.top_k < vocab else vocab for r in rows]
    top_p = [r.top_p for r in rows]
    ids: torch.Tensor | None = None  # [S, V] token id at each column once sorted
    if min(top_k) < vocab or min(top_p) < 1.0:
        scaled, ids = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=device)
        scaled = scaled.masked_fill(rank >= to_device(top_k, device)[:, None], float("-inf"))
        probs = scaled.softmax(dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p; the top token always stays.
        # Rows with top_p = 1 skip the filter, so float rounding of the cumsum cannot cut their tail.
        p = to_device(top_p, device, torch.float32)[:, None]
        outside = ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1.0)
        outside[:, 0] = False
        scaled = scaled.masked_fill(outside, float("-inf"))
    if any(r.min_p > 0.0 for r in rows):
        # p / p_max >= min_p  <=>  scaled >= max + log(min_p); the top token always passes.
        log_min_p = to_device([r.min_p for r in rows], device, torch.float32).log()[:, None]
        scaled = scaled.masked_fill(scaled < scaled.amax(dim=-1, keepdim=True) + log_min_p, float("-inf"))

    token_ids = ids if ids is not None else torch.arange(vocab, device=device, dtype=torch.int32)[None, :]
    keys = to_device([_row_keys(r.seed, r.position) for r in rows], device, torch.int32)  # [S, 2]
    pick = (scaled + _gumbel(keys, token_ids)).argmax(dim=-1)  # [S]; -inf + finite noise stays -inf, no NaN
    return pick if ids is None else ids.gather(1, pick[:, None]).squeeze(1)


def _fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int in [0, 2**32): a bijection with full avalanche."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _as_int32(value: int) -> int:
    """The int32 with the same 32 bits as `value` in [0, 2**32)."""
    return value - (1 << 32) if value >= 1 << 31 else value


_MIX1, _MIX2 = _as_int32(0x85EBCA6B), _as_int32(0xC2B2AE35)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """`_fmix32` on an int32 tensor holding 32-bit values, in place: int32 products wrap to the same low 32 bits,
    and each shift is masked to be a logical one. In place and in int32, since the noise of a step is [S, V]: the
    int64 form with new temporaries took 72 ms for 32 rows of SmolLM2's vocabulary, this one 14
    (bench/sampling_cost.py); tests/kernels/test_kernels_sampling.py checks it against the hash in Python's exact
    ints."""
    h ^= (h >> 16) & 0xFFFF
    h *= _MIX1
    h ^= (h >> 13) & 0x7FFFF
    h *= _MIX2
    h ^= (h >> 16) & 0xFFFF
    return h


def _row_keys(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys from a 64-bit seed and a position, hashed on the host (plain Python ints), as the int32
    values with their bits (what `_gumbel` takes)."""
    h = _fmix32(((seed >> 32) & _M32) ^ 0x9E3779B9)
    h = _fmix32(h ^ (seed & _M32))
    k1 = _fmix32(h ^ (position & _M32))
    return _as_int32(k1), _as_int32(_fmix32(k1 ^ 0x5BD1E995))


def _gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise `[S, V]` hashed from per-row int32 `keys` `[S, 2]` (`_row_keys`' bits) and `token_ids`
    (`[S, V]` or `[1, V]`)."""
    h = _fmix32_(token_ids.to(torch.int32) ^ keys[:, :1])  # a new [S, V] tensor, hashed in place from here on
    # (the sorted ids of top-k/top-p rows are int64, for the gather after the draw: converted here)
    h += keys[:, 1:]
    h = _fmix32_(h)
    # 23 bits as an odd multiple of 2**-24: exact in float32 and strictly inside (0, 1), so both logs are finite.
    h >>= 9
    h &= 0x7FFFFF
    h *= 2
    h += 1
    return h.float().mul_(2.0**-24).log_().neg_().log_().neg_()


@dataclass
class ScoredTokens:
    """Logprobs of given tokens (prompt tokens) under raw logits: each one's, its 1-based rank, the top k."""

    logprobs: torch.Tensor  # [E] float32
    ranks: torch.Tensor  # [E] int64, 1 = the most likely token
    top_ids: torch.Tensor | None  # [E, K] int64, None when k is 0
    top_logprobs: torch.Tensor | None  # [E, K] float32


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> ScoredTokens:
    """Score `targets` `[E]` under `logits` `[E, V]` (raw log-softmax, as `sample`'s logprobs)."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(1, targets[:, None])  # [E, 1]
    ranks = (raw > chosen).sum(dim=-1) + 1
    if k <= 0:
        return ScoredTokens(chosen.squeeze(1), ranks, None, None)
    top_logprobs, top_ids = raw.topk(min(k, raw.shape[-1]), dim=-1)
    return ScoredTokens(chosen.squeeze(1), ranks, top_ids, top_logprobs)
