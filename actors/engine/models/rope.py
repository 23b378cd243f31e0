"""Rotary position embeddings: every variant transformers implements for the families we serve.

`rope_parameters(config, layer_type)` reads a layer type's parameters as transformers 5 stores them
(`rope_parameters`, per layer type for Gemma 3), or from the older `rope_theta`/`rope_scaling` fields. `Rotary`
turns positions into cos/sin for `default`, `linear`, `llama3`, `yarn`, `dynamic` (NTK) and `longrope` (Phi-3),
with a partial rotary dimension and the variant's attention factor. Frequencies are computed as transformers
computes them (float32 from a Python-float base) so greedy tokens match it.

Two variants depend on the sequence length, as transformers' `generate` runs them: `dynamic` recomputes its
frequencies, and `longrope` picks its long factors, from the length of the sequence a forward reaches. A serving step
mixes requests and chunks prompts, so each token is given the length transformers would have used for it
(`lengths`): the whole prompt's for a prompt token (transformers encodes a prompt in one forward), its own
`position + 1` for a generated one. `RopeLengthRule` says what follows for a request: which prefix-cache tree its
keys belong to, and (longrope, as Phi-3's `generate` does) that crossing the original context while decoding
recomputes every earlier key with the long factors. One request's tokens never depend on another's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

# rotates `x` `[T, heads, D]` by cos/sin `[T, d]` (`apply_rotary`, or the fused Triton kernel)
Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True)
class RopeLengthRule:
    """How a model's rotary depends on the length of the sequence: `kind` "dynamic" or "longrope", past the
    `original` context. A request's *floor* is the length its tokens are rotated for at the least (its prompt's,
    or the whole sequence's once a longrope request recomputed its keys); each token takes `max(position + 1,
    floor)`."""

    kind: str
    original: int

    def cache_name(self, floor: int) -> str | None:
        """The prefix-cache tree of keys rotated with `floor` (None: the plain tree, a floor within the original
        context): longrope's long factors are one tree; dynamic frequencies depend on the floor itself."""
        if floor <= self.original:
            return None
        return "long" if self.kind == "longrope" else f"ntk{floor}"

    def reencodes(self, floor: int, position: int) -> bool:
        """Whether computing `position` of a request with this floor first recomputes all its keys: longrope's
        switch to the long factors once the sequence passes the original context (Phi-3's `generate` drops its
        cache and encodes the whole sequence again there)."""
        return self.kind == "longrope" and floor <= self.original <= position


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rotary parameters of `layer_type`'s layers (or the model's, when they are not per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        raise ValueError("config has no rope_theta (neither in rope_parameters nor as an attribute)")
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {params['rope_type']!r}: implemented are {ROPE_TYPES}")
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, p: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
                            if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** _exponents(dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class Rotary(nn.Module):
    """cos/sin `[T, dim]` for the step's positions (`dim` the rotated part of a head, scaled by the variant's
    attention factor)."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope_type = params["rope_type"]
        self.dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.base = float(params["rope_theta"])
        self.params = params
        self.max_positions = max_positions
        self.attention_scaling = 1.0
        self.original = int(params.get("original_max_position_embeddings") or max_positions)
        inv_freq = 1.0 / (self.base ** _exponents(self.dim))
        long_freq = None
        if self.rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3(inv_freq, params)
        elif self.rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn(self.dim, self.base, params, max_positions)
        elif self.rope_type == "longrope":
            factor = params.get("factor") or max_positions / self.original
            self.attention_scaling = params.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original)))
            base_freq = self.base ** _exponents(self.dim)
            inv_freq = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32, device="cpu") * base_freq)
            long_freq = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32, device="cpu") * base_freq)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.long_freq: torch.Tensor | None
        self.register_buffer("long_freq", long_freq, persistent=False)

    @property
    def length_rule(self) -> RopeLengthRule | None:
        """How this rotary depends on the sequence's length; None when it does not."""
        return RopeLengthRule(self.rope_type, self.original) if self.rope_type in LENGTH_DEPENDENT else None

    def _frequencies(self, positions: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """`[T, dim/2]` angles of each token."""
        pos = positions[:, None].float()
        if self.rope_type in LENGTH_DEPENDENT:
            seq_len = positions + 1 if lengths is None else lengths
            beyond = (seq_len > self.original)[:, None]
            if self.rope_type == "longrope":
                return torch.where(beyond, pos * self.long_freq[None, :], pos * self.inv_freq[None, :])
            return pos * torch.where(beyond, self._dynamic_inv_freq(seq_len), self.inv_freq[None, :])
        return pos * self.inv_freq[None, :]

    def _dynamic_inv_freq(self, seq_len: torch.Tensor) -> torch.Tensor:
        """`[T, dim/2]`: per token, NTK-scaled frequencies for a sequence of `seq_len` tokens (transformers'
        formula)."""
        factor, dim = self.params["factor"], self.dim
        length = seq_len.double().clamp(min=self.original)
        base = (self.base * ((factor * length / self.original) - (factor - 1)) ** (dim / (dim - 2))).float()
        return 1.0 / (base[:, None] ** _exponents(dim).to(seq_len.device)[None, :])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of `positions` `[T]`; `lengths` `[T]`: the sequence length each token is rotated for by the
        length-dependent variants (default `positions + 1`)."""
        emb = torch.cat([self._frequencies(positions, lengths)] * 2, dim=-1)  # [T, dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rope_lengths(positions: torch.Tensor, extend_lens: list[int], floors: list[int] | None) -> torch.Tensor | None:
    """`[T]`: the sequence length each of a step's tokens is rotated for, `max(position + 1, floor)` of its row
    (`extend_lens` tokens each, `floors` their `Req.rope_floor`); None without floors (no length-dependent
    rotary)."""
    if floors is None:
        return None
    floor = torch.repeat_interleave(torch.tensor(floors, dtype=torch.int64), torch.tensor(extend_lens))
    return torch.maximum(positions + 1, floor.to(positions.device))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, D]` by cos/sin `[T, d]`: all of D, or its first `d` dims (partial rotary)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat(((rot * cos) + (rotate_half(rot) * sin), rest), dim=-1)


def rotation(kernels: str, full_rotary: bool) -> Rotation:
    """What rotates queries and keys under the execution plan's `kernels`: the fused Triton kernel where the plan
    chose it and the rotary turns whole heads (all it takes), else `apply_rotary`."""
    if kernels == "triton" and full_rotary:
        from ringserve.kernels.triton.rotary import apply_rotary as triton_rotary  # triton: only where it runs

        return triton_rotary
    return apply_rotary
